//! Injecting and clearing faults on a running simulator, for recovery tests (`Buffer::reset`,
//! shrink masking): the fault strikes in a later call, then the fabric is repaired.

use ep_core::transport::QpIndex;

use crate::Sim;
use crate::fault::Fault;

impl Sim {
    /// Replaces the injected faults ([`crate::SimConfig::faults`]). Triggers count from the
    /// simulator's creation: `Trigger::AtTick(sim.now() + t)` strikes `t` ticks from now, and a
    /// QP error with `after_wrs: 0` loses every later post on its QP. The old faults' effects end
    /// as with [`Sim::clear_faults`].
    pub fn set_faults(&mut self, faults: Vec<Fault>) {
        self.cfg.faults.clone_from(&faults);
        self.world.set_faults(faults);
    }

    /// Work requests ever posted on QP `(src → dst, qp)`, the count QP faults use: a
    /// `Fault::DroppedCompletion` with `nth: sim.qp_posted(..) + 1` drops the next one.
    #[must_use]
    pub fn qp_posted(&self, src: usize, dst: usize, qp: QpIndex) -> u64 {
        self.world.posted_on((src, dst, qp.0))
    }

    /// Clears every injected fault: a dead rank comes back (its memory as it was when it died,
    /// its queued work requests deliverable again), a stall ends, a QP in error state is repaired
    /// (posts already lost stay lost: the next `quiet` or [`ep_core::transport::Transport::recover`]
    /// flushes their error completions), a dropped completion arrives. What the failed phases left
    /// in flight stays in flight until a barrier or a recovery.
    pub fn clear_faults(&mut self) {
        self.set_faults(Vec::new());
    }
}
