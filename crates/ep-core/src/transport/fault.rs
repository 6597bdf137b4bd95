//! Faults: how a backend reports a failed rank, QP or completion, and what the layer above does.
//!
//! Legal behaviour (reordering across QPs, lazy delivery, slowness within the wait bound) must give
//! correct results; a **fault** — a dead or stalled rank, a QP in error state, a lost completion —
//! ends in bounded time in one of these typed errors, each naming the rank and what was awaited:
//!
//! | error | raised when | suspect ([`fault_rank`]) |
//! |---|---|---|
//! | [`Error::WaitTimeout`] | a `wait` or block barrier exceeded its bound | the protocol's label (`what`) names the writer it awaited; the error names the waiter |
//! | [`Error::CompletionTimeout`] | `quiet`, or a post to a full QP, saw no completion within the bound | `peer` |
//! | [`Error::QpError`] | `quiet` found error completions: posts were flushed undelivered | `peer` |
//! | [`Error::RankFailed`] | a rank's agents never finished while the others did | `rank` |
//! | [`Error::Deadlock`] | (simulator) nothing in flight can wake any waiter: a protocol bug, not a fault | none |
//!
//! # What the Buffer does with them (docs/protocol.md §7)
//! - **Default**: a failed phase (any of the errors above, or any other error once a phase ran)
//!   poisons the Buffer: the failing call returns the error itself, every later call
//!   [`Error::BufferPoisoned`] naming it and the suspect rank, until a **collective reset**
//!   (`Buffer::reset`: [`super::Transport::recover`] drains or flushes what is in flight, every
//!   rank zeroes its signal words, a barrier, hooks forgotten), as DESIGN.md requires of device
//!   timeouts. The suspect of a wait timeout is the writer of the awaited word
//!   (`protocol::layout::NormalCtrl::writer`, `ll_signal_writer`).
//! - **Low-latency shrink mode** (spec §2.7): receive agents wait for a peer's signal with
//!   [`super::AgentCtx::wait_or_expire`], which returns `Ok(None)` instead of failing the phase
//!   when the bound expires; the agent reports the peer, the Buffer masks it
//!   (`mask_buffer[peer] = 1`, what `query_mask_buffer` reports) and runs the phase again under
//!   the new mask, so the call returns exactly the result of the plan with that rank masked.
//!   A phase of a low-latency call that fails with an error naming a rank ([`fault_rank`]: a
//!   sender's `quiet` towards a dead peer, a QP error, [`Error::RankFailed`]) masks that rank the
//!   same way, after [`super::Transport::recover`] over the survivors flushed what was in flight
//!   towards it. Normal mode never masks: its faults poison.

use crate::Error;

/// The rank a transport error points at, when it names one: the peer of a failed or silent QP,
/// or a rank that stopped. `None` for waits (the protocol's label names the awaited writer; the
/// agent that built the wait knows it) and for errors that are not faults.
#[must_use]
pub fn fault_rank(e: &Error) -> Option<usize> {
    match e {
        Error::QpError { peer, .. } | Error::CompletionTimeout { peer, .. } => Some(*peer),
        Error::RankFailed { rank, .. } | Error::ResetNeedsRank { rank, .. } => Some(*rank),
        Error::BufferPoisoned { failed_rank, .. } => *failed_rank,
        _ => None,
    }
}

/// Whether `e` is a fault (or a timeout that may stem from one): the Buffer is poisoned until a
/// collective reset, or, in shrink mode, the rank it names is masked.
#[must_use]
pub fn is_fault(e: &Error) -> bool {
    matches!(
        e,
        Error::WaitTimeout { .. }
            | Error::CompletionTimeout { .. }
            | Error::QpError { .. }
            | Error::RankFailed { .. }
            | Error::BufferPoisoned { .. }
            | Error::ResetNeedsRank { .. }
    )
}
