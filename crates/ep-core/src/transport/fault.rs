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
//! # What the Buffer does with them
//! - **Default**: any of the errors above poisons the Buffer: every later call returns the
//!   error until a **collective reset** (all ranks re-zero their counters and flags, drain their
//!   QPs with `quiet`, and barrier), as DESIGN.md requires of device timeouts.
//! - **Low-latency shrink mode** (spec §2.7): a wait for a peer is made with
//!   [`super::AgentCtx::wait_or_expire`], which returns `Ok(None)` instead of failing the phase
//!   when the bound expires; the agent then treats that peer as masked (its count as zero, no more
//!   sends to it, its top-k entries dropped in combine) and records it in the Buffer's mask
//!   (`mask_buffer[peer] = 1`, what `query_mask_buffer` reports). A phase that ends in
//!   [`Error::RankFailed`] after its survivors finished tells the host which rank to mask for the
//!   next calls instead of poisoning the Buffer.

use crate::Error;

/// The rank a transport error points at, when it names one: the peer of a failed or silent QP,
/// or a rank that stopped. `None` for waits (the protocol's label names the awaited writer; the
/// agent that built the wait knows it) and for errors that are not faults.
#[must_use]
pub fn fault_rank(e: &Error) -> Option<usize> {
    match e {
        Error::QpError { peer, .. } | Error::CompletionTimeout { peer, .. } => Some(*peer),
        Error::RankFailed { rank, .. } => Some(*rank),
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
    )
}
