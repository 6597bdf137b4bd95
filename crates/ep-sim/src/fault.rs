//! Injected faults, distinct from legal reordering (DESIGN.md, "The simulator").
//!
//! Legal behaviour — any delivery order the memory model allows, slowness within the wait
//! bound — must give correct results. A [`Fault`] breaks the fabric's promises, and the run must
//! end, in bounded (virtual) time, in a typed error naming the rank and what was awaited:
//!
//! | fault | what happens | how it ends |
//! |---|---|---|
//! | [`Fault::DeadRank`] | the rank's agents stop at the trigger; nothing more leaves it (its queued work requests are never delivered) and its NIC applies nothing more | the survivors' waits for it time out ([`ep_core::Error::WaitTimeout`], the simulator's report naming the dead rank); quiets towards it time out ([`ep_core::Error::CompletionTimeout`] naming the QP and peer); if every survivor finished, [`ep_core::Error::RankFailed`] naming it |
//! | [`Fault::StalledRank`] | the rank's agents pause for `ticks` (its NIC keeps working) | within the wait bound: legal, results are correct; beyond it: the waits for it time out, naming the stall |
//! | [`Fault::QpError`] | after `after_wrs` work requests on the QP, posts still succeed locally but nothing is delivered | the poster's `quiet` fails at once with [`ep_core::Error::QpError`] naming the QP and peer; a receiver waiting for the lost data times out |
//! | [`Fault::DroppedCompletion`] | the `nth` work request on the QP is delivered, but its completion never comes (later ones on that QP queue behind it) | `quiet`, or a post waiting for a slot of the full QP, times out with [`ep_core::Error::CompletionTimeout`] naming the QP |
//!
//! In the deterministic simulator time is virtual: when every live agent is parked and only a
//! fault stands in the way, the clock jumps to the earliest wait deadline (or to the end of a
//! stall), so a fault costs no wall time. A protocol deadlock without faults is still reported at
//! once as [`crate::Violation::Deadlock`].
//!
//! Threads mode ([`crate::ThreadSim`]) honours the same faults, in wall time: triggers count the
//! rank's operations (`AfterOps`) or microseconds since the phase began (`AtTick`), a stall sleeps
//! `ticks` microseconds, a QP error drops whole operations whose last work request is past
//! `after_wrs`, and a dropped completion makes the poster's next `quiet` time out.

use std::fmt;

use ep_core::transport::QpIndex;

/// When a rank fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// After the rank's agents have performed this many vocabulary operations (counted from the
    /// executor's creation, across phases; 0: before its first).
    AfterOps(u64),
    /// At this virtual tick (simulator: absolute time since creation; threads mode: microseconds
    /// since the phase began).
    AtTick(u64),
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Trigger::AfterOps(n) => write!(f, "after {n} operations"),
            Trigger::AtTick(t) => write!(f, "at tick {t}"),
        }
    }
}

/// A fault to inject ([`crate::SimConfig::faults`], [`crate::ThreadSim::set_faults`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The rank dies: its agents stop, nothing more leaves it, its NIC applies nothing more.
    DeadRank {
        /// The rank.
        rank: usize,
        /// When.
        at: Trigger,
    },
    /// The rank's agents pause for `ticks` (a long but finite, legal slowness).
    StalledRank {
        /// The rank.
        rank: usize,
        /// When the stall begins.
        at: Trigger,
        /// How long (virtual ticks; microseconds in threads mode).
        ticks: u64,
    },
    /// The QP `(src → dst, qp)` enters the error state after `after_wrs` work requests: later
    /// posts succeed locally but are never delivered; `quiet` reports the error.
    QpError {
        /// Source rank.
        src: usize,
        /// Destination rank.
        dst: usize,
        /// QP index.
        qp: QpIndex,
        /// Work requests delivered normally before the error (counted from creation).
        after_wrs: u64,
    },
    /// The `nth` work request (1-based, counted from creation) on QP `(src → dst, qp)` is
    /// delivered but never completes.
    DroppedCompletion {
        /// Source rank.
        src: usize,
        /// Destination rank.
        dst: usize,
        /// QP index.
        qp: QpIndex,
        /// Which work request.
        nth: u64,
    },
}

impl Fault {
    /// Whether the fault concerns QP `(src, dst, qp)`.
    pub(crate) fn on_qp(&self, k: (usize, usize, u16)) -> bool {
        match *self {
            Fault::QpError { src, dst, qp, .. } | Fault::DroppedCompletion { src, dst, qp, .. } => {
                (src, dst, qp.0) == k
            }
            _ => false,
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::DeadRank { rank, at } => write!(f, "rank {rank} dead ({at}, injected)"),
            Fault::StalledRank { rank, at, ticks } => {
                write!(f, "rank {rank} stalled for {ticks} ticks ({at}, injected)")
            }
            Fault::QpError {
                src,
                dst,
                qp,
                after_wrs,
            } => write!(
                f,
                "{qp} rank {src} -> rank {dst} in error state after {after_wrs} work requests (injected)"
            ),
            Fault::DroppedCompletion { src, dst, qp, nth } => write!(
                f,
                "completion of work request #{nth} on {qp} rank {src} -> rank {dst} dropped (injected)"
            ),
        }
    }
}
