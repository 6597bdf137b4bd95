//! The cost model over recorded runs: both executors record the same traffic for the same
//! protocol, predictions are deterministic, and QP depth and payload move them the right way.

mod common;

use std::time::Duration;

use common::*;
use ep_core::transport::{
    AgentCtx, Cmp, FabricParams, Init, Phase, PhaseKind, QpIndex, Transport, WaitUntil,
};
use ep_sim::cost::{CostModel, Hops, LinkClass, PhaseRecord};
use ep_sim::{Sim, SimConfig, ThreadSim, ring_offset};

/// 4 ranks, 2 per node: each rank sends `rows` rows of `row` bytes to every other rank (NVLink
/// stores then a release to its node peer, RDMA puts then an `amo_add` to the other node), then
/// waits for all.
fn all_to_all(t: &mut impl Transport, row: u64, rows: u64) {
    let n = 4usize;
    let data = alloc(t, "data", n as u64 * rows * row, Init::Poison);
    let src = alloc(t, "src", rows * row, Init::Poison);
    let flags = alloc(t, "flags", n as u64 * 16, Init::Zero);
    let mut p = Phase::new(PhaseKind::DispatchSend, 1);
    for r in 0..n {
        let (data, src, flags) = (data.clone(), src.clone(), flags.clone());
        p = p.agent(r, 0, "sender", move |c: &mut dyn AgentCtx| {
            let bytes = pattern(r as u64, 0, 0, (rows * row) as usize);
            c.store(r, src.at(0), &bytes)?;
            for d in (0..n).filter(|&d| d != r) {
                let at = data.at(r as u64 * rows * row);
                let flag = flags.at(r as u64 * 16);
                if d / 2 == r / 2 {
                    for i in 0..rows {
                        let s = (i * row) as usize;
                        c.store(d, at.add(i * row), &bytes[s..s + row as usize])?;
                    }
                    c.store_release(d, flag, 1)?;
                } else {
                    for i in 0..rows {
                        c.put(d, QpIndex(0), at.add(i * row), src.at(i * row), row)?;
                    }
                    c.amo_add(d, QpIndex(0), flag, 1)?;
                }
            }
            for s in (0..n).filter(|&s| s != r && s / 2 == r / 2) {
                c.wait(&WaitUntil {
                    rank: r,
                    word: flags.at(s as u64 * 16),
                    cmp: Cmp::Eq,
                    value: 1,
                    what: format!("rows from rank {s}"),
                })?;
            }
            c.quiet()
        });
    }
    t.run_phase(p).expect("all-to-all");
}

fn fabric(depth: u32) -> FabricParams {
    let mut f = FabricParams::single_node(4);
    f.ranks_per_node = 2;
    f.qp_depth = depth;
    f
}

fn sim_record(depth: u32, row: u64, rows: u64, seed: u64) -> PhaseRecord {
    let mut s = Sim::new(SimConfig::new(fabric(depth), seed));
    all_to_all(&mut s, row, rows);
    s.records().last().expect("record").clone()
}

#[test]
fn both_executors_record_the_same_traffic() {
    let a = sim_record(8, 256, 5, 1);
    let b = sim_record(8, 256, 5, 2);
    let mut ts = ThreadSim::new(fabric(8), Duration::from_secs(10));
    all_to_all(&mut ts, 256, 5);
    let c = ts.records().last().expect("record").clone();
    assert_eq!(a.flows, b.flows, "traffic does not depend on the schedule");
    assert_eq!(
        a.flows, c.flows,
        "threads mode records what the simulator records"
    );
    assert_eq!(a.qps, c.qps);
    assert_eq!(a.kind, PhaseKind::DispatchSend);
    // Rank 0: its own row copy, 5 NVLink rows + a release to rank 1, 5 RDMA puts + an atomic
    // to ranks 2 and 3 each.
    let f = |s, d| a.flows[&(s, d)];
    assert_eq!((f(0, 0).link, f(0, 0).bytes), (LinkClass::Local, 5 * 256));
    assert_eq!(
        (f(0, 1).link, f(0, 1).bytes, f(0, 1).messages),
        (LinkClass::NvLink, 5 * 256 + 8, 6)
    );
    assert_eq!(
        (f(0, 2).link, f(0, 2).bytes, f(0, 2).work_requests),
        (LinkClass::Rdma, 5 * 256 + 8, 6)
    );
    assert_eq!(a.qps[&(0, 3, 0)].work_requests, 6);
    // The only waits are on NVLink releases: one NVLink hop, no RDMA hop on a wait chain.
    assert_eq!(a.depth, Hops { nvlink: 1, rdma: 0 });
    assert_eq!(a.remote_bytes(), 4 * 3 * (5 * 256 + 8));
}

#[test]
fn predictions_are_deterministic_and_monotone_in_depth_and_payload() {
    let m = CostModel::default();
    let p1 = m.predict(&sim_record(8, 1024, 16, 3), &fabric(8));
    let p2 = m.predict(&sim_record(8, 1024, 16, 4), &fabric(8));
    assert_eq!(p1, p2);
    assert!(p1.total_us > 0.0 && !p1.bottleneck.is_empty(), "{p1}");
    let rec = sim_record(64, 1024, 16, 3);
    let mut last = f64::INFINITY;
    for depth in [1u32, 2, 4, 17, 64, 1024] {
        let p = m.predict(&rec, &fabric(depth));
        assert!(p.total_us <= last, "depth {depth}: {p}");
        last = p.total_us;
    }
    let mut last = 0.0;
    for row in [16u64, 256, 4096, 14336] {
        let p = m.predict(&sim_record(64, row, 4, 5), &fabric(64));
        assert!(p.total_us >= last, "row {row}: {p}");
        last = p.total_us;
    }
}

#[test]
fn ring_offsets_are_seeded_and_leave_headroom() {
    let a = SimConfig::new(fabric(4), 1);
    let b = SimConfig::new(fabric(4), 2);
    assert_eq!(a.ring_offset("tail 0->1"), ring_offset(1, "tail 0->1"));
    let names: Vec<String> = (0..64).map(|i| format!("ring {i}")).collect();
    let va: Vec<u64> = names.iter().map(|n| a.ring_offset(n)).collect();
    let vb: Vec<u64> = names.iter().map(|n| b.ring_offset(n)).collect();
    assert_ne!(va, vb, "different seeds, different offsets");
    assert!(va.iter().any(|&v| v < 1 << 20) && va.iter().any(|&v| v > u64::MAX / 2));
    assert!(va.iter().all(|&v| v <= u64::MAX - (1 << 40)));
}
