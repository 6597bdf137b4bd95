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

/// The shapes `(rows, cols)` of one rank's dispatch inputs, whatever holds them (host tensors
/// here, device tensors on the GPU): what the shape-level rules read, never the contents
/// (docs/buffer-api.md, step 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputShapes {
    /// `x`: `[T, H]`.
    pub x: (usize, usize),
    /// Whether `x` is FP8 e4m3 (with per-128 scales) rather than BF16.
    pub fp8: bool,
    /// FP8 scales, `[T, ceil(H / 128)]` (`None`: not given).
    pub x_scales: Option<(usize, usize)>,
    /// `topk_idx`, `[T, K]` (`None`: not given).
    pub topk_idx: Option<(usize, usize)>,
    /// `topk_weights`, `[T, K]` (`None`: not given).
    pub topk_weights: Option<(usize, usize)>,
}

impl InputShapes {
    /// Rank `rank`'s own rules: FP8 scales present and `[T, ceil(H/128)]`; with top-k, the ids
    /// present with `T` rows and the weights shaped like them.
    pub fn check(&self, rank: usize, with_topk: bool) -> Result<()> {
        let (t, h) = self.x;
        let missing = |what: &'static str, want: String| Error::ShapeMismatch {
            what,
            expected: format!("{want} (rank {rank})"),
            found: "none".into(),
        };
        if self.fp8 {
            let want = (t, h.div_ceil(128));
            match self.x_scales {
                None => return Err(missing("FP8 scales", format!("{want:?}"))),
                Some(s) if s != want => {
                    return Err(Error::ShapeMismatch {
                        what: "FP8 scales",
                        expected: format!("{want:?} (rank {rank})"),
                        found: format!("{s:?}"),
                    });
                }
                Some(_) => {}
            }
        }
        if !with_topk {
            return Ok(());
        }
        let idx = self
            .topk_idx
            .ok_or_else(|| missing("topk_idx", format!("[{t}, K]")))?;
        if idx.0 != t {
            return Err(Error::ShapeMismatch {
                what: "x rows versus topk_idx rows",
                expected: format!("{} tokens (rank {rank})", idx.0),
                found: format!("{t} tokens"),
            });
        }
        match self.topk_weights {
            None => Err(missing("topk_weights", format!("{idx:?}"))),
            Some(w) if w != idx => Err(Error::ShapeMismatch {
                what: "topk_weights versus topk_idx",
                expected: format!("{idx:?} (rank {rank})"),
                found: format!("{w:?}"),
            }),
            Some(_) => Ok(()),
        }
    }

    /// Rank `rank`'s inputs against the first rank's: one row kind (BF16 or FP8) and hidden
    /// size, and with top-k one `K`, across ranks.
    pub fn agree(&self, first: &Self, rank: usize, with_topk: bool) -> Result<()> {
        let kind = |s: &Self| if s.fp8 { "FP8" } else { "BF16" };
        if self.fp8 != first.fp8 || self.x.1 != first.x.1 {
            return Err(Error::ShapeMismatch {
                what: "activations (dtype and hidden size must agree across ranks)",
                expected: format!("{} x {}", kind(first), first.x.1),
                found: format!("{} x {} on rank {rank}", kind(self), self.x.1),
            });
        }
        let k = |s: &Self| s.topk_idx.map_or(0, |(_, k)| k);
        if with_topk && k(self) != k(first) {
            return Err(Error::ShapeMismatch {
                what: "top-k (must agree across ranks)",
                expected: format!("{} columns", k(first)),
                found: format!("{} columns on rank {rank}", k(self)),
            });
        }
        Ok(())
    }
}

impl Activations {
    /// The shapes of these rows (no top-k).
    pub fn shapes(&self) -> InputShapes {
        match self {
            Self::Bf16(x) => InputShapes {
                x: x.shape(),
                fp8: false,
                x_scales: None,
                topk_idx: None,
                topk_weights: None,
            },
            Self::Fp8 { data, scales } => InputShapes {
                x: data.shape(),
                fp8: true,
                x_scales: Some(scales.shape()),
                topk_idx: None,
                topk_weights: None,
            },
        }
    }
}

impl RankInputs {
    /// The shapes of these inputs.
    pub fn shapes(&self) -> InputShapes {
        InputShapes {
            topk_idx: Some(self.topk_idx.shape()),
            topk_weights: Some(self.topk_weights.shape()),
            ..self.x.shapes()
        }
    }
}

/// Checks that `inputs` is internally consistent: `x`, `topk_idx` and `topk_weights` agree on
/// `T`, `topk_weights` has the same `[T, K]` shape, FP8 scales are `[T, ceil(H/128)]`
/// ([`InputShapes::check`]), and the expert ids are in range.
pub fn validate_inputs(inputs: &RankInputs, num_experts: usize, rank: usize) -> Result<()> {
    inputs.shapes().check(rank, true)?;
    validate_routing(&inputs.topk_idx, num_experts, rank)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp8(t: usize, h: usize, k: usize) -> InputShapes {
        InputShapes {
            x: (t, h),
            fp8: true,
            x_scales: Some((t, h.div_ceil(128))),
            topk_idx: Some((t, k)),
            topk_weights: Some((t, k)),
        }
    }

    fn what(r: Result<()>) -> &'static str {
        match r {
            Err(Error::ShapeMismatch { what, .. }) => what,
            other => panic!("expected a shape mismatch, got {other:?}"),
        }
    }

    #[test]
    fn each_input_shape_rule_is_a_typed_error() {
        let ok = fp8(10, 300, 4);
        ok.check(0, true).unwrap();
        let cases = [
            (
                InputShapes {
                    x_scales: None,
                    ..ok
                },
                "FP8 scales",
            ),
            (
                InputShapes {
                    x_scales: Some((10, 2)),
                    ..ok
                },
                "FP8 scales",
            ),
            (
                InputShapes {
                    topk_idx: None,
                    ..ok
                },
                "topk_idx",
            ),
            (
                InputShapes {
                    topk_idx: Some((9, 4)),
                    ..ok
                },
                "x rows versus topk_idx rows",
            ),
            (
                InputShapes {
                    topk_weights: None,
                    ..ok
                },
                "topk_weights",
            ),
            (
                InputShapes {
                    topk_weights: Some((10, 3)),
                    ..ok
                },
                "topk_weights versus topk_idx",
            ),
        ];
        for (shapes, want) in cases {
            assert_eq!(what(shapes.check(3, true)), want);
        }
        // Without top-k the ids and weights are not looked at; BF16 has no scales.
        InputShapes {
            topk_idx: None,
            topk_weights: None,
            ..ok
        }
        .check(0, false)
        .unwrap();
        InputShapes {
            fp8: false,
            x_scales: None,
            ..ok
        }
        .check(0, true)
        .unwrap();
    }

    #[test]
    fn ranks_agree_on_row_kind_hidden_and_top_k() {
        let first = fp8(10, 256, 4);
        fp8(7, 256, 4).agree(&first, 1, true).unwrap();
        let bf16 = InputShapes {
            fp8: false,
            x_scales: None,
            ..first
        };
        assert!(what(bf16.agree(&first, 1, true)).starts_with("activations"));
        assert!(what(fp8(10, 128, 4).agree(&first, 1, true)).starts_with("activations"));
        assert!(what(fp8(10, 256, 2).agree(&first, 2, true)).starts_with("top-k"));
        fp8(10, 256, 2).agree(&first, 2, false).unwrap();
        // The real inputs' shapes are what their tensors say.
        let inp = RankInputs {
            x: Activations::Bf16(Tensor2::zeros(3, 16)),
            topk_idx: Tensor2::filled(3, 2, -1),
            topk_weights: Tensor2::filled(3, 2, 0.0),
        };
        assert_eq!(
            inp.shapes(),
            InputShapes {
                x: (3, 16),
                fp8: false,
                x_scales: None,
                topk_idx: Some((3, 2)),
                topk_weights: Some((3, 2)),
            }
        );
    }
}
