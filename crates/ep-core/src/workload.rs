//! Seeded, portable workload generation (ChaCha8): a seed means the same routing and the same
//! activations on every machine, so a failing case can be replayed anywhere.
//!
//! What is generated, per rank (the way DeepEP's tests build their inputs, spec §6.2–§6.4):
//! - `topk_idx [T, K]`: for each token `K` **distinct** experts drawn uniformly (equivalent in
//!   distribution to DeepEP's `topk(|randn| + 1, K)`), then `masked_per_rank` distinct slots of
//!   the rank set to `-1` (DeepEP's low-latency test masks 10 random slots, with replacement; here
//!   the count is exact);
//! - `topk_weights [T, K]`: uniform in `(0, 1]` (positive; masked slots keep their weight, as in
//!   DeepEP's test, and consumers ignore them);
//! - `x [T, H]`: standard normal values rounded to BF16 (like `torch.randn`), or, with `fp8`, the
//!   same values cast by DeepEP's test helper `per_token_cast_to_fp8` (e4m3 bytes plus
//!   per-128-channel scales, [`crate::numerics::fp8::per_token_cast_to_fp8`]).
//!
//! Routings ([`Routing`], parsed from `uniform`, `zipf:S`, `hot:F`):
//! - `Uniform`: every set of `K` distinct experts equally likely (the default; its output is
//!   pinned bit for bit by a golden digest);
//! - `Zipf { exponent: S }`: expert popularity follows a Zipf law: the expert at popularity
//!   position `i` ([`WorkloadSpec::zipf_order`], a seeded permutation of the experts shared by
//!   all ranks, so hot experts are spread over ranks as in real models) has weight
//!   `(i + 1)^-S`, and each token draws `K` distinct experts by weighted sampling without
//!   replacement (slot by slot, each draw proportional to the weights still available);
//! - `Hot { fraction: F }`: each token independently, with probability `F`, puts expert 0 in
//!   slot 0 and draws its other `K - 1` experts uniformly among the rest; the other tokens are
//!   routed uniformly (so expert 0 leads a fraction `F + (1 - F) / E` of tokens on average).
//!
//! Portability: every rank and every purpose (routing, weights, activations, masking) has its
//! own ChaCha8 stream, `ChaCha8Rng::seed_from_u64(seed)` with stream `4 * rank + purpose`, so rank
//! `r`'s data depends only on `(seed, r)` and the shapes — not on `R` or on generation order —
//! and changing `H` leaves the routing alone. Only raw `u32`/`u64` draws are used (ChaCha's output
//! is specified); integers in a range use Lemire's multiply-and-reject, normals the ziggurat
//! (tables and tests from a logarithm and an exponential written here from IEEE `+ - * /` and
//! `sqrt` only), and
//! Zipf weights `exp(-S ln(i + 1))` from that logarithm and an exponential written the same way,
//! so no platform `libm` can change a bit. The Zipf popularity order uses its own stream
//! (`u64::MAX`), which depends on the seed alone.

use std::fmt;
use std::hash::{Hash, Hasher};
use std::str::FromStr;

use half::bf16;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::Tensor2;

/// How tokens choose their experts (module docs give the exact distributions). More
/// distributions (group-limited as in DeepEP's internode test) can be added without breaking
/// callers.
///
/// Parsed from and printed as `uniform`, `zipf:S`, `hot:F` ([`FromStr`], [`fmt::Display`];
/// printing then parsing gives the same value). Equality and hashing compare the parameters'
/// bit patterns.
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub enum Routing {
    /// Every set of `K` distinct experts is equally likely.
    #[default]
    Uniform,
    /// Expert popularity follows a Zipf law with this exponent (finite, `>= 0`; `0` is
    /// uniform popularity, larger is more skewed).
    Zipf {
        /// `S` in `weight(i) = (i + 1)^-S`.
        exponent: f64,
    },
    /// A fraction of tokens put expert 0 first.
    Hot {
        /// Probability, in `[0, 1]`, that a token puts expert 0 in slot 0.
        fraction: f64,
    },
}

impl Routing {
    /// Checks the parameter: Zipf exponent finite and `>= 0`, hot fraction in `[0, 1]`.
    pub fn validate(&self) -> Result<()> {
        let bad = |fix: &str| {
            Err(Error::InvalidRouting {
                routing: self.to_string(),
                fix: fix.into(),
            })
        };
        match *self {
            Self::Uniform => Ok(()),
            Self::Zipf { exponent } if !(exponent.is_finite() && exponent >= 0.0) => {
                bad("the Zipf exponent must be a finite number >= 0, e.g. zipf:1.2")
            }
            Self::Hot { fraction } if !(0.0..=1.0).contains(&fraction) => {
                bad("the hot fraction must lie in [0, 1], e.g. hot:0.5")
            }
            Self::Zipf { .. } | Self::Hot { .. } => Ok(()),
        }
    }

    /// `(variant, parameter bits)`: the identity used by `Eq` and `Hash`.
    fn key(&self) -> (u8, u64) {
        match *self {
            Self::Uniform => (0, 0),
            Self::Zipf { exponent } => (1, exponent.to_bits()),
            Self::Hot { fraction } => (2, fraction.to_bits()),
        }
    }
}

impl PartialEq for Routing {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Routing {}

impl Hash for Routing {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Uniform => f.write_str("uniform"),
            Self::Zipf { exponent } => write!(f, "zipf:{exponent}"),
            Self::Hot { fraction } => write!(f, "hot:{fraction}"),
        }
    }
}

impl FromStr for Routing {
    type Err = Error;

    /// Parses `uniform`, `zipf:S` (`S` finite, `>= 0`) or `hot:F` (`F` in `[0, 1]`); names are
    /// case-insensitive, surrounding spaces ignored.
    fn from_str(s: &str) -> Result<Self> {
        let bad = |fix: String| Error::InvalidRouting {
            routing: s.into(),
            fix,
        };
        let text = s.trim();
        let (name, value) = match text.split_once(':') {
            Some((n, v)) => (n.trim(), Some(v.trim())),
            None => (text, None),
        };
        let number = |what: &str, example: &str| -> Result<f64> {
            let v = value.ok_or_else(|| bad(format!("{what} needs a value, e.g. {example}")))?;
            v.parse::<f64>()
                .map_err(|_| bad(format!("{v:?} is not a number; write e.g. {example}")))
        };
        let routing = match name.to_ascii_lowercase().as_str() {
            "uniform" => match value {
                None => Self::Uniform,
                Some(_) => return Err(bad("uniform takes no value; write `uniform`".into())),
            },
            "zipf" => Self::Zipf {
                exponent: number("zipf", "zipf:1.2")?,
            },
            "hot" => Self::Hot {
                fraction: number("hot", "hot:0.5")?,
            },
            _ => {
                return Err(bad(
                    "unknown routing; use uniform, zipf:S (S >= 0) or hot:F (F in [0, 1])".into(),
                ));
            }
        };
        routing.validate().map_err(|_| match routing {
            Self::Zipf { .. } => bad("the Zipf exponent must be a finite number >= 0".into()),
            _ => bad("the hot fraction must lie in [0, 1]".into()),
        })?;
        Ok(routing)
    }
}

/// What to generate: shapes, seed and options.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorkloadSpec {
    /// EP size `R`: one [`RankInputs`] per rank.
    pub num_ranks: usize,
    /// Tokens per rank `T`.
    pub num_tokens: usize,
    /// Hidden size `H` (>= 1).
    pub hidden: usize,
    /// Top-k `K` (<= `num_experts`, since a token's experts are distinct).
    pub num_topk: usize,
    /// Experts `E`, a multiple of `R`.
    pub num_experts: usize,
    /// The seed.
    pub seed: u64,
    /// Top-k slots per rank set to `-1` (distinct slots, exact count, at most `T * K`).
    pub masked_per_rank: usize,
    /// Expert choice.
    pub routing: Routing,
    /// Produce FP8 activations (e4m3 bytes and float32 scales) instead of BF16.
    pub fp8: bool,
}

/// Stream offsets of the four purposes (stream = 4 * rank + purpose).
const ROUTING: u64 = 0;
const WEIGHTS: u64 = 1;
const ACTIVATIONS: u64 = 2;
const MASK: u64 = 3;
/// Stream of the Zipf popularity order: the seed's alone, shared by every rank.
const POPULARITY: u64 = u64::MAX;

impl WorkloadSpec {
    /// A BF16, uniformly routed workload without masked slots.
    pub fn new(
        num_ranks: usize,
        num_tokens: usize,
        hidden: usize,
        num_topk: usize,
        num_experts: usize,
        seed: u64,
    ) -> Self {
        Self {
            num_ranks,
            num_tokens,
            hidden,
            num_topk,
            num_experts,
            seed,
            masked_per_rank: 0,
            routing: Routing::Uniform,
            fp8: false,
        }
    }

    /// Checks the spec can be generated.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::InvalidWorkload(msg));
        if self.num_ranks == 0 {
            return bad("num_ranks = 0; a workload has at least one rank".into());
        }
        if self.hidden == 0 {
            return bad("hidden = 0; rows need at least one channel".into());
        }
        if self.num_experts == 0 || !self.num_experts.is_multiple_of(self.num_ranks) {
            return Err(Error::ExpertsNotDivisible {
                num_experts: self.num_experts,
                num_ranks: self.num_ranks,
            });
        }
        if self.num_topk > self.num_experts {
            return bad(format!(
                "num_topk = {} > num_experts = {}; a token's experts are distinct",
                self.num_topk, self.num_experts
            ));
        }
        self.routing.validate()?;
        let slots = self.num_tokens.checked_mul(self.num_topk);
        if slots.is_none_or(|s| self.masked_per_rank > s) {
            return bad(format!(
                "masked_per_rank = {} exceeds the {} x {} top-k slots of a rank",
                self.masked_per_rank, self.num_tokens, self.num_topk
            ));
        }
        Ok(())
    }

    /// One [`RankInputs`] per rank, rank order.
    pub fn generate(&self) -> Result<Vec<RankInputs>> {
        self.validate()?;
        (0..self.num_ranks).map(|r| self.rank_inputs(r)).collect()
    }

    /// The inputs of `rank` alone (equal to `generate()?[rank]`).
    pub fn generate_rank(&self, rank: usize) -> Result<RankInputs> {
        self.validate()?;
        if rank >= self.num_ranks {
            return Err(Error::InvalidWorkload(format!(
                "rank {rank} outside 0..{}",
                self.num_ranks
            )));
        }
        self.rank_inputs(rank)
    }

    /// The experts from most to least popular under [`Routing::Zipf`] with this seed: a
    /// seeded permutation of `0..E` (its own stream, so it depends on the seed and `E` only).
    pub fn zipf_order(&self) -> Vec<ExpertIdx> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(POPULARITY);
        let e = self.num_experts;
        let mut perm: Vec<ExpertIdx> = (0..e as ExpertIdx).collect();
        for i in 0..e.saturating_sub(1) {
            let j = i + below(&mut rng, (e - i) as u64) as usize;
            perm.swap(i, j);
        }
        perm
    }

    fn stream(&self, rank: usize, purpose: u64) -> ChaCha8Rng {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        rng.set_stream(4 * rank as u64 + purpose);
        rng
    }

    fn rank_inputs(&self, rank: usize) -> Result<RankInputs> {
        let (t, h, k, e) = (
            self.num_tokens,
            self.hidden,
            self.num_topk,
            self.num_experts,
        );

        let mut rng = self.stream(rank, ROUTING);
        let mut topk_idx = match self.routing {
            Routing::Uniform => uniform_routing(&mut rng, t, k, e),
            Routing::Zipf { exponent } => {
                zipf_routing(&mut rng, t, k, &zipf_weights(&self.zipf_order(), exponent))
            }
            Routing::Hot { fraction } => hot_routing(&mut rng, t, k, e, fraction),
        };

        let mut rng = self.stream(rank, WEIGHTS);
        let topk_weights = Tensor2::from_fn(t, k, |_, _| unit_open_closed_f32(&mut rng));

        let mut normal = Normal::new(self.stream(rank, ACTIVATIONS));
        let x = Tensor2::from_fn(t, h, |_, _| bf16::from_f32(normal.sample() as f32));

        if self.masked_per_rank > 0 {
            let mut rng = self.stream(rank, MASK);
            let mut slots: Vec<usize> = (0..t * k).collect();
            for i in 0..self.masked_per_rank {
                let j = i + below(&mut rng, (slots.len() - i) as u64) as usize;
                slots.swap(i, j);
                topk_idx.data_mut()[slots[i]] = -1;
            }
        }

        let x = if self.fp8 {
            let (data, scales) = crate::numerics::fp8::per_token_cast_to_fp8(&x);
            Activations::Fp8 { data, scales }
        } else {
            Activations::Bf16(x)
        };
        Ok(RankInputs {
            x,
            topk_idx,
            topk_weights,
        })
    }
}

/// `K` distinct experts per token by a partial Fisher–Yates shuffle of `0..E`.
fn uniform_routing(rng: &mut ChaCha8Rng, t: usize, k: usize, e: usize) -> Tensor2<ExpertIdx> {
    let mut perm: Vec<ExpertIdx> = (0..e as ExpertIdx).collect();
    let mut out = Tensor2::filled(t, k, -1);
    for token in 0..t {
        for slot in 0..k {
            let j = slot + below(rng, (e - slot) as u64) as usize;
            perm.swap(slot, j);
            out.set(token, slot, perm[slot]);
        }
    }
    out
}

/// Zipf weight of each expert id: `(i + 1)^-S = exp(-S ln(i + 1))` for the expert at
/// popularity position `i` of `order`.
fn zipf_weights(order: &[ExpertIdx], exponent: f64) -> Vec<f64> {
    let mut w = vec![0.0; order.len()];
    for (i, &e) in order.iter().enumerate() {
        w[e as usize] = portable_exp(-exponent * portable_ln((i + 1) as f64));
    }
    w
}

/// `K` distinct experts per token by weighted sampling without replacement: slot by slot, one
/// uniform draw in `[0, remaining weight)` walks the untaken experts in id order. The running
/// total is updated by subtraction in a fixed order (deterministic); if rounding leaves the
/// draw past the last untaken expert, that expert is taken.
fn zipf_routing(rng: &mut ChaCha8Rng, t: usize, k: usize, weights: &[f64]) -> Tensor2<ExpertIdx> {
    let e = weights.len();
    let total_all: f64 = weights.iter().sum();
    let mut out = Tensor2::filled(t, k, -1);
    let mut taken = vec![false; e];
    for token in 0..t {
        taken.iter_mut().for_each(|x| *x = false);
        let mut total = total_all;
        for slot in 0..k {
            let u = unit_f64(rng) * total;
            let mut acc = 0.0;
            let mut pick = None;
            let mut last = None;
            for (id, &w) in weights.iter().enumerate() {
                if taken[id] {
                    continue;
                }
                if last.is_none() || w > 0.0 {
                    last = Some(id);
                }
                acc += w;
                if acc > u && w > 0.0 {
                    pick = Some(id);
                    break;
                }
            }
            // `k <= e` is validated, so an untaken expert remains.
            let Some(id) = pick.or(last) else { break };
            taken[id] = true;
            total -= weights[id];
            out.set(token, slot, id as ExpertIdx);
        }
    }
    out
}

/// Per token, with probability `fraction` expert 0 in slot 0 and `K - 1` other experts drawn
/// uniformly from the rest; otherwise `K` distinct experts uniformly (as [`uniform_routing`]).
fn hot_routing(
    rng: &mut ChaCha8Rng,
    t: usize,
    k: usize,
    e: usize,
    fraction: f64,
) -> Tensor2<ExpertIdx> {
    let mut perm: Vec<ExpertIdx> = (0..e as ExpertIdx).collect();
    let mut out = Tensor2::filled(t, k, -1);
    for token in 0..t {
        let hot = unit_f64(rng) < fraction;
        let mut first = 0;
        if hot && k > 0 {
            // Expert 0 is somewhere in the permutation; move it to the front.
            if let Some(p) = perm.iter().position(|&x| x == 0) {
                perm.swap(0, p);
            }
            out.set(token, 0, 0);
            first = 1;
        }
        for slot in first..k {
            let j = slot + below(rng, (e - slot) as u64) as usize;
            perm.swap(slot, j);
            out.set(token, slot, perm[slot]);
        }
    }
    out
}

/// Uniform integer in `0..n` (`n >= 1`): Lemire's multiply-and-reject, unbiased and portable.
fn below(rng: &mut impl RngCore, n: u64) -> u64 {
    debug_assert!(n > 0);
    let mut m = u128::from(rng.next_u64()) * u128::from(n);
    if (m as u64) < n {
        let threshold = n.wrapping_neg() % n;
        while (m as u64) < threshold {
            m = u128::from(rng.next_u64()) * u128::from(n);
        }
    }
    (m >> 64) as u64
}

/// Uniform in `(0, 1]` with 24 bits: exact in f32, never zero.
fn unit_open_closed_f32(rng: &mut impl RngCore) -> f32 {
    ((rng.next_u32() >> 8) + 1) as f32 * (1.0 / (1u32 << 24) as f32)
}

/// Uniform in `[0, 1)` with 53 bits.
fn unit_f64(rng: &mut impl RngCore) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal samples by Marsaglia and Tsang's ziggurat (128 layers, "The Ziggurat Method
/// for Generating Random Variables", 2000): one `u64` draw per sample almost always — its low 7
/// bits pick the layer, its high 32 bits (signed) the point — with the wedge and tail tests in
/// the rare rest. The layer tables come from the paper's recurrence evaluated with the portable
/// `ln`/`exp` below and IEEE `sqrt`, so every machine draws the same values.
struct Normal<R> {
    rng: R,
    t: &'static Ziggurat,
}

/// The ziggurat's layer tables: `k[i]` the fast-path bound on `|hz|`, `w[i]` the scale from
/// `hz` to `x`, `f[i] = exp(-x_i² / 2)`.
struct Ziggurat {
    k: [u32; 128],
    w: [f64; 128],
    f: [f64; 128],
}

/// The rightmost layer's edge and the common layer area of the 128-layer ziggurat.
const ZIG_R: f64 = 3.442_619_855_899;
const ZIG_V: f64 = 9.912_563_035_262_17e-3;

impl Ziggurat {
    fn get() -> &'static Ziggurat {
        static T: std::sync::OnceLock<Ziggurat> = std::sync::OnceLock::new();
        T.get_or_init(Self::build)
    }

    fn build() -> Self {
        let m1 = 2_147_483_648.0f64;
        let (mut dn, mut tn) = (ZIG_R, ZIG_R);
        let q = ZIG_V / portable_exp(-0.5 * dn * dn);
        let mut t = Ziggurat {
            k: [0; 128],
            w: [0.0; 128],
            f: [0.0; 128],
        };
        t.k[0] = ((dn / q) * m1) as u32;
        t.k[1] = 0;
        t.w[0] = q / m1;
        t.w[127] = dn / m1;
        t.f[0] = 1.0;
        t.f[127] = portable_exp(-0.5 * dn * dn);
        for i in (1..=126).rev() {
            dn = (-2.0 * portable_ln(ZIG_V / dn + portable_exp(-0.5 * dn * dn))).sqrt();
            t.k[i + 1] = ((dn / tn) * m1) as u32;
            tn = dn;
            t.f[i] = portable_exp(-0.5 * dn * dn);
            t.w[i] = dn / m1;
        }
        t
    }
}

impl<R: RngCore> Normal<R> {
    fn new(rng: R) -> Self {
        Self {
            rng,
            t: Ziggurat::get(),
        }
    }

    /// Uniform in `(0, 1]` with 53 bits (never zero, so its logarithm is finite).
    fn unit_open(&mut self) -> f64 {
        ((self.rng.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    fn sample(&mut self) -> f64 {
        let t = self.t;
        loop {
            let u = self.rng.next_u64();
            let i = (u & 127) as usize;
            let hz = (u >> 32) as u32 as i32;
            let x = f64::from(hz) * t.w[i];
            if hz.unsigned_abs() < t.k[i] {
                return x;
            }
            if i == 0 {
                // The tail beyond ZIG_R (Marsaglia's exponential method).
                loop {
                    let xt = -portable_ln(self.unit_open()) / ZIG_R;
                    let y = -portable_ln(self.unit_open());
                    if y + y >= xt * xt {
                        return if hz > 0 { ZIG_R + xt } else { -ZIG_R - xt };
                    }
                }
            }
            // The wedge between layers i and i - 1.
            if t.f[i] + unit_f64(&mut self.rng) * (t.f[i - 1] - t.f[i]) < portable_exp(-0.5 * x * x)
            {
                return x;
            }
        }
    }
}

/// Natural logarithm of a positive, normal, finite `x`, from IEEE basic operations only (so the
/// result is the same bits everywhere): `x = m * 2^e` with `m` in `[sqrt(1/2), sqrt(2))`, then
/// `ln m = 2 atanh(t)`, `t = (m - 1) / (m + 1)`, `|t| < 0.172`, summed to `t^27` (error < 1e-19).
fn portable_ln(x: f64) -> f64 {
    const MANTISSA: u64 = (1 << 52) - 1;
    let bits = x.to_bits();
    let mut e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & MANTISSA) | (1023 << 52));
    if m > std::f64::consts::SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let mut term = t;
    let mut sum = 0.0;
    for k in 0..14 {
        sum += term / (2 * k + 1) as f64;
        term *= t2;
    }
    2.0 * sum + e as f64 * std::f64::consts::LN_2
}

/// `e^x` from IEEE basic operations only (the same bits everywhere): `x = k ln 2 + r` with
/// `|r| <= ln 2 / 2` (Cody–Waite reduction; `k` rounded half away from zero by an exact cast), `e^r` by its Taylor
/// series to `r^20` (Horner; remainder < 1e-25), scaled by `2^k` built from its bits. Returns
/// `0` below `-745`, `+inf` above `709`, NaN for NaN. Relative error about 1e-15.
fn portable_exp(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x > 709.0 {
        return f64::INFINITY;
    }
    if x < -745.0 {
        return 0.0;
    }
    let q = x / std::f64::consts::LN_2;
    let k = (q + if q < 0.0 { -0.5 } else { 0.5 }) as i64;
    // Cody–Waite: ln 2 = LN2_HI + LN2_LO with LN2_HI's low 21 bits zero, so `k * LN2_HI` is
    // exact for any `k` here and `r` keeps full precision even for `|x|` near 700.
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    let r = (x - k as f64 * LN2_HI) - k as f64 * LN2_LO;
    let mut p = 1.0;
    for n in (1..=20).rev() {
        p = 1.0 + r * p / f64::from(n);
    }
    let pow2 = |k: i64| f64::from_bits(((k + 1023) as u64) << 52);
    if k >= -1022 {
        p * pow2(k)
    } else {
        // Subnormal result: scale in two exact-power steps.
        p * pow2(k + 600) * pow2(-600)
    }
}

/// A portable fingerprint of a workload (pin it in tests; compare it across repeats, like
/// DeepEP's `hash_tensor`): FNV-1a (64-bit) over 64-bit words — the little-endian byte stream of
/// every rank's shapes and bits, in rank order, cut into 8-byte words (a short last word is
/// zero-padded and followed by its byte count), each word XORed in whole before the multiply.
/// Word-wise rather than byte-wise so that half a GiB of activations hashes in a fraction of a
/// second.
pub fn digest(inputs: &[RankInputs]) -> u64 {
    let mut h = Fnv::new();
    h.write(&(inputs.len() as u64).to_le_bytes());
    for r in inputs {
        for d in [r.num_tokens(), r.num_topk(), r.x.hidden()] {
            h.write(&(d as u64).to_le_bytes());
        }
        match &r.x {
            Activations::Bf16(x) => {
                h.write(&[0]);
                h.elements(x.data(), |v| v.to_bits().to_le_bytes());
            }
            Activations::Fp8 { data, scales } => {
                h.write(&[1]);
                h.write(data.data());
                h.elements(scales.data(), |s| s.to_bits().to_le_bytes());
            }
            // `Activations` may grow; a new kind still changes the digest through its shape.
            #[allow(unreachable_patterns, reason = "Activations may gain variants")]
            _ => h.write(&[2]),
        }
        h.elements(r.topk_idx.data(), i64::to_le_bytes);
        h.elements(r.topk_weights.data(), |w| w.to_bits().to_le_bytes());
    }
    h.finish()
}

/// Word-wise FNV-1a over a byte stream (see [`digest`]); bytes are staged so that words never
/// depend on how the stream was cut into writes.
struct Fnv {
    h: u64,
    buf: Vec<u8>,
}

impl Fnv {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    /// Bytes staged before they are hashed (a multiple of 8).
    const STAGE: usize = 1 << 16;

    fn new() -> Self {
        Self {
            h: 0xcbf2_9ce4_8422_2325,
            buf: Vec::with_capacity(Self::STAGE),
        }
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(Self::STAGE) {
            if self.buf.len() + chunk.len() > Self::STAGE {
                self.drain_words();
            }
            self.buf.extend_from_slice(chunk);
        }
    }

    fn elements<T: Copy, const N: usize>(&mut self, v: &[T], enc: impl Fn(T) -> [u8; N]) {
        for chunk in v.chunks(Self::STAGE / N) {
            if self.buf.len() + chunk.len() * N > Self::STAGE {
                self.drain_words();
            }
            for &x in chunk {
                self.buf.extend_from_slice(&enc(x));
            }
        }
    }

    /// Hashes every whole word staged, keeping the remainder (under 8 bytes).
    fn drain_words(&mut self) {
        let whole = self.buf.len() / 8 * 8;
        for w in self.buf[..whole].chunks_exact(8) {
            self.h ^= u64::from_le_bytes(w.try_into().expect("8 bytes"));
            self.h = self.h.wrapping_mul(Self::PRIME);
        }
        self.buf.drain(..whole);
    }

    fn finish(mut self) -> u64 {
        self.drain_words();
        let n = self.buf.len();
        if n > 0 {
            let mut w = [0u8; 8];
            w[..n].copy_from_slice(&self.buf);
            for x in [u64::from_le_bytes(w), n as u64] {
                self.h ^= x;
                self.h = self.h.wrapping_mul(Self::PRIME);
            }
        }
        self.h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_ln_matches_std() {
        let mut x = 1e-30f64;
        while x < 1.0 {
            let (a, b) = (portable_ln(x), x.ln());
            assert!((a - b).abs() <= 1e-15 * b.abs().max(1.0), "{x}: {a} vs {b}");
            x *= 1.37;
        }
    }

    #[test]
    fn portable_exp_matches_std() {
        let mut x = -700.0f64;
        while x < 709.0 {
            let (a, b) = (portable_exp(x), x.exp());
            assert!((a - b).abs() <= 4e-15 * b, "{x}: {a} vs {b}");
            x += 0.731;
        }
        assert_eq!(portable_exp(0.0), 1.0);
        assert_eq!(portable_exp(-1000.0), 0.0);
        assert_eq!(portable_exp(1000.0), f64::INFINITY);
        assert!(portable_exp(f64::NAN).is_nan());
    }

    #[test]
    fn zipf_weights_follow_the_power_law() {
        let order: Vec<ExpertIdx> = vec![2, 0, 1, 3];
        let w = zipf_weights(&order, 1.5);
        for (i, &e) in order.iter().enumerate() {
            let want = ((i + 1) as f64).powf(-1.5);
            assert!(
                (w[e as usize] - want).abs() < 1e-14,
                "{i}: {} vs {want}",
                w[e as usize]
            );
        }
        assert_eq!(zipf_weights(&order, 0.0), vec![1.0; 4]);
    }

    #[test]
    fn below_is_in_range_and_hits_all() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut seen = [false; 7];
        for _ in 0..1000 {
            let v = below(&mut rng, 7) as usize;
            seen[v] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn normal_moments() {
        let mut n = Normal::new(ChaCha8Rng::seed_from_u64(3));
        let k = 200_000;
        let (mut s1, mut s2) = (0.0, 0.0);
        for _ in 0..k {
            let z = n.sample();
            s1 += z;
            s2 += z * z;
        }
        let mean = s1 / k as f64;
        let var = s2 / k as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }

    /// The ziggurat's shape: the fourth moment, the mass within one sigma, and the tail beyond
    /// the last layer (where the exponential method takes over) match the normal law.
    #[test]
    fn normal_shape_and_tail() {
        let mut n = Normal::new(ChaCha8Rng::seed_from_u64(11));
        let k = 2_000_000;
        let (mut s4, mut inside, mut tail, mut neg) = (0.0, 0usize, 0usize, 0usize);
        for _ in 0..k {
            let z = n.sample();
            s4 += z * z * z * z;
            inside += usize::from(z.abs() < 1.0);
            tail += usize::from(z.abs() > ZIG_R);
            neg += usize::from(z < 0.0);
        }
        let kf = k as f64;
        assert!((s4 / kf - 3.0).abs() < 0.05, "E[z^4] {}", s4 / kf);
        assert!((inside as f64 / kf - 0.682_689).abs() < 0.002, "P(|z|<1)");
        // P(|z| > 3.4426) = 5.76e-4: about 1152 of 2e6, sd about 34.
        assert!((1000..1300).contains(&tail), "tail {tail}");
        assert!((neg as f64 / kf - 0.5).abs() < 0.002, "P(z<0)");
    }
}
