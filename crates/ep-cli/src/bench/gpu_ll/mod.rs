//! `ep bench --backend gpu --mode low-latency`: low-latency mode on `--ranks` co-resident ranks of
//! one GPU (`ep_kernels::gpu::LlGroup`), `--num-sms` blocks per rank, kernel variant `--variant`:
//! (a) peers by pointer, or (b) every peer through NVSHMEM's device API — then the NVSHMEM
//! environment plan (ep-core's, DeepEP's variables) is set in this process before NVSHMEM starts
//! with one PE holding every rank, and the plan, NVSHMEM's init report and the group's transport
//! report are printed before anything runs.
//!
//! Verification first, through ep-core's `Buffer` over the GPU executor (`Buffer<Gpu>`, the API
//! a user calls; the group is its low-latency kernels; `--logfmt` is its combine option
//! `LlCombineOptions::use_logfmt`): one dispatch and combine of the workload (outputs poisoned
//! before) against the plan (`plan::low_latency`, itself checked against the oracle) — counts
//! and layout ranges exact, every received row canonically, combine bit for bit with ep-rs's
//! reduction order (LogFMT-10 partials with `--logfmt`), and the canonical digest equal to the
//! plan's, so to `--backend sim`'s for the same flags — before anything is timed.
//!
//! Timing: CUDA events on every rank's stream with all ranks released together behind a gate
//! (`LlGroup::timed`), the slowest rank's time per call, median over `max(--gpu-iters, 1000)`
//! calls after warm-up, un-graphed (each call is its kernel launches). Figures: dispatch (send
//! and receive parts in one launch), combine likewise, dispatch + combine, and the hook halves
//! (send part alone, receive part alone, each timed on its own). The floor measured in the same
//! run, as BASELINES.md defines it: an empty one-kernel graph replayed on every rank's stream
//! (timed like the calls), one flag round trip between two resident kernels, and the phase's
//! bytes (DeepEP's count) through the copy engine on every rank at once; each phase's ratio to
//! it, eager and (`--graph`) replayed. Beside it, as a diagnostic, a **steady-rate floor**: the
//! same with the phase's bytes at the copy engine's steady rate (the slope between a 32 and a 64
//! MiB copy on every rank at once) instead of a copy of those bytes timed on its own (which
//! carries its own start, but finds part of its few MB in L2); and the ratios to it. The floor
//! is the lower of the two on an H100, so the targets stay judged against it. Printed beside them: the gate's
//! empty call and a dispatch of zero tokens (what the protocol itself costs with nothing to
//! move).
//!
//! `--graph`: dispatch, combine and dispatch + combine are then each captured as CUDA graphs
//! (`LlGroup::capture`), one replay of each is verified against the plan like the eager call
//! (outputs poisoned first), and `max(--gpu-iters, 1000)` replays of each are timed the same way
//! (`LlGroup::timed` around `LlGraph::replay`). A dispatch graph and a combine graph replay in
//! alternation (each one operation: the halves stay in step); the untimed one of each pair runs
//! outside the gate.
//!
//! Bytes: ep-rs sends one message per (token, destination rank); DeepEP one per (token, expert).
//! Both per-token byte counts are printed, with DeepEP's bandwidth convention (spec §6.2).
//!
//! This file runs the bench (`run`); beside it: `verify` (against the plan, and the reference
//! digest), `graphs` (captured phases replayed and timed), `nvshmem` (variant (b)'s bring-up and
//! the doctor's reasons), `stamps` (the dispatch's steps from the phase stamps).

use std::time::Instant;

use ep_core::plan::low_latency::LlParams;

use ep_core::Buffer;
use ep_core::buffer::LlCombineOptions;
use ep_core::config::BufferConfig;
use ep_core::routing::Activations;
use ep_core::tensor::Tensor2;
use ep_kernels::gpu::floor::{EmptyGraphs, flag_round_trip};
use ep_kernels::gpu::mem::DevBuf;
use ep_kernels::gpu::{
    DType, DevTensor, Device, Gpu, GpuExpertOut, GpuInputs, LlCombineArgs, LlCombineInput,
    LlConfig, LlDispatchArgs, LlGpuDispatch, LlGroup, LlPoison, LlRankInputs, LlVariant,
};

use super::error::BenchError;
use super::{BenchArgs, LlVariantArg};
use crate::bench::gpu::{Figure, core_err, figure, gpu_err, samples};
use crate::bench::report::median;
use crate::workload::{self, Defaults};

mod graphs;
mod nvshmem;
mod stamps;
mod verify;

use graphs::time_graphs;
use nvshmem::{env_plan, ibgda_diagnosis, join_nvshmem, start_nvshmem};
use stamps::{dispatch_detail, rank_spread};
use verify::{Reference, Verify, reference, verify};

/// Calls timed per figure at least (issue: ≥ 1000 replays).
const MIN_ITERS: usize = 1000;

/// Bytes per rank of the larger steady copy (the smaller is half): large enough that a copy's
/// start is a small part of it, small enough for eight ranks' buffers.
const STEADY_BYTES: usize = 64 << 20;
/// Timed calls of each steady copy.
const STEADY_ITERS: usize = 50;

/// The copy engine's steady rate (bytes per second per rank) from two copies of `small` and
/// `large` bytes per rank that took `t_small` and `t_large` seconds: the slope, so that what
/// both pay once (the copy's start, the gate's release) cancels. `None` when the larger was not
/// slower (noise): no rate to report.
fn steady_rate(small: usize, t_small: f64, large: usize, t_large: f64) -> Option<f64> {
    let (db, dt) = (large as f64 - small as f64, t_large - t_small);
    (db > 0.0 && dt > 0.0 && dt.is_finite()).then(|| db / dt)
}

struct DevSet {
    x: Vec<DevTensor>,
    idx: Vec<DevTensor>,
    w: Vec<DevTensor>,
}

impl DevSet {
    fn inputs(&self) -> Vec<LlRankInputs<'_>> {
        (0..self.x.len())
            .map(|r| LlRankInputs {
                x: &self.x[r],
                topk_idx: &self.idx[r],
                topk_weights: &self.w[r],
            })
            .collect()
    }
}

#[derive(Clone, Default, serde::Serialize)]
struct LlReport {
    /// The combine's partials are LogFMT-10 (`--logfmt`).
    logfmt: bool,
    /// `a` or `b`.
    variant: &'static str,
    /// How the ranks reach each other (`LlGroup::transport_report`).
    transport: String,
    ranks: usize,
    sms_per_rank: usize,
    tokens_per_rank: usize,
    hidden: usize,
    topk: usize,
    experts: usize,
    fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
    iters: usize,
    dispatch: Figure,
    combine: Figure,
    dispatch_combine: Figure,
    dispatch_send: Figure,
    dispatch_recv: Figure,
    combine_send: Figure,
    combine_recv: Figure,
    empty_launch_us: f64,
    /// A one-kernel empty CUDA graph replayed on every rank's stream, timed like the calls.
    graph_launch_us: f64,
    /// One flag round trip between two resident kernels (release store, acquire loads; system
    /// scope, the protocol's signals').
    flag_round_trip_us: f64,
    /// The same at GPU scope (diagnostic).
    flag_round_trip_gpu_scope_us: f64,
    /// A dispatch of zero tokens: what the protocol costs with nothing to move (diagnostic,
    /// not part of the floor).
    zero_token_dispatch_us: f64,
    /// The dispatch's / combine's bytes (DeepEP's count, the GB/s column's) through the copy
    /// engine, every rank at once.
    copy_dispatch_bytes_us: f64,
    copy_combine_bytes_us: f64,
    /// The same-run floor of each phase (BASELINES.md): graph launch + flag round trip + the
    /// phase's bytes at the copy ceiling.
    floor_dispatch_us: f64,
    floor_combine_us: f64,
    /// The copy engine's steady rate per rank, every rank copying at once (GB/s copied): the
    /// slope between two large copies, so without any copy's start.
    steady_copy_gb_per_s: Option<f64>,
    /// The floor with the phase's bytes at that steady rate: graph launch + flag round trip +
    /// bytes / rate (a diagnostic beside `floor_*_us`, whose copy, timed as a stream operation
    /// of its own, carries that operation's start but also finds part of its few MB in L2; on
    /// an H100 this one came out the higher of the two, BENCHMARKS.md 2026-12-07 20:34).
    steady_floor_dispatch_us: Option<f64>,
    steady_floor_combine_us: Option<f64>,
    /// One call, median over blocks: routing (send start to known), send rows, (gap), wait for
    /// the sources, receive rows; then the whole span over all blocks and ranks (us).
    dispatch_phases_us: Vec<f64>,
    /// Combine: send rows, gap, wait, reduce; whole span.
    combine_phases_us: Vec<f64>,
    /// Where one plain dispatch's time goes inside its steps ([`dispatch_detail`]).
    dispatch_detail: String,
    /// The zero-token dispatch's phases, as `dispatch_phases_us`.
    zero_token_phases_us: Vec<f64>,
    /// Per rank, the blocks' starts and receive ends ([`rank_spread`]) of the stamped combine
    /// and zero-token dispatch (the dispatch's are in `dispatch_detail`).
    combine_ranks: String,
    zero_token_ranks: String,
    bytes_per_token_ep_rs: f64,
    bytes_per_token_deepep: f64,
    /// `--graph`: the same calls replayed from CUDA graphs.
    graph: Option<GraphReport>,
}

/// Replays of captured CUDA graphs (`--graph`), timed like the un-graphed calls.
#[derive(Clone, Copy, Default, serde::Serialize)]
struct GraphReport {
    dispatch: Figure,
    combine: Figure,
    dispatch_combine: Figure,
}

/// Runs the low-latency GPU bench (module docs); exit code 0 when verified.
pub(super) fn run(args: &BenchArgs) -> Result<i32, BenchError> {
    let started = Instant::now();
    let defaults = Defaults {
        hidden: 7168,
        low_latency_fp8: true,
    };
    let w = workload::load(&args.workload, &defaults)?;
    let r = w.inputs.len();
    let e = w.num_experts;
    let fp8 = w.fp8;
    let hidden = w.inputs[0].x.hidden();
    let k = w.inputs[0].num_topk();
    let n = w.inputs.iter().map(|i| i.num_tokens()).max().unwrap_or(0);
    let sms = args.workload.num_sms;
    // One rank per process (`--procs N`): the launcher starts the ranks with the NVSHMEM
    // environment plan in their environment; each rank starts NVSHMEM with one PE per rank.
    let me = match args.procs {
        Some(np) => {
            if np != r || args.workload.dump.is_some() {
                return Err(BenchError::Usage(format!(
                    "--procs {np} runs one rank per process: give --ranks {np} as well, and no --dump (each process holds only its rank's outputs)"
                )));
            }
            match super::procs::role() {
                super::procs::Role::Launcher => {
                    let plan = env_plan(r, n.max(1), hidden, e)?;
                    for p in &plan {
                        println!(
                            "env {}={} (the plan, set in each rank process)",
                            p.var, p.value
                        );
                    }
                    return super::procs::launch(np, plan);
                }
                super::procs::Role::Rank { rank, world } if world == np => Some(rank),
                super::procs::Role::Rank { world, .. } => {
                    return Err(BenchError::Usage(format!(
                        "this rank process was started for {world} ranks, --procs says {np}"
                    )));
                }
            }
        }
        None => None,
    };
    // NVSHMEM (environment plan first) before the GPU is opened for the group: one PE holding
    // every rank (variant (b), co-resident), or this rank process's PE.
    let session = match (me, args.variant) {
        (None, LlVariantArg::Pointers) => None,
        (None, LlVariantArg::Nvshmem) => Some(start_nvshmem(r, n.max(1), hidden, e)?),
        (Some(rank), _) => Some(join_nvshmem(rank, r)?),
    };
    let dev = match me {
        Some(_) => super::procs::device().map_err(gpu_err("opening this rank's GPU"))?,
        None => Device::open(0).map_err(gpu_err("opening GPU 0"))?,
    };
    let local: Vec<usize> = match me {
        Some(rank) => vec![rank],
        None => (0..r).collect(),
    };
    println!(
        "ep bench: low-latency mode (variant {}) on GPU {} ({} SMs), {}, {sms} SMs per rank, {}",
        args.variant.letter(),
        dev.ordinal(),
        dev.num_sms(),
        match me {
            Some(rank) => format!("rank {rank} of {r} in this process (figures: this rank)"),
            None => format!("{r} co-resident ranks"),
        },
        w.description
    );
    let cfg = LlConfig {
        num_ranks: r,
        num_max_dispatch_tokens_per_rank: n.max(1),
        hidden,
        num_experts: e,
        num_sms: sms,
    };
    // The verified call goes through ep-core's `Buffer` over the GPU executor (the API a user
    // calls); the timed calls then run on its low-latency group directly.
    let variant = match args.variant {
        LlVariantArg::Pointers => LlVariant::Pointers,
        LlVariantArg::Nvshmem => LlVariant::Nvshmem,
    };
    let exec = match (session, me) {
        (None, _) => Gpu::co_resident(dev.clone(), r, sms),
        (Some(s), Some(_)) => Gpu::process_over_nvshmem(dev.clone(), sms, s, variant),
        (Some(s), None) => Gpu::co_resident(dev.clone(), r, sms).with_nvshmem(s, variant),
    };
    let mut bcfg = BufferConfig::new(r);
    bcfg.low_latency_mode = true;
    bcfg.num_qps_per_rank = (e / r).max(1) as u32;
    bcfg.num_rdma_bytes =
        Buffer::<Gpu>::low_latency_size_hint(cfg.num_max_dispatch_tokens_per_rank, hidden, r, e)
            .div_ceil(128)
            * 128;
    let mut buf = Buffer::new(exec, bcfg).map_err(core_err("creating the Buffer<Gpu>"))?;
    let ctx = dev.context();
    let mut set = DevSet {
        x: Vec::new(),
        idx: Vec::new(),
        w: Vec::new(),
    };
    for inp in local.iter().map(|&s| &w.inputs[s]) {
        let Activations::Bf16(x) = &inp.x else {
            return Err(BenchError::Usage(
                "low-latency inputs are BF16 (the dispatch casts them)".into(),
            ));
        };
        set.x
            .push(DevTensor::upload(ctx, x).map_err(gpu_err("uploading x"))?);
        set.idx
            .push(DevTensor::upload(ctx, &inp.topk_idx).map_err(gpu_err("uploading topk_idx"))?);
        set.w
            .push(DevTensor::upload(ctx, &inp.topk_weights).map_err(gpu_err("uploading weights"))?);
    }
    let gpu_inputs: Vec<GpuInputs> = (0..set.x.len())
        .map(|i| GpuInputs {
            x: set.x[i].clone(),
            x_scales: None,
            topk_idx: Some(set.idx[i].clone()),
            topk_weights: Some(set.w[i].clone()),
        })
        .collect();
    let cast = w.ll_cast();
    let cargs = LlCombineArgs {
        return_recv_hook: false,
        use_logfmt: args.logfmt,
    };
    let cargs_hook = LlCombineArgs {
        return_recv_hook: true,
        ..cargs
    };
    let dargs = LlDispatchArgs {
        use_fp8: cast.use_fp8,
        round_scale: cast.round_scale,
        use_ue8m0: cast.use_ue8m0,
        ..LlDispatchArgs::default()
    };
    // The plan's outputs, with the simulator bench's expert (the identity over the received
    // rows) as the expert outputs: the canonical digest then compares with `--backend sim`'s.
    let params = cast.apply(LlParams::new(cfg.num_max_dispatch_tokens_per_rank, e));
    let Reference {
        plan,
        expert_out,
        want,
        digest: plan_digest,
    } = reference(&w.inputs, &params, args.logfmt)?;
    let (l, rows) = (e / r, r * cfg.num_max_dispatch_tokens_per_rank);
    let y_dev: Vec<DevTensor> = local
        .iter()
        .map(|&d| match &expert_out[d] {
            Some(y) => Tensor2::new(l * rows, hidden, y.data().to_vec())
                .map_err(|e| BenchError::Reference {
                    what: "expert outputs",
                    source: Box::new(e),
                })
                .and_then(|t| {
                    DevTensor::upload(ctx, &t).map_err(gpu_err("uploading expert outputs"))
                }),
            None => DevTensor::zeros(ctx, DType::Bf16, l * rows, hidden)
                .map_err(gpu_err("expert outputs")),
        })
        .collect::<Result<_, _>>()?;
    drop(expert_out);
    let y_in: Vec<LlCombineInput<'_>> = y_dev.iter().map(LlCombineInput::Tensor).collect();
    // A first dispatch makes the group (for this shape); then outputs and arenas are poisoned,
    // so that anything the kernels fail to write in the verified call shows.
    buf.low_latency_dispatch(&gpu_inputs, &params)
        .map_err(core_err("first dispatch"))?;
    buf.sync().map_err(core_err("first dispatch"))?;
    let transport = group(&mut buf)?.transport_report();
    println!("transport: {transport}");
    if transport.contains("IBGDA: requested, NVSHMEM fell back") {
        // The doctor's verdict on why, surfaced at run time (file-based checks; `ep doctor`
        // adds the live probes).
        for line in ibgda_diagnosis(std::path::Path::new("/")) {
            println!("ep doctor: {line}");
        }
    }
    group(&mut buf)?
        .poison_for_test(LlPoison::Dispatch, 0xa5)
        .map_err(gpu_err("poisoning the outputs"))?;
    let out: Vec<LlGpuDispatch> = buf
        .low_latency_dispatch(&gpu_inputs, &params)
        .map_err(core_err("dispatch"))?
        .into_iter()
        .flatten()
        .collect();
    buf.sync().map_err(core_err("dispatch"))?;
    group(&mut buf)?
        .poison_for_test(LlPoison::Combine, 0x5a)
        .map_err(gpu_err("poisoning the outputs"))?;
    let handles: Vec<_> = out.iter().map(|o| Some(o.handle.clone())).collect();
    let ys: Vec<Option<GpuExpertOut>> = y_dev
        .iter()
        .map(|y| {
            Some(GpuExpertOut {
                y: y.clone(),
                num_local_experts: l,
            })
        })
        .collect();
    let opts = LlCombineOptions::default().with_logfmt(args.logfmt);
    let combined: Vec<DevTensor> = buf
        .low_latency_combine(&handles, &ys, &gpu_inputs, opts)
        .map_err(core_err("combine"))?
        .into_iter()
        .flatten()
        .collect();
    buf.sync().map_err(core_err("first call"))?;
    let g = group(&mut buf)?;
    let v = Verify {
        cfg: &cfg,
        local: &local,
        plan: &plan,
        want: &want,
        digest: &plan_digest,
    };
    let (bad, gpu_digest) = verify(&out, &combined, &v)?;
    if !bad.is_empty() {
        for b in &bad {
            eprintln!("MISMATCH {b}");
        }
        return Ok(1);
    }
    let partials = if args.logfmt {
        " (LogFMT-10 partials, through Buffer<Gpu>'s use_logfmt)"
    } else {
        ""
    };
    if local.len() == r {
        println!(
            "verified: counts and layout ranges exact, every received row canonically, combined_x{partials} bit for bit against the plan; output digest {} (blake3, canonical format v2), equal to the plan's and so to `--backend sim`'s for the same flags (the identity expert of the simulator bench)",
            gpu_digest.total
        );
    } else {
        for &d in &local {
            println!(
                "verified rank {d}: counts and layout ranges exact, every received row canonically, combined_x{partials} bit for bit against the plan; rank digest {} (blake3, canonical format v2), equal to the plan's (`--backend sim --json`'s digest.ranks[{d}] for the same flags)",
                gpu_digest.ranks[d]
            );
        }
    }

    // Timing.
    let iters = args.gpu_iters.max(MIN_ITERS);
    let warm = 20.max(args.warmup);
    let total = warm + iters;
    let inputs = set.inputs();
    let hook = LlDispatchArgs {
        return_recv_hook: true,
        ..dargs
    };
    let mut rep = LlReport {
        logfmt: args.logfmt,
        variant: args.variant.letter(),
        transport,
        ranks: r,
        sms_per_rank: sms,
        tokens_per_rank: n,
        hidden,
        topk: k,
        experts: e,
        fp8,
        round_scale: cast.round_scale,
        use_ue8m0: cast.use_ue8m0,
        iters,
        ..LlReport::default()
    };
    let t_dispatch = samples(total, warm, |_| {
        g.timed(|g| g.dispatch(&inputs, &dargs))
            .map(|(_, t)| t)
            .map_err(gpu_err("timed dispatch"))
    })?;
    let t_combine = samples(total, warm, |_| {
        // Each timed combine combines a fresh dispatch (untimed, enqueued before the gate).
        let o = g.dispatch(&inputs, &dargs).map_err(gpu_err("dispatch"))?;
        let h: Vec<_> = o.iter().map(|o| o.handle.clone()).collect();
        let hs: Vec<_> = h.iter().collect();
        g.timed(|g| g.combine_with(&hs, &y_in, &cargs))
            .map(|(_, t)| t)
            .map_err(gpu_err("timed combine"))
    })?;
    let t_both = samples(total, warm, |_| {
        let t = g
            .timed(|g| {
                let o = g.dispatch(&inputs, &dargs)?;
                let h: Vec<_> = o.iter().map(|o| o.handle.clone()).collect();
                let hs: Vec<_> = h.iter().collect();
                g.combine_with(&hs, &y_in, &cargs)
            })
            .map_err(gpu_err("timed dispatch + combine"))?
            .1;
        Ok(t)
    })?;
    let mut ds = Vec::new();
    let mut dr = Vec::new();
    let mut cs = Vec::new();
    let mut cr = Vec::new();
    for it in 0..total {
        let (o, t1) = g
            .timed(|g| g.dispatch(&inputs, &hook))
            .map_err(gpu_err("timed dispatch send"))?;
        let (_, t2) = g
            .timed(|g| g.recv_hook())
            .map_err(gpu_err("timed dispatch recv"))?;
        let h: Vec<_> = o.iter().map(|o| o.handle.clone()).collect();
        let hs: Vec<_> = h.iter().collect();
        let (_, t3) = g
            .timed(|g| g.combine_with(&hs, &y_in, &cargs_hook))
            .map_err(gpu_err("timed combine send"))?;
        let (_, t4) = g
            .timed(|g| g.recv_hook())
            .map_err(gpu_err("timed combine recv"))?;
        if it >= warm {
            ds.push(crate::bench::gpu::slowest(&t1));
            dr.push(crate::bench::gpu::slowest(&t2));
            cs.push(crate::bench::gpu::slowest(&t3));
            cr.push(crate::bench::gpu::slowest(&t4));
        }
    }
    let t_empty = samples(total, warm, |_| {
        g.timed(|_| Ok(()))
            .map(|(_, t)| t)
            .map_err(gpu_err("timed empty gate"))
    })?;
    // The protocol's floor: a dispatch of zero tokens (the launch, and one signal from every
    // rank to every rank awaited by every rank).
    let empty = DevSet {
        x: (0..local.len())
            .map(|_| DevTensor::zeros(ctx, DType::Bf16, 0, hidden))
            .collect::<Result<_, _>>()
            .map_err(gpu_err("empty inputs"))?,
        idx: (0..local.len())
            .map(|_| DevTensor::zeros(ctx, DType::I64, 0, k))
            .collect::<Result<_, _>>()
            .map_err(gpu_err("empty inputs"))?,
        w: (0..local.len())
            .map(|_| DevTensor::zeros(ctx, DType::F32, 0, k))
            .collect::<Result<_, _>>()
            .map_err(gpu_err("empty inputs"))?,
    };
    let empty_inputs = empty.inputs();
    let t_signal = samples(total, warm, |_| {
        g.timed(|g| g.dispatch(&empty_inputs, &dargs))
            .map(|(_, t)| t)
            .map_err(gpu_err("timed zero-token dispatch"))
    })?;

    // The floor's latency parts (BASELINES.md): an empty graph launch on every rank's stream,
    // timed like the calls, and one flag round trip between two resident kernels.
    let streams: Vec<_> = (0..local.len()).map(|i| g.stream(i).clone()).collect();
    let empty_graphs =
        EmptyGraphs::capture(&dev, &streams).map_err(gpu_err("capturing empty graphs"))?;
    let t_graph_launch = samples(total, warm, |_| {
        g.timed(|_| empty_graphs.replay())
            .map(|(_, t)| t)
            .map_err(gpu_err("timed empty graph"))
    })?;
    let rtt = flag_round_trip(&dev, 1000, false, std::time::Duration::from_secs(2))
        .map_err(gpu_err("flag round trip"))?;
    let rtt_gpu = flag_round_trip(&dev, 1000, true, std::time::Duration::from_secs(2))
        .map_err(gpu_err("flag round trip (GPU scope)"))?;

    // CUDA graphs of the same calls (after the un-graphed figures).
    let graph_samples = if args.graph {
        let t = time_graphs(g, &inputs, (&dargs, &cargs), &y_in, &v, total, warm)?;
        if let Some(bad) = t.bad {
            for b in &bad {
                eprintln!("MISMATCH (graph replay) {b}");
            }
            return Ok(1);
        }
        println!(
            "verified: one replay of each graph, counts, layout ranges and combined_x bit for bit against the plan"
        );
        Some(t)
    } else {
        None
    };

    // Phases of one plain dispatch and one plain combine (median over blocks of all ranks),
    // behind the gate like the timed calls, so that the ranks start together: launched one
    // after the other by the host, rank 1's blocks started 7-8 us after rank 0's, whose
    // receive part then waited that long (BENCHMARKS.md, 2026-12-07 from 18:44).
    let slots = [1usize, 2, 4, 5, 6];
    let comb_slots = [2usize, 4, 5, 6];
    g.measure_phases(true).map_err(gpu_err("phase stamps"))?;
    let (o, _) = g
        .timed(|g| g.dispatch(&inputs, &dargs))
        .map_err(gpu_err("dispatch"))?;
    let dstamps = g.phase_times().map_err(gpu_err("phase stamps"))?;
    let dphases = crate::bench::gpu::phase_split(&dstamps, &slots);
    rep.dispatch_detail = dispatch_detail(&dstamps);
    g.measure_phases(true).map_err(gpu_err("phase stamps"))?;
    let h: Vec<_> = o.iter().map(|o| o.handle.clone()).collect();
    let hs: Vec<_> = h.iter().collect();
    g.timed(|g| g.combine_with(&hs, &y_in, &cargs))
        .map_err(gpu_err("combine"))?;
    let cstamps = g.phase_times().map_err(gpu_err("phase stamps"))?;
    let cphases = crate::bench::gpu::phase_split(&cstamps, &comb_slots);
    rep.combine_ranks = rank_spread(&cstamps, 6);
    g.measure_phases(true).map_err(gpu_err("phase stamps"))?;
    g.timed(|g| g.dispatch(&empty_inputs, &dargs))
        .map_err(gpu_err("zero-token dispatch"))?;
    let zstamps = g.phase_times().map_err(gpu_err("phase stamps"))?;
    let zphases = crate::bench::gpu::phase_split(&zstamps, &slots);
    rep.zero_token_ranks = rank_spread(&zstamps, 6);
    g.measure_phases(false).map_err(gpu_err("phase stamps"))?;
    rep.zero_token_phases_us = zphases;
    rep.dispatch_phases_us = dphases;
    rep.combine_phases_us = cphases;

    // Bytes per token: one row (+ scales) per destination rank vs per expert; DeepEP's
    // bandwidth convention counts per expert.
    let row = if fp8 {
        hidden as f64 + 4.0 * (hidden / 128) as f64
    } else {
        2.0 * hidden as f64
    };
    let (mut msgs, mut entries, mut toks) = (0usize, 0usize, 0usize);
    for inp in &w.inputs {
        for t in 0..inp.num_tokens() {
            let mut dst = 0u32;
            for &x in inp.topk_idx.row(t) {
                if let Ok(x) = usize::try_from(x) {
                    dst |= 1 << (x / l);
                    entries += 1;
                }
            }
            msgs += dst.count_ones() as usize;
            toks += 1;
        }
    }
    let per_tok = |c: usize| c as f64 / toks.max(1) as f64 * row;
    rep.bytes_per_token_ep_rs = per_tok(msgs);
    rep.bytes_per_token_deepep = per_tok(entries);
    // The phases' bytes (DeepEP's count: one row per received (token, expert) entry, FP8 row +
    // scales for dispatch, BF16 for combine) through the copy engine, every rank at once on its
    // stream. With the graph launch and the flag round trip: the same-run floor.
    let per_rank = |c: usize| c as f64 / r as f64;
    let disp_copy = (per_rank(entries) * row) as usize;
    let comb_copy = (per_rank(entries) * 2.0 * hidden as f64) as usize;
    // Copies on every local rank's stream at once, timed like the calls: `iters` after warm-up
    // of `bytes` from each rank's `(dst, src)` pair.
    let buffers = |bytes: usize, what: &'static str| {
        (0..local.len())
            .map(|_| Ok((DevBuf::new(ctx, bytes)?, DevBuf::new(ctx, bytes)?)))
            .collect::<ep_kernels::Result<Vec<(DevBuf, DevBuf)>>>()
            .map_err(gpu_err(what))
    };
    let mut copy = |bufs: &[(DevBuf, DevBuf)], bytes: usize, iters: usize, what: &'static str| {
        samples(warm + iters, warm, |_| {
            g.timed(|g| {
                for (rank, (dst, src)) in bufs.iter().enumerate() {
                    dst.copy_from_async(src, bytes, g.stream(rank))?;
                }
                Ok(())
            })
            .map(|(_, t)| t)
            .map_err(gpu_err(what))
        })
    };
    let bufs = buffers(disp_copy.max(comb_copy).max(16), "copy-ceiling buffers")?;
    let t_copy_d = copy(&bufs, disp_copy, iters, "timed dispatch-bytes copy")?;
    let t_copy_c = copy(&bufs, comb_copy, iters, "timed combine-bytes copy")?;
    // The copy engine's steady rate: two large copies on every rank at once, the slope between
    // them (their starts cancel).
    let steady = buffers(STEADY_BYTES, "steady-copy buffers")?;
    let half = STEADY_BYTES / 2;
    let t_half = median(&copy(&steady, half, STEADY_ITERS, "timed steady copy")?);
    let t_full = median(&copy(
        &steady,
        STEADY_BYTES,
        STEADY_ITERS,
        "timed steady copy",
    )?);
    let rate = steady_rate(STEADY_BYTES / 2, t_half, STEADY_BYTES, t_full);
    let disp_bytes = per_tok(entries) * n as f64;
    let comb_bytes = per_tok(entries) / row * 2.0 * hidden as f64 * n as f64;
    rep.dispatch = figure(&t_dispatch, disp_bytes);
    rep.combine = figure(&t_combine, comb_bytes);
    rep.dispatch_combine = figure(&t_both, disp_bytes + comb_bytes);
    rep.dispatch_send = figure(&ds, disp_bytes);
    rep.dispatch_recv = figure(&dr, disp_bytes);
    rep.combine_send = figure(&cs, comb_bytes);
    rep.combine_recv = figure(&cr, comb_bytes);
    rep.graph = graph_samples.as_ref().map(|t| GraphReport {
        dispatch: figure(&t.dispatch, disp_bytes),
        combine: figure(&t.combine, comb_bytes),
        dispatch_combine: figure(&t.both, disp_bytes + comb_bytes),
    });
    rep.empty_launch_us = figure(&t_empty, 0.0).median_us;
    rep.zero_token_dispatch_us = figure(&t_signal, 0.0).median_us;
    rep.copy_dispatch_bytes_us = figure(&t_copy_d, 0.0).median_us;
    rep.copy_combine_bytes_us = figure(&t_copy_c, 0.0).median_us;
    rep.graph_launch_us = figure(&t_graph_launch, 0.0).median_us;
    rep.flag_round_trip_us = rtt.as_secs_f64() * 1e6;
    rep.flag_round_trip_gpu_scope_us = rtt_gpu.as_secs_f64() * 1e6;
    let latency = rep.graph_launch_us + rep.flag_round_trip_us;
    rep.floor_dispatch_us = latency + rep.copy_dispatch_bytes_us;
    rep.floor_combine_us = latency + rep.copy_combine_bytes_us;
    rep.steady_copy_gb_per_s = rate.map(|b| b * 1e-9);
    rep.steady_floor_dispatch_us = rate.map(|b| latency + disp_copy as f64 / b * 1e6);
    rep.steady_floor_combine_us = rate.map(|b| latency + comb_copy as f64 / b * 1e6);
    println!(
        "bytes per token sent: ep-rs {:.0} (one message per destination rank), DeepEP {:.0} (one per expert)",
        rep.bytes_per_token_ep_rs, rep.bytes_per_token_deepep
    );
    let graph_cols = if rep.graph.is_some() {
        format!(" {:>10} {:>10}", "graph us", "graph GB/s")
    } else {
        String::new()
    };
    println!(
        "{:<22} {:>10} {:>10}{graph_cols}  (median of {iters} event-timed calls{}, slowest rank; DeepEP bytes)",
        "call",
        "us",
        "GB/s",
        if rep.graph.is_some() {
            " / graph replays"
        } else {
            ""
        }
    );
    let graphed = |f: fn(&GraphReport) -> Figure| rep.graph.as_ref().map(f);
    for (name, f, gf) in [
        ("dispatch", rep.dispatch, graphed(|g| g.dispatch)),
        ("combine", rep.combine, graphed(|g| g.combine)),
        (
            "dispatch + combine",
            rep.dispatch_combine,
            graphed(|g| g.dispatch_combine),
        ),
        ("hook: dispatch send", rep.dispatch_send, None),
        ("hook: dispatch recv", rep.dispatch_recv, None),
        ("hook: combine send", rep.combine_send, None),
        ("hook: combine recv", rep.combine_recv, None),
    ] {
        let gcol = gf
            .map(|g| format!(" {:>10.2} {:>10.1}", g.median_us, g.gb_per_s))
            .unwrap_or_default();
        println!(
            "{name:<22} {:>10.2} {:>10.1}{gcol}",
            f.median_us, f.gb_per_s
        );
    }
    println!(
        "{:<22} {:>10.2}            (the gate's release to an empty end)",
        "empty call", rep.empty_launch_us
    );
    println!(
        "{:<22} {:>10.2}            (launch + one signal round; diagnostic, not in the floor)",
        "zero-token dispatch", rep.zero_token_dispatch_us
    );
    println!(
        "floor (same run, BASELINES.md): empty graph launch {:.2} us + flag round trip {:.2} us (GPU scope {:.2}) + the phase's bytes through the copy engine (dispatch {:.2} us, combine {:.2} us) = dispatch {:.2} us, combine {:.2} us",
        rep.graph_launch_us,
        rep.flag_round_trip_us,
        rep.flag_round_trip_gpu_scope_us,
        rep.copy_dispatch_bytes_us,
        rep.copy_combine_bytes_us,
        rep.floor_dispatch_us,
        rep.floor_combine_us
    );
    let ratio = |us: f64, floor: f64| us / floor.max(1e-9);
    let graph_ratios = rep
        .graph
        .as_ref()
        .map(|gr| {
            format!(
                "; graph replays: dispatch {:.2}x, combine {:.2}x",
                ratio(gr.dispatch.median_us, rep.floor_dispatch_us),
                ratio(gr.combine.median_us, rep.floor_combine_us)
            )
        })
        .unwrap_or_default();
    println!(
        "against the floor: dispatch {:.2}x, combine {:.2}x{graph_ratios}",
        ratio(rep.dispatch.median_us, rep.floor_dispatch_us),
        ratio(rep.combine.median_us, rep.floor_combine_us),
    );
    match (
        rep.steady_copy_gb_per_s,
        rep.steady_floor_dispatch_us,
        rep.steady_floor_combine_us,
    ) {
        (Some(gbs), Some(fd), Some(fc)) => {
            let graph = rep
                .graph
                .as_ref()
                .map(|gr| {
                    format!(
                        "; graph replays: dispatch {:.2}x, combine {:.2}x",
                        ratio(gr.dispatch.median_us, fd),
                        ratio(gr.combine.median_us, fc)
                    )
                })
                .unwrap_or_default();
            println!(
                "steady-rate floor (diagnostic): dispatch {fd:.2} us, combine {fc:.2} us (the phase's bytes at the copy engine's steady rate, {gbs:.0} GB/s per rank with every rank copying)"
            );
            println!(
                "against the steady-rate floor: dispatch {:.2}x, combine {:.2}x{graph}",
                ratio(rep.dispatch.median_us, fd),
                ratio(rep.combine.median_us, fc),
            );
        }
        _ => println!(
            "steady-rate floor: not measured (the larger steady copy was not slower than the smaller: noise)"
        ),
    }
    let ph = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!(
        "phases (us, median over blocks; dispatch: routing / send rows / gap / wait / receive rows / whole span; combine: send rows / gap / wait / reduce / whole span): dispatch {}; combine {}",
        ph(&rep.dispatch_phases_us),
        ph(&rep.combine_phases_us)
    );
    println!(
        "zero-token dispatch phases (us, as above): {}",
        ph(&rep.zero_token_phases_us)
    );
    println!("dispatch steps: {}", rep.dispatch_detail);
    println!(
        "rank spread (median/last, us from the first block start): combine {}; zero-token dispatch {}",
        rep.combine_ranks, rep.zero_token_ranks
    );
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "backend": "gpu",
            "mode": "low-latency",
            "variant": args.variant.letter(),
            "device": format!("GPU {} ({} SMs)", dev.ordinal(), dev.num_sms()),
            "workload": w.description,
            "digest": gpu_digest.total.to_string(),
            "rank_digests": local.iter().map(|&d| gpu_digest.ranks[d].to_string()).collect::<Vec<_>>(),
            "report": rep,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap_or_default()).map_err(
            |source| BenchError::Json {
                path: path.clone(),
                source,
            },
        )?;
    }
    println!("total {:.1} s", started.elapsed().as_secs_f64());
    Ok(0)
}

/// The low-latency group of the `Buffer` (made by its first dispatch).
fn group(buf: &mut Buffer<Gpu>) -> Result<&mut LlGroup, BenchError> {
    buf.transport_mut()
        .low_latency_mut()
        .ok_or_else(|| BenchError::Usage("the Buffer made no low-latency group".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The steady rate is the slope between the two copies: what both pay once (a copy's start)
    /// cancels, and a larger copy that was not slower gives no rate rather than a wrong one.
    #[test]
    fn the_steady_copy_rate_is_the_slope_between_two_copies() {
        // 32 MiB in 20 us + 4 us of start, 64 MiB in 40 us + 4 us: 32 MiB / 20 us.
        let mib = 1 << 20;
        let rate = steady_rate(32 * mib, 24e-6, 64 * mib, 44e-6).expect("a rate");
        assert!((rate - 32.0 * mib as f64 / 20e-6).abs() < 1.0, "{rate}");
        assert_eq!(steady_rate(32 * mib, 24e-6, 64 * mib, 24e-6), None);
        assert_eq!(steady_rate(32 * mib, 24e-6, 64 * mib, 20e-6), None);
        assert_eq!(steady_rate(64 * mib, 24e-6, 64 * mib, 30e-6), None);
        assert_eq!(steady_rate(32 * mib, 24e-6, 64 * mib, f64::NAN), None);
    }
}
