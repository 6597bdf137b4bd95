//! Shared helpers of the protocol tests: seeded inputs, simulator fabrics, buffers.

#![allow(dead_code, reason = "each test file uses a different subset")]

use ep_rs::core::config::BufferConfig;
use ep_rs::core::transport::{FabricParams, QpFullPolicy};
use ep_rs::core::{Activations, Buffer, ExpertIdx, RankInputs, Tensor2, Tensor3};
use ep_rs::sim::{Policy, Sim, SimConfig};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[path = "../../crates/ep-core/tests/normal_support/values.rs"]
mod values;
pub(crate) use values::rand_bf16;

/// Proptest cases: 256 in CI unless `PROPTEST_CASES` says more.
pub(crate) fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
        .max(256)
}

/// Random BF16 `[rows, cols]` of [`rand_bf16`]'s wide range.
pub(crate) fn rand_bf16_tensor(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Tensor2<bf16> {
    Tensor2::from_fn(rows, cols, |_, _| rand_bf16(rng))
}

/// Random BF16 `[n, rows, cols]`: the draws of `n` [`rand_bf16_tensor`]s in a row.
pub(crate) fn rand_bf16_tensor3(
    rng: &mut ChaCha8Rng,
    n: usize,
    rows: usize,
    cols: usize,
) -> Tensor3<bf16> {
    let data = (0..n * rows * cols).map(|_| rand_bf16(rng)).collect();
    Tensor3::new(n, rows, cols, data).unwrap()
}

/// Random f32 in `±[0.01, 1)`.
pub(crate) fn rand_f32_tensor(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Tensor2<f32> {
    Tensor2::from_fn(rows, cols, |_, _| {
        let v: f32 = rng.random_range(0.01f32..1.0);
        if rng.random_bool(0.5) { v } else { -v }
    })
}

/// Shape of a generated batch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gen {
    pub(crate) num_ranks: usize,
    pub(crate) max_tokens: usize,
    pub(crate) num_experts: usize,
    pub(crate) num_topk: usize,
    pub(crate) hidden: usize,
    pub fp8: bool,
    /// Probability of a masked (`-1`) top-k entry.
    pub(crate) mask: f64,
    /// Tokens per rank exactly `max_tokens` (else drawn in `0..=max_tokens`).
    pub(crate) full: bool,
}

/// Every rank's inputs. With `distinct`, a row never names one expert twice.
pub(crate) fn gen_inputs(g: &Gen, seed: u64, distinct: bool) -> Vec<RankInputs> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..g.num_ranks)
        .map(|_| {
            let t = if g.full {
                g.max_tokens
            } else {
                rng.random_range(0..=g.max_tokens)
            };
            let mut topk_idx = Tensor2::filled(t, g.num_topk, -1 as ExpertIdx);
            for r in 0..t {
                for k in 0..g.num_topk {
                    if rng.random_bool(g.mask) {
                        continue;
                    }
                    let e = rng.random_range(0..g.num_experts) as ExpertIdx;
                    if distinct && topk_idx.row(r).contains(&e) {
                        continue;
                    }
                    topk_idx.set(r, k, e);
                }
            }
            let topk_weights = rand_f32_tensor(&mut rng, t, g.num_topk);
            let x = if g.fp8 {
                Activations::Fp8 {
                    data: Tensor2::from_fn(t, g.hidden, |_, _| rng.random::<u8>() & 0x7e),
                    scales: Tensor2::from_fn(t, g.hidden.div_ceil(128), |_, _| {
                        rng.random_range(0.001f32..2.0)
                    }),
                }
            } else {
                Activations::Bf16(rand_bf16_tensor(&mut rng, t, g.hidden))
            };
            RankInputs {
                x,
                topk_idx,
                topk_weights,
            }
        })
        .collect()
}

/// The three delivery policies, picked by `i`.
pub(crate) fn policy(i: u8) -> Policy {
    match i % 3 {
        0 => Policy::Uniform,
        1 => Policy::Pct {
            depth: 3,
            horizon: 20_000,
        },
        _ => Policy::LatestLegal,
    }
}

/// One node of `num_ranks` with small chunks, a small QP depth and `rc_per_pe` QPs per peer.
pub(crate) fn fabric(
    num_ranks: usize,
    granularity: u64,
    qp_depth: u32,
    rc_per_pe: u16,
) -> FabricParams {
    FabricParams {
        granularity,
        qp_depth,
        rc_per_pe,
        qp_full: QpFullPolicy::Wait,
        ..FabricParams::single_node(num_ranks)
    }
}

/// A simulator with `fabric`, `seed` and policy.
pub(crate) fn sim(fabric: FabricParams, seed: u64, p: Policy) -> Sim {
    Sim::new(SimConfig::new(fabric, seed).policy(p))
}

/// A normal-mode buffer for up to `rows` received rows.
pub(crate) fn normal_buffer(
    sim: Sim,
    num_ranks: usize,
    rows: usize,
    hidden: usize,
    elem: usize,
    k: usize,
) -> Buffer<Sim> {
    let mut cfg = BufferConfig::new(num_ranks);
    cfg.num_nvl_bytes = Buffer::<Sim>::normal_size_hint(num_ranks, rows.max(1), hidden, elem, k)
        .div_ceil(128)
        * 128;
    Buffer::new(sim, cfg).expect("buffer")
}

/// A low-latency buffer for `(N, H, R, E)`, with shrink.
pub(crate) fn ll_buffer(
    sim: Sim,
    n: usize,
    hidden: usize,
    num_ranks: usize,
    e: usize,
    qps: u32,
) -> Buffer<Sim> {
    let mut cfg = BufferConfig::new(num_ranks);
    cfg.low_latency_mode = true;
    cfg.enable_shrink = true;
    cfg.num_qps_per_rank = qps;
    cfg.num_rdma_bytes =
        Buffer::<Sim>::low_latency_size_hint(n, hidden, num_ranks, e).div_ceil(128) * 128;
    Buffer::new(sim, cfg).expect("buffer")
}

/// DeepEP's `calc_diff`: `1 - 2Σxy / Σ(x² + y²)` over `x + 1`, `y + 1` in f64.
pub(crate) fn calc_diff(x: &Tensor2<bf16>, y: &Tensor2<bf16>) -> f64 {
    let (mut xy, mut sq) = (0.0f64, 0.0f64);
    for (a, b) in x.data().iter().zip(y.data()) {
        let a = f64::from(a.to_f32()) + 1.0;
        let b = f64::from(b.to_f32()) + 1.0;
        xy += a * b;
        sq += a * a + b * b;
    }
    if sq == 0.0 { 0.0 } else { 1.0 - 2.0 * xy / sq }
}

/// Normal dispatch on 4 SMs (2 channels), alignment 1, no worst-token sizing, with top-k: the
/// `Buffer` arguments and the plan's options that match them.
#[allow(dead_code, reason = "not every test binary uses every helper")]
pub(crate) fn two_channel_dispatch() -> (
    ep_rs::core::buffer::NormalDispatchArgs,
    ep_rs::core::plan::intranode::DispatchOptions,
) {
    let args = ep_rs::core::buffer::NormalDispatchArgs::new(
        ep_rs::core::config::Config::new(4, 1, 2, 1, 2).expect("a valid config"),
    );
    let opts = ep_rs::core::plan::intranode::DispatchOptions {
        num_channels: 2,
        expert_alignment: 1,
        num_worst_tokens: 0,
        with_topk: true,
    };
    (args, opts)
}

/// An identity expert's outputs for low-latency dispatch outputs: each received row as BF16
/// (masked ranks: `None`).
pub(crate) fn ll_identity_outputs(
    outputs: &[Option<ep_rs::core::plan::low_latency::LlDispatchOutput>],
) -> Vec<Option<Tensor3<bf16>>> {
    outputs
        .iter()
        .map(|o| {
            o.as_ref().map(|o| {
                ep_rs::core::plan::low_latency::map_rows(o, |_, x| {
                    x.iter().map(|&v| bf16::from_f32(v)).collect()
                })
                .expect("identity expert")
            })
        })
        .collect()
}
