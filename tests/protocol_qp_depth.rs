//! QP depth is a matter of speed, never of results (docs/protocol.md §3.9, DESIGN.md "NVSHMEM and
//! IBGDA"): the same calls with QP depth `D` and with a smaller `D'` give identical outputs, and
//! the cost model's prediction of every phase (`CostModel::predict` over `Sim::records`) never
//! decreases when the depth shrinks. Low-latency workloads run over RDMA peers
//! (`ranks_per_node = 1`, small heap chunks so puts split into several work requests), where
//! the depth bounds outstanding work requests; normal intranode mode posts none, so there the
//! depth must change nothing at all.

mod protocol_support;

use ep_rs::core::buffer::{LlCombineOptions, NormalDispatchArgs};
use ep_rs::core::config::{BufferConfig, Config};
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::low_latency::LlParams;
use ep_rs::core::transport::FabricParams;
use ep_rs::core::{Buffer, Tensor3};
use ep_rs::sim::cost::CostModel;
use ep_rs::sim::{Sim, SimConfig};
use half::bf16;
use protocol_support::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Depths tried, largest first.
const DEPTHS: [u32; 4] = [16, 4, 2, 1];

#[derive(Clone, Copy, Debug)]
struct Case {
    r: usize,
    n: usize,
    l: usize,
    k: usize,
    qps: u16,
    seed: u64,
}

fn draw(rng: &mut ChaCha8Rng) -> Case {
    Case {
        r: rng.random_range(2..=4),
        // R·N must be a multiple of 4 (packed expert rows).
        n: 4 * rng.random_range(1..=2),
        l: rng.random_range(1..=3),
        k: rng.random_range(1..=3),
        qps: rng.random_range(1..=3),
        seed: rng.random(),
    }
}

/// Every phase's predicted time, in order.
fn predictions(sim: &Sim, fabric: &FabricParams) -> Vec<f64> {
    let m = CostModel::default();
    sim.records()
        .iter()
        .map(|r| m.predict(r, fabric).total_us)
        .collect()
}

/// What one run produced: the outputs (as debug text: every tensor bit for bit) and the
/// predictions.
type Run = (String, Vec<f64>);

fn ll_run(c: Case, depth: u32) -> Run {
    let h = 128;
    let e = c.r * c.l;
    let mut fabric = fabric(c.r, 1024, depth, c.qps);
    fabric.ranks_per_node = 1;
    let sim = Sim::new(SimConfig::new(fabric.clone(), c.seed).policy(policy(c.seed as u8)));
    let mut buf = ll_buffer(sim, c.n, h, c.r, e, u32::from(c.qps));
    let g = Gen {
        num_ranks: c.r,
        max_tokens: c.n,
        num_experts: e,
        num_topk: c.k,
        hidden: h,
        fp8: false,
        mask: 0.2,
        full: false,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
    let mut out = String::new();
    for call in 0..2 {
        let inputs = gen_inputs(&g, c.seed.wrapping_add(call), true);
        let p = LlParams::new(c.n, e);
        let got = buf.low_latency_dispatch(&inputs, &p).unwrap();
        let y: Vec<Option<Tensor3<bf16>>> = (0..c.r)
            .map(|_| Some(rand_bf16_tensor3(&mut rng, c.l, c.r * c.n, h)))
            .collect();
        let comb = buf
            .low_latency_combine(
                &got.routes,
                &y,
                &inputs,
                LlCombineOptions::default().with_zero_copy(call.is_multiple_of(2)),
            )
            .unwrap();
        out.push_str(&format!("{:?}\n{comb:?}\n", got.outputs));
    }
    let pred = predictions(buf.transport(), &fabric);
    (out, pred)
}

fn normal_run(c: Case, depth: u32) -> Run {
    let h = 128;
    let e = c.r * c.l;
    let fabric = fabric(c.r, 1024, depth, c.qps);
    let sim = Sim::new(SimConfig::new(fabric.clone(), c.seed).policy(policy(c.seed as u8)));
    let mut cfg = BufferConfig::new(c.r);
    cfg.num_nvl_bytes =
        Buffer::<Sim>::normal_size_hint(c.r, c.r * c.n, h, 2, c.k).div_ceil(128) * 128;
    let mut buf = Buffer::new(sim, cfg).unwrap();
    let g = Gen {
        num_ranks: c.r,
        max_tokens: c.n,
        num_experts: e,
        num_topk: c.k,
        hidden: h,
        fp8: false,
        mask: 0.2,
        full: false,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
    let inputs = gen_inputs(&g, c.seed, false);
    let topk: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let layouts = buf.get_dispatch_layout(&topk, e).unwrap();
    let args = NormalDispatchArgs::new(Config::new(4, 1, 2, 1, 2).unwrap());
    let got = buf.dispatch(&inputs, &layouts, e, &args).unwrap();
    let handles: Vec<_> = got.iter().map(|o| o.handle.clone()).collect();
    let ys: Vec<_> = handles
        .iter()
        .map(|hd| rand_bf16_tensor(&mut rng, hd.recv_src_idx.len(), h))
        .collect();
    let cargs: Vec<_> = ys
        .iter()
        .map(|x| CombineArgs {
            x,
            topk_weights: None,
            bias: &[],
        })
        .collect();
    let comb = buf.combine(&handles, &cargs).unwrap();
    let pred = predictions(buf.transport(), &fabric);
    (format!("{got:?}\n{comb:?}"), pred)
}

fn check(name: &str, c: Case, run: fn(Case, u32) -> Run) {
    let mut last: Option<Run> = None;
    for depth in DEPTHS {
        let (out, pred) = run(c, depth);
        if let Some((out0, pred0)) = &last {
            assert!(
                out == *out0,
                "{name} {c:?}: depth {depth} changed the outputs"
            );
            assert_eq!(pred.len(), pred0.len(), "{name} {c:?}: phases differ");
            for (i, (a, b)) in pred.iter().zip(pred0).enumerate() {
                assert!(
                    a >= b,
                    "{name} {c:?}: phase {i} predicted {a} us with depth {depth}, {b} us with a \
                     larger one"
                );
            }
        }
        last = Some((out, pred));
    }
}

#[test]
fn smaller_qp_depth_same_low_latency_results_never_faster() {
    let mut rng = ChaCha8Rng::seed_from_u64(0xdeb7);
    for _ in 0..16 {
        check("low-latency", draw(&mut rng), ll_run);
    }
}

#[test]
fn qp_depth_changes_nothing_in_normal_mode() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x0de7);
    for _ in 0..6 {
        let c = draw(&mut rng);
        let (out, pred) = normal_run(c, DEPTHS[0]);
        let (out1, pred1) = normal_run(c, 1);
        assert!(out == out1, "{c:?}: depth changed the outputs");
        assert_eq!(pred, pred1, "{c:?}");
    }
}

/// The property has teeth: on RDMA peers a depth of 1 predicts strictly more than a large depth
/// for a workload with many work requests per QP.
#[test]
fn depth_one_is_predicted_slower_on_rdma() {
    let c = Case {
        r: 2,
        n: 8,
        l: 2,
        k: 3,
        qps: 1,
        seed: 7,
    };
    let (_, big) = ll_run(c, 64);
    let (_, one) = ll_run(c, 1);
    let (b, o): (f64, f64) = (big.iter().sum(), one.iter().sum());
    assert!(o > b, "depth 1: {o} us, depth 64: {b} us");
}
