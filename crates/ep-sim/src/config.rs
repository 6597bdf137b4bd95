//! Simulator configuration: fabric, seed, delivery policy, bounds.

use ep_core::transport::FabricParams;

/// Which legal event happens next. Every policy only picks legal events, so a correct protocol
/// gives correct results under all of them; they differ in which bugs they expose quickly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Uniformly random among the enabled events (agent steps, deliveries, completions).
    Uniform,
    /// PCT (Burckhardt et al., ASPLOS 2010): every agent and every QP's delivery and completion
    /// queue gets a random priority; the highest enabled one runs; at `depth - 1` random steps
    /// within `horizon`, the running entity drops below all others.
    Pct {
        /// Bug depth `d`.
        depth: u32,
        /// Expected number of steps (where change points are drawn).
        horizon: u64,
    },
    /// Deliver as late as legal: agents run while any can; deliveries and completions happen
    /// only when every live agent is parked (at its next ordering point or wait).
    LatestLegal,
}

/// Simulator configuration.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The fabric modelled.
    pub fabric: FabricParams,
    /// Fixes every scheduling and delivery choice.
    pub seed: u64,
    /// Delivery policy.
    pub policy: Policy,
    /// Virtual-time bound of a wait, in ticks (one tick per executed event).
    pub wait_timeout_ticks: u64,
    /// Record the event trace (for replay checks).
    pub trace: bool,
}

impl SimConfig {
    /// A configuration with the uniform policy and a 200 000-tick wait bound.
    #[must_use]
    pub fn new(fabric: FabricParams, seed: u64) -> SimConfig {
        SimConfig {
            fabric,
            seed,
            policy: Policy::Uniform,
            wait_timeout_ticks: 200_000,
            trace: false,
        }
    }
    /// Sets the policy.
    #[must_use]
    pub fn policy(mut self, p: Policy) -> SimConfig {
        self.policy = p;
        self
    }
    /// Enables the trace.
    #[must_use]
    pub fn traced(mut self) -> SimConfig {
        self.trace = true;
        self
    }
}
