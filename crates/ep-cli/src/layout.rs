//! `ep layout`: generate a seeded workload (or read one from `.npy` files), compute every rank's
//! dispatch layout and outputs with the plan, check them against the independent oracle
//! (dispatch and combine), print a per-rank summary with DeepEP's byte counts and the canonical
//! output digest, and optionally dump the inputs and every output. The simulator backend's
//! `ep bench` builds on the same pieces (`ep_cli::io`, `ep_core::digest`).

use std::time::Instant;

use anyhow::Context;
use clap::Args;
use ep_cli::io::{self, Outputs};
use ep_cli::preflight;
use ep_cli::workload::{self, Defaults, Mode, Workload, WorkloadArgs};
use ep_core::oracle;
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{self, DispatchOptions, IntranodeDispatch};
use ep_core::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use ep_core::plan::low_latency::{self as ll, LlDispatchOutput, LlParams};
use ep_core::{RankInputs, Tensor2, Tensor3, digest};
use half::bf16;
use serde_json::json;

/// Options of `ep layout`: the shared workload options ([`ep_cli::workload::WorkloadArgs`];
/// defaults are DeepEP's test routings, spec §6.2, §6.4, except the hidden size, which defaults
/// small because the layout does not depend on it: pass `--hidden 7168` for the full byte volume).
#[derive(Debug, Args)]
pub(crate) struct LayoutArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Hidden size for the DeepEP byte counts printed beside the layout.
    #[arg(long, default_value_t = 7168)]
    bytes_hidden: usize,
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
    let w = &args.workload;
    let ll_mode = w.mode == Mode::LowLatency;
    let mode_name = w.mode.name();
    let start = Instant::now();
    // Low-latency dispatch is FP8 unless --no-fp8, as in ep bench (one default, one digest);
    // the small default hidden size is a multiple of FP8 low-latency's 512.
    let defaults = Defaults {
        hidden: 512,
        low_latency_fp8: true,
    };
    let need = preflight::before_load(w, &defaults, preflight::Command::Layout, None)?;
    let workload = workload::load(w, &defaults).context("loading the workload")?;
    let need = need.or(preflight::after_load(
        &workload,
        w,
        preflight::Command::Layout,
    )?);
    println!("ep layout: {}", workload.description);
    if let (Some(dir), Some(need)) = (&w.dump, &need) {
        println!("{}", preflight::dump_line(need, dir));
    }
    if let Some(dir) = &w.dump_inputs {
        println!("inputs written to {}", dir.display());
    }
    let cast = workload.ll_cast();
    let Workload {
        inputs,
        num_experts: experts,
        mut info,
        fp8,
        round_scale,
        use_ue8m0,
        ..
    } = workload;

    let s = io::summarize(&inputs);
    let opts = DispatchOptions {
        num_channels: (w.num_sms / 2).max(1),
        ..DispatchOptions::default()
    };
    let (ok, outputs) = if ll_mode {
        let params = workload::ll_params(cast, &s, experts);
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
        low_latency(args, fp8, &inputs, &params)?
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
        "output digest {} (blake3, canonical format v{})",
        digests.total,
        digest::FORMAT_VERSION
    );
    if let Some(dir) = &w.dump {
        info.backend = "plan".into();
        info.options.extend(
            json!({
                "mode": mode_name,
                "ranks": s.num_ranks,
                "tokens": s.tokens,
                "hidden": s.hidden,
                "topk": s.topk,
                "experts": experts,
                "fp8": fp8,
                "round_scale": round_scale,
                "use_ue8m0": use_ue8m0,
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
        .map(|o| workload::expert_rows(&o.recv_x).map_err(anyhow::Error::from))
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
fn ll_expert(out: &Option<LlDispatchOutput>) -> anyhow::Result<Option<Tensor3<bf16>>> {
    out.as_ref()
        .map(|o| ll::map_rows(o, |_, row| row.iter().map(|&v| bf16::from_f32(v)).collect()))
        .transpose()
        .map_err(Into::into)
}

fn low_latency(
    args: &LayoutArgs,
    fp8: bool,
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
    let msg = if fp8 {
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
        if fp8 {
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
    // What ep-rs returns (and digests, on every backend) is the combine reduced on the expert's
    // rank with BF16 partials (docs/protocol.md §5); DeepEP's order is checked above.
    let returned = ll::combine_reduced_on_expert_rank(
        inputs,
        &handles(&plan),
        &plan_y,
        params,
        ll::PartialPrecision::Bf16,
    )?;
    Ok((ok, RunOutputs::LowLatency(plan, returned)))
}
