//! Decode -> check: a low-latency dispatch trace (docs/protocol.md §3.10) encoded per rank in the
//! device format (`gpu::trace`), decoded, and judged by ep-sim's checker; the same trace with a
//! planted missing fence is caught after the round trip, naming the block and the bytes.

use ep_core::transport::{AgentEvents, DeviceEvent, FenceScope, TraceRegion};
use ep_kernels::gpu::trace::{decode, encode};
use ep_sim::Violation;
use ep_sim::device_trace::{Arenas, TraceError, check};

const R: usize = 2;
const B: usize = 4;
const N: u64 = 7;
const ROW: u64 = 128;

fn row(s: usize, i: u64) -> u64 {
    16 + s as u64 * (16 + N * ROW) + i * ROW
}
fn hdr(s: usize) -> u64 {
    s as u64 * (16 + N * ROW)
}
fn sig(s: usize) -> u64 {
    16 * (R + s) as u64
}

/// Every block of every rank: rows to every rank, fence, arrival (the last: headers, fence,
/// releases), then acquires and loads of its share. Block `b` arrives `(b + rank) % B`-th.
fn trace(skip_fence: Option<(usize, usize)>) -> Vec<AgentEvents> {
    let mut out = Vec::new();
    for rank in 0..R {
        for b in 0..B {
            let mut ev = Vec::new();
            for t in (b as u64..N).step_by(B) {
                for d in 0..R {
                    ev.push(DeviceEvent::Store {
                        rank: d,
                        region: TraceRegion::Data,
                        offset: row(rank, t),
                        len: ROW,
                    });
                }
            }
            if skip_fence != Some((rank, b)) {
                ev.push(DeviceEvent::Fence {
                    scope: FenceScope::System,
                });
            }
            let ticket = ((b + rank) % B) as u64;
            let last = ticket + 1 == B as u64;
            ev.push(DeviceEvent::CounterArrive {
                counter: 0,
                ticket,
                last,
            });
            if last {
                for d in 0..R {
                    ev.push(DeviceEvent::Store {
                        rank: d,
                        region: TraceRegion::Data,
                        offset: hdr(rank),
                        len: 16,
                    });
                }
                ev.push(DeviceEvent::Fence {
                    scope: FenceScope::System,
                });
                for d in 0..R {
                    ev.push(DeviceEvent::Release {
                        rank: d,
                        offset: sig(rank),
                        value: (3 << 32) | N,
                    });
                }
            }
            for s in 0..R {
                ev.push(DeviceEvent::Acquire {
                    rank,
                    offset: sig(s),
                    value: (3 << 32) | N,
                });
                ev.push(DeviceEvent::Load {
                    rank,
                    region: TraceRegion::Data,
                    offset: hdr(s),
                    len: 16,
                });
                for i in (b as u64..N).step_by(B) {
                    ev.push(DeviceEvent::Load {
                        rank,
                        region: TraceRegion::Data,
                        offset: row(s, i),
                        len: ROW,
                    });
                }
            }
            out.push(AgentEvents {
                rank,
                agent: b,
                events: ev,
            });
        }
    }
    out
}

/// Encodes each rank's blocks as its device would, then decodes every rank.
fn round_trip(t: &[AgentEvents]) -> Vec<AgentEvents> {
    let mut all = Vec::new();
    for rank in 0..R {
        let mine: Vec<AgentEvents> = t.iter().filter(|a| a.rank == rank).cloned().collect();
        let bytes = encode(rank, B, 64, &mine);
        let got = decode(rank, &bytes).expect("decode");
        assert_eq!(got, mine);
        all.extend(got);
    }
    all
}

fn arenas() -> Arenas {
    Arenas {
        signals_bytes: 64 * R as u64,
        data_bytes: hdr(R),
    }
}

#[test]
fn decoded_trace_passes() {
    let r = check(R, arenas(), &round_trip(&trace(None))).unwrap();
    assert_eq!(r.agents, R * B);
}

#[test]
fn decoded_trace_with_a_missing_fence_is_caught() {
    // Rank 1 block 0 arrives with ticket 1 (not last) and skips its fence.
    let e = check(R, arenas(), &round_trip(&trace(Some((1, 0))))).unwrap_err();
    let TraceError::Violation {
        violation,
        place: Some(place),
    } = &e
    else {
        panic!("expected a violation, got {e}");
    };
    let Violation::DataRace { writer, .. } = violation.as_ref() else {
        panic!("expected a data race, got {violation}");
    };
    assert!(writer.starts_with("rank1/agent0(block0)"), "{e}");
    assert_eq!(place.region, TraceRegion::Data);
    assert!(
        [0, B as u64].iter().any(|&t| place.offset == row(1, t)),
        "{e}"
    );
}
