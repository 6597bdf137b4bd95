//! The backends `ep bench` runs on and what it needs from them beyond [`Transport`]: the traffic
//! each phase moved, for the cost model.

use clap::ValueEnum;
use ep_core::transport::Transport;
use ep_sim::cost::PhaseRecord;
use ep_sim::{Sim, ThreadSim};

/// Where dispatch and combine run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The simulator in threads mode (`ThreadSim`): every agent on its own thread, real
    /// concurrency, no memory-model checks; for throughput.
    Sim,
    /// The deterministic simulator (`Sim`) with every violation check (seeded by --seed); for
    /// small runs.
    SimChecked,
    /// GPUs through CUDA and NVSHMEM (not built yet).
    Gpu,
}

impl Backend {
    /// The name recorded in manifests and reports.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Sim => "sim",
            Self::SimChecked => "sim-checked",
            Self::Gpu => "gpu",
        }
    }
}

/// A transport whose phases' traffic is recorded.
pub(crate) trait Recorded: Transport + Sync {
    /// Every phase run so far, in order.
    fn phase_records(&self) -> &[PhaseRecord];
}

impl Recorded for ThreadSim {
    fn phase_records(&self) -> &[PhaseRecord] {
        self.records()
    }
}

impl Recorded for Sim {
    fn phase_records(&self) -> &[PhaseRecord] {
        self.records()
    }
}
