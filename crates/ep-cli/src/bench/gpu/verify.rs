//! Verification of a set's dispatch and combine against the plan, bit for bit, every output.

use ep_core::buffer::NormalDispatchArgs;
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{
    DispatchOptions, IntranodeDispatch, intranode_combine, intranode_dispatch_all,
};
use ep_core::routing::Activations;
use ep_core::{Buffer, Tensor2};
use ep_kernels::gpu::{DevTensor, Gpu, GpuCombineIn, GpuDispatch};
use half::bf16;

use super::group;
use super::inputs::{Set, identity_rows};
use super::timing::{core_err, gpu_err};
use crate::bench::error::BenchError;

/// What verification found.
#[derive(Default)]
pub(super) struct Verdict {
    pub(super) checked: usize,
    pub(super) failures: Vec<String>,
}

/// What [`verify_set`] ran: the GPU's outputs (downloaded, and on the device) and the plan's.
pub(super) struct Verified {
    pub(super) host: Vec<IntranodeDispatch>,
    pub(super) comb: Vec<CombineOutput>,
    pub(super) out: Vec<GpuDispatch>,
    pub(super) plan: Vec<IntranodeDispatch>,
    pub(super) plan_comb: Vec<CombineOutput>,
}

/// Dispatch + identity combine of `set` through the public API (`Buffer<Gpu>`: the same
/// `Buffer` as the simulator's), compared with the plan.
pub(super) fn verify_set(
    buf: &mut Buffer<Gpu>,
    set: &Set,
    num_experts: usize,
    verdict: &mut Verdict,
    what: &str,
) -> Result<Verified, BenchError> {
    let r = buf.num_ranks();
    let sms = buf.transport().num_sms();
    let opts = DispatchOptions {
        num_channels: sms / 2,
        expert_alignment: 1,
        num_worst_tokens: 0,
        with_topk: true,
    };
    let plan =
        intranode_dispatch_all(&set.host, &set.layouts, num_experts, &opts).map_err(|e| {
            BenchError::Reference {
                what: "plan dispatch",
                source: Box::new(e),
            }
        })?;
    let ys: Vec<Tensor2<bf16>> = plan.iter().map(identity_rows).collect::<Result<_, _>>()?;
    let handles: Vec<_> = plan.iter().map(|p| p.handle.clone()).collect();
    let cargs: Vec<CombineArgs<'_>> = (0..r)
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: plan[d].recv_topk_weights.as_ref(),
            bias: &[],
        })
        .collect();
    let plan_comb = intranode_combine(&handles, &cargs).map_err(|e| BenchError::Reference {
        what: "plan combine",
        source: Box::new(e),
    })?;

    group(buf)?
        .fill_arenas_for_test(0xa5)
        .map_err(gpu_err("poison arenas"))?;
    let lay = buf
        .get_dispatch_layout(&set.idx, num_experts)
        .map_err(core_err("layout"))?;
    let config = ep_core::config::Config::new(sms, 8, 256, 6, 128).map_err(core_err("config"))?;
    let out = buf
        .dispatch(
            &set.buffer_inputs(),
            &lay,
            num_experts,
            &NormalDispatchArgs::new(config),
        )
        .map_err(core_err("dispatch"))?;
    buf.sync().map_err(core_err("dispatch"))?;
    let mut host = Vec::with_capacity(set.local.len());
    for (l, &s) in lay.iter().zip(&set.local) {
        verdict.checked += 1;
        if l.download().map_err(gpu_err("download"))? != set.layouts[s] {
            verdict
                .failures
                .push(format!("{what}: layout of rank {s} differs from the plan"));
        }
    }
    for (o, &s) in out.iter().zip(&set.local) {
        let (h, _) = o.download().map_err(gpu_err("download"))?;
        verdict.checked += 1;
        if h != plan[s] {
            verdict.failures.push(format!(
                "{what}: dispatch of rank {s} differs from the plan"
            ));
        }
        host.push(h);
    }
    // The identity expert: BF16 rows are combined where they lie (x = recv_x), FP8 rows'
    // BF16 expert outputs are copied into the combine rows by the Buffer's executor.
    let fp8 = matches!(set.host[0].x, Activations::Fp8 { .. });
    let ctx = buf.transport().device().context().clone();
    let dys: Vec<DevTensor> = if fp8 {
        set.local
            .iter()
            .map(|&s| DevTensor::upload(&ctx, &ys[s]))
            .collect::<Result<_, _>>()
            .map_err(gpu_err("upload expert rows"))?
    } else {
        Vec::new()
    };
    let gargs: Vec<GpuCombineIn<'_>> = out
        .iter()
        .enumerate()
        .map(|(i, o)| GpuCombineIn {
            x: if fp8 { &dys[i] } else { &o.recv_x },
            topk_weights: o.recv_topk_weights.as_ref(),
            bias: &[],
        })
        .collect();
    let ghandles: Vec<_> = out.iter().map(|o| o.handle.clone()).collect();
    let comb = buf
        .combine(&ghandles, &gargs)
        .map_err(core_err("combine"))?;
    buf.sync().map_err(core_err("combine"))?;
    let mut host_comb = Vec::with_capacity(set.local.len());
    for (c, &s) in comb.iter().zip(&set.local) {
        let c = c.download().map_err(gpu_err("download"))?;
        verdict.checked += 1;
        let bits = |t: &Tensor2<bf16>| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        if bits(&c.combined_x) != bits(&plan_comb[s].combined_x)
            || c.combined_topk_weights != plan_comb[s].combined_topk_weights
        {
            verdict
                .failures
                .push(format!("{what}: combine of rank {s} differs from the plan"));
        }
        host_comb.push(c);
    }
    Ok(Verified {
        host,
        comb: host_comb,
        out,
        plan,
        plan_comb,
    })
}
