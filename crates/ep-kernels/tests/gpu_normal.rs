//! Normal mode on the GPU against the plan (ep-core's reference of the protocol, itself
//! checked against the oracle), on co-resident ranks of one GPU: layout, dispatch (BF16, FP8,
//! worst-token), cached dispatch, combine (in place and from the combine rows, weights, biases)
//! bit for bit, the canonical digest, many back-to-back rounds, a planted absent rank and bad
//! inputs. Arenas are poisoned before each call; activations span a wide range of binades so
//! that a combine adding in another order would not match.
//!
//! These tests need a GPU: they are `#[ignore]`d, and `scripts/gpu-run.sh` runs them with
//! `--include-ignored` on the GPU machine. Without a GPU they fail (they never pass unrun).

use std::sync::Arc;
use std::time::Duration;

use ep_core::digest;
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{
    DispatchOptions, IntranodeDispatch, IntranodeHandle, intranode_combine, intranode_dispatch_all,
    intranode_dispatch_cached,
};
use ep_core::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use ep_core::protocol::layout::{NormalCtrl, NormalData, RowFormat, align128};
use ep_core::routing::{Activations, RankInputs};
use ep_core::tensor::Tensor2;
use ep_core::workload::{Routing, WorkloadSpec};
use ep_kernels::Error;
use ep_kernels::gpu::{
    CombineSource, DType, DevTensor, Device, GpuCombineArgs, GpuDispatch, GpuDispatchArgs,
    GpuLayout, GpuRankInputs, NormalGroup,
};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn device() -> Arc<Device> {
    Device::open(0).expect("these tests need a GPU (run them with scripts/gpu-run.sh)")
}

/// A finite BF16 value anywhere from 2^-60 to 2^60 in magnitude, or zero (sums of up to 8 of
/// them in f32 depend on their order).
fn wide_bf16(rng: &mut ChaCha8Rng) -> bf16 {
    match rng.random_range(0..16) {
        0 => bf16::ZERO,
        1 => bf16::NEG_ZERO,
        _ => {
            let e: i32 = rng.random_range(-60..=60);
            let m: f32 = 1.0 + rng.random_range(0..128) as f32 / 128.0;
            let s = if rng.random_bool(0.5) { -1.0 } else { 1.0 };
            bf16::from_f32(s * m * 2f32.powi(e))
        }
    }
}

fn wide_tensor(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Tensor2<bf16> {
    Tensor2::from_fn(rows, cols, |_, _| wide_bf16(rng))
}

#[derive(Clone, Debug)]
struct Case {
    ranks: usize,
    tokens: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    fp8: bool,
    masked: usize,
    routing: Routing,
    worst: bool,
    sms: usize,
    alignment: usize,
    biases: usize,
    seed: u64,
}

impl Case {
    fn new(ranks: usize, tokens: usize, hidden: usize, topk: usize, experts: usize) -> Self {
        Self {
            ranks,
            tokens,
            hidden,
            topk,
            experts,
            fp8: false,
            masked: tokens / 7,
            routing: Routing::Uniform,
            worst: false,
            sms: 8,
            alignment: 1,
            biases: 2,
            seed: 1,
        }
    }
}

fn inputs_of(case: &Case) -> Vec<RankInputs> {
    let mut spec = WorkloadSpec::new(
        case.ranks,
        case.tokens,
        case.hidden,
        case.topk,
        case.experts,
        case.seed,
    );
    spec.masked_per_rank = case.masked.min(case.tokens * case.topk);
    spec.routing = case.routing;
    spec.fp8 = case.fp8;
    let mut inputs = spec.generate().expect("workload");
    if !case.fp8 {
        let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0x5eed);
        for inp in &mut inputs {
            inp.x = Activations::Bf16(wide_tensor(&mut rng, case.tokens, case.hidden));
        }
    }
    inputs
}

/// What the device holds for one rank's inputs.
struct DevInputs {
    x: DevTensor,
    scales: Option<DevTensor>,
    idx: DevTensor,
    w: DevTensor,
}

fn upload(dev: &Device, inputs: &[RankInputs]) -> Vec<DevInputs> {
    let ctx = dev.context();
    inputs
        .iter()
        .map(|inp| {
            let (x, scales) = match &inp.x {
                Activations::Bf16(t) => (DevTensor::upload(ctx, t).unwrap(), None),
                Activations::Fp8 { data, scales } => {
                    let d = DevTensor::upload(ctx, data).unwrap();
                    let d = DevTensor::contiguous(
                        d.buffer().clone(),
                        0,
                        DType::F8E4M3,
                        data.rows(),
                        data.cols(),
                    );
                    (d, Some(DevTensor::upload(ctx, scales).unwrap()))
                }
            };
            DevInputs {
                x,
                scales,
                idx: DevTensor::upload(ctx, &inp.topk_idx).unwrap(),
                w: DevTensor::upload(ctx, &inp.topk_weights).unwrap(),
            }
        })
        .collect()
}

fn rank_inputs(d: &[DevInputs], with_topk: bool) -> Vec<GpuRankInputs<'_>> {
    d.iter()
        .map(|i| GpuRankInputs {
            x: &i.x,
            x_scales: i.scales.as_ref(),
            topk_idx: with_topk.then_some(&i.idx),
            topk_weights: with_topk.then_some(&i.w),
        })
        .collect()
}

fn host_layout(l: &GpuLayout) -> DispatchLayout {
    l.download().unwrap()
}

/// A GPU dispatch as the plan's host type; in worst-token mode `num_recv_tokens` is
/// `usize::MAX` (the host never learned it; the caller checks the rows instead).
fn host_dispatch(out: &GpuDispatch, _fp8: bool) -> IntranodeDispatch {
    let (mut d, n) = out.download().unwrap();
    d.handle.num_recv_tokens = n.unwrap_or(usize::MAX);
    d
}

fn group(dev: &Arc<Device>, case: &Case) -> NormalGroup {
    let rows = case.ranks * case.tokens + 64;
    let fmt = RowFormat {
        hidden: case.hidden,
        elem_bytes: if case.fp8 { 1 } else { 2 },
        num_scales: if case.fp8 {
            case.hidden.div_ceil(128)
        } else {
            0
        },
        num_topk: case.topk,
    };
    let bytes = align128(
        NormalCtrl {
            num_ranks: case.ranks,
        }
        .bytes(),
    ) + NormalData::data_bytes_for(
        case.ranks,
        rows as u64,
        fmt.dispatch_record(),
        fmt.combine_record(),
    );
    let mut g = NormalGroup::new(dev.clone(), case.ranks, case.sms, bytes).expect("group");
    g.set_timeout(Duration::from_secs(5));
    g
}

/// Layout, dispatch and both combines of `case` on `g`, each compared with the plan bit for bit;
/// returns the digest of the GPU run.
fn run_case(g: &mut NormalGroup, case: &Case) -> digest::RunDigest {
    let dev = g.device().clone();
    let inputs = inputs_of(case);
    let r = case.ranks;
    let e = case.experts;
    let layouts: Vec<DispatchLayout> = inputs
        .iter()
        .enumerate()
        .map(|(s, i)| get_dispatch_layout_for_rank(s, &i.topk_idx, e, r).unwrap())
        .collect();
    let max_recv = (0..r)
        .map(|d| {
            layouts
                .iter()
                .map(|l| l.num_tokens_per_rank[d] as usize)
                .sum::<usize>()
        })
        .max()
        .unwrap();
    let worst = if case.worst { max_recv + 5 } else { 0 };
    let opts = DispatchOptions {
        num_channels: case.sms / 2,
        expert_alignment: case.alignment,
        num_worst_tokens: worst,
        with_topk: true,
    };
    let plan = intranode_dispatch_all(&inputs, &layouts, e, &opts).unwrap();

    let dins = upload(&dev, &inputs);
    g.fill_arenas_for_test(0xa5).unwrap();
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let glay = g.layout(&idx, e).unwrap();
    g.sync().unwrap();
    for (s, l) in glay.iter().enumerate() {
        assert_eq!(host_layout(l), layouts[s], "layout of rank {s}, {case:?}");
    }
    let out = g
        .dispatch(
            &rank_inputs(&dins, true),
            &glay,
            e,
            &GpuDispatchArgs {
                expert_alignment: case.alignment,
                num_worst_tokens: worst,
            },
        )
        .unwrap();
    g.sync().unwrap();
    let mut host: Vec<IntranodeDispatch> = out.iter().map(|o| host_dispatch(o, case.fp8)).collect();
    for (d, (h, p)) in host.iter_mut().zip(&plan).enumerate() {
        if case.worst {
            assert_eq!(h.handle.num_recv_tokens, usize::MAX);
            h.handle.num_recv_tokens = p.handle.num_recv_tokens;
        }
        assert_eq!(h.recv_x, p.recv_x, "recv_x of rank {d}, {case:?}");
        assert_eq!(h.handle, p.handle, "handle of rank {d}, {case:?}");
        assert_eq!(h, p, "dispatch of rank {d}, {case:?}");
    }

    // Combine from the combine rows: random expert outputs and weights per rank.
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0xc0b1);
    let ys: Vec<Tensor2<bf16>> = plan
        .iter()
        .map(|p| wide_tensor(&mut rng, p.handle.recv_src_idx.len(), case.hidden))
        .collect();
    let biases: Vec<Vec<Tensor2<bf16>>> = (0..r)
        .map(|_| {
            (0..case.biases)
                .map(|_| wide_tensor(&mut rng, case.tokens, case.hidden))
                .collect()
        })
        .collect();
    let handles: Vec<IntranodeHandle> = plan.iter().map(|p| p.handle.clone()).collect();
    let want_rows = intranode_combine(
        &handles,
        &(0..r)
            .map(|d| CombineArgs {
                x: &ys[d],
                topk_weights: plan[d].recv_topk_weights.as_ref(),
                bias: &biases[d],
            })
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let ctx = dev.context();
    let dys: Vec<DevTensor> = ys
        .iter()
        .map(|y| DevTensor::upload(ctx, y).unwrap())
        .collect();
    let dbias: Vec<Vec<DevTensor>> = biases
        .iter()
        .map(|bs| {
            bs.iter()
                .map(|b| DevTensor::upload(ctx, b).unwrap())
                .collect()
        })
        .collect();
    for d in 0..r {
        g.write_combine_rows(d, &dys[d], out[d].recv_topk_weights.as_ref())
            .unwrap();
    }
    let cargs: Vec<GpuCombineArgs<'_>> = (0..r)
        .map(|s| GpuCombineArgs {
            handle: &out[s].handle,
            with_weights: true,
            bias: [dbias[s].first(), dbias[s].get(1)],
        })
        .collect();
    let got = g.combine(CombineSource::Rows, &cargs).unwrap();
    g.sync().unwrap();
    let got_host = host_combined(&got);
    for s in 0..r {
        assert_bits_eq(
            &got_host[s],
            &want_rows[s],
            &format!("combine from rows, rank {s}, {case:?}"),
        );
    }

    // In place (BF16): the expert is the identity on the received rows.
    if !case.fp8 {
        let xs: Vec<Tensor2<bf16>> = plan
            .iter()
            .map(|p| match &p.recv_x {
                Activations::Bf16(t) => t.clone(),
                Activations::Fp8 { .. } => unreachable!(),
            })
            .collect();
        let want = intranode_combine(
            &handles,
            &(0..r)
                .map(|d| CombineArgs {
                    x: &xs[d],
                    topk_weights: plan[d].recv_topk_weights.as_ref(),
                    bias: &biases[d],
                })
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let got = g.combine(CombineSource::InPlace, &cargs).unwrap();
        g.sync().unwrap();
        let got = host_combined(&got);
        for s in 0..r {
            assert_bits_eq(
                &got[s],
                &want[s],
                &format!("combine in place, rank {s}, {case:?}"),
            );
        }
    }

    let d_gpu = digest::normal(&host, &got_host).unwrap();
    let d_plan = digest::normal(&plan, &want_rows).unwrap();
    assert_eq!(d_gpu.total, d_plan.total, "canonical digest, {case:?}");
    d_gpu
}

fn host_combined(got: &[ep_kernels::gpu::GpuCombined]) -> Vec<CombineOutput> {
    got.iter().map(|c| c.download().unwrap()).collect()
}

fn assert_bits_eq(got: &CombineOutput, want: &CombineOutput, what: &str) {
    let gx: Vec<u16> = got.combined_x.data().iter().map(|v| v.to_bits()).collect();
    let wx: Vec<u16> = want.combined_x.data().iter().map(|v| v.to_bits()).collect();
    if gx != wx {
        let i = gx.iter().zip(&wx).position(|(a, b)| a != b).unwrap();
        let h = got.combined_x.cols();
        panic!(
            "{what}: combined_x differs first at token {} column {}: {:#06x} vs {:#06x}",
            i / h,
            i % h,
            gx[i],
            wx[i]
        );
    }
    let bits = |t: &Option<Tensor2<f32>>| {
        t.as_ref()
            .map(|t| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>())
    };
    assert_eq!(
        bits(&got.combined_topk_weights),
        bits(&want.combined_topk_weights),
        "{what}: weights"
    );
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn co_resident_ranks_equal_the_plan() {
    let dev = device();
    let mut cases = Vec::new();
    for (i, &(r, hidden, k, fp8)) in [
        (2, 7168, 8, false),
        (2, 7168, 8, true),
        (4, 4096, 6, false),
        (4, 2048, 1, true),
        (8, 8192, 8, false),
        (8, 2048, 3, true),
        (8, 7168, 8, false),
        (2, 2048, 2, false),
    ]
    .iter()
    .enumerate()
    {
        let mut c = Case::new(r, 300 + 37 * i, hidden, k, 32 * r);
        c.fp8 = fp8;
        c.seed = 100 + i as u64;
        c.sms = [8, 12, 16, 6, 16, 10, 4, 2][i];
        c.routing = match i % 3 {
            0 => Routing::Uniform,
            1 => Routing::Zipf { exponent: 1.2 },
            _ => Routing::Hot { fraction: 0.6 },
        };
        c.alignment = [1, 4, 1, 16, 1, 1, 8, 1][i];
        c.biases = i % 3;
        c.worst = i % 4 == 3;
        cases.push(c);
    }
    for c in &cases {
        let mut g = group(&dev, c);
        let d = run_case(&mut g, c);
        eprintln!("ok: {c:?} digest {}", d.total);
    }
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn deepep_shape_equals_the_plan() {
    // DeepEP's test shape (4096 tokens/rank, hidden 7168, top-8, 256 experts), 2 and 8 ranks.
    let dev = device();
    for (r, sms, fp8) in [(2, 24, false), (8, 16, false), (2, 64, true)] {
        let mut c = Case::new(r, 4096, 7168, 8, 256);
        c.sms = sms;
        c.fp8 = fp8;
        c.masked = 0;
        c.biases = 1;
        let mut g = group(&dev, &c);
        run_case(&mut g, &c);
    }
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn cached_dispatch_equals_the_plan() {
    let dev = device();
    let c = Case::new(4, 700, 4096, 8, 128);
    let mut g = group(&dev, &c);
    let inputs = inputs_of(&c);
    let dins = upload(&dev, &inputs);
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let glay = g.layout(&idx, c.experts).unwrap();
    let first = g
        .dispatch(
            &rank_inputs(&dins, true),
            &glay,
            c.experts,
            &GpuDispatchArgs::default(),
        )
        .unwrap();
    g.sync().unwrap();
    let handles_host: Vec<IntranodeHandle> = first
        .iter()
        .map(|o| host_dispatch(o, false).handle)
        .collect();
    // New rows along the same handles.
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let xs: Vec<Activations> = (0..c.ranks)
        .map(|_| Activations::Bf16(wide_tensor(&mut rng, c.tokens, c.hidden)))
        .collect();
    let dxs: Vec<DevTensor> = xs
        .iter()
        .map(|x| match x {
            Activations::Bf16(t) => DevTensor::upload(dev.context(), t).unwrap(),
            Activations::Fp8 { .. } => unreachable!(),
        })
        .collect();
    for round in 0..3 {
        g.fill_arenas_for_test(0x5a).unwrap();
        let ins: Vec<GpuRankInputs<'_>> = dxs
            .iter()
            .map(|x| GpuRankInputs {
                x,
                x_scales: None,
                topk_idx: None,
                topk_weights: None,
            })
            .collect();
        let hs: Vec<_> = first.iter().map(|o| &o.handle).collect();
        let out = g.dispatch_cached(&ins, &hs).unwrap();
        g.sync().unwrap();
        let xrefs: Vec<&Activations> = xs.iter().collect();
        for d in 0..c.ranks {
            let want = intranode_dispatch_cached(&xrefs, &handles_host, d).unwrap();
            let got = Activations::Bf16(out[d].recv_x.download().unwrap());
            assert_eq!(got, want, "cached dispatch round {round}, rank {d}");
            assert_eq!(
                out[d].recv_src_idx.download::<i32>().unwrap().into_data(),
                handles_host[d].recv_src_idx
            );
        }
    }
    // Back to a dispatch with top-k: the meta buffers change shape between calls, and no
    // allocation may stall a rank whose peers' kernels already wait for it.
    run_case(&mut g, &c);
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn a_thousand_back_to_back_rounds_with_fresh_routings() {
    let dev = device();
    let base = Case::new(4, 96, 512, 4, 32);
    let mut g = group(&dev, &base);
    for round in 0..1000u64 {
        let mut c = base.clone();
        c.seed = 10_000 + round;
        c.routing = if round % 2 == 0 {
            Routing::Uniform
        } else {
            Routing::Zipf { exponent: 0.8 }
        };
        c.masked = (round % 50) as usize;
        c.biases = (round % 3) as usize;
        run_case(&mut g, &c);
    }
    assert_eq!(g.last_call(), 3000);
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn an_absent_rank_times_out_naming_it_and_reset_recovers() {
    let dev = device();
    let c = Case::new(4, 200, 1024, 4, 32);
    let mut g = group(&dev, &c);
    g.set_timeout(Duration::from_millis(200));
    run_case(&mut g, &c);
    let inputs = inputs_of(&c);
    let dins = upload(&dev, &inputs);
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let glay = g.layout(&idx, c.experts).unwrap();
    g.sync().unwrap();
    g.set_absent_rank_for_test(Some(2));
    let t0 = std::time::Instant::now();
    let err = g
        .dispatch(
            &rank_inputs(&dins, true),
            &glay,
            c.experts,
            &GpuDispatchArgs::default(),
        )
        .and_then(|_| g.sync())
        .unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "bounded: {:?}",
        t0.elapsed()
    );
    match &err {
        Error::DeviceWaitTimeout { writer, word, .. } => {
            assert_eq!(*writer, Some(2), "{err}");
            assert!(word.starts_with("notify"), "{err}");
        }
        other => panic!("expected a device wait timeout, got {other}"),
    }
    eprintln!("planted: {err}");
    assert!(
        matches!(g.sync(), Err(Error::Poisoned { .. })),
        "poisoned until reset"
    );
    g.set_absent_rank_for_test(None);
    g.reset().unwrap();
    g.set_timeout(Duration::from_secs(5));
    for seed in 0..3 {
        let mut c2 = c.clone();
        c2.seed = 500 + seed;
        run_case(&mut g, &c2);
    }
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn bad_inputs_are_typed_errors_and_leave_the_group_usable() {
    let dev = device();
    assert!(matches!(
        NormalGroup::new(dev.clone(), 8, 24, 1 << 26),
        Err(Error::NotEnoughSms { .. })
    ));
    assert!(matches!(
        NormalGroup::new(dev.clone(), 9, 2, 1 << 26),
        Err(Error::Unsupported(_))
    ));
    let c = Case::new(2, 256, 1024, 4, 16);
    let mut g = group(&dev, &c);
    let inputs = inputs_of(&c);
    let dins = upload(&dev, &inputs);
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let glay = g.layout(&idx, c.experts).unwrap();
    // Weights passed as the ids: a dtype error before any launch.
    let mut bad = rank_inputs(&dins, true);
    bad[1].topk_idx = Some(&dins[1].w);
    assert!(matches!(
        g.dispatch(&bad, &glay, c.experts, &GpuDispatchArgs::default()),
        Err(Error::TensorMismatch { .. })
    ));
    // Too few worst-case rows: refused on the device, nothing written, still usable.
    let err = g
        .dispatch(
            &rank_inputs(&dins, true),
            &glay,
            c.experts,
            &GpuDispatchArgs {
                expert_alignment: 1,
                num_worst_tokens: 3,
            },
        )
        .and_then(|_| g.sync())
        .unwrap_err();
    assert!(matches!(err, Error::DeviceCapacity { .. }), "{err}");
    // An expert id out of range, routed on the device.
    let mut t = inputs[0].topk_idx.clone();
    t.set(5, 1, 999);
    let dt = DevTensor::upload(dev.context(), &t).unwrap();
    let mut idx2 = idx.clone();
    idx2[0] = &dt;
    let _ = g.layout(&idx2, c.experts).unwrap();
    let err = g.sync().unwrap_err();
    assert!(
        matches!(
            err,
            Error::ExpertOutOfRange {
                expert: 999,
                index: 21,
                rank: 0
            }
        ),
        "{err}"
    );
    run_case(&mut g, &c);
}
