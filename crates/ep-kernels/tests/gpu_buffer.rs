//! ep-core's `Buffer` over the GPU executor (`Buffer<Gpu>`) against the same `Buffer` over the
//! simulator (`Buffer<Sim>`), on co-resident ranks of one GPU: layout, dispatch (BF16, FP8,
//! worst-token), combine (copying the expert outputs, and in place over `recv_x`), cached
//! dispatch — outputs bit for bit, the canonical digest equal; bad inputs as typed errors that
//! leave the buffer usable; a planted absent rank as a typed timeout that poisons the buffer
//! until `reset`. Arenas are poisoned before each round.
//!
//! These tests need a GPU: they are `#[ignore]`d, and `scripts/gpu-run.sh` runs them with
//! `--include-ignored` on the GPU machine. Without a GPU they fail (they never pass unrun).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Case, DevInputs, assert_bits_eq, device_at, inputs_of, upload, wide_tensor};
use ep_core::buffer::NormalDispatchArgs;
use ep_core::config::{BufferConfig, Config};
use ep_core::digest;
use ep_core::plan::combine::CombineArgs;
use ep_core::plan::intranode::{IntranodeDispatch, IntranodeHandle};
use ep_core::transport::FabricParams;
use ep_core::workload::Routing;
use ep_core::{Activations, Buffer, Error as CoreError, Tensor2};
use ep_kernels::Error;
use ep_kernels::gpu::{
    DType, DevTensor, Device, Gpu, GpuCombineIn, GpuDispatch, GpuHandle, GpuInputs, GpuRows,
};
use ep_sim::{Sim, SimConfig};
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn device() -> Arc<Device> {
    device_at(0)
}

fn config(case: &Case) -> BufferConfig {
    let mut c = BufferConfig::new(case.ranks);
    c.num_nvl_bytes = case.arena_bytes();
    c
}

fn args(case: &Case, worst: usize) -> NormalDispatchArgs {
    NormalDispatchArgs {
        config: Config::new(case.sms, 8, 256, 6, 128).unwrap(),
        expert_alignment: case.alignment,
        num_worst_tokens: worst,
        with_topk: true,
    }
}

fn gpu_buffer(dev: &Arc<Device>, case: &Case) -> Buffer<Gpu> {
    let mut g = Gpu::co_resident(dev.clone(), case.ranks, case.sms);
    g.set_timeout(Duration::from_secs(5));
    Buffer::new(g, config(case)).expect("Buffer<Gpu>")
}

fn sim_buffer(case: &Case) -> Buffer<Sim> {
    let sim = Sim::new(SimConfig::new(
        FabricParams::single_node(case.ranks),
        case.seed,
    ));
    Buffer::new(sim, config(case)).expect("Buffer<Sim>")
}

fn gpu_inputs(d: &[DevInputs]) -> Vec<GpuInputs> {
    d.iter()
        .map(|i| GpuInputs {
            x: i.x.clone(),
            x_scales: i.scales.clone(),
            topk_idx: Some(i.idx.clone()),
            topk_weights: Some(i.w.clone()),
        })
        .collect()
}

fn poison(buf: &mut Buffer<Gpu>) {
    buf.transport_mut()
        .normal_mut()
        .expect("arena")
        .fill_arenas_for_test(0xa5)
        .unwrap();
}

/// A GPU dispatch as the host type; in worst-token mode the handle's `num_recv_tokens` is the
/// simulator's (the host never learned it on the GPU).
fn host_dispatch(out: &GpuDispatch, want: &IntranodeDispatch) -> IntranodeDispatch {
    let (mut d, n) = out.download().unwrap();
    d.handle.num_recv_tokens = n.unwrap_or(want.handle.num_recv_tokens);
    d
}

/// One round of `case` on both buffers: every output compared bit for bit; returns the
/// canonical digest (equal on both).
fn round(gbuf: &mut Buffer<Gpu>, case: &Case) -> digest::RunDigest {
    let dev = gbuf.transport().device().clone();
    let (r, e) = (case.ranks, case.experts);
    let inputs = inputs_of(case);
    let mut sim = sim_buffer(case);
    let idx: Vec<Tensor2<i64>> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let lay = sim.get_dispatch_layout(&idx, e).unwrap();
    let worst = if case.worst {
        (0..r)
            .map(|d| {
                lay.iter()
                    .map(|l| l.num_tokens_per_rank[d] as usize)
                    .sum::<usize>()
            })
            .max()
            .unwrap()
            + 5
    } else {
        0
    };
    let a = args(case, worst);
    let want = sim.dispatch(&inputs, &lay, e, &a).unwrap();

    poison(gbuf);
    let all: Vec<usize> = (0..r).collect();
    let dins = upload(&dev, &inputs, &all);
    let gidx: Vec<DevTensor> = dins.iter().map(|d| d.idx.clone()).collect();
    let glay = gbuf.get_dispatch_layout(&gidx, e).unwrap();
    gbuf.sync().unwrap();
    for (s, l) in glay.iter().enumerate() {
        assert_eq!(
            l.download().unwrap(),
            lay[s],
            "layout of rank {s}, {case:?}"
        );
    }
    let got = gbuf.dispatch(&gpu_inputs(&dins), &glay, e, &a).unwrap();
    gbuf.sync().unwrap();
    let host: Vec<IntranodeDispatch> = got
        .iter()
        .zip(&want)
        .map(|(g, w)| host_dispatch(g, w))
        .collect();
    for (s, (h, w)) in host.iter().zip(&want).enumerate() {
        assert_eq!(h.recv_x, w.recv_x, "recv_x of rank {s}, {case:?}");
        assert_eq!(h.handle, w.handle, "handle of rank {s}, {case:?}");
        assert_eq!(h, w, "dispatch of rank {s}, {case:?}");
    }

    // Combine of random expert outputs (copied into the combine rows) with weights and biases.
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0xc0b1);
    let (ys, biases) = common::expert_outputs(&mut rng, case, &want);
    let handles: Vec<IntranodeHandle> = want.iter().map(|w| w.handle.clone()).collect();
    let cargs: Vec<CombineArgs<'_>> = (0..r)
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: want[d].recv_topk_weights.as_ref(),
            bias: &biases[d],
        })
        .collect();
    let want_c = sim.combine(&handles, &cargs).unwrap();
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
    let ghandles: Vec<GpuHandle> = got.iter().map(|g| g.handle.clone()).collect();
    let gargs: Vec<GpuCombineIn<'_>> = (0..r)
        .map(|d| GpuCombineIn {
            x: &dys[d],
            topk_weights: got[d].recv_topk_weights.as_ref(),
            bias: &dbias[d],
        })
        .collect();
    let got_c = gbuf.combine(&ghandles, &gargs).unwrap();
    // The outputs are written on the ranks' streams: downloads after the sync.
    gbuf.sync().unwrap();
    let got_c: Vec<_> = got_c.iter().map(|c| c.download().unwrap()).collect();
    for (s, (g, w)) in got_c.iter().zip(&want_c).enumerate() {
        assert_bits_eq(g, w, &format!("combine, rank {s}, {case:?}"));
    }

    // In place (BF16): the identity expert, combine reading recv_x where it lies.
    if !case.fp8 {
        let xs: Vec<Tensor2<bf16>> = want
            .iter()
            .map(|w| match &w.recv_x {
                Activations::Bf16(t) => t.clone(),
                Activations::Fp8 { .. } => unreachable!(),
            })
            .collect();
        let cargs: Vec<CombineArgs<'_>> = (0..r)
            .map(|d| CombineArgs {
                x: &xs[d],
                topk_weights: want[d].recv_topk_weights.as_ref(),
                bias: &biases[d],
            })
            .collect();
        let want_ip = sim.combine(&handles, &cargs).unwrap();
        let gargs: Vec<GpuCombineIn<'_>> = (0..r)
            .map(|d| GpuCombineIn {
                x: &got[d].recv_x,
                topk_weights: got[d].recv_topk_weights.as_ref(),
                bias: &dbias[d],
            })
            .collect();
        let got_ip = gbuf.combine(&ghandles, &gargs).unwrap();
        gbuf.sync().unwrap();
        for (s, (g, w)) in got_ip.iter().zip(&want_ip).enumerate() {
            let g = g.download().unwrap();
            assert_bits_eq(&g, w, &format!("combine in place, rank {s}, {case:?}"));
        }
    }

    let d_gpu = digest::normal(&host, &got_c).unwrap();
    let d_sim = digest::normal(&want, &want_c).unwrap();
    assert_eq!(d_gpu.total, d_sim.total, "canonical digest, {case:?}");

    // Cached dispatch of fresh rows along the handles (exact sizing only).
    if !case.worst {
        let fresh: Vec<Activations> = (0..r)
            .map(|_| Activations::Bf16(wide_tensor(&mut rng, case.tokens, case.hidden)))
            .collect();
        let refs: Vec<&Activations> = fresh.iter().collect();
        let want_cd = sim.dispatch_cached(&refs, &handles).unwrap();
        let rows: Vec<GpuRows> = fresh
            .iter()
            .map(|x| match x {
                Activations::Bf16(t) => GpuRows {
                    x: DevTensor::upload(ctx, t).unwrap(),
                    x_scales: None,
                },
                Activations::Fp8 { .. } => unreachable!(),
            })
            .collect();
        let grefs: Vec<&GpuRows> = rows.iter().collect();
        let got_cd = gbuf.dispatch_cached(&grefs, &ghandles).unwrap();
        gbuf.sync().unwrap();
        for (s, (g, w)) in got_cd.iter().zip(&want_cd).enumerate() {
            let Activations::Bf16(w) = w else {
                unreachable!()
            };
            assert_eq!(
                &g.x.download::<bf16>().unwrap(),
                w,
                "cached rows of rank {s}, {case:?}"
            );
        }
    }
    d_gpu
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn buffer_over_the_gpu_equals_buffer_over_the_simulator() {
    let dev = device();
    for (i, &(r, hidden, k, fp8, worst, routing)) in [
        (2, 7168, 8, false, false, Routing::Uniform),
        (2, 7168, 8, true, false, Routing::Zipf { exponent: 1.2 }),
        (4, 4096, 6, false, true, Routing::Hot { fraction: 0.5 }),
        (4, 2048, 1, true, false, Routing::Uniform),
        (8, 8192, 8, false, false, Routing::Uniform),
        (8, 2048, 3, true, true, Routing::Zipf { exponent: 0.8 }),
        (2, 2048, 2, false, true, Routing::Uniform),
    ]
    .iter()
    .enumerate()
    {
        let mut c = Case::new(r, 96 + 29 * i, hidden, k, 16 * r);
        c.fp8 = fp8;
        c.worst = worst;
        c.routing = routing;
        c.alignment = 1 + (i % 3) * 3;
        c.biases = i % 3;
        c.seed = 900 + i as u64;
        let mut buf = gpu_buffer(&dev, &c);
        for round_no in 0..2 {
            let mut c2 = c.clone();
            c2.seed += 100 * round_no;
            round(&mut buf, &c2);
        }
        eprintln!("ok: {c:?}, last call {}", buf.last_call());
    }
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn many_rounds_through_one_buffer() {
    let dev = device();
    let mut c = Case::new(4, 64, 1024, 4, 32);
    let mut buf = gpu_buffer(&dev, &c);
    for seed in 0..200 {
        c.seed = 3000 + seed;
        c.fp8 = seed % 3 == 1;
        c.worst = seed % 4 == 2;
        round(&mut buf, &c);
    }
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn bad_inputs_are_typed_errors_and_leave_the_buffer_usable() {
    let dev = device();
    // Eight ranks of 24 SMs do not fit one H200: refused when the Buffer is made.
    let big = Case::new(8, 64, 1024, 4, 32);
    let mut over = big.clone();
    over.sms = 24;
    let err = Buffer::new(Gpu::co_resident(dev.clone(), 8, 24), config(&over)).unwrap_err();
    assert!(
        matches!(err.backend::<Error>(), Some(Error::NotEnoughSms { .. })),
        "{err}"
    );
    let c = Case::new(2, 256, 1024, 4, 16);
    let mut buf = gpu_buffer(&dev, &c);
    round(&mut buf, &c);
    let inputs = inputs_of(&c);
    let dins = upload(&dev, &inputs, &[0, 1]);
    let gidx: Vec<DevTensor> = dins.iter().map(|d| d.idx.clone()).collect();
    let glay = buf.get_dispatch_layout(&gidx, c.experts).unwrap();
    let calls = buf.last_call();

    // The weights passed as the ids: a dtype error before any launch, no call taken.
    let mut bad = gpu_inputs(&dins);
    bad[1].topk_idx = Some(dins[1].w.clone());
    let err = buf
        .dispatch(&bad, &glay, c.experts, &args(&c, 0))
        .unwrap_err();
    assert!(
        matches!(err.backend::<Error>(), Some(Error::TensorMismatch { .. })),
        "{err}"
    );
    assert_eq!(buf.last_call(), calls, "no call taken");
    // One rank's inputs for two ranks.
    let err = buf
        .dispatch(&gpu_inputs(&dins)[..1], &glay, c.experts, &args(&c, 0))
        .unwrap_err();
    assert!(matches!(err, CoreError::RankCountMismatch { .. }), "{err}");
    // A hidden size that differs between the ranks: ep-core's shape rule.
    let odd = DevTensor::zeros(dev.context(), DType::Bf16, c.tokens, 512).unwrap();
    let mut bad = gpu_inputs(&dins);
    bad[1].x = odd;
    let err = buf
        .dispatch(&bad, &glay, c.experts, &args(&c, 0))
        .unwrap_err();
    assert!(matches!(err, CoreError::ShapeMismatch { .. }), "{err}");
    // Config::num_sms other than the executor's.
    let mut wrong = args(&c, 0);
    wrong.config = Config::new(c.sms + 2, 8, 256, 6, 128).unwrap();
    let err = buf
        .dispatch(&gpu_inputs(&dins), &glay, c.experts, &wrong)
        .unwrap_err();
    assert!(matches!(err, CoreError::InputRefused { .. }), "{err}");
    // Too few worst-case rows: refused on the device, surfaced at the sync.
    let err = buf
        .dispatch(&gpu_inputs(&dins), &glay, c.experts, &args(&c, 3))
        .and_then(|_| buf.sync())
        .unwrap_err();
    assert!(
        matches!(err.backend::<Error>(), Some(Error::DeviceCapacity { .. })),
        "{err}"
    );
    // An expert id out of range, routed on the device.
    let mut t = inputs[0].topk_idx.clone();
    t.set(5, 1, 999);
    let mut gidx2 = gidx.clone();
    gidx2[0] = DevTensor::upload(dev.context(), &t).unwrap();
    let _ = buf.get_dispatch_layout(&gidx2, c.experts).unwrap();
    let err = buf.sync().unwrap_err();
    assert!(matches!(err, CoreError::InputRefused { .. }), "{err}");
    assert!(
        matches!(
            err.backend::<Error>(),
            Some(Error::ExpertOutOfRange { expert: 999, .. })
        ),
        "{err}"
    );
    assert!(buf.poisoned().is_none(), "refused inputs do not poison");
    round(&mut buf, &c);
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn an_absent_rank_poisons_the_buffer_and_reset_recovers() {
    let dev = device();
    let c = Case::new(4, 200, 1024, 4, 32);
    let mut buf = gpu_buffer(&dev, &c);
    buf.transport_mut().set_timeout(Duration::from_millis(200));
    round(&mut buf, &c);
    let inputs = inputs_of(&c);
    let dins = upload(&dev, &inputs, &[0, 1, 2, 3]);
    let gidx: Vec<DevTensor> = dins.iter().map(|d| d.idx.clone()).collect();
    let glay = buf.get_dispatch_layout(&gidx, c.experts).unwrap();
    buf.sync().unwrap();
    buf.transport_mut()
        .normal_mut()
        .unwrap()
        .set_absent_rank_for_test(Some(2));
    let t0 = std::time::Instant::now();
    let err = buf
        .dispatch(&gpu_inputs(&dins), &glay, c.experts, &args(&c, 0))
        .and_then(|_| buf.sync())
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5), "bounded");
    match err.backend::<Error>() {
        Some(Error::DeviceWaitTimeout { writer, .. }) => assert_eq!(*writer, Some(2), "{err}"),
        _ => panic!("expected a device wait timeout naming rank 2, got {err}"),
    }
    assert!(matches!(
        buf.dispatch(&gpu_inputs(&dins), &glay, c.experts, &args(&c, 0)),
        Err(CoreError::BufferPoisoned { .. })
    ));
    buf.transport_mut()
        .normal_mut()
        .unwrap()
        .set_absent_rank_for_test(None);
    buf.reset().unwrap();
    buf.transport_mut().set_timeout(Duration::from_secs(5));
    for seed in 0..3 {
        let mut c2 = c.clone();
        c2.seed = 700 + seed;
        round(&mut buf, &c2);
    }
}
