//! Normal mode on the GPU against the plan (ep-core's reference of the protocol, itself
//! checked against the oracle), on co-resident ranks of one GPU: layout, dispatch (BF16, FP8,
//! worst-token), cached dispatch, combine (in place and from the combine rows, weights, biases)
//! bit for bit, the canonical digest, many back-to-back rounds, a planted absent rank, bad
//! inputs and a layout that disagrees with its membership. Arenas are poisoned before each
//! call; activations span a wide range of binades so that a combine adding in another order
//! would not match.
//!
//! These tests need a GPU: they are `#[ignore]`d, and `scripts/gpu-run.sh` runs them with
//! `--include-ignored` on the GPU machine. Without a GPU they fail (they never pass unrun).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    Case, device_at, inputs_of, rank_inputs, run_cached, run_cached_with, run_case, run_case_with,
    upload,
};
use ep_core::workload::Routing;
use ep_kernels::Error;
use ep_kernels::gpu::{DType, DevTensor, Device, GpuDispatchArgs, NormalGroup};

fn device() -> Arc<Device> {
    device_at(0)
}

fn group(dev: &Arc<Device>, case: &Case) -> NormalGroup {
    let mut g =
        NormalGroup::new(dev.clone(), case.ranks, case.sms, case.arena_bytes()).expect("group");
    g.set_timeout(Duration::from_secs(5));
    g
}

/// Every rank of `case`, in order (co-resident: all are local).
fn all(case: &Case) -> Vec<usize> {
    (0..case.ranks).collect()
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
        // 2H = 2000 bytes, not a whole number of the combine's 1 KiB passes: the checked gather.
        (2, 1000, 4, false),
    ]
    .iter()
    .enumerate()
    {
        let mut c = Case::new(r, 300 + 37 * i, hidden, k, 32 * r);
        c.fp8 = fp8;
        c.seed = 100 + i as u64;
        c.sms = [8, 12, 16, 6, 16, 10, 4, 2, 4][i];
        c.routing = match i % 3 {
            0 => Routing::Uniform,
            1 => Routing::Zipf { exponent: 1.2 },
            _ => Routing::Hot { fraction: 0.6 },
        };
        c.alignment = [1, 4, 1, 16, 1, 1, 8, 1, 1][i];
        c.biases = i % 3;
        c.worst = i % 4 == 3;
        cases.push(c);
    }
    for c in &cases {
        let mut g = group(&dev, c);
        let d = run_case(&mut g, c);
        eprintln!("ok: {c:?} digest of rank 0 {}", d[0]);
    }
}

/// The layout kernel's other paths: more experts than its shared histogram holds (global
/// atomics), odd top-k (no 16-byte loads), 32 columns (16 lanes a token), and ids at an address
/// that is 8- but not 16-byte aligned; each compared with the host's layout.
#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn layouts_equal_the_plan_on_wide_experts_odd_top_k_and_misaligned_ids() {
    use ep_core::plan::layout::get_dispatch_layout_for_rank;
    let dev = device();
    for (i, &(r, tokens, k, experts, misaligned)) in [
        (8, 777, 5, 8 * 640, false),
        (2, 1000, 8, 256, true),
        (2, 513, 32, 64, false),
        (4, 300, 7, 4 * 1024, true),
    ]
    .iter()
    .enumerate()
    {
        let mut c = Case::new(r, tokens, 256, k, experts);
        c.seed = 900 + i as u64;
        c.routing = if i % 2 == 0 {
            Routing::Zipf { exponent: 1.1 }
        } else {
            Routing::Uniform
        };
        let mut g = group(&dev, &c);
        let inputs = inputs_of(&c);
        let ids: Vec<DevTensor> = inputs
            .iter()
            .map(|inp| {
                let t = &inp.topk_idx;
                let off = if misaligned { 8 } else { 0 };
                let d =
                    DevTensor::empty(dev.context(), DType::U8, 1, off + 8 * t.rows() * t.cols())
                        .unwrap();
                // The padding before the ids poisoned (an id read from it would be out of range).
                let mut bytes = vec![0xa5u8; off];
                bytes.extend(t.data().iter().flat_map(|e| e.to_le_bytes()));
                d.buffer().write(0, &bytes).unwrap();
                DevTensor::strided(
                    d.buffer().clone(),
                    off as u64,
                    DType::I64,
                    t.rows(),
                    t.cols(),
                    8 * t.cols() as u64,
                )
                .unwrap()
            })
            .collect();
        let idx: Vec<&DevTensor> = ids.iter().collect();
        let glay = g.layout(&idx, experts).unwrap();
        g.sync().unwrap();
        for (s, l) in glay.iter().enumerate() {
            let want = get_dispatch_layout_for_rank(s, &inputs[s].topk_idx, experts, r).unwrap();
            assert_eq!(
                common::host_layout(l),
                want,
                "layout of rank {s}, case {i}: {c:?}"
            );
        }
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
    run_cached(&mut g, &c, 3);
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
    // Per round: a dispatch and four combines (run_case).
    assert_eq!(g.last_call(), 5000);
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
    let dins = upload(&dev, &inputs, &all(&c));
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
            // The first-order wait of the dispatch: the absent rank's counted head words.
            assert!(word.starts_with("head["), "{err}");
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
    let dins = upload(&dev, &inputs, &all(&c));
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

/// A layout whose `num_tokens_per_rank` disagrees with its `is_token_in_rank` (docs/protocol.md
/// §2.3): the notify block's scan sees it (`EP_ERR_LAYOUT`), the call fails with a typed error
/// naming both ranks and both counts, the group is poisoned until `reset`, and after the reset
/// calls equal the plan again.
#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn a_layout_that_disagrees_with_its_membership_poisons_until_reset() {
    let dev = device();
    let c = Case::new(2, 256, 1024, 4, 16);
    let mut g = group(&dev, &c);
    g.set_timeout(Duration::from_millis(500));
    let inputs = inputs_of(&c);
    let dins = upload(&dev, &inputs, &all(&c));
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let mut glay = g.layout(&idx, c.experts).unwrap();
    g.sync().unwrap();
    let mut n: ep_core::tensor::Tensor2<i32> = glay[1].num_tokens_per_rank.download().unwrap();
    let counted = n.get(0, 0);
    assert!(counted > 0, "rank 1 sends to rank 0");
    n.set(0, 0, counted - 1);
    glay[1].num_tokens_per_rank = DevTensor::upload(dev.context(), &n).unwrap();
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
        Error::DeviceLayoutMismatch {
            rank,
            dest,
            given,
            counted: seen,
        } => {
            assert_eq!((*rank, *dest), (1, 0), "{err}");
            assert_eq!(
                (*given, *seen),
                (i64::from(counted) - 1, i64::from(counted)),
                "{err}"
            );
        }
        other => panic!("expected a layout mismatch, got {other}"),
    }
    eprintln!("planted: {err}");
    assert!(
        matches!(g.sync(), Err(Error::Poisoned { .. })),
        "poisoned until reset"
    );
    g.reset().unwrap();
    g.set_timeout(Duration::from_secs(5));
    run_case(&mut g, &c);
}

/// Protocol traces (docs/protocol.md §3.13): every traced dispatch, cached dispatch and combine
/// (from the rows and in place) of co-resident ranks passes ep-sim's memory-model checker under
/// several schedules, with outputs still equal to the plan; a dispatch whose second CTAs skip
/// their fence before the cluster barrier (the planted switch) is caught.
#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn traces_pass_the_checker_and_a_planted_missing_fence_is_caught() {
    use ep_sim::device_trace::{Arenas, CheckConfig, TraceError, check_with};
    let dev = device();
    let mut cases = Vec::new();
    let mut c = Case::new(2, 120, 1024, 4, 16);
    c.sms = 8;
    c.biases = 1;
    cases.push(c.clone());
    c = Case::new(4, 90, 2048, 6, 32);
    c.sms = 4;
    c.fp8 = true;
    c.worst = true;
    c.seed = 77;
    cases.push(c);
    let judged = |g: &mut NormalGroup, ranks: usize, what: &str| {
        let (signals_bytes, data_bytes) = g.trace_arena_bytes();
        let events = g
            .trace()
            .unwrap_or_else(|e| panic!("decode the {what} trace: {e}"));
        assert!(
            events.len() >= ranks,
            "{what}: {} agents recorded",
            events.len()
        );
        let arenas = Arenas {
            signals_bytes,
            data_bytes,
        };
        // Co-resident ranks fence and signal at GPU scope (EP_FLAG_SAME_GPU): the checker
        // judges them as ranks of one GPU.
        for seed in 0..4 {
            let same_gpu = true;
            check_with(ranks, arenas, &events, &CheckConfig { seed, same_gpu })
                .unwrap_or_else(|e| panic!("{what} trace (seed {seed}, same GPU {same_gpu}): {e}"));
        }
        eprintln!(
            "{what}: {} agents, {} events: pass",
            events.len(),
            events.iter().map(|a| a.events.len()).sum::<usize>()
        );
    };
    for c in &cases {
        let mut g = group(&dev, c);
        g.set_trace(Some(1 << 14)).unwrap();
        run_case_with(&mut g, c, &mut |g, what| judged(g, c.ranks, what));
    }
    let c = Case::new(2, 150, 2048, 8, 16);
    let mut g = group(&dev, &c);
    g.set_trace(Some(1 << 14)).unwrap();
    run_cached_with(&mut g, &c, 2, &mut |g, what| judged(g, c.ranks, what));

    // The planted missing fence: the checker must report an unpublished store or a race.
    let mut c = Case::new(2, 120, 1024, 4, 16);
    c.sms = 8;
    let mut g = group(&dev, &c);
    g.set_trace(Some(1 << 14)).unwrap();
    g.plant_missing_fence_for_test(true).unwrap();
    let mut caught = None;
    run_case_with(&mut g, &c, &mut |g, what| {
        if what != "dispatch" {
            return;
        }
        let (signals_bytes, data_bytes) = g.trace_arena_bytes();
        let events = g.trace().expect("decode the planted trace");
        let arenas = Arenas {
            signals_bytes,
            data_bytes,
        };
        for seed in 0..4 {
            if let Err(e) = check_with(
                c.ranks,
                arenas,
                &events,
                &CheckConfig {
                    seed,
                    same_gpu: true,
                },
            ) {
                caught = Some(e);
                break;
            }
        }
    });
    let e = caught.expect("the planted missing fence was not caught");
    assert!(
        matches!(&e, TraceError::Violation { .. }),
        "expected a memory-model violation, got {e}"
    );
    eprintln!("planted missing fence caught: {e}");
    assert!(g.plant_missing_fence_for_test(false).is_ok());
    g.set_trace(None).unwrap();
    assert!(
        g.plant_missing_fence_for_test(true).is_err(),
        "the switch needs the traced kernels"
    );
}
