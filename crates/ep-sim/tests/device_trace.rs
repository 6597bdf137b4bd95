//! The GPU trace checker (`ep_sim::device_trace`) on hand-built traces shaped like the
//! low-latency kernels of docs/protocol.md §3.10 (variant (a), stores by pointer; one signal per
//! send group) and §3.11 (variant (b), NVSHMEM puts): the
//! correct shapes pass under many seeds; a planted missing fence, a load before its acquire and
//! a put signalled without a fence are each caught, with the rank, block and bytes named.

use ep_core::transport::{AgentEvents, DeviceEvent, FenceScope, TraceRegion};
use ep_sim::Violation;
use ep_sim::device_trace::{Arenas, CheckConfig, TraceError, TracePlace, check, check_with};

const R: usize = 2;
/// Blocks per rank.
const B: usize = 3;
/// Tokens per rank (every token goes to every rank).
const N: u64 = 5;
const ROW: u64 = 64;
/// One send group's header copy; the header holds `B` of them.
const HC: u64 = 16;
const HDR: u64 = B as u64 * HC;
const META: u64 = 32;
/// Operation half and call.
const H: u64 = 1;
const K: u64 = 7;

/// `disp_sig[h][s][b]`: send group `b` of source `s`.
fn disp_sig(s: usize, b: usize) -> u64 {
    16 * ((H * R as u64 + s as u64) * B as u64 + b as u64)
}
/// `comb_sig[h][d][b]`: the partials of send group `b`'s messages from expert rank `d`.
fn comb_sig(d: usize, b: usize) -> u64 {
    16 * (2 * R as u64 * B as u64 + (H * R as u64 + d as u64) * B as u64 + b as u64)
}
/// Send group `b`'s header copy in `drecv[s]`.
fn header_copy(s: usize, b: usize) -> u64 {
    drecv(s) + b as u64 * HC
}
/// Send group `b`'s tokens (docs/protocol.md §3.3).
fn group(b: usize) -> std::ops::Range<u64> {
    let g = ep_core::protocol::layout::ll_send_group(N as usize, B, b);
    g.start as u64..g.end as u64
}
/// `drecv[s]` in the receiver's `ll.data`: header, `N` meta records, `N` rows.
fn drecv(s: usize) -> u64 {
    s as u64 * (HDR + N * (META + ROW))
}
fn meta(s: usize, i: u64) -> u64 {
    drecv(s) + HDR + i * META
}
fn row(s: usize, i: u64) -> u64 {
    drecv(s) + HDR + N * META + i * ROW
}
/// Variant (b)'s staging of token `t` in the sender's own `ll.data` (after every drecv).
fn dsend(t: u64) -> u64 {
    drecv(R) + t * ROW
}
/// Variant (b)'s staging of send group `b`'s header copy (after the staged rows).
fn header_stage(b: usize) -> u64 {
    dsend(N) + b as u64 * HC
}
/// Combine: `crecv[d]` slot `i` on the token's rank.
fn crecv(d: usize, i: u64) -> u64 {
    d as u64 * N * ROW + i * ROW
}

fn arenas() -> Arenas {
    Arenas {
        signals_bytes: 16 * 4 * R as u64 * B as u64,
        data_bytes: header_stage(B),
    }
}

fn store(rank: usize, offset: u64, len: u64) -> DeviceEvent {
    DeviceEvent::Store {
        rank,
        region: TraceRegion::Data,
        offset,
        len,
    }
}
fn load(rank: usize, offset: u64, len: u64) -> DeviceEvent {
    DeviceEvent::Load {
        rank,
        region: TraceRegion::Data,
        offset,
        len,
    }
}
const FENCE: DeviceEvent = DeviceEvent::Fence {
    scope: FenceScope::System,
};
fn value(n: u64) -> u64 {
    (K << 32) | n
}
/// The releases of the signal word at `offset` on every rank, value `n`.
fn release_on_all(ev: &mut Vec<DeviceEvent>, offset: u64, n: u64) {
    ev.extend((0..R).map(|rank| DeviceEvent::Release {
        rank,
        offset,
        value: value(n),
    }));
}
/// `rank`'s acquires of the words `offset(s)` of every writer `s`, value `n`.
fn acquire_from_all(ev: &mut Vec<DeviceEvent>, rank: usize, offset: impl Fn(usize) -> u64, n: u64) {
    ev.extend((0..R).map(|s| DeviceEvent::Acquire {
        rank,
        offset: offset(s),
        value: value(n),
    }));
}

/// A send group's publication and its receive part's wait (variant (a)): one fence, `rank`'s
/// word `word(rank)` released on every rank, then the words `word(w)` of every writer acquired.
fn fence_release_acquire(
    ev: &mut Vec<DeviceEvent>,
    rank: usize,
    word: impl Fn(usize) -> u64,
    n: u64,
) {
    ev.push(FENCE);
    release_on_all(ev, word(rank), n);
    acquire_from_all(ev, rank, word, n);
}

/// One agent per block `b` of every rank, its events from `events(rank, b)`.
fn per_block(events: impl Fn(usize, usize) -> Vec<DeviceEvent>) -> Vec<AgentEvents> {
    let events = &events;
    (0..R)
        .flat_map(|rank| {
            (0..B).map(move |b| AgentEvents {
                rank,
                agent: b,
                events: events(rank, b),
            })
        })
        .collect()
}

/// LL dispatch, variant (a) (§3.10): block `b` of rank `s` is send group `b`: it stores its
/// tokens' rows and meta records and its header copy straight into each destination's
/// `drecv[s]`, fences and releases `disp_sig[h][s][b]` on every destination. Its receive part
/// acquires group `b`'s signal of every source, loads the header copies, then that group's meta
/// records and rows.
fn dispatch_a() -> Vec<AgentEvents> {
    per_block(|rank, b| {
        let mut ev = Vec::new();
        for t in group(b) {
            for d in 0..R {
                ev.push(store(d, row(rank, t), ROW));
                ev.push(store(d, meta(rank, t), META));
            }
        }
        for d in 0..R {
            ev.push(store(d, header_copy(rank, b), HC));
        }
        fence_release_acquire(&mut ev, rank, |s| disp_sig(s, b), group(b).count() as u64);
        // Receive part.
        for s in 0..R {
            ev.push(load(rank, header_copy(s, b), HC));
            for i in group(b) {
                ev.push(load(rank, meta(s, i), META));
                ev.push(load(rank, row(s, i), ROW));
            }
        }
        ev
    })
}

/// LL combine, variant (a): block `b` of expert rank `d` stores the partials of send group `b`'s
/// messages into each token rank's `crecv[d]`, fences and releases `comb_sig[h][d][b]`. Block
/// `b` of the token rank acquires group `b`'s signal of every expert rank and loads its partials.
fn combine_a() -> Vec<AgentEvents> {
    per_block(|rank, b| {
        let mut ev = Vec::new();
        for i in group(b) {
            for s in 0..R {
                ev.push(store(s, crecv(rank, i), ROW));
            }
        }
        fence_release_acquire(&mut ev, rank, |d| comb_sig(d, b), group(b).count() as u64);
        for i in group(b) {
            for d in 0..R {
                ev.push(load(rank, crecv(d, i), ROW));
            }
        }
        ev
    })
}

/// LL dispatch, variant (b) (§3.11): send group `b` stages its tokens' rows in the sender's
/// `dsend` and puts them to each destination, stages its header copy, fences, then puts the
/// header copy with `disp_sig[h][s][b]` per destination.
fn dispatch_b() -> Vec<AgentEvents> {
    per_block(|rank, b| {
        let mut ev = Vec::new();
        for t in group(b) {
            ev.push(store(rank, dsend(t), ROW));
            for d in 0..R {
                ev.push(DeviceEvent::Put {
                    dst_rank: d,
                    dst_offset: row(rank, t),
                    src_offset: dsend(t),
                    len: ROW,
                });
            }
        }
        ev.push(store(rank, header_stage(b), HC));
        ev.push(FENCE);
        let n = group(b).count() as u64;
        for d in 0..R {
            ev.push(DeviceEvent::PutSignal {
                dst_rank: d,
                dst_offset: header_copy(rank, b),
                src_offset: header_stage(b),
                len: HC,
                signal_offset: disp_sig(rank, b),
                value: value(n),
            });
        }
        acquire_from_all(&mut ev, rank, |s| disp_sig(s, b), n);
        for s in 0..R {
            ev.push(load(rank, header_copy(s, b), HC));
            for i in group(b) {
                ev.push(load(rank, row(s, i), ROW));
            }
        }
        ev
    })
}

fn seeds(seeds: u64) -> impl Iterator<Item = CheckConfig> {
    (0..seeds).map(|seed| CheckConfig {
        seed,
        same_gpu: false,
    })
}

/// Removes the first fence of `(rank, block)`'s events.
fn drop_fence(agents: &mut [AgentEvents], rank: usize, block: usize, nth: usize) {
    let a = agents
        .iter_mut()
        .find(|a| (a.rank, a.agent) == (rank, block))
        .unwrap();
    let at = a
        .events
        .iter()
        .enumerate()
        .filter(|(_, e)| matches!(e, DeviceEvent::Fence { .. }))
        .nth(nth)
        .unwrap()
        .0;
    a.events.remove(at);
}

fn expect_violation(e: TraceError) -> (Violation, TracePlace) {
    match e {
        TraceError::Violation {
            violation,
            place: Some(p),
        } => (*violation, p),
        other => panic!("expected a violation with a place, got {other}"),
    }
}

#[test]
fn correct_shapes_pass_under_many_seeds() {
    for (name, t) in [
        ("dispatch (a)", dispatch_a()),
        ("combine (a)", combine_a()),
        ("dispatch (b)", dispatch_b()),
    ] {
        for cfg in seeds(24) {
            let r = check_with(R, arenas(), &t, &cfg)
                .unwrap_or_else(|e| panic!("{name}, seed {}: {e}", cfg.seed));
            assert_eq!(r.agents, R * B);
            assert!(
                r.loads > 0 && r.acquires == (R * B * R) as u64,
                "{name}: {r:?}"
            );
        }
    }
}

/// The writer a violation names (`rank r/agent b(block b)`), for a race or an unpublished store.
fn writer_of(v: &Violation) -> String {
    match v {
        Violation::DataRace { writer, .. } => writer.clone(),
        Violation::StoreNotPublished { writer, .. } => {
            format!("rank{}/{}", writer.rank, writer.role)
        }
        other => panic!("expected a race or an unpublished store, got {other}"),
    }
}

#[test]
fn missing_fence_of_a_send_group_is_caught_naming_its_store() {
    // Without its fence, block 2 of rank 0 releases its signal before its stores are published.
    for cfg in seeds(12) {
        let mut t = dispatch_a();
        drop_fence(&mut t, 0, 2, 0);
        let e = check_with(R, arenas(), &t, &cfg).unwrap_err();
        let msg = e.to_string();
        let (v, place) = expect_violation(e);
        let writer = writer_of(&v);
        assert!(
            writer.starts_with("rank0") && writer.contains("block2"),
            "{msg}"
        );
        // The bytes are group 2's rows, meta records (token 4) or header copy, on one of the ranks.
        assert_eq!(place.region, TraceRegion::Data, "{msg}");
        let owned = [row(0, 4), meta(0, 4), header_copy(0, 2)]
            .iter()
            .any(|&o| (o..o + ROW).contains(&place.offset));
        assert!(owned, "{msg}");
    }
}

#[test]
fn a_load_before_its_acquire_is_caught() {
    for cfg in seeds(12) {
        let mut t = dispatch_a();
        // Rank 1 block 0 loads source 0's first row before waiting for its signal.
        let a = t.iter_mut().find(|a| (a.rank, a.agent) == (1, 0)).unwrap();
        let first_acquire = a
            .events
            .iter()
            .position(|e| matches!(e, DeviceEvent::Acquire { .. }))
            .unwrap();
        a.events.insert(first_acquire, load(1, row(0, 0), ROW));
        let e = check_with(R, arenas(), &t, &cfg).unwrap_err();
        let msg = e.to_string();
        let (v, place) = expect_violation(e);
        assert!(
            matches!(
                v,
                Violation::DataRace { .. } | Violation::ReadOfPoison { .. }
            ),
            "seed {}: {msg}",
            cfg.seed
        );
        assert_eq!(v.rank(), 1);
        assert_eq!(
            (place.rank, place.region, place.offset),
            (1, TraceRegion::Data, row(0, 0)),
            "{msg}"
        );
        assert!(msg.contains("rank1/agent0(block0)"), "{msg}");
    }
}

#[test]
fn missing_fence_in_the_combine_direction_is_caught() {
    // Expert rank 1's block 0 releases its signal with its partials unpublished.
    let mut t = combine_a();
    drop_fence(&mut t, 1, 0, 0);
    let (v, place) = expect_violation(check(R, arenas(), &t).unwrap_err());
    let writer = writer_of(&v);
    assert!(
        writer.starts_with("rank1") && writer.contains("block0"),
        "{v}"
    );
    assert!([crecv(1, 0), crecv(1, 1)].contains(&place.offset), "{v}");
}

#[test]
fn variant_b_puts_need_the_fence_before_the_put_signal() {
    // Without block 2's fence the rows it put are not ordered before its signal.
    let mut t = dispatch_b();
    drop_fence(&mut t, 0, 2, 0);
    let (v, place) = expect_violation(check(R, arenas(), &t).unwrap_err());
    let writer = writer_of(&v);
    assert!(
        writer.starts_with("rank0") && writer.contains("block2"),
        "{v}"
    );
    assert_eq!(place.offset, row(0, 4), "{v}");
}

#[test]
fn put_signal_publishes_its_own_data_without_a_fence() {
    // A header copy staged after the block's fence still travels with its put-with-signal, whose
    // data the signal covers (NVSHMEM semantics): the trace stays correct.
    let mut t = dispatch_b();
    let a = t.iter_mut().find(|a| (a.rank, a.agent) == (0, 1)).unwrap();
    let staged = a
        .events
        .iter()
        .position(|e| matches!(e, DeviceEvent::Store { offset, .. } if *offset == header_stage(1)))
        .unwrap();
    let ev = a.events.remove(staged);
    let fence = a
        .events
        .iter()
        .position(|e| matches!(e, DeviceEvent::Fence { .. }))
        .unwrap();
    a.events.insert(fence + 1, ev);
    check(R, arenas(), &t).unwrap();
    // But a store of the block's after its fence, read through the signal, is not.
    let a = t.iter_mut().find(|a| (a.rank, a.agent) == (0, 1)).unwrap();
    let at = a
        .events
        .iter()
        .position(|e| matches!(e, DeviceEvent::PutSignal { .. }))
        .unwrap();
    a.events.insert(at, store(1, meta(0, 2), META));
    let b = t.iter_mut().find(|a| (a.rank, a.agent) == (1, 1)).unwrap();
    b.events.push(load(1, meta(0, 2), META));
    let (v, place) = expect_violation(check(R, arenas(), &t).unwrap_err());
    match &v {
        Violation::StoreNotPublished { writer, .. } => assert_eq!(writer.role, "block1"),
        other => panic!("expected StoreNotPublished, got {other}"),
    }
    assert_eq!((place.rank, place.offset), (1, meta(0, 2)), "{v}");
}

#[test]
fn gpu_scope_fences_count_only_on_one_gpu() {
    let mut t = dispatch_a();
    for a in &mut t {
        for e in &mut a.events {
            if let DeviceEvent::Fence { scope } = e {
                *scope = FenceScope::Gpu;
            }
        }
    }
    let same = CheckConfig {
        seed: 3,
        same_gpu: true,
    };
    let r = check_with(R, arenas(), &t, &same).unwrap();
    assert_eq!(r.gpu_fences_ignored, 0);
    assert!(check(R, arenas(), &t).unwrap_err().violation().is_some());
}

#[test]
fn inconsistent_traces_are_refused_before_replay() {
    let mut t = dispatch_a();
    // An acquire of a value nobody released.
    let a = t.iter_mut().find(|a| (a.rank, a.agent) == (1, 2)).unwrap();
    a.events.push(DeviceEvent::Acquire {
        rank: 1,
        offset: disp_sig(0, 2),
        value: value(N + 1),
    });
    assert!(matches!(
        check(R, arenas(), &t),
        Err(TraceError::Inconsistent {
            rank: 1,
            agent: 2,
            ..
        })
    ));
    // Two arrivals at one completion counter with one ticket.
    let arrive = |agent, last| AgentEvents {
        rank: 0,
        agent,
        events: vec![DeviceEvent::CounterArrive {
            counter: 0,
            ticket: 0,
            last,
        }],
    };
    let t = vec![arrive(0, false), arrive(1, true)];
    let e = check(R, arenas(), &t).unwrap_err();
    assert!(matches!(e, TraceError::Inconsistent { rank: 0, .. }), "{e}");
    // Bytes outside the arena.
    let mut t = dispatch_a();
    t[0].events.push(load(0, arenas().data_bytes - 8, 16));
    assert!(matches!(
        check(R, arenas(), &t),
        Err(TraceError::Inconsistent { .. })
    ));
}
