//! The GPU data path over the public API (`Buffer<Gpu>`, the same `Buffer` as the simulator's):
//! normal-mode dispatch and combine of two co-resident ranks on GPU 0 at DeepEP's shape (4096
//! tokens per rank, hidden 7168, top-8, 256 experts, 24 SMs per rank). Host wall-clock per call, launch and `sync` included; the event-timed
//! medians beside the same-run ceiling come from `ep bench --backend gpu` (BENCHMARKS.md).
//!
//! `cargo bench --bench gpu -- --warm-up-time 1 --measurement-time 3` on a machine with a GPU
//! (the GPU machine gets it as a binary from `scripts/gpu-bundle.sh`); without one it prints
//! "skipped: no GPU" and measures nothing.
//!
//! Before timing, one dispatch and one in-place combine are compared with the plan bit for bit
//! (the identity expert: the combine reads the received rows in place), so a broken kernel cannot
//! produce a fast number. `dispatch, NormalGroup directly` times the same call on the kernels'
//! group without the `Buffer`'s host logic, so the two differ by what that logic costs.

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::intranode::{DispatchOptions, intranode_combine, intranode_dispatch_all};
use ep_rs::core::plan::layout::get_dispatch_layout_for_rank;
use ep_rs::kernels::gpu::{GpuDispatchArgs, GpuRankInputs};
use ep_rs::prelude::*;

const RANKS: usize = 2;
const TOKENS: usize = 4096;
const HIDDEN: usize = 7168;
const TOPK: usize = 8;
const EXPERTS: usize = 256;
const SMS: usize = 24;

fn normal(c: &mut Criterion, dev: std::sync::Arc<Device>) {
    let inputs = WorkloadSpec::new(RANKS, TOKENS, HIDDEN, TOPK, EXPERTS, 7)
        .generate()
        .expect("workload");
    let mut cfg = BufferConfig::new(RANKS);
    cfg.num_nvl_bytes = Buffer::<Sim>::normal_size_hint(RANKS, RANKS * TOKENS, HIDDEN, 2, TOPK);
    let mut buf = Buffer::new(Gpu::co_resident(dev.clone(), RANKS, SMS), cfg).expect("buffer");
    let dev_inputs: Vec<GpuInputs> = inputs
        .iter()
        .map(|i| GpuInputs {
            x: match &i.x {
                Activations::Bf16(t) => DevTensor::upload(dev.context(), t).expect("upload x"),
                Activations::Fp8 { .. } => unreachable!("BF16 workload"),
            },
            x_scales: None,
            topk_idx: Some(DevTensor::upload(dev.context(), &i.topk_idx).expect("upload ids")),
            topk_weights: Some(
                DevTensor::upload(dev.context(), &i.topk_weights).expect("upload weights"),
            ),
        })
        .collect();
    let idx: Vec<DevTensor> = dev_inputs
        .iter()
        .map(|i| i.topk_idx.clone().expect("ids"))
        .collect();
    let layouts = buf.get_dispatch_layout(&idx, EXPERTS).expect("layout");
    let args = NormalDispatchArgs::new(Config::new(SMS, 8, 256, 6, 128).expect("config"));

    // The plan: dispatch, then the identity expert's combine.
    let host_layouts: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(s, i)| get_dispatch_layout_for_rank(s, &i.topk_idx, EXPERTS, RANKS).expect("layout"))
        .collect();
    let opts = DispatchOptions {
        num_channels: SMS / 2,
        expert_alignment: 1,
        num_worst_tokens: 0,
        with_topk: true,
    };
    let want = intranode_dispatch_all(&inputs, &host_layouts, EXPERTS, &opts).expect("plan");
    let ys: Vec<Tensor2<half::bf16>> = want
        .iter()
        .map(|d| match &d.recv_x {
            Activations::Bf16(x) => x.clone(),
            Activations::Fp8 { .. } => unreachable!("BF16 workload"),
        })
        .collect();
    let handles: Vec<_> = want.iter().map(|d| d.handle.clone()).collect();
    let cargs: Vec<CombineArgs<'_>> = (0..RANKS)
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: want[d].recv_topk_weights.as_ref(),
            bias: &[],
        })
        .collect();
    let want_combined = intranode_combine(&handles, &cargs).expect("plan combine");

    // One checked round on the GPU.
    // The identity expert: combine reads each rank's recv_x in place.
    let identity =
        |out: &[GpuDispatch]| -> Vec<GpuHandle> { out.iter().map(|d| d.handle.clone()).collect() };
    fn in_place(out: &[GpuDispatch]) -> Vec<GpuCombineIn<'_>> {
        out.iter()
            .map(|d| GpuCombineIn {
                x: &d.recv_x,
                topk_weights: d.recv_topk_weights.as_ref(),
                bias: &[],
            })
            .collect()
    }
    let got = buf
        .dispatch(&dev_inputs, &layouts, EXPERTS, &args)
        .expect("dispatch");
    let ghandles = identity(&got);
    let combined = buf.combine(&ghandles, &in_place(&got)).expect("combine");
    buf.sync().expect("sync");
    for r in 0..RANKS {
        let x: Tensor2<half::bf16> = got[r].recv_x.download().expect("download recv_x");
        assert_eq!(
            x, ys[r],
            "rank {r}: recv_x must equal the plan's before it is timed"
        );
        let y: Tensor2<half::bf16> = combined[r].combined_x.download().expect("download");
        assert_eq!(
            y, want_combined[r].combined_x,
            "rank {r}: the combine must equal the plan's before it is timed"
        );
    }

    let rows: usize = want.iter().map(|d| d.handle.num_recv_tokens).sum();
    let mut group = c.benchmark_group("gpu_normal_r2_24sms");
    group.throughput(Throughput::Bytes((rows * HIDDEN * 2) as u64));
    group.bench_function("dispatch", |b| {
        b.iter(|| {
            let out = buf
                .dispatch(&dev_inputs, &layouts, EXPERTS, &args)
                .expect("dispatch");
            buf.sync().expect("sync");
            black_box(out.len())
        })
    });
    // The same dispatch on the kernels' group directly (no Buffer host logic): the difference
    // is what the Buffer's checks cost per call.
    group.bench_function("dispatch, NormalGroup directly", |b| {
        let views: Vec<GpuRankInputs<'_>> = dev_inputs
            .iter()
            .map(|i| GpuRankInputs {
                x: &i.x,
                x_scales: None,
                topk_idx: i.topk_idx.as_ref(),
                topk_weights: i.topk_weights.as_ref(),
            })
            .collect();
        let g = buf.transport_mut().normal_mut().expect("group");
        b.iter(|| {
            let out = g
                .dispatch(&views, &layouts, EXPERTS, &GpuDispatchArgs::default())
                .expect("dispatch");
            g.sync().expect("sync");
            black_box(out.len())
        })
    });
    group.bench_function("dispatch + combine in place", |b| {
        b.iter(|| {
            let out = buf
                .dispatch(&dev_inputs, &layouts, EXPERTS, &args)
                .expect("dispatch");
            let hs = identity(&out);
            let y = buf.combine(&hs, &in_place(&out)).expect("combine");
            buf.sync().expect("sync");
            black_box(y.len())
        })
    });
    group.finish();
}
fn main() {
    let dev = match Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: no GPU ({e})");
            return;
        }
    };
    let mut c = Criterion::default().configure_from_args();
    normal(&mut c, dev);
    c.final_summary();
}
