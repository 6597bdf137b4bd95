//! Property tests of the executor's invariants over random programs: a correct protocol (puts
//! on random QPs, fence, then a signal) never raises a violation under any policy; per-stream
//! delivery is FIFO; no QP holds more than its depth; every work request is delivered once and
//! completed after its delivery; virtual time never goes back; a seed replays exactly.

mod common;

use std::collections::BTreeMap;

use common::*;
use ep_core::transport::{AgentCtx, Cmp, FabricParams, Init, Phase, PhaseKind, QpIndex, WaitUntil};
use ep_sim::{Policy, Sim, SimConfig, TraceEvent};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Msg {
    dst: usize,
    qp: u16,
    len: u64,
    fence_after: bool,
}

#[derive(Debug, Clone)]
struct Prog {
    ranks: usize,
    per_node: usize,
    rc: u16,
    depth: u32,
    granularity: u64,
    policy: u8,
    seed: u64,
    msgs: Vec<Vec<Msg>>,
}

const SLOT: u64 = 256;
const MAX_MSGS: usize = 6;

fn prog() -> impl Strategy<Value = Prog> {
    (
        2usize..=4,
        1u16..=3,
        1u32..=4,
        prop::sample::select(vec![64u64, 96, 4096]),
        0u8..3,
        any::<u64>(),
    )
        .prop_flat_map(|(ranks, rc, depth, granularity, policy, seed)| {
            let msg = (0..ranks, 0..rc, 1u64..=SLOT, any::<bool>()).prop_map(
                |(dst, qp, len, fence_after)| Msg {
                    dst,
                    qp,
                    len,
                    fence_after,
                },
            );
            (
                Just((ranks, rc, depth, granularity, policy, seed)),
                1..=ranks,
                prop::collection::vec(prop::collection::vec(msg, 0..=MAX_MSGS), ranks),
            )
        })
        .prop_map(
            |((ranks, rc, depth, granularity, policy, seed), per_node, msgs)| Prog {
                ranks,
                per_node,
                rc,
                depth,
                granularity,
                policy,
                seed,
                msgs,
            },
        )
}

fn policy(p: u8) -> Policy {
    match p {
        0 => Policy::Uniform,
        1 => Policy::Pct {
            depth: 2,
            horizon: 300,
        },
        _ => Policy::LatestLegal,
    }
}

/// Runs the program; returns the sim.
fn run(p: &Prog) -> Sim {
    let mut f = FabricParams::single_node(p.ranks);
    f.ranks_per_node = p.per_node;
    f.rc_per_pe = p.rc;
    f.qp_depth = p.depth;
    f.granularity = p.granularity;
    let mut s = Sim::new(SimConfig::new(f, p.seed).policy(policy(p.policy)).traced());
    let n = p.ranks as u64;
    let m = MAX_MSGS as u64;
    // recv[src][msg] on each rank; src staging per message; one flag per source.
    let recv = alloc(&mut s, "recv", n * m * SLOT, Init::Poison);
    let stage = alloc(&mut s, "stage", m * SLOT, Init::Poison);
    let flags = alloc(&mut s, "flags", n * 16, Init::Zero);
    let mut phase = Phase::new(PhaseKind::Custom("random".into()), 1);
    for r in 0..p.ranks {
        let mine = p.msgs[r].clone();
        let (recv_s, stage, flags_s) = (recv.clone(), stage.clone(), flags.clone());
        let seed = p.seed;
        phase = phase.agent(r, 0, "sender", move |c: &mut dyn AgentCtx| {
            for (i, msg) in mine.iter().enumerate() {
                let src = stage.at(i as u64 * SLOT);
                c.store(r, src, &pattern(seed, r as u64, i as u64, msg.len as usize))?;
                c.put(
                    msg.dst,
                    QpIndex(msg.qp),
                    recv_s.at((r as u64 * m + i as u64) * SLOT),
                    src,
                    msg.len,
                )?;
                if msg.fence_after {
                    c.fence()?;
                }
            }
            c.fence()?;
            for dst in 0..c.num_ranks() {
                c.amo_add(dst, QpIndex(0), flags_s.at(r as u64 * 16), 1)?;
            }
            c.quiet()
        });
        let all = p.msgs.clone();
        let (recv, flags) = (recv.clone(), flags.clone());
        phase = phase.agent(r, 1, "receiver", move |c: &mut dyn AgentCtx| {
            for (src, list) in all.iter().enumerate() {
                let what = format!("flag from {src}");
                c.wait(&WaitUntil {
                    rank: r,
                    word: flags.at(src as u64 * 16),
                    cmp: Cmp::Ge,
                    value: 1,
                    what,
                })?;
                for (i, msg) in list.iter().enumerate().filter(|(_, msg)| msg.dst == r) {
                    let mut b = vec![0u8; msg.len as usize];
                    c.load(r, recv.at((src as u64 * m + i as u64) * SLOT), &mut b)?;
                    assert_eq!(b, pattern(seed, src as u64, i as u64, msg.len as usize));
                }
            }
            Ok(())
        });
    }
    if let Err(e) = s.run(phase) {
        panic!("correct random program raised {e}\n{p:?}");
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn executor_invariants_hold(p in prog()) {
        let s = run(&p);
        prop_assert_eq!(s.stats().fifo_breaches, 0);
        prop_assert!(s.stats().max_outstanding <= p.depth);
        let mut delivered = BTreeMap::new();
        let mut last_t = 0;
        for e in s.trace() {
            let t = match *e {
                TraceEvent::Agent { t, .. } => t,
                TraceEvent::Deliver { t, wr } => {
                    prop_assert!(delivered.insert(wr, t).is_none(), "work request {} delivered twice", wr);
                    t
                }
                TraceEvent::Complete { t, wr } => {
                    let d = delivered.get(&wr).copied();
                    prop_assert!(d.is_some_and(|d| d < t), "work request {} completed before delivery", wr);
                    t
                }
            };
            prop_assert!(t >= last_t);
            last_t = t;
        }
        prop_assert_eq!(delivered.len() as u64, s.stats().posted);
        // Replay: the same program and seed give the same trace and memory.
        let again = run(&p);
        prop_assert_eq!(s.trace(), again.trace());
        prop_assert_eq!(s.memory_digest(), again.memory_digest());
    }
}
