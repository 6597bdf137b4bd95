//! The backends `ep bench` runs on and what it needs from them beyond [`Executor`]: the traffic
//! each phase moved, for the cost model.

use clap::ValueEnum;
use ep_core::Executor;
use ep_core::executor::Host;
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
    /// GPU 0 through CUDA (and NVSHMEM for the low-latency `--variant nvshmem`).
    Gpu,
}

/// The low-latency GPU kernel variant (docs/protocol.md §3.10, §3.11).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LlVariantArg {
    /// (a) Peers by pointer.
    #[default]
    Pointers,
    /// (b) Every peer through NVSHMEM's device API: the co-resident ranks are regions of one
    /// NVSHMEM PE in this process; the kernels are linked at run time against the loaded
    /// NVSHMEM's device library.
    Nvshmem,
}

impl LlVariantArg {
    /// `a` or `b`, as the protocol names them.
    #[must_use]
    pub fn letter(self) -> &'static str {
        match self {
            Self::Pointers => "a",
            Self::Nvshmem => "b",
        }
    }
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
pub(crate) trait Recorded: Executor<T = Host> + Sync {
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
