//! Simulator configuration: fabric, seed, delivery policy, bounds.

use ep_core::transport::FabricParams;

use crate::fault::Fault;

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
    /// Faults to inject ([`crate::fault`]); empty: the fabric keeps every promise.
    pub faults: Vec<Fault>,
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
            faults: Vec::new(),
        }
    }
    /// Sets the policy.
    #[must_use]
    pub fn policy(mut self, p: Policy) -> SimConfig {
        self.policy = p;
        self
    }
    /// Adds a fault to inject.
    #[must_use]
    pub fn fault(mut self, f: Fault) -> SimConfig {
        self.faults.push(f);
        self
    }
    /// Sets the wait bound, in ticks.
    #[must_use]
    pub fn wait_timeout(mut self, ticks: u64) -> SimConfig {
        self.wait_timeout_ticks = ticks;
        self
    }
    /// The initial value of the ring counter named `name` under this seed (DESIGN.md: "ring
    /// counters start at random offsets to exercise wraparound"). Protocol code that owns a ring
    /// starts its head and tail at this value instead of 0, so slot `i % capacity` arithmetic and
    /// `tail - head` comparisons are exercised across a wrap of the slot index (and, with
    /// `high` offsets, near the top of the 64-bit range). Deterministic in (seed, name); ranks that
    /// must agree on a ring's start ask with the same name. Half the names get a value below 2^20,
    /// half one within 2^40 + 2^20 of `u64::MAX` (headroom for 2^40 entries without wrapping).
    #[must_use]
    pub fn ring_offset(&self, name: &str) -> u64 {
        ring_offset(self.seed, name)
    }
    /// Enables the trace.
    #[must_use]
    pub fn traced(mut self) -> SimConfig {
        self.trace = true;
        self
    }
}

/// [`SimConfig::ring_offset`] for a seed: FNV-1a of the name mixed with the seed (splitmix64).
#[must_use]
pub fn ring_offset(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    let mut z = h ^ seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    // Half the names start low (small offsets wrap slot indices), half near the top of u64.
    let low = (z >> 1) % (1 << 20);
    if z & 1 == 0 {
        low
    } else {
        u64::MAX - (1 << 40) - low
    }
}
