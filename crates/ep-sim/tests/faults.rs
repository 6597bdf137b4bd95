//! Injected faults end in typed errors naming the rank, the QP and what was awaited, within
//! bounded virtual time; legal slowness within the bound gives correct results.

mod common;

use std::time::Duration;

use common::*;
use ep_core::Error;
use ep_core::transport::{
    AgentCtx, Cmp, FabricParams, Init, Phase, PhaseKind, QpIndex, SignalOp, SymAlloc, Team,
    Transport, WaitUntil, fault_rank,
};
use ep_sim::{Fault, Sim, SimConfig, SimError, ThreadSim, Trigger, Violation};

const BOUND: u64 = 5_000;

/// Two ranks on two nodes (RDMA only), QP depth `depth`.
fn fabric(depth: u32) -> FabricParams {
    let mut f = FabricParams::single_node(2);
    f.ranks_per_node = 1;
    f.rc_per_pe = 2;
    f.qp_depth = depth;
    f
}

fn sim(faults: &[Fault], depth: u32, seed: u64) -> Sim {
    let mut c = SimConfig::new(fabric(depth), seed).wait_timeout(BOUND);
    for f in faults {
        c = c.fault(f.clone());
    }
    Sim::new(c)
}

struct Bufs {
    data: SymAlloc,
    src: SymAlloc,
    flag: SymAlloc,
    out: SymAlloc,
}

fn bufs(t: &mut impl Transport) -> Bufs {
    Bufs {
        data: alloc(t, "data", 256, Init::Poison),
        src: alloc(t, "src", 256, Init::Poison),
        flag: alloc(t, "flag", 16, Init::Zero),
        out: alloc(t, "out", 16, Init::Zero),
    }
}

fn flag_from(b: &Bufs, me: usize, peer: usize) -> WaitUntil {
    WaitUntil {
        rank: me,
        word: b.flag.at(0),
        cmp: Cmp::Eq,
        value: 1,
        what: format!("flag from rank {peer}"),
    }
}

/// Each rank in `senders` puts a 256-byte row with a signal to the other rank (`puts` times, QP
/// 0) and quiets; each rank in `receivers` waits for its flag and checks the row. With
/// `shrink`, receivers use `wait_or_expire` and record a mask instead of failing.
fn exchange<'a>(
    b: &'a Bufs,
    senders: &[usize],
    receivers: &[usize],
    puts: u64,
    shrink: bool,
) -> Phase<'a> {
    let mut p = Phase::new(PhaseKind::Custom("exchange".into()), 1);
    for r in 0..2usize {
        let peer = 1 - r;
        let (send, recv) = (senders.contains(&r), receivers.contains(&r));
        p = p.agent(r, 0, "peer", move |c: &mut dyn AgentCtx| {
            if send {
                c.store(r, b.src.at(0), &pattern(1, r as u64, 0, 256))?;
                for i in 0..puts {
                    let last = i + 1 == puts;
                    if last {
                        c.put_signal(
                            peer,
                            QpIndex(0),
                            b.data.at(0),
                            b.src.at(0),
                            256,
                            b.flag.at(0),
                            SignalOp::Add,
                            1,
                        )?;
                    } else {
                        c.put(peer, QpIndex(0), b.data.at(0), b.src.at(0), 256)?;
                    }
                }
                c.quiet()?;
            }
            if recv {
                let until = flag_from(b, r, peer);
                if shrink {
                    if c.wait_or_expire(&until)?.is_none() {
                        c.store_u64(r, b.out.at(0), 100 + peer as u64)?; // mask[peer] = 1
                        return Ok(());
                    }
                } else {
                    c.wait(&until)?;
                }
                let mut row = vec![0u8; 256];
                c.load(r, b.data.at(0), &mut row)?;
                assert_eq!(row, pattern(1, peer as u64, 0, 256));
                c.store_u64(r, b.out.at(0), 1)?;
            }
            Ok(())
        });
    }
    p
}

fn both() -> [usize; 2] {
    [0, 1]
}

#[test]
fn without_faults_the_exchange_is_correct() {
    for seed in 0..6 {
        let mut s = sim(&[], 4, seed);
        let b = bufs(&mut s);
        s.run(exchange(&b, &both(), &both(), 3, false)).unwrap();
        for r in 0..2 {
            assert_eq!(s.host_read_u64(r, b.out.at(0)).unwrap(), 1);
        }
    }
}

#[test]
fn dead_sender_makes_the_receivers_wait_time_out_naming_it() {
    let dead = Fault::DeadRank {
        rank: 1,
        at: Trigger::AfterOps(0),
    };
    for seed in 0..4 {
        let mut s = sim(std::slice::from_ref(&dead), 4, seed);
        let b = bufs(&mut s);
        let t0 = s.now();
        let err = s.run(exchange(&b, &[1], &[0], 1, false)).unwrap_err();
        let Some(Violation::WaitTimeout { waiting, waited }) = err.violation() else {
            panic!("expected a wait timeout, got {err}");
        };
        assert_eq!(waiting.agent.rank, 0);
        assert!(waiting.what.contains("flag from rank 1"), "{err}");
        assert!(
            waiting.faults.iter().any(|f| f.contains("rank 1 dead")),
            "{err}"
        );
        assert!(*waited > BOUND && s.now() - t0 <= 2 * BOUND + 100, "{err}");
        let core: Error = err.into();
        assert!(matches!(core, Error::WaitTimeout { rank: 0, .. }), "{core}");
        assert!(core.to_string().contains("rank 1 dead"), "{core}");
    }
}

#[test]
fn quiet_towards_a_dead_rank_times_out_naming_the_qp_and_peer() {
    let dead = Fault::DeadRank {
        rank: 1,
        at: Trigger::AfterOps(0),
    };
    let mut s = sim(&[dead], 4, 3);
    let b = bufs(&mut s);
    let err = s.run(exchange(&b, &[0], &[], 1, false)).unwrap_err();
    let Some(Violation::CompletionTimeout {
        agent,
        peer,
        qp,
        during,
        ..
    }) = err.violation()
    else {
        panic!("expected a completion timeout, got {err}");
    };
    assert_eq!((agent.rank, *peer, qp.0, *during), (0, 1, 0, "quiet"));
    assert!(s.now() <= 2 * BOUND + 100);
    let core: Error = err.into();
    assert_eq!(fault_rank(&core), Some(1), "{core}");
    assert!(core.to_string().contains("rank 1 dead"), "{core}");
}

#[test]
fn a_dead_rank_whose_peers_finish_is_rank_failed() {
    let dead = Fault::DeadRank {
        rank: 1,
        at: Trigger::AfterOps(1),
    };
    let mut s = sim(&[dead], 4, 0);
    let b = bufs(&mut s);
    // Rank 1 stores its row (operation 1), then dies before its put; rank 0 has nothing to do.
    let err = s.run(exchange(&b, &[1], &[], 1, false)).unwrap_err();
    match &err {
        SimError::Core(e @ Error::RankFailed { rank: 1, detail }) => {
            assert!(
                detail.contains("rank1/agent0(peer) before put_signal"),
                "{e}"
            );
            assert_eq!(fault_rank(e), Some(1));
        }
        other => panic!("expected RankFailed for rank 1, got {other}"),
    }
    // The host learns it too: a barrier over the dead rank fails, one without it works.
    let e = s.barrier(&Team { ranks: vec![0, 1] }).unwrap_err();
    assert!(matches!(e, Error::RankFailed { rank: 1, .. }), "{e}");
    s.barrier(&Team { ranks: vec![0] }).unwrap();
}

#[test]
fn shrink_mode_masks_the_dead_rank_and_the_survivor_finishes() {
    let dead = Fault::DeadRank {
        rank: 1,
        at: Trigger::AfterOps(0),
    };
    let mut s = sim(&[dead], 4, 5);
    let b = bufs(&mut s);
    let err = s.run(exchange(&b, &[1], &[0], 1, true)).unwrap_err();
    assert!(
        matches!(err, SimError::Core(Error::RankFailed { rank: 1, .. })),
        "{err}"
    );
    assert_eq!(
        s.host_read_u64(0, b.out.at(0)).unwrap(),
        101,
        "rank 0 masked rank 1"
    );
    assert!(s.now() <= 2 * BOUND + 100);
}

#[test]
fn a_stall_within_the_bound_is_legal_and_beyond_it_times_out_naming_the_stall() {
    for (ticks, ok) in [(BOUND / 2, true), (10 * BOUND, false)] {
        let stall = Fault::StalledRank {
            rank: 1,
            at: Trigger::AfterOps(1),
            ticks,
        };
        let mut s = sim(&[stall], 4, 2);
        let b = bufs(&mut s);
        let r = s.run(exchange(&b, &both(), &both(), 2, false));
        if ok {
            r.unwrap();
            assert_eq!(s.host_read_u64(0, b.out.at(0)).unwrap(), 1);
            assert!(s.now() >= ticks, "the stall took virtual time");
        } else {
            let err = r.unwrap_err();
            let Some(Violation::WaitTimeout { waiting, .. }) = err.violation() else {
                panic!("expected a wait timeout, got {err}");
            };
            assert_eq!(waiting.agent.rank, 0);
            assert!(
                waiting.faults.iter().any(|f| f.contains("rank 1 stalled")),
                "{err}"
            );
            assert!(s.now() <= 2 * BOUND + 100, "ended at {}", s.now());
        }
    }
}

#[test]
fn qp_error_fails_quiet_at_once_naming_qp_and_peer() {
    let f = Fault::QpError {
        src: 0,
        dst: 1,
        qp: QpIndex(0),
        after_wrs: 1,
    };
    let mut s = sim(&[f], 4, 1);
    let b = bufs(&mut s);
    // Three puts: the first is delivered, the second and the put_signal's two are lost.
    let err = s.run(exchange(&b, &[0], &[1], 3, false)).unwrap_err();
    match &err {
        SimError::Core(
            e @ Error::QpError {
                rank: 0,
                peer: 1,
                qp: 0,
                lost: 3,
                first_lost,
                ..
            },
        ) => {
            assert!(first_lost.contains("put of 256 bytes"), "{e}");
            assert_eq!(fault_rank(e), Some(1));
        }
        other => panic!("expected a QP error, got {other}"),
    }
    assert!(s.now() < BOUND, "quiet fails at once, not by timeout");
}

#[test]
fn a_lost_signal_makes_the_receiver_time_out_naming_the_qp_fault() {
    let f = Fault::QpError {
        src: 0,
        dst: 1,
        qp: QpIndex(0),
        after_wrs: 1,
    };
    let mut s = sim(&[f], 4, 4);
    let b = bufs(&mut s);
    // The sender never quiets (it only puts), so the receiver is the one to notice.
    let data = b.data.clone();
    let (src, flag) = (b.src.clone(), b.flag.clone());
    let p = Phase::new(PhaseKind::Custom("lost".into()), 1)
        .agent(0, 0, "sender", move |c: &mut dyn AgentCtx| {
            c.store(0, src.at(0), &[3; 64])?;
            c.put_signal(
                1,
                QpIndex(0),
                data.at(0),
                src.at(0),
                64,
                flag.at(0),
                SignalOp::Set,
                1,
            )
        })
        .agent(1, 0, "receiver", |c: &mut dyn AgentCtx| {
            c.wait(&flag_from(&b, 1, 0)).map(|_| ())
        });
    let err = s.run(p).unwrap_err();
    let Some(Violation::WaitTimeout { waiting, .. }) = err.violation() else {
        panic!("expected a wait timeout, got {err}");
    };
    assert_eq!(waiting.agent.rank, 1);
    assert!(
        waiting
            .faults
            .iter()
            .any(|f| f.contains("qp0 rank 0 -> rank 1 in error state")),
        "{err}"
    );
}

#[test]
fn a_dropped_completion_times_out_quiet_and_full_qp_posts_naming_the_qp() {
    for (depth, during) in [(4, "quiet"), (1, "post to a full QP")] {
        let f = Fault::DroppedCompletion {
            src: 0,
            dst: 1,
            qp: QpIndex(0),
            nth: 1,
        };
        let mut s = sim(&[f], depth, 7);
        let b = bufs(&mut s);
        let err = s.run(exchange(&b, &[0], &[], 2, false)).unwrap_err();
        let Some(Violation::CompletionTimeout {
            agent,
            peer,
            qp,
            during: d,
            oldest,
            ..
        }) = err.violation()
        else {
            panic!("expected a completion timeout, got {err}");
        };
        assert_eq!((agent.rank, *peer, qp.0, *d), (0, 1, 0, during), "{err}");
        assert!(oldest.contains("delivered, no completion"), "{err}");
        assert!(s.now() <= 2 * BOUND + 200);
    }
}

#[test]
fn threads_mode_faults_end_in_the_same_typed_errors() {
    let t = Duration::from_millis(300);
    // Dead sender: the receiver's wait times out.
    let mut ts = ThreadSim::new(fabric(4), t);
    ts.set_faults(vec![Fault::DeadRank {
        rank: 1,
        at: Trigger::AfterOps(0),
    }]);
    let b = bufs(&mut ts);
    let e = ts
        .run_phase(exchange(&b, &[1], &[0], 1, false))
        .unwrap_err();
    assert!(
        matches!(e, Error::WaitTimeout { rank: 0, ref what, .. } if what.contains("from rank 1")),
        "{e}"
    );
    // Shrink mode: the survivor masks the dead rank; the phase names it.
    let e = ts.run_phase(exchange(&b, &[1], &[0], 1, true)).unwrap_err();
    assert!(matches!(e, Error::RankFailed { rank: 1, .. }), "{e}");
    assert_eq!(ts.host_read(0, b.out.at(0), 8).unwrap()[0], 101);
    // QP error: quiet fails naming the QP and peer.
    let mut ts = ThreadSim::new(fabric(4), t);
    ts.set_faults(vec![Fault::QpError {
        src: 0,
        dst: 1,
        qp: QpIndex(0),
        after_wrs: 0,
    }]);
    let b = bufs(&mut ts);
    let e = ts.run_phase(exchange(&b, &[0], &[], 1, false)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::QpError {
                rank: 0,
                peer: 1,
                qp: 0,
                ..
            }
        ),
        "{e}"
    );
    // Dropped completion: quiet times out naming the QP.
    let mut ts = ThreadSim::new(fabric(4), t);
    ts.set_faults(vec![Fault::DroppedCompletion {
        src: 0,
        dst: 1,
        qp: QpIndex(0),
        nth: 1,
    }]);
    let b = bufs(&mut ts);
    let e = ts.run_phase(exchange(&b, &[0], &[], 1, false)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::CompletionTimeout {
                rank: 0,
                peer: 1,
                qp: 0,
                during: "quiet",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn threads_mode_spawn_failure_aborts_the_phase_at_once() {
    // The wait bound is long: a phase that waited for the agent that never started would take
    // it; the spawn failure must stop the started agents at once instead.
    let t = Duration::from_secs(60);
    let mut ts = ThreadSim::new(fabric(4), t);
    let b = bufs(&mut ts);
    ts.limit_agent_threads(Some(1));
    let started = std::time::Instant::now();
    let e = ts
        .run_phase(exchange(&b, &[0, 1], &[0, 1], 1, false))
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the phase sat out its wait bound: {:?}",
        started.elapsed()
    );
    assert!(
        matches!(e, Error::AgentSpawnFailed { started: 1, .. }),
        "expected a typed spawn failure, got {e}"
    );
    assert!(e.to_string().contains("ulimit"), "{e}");
    // Lifted, the same fabric runs the phase (on fresh words: the aborted one left a signal).
    ts.limit_agent_threads(None);
    let b = bufs(&mut ts);
    ts.run_phase(exchange(&b, &[0, 1], &[0, 1], 1, false))
        .unwrap();
}

#[test]
fn deterministic_mode_spawn_failure_is_a_typed_error_not_a_panic() {
    // The deterministic simulator spawns one thread per agent too: a refused one ends the phase
    // in AgentSpawnFailed (the agents already started are released), and the simulator runs
    // the next phase normally.
    let mut sim = Sim::new(SimConfig::new(fabric(4), 3).wait_timeout(BOUND));
    let b = bufs(&mut sim);
    sim.limit_agent_threads(Some(1));
    let e = sim
        .run(exchange(&b, &[0, 1], &[0, 1], 1, false))
        .unwrap_err();
    assert!(
        matches!(&e, SimError::Core(Error::AgentSpawnFailed { started: 1, total, .. }) if *total > 1),
        "expected a typed spawn failure, got {e}"
    );
    sim.limit_agent_threads(None);
    let b = bufs(&mut sim);
    sim.run(exchange(&b, &[0, 1], &[0, 1], 1, false)).unwrap();
}
