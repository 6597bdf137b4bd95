//! `BufferConfig`: the options of DeepEP's `Buffer` constructor (spec §1.1), their validation,
//! and the configuration-level checks of normal-mode calls (spec §1.8).

use crate::config::{
    Config, DEFAULT_NVSHMEM_QP_DEPTH, INT_MAX, NUM_BUFFER_ALIGNMENT_BYTES, NUM_MAX_NVL_PEERS,
    NUM_MAX_RDMA_PEERS, NUM_MAX_TOPK_NORMAL, num_nvl_ranks, num_rdma_ranks,
};
use crate::error::{Error, Result};

/// Options of `deep_ep.Buffer(...)` (spec §1.1) that shape what is allocated and how NVSHMEM is
/// set up. Plain data with DeepEP's defaults ([`BufferConfig::new`]); [`BufferConfig::validate`]
/// applies DeepEP's constructor checks.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct BufferConfig {
    /// EP size `R` (DeepEP: `group.size()`).
    pub num_ranks: usize,
    /// Per-rank NVLink (peer-mapped) buffer bytes; multiple of 128. Default 0.
    pub num_nvl_bytes: u64,
    /// Per-rank NVSHMEM symmetric buffer bytes; multiple of 128; only with `R > 8` or
    /// low-latency mode. Default 0.
    pub num_rdma_bytes: u64,
    /// Low-latency mode: NVSHMEM world = all ranks, LL kernels enabled. Default false.
    pub low_latency_mode: bool,
    /// RC QPs per peer PE (`NVSHMEM_IBGDA_NUM_RC_PER_PE`); LL needs `>= E / R`. Default 24.
    pub num_qps_per_rank: u32,
    /// Let LL kernels reach same-node peers by NVLink (`NVSHMEM_DISABLE_P2P=0`). Default true.
    pub allow_nvlink_for_low_latency_mode: bool,
    /// Keep NVSHMEM's multi-node NVLink detection (else `NVSHMEM_DISABLE_MNNVL=1`). Default false.
    pub allow_mnnvl: bool,
    /// Allocate the NVL buffer with fabric handles (multi-node NVLink). Default false.
    pub use_fabric: bool,
    /// The user must destroy the buffer explicitly. Default false.
    pub explicitly_destroy: bool,
    /// Allocate the LL rank-masking buffers (spec §2.7). Default false.
    pub enable_shrink: bool,
    /// `NVSHMEM_QP_DEPTH` to plan when the user's environment sets none. Default 1024
    /// (DeepEP). Downstream projects use `max(1024, 2 * (N + 1))` (spec §4).
    pub nvshmem_qp_depth: u32,
}

impl BufferConfig {
    /// DeepEP's defaults for `num_ranks` ranks: no buffers, normal mode, 24 QPs per rank, NVLink
    /// allowed for LL, MNNVL off, QP depth 1024 (spec §1.1, §1.2).
    pub fn new(num_ranks: usize) -> Self {
        Self {
            num_ranks,
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: false,
            num_qps_per_rank: 24,
            allow_nvlink_for_low_latency_mode: true,
            allow_mnnvl: false,
            use_fabric: false,
            explicitly_destroy: false,
            enable_shrink: false,
            nvshmem_qp_depth: DEFAULT_NVSHMEM_QP_DEPTH,
        }
    }

    /// `RR = max(R / 8, 1)`.
    pub fn num_rdma_ranks(&self) -> usize {
        num_rdma_ranks(self.num_ranks)
    }

    /// `min(R, 8)`.
    pub fn num_nvl_ranks(&self) -> usize {
        num_nvl_ranks(self.num_ranks)
    }

    /// Whether DeepEP sets up NVSHMEM's environment: `RR > 1` or low-latency mode (spec §1.2).
    pub fn uses_nvshmem(&self) -> bool {
        self.num_rdma_ranks() > 1 || self.low_latency_mode
    }

    /// Bytes DeepEP allocates for the NVL buffer: `num_nvl_bytes` plus 8 barrier ints and the
    /// two 8-pointer peer tables (spec §1.1); 0 when `num_nvl_bytes == 0`.
    pub fn nvl_allocation_bytes(&self) -> u64 {
        if self.num_nvl_bytes == 0 {
            0
        } else {
            self.num_nvl_bytes + 8 * 4 + 8 * 8 + 8 * 8
        }
    }

    /// DeepEP's constructor checks (spec §1.1, §1.2), first failure returned:
    /// - `R >= 1`; `R < 8` or `R % 8 == 0`; `R <= 160` unless low-latency mode;
    /// - both byte counts multiples of 128;
    /// - `num_nvl_bytes <= INT_MAX` unless `num_rdma_bytes == 0`;
    /// - `num_rdma_bytes <= INT_MAX` unless low-latency mode;
    /// - `num_rdma_bytes > 0` only with `R > 8` or low-latency mode;
    /// - `num_qps_per_rank > 0` and `nvshmem_qp_depth > 0` when NVSHMEM is used.
    pub fn validate(&self) -> Result<()> {
        let r = self.num_ranks;
        if r == 0 {
            return Err(Error::UnsupportedNumRanks {
                num_ranks: r,
                rule: "an EP group has at least 1 rank",
            });
        }
        if r >= NUM_MAX_NVL_PEERS && !r.is_multiple_of(NUM_MAX_NVL_PEERS) {
            return Err(Error::UnsupportedNumRanks {
                num_ranks: r,
                rule: "use fewer than 8 ranks or a multiple of 8 (whole 8-GPU NVLink domains)",
            });
        }
        if r > NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS && !self.low_latency_mode {
            return Err(Error::UnsupportedNumRanks {
                num_ranks: r,
                rule: "normal mode supports at most 160 ranks (20 nodes of 8); only \
                       low-latency mode goes beyond",
            });
        }
        for (field, bytes) in [
            ("num_nvl_bytes", self.num_nvl_bytes),
            ("num_rdma_bytes", self.num_rdma_bytes),
        ] {
            if !bytes.is_multiple_of(NUM_BUFFER_ALIGNMENT_BYTES) {
                return Err(Error::BufferMisaligned {
                    field,
                    bytes,
                    alignment: NUM_BUFFER_ALIGNMENT_BYTES,
                });
            }
        }
        if self.num_nvl_bytes > INT_MAX && self.num_rdma_bytes != 0 {
            return Err(Error::BufferTooLarge {
                field: "num_nvl_bytes",
                bytes: self.num_nvl_bytes,
                limit: INT_MAX,
                why: "internode kernels address the NVL buffer with 32-bit offsets",
            });
        }
        if self.num_rdma_bytes > INT_MAX && !self.low_latency_mode {
            return Err(Error::BufferTooLarge {
                field: "num_rdma_bytes",
                bytes: self.num_rdma_bytes,
                limit: INT_MAX,
                why: "normal-mode kernels address the RDMA buffer with 32-bit offsets",
            });
        }
        if self.num_rdma_bytes > 0 && r <= NUM_MAX_NVL_PEERS && !self.low_latency_mode {
            return Err(Error::RdmaBufferUnused {
                num_rdma_bytes: self.num_rdma_bytes,
                num_ranks: r,
            });
        }
        if self.uses_nvshmem() {
            if self.num_qps_per_rank == 0 {
                return Err(Error::NoQpsPerRank);
            }
            if self.nvshmem_qp_depth == 0 {
                return Err(Error::InvalidConfig {
                    field: "nvshmem_qp_depth",
                    value: "0".into(),
                    fix: "a QP holds at least one work request; use the default 1024".into(),
                });
            }
        }
        Ok(())
    }

    /// DeepEP's per-channel check with the device's SM count (spec §1.1):
    /// `ceil(bytes / (num_device_sms / 2)) < INT_MAX` for both buffers.
    pub fn check_device_sms(&self, num_device_sms: usize) -> Result<()> {
        let channels = (num_device_sms / 2) as u64;
        if channels == 0 {
            return Err(Error::InvalidConfig {
                field: "num_device_sms",
                value: num_device_sms.to_string(),
                fix: "a device has at least 2 SMs; pass the device's multiprocessor count".into(),
            });
        }
        for (field, bytes) in [
            ("num_nvl_bytes", self.num_nvl_bytes),
            ("num_rdma_bytes", self.num_rdma_bytes),
        ] {
            if bytes.div_ceil(channels) >= INT_MAX {
                return Err(Error::BufferTooLarge {
                    field,
                    bytes,
                    limit: (INT_MAX - 1) * channels,
                    why: "each of the device's channels addresses its share with 32-bit offsets",
                });
            }
        }
        Ok(())
    }

    /// Configuration-level checks of a normal-mode dispatch or combine (spec §1.8, §0, §4):
    /// the buffer config is valid; `num_sms` even; `num_topk <= 32`; `expert_alignment >= 1`;
    /// row bytes (`hidden * elem_bytes`) a multiple of 16; for `R > 8` combine, DeepEP's
    /// internode ring checks ([`Config::check_internode_combine`]).
    ///
    /// Not checked here: tensor shapes (plan module) and `num_worst_tokens` against the actual
    /// receive count, which is only known after the count exchange (the plan reports it).
    pub fn check_normal(&self, call: &NormalCall) -> Result<()> {
        self.validate()?;
        call.config.check_even_num_sms()?;
        if call.num_topk > NUM_MAX_TOPK_NORMAL {
            return Err(Error::TopkTooLarge {
                num_topk: call.num_topk,
                max: NUM_MAX_TOPK_NORMAL,
                mode: "normal",
            });
        }
        if call.expert_alignment == 0 {
            return Err(Error::ZeroExpertAlignment);
        }
        let row_bytes = call
            .hidden
            .checked_mul(call.elem_bytes)
            .ok_or(Error::SizeOverflow { what: "row bytes" })?;
        if !row_bytes.is_multiple_of(16) {
            return Err(Error::HiddenMisaligned {
                what: "row bytes (hidden * element size)",
                value: row_bytes,
                multiple: 16,
                why: "rows move in 16-byte vectors",
            });
        }
        if call.combine {
            call.config.check_internode_combine(self.num_ranks)?;
        }
        Ok(())
    }
}

/// The configuration-relevant parameters of a normal-mode call (spec §1.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalCall {
    /// Chunking (`config=None` → [`Config::dispatch_for`] / [`Config::combine_for`]).
    pub config: Config,
    /// `H`.
    pub hidden: usize,
    /// Bytes per element of `x`: 2 (BF16) or 1 (FP8).
    pub elem_bytes: usize,
    /// `K` (0 for a cached dispatch without top-k).
    pub num_topk: usize,
    /// `expert_alignment` (dispatch; 1 for combine).
    pub expert_alignment: usize,
    /// Whether this is a combine (enables the internode combine ring checks).
    pub combine: bool,
}
