//! Decode -> check of cluster agents (normal mode, docs/protocol.md §1.3: a sender agent is a
//! cluster of two CTAs): each CTA's records with an `EP_TRACE_CLUSTER_BARRIER` between its
//! segments, merged by `decode_clusters` into one agent per cluster and judged by ep-sim's
//! checker; the second CTA's missing fence before the barrier is caught, and clusters whose
//! blocks crossed different numbers of barriers are refused.

use ep_core::transport::{AgentEvents, DeviceEvent, FenceScope, TraceRegion};
use ep_kernels::Error;
use ep_kernels::gpu::trace::{decode, decode_clusters, encode_segments};
use ep_sim::Violation;
use ep_sim::device_trace::{Arenas, TraceError, check};

const R: usize = 2;
/// Clusters (channels) per rank; blocks = 2 x C.
const C: usize = 2;
const ROWS: u64 = 4;
const ROW: u64 = 64;

/// Row `i` sent by source `s` over channel `c` (its place on the receiver).
fn row(s: usize, c: usize, i: u64) -> u64 {
    ((s * C + c) as u64 * ROWS + i) * ROW
}
/// done[s][c] on a receiver.
fn done(s: usize, c: usize) -> u64 {
    16 * (s * C + c) as u64
}

/// Block (c, h) of `rank`: its half of the channel's rows to every rank, fence (unless planted
/// away), barrier; then CTA 0 releases done[rank][c] on every rank; both wait done[s][c] of
/// every source and load their half of those rows.
fn blocks(rank: usize, skip_fence: Option<usize>) -> Vec<(usize, Vec<Vec<DeviceEvent>>)> {
    let mut out = Vec::new();
    for c in 0..C {
        for h in 0..2usize {
            let b = 2 * c + h;
            let half = (h as u64 * ROWS / 2)..((h as u64 + 1) * ROWS / 2);
            let mut pre = Vec::new();
            for i in half.clone() {
                for d in 0..R {
                    pre.push(DeviceEvent::Store {
                        rank: d,
                        region: TraceRegion::Data,
                        offset: row(rank, c, i),
                        len: ROW,
                    });
                }
            }
            if skip_fence != Some(b) {
                pre.push(DeviceEvent::Fence {
                    scope: FenceScope::System,
                });
            }
            let mut post = Vec::new();
            if h == 0 {
                for d in 0..R {
                    post.push(DeviceEvent::Release {
                        rank: d,
                        offset: done(rank, c),
                        value: 5,
                    });
                }
            }
            for s in 0..R {
                post.push(DeviceEvent::Acquire {
                    rank,
                    offset: done(s, c),
                    value: 5,
                });
            }
            for s in 0..R {
                for i in half.clone() {
                    post.push(DeviceEvent::Load {
                        rank,
                        region: TraceRegion::Data,
                        offset: row(s, c, i),
                        len: ROW,
                    });
                }
            }
            out.push((b, vec![pre, post]));
        }
    }
    out
}

fn decoded(skip: Option<(usize, usize)>) -> Vec<AgentEvents> {
    let mut all = Vec::new();
    for rank in 0..R {
        let bs = blocks(rank, skip.filter(|s| s.0 == rank).map(|s| s.1));
        let bytes = encode_segments(rank, 2 * C, 64, &bs);
        let got = decode_clusters(rank, &bytes, 2).expect("decode");
        assert_eq!(got.len(), C, "one agent per cluster");
        for (c, a) in got.iter().enumerate() {
            assert_eq!((a.rank, a.agent), (rank, c));
            // Segment by segment: block 2c's first segment, block 2c + 1's, then the second ones.
            let want: Vec<DeviceEvent> = [0usize, 1]
                .iter()
                .flat_map(|&k| {
                    bs[2 * c].1[k]
                        .iter()
                        .chain(&bs[2 * c + 1].1[k])
                        .copied()
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(a.events, want);
        }
        all.extend(got);
    }
    all
}

fn arenas() -> Arenas {
    Arenas {
        signals_bytes: 16 * (R * C) as u64,
        data_bytes: row(R, 0, 0),
    }
}

#[test]
fn merged_clusters_pass_the_checker() {
    let r = check(R, arenas(), &decoded(None)).unwrap();
    assert_eq!(r.agents, R * C);
}

#[test]
fn a_second_cta_without_its_fence_is_caught() {
    // Rank 1, channel 1, CTA 1 (block 3) stores its rows and skips the fence before the barrier.
    let e = check(R, arenas(), &decoded(Some((1, 3)))).unwrap_err();
    let TraceError::Violation {
        violation,
        place: Some(place),
    } = &e
    else {
        panic!("expected a violation, got {e}");
    };
    // The stores after the agent's last fence: published by no release of the cluster.
    let Violation::StoreNotPublished { writer, .. } = violation.as_ref() else {
        panic!("expected an unpublished store, got {violation}");
    };
    assert!(writer.to_string().starts_with("rank1/agent1"), "{e}");
    assert_eq!(place.region, TraceRegion::Data);
    assert!(
        (ROWS / 2..ROWS).any(|i| place.offset == row(1, 1, i)),
        "{e}"
    );
}

#[test]
fn blocks_of_a_cluster_with_different_barrier_counts_are_refused() {
    let mut bs = blocks(0, None);
    bs[1].1.push(Vec::new()); // block 1 crosses one more barrier than block 0
    let bytes = encode_segments(0, 2 * C, 64, &bs);
    let e = decode_clusters(0, &bytes, 2).unwrap_err();
    assert!(
        matches!(&e, Error::TraceMalformed { detail, .. } if detail.contains("cluster 0")),
        "{e}"
    );
}

#[test]
fn plain_decode_keeps_each_block_and_drops_its_barriers() {
    let bs = blocks(1, None);
    let bytes = encode_segments(1, 2 * C, 64, &bs);
    let got = decode(1, &bytes).unwrap();
    assert_eq!(got.len(), 2 * C, "one agent per block");
    for (a, (b, segs)) in got.iter().zip(&bs) {
        assert_eq!((a.rank, a.agent), (1, *b));
        assert_eq!(a.events, segs.concat());
    }
}
