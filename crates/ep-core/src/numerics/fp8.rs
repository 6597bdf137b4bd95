//! FP8 e4m3 and the per-token, per-128-channel casts of low-latency dispatch (spec §2.4, §6.1).
//!
//! # The e4m3 format (OCP "e4m3fn", `torch.float8_e4m3fn`, CUDA `__NV_E4M3`)
//!
//! ```text
//!   bit  7    6 5 4 3    2 1 0
//!       sign  exponent   mantissa        bias 7, no infinities
//!   exponent 0:      ±m · 2^-9            (subnormals, m = 0..=7; 0x00 = +0, 0x80 = -0)
//!   exponent 1..=15: ±(1 + m/8) · 2^(e-7) (0x7e = 448 is the largest finite value)
//!   0x7f, 0xff:      NaN                  (exponent 15 with mantissa 7)
//! ```
//!
//! [`e4m3_encode`] is `cvt.rn.satfinite.e4m3x2.f32` (what `__nv_cvt_float2_to_fp8x2(...,
//! __NV_SATFINITE, __NV_E4M3)` compiles to): round to nearest, ties to even, from the f32 value
//! in one step; magnitudes beyond 448 (infinities included) saturate to ±448; NaN becomes 0x7f.
//!
//! # The low-latency cast (spec §2.4, DeepEP `internode_ll.cu` + `utils.cuh`)
//!
//! Per token and per block of 128 channels: `amax = max(1e-4, max |x|)` (NaNs ignored, as
//! `fmaxf` does), then
//! - `round_scale = false`: `scale_inv = amax * f32(1/448)`, `scale = 448 / amax`;
//! - `round_scale = true`: `e = ceil(log2(amax * f32(1/448)))` read off the f32 bits,
//!   `scale_inv = 2^e`, `scale = 2^-e`;
//!
//! then `q = e4m3(f32(x) * scale)` with the product rounded to f32 first (two roundings, as on
//! the GPU), and the stored scale is `scale_inv`. The spec writes `scale_inv = amax / 448`; the
//! kernel multiplies by the f32 reciprocal `1/448`, which differs from the division in the last
//! bit for some `amax` — we follow the kernel, bit for bit (see [`block_scale`]). DeepEP's test
//! helper `per_token_cast_to_fp8` ([`per_token_cast_to_fp8`]) divides instead: its e4m3 bytes are
//! identical to the kernel's non-rounded cast (both compute `x * f32(448/amax)`), its scales may
//! differ in the last bit. The plan uses the kernel's cast ([`cast_row`]).
//!
//! # UE8M0 scales (spec §2.4, §6.1)
//!
//! With `use_ue8m0` (which requires `round_scale`) each scale is stored as one unsigned byte, the
//! biased f32 exponent of `scale_inv` (`bits >> 23`; exact because `scale_inv` is a power of two),
//! and four bytes pack into one int32: scale `i` of a token lives in pack `i / 4`, byte `i % 4`
//! (byte 0 = least significant, i.e. little-endian memory order). Unpacking is `f32::from_bits(byte
//! << 23)`.

use half::bf16;

use crate::error::{Error, Result};
use crate::tensor::Tensor2;

/// Largest finite e4m3 value (`0x7e`); saturation target.
pub const E4M3_MAX: f32 = 448.0;
/// Code of +448, the largest finite e4m3 value.
pub const E4M3_MAX_CODE: u8 = 0x7e;
/// The NaN code the encoder produces (0xff is the other NaN code).
pub const E4M3_NAN: u8 = 0x7f;
/// Channels per FP8 scale (spec §2.4: "per 128-channel block").
pub const FP8_BLOCK: usize = 128;
/// Floor of `amax` (DeepEP `kFP8Margin`), so that all-zero blocks get a finite scale.
pub const AMAX_FLOOR: f32 = 1e-4;
/// `f32(1/448)`, the reciprocal the kernel multiplies by (DeepEP `kFinfoAmaxInvE4M3`).
pub const E4M3_MAX_INV: f32 = 1.0 / 448.0;
/// Scales per UE8M0 int32 pack.
pub const UE8M0_PER_PACK: usize = 4;

/// Encodes `x` as e4m3: round to nearest even, saturate to ±448, NaN → [`E4M3_NAN`].
///
/// The sign of zero is kept (`-0.0` and negative values that round to zero give `0x80`).
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        // satfinite: everything from 448 up (448 itself, infinities) becomes the max code.
        return sign | E4M3_MAX_CODE;
    }
    let magnitude = if a < 2f32.powi(-6) {
        // Below the smallest normal the grid is uniform, m · 2^-9 for m = 0..=8 (m = 8 is the
        // smallest normal, code 0x08), so codes are the rounded multiple. Scaling by 2^9 is exact.
        (a * 512.0).round_ties_even() as u8
    } else {
        // Normal: keep 3 of the 23 f32 mantissa bits, round to nearest even on the bits. A carry
        // out of the mantissa bumps the exponent, which is exactly the rounded value; `a < 448`
        // keeps the result at or below 0x7e.
        let bits = a.to_bits();
        let rounded = bits + 0x7_ffff + ((bits >> 20) & 1);
        ((rounded >> 20) - ((127 - 7) << 3)) as u8
    };
    sign | magnitude
}

/// Decodes an e4m3 code to f32 (exact); `0x7f` and `0xff` decode to NaN.
pub fn e4m3_decode(code: u8) -> f32 {
    let magnitude = code & 0x7f;
    if magnitude == 0x7f {
        return f32::NAN;
    }
    let exponent = u32::from(magnitude >> 3);
    let mantissa = u32::from(magnitude & 7);
    let value = if exponent == 0 {
        mantissa as f32 * 2f32.powi(-9)
    } else {
        // Rebias 7 → 127 and place the 3 mantissa bits at the top of the f32 mantissa.
        f32::from_bits(((exponent + 120) << 23) | (mantissa << 20))
    };
    if code & 0x80 != 0 { -value } else { value }
}

/// Whether `code` is one of the two e4m3 NaN codes.
pub fn e4m3_is_nan(code: u8) -> bool {
    code & 0x7f == 0x7f
}

/// The multiplier and the stored dequantisation scale of one 128-channel block (spec §2.4).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockScale {
    /// Multiplier applied before the cast (`448 / amax`, or `2^-e` when rounded).
    pub scale: f32,
    /// Dequantisation scale stored beside the bytes (`amax * f32(1/448)`, or `2^e`).
    pub scale_inv: f32,
}

/// `max(1e-4, max |x|)` over a block; NaNs are ignored (as `fmaxf` ignores them).
pub fn block_amax(block: &[bf16]) -> f32 {
    block
        .iter()
        .fold(AMAX_FLOOR, |m, v| m.max(v.to_f32().abs()))
}

/// DeepEP's `fast_log2_ceil`: `ceil(log2(x))` for positive normal `x`, read off the f32 bits.
fn log2_ceil_bits(x: f32) -> i32 {
    let bits = x.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32;
    let mantissa_nonzero = i32::from(bits & 0x7f_ffff != 0);
    exponent - 127 + mantissa_nonzero
}

/// DeepEP's `fast_pow2`: `2^e` by building the f32 bits; exact for `-126 <= e <= 127`. Outside
/// that range the bits wrap exactly as the kernel's `(e + 127) << 23` does.
fn pow2_bits(e: i32) -> f32 {
    f32::from_bits((e.wrapping_add(127) as u32).wrapping_shl(23))
}

/// The scales of a block with the given `amax` (already floored by [`block_amax`]).
///
/// Bit-exact with DeepEP's `calculate_fp8_scales`: the non-rounded `scale_inv` is
/// `amax * f32(1/448)` (the spec's `amax / 448` can differ in the last bit), `scale` is the
/// correctly rounded `448 / amax`; the rounded scales are exact powers of two.
pub fn block_scale(amax: f32, round_scale: bool) -> BlockScale {
    if round_scale {
        let e = log2_ceil_bits(amax * E4M3_MAX_INV);
        BlockScale {
            scale: pow2_bits(-e),
            scale_inv: pow2_bits(e),
        }
    } else {
        BlockScale {
            scale: E4M3_MAX / amax,
            scale_inv: amax * E4M3_MAX_INV,
        }
    }
}

fn check_row_shapes(hidden: usize, q_len: usize, scales_len: usize) -> Result<()> {
    if !hidden.is_multiple_of(FP8_BLOCK) {
        return Err(Error::HiddenMisaligned {
            what: "hidden",
            value: hidden,
            multiple: FP8_BLOCK,
            why: "FP8 scales cover blocks of 128 channels",
        });
    }
    if q_len != hidden || scales_len != hidden / FP8_BLOCK {
        return Err(Error::ShapeMismatch {
            what: "FP8 row outputs",
            expected: format!("{hidden} bytes and {} scales", hidden / FP8_BLOCK),
            found: format!("{q_len} bytes and {scales_len} scales"),
        });
    }
    Ok(())
}

/// Casts one token the way DeepEP's low-latency dispatch kernel does (spec §2.4): `q` receives
/// `x.len()` e4m3 bytes and `scale_inv` one dequantisation scale per 128 channels.
///
/// Errors if `x.len()` is not a multiple of 128 or the outputs have the wrong lengths.
pub fn cast_row(x: &[bf16], round_scale: bool, q: &mut [u8], scale_inv: &mut [f32]) -> Result<()> {
    check_row_shapes(x.len(), q.len(), scale_inv.len())?;
    for ((block, q_block), s_out) in x
        .chunks_exact(FP8_BLOCK)
        .zip(q.chunks_exact_mut(FP8_BLOCK))
        .zip(scale_inv.iter_mut())
    {
        let s = block_scale(block_amax(block), round_scale);
        for (v, out) in block.iter().zip(q_block.iter_mut()) {
            // The product is an f32 multiply, then the cvt rounds it again (as on the GPU).
            *out = e4m3_encode(v.to_f32() * s.scale);
        }
        *s_out = s.scale_inv;
    }
    Ok(())
}

/// Casts every row of `x [T, H]` with [`cast_row`]: e4m3 bytes `[T, H]` and `scale_inv [T, H/128]`.
pub fn cast_rows(x: &Tensor2<bf16>, round_scale: bool) -> Result<(Tensor2<u8>, Tensor2<f32>)> {
    let (t, h) = x.shape();
    check_row_shapes(h, h, h / FP8_BLOCK)?;
    let mut q = Tensor2::filled(t, h, 0u8);
    let mut s = Tensor2::filled(t, h / FP8_BLOCK, 0f32);
    for r in 0..t {
        cast_row(x.row(r), round_scale, q.row_mut(r), s.row_mut(r))?;
    }
    Ok((q, s))
}

/// DeepEP's test helper `per_token_cast_to_fp8` (spec §6.1): per row and 128-channel block
/// (the last block may be partial — the helper pads with zeros), `amax` as in the kernel,
/// bytes `e4m3(f32(x) * f32(448 / amax))`, scales `amax / 448` (a division).
///
/// The bytes equal [`cast_rows`]`(x, false)`'s bit for bit; the scales can differ from the
/// kernel's `amax * f32(1/448)` in the last bit. Returns bytes `[T, H]`, scales `[T, ceil(H/128)]`.
pub fn per_token_cast_to_fp8(x: &Tensor2<bf16>) -> (Tensor2<u8>, Tensor2<f32>) {
    let (t, h) = x.shape();
    let blocks = h.div_ceil(FP8_BLOCK);
    let mut q = Tensor2::filled(t, h, 0u8);
    let mut s = Tensor2::filled(t, blocks, 0f32);
    for r in 0..t {
        let row = x.row(r);
        for (b, block) in row.chunks(FP8_BLOCK).enumerate() {
            // Zero padding never raises the amax, so the partial block needs no padding here.
            let amax = block_amax(block);
            let mult = E4M3_MAX / amax;
            for (c, v) in block.iter().enumerate() {
                q.set(r, b * FP8_BLOCK + c, e4m3_encode(v.to_f32() * mult));
            }
            s.set(r, b, amax / E4M3_MAX);
        }
    }
    (q, s)
}

/// The UE8M0 byte of a scale: its biased f32 exponent (`bits >> 23`, truncated to 8 bits, as
/// DeepEP's `extract_required_scale_format<true>`). Exact for powers of two.
pub fn ue8m0_byte(scale_inv: f32) -> u8 {
    (scale_inv.to_bits() >> 23) as u8
}

/// The scale a UE8M0 byte stands for: `f32::from_bits(byte << 23)` (spec §6.1).
pub fn ue8m0_to_f32(byte: u8) -> f32 {
    f32::from_bits(u32::from(byte) << 23)
}

/// Packs per-block scales into UE8M0 int32 words: scale `i` goes to word `i / 4`, byte `i % 4`
/// (byte 0 least significant). A short last word is zero-padded.
pub fn pack_ue8m0(scale_inv: &[f32]) -> Vec<i32> {
    scale_inv
        .chunks(UE8M0_PER_PACK)
        .map(|chunk| {
            let mut bytes = [0u8; UE8M0_PER_PACK];
            for (b, &s) in bytes.iter_mut().zip(chunk) {
                *b = ue8m0_byte(s);
            }
            i32::from_le_bytes(bytes)
        })
        .collect()
}

/// The UE8M0 byte of scale `i` inside packed words (see [`pack_ue8m0`]); `None` past the end.
pub fn ue8m0_unpack_byte(packed: &[i32], i: usize) -> Option<u8> {
    packed
        .get(i / UE8M0_PER_PACK)
        .map(|w| w.to_le_bytes()[i % UE8M0_PER_PACK])
}

/// Unpacks `num_scales` UE8M0 scales into f32 (`byte << 23`, spec §6.1 `per_token_cast_back`).
pub fn unpack_ue8m0(packed: &[i32], num_scales: usize) -> Result<Vec<f32>> {
    if packed.len() * UE8M0_PER_PACK < num_scales {
        return Err(Error::ShapeMismatch {
            what: "UE8M0 packed scales",
            expected: format!("at least {} words", num_scales.div_ceil(UE8M0_PER_PACK)),
            found: format!("{} words", packed.len()),
        });
    }
    Ok((0..num_scales)
        .filter_map(|i| ue8m0_unpack_byte(packed, i).map(ue8m0_to_f32))
        .collect())
}

/// Dequantises one row: `f32(e4m3) * scale_inv[c / 128]`, an f32 multiply (spec §6.1
/// `per_token_cast_back`). `scale_inv` needs `ceil(q.len() / 128)` entries.
pub fn dequantize_row(q: &[u8], scale_inv: &[f32]) -> Result<Vec<f32>> {
    let blocks = q.len().div_ceil(FP8_BLOCK);
    if scale_inv.len() != blocks {
        return Err(Error::ShapeMismatch {
            what: "FP8 scales of a row",
            expected: format!("{blocks} scales"),
            found: format!("{} scales", scale_inv.len()),
        });
    }
    Ok(q.iter()
        .enumerate()
        .map(|(c, &b)| e4m3_decode(b) * scale_inv[c / FP8_BLOCK])
        .collect())
}

/// [`dequantize_row`] rounded to BF16 into `out` (`bf16::from_f32` of each element, the same
/// bits), through a 256-entry table of [`e4m3_decode`] and without allocating: the identity
/// expert of DeepEP's FP8 tests (`per_token_cast_back`) at memory speed.
pub fn dequantize_row_bf16(q: &[u8], scale_inv: &[f32], out: &mut [bf16]) -> Result<()> {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| std::array::from_fn(|b| e4m3_decode(b as u8)));
    let blocks = q.len().div_ceil(FP8_BLOCK);
    if scale_inv.len() != blocks || out.len() != q.len() {
        return Err(Error::ShapeMismatch {
            what: "FP8 row, its scales and the BF16 output",
            expected: format!("{blocks} scales and {} outputs", q.len()),
            found: format!("{} scales and {} outputs", scale_inv.len(), out.len()),
        });
    }
    for ((qb, ob), &s) in q
        .chunks(FP8_BLOCK)
        .zip(out.chunks_mut(FP8_BLOCK))
        .zip(scale_inv)
    {
        for (o, &b) in ob.iter_mut().zip(qb) {
            *o = super::bf16::round(table[usize::from(b)] * s);
        }
    }
    Ok(())
}

/// Dequantises `q [T, H]` with `scale_inv [T, ceil(H/128)]` into f32 `[T, H]`.
pub fn dequantize(q: &Tensor2<u8>, scale_inv: &Tensor2<f32>) -> Result<Tensor2<f32>> {
    if scale_inv.rows() != q.rows() {
        return Err(Error::ShapeMismatch {
            what: "FP8 scales rows",
            expected: format!("{} rows", q.rows()),
            found: format!("{} rows", scale_inv.rows()),
        });
    }
    let mut out = Vec::with_capacity(q.rows() * q.cols());
    for r in 0..q.rows() {
        out.extend(dequantize_row(q.row(r), scale_inv.row(r))?);
    }
    Tensor2::new(q.rows(), q.cols(), out)
}

/// Bound on `|dequantised - x|` for one element of a block cast by [`cast_row`] (either scale
/// mode): `2^-4 · |x| · (1 + 2^-16) + 2^-17 · amax`.
///
/// Why: the cast value is `v = x · scale` with `|v| ≤ 448` (up to f32 rounding; saturation only
/// trims that rounding). e4m3 keeps 3 mantissa bits, so rounding a normal `v` moves it by at most
/// half an ulp, `2^-4 · |v|`; below the smallest normal `2^-6` the grid is `2^-9`, an absolute
/// error of at most `2^-10`. Multiplying back by `scale_inv` (`scale · scale_inv = 1` up to a few
/// f32 ulps, exactly 1 when rounded) gives `2^-4 |x|` plus `2^-10 · scale_inv`, and
/// `scale_inv < 2 · amax / 448` (rounded) so that term is below `2^-9 · amax / 448 < 2^-17 · amax`.
/// The `(1 + 2^-16)` factor covers the f32 roundings of the products.
pub fn fp8_abs_error_bound(x: f32, amax: f32) -> f32 {
    2f32.powi(-4) * x.abs() * (1.0 + 2f32.powi(-16)) + 2f32.powi(-17) * amax
}
