//! Verification of the low-latency bench's outputs against the plan (counts, layout ranges,
//! rows canonically, the combine) and the reference digest the simulator bench prints.

use ep_core::plan::low_latency::{
    LlDispatchOutput, LlParams, PartialPrecision, canonicalize, combine_reduced_on_expert_rank,
    dispatch as plan_dispatch,
};

use ep_core::tensor::{Tensor2, Tensor3};
use ep_kernels::gpu::{DevTensor, LlConfig, LlGpuDispatch};
use half::bf16;

use crate::bench::error::BenchError;
use crate::bench::gpu::gpu_err;

/// The plan a call's outputs are verified against.
pub(super) struct Verify<'a> {
    pub(super) cfg: &'a LlConfig,
    /// The ranks the group drives (outputs are indexed like this list).
    pub(super) local: &'a [usize],
    /// The plan's canonical digests.
    pub(super) digest: &'a ep_core::digest::RunDigest,
    pub(super) plan: &'a [Option<LlDispatchOutput>],
    pub(super) want: &'a [Option<Tensor2<bf16>>],
}

/// Counts, layout ranges and `combined_x` bit for bit against the plan: the mismatches.
/// The plan's outputs for `inputs`: dispatch, the simulator bench's expert outputs (the
/// identity over the received rows), the combine reduced on the expert's rank (BF16 partials, or
/// LogFMT-10 ones with `logfmt`), and their canonical digest — the one `--backend sim` prints
/// for the same flags.
pub(super) struct Reference {
    pub(super) plan: Vec<Option<LlDispatchOutput>>,
    pub(super) expert_out: Vec<Option<Tensor3<bf16>>>,
    pub(super) want: Vec<Option<Tensor2<bf16>>>,
    pub(super) digest: ep_core::digest::RunDigest,
}

pub(super) fn reference(
    inputs: &[ep_core::RankInputs],
    params: &LlParams,
    logfmt: bool,
) -> Result<Reference, BenchError> {
    let reference = |what: &'static str| {
        move |e: ep_core::Error| BenchError::Reference {
            what,
            source: Box::new(e),
        }
    };
    let plan = plan_dispatch(inputs, params).map_err(reference("plan::low_latency::dispatch"))?;
    let expert_out = crate::bench::low_latency::identity_expert_outputs(&plan)?;
    let handles: Vec<_> = plan
        .iter()
        .map(|p| p.as_ref().map(|p| p.handle.clone()))
        .collect();
    let want = combine_reduced_on_expert_rank(
        inputs,
        &handles,
        &expert_out,
        params,
        if logfmt {
            PartialPrecision::LogFmt10
        } else {
            PartialPrecision::Bf16
        },
    )
    .map_err(reference(
        "plan::low_latency::combine_reduced_on_expert_rank",
    ))?;
    let digest = ep_core::digest::low_latency(&plan, &want).map_err(reference("digest"))?;
    Ok(Reference {
        plan,
        expert_out,
        want,
        digest,
    })
}

pub(super) fn verify(
    out: &[LlGpuDispatch],
    combined: &[DevTensor],
    v: &Verify<'_>,
) -> Result<(Vec<String>, ep_core::digest::RunDigest), BenchError> {
    let (cfg, plan, want) = (v.cfg, v.plan, v.want);
    let r = plan.len();
    let mut bad = Vec::new();
    // Every received row, its scales and src_info, canonically (rows per (expert, source) as
    // multisets, as the oracle states them), besides counts and layout ranges exactly.
    let canon = |x: &LlDispatchOutput| {
        canonicalize(x).map_err(|e| BenchError::Reference {
            what: "plan::low_latency::canonicalize",
            source: Box::new(e),
        })
    };
    // Every rank's slot, the local ranks' filled (a rank process holds only its own).
    let mut gpu_disp: Vec<Option<LlDispatchOutput>> = vec![None; r];
    for (o, &d) in out.iter().zip(v.local) {
        let Some(p) = &plan[d] else { continue };
        check_counts(d, o, p, &mut bad)?;
        let host = o
            .download(cfg)
            .map_err(gpu_err("downloading the dispatch"))?;
        if let Some(diff) = canon(&host)?.first_difference(&canon(p)?) {
            bad.push(format!("rank {d}: dispatch differs from the plan: {diff}"));
        }
        gpu_disp[d] = Some(host);
    }
    let mut gpu_comb: Vec<Option<Tensor2<bf16>>> = vec![None; r];
    for (c, &s) in combined.iter().zip(v.local) {
        let Some(wnt) = &want[s] else { continue };
        let got: Tensor2<bf16> = c.download().map_err(gpu_err("downloading combined_x"))?;
        let diff = got
            .data()
            .iter()
            .zip(wnt.data())
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        if diff > 0 {
            bad.push(format!(
                "rank {s}: {diff} combined elements differ from the plan"
            ));
        }
        gpu_comb[s] = Some(got);
    }
    // The canonical digests: per local rank against the plan's, and the run's when every rank
    // is here.
    let reference = |e: ep_core::Error| BenchError::Reference {
        what: "digest",
        source: Box::new(e),
    };
    let mut ranks = v.digest.ranks.clone();
    for &d in v.local {
        ranks[d] = ep_core::digest::low_latency_rank(d, gpu_disp[d].as_ref(), gpu_comb[d].as_ref())
            .map_err(reference)?;
        if ranks[d] != v.digest.ranks[d] {
            bad.push(format!(
                "rank {d}: the canonical digest differs from the plan's"
            ));
        }
    }
    let gpu_digest = if v.local.len() == r {
        ep_core::digest::low_latency(&gpu_disp, &gpu_comb).map_err(reference)?
    } else {
        ep_core::digest::RunDigest {
            ranks,
            total: v.digest.total,
        }
    };
    if gpu_digest.total != v.digest.total {
        bad.push("the canonical digest differs from the plan's".into());
    }
    Ok((bad, gpu_digest))
}

pub(super) fn check_counts(
    d: usize,
    o: &LlGpuDispatch,
    p: &ep_core::plan::low_latency::LlDispatchOutput,
    bad: &mut Vec<String>,
) -> Result<(), BenchError> {
    let count: Tensor2<i32> = o
        .recv_count
        .download()
        .map_err(gpu_err("downloading recv_count"))?;
    if count.data() != &p.recv_count[..] {
        bad.push(format!("rank {d}: recv_count differs from the plan"));
    }
    let range: Tensor2<i64> = o
        .recv_layout_range
        .download()
        .map_err(gpu_err("downloading layout_range"))?;
    if range.data() != p.handle.layout_range.data() {
        bad.push(format!("rank {d}: layout_range differs from the plan"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::BenchArgs;
    use crate::workload::{self, Defaults};
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    /// The reference the GPU bench requires its outputs' digest to equal is the digest the
    /// simulator bench prints for the same flags (same workload, same identity expert), so an
    /// `ep bench --backend gpu --mode low-latency` that verifies gives `--backend sim`'s digest.
    #[test]
    fn the_gpu_reference_digest_is_the_simulators() {
        for extra in [
            &[][..],
            &["--no-fp8"][..],
            &["--round-scale", "--ue8m0"][..],
        ] {
            let mut argv = vec![
                "bench",
                "--mode",
                "low-latency",
                "--ranks",
                "2",
                "--tokens",
                "24",
                "--hidden",
                "512",
                "--topk",
                "4",
                "--experts",
                "8",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--quiet",
            ];
            argv.extend_from_slice(extra);
            let args = Cli::try_parse_from(&argv).expect("flags").bench;
            let sim = crate::bench::run(&args).expect("sim bench");
            assert_eq!(sim.exit_code(), 0, "{extra:?}");
            let defaults = Defaults {
                hidden: 7168,
                low_latency_fp8: true,
            };
            let w = workload::load(&args.workload, &defaults).expect("workload");
            let n = w.inputs.iter().map(|i| i.num_tokens()).max().unwrap_or(0);
            let params = w.ll_cast().apply(LlParams::new(n.max(1), w.num_experts));
            let r = reference(&w.inputs, &params, false).expect("reference");
            assert_eq!(
                r.digest.total.to_string(),
                sim.report.digest.total,
                "{extra:?}: the GPU bench's reference digest differs from the simulator's"
            );
        }
    }
}
