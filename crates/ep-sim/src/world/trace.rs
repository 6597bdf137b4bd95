//! The replayable trace and the run's counters.

use super::World;

/// One entry of the replayable trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceEvent {
    /// An agent's request was served.
    Agent {
        /// Virtual time.
        t: u64,
        /// Rank.
        rank: usize,
        /// Agent index on the rank.
        index: usize,
        /// The vocabulary call.
        op: &'static str,
    },
    /// A work request was applied by its target.
    Deliver {
        /// Virtual time.
        t: u64,
        /// Work request id.
        wr: u64,
    },
    /// A work request completed at its source.
    Complete {
        /// Virtual time.
        t: u64,
        /// Work request id.
        wr: u64,
    },
}

/// Counters of a run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Agent requests served.
    pub operations: u64,
    /// Work requests delivered.
    pub delivered: u64,
    /// Work requests posted.
    pub posted: u64,
    /// Posts that found their QP full and waited.
    pub qp_full_waits: u64,
    /// Highest number of outstanding work requests seen on any QP.
    pub max_outstanding: u32,
    /// Ordering breaches the executor found in its own bookkeeping (must stay 0).
    pub fifo_breaches: u64,
}

impl World {
    /// Appends `e` to the trace when tracing is on.
    pub(super) fn trace(&mut self, e: TraceEvent) {
        if let Some(t) = &mut self.trace {
            t.push(e);
        }
    }
}
