//! Normal-mode combine numerics shared by intranode and internode (spec §2.2, §2.3, §3.4),
//! and the in-place rewrite of send heads that combine performs on a handle (spec §3.4, §7.1).
//!
//! Combine is an **unweighted** sum: every contribution is widened to f32, summed in a fixed
//! order after the biases, and rounded once to BF16 (round to nearest even, as CUDA's
//! `__float2bfloat16`). The order is part of the result, so it lives here, once.

use std::ops::Range;

use half::bf16;

use crate::error::{Error, Result};
use crate::tensor::Tensor2;

/// What one rank hands to a normal-mode combine (spec §1.8 `combine(x, handle, topk_weights, bias)`).
#[derive(Clone, Copy, Debug)]
pub struct CombineArgs<'a> {
    /// `[num_recv, H]` BF16, row `j` aligned with row `j` of this rank's dispatch `recv_x`
    /// (including the tail rows when the dispatch used `num_worst_tokens`).
    pub x: &'a Tensor2<bf16>,
    /// `[num_recv, K]` f32 weights aligned like `x`; reduced separately (plain sum).
    pub topk_weights: Option<&'a Tensor2<f32>>,
    /// 0, 1 or 2 BF16 tensors `[T, H]` over this rank's *original* tokens, added once per token.
    pub bias: &'a [Tensor2<bf16>],
}

/// What combine gives back to a rank (spec §1.8).
#[derive(Clone, Debug, PartialEq)]
pub struct CombineOutput {
    /// `[T, H]` BF16, in the rank's original token order.
    pub combined_x: Tensor2<bf16>,
    /// `[T, K]` f32, when `topk_weights` were given.
    pub combined_topk_weights: Option<Tensor2<f32>>,
}

/// Sentinel "next valid head" for a run of skipped tokens with no valid head after it in the
/// channel (`1 << 25`, spec §3.4).
pub const SEND_HEAD_SENTINEL: i32 = 1 << 25;

/// Starts a row's f32 accumulator: `f32(b0) + f32(b1)`, an absent bias reading as `+0.0`
/// (DeepEP loads a zero vector for a missing bias, so the start is never `-0.0`).
pub fn init_accumulator(acc: &mut [f32], b0: Option<&[bf16]>, b1: Option<&[bf16]>) {
    for (i, a) in acc.iter_mut().enumerate() {
        let v0 = b0.map_or(0.0, |b| b[i].to_f32());
        let v1 = b1.map_or(0.0, |b| b[i].to_f32());
        *a = v0 + v1;
    }
}

/// Adds one BF16 contribution to a row's f32 accumulator.
pub fn accumulate(acc: &mut [f32], contribution: &[bf16]) {
    for (a, &y) in acc.iter_mut().zip(contribution) {
        *a += y.to_f32();
    }
}

/// Rounds a row's accumulator to BF16 (round to nearest even).
pub fn round_row(acc: &[f32], out: &mut [bf16]) {
    for (o, &a) in out.iter_mut().zip(acc) {
        *o = crate::numerics::bf16::round(a);
    }
}

/// One combined row: `bf16(f32(b0) + f32(b1) + Σ f32(y))`, contributions in the given order
/// (ascending rank intranode, ascending node internode: spec §2.2, §3.4, §3.5).
pub fn combine_row(
    b0: Option<&[bf16]>,
    b1: Option<&[bf16]>,
    contributions: &[&[bf16]],
    acc: &mut [f32],
    out: &mut [bf16],
) {
    init_accumulator(acc, b0, b1);
    for y in contributions {
        accumulate(acc, y);
    }
    round_row(acc, out);
}

/// Combined top-k weights of one token: `0.0 + Σ w` in f32, contributions in the given order.
pub fn combine_weights(contributions: &[&[f32]], out: &mut [f32]) {
    out.iter_mut().for_each(|o| *o = 0.0);
    for w in contributions {
        for (o, &v) in out.iter_mut().zip(w.iter()) {
            *o += v;
        }
    }
}

/// Rewrites skipped heads of one column segment the way `cached_notify_combine` does (spec
/// §3.4): walking backwards, each `-1` (any negative) becomes `-(next valid head) - 1`, where
/// the next valid head is the nearest later non-negative entry in the segment, or
/// [`SEND_HEAD_SENTINEL`]. Receivers decode `-v - 1` to advance past tokens they do not need.
///
/// Idempotent: every negative entry is recomputed from the non-negative ones, which never
/// change (spec §7.1: repeated combines with one handle work).
pub fn rewrite_heads(heads: &mut Tensor2<i32>, segments: &[Range<usize>]) {
    for col in 0..heads.cols() {
        for seg in segments {
            let mut next_valid = SEND_HEAD_SENTINEL;
            for t in seg.clone().rev() {
                let h = heads.get(t, col);
                if h >= 0 {
                    next_valid = h;
                } else {
                    heads.set(t, col, -next_valid - 1);
                }
            }
        }
    }
}

/// Checks the per-rank combine arguments common to intranode and internode combine:
/// at most two biases of shape `[T_s, H]`, one hidden size, and `topk_weights` given on every
/// rank or on none (the kernels read peers' weights whenever their own are given).
///
/// `num_tokens[s]` is rank `s`'s original token count, `num_recv[s]` its dispatch row count.
/// Returns `(H, Some(K))` or `(H, None)`.
pub(crate) fn check_combine_args(
    args: &[CombineArgs<'_>],
    num_tokens: &[usize],
    num_recv: &[usize],
) -> Result<(usize, Option<usize>)> {
    let shapes: Vec<_> = args
        .iter()
        .map(|a| crate::executor::CombineShapes {
            x: a.x.shape(),
            topk_weights: a.topk_weights.map(Tensor2::shape),
            bias: a.bias.iter().map(Tensor2::shape).collect(),
        })
        .collect();
    check_combine_shapes(&shapes, num_tokens, num_recv)
}

/// `check_combine_args` over the inputs' shapes (every backend's combine): `args[i]` is
/// local rank `i`'s, `num_tokens[i]` its original token count, `num_recv[i]` its dispatch row
/// count. Returns `(H, Some(K))` or `(H, None)`.
pub fn check_combine_shapes(
    args: &[crate::executor::CombineShapes],
    num_tokens: &[usize],
    num_recv: &[usize],
) -> Result<(usize, Option<usize>)> {
    let hidden = args.first().map_or(0, |a| a.x.1);
    let with_weights = args.first().is_some_and(|a| a.topk_weights.is_some());
    let num_topk = args.first().and_then(|a| a.topk_weights).map(|w| w.1);
    for (s, a) in args.iter().enumerate() {
        if a.x.1 != hidden {
            return Err(Error::ShapeMismatch {
                what: "combine x hidden size (must agree across ranks)",
                expected: format!("{hidden} columns"),
                found: format!("{} columns on rank {s}", a.x.1),
            });
        }
        if a.x.0 != num_recv[s] {
            return Err(Error::ShapeMismatch {
                what: "combine x rows versus the dispatch's received rows",
                expected: format!("{} rows on rank {s}", num_recv[s]),
                found: format!("{} rows", a.x.0),
            });
        }
        if a.topk_weights.is_some() != with_weights {
            return Err(Error::ShapeMismatch {
                what: "combine topk_weights (give them on every rank or on none)",
                expected: format!("topk_weights given = {with_weights}"),
                found: format!("given = {} on rank {s}", a.topk_weights.is_some()),
            });
        }
        if let (Some(w), Some(k)) = (a.topk_weights, num_topk)
            && w != (num_recv[s], k)
        {
            return Err(Error::ShapeMismatch {
                what: "combine topk_weights",
                expected: format!("({}, {k}) on rank {s}", num_recv[s]),
                found: format!("{w:?}"),
            });
        }
        if a.bias.len() > 2 {
            return Err(Error::TooManyBiases {
                rank: s,
                found: a.bias.len(),
            });
        }
        for &b in &a.bias {
            if b != (num_tokens[s], hidden) {
                return Err(Error::ShapeMismatch {
                    what: "combine bias",
                    expected: format!("({}, {hidden}) on rank {s}", num_tokens[s]),
                    found: format!("{b:?}"),
                });
            }
        }
    }
    Ok((hidden, num_topk))
}
