//! Low-latency mode: `Buffer::low_latency_dispatch` then `Buffer::low_latency_combine` with the
//! identity expert (received rows dequantised to BF16), as DeepEP's `test_low_latency.py`
//! (spec §6.4): FP8 dispatch by default, BF16 combine, or LogFMT-10 partials with `--logfmt`
//! (`LlCombineOptions::use_logfmt`).
//!
//! Verification, every iteration:
//! - dispatch: each rank's outputs in canonical form equal the oracle's
//!   (`oracle::low_latency::dispatch`; block offsets and the order inside a block are free);
//! - combine: bit for bit equal to `plan::low_latency::combine_reduced_on_expert_rank` with BF16
//!   partials (LogFMT-10 ones with `--logfmt`; ep-rs's reduction order, docs/protocol.md §5),
//!   within `calc_diff < 1e-5` of DeepEP's order (`plan::low_latency::combine`; 9e-4 with
//!   LogFMT, the bound DeepEP's test holds its lossy combines to), and DeepEP's own check,
//!   `calc_diff(x * Σ weights, combined)` below 9e-4 (FP8 dispatch or LogFMT) or 1e-5 (BF16).
//!
//! The references are computed once for the inputs and once for their negation; iterations
//! alternate between the two, so rows left over from the previous iteration never pass.

use std::time::Instant;

use ep_core::Buffer;
use ep_core::buffer::LlCombineOptions;
use ep_core::config::BufferConfig;
use ep_core::numerics::calc_diff;
use ep_core::oracle;
use ep_core::plan::low_latency::{
    self as ll, LlCanonical, LlDispatchOutput, LlHandle, LlParams, LlRecvX, PartialPrecision,
};
use ep_core::{Activations, RankInputs, Tensor2, Tensor3};
use half::bf16;

use super::backend::Recorded;
use super::error::BenchError;
use super::{Checks, ModeResult, PhaseResult, RunParams, flip_signs, predictions};
use crate::io::{IoError, Outputs};
use crate::workload::{self, Workload};

/// DeepEP's tolerance of BF16 combine (spec §6.4), also used between the two reduction orders.
const TOL_BF16: f64 = 1e-5;
/// DeepEP's tolerance of combine after an FP8 dispatch (spec §6.4).
const TOL_FP8: f64 = 9e-4;

/// What one sign of the inputs must give.
struct Reference {
    /// The oracle's dispatch in canonical form.
    canonical: Vec<Option<LlCanonical>>,
    /// ep-rs's order (BF16 or LogFMT-10 partials on the expert rank).
    reduced: Vec<Option<Tensor2<bf16>>>,
    /// DeepEP's order.
    deepep: Vec<Option<Tensor2<bf16>>>,
}

/// Runs low-latency mode on `transport` (module docs).
pub(crate) fn run<T: Recorded>(
    transport: T,
    w: &mut Workload,
    p: &RunParams<'_>,
) -> Result<ModeResult, BenchError> {
    let r = w.inputs.len();
    let e = w.num_experts;
    let h = w.summary.hidden;
    let params = workload::ll_params(w.ll_cast(), &w.summary, e);
    let n = params.num_max_dispatch_tokens_per_rank;

    let tl = p.timeline;
    let mut lap = Instant::now();
    p.progress.step("oracle: dispatch and combine");
    // At most two sets of packed FP8 arrays and one of BF16 expert outputs are alive at once
    // (the run's peak of address space): the oracle's dispatch of both signs, computed side by
    // side, then the two signs' combine references one after the other over one set of expert
    // outputs. Those are kept from one use to the next (the references', then every
    // iteration's): only the rows a dispatch filled are written (and cleared again), so the
    // mostly empty packed arrays are never touched, let alone zeroed or copied. The first
    // sign's oracle outputs become the spare of the first dispatch, which reuses their arrays
    // as it does its own outputs' afterwards.
    let negated: Option<Vec<RankInputs>> = p.alternate.then(|| {
        let mut x = w.inputs.clone();
        flip_signs(&mut x);
        x
    });
    let (pos_out, neg_out) = {
        let (inputs, params, negated) = (&w.inputs, &params, &negated);
        crate::ranks::join(
            || oracle_dispatch(inputs, params),
            move || {
                negated
                    .as_ref()
                    .map(|x| oracle_dispatch(x, params))
                    .transpose()
            },
        )
    };
    let (pos_out, neg_out) = (pos_out?, neg_out?);
    let mut y = ExpertOutputs::default();
    let partials = if p.logfmt {
        PartialPrecision::LogFmt10
    } else {
        PartialPrecision::Bf16
    };
    let pos = reference(
        &w.inputs,
        &params,
        &pos_out.out,
        (pos_out.canonical, partials),
        &mut y,
    )?;
    // The second sign's oracle outputs are freed once its reference is computed (the caching
    // allocator may keep their blocks, but nothing of their size is allocated again: every
    // dispatch reuses its spare).
    let neg = match (&negated, neg_out) {
        (Some(x), Some(o)) => Some(reference(
            x,
            &params,
            &o.out,
            (o.canonical, partials),
            &mut y,
        )?),
        _ => None,
    };
    drop(negated);
    // Only the outputs' arrays are reused; no routes are read.
    let mut spare = Some(ep_core::buffer::LlDispatched {
        outputs: pos_out.out,
        routes: Vec::new(),
    });
    lap = tl.lap("oracle", lap);
    p.progress.done();

    let mut cfg = BufferConfig::new(r);
    cfg.low_latency_mode = true;
    cfg.num_qps_per_rank = (e / r.max(1)).max(1) as u32;
    cfg.nvshmem_qp_depth = p.fabric.qp_depth;
    cfg.num_rdma_bytes = Buffer::<T>::low_latency_size_hint(n, h, r, e).div_ceil(128) * 128;
    let mut buf =
        Buffer::new(transport, cfg).map_err(|x| BenchError::setup("low-latency", p.backend, x))?;
    lap = tl.lap("buffer", lap);

    // LogFMT is lossy: DeepEP holds it to the FP8 bound, also against the other order.
    let tol = if params.use_fp8 || p.logfmt {
        TOL_FP8
    } else {
        TOL_BF16
    };
    let tol_order = if p.logfmt { TOL_FP8 } else { TOL_BF16 };
    let opts = LlCombineOptions::default().with_logfmt(p.logfmt);
    let mut checks = Checks::default();
    let mut worst = (0.0f64, 0.0f64);
    let mut disp = Vec::new();
    let mut comb = Vec::new();
    let mut last = (0, 0, 0);
    let mut digest = None;
    let mut negated = false;
    // `spare`: the previous dispatch outputs (the oracle's first), whose packed arrays the next
    // dispatch reuses.
    for it in 0..p.warmup + p.iters {
        let timed = p.begin_iteration(it, &mut w.inputs, &mut negated)?;
        let want = if negated {
            neg.as_ref().unwrap_or(&pos)
        } else {
            &pos
        };
        let rec0 = buf.transport().phase_records().len();
        lap = tl.lap("other", lap);
        let t0 = Instant::now();
        let got = buf
            .low_latency_dispatch_reusing(&w.inputs, &params, spare.take())
            .map_err(|x| BenchError::call("low-latency dispatch", it, x))?;
        let dt = t0.elapsed();
        let rec1 = buf.transport().phase_records().len();
        lap = tl.lap("dispatch", lap);
        check_dispatch(&got.outputs, want, it, &mut checks);
        lap = tl.lap("dispatch check", lap);

        y.identity(&got.outputs)?;
        lap = tl.lap("expert outputs", lap);
        let t1 = Instant::now();
        let combined = buf
            .low_latency_combine(&got.routes, &y.y, &w.inputs, opts)
            .map_err(|x| BenchError::call("low-latency combine", it, x))?;
        let ct = t1.elapsed();
        let rec2 = buf.transport().phase_records().len();
        lap = tl.lap("combine", lap);
        let cx = CombineCheck {
            inputs: &w.inputs,
            want,
            params: &params,
            tol,
            tol_order,
            partials,
            it,
        };
        cx.check(&combined, &mut checks, &mut worst);
        checks.iterations += 1;
        lap = tl.lap("combine check", lap);
        if it == 0 {
            let view = Outputs::LowLatency {
                dispatch: &got.outputs,
                combined_x: &combined,
            };
            digest = Some(view.digest().map_err(IoError::outputs)?);
            if let Some(dir) = p.dump {
                crate::io::dump_outputs(dir, &view, p.info)?;
            }
        }
        lap = tl.lap("digest", lap);
        drop(combined);
        spare = Some(got);
        lap = tl.lap("free outputs", lap);
        if timed {
            disp.push(dt.as_secs_f64() * 1e6);
            comb.push(ct.as_secs_f64() * 1e6);
        }
        last = (rec0, rec1, rec2);
        p.progress.done();
    }
    if negated {
        flip_signs(&mut w.inputs);
    }
    tl.lap("other", lap);
    checks.notes.push(format!(
        "combine{}: worst calc_diff to DeepEP's order {:.2e} (< {tol_order:e}), DeepEP's check \
         calc_diff(x * sum(w), combined) {:.2e} (< {tol:e})",
        if p.logfmt {
            " (LogFMT-10 partials)"
        } else {
            ""
        },
        worst.0,
        worst.1
    ));

    let phases = figures(
        &w.inputs,
        &params,
        buf.transport().phase_records(),
        p,
        (disp, comb),
        last,
    );
    Ok(ModeResult {
        phases,
        checks,
        digest: digest.ok_or(BenchError::Internal("no iteration ran"))?,
    })
}

/// The figures of a run: DeepEP's byte counts (spec §6.4), per rank over its own tokens' valid
/// selections `s`: dispatch s * (H + H/128*4 + 16) with FP8 (s * (2H + 16) with BF16), combine
/// s * 2H (s * (10H/8 + H/128*4) with LogFMT). Payload: one row per (token, destination rank),
/// local included, both ways (a LogFMT partial counted at its largest, every chunk raw; the
/// recorded bytes are what moved).
fn figures(
    inputs: &[RankInputs],
    params: &ll::LlParams,
    recs: &[ep_sim::cost::PhaseRecord],
    p: &RunParams<'_>,
    (disp, comb): (Vec<f64>, Vec<f64>),
    last: (usize, usize, usize),
) -> Vec<PhaseResult> {
    let (r, e) = (inputs.len(), params.num_experts);
    let h = inputs.first().map_or(0, |i| i.x.hidden());
    let per_sel_dispatch = if params.use_fp8 {
        h + h / 128 * 4 + 16
    } else {
        2 * h + 16
    };
    let row_bytes = if params.use_fp8 {
        h + h / 128 * 4
    } else {
        2 * h
    } as u64;
    let mut sel = Vec::with_capacity(r);
    let mut msgs = 0u64;
    for (s, inp) in inputs.iter().enumerate() {
        let mut count = 0u64;
        if !params.is_masked(s) {
            for t in 0..inp.num_tokens() {
                let mut ranks: Vec<usize> = inp
                    .topk_idx
                    .row(t)
                    .iter()
                    .filter_map(|&x| usize::try_from(x).ok())
                    .map(|x| x / (e / r))
                    .filter(|&d| !params.is_masked(d))
                    .collect();
                count += ranks.len() as u64;
                ranks.sort_unstable();
                ranks.dedup();
                msgs += ranks.len() as u64;
            }
        }
        sel.push(count);
    }
    let label = if params.use_fp8 { "FP8" } else { "BF16" };
    let (comb_label, comb_per_sel, comb_row, comb_what) = if p.logfmt {
        let lf = ep_core::numerics::logfmt::Layout::new(h).ok();
        (
            "LogFMT-10",
            lf.map_or(0, |l| l.deepep_counted_bytes()) as u64,
            (2 * h + 4 * (h / 128)) as u64,
            "one LogFMT-10 partial per (token, expert rank) at its largest (every chunk raw, \
             with its metas), local included",
        )
    } else {
        (
            "BF16",
            2 * h as u64,
            2 * h as u64,
            "one BF16 partial per (token, expert rank), local included",
        )
    };
    vec![
        PhaseResult {
            name: "dispatch",
            format: label,
            samples_us: disp,
            deepep_bytes_per_rank: sel
                .iter()
                .map(|&s| (s * per_sel_dispatch as u64) as f64)
                .collect(),
            deepep_unit: "logical",
            payload_bytes: msgs * row_bytes,
            payload_what: "one row per (token, destination rank), x and scales, local \
                               included",
            recorded_bytes: recs[last.0..last.1].iter().map(|x| x.bytes()).sum(),
            predictions: predictions(&recs[last.0..last.1], p.fabric),
        },
        PhaseResult {
            name: "combine",
            format: comb_label,
            samples_us: comb,
            deepep_bytes_per_rank: sel.iter().map(|&s| (s * comb_per_sel) as f64).collect(),
            deepep_unit: "logical",
            payload_bytes: msgs * comb_row,
            payload_what: comb_what,
            recorded_bytes: recs[last.1..last.2].iter().map(|x| x.bytes()).sum(),
            predictions: predictions(&recs[last.1..last.2], p.fabric),
        },
    ]
}

/// Compares one iteration's dispatch with the oracle's (canonical form), every rank.
fn check_dispatch(
    got: &[Option<LlDispatchOutput>],
    want: &Reference,
    it: usize,
    checks: &mut Checks,
) {
    let diffs = crate::ranks::per_rank(got.len(), |d| match (&got[d], &want.canonical[d]) {
        (Some(g), Some(c)) => match ll::canonicalize(g) {
            Ok(gc) => gc.first_difference(c).map(|x| format!(": {x}")),
            Err(x) => Some(format!(": {x}")),
        },
        (None, None) => None,
        _ => Some(": masked on one side only".into()),
    });
    for (d, same) in diffs.into_iter().enumerate() {
        if let Some(why) = same {
            checks.fail(format!(
                "iteration {it}: rank {d}: dispatch differs from the oracle{why}"
            ));
        }
    }
}

/// What one iteration's combine is checked against: the plan bit for bit, DeepEP's order and
/// `x * sum(weights)` within tolerance.
struct CombineCheck<'a> {
    inputs: &'a [RankInputs],
    want: &'a Reference,
    params: &'a ll::LlParams,
    /// Tolerance of DeepEP's check `calc_diff(x * sum(w), combined)`.
    tol: f64,
    /// Tolerance of `calc_diff` to DeepEP's reduction order.
    tol_order: f64,
    /// The partials of the plan's reduction (`want.reduced`).
    partials: PartialPrecision,
    it: usize,
}

impl CombineCheck<'_> {
    /// Checks every rank's `combined`; `worst` keeps the largest differences seen.
    fn check(
        &self,
        combined: &[Option<Tensor2<bf16>>],
        checks: &mut Checks,
        worst: &mut (f64, f64),
    ) {
        let (r, e) = (self.inputs.len(), self.params.num_experts);
        let (tol, tol_order) = (self.tol, self.tol_order);
        let results = crate::ranks::per_rank(r, |s| {
            let (g, a, b) = (&combined[s], &self.want.reduced[s], &self.want.deepep[s]);
            let (Some(g), Some(a), Some(b)) = (g, a, b) else {
                let one_sided = g.is_some() || a.is_some();
                return (
                    one_sided.then(|| "masked on one side only".to_string()),
                    vec![],
                    None,
                );
            };
            let mut fails = Vec::new();
            let exact = g.shape() == a.shape()
                && g.data()
                    .iter()
                    .zip(a.data())
                    .all(|(x, y)| x.to_bits() == y.to_bits());
            if !exact {
                fails.push(format!(
                    "combined_x differs from the plan (combine_reduced_on_expert_rank, {:?} \
                     partials)",
                    self.partials
                ));
            }
            let (d1, d2) = combine_diffs(&self.inputs[s], g, b, self.params, r, e);
            if d1.is_nan() || d1 >= tol_order {
                fails.push(format!(
                    "calc_diff to DeepEP's combine order {d1:.3e} >= {tol_order:e}"
                ));
            }
            if d2.is_nan() || d2 >= tol {
                fails.push(format!(
                    "calc_diff(x * sum(weights), combined) {d2:.3e} >= {tol:e}"
                ));
            }
            (None, fails, Some((d1, d2)))
        });
        for (s, (masked, fails, diffs)) in results.into_iter().enumerate() {
            for why in masked.into_iter().chain(fails) {
                checks.fail(format!("iteration {}: rank {s}: {why}", self.it));
            }
            if let Some((d1, d2)) = diffs {
                *worst = (worst.0.max(d1), worst.1.max(d2));
            }
        }
    }
}

/// The oracle's dispatch of one sign of the inputs.
struct OracleDispatch {
    out: Vec<Option<LlDispatchOutput>>,
    canonical: Vec<Option<LlCanonical>>,
}

/// The oracle's dispatch outputs for `inputs` and their canonical form.
fn oracle_dispatch(inputs: &[RankInputs], params: &LlParams) -> Result<OracleDispatch, BenchError> {
    let out = oracle::low_latency::dispatch(inputs, params)
        .map_err(|x| BenchError::reference("oracle low-latency dispatch", x))?;
    let canonical = out
        .iter()
        .map(|o| o.as_ref().map(ll::canonicalize).transpose())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|x| BenchError::reference("canonical form", x))?;
    Ok(OracleDispatch { out, canonical })
}

/// Both combine orders for `inputs` over the identity expert of the oracle's dispatch `out`
/// (written into `y`), the two computed side by side; ep-rs's with `partials`.
fn reference(
    inputs: &[RankInputs],
    params: &LlParams,
    out: &[Option<LlDispatchOutput>],
    (canonical, partials): (Vec<Option<LlCanonical>>, PartialPrecision),
    y: &mut ExpertOutputs,
) -> Result<Reference, BenchError> {
    let handles: Vec<Option<LlHandle>> = out
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    y.identity(out)?;
    let (handles, y) = (&handles, &y.y);
    let (reduced, deepep) = crate::ranks::join(
        || {
            ll::combine_reduced_on_expert_rank(inputs, handles, y, params, partials)
                .map_err(|x| BenchError::reference("low-latency combine (ep-rs order)", x))
        },
        || {
            ll::combine(inputs, handles, y, params)
                .map_err(|x| BenchError::reference("low-latency combine (DeepEP order)", x))
        },
    );
    Ok(Reference {
        canonical,
        reduced: reduced?,
        deepep: deepep?,
    })
}

/// Expert outputs `[L, R·N, H]` BF16 per rank, kept from one dispatch to the next: the packed
/// layout is mostly empty, so the arrays come from zeroed memory once and afterwards only the
/// rows a dispatch filled are written, and cleared when a later dispatch fills fewer.
#[derive(Default)]
struct ExpertOutputs {
    /// What combine reads.
    y: Vec<Option<Tensor3<bf16>>>,
    /// `written[d][l]`: rows `0..written` of `y[d][l]` may be nonzero, the rest are zero.
    written: Vec<Vec<usize>>,
}

impl ExpertOutputs {
    /// The identity expert over every receiver's packed rows: valid rows dequantised to BF16
    /// (as [`ep_core::plan::low_latency::LlRecvX::row_f32`], then rounded), the rest zero
    /// (`None` for masked receivers). Receivers are spread over the host's cores.
    fn identity(&mut self, outs: &[Option<LlDispatchOutput>]) -> Result<(), BenchError> {
        self.y.resize_with(outs.len(), || None);
        self.written.resize_with(outs.len(), Vec::new);
        let mut work: Vec<_> = outs
            .iter()
            .zip(&mut self.y)
            .zip(&mut self.written)
            .map(|((o, y), w)| (o, y, w))
            .collect();
        crate::ranks::per_item_mut(&mut work, |_, (o, y, w)| identity_one(o.as_ref(), y, w))
            .into_iter()
            .collect()
    }
}

/// The simulator bench's expert outputs for the dispatch `outs` (the identity expert,
/// [`ExpertOutputs::identity`]): `[L, R·N, H]` BF16 per receiver, `None` for masked ones. The GPU
/// bench combines the same values, so that its digest compares with this backend's.
pub(super) fn identity_expert_outputs(
    outs: &[Option<LlDispatchOutput>],
) -> Result<Vec<Option<Tensor3<bf16>>>, BenchError> {
    let mut y = ExpertOutputs::default();
    y.identity(outs)?;
    Ok(y.y)
}

/// [`ExpertOutputs::identity`] for one receiver.
fn identity_one(
    out: Option<&LlDispatchOutput>,
    y: &mut Option<Tensor3<bf16>>,
    written: &mut Vec<usize>,
) -> Result<(), BenchError> {
    let Some(out) = out else {
        *y = None;
        written.clear();
        return Ok(());
    };
    let h = out.handle.hidden;
    let rows = out.handle.src_info.cols();
    let l_count = out.recv_count.len();
    let fits = y.as_ref().is_some_and(|t| t.shape() == (l_count, rows, h));
    if !fits {
        *y = Some(ll::packed_zeros_bf16(l_count, rows, h));
        written.clear();
    }
    written.resize(l_count, 0);
    let Some(y) = y.as_mut() else {
        return Ok(());
    };
    let malformed = |l: usize, row: usize| {
        BenchError::reference(
            "expert outputs",
            ep_core::Error::LlInvalidLayout {
                local_expert: l,
                source_rank: usize::MAX,
                detail: format!("row {row} is malformed"),
            },
        )
    };
    let block = ep_core::numerics::fp8::FP8_BLOCK;
    for (l, written) in written.iter_mut().enumerate() {
        let count = usize::try_from(out.recv_count[l]).unwrap_or(0).min(rows);
        for row in 0..count {
            match &out.recv_x {
                // Same arithmetic as `row_f32` (`e4m3_decode(b) * scale_inv`), decoded without table.
                LlRecvX::Fp8 { data, scales }
                    if data.shape() == (l_count, rows, h)
                        && scales.shape() == (l_count, rows, h.div_ceil(block)) =>
                {
                    ep_core::numerics::fp8::dequantize_row_bf16(
                        data.row(l, row),
                        scales.row(l, row),
                        y.row_mut(l, row),
                    )
                    .map_err(|e| BenchError::reference("dequantising FP8 rows", e))?;
                }
                _ => {
                    let x = out
                        .recv_x
                        .row_f32(l, row)
                        .ok_or_else(|| malformed(l, row))?;
                    for (o, v) in y.row_mut(l, row).iter_mut().zip(x) {
                        *o = bf16::from_f32(v);
                    }
                }
            }
        }
        // Rows the last use wrote past this one's count.
        let cols = y.cols();
        if *written > count {
            y.matrix_mut(l)[count * cols..*written * cols].fill(bf16::ZERO);
        }
        *written = count;
    }
    Ok(())
}

/// Rank `s`'s two tolerance checks of its combined output `got` in one pass (the same sums,
/// term by term in the same order, as two separate [`calc_diff`]s):
/// - `calc_diff(got, deepep)`: to DeepEP's reduction order;
/// - DeepEP's own check, `calc_diff(x * Σ_k w[t][k] [idx >= 0, expert's rank unmasked], got)`
///   with `x` the BF16 input (NaN if `x` is not BF16 or of another shape).
fn combine_diffs(
    inp: &RankInputs,
    got: &Tensor2<bf16>,
    deepep: &Tensor2<bf16>,
    params: &LlParams,
    r: usize,
    e: usize,
) -> (f64, f64) {
    let f64s = |t: &Tensor2<bf16>| t.data().iter().map(|v| v.to_f64()).collect::<Vec<_>>();
    let Activations::Bf16(x) = &inp.x else {
        return (calc_diff(f64s(got), f64s(deepep)), f64::NAN);
    };
    if got.shape() != deepep.shape() || got.shape() != x.shape() {
        let d1 = calc_diff(f64s(got), f64s(deepep));
        return (d1, f64::NAN);
    }
    let l = (e / r.max(1)).max(1);
    let (mut xy1, mut sq1, mut xy2, mut sq2) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
    for t in 0..x.rows() {
        let sw: f64 = inp
            .topk_idx
            .row(t)
            .iter()
            .zip(inp.topk_weights.row(t))
            .filter(|&(&i, _)| i >= 0 && !params.is_masked(i as usize / l))
            .map(|(_, &w)| f64::from(w))
            .sum();
        for ((gv, dv), xv) in got.row(t).iter().zip(deepep.row(t)).zip(x.row(t)) {
            let (p, q) = (gv.to_f64() + 1.0, dv.to_f64() + 1.0);
            xy1 += p * q;
            sq1 += p * p + q * q;
            let w = xv.to_f64() * sw + 1.0;
            xy2 += w * p;
            sq2 += w * w + p * p;
        }
    }
    (finish_diff(xy1, sq1), finish_diff(xy2, sq2))
}

/// DeepEP's `calc_diff` from its two sums (both figures accumulate in one pass above).
fn finish_diff(xy: f64, sq: f64) -> f64 {
    if sq == 0.0 { 0.0 } else { 1.0 - 2.0 * xy / sq }
}
