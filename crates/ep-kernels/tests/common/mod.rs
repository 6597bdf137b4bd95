//! What the GPU normal-mode tests share (`gpu_normal`: co-resident ranks; `gpu_normal_procs`:
//! ranks in several processes): workloads with wide-range activations, uploads, and runs of a
//! case on a group compared with the plan bit for bit, for the group's **local** ranks (every
//! process generates every rank's inputs from the seed, uploads its own, and checks its own
//! against the plan of the whole world).

#![allow(
    dead_code,
    reason = "each test binary uses a part of the shared helpers"
)]

pub(crate) mod ll;
pub(crate) mod procs;

use std::sync::Arc;

use ep_core::digest;
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{
    DispatchOptions, IntranodeDispatch, IntranodeHandle, intranode_combine, intranode_dispatch_all,
    intranode_dispatch_cached,
};
use ep_core::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use ep_core::protocol::layout::{NormalCtrl, NormalData, RowFormat, align128};
use ep_core::routing::{Activations, RankInputs};
use ep_core::tensor::Tensor2;
use ep_core::workload::{Routing, WorkloadSpec};
use ep_kernels::gpu::{
    CombineSource, DType, DevTensor, Device, GpuCombineArgs, GpuCombined, GpuDispatch,
    GpuDispatchArgs, GpuLayout, GpuRankInputs, NormalGroup,
};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// GPU `ordinal`, or a panic saying what is missing.
pub(crate) fn device_at(ordinal: usize) -> Arc<Device> {
    Device::open(ordinal).expect("these tests need a GPU (run them with scripts/gpu-run.sh)")
}

/// A finite BF16 value anywhere from 2^-60 to 2^60 in magnitude, or zero (sums of up to 8 of
/// them in f32 depend on their order).
pub(crate) fn wide_bf16(rng: &mut ChaCha8Rng) -> bf16 {
    wide_bf16_within(rng, 60)
}

/// A finite BF16 value from 2^-`max_exp` to 2^`max_exp` in magnitude, or a signed zero.
pub(crate) fn wide_bf16_within(rng: &mut ChaCha8Rng, max_exp: i32) -> bf16 {
    match rng.random_range(0..16) {
        0 => bf16::ZERO,
        1 => bf16::NEG_ZERO,
        _ => {
            let e: i32 = rng.random_range(-max_exp..=max_exp);
            let m: f32 = 1.0 + rng.random_range(0..128) as f32 / 128.0;
            let s = if rng.random_bool(0.5) { -1.0 } else { 1.0 };
            bf16::from_f32(s * m * 2f32.powi(e))
        }
    }
}

pub(crate) fn wide_tensor(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Tensor2<bf16> {
    Tensor2::from_fn(rows, cols, |_, _| wide_bf16(rng))
}

#[derive(Clone, Debug)]
pub(crate) struct Case {
    pub(crate) ranks: usize,
    pub(crate) tokens: usize,
    pub(crate) hidden: usize,
    pub(crate) topk: usize,
    pub(crate) experts: usize,
    pub(crate) fp8: bool,
    pub(crate) masked: usize,
    pub(crate) routing: Routing,
    pub(crate) worst: bool,
    pub(crate) sms: usize,
    pub(crate) alignment: usize,
    pub(crate) biases: usize,
    pub(crate) seed: u64,
}

impl Case {
    pub(crate) fn new(
        ranks: usize,
        tokens: usize,
        hidden: usize,
        topk: usize,
        experts: usize,
    ) -> Self {
        Self {
            ranks,
            tokens,
            hidden,
            topk,
            experts,
            fp8: false,
            masked: tokens / 7,
            routing: Routing::Uniform,
            worst: false,
            sms: 8,
            alignment: 1,
            biases: 2,
            seed: 1,
        }
    }

    /// `num_nvl_bytes` that hold every rank's rows of this case (and some).
    pub(crate) fn arena_bytes(&self) -> u64 {
        let rows = self.ranks * self.tokens + 64;
        let fmt = RowFormat {
            hidden: self.hidden,
            elem_bytes: if self.fp8 { 1 } else { 2 },
            num_scales: if self.fp8 {
                self.hidden.div_ceil(128)
            } else {
                0
            },
            num_topk: self.topk,
        };
        align128(
            NormalCtrl {
                num_ranks: self.ranks,
            }
            .bytes(),
        ) + NormalData::data_bytes_for(
            self.ranks,
            rows as u64,
            fmt.dispatch_record(),
            fmt.combine_record(),
        )
    }
}

/// Every rank's inputs of `case` (the same in every process).
pub(crate) fn inputs_of(case: &Case) -> Vec<RankInputs> {
    let mut spec = WorkloadSpec::new(
        case.ranks,
        case.tokens,
        case.hidden,
        case.topk,
        case.experts,
        case.seed,
    );
    spec.masked_per_rank = case.masked.min(case.tokens * case.topk);
    spec.routing = case.routing;
    spec.fp8 = case.fp8;
    let mut inputs = spec.generate().expect("workload");
    if !case.fp8 {
        let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0x5eed);
        for inp in &mut inputs {
            inp.x = Activations::Bf16(wide_tensor(&mut rng, case.tokens, case.hidden));
        }
    }
    inputs
}

/// What the device holds for one rank's inputs.
pub(crate) struct DevInputs {
    pub(crate) x: DevTensor,
    pub(crate) scales: Option<DevTensor>,
    pub(crate) idx: DevTensor,
    pub(crate) w: DevTensor,
}

/// Uploads the inputs of the world ranks `ranks` (in that order).
pub(crate) fn upload(dev: &Device, inputs: &[RankInputs], ranks: &[usize]) -> Vec<DevInputs> {
    let ctx = dev.context();
    ranks
        .iter()
        .map(|&r| {
            let inp = &inputs[r];
            let (x, scales) = match &inp.x {
                Activations::Bf16(t) => (DevTensor::upload(ctx, t).unwrap(), None),
                Activations::Fp8 { data, scales } => {
                    let d = DevTensor::upload(ctx, data).unwrap();
                    let d = DevTensor::contiguous(
                        d.buffer().clone(),
                        0,
                        DType::F8E4M3,
                        data.rows(),
                        data.cols(),
                    );
                    (d, Some(DevTensor::upload(ctx, scales).unwrap()))
                }
            };
            DevInputs {
                x,
                scales,
                idx: DevTensor::upload(ctx, &inp.topk_idx).unwrap(),
                w: DevTensor::upload(ctx, &inp.topk_weights).unwrap(),
            }
        })
        .collect()
}

pub(crate) fn rank_inputs(d: &[DevInputs], with_topk: bool) -> Vec<GpuRankInputs<'_>> {
    d.iter()
        .map(|i| GpuRankInputs {
            x: &i.x,
            x_scales: i.scales.as_ref(),
            topk_idx: with_topk.then_some(&i.idx),
            topk_weights: with_topk.then_some(&i.w),
        })
        .collect()
}

pub(crate) fn host_layout(l: &GpuLayout) -> DispatchLayout {
    l.download().unwrap()
}

/// A GPU dispatch as the plan's host type; in worst-token mode `num_recv_tokens` is
/// `usize::MAX` (the host never learned it; the caller checks the rows instead).
pub(crate) fn host_dispatch(out: &GpuDispatch) -> IntranodeDispatch {
    let (mut d, n) = out.download().unwrap();
    d.handle.num_recv_tokens = n.unwrap_or(usize::MAX);
    d
}

pub(crate) fn host_combined(got: &[GpuCombined]) -> Vec<CombineOutput> {
    got.iter().map(|c| c.download().unwrap()).collect()
}

/// The layouts of every rank and the plan of `case`'s dispatch (all ranks), with the worst-token
/// row count used (0 unless `case.worst`).
pub(crate) fn plan_of(
    case: &Case,
    inputs: &[RankInputs],
) -> (Vec<DispatchLayout>, Vec<IntranodeDispatch>, usize) {
    let r = case.ranks;
    let layouts = host_layouts(case, inputs);
    let max_recv = (0..r)
        .map(|d| {
            layouts
                .iter()
                .map(|l| l.num_tokens_per_rank[d] as usize)
                .sum::<usize>()
        })
        .max()
        .unwrap();
    let worst = if case.worst { max_recv + 5 } else { 0 };
    let plan = plan_with_worst(case, inputs, &layouts, worst);
    (layouts, plan, worst)
}

/// The plan of `case`'s dispatch (all ranks) with `worst` rows per rank (0: exact).
pub(crate) fn plan_with_worst(
    case: &Case,
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    worst: usize,
) -> Vec<IntranodeDispatch> {
    let opts = DispatchOptions {
        num_channels: case.sms / 2,
        expert_alignment: case.alignment,
        num_worst_tokens: worst,
        with_topk: true,
    };
    intranode_dispatch_all(inputs, layouts, case.experts, &opts).unwrap()
}

/// Every rank's layout of `case` on the host.
pub(crate) fn host_layouts(case: &Case, inputs: &[RankInputs]) -> Vec<DispatchLayout> {
    inputs
        .iter()
        .enumerate()
        .map(|(s, i)| {
            get_dispatch_layout_for_rank(s, &i.topk_idx, case.experts, case.ranks).unwrap()
        })
        .collect()
}

/// Random expert outputs for every rank's received rows (`dispatched[d]`'s) and `case.biases`
/// biases per rank, drawn from `rng` in rank order (so every process draws the same).
#[allow(clippy::type_complexity)]
pub(crate) fn expert_outputs(
    rng: &mut ChaCha8Rng,
    case: &Case,
    dispatched: &[IntranodeDispatch],
) -> (Vec<Tensor2<bf16>>, Vec<Vec<Tensor2<bf16>>>) {
    let ys = dispatched
        .iter()
        .map(|p| wide_tensor(rng, p.handle.recv_src_idx.len(), case.hidden))
        .collect();
    let biases = (0..case.ranks)
        .map(|_| {
            (0..case.biases)
                .map(|_| wide_tensor(rng, case.tokens, case.hidden))
                .collect()
        })
        .collect();
    (ys, biases)
}

/// The plan's combine of expert outputs `ys` with biases `biases` after the dispatch `plan`
/// (every rank), with the dispatched weights.
pub(crate) fn plan_combine(
    plan: &[IntranodeDispatch],
    ys: &[Tensor2<bf16>],
    biases: &[Vec<Tensor2<bf16>>],
) -> Vec<CombineOutput> {
    let handles: Vec<IntranodeHandle> = plan.iter().map(|p| p.handle.clone()).collect();
    let args: Vec<CombineArgs<'_>> = (0..plan.len())
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: plan[d].recv_topk_weights.as_ref(),
            bias: &biases[d],
        })
        .collect();
    intranode_combine(&handles, &args).unwrap()
}

/// Layout, dispatch and both combines of `case` on `g`'s local ranks, each compared with the
/// plan bit for bit; returns the local ranks' digests (checked against the plan's, and the
/// whole run's too when every rank is local).
pub(crate) fn run_case(g: &mut NormalGroup, case: &Case) -> Vec<digest::Digest> {
    run_case_with(g, case, &mut |_, _| {})
}

/// [`run_case`], calling `after(g, what)` once each operation's kernels finished (`what`:
/// "dispatch", "combine from rows", "combine in place", "combine back to back": the second of
/// two), e.g. to read its protocol trace.
pub(crate) fn run_case_with(
    g: &mut NormalGroup,
    case: &Case,
    after: &mut dyn FnMut(&mut NormalGroup, &str),
) -> Vec<digest::Digest> {
    let dev = g.device().clone();
    let local = g.local_ranks();
    let inputs = inputs_of(case);
    let r = case.ranks;
    let e = case.experts;
    assert_eq!(g.num_ranks(), r, "the group's world is the case's");
    let (layouts, plan, worst) = plan_of(case, &inputs);

    let dins = upload(&dev, &inputs, &local);
    g.fill_arenas_for_test(0xa5).unwrap();
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let glay = g.layout(&idx, e).unwrap();
    g.sync().unwrap();
    for (l, &s) in glay.iter().zip(&local) {
        assert_eq!(host_layout(l), layouts[s], "layout of rank {s}, {case:?}");
    }
    let out = g
        .dispatch(
            &rank_inputs(&dins, true),
            &glay,
            e,
            &GpuDispatchArgs {
                expert_alignment: case.alignment,
                num_worst_tokens: worst,
            },
        )
        .unwrap();
    g.sync().unwrap();
    after(g, "dispatch");
    let mut host: Vec<IntranodeDispatch> = out.iter().map(host_dispatch).collect();
    for (h, &d) in host.iter_mut().zip(&local) {
        let p = &plan[d];
        if case.worst {
            assert_eq!(h.handle.num_recv_tokens, usize::MAX);
            h.handle.num_recv_tokens = p.handle.num_recv_tokens;
        }
        assert_eq!(h.recv_x, p.recv_x, "recv_x of rank {d}, {case:?}");
        assert_eq!(h.handle, p.handle, "handle of rank {d}, {case:?}");
        assert_eq!(h, p, "dispatch of rank {d}, {case:?}");
    }

    // Combine from the combine rows: random expert outputs and weights per rank (every rank's
    // drawn, in rank order, so every process draws the same).
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0xc0b1);
    let (ys, biases) = expert_outputs(&mut rng, case, &plan);
    let handles: Vec<IntranodeHandle> = plan.iter().map(|p| p.handle.clone()).collect();
    let want_rows = plan_combine(&plan, &ys, &biases);
    let ctx = dev.context();
    let dys: Vec<DevTensor> = local
        .iter()
        .map(|&d| DevTensor::upload(ctx, &ys[d]).unwrap())
        .collect();
    let dbias: Vec<Vec<DevTensor>> = local
        .iter()
        .map(|&d| {
            biases[d]
                .iter()
                .map(|b| DevTensor::upload(ctx, b).unwrap())
                .collect()
        })
        .collect();
    for i in 0..local.len() {
        g.write_combine_rows(i, &dys[i], out[i].recv_topk_weights.as_ref())
            .unwrap();
    }
    let cargs: Vec<GpuCombineArgs<'_>> = (0..local.len())
        .map(|i| GpuCombineArgs {
            handle: &out[i].handle,
            with_weights: true,
            bias: [dbias[i].first(), dbias[i].get(1)],
        })
        .collect();
    let got = g.combine(CombineSource::Rows, &cargs).unwrap();
    g.sync().unwrap();
    after(g, "combine from rows");
    let got_host = host_combined(&got);
    for (got, &s) in got_host.iter().zip(&local) {
        assert_bits_eq(
            got,
            &want_rows[s],
            &format!("combine from rows, rank {s}, {case:?}"),
        );
    }

    // In place (BF16): the expert is the identity on the received rows.
    if !case.fp8 {
        let xs: Vec<Tensor2<bf16>> = plan
            .iter()
            .map(|p| match &p.recv_x {
                Activations::Bf16(t) => t.clone(),
                Activations::Fp8 { .. } => unreachable!(),
            })
            .collect();
        let want = intranode_combine(
            &handles,
            &(0..r)
                .map(|d| CombineArgs {
                    x: &xs[d],
                    topk_weights: plan[d].recv_topk_weights.as_ref(),
                    bias: &biases[d],
                })
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let got = g.combine(CombineSource::InPlace, &cargs).unwrap();
        g.sync().unwrap();
        after(g, "combine in place");
        for (got, &s) in host_combined(&got).iter().zip(&local) {
            assert_bits_eq(
                got,
                &want[s],
                &format!("combine in place, rank {s}, {case:?}"),
            );
        }
    }

    // Back to back, no host sync: a combine from the rows, the rows rewritten with fresh
    // outputs, a second combine. A rank's combine ends only when every rank pulled from its rows
    // (docs/protocol.md §2.5), so the rewrite, next on its stream, cannot overtake the first
    // combine's pulls, nor the second combine's y_ready the first's waits.
    let (ys2, _) = expert_outputs(&mut rng, case, &plan);
    let want2 = plan_combine(&plan, &ys2, &biases);
    let dys2: Vec<DevTensor> = local
        .iter()
        .map(|&d| DevTensor::upload(ctx, &ys2[d]).unwrap())
        .collect();
    let first = g.combine(CombineSource::Rows, &cargs).unwrap();
    for i in 0..local.len() {
        g.write_combine_rows(i, &dys2[i], out[i].recv_topk_weights.as_ref())
            .unwrap();
    }
    let second = g.combine(CombineSource::Rows, &cargs).unwrap();
    g.sync().unwrap();
    after(g, "combine back to back");
    for (i, &s) in local.iter().enumerate() {
        let what = |n| format!("{n} of two back-to-back combines, rank {s}, {case:?}");
        assert_bits_eq(&host_combined(&first)[i], &want_rows[s], &what("first"));
        assert_bits_eq(&host_combined(&second)[i], &want2[s], &what("second"));
    }

    let mut digests = Vec::with_capacity(local.len());
    for (i, &s) in local.iter().enumerate() {
        let d_gpu = digest::normal_rank(s, &host[i], Some(&got_host[i])).unwrap();
        let d_plan = digest::normal_rank(s, &plan[s], Some(&want_rows[s])).unwrap();
        assert_eq!(d_gpu, d_plan, "digest of rank {s}, {case:?}");
        digests.push(d_gpu);
    }
    if local.len() == r {
        let d_gpu = digest::normal(&host, &got_host).unwrap();
        let d_plan = digest::normal(&plan, &want_rows).unwrap();
        assert_eq!(d_gpu.total, d_plan.total, "canonical digest, {case:?}");
    }
    digests
}

/// A dispatch of `case` on `g`, then `rounds` cached dispatches of fresh BF16 rows along its
/// handles, each compared with the plan (rows and source indices), then a full
/// [`run_case`] (the meta buffers change shape between calls, and no allocation may stall a rank
/// whose peers' kernels already wait for it).
pub(crate) fn run_cached(g: &mut NormalGroup, case: &Case, rounds: usize) {
    run_cached_with(g, case, rounds, &mut |_, _| {});
}

/// [`run_cached`], calling `after(g, what)` once each operation's kernels finished (`what`:
/// "dispatch", "cached dispatch", then [`run_case_with`]'s).
pub(crate) fn run_cached_with(
    g: &mut NormalGroup,
    case: &Case,
    rounds: usize,
    after: &mut dyn FnMut(&mut NormalGroup, &str),
) {
    assert!(!case.fp8 && !case.worst, "cached rounds use BF16 rows");
    let dev = g.device().clone();
    let local = g.local_ranks();
    let inputs = inputs_of(case);
    let (_, plan, _) = plan_of(case, &inputs);
    let dins = upload(&dev, &inputs, &local);
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let glay = g.layout(&idx, case.experts).unwrap();
    let first = g
        .dispatch(
            &rank_inputs(&dins, true),
            &glay,
            case.experts,
            &GpuDispatchArgs {
                expert_alignment: case.alignment,
                num_worst_tokens: 0,
            },
        )
        .unwrap();
    g.sync().unwrap();
    after(g, "dispatch");
    for (o, &d) in first.iter().zip(&local) {
        assert_eq!(
            host_dispatch(o).handle,
            plan[d].handle,
            "handle of rank {d}"
        );
    }
    let handles_host: Vec<IntranodeHandle> = plan.iter().map(|p| p.handle.clone()).collect();
    // New rows along the same handles (every rank's drawn, the local ones uploaded).
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 7);
    let xs: Vec<Activations> = (0..case.ranks)
        .map(|_| Activations::Bf16(wide_tensor(&mut rng, case.tokens, case.hidden)))
        .collect();
    let dxs: Vec<DevTensor> = local
        .iter()
        .map(|&d| match &xs[d] {
            Activations::Bf16(t) => DevTensor::upload(dev.context(), t).unwrap(),
            Activations::Fp8 { .. } => unreachable!(),
        })
        .collect();
    let xrefs: Vec<&Activations> = xs.iter().collect();
    for round in 0..rounds {
        g.fill_arenas_for_test(0x5a).unwrap();
        let ins: Vec<GpuRankInputs<'_>> = dxs
            .iter()
            .map(|x| GpuRankInputs {
                x,
                x_scales: None,
                topk_idx: None,
                topk_weights: None,
            })
            .collect();
        let hs: Vec<_> = first.iter().map(|o| &o.handle).collect();
        let out = g.dispatch_cached(&ins, &hs).unwrap();
        g.sync().unwrap();
        after(g, "cached dispatch");
        for (o, &d) in out.iter().zip(&local) {
            let want = intranode_dispatch_cached(&xrefs, &handles_host, d).unwrap();
            let got = Activations::Bf16(o.recv_x.download().unwrap());
            assert_eq!(got, want, "cached dispatch round {round}, rank {d}");
            assert_eq!(
                o.recv_src_idx.download::<i32>().unwrap().into_data(),
                handles_host[d].recv_src_idx
            );
        }
    }
    run_case_with(g, case, after);
}

pub(crate) use ep_core::numerics::calc_diff;

/// DeepEP's round trip (its `test_intranode.py`): dispatch BF16 `x`, combine the received rows
/// unchanged (in place, no weights, no bias); each token comes back as `x` times the number of
/// ranks it went to, so `calc_diff(combined / ranks, x) < 5e-6`. Tokens sent nowhere combine
/// to zero.
pub(crate) fn round_trip_calc_diff(g: &mut NormalGroup, case: &Case) -> f64 {
    assert!(!case.fp8, "the round trip dispatches BF16");
    let dev = g.device().clone();
    let local = g.local_ranks();
    let mut c = case.clone();
    // Moderate values: calc_diff is a relative measure dominated by the largest terms.
    c.seed ^= 0xdee9;
    let mut inputs = inputs_of(&c);
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
    for inp in &mut inputs {
        inp.x = Activations::Bf16(Tensor2::from_fn(c.tokens, c.hidden, |_, _| {
            bf16::from_f32(rng.random_range(-4.0f32..4.0))
        }));
    }
    let dins = upload(&dev, &inputs, &local);
    g.fill_arenas_for_test(0x3c).unwrap();
    let idx: Vec<&DevTensor> = dins.iter().map(|d| &d.idx).collect();
    let glay = g.layout(&idx, c.experts).unwrap();
    let out = g
        .dispatch(
            &rank_inputs(&dins, true),
            &glay,
            c.experts,
            &GpuDispatchArgs::default(),
        )
        .unwrap();
    let cargs: Vec<GpuCombineArgs<'_>> = out
        .iter()
        .map(|o| GpuCombineArgs {
            handle: &o.handle,
            with_weights: false,
            bias: [None, None],
        })
        .collect();
    let got = g.combine(CombineSource::InPlace, &cargs).unwrap();
    g.sync().unwrap();
    let mut worst = 0.0f64;
    for ((comb, l), &s) in host_combined(&got).iter().zip(&glay).zip(&local) {
        let in_rank = host_layout(l).is_token_in_rank;
        let Activations::Bf16(x) = &inputs[s].x else {
            unreachable!()
        };
        let h = c.hidden;
        let n: Vec<f64> = (0..c.tokens)
            .map(|t| (0..c.ranks).filter(|&d| in_rank.get(t, d)).count() as f64)
            .collect();
        let got = comb.combined_x.data().iter().enumerate().map(|(i, v)| {
            let k = n[i / h];
            if k == 0.0 {
                0.0
            } else {
                f64::from(v.to_f32()) / k
            }
        });
        let want = x.data().iter().enumerate().map(|(i, v)| {
            if n[i / h] == 0.0 {
                0.0
            } else {
                f64::from(v.to_f32())
            }
        });
        let d = calc_diff(got, want);
        assert!(d < 5e-6, "round trip of rank {s}: calc_diff {d}, {c:?}");
        worst = worst.max(d);
    }
    worst
}

pub(crate) fn assert_bits_eq(got: &CombineOutput, want: &CombineOutput, what: &str) {
    let gx: Vec<u16> = got.combined_x.data().iter().map(|v| v.to_bits()).collect();
    let wx: Vec<u16> = want.combined_x.data().iter().map(|v| v.to_bits()).collect();
    if gx != wx {
        let i = gx.iter().zip(&wx).position(|(a, b)| a != b).unwrap();
        let h = got.combined_x.cols();
        panic!(
            "{what}: combined_x differs first at token {} column {}: {:#06x} vs {:#06x}",
            i / h,
            i % h,
            gx[i],
            wx[i]
        );
    }
    let bits = |t: &Option<Tensor2<f32>>| {
        t.as_ref()
            .map(|t| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>())
    };
    assert_eq!(
        bits(&got.combined_topk_weights),
        bits(&want.combined_topk_weights),
        "{what}: weights"
    );
}
