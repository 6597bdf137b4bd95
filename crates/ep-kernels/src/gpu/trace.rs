//! The device trace of debug builds: each block of a traced kernel records its protocol events
//! (ep-core's [`DeviceEvent`]) into a bounded per-block log in device memory; [`decode`] turns a
//! rank's log into [`AgentEvents`] for `ep_sim::device_trace::check`, which judges them under the
//! simulator's memory model (DESIGN.md, "The GPU backend").
//!
//! # Format (`gpu_abi.rs`, `TRACE_*`; the kernels include the same `ep_gpu_abi.h`)
//! Per rank: an [`abi::TraceHeader`](super::abi::TraceHeader) (`magic`, `rank`, `capacity`
//! records per block, `num_blocks`, `overflow`, per-block write indices
//! `next[EP_TRACE_MAX_BLOCKS]`), then `num_blocks x capacity`
//! [`abi::TraceRecord`](super::abi::TraceRecord)s of 4 u64 words; block `b` owns records
//! `[b * capacity, (b + 1) * capacity)`. Words: `word0 = kind | aux << 8 | region << 16 |
//! block << 32`, `word1 = rank | len << 32`, `word2` = offset (a counter arrival: its ticket),
//! `word3` = value or a put's source offset. A put with signal is an `EP_TRACE_PUT_SIGNAL`
//! record followed by its `EP_TRACE_SIGNAL` record, reserved together.
//!
//! # Recording (what a kernel does)
//! - The host writes the header before the launch (magic, rank, capacity, num_blocks; `next` and
//!   `overflow` zero) and reads header and records back after it completes.
//! - To record, a thread reserves `n` records (1, or 2 for a put with signal) with a relaxed
//!   `atomicAdd(&next[blockIdx.x], n)` returning `i`; if `i + n > capacity` it sets `overflow`
//!   and drops the record (decode reports how many were lost), else writes the words to records
//!   `i..i + n` of its block with ordinary stores. No fence: the host reads after the kernel.
//! - The records of a block are its program order: record an event **after** performing it, and
//!   rely on `__syncthreads` to order records of different threads (a reservation before a
//!   barrier precedes one after it). Events of different warps between two barriers are
//!   unordered on the GPU and may appear in any order; that is only right for stores and loads.
//! - Offsets are relative to the rank's `ll.signals` / `ll.data` base (`peer_signals[r]`,
//!   `peer_data[r]`), so half bases are included.
//! - What to record: each warp's stores of a row unit or meta record to a destination (lane 0,
//!   after `__syncwarp`, one `STORE` per contiguous range); each block's header-copy stores
//!   (thread 0 after the `__syncthreads` that follows them, one `STORE` per destination); every
//!   fence with its scope (each send block's `fence_for_peers` before its signals,
//!   `nvshmem_fence` as system scope); a completion counter's `atom.acq_rel` (`COUNTER`, ticket
//!   = the old value, `EP_TRACE_FLAG_LAST` when last; no kernel uses one since the send groups
//!   of docs/protocol.md §3.3); each `st.release` / `signal_op` SET (`RELEASE`);
//!   each successful wait (`ACQUIRE` with the value seen, after `signal_seen`'s fence in variant
//!   (b)); each unit, header and meta load of the receive part (`LOAD`, lane 0 after the loads);
//!   each `putmem_nbi_warp` (`PUT`) and `putmem_signal_nbi_warp` (`PUT_SIGNAL` + `SIGNAL`).
//!   A block's fence record must follow (through a barrier) the store records it orders, and
//!   the publishing record must follow the fence: the checker takes stores recorded after a
//!   block's last fence as unpublished by its releases.

use ep_core::transport::{AgentEvents, DeviceEvent, FenceScope, TraceRegion};

use super::abi::{
    EP_TRACE_ACQUIRE, EP_TRACE_CLUSTER_BARRIER, EP_TRACE_COUNTER, EP_TRACE_FENCE,
    EP_TRACE_FLAG_LAST, EP_TRACE_LOAD, EP_TRACE_MAGIC, EP_TRACE_MAX_BLOCKS, EP_TRACE_PUT,
    EP_TRACE_PUT_SIGNAL, EP_TRACE_RECORD_BYTES, EP_TRACE_REGION_DATA, EP_TRACE_REGION_SIGNALS,
    EP_TRACE_RELEASE, EP_TRACE_SCOPE_GPU, EP_TRACE_SCOPE_SYSTEM, EP_TRACE_SIGNAL, EP_TRACE_STORE,
    TraceHeader, TraceRecord,
};
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::abi::EP_FLAG_TEST_SKIP_FENCE;
use super::mem::DevBuf;
use crate::{Error, Result};

/// Bytes of the header; records start here.
pub const HEADER_BYTES: usize = std::mem::size_of::<TraceHeader>();
const RECORD_BYTES: usize = std::mem::size_of::<TraceRecord>();
const _: () = assert!(RECORD_BYTES as u64 == EP_TRACE_RECORD_BYTES);
const _: () = assert!(HEADER_BYTES.is_multiple_of(RECORD_BYTES));
const _: () = assert!(std::mem::size_of::<[u64; EP_TRACE_MAX_BLOCKS as usize]>() == 8 * 256);
/// Word index of `next[0]` in the header (after magic, rank, capacity, num_blocks, overflow,
/// reserved[3]).
const NEXT_WORD: usize = 8;
const _: () = assert!(HEADER_BYTES == 8 * (NEXT_WORD + EP_TRACE_MAX_BLOCKS as usize));

/// Bytes of a trace of `num_blocks` blocks with `capacity` records each (what to allocate).
#[must_use]
pub fn trace_bytes(num_blocks: usize, capacity: u64) -> usize {
    HEADER_BYTES + num_blocks * capacity as usize * RECORD_BYTES
}

/// The trace buffers of a group's local ranks (both modes' `set_trace`): one per local rank,
/// its header and `blocks x capacity` records, and the planted-fence test switch.
#[derive(Debug)]
pub(crate) struct TraceBufs {
    capacity: u64,
    blocks: usize,
    bufs: Vec<DevBuf>,
    plant_missing_fence: bool,
}

impl TraceBufs {
    /// Zeroed buffers for `local_ranks` ranks whose kernels have `blocks` blocks.
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        local_ranks: usize,
        blocks: usize,
        capacity: u64,
    ) -> Result<Self> {
        let capacity = capacity.max(1);
        let bytes = trace_bytes(blocks, capacity);
        let bufs = (0..local_ranks)
            .map(|_| DevBuf::zeroed(ctx, bytes))
            .collect::<Result<_>>()?;
        Ok(Self {
            capacity,
            blocks,
            bufs,
            plant_missing_fence: false,
        })
    }

    /// Local rank `i`'s kernel-argument words: its header's address, and the flags to add.
    pub(crate) fn args(&self, i: usize) -> (u64, u64) {
        let flags = if self.plant_missing_fence {
            EP_FLAG_TEST_SKIP_FENCE
        } else {
            0
        };
        (self.bufs[i].ptr(), flags)
    }

    /// Turns the planted missing fence on or off.
    pub(crate) fn plant(&mut self, on: bool) {
        self.plant_missing_fence = on;
    }

    /// Empty headers before an operation (local rank `i` is world rank `world[i]`); the streams
    /// must be idle.
    pub(crate) fn reset(&self, world: impl IntoIterator<Item = usize>) -> Result<()> {
        for (rank, b) in world.into_iter().zip(&self.bufs) {
            let empty = encode(rank, self.blocks, self.capacity, &[]);
            b.write(0, &empty[..trace_bytes(0, 0)])?;
        }
        Ok(())
    }

    /// Local rank `i`'s trace as the kernels left it (the streams must be idle).
    pub(crate) fn read(&self, i: usize) -> Result<Vec<u8>> {
        let b = &self.bufs[i];
        let mut bytes = vec![0u8; b.len()];
        b.read(0, &mut bytes)?;
        Ok(bytes)
    }
}

/// What the trace calls of a group say when tracing is off.
pub(crate) fn not_tracing(what: &str) -> Error {
    Error::Unsupported(format!("{what}: set_trace first"))
}

fn word(bytes: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&bytes[8 * i..8 * i + 8]);
    u64::from_le_bytes(w)
}

/// Decodes `rank`'s trace (its header followed by its records, as the kernel left them) into the
/// events of each block that recorded any, in program order.
///
/// Fails with [`Error::TraceOverflow`] when a block had more events than its capacity (naming
/// how many were lost and the capacity needed), and [`Error::TraceMalformed`] when the bytes are
/// not such a trace (magic, rank, sizes, a record of another block or of an unknown kind).
pub fn decode(rank: usize, bytes: &[u8]) -> Result<Vec<AgentEvents>> {
    decode_clusters(rank, bytes, 1)
}

/// [`decode`] for kernels whose agent is a cluster of `cluster` consecutive blocks (normal
/// mode: 2 CTAs, docs/protocol.md §1.3): each cluster becomes one agent (`agent` = the cluster
/// index) whose events are its blocks' events segment by segment — every block's events up to
/// its first `EP_TRACE_CLUSTER_BARRIER` record in block order, then every block's next segment,
/// and so on. The barrier orders each segment after all of the previous ones; within a segment
/// the blocks' events are unordered on the GPU, and the merge's order between them is only right
/// for stores and loads to distinct bytes (the same caveat as warps between block barriers), so
/// a block must not wait in a segment for a later block of its cluster. Fails with
/// [`Error::TraceMalformed`] when the blocks of a cluster crossed different numbers of barriers.
pub fn decode_clusters(rank: usize, bytes: &[u8], cluster: usize) -> Result<Vec<AgentEvents>> {
    let cluster = cluster.max(1);
    let blocks = decode_blocks(rank, bytes)?;
    let mut out: Vec<AgentEvents> = Vec::new();
    let mut i = 0usize;
    while i < blocks.len() {
        let c = blocks[i].0 / cluster;
        let mut members = Vec::new();
        while i < blocks.len() && blocks[i].0 / cluster == c {
            members.push(&blocks[i]);
            i += 1;
        }
        // Segments of each member, split at its barriers.
        let segs: Vec<Vec<&[Item]>> = members
            .iter()
            .map(|(_, items)| items.split(|it| matches!(it, Item::Barrier)).collect())
            .collect();
        let n = segs[0].len();
        if cluster > 1 && segs.iter().any(|s| s.len() != n) {
            let counts: Vec<String> = members
                .iter()
                .zip(&segs)
                .map(|((b, _), s)| format!("block {b}: {}", s.len() - 1))
                .collect();
            return Err(Error::TraceMalformed {
                rank,
                detail: format!(
                    "the blocks of cluster {c} crossed different numbers of cluster barriers ({})",
                    counts.join(", ")
                ),
            });
        }
        let mut events = Vec::new();
        for k in 0..segs.iter().map(Vec::len).max().unwrap_or(0) {
            for s in &segs {
                for it in s.get(k).copied().unwrap_or(&[]) {
                    if let Item::Event(e) = it {
                        events.push(*e);
                    }
                }
            }
        }
        if !events.is_empty() {
            out.push(AgentEvents {
                rank,
                agent: c,
                events,
            });
        }
    }
    Ok(out)
}

/// A decoded record: an event, or a block's arrival at its cluster's barrier.
enum Item {
    Event(DeviceEvent),
    Barrier,
}

/// Every recording block's items, in block order.
fn decode_blocks(rank: usize, bytes: &[u8]) -> Result<Vec<(usize, Vec<Item>)>> {
    let bad = |detail: String| Error::TraceMalformed { rank, detail };
    if bytes.len() < HEADER_BYTES {
        return Err(bad(format!(
            "{} bytes, shorter than the {HEADER_BYTES}-byte header",
            bytes.len()
        )));
    }
    let (magic, hrank, capacity, num_blocks, overflow) = (
        word(bytes, 0),
        word(bytes, 1),
        word(bytes, 2),
        word(bytes, 3),
        word(bytes, 4),
    );
    if magic != EP_TRACE_MAGIC {
        return Err(bad(format!(
            "magic {magic:#x}, not EP_TRACE_MAGIC {EP_TRACE_MAGIC:#x}"
        )));
    }
    if hrank != rank as u64 {
        return Err(bad(format!("the header names rank {hrank}")));
    }
    if num_blocks > EP_TRACE_MAX_BLOCKS {
        return Err(bad(format!(
            "{num_blocks} blocks, more than EP_TRACE_MAX_BLOCKS ({EP_TRACE_MAX_BLOCKS})"
        )));
    }
    let need = (num_blocks as u128 * capacity as u128 * RECORD_BYTES as u128)
        .saturating_add(HEADER_BYTES as u128);
    if (bytes.len() as u128) < need {
        return Err(bad(format!(
            "{} bytes for {num_blocks} blocks of {capacity} records ({need} bytes needed)",
            bytes.len()
        )));
    }
    let next: Vec<u64> = (0..num_blocks as usize)
        .map(|b| word(bytes, NEXT_WORD + b))
        .collect();
    if let Some(b) = (num_blocks as usize..EP_TRACE_MAX_BLOCKS as usize)
        .find(|&b| word(bytes, NEXT_WORD + b) != 0)
    {
        return Err(bad(format!(
            "block {b} recorded but the launch has {num_blocks} blocks"
        )));
    }
    let lost: u64 = next.iter().map(|&n| n.saturating_sub(capacity)).sum();
    if lost > 0 || overflow != 0 {
        let (block, needed) = next
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|&(b, n)| (n, std::cmp::Reverse(b)))
            .unwrap_or((0, 0));
        if lost == 0 {
            return Err(bad(
                "the overflow flag is set but no block exceeded its capacity".into(),
            ));
        }
        return Err(Error::TraceOverflow {
            rank,
            lost,
            block,
            needed,
            capacity,
        });
    }
    let mut out = Vec::new();
    for (b, &n) in next.iter().enumerate() {
        let base = HEADER_BYTES / 8 + 4 * b * capacity as usize;
        let rec = |i: usize| -> [u64; 4] {
            let w = base + 4 * i;
            [
                word(bytes, w),
                word(bytes, w + 1),
                word(bytes, w + 2),
                word(bytes, w + 3),
            ]
        };
        let mut events = Vec::with_capacity(n as usize);
        let mut i = 0usize;
        while i < n as usize {
            let r = rec(i);
            let at = |detail: &str| bad(format!("block {b} record {i}: {detail}"));
            if r[0] >> 32 != b as u64 {
                return Err(at(&format!("written by block {}", r[0] >> 32)));
            }
            let (kind, aux, region) = (r[0] & 0xff, (r[0] >> 8) & 0xff, (r[0] >> 16) & 0xff);
            let (target, len) = ((r[1] & 0xffff_ffff) as usize, r[1] >> 32);
            let region = || match region {
                EP_TRACE_REGION_SIGNALS => Ok(TraceRegion::Signals),
                EP_TRACE_REGION_DATA => Ok(TraceRegion::Data),
                x => Err(at(&format!("unknown region {x}"))),
            };
            if kind == EP_TRACE_CLUSTER_BARRIER {
                events.push(Item::Barrier);
                i += 1;
                continue;
            }
            let e = match kind {
                EP_TRACE_STORE => DeviceEvent::Store {
                    rank: target,
                    region: region()?,
                    offset: r[2],
                    len,
                },
                EP_TRACE_LOAD => DeviceEvent::Load {
                    rank: target,
                    region: region()?,
                    offset: r[2],
                    len,
                },
                EP_TRACE_FENCE => DeviceEvent::Fence {
                    scope: match aux {
                        EP_TRACE_SCOPE_GPU => FenceScope::Gpu,
                        EP_TRACE_SCOPE_SYSTEM => FenceScope::System,
                        x => return Err(at(&format!("unknown fence scope {x}"))),
                    },
                },
                EP_TRACE_RELEASE => DeviceEvent::Release {
                    rank: target,
                    offset: r[2],
                    value: r[3],
                },
                EP_TRACE_ACQUIRE => DeviceEvent::Acquire {
                    rank: target,
                    offset: r[2],
                    value: r[3],
                },
                EP_TRACE_COUNTER => DeviceEvent::CounterArrive {
                    counter: target as u32,
                    ticket: r[2],
                    last: aux & EP_TRACE_FLAG_LAST != 0,
                },
                EP_TRACE_PUT => DeviceEvent::Put {
                    dst_rank: target,
                    dst_offset: r[2],
                    src_offset: r[3],
                    len,
                },
                EP_TRACE_PUT_SIGNAL => {
                    if i + 1 >= n as usize {
                        return Err(at("a put with signal without its signal record"));
                    }
                    let s = rec(i + 1);
                    if s[0] & 0xff != EP_TRACE_SIGNAL
                        || s[0] >> 32 != b as u64
                        || s[1] & 0xffff_ffff != target as u64
                    {
                        return Err(at(
                            "a put with signal not followed by its signal record (same block, same destination)",
                        ));
                    }
                    i += 1;
                    DeviceEvent::PutSignal {
                        dst_rank: target,
                        dst_offset: r[2],
                        src_offset: r[3],
                        len,
                        signal_offset: s[2],
                        value: s[3],
                    }
                }
                EP_TRACE_SIGNAL => return Err(at("a signal record without its put")),
                x => return Err(at(&format!("unknown record kind {x}"))),
            };
            events.push(Item::Event(e));
            i += 1;
        }
        if !events.is_empty() {
            out.push((b, events));
        }
    }
    Ok(out)
}

/// The records of `e` as block `block` writes them (one, or two for a put with signal).
#[must_use]
pub fn records(block: usize, e: &DeviceEvent) -> Vec<[u64; 4]> {
    let w0 =
        |kind: u64, aux: u64, region: u64| kind | aux << 8 | region << 16 | (block as u64) << 32;
    let w1 = |rank: usize, len: u64| rank as u64 | len << 32;
    let reg = |r: TraceRegion| match r {
        TraceRegion::Signals => EP_TRACE_REGION_SIGNALS,
        TraceRegion::Data => EP_TRACE_REGION_DATA,
    };
    match *e {
        DeviceEvent::Store {
            rank,
            region,
            offset,
            len,
        } => vec![[w0(EP_TRACE_STORE, 0, reg(region)), w1(rank, len), offset, 0]],
        DeviceEvent::Load {
            rank,
            region,
            offset,
            len,
        } => vec![[w0(EP_TRACE_LOAD, 0, reg(region)), w1(rank, len), offset, 0]],
        DeviceEvent::Fence { scope } => {
            let s = match scope {
                FenceScope::Gpu => EP_TRACE_SCOPE_GPU,
                FenceScope::System => EP_TRACE_SCOPE_SYSTEM,
            };
            vec![[w0(EP_TRACE_FENCE, s, 0), 0, 0, 0]]
        }
        DeviceEvent::Release {
            rank,
            offset,
            value,
        } => vec![[
            w0(EP_TRACE_RELEASE, 0, EP_TRACE_REGION_SIGNALS),
            w1(rank, 8),
            offset,
            value,
        ]],
        DeviceEvent::Acquire {
            rank,
            offset,
            value,
        } => vec![[
            w0(EP_TRACE_ACQUIRE, 0, EP_TRACE_REGION_SIGNALS),
            w1(rank, 8),
            offset,
            value,
        ]],
        DeviceEvent::CounterArrive {
            counter,
            ticket,
            last,
        } => vec![[
            w0(
                EP_TRACE_COUNTER,
                if last { EP_TRACE_FLAG_LAST } else { 0 },
                0,
            ),
            u64::from(counter),
            ticket,
            0,
        ]],
        DeviceEvent::Put {
            dst_rank,
            dst_offset,
            src_offset,
            len,
        } => vec![[
            w0(EP_TRACE_PUT, 0, EP_TRACE_REGION_DATA),
            w1(dst_rank, len),
            dst_offset,
            src_offset,
        ]],
        DeviceEvent::PutSignal {
            dst_rank,
            dst_offset,
            src_offset,
            len,
            signal_offset,
            value,
        } => vec![
            [
                w0(EP_TRACE_PUT_SIGNAL, 0, EP_TRACE_REGION_DATA),
                w1(dst_rank, len),
                dst_offset,
                src_offset,
            ],
            [
                w0(EP_TRACE_SIGNAL, 0, EP_TRACE_REGION_SIGNALS),
                w1(dst_rank, 8),
                signal_offset,
                value,
            ],
        ],
    }
}

/// `rank`'s trace bytes for `agents` (its blocks) with `capacity` records per block over
/// `num_blocks` blocks, as the device would leave them: the host-side writer of the format (tests,
/// and the reference the kernels' recording follows). A block with more records than `capacity`
/// keeps the first `capacity` and counts the rest in `next`, with `overflow` set, as on the GPU.
///
/// # Panics
/// If an agent's block is not below `num_blocks` or `num_blocks > EP_TRACE_MAX_BLOCKS`.
#[must_use]
pub fn encode(rank: usize, num_blocks: usize, capacity: u64, agents: &[AgentEvents]) -> Vec<u8> {
    let blocks: Vec<(usize, Vec<Vec<DeviceEvent>>)> = agents
        .iter()
        .map(|a| (a.agent, vec![a.events.clone()]))
        .collect();
    encode_segments(rank, num_blocks, capacity, &blocks)
}

/// [`encode`] with cluster barriers: block `b`'s events as segments, an
/// `EP_TRACE_CLUSTER_BARRIER` record between consecutive ones (what [`decode_clusters`] reads).
#[must_use]
pub fn encode_segments(
    rank: usize,
    num_blocks: usize,
    capacity: u64,
    blocks: &[(usize, Vec<Vec<DeviceEvent>>)],
) -> Vec<u8> {
    assert!(num_blocks as u64 <= EP_TRACE_MAX_BLOCKS, "too many blocks");
    let mut w = vec![0u64; trace_bytes(num_blocks, capacity) / 8];
    w[0] = EP_TRACE_MAGIC;
    w[1] = rank as u64;
    w[2] = capacity;
    w[3] = num_blocks as u64;
    for (b, segs) in blocks {
        let b = *b;
        assert!(b < num_blocks, "block {b} of {num_blocks}");
        let barrier = [EP_TRACE_CLUSTER_BARRIER | (b as u64) << 32, 0, 0, 0];
        // One reservation per event (a put with signal: its two records together).
        let groups = segs.iter().enumerate().flat_map(|(k, seg)| {
            let lead = (k > 0).then(|| vec![barrier]);
            lead.into_iter().chain(seg.iter().map(|e| records(b, e)))
        });
        for recs in groups {
            let i = w[NEXT_WORD + b];
            w[NEXT_WORD + b] += recs.len() as u64;
            if i + recs.len() as u64 > capacity {
                w[4] = 1;
                continue;
            }
            for (k, r) in recs.iter().enumerate() {
                let at = HEADER_BYTES / 8 + 4 * (b * capacity as usize + i as usize + k);
                w[at..at + 4].copy_from_slice(r);
            }
        }
    }
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<AgentEvents> {
        let ev = vec![
            DeviceEvent::Store {
                rank: 1,
                region: TraceRegion::Data,
                offset: 0x1230,
                len: 512,
            },
            DeviceEvent::Fence {
                scope: FenceScope::Gpu,
            },
            DeviceEvent::CounterArrive {
                counter: 0,
                ticket: 3,
                last: true,
            },
            DeviceEvent::Release {
                rank: 1,
                offset: 0x50,
                value: (7 << 32) | 12,
            },
            DeviceEvent::Acquire {
                rank: 0,
                offset: 0x40,
                value: (7 << 32) | 9,
            },
            DeviceEvent::Load {
                rank: 0,
                region: TraceRegion::Signals,
                offset: 0x40,
                len: 8,
            },
            DeviceEvent::Put {
                dst_rank: 1,
                dst_offset: 0x9000,
                src_offset: 0x100,
                len: 2048,
            },
            DeviceEvent::Fence {
                scope: FenceScope::System,
            },
            DeviceEvent::PutSignal {
                dst_rank: 1,
                dst_offset: 0x800,
                src_offset: 0x200,
                len: 64,
                signal_offset: 0x50,
                value: 5,
            },
        ];
        vec![
            AgentEvents {
                rank: 0,
                agent: 0,
                events: ev[..3].to_vec(),
            },
            AgentEvents {
                rank: 0,
                agent: 2,
                events: ev.clone(),
            },
        ]
    }

    #[test]
    fn hand_made_bytes_decode() {
        // Block 0, record 0: a store of 64 bytes at ll.data+0x40 of rank 3; record 1: a system
        // fence; record 2: the last arrival, ticket 5, at counter 1.
        let mut w = vec![0u64; (HEADER_BYTES + 2 * 4 * RECORD_BYTES) / 8];
        w[0] = EP_TRACE_MAGIC;
        w[1] = 2;
        w[2] = 4;
        w[3] = 2;
        w[NEXT_WORD] = 3;
        let r = HEADER_BYTES / 8;
        w[r..r + 4].copy_from_slice(&[1 | 1 << 16, 3 | 64 << 32, 0x40, 0]);
        w[r + 4..r + 8].copy_from_slice(&[3 | 1 << 8, 0, 0, 0]);
        w[r + 8..r + 12].copy_from_slice(&[6 | 1 << 8, 1, 5, 0]);
        let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
        let got = decode(2, &bytes).unwrap();
        assert_eq!(
            got,
            vec![AgentEvents {
                rank: 2,
                agent: 0,
                events: vec![
                    DeviceEvent::Store {
                        rank: 3,
                        region: TraceRegion::Data,
                        offset: 0x40,
                        len: 64
                    },
                    DeviceEvent::Fence {
                        scope: FenceScope::System
                    },
                    DeviceEvent::CounterArrive {
                        counter: 1,
                        ticket: 5,
                        last: true
                    },
                ],
            }]
        );
        assert_eq!(encode(2, 2, 4, &got), bytes);
        // Wrong rank, wrong magic, a record of another block, truncated bytes.
        assert!(matches!(
            decode(1, &bytes),
            Err(Error::TraceMalformed { rank: 1, .. })
        ));
        let mut b = bytes.clone();
        b[0] ^= 1;
        assert!(matches!(decode(2, &b), Err(Error::TraceMalformed { .. })));
        let mut b = bytes.clone();
        b[HEADER_BYTES + 4] = 1; // word0's block field = 1
        let e = decode(2, &b).unwrap_err();
        assert!(e.to_string().contains("written by block 1"), "{e}");
        assert!(matches!(
            decode(2, &bytes[..bytes.len() - 8]),
            Err(Error::TraceMalformed { .. })
        ));
    }

    #[test]
    fn encode_decode_round_trip() {
        let t = sample();
        let bytes = encode(0, 3, 16, &t);
        assert_eq!(bytes.len(), trace_bytes(3, 16));
        assert_eq!(decode(0, &bytes).unwrap(), t);
    }

    #[test]
    fn overflow_names_what_was_lost_and_the_capacity_needed() {
        let t = sample();
        // Block 2 needs 10 records (the put with signal takes two); capacity 6 loses 4.
        let e = decode(0, &encode(0, 3, 6, &t)).unwrap_err();
        match e {
            Error::TraceOverflow {
                rank: 0,
                lost: 4,
                block: 2,
                needed: 10,
                capacity: 6,
            } => {}
            other => panic!("{other}"),
        }
        assert!(e_string(&decode(0, &encode(0, 3, 6, &t))).contains("at least 10"));
        // Exactly enough room.
        assert_eq!(decode(0, &encode(0, 3, 10, &t)).unwrap(), t);
    }

    fn e_string(r: &Result<Vec<AgentEvents>>) -> String {
        r.as_ref()
            .map_or_else(ToString::to_string, |_| String::new())
    }

    #[test]
    fn a_put_signal_needs_its_signal_record() {
        let t = vec![AgentEvents {
            rank: 0,
            agent: 0,
            events: vec![sample()[1].events[8]],
        }];
        let mut bytes = encode(0, 1, 2, &t);
        // Turn the signal record into a fence.
        let at = HEADER_BYTES + RECORD_BYTES;
        bytes[at] = EP_TRACE_FENCE as u8;
        assert!(matches!(
            decode(0, &bytes),
            Err(Error::TraceMalformed { .. })
        ));
    }
}
