//! `ep layout`: generate a seeded workload (or read one from `.npy` files), compute every rank's
//! dispatch layout and outputs with the plan, check them against the independent oracle
//! (dispatch and combine), print a per-rank summary with DeepEP's byte counts and the canonical
//! output digest, and optionally dump the inputs and every output. The simulator backend's
//! `ep bench` builds on the same pieces (`ep_cli::io`, `ep_core::digest`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use ep_cli::io::{self, InputsSummary, IoError, Outputs, RunInfo};
use ep_core::numerics::fp8;
use ep_core::oracle;
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{self, DispatchOptions, IntranodeDispatch};
use ep_core::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use ep_core::plan::low_latency::{self as ll, LlDispatchOutput, LlParams};
use ep_core::routing::Activations;
use ep_core::workload::{Routing, WorkloadSpec};
use ep_core::{RankInputs, Tensor2, digest};
use half::bf16;
use serde_json::json;

/// Which dispatch/combine family to plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// Normal (high-throughput) intranode mode.
    Normal,
    /// Low-latency mode.
    LowLatency,
}

/// Options of `ep layout`. Defaults are DeepEP's test routings (spec §6.2, §6.4); the hidden
/// size defaults small because the layout does not depend on it (pass `--hidden 7168` for the
/// full byte volume).
#[derive(Debug, Args)]
pub(crate) struct LayoutArgs {
    /// Mode to plan.
    #[arg(long, value_enum, default_value_t = Mode::Normal)]
    mode: Mode,
    /// EP size (ranks) [default: 8; with --inputs: the number of rank directories].
    #[arg(long)]
    ranks: Option<usize>,
    /// Tokens per rank [default: 4096 normal, 128 low-latency; with --inputs: from the files].
    #[arg(long)]
    tokens: Option<usize>,
    /// Hidden size used for the data check [default: 256; with --inputs: from the files]
    /// (byte counts are also given for `--bytes-hidden`).
    #[arg(long)]
    hidden: Option<usize>,
    /// Hidden size for the DeepEP byte counts printed beside the layout.
    #[arg(long, default_value_t = 7168)]
    bytes_hidden: usize,
    /// Top-k [default: 8; with --inputs: from the files].
    #[arg(long)]
    topk: Option<usize>,
    /// Experts (default: 256 normal, 288 low-latency; required with --inputs).
    #[arg(long)]
    experts: Option<usize>,
    /// Seed of the workload (ChaCha8; the same seed gives the same routing on every machine).
    #[arg(long, default_value_t = 0, conflicts_with = "inputs")]
    seed: u64,
    /// Top-k slots per rank set to -1 (default: 0 normal, 10 low-latency, as DeepEP's tests).
    #[arg(long, conflicts_with = "inputs")]
    masked: Option<usize>,
    /// Expert choice of the generated workload: uniform, zipf:S (expert popularity follows a
    /// Zipf law with exponent S) or hot:F (a fraction F of tokens put expert 0 first).
    #[arg(long, default_value = "uniform", conflicts_with = "inputs")]
    routing: Routing,
    /// FP8: low-latency casts to e4m3 with per-128-channel scales on dispatch; normal mode
    /// dispatches FP8 inputs (generated with DeepEP's per_token_cast_to_fp8, or x_fp8.npy).
    #[arg(long)]
    fp8: bool,
    /// Read every rank's inputs from DIR/rank{r}/{topk_idx,topk_weights,x}.npy (or x_fp8.npy +
    /// x_scales.npy) instead of generating them; ranks, tokens, hidden and top-k come from the
    /// files, --experts is required.
    #[arg(long, value_name = "DIR")]
    inputs: Option<PathBuf>,
    /// Write the inputs in the --inputs format (replay them later with --inputs DIR).
    #[arg(long, value_name = "DIR")]
    dump_inputs: Option<PathBuf>,
    /// Write every output as .npy under the spec's names, plus manifest.json with the digest.
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
}

/// Outputs of a run, owned.
enum RunOutputs {
    Normal(Vec<IntranodeDispatch>, Vec<CombineOutput>),
    LowLatency(Vec<Option<LlDispatchOutput>>, Vec<Option<Tensor2<bf16>>>),
}

impl RunOutputs {
    fn view(&self) -> Outputs<'_> {
        match self {
            Self::Normal(d, c) => Outputs::Normal {
                dispatch: d,
                combine: c,
            },
            Self::LowLatency(d, c) => Outputs::LowLatency {
                dispatch: d,
                combined_x: c,
            },
        }
    }
}

/// Runs `ep layout`; returns the process exit code (non-zero when plan and oracle disagree).
pub(crate) fn run(args: &LayoutArgs) -> anyhow::Result<i32> {
    let ll_mode = args.mode == Mode::LowLatency;
    let mode_name = if ll_mode { "low-latency" } else { "normal" };
    let start = Instant::now();
    let (inputs, experts, mut info) = match &args.inputs {
        Some(dir) => {
            let experts = args
                .experts
                .context("--experts is required with --inputs (the files do not say it)")?;
            let inputs = io::read_inputs(dir, experts)
                .with_context(|| format!("reading inputs from {}", dir.display()))?;
            let s = io::summarize(&inputs);
            check_options(args, dir, &s)?;
            println!(
                "ep layout: {mode_name} mode, inputs {}: {} ranks, {} tokens/rank, hidden {}, \
                 top-{}, {experts} experts, {} (workload digest {:016x})",
                dir.display(),
                s.num_ranks,
                tokens_text(&s.tokens),
                s.hidden,
                s.topk,
                if s.fp8 { "FP8" } else { "BF16" },
                ep_core::workload::digest(&inputs),
            );
            let info = RunInfo {
                inputs: Some(dir.display().to_string()),
                ..RunInfo::default()
            };
            (inputs, experts, info)
        }
        None => {
            let ranks = args.ranks.unwrap_or(8);
            let tokens = args.tokens.unwrap_or(if ll_mode { 128 } else { 4096 });
            let experts = args.experts.unwrap_or(if ll_mode { 288 } else { 256 });
            let mut spec = WorkloadSpec::new(
                ranks,
                tokens,
                args.hidden.unwrap_or(256),
                args.topk.unwrap_or(8),
                experts,
                args.seed,
            );
            spec.masked_per_rank = args.masked.unwrap_or(if ll_mode { 10 } else { 0 });
            spec.routing = args.routing;
            // Low-latency casts on dispatch; normal mode dispatches FP8 inputs as they are.
            spec.fp8 = args.fp8 && !ll_mode;
            let inputs = spec.generate().context("generating the workload")?;
            let routing = match args.routing {
                Routing::Uniform => String::new(),
                r => format!(", routing {r}"),
            };
            println!(
                "ep layout: {mode_name} mode, {ranks} ranks, {tokens} tokens/rank, hidden {}, \
                 top-{}, {experts} experts, {} masked slots/rank{routing}, seed {} (workload \
                 digest {:016x})",
                spec.hidden,
                spec.num_topk,
                spec.masked_per_rank,
                args.seed,
                ep_core::workload::digest(&inputs),
            );
            let info = RunInfo {
                seed: Some(args.seed),
                routing: Some(args.routing.to_string()),
                options: json!({ "masked_per_rank": spec.masked_per_rank })
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
                ..RunInfo::default()
            };
            (inputs, experts, info)
        }
    };
    if let Some(dir) = &args.dump_inputs {
        io::write_inputs(dir, &inputs)
            .with_context(|| format!("writing inputs to {}", dir.display()))?;
        println!("inputs written to {}", dir.display());
    }

    let s = io::summarize(&inputs);
    let opts = DispatchOptions::default();
    let (ok, outputs) = if ll_mode {
        let params = ll_params(args, &s, experts);
        info.options.extend(
            json!({
                "num_max_dispatch_tokens_per_rank": params.num_max_dispatch_tokens_per_rank,
                "use_fp8": params.use_fp8,
                "round_scale": params.round_scale,
                "use_ue8m0": params.use_ue8m0,
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        );
        low_latency(args, &inputs, &params)?
    } else {
        info.options.extend(
            json!({
                "num_channels": opts.num_channels,
                "expert_alignment": opts.expert_alignment,
                "num_worst_tokens": opts.num_worst_tokens,
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        );
        normal(args, &inputs, experts, &opts)?
    };
    println!("checked in {:.2} s", start.elapsed().as_secs_f64());

    let view = outputs.view();
    let digests = view.digest().context("digesting the outputs")?;
    println!(
        "output digest {} (sha256, canonical format v{})",
        digests.total,
        digest::FORMAT_VERSION
    );
    if let Some(dir) = &args.dump {
        info.backend = "plan".into();
        info.options.extend(
            json!({
                "mode": mode_name,
                "ranks": s.num_ranks,
                "tokens": s.tokens,
                "hidden": s.hidden,
                "topk": s.topk,
                "experts": experts,
                "fp8": args.fp8 || s.fp8,
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        );
        io::dump_outputs(dir, &view, &info)
            .with_context(|| format!("dumping outputs to {}", dir.display()))?;
        println!("outputs written to {} ({})", dir.display(), io::MANIFEST);
    }
    if ok {
        println!("plan == oracle: OK");
        Ok(0)
    } else {
        println!("plan != oracle: MISMATCH");
        Ok(1)
    }
}

/// `T` of every rank: one number when they agree, `min..max` otherwise.
fn tokens_text(tokens: &[usize]) -> String {
    let (lo, hi) = (
        tokens.iter().min().copied().unwrap_or(0),
        tokens.iter().max().copied().unwrap_or(0),
    );
    if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}..{hi}")
    }
}

/// Options given beside `--inputs` must agree with the files.
fn check_options(
    args: &LayoutArgs,
    dir: &std::path::Path,
    s: &InputsSummary,
) -> anyhow::Result<()> {
    let rank0 = io::rank_dir(dir, 0);
    let x_file = rank0.join(if s.fp8 { "x_fp8.npy" } else { "x.npy" });
    let idx_file = rank0.join("topk_idx.npy");
    let t0 = s.tokens.first().copied().unwrap_or(0) as u64;
    let mismatch =
        |path: PathBuf, shape: Vec<u64>, expected: String, option: String| IoError::ShapeMismatch {
            path,
            shape,
            expected,
            why: format!("{option} was given"),
        };
    if let Some(r) = args.ranks
        && r != s.num_ranks
    {
        bail!(IoError::RankCountMismatch {
            dir: dir.to_path_buf(),
            found: s.num_ranks,
            expected: r,
        });
    }
    if let Some(t) = args.tokens
        && let Some(r) = s.tokens.iter().position(|&x| x != t)
    {
        let path = io::rank_dir(dir, r).join("topk_idx.npy");
        bail!(mismatch(
            path,
            vec![s.tokens[r] as u64, s.topk as u64],
            format!("[{t}, K]"),
            format!("--tokens {t}")
        ));
    }
    if let Some(h) = args.hidden
        && h != s.hidden
    {
        bail!(mismatch(
            x_file,
            vec![t0, s.hidden as u64],
            format!("[T, {h}]"),
            format!("--hidden {h}")
        ));
    }
    if let Some(k) = args.topk
        && k != s.topk
    {
        bail!(mismatch(
            idx_file,
            vec![t0, s.topk as u64],
            format!("[T, {k}]"),
            format!("--topk {k}")
        ));
    }
    if args.fp8 && args.mode == Mode::Normal && !s.fp8 {
        bail!(IoError::AmbiguousActivations {
            path: rank0,
            detail: "--fp8 was given but the inputs are BF16 (x.npy); drop --fp8 or provide \
                     x_fp8.npy + x_scales.npy"
                .into(),
        });
    }
    Ok(())
}

/// Low-latency parameters: `N` = the tokens per rank, or with inputs from files the largest
/// `T`, raised until `R * N` is a multiple of 4 (spec §1.9).
fn ll_params(args: &LayoutArgs, s: &InputsSummary, experts: usize) -> LlParams {
    let mut n = s.max_tokens().max(1);
    while !(s.num_ranks * n).is_multiple_of(ll::LL_PACKED_ROWS_MULTIPLE) {
        n += 1;
    }
    let params = LlParams::new(n, experts);
    if args.fp8 {
        params.with_fp8(false, false)
    } else {
        params
    }
}

/// The "expert" of the round trips: identity, as BF16 (FP8 rows dequantised first).
fn expert_rows(x: &Activations) -> anyhow::Result<Tensor2<bf16>> {
    Ok(match x {
        Activations::Bf16(x) => x.clone(),
        Activations::Fp8 { data, scales } => {
            let f = fp8::dequantize(data, scales)?;
            Tensor2::from_fn(f.rows(), f.cols(), |r, c| bf16::from_f32(f.get(r, c)))
        }
    })
}

fn normal(
    args: &LayoutArgs,
    inputs: &[RankInputs],
    experts: usize,
    opts: &DispatchOptions,
) -> anyhow::Result<(bool, RunOutputs)> {
    let ranks = inputs.len();
    let layouts = inputs
        .iter()
        .enumerate()
        .map(|(r, i)| get_dispatch_layout_for_rank(r, &i.topk_idx, experts, ranks))
        .collect::<ep_core::Result<Vec<DispatchLayout>>>()?;
    let mut ok = true;
    for (r, (l, i)) in layouts.iter().zip(inputs).enumerate() {
        let reference = oracle::normal::layout(&i.topk_idx, experts, ranks)?;
        if *l != reference {
            println!("rank {r}: layout differs from the oracle");
            ok = false;
        }
    }
    let plan = intranode::intranode_dispatch_all(inputs, &layouts, experts, opts)?;
    let reference = oracle::normal::intranode_dispatch(inputs, experts, opts)?;
    for (r, (p, o)) in plan.iter().zip(&reference).enumerate() {
        if p != o {
            println!("rank {r}: dispatch outputs differ from the oracle");
            ok = false;
        }
    }
    let (combine_ok, combined) = combine_round_trip(inputs, experts, &plan)?;
    ok &= combine_ok;

    println!();
    println!(
        "{:>4} {:>12} {:>10} {:>14} {:>16} {:>18}",
        "rank", "tokens sent", "rows recv", "experts min..max", "recv MB @H", "DeepEP NVL bytes"
    );
    let mut total_rows = 0usize;
    for (r, out) in plan.iter().enumerate() {
        let sent: i32 = layouts[r].num_tokens_per_rank.iter().sum();
        let rows = out.handle.num_recv_tokens;
        total_rows += rows;
        let list = &out.num_recv_tokens_per_expert_list;
        let (lo, hi) = (
            list.iter().min().copied().unwrap_or(0),
            list.iter().max().copied().unwrap_or(0),
        );
        let bytes = rows * args.bytes_hidden * 2;
        println!(
            "{r:>4} {sent:>12} {rows:>10} {:>14} {:>16.1} {bytes:>18}",
            format!("{lo}..{hi}"),
            bytes as f64 / 1e6
        );
    }
    println!(
        "total rows received {total_rows}; DeepEP's dispatch byte count (recv_x.numel()*2 at H={}) \
         {:.1} MB over all ranks",
        args.bytes_hidden,
        (total_rows * args.bytes_hidden * 2) as f64 / 1e6
    );
    Ok((ok, RunOutputs::Normal(plan, combined)))
}

/// Combines the unchanged `recv_x` (FP8 dequantised to BF16) and weights with plan and oracle;
/// they must agree, and the weights must come back. Returns the plan's combine outputs.
fn combine_round_trip(
    inputs: &[RankInputs],
    experts: usize,
    plan: &[IntranodeDispatch],
) -> anyhow::Result<(bool, Vec<CombineOutput>)> {
    let ys: Vec<Tensor2<bf16>> = plan
        .iter()
        .map(|o| expert_rows(&o.recv_x))
        .collect::<anyhow::Result<_>>()?;
    let args: Vec<CombineArgs<'_>> = plan
        .iter()
        .zip(&ys)
        .map(|(o, y)| CombineArgs {
            x: y,
            topk_weights: o.recv_topk_weights.as_ref(),
            bias: &[],
        })
        .collect();
    let handles: Vec<_> = plan.iter().map(|o| o.handle.clone()).collect();
    let p = intranode::intranode_combine(&handles, &args)?;
    let o = oracle::normal::intranode_combine(inputs, experts, &args)?;
    let mut ok = p == o;
    if !ok {
        println!("combine differs from the oracle");
    }
    for (r, (out, i)) in p.iter().zip(inputs).enumerate() {
        if let Some(w) = &out.combined_topk_weights {
            for t in 0..i.num_tokens() {
                for k in 0..i.num_topk() {
                    let want = if i.topk_idx.get(t, k) >= 0 {
                        i.topk_weights.get(t, k)
                    } else {
                        0.0
                    };
                    if w.get(t, k) != want {
                        println!(
                            "rank {r}: combined weight [{t}][{k}] {} != {want}",
                            w.get(t, k)
                        );
                        ok = false;
                    }
                }
            }
        }
    }
    Ok((ok, p))
}

/// Identity expert over a low-latency receiver's rows (dequantised, rounded to BF16).
fn ll_expert(out: &Option<LlDispatchOutput>) -> anyhow::Result<Option<Vec<Tensor2<bf16>>>> {
    out.as_ref()
        .map(|o| ll::map_rows(o, |_, row| row.iter().map(|&v| bf16::from_f32(v)).collect()))
        .transpose()
        .map_err(Into::into)
}

fn low_latency(
    args: &LayoutArgs,
    inputs: &[RankInputs],
    params: &LlParams,
) -> anyhow::Result<(bool, RunOutputs)> {
    let plan = ll::dispatch(inputs, params)?;
    let reference = oracle::low_latency::dispatch(inputs, params)?;
    let mut ok = true;
    println!();
    println!(
        "{:>4} {:>14} {:>14} {:>22}",
        "rank", "rows recv", "experts min..max", "DeepEP dispatch bytes"
    );
    let msg = if args.fp8 {
        args.bytes_hidden + args.bytes_hidden / 128 * 4 + 16
    } else {
        2 * args.bytes_hidden + 16
    };
    let mut total = 0usize;
    for (r, (p, o)) in plan.iter().zip(&reference).enumerate() {
        let (Some(p), Some(o)) = (p, o) else {
            println!("{r:>4} masked");
            continue;
        };
        if ll::canonicalize(p)? != ll::canonicalize(o)? {
            println!("rank {r}: low-latency dispatch differs from the oracle (canonical form)");
            ok = false;
        }
        let rows: i32 = p.recv_count.iter().sum();
        total += rows as usize;
        let (lo, hi) = (
            p.recv_count.iter().min().copied().unwrap_or(0),
            p.recv_count.iter().max().copied().unwrap_or(0),
        );
        println!(
            "{r:>4} {rows:>14} {:>14} {:>22}",
            format!("{lo}..{hi}"),
            rows as usize * msg
        );
    }
    println!(
        "total (token, expert) rows {total}; DeepEP's byte count per row {msg} B at H={} ({})",
        args.bytes_hidden,
        if args.fp8 {
            "FP8 + scales + 16"
        } else {
            "BF16 + 16"
        }
    );

    // Combine the identity expert's outputs with plan and oracle: they must agree bit for bit.
    let handles = |d: &[Option<LlDispatchOutput>]| -> Vec<_> {
        d.iter()
            .map(|o| o.as_ref().map(|o| o.handle.clone()))
            .collect()
    };
    let plan_y = plan
        .iter()
        .map(ll_expert)
        .collect::<anyhow::Result<Vec<_>>>()?;
    let ref_y = reference
        .iter()
        .map(ll_expert)
        .collect::<anyhow::Result<Vec<_>>>()?;
    let combined = ll::combine(inputs, &handles(&plan), &plan_y, params)?;
    let reference_combined =
        oracle::low_latency::combine(inputs, &handles(&reference), &ref_y, params)?;
    if combined != reference_combined {
        println!("low-latency combine differs from the oracle");
        ok = false;
    }
    Ok((ok, RunOutputs::LowLatency(plan, combined)))
}
