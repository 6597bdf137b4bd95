//! Shrink mode (spec §2.7, docs/protocol.md §3.8 and §7.3): the mask API, and how a peer that
//! failed during a low-latency phase gets masked so that the call still returns the plan's
//! result with that rank masked.

use super::{Buffer, LlMem};
use crate::error::{Error, Result};
use crate::executor::Executor;
use crate::protocol::low_latency::LlOp;
use crate::transport::{Team, is_fault};

impl<E: Executor> Buffer<E> {
    fn check_shrink(&self) -> Result<()> {
        if self.config.enable_shrink {
            Ok(())
        } else {
            Err(Error::ShrinkNotEnabled)
        }
    }

    /// `low_latency_update_mask_buffer(rank, mask)` (spec §2.7), on every rank's view.
    pub fn update_mask(&mut self, rank: usize, mask: bool) -> Result<()> {
        self.check_shrink()?;
        let r = self.num_ranks();
        let m = self
            .mask
            .get_mut(rank)
            .ok_or(Error::RankOutOfRange { rank, num_ranks: r })?;
        *m = mask;
        Ok(())
    }

    /// `low_latency_query_mask_buffer` (spec §2.7): `1` for masked ranks.
    pub fn query_mask(&self) -> Result<Vec<i32>> {
        self.check_shrink()?;
        Ok(self.mask.iter().map(|&m| i32::from(m)).collect())
    }

    /// `low_latency_clean_mask_buffer` (spec §2.7).
    pub fn clean_mask(&mut self) -> Result<()> {
        self.check_shrink()?;
        self.mask.iter_mut().for_each(|m| *m = false);
        Ok(())
    }

    /// The masked ranks (`true` = masked).
    #[must_use]
    pub fn masked_ranks(&self) -> &[bool] {
        &self.mask
    }

    /// Ranks masked since `op` was launched (by a fault, or the caller) are masked in `op` too.
    pub(super) fn apply_mask(&self, op: &mut LlOp) {
        for (m, &now) in op.masked.iter_mut().zip(&self.mask) {
            *m |= now;
        }
    }

    /// Masks rank `r` for `op` and every later call: a rank lost to a fault.
    fn mask_lost(&mut self, op: &mut LlOp, r: usize) {
        self.mask[r] = true;
        op.masked[r] = true;
        // Its signal words keep whatever the failure left (older epochs): never assumed zero.
        self.ll_mem[r] = LlMem::Used;
    }

    /// Settles one attempt of a low-latency phase of `op`; `Ok(true)`: run it again under
    /// `op`'s (grown) mask.
    ///
    /// - Success with no peer given up on: done.
    /// - Shrink mode, receive agents gave up on peers (`gave_up`): they are masked and the phase
    ///   runs again, so every rank computes its result under the same mask — the plan's result
    ///   with those ranks masked, exactly, whatever some receivers had already taken from them.
    /// - Shrink mode, the phase failed with a fault naming an unmasked rank ([`Buffer::suspect`]:
    ///   a `quiet` towards a dead peer, a QP error, a dead rank's agents): that rank is masked,
    ///   what is in flight is recovered over the survivors ([`Transport::recover`]), and the phase
    ///   runs again. Re-running is idempotent: the same call number, the same bytes, the same
    ///   signal values (`Set`), minus the masked rank.
    /// - An input the executor refused before any launch ([`Error::InputRefused`]) is
    ///   returned as is: nothing ran, the buffer stays usable.
    /// - Anything else poisons the buffer and returns the error.
    ///
    /// Bounded: every re-run masks at least one more rank.
    ///
    /// [`Transport::recover`]: crate::transport::Transport::recover
    pub(super) fn ll_settle(
        &mut self,
        op: &mut LlOp,
        res: Result<()>,
        gave_up: Vec<usize>,
    ) -> Result<bool> {
        let gave_up: Vec<usize> = gave_up.into_iter().filter(|&r| !op.masked[r]).collect();
        let e = match res {
            Err(e @ Error::InputRefused { .. }) => return Err(e),
            Ok(_) if gave_up.is_empty() => return Ok(false),
            Ok(_) => {
                for r in gave_up {
                    self.mask_lost(op, r);
                }
                return Ok(true);
            }
            Err(e) => e,
        };
        let lost = self
            .suspect(&e)
            .filter(|&x| op.shrink && is_fault(&e) && !op.masked[x]);
        let Some(x) = lost else {
            return Err(self.poison_with(op.call, e));
        };
        self.mask_lost(op, x);
        for r in gave_up {
            self.mask_lost(op, r);
        }
        self.recover_survivors(op)?;
        Ok(true)
    }

    /// [`Transport::recover`] over the unmasked ranks; a recovery that fails naming another
    /// unmasked rank masks it too and tries again (bounded by the rank count).
    ///
    /// [`Transport::recover`]: crate::transport::Transport::recover
    fn recover_survivors(&mut self, op: &mut LlOp) -> Result<()> {
        loop {
            let team = Team {
                ranks: (0..self.num_ranks()).filter(|&d| !op.masked[d]).collect(),
            };
            let Err(e) = self.transport.recover(&team) else {
                return Ok(());
            };
            match self.suspect(&e).filter(|&x| is_fault(&e) && !op.masked[x]) {
                Some(x) => self.mask_lost(op, x),
                None => return Err(self.poison_with(op.call, e)),
            }
        }
    }

    /// The rank a failure points at: the peer of a failed or silent QP, a rank that stopped, or,
    /// for a wait timeout, the writer of the awaited word (docs/protocol.md §7.1).
    #[must_use]
    pub(super) fn suspect(&self, e: &Error) -> Option<usize> {
        if let Some(r) = crate::transport::fault_rank(e) {
            return Some(r);
        }
        let Error::WaitTimeout {
            word_rank, word, ..
        } = e
        else {
            return None;
        };
        let inside = |region: crate::transport::Region| {
            (region.addr.0..region.end())
                .contains(word)
                .then(|| word - region.addr.0)
        };
        if let Some(n) = &self.normal
            && let Some(off) = inside(n.ctrl.region)
        {
            return n.ctrl_layout().writer(off, *word_rank);
        }
        if let Some(l) = &self.ll
            && let Some(off) = inside(l.signals.region)
        {
            return crate::protocol::layout::ll_signal_writer(self.num_ranks(), off);
        }
        None
    }
}
