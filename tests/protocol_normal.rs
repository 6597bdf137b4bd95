//! Normal intranode protocol on the simulator (docs/protocol.md §2): `Buffer` dispatch, cached
//! dispatch and combine equal the plan bit for bit, for random ranks (1..=8), experts, top-k with
//! masked entries, hidden sizes, BF16/FP8, channels, alignment, worst-token mode, seeds and all
//! delivery policies; no violation, no deadlock.

mod protocol_support;

use ep_rs::core::Activations;
use ep_rs::core::buffer::NormalDispatchArgs;
use ep_rs::core::config::Config;
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::intranode::{
    DispatchOptions, intranode_combine, intranode_dispatch_all, intranode_dispatch_cached,
};
use proptest::prelude::*;
use protocol_support::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
struct NCase {
    g: Gen,
    seed: u64,
    policy: u8,
    num_sms: usize,
    alignment: usize,
    worst: bool,
    with_topk: bool,
    biases: usize,
}

fn strategy() -> impl Strategy<Value = NCase> {
    (
        (
            1usize..=8,
            0usize..=6,
            1usize..=3,
            1usize..=4,
            1usize..=8,
            any::<bool>(),
        ),
        (
            any::<u64>(),
            any::<u8>(),
            1usize..=3,
            1usize..=3,
            any::<bool>(),
            any::<bool>(),
            0usize..=2,
        ),
        0.0f64..0.4,
    )
        .prop_map(
            |(
                (r, t, l, k, h16, fp8),
                (seed, policy, c, alignment, worst, with_topk, biases),
                mask,
            )| NCase {
                g: Gen {
                    num_ranks: r,
                    max_tokens: t,
                    num_experts: r * l,
                    num_topk: k,
                    hidden: 16 * h16,
                    fp8,
                    mask,
                    full: false,
                },
                seed,
                policy,
                num_sms: 2 * c,
                alignment,
                worst: worst && with_topk,
                with_topk,
                biases,
            },
        )
}

fn run_case(c: &NCase) -> Result<(), TestCaseError> {
    let g = c.g;
    let r = g.num_ranks;
    let inputs = gen_inputs(&g, c.seed, false);
    let layouts: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(s, i)| {
            ep_rs::core::plan::layout::get_dispatch_layout_for_rank(
                s,
                &i.topk_idx,
                g.num_experts,
                r,
            )
            .unwrap()
        })
        .collect();
    let worst = if c.worst { g.max_tokens.max(1) * r } else { 0 };
    let opts = DispatchOptions {
        num_channels: c.num_sms / 2,
        expert_alignment: c.alignment,
        num_worst_tokens: worst,
        with_topk: c.with_topk,
    };
    let want = intranode_dispatch_all(&inputs, &layouts, g.num_experts, &opts).unwrap();

    let elem = if g.fp8 { 1 } else { 2 };
    let fab = fabric(r, 4096, 2, 1);
    let sim = sim(fab, c.seed, policy(c.policy));
    let mut buf = normal_buffer(
        sim,
        r,
        (g.max_tokens * r).max(worst),
        g.hidden,
        elem,
        g.num_topk,
    );
    let mut args = NormalDispatchArgs::new(Config::new(c.num_sms, 1, 2, 1, 2).unwrap());
    args.expert_alignment = c.alignment;
    args.num_worst_tokens = worst;
    args.with_topk = c.with_topk;
    let got = buf.dispatch(&inputs, &layouts, g.num_experts, &args);
    let got = got.map_err(|e| TestCaseError::fail(format!("dispatch: {e}")))?;
    prop_assert_eq!(&got, &want);

    // Cached dispatch along the handles: equals the plan's cached dispatch.
    let handles: Vec<_> = got.iter().map(|o| o.handle.clone()).collect();
    let xs: Vec<&Activations> = inputs.iter().map(|i| &i.x).collect();
    let cached = buf
        .dispatch_cached(&xs, &handles)
        .map_err(|e| TestCaseError::fail(format!("cached: {e}")))?;
    for (d, x) in cached.iter().enumerate() {
        prop_assert_eq!(x, &intranode_dispatch_cached(&xs, &handles, d).unwrap());
    }

    // Combine random expert outputs (weights when top-k was dispatched, biases).
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed ^ 0xc0b1);
    let ys: Vec<_> = handles
        .iter()
        .map(|h| rand_bf16_tensor(&mut rng, h.recv_src_idx.len(), g.hidden))
        .collect();
    let ws: Vec<_> = handles
        .iter()
        .map(|h| rand_f32_tensor(&mut rng, h.recv_src_idx.len(), g.num_topk))
        .collect();
    let bs: Vec<Vec<_>> = inputs
        .iter()
        .map(|i| {
            (0..c.biases)
                .map(|_| rand_bf16_tensor(&mut rng, i.num_tokens(), g.hidden))
                .collect()
        })
        .collect();
    let cargs: Vec<CombineArgs<'_>> = (0..r)
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: c.with_topk.then(|| &ws[d]),
            bias: &bs[d],
        })
        .collect();
    let want_c = intranode_combine(&handles, &cargs).unwrap();
    let got_c = buf
        .combine(&handles, &cargs)
        .map_err(|e| TestCaseError::fail(format!("combine: {e}")))?;
    prop_assert_eq!(got_c, want_c);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Dispatch, cached dispatch and combine on the simulator equal the plan bit for bit.
    #[test]
    fn buffer_equals_plan(c in strategy()) {
        run_case(&c)?;
    }
}
