//! Configuration-level checks of low-latency dispatch and combine (spec §1.9, §4).
//!
//! The plan module checks the tensors of a call (`x` is `[T <= N, H]`, `topk_idx` `[T, K]`, ...);
//! this module checks what the call asks of the buffer and of NVSHMEM.
//!
//! ep-rs enforces DeepEP's call contract, so a program accepted here is accepted by DeepEP and
//! vice versa, with one exception: DeepEP's kernels are instantiated only for the hidden sizes
//! of [`DEEPEP_LOW_LATENCY_HIDDEN_SIZES`]. That list is a template-instantiation limit, not a
//! semantic one, and ep-rs's own kernels need not share it, so [`BufferConfig::check_low_latency`]
//! does **not** enforce it; [`check_deepep_ll_hidden`] is there for callers that need DeepEP's
//! exact limits (e.g. comparing against DeepEP itself).

use crate::config::{
    BufferConfig, NUM_MAX_DISPATCH_TOKENS_PER_RANK, NUM_MAX_TOPK_LOW_LATENCY, NvshmemResources,
};
use crate::error::{Error, Result};

/// Hidden sizes DeepEP's low-latency kernels are compiled for (spec §0).
pub const DEEPEP_LOW_LATENCY_HIDDEN_SIZES: [usize; 8] =
    [2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192];

/// The configuration-relevant parameters of a low-latency dispatch or combine (spec §1.9).
/// For a combine, `use_fp8`, `round_scale` and `use_ue8m0` are false.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowLatencyCall {
    /// `N`: `num_max_dispatch_tokens_per_rank`.
    pub num_max_dispatch_tokens_per_rank: usize,
    /// `H`.
    pub hidden: usize,
    /// `E`.
    pub num_experts: usize,
    /// `K`.
    pub num_topk: usize,
    /// Dispatch casts to FP8 e4m3 with per-128-channel scales.
    pub use_fp8: bool,
    /// Scales rounded to powers of two.
    pub round_scale: bool,
    /// Scales stored as UE8M0 bytes (needs `round_scale`).
    pub use_ue8m0: bool,
}

impl BufferConfig {
    /// Checks a low-latency call against this buffer and the NVSHMEM resources in effect
    /// (`nvshmem` = [`crate::config::EnvPlan::resources`]), first failure returned:
    /// - the buffer config is valid and in low-latency mode;
    /// - `E % R == 0`; RC QPs per peer `>= L = E / R` (each local expert has its own QP in
    ///   DeepEP; the README asks for exactly `L`);
    /// - `1 <= N <= 1024` (spec §3.6) and `NVSHMEM_QP_DEPTH >= 2 * (N + 1)` (spec §4,
    ///   conformance case 18: depth 1024 allows N = 511, rejects N = 512);
    /// - `(R * N) % 4 == 0`; `K <= 11`;
    /// - `H % 128 == 0` (per-128-channel scales and LogFMT meta), which also makes rows
    ///   multiples of 16 bytes; FP8: `H % 512 == 0`; `use_ue8m0` requires `round_scale`.
    ///
    /// Not enforced: DeepEP's hidden-size list (see the module docs).
    pub fn check_low_latency(
        &self,
        call: &LowLatencyCall,
        nvshmem: &NvshmemResources,
    ) -> Result<()> {
        self.validate()?;
        if !self.low_latency_mode {
            return Err(Error::NotLowLatencyMode);
        }
        let r = self.num_ranks;
        let n = call.num_max_dispatch_tokens_per_rank;
        if call.num_experts == 0 || !call.num_experts.is_multiple_of(r) {
            return Err(Error::ExpertsNotDivisible {
                num_experts: call.num_experts,
                num_ranks: r,
            });
        }
        let num_local_experts = call.num_experts / r;
        if (nvshmem.num_rc_per_pe as usize) < num_local_experts {
            return Err(Error::TooFewQpsPerRank {
                num_rc_per_pe: nvshmem.num_rc_per_pe,
                num_local_experts,
            });
        }
        if n == 0 || n > NUM_MAX_DISPATCH_TOKENS_PER_RANK {
            return Err(Error::DispatchTokensOutOfRange {
                num_max_dispatch_tokens_per_rank: n,
                max: NUM_MAX_DISPATCH_TOKENS_PER_RANK,
            });
        }
        let needed = 2 * (n as u64 + 1);
        if u64::from(nvshmem.qp_depth) < needed {
            return Err(Error::QpDepthTooSmall {
                depth: nvshmem.qp_depth,
                needed,
                num_max_dispatch_tokens_per_rank: n,
            });
        }
        if !(r * n).is_multiple_of(4) {
            return Err(Error::PackedRowsMisaligned {
                num_ranks: r,
                num_max_dispatch_tokens_per_rank: n,
            });
        }
        if call.num_topk > NUM_MAX_TOPK_LOW_LATENCY {
            return Err(Error::TopkTooLarge {
                num_topk: call.num_topk,
                max: NUM_MAX_TOPK_LOW_LATENCY,
                mode: "low-latency",
            });
        }
        if call.hidden == 0 || !call.hidden.is_multiple_of(128) {
            return Err(Error::HiddenMisaligned {
                what: "hidden",
                value: call.hidden,
                multiple: 128,
                why: "low-latency messages carry one scale / LogFMT meta per 128 channels",
            });
        }
        if call.use_fp8 && !call.hidden.is_multiple_of(512) {
            return Err(Error::HiddenMisaligned {
                what: "hidden",
                value: call.hidden,
                multiple: 512,
                why: "low-latency FP8 casts 512 channels per step and UE8M0 packs 4 scales per int32",
            });
        }
        if call.use_ue8m0 && !call.round_scale {
            return Err(Error::Ue8m0WithoutRoundScale);
        }
        Ok(())
    }
}

/// DeepEP's hidden-size limit of its low-latency kernels (spec §0); not enforced by
/// [`BufferConfig::check_low_latency`].
pub fn check_deepep_ll_hidden(hidden: usize) -> Result<()> {
    if DEEPEP_LOW_LATENCY_HIDDEN_SIZES.contains(&hidden) {
        Ok(())
    } else {
        Err(Error::Unsupported(format!(
            "DeepEP's low-latency kernels are compiled for hidden sizes {DEEPEP_LOW_LATENCY_HIDDEN_SIZES:?}, \
             not {hidden}; ep-rs's kernels accept any multiple of 128"
        )))
    }
}
