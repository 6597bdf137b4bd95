//! Declared rings (`RingDecl`, docs/protocol.md): which slots an access touches, which of them
//! hold live entries, and the two ring violations (a write over a live entry, a read past the
//! acquired tail).

use std::ops::RangeInclusive;

use ep_core::transport::{Region, RingDecl};

use super::{SlotKey, World};
use crate::clock::KeyDesc;
use crate::memory::Stamp;
use crate::violation::Violation;

/// The slots of `ring` that `region` touches (`None` when it touches none): the one place that
/// turns heap offsets into slot indices.
fn touched_slots(ring: &RingDecl, region: Region) -> Option<RangeInclusive<u64>> {
    let slots = Region::new(ring.slots, ring.slot_bytes * ring.capacity);
    if !slots.overlaps(&region) {
        return None;
    }
    let first = (region.addr.0.max(slots.addr.0) - slots.addr.0) / ring.slot_bytes;
    let last = (region.end().min(slots.end()) - 1 - slots.addr.0) / ring.slot_bytes;
    Some(first..=last)
}

/// Whether ring slot `s` holds a live entry given `head` and `tail` (entry counts).
fn slot_live(ring: &RingDecl, head: u64, tail: u64, s: u64) -> bool {
    let live = tail.wrapping_sub(head);
    if live >= ring.capacity {
        return true;
    }
    let from_head = (s + ring.capacity - head % ring.capacity) % ring.capacity;
    from_head < live
}

impl World {
    /// The first live ring slot `region` on `rank` touches: (ring, slot, head, tail).
    pub(super) fn live_ring_slot(
        &mut self,
        rank: usize,
        region: Region,
    ) -> Option<(RingDecl, u64, u64, u64)> {
        for ring in self.rings.clone() {
            if ring.rank != rank {
                continue;
            }
            let Some(touched) = touched_slots(&ring, region) else {
                continue;
            };
            let head = self.heaps[ring.head_rank].read_u64(ring.head.0);
            let tail = self.heaps[ring.rank].read_u64(ring.tail.0);
            for s in touched {
                if slot_live(&ring, head, tail, s) {
                    return Some((ring, s, head, tail));
                }
            }
        }
        None
    }

    /// A write into a live ring slot is an overrun.
    ///
    /// A delivered data work request `data_wr` (id, sender slot, QP) that lands in a slot made
    /// live by a tail update its own sender posted **later** on another QP is not an overrun: the
    /// tail overtook its data, which the reader's check reports as `SignalBeforeData`.
    pub(super) fn check_ring_write(
        &mut self,
        rank: usize,
        region: Region,
        who: &str,
        data_wr: Option<(u64, SlotKey, u16)>,
    ) {
        if let Some((ring, slot, head, tail)) = self.live_ring_slot(rank, region) {
            if let Some((id, slot_key, qp)) = data_wr {
                let mut stamp = Stamp::default();
                self.heaps[ring.rank].granules(ring.tail.0, 8, |_, _, s| stamp = s);
                if let KeyDesc::Stream {
                    rank: sr,
                    index: si,
                    target,
                    qp: tq,
                } = self.keys.desc(stamp.key)
                    && (sr, si) == slot_key
                    && target == ring.rank
                    && tq != qp
                    && stamp.op > id
                {
                    return;
                }
            }
            self.flag(Violation::RingOverrun {
                ring: ring.name,
                rank,
                slot,
                head,
                tail,
                capacity: ring.capacity,
                writer: who.to_owned(),
            });
        }
    }

    /// An ordinary read by agent `i` of `region` on `rank` must see live ring entries only: the
    /// reader may use only the tail it acquired (none acquired: nothing is live). Flags
    /// `ReadPastTail` and returns `true` when it does not.
    pub(super) fn check_ring_read(&mut self, i: usize, rank: usize, region: Region) -> bool {
        for ring in self.rings.clone() {
            if ring.rank != rank {
                continue;
            }
            let Some(touched) = touched_slots(&ring, region) else {
                continue;
            };
            let head = self.heaps[ring.head_rank].read_u64(ring.head.0);
            let tail_mem = self.heaps[ring.rank].read_u64(ring.tail.0);
            let tail = self.agents[i]
                .acquired
                .get(&(ring.rank, ring.tail.0))
                .map_or(head, |&t| t.min(tail_mem));
            for s in touched {
                if !slot_live(&ring, head, tail, s) {
                    self.flag(Violation::ReadPastTail {
                        ring: ring.name.clone(),
                        rank,
                        reader: self.agents[i].r.clone(),
                        slot: s,
                        head,
                        tail,
                    });
                    return true;
                }
            }
        }
        false
    }
}
