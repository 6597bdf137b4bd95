//! Per-rank inputs of dispatch (spec §1.8, §1.9) and validation of routing data.

use half::bf16;

use crate::error::{Error, Result};
use crate::tensor::Tensor2;

/// Expert index type of `topk_idx` (DeepEP's `topk_idx_t`, int64 by default). `-1` = masked.
pub type ExpertIdx = i64;

/// Hidden states handed to dispatch: BF16 `[T, H]` or an FP8 e4m3 tuple with per-128-channel
/// float32 scales `[T, H/128]` (spec §1.8; normal kernels copy FP8 bytes and scales verbatim).
#[derive(Clone, Debug, PartialEq)]
pub enum Activations {
    /// BF16 rows `[T, H]`.
    Bf16(Tensor2<bf16>),
    /// FP8 e4m3 bytes `[T, H]` plus `scales [T, H/128]` (float32, `scale_inv` per block).
    Fp8 {
        /// Raw e4m3 bytes, one per channel.
        data: Tensor2<u8>,
        /// Per-token, per-128-channel dequantisation scales.
        scales: Tensor2<f32>,
    },
}

impl Activations {
    /// Number of tokens `T`.
    pub fn num_tokens(&self) -> usize {
        match self {
            Self::Bf16(x) => x.rows(),
            Self::Fp8 { data, .. } => data.rows(),
        }
    }

    /// Hidden size `H`.
    pub fn hidden(&self) -> usize {
        match self {
            Self::Bf16(x) => x.cols(),
            Self::Fp8 { data, .. } => data.cols(),
        }
    }
}

/// Everything one rank feeds into a dispatch: its tokens and their routing.
#[derive(Clone, Debug, PartialEq)]
pub struct RankInputs {
    /// Hidden states `[T, H]`.
    pub x: Activations,
    /// Top-k expert ids `[T, K]`; `-1` = masked slot.
    pub topk_idx: Tensor2<ExpertIdx>,
    /// Top-k weights `[T, K]` (float32).
    pub topk_weights: Tensor2<f32>,
}

impl RankInputs {
    /// Number of tokens `T`.
    pub fn num_tokens(&self) -> usize {
        self.topk_idx.rows()
    }

    /// Top-k `K`.
    pub fn num_topk(&self) -> usize {
        self.topk_idx.cols()
    }
}

/// Checks that every expert id in `topk_idx` lies in `[-1, num_experts)`.
///
/// Routing that lives on the host is checked by ep-rs itself before any transfer; callers whose
/// routing lives elsewhere (e.g. produced on the GPU) call this on a host copy when they want the
/// same guarantee. `rank` is only used to name the offender in the error.
pub fn validate_routing(
    topk_idx: &Tensor2<ExpertIdx>,
    num_experts: usize,
    rank: usize,
) -> Result<()> {
    for (token, row) in topk_idx.iter_rows().enumerate() {
        for (slot, &e) in row.iter().enumerate() {
            if e < -1 || e >= num_experts as i64 {
                return Err(Error::ExpertOutOfRange {
                    rank,
                    token,
                    slot,
                    expert: e,
                    num_experts,
                });
            }
        }
    }
    Ok(())
}

/// Checks that `inputs` is internally consistent: `x`, `topk_idx` and `topk_weights` agree on
/// `T`, `topk_weights` has the same `[T, K]` shape, FP8 scales are `[T, ceil(H/128)]`, and the
/// expert ids are in range.
pub fn validate_inputs(inputs: &RankInputs, num_experts: usize, rank: usize) -> Result<()> {
    let t = inputs.num_tokens();
    if inputs.x.num_tokens() != t {
        return Err(Error::ShapeMismatch {
            what: "x rows versus topk_idx rows",
            expected: format!("{t} tokens (rank {rank})"),
            found: format!("{} tokens", inputs.x.num_tokens()),
        });
    }
    if inputs.topk_weights.shape() != inputs.topk_idx.shape() {
        return Err(Error::ShapeMismatch {
            what: "topk_weights versus topk_idx",
            expected: format!("{:?} (rank {rank})", inputs.topk_idx.shape()),
            found: format!("{:?}", inputs.topk_weights.shape()),
        });
    }
    if let Activations::Fp8 { data, scales } = &inputs.x {
        let want = (data.rows(), data.cols().div_ceil(128));
        if scales.shape() != want {
            return Err(Error::ShapeMismatch {
                what: "FP8 scales",
                expected: format!("{want:?} (rank {rank})"),
                found: format!("{:?}", scales.shape()),
            });
        }
    }
    validate_routing(&inputs.topk_idx, num_experts, rank)
}
