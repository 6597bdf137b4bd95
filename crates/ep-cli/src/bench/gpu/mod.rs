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
//!
//! This file runs the bench (`run`); beside it: `inputs` (the rotated sets on the device),
//! `verify` (against the plan), `timing` (gated samples and figures), `stamps` (phase stamps as
//! figures), `report` (the printed rows), `plot` (`--plot`).

use std::time::Instant;

use ep_core::Buffer;
use ep_core::config::BufferConfig;
use ep_core::digest::RunDigest;
use ep_core::plan::combine::CombineOutput;
use ep_core::plan::intranode::IntranodeDispatch;
use ep_core::protocol::layout::{NormalCtrl, NormalData, RowFormat, align128};
use ep_kernels::gpu::{
    CombineSource, DType, DevTensor, Device, Gpu, GpuCombineArgs, GpuDispatch, GpuDispatchArgs,
    GpuLayout, NormalGroup,
};

use super::BenchArgs;
use super::error::BenchError;
use super::procs;
use super::report::median;
use crate::workload::{self, Defaults, Mode};

mod inputs;
mod plot;
mod report;
mod stamps;
mod timing;
mod verify;

use inputs::{Set, final_rows, rotated, upload_set};
use plot::plot;
use report::{SmRow, print_row};
use stamps::{dispatch_path, dispatch_tail};
pub(super) use stamps::{phase_split, since_first_start};
use timing::timed;
pub(super) use timing::{Figure, core_err, figure, gpu_err, samples, slowest};
use verify::{Verdict, verify_set};

/// The kernels' group of a `Buffer<Gpu>` (its arena is made with the `Buffer`).
fn group(buf: &mut Buffer<Gpu>) -> Result<&mut NormalGroup, BenchError> {
    buf.transport_mut().normal_mut().ok_or(BenchError::Usage(
        "the GPU buffer has no normal-mode arena".into(),
    ))
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
