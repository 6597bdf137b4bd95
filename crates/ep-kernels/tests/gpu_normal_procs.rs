//! Normal mode with ranks in separate processes (the deployment shape, docs/protocol.md §2.7):
//! the test spawns itself as two rank processes (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, a loopback
//! rendezvous with a session token); each maps the other's arena through CUDA IPC
//! ([`NormalGroup::new_process`] / [`NormalGroup::with_peers`]) and runs layout, dispatch (BF16
//! and FP8, top-k, masked entries, wide-range values), cached dispatch and combine, each compared
//! with the plan bit for bit exactly as `gpu_normal` does (the shared helpers of
//! `tests/common`), DeepEP's round trip (`calc_diff < 5e-6`), a rank that never arrives and the
//! collective reset, over a few rounds.
//!
//! The processes use GPU `LOCAL_RANK % (number of GPUs)`: on one GPU both share it. Without MPS
//! their kernels only take turns (a cross-process flag round trip takes ~4.5 ms, GPU.md), so the
//! shapes are small and the device timeouts generous. Under MPS they overlap; start it around
//! the run (environment only):
//!
//! ```text
//! export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
//! mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d
//! trap 'echo quit | nvidia-cuda-mps-control' EXIT
//! bash scripts/gpu-run.sh gpu_normal_procs   # or the test binary with --include-ignored
//! ```
//!
//! These tests need a GPU: they are `#[ignore]`d, and `scripts/gpu-run.sh` runs them with
//! `--include-ignored`. Without a GPU they fail (they never pass unrun).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::procs::{my_device, spawn_or_run};
use common::{Case, inputs_of, rank_inputs, round_trip_calc_diff, run_cached, run_case};
use ep_core::buffer::NormalDispatchArgs;
use ep_core::config::{BufferConfig, Config};
use ep_core::plan::intranode::intranode_dispatch_cached;
use ep_core::routing::Activations;
use ep_core::workload::Routing;
use ep_core::{Buffer, Executor, Tensor2};
use ep_kernels::Error;
use ep_kernels::exchange::TcpExchange;
use ep_kernels::gpu::{
    DevTensor, Device, Gpu, GpuCombineIn, GpuDispatchArgs, GpuInputs, GpuRows, NormalGroup,
};
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Device waits: generous, the processes take turns on one GPU without MPS.
const DEVICE_TIMEOUT: Duration = Duration::from_secs(20);

/// The process-shaped group of `case` on `dev` (one rank per process).
fn process_group(dev: &Arc<Device>, case: &Case) -> ep_kernels::Result<NormalGroup> {
    let ex = TcpExchange::from_env()?;
    let mut g = NormalGroup::new_process(dev.clone(), case.sms, case.arena_bytes(), Box::new(ex))?;
    g.set_timeout(DEVICE_TIMEOUT);
    Ok(g)
}

fn small_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (i, &(tokens, topk, experts, fp8)) in [
        (256, 8, 32, false),
        (128, 4, 16, true),
        (64, 2, 16, false),
        (200, 6, 32, true),
    ]
    .iter()
    .enumerate()
    {
        let mut c = Case::new(2, tokens, 2048, topk, experts);
        c.fp8 = fp8;
        c.sms = [8, 4, 2, 6][i];
        c.routing = match i % 3 {
            0 => Routing::Uniform,
            1 => Routing::Zipf { exponent: 1.2 },
            _ => Routing::Hot { fraction: 0.6 },
        };
        c.alignment = [1, 4, 1, 8][i];
        c.biases = i % 3;
        c.worst = i == 3;
        cases.push(c);
    }
    cases
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn one_rank_per_process_equals_the_plan() {
    spawn_or_run("one_rank_per_process_equals_the_plan", 2, |rank| {
        let dev = my_device();
        for (i, base) in small_cases().iter().enumerate() {
            let mut g = process_group(&dev, base)?;
            assert_eq!(g.local_ranks(), vec![rank as usize]);
            for round in 0..3u64 {
                let mut c = base.clone();
                c.seed = 1000 * i as u64 + round;
                c.masked = (c.tokens / 7 + 13 * round as usize) % c.tokens;
                let d = run_case(&mut g, &c);
                eprintln!("ok round {round}: {c:?} digest {}", d[0]);
            }
            if !base.fp8 {
                let diff = round_trip_calc_diff(&mut g, base);
                eprintln!("round trip calc_diff {diff:e}");
            }
            if !base.fp8 && !base.worst {
                run_cached(&mut g, base, 2);
            }
            g.close()?;
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn an_absent_process_rank_times_out_and_the_collective_reset_recovers() {
    spawn_or_run(
        "an_absent_process_rank_times_out_and_the_collective_reset_recovers",
        2,
        |rank| {
            let c = Case::new(2, 96, 2048, 4, 16);
            let mut g = process_group(&my_device(), &c)?;
            run_case(&mut g, &c);
            g.set_timeout(Duration::from_secs(2));
            let inputs = inputs_of(&c);
            let dins = common::upload(g.device(), &inputs, &[rank as usize]);
            let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
            let glay = g.layout(&idx, c.experts)?;
            g.sync()?;
            // Rank 1's process launches nothing: rank 0's kernels wait for it and time out
            // naming it; rank 1's host wait for its own count times out.
            g.set_absent_rank_for_test((rank == 1).then_some(0));
            let err = g
                .dispatch(
                    &rank_inputs(&dins, true),
                    &glay,
                    c.experts,
                    &GpuDispatchArgs::default(),
                )
                .and_then(|_| g.sync())
                .unwrap_err();
            eprintln!("planted: {err}");
            match (rank, &err) {
                (0, Error::DeviceWaitTimeout { writer, .. }) => {
                    assert_eq!(*writer, Some(1), "{err}")
                }
                (1, Error::HostWaitTimeout { rank: 1, .. }) => {}
                _ => panic!("rank {rank}: unexpected {err}"),
            }
            assert!(matches!(g.sync(), Err(Error::Poisoned { .. })));
            g.set_absent_rank_for_test(None);
            g.reset()?;
            g.set_timeout(DEVICE_TIMEOUT);
            for seed in 0..2 {
                let mut c2 = c.clone();
                c2.seed = 700 + seed;
                run_case(&mut g, &c2);
            }
            g.close()
        },
    );
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn a_process_with_two_ranks_and_one_with_one_equal_the_plan() {
    // World 3: process 0 holds ranks 0 and 2 (co-resident), process 1 holds rank 1.
    spawn_or_run(
        "a_process_with_two_ranks_and_one_with_one_equal_the_plan",
        2,
        |process| {
            let mut c = Case::new(3, 160, 2048, 6, 24);
            c.sms = 6;
            let local: &[usize] = if process == 0 { &[0, 2] } else { &[1] };
            let ex = TcpExchange::from_env()?;
            let mut g = NormalGroup::with_peers(
                my_device(),
                3,
                local,
                c.sms,
                c.arena_bytes(),
                Box::new(ex),
            )?;
            g.set_timeout(DEVICE_TIMEOUT);
            assert_eq!((g.num_ranks(), g.local_ranks()), (3, local.to_vec()));
            for (round, fp8) in [(0u64, false), (1, true), (2, false)] {
                c.seed = 300 + round;
                c.fp8 = fp8;
                run_case(&mut g, &c);
            }
            g.close()
        },
    );
}

/// One round of `c` through `Buffer<Gpu>` in the process of world rank `rank` (its one local
/// rank's inputs and outputs): layout, dispatch and a combine of random expert outputs with
/// biases, each compared with the plan's for that rank bit for bit, and the rank's digest.
fn buffer_round(buf: &mut Buffer<Gpu>, c: &Case, rank: usize) {
    let dev = buf.transport().device().clone();
    let inputs = inputs_of(c);
    let (layouts, plan, worst) = common::plan_of(c, &inputs);
    buf.transport_mut()
        .normal_mut()
        .expect("arena")
        .fill_arenas_for_test(0xa5)
        .unwrap();
    let dins = common::upload(&dev, &inputs, &[rank]);
    let gin = GpuInputs {
        x: dins[0].x.clone(),
        x_scales: dins[0].scales.clone(),
        topk_idx: Some(dins[0].idx.clone()),
        topk_weights: Some(dins[0].w.clone()),
    };
    let glay = buf.layout_one(&dins[0].idx, c.experts).unwrap();
    buf.sync().unwrap();
    assert_eq!(glay.download().unwrap(), layouts[rank], "layout, {c:?}");
    let args = NormalDispatchArgs {
        config: Config::new(c.sms, 8, 256, 6, 128).unwrap(),
        expert_alignment: c.alignment,
        num_worst_tokens: worst,
        with_topk: true,
    };
    let out = buf.dispatch_one(&gin, &glay, c.experts, &args).unwrap();
    buf.sync().unwrap();
    let mut host = common::host_dispatch(&out);
    if c.worst {
        host.handle.num_recv_tokens = plan[rank].handle.num_recv_tokens;
    }
    assert_eq!(host, plan[rank], "dispatch of rank {rank}, {c:?}");
    // Every rank's expert outputs and biases drawn alike in every process.
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed ^ 0xb0ff);
    let (ys, biases) = common::expert_outputs(&mut rng, c, &plan);
    let handles: Vec<_> = plan.iter().map(|p| p.handle.clone()).collect();
    let want = common::plan_combine(&plan, &ys, &biases);
    let ctx = dev.context();
    let dy = DevTensor::upload(ctx, &ys[rank]).unwrap();
    let dbias: Vec<DevTensor> = biases[rank]
        .iter()
        .map(|b| DevTensor::upload(ctx, b).unwrap())
        .collect();
    let got = buf
        .combine_one(
            &out.handle,
            &GpuCombineIn {
                x: &dy,
                topk_weights: out.recv_topk_weights.as_ref(),
                bias: &dbias,
            },
        )
        .unwrap();
    buf.sync().unwrap();
    let got = got.download().unwrap();
    common::assert_bits_eq(&got, &want[rank], &format!("combine of rank {rank}, {c:?}"));
    let d_gpu = ep_core::digest::normal_rank(rank, &host, Some(&got)).unwrap();
    let d_plan = ep_core::digest::normal_rank(rank, &plan[rank], Some(&want[rank])).unwrap();
    assert_eq!(d_gpu, d_plan, "digest of rank {rank}, {c:?}");
    // Cached dispatch of fresh BF16 rows along the handle (exact sizing only).
    if !c.worst && !c.fp8 {
        let fresh: Vec<Tensor2<bf16>> = (0..c.ranks)
            .map(|_| common::wide_tensor(&mut rng, c.tokens, c.hidden))
            .collect();
        let xs: Vec<Activations> = fresh.iter().cloned().map(Activations::Bf16).collect();
        let refs: Vec<&Activations> = xs.iter().collect();
        let want_x = intranode_dispatch_cached(&refs, &handles, rank).unwrap();
        let rows = GpuRows {
            x: DevTensor::upload(ctx, &fresh[rank]).unwrap(),
            x_scales: None,
        };
        let got_x = buf.dispatch_cached_one(&rows, &out.handle).unwrap();
        buf.sync().unwrap();
        let Activations::Bf16(want_x) = want_x else {
            unreachable!()
        };
        assert_eq!(got_x.x.download::<bf16>().unwrap(), want_x, "cached, {c:?}");
    }
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn a_buffer_per_process_equals_the_plan() {
    // The deployment shape through the public API: each process's Buffer<Gpu> holds its one
    // rank (one-element slices in, one-element Vecs out).
    spawn_or_run("a_buffer_per_process_equals_the_plan", 2, |rank| {
        let dev = my_device();
        for (i, base) in small_cases().iter().enumerate() {
            let ex = TcpExchange::from_env()?;
            let mut exec = Gpu::process(dev.clone(), base.sms, Box::new(ex));
            exec.set_timeout(DEVICE_TIMEOUT);
            let mut cfg = BufferConfig::new(base.ranks);
            cfg.num_nvl_bytes = base.arena_bytes();
            let mut buf = Buffer::new(exec, cfg).expect("Buffer<Gpu> of one rank");
            assert_eq!(buf.transport().local_ranks(), vec![rank as usize]);
            for round in 0..2u64 {
                let mut c = base.clone();
                c.seed = 5000 + 100 * i as u64 + round;
                buffer_round(&mut buf, &c, rank as usize);
                eprintln!("ok buffer round {round}: {c:?}");
            }
            buf.sync().expect("sync");
            buf.transport_mut().normal_mut().expect("arena").barrier()?;
        }
        Ok(())
    });
}
