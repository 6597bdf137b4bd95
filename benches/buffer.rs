//! `Buffer` over the public API on the simulator in threads mode: normal dispatch and combine
//! at a small shape that fits any laptop (the figures to compare
//! with DeepEP's come from `ep bench`, on the GPU with `--backend gpu`).
//!
//! `cargo bench --bench buffer -- --warm-up-time 1 --measurement-time 3`
//!
//! Every iteration is the real call (validation, phases, outputs); outputs are checked against
//! the plan once before timing, so a broken protocol cannot produce a fast number.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use ep_rs::core::Buffer;
use ep_rs::core::buffer::NormalDispatchArgs;
use ep_rs::core::config::{BufferConfig, Config};
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::intranode::{DispatchOptions, intranode_dispatch_all};
use ep_rs::core::plan::layout::get_dispatch_layout_for_rank;
use ep_rs::core::routing::Activations;
use ep_rs::core::transport::FabricParams;
use ep_rs::core::workload::WorkloadSpec;
use ep_rs::sim::ThreadSim;

const RANKS: usize = 4;
const TOKENS: usize = 512;
const HIDDEN: usize = 2048;
const TOPK: usize = 8;
const EXPERTS: usize = 64;

fn normal(c: &mut Criterion) {
    let inputs = WorkloadSpec::new(RANKS, TOKENS, HIDDEN, TOPK, EXPERTS, 7)
        .generate()
        .expect("workload");
    let layouts: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(s, i)| get_dispatch_layout_for_rank(s, &i.topk_idx, EXPERTS, RANKS).expect("layout"))
        .collect();
    let sim = ThreadSim::new(FabricParams::single_node(RANKS), Duration::from_secs(60));
    let mut cfg = BufferConfig::new(RANKS);
    cfg.num_nvl_bytes =
        Buffer::<ThreadSim>::normal_size_hint(RANKS, RANKS * TOKENS, HIDDEN, 2, TOPK).div_ceil(128)
            * 128;
    let mut buf = Buffer::new(sim, cfg).expect("buffer");
    let args = NormalDispatchArgs::new(Config::new(8, 1, 2, 1, 2).expect("config"));
    let opts = DispatchOptions {
        num_channels: args.config.num_channels(),
        expert_alignment: 1,
        num_worst_tokens: 0,
        with_topk: true,
    };
    let want = intranode_dispatch_all(&inputs, &layouts, EXPERTS, &opts).expect("plan");
    let got = buf
        .dispatch(&inputs, &layouts, EXPERTS, &args)
        .expect("dispatch");
    assert_eq!(
        got, want,
        "the dispatch must equal the plan before it is timed"
    );
    let rows: usize = want.iter().map(|d| d.handle.num_recv_tokens).sum();
    let bytes = (rows * HIDDEN * 2) as u64;

    let mut g = c.benchmark_group("normal");
    g.throughput(Throughput::Bytes(bytes));
    g.bench_function("dispatch", |b| {
        b.iter(|| {
            black_box(
                buf.dispatch(&inputs, &layouts, EXPERTS, &args)
                    .expect("dispatch"),
            )
        })
    });
    let handles: Vec<_> = want.iter().map(|d| d.handle.clone()).collect();
    let xs: Vec<_> = want
        .iter()
        .map(|d| match &d.recv_x {
            Activations::Bf16(x) => x.clone(),
            Activations::Fp8 { .. } => unreachable!("BF16 workload"),
        })
        .collect();
    let cargs: Vec<CombineArgs<'_>> = (0..RANKS)
        .map(|d| CombineArgs {
            x: &xs[d],
            topk_weights: want[d].recv_topk_weights.as_ref(),
            bias: &[],
        })
        .collect();
    g.bench_function("combine", |b| {
        b.iter(|| black_box(buf.combine(&handles, &cargs).expect("combine")))
    });
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    normal(&mut c);
    c.final_summary();
}
