//! What `ep bench` prints and writes with `--json`.
//!
//! Per call (dispatch, combine), in DeepEP's style (spec §6.2, §6.4):
//! `[normal] dispatch BF16: 11.2 GB/s (NVL, per rank), 27650 us (min .., max ..) | predicted
//! 880.1 us = 352.9 GB/s (NVLink-bound: nvlink into rank 3)`. DeepEP prints each rank's own
//! bytes over its own kernel time; on the simulator one host-timed call serves every rank, so
//! the figure is the mean of the ranks' byte counts over the median call time. The predicted
//! figure is the same bytes over the cost model's time, the one to compare with BASELINES.md.
//! Then the payload rate: bytes the protocol must move per call (each phase says what it counts)
//! over the median time, and its ratio to this machine's single-thread `memcpy`.

use std::path::Path;
use std::time::Instant;

use ep_core::transport::FabricParams;
use ep_sim::cost::Prediction;
use serde::Serialize;

use super::{BenchArgs, BenchError, ModeResult, PhaseResult};
use crate::io::RunInfo;
use crate::workload::Workload;

/// The fabric a run modelled.
#[derive(Clone, Debug, Serialize)]
pub struct FabricReport {
    /// Ranks.
    pub num_ranks: usize,
    /// Ranks per node (NVLink domain).
    pub ranks_per_node: usize,
    /// Outstanding work requests per QP.
    pub qp_depth: u32,
    /// RC QPs per peer.
    pub rc_per_pe: u16,
    /// Heap chunk size, bytes.
    pub granularity: u64,
}

/// DeepEP's figure for one call.
#[derive(Clone, Debug, Serialize)]
pub struct DeepEpFigure {
    /// `NVL` (normal mode: `recv_x.numel() * 2`, FP8 scaled) or `logical` (low-latency).
    pub unit: String,
    /// Each rank's byte count.
    pub bytes_per_rank: Vec<f64>,
    /// Their mean.
    pub mean_bytes_per_rank: f64,
    /// Mean bytes per rank over the median time, GB/s.
    pub gb_per_s: f64,
}

/// The cost model's prediction of one phase.
#[derive(Clone, Debug, Serialize)]
pub struct PhasePrediction {
    /// The phase (`DispatchSend`, `LowLatencyDispatchRecv`, ...).
    pub phase: String,
    /// Predicted time, microseconds.
    pub total_us: f64,
    /// Busiest resource's time.
    pub serialisation_us: f64,
    /// Busiest resource.
    pub bottleneck: String,
    /// Slowest QP's depth-bound time.
    pub qp_stall_us: f64,
    /// Latency of the longest wait chain.
    pub latency_us: f64,
    /// Launch overhead.
    pub launch_us: f64,
}

/// One call (dispatch or combine).
#[derive(Clone, Debug, Serialize)]
pub struct CallReport {
    /// `dispatch` or `combine`.
    pub name: String,
    /// `BF16`, `FP8` or (a LogFMT combine) `LogFMT-10`.
    pub format: String,
    /// Host time of each timed iteration, microseconds.
    pub samples_us: Vec<f64>,
    /// Their median.
    pub median_us: f64,
    /// Their minimum.
    pub min_us: f64,
    /// Their maximum.
    pub max_us: f64,
    /// DeepEP's byte count and bandwidth figure.
    pub deepep: DeepEpFigure,
    /// Bytes the protocol must move per call.
    pub payload_bytes: u64,
    /// What they are.
    pub payload_counts: String,
    /// Payload bytes over the median time, GB/s.
    pub payload_gb_per_s: f64,
    /// That rate over the single-thread memcpy rate.
    pub payload_memcpy_ratio: f64,
    /// Bytes the executor recorded in the last iteration (all data, metadata and signals).
    pub recorded_bytes: u64,
    /// The cost model's time for the call (sum over its phases), microseconds.
    pub predicted_us: f64,
    /// DeepEP's mean bytes per rank over the predicted time, GB/s.
    pub predicted_gb_per_s: f64,
    /// What bounds the prediction.
    pub predicted_bound: String,
    /// Each phase's prediction.
    pub predicted_phases: Vec<PhasePrediction>,
}

/// Payload of both calls together.
#[derive(Clone, Debug, Serialize)]
pub struct PayloadReport {
    /// Bytes per iteration (dispatch + combine).
    pub bytes: u64,
    /// Sum of the median times, microseconds.
    pub median_us: f64,
    /// Bytes over time, GB/s.
    pub gb_per_s: f64,
    /// This machine's single-thread memcpy, GB/s.
    pub memcpy_gb_per_s: f64,
    /// Their ratio.
    pub memcpy_ratio: f64,
}

/// The canonical digests of the outputs.
#[derive(Clone, Debug, Serialize)]
pub struct DigestReport {
    /// `blake3`.
    pub algorithm: String,
    /// `ep_core::digest::FORMAT_VERSION`.
    pub format_version: u32,
    /// Over the run.
    pub total: String,
    /// Per rank.
    pub ranks: Vec<String>,
}

/// What the verification found.
#[derive(Clone, Debug, Serialize)]
pub struct VerificationReport {
    /// Every output of every iteration matched.
    pub verified: bool,
    /// Iterations checked (warm-up included).
    pub iterations: usize,
    /// Mismatches found.
    pub mismatches: usize,
    /// The first of them.
    pub first_mismatches: Vec<String>,
    /// Figures of the checks (tolerances met).
    pub notes: Vec<String>,
    /// What was compared with what.
    pub against: String,
}

/// The whole report (`--json` writes it as is).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// ep-rs's version.
    pub ep_rs_version: String,
    /// `bench`.
    pub command: String,
    /// `sim` or `sim-checked`.
    pub backend: String,
    /// `normal` or `low-latency`.
    pub mode: String,
    /// Every option of the run.
    pub options: serde_json::Map<String, serde_json::Value>,
    /// Workload description.
    pub workload: String,
    /// The fabric.
    pub fabric: FabricReport,
    /// Single-thread memcpy, GB/s.
    pub memcpy_gb_per_s: f64,
    /// Dispatch, then combine.
    pub calls: Vec<CallReport>,
    /// Both calls' payload.
    pub payload: PayloadReport,
    /// Output digests.
    pub digest: DigestReport,
    /// Verification.
    pub verification: VerificationReport,
    /// Whether everything matched (also in `verification`).
    pub verified: bool,
    /// Wall time per step, seconds (set-up, references, timed calls, verification, digest).
    pub steps_s: Vec<(String, f64)>,
    /// Wall time of the whole command, seconds.
    pub wall_s: f64,
}

pub(crate) fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => 0.5 * (s[n / 2 - 1] + s[n / 2]),
    }
}

/// What bounds a prediction: the QP depth, latency, or the busiest resource's link class.
fn bound(p: &Prediction) -> String {
    if p.qp_stall_us > p.serialisation_us {
        let at = p
            .qp_stall_at
            .map(|(s, d, q)| format!(" (QP {q} of rank {s} to {d})"))
            .unwrap_or_default();
        format!("QP-depth-bound{at}")
    } else if p.serialisation_us < p.latency_us + p.launch_us {
        "latency-bound".into()
    } else {
        let class = if p.bottleneck.contains("nvlink") {
            "NVLink-bound"
        } else if p.bottleneck.contains("hbm") {
            "HBM-bound"
        } else {
            "RDMA-bound"
        };
        format!("{class}: {}", p.bottleneck)
    }
}

impl CallReport {
    fn new(p: PhaseResult, memcpy: f64) -> Self {
        let med = median(&p.samples_us);
        let min = p.samples_us.iter().copied().fold(f64::INFINITY, f64::min);
        let max = p.samples_us.iter().copied().fold(0.0, f64::max);
        let n = p.deepep_bytes_per_rank.len().max(1) as f64;
        let mean = p.deepep_bytes_per_rank.iter().sum::<f64>() / n;
        let rate = |bytes: f64, us: f64| if us > 0.0 { bytes / us / 1e3 } else { 0.0 };
        let predicted_us: f64 = p.predictions.iter().map(|(_, x)| x.total_us).sum();
        let predicted_bound = p
            .predictions
            .iter()
            .max_by(|a, b| a.1.total_us.total_cmp(&b.1.total_us))
            .map(|(_, x)| bound(x))
            .unwrap_or_default();
        let payload_rate = rate(p.payload_bytes as f64, med);
        Self {
            name: p.name.into(),
            format: p.format.into(),
            median_us: med,
            min_us: if min.is_finite() { min } else { 0.0 },
            max_us: max,
            deepep: DeepEpFigure {
                unit: p.deepep_unit.into(),
                gb_per_s: rate(mean, med),
                mean_bytes_per_rank: mean,
                bytes_per_rank: p.deepep_bytes_per_rank,
            },
            payload_bytes: p.payload_bytes,
            payload_counts: p.payload_what.into(),
            payload_gb_per_s: payload_rate,
            payload_memcpy_ratio: if memcpy > 0.0 {
                payload_rate / memcpy
            } else {
                0.0
            },
            recorded_bytes: p.recorded_bytes,
            predicted_us,
            predicted_gb_per_s: rate(mean, predicted_us),
            predicted_bound,
            predicted_phases: p
                .predictions
                .into_iter()
                .map(|(phase, x)| PhasePrediction {
                    phase,
                    total_us: x.total_us,
                    serialisation_us: x.serialisation_us,
                    bottleneck: x.bottleneck,
                    qp_stall_us: x.qp_stall_us,
                    latency_us: x.latency_us,
                    launch_us: x.launch_us,
                })
                .collect(),
            samples_us: p.samples_us,
        }
    }
}

impl Report {
    #[allow(clippy::too_many_arguments, reason = "the pieces of one report")]
    pub(crate) fn new(
        args: &BenchArgs,
        w: &Workload,
        info: &RunInfo,
        fabric: &FabricParams,
        memcpy: f64,
        result: ModeResult,
        timeline: &super::Timeline,
        started: Instant,
    ) -> Self {
        let calls: Vec<CallReport> = result
            .phases
            .into_iter()
            .map(|p| CallReport::new(p, memcpy))
            .collect();
        let bytes: u64 = calls.iter().map(|c| c.payload_bytes).sum();
        let us: f64 = calls.iter().map(|c| c.median_us).sum();
        let gb = if us > 0.0 {
            bytes as f64 / us / 1e3
        } else {
            0.0
        };
        let checks = result.checks;
        let verified = checks.failures == 0;
        let against = match w.mode {
            crate::workload::Mode::Normal => {
                "oracle::normal (layout, dispatch and combine), bit for bit".to_string()
            }
            crate::workload::Mode::LowLatency => format!(
                "oracle::low_latency dispatch (canonical form); combine bit for bit with \
                 combine_reduced_on_expert_rank ({} partials) and within DeepEP's tolerances",
                if args.logfmt { "LogFMT-10" } else { "BF16" }
            ),
        };
        Self {
            ep_rs_version: env!("CARGO_PKG_VERSION").into(),
            command: "bench".into(),
            backend: args.backend.name().into(),
            mode: w.mode.name().into(),
            options: info.options.clone(),
            workload: w.description.clone(),
            fabric: FabricReport {
                num_ranks: fabric.num_ranks,
                ranks_per_node: fabric.ranks_per_node,
                qp_depth: fabric.qp_depth,
                rc_per_pe: fabric.rc_per_pe,
                granularity: fabric.granularity,
            },
            memcpy_gb_per_s: memcpy,
            calls,
            payload: PayloadReport {
                bytes,
                median_us: us,
                gb_per_s: gb,
                memcpy_gb_per_s: memcpy,
                memcpy_ratio: if memcpy > 0.0 { gb / memcpy } else { 0.0 },
            },
            digest: DigestReport {
                algorithm: "blake3".into(),
                format_version: ep_core::digest::FORMAT_VERSION,
                total: result.digest.total.to_string(),
                ranks: result
                    .digest
                    .ranks
                    .iter()
                    .map(ToString::to_string)
                    .collect(),
            },
            verification: VerificationReport {
                verified,
                iterations: checks.iterations,
                mismatches: checks.failures,
                first_mismatches: checks.mismatches,
                notes: checks.notes,
                against,
            },
            verified,
            steps_s: timeline
                .steps()
                .into_iter()
                .map(|(n, s)| (n.to_string(), s))
                .collect(),
            wall_s: started.elapsed().as_secs_f64(),
        }
    }

    /// Prints the DeepEP-style lines, the payload rate, the verification and the digest.
    pub fn print(&self) {
        let tag = format!("[{}]", self.mode);
        for c in &self.calls {
            println!(
                "{tag} {} {}: simulated on this CPU {:.2} GB/s ({}, per rank), {:.0} us (min \
                 {:.0}, max {:.0}) | GPU prediction (cost model) {:.1} us = {:.1} GB/s ({})",
                c.name,
                c.format,
                c.deepep.gb_per_s,
                c.deepep.unit,
                c.median_us,
                c.min_us,
                c.max_us,
                c.predicted_us,
                c.predicted_gb_per_s,
                c.predicted_bound,
            );
        }
        for c in &self.calls {
            println!(
                "{tag} payload {}: {:.3} GB per call ({}) in {:.0} us = {:.2} GB/s, {:.0}% of \
                 single-thread memcpy",
                c.name,
                c.payload_bytes as f64 / 1e9,
                c.payload_counts,
                c.median_us,
                c.payload_gb_per_s,
                100.0 * c.payload_memcpy_ratio,
            );
        }
        println!(
            "{tag} payload dispatch + combine: {:.2} GB/s = {:.0}% of this machine's single-thread \
             memcpy ({:.2} GB/s)",
            self.payload.gb_per_s,
            100.0 * self.payload.memcpy_ratio,
            self.payload.memcpy_gb_per_s,
        );
        for n in &self.verification.notes {
            println!("{tag} {n}");
        }
        println!(
            "output digest {} (blake3, canonical format v{})",
            self.digest.total, self.digest.format_version
        );
        if self.verified {
            println!(
                "verified: {} iteration(s), every output == reference ({})",
                self.verification.iterations, self.verification.against
            );
        } else {
            for m in &self.verification.first_mismatches {
                println!("mismatch: {m}");
            }
            println!(
                "MISMATCH: {} difference(s) from the reference over {} iteration(s)",
                self.verification.mismatches, self.verification.iterations
            );
        }
        let steps: Vec<String> = self
            .steps_s
            .iter()
            .map(|(n, s)| format!("{n} {s:.2}"))
            .collect();
        println!("done in {:.2} s ({})", self.wall_s, steps.join(", "));
    }

    /// Writes the report as JSON.
    pub fn write_json(&self, path: &Path) -> Result<(), BenchError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| BenchError::Json {
            path: path.to_path_buf(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(path, text + "\n").map_err(|source| BenchError::Json {
            path: path.to_path_buf(),
            source,
        })
    }
}
