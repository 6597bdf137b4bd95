//! Poisoning and the collective reset (docs/protocol.md §7).
//!
//! A phase that fails may leave ranks at different points of the call (some finished, some
//! stopped mid-way), operations in flight, and signal words holding values of the failed call.
//! The `Buffer` therefore refuses every later call with [`Error::BufferPoisoned`] until
//! [`Buffer::reset`], which re-establishes a clean state on every rank.

use super::{Buffer, LlMem};
use crate::error::{Error, Result};
use crate::executor::{Executor, ResetJob};
use crate::transport::{Team, is_fault};

/// Why a `Buffer` is poisoned.
#[derive(Clone, Debug)]
pub(super) struct Poison {
    call: u64,
    failed_rank: Option<usize>,
    cause: Error,
}

impl<E: Executor> Buffer<E> {
    /// The error every call returns while the buffer is poisoned; `None` when it is usable.
    #[must_use]
    pub fn poisoned(&self) -> Option<Error> {
        self.poison.as_ref().map(|p| Error::BufferPoisoned {
            call: p.call,
            failed_rank: p.failed_rank,
            cause: Box::new(p.cause.clone()),
        })
    }

    /// `Err(BufferPoisoned)` while poisoned.
    pub(super) fn check_poison(&self) -> Result<()> {
        self.poisoned().map_or(Ok(()), Err)
    }

    /// Poisons the buffer with `e`, the failure of call `call`, and returns `e`.
    pub(super) fn poison_with(&mut self, call: u64, e: Error) -> Error {
        if self.poison.is_none() {
            self.poison = Some(Poison {
                call,
                failed_rank: self.suspect(&e),
                cause: e.clone(),
            });
        }
        e
    }

    /// `res`, what the executor's phase of call `call` gave; a failure poisons the buffer.
    /// An input the device refused ([`Error::InputRefused`]) does not poison.
    pub(super) fn ran<R>(&mut self, call: u64, res: Result<R>) -> Result<R> {
        res.map_err(|e| match e {
            Error::InputRefused { .. } => e,
            e => self.poison_with(call, e),
        })
    }

    /// Before a call: `Err(BufferPoisoned)` while poisoned, then what the executor found since
    /// the last call ([`Executor::poll`](crate::Executor::poll): a device error record), which
    /// poisons unless it is a refused input.
    pub(super) fn ready(&mut self) -> Result<()> {
        self.check_poison()?;
        let res = self.transport.poll();
        self.ran(self.last_call, res)
    }

    /// Waits for the local ranks' outstanding work and reports what it found, as a call would
    /// ([`Executor::sync`]; a no-op on the simulator, whose calls
    /// return finished). In shrink mode, ranks the device kernels masked on their own (a
    /// source that never arrived) join the mask here ([`Buffer::query_mask`]).
    pub fn sync(&mut self) -> Result<()> {
        self.check_poison()?;
        let res = self.transport.sync();
        self.ran(self.last_call, res)?;
        for r in self.transport.take_masked_by_device() {
            if let Some(m) = self.mask.get_mut(r) {
                *m = true;
                self.ll_mem[r] = super::LlMem::Used;
            }
        }
        Ok(())
    }

    /// A host barrier of call `call`; a failure poisons the buffer.
    pub(super) fn barrier(&mut self, call: u64, team: &Team) -> Result<()> {
        self.transport
            .barrier(team)
            .map_err(|e| self.poison_with(call, e))
    }

    /// Collective reset (docs/protocol.md §7.2): makes a poisoned buffer usable again once the
    /// fault is repaired (on the simulator: `Sim::clear_faults`). On every rank of the team —
    /// every rank, or in low-latency shrink mode the unmasked ones:
    ///
    /// 1. [`Transport::recover`]: operations still in flight among the team complete, those
    ///    towards or from ranks outside it are flushed, what torn-down agents left is forgotten;
    /// 2. one phase zeroes every signal word of both modes (normal control words, low-latency
    ///    signals of both halves), then a barrier;
    /// 3. pending hooks are forgotten (a hook taken before the reset is refused with
    ///    [`Error::LowLatencyHookNotPending`]); the call counter continues upward.
    ///
    /// A rank that cannot take part (dead, or an operation towards it that can never complete)
    /// makes the reset fail with [`Error::ResetNeedsRank`] naming it, and the buffer stays
    /// poisoned; in shrink mode such a rank is masked instead and the reset covers the others.
    /// Harmless on a buffer that is not poisoned.
    ///
    /// [`Transport::recover`]: crate::transport::Transport::recover
    pub fn reset(&mut self) -> Result<()> {
        let r = self.num_ranks();
        let shrink = self.config.enable_shrink;
        let mut team;
        loop {
            team = Team {
                ranks: (0..r).filter(|&d| !(shrink && self.mask[d])).collect(),
            };
            let Err(e) = self.transport.recover(&team) else {
                break;
            };
            self.reset_failed(e, shrink)?;
        }
        self.in_place = None;
        let call = self.next_call();
        let words: Vec<_> = self
            .normal
            .iter()
            .map(|n| &n.ctrl)
            .chain(self.ll.iter().map(|l| &l.signals))
            .cloned()
            .collect();
        let word_refs: Vec<_> = words.iter().collect();
        let job = ResetJob {
            words: &word_refs,
            call,
            team: &team,
        };
        if let Err(e) = self
            .transport
            .run_reset(&job)
            .and_then(|()| self.transport.barrier(&team))
        {
            return Err(self.reset_error(e));
        }
        for &d in &team.ranks {
            self.ll_mem[d] = LlMem::Fresh;
        }
        self.pending_hooks.clear();
        self.poison = None;
        Ok(())
    }

    /// A reset step failed with `e`: in shrink mode a fault naming an unmasked rank masks it
    /// (`Ok`: try again without it); otherwise [`Buffer::reset_error`].
    fn reset_failed(&mut self, e: Error, shrink: bool) -> Result<()> {
        match self.suspect(&e).filter(|&x| is_fault(&e) && !self.mask[x]) {
            Some(x) if shrink => {
                self.mask[x] = true;
                self.ll_mem[x] = LlMem::Used;
                Ok(())
            }
            _ => Err(self.reset_error(e)),
        }
    }

    /// The typed error of a failed reset ([`Error::ResetNeedsRank`] when it names a rank); the
    /// buffer stays (or becomes) poisoned.
    fn reset_error(&mut self, e: Error) -> Error {
        let e = match self.suspect(&e).filter(|_| is_fault(&e)) {
            Some(rank) => Error::ResetNeedsRank {
                rank,
                cause: Box::new(e),
            },
            None => e,
        };
        self.poison_with(self.last_call, e)
    }
}
