//! Reference oracle for low-latency dispatch and combine (spec §2.4, §2.5, §2.7).
//!
//! Written from the spec's definitions, as plainly as possible, and independently of
//! [`crate::plan::low_latency`] and [`crate::numerics::fp8`]: it has its own argument checks,
//! its own FP8 cast (nearest of the e4m3 values, built from the format's definition) and its
//! own scale computation, so that the two implementations check each other. Only the output
//! types are shared.
//!
//! The oracle deliberately picks a **different legal placement** from the plan: blocks in
//! *descending* source rank, rows inside a block in *descending* `(token, top-k slot)`. The
//! spec makes order free (multisets keyed by `(source, src_info)`), so plan and oracle agree
//! only through [`crate::plan::low_latency::canonicalize`] — which is thereby tested too.

use half::bf16;

use crate::error::{Error, Result};
use crate::plan::low_latency::{
    LlDispatchOutput, LlHandle, LlParams, LlRecvX, packed_zeros_bf16, packed_zeros_f32,
    packed_zeros_i32, packed_zeros_u8,
};
use crate::routing::{Activations, RankInputs};
use crate::tensor::{Tensor2, Tensor3};

/// Checks the arguments of spec §1.9 the oracle relies on; the same conditions and error
/// variants as the plan's validation, written again.
fn check(inputs: &[RankInputs], p: &LlParams, for_dispatch: bool) -> Result<()> {
    let r = inputs.len();
    if r == 0 {
        return Err(Error::InvalidRankCount {
            num_ranks: 0,
            need: "at least one rank",
        });
    }
    if !p.masked_ranks.is_empty() && p.masked_ranks.len() != r {
        return Err(Error::RankCountMismatch {
            expected: r,
            found: p.masked_ranks.len(),
        });
    }
    if p.num_experts == 0 {
        return Err(Error::InvalidConfig {
            field: "num_experts",
            value: "0".into(),
            fix: "pass at least one expert per rank".into(),
        });
    }
    if !p.num_experts.is_multiple_of(r) {
        return Err(Error::ExpertsNotDivisible {
            num_experts: p.num_experts,
            num_ranks: r,
        });
    }
    if p.use_ue8m0 && !p.round_scale {
        return Err(Error::Ue8m0WithoutRoundScale);
    }
    let n = p.num_max_dispatch_tokens_per_rank;
    if !(r * n).is_multiple_of(4) {
        return Err(Error::PackedRowsMisaligned {
            num_ranks: r,
            num_max_dispatch_tokens_per_rank: n,
        });
    }
    let h0 = inputs[0].x.hidden();
    if for_dispatch {
        if h0 == 0 || !h0.is_multiple_of(128) {
            return Err(Error::HiddenMisaligned {
                what: "hidden",
                value: h0,
                multiple: 128,
                why: "low-latency rows are moved in 128-channel blocks",
            });
        }
        if p.use_fp8 && !h0.is_multiple_of(512) {
            return Err(Error::HiddenMisaligned {
                what: "hidden",
                value: h0,
                multiple: 512,
                why: "FP8 low-latency dispatch packs scales four to an int32",
            });
        }
    }
    for (rank, inp) in inputs.iter().enumerate() {
        let t = inp.topk_idx.rows();
        if for_dispatch {
            let Activations::Bf16(x) = &inp.x else {
                return Err(Error::LlExpectsBf16 { rank });
            };
            if x.cols() != h0 {
                return Err(Error::ShapeMismatch {
                    what: "hidden size across ranks",
                    expected: format!("{h0} (rank 0)"),
                    found: format!("{} (rank {rank})", x.cols()),
                });
            }
            if x.rows() != t {
                return Err(Error::ShapeMismatch {
                    what: "x rows versus topk_idx rows",
                    expected: format!("{t} tokens (rank {rank})"),
                    found: format!("{} tokens", x.rows()),
                });
            }
        }
        if inp.topk_weights.shape() != inp.topk_idx.shape() {
            return Err(Error::ShapeMismatch {
                what: "topk_weights versus topk_idx",
                expected: format!("{:?} (rank {rank})", inp.topk_idx.shape()),
                found: format!("{:?}", inp.topk_weights.shape()),
            });
        }
        for token in 0..t {
            for slot in 0..inp.topk_idx.cols() {
                let e = inp.topk_idx.get(token, slot);
                if e < -1 || e >= p.num_experts as i64 {
                    return Err(Error::ExpertOutOfRange {
                        rank,
                        token,
                        slot,
                        expert: e,
                        num_experts: p.num_experts,
                    });
                }
            }
        }
        if t > n {
            return Err(Error::LlTooManyTokens {
                rank,
                num_tokens: t,
                num_max_dispatch_tokens_per_rank: n,
            });
        }
        if inp.topk_idx.cols() > 11 {
            return Err(Error::TopkTooLarge {
                num_topk: inp.topk_idx.cols(),
                max: 11,
                mode: "low-latency",
            });
        }
        if for_dispatch {
            for expert in 0..p.num_experts {
                let count = inp
                    .topk_idx
                    .data()
                    .iter()
                    .filter(|&&e| e == expert as i64)
                    .count();
                if count > n {
                    return Err(Error::LlSlotOverflow {
                        rank,
                        expert,
                        count,
                        num_max_dispatch_tokens_per_rank: n,
                    });
                }
            }
        }
    }
    Ok(())
}

fn masked(p: &LlParams, r: usize) -> bool {
    !p.masked_ranks.is_empty() && p.masked_ranks[r]
}

// ---- FP8, from the definitions -------------------------------------------------------------

/// Value of the non-negative e4m3 code `c` (0..=0x7e), straight from the format definition:
/// exponent field 0 → `(m/8) · 2^-6`, otherwise `(1 + m/8) · 2^(exp - 7)`.
fn e4m3_value(c: u8) -> f64 {
    let exp = i32::from(c >> 3);
    let m = f64::from(c & 7);
    if exp == 0 {
        m / 8.0 * 2f64.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(exp - 7)
    }
}

/// The 127 finite non-negative e4m3 values, indexed by code.
fn e4m3_values() -> &'static [f64] {
    static VALUES: std::sync::OnceLock<Vec<f64>> = std::sync::OnceLock::new();
    VALUES.get_or_init(|| (0u8..=0x7e).map(e4m3_value).collect())
}

/// e4m3 encoding as "the nearest finite e4m3 value, ties to the even code": values past 448
/// are nearest to 448 (saturation), NaN maps to 0x7f, the sign is kept (also for zero).
fn to_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80 } else { 0x00 };
    let a = f64::from(v.abs());
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // The finite magnitudes grow with the code, so find the first code whose value is ≥ a and
    // compare it with the one below.
    let values = e4m3_values();
    let above = values.partition_point(|&x| x < a).min(0x7e);
    let best = if above == 0 {
        0
    } else {
        let below = above - 1;
        let (d_below, d_above) = (a - values[below], values[above] - a);
        if d_below < d_above {
            below
        } else if d_above < d_below {
            above
        } else if below % 2 == 0 {
            below
        } else {
            above
        }
    };
    sign | best as u8
}

/// Decodes an e4m3 code (both NaN codes → NaN).
fn from_e4m3(c: u8) -> f32 {
    if c & 0x7f == 0x7f {
        return f32::NAN;
    }
    let v = e4m3_value(c & 0x7f) as f32;
    if c & 0x80 != 0 { -v } else { v }
}

/// One token's cast (spec §2.4): e4m3 bytes and `scale_inv` per 128 channels.
fn cast_token(x: &[bf16], round_scale: bool) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::with_capacity(x.len());
    let mut scale_invs = Vec::new();
    for block in x.chunks(128) {
        let mut amax = 1e-4f32;
        for v in block {
            let a = v.to_f32().abs();
            if a > amax {
                amax = a;
            }
        }
        // The kernel multiplies by the f32 constant 1/448 (the spec writes amax / 448).
        let ratio = amax * (1.0f32 / 448.0);
        let (scale, scale_inv) = if round_scale {
            // The smallest power of two not below amax / 448.
            let mut p = 1.0f32;
            while p < ratio {
                p *= 2.0;
            }
            while p / 2.0 >= ratio {
                p /= 2.0;
            }
            (1.0 / p, p)
        } else {
            (448.0 / amax, ratio)
        };
        for v in block {
            let product: f32 = v.to_f32() * scale;
            bytes.push(to_e4m3(product));
        }
        scale_invs.push(scale_inv);
    }
    (bytes, scale_invs)
}

/// The UE8M0 byte of a power-of-two scale: its biased exponent, found by counting.
fn ue8m0(scale_inv: f32) -> u8 {
    let mut e: i32 = 0;
    let mut p = 1.0f64;
    let s = f64::from(scale_inv);
    while p < s {
        p *= 2.0;
        e += 1;
    }
    while p > s {
        p /= 2.0;
        e -= 1;
    }
    (e + 127) as u8
}

// ---- dispatch ------------------------------------------------------------------------------

/// Low-latency dispatch outputs of every rank (`None` for masked ranks), placed in the
/// oracle's order (descending source, descending `(t, k)`).
pub fn dispatch(inputs: &[RankInputs], p: &LlParams) -> Result<Vec<Option<LlDispatchOutput>>> {
    check(inputs, p, true)?;
    let casts = cast_all(inputs, p);
    (0..inputs.len())
        .map(|d| dispatch_unchecked(inputs, p, d, &casts))
        .collect()
}

/// Low-latency dispatch outputs of receiver `rank` alone.
pub fn dispatch_rank(
    inputs: &[RankInputs],
    p: &LlParams,
    rank: usize,
) -> Result<Option<LlDispatchOutput>> {
    check(inputs, p, true)?;
    if rank >= inputs.len() {
        return Err(Error::RankOutOfRange {
            rank,
            num_ranks: inputs.len(),
        });
    }
    dispatch_unchecked(inputs, p, rank, &cast_all(inputs, p))
}

/// Every token's FP8 cast (empty without FP8): each token is cast once, as its sender does.
fn cast_all(inputs: &[RankInputs], p: &LlParams) -> Vec<Vec<(Vec<u8>, Vec<f32>)>> {
    inputs
        .iter()
        .map(|inp| match &inp.x {
            Activations::Bf16(x) if p.use_fp8 => (0..x.rows())
                .map(|t| cast_token(x.row(t), p.round_scale))
                .collect(),
            _ => Vec::new(),
        })
        .collect()
}

fn dispatch_unchecked(
    inputs: &[RankInputs],
    p: &LlParams,
    d: usize,
    casts: &[Vec<(Vec<u8>, Vec<f32>)>],
) -> Result<Option<LlDispatchOutput>> {
    if masked(p, d) {
        return Ok(None);
    }
    let r = inputs.len();
    let l_count = p.num_experts / r;
    let n = p.num_max_dispatch_tokens_per_rank;
    let h = inputs[0].x.hidden();
    let rows = r * n;

    // Only the arrays of the requested format get rows (the others stay empty).
    let sized = |yes: bool, cols: usize| if yes { (rows, cols) } else { (0, 0) };
    let (bf, fp, fp_f32, fp_ue) = (
        sized(!p.use_fp8, h),
        sized(p.use_fp8, h),
        sized(p.use_fp8 && !p.use_ue8m0, h / 128),
        sized(p.use_fp8 && p.use_ue8m0, h / 512),
    );
    // The packed arrays are mostly empty: zeroed memory, touched only where rows land.
    let mut x_bf16 = packed_zeros_bf16(l_count, bf.0, bf.1);
    let mut x_fp8 = packed_zeros_u8(l_count, fp.0, fp.1);
    let mut s_f32 = packed_zeros_f32(l_count, fp_f32.0, fp_f32.1);
    let mut s_ue8m0 = packed_zeros_i32(l_count, fp_ue.0, fp_ue.1);
    let mut src_info = Tensor2::filled(l_count, rows, -1i32);
    let mut layout_range = Tensor2::filled(l_count, r, 0i64);
    let mut recv_count = vec![0i32; l_count];

    for (l, recv_count) in recv_count.iter_mut().enumerate() {
        let expert = (d * l_count + l) as i64;
        let mut row = 0usize;
        for s in (0..r).rev() {
            let begin = row;
            if !masked(p, s) {
                let inp = &inputs[s];
                for t in (0..inp.topk_idx.rows()).rev() {
                    for k in (0..inp.topk_idx.cols()).rev() {
                        if inp.topk_idx.get(t, k) != expert {
                            continue;
                        }
                        src_info.set(l, row, t as i32);
                        if p.use_fp8 {
                            let (bytes, scales) = &casts[s][t];
                            x_fp8.row_mut(l, row).copy_from_slice(bytes);
                            if p.use_ue8m0 {
                                for (i, &sc) in scales.iter().enumerate() {
                                    let word = s_ue8m0.get(l, row, i / 4) as u32;
                                    let word = word | (u32::from(ue8m0(sc)) << (8 * (i % 4)));
                                    s_ue8m0.set(l, row, i / 4, word as i32);
                                }
                            } else {
                                s_f32.row_mut(l, row).copy_from_slice(scales);
                            }
                        } else if let Activations::Bf16(x) = &inp.x {
                            x_bf16.row_mut(l, row).copy_from_slice(x.row(t));
                        }
                        row += 1;
                    }
                }
            }
            let count = row - begin;
            layout_range.set(l, s, ((begin as i64) << 32) | count as i64);
        }
        *recv_count = row as i32;
    }

    let recv_x = match (p.use_fp8, p.use_ue8m0) {
        (false, _) => LlRecvX::Bf16(x_bf16),
        (true, false) => LlRecvX::Fp8 {
            data: x_fp8,
            scales: s_f32,
        },
        (true, true) => LlRecvX::Fp8Ue8m0 {
            data: x_fp8,
            scales: s_ue8m0,
        },
    };
    Ok(Some(LlDispatchOutput {
        recv_x,
        recv_count,
        handle: LlHandle {
            src_info,
            layout_range,
            num_max_dispatch_tokens_per_rank: n,
            hidden: h,
            num_experts: p.num_experts,
        },
    }))
}

/// Dequantised (or widened) received row, from the definitions: `f32(e4m3) · scale_inv`, with
/// UE8M0 bytes read as `2^(byte - 127)`. `None` if `(l, row)` is outside the arrays or the
/// scales do not cover the row.
pub fn received_row_f32(out: &LlDispatchOutput, l: usize, row: usize) -> Option<Vec<f32>> {
    // Matrix `l` holds `row`, with at least `need_cols` columns.
    let fits = |(n, rows, cols): (usize, usize, usize), need_cols: usize| {
        l < n && row < rows && cols >= need_cols
    };
    match &out.recv_x {
        LlRecvX::Bf16(x) => {
            fits(x.shape(), 0).then(|| x.row(l, row).iter().map(|v| v.to_f32()).collect())
        }
        LlRecvX::Fp8 { data: d, scales: s } => {
            if !fits(d.shape(), 0) || !fits(s.shape(), d.cols().div_ceil(128)) {
                return None;
            }
            Some(
                d.row(l, row)
                    .iter()
                    .enumerate()
                    .map(|(c, &b)| from_e4m3(b) * s.get(l, row, c / 128))
                    .collect(),
            )
        }
        LlRecvX::Fp8Ue8m0 { data: d, scales: s } => {
            if !fits(d.shape(), 0) || !fits(s.shape(), d.cols().div_ceil(512)) {
                return None;
            }
            Some(
                d.row(l, row)
                    .iter()
                    .enumerate()
                    .map(|(c, &b)| {
                        let i = c / 128;
                        let byte = (s.get(l, row, i / 4) as u32 >> (8 * (i % 4))) & 0xff;
                        let scale = 2f64.powi(byte as i32 - 127) as f32;
                        from_e4m3(b) * scale
                    })
                    .collect(),
            )
        }
    }
}

// ---- combine -------------------------------------------------------------------------------

/// Low-latency combine of every rank (spec §2.5), `None` for masked ranks:
/// `combined[t] = bf16(acc)`, `acc` accumulated over `k` in order, skipping `-1` and experts on
/// masked ranks, as `acc = fma(f32(y), w, acc)` (DeepEP's `acc += y * w` is compiled to a fused
/// multiply-add). `y` is the owner's expert output at the row of `(me, t)`: the first row, in
/// the owner's block for source `me`, whose `src_info` is `t`.
pub fn combine(
    inputs: &[RankInputs],
    handles: &[Option<LlHandle>],
    expert_out: &[Option<Tensor3<bf16>>],
    p: &LlParams,
) -> Result<Vec<Option<Tensor2<bf16>>>> {
    check(inputs, p, false)?;
    let r = inputs.len();
    if handles.len() != r || expert_out.len() != r {
        return Err(Error::RankCountMismatch {
            expected: r,
            found: handles.len().min(expert_out.len()),
        });
    }
    let l_count = p.num_experts / r;
    let hidden = handles
        .iter()
        .flatten()
        .map(|h| h.hidden)
        .next()
        .unwrap_or(128);
    for (owner, h) in handles.iter().enumerate() {
        let Some(h) = h else { continue };
        let rows = r * p.num_max_dispatch_tokens_per_rank;
        if h.layout_range.rows() != l_count
            || h.layout_range.cols() != r
            || h.src_info.rows() != l_count
            || h.src_info.cols() != rows
            || h.hidden != hidden
        {
            return Err(Error::ShapeMismatch {
                what: "combine handle",
                expected: format!(
                    "layout_range [{l_count}, {r}], src_info [{l_count}, {rows}], H {hidden}"
                ),
                found: format!(
                    "layout_range {:?}, src_info {:?}, H {} (rank {owner})",
                    h.layout_range.shape(),
                    h.src_info.shape(),
                    h.hidden
                ),
            });
        }
    }
    let mut result = Vec::with_capacity(r);
    for (me, inp) in inputs.iter().enumerate() {
        if masked(p, me) {
            result.push(None);
            continue;
        }
        let t_count = inp.topk_idx.rows();
        let mut out = Tensor2::filled(t_count, hidden, bf16::ZERO);
        for t in 0..t_count {
            let mut acc = vec![0f32; hidden];
            for k in 0..inp.topk_idx.cols() {
                let e = inp.topk_idx.get(t, k);
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                let owner = e / l_count;
                let l = e % l_count;
                if masked(p, owner) {
                    continue;
                }
                let missing = Error::LlMissingRow {
                    rank: me,
                    token: t,
                    expert: e,
                    owner,
                };
                let (Some(handle), Some(y)) = (&handles[owner], &expert_out[owner]) else {
                    return Err(missing);
                };
                let packed = handle.layout_range.get(l, me) as u64;
                let begin = (packed >> 32) as usize;
                let count = (packed & 0xffff_ffff) as usize;
                let row = (begin..begin + count)
                    .find(|&row| {
                        row < handle.src_info.cols() && handle.src_info.get(l, row) == t as i32
                    })
                    .ok_or(missing.clone())?;
                if l >= y.matrices() || row >= y.rows() || y.cols() != hidden {
                    return Err(missing);
                }
                let w = inp.topk_weights.get(t, k);
                for (c, a) in acc.iter_mut().enumerate() {
                    *a = y.get(l, row, c).to_f32().mul_add(w, *a);
                }
            }
            for (c, a) in acc.into_iter().enumerate() {
                out.set(t, c, bf16::from_f32(a));
            }
        }
        result.push(Some(out));
    }
    Ok(result)
}
