//! LogFMT-10: the lossy 10-bit log-domain format of low-latency combine's `use_logfmt` (spec
//! §2.6), the reference codec. `ep-kernels/include/ep_logfmt.cuh` is the same rule for CUDA
//! (and for the host); `ep-kernels/tests/logfmt_rules.rs` checks the two bit for bit.
//!
//! # The rule
//!
//! A row of `H` BF16 channels (`H % 128 == 0`) is cut into **divisions** of 128 channels and
//! **chunks** of [`CHUNK`] = 512 channels (4 divisions; the last chunk is shorter when
//! `H % 512 != 0`, which none of DeepEP's low-latency hidden sizes are). Per division:
//!
//! - `amax`, `amin` = largest and smallest `|x|`, taken on the BF16 bits (`bits & 0x7fff` as
//!   integers: the order of non-negative floats, and a NaN counts as larger than everything, so a
//!   NaN or an infinity makes `amax >= 1`). They travel as the **meta** word
//!   `amax_bits | amin_bits << 16` (bf16x2, `amax` first in memory).
//! - `log_amax = log2(amax)`, `log_amin = max(log2(amin), log_amax - 32)` (`log2(0) = -inf`).
//!   The division is **castable** iff `0 < amax < 1` and `log_amin < log_amax`.
//!
//! A chunk is cast iff all of its divisions are castable, otherwise it is sent as raw BF16. The
//! chunk is the spec's `32 lanes × unroll × 8` channels with unroll 2: the GPU moves a row as
//! warp-wide 16-byte loads of 256 channels, two per chunk. Both sides derive every flag from the
//! meta alone, so encoder and decoder agree whatever the data.
//!
//! In a cast division, with `step = (log_amax - log_amin) / 510`, each value is `1` sign bit and
//! a 9-bit code: `0` is zero, `c >= 1` stands for `2^(log_amin + (c-1)·step)`. The encoder picks
//! the code nearest in the linear domain, the spec's
//! `floor(max(log2|x|/step + 2 - log2((1+2^step)/2)/step - log_amin/step, 0))`, evaluated as
//! `floor(max(fma(log2|x| - log_amin, 1/step, 2 - log2((1+2^step)/2)/step), 0))` (the same
//! number, without subtracting two large quotients), clamped to 511.
//!
//! 16 consecutive values pack into 5 `u32` ([`pack_group`]): code `i` at bits `9i .. 9i+9` of
//! the 160-bit little-endian word sequence (144 bits), sign `i` at bit `16 + i` of word 4.
//!
//! # Arithmetic that is the same everywhere
//!
//! `log2` and `exp2` here are our own ([`log2`], [`exp2`]): IEEE adds, multiplies, divisions and
//! fused multiply-adds only, written so that no multiply feeds an add outside an explicit FMA.
//! Host C, CUDA and Rust then compute the same bits (libm's and CUDA's `log2f`/`exp2f` differ in
//! the last place, which would make the GPU's codes differ from this reference).
//!
//! # The message ([`Layout`])
//!
//! ```text
//!   offset 0            S = H/128 meta words (u32, little-endian)
//!   align16(4S)         chunk 0, chunk 1, ... back to back:
//!                         cast: (channels/16) groups of 5 u32 = 10·channels/8 bytes
//!                         raw:  channels BF16 = 2·channels bytes
//! ```
//!
//! Chunk `k` starts at `align16(4S) + Σ_{j<k} bytes(j)`, which the receiver computes from the
//! meta; every chunk size is a multiple of 160 or 256 bytes, so every chunk is 16-byte aligned.
//! A receive slot of [`Layout::max_bytes`] `= align16(4S) + 2H` holds any message (DeepEP's
//! combine message is `4S + 2H`; the two agree when `S % 4 == 0`, i.e. for every DeepEP `H`).
//! The decoder yields f32: a cast value is `±exp2(...)` in f32 (not rounded to BF16), a raw value
//! its BF16 widened; the receiver accumulates those f32 values as they are.

use half::bf16;

use crate::error::{Error, Result};

/// Channels per meta (spec §2.6: the code uses 128, the docstring says 64).
pub const DIVISION: usize = 128;
/// Channels per cast decision (see the module docs).
pub const CHUNK: usize = 512;
/// Values per packed group.
pub const GROUP: usize = 16;
/// `u32` words per packed group (16 × 10 bits).
pub const GROUP_WORDS: usize = 5;
/// Largest 9-bit code.
pub const MAX_CODE: u32 = 511;
/// Steps between `log_amin` (code 1) and `log_amax` (code 511).
pub const STEPS: f32 = 510.0;
/// How far below `log_amax` the grid may start (`log_amin >= log_amax - 32`).
pub const LOG_RANGE: f32 = 32.0;

/// BF16 bits of `|x| = 1.0`: a division is castable only below it.
const ONE_BITS: u16 = 0x3f80;

// log2(m) = u · P(u²) with u = (m - 1)/(m + 1): P = (2/ln 2)·(1 + s/3 + s²/5 + s³/7 + s⁴/9).
const LOG2_C1: f32 = f32::from_bits(0x4038_aa3b);
const LOG2_C3: f32 = f32::from_bits(0x3f76_384f);
const LOG2_C5: f32 = f32::from_bits(0x3f13_bb63);
const LOG2_C7: f32 = f32::from_bits(0x3ed3_0bb1);
const LOG2_C9: f32 = f32::from_bits(0x3ea4_258a);
// 2^g = Σ_{k ≤ 7} (g ln 2)^k / k! for |g| ≤ 1/2.
const EXP2_C: [f32; 8] = [
    f32::from_bits(0x3f80_0000),
    f32::from_bits(0x3f31_7218),
    f32::from_bits(0x3e75_fdf0),
    f32::from_bits(0x3d63_5847),
    f32::from_bits(0x3c1d_955b),
    f32::from_bits(0x3aae_c3ff),
    f32::from_bits(0x3921_8489),
    f32::from_bits(0x377f_e5fe),
];

/// `log2(x)` for `x >= 0` finite (subnormals included); `-inf` for `0`. Absolute error about
/// `2^-24 · max(1, |log2 x|)`. The same bits as `ep_logfmt_log2` of the header.
///
/// `x = 2^e · m` with `m` in `[√2/2, √2)`, then the atanh series of `log2 m` in
/// `u = (m-1)/(m+1)`, `|u| < 0.172`, to `u⁹` (next term below `2^-28`).
pub fn log2(x: f32) -> f32 {
    let subnormal = x.to_bits() < 0x0080_0000;
    let b = (if subnormal { x * 16_777_216.0 } else { x }).to_bits();
    let big = (b & 0x007f_ffff) > 0x0035_04f3;
    let e = (b >> 23) as i32 - 127 - if subnormal { 24 } else { 0 } + i32::from(big);
    // m in [1, 2), halved (exponent 127 → 126) above √2.
    let m = f32::from_bits((b & 0x007f_ffff) | if big { 0x3f00_0000 } else { 0x3f80_0000 });
    let u = (m - 1.0) / (m + 1.0);
    let s = u * u;
    let p = LOG2_C9
        .mul_add(s, LOG2_C7)
        .mul_add(s, LOG2_C5)
        .mul_add(s, LOG2_C3)
        .mul_add(s, LOG2_C1);
    let r = u.mul_add(p, e as f32);
    if x == 0.0 { f32::NEG_INFINITY } else { r }
}

/// `2^e` for integer `-126 <= e <= 127`, from the bits.
fn pow2i(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `2^t`, `t` clamped to `[-252, 127]`; relative error about `2^-23` while the result is a
/// normal f32, then the rounding of a subnormal. The same bits as `ep_logfmt_exp2`.
///
/// `t = n + g` with `n = rint(t)`, `|g| <= 1/2`, Taylor series of `2^g` to degree 7 (next term
/// below `2^-27`), then two exact power-of-two factors so that `n` down to -252 stays finite.
pub fn exp2(t: f32) -> f32 {
    // max/min (not clamp): a NaN becomes -252, as fmaxf/fminf do in the header.
    #[allow(
        clippy::manual_clamp,
        reason = "clamp keeps a NaN; the header's fmaxf does not"
    )]
    let t = t.max(-252.0).min(127.0);
    let n = t.round_ties_even();
    let g = t - n;
    let p = EXP2_C[..7]
        .iter()
        .rev()
        .fold(EXP2_C[7], |acc, &c| acc.mul_add(g, c));
    let n = n as i32;
    let a = n / 2;
    p * pow2i(a) * pow2i(n - a)
}

/// The meta of one division: largest and smallest `|x|`, as BF16.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DivisionMeta {
    /// `max |x|` (a NaN anywhere makes this a NaN).
    pub amax: bf16,
    /// `min |x|`.
    pub amin: bf16,
}

impl DivisionMeta {
    /// The meta of `x` (any length; a division is 128 values). Empty input gives zeros.
    pub fn of(x: &[bf16]) -> Self {
        let (mut hi, mut lo) = (0u16, if x.is_empty() { 0 } else { u16::MAX });
        for v in x {
            let a = v.to_bits() & 0x7fff;
            hi = hi.max(a);
            lo = lo.min(a);
        }
        DivisionMeta {
            amax: bf16::from_bits(hi),
            amin: bf16::from_bits(lo),
        }
    }

    /// The wire word: `amax` bits in the low half (first in memory), `amin` in the high half.
    pub fn to_word(self) -> u32 {
        u32::from(self.amax.to_bits()) | u32::from(self.amin.to_bits()) << 16
    }

    /// Inverse of [`DivisionMeta::to_word`].
    pub fn from_word(w: u32) -> Self {
        DivisionMeta {
            amax: bf16::from_bits(w as u16),
            amin: bf16::from_bits((w >> 16) as u16),
        }
    }

    /// The grid of a castable division, `None` if the division must travel raw.
    pub fn params(self) -> Option<Params> {
        let amax_bits = self.amax.to_bits();
        if amax_bits == 0 || amax_bits >= ONE_BITS {
            return None;
        }
        let log_amax = log2(self.amax.to_f32());
        let log_amin = log2(self.amin.to_f32()).max(log_amax - LOG_RANGE);
        if log_amin.partial_cmp(&log_amax) != Some(std::cmp::Ordering::Less) {
            return None;
        }
        let range = log_amax - log_amin;
        let step = range / STEPS;
        let inv_step = STEPS / range;
        // log2 of the linear midpoint between two grid points, relative to the lower one.
        let mid = log2((1.0 + exp2(step)) * 0.5);
        Some(Params {
            log_amin,
            step,
            inv_step,
            bias: (-mid).mul_add(inv_step, 2.0),
        })
    }
}

/// The code grid of a cast division (everything the per-value encoder and decoder need).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// `log2` of the value of code 1.
    pub log_amin: f32,
    /// `(log_amax - log_amin) / 510`.
    pub step: f32,
    /// `510 / (log_amax - log_amin)`.
    pub inv_step: f32,
    /// `2 - log2((1 + 2^step)/2) / step`: shifts the floor to the linear midpoints.
    pub bias: f32,
}

impl Params {
    /// The 9-bit code of `|x|` (the sign travels apart).
    pub fn code(&self, x: bf16) -> u32 {
        let a = bf16::from_bits(x.to_bits() & 0x7fff).to_f32();
        let y = (log2(a) - self.log_amin).mul_add(self.inv_step, self.bias);
        y.max(0.0).floor().min(MAX_CODE as f32) as u32
    }

    /// The magnitude code `c` stands for: `0` for `0`, else `2^(log_amin + (c-1)·step)`.
    pub fn magnitude(&self, code: u32) -> f32 {
        let t = ((code.max(1) - 1) as f32).mul_add(self.step, self.log_amin);
        if code == 0 { 0.0 } else { exp2(t) }
    }

    /// Encodes 16 consecutive values into 5 words.
    pub fn encode_group(&self, x: &[bf16; GROUP]) -> [u32; GROUP_WORDS] {
        let mut codes = [0u16; GROUP];
        let mut signs = 0u16;
        for (i, (c, v)) in codes.iter_mut().zip(x).enumerate() {
            *c = self.code(*v) as u16;
            signs |= (v.to_bits() >> 15) << i;
        }
        pack_group(&codes, signs)
    }

    /// Decodes 5 words into 16 values (`±0.0` for code 0, with its sign).
    pub fn decode_group(&self, w: &[u32; GROUP_WORDS]) -> [f32; GROUP] {
        let (codes, signs) = unpack_group(w);
        std::array::from_fn(|i| {
            let m = self.magnitude(u32::from(codes[i]));
            if signs >> i & 1 == 1 { -m } else { m }
        })
    }
}

/// Packs 16 codes (9 bits each, higher bits ignored) and 16 sign bits into 5 words: code `i` at
/// bits `9i..9i+9` of the words read as one little-endian 160-bit number, sign `i` at bit
/// `16 + i` of word 4.
pub fn pack_group(codes: &[u16; GROUP], signs: u16) -> [u32; GROUP_WORDS] {
    let mut w = [0u32; GROUP_WORDS];
    for (i, &c) in codes.iter().enumerate() {
        let (c, bit) = (u64::from(c & 0x1ff), 9 * i);
        // A code spans at most two words; place it in a 64-bit window over them.
        let (word, shift) = (bit / 32, bit % 32);
        let v = c << shift;
        w[word] |= v as u32;
        if word + 1 < GROUP_WORDS {
            w[word + 1] |= (v >> 32) as u32;
        }
    }
    w[4] |= u32::from(signs) << 16;
    w
}

/// Inverse of [`pack_group`]: the 16 codes and the sign bits.
pub fn unpack_group(w: &[u32; GROUP_WORDS]) -> ([u16; GROUP], u16) {
    let codes = std::array::from_fn(|i| {
        let (word, shift) = (9 * i / 32, 9 * i % 32);
        let hi = if word + 1 < GROUP_WORDS {
            w[word + 1]
        } else {
            0
        };
        let v = (u64::from(hi) << 32 | u64::from(w[word])) >> shift;
        (v & 0x1ff) as u16
    });
    (codes, (w[4] >> 16) as u16)
}

/// The message layout of one row of `hidden` channels (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    hidden: usize,
}

impl Layout {
    /// The layout for `hidden` channels; errors unless `hidden` is a positive multiple of 128.
    pub fn new(hidden: usize) -> Result<Self> {
        if hidden == 0 || !hidden.is_multiple_of(DIVISION) {
            return Err(Error::HiddenMisaligned {
                what: "hidden",
                value: hidden,
                multiple: DIVISION,
                why: "LogFMT keeps one meta word per 128 channels",
            });
        }
        Ok(Layout { hidden })
    }

    /// `H`.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// `S = H / 128` meta words.
    pub fn num_divisions(&self) -> usize {
        self.hidden / DIVISION
    }

    /// Where the first chunk starts: `align16(4S)`.
    pub fn data_offset(&self) -> usize {
        (4 * self.num_divisions()).next_multiple_of(16)
    }

    /// `ceil(H / 512)`.
    pub fn num_chunks(&self) -> usize {
        self.hidden.div_ceil(CHUNK)
    }

    /// Channels of chunk `k`: `[512k, min(512(k+1), H))`.
    pub fn chunk_channels(&self, k: usize) -> std::ops::Range<usize> {
        let start = (k * CHUNK).min(self.hidden);
        start..(start + CHUNK).min(self.hidden)
    }

    /// The grids of chunk `k`'s divisions if the chunk is cast, from the row's meta words.
    pub fn chunk_params(&self, meta: &[u32], k: usize) -> Option<Vec<Params>> {
        let ch = self.chunk_channels(k);
        meta[ch.start / DIVISION..ch.end / DIVISION]
            .iter()
            .map(|&w| DivisionMeta::from_word(w).params())
            .collect()
    }

    /// Whether chunk `k` is cast, from the row's meta words.
    pub fn chunk_cast(&self, meta: &[u32], k: usize) -> bool {
        self.chunk_params(meta, k).is_some()
    }

    /// Bytes of a chunk of `channels` channels: `10·channels/8` cast, `2·channels` raw.
    pub fn chunk_bytes(channels: usize, cast: bool) -> usize {
        if cast {
            channels * 10 / 8
        } else {
            channels * 2
        }
    }

    /// Offset of chunk `k` in the message (`k = num_chunks()` gives the message's size).
    pub fn chunk_offset(&self, meta: &[u32], k: usize) -> usize {
        self.data_offset()
            + (0..k)
                .map(|j| Self::chunk_bytes(self.chunk_channels(j).len(), self.chunk_cast(meta, j)))
                .sum::<usize>()
    }

    /// Size of the message whose meta words are `meta`.
    pub fn message_bytes(&self, meta: &[u32]) -> usize {
        self.chunk_offset(meta, self.num_chunks())
    }

    /// The largest message (every chunk raw): the receive slot size, `align16(4S) + 2H`.
    pub fn max_bytes(&self) -> usize {
        self.data_offset() + 2 * self.hidden
    }

    /// The bytes DeepEP's test counts per selection for a LogFMT combine (spec §6.4):
    /// `10H/8 + 4H/128`, i.e. every chunk cast.
    pub fn deepep_counted_bytes(&self) -> usize {
        10 * self.hidden / 8 + self.hidden / DIVISION * 4
    }
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The meta words of a row (what the encoder writes first).
pub fn row_meta(x: &[bf16]) -> Vec<u32> {
    x.chunks(DIVISION)
        .map(|d| DivisionMeta::of(d).to_word())
        .collect()
}

/// Encodes one row into `out` (at least the message's size, e.g. a [`Layout::max_bytes`] slot;
/// the alignment padding is zeroed, bytes past the message untouched). Returns the message size.
pub fn encode_row_into(x: &[bf16], out: &mut [u8]) -> Result<usize> {
    let layout = Layout::new(x.len())?;
    let meta = row_meta(x);
    let size = layout.message_bytes(&meta);
    if out.len() < size {
        return Err(Error::ShapeMismatch {
            what: "LogFMT output slot",
            expected: format!("at least {size} bytes"),
            found: format!("{} bytes", out.len()),
        });
    }
    for (i, w) in meta.iter().enumerate() {
        out[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
    }
    out[4 * meta.len()..layout.data_offset()].fill(0);
    for k in 0..layout.num_chunks() {
        let mut at = layout.chunk_offset(&meta, k);
        let ch = layout.chunk_channels(k);
        if let Some(params) = layout.chunk_params(&meta, k) {
            for (div, p) in x[ch].chunks_exact(DIVISION).zip(&params) {
                for g in div.chunks_exact(GROUP) {
                    for w in p.encode_group(&std::array::from_fn(|i| g[i])) {
                        out[at..at + 4].copy_from_slice(&w.to_le_bytes());
                        at += 4;
                    }
                }
            }
        } else {
            for v in &x[ch] {
                out[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
                at += 2;
            }
        }
    }
    Ok(size)
}

/// Encodes one row: the message, exactly [`Layout::message_bytes`] long.
pub fn encode_row(x: &[bf16]) -> Result<Vec<u8>> {
    let layout = Layout::new(x.len())?;
    let mut out = vec![0u8; layout.max_bytes()];
    let size = encode_row_into(x, &mut out)?;
    out.truncate(size);
    Ok(out)
}

/// Decodes the message at the start of `bytes` (a slot at least as long as the message) into
/// `hidden` f32 values: what the receiver accumulates.
pub fn decode_row(bytes: &[u8], hidden: usize) -> Result<Vec<f32>> {
    let layout = Layout::new(hidden)?;
    let short = |need: usize| Error::ShapeMismatch {
        what: "LogFMT message",
        expected: format!("at least {need} bytes for H = {hidden}"),
        found: format!("{} bytes", bytes.len()),
    };
    if bytes.len() < layout.data_offset() {
        return Err(short(layout.data_offset()));
    }
    let meta: Vec<u32> = (0..layout.num_divisions())
        .map(|i| read_u32(bytes, 4 * i))
        .collect();
    let size = layout.message_bytes(&meta);
    if bytes.len() < size {
        return Err(short(size));
    }
    let mut out = vec![0f32; hidden];
    for k in 0..layout.num_chunks() {
        let mut at = layout.chunk_offset(&meta, k);
        let ch = layout.chunk_channels(k);
        if let Some(params) = layout.chunk_params(&meta, k) {
            for (div, p) in out[ch].chunks_exact_mut(DIVISION).zip(&params) {
                for g in div.chunks_exact_mut(GROUP) {
                    let w = std::array::from_fn(|j| read_u32(bytes, at + 4 * j));
                    at += 4 * GROUP_WORDS;
                    g.copy_from_slice(&p.decode_group(&w));
                }
            }
        } else {
            for v in &mut out[ch] {
                *v = bf16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32();
                at += 2;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn b(x: f32) -> bf16 {
        bf16::from_f32(x)
    }

    /// Our log2 against f64's over every positive finite BF16 value (the encoder's inputs) and
    /// a sweep of f32 values near 1 (the midpoint term): within `2^-22 · max(1, |log2 x|)`.
    #[test]
    fn log2_is_accurate() {
        let check = |x: f32| {
            let want = f64::from(x).log2();
            let got = f64::from(log2(x));
            let tol = 2f64.powi(-22) * want.abs().max(1.0);
            assert!((got - want).abs() <= tol, "log2({x:e}) = {got} vs {want}");
        };
        for bits in 1..0x7f80u16 {
            check(bf16::from_bits(bits).to_f32());
        }
        for i in 0..100_000u32 {
            check(f32::from_bits(0x3f80_0000 + i * 7));
            check(f32::from_bits(0x3f7f_ffff - i * 7));
        }
        assert_eq!(log2(0.0), f32::NEG_INFINITY);
        for e in -149..128 {
            let x = if e < -126 {
                f32::from_bits(1 << (e + 149))
            } else {
                2f32.powi(e)
            };
            assert_eq!(log2(x), e as f32, "powers of two are exact");
        }
    }

    /// Our exp2 against f64's over the range the decoder uses (and beyond): relative error
    /// `2^-22` for normal results, half a subnormal ulp below.
    #[test]
    fn exp2_is_accurate() {
        for i in 0..200_000 {
            let t = -170.0 + i as f32 * (180.0 / 200_000.0);
            let want = f64::from(t).exp2();
            let got = f64::from(exp2(t));
            assert!(
                (got - want).abs() <= want * 2f64.powi(-22) + 2f64.powi(-150),
                "exp2({t}) = {got:e} vs {want:e}"
            );
        }
        for e in -126..128 {
            assert_eq!(exp2(e as f32), 2f32.powi(e));
        }
    }

    /// The packing, by hand: code 0 = 1 (bit 0), code 3 = 0x1ff (bits 27..36: the top 5 bits of
    /// word 0, the low 4 of word 1), code 7 = 0x155 (bits 63..72: bit 31 of word 1 is its low bit,
    /// word 2's low byte the other 8, 0xaa), code 15 = 0x100 (bits 135..144: only bit 143, bit 15
    /// of word 4), sign 15 at bit 31 of word 4 and sign 1 at bit 17.
    #[test]
    fn packing_layout_by_hand() {
        let mut codes = [0u16; GROUP];
        codes[0] = 1;
        codes[3] = 0x1ff;
        codes[7] = 0x155;
        codes[15] = 0x100;
        let signs = 1 << 15 | 1 << 1;
        let w = pack_group(&codes, signs);
        assert_eq!(
            w,
            [
                0xf800_0001,
                0x8000_000f,
                0x0000_00aa,
                0,
                0x8002_0000 | 0x8000
            ]
        );
        assert_eq!(unpack_group(&w), (codes, signs));
        // All codes at maximum: 144 ones, no sign.
        assert_eq!(
            pack_group(&[0x1ff; GROUP], 0),
            [u32::MAX, u32::MAX, u32::MAX, u32::MAX, 0xffff]
        );
    }

    /// Codes by hand: amax = 0.5, amin = 0.125, so log_amin = -3, step = 2/510 and code `c`
    /// stands for 2^(-3 + (c-1)/255): 0.125 → 1, 0.25 → 256, 0.5 → 511, 0 → 0; a value just
    /// above a linear midpoint rounds up, just below rounds down.
    #[test]
    fn codes_by_hand() {
        let mut x = vec![b(0.3); DIVISION];
        x[0] = b(0.5);
        x[1] = b(-0.125);
        x[2] = b(0.25);
        x[3] = b(-0.0);
        x[4] = b(0.0);
        // Zeros count in amin (the 32-octave clamp then sets the grid floor).
        let meta = DivisionMeta::of(&x[..]);
        assert_eq!(meta.to_word(), 0x3f00, "amin 0 (high half), amax 0.5");
        x[3] = b(-0.2);
        x[4] = b(0.2);
        let meta = DivisionMeta::of(&x[..]);
        assert_eq!(meta.to_word(), 0x3f00 | 0x3e00 << 16);
        let p = meta.params().unwrap();
        assert_eq!((p.log_amin, p.step), (-3.0, 2.0 / 510.0));
        assert_eq!(p.code(b(0.125)), 1);
        assert_eq!(p.code(b(0.25)), 256);
        assert_eq!(p.code(b(-0.25)), 256);
        assert_eq!(p.code(b(0.5)), 511);
        assert_eq!(p.code(b(0.0)), 0);
        assert_eq!(p.magnitude(1), 0.125);
        // 510 · f32(2/510) is 2 within an ulp of the exponent's f32 arithmetic.
        assert!((p.magnitude(511) - 0.5).abs() < 1e-7);
        assert!((p.magnitude(256) - 0.25).abs() < 1e-7);
        // Every BF16 value in [amin, amax) gets the code nearest in the linear domain (up to
        // 1e-5 relative for the f32 evaluation).
        for bits in 0x3e00u16..0x3f00 {
            let v = bf16::from_bits(bits).to_f32();
            let c = p.code(bf16::from_bits(bits));
            let at = (v - p.magnitude(c)).abs();
            assert!(
                at <= (p.magnitude(c + 1) - v).abs() * (1.0 + 1e-5),
                "{v}: {c}"
            );
            if c > 1 {
                assert!(
                    at <= (v - p.magnitude(c - 1)).abs() * (1.0 + 1e-5),
                    "{v}: {c}"
                );
            }
        }
        // Signs and zeros through a group.
        let g: [bf16; GROUP] = std::array::from_fn(|i| x[i]);
        let d = p.decode_group(&p.encode_group(&g));
        assert!((d[0] - 0.5).abs() < 1e-7);
        assert_eq!(d[1], -0.125);
        assert!(d[3].is_sign_negative());
        let z = p.decode_group(&p.encode_group(&[b(-0.0); GROUP]));
        assert!(z.iter().all(|v| *v == 0.0 && v.is_sign_negative()));
    }

    /// A random division: magnitudes `2^(top - spread·u)`, random signs, some zeros; `top` from
    /// `-1` down to `-140` (BF16 subnormals included) and spreads from tiny to beyond the
    /// 32-octave clamp.
    fn random_division(rng: &mut ChaCha8Rng, top: f32, spread: f32) -> Vec<bf16> {
        (0..DIVISION)
            .map(|_| {
                let u: f32 = rng.random();
                let v = if rng.random_range(0..16) == 0 {
                    0.0
                } else {
                    (top - spread * u).exp2().min(0.99)
                };
                b(if rng.random() { -v } else { v })
            })
            .collect()
    }

    fn random_row(rng: &mut ChaCha8Rng, h: usize) -> Vec<bf16> {
        (0..h / DIVISION)
            .flat_map(|_| {
                let top = if rng.random_range(0..8) == 0 {
                    rng.random_range(-140.0..-100.0)
                } else {
                    rng.random_range(-20.0..-0.01)
                };
                let spread = [0.01f32, 0.5, 4.0, 20.0, 45.0][rng.random_range(0..5)];
                random_division(rng, top, spread)
            })
            .collect()
    }

    /// The per-value bound: zeros and signs exact; a value at or above the grid's floor
    /// `2^log_amin` within the half-width of a step in the log domain (`max(m, step - m)`,
    /// `m = log2((1 + 2^step)/2)`: linear rounding is not symmetric in log2) plus the f32
    /// evaluation slack `2^-19 · (1 + |log_amin|)`; below the floor (clamped `amin`) within
    /// `2^log_amin`; and half a subnormal ulp when the result underflows f32.
    fn check_value(x: bf16, got: f32, p: &Params) -> std::result::Result<(), String> {
        let xa = f64::from(x.to_f32().abs());
        if got.is_sign_negative() != x.is_sign_negative() {
            return Err(format!("{x}: sign of {got}"));
        }
        if xa == 0.0 {
            return if got == 0.0 {
                Ok(())
            } else {
                Err(format!("0 → {got}"))
            };
        }
        let (step, lmin) = (f64::from(p.step), f64::from(p.log_amin));
        let m = ((1.0 + step.exp2()) / 2.0).log2();
        let half = m.max(step - m) + 2f64.powi(-19) * (1.0 + lmin.abs());
        let floor = lmin.exp2();
        let err = (f64::from(got.abs()) - xa).abs();
        let tol = if xa >= floor {
            xa * (half.exp2() - 1.0)
        } else {
            floor * (1.0 + 2f64.powi(-20))
        } + 2f64.powi(-149);
        if err <= tol {
            Ok(())
        } else {
            Err(format!(
                "{x} → {got}: error {err:e} > {tol:e} (step {step}, log_amin {lmin})"
            ))
        }
    }

    fn cases() -> u32 {
        std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        /// Every value of a random row decodes within the per-value bound (cast chunks) or
        /// exactly (raw chunks); the message has the size the layout computes from its meta.
        #[test]
        fn round_trip_within_bound(seed in any::<u64>(), h128 in 1usize..=24) {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let h = h128 * DIVISION;
            let mut x = random_row(&mut rng, h);
            // Now and then a division at or above 1 (or a NaN / infinity) forces its chunk raw.
            if rng.random_range(0..3) == 0 {
                let i = rng.random_range(0..h);
                x[i] = [b(1.0), b(-3.5), bf16::INFINITY, bf16::NAN][rng.random_range(0..4)];
            }
            let layout = Layout::new(h).unwrap();
            let msg = encode_row(&x).unwrap();
            let meta = row_meta(&x);
            prop_assert_eq!(msg.len(), layout.message_bytes(&meta));
            prop_assert!(msg.len() <= layout.max_bytes());
            // Decoding from a slot with garbage after the message gives the same.
            let mut slot = msg.clone();
            slot.resize(layout.max_bytes(), 0xa5);
            let got = decode_row(&slot, h).unwrap();
            prop_assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                decode_row(&msg, h).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            for k in 0..layout.num_chunks() {
                let ch = layout.chunk_channels(k);
                match layout.chunk_params(&meta, k) {
                    None => {
                        for c in ch {
                            prop_assert_eq!(got[c].to_bits(), x[c].to_f32().to_bits(), "raw channel {}", c);
                        }
                    }
                    Some(params) => {
                        for c in ch.clone() {
                            let p = &params[(c - ch.start) / DIVISION];
                            check_value(x[c], got[c], p).map_err(TestCaseError::fail)?;
                        }
                    }
                }
            }
        }

        /// The cast-enable rule, on one division of an otherwise castable row of two chunks:
        /// `amax >= 1` (or an infinity, a NaN), an all-zero division, or one whose values all
        /// have the same magnitude makes that chunk raw; the other chunk stays cast.
        #[test]
        fn cast_enable_rule(seed in any::<u64>(), which in 0usize..5, div in 0usize..4) {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let h = 2 * CHUNK;
            let mut x: Vec<bf16> = (0..h / DIVISION).flat_map(|_| random_division(&mut rng, -1.5, 10.0)).collect();
            // Make sure every division is castable to start with (a random one almost always is).
            for d in x.chunks_mut(DIVISION) {
                d[0] = b(0.3);
                d[1] = b(-0.001);
            }
            let layout = Layout::new(h).unwrap();
            prop_assert!((0..2).all(|k| layout.chunk_cast(&row_meta(&x), k)));
            let d = &mut x[div * DIVISION..(div + 1) * DIVISION];
            match which {
                0 => d[rng.random_range(0..DIVISION)] = b(rng.random_range(1.0f32..100.0)),
                1 => d[rng.random_range(0..DIVISION)] = bf16::NEG_INFINITY,
                2 => d[rng.random_range(0..DIVISION)] = bf16::NAN,
                3 => d.fill(b(0.0)),
                _ => {
                    let v = b(rng.random_range(0.001f32..0.99));
                    d.iter_mut().for_each(|e| *e = if rng.random() { -v } else { v });
                }
            }
            let meta = row_meta(&x);
            prop_assert!(DivisionMeta::from_word(meta[div]).params().is_none());
            prop_assert!(!layout.chunk_cast(&meta, 0));
            prop_assert!(layout.chunk_cast(&meta, 1));
            let msg = encode_row(&x).unwrap();
            prop_assert_eq!(msg.len(), 32 + 2 * CHUNK + 10 * CHUNK / 8);
            let got = decode_row(&msg, h).unwrap();
            for c in 0..CHUNK {
                prop_assert_eq!(got[c].to_bits(), x[c].to_f32().to_bits());
            }
        }
    }

    /// A division just below 1 casts, one at exactly 1 does not.
    #[test]
    fn amax_threshold_is_one() {
        let mut x = vec![b(0.01); DIVISION];
        x[5] = bf16::from_bits(0x3f7f); // largest BF16 below 1
        assert!(DivisionMeta::of(&x).params().is_some());
        x[5] = b(-1.0);
        assert!(DivisionMeta::of(&x).params().is_none());
    }

    /// Sizes: the meta, the slot, and DeepEP's count (spec §6.4) for H = 7168, 2560 and an `H`
    /// that is not a multiple of 512 (a short last chunk, a padded meta).
    #[test]
    fn layout_sizes() {
        let l = Layout::new(7168).unwrap();
        assert_eq!(
            (l.num_divisions(), l.data_offset(), l.num_chunks()),
            (56, 224, 14)
        );
        assert_eq!(l.max_bytes(), 224 + 2 * 7168);
        assert_eq!(l.deepep_counted_bytes(), 10 * 7168 / 8 + 7168 / 128 * 4);
        let cast = vec![
            DivisionMeta {
                amax: b(0.5),
                amin: b(0.01)
            }
            .to_word();
            56
        ];
        assert_eq!(l.message_bytes(&cast), l.deepep_counted_bytes());
        let raw = vec![
            DivisionMeta {
                amax: b(2.0),
                amin: b(0.01)
            }
            .to_word();
            56
        ];
        assert_eq!(l.message_bytes(&raw), l.max_bytes());
        let l = Layout::new(2560).unwrap();
        assert_eq!((l.data_offset(), l.num_chunks()), (80, 5));
        let l = Layout::new(640).unwrap();
        assert_eq!(
            (l.data_offset(), l.num_chunks(), l.chunk_channels(1)),
            (32, 2, 512..640)
        );
        let mut meta = vec![cast[0]; 5];
        assert_eq!(l.chunk_offset(&meta, 1), 32 + 640);
        assert_eq!(l.message_bytes(&meta), 32 + 800);
        meta[1] = raw[0];
        assert_eq!(l.chunk_offset(&meta, 1), 32 + 1024);
        assert_eq!(l.message_bytes(&meta), 32 + 1024 + 160);
        assert!(Layout::new(0).is_err());
        assert!(Layout::new(200).is_err());
        assert!(encode_row(&[b(0.1); 100]).is_err());
        let msg = encode_row(&[b(0.1); 640]).unwrap();
        assert!(decode_row(&msg[..msg.len() - 1], 640).is_err());
        assert!(encode_row_into(&[b(0.1); 640], &mut [0u8; 100]).is_err());
    }

    fn randn(rng: &mut ChaCha8Rng) -> f32 {
        // Box–Muller.
        let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }

    /// DeepEP's LogFMT test inputs `randn · 0.5 · rand` and its performance inputs `randn · 0.1`
    /// (spec §6.4) at H = 7168: the decoded payload against the BF16 payload within the FP8
    /// combine bound `calc_diff < 9e-4` (the spec gives no LogFMT-specific bound). With the
    /// first, most 512-channel chunks hold a value of magnitude 1 or more and travel raw; with
    /// the second every chunk is cast, so the bound is tested on the lossy path.
    #[test]
    fn deepep_inputs_calc_diff() {
        let mut rng = ChaCha8Rng::seed_from_u64(7168);
        let h = 7168;
        let layout = Layout::new(h).unwrap();
        let rows = 64;
        for (name, scale_by_rand, scale, min_cast) in [
            ("randn*0.5*rand", true, 0.5, 1),
            ("randn*0.1", false, 0.1, rows * 14),
        ] {
            let (mut want, mut got, mut bytes, mut cast_chunks) = (Vec::new(), Vec::new(), 0, 0);
            for _ in 0..rows {
                let x: Vec<bf16> = (0..h)
                    .map(|_| {
                        let r = if scale_by_rand {
                            rng.random::<f32>()
                        } else {
                            1.0
                        };
                        b(randn(&mut rng) * scale * r)
                    })
                    .collect();
                let msg = encode_row(&x).unwrap();
                let meta = row_meta(&x);
                cast_chunks += (0..layout.num_chunks())
                    .filter(|&k| layout.chunk_cast(&meta, k))
                    .count();
                bytes += msg.len();
                want.extend(x.iter().map(|v| f64::from(v.to_f32())));
                got.extend(decode_row(&msg, h).unwrap().into_iter().map(f64::from));
            }
            let diff = crate::numerics::calc_diff(got.iter().copied(), want.iter().copied());
            eprintln!(
                "{name}: calc_diff {diff:e}, {cast_chunks}/{} chunks cast, {bytes} bytes",
                rows * 14
            );
            assert!(diff < 9e-4, "{name}: calc_diff {diff}");
            // It meets DeepEP's BF16 combine bound too.
            assert!(diff < 1e-5, "{name}: calc_diff {diff}");
            assert!(diff > 0.0, "{name}: lossy");
            assert!(cast_chunks >= min_cast, "{name}: {cast_chunks} chunks cast");
        }
    }
}
