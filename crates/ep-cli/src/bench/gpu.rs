//! `ep bench --backend gpu`: normal mode on `--ranks` co-resident ranks of one GPU
//! (`ep_kernels::gpu::NormalGroup`), at each SM count of `--sms-sweep` (default `--num-sms`).
//!
//! Per SM count, every call is timed with CUDA events on each rank's stream, all ranks released
//! together behind a gate (`NormalGroup::timed`), `--gpu-iters` calls (default 50) after
//! `--warmup` + 4 warm-up calls, rotating over `--input-sets` sets of inputs (default 4; set 0 is
//! the workload, set `i` its rows rotated by `i` tokens with the sign flipped for odd `i`: the
//! same routing, other bytes, so no call finds the previous call's rows in L2 — each set is
//! larger than the 60 MB L2 at DeepEP's shapes). A call's time is the slowest rank's; the
//! reported figure is the median over the timed calls. Calls timed:
//!
//! - `dispatch`: the dispatch kernel (count exchange, table, rows, meta), layouts precomputed;
//! - `dispatch+layout`: the whole call, the layout kernel included (and the host's wait for
//!   `num_recv`, which overlaps the rows);
//! - `cached`: dispatch with the set's handle;
//! - `combine`: BF16 rows pulled in place (FP8: from the combine rows, written by the identity
//!   expert once), with the weights;
//! - `ceiling dispatch` / `ceiling combine`: copy kernels moving the same bytes to and from the
//!   same final rows with the same blocks per rank and no protocol (the one-GPU yardstick of
//!   BASELINES.md): the bytes DeepEP counts, so an FP8 row's scales too (before 2026-12-06 the
//!   dispatch ceiling moved x alone, ~3% fewer bytes at FP8); the ratio printed is ceiling time /
//!   call time.
//!
//! Bytes are DeepEP's (spec §6.2): dispatch `recv_x.numel() * 2` per rank (FP8:
//! `numel * (1 + 4/128)`), combine `numel * 2`, averaged over ranks.
//!
//! Verification: at every SM count the first dispatch and combine of set 0 are compared with
//! the plan (`plan::intranode`, itself checked against the oracle) bit for bit, every output;
//! at the first SM count every set is. The canonical digest of set 0 (dispatch + identity-expert
//! combine, as `--backend sim` computes it, at the first SM count of the sweep: the channel count
//! is part of the handle) is printed, must equal the plan's, and is what `--dump DIR` writes.
//! Timed calls are not verified one by one.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use ep_core::buffer::NormalDispatchArgs;
use ep_core::config::BufferConfig;
use ep_core::digest::RunDigest;
use ep_core::numerics::fp8;
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{
    DispatchOptions, IntranodeDispatch, intranode_combine, intranode_dispatch_all,
};
use ep_core::plan::layout::{DispatchLayout, channel_range, get_dispatch_layout_for_rank};
use ep_core::protocol::layout::{NormalCtrl, NormalData, RowFormat, align128};
use ep_core::routing::Activations;
use ep_core::{Buffer, RankInputs, Tensor2};
use ep_kernels::gpu::{
    CombineSource, DType, DevTensor, Device, Gpu, GpuCombineArgs, GpuCombineIn, GpuDispatch,
    GpuDispatchArgs, GpuInputs, GpuLayout, GpuRankInputs, NormalGroup,
};
use half::bf16;

use super::error::BenchError;
use super::procs;
use super::report::median;
use super::{BenchArgs, flip_signs};
use crate::workload::{self, Defaults, Mode};

/// DeepEP V1 on one H200, 2 ranks as 2 processes under MPS (BASELINES.md): (SMs per rank, BF16
/// dispatch, FP8 dispatch, combine) GB/s per rank.
const DEEPEP_ONE_GPU: [(usize, f64, f64, f64); 4] = [
    (24, 307.0, 231.0, 252.0),
    (32, 391.0, 286.0, 316.0),
    (48, 445.0, 351.0, 367.0),
    (64, 463.0, 398.0, 428.0),
];

/// A `Buffer<Gpu>` call's error, with the GPU's own inside when there is one.
pub(super) fn core_err(what: &'static str) -> impl FnOnce(ep_core::Error) -> BenchError {
    move |e| BenchError::GpuBuffer {
        what,
        source: Box::new(e),
    }
}

/// The kernels' group of a `Buffer<Gpu>` (its arena is made with the `Buffer`).
fn group(buf: &mut Buffer<Gpu>) -> Result<&mut NormalGroup, BenchError> {
    buf.transport_mut().normal_mut().ok_or(BenchError::Usage(
        "the GPU buffer has no normal-mode arena".into(),
    ))
}

pub(super) fn gpu_err(what: &'static str) -> impl FnOnce(ep_kernels::Error) -> BenchError {
    move |e| BenchError::Gpu {
        what,
        source: Box::new(e),
    }
}

/// One set of inputs: every rank's on the host (with its layout, the plan needs them all), the
/// process's local ranks' on the device (`x`, `scales`, `idx`, `w` indexed like `local`).
struct Set {
    host: Vec<RankInputs>,
    layouts: Vec<DispatchLayout>,
    local: Vec<usize>,
    x: Vec<DevTensor>,
    scales: Vec<Option<DevTensor>>,
    idx: Vec<DevTensor>,
    w: Vec<DevTensor>,
}

impl Set {
    /// The rows alone (cached dispatch, dispatch without top-k).
    fn inputs_without_topk(&self) -> Vec<GpuRankInputs<'_>> {
        self.inputs()
            .into_iter()
            .map(|i| GpuRankInputs {
                topk_idx: None,
                topk_weights: None,
                ..i
            })
            .collect()
    }

    /// The inputs as the `Buffer` takes them.
    fn buffer_inputs(&self) -> Vec<GpuInputs> {
        (0..self.x.len())
            .map(|r| GpuInputs {
                x: self.x[r].clone(),
                x_scales: self.scales[r].clone(),
                topk_idx: Some(self.idx[r].clone()),
                topk_weights: Some(self.w[r].clone()),
            })
            .collect()
    }

    fn inputs(&self) -> Vec<GpuRankInputs<'_>> {
        (0..self.x.len())
            .map(|r| GpuRankInputs {
                x: &self.x[r],
                x_scales: self.scales[r].as_ref(),
                topk_idx: Some(&self.idx[r]),
                topk_weights: Some(&self.w[r]),
            })
            .collect()
    }
}

/// The slowest rank's time of a call.
pub(super) fn slowest(per_rank: &[f64]) -> f64 {
    per_rank.iter().copied().fold(0.0, f64::max)
}

/// One call enqueued by `f`, timed on every rank (`NormalGroup::timed`): each rank's seconds.
fn timed<T>(
    g: &mut NormalGroup,
    what: &'static str,
    f: impl FnOnce(&mut NormalGroup) -> ep_kernels::Result<T>,
) -> Result<Vec<f64>, BenchError> {
    // One rank per process: the processes meet before each timed call (a no-op otherwise).
    g.barrier().map_err(gpu_err(what))?;
    g.timed(f).map(|(_, t)| t).map_err(gpu_err(what))
}

/// `step(it)` for `total` iterations; the slowest rank's time of each one from `warm` on.
pub(super) fn samples(
    total: usize,
    warm: usize,
    mut step: impl FnMut(usize) -> Result<Vec<f64>, BenchError>,
) -> Result<Vec<f64>, BenchError> {
    let mut out = Vec::with_capacity(total.saturating_sub(warm));
    for it in 0..total {
        let t = step(it)?;
        if it >= warm {
            out.push(slowest(&t));
        }
    }
    Ok(out)
}

/// Set `i` of the rotation: the workload's rows moved by `i` tokens, signs flipped for odd `i`.
fn rotated(base: &[RankInputs], i: usize) -> Vec<RankInputs> {
    let mut out: Vec<RankInputs> = base
        .iter()
        .map(|inp| {
            let t = inp.num_tokens();
            let x = match &inp.x {
                Activations::Bf16(x) => Activations::Bf16(Tensor2::from_fn(t, x.cols(), |r, c| {
                    x.get((r + i) % t.max(1), c)
                })),
                Activations::Fp8 { data, scales } => Activations::Fp8 {
                    data: Tensor2::from_fn(t, data.cols(), |r, c| data.get((r + i) % t.max(1), c)),
                    scales: Tensor2::from_fn(t, scales.cols(), |r, c| {
                        scales.get((r + i) % t.max(1), c)
                    }),
                },
            };
            RankInputs {
                x,
                topk_idx: inp.topk_idx.clone(),
                topk_weights: inp.topk_weights.clone(),
            }
        })
        .collect();
    if i % 2 == 1 {
        flip_signs(&mut out);
    }
    out
}

fn upload_set(
    dev: &Device,
    host: Vec<RankInputs>,
    num_experts: usize,
    local: &[usize],
) -> Result<Set, BenchError> {
    let ctx = dev.context();
    let r = host.len();
    let mut set = Set {
        local: local.to_vec(),
        layouts: Vec::with_capacity(r),
        x: Vec::with_capacity(r),
        scales: Vec::with_capacity(r),
        idx: Vec::with_capacity(r),
        w: Vec::with_capacity(r),
        host: Vec::new(),
    };
    for (s, inp) in host.iter().enumerate() {
        set.layouts.push(
            get_dispatch_layout_for_rank(s, &inp.topk_idx, num_experts, r).map_err(|e| {
                BenchError::Reference {
                    what: "layout",
                    source: Box::new(e),
                }
            })?,
        );
        if !local.contains(&s) {
            continue;
        }
        match &inp.x {
            Activations::Bf16(x) => {
                set.x
                    .push(DevTensor::upload(ctx, x).map_err(gpu_err("upload x"))?);
                set.scales.push(None);
            }
            Activations::Fp8 { data, scales } => {
                let d = DevTensor::upload(ctx, data).map_err(gpu_err("upload x"))?;
                set.x.push(DevTensor::contiguous(
                    d.buffer().clone(),
                    0,
                    DType::F8E4M3,
                    data.rows(),
                    data.cols(),
                ));
                set.scales.push(Some(
                    DevTensor::upload(ctx, scales).map_err(gpu_err("upload scales"))?,
                ));
            }
        }
        set.idx
            .push(DevTensor::upload(ctx, &inp.topk_idx).map_err(gpu_err("upload topk_idx"))?);
        set.w.push(
            DevTensor::upload(ctx, &inp.topk_weights).map_err(gpu_err("upload topk_weights"))?,
        );
    }
    set.host = host;
    Ok(set)
}

/// The identity expert's BF16 output rows of a dispatch (FP8 rows dequantised, as DeepEP's
/// `per_token_cast_back` and `--backend sim`).
fn identity_rows(d: &IntranodeDispatch) -> Result<Tensor2<bf16>, BenchError> {
    match &d.recv_x {
        Activations::Bf16(x) => Ok(x.clone()),
        Activations::Fp8 { data, scales } => {
            let mut out = Tensor2::filled(data.rows(), data.cols(), bf16::ZERO);
            for r in 0..data.rows() {
                fp8::dequantize_row_bf16(data.row(r), scales.row(r), out.row_mut(r)).map_err(
                    |e| BenchError::Reference {
                        what: "FP8 dequantisation",
                        source: Box::new(e),
                    },
                )?;
            }
            Ok(out)
        }
    }
}

/// Final row of every (token, destination) of rank `rank` from its handle: what the ceilings copy.
fn final_rows(d: &IntranodeDispatch, rank: usize) -> Tensor2<i32> {
    let h = &d.handle;
    let r = h.rank_prefix_matrix.rows();
    let t = h.send_head.rows();
    let c_count = h.channel_prefix_matrix.cols();
    let mut out = Tensor2::filled(t, r, -1i32);
    for c in 0..c_count {
        for tok in channel_range(t, c_count, c) {
            for dst in 0..r {
                let sh = h.send_head.get(tok, dst);
                if sh < 0 {
                    continue;
                }
                let base = if rank == 0 {
                    0
                } else {
                    h.rank_prefix_matrix.get(rank - 1, dst)
                };
                let start = if c == 0 {
                    0
                } else {
                    h.channel_prefix_matrix.get(dst, c - 1)
                };
                out.set(tok, dst, base + start + sh);
            }
        }
    }
    out
}

/// What verification found.
#[derive(Default)]
struct Verdict {
    checked: usize,
    failures: Vec<String>,
}

/// What [`verify_set`] ran: the GPU's outputs (downloaded, and on the device) and the plan's.
struct Verified {
    host: Vec<IntranodeDispatch>,
    comb: Vec<CombineOutput>,
    out: Vec<GpuDispatch>,
    plan: Vec<IntranodeDispatch>,
    plan_comb: Vec<CombineOutput>,
}

/// Dispatch + identity combine of `set` through the public API (`Buffer<Gpu>`: the same
/// `Buffer` as the simulator's), compared with the plan.
fn verify_set(
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

/// Median figures of one call kind at one SM count.
#[derive(Clone, Copy, Default, serde::Serialize)]
pub(super) struct Figure {
    pub(super) median_us: f64,
    pub(super) gb_per_s: f64,
}

pub(super) fn figure(samples: &[f64], bytes_per_rank: f64) -> Figure {
    let m = median(samples);
    Figure {
        median_us: m * 1e6,
        gb_per_s: if m > 0.0 {
            bytes_per_rank / m * 1e-9
        } else {
            0.0
        },
    }
}

#[derive(Clone, Default, serde::Serialize)]
struct SmRow {
    sms_per_rank: usize,
    dispatch: Figure,
    dispatch_with_layout: Figure,
    /// The dispatch without top-k (no meta but src_idx): isolates the count exchange against
    /// `cached`, which has none.
    dispatch_no_topk: Figure,
    cached: Figure,
    combine: Figure,
    ceiling_dispatch: Figure,
    ceiling_combine: Figure,
    layout_us: f64,
    /// Dispatch, one measured call: median over blocks of each phase (offsets known, rows
    /// stored, done released, done acquired, meta copied), and the whole kernel (first start to
    /// last end over every rank), microseconds.
    dispatch_phases_us: Vec<f64>,
    /// Combine likewise: y_ready acquired, rows reduced, pulled exchanged; whole kernel.
    combine_phases_us: Vec<f64>,
    /// Host time to enqueue every local rank's call (median over all calls, warm-up included),
    /// microseconds: cached dispatch, combine. Neither waits on the device.
    host_enqueue_us: [f64; 2],
}

/// Median over blocks (of every rank) of the time from stamp `slots[i-1]` (0 first) to
/// `slots[i]`, then the whole span (earliest start to latest end), in microseconds.
pub(super) fn phase_split(stamps: &[Vec<Vec<u64>>], slots: &[usize]) -> Vec<f64> {
    let blocks: Vec<&Vec<u64>> = stamps.iter().flatten().filter(|b| b[0] != 0).collect();
    let mut out = Vec::with_capacity(slots.len() + 1);
    let mut prev = 0;
    for &s in slots {
        let d: Vec<f64> = blocks
            .iter()
            .filter(|b| b[s] >= b[prev] && b[s] != 0)
            .map(|b| (b[s] - b[prev]) as f64 * 1e-3)
            .collect();
        out.push(median(&d));
        prev = s;
    }
    let start = blocks.iter().map(|b| b[0]).min().unwrap_or(0);
    let end = blocks
        .iter()
        .map(|b| b[*slots.last().unwrap_or(&0)])
        .max()
        .unwrap_or(0);
    out.push(end.saturating_sub(start) as f64 * 1e-3);
    out
}

/// Microseconds from the earliest block start (stamp 0) of any rank to a stamp.
pub(super) fn since_first_start(stamps: &[Vec<Vec<u64>>]) -> impl Fn(u64) -> f64 {
    let t0 = stamps
        .iter()
        .flatten()
        .map(|b| b[0])
        .filter(|&v| v != 0)
        .min()
        .unwrap_or(0);
    move |v: u64| v.saturating_sub(t0) as f64 * 1e-3
}

/// Where a measured dispatch's offsets become known, per rank, in microseconds from the
/// earliest block start of any rank: the rank's first block start, its notify block's expert
/// parts fenced (stamp 6), every head word acquired (7) and table ready (1), then over its blocks
/// the median and last "offsets known" (1), the median "rows stored" (2) and the last end (5).
pub(super) fn dispatch_path(stamps: &[Vec<Vec<u64>>]) -> String {
    let us = since_first_start(stamps);
    stamps
        .iter()
        .enumerate()
        .map(|(r, blocks)| {
            let live: Vec<&Vec<u64>> = blocks.iter().filter(|b| b[0] != 0).collect();
            let Some(b0) = live.first() else {
                return format!("rank {r}: no stamps");
            };
            let col = |s: usize| -> Vec<f64> {
                live.iter().filter(|b| b[s] != 0).map(|b| us(b[s])).collect()
            };
            let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
            let first = col(0).iter().copied().fold(f64::INFINITY, f64::min);
            let steps: Vec<String> = (0..b0.len())
                .map(|i| format!("{i}:{:.1}", if b0[i] == 0 { 0.0 } else { us(b0[i]) }))
                .collect();
            format!(
                "rank {r} [block 0 stamps {}]: start {first:.1}..{:.1}, experts {:.1}, heads {:.1}, table {:.1}, offsets median {:.1} last {:.1}, rows median {:.1}, end {:.1}",
                steps.join(" "),
                max(&col(0)),
                us(b0[6]),
                us(b0[7]),
                us(b0[1]),
                median(&col(1)),
                max(&col(1)),
                median(&col(2)),
                max(&col(5)),
            )
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Where a measured dispatch's last blocks spend their time, per rank: the quantiles over blocks
/// of the rows phase (stamp 1 to 2) and of the receive wait (3 to 4), then the rank's
/// last-ending block (stamp 5) split into its start, offsets known, rows stored, done released,
/// done acquired and end, in microseconds from the earliest block start of any rank. Says
/// whether the blocks' spread comes from their row work, from waiting for another rank's
/// channel, or from a late start.
pub(super) fn dispatch_tail(stamps: &[Vec<Vec<u64>>]) -> String {
    let us = since_first_start(stamps);
    let q = |v: &mut Vec<f64>, f: f64| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * f).round() as usize]
    };
    stamps
        .iter()
        .enumerate()
        .map(|(r, blocks)| {
            let live: Vec<(usize, &Vec<u64>)> = blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| b[0] != 0 && b[5] != 0)
                .collect();
            let Some(&(last, lb)) = live.iter().max_by_key(|(_, b)| b[5]) else {
                return format!("rank {r}: no stamps");
            };
            let span = |a: usize, b: usize| -> Vec<f64> {
                live.iter()
                    .filter(|(_, x)| x[b] >= x[a] && x[a] != 0)
                    .map(|(_, x)| (x[b] - x[a]) as f64 * 1e-3)
                    .collect()
            };
            let (mut rows, mut wait) = (span(1, 2), span(3, 4));
            format!(
                "rank {r}: rows took p10 {:.1} p50 {:.1} p90 {:.1} max {:.1}, done wait p50 {:.1} max {:.1}; last block {last}: start {:.1}, offsets {:.1}, rows {:.1}, released {:.1}, acquired {:.1}, end {:.1}",
                q(&mut rows, 0.1),
                q(&mut rows, 0.5),
                q(&mut rows, 0.9),
                q(&mut rows, 1.0),
                q(&mut wait, 0.5),
                q(&mut wait, 1.0),
                us(lb[0]),
                us(lb[1]),
                us(lb[2]),
                us(lb[3]),
                us(lb[4]),
                us(lb[5]),
            )
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Runs `ep bench --backend gpu` (module docs). Returns the exit code: 0 verified, 1 mismatch.
pub fn run(args: &BenchArgs) -> Result<i32, BenchError> {
    let started = Instant::now();
    if args.workload.mode == Mode::LowLatency {
        return super::gpu_ll::run(args);
    }
    if args.gpu_iters == 0 || args.input_sets == 0 {
        return Err(BenchError::Usage(
            "--gpu-iters and --input-sets must be at least 1".into(),
        ));
    }
    let sweep: Vec<usize> = match &args.sms_sweep {
        Some(list) => list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse::<usize>()
                    .map_err(|_| BenchError::Usage(format!("--sms-sweep: {s:?} is not a number")))
            })
            .collect::<Result<_, _>>()?,
        None => vec![args.workload.num_sms],
    };
    // One rank per process (`--procs N`): this process is the launcher, or one of its ranks.
    let me = match args.procs {
        Some(n) => {
            if args.workload.ranks != Some(n) {
                return Err(BenchError::Usage(format!(
                    "--procs {n} runs one rank per process: give --ranks {n} as well"
                )));
            }
            if sweep.len() != 1 || args.workload.dump.is_some() || args.plot.is_some() {
                return Err(BenchError::Usage(
                    "--procs runs one SM count (--num-sms or a one-entry --sms-sweep) without \
                     --dump or --plot (each process holds only its rank's outputs)"
                        .into(),
                ));
            }
            match procs::role() {
                procs::Role::Launcher => return procs::launch(n, Vec::new()),
                procs::Role::Rank { rank, world } => {
                    if world != n {
                        return Err(BenchError::Usage(format!(
                            "this rank process was started for {world} ranks, --procs says {n}"
                        )));
                    }
                    Some(rank)
                }
            }
        }
        None => None,
    };
    let dev = match me {
        Some(_) => procs::device().map_err(gpu_err("opening this rank's GPU"))?,
        None => Device::open(0).map_err(gpu_err("opening GPU 0"))?,
    };
    let defaults = Defaults {
        hidden: 7168,
        low_latency_fp8: true,
    };
    let w = workload::load(&args.workload, &defaults)?;
    let r = w.inputs.len();
    if me.is_some_and(|_| args.procs != Some(r)) {
        return Err(BenchError::Usage(format!(
            "--procs {} with --ranks {r}: one process per rank, so give --procs {r}",
            args.procs.unwrap_or(0)
        )));
    }
    let local: Vec<usize> = match me {
        Some(rank) => vec![rank],
        None => (0..r).collect(),
    };
    let e = w.num_experts;
    let fp8 = w.fp8;
    let hidden = w.inputs[0].x.hidden();
    let k = w.inputs[0].num_topk();
    println!(
        "ep bench: normal mode on GPU {} ({} SMs), {}, {}, {} input sets, {} timed calls per figure",
        dev.ordinal(),
        dev.num_sms(),
        match me {
            Some(rank) => format!("rank {rank} of {r}, one rank per process (figures: this rank)"),
            None => format!("{r} co-resident ranks"),
        },
        w.description,
        args.input_sets,
        args.gpu_iters
    );
    let sets: Vec<Set> = (0..args.input_sets)
        .map(|i| {
            upload_set(
                &dev,
                if i == 0 {
                    w.inputs.clone()
                } else {
                    rotated(&w.inputs, i)
                },
                e,
                &local,
            )
        })
        .collect::<Result<_, _>>()?;
    let max_recv = sets
        .iter()
        .flat_map(|s| {
            (0..r).map(move |d| {
                s.layouts
                    .iter()
                    .map(|l| l.num_tokens_per_rank[d] as usize)
                    .sum::<usize>()
            })
        })
        .max()
        .unwrap_or(0);
    let fmt = RowFormat {
        hidden,
        elem_bytes: if fp8 { 1 } else { 2 },
        num_scales: if fp8 { hidden.div_ceil(128) } else { 0 },
        num_topk: k,
    };
    let nvl_bytes = align128(NormalCtrl { num_ranks: r }.bytes())
        + NormalData::data_bytes_for(
            r,
            max_recv as u64 + 16,
            fmt.dispatch_record(),
            fmt.combine_record(),
        );
    let recv_rows: Vec<Vec<usize>> = sets
        .iter()
        .map(|s| {
            (0..r)
                .map(|d| {
                    s.layouts
                        .iter()
                        .map(|l| l.num_tokens_per_rank[d] as usize)
                        .sum()
                })
                .collect()
        })
        .collect();
    // DeepEP's bytes per rank, averaged over ranks and sets.
    let mean_rows = recv_rows.iter().flatten().sum::<usize>() as f64 / (r * sets.len()) as f64;
    let bf16_bytes = mean_rows * hidden as f64 * 2.0;
    let dispatch_bytes = if fp8 {
        mean_rows * hidden as f64 * (1.0 + 4.0 / 128.0)
    } else {
        bf16_bytes
    };

    let mut verdict = Verdict::default();
    let mut digest: Option<(RunDigest, RunDigest)> = None;
    let mut rows_out = Vec::new();
    for (si, &sms) in sweep.iter().enumerate() {
        let mut exec = match me {
            Some(_) => Gpu::process(dev.clone(), sms, procs::exchange()?),
            None => Gpu::co_resident(dev.clone(), r, sms),
        };
        // A stuck call ends in a typed error within seconds, not the 10 s default.
        exec.set_timeout(std::time::Duration::from_secs(3));
        let mut bcfg = BufferConfig::new(r);
        bcfg.num_nvl_bytes = nvl_bytes;
        let mut buf = Buffer::new(exec, bcfg).map_err(core_err("creating the buffer"))?;
        // Verification, and per set: handles, ceilings' rows, layouts.
        let mut handles: Vec<Vec<GpuDispatch>> = Vec::new();
        let mut dst_rows: Vec<Vec<DevTensor>> = Vec::new();
        let mut layouts: Vec<Vec<GpuLayout>> = Vec::new();
        for (i, set) in sets.iter().enumerate() {
            let full = si == 0 || i == 0;
            let (host, out) = if full {
                let v = verify_set(
                    &mut buf,
                    set,
                    e,
                    &mut verdict,
                    &format!("{sms} SMs, set {i}"),
                )?;
                if si == 0 && i == 0 {
                    let digest_of = |d: &[IntranodeDispatch], c: &[CombineOutput]| {
                        ep_core::digest::normal(d, c).map_err(|e| BenchError::Reference {
                            what: "digest",
                            source: Box::new(e),
                        })
                    };
                    let want = digest_of(&v.plan, &v.plan_comb)?;
                    // One rank per process holds only its rank's outputs (compared with the
                    // plan's bit for bit above): the digest printed is then the plan's.
                    let gpu = if me.is_some() {
                        want.clone()
                    } else {
                        digest_of(&v.host, &v.comb)?
                    };
                    if gpu.total != want.total {
                        verdict
                            .failures
                            .push("the canonical digest differs from the plan's".into());
                    }
                    if let Some(dir) = &args.workload.dump {
                        let view = crate::io::Outputs::Normal {
                            dispatch: &v.host,
                            combine: &v.comb,
                        };
                        crate::io::dump_outputs(dir, &view, &w.info)?;
                    }
                    digest = Some((gpu, want));
                }
                (v.host, v.out)
            } else {
                let g = group(&mut buf)?;
                let idx: Vec<&DevTensor> = set.idx.iter().collect();
                let lay = g.layout(&idx, e).map_err(gpu_err("layout"))?;
                let out = g
                    .dispatch(&set.inputs(), &lay, e, &GpuDispatchArgs::default())
                    .map_err(gpu_err("dispatch"))?;
                g.sync().map_err(gpu_err("dispatch"))?;
                let host = out
                    .iter()
                    .map(|o| o.download().map(|d| d.0))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(gpu_err("download"))?;
                (host, out)
            };
            let ctx = dev.context();
            dst_rows.push(
                set.local
                    .iter()
                    .zip(&host)
                    .map(|(&s, d)| DevTensor::upload(ctx, &final_rows(d, s)))
                    .collect::<Result<_, _>>()
                    .map_err(gpu_err("upload rows"))?,
            );
            let idx: Vec<&DevTensor> = set.idx.iter().collect();
            layouts.push(
                group(&mut buf)?
                    .layout(&idx, e)
                    .map_err(gpu_err("layout"))?,
            );
            handles.push(out);
        }
        // The timed calls go to the kernels' group directly (behind the gate that starts the
        // ranks together); the Buffer's host checks are outside the figures.
        let g = group(&mut buf)?;
        g.sync().map_err(gpu_err("setup"))?;
        let n_sets = sets.len();
        let warm = args.warmup + 4;
        let total = warm + args.gpu_iters;
        let mut row = SmRow {
            sms_per_rank: sms,
            ..SmRow::default()
        };
        let blocks = sms as u32;
        let source = if fp8 {
            CombineSource::Rows
        } else {
            CombineSource::InPlace
        };
        let none = GpuDispatchArgs::default();
        // Dispatch (layouts precomputed).
        let s = samples(total, warm, |it| {
            let i = it % n_sets;
            timed(g, "dispatch", |g| {
                g.dispatch(&sets[i].inputs(), &layouts[i], e, &none)
            })
        })?;
        row.dispatch = figure(&s, dispatch_bytes);
        // Without top-k.
        let s = samples(total, warm, |it| {
            let i = it % n_sets;
            let ins = sets[i].inputs_without_topk();
            timed(g, "dispatch without top-k", |g| {
                g.dispatch(&ins, &layouts[i], e, &none)
            })
        })?;
        row.dispatch_no_topk = figure(&s, dispatch_bytes);
        // The whole call: layout + dispatch; and the layout alone.
        let mut lay_samples = Vec::new();
        let s = samples(total, warm, |it| {
            let set = &sets[it % n_sets];
            let idx: Vec<&DevTensor> = set.idx.iter().collect();
            let t = timed(g, "layout + dispatch", |g| {
                let lay = g.layout(&idx, e)?;
                g.dispatch(&set.inputs(), &lay, e, &none)
            })?;
            let tl = timed(g, "layout", |g| g.layout(&idx, e))?;
            if it >= warm {
                lay_samples.push(slowest(&tl));
            }
            Ok(t)
        })?;
        row.dispatch_with_layout = figure(&s, dispatch_bytes);
        row.layout_us = median(&lay_samples) * 1e6;
        // Cached dispatch.
        let mut host_cached = Vec::new();
        let s = samples(total, warm, |it| {
            let i = it % n_sets;
            let ins = sets[i].inputs_without_topk();
            let hs: Vec<_> = handles[i].iter().map(|o| &o.handle).collect();
            let t = timed(g, "cached dispatch", |g| g.dispatch_cached(&ins, &hs))?;
            host_cached.push(g.last_enqueue().as_secs_f64());
            Ok(t)
        })?;
        row.cached = figure(&s, dispatch_bytes);
        // Combine: each set's rows must be in the arena, so dispatch the set (untimed) first.
        let mut host_combine = Vec::new();
        let s = samples(total, warm, |it| {
            let i = it % n_sets;
            let out = g
                .dispatch(&sets[i].inputs(), &layouts[i], e, &none)
                .and_then(|o| g.sync().map(|()| o))
                .map_err(gpu_err("dispatch before combine"))?;
            let ca = GpuCombineArgs::of_dispatch(&out);
            let t = timed(g, "combine", |g| g.combine(source, &ca))?;
            host_combine.push(g.last_enqueue().as_secs_f64());
            Ok(t)
        })?;
        row.combine = figure(&s, bf16_bytes);
        row.host_enqueue_us = [median(&host_cached) * 1e6, median(&host_combine) * 1e6];
        // Ceilings.
        let drec = fmt.dispatch_record();
        let s = samples(total, warm, |it| {
            let i = it % n_sets;
            let xs: Vec<&DevTensor> = sets[i].x.iter().collect();
            let sc: Vec<Option<&DevTensor>> = sets[i].scales.iter().map(Option::as_ref).collect();
            let dr: Vec<&DevTensor> = dst_rows[i].iter().collect();
            timed(g, "dispatch ceiling", |g| {
                g.ceiling(&xs, &sc, &dr, drec, blocks)
            })
        })?;
        row.ceiling_dispatch = figure(&s, dispatch_bytes);
        if !fp8 {
            // One output per local rank (every rank co-resident, this rank in a rank process).
            let outs: Vec<DevTensor> = sets[0]
                .local
                .iter()
                .map(|&s| {
                    DevTensor::empty(
                        dev.context(),
                        DType::Bf16,
                        sets[0].host[s].num_tokens(),
                        hidden,
                    )
                })
                .collect::<Result<_, _>>()
                .map_err(gpu_err("alloc"))?;
            let s = samples(total, warm, |it| {
                let i = it % n_sets;
                g.dispatch(&sets[i].inputs(), &layouts[i], e, &none)
                    .and_then(|_| g.sync())
                    .map_err(gpu_err("dispatch before ceiling"))?;
                let dr: Vec<&DevTensor> = dst_rows[i].iter().collect();
                let o: Vec<&DevTensor> = outs.iter().collect();
                timed(g, "combine ceiling", |g| g.ceiling_combine(&dr, &o, blocks))
            })?;
            row.ceiling_combine = figure(&s, bf16_bytes);
        }
        // Where a dispatch and a combine spend their time (untimed calls with phase stamps).
        // Behind the gate like the timed calls, so the ranks start together.
        g.measure_phases(true).map_err(gpu_err("phase stamps"))?;
        let mut out = Vec::new();
        timed(g, "measured dispatch", |g| {
            out = g.dispatch(
                &sets[0].inputs(),
                &layouts[0],
                e,
                &GpuDispatchArgs::default(),
            )?;
            Ok(())
        })?;
        let stamps = g.phase_times().map_err(gpu_err("phase stamps"))?;
        row.dispatch_phases_us = phase_split(&stamps, &[1, 2, 3, 4, 5]);
        println!(
            "[gpu {} SMs/rank] dispatch critical path (us from the first block's start): {}",
            sms,
            dispatch_path(&stamps)
        );
        println!(
            "[gpu {} SMs/rank] dispatch tail (us from the first block's start): {}",
            sms,
            dispatch_tail(&stamps)
        );
        let ca = GpuCombineArgs::of_dispatch(&out);
        timed(g, "measured combine", |g| g.combine(source, &ca))?;
        row.combine_phases_us = phase_split(
            &g.phase_times().map_err(gpu_err("phase stamps"))?,
            &[1, 2, 5],
        );
        g.measure_phases(false).map_err(gpu_err("phase stamps"))?;
        print_row(&row, fp8);
        rows_out.push(row);
    }
    let verified = verdict.failures.is_empty();
    if let Some((gpu, want)) = &digest {
        println!(
            "output digest {} (blake3, canonical format v2; {} SMs per rank, i.e. {} channels, as --backend sim --num-sms {}){}",
            gpu.total,
            sweep[0],
            sweep[0] / 2,
            sweep[0],
            if gpu.total == want.total {
                ", equal to the plan's"
            } else {
                ", DIFFERENT from the plan's"
            }
        );
    }
    if verified {
        println!(
            "verified: {} outputs == plan::intranode bit for bit (layout, dispatch, identity-expert combine); timed calls not verified one by one",
            verdict.checked
        );
    } else {
        for f in &verdict.failures {
            println!("MISMATCH {f}");
        }
    }
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
    if let Some(path) = args
        .json
        .as_ref()
        .filter(|_| me.is_none_or(|rank| rank == 0))
    {
        let j = serde_json::json!({
            "ep_rs_version": env!("CARGO_PKG_VERSION"),
            "backend": "gpu",
            "mode": "normal",
            "processes": args.procs,
            "gpu": format!("GPU {} ({} SMs)", dev.ordinal(), dev.num_sms()),
            "ranks": r,
            "workload": w.description,
            "fp8": fp8,
            "input_sets": sets.len(),
            "timed_calls": args.gpu_iters,
            "deepep_bytes_per_rank": { "dispatch": dispatch_bytes, "combine": bf16_bytes },
            "sms": rows_out,
            "digest": digest.as_ref().map(|d| d.0.total.to_string()),
            "verified": verified,
            "checked_outputs": verdict.checked,
            "failures": verdict.failures,
        });
        std::fs::write(path, serde_json::to_string_pretty(&j).unwrap_or_default())
            .map_err(|e| BenchError::Usage(format!("writing {}: {e}", path.display())))?;
    }
    if let Some(path) = &args.plot {
        plot(path, &rows_out, fp8, r)?;
    }
    Ok(if verified { 0 } else { 1 })
}

fn print_row(row: &SmRow, fp8: bool) {
    let p = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);
    println!(
        "[gpu {} SMs/rank] dispatch phases (median over blocks, us): offsets {:.1}, rows {:.1}, done release {:.1}, done wait {:.1}, meta {:.1}; kernel span {:.1} | combine: y_ready {:.1}, reduce {:.1}, pulled {:.1}; span {:.1}",
        row.sms_per_rank,
        p(&row.dispatch_phases_us, 0),
        p(&row.dispatch_phases_us, 1),
        p(&row.dispatch_phases_us, 2),
        p(&row.dispatch_phases_us, 3),
        p(&row.dispatch_phases_us, 4),
        p(&row.dispatch_phases_us, 5),
        p(&row.combine_phases_us, 0),
        p(&row.combine_phases_us, 1),
        p(&row.combine_phases_us, 2),
        p(&row.combine_phases_us, 3),
    );
    let ratio = |ceil: Figure, f: Figure| {
        if f.median_us > 0.0 {
            ceil.median_us / f.median_us
        } else {
            0.0
        }
    };
    println!(
        "[gpu {} SMs/rank] dispatch {}: {:.1} GB/s per rank, {:.1} us ({:.0}% of the same-run ceiling {:.1} GB/s) | with layout {:.1} us ({:.0}%) | layout {:.1} us | no top-k {:.1} us | cached {:.1} GB/s, {:.1} us ({:.0}%)",
        row.sms_per_rank,
        if fp8 { "FP8" } else { "BF16" },
        row.dispatch.gb_per_s,
        row.dispatch.median_us,
        100.0 * ratio(row.ceiling_dispatch, row.dispatch),
        row.ceiling_dispatch.gb_per_s,
        row.dispatch_with_layout.median_us,
        100.0 * ratio(row.ceiling_dispatch, row.dispatch_with_layout),
        row.layout_us,
        row.dispatch_no_topk.median_us,
        row.cached.gb_per_s,
        row.cached.median_us,
        100.0 * ratio(row.ceiling_dispatch, row.cached),
    );
    println!("{}", combine_line(row));
    println!(
        "[gpu {} SMs/rank] host enqueue of every local rank's call (p50): cached dispatch {:.1} us, combine {:.1} us",
        row.sms_per_rank, row.host_enqueue_us[0], row.host_enqueue_us[1]
    );
}

/// The combine's figure line: its ratio to the same-run ceiling, or why there is none (after an
/// FP8 dispatch the combine ceiling, which reads BF16 dispatch rows, is not measured).
fn combine_line(row: &SmRow) -> String {
    let head = format!(
        "[gpu {} SMs/rank] combine BF16: {:.1} GB/s per rank, {:.1} us",
        row.sms_per_rank, row.combine.gb_per_s, row.combine.median_us
    );
    if row.ceiling_combine.median_us > 0.0 && row.combine.median_us > 0.0 {
        format!(
            "{head} ({:.0}% of the same-run ceiling {:.1} GB/s)",
            100.0 * row.ceiling_combine.median_us / row.combine.median_us,
            row.ceiling_combine.gb_per_s
        )
    } else {
        format!("{head} (no same-run ceiling: it reads BF16 dispatch rows, this run's are FP8)")
    }
}

/// GB/s per rank against SMs per rank: ep-rs's calls, the same-run ceilings (dashed) and
/// DeepEP V1's one-GPU figures (BASELINES.md; 2 ranks under MPS) as points.
fn plot(path: &Path, rows: &[SmRow], fp8: bool, ranks: usize) -> Result<(), BenchError> {
    let (w, h, m) = (720.0, 440.0, 60.0);
    let max_x = rows
        .iter()
        .map(|r| r.sms_per_rank)
        .max()
        .unwrap_or(64)
        .max(64) as f64;
    let max_y = rows
        .iter()
        .flat_map(|r| {
            [
                r.dispatch.gb_per_s,
                r.combine.gb_per_s,
                r.ceiling_dispatch.gb_per_s,
                r.ceiling_combine.gb_per_s,
            ]
        })
        .fold(500.0, f64::max)
        * 1.1;
    let x = |v: f64| m + v / max_x * (w - 2.0 * m);
    let y = |v: f64| h - m - v / max_y * (h - 2.0 * m);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<line x1="{m}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{m}" y1="{m}" x2="{m}" y2="{}" stroke="black"/>"#,
        h - m,
        w - m,
        h - m,
        h - m
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">SMs per rank</text>"#,
        w / 2.0,
        h - 20.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">GB/s per rank (DeepEP bytes)</text>"#,
        h / 2.0,
        h / 2.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{m}" y="24">ep-rs normal mode, {ranks} co-resident ranks on one GPU ({})</text>"#,
        if fp8 { "FP8 dispatch" } else { "BF16" }
    );
    for i in 0..=4 {
        let v = max_y * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{v:.0}</text>"#,
            m - 6.0,
            y(v) + 4.0
        );
    }
    for r in rows {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            x(r.sms_per_rank as f64),
            h - m + 16.0,
            r.sms_per_rank
        );
    }
    type Series = (&'static str, &'static str, bool, fn(&SmRow) -> f64);
    let series: [Series; 4] = [
        ("dispatch", "#1f77b4", false, |r| r.dispatch.gb_per_s),
        ("combine", "#d62728", false, |r| r.combine.gb_per_s),
        ("ceiling dispatch", "#1f77b4", true, |r| {
            r.ceiling_dispatch.gb_per_s
        }),
        ("ceiling combine", "#d62728", true, |r| {
            r.ceiling_combine.gb_per_s
        }),
    ];
    for (i, (name, color, dashed, f)) in series.iter().enumerate() {
        let pts: Vec<String> = rows
            .iter()
            .filter(|r| f(r) > 0.0)
            .map(|r| format!("{:.1},{:.1}", x(r.sms_per_rank as f64), y(f(r))))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let dash = if *dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
            pts.join(" ")
        );
        let ly = 44.0 + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{}">{name}</text>"#,
            w - 230.0,
            w - 200.0,
            w - 195.0,
            ly + 4.0
        );
    }
    for (sms, bf, f8, comb) in DEEPEP_ONE_GPU {
        for (v, color) in [(if fp8 { f8 } else { bf }, "#1f77b4"), (comb, "#d62728")] {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="none" stroke="{color}"/>"#,
                x(sms as f64),
                y(v)
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<circle cx="{}" cy="108" r="4" fill="none" stroke="black"/><text x="{}" y="112">DeepEP V1, 1 GPU, 2 ranks (MPS)</text>"#,
        w - 215.0,
        w - 195.0
    );
    s.push_str("</svg>\n");
    std::fs::write(path, s)
        .map_err(|e| BenchError::Usage(format!("writing {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stamps of one block: slot i at `base + at[i]` ns (0 = not reached).
    fn block(base: u64, at: &[u64]) -> Vec<u64> {
        let mut b = vec![0u64; 16];
        for (i, &t) in at.iter().enumerate() {
            b[i] = if t == u64::MAX { 0 } else { base + t };
        }
        b
    }

    #[test]
    fn phases_are_medians_over_blocks_and_the_span_covers_every_rank() {
        // Two ranks of two blocks; rank 1 starts 1 us later.
        let stamps = vec![
            vec![
                block(10_000, &[0, 2_000, 9_000]),
                block(10_000, &[0, 4_000, 11_000]),
            ],
            vec![
                block(11_000, &[0, 2_000, 8_000]),
                block(11_000, &[0, 2_000, 8_000]),
            ],
        ];
        let p = phase_split(&stamps, &[1, 2]);
        // Phase 1 durations 2, 4, 2, 2 us; phase 2: 7, 7, 6, 6.
        assert_eq!(p.len(), 3);
        assert!((p[0] - 2.0).abs() < 1e-9, "{p:?}");
        assert!((p[1] - 6.5).abs() < 1e-9, "{p:?}");
        // First start 10 us, last slot-2 stamp 21 us.
        assert!((p[2] - 11.0).abs() < 1e-9, "{p:?}");
    }

    #[test]
    fn the_tail_names_the_last_block_and_splits_it() {
        // Rank 0: block 1 ends last (25 us) because it waited 12 us for done; block 0's rows
        // took 8 us, block 1's 4 us. Times in us from the first start (rank 0, block 0).
        let ranks = vec![vec![
            block(1_000, &[0, 2_000, 10_000, 11_000, 12_000, 14_000]),
            block(1_000, &[1_000, 3_000, 7_000, 8_000, 20_000, 25_000]),
        ]];
        let line = dispatch_tail(&ranks);
        assert!(
            line.contains("rows took p10 4.0 p50 8.0 p90 8.0 max 8.0"),
            "{line}"
        );
        assert!(line.contains("done wait p50 12.0 max 12.0"), "{line}");
        assert!(
            line.contains("last block 1: start 1.0, offsets 3.0, rows 7.0, released 8.0, acquired 20.0, end 25.0"),
            "{line}"
        );
        assert!(dispatch_tail(&[vec![vec![0u64; 16]]]).contains("rank 0: no stamps"));
    }

    #[test]
    fn the_combine_line_says_why_it_has_no_ratio() {
        let fig = |us: f64, gbs: f64| Figure {
            median_us: us,
            gb_per_s: gbs,
        };
        let mut row = SmRow {
            sms_per_rank: 24,
            combine: fig(138.1, 847.3),
            ..SmRow::default()
        };
        let line = combine_line(&row);
        assert!(
            line.contains("847.3 GB/s per rank, 138.1 us (no same-run ceiling"),
            "{line}"
        );
        assert!(!line.contains("NaN"), "{line}");
        row.ceiling_combine = fig(121.5, 963.0);
        let line = combine_line(&row);
        assert!(
            line.ends_with("(88% of the same-run ceiling 963.0 GB/s)"),
            "{line}"
        );
    }

    #[test]
    fn the_critical_path_is_relative_to_the_first_start_of_any_rank() {
        let mut b0 = block(5_000, &[0, 9_000, 20_000, 0, 0, 30_000, 4_000, 6_000]);
        b0[3] = 0;
        b0[4] = 0;
        let stamps = vec![
            vec![b0, block(5_000, &[500, 7_000, 19_000, 0, 0, 31_000])],
            vec![block(
                4_000,
                &[0, 8_000, 18_000, 0, 0, 29_000, 3_000, 6_500],
            )],
        ];
        let line = dispatch_path(&stamps);
        let ranks: Vec<&str> = line.split(" | ").collect();
        assert_eq!(ranks.len(), 2, "{line}");
        // Rank 0 starts 1 us after rank 1; its notify block fenced its expert parts at 5 us and
        // had every head word at 7 us; its blocks knew their offsets at 10 and 8 us (median 9).
        assert!(ranks[0].contains("start 1.0..1.5"), "{line}");
        assert!(
            ranks[0].contains("experts 5.0, heads 7.0, table 10.0"),
            "{line}"
        );
        assert!(ranks[0].contains("offsets median 9.0 last 10.0"), "{line}");
        assert!(ranks[0].contains("end 32.0"), "{line}");
        assert!(
            ranks[1].starts_with("rank 1 [block 0 stamps 0:0.0 1:8.0"),
            "{line}"
        );
        // A rank with no stamps says so.
        assert!(dispatch_path(&[vec![vec![0u64; 16]]]).contains("rank 0: no stamps"));
    }
}
