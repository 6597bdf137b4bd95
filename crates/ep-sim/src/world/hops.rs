//! Cost hops (the cost model's wait chains): which link hops the last write to each word
//! carried, so an agent that waits on the word inherits them, and the per-phase records.

use super::{World, Wr, WrKind};
use crate::cost::{Hops, PhaseRecord};

impl World {
    /// The words a delivered work request writes carry its hops (signals, atomics, and small
    /// word-aligned puts, the ones a reader may wait on).
    pub(super) fn delivery_hops(&mut self, dst_rank: usize, wr: &Wr) {
        match wr.kind {
            WrKind::Signal { word, .. } | WrKind::Amo { word, .. } => {
                self.set_word_hops(dst_rank, word, wr.hops);
            }
            WrKind::Data { dst, len, .. } if len <= 64 && dst % 8 == 0 && len % 8 == 0 => {
                for w in (dst..dst + len).step_by(8) {
                    self.set_word_hops(dst_rank, w, wr.hops);
                }
            }
            WrKind::Data { .. } => {}
        }
    }

    pub(super) fn set_word_hops(&mut self, rank: usize, addr: u64, h: Hops) {
        let e = self.word_hops.entry((rank, addr)).or_default();
        *e = e.join(h);
    }

    /// What each finished phase moved (cost model).
    pub(crate) fn records(&self) -> &[PhaseRecord] {
        &self.records
    }
}
