//! What `diagnose` produces: checks, per-capability verdicts, the IBGDA mode.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use super::facts::Facts;

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Pass,
    /// Works, with a caveat, or could not be verified.
    Warn,
    /// Blocks the capabilities the check is needed for.
    Fail,
    /// Not applicable here (or not run); neutral for verdicts.
    Skip,
}

impl Status {
    /// `PASS`, `WARN`, `FAIL`, `SKIP`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Pass => "PASS",
            Self::Warn => "WARN",
            Self::Fail => "FAIL",
            Self::Skip => "SKIP",
        }
    }
}

/// What a machine can be used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Capability {
    /// Normal-mode dispatch/combine between the GPUs of one node over NVLink (CUDA IPC/VMM).
    IntranodeNvlink,
    /// Low-latency kernels with same-node peers reached over NVLink through NVSHMEM P2P.
    LowLatencyNvlink,
    /// GPU-initiated RDMA (IBGDA with the GPU ringing the NIC's doorbell).
    IbgdaGpuInitiated,
    /// CPU-assisted IBGDA (a CPU proxy posts, GDRCopy maps the GPU's queues).
    IbgdaCpuAssisted,
}

impl Capability {
    /// All capabilities, in report order.
    pub const ALL: [Capability; 4] = [
        Self::IntranodeNvlink,
        Self::LowLatencyNvlink,
        Self::IbgdaGpuInitiated,
        Self::IbgdaCpuAssisted,
    ];

    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::IntranodeNvlink => "intranode-nvlink",
            Self::LowLatencyNvlink => "low-latency-nvlink",
            Self::IbgdaGpuInitiated => "ibgda-gpu-initiated",
            Self::IbgdaCpuAssisted => "ibgda-cpu-assisted",
        }
    }

    /// A human title.
    pub fn title(self) -> &'static str {
        match self {
            Self::IntranodeNvlink => "intranode over NVLink",
            Self::LowLatencyNvlink => "low-latency over NVLink (NVSHMEM P2P)",
            Self::IbgdaGpuInitiated => "GPU-initiated IBGDA",
            Self::IbgdaCpuAssisted => {
                "CPU-assisted IBGDA (GDRCopy, or host memory with NVSHMEM >= 3.4.5)"
            }
        }
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Capability {
    type Err = String;

    /// Accepts the names of [`Capability::name`] and the short forms `intranode`, `ll`,
    /// `ibgda-gpu`, `ibgda-cpu`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "intranode-nvlink" | "intranode" => Self::IntranodeNvlink,
            "low-latency-nvlink" | "low-latency" | "ll" => Self::LowLatencyNvlink,
            "ibgda-gpu-initiated" | "ibgda-gpu" | "ibgda" => Self::IbgdaGpuInitiated,
            "ibgda-cpu-assisted" | "ibgda-cpu" => Self::IbgdaCpuAssisted,
            _ => {
                return Err(format!(
                    "unknown capability {s:?}; use one of intranode-nvlink, low-latency-nvlink, \
                     ibgda-gpu-initiated, ibgda-cpu-assisted"
                ));
            }
        })
    }
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    /// Stable identifier (`driver.ibgda-keys`).
    pub id: &'static str,
    /// Short title.
    pub title: &'static str,
    /// Outcome.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// The exact fix (files to write, commands to run), when there is one.
    pub fix: Option<String>,
    /// Capabilities this check's failure blocks.
    pub needed_for: Vec<Capability>,
}

/// A capability's verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The capability.
    pub capability: Capability,
    /// `Pass`: usable; `Warn`: usable with caveats or unverified; `Fail`: unusable.
    pub status: Status,
    /// Whether it can be used (`status != Fail`).
    pub usable: bool,
    /// `Fail`: ids of the checks that block it; `Warn`: ids of the checks that warned (caveats).
    pub because: Vec<&'static str>,
}

/// The IBGDA data paths NVSHMEM offers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IbgdaMode {
    /// The GPU posts work requests and rings the doorbell itself.
    GpuInitiated,
    /// A CPU proxy rings the doorbell; GDRCopy maps GPU memory for it.
    CpuAssisted,
    /// Neither: inter-node low-latency traffic is unavailable.
    None,
}

impl IbgdaMode {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::GpuInitiated => "GPU-initiated",
            Self::CpuAssisted => "CPU-assisted",
            Self::None => "none",
        }
    }
}

/// Which IBGDA modes the machine supports and which ep-rs will use.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IbgdaModeReport {
    /// Usable modes, preferred first.
    pub possible: Vec<IbgdaMode>,
    /// The one ep-rs will run with (NVSHMEM's `auto` NIC handler picks the same).
    pub selected: IbgdaMode,
}

/// Everything `ep doctor` reports.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// Checks in report order.
    pub checks: Vec<Check>,
    /// One verdict per capability.
    pub verdicts: Vec<Verdict>,
    /// IBGDA modes.
    pub ibgda: IbgdaModeReport,
    /// The facts the report was computed from.
    pub facts: Facts,
}

impl Report {
    /// The check with this id.
    pub fn check(&self, id: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.id == id)
    }

    /// The verdict for `cap`.
    pub fn verdict(&self, cap: Capability) -> &Verdict {
        self.verdicts
            .iter()
            .find(|v| v.capability == cap)
            .expect("diagnose gives a verdict for every capability")
    }

    /// Process exit code: with `require`, 2 when any required capability is unusable;
    /// without, 1 when no GPU path at all is usable; else 0.
    pub fn exit_code(&self, require: &[Capability]) -> i32 {
        if !require.is_empty() {
            if require.iter().all(|&c| self.verdict(c).usable) {
                0
            } else {
                2
            }
        } else if self.verdicts.iter().any(|v| v.usable) {
            0
        } else {
            1
        }
    }
}
