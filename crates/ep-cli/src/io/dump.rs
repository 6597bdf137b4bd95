//! Every output of a run as `.npy` under the spec's names, and `manifest.json`.
//!
//! Normal mode (intranode, spec §1.8, §2.2), `DIR/rank{r}/`:
//! `recv_x` (float32 `[rows, H]`; FP8: dequantised, plus `recv_x_fp8` uint8 and
//! `recv_x_scales` float32 `[rows, H/128]`), `recv_topk_idx` (int64), `recv_topk_weights`
//! (float32), `num_recv_tokens_per_expert_list` (int32 `[L]`), `rank_prefix_matrix` (int32
//! `[R, R]`, only column `r` defined), `channel_prefix_matrix`, `recv_channel_prefix_matrix`
//! (int32 `[R, C]`), `recv_src_idx` (int32 `[rows]`), `is_token_in_rank` (bool `[T, R]`),
//! `send_head` (int32 `[T, R]`, as the outputs hold it: raw from dispatch, or rewritten if a
//! combine rewrote it), `combined_x` (float32 `[T, H]`), `combined_topk_weights` (float32
//! `[T, K]`). `rows` includes worst-token padding when the dispatch used `num_worst_tokens`.
//!
//! Low-latency mode (spec §1.9, §2.4, §2.5), `DIR/rank{r}/` (empty for a masked rank):
//! `packed_recv_x` (float32 `[L, R*N, H]`; FP8: dequantised, plus `packed_recv_x_fp8` uint8),
//! `packed_recv_x_scales` (float32, logical `[L, R*N, H/128]`; UE8M0: the unpacked scales, plus
//! `packed_recv_x_scales_ue8m0` int32 `[L, R*N, H/512]` as packed), `packed_recv_count` (int32
//! `[L]`), `packed_recv_src_info` (int32 `[L, R*N]`), `packed_recv_layout_range` (int64
//! `[L, R]`), `combined_x` (float32 `[T, H]`). Rows past each count are dumped as they are
//! (zero from the plan, garbage from DeepEP); the digest ignores them.

use std::path::Path;

use ep_core::digest::{self, RunDigest};
use ep_core::numerics::fp8;
use ep_core::plan::combine::CombineOutput;
use ep_core::plan::intranode::IntranodeDispatch;
use ep_core::plan::low_latency::{LlDispatchOutput, LlRecvX};
use ep_core::{Activations, Tensor2};
use half::bf16;
use serde::{Deserialize, Serialize};

use super::npy::{self, Elem};
use super::{IoError, create_dir, rank_dir};

/// File name of the manifest in a dump directory.
pub const MANIFEST: &str = "manifest.json";

/// The outputs of one run, every rank, borrowed from whoever produced them (plan, simulator,
/// GPU).
#[derive(Clone, Copy, Debug)]
pub enum Outputs<'a> {
    /// Normal-mode intranode dispatch and combine.
    Normal {
        /// Each rank's dispatch outputs (handle included).
        dispatch: &'a [IntranodeDispatch],
        /// Each rank's combine outputs, or empty for a dispatch-only run.
        combine: &'a [CombineOutput],
    },
    /// Low-latency dispatch and combine.
    LowLatency {
        /// Each rank's dispatch outputs, `None` for a masked rank.
        dispatch: &'a [Option<LlDispatchOutput>],
        /// Each rank's `combined_x`, `None` for a masked rank; empty for a dispatch-only run.
        combined_x: &'a [Option<Tensor2<bf16>>],
    },
}

impl Outputs<'_> {
    /// `normal` or `low-latency`.
    pub fn mode(&self) -> &'static str {
        match self {
            Self::Normal { .. } => "normal",
            Self::LowLatency { .. } => "low-latency",
        }
    }

    /// Ranks.
    pub fn num_ranks(&self) -> usize {
        match self {
            Self::Normal { dispatch, .. } => dispatch.len(),
            Self::LowLatency { dispatch, .. } => dispatch.len(),
        }
    }

    /// The canonical digests ([`ep_core::digest`]): equal on every backend for equal
    /// semantics.
    pub fn digest(&self) -> ep_core::Result<RunDigest> {
        match *self {
            Self::Normal { dispatch, combine } => digest::normal(dispatch, combine),
            Self::LowLatency {
                dispatch,
                combined_x,
            } => digest::low_latency(dispatch, combined_x),
        }
    }
}

/// What produced a run, recorded in the manifest.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// `plan` (ep-core's plan), later `sim` or `gpu`.
    pub backend: String,
    /// Seed of a generated workload; `None` for inputs read from files.
    pub seed: Option<u64>,
    /// Routing of a generated workload (`uniform`, `zipf:S`, `hot:F`).
    pub routing: Option<String>,
    /// Directory the inputs were read from, if they were.
    pub inputs: Option<String>,
    /// Every option of the run (ranks, tokens, hidden, top-k, experts, channels, FP8, ...).
    pub options: serde_json::Map<String, serde_json::Value>,
}

/// One rank in the manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankManifest {
    /// The rank.
    pub rank: usize,
    /// Low-latency rank masked: no outputs.
    pub masked: bool,
    /// Canonical digest of its outputs (hex BLAKE3).
    pub digest: String,
    /// The `.npy` files written for it, relative to its directory.
    pub files: Vec<String>,
}

/// `manifest.json`: what ran and the digests of what came out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Version of ep-rs that wrote the dump.
    pub ep_rs_version: String,
    /// [`ep_core::digest::FORMAT_VERSION`] of the digests.
    pub digest_format_version: u32,
    /// Hash function of the digests (`blake3`).
    pub digest_algorithm: String,
    /// `normal` or `low-latency`.
    pub mode: String,
    /// Ranks.
    pub num_ranks: usize,
    /// Backend, seed, routing, inputs and options.
    #[serde(flatten)]
    pub run: RunInfo,
    /// Canonical digest of the whole run (hex BLAKE3).
    pub digest: String,
    /// Per rank.
    pub ranks: Vec<RankManifest>,
}

/// Writes every output of `outputs` to `dir/rank{r}/` and `dir/manifest.json`; returns the
/// manifest (with the digests).
pub fn dump_outputs(
    dir: &Path,
    outputs: &Outputs<'_>,
    info: &RunInfo,
) -> Result<Manifest, IoError> {
    let digests = outputs.digest().map_err(IoError::outputs)?;
    create_dir(dir)?;
    let stale = rank_dir(dir, outputs.num_ranks());
    if stale.exists() {
        return Err(IoError::StaleRankDir {
            path: stale,
            num_ranks: outputs.num_ranks(),
        });
    }
    // Until the new manifest is written last, the directory does not look like a dump.
    let path = dir.join(MANIFEST);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(IoError::io(&path, "removing the old manifest", e));
        }
        _ => {}
    }
    let mut ranks = Vec::with_capacity(outputs.num_ranks());
    for r in 0..outputs.num_ranks() {
        let rd = rank_dir(dir, r);
        create_dir(&rd)?;
        let mut files = Files {
            dir: &rd,
            names: Vec::new(),
        };
        let masked = match *outputs {
            Outputs::Normal { dispatch, combine } => {
                dump_normal(&mut files, &dispatch[r], combine.get(r))?;
                false
            }
            Outputs::LowLatency {
                dispatch,
                combined_x,
            } => match &dispatch[r] {
                Some(d) => {
                    dump_ll(&mut files, d, combined_x.get(r).and_then(Option::as_ref))?;
                    false
                }
                None => true,
            },
        };
        ranks.push(RankManifest {
            rank: r,
            masked,
            digest: digests.ranks[r].to_string(),
            files: files.names,
        });
    }
    let manifest = Manifest {
        ep_rs_version: env!("CARGO_PKG_VERSION").into(),
        digest_format_version: digest::FORMAT_VERSION,
        digest_algorithm: "blake3".into(),
        mode: outputs.mode().into(),
        num_ranks: outputs.num_ranks(),
        run: info.clone(),
        digest: digests.total.to_string(),
        ranks,
    };
    let text = serde_json::to_string_pretty(&manifest).map_err(|source| IoError::Json {
        path: path.clone(),
        source,
    })?;
    let partial = super::partial_path(&path);
    std::fs::write(&partial, text + "\n").map_err(|e| IoError::io(&partial, "writing", e))?;
    std::fs::rename(&partial, &path).map_err(|e| IoError::io(&path, "renaming into place", e))?;
    Ok(manifest)
}

/// Reads `dir/manifest.json`.
pub fn read_manifest(dir: &Path) -> Result<Manifest, IoError> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|e| IoError::io(&path, "reading", e))?;
    serde_json::from_str(&text).map_err(|source| IoError::Json { path, source })
}

/// The files of one rank directory, remembered for the manifest.
struct Files<'a> {
    dir: &'a Path,
    names: Vec<String>,
}

impl Files<'_> {
    fn write<T: Elem>(&mut self, name: &str, shape: &[usize], data: &[T]) -> Result<(), IoError> {
        let file = format!("{name}.npy");
        npy::write(&self.dir.join(&file), shape, data)?;
        self.names.push(file);
        Ok(())
    }

    fn bf16(&mut self, name: &str, shape: &[usize], data: &[bf16]) -> Result<(), IoError> {
        let v: Vec<f32> = data.iter().map(|v| v.to_f32()).collect();
        self.write(name, shape, &v)
    }

    fn matrix<T: Elem>(&mut self, name: &str, m: &Tensor2<T>) -> Result<(), IoError> {
        self.write(name, &[m.rows(), m.cols()], m.data())
    }
}

fn dump_normal(
    f: &mut Files<'_>,
    d: &IntranodeDispatch,
    combine: Option<&CombineOutput>,
) -> Result<(), IoError> {
    match &d.recv_x {
        Activations::Bf16(x) => f.bf16("recv_x", &[x.rows(), x.cols()], x.data())?,
        Activations::Fp8 { data, scales } => {
            let deq = fp8::dequantize(data, scales).map_err(IoError::outputs)?;
            f.matrix("recv_x", &deq)?;
            f.matrix("recv_x_fp8", data)?;
            f.matrix("recv_x_scales", scales)?;
        }
    }
    if let Some(t) = &d.recv_topk_idx {
        f.matrix("recv_topk_idx", t)?;
    }
    if let Some(t) = &d.recv_topk_weights {
        f.matrix("recv_topk_weights", t)?;
    }
    let list = &d.num_recv_tokens_per_expert_list;
    f.write("num_recv_tokens_per_expert_list", &[list.len()], list)?;
    let h = &d.handle;
    f.matrix("rank_prefix_matrix", &h.rank_prefix_matrix)?;
    f.matrix("channel_prefix_matrix", &h.channel_prefix_matrix)?;
    f.matrix("recv_channel_prefix_matrix", &h.recv_channel_prefix_matrix)?;
    f.write("recv_src_idx", &[h.recv_src_idx.len()], &h.recv_src_idx)?;
    f.matrix("is_token_in_rank", &h.is_token_in_rank)?;
    f.matrix("send_head", &h.send_head)?;
    if let Some(c) = combine {
        let x = &c.combined_x;
        f.bf16("combined_x", &[x.rows(), x.cols()], x.data())?;
        if let Some(w) = &c.combined_topk_weights {
            f.matrix("combined_topk_weights", w)?;
        }
    }
    Ok(())
}

fn dump_ll(
    f: &mut Files<'_>,
    d: &LlDispatchOutput,
    combined_x: Option<&Tensor2<bf16>>,
) -> Result<(), IoError> {
    let h = &d.handle;
    let l_count = d.recv_count.len();
    let rows = h.src_info.cols();
    let hidden = h.hidden;
    let dims = [l_count, rows, hidden];
    let bad = |l: usize, row: usize| {
        IoError::outputs(ep_core::Error::LlInvalidLayout {
            local_expert: l,
            source_rank: usize::MAX,
            detail: format!("row {row} of packed_recv_x is malformed (shape or scales)"),
        })
    };
    match &d.recv_x {
        LlRecvX::Bf16(x) => f.bf16("packed_recv_x", &dims, x.data())?,
        LlRecvX::Fp8 { data, .. } | LlRecvX::Fp8Ue8m0 { data, .. } => {
            let mut deq = Vec::with_capacity(l_count * rows * hidden);
            for l in 0..l_count {
                for row in 0..rows {
                    deq.extend(d.recv_x.row_f32(l, row).ok_or_else(|| bad(l, row))?);
                }
            }
            f.write("packed_recv_x", &dims, &deq)?;
            f.write("packed_recv_x_fp8", &dims, data.data())?;
        }
    }
    let num_scales = hidden / fp8::FP8_BLOCK;
    match &d.recv_x {
        LlRecvX::Bf16(_) => {}
        LlRecvX::Fp8 { scales, .. } => {
            f.write(
                "packed_recv_x_scales",
                &[l_count, rows, num_scales],
                scales.data(),
            )?;
        }
        LlRecvX::Fp8Ue8m0 { scales, .. } => {
            let mut logical = Vec::with_capacity(l_count * rows * num_scales);
            for l in 0..scales.matrices() {
                for row in 0..scales.rows() {
                    let v = fp8::unpack_ue8m0(scales.row(l, row), num_scales)
                        .map_err(|_| bad(l, row))?;
                    logical.extend(v);
                }
            }
            f.write(
                "packed_recv_x_scales",
                &[l_count, rows, num_scales],
                &logical,
            )?;
            f.write(
                "packed_recv_x_scales_ue8m0",
                &[l_count, rows, scales.cols()],
                scales.data(),
            )?;
        }
    }
    f.write("packed_recv_count", &[l_count], &d.recv_count)?;
    f.matrix("packed_recv_src_info", &h.src_info)?;
    f.matrix("packed_recv_layout_range", &h.layout_range)?;
    if let Some(x) = combined_x {
        f.bf16("combined_x", &[x.rows(), x.cols()], x.data())?;
    }
    Ok(())
}
