//! `ep layout`: generate a seeded workload, compute every rank's dispatch layout and outputs with
//! the plan, check them against the independent oracle (dispatch and combine), and print a
//! per-rank summary with DeepEP's byte counts. The simulator backend's `ep bench` builds on it.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use ep_core::RankInputs;
use ep_core::Tensor2;
use ep_core::oracle;
use ep_core::plan::combine::CombineArgs;
use ep_core::plan::intranode::{self, DispatchOptions, IntranodeDispatch};
use ep_core::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use ep_core::plan::low_latency::{self as ll, LlParams};
use ep_core::routing::Activations;
use ep_core::workload::WorkloadSpec;
use half::bf16;

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
    /// EP size (ranks).
    #[arg(long, default_value_t = 8)]
    ranks: usize,
    /// Tokens per rank (default: 4096 normal, 128 low-latency).
    #[arg(long)]
    tokens: Option<usize>,
    /// Hidden size used for the data check (byte counts are also given for `--bytes-hidden`).
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Hidden size for the DeepEP byte counts printed beside the layout.
    #[arg(long, default_value_t = 7168)]
    bytes_hidden: usize,
    /// Top-k.
    #[arg(long, default_value_t = 8)]
    topk: usize,
    /// Experts (default: 256 normal, 288 low-latency).
    #[arg(long)]
    experts: Option<usize>,
    /// Seed of the workload (ChaCha8; the same seed gives the same routing on every machine).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Top-k slots per rank set to -1 (default: 0 normal, 10 low-latency, as DeepEP's tests).
    #[arg(long)]
    masked: Option<usize>,
    /// Low-latency: cast to FP8 (e4m3 with per-128-channel scales).
    #[arg(long)]
    fp8: bool,
}

/// Runs `ep layout`; returns the process exit code (non-zero when plan and oracle disagree).
pub(crate) fn run(args: &LayoutArgs) -> anyhow::Result<i32> {
    let ll_mode = args.mode == Mode::LowLatency;
    let tokens = args.tokens.unwrap_or(if ll_mode { 128 } else { 4096 });
    let experts = args.experts.unwrap_or(if ll_mode { 288 } else { 256 });
    let mut spec = WorkloadSpec::new(
        args.ranks,
        tokens,
        args.hidden,
        args.topk,
        experts,
        args.seed,
    );
    spec.masked_per_rank = args.masked.unwrap_or(if ll_mode { 10 } else { 0 });
    let start = Instant::now();
    let inputs = spec.generate().context("generating the workload")?;
    println!(
        "ep layout: {} mode, {} ranks, {tokens} tokens/rank, hidden {}, top-{}, {experts} experts, \
         {} masked slots/rank, seed {} (workload digest {:016x})",
        if ll_mode { "low-latency" } else { "normal" },
        args.ranks,
        args.hidden,
        args.topk,
        spec.masked_per_rank,
        args.seed,
        ep_core::workload::digest(&inputs),
    );
    let ok = if ll_mode {
        low_latency(args, &inputs, tokens, experts)?
    } else {
        normal(args, &inputs, experts)?
    };
    println!("checked in {:.2} s", start.elapsed().as_secs_f64());
    if ok {
        println!("plan == oracle: OK");
        Ok(0)
    } else {
        println!("plan != oracle: MISMATCH");
        Ok(1)
    }
}

fn normal(args: &LayoutArgs, inputs: &[RankInputs], experts: usize) -> anyhow::Result<bool> {
    let layouts = inputs
        .iter()
        .enumerate()
        .map(|(r, i)| get_dispatch_layout_for_rank(r, &i.topk_idx, experts, args.ranks))
        .collect::<ep_core::Result<Vec<DispatchLayout>>>()?;
    let mut ok = true;
    for (r, (l, i)) in layouts.iter().zip(inputs).enumerate() {
        let reference = oracle::normal::layout(&i.topk_idx, experts, args.ranks)?;
        if *l != reference {
            println!("rank {r}: layout differs from the oracle");
            ok = false;
        }
    }
    let opts = DispatchOptions::default();
    let plan = intranode::intranode_dispatch_all(inputs, &layouts, experts, &opts)?;
    let reference = oracle::normal::intranode_dispatch(inputs, experts, &opts)?;
    for (r, (p, o)) in plan.iter().zip(&reference).enumerate() {
        if p != o {
            println!("rank {r}: dispatch outputs differ from the oracle");
            ok = false;
        }
    }
    ok &= combine_round_trip(inputs, experts, &plan)?;

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
    Ok(ok)
}

/// Combines the unchanged `recv_x` (and weights) with plan and oracle; they must agree, and
/// the weights must come back.
fn combine_round_trip(
    inputs: &[RankInputs],
    experts: usize,
    plan: &[IntranodeDispatch],
) -> anyhow::Result<bool> {
    let ys: Vec<Tensor2<bf16>> = plan
        .iter()
        .map(|o| match &o.recv_x {
            Activations::Bf16(x) => Ok(x.clone()),
            Activations::Fp8 { .. } => bail!("normal-mode round trip expects BF16 activations"),
        })
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
    Ok(ok)
}

fn low_latency(
    args: &LayoutArgs,
    inputs: &[RankInputs],
    tokens: usize,
    experts: usize,
) -> anyhow::Result<bool> {
    let mut params = LlParams::new(tokens, experts);
    if args.fp8 {
        params = params.with_fp8(false, false);
    }
    let plan = ll::dispatch(inputs, &params)?;
    let reference = oracle::low_latency::dispatch(inputs, &params)?;
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
    Ok(ok)
}
