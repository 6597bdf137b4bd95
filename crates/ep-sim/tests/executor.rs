//! The executor and the memory model: replay, deadlock, timeouts, release/acquire, fences,
//! poison, lazy memory, host-face errors, and threads mode running the same agent code.

mod common;

use std::time::Duration;

use common::*;
use ep_core::Error;
use ep_core::transport::{
    AgentCtx, Cmp, FabricParams, Init, Phase, PhaseKind, QpIndex, SignalOp, SymAddr, SymAlloc,
    Transport, WaitUntil,
};
use ep_sim::{Policy, Sim, SimConfig, SimError, ThreadSim, TraceEvent, Violation};

fn phase(call: u64) -> Phase<'static> {
    Phase::new(PhaseKind::Custom("test".into()), call)
}

fn w(rank: usize, word: SymAddr, cmp: Cmp, value: u64, what: &str) -> WaitUntil {
    WaitUntil {
        rank,
        word,
        cmp,
        value,
        what: what.into(),
    }
}

fn violation(r: Result<ep_core::transport::PhaseReport, SimError>) -> Violation {
    match r {
        Err(SimError::Violation(v)) => *v,
        other => panic!("expected a violation, got {other:?}"),
    }
}

// ---- replay ------------------------------------------------------------------------------

fn traced_all_to_all(seed: u64, policy: Policy) -> (Vec<TraceEvent>, u64) {
    let mut f = FabricParams::single_node(3);
    f.ranks_per_node = 1;
    f.qp_depth = 2;
    let mut sim = Sim::new(SimConfig::new(f, seed).policy(policy).traced());
    let data = alloc(&mut sim, "data", 3 * 256, Init::Poison);
    let src = alloc(&mut sim, "src", 3 * 256, Init::Poison);
    let flag = alloc(&mut sim, "flags", 3 * 16, Init::Zero);
    let mut p = phase(1);
    for r in 0..3 {
        let (data, src, flag) = (data.clone(), src.clone(), flag.clone());
        p = p.agent(r, 0, "all-to-all", move |c: &mut dyn AgentCtx| {
            for dst in 0..3usize {
                let s = src.at(dst as u64 * 256);
                c.store(r, s, &pattern(seed, r as u64, dst as u64, 256))?;
                let qp = QpIndex(0);
                c.put_signal(
                    dst,
                    qp,
                    data.at(r as u64 * 256),
                    s,
                    256,
                    flag.at(r as u64 * 16),
                    SignalOp::Add,
                    1,
                )?;
            }
            for from in 0..3usize {
                c.wait(&w(
                    r,
                    flag.at(from as u64 * 16),
                    Cmp::Ge,
                    1,
                    "all-to-all signal",
                ))?;
                let mut b = vec![0u8; 256];
                c.load(r, data.at(from as u64 * 256), &mut b)?;
                assert_eq!(b, pattern(seed, from as u64, r as u64, 256));
            }
            c.quiet()
        });
    }
    sim.run(p).unwrap();
    (sim.trace().to_vec(), sim.memory_digest())
}

#[test]
fn same_seed_replays_trace_and_memory_bit_for_bit() {
    for policy in [
        Policy::Uniform,
        Policy::Pct {
            depth: 3,
            horizon: 200,
        },
        Policy::LatestLegal,
    ] {
        for seed in [1, 7, 99] {
            let a = traced_all_to_all(seed, policy);
            let b = traced_all_to_all(seed, policy);
            assert!(!a.0.is_empty());
            assert_eq!(a, b, "policy {policy:?} seed {seed} did not replay");
        }
    }
    let (t1, _) = traced_all_to_all(1, Policy::Uniform);
    let (t2, _) = traced_all_to_all(2, Policy::Uniform);
    assert_ne!(t1, t2, "different seeds should explore different schedules");
}

#[test]
fn mutation_failures_replay_identically() {
    for seed in 0..6 {
        let a = ring(
            Mutation::RingOverflowByOne,
            RingParams::default(),
            seed,
            policy_for(seed),
        )
        .err();
        let b = ring(
            Mutation::RingOverflowByOne,
            RingParams::default(),
            seed,
            policy_for(seed),
        )
        .err();
        assert_eq!(a, b);
    }
}

// ---- deadlock and timeouts -----------------------------------------------------------------

#[test]
fn crossed_waits_report_deadlock_with_the_wait_for_graph() {
    for seed in 0..6 {
        let mut s = sim(FabricParams::single_node(2), seed, policy_for(seed));
        let flags = alloc(&mut s, "flags", 32, Init::Zero);
        let mut p = phase(1);
        for r in 0..2usize {
            let flags = flags.clone();
            p = p.agent(r, 0, "handshake", move |c: &mut dyn AgentCtx| {
                // Each waits for the other's flag before raising its own: a cycle.
                c.wait(&w(r, flags.at(16), Cmp::Eq, 1, "peer's hello"))?;
                c.store_release(1 - r, flags.at(16), 1)
            });
        }
        match violation(s.run(p)) {
            Violation::Deadlock { waiting } => {
                assert_eq!(waiting.len(), 2);
                for x in &waiting {
                    assert!(x.what.contains("peer's hello"), "{x}");
                    assert_eq!(x.last_seen, Some(0));
                    assert_eq!(x.word.map(|w| w.1), Some(flags.at(16).0));
                }
            }
            v => panic!("expected deadlock, got {v}"),
        }
    }
}

#[test]
fn barrier_missed_by_one_agent_is_a_deadlock() {
    let mut s = sim(FabricParams::single_node(1), 3, Policy::Uniform);
    let _ = alloc(&mut s, "x", 16, Init::Zero);
    let p = phase(1)
        .agent(0, 0, "a", |c: &mut dyn AgentCtx| c.block_barrier())
        .agent(0, 0, "b", |_c: &mut dyn AgentCtx| Ok(()));
    match violation(s.run(p)) {
        Violation::Deadlock { waiting } => {
            assert!(waiting[0].what.contains("1 of 2 arrived"), "{}", waiting[0])
        }
        v => panic!("{v}"),
    }
}

#[test]
fn a_wait_nobody_satisfies_times_out_while_others_run() {
    let mut cfg = SimConfig::new(FabricParams::single_node(1), 5);
    cfg.wait_timeout_ticks = 500;
    let mut s = Sim::new(cfg);
    let flag = alloc(&mut s, "flag", 16, Init::Zero);
    let f2 = flag.clone();
    let p = phase(1)
        .agent(0, 0, "waiter", move |c: &mut dyn AgentCtx| {
            c.wait(&w(0, flag.at(0), Cmp::Eq, 7, "flag = 7"))
                .map(|_| ())
        })
        .agent(0, 1, "spinner", move |c: &mut dyn AgentCtx| {
            for _ in 0..5000 {
                c.load_acquire(0, f2.at(0))?;
            }
            Ok(())
        });
    match violation(s.run(p)) {
        Violation::WaitTimeout { waiting, waited } => {
            assert!(waited > 500);
            assert_eq!(waiting.agent.role, "waiter");
            assert!(waiting.what.contains("flag = 7"));
            assert_eq!(waiting.last_seen, Some(0));
        }
        v => panic!("{v}"),
    }
    // Through the Transport face it is ep-core's typed timeout.
    let e: Error = SimError::from(Violation::Deadlock { waiting: vec![] }).into();
    assert!(matches!(e, Error::Deadlock { .. }));
}

// ---- load/store class: release/acquire, fences, barriers -----------------------------------

fn message_pass(seed: u64, publish: &'static str) -> Result<(), SimError> {
    let mut s = sim(FabricParams::single_node(2), seed, policy_for(seed));
    let data = alloc(&mut s, "data", 64, Init::Poison);
    let flag = alloc(&mut s, "flag", 16, Init::Zero);
    let (d2, f2) = (data.clone(), flag.clone());
    let p = phase(1)
        .agent(0, 0, "writer", move |c: &mut dyn AgentCtx| {
            c.store(1, data.at(0), &pattern(seed, 0, 0, 64))?;
            match publish {
                "release" => c.store_release(1, flag.at(0), 1),
                "fence" => {
                    c.fence()?;
                    c.store_u64(1, flag.at(0), 1)
                }
                _ => c.store_u64(1, flag.at(0), 1),
            }
        })
        .agent(1, 0, "reader", move |c: &mut dyn AgentCtx| {
            c.wait(&w(1, f2.at(0), Cmp::Eq, 1, "flag"))?;
            let mut b = [0u8; 64];
            c.load(1, d2.at(0), &mut b)?;
            assert_eq!(b.to_vec(), pattern(seed, 0, 0, 64));
            Ok(())
        });
    s.run(p).map(|_| ())
}

#[test]
fn store_release_and_fence_publish_relaxed_store_does_not() {
    for seed in 0..9 {
        message_pass(seed, "release").unwrap();
        message_pass(seed, "fence").unwrap();
        let v = message_pass(seed, "relaxed").unwrap_err();
        assert_eq!(
            v.violation().map(Violation::name),
            Some("StoreNotPublished"),
            "{v}"
        );
    }
}

fn block_publish(seed: u64, barrier: bool) -> Result<(), SimError> {
    let mut s = sim(FabricParams::single_node(2), seed, policy_for(seed));
    let data = alloc(&mut s, "data", 64, Init::Poison);
    let flag = alloc(&mut s, "flag", 16, Init::Zero);
    let (d2, f2) = (data.clone(), flag.clone());
    let p = phase(1)
        .agent(0, 0, "data warp", move |c: &mut dyn AgentCtx| {
            c.store(1, data.at(0), &pattern(seed, 1, 1, 64))?;
            if barrier { c.block_barrier() } else { Ok(()) }
        })
        .agent(0, 0, "notify warp", move |c: &mut dyn AgentCtx| {
            if barrier {
                c.block_barrier()?;
            }
            c.store_release(1, flag.at(0), 1)
        })
        .agent(1, 0, "reader", move |c: &mut dyn AgentCtx| {
            c.wait(&w(1, f2.at(0), Cmp::Eq, 1, "flag"))?;
            let mut b = [0u8; 64];
            c.load(1, d2.at(0), &mut b)
        });
    s.run(p).map(|_| ())
}

#[test]
fn block_barrier_is_release_acquire_among_the_block() {
    for seed in 0..9 {
        block_publish(seed, true).unwrap();
        let e = block_publish(seed, false).unwrap_err();
        let name = e.violation().map(Violation::name);
        // Either the rows were not yet written (poison) or written but not ordered (race).
        assert!(matches!(name, Some("DataRace" | "ReadOfPoison")), "{e}");
    }
}

// ---- RDMA class: fence across QPs, quiet ----------------------------------------------------

fn two_qp(seed: u64, order: &'static str) -> Result<(), SimError> {
    let mut f = FabricParams::single_node(2);
    f.ranks_per_node = 1;
    f.rc_per_pe = 2;
    let mut s = sim(f, seed, policy_for(seed));
    let data = alloc(&mut s, "data", 256, Init::Poison);
    let src = alloc(&mut s, "src", 256, Init::Poison);
    let flag = alloc(&mut s, "flag", 16, Init::Zero);
    let (d2, f2) = (data.clone(), flag.clone());
    let p = phase(1)
        .agent(0, 0, "sender", move |c: &mut dyn AgentCtx| {
            c.store(0, src.at(0), &pattern(seed, 2, 2, 256))?;
            c.put(1, QpIndex(0), data.at(0), src.at(0), 256)?;
            match order {
                "fence" => c.fence()?,
                "quiet" => c.quiet()?,
                _ => {}
            }
            c.amo_add(1, QpIndex(1), flag.at(0), 1)?;
            c.quiet()
        })
        .agent(1, 0, "receiver", move |c: &mut dyn AgentCtx| {
            c.wait(&w(1, f2.at(0), Cmp::Ge, 1, "flag"))?;
            let mut b = vec![0u8; 256];
            c.load(1, d2.at(0), &mut b)?;
            assert_eq!(b, pattern(seed, 2, 2, 256));
            Ok(())
        });
    s.run(p).map(|_| ())
}

#[test]
fn fence_and_quiet_order_across_qps_nothing_else_does() {
    for seed in 0..12 {
        two_qp(seed, "fence").unwrap();
        two_qp(seed, "quiet").unwrap();
        let e = two_qp(seed, "none").unwrap_err();
        assert_eq!(
            e.violation().map(Violation::name),
            Some("SignalBeforeData"),
            "{e}"
        );
    }
}

// ---- poison --------------------------------------------------------------------------------

#[test]
fn poison_on_allocation_and_scratch_between_calls() {
    let mut s = sim(FabricParams::single_node(1), 1, Policy::Uniform);
    let fresh = alloc(&mut s, "fresh", 64, Init::Poison);
    let p = phase(1).agent(0, 0, "r", move |c: &mut dyn AgentCtx| {
        c.load_u64(0, fresh.at(8)).map(|_| ())
    });
    assert!(
        matches!(violation(s.run(p)), Violation::ReadOfPoison { ref alloc, .. } if alloc == "fresh")
    );

    let scratch = alloc(&mut s, "scratch", 64, Init::Scratch);
    let sc = scratch.clone();
    let p = phase(1).agent(0, 0, "w", move |c: &mut dyn AgentCtx| {
        c.store_u64(0, sc.at(0), 5)?;
        assert_eq!(c.load_u64(0, sc.at(0))?, 5);
        Ok(())
    });
    s.run(p).unwrap();
    let p = phase(2).agent(0, 0, "r", move |c: &mut dyn AgentCtx| {
        c.load_u64(0, scratch.at(0)).map(|_| ())
    });
    assert!(
        matches!(violation(s.run(p)), Violation::ReadOfPoison { ref alloc, .. } if alloc == "scratch")
    );
}

#[test]
fn waiting_on_a_poisoned_flag_is_reported() {
    let mut s = sim(FabricParams::single_node(1), 1, Policy::Uniform);
    let flag = alloc(&mut s, "flag in scratch", 16, Init::Scratch);
    let p = phase(1).agent(0, 0, "r", move |c: &mut dyn AgentCtx| {
        c.wait(&w(0, flag.at(0), Cmp::Ne, 0, "flag")).map(|_| ())
    });
    assert!(matches!(
        violation(s.run(p)),
        Violation::ReadOfPoison { .. }
    ));
}

// ---- lazy memory and chunks ------------------------------------------------------------------

#[test]
fn lazy_memory_512mib_granularity_2gib_allocation_costs_what_is_touched() {
    let mut f = FabricParams::single_node(2);
    f.ranks_per_node = 1;
    f.granularity = 512 << 20;
    f.heap_bytes = 8 << 30;
    let mut s = sim(f, 11, Policy::Uniform);
    let big = alloc(&mut s, "2 GiB arena", 2 << 30, Init::Poison);
    let flag = alloc(&mut s, "flag", 16, Init::Zero);
    // A put straddling the first 512 MiB boundary: two work requests.
    let at = big.at((512 << 20) - 32);
    let far = big.at((2 << 30) - 4096);
    let (flag2, big2) = (flag.clone(), big.clone());
    let p = phase(1)
        .agent(0, 0, "sender", move |c: &mut dyn AgentCtx| {
            assert_eq!(c.work_requests(at, far, 64), 2);
            c.store(0, far, &pattern(1, 2, 3, 64))?;
            c.put_signal(1, QpIndex(0), at, far, 64, flag.at(0), SignalOp::Add, 1)?;
            c.quiet()
        })
        .agent(1, 0, "receiver", move |c: &mut dyn AgentCtx| {
            c.wait(&w(1, flag2.at(0), Cmp::Eq, 1, "flag"))?;
            let mut b = [0u8; 64];
            c.load(1, at, &mut b)?;
            assert_eq!(b.to_vec(), pattern(1, 2, 3, 64));
            let _ = big2;
            Ok(())
        });
    s.run(p).unwrap();
    assert_eq!(s.stats().posted, 3, "two data work requests and one signal");
    assert!(
        s.resident_bytes() <= 8 * 65536,
        "resident {} bytes",
        s.resident_bytes()
    );
}

// ---- host-face errors -------------------------------------------------------------------------

#[test]
fn bad_requests_are_typed_errors() {
    let mut f = FabricParams::single_node(2);
    f.ranks_per_node = 1;
    let mut s = sim(f.clone(), 1, Policy::Uniform);
    let a = alloc(&mut s, "a", 64, Init::Zero);
    let a1 = a.clone();
    let p = phase(1).agent(0, 0, "x", move |c: &mut dyn AgentCtx| {
        c.store_u64(1, a1.at(0), 1)
    });
    assert!(matches!(
        s.run(p),
        Err(SimError::Core(Error::Unreachable { from: 0, to: 1, .. }))
    ));
    let a2 = a.clone();
    let p = phase(1).agent(0, 0, "x", move |c: &mut dyn AgentCtx| {
        c.put(1, QpIndex(3), a2.at(0), a2.at(8), 8)
    });
    assert!(matches!(
        s.run(p),
        Err(SimError::Core(Error::QpOutOfRange {
            qp: 3,
            rc_per_pe: 1
        }))
    ));
    let p = phase(1).agent(0, 0, "x", move |c: &mut dyn AgentCtx| {
        c.load_u64(0, a.at(60)).map(|_| ())
    });
    assert!(matches!(
        s.run(p),
        Err(SimError::Core(Error::BadAccess { .. }))
    ));
    let p = phase(1).agent(0, 0, "x", |_c: &mut dyn AgentCtx| panic!("boom"));
    assert!(
        matches!(s.run(p), Err(SimError::Core(Error::AgentFailed { ref detail, .. })) if detail.contains("boom"))
    );
    let mut small = f;
    small.heap_bytes = 1024;
    let mut s = sim(small, 1, Policy::Uniform);
    assert!(matches!(
        s.alloc(ep_core::transport::AllocRequest {
            name: "big".into(),
            bytes: 4096,
            align: 128,
            init: Init::Zero
        }),
        Err(Error::HeapExhausted { .. })
    ));
}

// ---- threads mode: the same agent code on real threads ---------------------------------------

/// An all-to-all with `put_signal` whose receivers check their data in the agent.
fn all_to_all(t: &mut dyn Transport, seed: u64) -> ep_core::Result<()> {
    let n = t.fabric().num_ranks;
    let mk = |t: &mut dyn Transport, name: &str, bytes: u64, init| -> SymAlloc {
        t.alloc(ep_core::transport::AllocRequest {
            name: name.into(),
            bytes,
            align: 128,
            init,
        })
        .unwrap()
    };
    let data = mk(t, "data", n as u64 * 128, Init::Poison);
    let src = mk(t, "src", n as u64 * 128, Init::Poison);
    let flags = mk(t, "flags", n as u64 * 16, Init::Zero);
    for call in 1..=3u64 {
        let mut p = phase(call);
        for r in 0..n {
            let (data, src, flags) = (data.clone(), src.clone(), flags.clone());
            p = p.agent(r, 0, "peer", move |c: &mut dyn AgentCtx| {
                for k in 0..n {
                    let dst = (r + k) % n;
                    let s = src.at(dst as u64 * 128);
                    c.store(r, s, &pattern(seed + call, r as u64, dst as u64, 128))?;
                    c.put_signal(
                        dst,
                        QpIndex(0),
                        data.at(r as u64 * 128),
                        s,
                        128,
                        flags.at(r as u64 * 16),
                        SignalOp::Set,
                        call,
                    )?;
                }
                for from in 0..n {
                    c.wait(&w(r, flags.at(from as u64 * 16), Cmp::Ge, call, "signal"))?;
                    let mut b = vec![0u8; 128];
                    c.load(r, data.at(from as u64 * 128), &mut b)?;
                    if b != pattern(seed + call, from as u64, r as u64, 128) {
                        return Err(Error::Unsupported(format!(
                            "rank {r}: wrong data from {from}"
                        )));
                    }
                }
                c.quiet()
            });
        }
        t.run_phase(p)?;
        let world = t.world();
        t.barrier(&world)?;
    }
    Ok(())
}

#[test]
fn threads_mode_runs_the_same_agents() {
    let mut f = FabricParams::single_node(4);
    f.ranks_per_node = 2;
    let mut th = ThreadSim::new(f.clone(), Duration::from_secs(20));
    all_to_all(&mut th, 3).unwrap();
    let mut sim = Sim::new(SimConfig::new(f, 3));
    all_to_all(&mut sim, 3).unwrap();
}

#[test]
fn threads_mode_waits_are_bounded() {
    let mut th = ThreadSim::new(FabricParams::single_node(1), Duration::from_millis(100));
    let flag = alloc(&mut th, "flag", 16, Init::Zero);
    let p = phase(1).agent(0, 0, "waiter", move |c: &mut dyn AgentCtx| {
        c.wait(&w(0, flag.at(0), Cmp::Eq, 1, "never")).map(|_| ())
    });
    assert!(matches!(
        th.run_phase(p),
        Err(Error::WaitTimeout { last_seen: 0, .. })
    ));
}
