//! Low-latency dispatch/combine semantics (spec §2.4, §2.5, §2.7, §6.4, §10 cases 14–16): the
//! plan against the independent oracle, structural checks straight from the inputs, and the
//! end-to-end identity combine(expert(dispatch(x))) = 2·x.

use ep_core::numerics::fp8;
use ep_core::oracle::low_latency as oracle;
use ep_core::plan::low_latency::{
    self as plan, LlDispatchOutput, LlFormat, LlHandle, LlParams, LlRecvX, PartialPrecision,
    canonicalize, map_rows, scales_column_major, unpack_layout_range,
};
use ep_core::{Activations, RankInputs, Tensor2, Tensor3};
use half::bf16;
use proptest::prelude::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// ---- input generation ----------------------------------------------------------------------

/// A random low-latency problem.
#[derive(Clone, Debug)]
struct Problem {
    inputs: Vec<RankInputs>,
    params: LlParams,
}

/// Values spread over magnitudes, with zeros, per-block scales and outliers.
fn random_x(rng: &mut ChaCha8Rng, t: usize, h: usize) -> Tensor2<bf16> {
    let exps: Vec<i32> = (0..t * h / 128)
        .map(|_| rng.random_range(-12..12))
        .collect();
    Tensor2::from_fn(t, h, |r, c| {
        // One draw per element: 24 bits of value in [-1, 1), 8 bits to pick zeros / outliers.
        let bits: u32 = rng.random();
        let v = (bits >> 8) as f32 / (1u32 << 23) as f32 - 1.0;
        let v = match bits & 0xff {
            0..=5 => 0.0,
            6..=11 => v * 50.0,
            _ => v,
        };
        bf16::from_f32(v * 2f32.powi(exps[r * (h / 128) + c / 128]))
    })
}

/// `[T, K]` routing: distinct experts per row, some entries -1, and (when `dups`) some rows
/// naming an expert twice, without overflowing any expert's `n` slots for this rank.
fn random_topk(
    rng: &mut ChaCha8Rng,
    t: usize,
    k: usize,
    e: usize,
    n: usize,
    dups: bool,
) -> Tensor2<i64> {
    let mut idx = Tensor2::filled(t, k, -1i64);
    let mut experts: Vec<i64> = (0..e as i64).collect();
    for r in 0..t {
        experts.shuffle(rng);
        for (c, &x) in experts.iter().take(k).enumerate() {
            idx.set(r, c, x);
        }
        for c in 0..k {
            if rng.random_range(0..5) == 0 {
                idx.set(r, c, -1);
            }
        }
        if dups && k >= 2 && rng.random_range(0..6) == 0 {
            let v = idx.get(r, 0);
            idx.set(r, k - 1, v);
        }
    }
    // A rank has n slots per expert; drop duplicates that would overflow them.
    let mut count = vec![0usize; e];
    for r in 0..t {
        for c in 0..k {
            if let Ok(x) = usize::try_from(idx.get(r, c)) {
                if count[x] == n {
                    idx.set(r, c, -1);
                } else {
                    count[x] += 1;
                }
            }
        }
    }
    idx
}

/// Positive weights, `|randn|`-like.
fn random_weights(rng: &mut ChaCha8Rng, t: usize, k: usize) -> Tensor2<f32> {
    Tensor2::from_fn(t, k, |_, _| rng.random_range(0.05f32..1.5))
}

#[allow(clippy::too_many_arguments)]
fn make_problem(
    seed: u64,
    r: usize,
    l: usize,
    n_hint: usize,
    k: usize,
    h: usize,
    fp8_mode: u8,
    mask: bool,
) -> Problem {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // R·N must be a multiple of 4.
    let step = 4 / gcd(r, 4);
    let n = n_hint.div_ceil(step) * step;
    let e = r * l;
    let inputs = (0..r)
        .map(|_| {
            let t = rng.random_range(0..=n);
            RankInputs {
                x: Activations::Bf16(random_x(&mut rng, t, h)),
                topk_idx: random_topk(&mut rng, t, k, e, n, true),
                topk_weights: random_weights(&mut rng, t, k),
            }
        })
        .collect();
    let mut params = LlParams::new(n, e);
    params = match fp8_mode {
        1 => params.with_fp8(false, false),
        2 => params.with_fp8(true, false),
        3 => params.with_fp8(true, true),
        _ => params,
    };
    if mask {
        params.masked_ranks = (0..r).map(|_| rng.random_range(0..4) == 0).collect();
    }
    Problem { inputs, params }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Random problems: R in 1..=16, L in 1..=4 (E = R·L), N up to 8 (fewer for many ranks, which
/// keeps a case's R²·N·L·H work bounded; N is rounded up so that R·N % 4 == 0), T in 0..=N per
/// rank, K in 1..=9, H 128 or 256 (BF16) or 512 (FP8), FP8 modes from `fp8_modes` (0 = BF16,
/// 1 = FP8, 2 = rounded scales, 3 = UE8M0), masked entries, duplicates, and masked ranks in
/// half of the cases.
fn problem_strategy(fp8_modes: std::ops::Range<u8>) -> impl Strategy<Value = Problem> {
    (
        any::<u64>(),
        1usize..=16,
        1usize..=4,
        0usize..=8,
        1usize..=9,
        fp8_modes,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(seed, r, l, n, k, fp8_mode, wide, mask)| {
            let h = match (fp8_mode, wide) {
                (0, false) => 128,
                (0, true) => 256,
                _ => 512,
            };
            let n = n.min((48 / r).max(2));
            make_problem(seed, r, l, n, k, h, fp8_mode, mask)
        })
}

// ---- helpers -------------------------------------------------------------------------------

fn x_bf16(inp: &RankInputs) -> &Tensor2<bf16> {
    match &inp.x {
        Activations::Bf16(x) => x,
        Activations::Fp8 { .. } => panic!("test inputs are BF16"),
    }
}

/// Structural checks of one receiver's outputs straight from the inputs (independent of
/// `canonicalize`): counts, layout, and the multiset of `src_info` per source block.
fn check_structure(p: &Problem, d: usize, out: &LlDispatchOutput) -> Result<(), String> {
    let r = p.inputs.len();
    let l_count = p.params.num_experts / r;
    for l in 0..l_count {
        let e = (d * l_count + l) as i64;
        let mut total = 0usize;
        for (s, inp) in p.inputs.iter().enumerate() {
            let (begin, count) = unpack_layout_range(out.handle.layout_range.get(l, s));
            let mut expect: Vec<i32> = Vec::new();
            if !p.params.is_masked(s) {
                for t in 0..inp.num_tokens() {
                    for &x in inp.topk_idx.row(t) {
                        if x == e {
                            expect.push(t as i32);
                        }
                    }
                }
            }
            let mut got: Vec<i32> = (begin..begin + count)
                .map(|row| out.handle.src_info.get(l, row as usize))
                .collect();
            got.sort_unstable();
            if got != expect {
                return Err(format!(
                    "rank {d} local {l} source {s}: src_info {got:?}, expected {expect:?}"
                ));
            }
            total += count as usize;
        }
        if out.recv_count[l] as usize != total {
            return Err(format!(
                "rank {d} local {l}: count {} vs {total}",
                out.recv_count[l]
            ));
        }
    }
    Ok(())
}

/// An "expert" that is a function of the row contents and the local expert only.
fn expert_fn(l: usize, row: &[f32]) -> Vec<bf16> {
    let a = 0.75 * (l + 1) as f32;
    row.iter()
        .enumerate()
        .map(|(c, &v)| bf16::from_f32(v * a + (c % 7) as f32 * 0.01))
        .collect()
}

type ExpertOut = Vec<Option<Tensor3<bf16>>>;

fn plan_expert_outputs(
    outs: &[Option<LlDispatchOutput>],
    f: fn(usize, &[f32]) -> Vec<bf16>,
) -> ExpertOut {
    outs.iter()
        .map(|o| o.as_ref().map(|o| map_rows(o, f).unwrap()))
        .collect()
}

/// The oracle's expert outputs, dequantising with the oracle's own reader.
fn oracle_expert_outputs(
    outs: &[Option<LlDispatchOutput>],
    f: fn(usize, &[f32]) -> Vec<bf16>,
) -> ExpertOut {
    outs.iter()
        .map(|o| {
            o.as_ref().map(|o| {
                let rows = o.handle.src_info.cols();
                let mut t = Tensor3::filled(o.recv_count.len(), rows, o.handle.hidden, bf16::ZERO);
                for l in 0..o.recv_count.len() {
                    for row in 0..o.recv_count[l] as usize {
                        t.row_mut(l, row)
                            .copy_from_slice(&f(l, &oracle::received_row_f32(o, l, row).unwrap()));
                    }
                }
                t
            })
        })
        .collect()
}

fn handles(outs: &[Option<LlDispatchOutput>]) -> Vec<Option<LlHandle>> {
    outs.iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect()
}

fn bits(t: &Tensor2<bf16>) -> Vec<u16> {
    t.data().iter().map(|v| v.to_bits()).collect()
}

// ---- plan versus oracle --------------------------------------------------------------------

proptest! {
    #[test]
    fn plan_and_oracle_agree(p in problem_strategy(0..4)) {
        let plan_out = plan::dispatch(&p.inputs, &p.params).unwrap();
        let oracle_out = oracle::dispatch(&p.inputs, &p.params).unwrap();
        prop_assert_eq!(plan_out.len(), p.inputs.len());
        for (d, (a, b)) in plan_out.iter().zip(&oracle_out).enumerate() {
            prop_assert_eq!(a.is_none(), p.params.is_masked(d));
            prop_assert_eq!(b.is_none(), p.params.is_masked(d));
            let (Some(a), Some(b)) = (a, b) else { continue };
            check_structure(&p, d, a).map_err(TestCaseError::fail)?;
            check_structure(&p, d, b).map_err(TestCaseError::fail)?;
            let (ca, cb) = (canonicalize(a).unwrap(), canonicalize(b).unwrap());
            if let Some(diff) = ca.first_difference(&cb) {
                return Err(TestCaseError::fail(format!("rank {d}: {diff}")));
            }
            prop_assert_eq!(ca, cb);
            // dispatch_rank gives the same as the batch call.
            prop_assert_eq!(&plan::dispatch_rank(&p.inputs, &p.params, d).unwrap(), &Some(a.clone()));
        }

        // Combine: each side with its own placement, handles and expert outputs.
        let y_plan = plan_expert_outputs(&plan_out, expert_fn);
        let y_oracle = oracle_expert_outputs(&oracle_out, expert_fn);
        let c_plan = plan::combine(&p.inputs, &handles(&plan_out), &y_plan, &p.params).unwrap();
        let c_oracle = oracle::combine(&p.inputs, &handles(&oracle_out), &y_oracle, &p.params).unwrap();
        for (me, (a, b)) in c_plan.iter().zip(&c_oracle).enumerate() {
            prop_assert_eq!(a.is_none(), p.params.is_masked(me));
            if let (Some(a), Some(b)) = (a, b) {
                prop_assert_eq!(a.shape(), (p.inputs[me].num_tokens(), p.inputs[0].x.hidden()));
                prop_assert_eq!(bits(a), bits(b), "combine on rank {}", me);
            }
        }

        // ep-rs's reduction order (partials on the expert's rank) differs from DeepEP's only
        // in rounding. With mixed signs the result can cancel, so the tolerance is relative to
        // M = Σ_k w·|y| (computed by combining |y|): f32 partials reassociate the sum (error
        // ≪ 2^-20·M) and then round to BF16 (half an ulp of each result, ≤ 2^-9·M); BF16 partials
        // add one rounding per owner (≤ 2^-9·M in total, as Σ_d |p_d| ≤ M). 2^-7·M covers both.
        let y_abs: ExpertOut = y_plan
            .iter()
            .map(|o| o.as_ref().map(|t| {
                let (n, rows, cols) = t.shape();
                let abs = t.data().iter().map(|v| bf16::from_f32(v.to_f32().abs())).collect();
                Tensor3::new(n, rows, cols, abs).unwrap()
            }))
            .collect();
        let magnitude = plan::combine(&p.inputs, &handles(&plan_out), &y_abs, &p.params).unwrap();
        for precision in [PartialPrecision::F32, PartialPrecision::Bf16] {
            let c2 = plan::combine_reduced_on_expert_rank(
                &p.inputs, &handles(&plan_out), &y_plan, &p.params, precision).unwrap();
            for ((a, b), m) in c_plan.iter().zip(&c2).zip(&magnitude) {
                let (Some(a), Some(b), Some(m)) = (a, b, m) else { continue };
                for ((x, y), m) in a.data().iter().zip(b.data()).zip(m.data()) {
                    let (x, y, m) = (x.to_f32(), y.to_f32(), m.to_f32());
                    prop_assert!((x - y).abs() <= 2f32.powi(-7) * m, "{:?}: {} vs {} (M {})", precision, x, y, m);
                }
            }
        }
    }
}

// ---- end-to-end identity -------------------------------------------------------------------

/// Normalises each token's weights to sum to 1 over the entries combine will use (valid and on
/// an unmasked rank).
fn normalise_weights(p: &mut Problem) {
    let l_count = p.params.num_experts / p.inputs.len();
    let masked = p.params.clone();
    for inp in &mut p.inputs {
        for t in 0..inp.num_tokens() {
            let live: Vec<bool> = inp
                .topk_idx
                .row(t)
                .iter()
                .map(|&e| e >= 0 && !masked.is_masked(e as usize / l_count))
                .collect();
            let sum: f32 = (0..live.len())
                .filter(|&k| live[k])
                .map(|k| inp.topk_weights.get(t, k))
                .sum();
            for (k, &is_live) in live.iter().enumerate() {
                let w = if is_live {
                    inp.topk_weights.get(t, k) / sum
                } else {
                    0.0
                };
                inp.topk_weights.set(t, k, w);
            }
        }
    }
}

fn has_live_entry(p: &Problem, inp: &RankInputs, t: usize) -> bool {
    let l_count = p.params.num_experts / p.inputs.len();
    inp.topk_idx
        .row(t)
        .iter()
        .any(|&e| e >= 0 && !p.params.is_masked(e as usize / l_count))
}

fn double(_: usize, row: &[f32]) -> Vec<bf16> {
    row.iter().map(|&v| bf16::from_f32(2.0 * v)).collect()
}

proptest! {
    /// BF16 dispatch, weights normalised over the live entries, expert 2·x: combine gives 2·x
    /// exactly. Why exact: every live entry reads the same BF16 row 2·x (doubling is exact), the
    /// f32 sum is 2·x·Σw with Σw = 1 up to ~K f32 ulps, i.e. within ~2^-19 relative of 2·x, far
    /// inside half a BF16 ulp (2^-9 relative), so rounding to BF16 returns 2·x. Tokens without a
    /// live entry give 0.
    #[test]
    fn identity_bf16(p in problem_strategy(0..1)) {
        let mut p = p;
        normalise_weights(&mut p);
        let outs = plan::dispatch(&p.inputs, &p.params).unwrap();
        let y = plan_expert_outputs(&outs, double);
        let combined = plan::combine(&p.inputs, &handles(&outs), &y, &p.params).unwrap();
        for (me, c) in combined.iter().enumerate() {
            let Some(c) = c else { continue };
            let x = x_bf16(&p.inputs[me]);
            for t in 0..x.rows() {
                let live = has_live_entry(&p, &p.inputs[me], t);
                for (h, v) in c.row(t).iter().enumerate() {
                    let expect = if live { 2.0 * x.get(t, h).to_f32() } else { 0.0 };
                    prop_assert_eq!(v.to_f32(), expect, "rank {} token {} channel {}", me, t, h);
                }
            }
        }
    }

    /// FP8 dispatch, same identity: every live entry reads the same row bf16(2·deq(x)), so by
    /// the argument above combine returns exactly bf16(2·deq(x)); and
    /// |bf16(2·deq) − 2x| ≤ 2^-8·|2·deq| + 2·(2^-4·|x|·(1+2^-16) + 2^-17·amax) — one BF16
    /// rounding plus twice the per-element e4m3 bound of `fp8_abs_error_bound`.
    #[test]
    fn identity_fp8(p in problem_strategy(1..4)) {
        let mut p = p;
        normalise_weights(&mut p);
        let outs = plan::dispatch(&p.inputs, &p.params).unwrap();
        let y = plan_expert_outputs(&outs, double);
        let combined = plan::combine(&p.inputs, &handles(&outs), &y, &p.params).unwrap();
        for (me, c) in combined.iter().enumerate() {
            let Some(c) = c else { continue };
            let x = x_bf16(&p.inputs[me]);
            let (q, s) = fp8::cast_rows(x, p.params.round_scale).unwrap();
            let deq = fp8::dequantize(&q, &s).unwrap();
            for t in 0..x.rows() {
                let live = has_live_entry(&p, &p.inputs[me], t);
                let amaxes: Vec<f32> = x.row(t).chunks(128).map(fp8::block_amax).collect();
                for (h, v) in c.row(t).iter().enumerate() {
                    let v = v.to_f32();
                    if !live {
                        prop_assert_eq!(v, 0.0);
                        continue;
                    }
                    let d2 = bf16::from_f32(2.0 * deq.get(t, h)).to_f32();
                    prop_assert_eq!(v, d2, "rank {} token {} channel {}", me, t, h);
                    let xv = x.get(t, h).to_f32();
                    let amax = amaxes[h / 128];
                    let bound = 2f32.powi(-8) * d2.abs() + 2.0 * fp8::fp8_abs_error_bound(xv, amax);
                    prop_assert!((v - 2.0 * xv).abs() <= bound, "{} vs 2·{} (bound {})", v, xv, bound);
                }
            }
        }
    }
}

// ---- spec §10 conformance cases --------------------------------------------------------------

/// DeepEP's `calc_diff` (spec §6.1) over slices.
fn calc_diff(x: &[f64], y: &[f64]) -> f64 {
    ep_core::numerics::calc_diff(x.iter().copied(), y.iter().copied())
}

/// The §6.4 inputs: `x = rank − 128` except the last 128 columns, which hold the token index;
/// top-k distinct random experts with `masked_entries` random entries set to −1.
fn deepep_ll_inputs(
    seed: u64,
    r: usize,
    e: usize,
    t: usize,
    k: usize,
    h: usize,
    masked_entries: usize,
) -> Vec<RankInputs> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..r)
        .map(|rank| {
            let x = Tensor2::from_fn(t, h, |tok, c| {
                bf16::from_f32(if c >= h - 128 {
                    tok as f32
                } else {
                    rank as f32 - 128.0
                })
            });
            let mut idx = random_topk(&mut rng, t, k, e, t, false);
            // random_topk also masks ~1/5 of the entries; restore and mask exactly as DeepEP does.
            let mut experts: Vec<i64> = (0..e as i64).collect();
            for tok in 0..t {
                experts.shuffle(&mut rng);
                for (c, &x) in experts.iter().take(k).enumerate() {
                    idx.set(tok, c, x);
                }
            }
            for _ in 0..masked_entries {
                idx.set(rng.random_range(0..t), rng.random_range(0..k), -1);
            }
            RankInputs {
                x: Activations::Bf16(x),
                topk_weights: random_weights(&mut rng, t, k),
                topk_idx: idx,
            }
        })
        .collect()
}

/// Case 14 (LL dispatch multiset): R=8, E=288, N=T=128, K=8, 10 masked entries per rank. `H` is
/// 512 instead of 7168: each receiver's `packed_recv_x` is `[36][1024, H]`, 528 MiB of BF16 at
/// H=7168 per rank; the checks do not depend on H beyond the 128 token-id columns. BF16 and FP8.
#[test]
fn case14_ll_dispatch_multiset() {
    let (r, e, n, k, h) = (8, 288, 128, 8, 512);
    let inputs = deepep_ll_inputs(14, r, e, n, k, h, 10);
    let l_count = e / r;
    for fp8_mode in [0u8, 1] {
        let params = if fp8_mode == 0 {
            LlParams::new(n, e)
        } else {
            LlParams::new(n, e).with_fp8(false, false)
        };
        for d in 0..r {
            let out = plan::dispatch_rank(&inputs, &params, d).unwrap().unwrap();
            let out_oracle = oracle::dispatch_rank(&inputs, &params, d).unwrap().unwrap();
            assert_eq!(
                canonicalize(&out).unwrap(),
                canonicalize(&out_oracle).unwrap(),
                "rank {d}"
            );
            for l in 0..l_count {
                let expert = (d * l_count + l) as i64;
                let all = inputs
                    .iter()
                    .flat_map(|i| i.topk_idx.data())
                    .filter(|&&x| x == expert)
                    .count();
                assert_eq!(out.recv_count[l] as usize, all);
                let layout_sum: u32 = (0..r)
                    .map(|s| unpack_layout_range(out.handle.layout_range.get(l, s)).1)
                    .sum();
                assert_eq!(out.recv_count[l] as u32, layout_sum);
                for (s, inp) in inputs.iter().enumerate() {
                    let (begin, count) = unpack_layout_range(out.handle.layout_range.get(l, s));
                    let from_s = inp.topk_idx.data().iter().filter(|&&x| x == expert).count();
                    assert_eq!(count as usize, from_s);
                    for row in begin as usize..(begin + count) as usize {
                        let src = out.handle.src_info.get(l, row);
                        let v = out.recv_x.row_f32(l, row).unwrap();
                        // Per-token BF16 rounding of the dequantised row, as per_token_cast_back.
                        let v: Vec<f32> = v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect();
                        assert!(
                            v[..h - 128].iter().all(|&x| x == s as f32 - 128.0),
                            "rank {d} l {l} s {s}"
                        );
                        assert!(
                            v[h - 128..].iter().all(|&x| x == (src as usize % n) as f32),
                            "token id column"
                        );
                        assert!(inp.topk_idx.row(src as usize).contains(&expert));
                    }
                }
            }
        }
    }
}

/// Case 15 (LL FP8 scales): FP8 with and without `round_scale`, and UE8M0 — dequantised rows
/// within the e4m3 bound and `calc_diff` of the source; rounded scales are powers of two; UE8M0
/// bytes are the exponents of the rounded `scale_inv`; the scales' DeepEP memory order is
/// column-major. R=4, E=16, N=T=32, K=4, H=1024, random x.
#[test]
fn case15_ll_fp8_scales() {
    let (r, e, n, k, h) = (4, 16, 32, 4, 1024);
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    let inputs: Vec<RankInputs> = (0..r)
        .map(|_| RankInputs {
            x: Activations::Bf16(random_x(&mut rng, n, h)),
            topk_idx: random_topk(&mut rng, n, k, e, n, false),
            topk_weights: random_weights(&mut rng, n, k),
        })
        .collect();
    let rounded = plan::dispatch(&inputs, &LlParams::new(n, e).with_fp8(true, false)).unwrap();
    let ue8m0 = plan::dispatch(&inputs, &LlParams::new(n, e).with_fp8(true, true)).unwrap();
    let plain = plan::dispatch(&inputs, &LlParams::new(n, e).with_fp8(false, false)).unwrap();
    for d in 0..r {
        let (pl, ro, ue) = (
            plain[d].as_ref().unwrap(),
            rounded[d].as_ref().unwrap(),
            ue8m0[d].as_ref().unwrap(),
        );
        assert_eq!(pl.handle, ro.handle);
        assert_eq!(pl.handle, ue.handle);
        let (
            LlRecvX::Fp8 {
                data: ro_data,
                scales: ro_scales,
            },
            LlRecvX::Fp8Ue8m0 {
                data: ue_data,
                scales: ue_scales,
            },
        ) = (&ro.recv_x, &ue.recv_x)
        else {
            panic!("formats")
        };
        assert_eq!(pl.recv_x.format(), LlFormat::Fp8);
        for l in 0..e / r {
            assert_eq!(ro_data.shape(), (e / r, r * n, h));
            assert_eq!(ro_scales.shape(), (e / r, r * n, h / 128));
            assert_eq!(ue_scales.shape(), (e / r, r * n, h / 512));
            // Column-major memory order: element (row, i) at i·(R·N) + row.
            let cm = scales_column_major(&ro_scales.to_matrix(l));
            assert_eq!(cm[3 * r * n + 5], ro_scales.get(l, 5, 3));
            for row in 0..ro.recv_count[l] as usize {
                assert_eq!(
                    ro_data.row(l, row),
                    ue_data.row(l, row),
                    "same bytes with rounded scales"
                );
                for i in 0..h / 128 {
                    let s = ro_scales.get(l, row, i);
                    assert_eq!(s.to_bits() & 0x7f_ffff, 0, "power of two");
                    let byte = (ue_scales.get(l, row, i / 4) as u32 >> (8 * (i % 4))) & 0xff;
                    assert_eq!(
                        byte,
                        s.to_bits() >> 23,
                        "UE8M0 byte = exponent of scale_inv"
                    );
                }
                let src = pl.handle.src_info.get(l, row) as usize;
                let s_rank = (0..r)
                    .find(|&s| {
                        let (b, c) = unpack_layout_range(pl.handle.layout_range.get(l, s));
                        (b as usize..(b + c) as usize).contains(&row)
                    })
                    .unwrap();
                let x = x_bf16(&inputs[s_rank]).row(src);
                let amaxes: Vec<f32> = x.chunks(128).map(fp8::block_amax).collect();
                for out in [pl, ro, ue] {
                    let deq = out.recv_x.row_f32(l, row).unwrap();
                    for (c, (&dv, xv)) in deq.iter().zip(x).enumerate() {
                        let bound = fp8::fp8_abs_error_bound(xv.to_f32(), amaxes[c / 128]);
                        assert!((dv - xv.to_f32()).abs() <= bound);
                    }
                    let xs: Vec<f64> = x.iter().map(|v| f64::from(v.to_f32())).collect();
                    let ds: Vec<f64> = deq.iter().map(|&v| f64::from(v)).collect();
                    // Mostly a sanity check; the elementwise bound above is the sharp one. The inputs mix
                    // magnitudes inside blocks (outliers), so the calc_diff is above randn's.
                    assert!(
                        calc_diff(&xs, &ds) < 5e-3,
                        "calc_diff {}",
                        calc_diff(&xs, &ds)
                    );
                }
            }
        }
    }
}

/// Case 16 (LL combine weighted): identity "GEMM" (the expert returns its dequantised input),
/// unnormalised weights: `combined ≈ x[t] · Σ_k w[t,k]·[idx ≥ 0]` with `calc_diff < 1e-5` (BF16)
/// and `< 9e-4` (FP8), as DeepEP's test; plan equal to oracle bit for bit. Uses the §6.4 inputs
/// with R=8, N=T=64, K=8, H=512 and E=32 (E=288 needs 8 × 36 × [1024, H] expert buffers).
/// `zero_copy` and `out=` are properties of the Buffer API, not of these semantics.
#[test]
fn case16_ll_combine_weighted() {
    let (r, e, n, k, h) = (8, 32, 64, 8, 512);
    let mut inputs = deepep_ll_inputs(16, r, e, n, k, h, 10);
    // Use random x as well, so that the check is not about constants only.
    let mut rng = ChaCha8Rng::seed_from_u64(160);
    for inp in inputs.iter_mut().skip(1) {
        inp.x = Activations::Bf16(random_x(&mut rng, n, h));
    }
    let identity =
        |_: usize, row: &[f32]| row.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    for (fp8_mode, threshold) in [(false, 1e-5), (true, 9e-4)] {
        let params = if fp8_mode {
            LlParams::new(n, e).with_fp8(false, false)
        } else {
            LlParams::new(n, e)
        };
        let outs = plan::dispatch(&inputs, &params).unwrap();
        let y: ExpertOut = outs
            .iter()
            .map(|o| o.as_ref().map(|o| map_rows(o, identity).unwrap()))
            .collect();
        let combined = plan::combine(&inputs, &handles(&outs), &y, &params).unwrap();
        let outs_o = oracle::dispatch(&inputs, &params).unwrap();
        let y_o = oracle_expert_outputs(&outs_o, |_, row| {
            row.iter().map(|&v| bf16::from_f32(v)).collect()
        });
        let combined_o = oracle::combine(&inputs, &handles(&outs_o), &y_o, &params).unwrap();
        for me in 0..r {
            let c = combined[me].as_ref().unwrap();
            assert_eq!(bits(c), bits(combined_o[me].as_ref().unwrap()));
            assert!(c.data().iter().all(|v| !v.is_nan()));
            let x = x_bf16(&inputs[me]);
            let mut got = Vec::new();
            let mut want = Vec::new();
            for t in 0..n {
                let wsum: f32 = (0..k)
                    .filter(|&j| inputs[me].topk_idx.get(t, j) >= 0)
                    .map(|j| inputs[me].topk_weights.get(t, j))
                    .sum();
                for hh in 0..h {
                    want.push(f64::from(x.get(t, hh).to_f32() * wsum));
                    got.push(f64::from(c.get(t, hh).to_f32()));
                }
            }
            let diff = calc_diff(&got, &want);
            assert!(
                diff < threshold,
                "rank {me} fp8 {fp8_mode}: calc_diff {diff}"
            );
        }
    }
}

/// Masked ranks (spec §2.7, part of case 19's data semantics): no outputs on the masked rank,
/// empty blocks from it, and combine drops its experts.
#[test]
fn masked_rank_semantics() {
    let mut p = make_problem(19, 4, 2, 8, 4, 128, 0, false);
    p.params.masked_ranks = vec![false, true, false, false];
    let outs = plan::dispatch(&p.inputs, &p.params).unwrap();
    assert!(outs[1].is_none());
    for d in [0, 2, 3] {
        let o = outs[d].as_ref().unwrap();
        for l in 0..2 {
            assert_eq!(unpack_layout_range(o.handle.layout_range.get(l, 1)).1, 0);
        }
        check_structure(&p, d, o).unwrap();
    }
    let y = plan_expert_outputs(&outs, double);
    let c = plan::combine(&p.inputs, &handles(&outs), &y, &p.params).unwrap();
    assert!(c[1].is_none());
    // Token whose only live experts are on rank 1 gets zeros.
    let mut q = p.clone();
    q.inputs[0].topk_idx =
        Tensor2::from_fn(
            q.inputs[0].num_tokens(),
            4,
            |_, j| if j == 0 { 2 } else { -1 },
        );
    let outs = plan::dispatch(&q.inputs, &q.params).unwrap();
    let y = plan_expert_outputs(&outs, double);
    let c = plan::combine(&q.inputs, &handles(&outs), &y, &q.params).unwrap();
    assert!(
        c[0].as_ref()
            .unwrap()
            .data()
            .iter()
            .all(|v| v.to_f32() == 0.0)
    );
}

/// A token naming one expert twice gets two identical rows, and combine counts both entries.
#[test]
fn duplicate_expert_entries() {
    let x = Tensor2::from_fn(1, 128, |_, c| bf16::from_f32(c as f32 * 0.5 - 3.0));
    let inputs = vec![
        RankInputs {
            x: Activations::Bf16(x.clone()),
            topk_idx: Tensor2::new(1, 3, vec![1, 1, -1]).unwrap(),
            topk_weights: Tensor2::new(1, 3, vec![0.25, 0.5, 9.0]).unwrap(),
        },
        RankInputs {
            x: Activations::Bf16(Tensor2::filled(0, 128, bf16::ZERO)),
            topk_idx: Tensor2::filled(0, 3, 0),
            topk_weights: Tensor2::filled(0, 3, 0.0),
        },
    ];
    let params = LlParams::new(2, 4);
    let outs = plan::dispatch(&inputs, &params).unwrap();
    let o = outs[0].as_ref().unwrap();
    assert_eq!(o.recv_count, vec![0, 2]);
    let canon = canonicalize(o).unwrap();
    let rows = &canon.experts[1].per_source[0];
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0], rows[1]);
    assert_eq!(
        canon,
        canonicalize(
            oracle::dispatch(&inputs, &params).unwrap()[0]
                .as_ref()
                .unwrap()
        )
        .unwrap()
    );
    let y = plan_expert_outputs(&outs, double);
    let c = plan::combine(&inputs, &handles(&outs), &y, &params).unwrap();
    for (h, v) in c[0].as_ref().unwrap().row(0).iter().enumerate() {
        assert_eq!(
            v.to_f32(),
            bf16::from_f32(0.75 * 2.0 * x.get(0, h).to_f32()).to_f32()
        );
    }
}

/// LogFMT-10 combine (spec §2.6, `use_logfmt`; §6.4's LogFMT inputs `randn·0.5·rand`, and
/// smaller `randn·0.05` so that most chunks of the weighted partials are below 1 and cast):
/// [`PartialPrecision::LogFmt10`] against the `Bf16` variant and against DeepEP's expectation
/// `x · Σ_k w` with `calc_diff < 9e-4`. The spec gives no LogFMT-specific bound; this is its FP8
/// combine bound. Identity expert, BF16 dispatch, R=8, E=32, N=T=64, K=8, H=1536 (three
/// 512-channel chunks).
#[test]
fn logfmt_combine_within_tolerance_of_bf16() {
    let (r, e, n, k, h) = (8, 32, 64, 8, 1536);
    let mut rng = ChaCha8Rng::seed_from_u64(610);
    let mut randn = move || -> f32 {
        let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(611);
    let identity =
        |_: usize, row: &[f32]| row.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
    let params = LlParams::new(n, e);
    let mut lossy = 0usize;
    for (name, scale, by_rand) in [
        ("randn*0.5*rand", 0.5f32, true),
        ("randn*0.05", 0.05, false),
    ] {
        let mut inputs = deepep_ll_inputs(610, r, e, n, k, h, 10);
        for inp in &mut inputs {
            inp.x = Activations::Bf16(Tensor2::from_fn(n, h, |_, _| {
                let f = if by_rand { rng.random::<f32>() } else { 1.0 };
                bf16::from_f32(randn() * scale * f)
            }));
        }
        let outs = plan::dispatch(&inputs, &params).unwrap();
        let y: ExpertOut = outs
            .iter()
            .map(|o| o.as_ref().map(|o| map_rows(o, identity).unwrap()))
            .collect();
        let hs = handles(&outs);
        let bf =
            plan::combine_reduced_on_expert_rank(&inputs, &hs, &y, &params, PartialPrecision::Bf16)
                .unwrap();
        let lf = plan::combine_reduced_on_expert_rank(
            &inputs,
            &hs,
            &y,
            &params,
            PartialPrecision::LogFmt10,
        )
        .unwrap();
        for me in 0..r {
            let (a, b) = (lf[me].as_ref().unwrap(), bf[me].as_ref().unwrap());
            assert!(a.data().iter().all(|v| !v.is_nan()));
            lossy += a
                .data()
                .iter()
                .zip(b.data())
                .filter(|(x, y)| x != y)
                .count();
            let to64 = |t: &Tensor2<bf16>| -> Vec<f64> {
                t.data().iter().map(|v| f64::from(v.to_f32())).collect()
            };
            let diff = calc_diff(&to64(a), &to64(b));
            if me == 0 {
                eprintln!("{name}: rank 0 calc_diff vs BF16 {diff:e}");
            }
            assert!(diff < 9e-4, "{name} rank {me}: calc_diff vs BF16 {diff}");
            let x = x_bf16(&inputs[me]);
            let mut want = Vec::new();
            for t in 0..n {
                let wsum: f32 = (0..k)
                    .filter(|&j| inputs[me].topk_idx.get(t, j) >= 0)
                    .map(|j| inputs[me].topk_weights.get(t, j))
                    .sum();
                want.extend((0..h).map(|c| f64::from(x.get(t, c).to_f32() * wsum)));
            }
            let diff = calc_diff(&to64(a), &want);
            assert!(diff < 9e-4, "{name} rank {me}: calc_diff vs x·Σw {diff}");
        }
    }
    eprintln!(
        "{lossy} of {} combined values differ from the BF16 variant",
        2 * r * n * h
    );
    assert!(lossy > r * n * h / 10, "LogFMT changed only {lossy} values");
}
