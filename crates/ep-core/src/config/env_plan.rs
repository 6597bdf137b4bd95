//! The NVSHMEM environment plan (spec §1.2, §4, DESIGN.md "NVSHMEM and IBGDA"): which variables
//! must be set before NVSHMEM initialises, to which values, and why — as data.
//!
//! Applying the plan is not done here: the launcher or test harness starts one process per GPU
//! with the variables set (or an `unsafe` in-process setter does so before any thread starts).
//! Variables the user already set are respected, never overwritten, and reported with both
//! values. DeepEP itself overwrites every variable except `NVSHMEM_QP_DEPTH`; ep-rs respects all
//! of them, so a user's explicit choice always wins and the plan says where it differs.

use std::collections::BTreeMap;

use crate::config::{BufferConfig, DEEPEP_CUMEM_GRANULARITY, DEEPEP_NVSHMEM_MAX_TEAMS};
use crate::error::{Error, Result};

/// Who rings the NIC doorbell for IBGDA: NVSHMEM's `NVSHMEM_IBGDA_NIC_HANDLER`.
///
/// NVSHMEM defines the variable as a string, default `auto`, with choices `auto` (GPU SMs,
/// falling back to the CPU when unsupported), `gpu`, `cpu` (CPU with the GDRCopy backend) and,
/// since 3.4, `cpu_host_memory` (CPU with CUDA host memory, no GDRCopy needed) — see
/// `NVSHMEMI_ENV_DEF(IBGDA_NIC_HANDLER, ...)` in NVIDIA/nvshmem
/// `src/modules/transport/common/env_defs.h`, and the NVSHMEM 3.4.5 release notes ("CPU-Assisted
/// IBGDA without the use of GDRCopy or the x86 regkey setting"). DeepEP's first commit forced
/// `gpu`; `e6b4f52` (2025-07-14) removed that to allow the CPU-assisted path (spec §1.2).
/// Which mode is live after init is detected by the doctor, not assumed.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum IbgdaNicHandler {
    /// `auto`: GPU-initiated when the driver allows it, else CPU-assisted (NVSHMEM's default,
    /// and DeepEP V1's effective behaviour).
    #[default]
    Auto,
    /// `gpu`: GPU-initiated. Needs the driver keys `NVreg_EnableStreamMemOPs=1` and
    /// `PeerMappingOverride=1` (spec §5).
    Gpu,
    /// `cpu`: CPU-assisted, the proxy rings the doorbell through GDRCopy (`gdrdrv` loaded).
    Cpu,
    /// `cpu_host_memory`: CPU-assisted without GDRCopy (NVSHMEM >= 3.4).
    CpuHostMemory,
}

impl IbgdaNicHandler {
    /// The value of `NVSHMEM_IBGDA_NIC_HANDLER`.
    pub fn as_env_value(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Gpu => "gpu",
            Self::Cpu => "cpu",
            Self::CpuHostMemory => "cpu_host_memory",
        }
    }

    /// Parses a value of `NVSHMEM_IBGDA_NIC_HANDLER` (NVSHMEM compares case-sensitively).
    pub fn from_env_value(value: &str) -> Option<Self> {
        Some(match value.trim() {
            "auto" => Self::Auto,
            "gpu" => Self::Gpu,
            "cpu" => Self::Cpu,
            "cpu_host_memory" => Self::CpuHostMemory,
            _ => return None,
        })
    }

    /// Oldest NVSHMEM that accepts this value: 3.4.5 for `cpu_host_memory`, else DeepEP's
    /// minimum 3.3.9 (spec §5).
    pub fn min_nvshmem_version(self) -> (u32, u32, u32) {
        match self {
            Self::CpuHostMemory => (3, 4, 5),
            _ => (3, 3, 9),
        }
    }

    fn reason(self) -> &'static str {
        match self {
            Self::Auto => {
                "IBGDA NIC handler: GPU-initiated if the driver allows it, else CPU-assisted"
            }
            Self::Gpu => {
                "IBGDA NIC handler: GPU-initiated (needs NVreg_EnableStreamMemOPs=1 and PeerMappingOverride=1)"
            }
            Self::Cpu => "IBGDA NIC handler: CPU-assisted through GDRCopy (needs gdrdrv)",
            Self::CpuHostMemory => {
                "IBGDA NIC handler: CPU-assisted through CUDA host memory (no GDRCopy; NVSHMEM >= 3.4)"
            }
        }
    }
}

/// One variable of the plan.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EnvEntry {
    /// The variable, e.g. `NVSHMEM_QP_DEPTH`.
    pub name: &'static str,
    /// The value ep-rs plans (DeepEP's value, or the config's).
    pub planned: String,
    /// The value already in the user's environment, if any (non-empty); it wins.
    pub user: Option<String>,
    /// Why the variable is set (DeepEP's stated reason where it gives one).
    pub reason: &'static str,
}

impl EnvEntry {
    /// The value NVSHMEM will see: the user's if set, else the planned one.
    pub fn effective(&self) -> &str {
        self.user.as_deref().unwrap_or(&self.planned)
    }

    /// Whether the user set this variable (and so the plan leaves it alone).
    pub fn is_user_set(&self) -> bool {
        self.user.is_some()
    }

    /// Whether the user's value differs from the planned one (worth reporting).
    pub fn user_overrides(&self) -> bool {
        self.user.as_deref().is_some_and(|u| u != self.planned)
    }

    /// `(name, value)` to set, or `None` when the user's value is kept.
    pub fn to_apply(&self) -> Option<(&'static str, &str)> {
        match self.user {
            Some(_) => None,
            None => Some((self.name, &self.planned)),
        }
    }
}

/// The NVSHMEM resources in effect once the plan (and the user's variables) are applied; the
/// simulator models them and the doctor reports them (DESIGN.md "NVSHMEM and IBGDA").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NvshmemResources {
    /// `NVSHMEM_QP_DEPTH`: work requests a QP holds.
    pub qp_depth: u32,
    /// `NVSHMEM_IBGDA_NUM_RC_PER_PE`: RC QPs per peer PE.
    pub num_rc_per_pe: u32,
    /// `NVSHMEM_CUMEM_GRANULARITY`: symmetric-heap chunk bytes.
    pub cumem_granularity: u64,
    /// `NVSHMEM_IBGDA_NIC_HANDLER`.
    pub nic_handler: IbgdaNicHandler,
}

/// How NVSHMEM's world is laid out over the EP ranks (spec §1.2 steps 3–4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NvshmemWorld {
    /// PEs per NVSHMEM job: `R` in low-latency mode, else `RR` (one PE per node).
    pub num_pes: usize,
    /// Independent NVSHMEM jobs: 1 in low-latency mode; 8 in normal internode mode (one per
    /// GPU index, each spanning the same-index GPU of every node).
    pub num_jobs: usize,
    /// Low-latency mode with `R > 8` also splits a strided "CPU RDMA team" (start `rank % 8`,
    /// stride 8, size `R / 8`) so normal internode kernels keep working — the "+1" team.
    pub strided_rdma_team: bool,
}

impl NvshmemWorld {
    /// The PE of global rank `rank`: `rank` (low-latency) or `rank / 8` (normal).
    pub fn pe_of(&self, rank: usize) -> usize {
        if self.num_jobs == 1 { rank } else { rank / 8 }
    }
}

/// The NVSHMEM environment for one process of a buffer (spec §1.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvPlan {
    /// Whether DeepEP's setup touches NVSHMEM at all: `RR > 1` or low-latency mode. When false
    /// the plan is empty (intranode normal mode needs no NVSHMEM).
    pub uses_nvshmem: bool,
    /// Whether NVSHMEM is initialised: `uses_nvshmem` and `num_rdma_bytes > 0`.
    pub initialises_nvshmem: bool,
    /// The variables, in a fixed order (DeepEP's, with the NIC handler after IBGDA).
    pub entries: Vec<EnvEntry>,
    /// Effective resources (`None` when NVSHMEM is not used).
    pub resources: Option<NvshmemResources>,
    /// NVSHMEM's world (`None` when NVSHMEM is not initialised).
    pub world: Option<NvshmemWorld>,
}

impl EnvPlan {
    /// The entry for `name`, if planned.
    pub fn get(&self, name: &str) -> Option<&EnvEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// `(name, value)` pairs still to set (user-set variables excluded), in plan order.
    pub fn to_apply(&self) -> Vec<(&'static str, &str)> {
        self.entries.iter().filter_map(EnvEntry::to_apply).collect()
    }
}

/// Parses NVSHMEM's `size` kind: a number (decimals allowed, `.5` ok) and an optional suffix
/// `k/K/m/M/g/G/t/T` (powers of 1024), characters after the suffix ignored, fractional bytes
/// rounded up (`3.1M` → 3,250,586), as NVSHMEM's environment documentation states.
pub fn parse_nvshmem_size(value: &str) -> Option<u64> {
    let value = value.trim();
    let end = value
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(value.len());
    let (num, rest) = value.split_at(end);
    if num.is_empty() || num == "." || num.matches('.').count() > 1 {
        return None;
    }
    let shift = match rest.chars().next() {
        None => 0,
        Some('k' | 'K') => 10,
        Some('m' | 'M') => 20,
        Some('g' | 'G') => 30,
        Some('t' | 'T') => 40,
        Some(_) => return None,
    };
    if !num.contains('.') {
        return num.parse::<u64>().ok()?.checked_mul(1u64 << shift);
    }
    let (int, frac) = num.split_once('.')?;
    let int: u64 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let whole = int.checked_mul(1u64 << shift)?;
    // Exact fractional part: frac_digits / 10^len * 2^shift, rounded up, in integers.
    let digits = frac.trim_end_matches('0');
    if digits.is_empty() {
        return Some(whole);
    }
    if digits.len() > 18 {
        return None;
    }
    let f: u128 = digits.parse().ok()?;
    let den = 10u128.pow(digits.len() as u32);
    let part = (f << shift).div_ceil(den);
    whole.checked_add(u64::try_from(part).ok()?)
}

fn parse_int(name: &'static str, value: &str) -> Result<u32> {
    value
        .trim()
        .parse::<u32>()
        .map_err(|_| Error::InvalidEnvVar {
            name,
            value: value.to_string(),
            expected: "a non-negative integer",
        })
}

const QP_DEPTH: &str = "NVSHMEM_QP_DEPTH";
const RC_PER_PE: &str = "NVSHMEM_IBGDA_NUM_RC_PER_PE";
const GRANULARITY: &str = "NVSHMEM_CUMEM_GRANULARITY";
const NIC_HANDLER: &str = "NVSHMEM_IBGDA_NIC_HANDLER";

/// The NVSHMEM environment plan of `cfg` given the process's current environment `user_env`
/// and the chosen IBGDA NIC handler (spec §1.2). Pure: reads nothing, sets nothing.
///
/// NVSHMEM is used only if `RR > 1` or low-latency mode; then, in order:
///
/// | variable | planned value |
/// |---|---|
/// | `NVSHMEM_DISABLE_P2P` | `0` if `allow_nvlink_for_low_latency_mode` else `1` |
/// | `NVSHMEM_IB_ENABLE_IBGDA` | `1` |
/// | `NVSHMEM_IBGDA_NIC_HANDLER` | `nic_handler` (ep-rs addition) |
/// | `NVSHMEM_IBGDA_NUM_RC_PER_PE` | `num_qps_per_rank` |
/// | `NVSHMEM_QP_DEPTH` | `cfg.nvshmem_qp_depth` (1024 by default) |
/// | `NVSHMEM_MAX_TEAMS` | `7` |
/// | `NVSHMEM_DISABLE_NVLS` | `1` |
/// | `NVSHMEM_CUMEM_GRANULARITY` | `536870912` |
/// | `NVSHMEM_DISABLE_MNNVL` | `1`, only if `!allow_mnnvl` |
///
/// A variable the user set (non-empty) keeps the user's value, recorded in [`EnvEntry::user`];
/// the effective QP depth, RC QPs per PE, granularity and handler in [`EnvPlan::resources`] are
/// parsed from whichever value wins. Errors: an invalid `cfg`, or a user value NVSHMEM would
/// reject for one of those four variables.
pub fn nvshmem_env_plan(
    cfg: &BufferConfig,
    user_env: &BTreeMap<String, String>,
    nic_handler: IbgdaNicHandler,
) -> Result<EnvPlan> {
    cfg.validate()?;
    if !cfg.uses_nvshmem() {
        return Ok(EnvPlan {
            uses_nvshmem: false,
            initialises_nvshmem: false,
            entries: Vec::new(),
            resources: None,
            world: None,
        });
    }
    let mut planned: Vec<(&'static str, String, &'static str)> = vec![
        if cfg.allow_nvlink_for_low_latency_mode {
            (
                "NVSHMEM_DISABLE_P2P",
                "0".into(),
                "allow_nvlink_for_low_latency_mode: same-node peers are written over NVLink",
            )
        } else {
            (
                "NVSHMEM_DISABLE_P2P",
                "1".into(),
                "allow_nvlink_for_low_latency_mode = false: every peer is reached through the NIC",
            )
        },
        (
            "NVSHMEM_IB_ENABLE_IBGDA",
            "1".into(),
            "GPU-initiated RDMA (IBGDA) transport",
        ),
        (
            NIC_HANDLER,
            nic_handler.as_env_value().into(),
            nic_handler.reason(),
        ),
        (
            RC_PER_PE,
            cfg.num_qps_per_rank.to_string(),
            "num_qps_per_rank: RC QPs per peer PE (low-latency mode: one per local expert)",
        ),
        (
            QP_DEPTH,
            cfg.nvshmem_qp_depth.to_string(),
            "QP depth must exceed the work requests in flight: low-latency calls need 2 * (N + 1)",
        ),
        (
            "NVSHMEM_MAX_TEAMS",
            DEEPEP_NVSHMEM_MAX_TEAMS.to_string(),
            "reduce GPU memory usage: 6 default teams + 1 extra team",
        ),
        ("NVSHMEM_DISABLE_NVLS", "1".into(), "disable NVLink SHArP"),
        (
            GRANULARITY,
            DEEPEP_CUMEM_GRANULARITY.to_string(),
            "NVSHMEM initialisation needs at least 256 MiB; 512 MiB heap chunks keep IBGDA keys \
             few and RDMA operations unsplit",
        ),
    ];
    if !cfg.allow_mnnvl {
        planned.push((
            "NVSHMEM_DISABLE_MNNVL",
            "1".into(),
            "allow_mnnvl = false: disable multi-node NVLink detection",
        ));
    }
    let entries: Vec<EnvEntry> = planned
        .into_iter()
        .map(|(name, planned, reason)| EnvEntry {
            name,
            planned,
            user: user_env.get(name).filter(|v| !v.trim().is_empty()).cloned(),
            reason,
        })
        .collect();
    let effective = |name: &str| {
        entries
            .iter()
            .find(|e| e.name == name)
            .map(EnvEntry::effective)
            .unwrap_or_default()
            .to_string()
    };
    let granularity = effective(GRANULARITY);
    let handler = effective(NIC_HANDLER);
    let resources = NvshmemResources {
        qp_depth: parse_int(QP_DEPTH, &effective(QP_DEPTH))?,
        num_rc_per_pe: parse_int(RC_PER_PE, &effective(RC_PER_PE))?,
        cumem_granularity: parse_nvshmem_size(&granularity).ok_or(Error::InvalidEnvVar {
            name: GRANULARITY,
            value: granularity.clone(),
            expected: "a size such as 536870912 or 512M",
        })?,
        nic_handler: IbgdaNicHandler::from_env_value(&handler).ok_or(Error::InvalidEnvVar {
            name: NIC_HANDLER,
            value: handler.clone(),
            expected: "one of auto, gpu, cpu, cpu_host_memory",
        })?,
    };
    let initialises_nvshmem = cfg.num_rdma_bytes > 0;
    let world = initialises_nvshmem.then(|| {
        if cfg.low_latency_mode {
            NvshmemWorld {
                num_pes: cfg.num_ranks,
                num_jobs: 1,
                strided_rdma_team: cfg.num_ranks > crate::config::NUM_MAX_NVL_PEERS,
            }
        } else {
            NvshmemWorld {
                num_pes: cfg.num_rdma_ranks(),
                num_jobs: cfg.num_nvl_ranks(),
                strided_rdma_team: false,
            }
        }
    });
    Ok(EnvPlan {
        uses_nvshmem: true,
        initialises_nvshmem,
        entries,
        resources: Some(resources),
        world,
    })
}
