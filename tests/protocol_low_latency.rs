//! Low-latency protocol on the simulator (docs/protocol.md §3): `Buffer` dispatch (with and
//! without hook) equals the plan bit for bit and the oracle canonically; combine (zero-copy and
//! copying, BF16 or LogFMT-10 partials) equals the reduced-on-expert-rank plan bit for bit and
//! DeepEP's combine within its tolerance; random ranks (1..=16), experts, top-k with masked
//! entries and masked ranks, FP8, tiny chunks, QP depth 1..=4, several QPs per peer, seeds and
//! all delivery policies.

mod protocol_support;

use ep_rs::core::buffer::LlCombineOptions;
use ep_rs::core::plan::low_latency::{
    LlParams, PartialPrecision, canonicalize, combine, combine_reduced_on_expert_rank, dispatch,
};
use ep_rs::core::{RankInputs, Tensor2, Tensor3, oracle};
use half::bf16;
use proptest::prelude::*;
use protocol_support::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
struct LCase {
    g: Gen,
    n: usize,
    seed: u64,
    policy: u8,
    qp_depth: u32,
    qps: u16,
    fp8: (bool, bool, bool),
    masked: Vec<bool>,
    hook: bool,
    zero_copy: bool,
    logfmt: bool,
    distinct: bool,
}

fn strategy() -> impl Strategy<Value = LCase> {
    (
        (
            prop::sample::select(vec![1usize, 2, 3, 4, 5, 6, 7, 8, 16]),
            1usize..=4,
            1usize..=3,
            1usize..=4,
            any::<bool>(),
        ),
        (
            any::<u64>(),
            any::<u8>(),
            1u32..=4,
            1u16..=3,
            any::<(bool, bool, bool)>(),
        ),
        (
            prop::collection::vec(0u8..8, 16),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            0.0f64..0.4,
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                (r, t, l, k, big),
                (seed, policy, qp_depth, qps, fp8),
                (m, hook, zero_copy, distinct, mask, logfmt),
            )| {
                let fp8 = (fp8.0, fp8.0 && fp8.1, fp8.0 && fp8.1 && fp8.2);
                LCase {
                    g: Gen {
                        num_ranks: r,
                        max_tokens: t,
                        num_experts: r * l,
                        num_topk: k,
                        hidden: if fp8.0 {
                            512
                        } else if big {
                            256
                        } else {
                            128
                        },
                        fp8: false,
                        mask,
                        full: false,
                    },
                    n: 4,
                    seed,
                    policy,
                    qp_depth,
                    qps,
                    fp8,
                    masked: (0..r).map(|i| m[i] == 0).collect(),
                    hook,
                    zero_copy,
                    logfmt,
                    distinct,
                }
            },
        )
}

fn params(c: &LCase) -> LlParams {
    let mut p = LlParams::new(c.n, c.g.num_experts).with_masked_ranks(c.masked.clone());
    if c.fp8.0 {
        p = p.with_fp8(c.fp8.1, c.fp8.2);
    }
    p
}

/// Random expert outputs `[L, R·N, H]` for unmasked ranks.
fn expert_outputs(c: &LCase, seed: u64) -> Vec<Option<Tensor3<bf16>>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let l = c.g.num_experts / c.g.num_ranks;
    (0..c.g.num_ranks)
        .map(|d| {
            (!c.masked[d]).then(|| rand_bf16_tensor3(&mut rng, l, c.g.num_ranks * c.n, c.g.hidden))
        })
        .collect()
}

fn run_case(c: &LCase) -> Result<(), TestCaseError> {
    let inputs: Vec<RankInputs> = gen_inputs(&c.g, c.seed, c.distinct);
    let p = params(c);
    let want = match dispatch(&inputs, &p) {
        Ok(w) => w,
        // The plan rejects the case (e.g. > N entries to one expert): so must the Buffer.
        Err(_) => {
            let sim = sim(
                fabric(c.g.num_ranks, 4096, c.qp_depth, c.qps),
                c.seed,
                policy(c.policy),
            );
            let mut buf = ll_buffer(
                sim,
                c.n,
                c.g.hidden,
                c.g.num_ranks,
                c.g.num_experts,
                u32::from(c.qps),
            );
            for (r, &m) in c.masked.iter().enumerate() {
                buf.update_mask(r, m).unwrap();
            }
            prop_assert!(buf.low_latency_dispatch(&inputs, &p).is_err());
            return Ok(());
        }
    };
    let sim = sim(
        fabric(c.g.num_ranks, 4096, c.qp_depth, c.qps),
        c.seed,
        policy(c.policy),
    );
    let mut buf = ll_buffer(
        sim,
        c.n,
        c.g.hidden,
        c.g.num_ranks,
        c.g.num_experts,
        u32::from(c.qps),
    );
    for (r, &m) in c.masked.iter().enumerate() {
        buf.update_mask(r, m).unwrap();
    }
    let got = if c.hook {
        let h = buf
            .low_latency_dispatch_send(&inputs, &p)
            .map_err(|e| TestCaseError::fail(format!("send: {e}")))?;
        buf.low_latency_dispatch_recv(h)
    } else {
        buf.low_latency_dispatch(&inputs, &p)
    }
    .map_err(|e| TestCaseError::fail(format!("dispatch: {e}")))?;
    prop_assert_eq!(&got.outputs, &want);
    let oracle_out = oracle::low_latency::dispatch(&inputs, &p).unwrap();
    for (a, b) in got.outputs.iter().zip(&oracle_out) {
        match (a, b) {
            (Some(a), Some(b)) => {
                prop_assert_eq!(canonicalize(a).unwrap(), canonicalize(b).unwrap())
            }
            (None, None) => {}
            _ => prop_assert!(false, "masked ranks differ"),
        }
    }

    let y = expert_outputs(c, c.seed ^ 0x7e57);
    let handles: Vec<_> = got
        .outputs
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    let opts = LlCombineOptions {
        zero_copy: c.zero_copy,
        use_logfmt: c.logfmt,
    };
    let out = if c.hook {
        let h = buf
            .low_latency_combine_send(&got.routes, &y, &inputs, opts)
            .map_err(|e| TestCaseError::fail(format!("combine send: {e}")))?;
        buf.low_latency_combine_recv(h)
    } else {
        buf.low_latency_combine(&got.routes, &y, &inputs, opts)
    }
    .map_err(|e| TestCaseError::fail(format!("combine: {e}")))?;
    let precision = if c.logfmt {
        PartialPrecision::LogFmt10
    } else {
        PartialPrecision::Bf16
    };
    let want_c = combine_reduced_on_expert_rank(&inputs, &handles, &y, &p, precision).unwrap();
    prop_assert_eq!(&out, &want_c);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Low-latency dispatch and combine on the simulator equal the plan bit for bit.
    #[test]
    fn buffer_equals_plan(c in strategy()) {
        run_case(&c)?;
    }
}

/// DeepEP's own check (spec §6.4, case 16): identity "GEMM", `combined ≈ x · Σ_k w[t,k]` within
/// `calc_diff < 1e-5` (BF16), for the protocol's two-rounding combine as for DeepEP's.
#[test]
fn combine_within_deepep_tolerance() {
    let (r, n, l, k, h) = (8, 8, 4, 4, 256);
    let e = r * l;
    let g = Gen {
        num_ranks: r,
        max_tokens: n,
        num_experts: e,
        num_topk: k,
        hidden: h,
        fp8: false,
        mask: 0.1,
        full: true,
    };
    for seed in 0..3u64 {
        let mut inputs = gen_inputs(&g, seed, true);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for inp in &mut inputs {
            for v in inp.topk_weights.data_mut() {
                *v = rng.random_range(0.0f32..1.0);
            }
            // DeepEP's data is of one scale (randn), which its tolerance is for; the wide range
            // of the generator is for the bit-exact tests.
            let rows = inp.num_tokens();
            inp.x = ep_rs::core::Activations::Bf16(Tensor2::from_fn(rows, h, |_, _| {
                bf16::from_f32(rng.random_range(-2.0f32..2.0))
            }));
        }
        let p = LlParams::new(n, e);
        let sim = sim(fabric(r, 1 << 20, 8, 2), seed, policy(seed as u8));
        let mut buf = ll_buffer(sim, n, h, r, e, 2);
        let got = buf.low_latency_dispatch(&inputs, &p).unwrap();
        // Identity expert: y = received x.
        let y = ll_identity_outputs(&got.outputs);
        let handles: Vec<_> = got
            .outputs
            .iter()
            .map(|o| o.as_ref().map(|o| o.handle.clone()))
            .collect();
        let ours = buf
            .low_latency_combine(
                &got.routes,
                &y,
                &inputs,
                LlCombineOptions::default().with_zero_copy(true),
            )
            .unwrap();
        let deepep = combine(&inputs, &handles, &y, &p).unwrap();
        for (s, inp) in inputs.iter().enumerate() {
            let ep_rs::core::Activations::Bf16(x) = &inp.x else {
                unreachable!()
            };
            let want = Tensor2::from_fn(x.rows(), h, |t, j| {
                let w: f32 = (0..k)
                    .filter(|&kk| inp.topk_idx.get(t, kk) >= 0)
                    .map(|kk| inp.topk_weights.get(t, kk))
                    .sum();
                bf16::from_f32(x.get(t, j).to_f32() * w)
            });
            let a = ours[s].as_ref().unwrap();
            let b = deepep[s].as_ref().unwrap();
            assert!(
                calc_diff(a, &want) < 1e-5,
                "ours vs x*sum(w): {}",
                calc_diff(a, &want)
            );
            assert!(
                calc_diff(b, &want) < 1e-5,
                "DeepEP vs x*sum(w): {}",
                calc_diff(b, &want)
            );
            assert!(
                calc_diff(a, b) < 1e-5,
                "ours vs DeepEP: {}",
                calc_diff(a, b)
            );
        }
    }
}
