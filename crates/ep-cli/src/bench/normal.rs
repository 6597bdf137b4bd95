//! Normal (intranode) mode: dispatch then combine with the identity expert (the expert output of
//! each received row is the row itself, FP8 rows dequantised to BF16), as DeepEP's
//! `test_intranode.py` (spec §6.2).
//!
//! BF16 rows stay where the dispatch stored them, in the arena (`Buffer::dispatch_in_place`,
//! docs/protocol.md §2.6) — the GPU arrangement, where `recv_x` is a view — and the combine
//! pulls them from there (`Buffer::combine_in_place`); the identity expert writes nothing. So a
//! call moves the payload once and the run never holds a second copy of the received rows. FP8
//! rows are copied out (`Buffer::dispatch`), dequantised, and combined from host tensors.
//!
//! Verification against `oracle::normal`, exact, every iteration:
//! - the oracle runs once on the inputs narrowed to their first 128 columns (every index field of
//!   the outputs is independent of the columns): every output except `recv_x` is compared with
//!   it whole, and each `recv_x` row, all columns, with the input row the oracle placed there
//!   (its source rank from `rank_prefix_matrix`, its token from `recv_src_idx`; the oracle's own
//!   narrowed row is checked against the same input row) — in the arena, in place where the
//!   transport lends its memory, one rank per task on every core (`scan_rows`);
//! - the combine: with the identity expert every rank a token reached returns the token's own
//!   row, so the oracle's sum is `n_t` exact f32 additions of one BF16 value, i.e. the closed
//!   form `bf16(0 + n_t·y)` ([`CombineRef`]); it must reproduce the oracle's combine on the
//!   narrowed rows bit for bit (checked once), and every iteration's `combined_x` is compared
//!   with the closed form of that iteration's inputs, all columns, on every core; the weights
//!   with the oracle's;
//! - iterations alternate the sign of the activations (exact in BF16 and e4m3), so a row left in
//!   the arena by the previous iteration never passes for this one's;
//! - the first iteration's outputs are digested as they are verified (`NormalRankStream`).

use std::time::Instant;

use ep_core::Buffer;
use ep_core::buffer::{InPlaceDispatch, NormalDispatchArgs};
use ep_core::config::{BufferConfig, Config};
use ep_core::digest::RunDigest;
use ep_core::numerics::fp8;
use ep_core::oracle;
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{DispatchOptions, IntranodeDispatch, IntranodeHandle};
use ep_core::plan::layout::DispatchLayout;
use ep_core::routing::Activations;
use ep_core::{RankInputs, Tensor2};
use half::bf16;

use super::backend::Recorded;
use super::error::BenchError;
use super::{Checks, ModeResult, PhaseResult, RunParams, flip_signs, predictions};
use crate::io::Outputs;
use crate::workload::Workload;

/// Columns the oracle's dispatch runs on.
const NARROW: usize = 128;

/// Where each received row of each rank comes from: `(source rank, token)`.
type Sources = Vec<Vec<(usize, usize)>>;

/// Runs normal mode on `transport` (module docs).
pub(crate) fn run<T: Recorded>(
    transport: T,
    w: &mut Workload,
    p: &RunParams<'_>,
) -> Result<ModeResult, BenchError> {
    let r = w.inputs.len();
    let fp8_in = matches!(w.inputs[0].x, Activations::Fp8 { .. });
    let h = w.summary.hidden;
    let k = w.summary.topk;
    if p.num_sms < 2 {
        return Err(BenchError::Usage(format!(
            "--num-sms {}: normal mode needs at least 2 SMs (one channel)",
            p.num_sms
        )));
    }
    let config = Config::new(p.num_sms, 8, 256, 6, 128)
        .map_err(|e| BenchError::Usage(format!("--num-sms {}: {e}", p.num_sms)))?;
    let args = NormalDispatchArgs::new(config);
    let opts = DispatchOptions {
        num_channels: config.num_channels(),
        expert_alignment: args.expert_alignment,
        num_worst_tokens: args.num_worst_tokens,
        with_topk: args.with_topk,
    };

    let tl = p.timeline;
    let mut t = Instant::now();
    let mut checks = Checks::default();
    let refs = references(w, &opts, p, &mut checks, &mut t)?;

    let max_rows = refs
        .reference
        .iter()
        .map(|d| d.handle.num_recv_tokens)
        .max()
        .unwrap_or(0)
        .max(1);
    let mut cfg = BufferConfig::new(r);
    let elem = if fp8_in { 1 } else { 2 };
    cfg.num_nvl_bytes = Buffer::<T>::normal_size_hint(r, max_rows, h, elem, k).div_ceil(128) * 128;
    let mut buf =
        Buffer::new(transport, cfg).map_err(|x| BenchError::setup("normal", p.backend, x))?;
    t = tl.lap("buffer", t);

    let timing = iterate(&mut buf, w, &refs, &args, p, &mut checks, t)?;
    Ok(ModeResult {
        phases: figures(&refs.reference, &buf, &timing, h, fp8_in),
        checks,
        digest: timing
            .digest
            .ok_or(BenchError::Internal("no iteration ran"))?,
    })
}

/// What verification compares with, computed once, untimed.
struct References {
    /// The layouts (the routing never changes).
    layouts: Vec<DispatchLayout>,
    /// The oracle's dispatch of the narrowed inputs.
    reference: Vec<IntranodeDispatch>,
    sources: Sources,
    combine: CombineRef,
}

/// The layouts and the oracle's dispatch and combine (module docs); `t` laps the timeline.
fn references(
    w: &Workload,
    opts: &DispatchOptions,
    p: &RunParams<'_>,
    checks: &mut Checks,
    t: &mut Instant,
) -> Result<References, BenchError> {
    let (r, e, tl) = (w.inputs.len(), w.num_experts, p.timeline);
    p.progress.step("oracle: layout and dispatch");
    let topk: Vec<_> = w.inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let layouts: Vec<DispatchLayout> = (0..r)
        .map(|s| {
            ep_core::plan::layout::get_dispatch_layout_for_rank(s, &topk[s], e, r)
                .map_err(|x| BenchError::reference("dispatch layout", x))
        })
        .collect::<Result<_, _>>()?;
    for (s, l) in layouts.iter().enumerate() {
        let want = oracle::normal::layout(&topk[s], e, r)
            .map_err(|x| BenchError::reference("oracle layout", x))?;
        if *l != want {
            checks.fail(format!(
                "rank {s}: get_dispatch_layout differs from the oracle"
            ));
        }
    }
    let narrow: Vec<RankInputs> = w.inputs.iter().map(narrow_inputs).collect();
    let reference = oracle::normal::intranode_dispatch(&narrow, e, opts)
        .map_err(|x| BenchError::reference("oracle dispatch", x))?;
    let sources = sources_of(&reference, &narrow, checks);
    *t = tl.lap("oracle dispatch", *t);
    p.progress.done();
    p.progress.step("oracle: combine");
    let combine = combine_reference(&narrow, &reference, &sources, e, checks)?;
    *t = tl.lap("oracle combine", *t);
    p.progress.done();
    Ok(References {
        layouts,
        reference,
        sources,
        combine,
    })
}

/// The timed samples of a run, and where its last iteration's phase records are.
struct Timing {
    dispatch_us: Vec<f64>,
    combine_us: Vec<f64>,
    /// Phase records: before the dispatch, after it, before the combine, after it.
    last: (usize, usize, usize, usize),
    /// The first iteration's digest.
    digest: Option<RunDigest>,
}

/// The warm-ups and the timed iterations, each verified (`checks`); `t` laps the timeline.
fn iterate<T: Recorded>(
    buf: &mut Buffer<T>,
    w: &mut Workload,
    refs: &References,
    args: &NormalDispatchArgs,
    p: &RunParams<'_>,
    checks: &mut Checks,
    mut t: Instant,
) -> Result<Timing, BenchError> {
    let tl = p.timeline;
    // Rows stay in the arena (docs/protocol.md §2.6), as on the GPU: BF16 rows are combined in
    // place, FP8 rows dequantised into the combine rows first.
    let mut timing = Timing {
        dispatch_us: Vec::new(),
        combine_us: Vec::new(),
        last: (0, 0, 0, 0),
        digest: None,
    };
    let mut negated = false;
    for it in 0..p.warmup + p.iters {
        let timed = p.begin_iteration(it, &mut w.inputs, &mut negated)?;
        let rec0 = buf.transport().phase_records().len();
        tl.lap("inputs", t);
        let cx = IterCtx {
            w,
            layouts: &refs.layouts,
            args,
            reference: &refs.reference,
            sources: &refs.sources,
            p,
        };
        let step = iteration_in_place(buf, &cx, it, checks)?;
        t = Instant::now();
        check_combine(&step.combined, &refs.combine, &w.inputs, it, checks)?;
        checks.iterations += 1;
        t = tl.lap("combine verification", t);
        if it == 0 {
            timing.digest = Some(step.digest.ok_or(BenchError::Internal("no digest"))?);
        }
        drop(step.combined);
        t = tl.lap("freeing outputs", t);
        if timed {
            timing.dispatch_us.push(step.dispatch_us);
            timing.combine_us.push(step.combine_us);
        }
        timing.last = (rec0, step.records.0, step.records.1, step.records.2);
        p.progress.done();
    }
    if negated {
        flip_signs(&mut w.inputs);
    }
    Ok(timing)
}

/// The figures of a run: DeepEP's byte counts (spec §6.2): recv_x.numel() * 2 per rank, FP8
/// (1 + 4/128) / 2 of it; combine sends the same. Payload: every row stored at its destination
/// (dispatch) and every row pulled back (combine), the rank's own included: rows x (H x element
/// + scales).
fn figures<T: Recorded>(
    reference: &[IntranodeDispatch],
    buf: &Buffer<T>,
    timing: &Timing,
    h: usize,
    fp8_in: bool,
) -> Vec<PhaseResult> {
    let rows: Vec<u64> = reference
        .iter()
        .map(|d| d.handle.num_recv_tokens as u64)
        .collect();
    let bf16_bytes: Vec<f64> = rows.iter().map(|&n| (n * h as u64 * 2) as f64).collect();
    let disp_bytes: Vec<f64> = if fp8_in {
        bf16_bytes
            .iter()
            .map(|b| b * (1.0 + 4.0 / 128.0) / 2.0)
            .collect()
    } else {
        bf16_bytes.clone()
    };
    let total_rows: u64 = rows.iter().sum();
    let row_bytes = if fp8_in {
        (h + 4 * h.div_ceil(128)) as u64
    } else {
        2 * h as u64
    };
    let recs = buf.transport().phase_records();
    let fabric = buf.transport().fabric().clone();
    let label = if fp8_in { "FP8" } else { "BF16" };
    let last = timing.last;
    vec![
        PhaseResult {
            name: "dispatch",
            format: label,
            samples_us: timing.dispatch_us.clone(),
            deepep_bytes_per_rank: disp_bytes,
            deepep_unit: "NVL",
            payload_bytes: total_rows * row_bytes,
            payload_what: "received rows stored at their final place (x and scales), local \
                           rows included",
            recorded_bytes: recs[last.0..last.1].iter().map(|x| x.bytes()).sum(),
            predictions: predictions(&recs[last.0..last.1], &fabric),
        },
        PhaseResult {
            name: "combine",
            format: "BF16",
            samples_us: timing.combine_us.clone(),
            deepep_bytes_per_rank: bf16_bytes,
            deepep_unit: "NVL",
            payload_bytes: total_rows * 2 * h as u64,
            payload_what: "expert output rows pulled back by their token's rank (BF16), \
                           local rows included",
            recorded_bytes: recs[last.2..last.3].iter().map(|x| x.bytes()).sum(),
            predictions: predictions(&recs[last.2..last.3], &fabric),
        },
    ]
}

/// What every iteration of a run shares.
#[derive(Clone, Copy)]
struct IterCtx<'a> {
    w: &'a Workload,
    layouts: &'a [DispatchLayout],
    args: &'a NormalDispatchArgs,
    reference: &'a [IntranodeDispatch],
    sources: &'a Sources,
    p: &'a RunParams<'a>,
}

/// Runs one call, timed alone from `t`: its result, its time in microseconds and the number of
/// phase records after it; `t` restarts after the call's `lap` of the timeline.
fn timed_call<T: Recorded, R>(
    buf: &mut Buffer<T>,
    t: &mut Instant,
    tl: &super::Timeline,
    (what, lap): (&'static str, &'static str),
    it: usize,
    call: impl FnOnce(&mut Buffer<T>) -> ep_core::Result<R>,
) -> Result<(R, f64, usize), BenchError> {
    let out = call(buf).map_err(|x| BenchError::call(what, it, x))?;
    let us = t.elapsed().as_secs_f64() * 1e6;
    *t = tl.lap(lap, *t);
    Ok((out, us, buf.transport().phase_records().len()))
}

/// What one iteration of dispatch and combine gave.
struct Step {
    dispatch_us: f64,
    combine_us: f64,
    /// Phase records after the dispatch, before the combine (after the expert's phase, if
    /// any) and after the combine.
    records: (usize, usize, usize),
    combined: Vec<CombineOutput>,
    /// The outputs' digest (first iteration only).
    digest: Option<RunDigest>,
}

/// Dispatch in place, verification of the rows in the arena, combine in place of those rows
/// (the identity expert writes nothing).
fn iteration_in_place<T: Recorded>(
    buf: &mut Buffer<T>,
    cx: &IterCtx<'_>,
    it: usize,
    checks: &mut Checks,
) -> Result<Step, BenchError> {
    let (w, p) = (cx.w, cx.p);
    let tl = p.timeline;
    let r = w.inputs.len();
    let mut t = Instant::now();
    let (got, dispatch_us, rec1) = timed_call(
        buf,
        &mut t,
        tl,
        ("normal dispatch", "dispatch calls"),
        it,
        |b| b.dispatch_in_place(&w.inputs, cx.layouts, w.num_experts, cx.args),
    )?;
    let streams = verify_dispatch(&*buf, &got, cx, it, checks)?;
    t = tl.lap("dispatch verification", t);
    // The combine's phase records start here (after the expert's phase, when there is one).
    let mut combine_from = rec1;
    let handles: Vec<IntranodeHandle> = got.iter().map(|d| d.handle.clone()).collect();
    let no_bias: Vec<&[Tensor2<bf16>]> = vec![&[]; r];
    let fp8 = matches!(w.inputs[0].x, Activations::Fp8 { .. });
    if fp8 {
        // The identity expert of FP8 rows: dequantised to BF16 into the combine rows.
        fp8_expert(buf).map_err(|x| BenchError::call("the FP8 identity expert", it, x))?;
        t = tl.lap("expert outputs", t);
        combine_from = buf.transport().phase_records().len();
    }
    let with_w = got[0].recv_topk_weights.is_some();
    let (combined, combine_us, rec2) = timed_call(
        buf,
        &mut t,
        tl,
        ("normal combine", "combine calls"),
        it,
        |b| {
            if fp8 {
                b.combine_from_rows(&handles, &no_bias, with_w)
            } else {
                b.combine_in_place(&handles, &no_bias)
            }
        },
    )?;
    let digest = if let Some(streams) = streams {
        // The rows were digested as they were verified: no second copy of every row.
        let ranks = streams
            .into_iter()
            .zip(&got)
            .enumerate()
            .map(|(d, (st, g))| st.finish(g, Some(&combined[d])))
            .collect::<Result<Vec<_>, _>>()
            .map_err(crate::io::IoError::outputs)?;
        if let Some(dir) = p.dump {
            let mut owned = Vec::with_capacity(r);
            for (d, g) in got.into_iter().enumerate() {
                let mut x = recv_like(&w.inputs[0].x, g.num_rows);
                buf.read_recv_x(d, 0, &mut x)
                    .map_err(|x| BenchError::call("reading the received rows", it, x))?;
                owned.push(g.with_recv_x(x));
            }
            let view = Outputs::Normal {
                dispatch: &owned,
                combine: &combined,
            };
            crate::io::dump_outputs(dir, &view, p.info)?;
        }
        tl.lap("digest and dump", t);
        Some(ep_core::digest::normal_total(ranks))
    } else {
        None
    };
    Ok(Step {
        dispatch_us,
        combine_us,
        records: (rec1, combine_from, rec2),
        combined,
        digest,
    })
}

/// Verifies an in-place dispatch: its outputs but `recv_x` against the oracle's, and every
/// received row in the arena against its source row (digesting them on the first iteration).
fn verify_dispatch<T: Recorded>(
    buf: &Buffer<T>,
    got: &[InPlaceDispatch],
    cx: &IterCtx<'_>,
    it: usize,
    checks: &mut Checks,
) -> Result<Option<Vec<ep_core::digest::NormalRankStream>>, BenchError> {
    check_meta(got, cx.reference, it, checks);
    let rows: Vec<usize> = got
        .iter()
        .zip(cx.reference)
        .map(|(g, o)| o.handle.num_recv_tokens.min(g.num_rows))
        .collect();
    let (bad, streams) = scan_rows(buf, &rows, cx.sources, &cx.w.inputs, it == 0)
        .map_err(|x| BenchError::call("reading the received rows", it, x))?;
    for (d, b) in bad.into_iter().enumerate() {
        if let Some((j, s, tok)) = b {
            checks.fail(format!(
                "iteration {it}: rank {d}: recv_x row {j} differs from token {tok} of rank {s}"
            ));
        }
    }
    Ok(streams)
}

/// Zeroed activations of `rows` rows shaped like `like` (its kind, hidden size, scales).
fn recv_like(like: &Activations, rows: usize) -> Activations {
    match like {
        Activations::Bf16(x) => Activations::Bf16(Tensor2::zeros(rows, x.cols())),
        Activations::Fp8 { data, scales } => Activations::Fp8 {
            data: Tensor2::filled(rows, data.cols(), 0u8),
            scales: Tensor2::filled(rows, scales.cols(), 0.0f32),
        },
    }
}

/// The identity expert of FP8 rows left in the arena, run in the buffer over every rank's rows
/// (`Buffer::apply_expert`, on every core): each row dequantised to BF16
/// (`fp8::dequantize_row_bf16`, DeepEP's `per_token_cast_back`) into the rank's combine rows.
fn fp8_expert<T: Recorded>(buf: &mut Buffer<T>) -> Result<(), ep_core::Error> {
    buf.apply_expert(&|_, _, x, y| {
        let Activations::Fp8 { data, scales } = x else {
            return Err(ep_core::Error::Unsupported("FP8 rows expected".into()));
        };
        (0..data.rows())
            .try_for_each(|j| fp8::dequantize_row_bf16(data.row(j), scales.row(j), y.row_mut(j)))
    })
}

/// The first row of each rank that differs from its source: `(row, source rank, token)`.
type FirstBad = Vec<Option<(usize, usize, usize)>>;

/// Reads rows `[0, rows[d])` of every rank's `recv_x` in the arena (in place where the
/// transport lends its memory, `Buffer::scan_recv_rows`) and checks each row against its source
/// row — one rank per task on every core — digesting the rows as they pass when `digest` (BF16
/// rows, first iteration).
fn scan_rows<T: Recorded>(
    buf: &Buffer<T>,
    rows: &[usize],
    sources: &Sources,
    inputs: &[RankInputs],
    digest: bool,
) -> Result<(FirstBad, Option<Vec<ep_core::digest::NormalRankStream>>), ep_core::Error> {
    let h = inputs[0].x.hidden();
    let all = crate::ranks::per_rank(rows.len(), |d| {
        let n = rows[d];
        let mut stream = digest.then(|| match &inputs[0].x {
            Activations::Fp8 { scales, .. } => {
                ep_core::digest::NormalRankStream::fp8(d, n, h, scales.cols())
            }
            Activations::Bf16(_) => ep_core::digest::NormalRankStream::bf16(d, n, h),
        });
        let mut bad = None;
        buf.scan_recv_rows(d, 0..n, |j, rec| {
            let (s, t) = sources[d][j];
            if bad.is_none() && !record_is_row(rec, &inputs[s].x, t) {
                bad = Some((j, s, t));
            }
            if let Some(st) = &mut stream {
                st.row(rec);
            }
        })?;
        Ok((d, bad, stream))
    })
    .into_iter()
    .collect::<Result<Vec<_>, ep_core::Error>>()?;
    let bad = all.iter().map(|x| x.1).collect();
    let streams = digest.then(|| all.into_iter().filter_map(|x| x.2).collect());
    Ok((bad, streams))
}

/// Whether dispatch record `rec` (docs/protocol.md §2.1) carries row `t` of `x`: its x bytes
/// (and FP8 scales) bit for bit.
fn record_is_row(rec: &[u8], x: &Activations, t: usize) -> bool {
    match x {
        Activations::Bf16(x) => {
            let row = x.row(t);
            // A fold, not a search: the loop vectorises.
            rec.len() >= 2 * row.len()
                && rec[..2 * row.len()]
                    .chunks_exact(2)
                    .zip(row)
                    .fold(true, |ok, (b, v)| {
                        ok & (u16::from_le_bytes([b[0], b[1]]) == v.to_bits())
                    })
        }
        Activations::Fp8 { data, scales } => {
            let (q, sc) = (data.row(t), scales.row(t));
            let so = ep_core::protocol::layout::align16(q.len() as u64) as usize;
            rec.get(..q.len()) == Some(q)
                && rec.get(so..so + 4 * sc.len()).is_some_and(|b| {
                    b.chunks_exact(4)
                        .zip(sc)
                        .all(|(b, v)| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) == v.to_bits())
                })
        }
    }
}

/// The inputs with their activations cut to the first [`NARROW`] columns (FP8: one scale
/// block).
fn narrow_inputs(i: &RankInputs) -> RankInputs {
    let x = match &i.x {
        Activations::Bf16(x) => {
            let w = x.cols().min(NARROW);
            Activations::Bf16(Tensor2::from_fn(x.rows(), w, |r, c| x.get(r, c)))
        }
        Activations::Fp8 { data, scales } => {
            let w = data.cols().min(NARROW);
            Activations::Fp8 {
                data: Tensor2::from_fn(data.rows(), w, |r, c| data.get(r, c)),
                scales: Tensor2::from_fn(scales.rows(), 1.min(scales.cols()), |r, c| {
                    scales.get(r, c)
                }),
            }
        }
    };
    RankInputs {
        x,
        topk_idx: i.topk_idx.clone(),
        topk_weights: i.topk_weights.clone(),
    }
}

/// Whether row `i` of `a` and row `j` of `b` hold the same bits (data and FP8 scales).
fn same_row(a: &Activations, i: usize, b: &Activations, j: usize) -> bool {
    match (a, b) {
        (Activations::Bf16(a), Activations::Bf16(b)) => a
            .row(i)
            .iter()
            .zip(b.row(j))
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        (
            Activations::Fp8 {
                data: da,
                scales: sa,
            },
            Activations::Fp8 {
                data: db,
                scales: sb,
            },
        ) => {
            da.row(i) == db.row(j)
                && sa
                    .row(i)
                    .iter()
                    .zip(sb.row(j))
                    .all(|(x, y)| x.to_bits() == y.to_bits())
        }
        _ => false,
    }
}

/// `(source rank, token)` of every received row, from the oracle's handle; checks that the
/// oracle's (narrowed) row equals that input row.
fn sources_of(
    reference: &[IntranodeDispatch],
    narrow: &[RankInputs],
    checks: &mut Checks,
) -> Sources {
    reference
        .iter()
        .enumerate()
        .map(|(d, o)| {
            let h = &o.handle;
            let mut out = Vec::with_capacity(h.num_recv_tokens);
            for (s, src) in narrow.iter().enumerate() {
                let begin = h.rank_start(s, d) as usize;
                let end = h.rank_prefix_matrix.get(s, d) as usize;
                for j in begin..end {
                    let t = h.recv_src_idx[j] as usize;
                    if !same_row(&o.recv_x, j, &src.x, t) {
                        checks.fail(format!(
                            "oracle: rank {d} row {j} is not token {t} of rank {s} as its handle says"
                        ));
                    }
                    out.push((s, t));
                }
            }
            out
        })
        .collect()
}

fn same_f32(a: &Tensor2<f32>, b: &Tensor2<f32>, rows: usize) -> bool {
    let n = rows * a.cols();
    a.cols() == b.cols()
        && a.rows() >= rows
        && b.rows() >= rows
        && a.data()[..n]
            .iter()
            .zip(&b.data()[..n])
            .all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Compares everything of one iteration's dispatch but `recv_x` with the oracle.
fn check_meta(
    got: &[InPlaceDispatch],
    reference: &[IntranodeDispatch],
    it: usize,
    checks: &mut Checks,
) {
    if got.len() != reference.len() {
        checks.fail(format!("iteration {it}: {} ranks returned", got.len()));
        return;
    }
    for (d, (g, o)) in got.iter().zip(reference).enumerate() {
        let (gh, oh) = (&g.handle, &o.handle);
        let n = oh.num_recv_tokens;
        let mut bad = Vec::new();
        if gh.num_recv_tokens != n || g.num_rows < n {
            bad.push("num_recv_tokens");
        }
        let r = oh.rank_prefix_matrix.rows();
        if gh.rank_prefix_matrix.shape() != oh.rank_prefix_matrix.shape()
            || (0..r).any(|i| gh.rank_prefix_matrix.get(i, d) != oh.rank_prefix_matrix.get(i, d))
        {
            bad.push("rank_prefix_matrix[:, rank]");
        }
        if gh.channel_prefix_matrix != oh.channel_prefix_matrix {
            bad.push("channel_prefix_matrix");
        }
        if gh.recv_channel_prefix_matrix != oh.recv_channel_prefix_matrix {
            bad.push("recv_channel_prefix_matrix");
        }
        if gh.recv_src_idx.get(..n) != oh.recv_src_idx.get(..n) {
            bad.push("recv_src_idx");
        }
        if gh.is_token_in_rank != oh.is_token_in_rank {
            bad.push("is_token_in_rank");
        }
        let neg = |t: &Tensor2<i32>| t.data().iter().map(|&v| v.max(-1)).collect::<Vec<_>>();
        if gh.send_head.shape() != oh.send_head.shape() || neg(&gh.send_head) != neg(&oh.send_head)
        {
            bad.push("send_head");
        }
        if g.num_recv_tokens_per_expert_list != o.num_recv_tokens_per_expert_list {
            bad.push("num_recv_tokens_per_expert_list");
        }
        match (&g.recv_topk_idx, &o.recv_topk_idx) {
            (Some(a), Some(b)) if a.cols() == b.cols() && a.rows() >= n && b.rows() >= n => {
                if a.data()[..n * a.cols()] != b.data()[..n * b.cols()] {
                    bad.push("recv_topk_idx");
                }
            }
            (None, None) => {}
            _ => bad.push("recv_topk_idx"),
        }
        match (&g.recv_topk_weights, &o.recv_topk_weights) {
            (Some(a), Some(b)) => {
                if !same_f32(a, b, n) {
                    bad.push("recv_topk_weights");
                }
            }
            (None, None) => {}
            _ => bad.push("recv_topk_weights"),
        }
        if !bad.is_empty() {
            checks.fail(format!(
                "iteration {it}: rank {d}: {} differ from the oracle",
                bad.join(", ")
            ));
        }
    }
}

/// The combine reference of the identity expert (module docs): with the identity expert every
/// rank a token reached returns the token's own row `y = y(x[t])`, so the oracle's definition
/// `bf16(0 + 0 + Σ_{d ascending} f32(y_d[j_d(t)]))` is `n_t` f32 additions of the same BF16
/// value — each partial sum `k·y` is exact (a BF16 value has 8 significant bits, `k ≤ R ≤ 1024`
/// adds at most 10), so the element is `bf16(0 + n_t·f32(y))` ([`closed_form`]). The oracle's
/// combine on the narrowed rows gives the weights and the first columns, which the closed form
/// must reproduce bit for bit, or the reference is refused. Every later iteration's
/// `combined_x` is compared with the closed form of that iteration's inputs, all columns.
struct CombineRef {
    /// `n_t`: the ranks each token reached, per rank.
    reached: Vec<Vec<u32>>,
    /// The oracle's combined weights, per rank.
    weights: Vec<Option<Tensor2<f32>>>,
}

/// `bf16(0 + n·f32(y))` (see [`CombineRef`]); `+0` when no rank was reached.
fn closed_form(n: u32, y: bf16) -> bf16 {
    if n == 0 {
        return bf16::ZERO;
    }
    ep_core::numerics::bf16::round(0.0 + n as f32 * y.to_f32())
}

fn combine_reference(
    narrow: &[RankInputs],
    reference: &[IntranodeDispatch],
    sources: &Sources,
    e: usize,
    checks: &mut Checks,
) -> Result<CombineRef, BenchError> {
    let w = narrow[0].x.hidden();
    let ys = sources
        .iter()
        .map(|src| {
            let mut rows = Vec::with_capacity(src.len() * w);
            for &(s, t) in src {
                rows.extend(row_block(&narrow[s].x, t, 0..w)?);
            }
            Tensor2::new(src.len(), w, rows).map_err(|x| BenchError::reference("expert outputs", x))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let args: Vec<CombineArgs<'_>> = ys
        .iter()
        .zip(reference)
        .map(|(y, o)| CombineArgs {
            x: y,
            topk_weights: o.recv_topk_weights.as_ref(),
            bias: &[],
        })
        .collect();
    let oracle = oracle::normal::intranode_combine(narrow, e, &args)
        .map_err(|x| BenchError::reference("oracle combine", x))?;
    drop(args);
    let reached: Vec<Vec<u32>> = reference
        .iter()
        .map(|o| {
            let itr = &o.handle.is_token_in_rank;
            (0..itr.rows())
                .map(|t| itr.row(t).iter().filter(|&&b| b).count() as u32)
                .collect()
        })
        .collect();
    let mut weights = Vec::with_capacity(oracle.len());
    for (s, o) in oracle.into_iter().enumerate() {
        let agrees = (0..o.combined_x.rows()).all(|t| {
            row_block(&narrow[s].x, t, 0..w).is_ok_and(|y| {
                y.iter()
                    .zip(o.combined_x.row(t))
                    .all(|(&y, b)| closed_form(reached[s][t], y).to_bits() == b.to_bits())
            })
        });
        if !agrees {
            checks.fail(format!(
                "reference: rank {s}: the closed-form combine disagrees with the oracle's on the \
                 first {w} columns"
            ));
        }
        weights.push(o.combined_topk_weights);
    }
    Ok(CombineRef { reached, weights })
}

/// Columns `cols` of row `t` through the identity expert (BF16; FP8 dequantised).
fn row_block(
    x: &Activations,
    t: usize,
    cols: std::ops::Range<usize>,
) -> Result<Vec<bf16>, BenchError> {
    Ok(match x {
        Activations::Bf16(x) => x.row(t)[cols].to_vec(),
        Activations::Fp8 { data, scales } => {
            let (b0, b1) = (cols.start / 128, cols.end.div_ceil(128));
            fp8::dequantize_row(&data.row(t)[cols], &scales.row(t)[b0..b1])
                .map_err(|e| BenchError::reference("dequantising FP8 rows", e))?
                .into_iter()
                .map(bf16::from_f32)
                .collect()
        }
    })
}

/// Compares one iteration's combine with the reference: `combined_x` bit for bit with the
/// closed form of this iteration's inputs ([`CombineRef`]), the weights bit for bit with the
/// oracle's. Ranks are checked on all cores.
fn check_combine(
    got: &[CombineOutput],
    reference: &CombineRef,
    inputs: &[RankInputs],
    it: usize,
    checks: &mut Checks,
) -> Result<(), BenchError> {
    let r = got.len().min(inputs.len());
    let found = crate::ranks::per_rank(r, |s| {
        check_combine_rank(s, &got[s], reference, &inputs[s], it)
    });
    for f in found {
        if let Some(m) = f? {
            checks.fail(m);
        }
    }
    Ok(())
}

/// [`check_combine`] of rank `s`: the first mismatch, if any.
fn check_combine_rank(
    s: usize,
    g: &CombineOutput,
    reference: &CombineRef,
    input: &RankInputs,
    it: usize,
) -> Result<Option<String>, BenchError> {
    let (t_s, h) = (input.num_tokens(), input.x.hidden());
    if g.combined_x.shape() != (t_s, h) {
        return Ok(Some(format!(
            "iteration {it}: rank {s}: combined_x shape {:?}, expected {:?}",
            g.combined_x.shape(),
            (t_s, h)
        )));
    }
    let mut ybuf = vec![bf16::ZERO; h];
    for t in 0..t_s {
        let n = reference.reached[s][t];
        let row = g.combined_x.row(t);
        // The token's expert output: its row, FP8 dequantised as the identity expert does.
        let y: &[bf16] = match &input.x {
            Activations::Bf16(x) => x.row(t),
            Activations::Fp8 { data, scales } => {
                fp8::dequantize_row_bf16(data.row(t), scales.row(t), &mut ybuf)
                    .map_err(|e| BenchError::reference("dequantising FP8 rows", e))?;
                &ybuf
            }
        };
        // A fold, not a search: the loop vectorises (the rounding is branch-free).
        let ok = row.iter().zip(y).fold(0u16, |acc, (a, &y)| {
            acc | (a.to_bits() ^ closed_form(n, y).to_bits())
        }) == 0;
        if !ok {
            let c = (0..h)
                .find(|&c| row[c].to_bits() != closed_form(n, y[c]).to_bits())
                .unwrap_or(0);
            return Ok(Some(format!(
                "iteration {it}: rank {s}: combined_x[{t}][{c}] differs from the oracle"
            )));
        }
    }
    let w_ok = match (&g.combined_topk_weights, &reference.weights[s]) {
        (Some(a), Some(b)) => a.shape() == b.shape() && same_f32(a, b, a.rows()),
        (None, None) => true,
        _ => false,
    };
    Ok((!w_ok)
        .then(|| format!("iteration {it}: rank {s}: combined_topk_weights differ from the oracle")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bit-level rounding of `closed_form` equals the library's `bf16::from_f32` of the
    /// same sum for every BF16 input and reach count (NaN payloads included).
    #[test]
    fn closed_form_rounds_like_the_library() {
        for n in 0..=64u32 {
            for bits in 0..=u16::MAX {
                let y = bf16::from_bits(bits);
                let want = if n == 0 {
                    bf16::ZERO
                } else {
                    bf16::from_f32(0.0 + n as f32 * y.to_f32())
                };
                assert_eq!(
                    closed_form(n, y).to_bits(),
                    want.to_bits(),
                    "n {n} y {bits:#06x}"
                );
            }
        }
    }
}
