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

/// A live entry's slot that an access touches.
pub(super) struct LiveSlot {
    ring: RingDecl,
    slot: u64,
    head: u64,
    tail: u64,
}

impl LiveSlot {
    /// The overrun of this slot on `rank` by `writer`.
    pub(super) fn overrun(self, rank: usize, writer: String) -> Violation {
        Violation::RingOverrun {
            ring: self.ring.name,
            rank,
            slot: self.slot,
            head: self.head,
            tail: self.tail,
            capacity: self.ring.capacity,
            writer,
        }
    }
}

impl World {
    /// The rings on `rank` that `region` touches: each with the slots touched and its head.
    fn rings_touched(
        &mut self,
        rank: usize,
        region: Region,
    ) -> Vec<(RingDecl, RangeInclusive<u64>, u64)> {
        let mut out = Vec::new();
        for ring in self.rings.clone() {
            if ring.rank != rank {
                continue;
            }
            if let Some(touched) = touched_slots(&ring, region) {
                let head = self.heaps[ring.head_rank].read_u64(ring.head.0);
                out.push((ring, touched, head));
            }
        }
        out
    }

    /// The first live ring slot `region` on `rank` touches.
    pub(super) fn live_ring_slot(&mut self, rank: usize, region: Region) -> Option<LiveSlot> {
        for (ring, touched, head) in self.rings_touched(rank, region) {
            let tail = self.heaps[ring.rank].read_u64(ring.tail.0);
            for slot in touched {
                if slot_live(&ring, head, tail, slot) {
                    return Some(LiveSlot {
                        ring,
                        slot,
                        head,
                        tail,
                    });
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
        if let Some(live) = self.live_ring_slot(rank, region) {
            let ring = &live.ring;
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
            self.flag(live.overrun(rank, who.to_owned()));
        }
    }

    /// An ordinary read by agent `i` of `region` on `rank` must see live ring entries only: the
    /// reader may use only the tail it acquired (none acquired: nothing is live). Flags
    /// `ReadPastTail` and returns `true` when it does not.
    pub(super) fn check_ring_read(&mut self, i: usize, rank: usize, region: Region) -> bool {
        for (ring, touched, head) in self.rings_touched(rank, region) {
            let tail_mem = self.heaps[ring.rank].read_u64(ring.tail.0);
            let tail = self.agents[i]
                .acquired
                .get(&(ring.rank, ring.tail.0))
                .map_or(head, |&t| t.min(tail_mem));
            for s in touched {
                if !slot_live(&ring, head, tail, s) {
                    self.flag(Violation::ReadPastTail {
                        ring: ring.name,
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
