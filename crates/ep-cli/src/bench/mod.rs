//! `ep bench`: dispatch then combine on a backend, every result verified against the oracle,
//! timed on the host, reported with DeepEP's byte counts beside the cost model's prediction.
//!
//! A run: calibrate this machine's single-thread `memcpy` (about 0.2 s); load the workload
//! ([`crate::workload::load`]: generated from `--seed`, or read from `--inputs`); compute the
//! references; then `--warmup` + `--iters` iterations of dispatch and combine on one `Buffer`.
//! Each call is timed alone on the host (verification, expert outputs and input preparation are
//! not timed); every iteration's outputs are compared with the references. The first iteration's
//! outputs are digested (`ep_core::digest`, canonical, equal on every backend) and dumped with
//! `--dump`. Reported per phase: median (min, max) time of the timed iterations, DeepEP's
//! bandwidth figure, the payload rate (bytes the protocol must move / median time) and its ratio
//! to the `memcpy` rate, and the cost model's prediction for the traffic the last iteration
//! recorded (`ep_sim::cost`, summed over the phases of the call).
//!
//! Exit codes: 0 verified, 1 mismatch, 2 usage error, 3 other errors, 128 + the signal when
//! stopped by SIGINT or SIGTERM ([`BenchError`]). What can be refused is refused before any work
//! ([`crate::preflight`]).

mod backend;
mod error;
pub mod gpu;
mod gpu_ll;
mod low_latency;
mod memcpy;
mod normal;
mod procs;
mod progress;
mod report;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use ep_core::RankInputs;
use ep_core::digest::RunDigest;
use ep_core::routing::Activations;
use ep_core::transport::FabricParams;
use ep_sim::cost::{CostModel, PhaseRecord, Prediction};
use ep_sim::{Sim, SimConfig, ThreadSim};
use half::slice::HalfFloatSliceExt;

pub use backend::{Backend, LlVariantArg};
pub use error::{BenchError, error_chain};
pub use progress::ProgressMode;
pub use report::Report;

use crate::io::RunInfo;
use crate::preflight;
use crate::workload::{self, Defaults, Mode, OptionsError, Workload, WorkloadArgs};
use progress::Progress;

/// Options of `ep bench`. Defaults are DeepEP's test settings: normal mode 4096 tokens x 7168
/// hidden, top-8, 256 experts, 8 ranks, BF16, 24 SMs (spec §6.2); low-latency mode 128 tokens,
/// 288 experts, FP8 dispatch, BF16 combine (spec §6.4).
#[derive(Clone, Debug, Args)]
pub struct BenchArgs {
    /// The workload and its dumps (shared with `ep layout`).
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Where to run: sim (threads mode, for throughput), sim-checked (the deterministic
    /// simulator with every check, seeded by --seed; small runs), gpu (normal mode on
    /// --ranks co-resident ranks of GPU 0, CUDA-event timed beside the same-run copy ceiling).
    #[arg(long, value_enum, default_value_t = Backend::Sim)]
    pub backend: Backend,
    /// Ranks per node: ranks of one node reach each other over NVLink, others over RDMA
    /// [default: all ranks on one node]. Low-latency mode may use 1 to model RDMA only.
    #[arg(long)]
    pub ranks_per_node: Option<usize>,
    /// Outstanding work requests per QP (NVSHMEM_QP_DEPTH) [default: 1024, DeepEP's].
    #[arg(long, default_value_t = 1024)]
    pub qp_depth: u32,
    /// RC QPs per peer (NVSHMEM_IBGDA_NUM_RC_PER_PE) [default: the local experts in
    /// low-latency mode, as DeepEP sets it; 1 in normal mode].
    #[arg(long)]
    pub rc_per_pe: Option<u16>,
    /// Symmetric heap chunk size in bytes (NVSHMEM_CUMEM_GRANULARITY); RDMA transfers crossing a
    /// chunk boundary become one work request per chunk.
    #[arg(long, default_value_t = 1 << 29)]
    pub granularity: u64,
    /// Timed iterations [default: 3 normal (each moves ~5 GB and is verified in full; the whole
    /// default run stays under 10 s on a 2-core machine), 20 low-latency].
    #[arg(long)]
    pub iters: Option<usize>,
    /// Untimed warm-up iterations before them (verified all the same).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Write a JSON report (options, fabric, timings, byte counts, predictions, digests,
    /// verification) to PATH.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// No progress output at all (as --progress none).
    #[arg(long)]
    pub quiet: bool,
    /// Progress: a bar when stderr is a terminal, else one line per step on stderr (auto); or
    /// always bar, plain or none.
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    pub progress: ProgressMode,
    /// GPU: SM counts per rank to measure, comma-separated (e.g. 8,16,24,32,48,64) [default:
    /// --num-sms].
    #[arg(long, value_name = "LIST")]
    pub sms_sweep: Option<String>,
    /// GPU: timed calls per figure (after --warmup + 4 warm-up calls).
    #[arg(long, default_value_t = 50)]
    pub gpu_iters: usize,
    /// GPU: input sets rotated between calls (each larger than L2 at DeepEP's shapes).
    #[arg(long, default_value_t = 4)]
    pub input_sets: usize,
    /// GPU: draw GB/s against SMs per rank, with the ceilings and DeepEP's figures, as SVG.
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
    /// GPU, normal mode: run one rank per process (the deployment shape), N processes started by
    /// this one on GPU `LOCAL_RANK % GPUs`, peers' arenas mapped with CUDA IPC; N = --ranks.
    /// Each prints its own rank's figures. On one GPU the processes' kernels only overlap under
    /// MPS.
    #[arg(long, value_name = "N")]
    pub procs: Option<usize>,
    /// GPU, low-latency mode: after the un-graphed figures, capture dispatch, combine and
    /// dispatch + combine each as a CUDA graph, verify one replay against the plan, and time
    /// at least 1000 replays of each (printed beside the un-graphed figures, `graph` in --json).
    #[arg(long)]
    pub graph: bool,
    /// GPU, low-latency mode: the kernel variant, pointers (a: peers by pointer) or nvshmem (b:
    /// every put, signal, fence and quiet through NVSHMEM's device API, one PE in this process,
    /// the NVSHMEM environment plan applied before its init).
    #[arg(long, value_enum, default_value_t = LlVariantArg::Pointers)]
    pub variant: LlVariantArg,
    /// Low-latency mode: combine with LogFMT-10 partials (DeepEP's `use_logfmt`,
    /// `LlCombineOptions::use_logfmt`; verified bit for bit against the plan's LogFMT reduction,
    /// on every backend, so `--backend gpu` and `--backend sim` print the same digest).
    #[arg(long)]
    pub logfmt: bool,
}

/// How a run ended when it ran to the end.
#[derive(Debug)]
pub struct Outcome {
    /// The report (also printed, and written with `--json`).
    pub report: Report,
}

impl Outcome {
    /// 0 when every result matched the references, 1 otherwise.
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        if self.report.verified { 0 } else { 1 }
    }
}

/// What the verification of a run found.
#[derive(Debug, Default, Clone)]
pub(crate) struct Checks {
    /// Iterations verified.
    pub(crate) iterations: usize,
    /// Mismatches (at most [`Checks::MAX`] kept), empty when verified.
    pub(crate) mismatches: Vec<String>,
    /// Number of mismatches found.
    pub(crate) failures: usize,
    /// Figures worth printing (tolerances met).
    pub(crate) notes: Vec<String>,
}

impl Checks {
    const MAX: usize = 20;

    pub(crate) fn fail(&mut self, what: String) {
        self.failures += 1;
        if self.mismatches.len() < Self::MAX {
            self.mismatches.push(what);
        }
    }
}

/// One timed call (dispatch or combine) of a mode.
#[derive(Debug)]
pub(crate) struct PhaseResult {
    pub(crate) name: &'static str,
    pub(crate) format: &'static str,
    /// Host wall time of each timed iteration, microseconds.
    pub(crate) samples_us: Vec<f64>,
    /// DeepEP's byte count of each rank.
    pub(crate) deepep_bytes_per_rank: Vec<f64>,
    /// What DeepEP calls those bytes (`NVL`, `logical`).
    pub(crate) deepep_unit: &'static str,
    /// Bytes the protocol must move per call.
    pub(crate) payload_bytes: u64,
    /// What [`PhaseResult::payload_bytes`] counts.
    pub(crate) payload_what: &'static str,
    /// Bytes the executor recorded (data, metadata and signals over every link, local stores
    /// included).
    pub(crate) recorded_bytes: u64,
    /// The cost model's prediction of each phase of the call.
    pub(crate) predictions: Vec<(String, Prediction)>,
}

/// What a mode's run produced.
#[derive(Debug)]
pub(crate) struct ModeResult {
    pub(crate) phases: Vec<PhaseResult>,
    pub(crate) checks: Checks,
    pub(crate) digest: RunDigest,
}

/// What the modes need from the command.
pub(crate) struct RunParams<'a> {
    pub(crate) backend: &'static str,
    pub(crate) fabric: &'a FabricParams,
    pub(crate) iters: usize,
    pub(crate) warmup: usize,
    pub(crate) num_sms: usize,
    /// Alternate the sign of the activations between iterations.
    pub(crate) alternate: bool,
    /// Low-latency combine with LogFMT-10 partials (`--logfmt`).
    pub(crate) logfmt: bool,
    pub(crate) dump: Option<&'a Path>,
    pub(crate) info: &'a RunInfo,
    pub(crate) progress: &'a Progress,
    /// Where the wall time went: (step, seconds), summed per step.
    pub(crate) timeline: &'a Timeline,
}

impl RunParams<'_> {
    /// Starts iteration `it` (warm-ups first): shows it on the progress bar and brings the
    /// inputs' sign to this iteration's (`*negated` tracks it). Returns whether it is timed, or
    /// `Interrupted` after SIGINT/SIGTERM.
    pub(crate) fn begin_iteration(
        &self,
        it: usize,
        inputs: &mut [RankInputs],
        negated: &mut bool,
    ) -> Result<bool, BenchError> {
        BenchError::check_interrupt(|| format!("before iteration {it}"))?;
        let timed = it >= self.warmup;
        self.progress.step(format!(
            "{} {}",
            if timed { "iteration" } else { "warm-up" },
            if timed { it - self.warmup + 1 } else { it + 1 }
        ));
        let want_negated = self.alternate && it % 2 == 1;
        if want_negated != *negated {
            flip_signs(inputs);
            *negated = want_negated;
        }
        Ok(timed)
    }
}

/// Wall time per step of a run (set-up, references, calls, verification, digest).
#[derive(Debug, Default)]
pub(crate) struct Timeline(std::cell::RefCell<Vec<(&'static str, f64)>>);

impl Timeline {
    /// Adds the time since `since` to `step`; returns now.
    pub(crate) fn lap(&self, step: &'static str, since: Instant) -> Instant {
        let now = Instant::now();
        let s = (now - since).as_secs_f64();
        let mut v = self.0.borrow_mut();
        match v.iter_mut().find(|(n, _)| *n == step) {
            Some(e) => e.1 += s,
            None => v.push((step, s)),
        }
        now
    }

    pub(crate) fn steps(&self) -> Vec<(&'static str, f64)> {
        self.0.borrow().clone()
    }
}

/// Negates every activation in place (BF16 and e4m3: the sign bit; scales unchanged). Exact,
/// and its own inverse.
pub(crate) fn flip_signs(inputs: &mut [RankInputs]) {
    for i in inputs {
        match &mut i.x {
            Activations::Bf16(x) => {
                for v in x.data_mut().reinterpret_cast_mut() {
                    *v ^= 0x8000;
                }
            }
            Activations::Fp8 { data, .. } => {
                for v in data.data_mut() {
                    *v ^= 0x80;
                }
            }
        }
    }
}

/// Whether every activation is finite (negation commutes with the arithmetic only then).
fn all_finite(inputs: &[RankInputs]) -> bool {
    inputs.iter().all(|i| match &i.x {
        Activations::Bf16(x) => x.data().iter().all(|v| v.is_finite()),
        // e4m3 has no infinities; 0x7f / 0xff are its NaNs.
        Activations::Fp8 { data, scales } => {
            data.data().iter().all(|&b| b & 0x7f != 0x7f)
                && scales.data().iter().all(|s| s.is_finite())
        }
    })
}

/// The cost model's prediction for each recorded phase.
pub(crate) fn predictions(
    records: &[PhaseRecord],
    fabric: &FabricParams,
) -> Vec<(String, Prediction)> {
    let model = CostModel::default();
    records
        .iter()
        .map(|r| (format!("{:?}", r.kind), model.predict(r, fabric)))
        .collect()
}

/// `ep bench`'s defaults (every backend): DeepEP's hidden size, FP8 low-latency dispatch.
const DEFAULTS: Defaults = Defaults {
    hidden: 7168,
    low_latency_fp8: true,
};

/// Runs `ep bench` on the backend `--backend` names and returns the exit code (0 verified,
/// 1 mismatch): the simulator through [`run`], the GPU through [`gpu::run`].
pub fn run_any(args: &BenchArgs) -> Result<i32, BenchError> {
    check_graph_flag(args)?;
    if args.backend == Backend::Gpu {
        // Refused before the GPU is opened, as on the simulator (every command of ep bench
        // defaults low-latency dispatch to FP8).
        args.workload
            .ll_cast(&DEFAULTS)
            .map_err(OptionsError::from)?;
        return gpu::run(args);
    }
    run(args).map(|o| o.exit_code())
}

/// `--graph` and `--variant` are GPU low-latency options, `--logfmt` a low-latency one: refused
/// (usage error) anywhere else.
fn check_graph_flag(args: &BenchArgs) -> Result<(), BenchError> {
    let ll = args.workload.mode == Mode::LowLatency;
    let gpu_ll = args.backend == Backend::Gpu && ll;
    if args.graph && !gpu_ll {
        return Err(BenchError::Usage(
            "--graph captures low-latency calls in CUDA graphs: use it with --backend gpu --mode low-latency".into(),
        ));
    }
    if args.variant != LlVariantArg::Pointers && !gpu_ll {
        return Err(BenchError::Usage(
            "--variant picks the GPU low-latency kernels: use it with --backend gpu --mode low-latency".into(),
        ));
    }
    if args.logfmt && !ll {
        return Err(BenchError::Usage(
            "--logfmt is the low-latency combine's LogFMT-10: use it with --mode low-latency"
                .into(),
        ));
    }
    Ok(())
}

/// Runs `ep bench` on the simulator (module docs): prints the report, writes `--json`, returns
/// the outcome. `--backend gpu` goes to [`gpu::run`] ([`run_any`] routes).
pub fn run(args: &BenchArgs) -> Result<Outcome, BenchError> {
    let started = Instant::now();
    check_graph_flag(args)?;
    if args.backend == Backend::Gpu {
        return Err(BenchError::Usage(
            "bench::run drives the simulator; --backend gpu runs through bench::gpu::run (bench::run_any)".into(),
        ));
    }
    let mode = args.workload.mode;
    let iters = args
        .iters
        .unwrap_or(if mode == Mode::Normal { 3 } else { 20 });
    if iters == 0 {
        return Err(BenchError::Usage(
            "--iters 0: time at least one iteration".into(),
        ));
    }
    let defaults = DEFAULTS;
    // Everything that can be refused is refused here, before a byte of the workload exists.
    preflight::check_granularity(args.granularity)?;
    let need = preflight::before_load(
        &args.workload,
        &defaults,
        preflight::Command::Bench,
        args.json.as_deref(),
    )?;
    ep_sim::alloc::tune_system_allocator();
    let progress = Progress::new(4 + (args.warmup + iters) as u64, args.quiet, args.progress);
    let timeline = Timeline::default();
    progress.step("memcpy calibration");
    let memcpy = memcpy::single_thread_gb_per_s(Duration::from_millis(200));
    let t = timeline.lap("memcpy calibration", started);
    progress.done();
    progress.step("workload");
    let mut w: Workload = workload::load(&args.workload, &defaults)?;
    let need = need.or(preflight::after_load(
        &w,
        &args.workload,
        preflight::Command::Bench,
    )?);
    timeline.lap("workload", t);
    progress.done();
    if let Err(e) = BenchError::check_interrupt(|| "after loading the workload".into()) {
        progress.finish();
        return Err(e);
    }
    let r = w.inputs.len();
    let rpn = args.ranks_per_node.unwrap_or(r);
    if rpn == 0 || !r.is_multiple_of(rpn) {
        return Err(BenchError::Usage(format!(
            "--ranks-per-node {rpn} must divide the {r} ranks"
        )));
    }
    if mode == Mode::Normal && rpn != r {
        return Err(BenchError::Usage(format!(
            "normal mode needs every rank on one NVLink domain (--ranks-per-node {r}); normal \
             internode mode is not implemented yet (docs/protocol.md §4)"
        )));
    }
    let local_experts = (w.num_experts / r.max(1)).max(1);
    let rc_per_pe = args.rc_per_pe.unwrap_or(if mode == Mode::LowLatency {
        u16::try_from(local_experts).unwrap_or(u16::MAX)
    } else {
        1
    });
    if rc_per_pe == 0 || args.qp_depth == 0 || args.granularity == 0 {
        return Err(BenchError::Usage(
            "--rc-per-pe, --qp-depth and --granularity must be at least 1".into(),
        ));
    }
    let fabric = FabricParams {
        ranks_per_node: rpn,
        qp_depth: args.qp_depth,
        rc_per_pe,
        granularity: args.granularity,
        ..FabricParams::single_node(r)
    };
    let mut info = w.info.clone();
    info.backend = args.backend.name().into();
    info.options.extend(options_json(args, &w, iters, &fabric));
    progress.println(format!("ep bench: {}", w.description));
    progress.println(format!(
        "backend {} ({}), fabric: {} rank(s) per node, QP depth {}, {} RC QP(s) per peer, heap \
         chunks of {} MiB",
        args.backend.name(),
        match args.backend {
            Backend::Sim => "threads mode: no memory-model checks; every output is verified",
            _ => "deterministic, every memory-model check; every output is verified",
        },
        rpn,
        fabric.qp_depth,
        fabric.rc_per_pe,
        fabric.granularity >> 20,
    ));
    if let Some(need) = &need {
        progress.println(format!(
            "memory: about {} at the peak (estimate)",
            preflight::gib(need.memory_total())
        ));
        if let Some(dir) = &args.workload.dump {
            progress.println(preflight::dump_line(need, dir));
        }
    }
    let params = RunParams {
        backend: args.backend.name(),
        fabric: &fabric,
        iters,
        warmup: args.warmup,
        num_sms: args.workload.num_sms,
        alternate: all_finite(&w.inputs),
        logfmt: args.logfmt,
        dump: args.workload.dump.as_deref(),
        info: &info,
        progress: &progress,
        timeline: &timeline,
    };
    let result = match (args.backend, mode) {
        (Backend::Sim, m) => {
            let ts = ThreadSim::new(fabric.clone(), Duration::from_secs(300));
            match m {
                Mode::Normal => normal::run(ts, &mut w, &params),
                Mode::LowLatency => low_latency::run(ts, &mut w, &params),
            }
        }
        (_, m) => {
            let sim = Sim::new(
                SimConfig::new(fabric.clone(), args.workload.seed).wait_timeout(50_000_000),
            );
            match m {
                Mode::Normal => normal::run(sim, &mut w, &params),
                Mode::LowLatency => low_latency::run(sim, &mut w, &params),
            }
        }
    };
    progress.finish();
    let result = result?;
    let report = Report::new(args, &w, &info, &fabric, memcpy, result, &timeline, started);
    report.print();
    if let Some(dir) = &args.workload.dump {
        println!(
            "outputs written to {} ({})",
            dir.display(),
            crate::io::MANIFEST
        );
    }
    if let Some(path) = &args.json {
        report.write_json(path)?;
        println!("report written to {}", path.display());
    }
    Ok(Outcome { report })
}

/// The options of a run, for the manifest and the JSON report.
fn options_json(
    args: &BenchArgs,
    w: &Workload,
    iters: usize,
    fabric: &FabricParams,
) -> serde_json::Map<String, serde_json::Value> {
    let s = &w.summary;
    let v = serde_json::json!({
        "mode": w.mode.name(),
        "backend": args.backend.name(),
        "ranks": s.num_ranks,
        "tokens": s.tokens,
        "hidden": s.hidden,
        "topk": s.topk,
        "experts": w.num_experts,
        "fp8": w.fp8,
        "round_scale": w.round_scale,
        "use_ue8m0": w.use_ue8m0,
        "logfmt": args.logfmt,
        "seed": w.info.seed,
        "routing": w.info.routing,
        "masked_per_rank": w.masked_per_rank,
        "inputs": w.info.inputs,
        "num_sms": args.workload.num_sms,
        "iters": iters,
        "warmup": args.warmup,
        "ranks_per_node": fabric.ranks_per_node,
        "qp_depth": fabric.qp_depth,
        "rc_per_pe": fabric.rc_per_pe,
        "granularity": fabric.granularity,
    });
    v.as_object().cloned().unwrap_or_default()
}
