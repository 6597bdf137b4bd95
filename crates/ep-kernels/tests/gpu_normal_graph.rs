//! Normal mode captured in CUDA graphs and ordered against the caller's streams, on co-resident
//! ranks of one GPU, against the plan bit for bit: a worst-token layout + dispatch + combine
//! captured once and replayed with fresh values (and fresh routings) written into the same input
//! tensors, outputs poisoned before every replay, eager calls interleaved (the device epoch words
//! must keep count with the host's); a capture that needs the host refused with a typed error;
//! `previous_event` / `async_finish` / caller streams giving correct results on a caller stream.
//!
//! These tests need a GPU: they are `#[ignore]`d, and `scripts/gpu-run.sh` runs them with
//! `--include-ignored` on the GPU machine. Without a GPU they fail (they never pass unrun).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    Case, DevInputs, assert_bits_eq, device_at, host_combined, host_dispatch, host_layout,
    host_layouts, inputs_of, plan_with_worst, rank_inputs, run_case, upload, wide_tensor,
};
use cudarc::driver::{CudaEvent, CudaStream};
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{IntranodeHandle, intranode_combine};
use ep_core::routing::{Activations, RankInputs};
use ep_core::tensor::Tensor2;
use ep_core::workload::Routing;
use ep_kernels::Error;
use ep_kernels::gpu::mem::DevBuf;
use ep_kernels::gpu::{
    CallStreams, CombineSource, DType, DevTensor, Device, GpuCombineArgs, GpuCombined, GpuDispatch,
    GpuDispatchArgs, GpuLayout, NormalGroup,
};
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn group(dev: &Arc<Device>, case: &Case) -> NormalGroup {
    let mut g =
        NormalGroup::new(dev.clone(), case.ranks, case.sms, case.arena_bytes()).expect("group");
    g.set_timeout(Duration::from_secs(5));
    g
}

fn all(case: &Case) -> Vec<usize> {
    (0..case.ranks).collect()
}

/// What a captured layout + dispatch + combine returns (rewritten by every replay).
struct Outs {
    lay: Vec<GpuLayout>,
    disp: Vec<GpuDispatch>,
    comb: Vec<GpuCombined>,
}

/// Layout, dispatch and combine of every local rank on `dins` (in place for BF16 rows, from the
/// combine rows `dys` for FP8), weights and one bias combined.
fn calls(
    g: &mut NormalGroup,
    case: &Case,
    dins: &[DevInputs],
    dbias: &[DevTensor],
    dys: &[DevTensor],
    worst: usize,
) -> ep_kernels::Result<Outs> {
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let lay = g.layout(&idx, case.experts)?;
    let disp = g.dispatch(
        &rank_inputs(dins, true),
        &lay,
        case.experts,
        &GpuDispatchArgs {
            expert_alignment: case.alignment,
            num_worst_tokens: worst,
        },
    )?;
    let source = if case.fp8 {
        for (i, y) in dys.iter().enumerate() {
            g.write_combine_rows(i, y, disp[i].recv_topk_weights.as_ref())?;
        }
        CombineSource::Rows
    } else {
        CombineSource::InPlace
    };
    let cargs: Vec<GpuCombineArgs<'_>> = disp
        .iter()
        .zip(dbias)
        .map(|(d, b)| GpuCombineArgs {
            handle: &d.handle,
            with_weights: true,
            bias: [Some(b), None],
        })
        .collect();
    let comb = g.combine(source, &cargs)?;
    Ok(Outs { lay, disp, comb })
}

/// Writes `inputs`' values of the local ranks into the tensors `dins` (the same buffers).
fn write_inputs(dins: &[DevInputs], inputs: &[RankInputs], local: &[usize]) {
    for (d, &s) in dins.iter().zip(local) {
        match &inputs[s].x {
            Activations::Bf16(t) => d.x.write(t).unwrap(),
            Activations::Fp8 { data, scales } => {
                d.x.write(data).unwrap();
                d.scales.as_ref().unwrap().write(scales).unwrap();
            }
        }
        d.idx.write(&inputs[s].topk_idx).unwrap();
        d.w.write(&inputs[s].topk_weights).unwrap();
    }
}

/// Fills every buffer the outputs live in (but the arenas, see `fill_arenas_for_test`) with
/// `byte`.
fn poison(g: &mut NormalGroup, o: &Outs, byte: u8) {
    for i in 0..o.lay.len() {
        let st = g.stream(i).clone();
        let (l, d, c) = (&o.lay[i], &o.disp[i], &o.comb[i]);
        let h = &d.handle;
        let mut ts = vec![
            &l.num_tokens_per_rank,
            &l.num_tokens_per_expert,
            &l.is_token_in_rank,
            &d.recv_src_idx,
            &h.rank_prefix_matrix,
            &h.channel_prefix_matrix,
            &h.recv_channel_prefix_matrix,
            &h.send_head,
            &c.combined_x,
        ];
        ts.extend(d.recv_topk_idx.iter());
        ts.extend(d.recv_topk_weights.iter());
        ts.extend(c.combined_topk_weights.iter());
        for t in ts {
            let b = t.buffer();
            b.memset_async(&st, byte, 0, b.len()).unwrap();
        }
    }
    g.sync().unwrap();
}

/// The plan's combine of `plan` with expert outputs `xs` (per rank) and one bias per rank.
fn plan_combine(
    plan: &[ep_core::plan::intranode::IntranodeDispatch],
    xs: &[Tensor2<bf16>],
    biases: &[Tensor2<bf16>],
) -> Vec<CombineOutput> {
    let handles: Vec<IntranodeHandle> = plan.iter().map(|p| p.handle.clone()).collect();
    intranode_combine(
        &handles,
        &(0..plan.len())
            .map(|d| CombineArgs {
                x: &xs[d],
                topk_weights: plan[d].recv_topk_weights.as_ref(),
                bias: std::slice::from_ref(&biases[d]),
            })
            .collect::<Vec<_>>(),
    )
    .unwrap()
}

fn bf16_rows(a: &Activations) -> Tensor2<bf16> {
    match a {
        Activations::Bf16(t) => t.clone(),
        Activations::Fp8 { .. } => unreachable!("BF16 rows"),
    }
}

/// Compares a replay's (or a call's) outputs with the plan of `case` on `inputs`.
fn check(
    case: &Case,
    inputs: &[RankInputs],
    o: &Outs,
    worst: usize,
    biases: &[Tensor2<bf16>],
    ys: &[Tensor2<bf16>],
    what: &str,
) {
    let layouts = host_layouts(case, inputs);
    let plan = plan_with_worst(case, inputs, &layouts, worst);
    for (i, s) in all(case).into_iter().enumerate() {
        assert_eq!(
            host_layout(&o.lay[i]),
            layouts[s],
            "{what}: layout of rank {s}"
        );
        let mut h = host_dispatch(&o.disp[i]);
        let p = &plan[s];
        if worst > 0 {
            assert_eq!(h.handle.num_recv_tokens, usize::MAX);
            h.handle.num_recv_tokens = p.handle.num_recv_tokens;
        }
        assert_eq!(h.recv_x, p.recv_x, "{what}: recv_x of rank {s}");
        assert_eq!(h.handle, p.handle, "{what}: handle of rank {s}");
        assert_eq!(&h, p, "{what}: dispatch of rank {s}");
    }
    let xs: Vec<Tensor2<bf16>> = if case.fp8 {
        ys.to_vec()
    } else {
        plan.iter().map(|p| bf16_rows(&p.recv_x)).collect()
    };
    let want = plan_combine(&plan, &xs, biases);
    for (i, got) in host_combined(&o.comb).iter().enumerate() {
        assert_bits_eq(got, &want[i], &format!("{what}: combine of rank {i}"));
    }
}

fn assert_epochs(g: &mut NormalGroup, what: &str) {
    let want = g.last_call();
    for (i, words) in g.epochs_for_test().unwrap().iter().enumerate() {
        assert!(
            words.iter().all(|&w| w == want),
            "{what}: epoch words of local rank {i} are {words:?}, the host's counter is {want}"
        );
    }
}

/// `rounds` replays of one captured layout + worst-token dispatch + combine of `base`'s shape,
/// each with fresh values and a fresh routing in the captured input tensors, compared with the
/// plan; an eager `run_case` every tenth round.
fn replay_rounds(base: &Case, rounds: u64) {
    let dev = device_at(0);
    let mut g = group(&dev, base);
    let local = all(base);
    let (n, t, h) = (base.ranks, base.tokens, base.hidden);
    // Every token to every rank fits any routing: one graph serves them all.
    let worst = base.ranks * base.tokens;
    let ctx = dev.context();
    let dins = upload(&dev, &inputs_of(base), &local);
    let dbias: Vec<DevTensor> = (0..n)
        .map(|_| DevTensor::empty(ctx, DType::Bf16, t, h).unwrap())
        .collect();
    let dys: Vec<DevTensor> = (0..n)
        .filter(|_| base.fp8)
        .map(|_| DevTensor::empty(ctx, DType::Bf16, worst, h).unwrap())
        .collect();
    let graph = g
        .capture(|g| calls(g, base, &dins, &dbias, &dys, worst))
        .unwrap();
    assert_eq!(graph.calls(), 2, "a dispatch and a combine per replay");
    assert_eq!(g.last_call(), 0, "capturing runs nothing");
    // run_case: a dispatch, a combine from the rows, in place (BF16), two back to back.
    let eager_calls = if base.fp8 { 4 } else { 5 };
    let mut calls_made = 0;
    for round in 0..rounds {
        let mut c = base.clone();
        c.seed = 7_000 + round;
        c.routing = match round % 3 {
            0 => Routing::Uniform,
            1 => Routing::Zipf { exponent: 1.1 },
            _ => Routing::Hot { fraction: 0.5 },
        };
        c.masked = (round % 40) as usize;
        let inputs = inputs_of(&c);
        let mut rng = ChaCha8Rng::seed_from_u64(c.seed ^ 0xb1a5);
        let biases: Vec<Tensor2<bf16>> = (0..n).map(|_| wide_tensor(&mut rng, t, h)).collect();
        let ys: Vec<Tensor2<bf16>> = (0..dys.len())
            .map(|_| wide_tensor(&mut rng, worst, h))
            .collect();
        write_inputs(&dins, &inputs, &local);
        for (d, b) in dbias.iter().zip(&biases) {
            d.write(b).unwrap();
        }
        for (d, y) in dys.iter().zip(&ys) {
            d.write(y).unwrap();
        }
        g.fill_arenas_for_test(if round % 2 == 0 { 0xa5 } else { 0x5a })
            .unwrap();
        poison(
            &mut g,
            graph.outputs(),
            if round % 2 == 0 { 0xff } else { 0x7e },
        );
        graph.replay(&mut g).unwrap();
        calls_made += 2;
        g.sync().unwrap();
        check(
            &c,
            &inputs,
            graph.outputs(),
            worst,
            &biases,
            &ys,
            &format!("replay {round} of {c:?}"),
        );
        if round % 10 == 9 {
            // Eager calls between replays (exact and worst-token in turn), on other tensors.
            let mut e = c.clone();
            e.seed += 1_000_000;
            e.worst = round % 20 == 19;
            run_case(&mut g, &e);
            calls_made += eager_calls;
        }
        if round % 25 == 0 {
            assert_epochs(&mut g, &format!("after round {round}"));
        }
    }
    assert_eq!(g.last_call(), calls_made);
    assert_epochs(&mut g, "at the end");
}

#[test]
#[ignore = "needs a GPU: run with scripts/gpu-run.sh"]
fn a_captured_worst_token_round_replays_with_fresh_inputs() {
    let mut c = Case::new(4, 160, 1024, 4, 32);
    c.sms = 8;
    replay_rounds(&c, 120);
}

#[test]
#[ignore = "needs a GPU: run with scripts/gpu-run.sh"]
fn a_captured_fp8_round_with_combine_rows_replays_with_fresh_inputs() {
    let mut c = Case::new(2, 200, 2048, 8, 16);
    c.fp8 = true;
    c.sms = 12;
    c.alignment = 4;
    replay_rounds(&c, 100);
}

#[test]
#[ignore = "needs a GPU: run with scripts/gpu-run.sh"]
fn capturing_what_needs_the_host_is_a_typed_error() {
    let dev = device_at(0);
    let c = Case::new(2, 128, 512, 4, 16);
    let mut g = group(&dev, &c);
    let dins = upload(&dev, &inputs_of(&c), &all(&c));
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let glay = g.layout(&idx, c.experts).unwrap();
    g.sync().unwrap();
    let err = g
        .capture(|g| {
            g.dispatch(
                &rank_inputs(&dins, true),
                &glay,
                c.experts,
                &GpuDispatchArgs::default(),
            )
        })
        .unwrap_err();
    assert!(matches!(err, Error::NotCapturable { .. }), "{err}");
    eprintln!("refused: {err}");
    let err = g.capture(|g| g.sync()).unwrap_err();
    assert!(matches!(err, Error::NotCapturable { .. }), "{err}");
    let err = g.capture(|g| g.capture(|_| Ok(()))).unwrap_err();
    assert!(matches!(err, Error::NotCapturable { .. }), "{err}");
    assert_eq!(g.last_call(), 0, "nothing counted");
    // The streams left capture: the group works, eagerly and captured.
    run_case(&mut g, &c);
    let empty = g.capture(|_| Ok(())).unwrap();
    assert_eq!(empty.calls(), 0);
    empty.replay(&mut g).unwrap();
    // A graph replays on its own group only.
    let mut other = group(&dev, &c);
    assert!(matches!(
        empty.replay(&mut other),
        Err(Error::Unsupported(_))
    ));
    run_case(&mut g, &c);
    assert_epochs(&mut g, "after the refused captures");
}

/// `bytes` on `stream`: `dst` = `src` (both contiguous, the same size).
fn copy_on(stream: &CudaStream, src: &DevTensor, dst: &DevTensor) {
    assert!(src.is_contiguous() && dst.is_contiguous());
    assert_eq!(src.span_bytes(), dst.span_bytes());
    // SAFETY: both are contiguous views of live device buffers holding `span_bytes` bytes from
    // their addresses (asserted); the test keeps them alive until `stream` is synchronised.
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(
            dst.ptr(),
            src.ptr(),
            src.span_bytes() as usize,
            stream.cu_stream(),
        )
    }
    .unwrap();
}

#[test]
#[ignore = "needs a GPU: run with scripts/gpu-run.sh"]
fn calls_ordered_on_caller_streams_by_events_equal_the_plan() {
    let dev = device_at(0);
    let mut c = Case::new(2, 256, 2048, 4, 16);
    c.sms = 10;
    let mut g = group(&dev, &c);
    let local = all(&c);
    let (n, t, h, k) = (c.ranks, c.tokens, c.hidden, c.topk);
    let ctx = dev.context();
    let inputs = inputs_of(&c);
    let staging = upload(&dev, &inputs, &local);
    let dins = upload(&dev, &inputs, &local);
    let mut rng = ChaCha8Rng::seed_from_u64(99);
    let biases: Vec<Tensor2<bf16>> = (0..n).map(|_| wide_tensor(&mut rng, t, h)).collect();
    let dbias: Vec<DevTensor> = biases
        .iter()
        .map(|b| DevTensor::upload(ctx, b).unwrap())
        .collect();
    let caller: Vec<Arc<CudaStream>> = (0..n).map(|_| ctx.new_stream().unwrap()).collect();
    // Work the caller's streams do first, long enough (a 1 GiB memset each) that calls not
    // ordered after it would read the poisoned inputs.
    let delay: Vec<DevBuf> = (0..n).map(|_| DevBuf::new(ctx, 1 << 30).unwrap()).collect();
    let res_x: Vec<DevTensor> = (0..n)
        .map(|_| DevTensor::empty(ctx, DType::Bf16, t, h).unwrap())
        .collect();
    let res_w: Vec<DevTensor> = (0..n)
        .map(|_| DevTensor::empty(ctx, DType::F32, t, k).unwrap())
        .collect();
    for (round, by_events) in [true, false, true, false].into_iter().enumerate() {
        // Events: exact dispatch (the host waits for num_recv); caller streams: worst-token.
        let worst = if by_events { 0 } else { n * t };
        for (i, d) in dins.iter().enumerate() {
            for b in [d.x.buffer(), d.idx.buffer(), d.w.buffer()] {
                b.memset_async(&caller[i], 0xff, 0, b.len()).unwrap();
            }
            for b in [res_x[i].buffer(), res_w[i].buffer()] {
                b.memset_async(&caller[i], 0xff, 0, b.len()).unwrap();
            }
            caller[i].synchronize().unwrap();
        }
        g.fill_arenas_for_test(0xa5).unwrap();
        // The caller's producer: the delay, then the inputs' values.
        for i in 0..n {
            delay[i]
                .memset_async(&caller[i], round as u8, 0, delay[i].len())
                .unwrap();
            copy_on(&caller[i], &staging[i].x, &dins[i].x);
            copy_on(&caller[i], &staging[i].idx, &dins[i].idx);
            copy_on(&caller[i], &staging[i].w, &dins[i].w);
        }
        let ready: Vec<CudaEvent> = caller
            .iter()
            .map(|s| s.record_event(None).unwrap())
            .collect();
        let ready: Vec<&CudaEvent> = ready.iter().collect();
        let order = if by_events {
            CallStreams {
                after: &ready,
                streams: None,
                record: true,
            }
        } else {
            CallStreams {
                after: &[],
                streams: Some(&caller),
                record: false,
            }
        };
        let (outs, done) = g
            .with_streams(&order, |g| calls(g, &c, &dins, &dbias, &[], worst))
            .unwrap();
        assert_eq!(done.len(), if by_events { n } else { 0 });
        // The caller's consumer: copies the combined rows out after the calls.
        for i in 0..n {
            if by_events {
                caller[i].wait(&done[i]).unwrap();
            }
            copy_on(&caller[i], &outs.comb[i].combined_x, &res_x[i]);
            copy_on(
                &caller[i],
                outs.comb[i].combined_topk_weights.as_ref().unwrap(),
                &res_w[i],
            );
        }
        for s in &caller {
            s.synchronize().unwrap();
        }
        let layouts = host_layouts(&c, &inputs);
        let plan = plan_with_worst(&c, &inputs, &layouts, worst);
        let xs: Vec<Tensor2<bf16>> = plan.iter().map(|p| bf16_rows(&p.recv_x)).collect();
        let want = plan_combine(&plan, &xs, &biases);
        for i in 0..n {
            let got = CombineOutput {
                combined_x: res_x[i].download().unwrap(),
                combined_topk_weights: Some(res_w[i].download().unwrap()),
            };
            assert_bits_eq(
                &got,
                &want[i],
                &format!(
                    "round {round} (events {by_events}): combine of rank {i} read on the caller's stream"
                ),
            );
        }
        g.sync().unwrap();
        check(
            &c,
            &inputs,
            &outs,
            worst,
            &biases,
            &[],
            &format!("round {round} (events {by_events})"),
        );
    }
    // One stream for two co-resident ranks would deadlock them: refused.
    let twice = [caller[0].clone(), caller[0].clone()];
    let err = g
        .with_streams(
            &CallStreams {
                streams: Some(&twice),
                ..CallStreams::default()
            },
            |_| Ok(()),
        )
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
    // The group's own streams are ordered after the caller's: eager calls on them.
    run_case(&mut g, &c);
    assert_epochs(&mut g, "after the ordered calls");
}
