//! Shared generators for the normal-mode tests: seeded routings and random data over a wide range.

#![allow(dead_code, reason = "each test file uses a different subset")]

use ep_core::plan::intranode::DispatchOptions;
use ep_core::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use ep_core::{Activations, ExpertIdx, RankInputs, Tensor2};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

mod values;
pub(crate) use values::rand_bf16;

/// How a generated routing is shaped.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Routing {
    /// Uniform experts, each slot masked with probability `mask`.
    Random,
    /// Every unmasked slot picks expert `0`.
    OneExpert,
    /// No token of any rank picks an expert of rank `victim` (it receives nothing).
    Starve(usize),
    /// Every slot masked.
    AllMasked,
}

/// Parameters of one generated case.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Case {
    pub(crate) seed: u64,
    pub(crate) num_ranks: usize,
    pub(crate) max_tokens: usize,
    pub(crate) num_local: usize,
    pub(crate) num_topk: usize,
    pub(crate) hidden: usize,
    pub(crate) fp8: bool,
    pub(crate) mask: f64,
    pub(crate) routing: Routing,
}

impl Case {
    pub(crate) fn num_experts(&self) -> usize {
        self.num_ranks * self.num_local
    }
}

/// Random BF16 `[rows, cols]` of [`rand_bf16`]'s wide range.
pub(crate) fn rand_bf16_tensor(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Tensor2<bf16> {
    Tensor2::from_fn(rows, cols, |_, _| rand_bf16(rng))
}

/// Random non-zero f32 `[rows, cols]`.
pub(crate) fn rand_f32_tensor(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Tensor2<f32> {
    Tensor2::from_fn(rows, cols, |_, _| {
        let v: f32 = rng.random_range(0.01f32..1.0);
        if rng.random_bool(0.5) { v } else { -v }
    })
}

/// Every rank's inputs for a case (token counts drawn in `0..=max_tokens` per rank).
pub(crate) fn gen_inputs(case: &Case) -> Vec<RankInputs> {
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed);
    let e = case.num_experts();
    (0..case.num_ranks)
        .map(|_| {
            let t = rng.random_range(0..=case.max_tokens);
            let topk_idx =
                Tensor2::from_fn(t, case.num_topk, |_, _| pick_expert(&mut rng, case, e));
            let topk_weights = rand_f32_tensor(&mut rng, t, case.num_topk);
            let x = if case.fp8 {
                let data = Tensor2::from_fn(t, case.hidden, |_, _| rng.random::<u8>());
                let scales = Tensor2::from_fn(t, case.hidden.div_ceil(128), |_, _| {
                    rng.random_range(0.001f32..2.0)
                });
                Activations::Fp8 { data, scales }
            } else {
                Activations::Bf16(rand_bf16_tensor(&mut rng, t, case.hidden))
            };
            RankInputs {
                x,
                topk_idx,
                topk_weights,
            }
        })
        .collect()
}

fn pick_expert(rng: &mut ChaCha8Rng, case: &Case, e: usize) -> ExpertIdx {
    if matches!(case.routing, Routing::AllMasked) || rng.random_bool(case.mask) {
        return -1;
    }
    match case.routing {
        Routing::OneExpert => 0,
        Routing::Starve(victim) => {
            if case.num_ranks == 1 {
                return -1;
            }
            // Draw among the experts of the other ranks.
            let v = victim % case.num_ranks;
            let x = rng.random_range(0..e - case.num_local);
            let x = if x >= v * case.num_local {
                x + case.num_local
            } else {
                x
            };
            x as ExpertIdx
        }
        _ => rng.random_range(0..e) as ExpertIdx,
    }
}

/// The plan's layout of every rank.
pub(crate) fn layouts(inputs: &[RankInputs], num_experts: usize) -> Vec<DispatchLayout> {
    inputs
        .iter()
        .enumerate()
        .map(|(s, inp)| {
            get_dispatch_layout_for_rank(s, &inp.topk_idx, num_experts, inputs.len()).unwrap()
        })
        .collect()
}

/// BF16 rows of activations (panics on FP8: test helper).
pub(crate) fn bf16_rows(a: &Activations) -> &Tensor2<bf16> {
    match a {
        Activations::Bf16(x) => x,
        Activations::Fp8 { .. } => panic!("expected BF16 activations"),
    }
}

/// Routing strategies for proptest, as an index turned into [`Routing`].
pub(crate) fn routing_from(code: u8, victim: usize) -> Routing {
    match code % 8 {
        0 => Routing::OneExpert,
        1 => Routing::Starve(victim),
        2 => Routing::AllMasked,
        _ => Routing::Random,
    }
}

/// Dispatch options of a random case; `worst` (with top-k only) sizes the outputs like the
/// DeepEP test's worst case, `max_rows` = `T * R`.
pub(crate) fn dispatch_options(
    num_channels: usize,
    expert_alignment: usize,
    worst: bool,
    with_topk: bool,
    max_rows: usize,
) -> DispatchOptions {
    DispatchOptions {
        num_channels,
        expert_alignment,
        num_worst_tokens: if worst && with_topk { max_rows } else { 0 },
        with_topk,
    }
}
