//! Per-rank inputs from and to `.npy` files (format in the module docs of [`super`]).

use std::collections::BTreeSet;
use std::path::Path;

use ep_core::{Activations, RankInputs, Tensor2, validate_routing};
use half::bf16;

use super::npy::{self, Npy};
use super::{IoError, create_dir, rank_dir};

const TOPK_IDX: &str = "topk_idx.npy";
const TOPK_WEIGHTS: &str = "topk_weights.npy";
const X: &str = "x.npy";
const X_FP8: &str = "x_fp8.npy";
const X_SCALES: &str = "x_scales.npy";

/// FP8 scales cover 128 channels each (spec §1.8).
const FP8_BLOCK: usize = 128;

/// The shapes of a set of inputs, as the files gave them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InputsSummary {
    /// Ranks `R`.
    pub num_ranks: usize,
    /// Tokens `T` of each rank.
    pub tokens: Vec<usize>,
    /// Hidden size `H`.
    pub hidden: usize,
    /// Top-k `K`.
    pub topk: usize,
    /// FP8 activations (e4m3 + scales) rather than BF16.
    pub fp8: bool,
}

impl InputsSummary {
    /// The largest `T` over ranks (0 without ranks).
    pub fn max_tokens(&self) -> usize {
        self.tokens.iter().copied().max().unwrap_or(0)
    }
}

/// The shapes of `inputs` (rank 0 gives `H`, `K` and the kind; [`read_inputs`] has checked the
/// others agree).
pub fn summarize(inputs: &[RankInputs]) -> InputsSummary {
    InputsSummary {
        num_ranks: inputs.len(),
        tokens: inputs.iter().map(RankInputs::num_tokens).collect(),
        hidden: inputs.first().map_or(0, |i| i.x.hidden()),
        topk: inputs.first().map_or(0, RankInputs::num_topk),
        fp8: matches!(inputs.first().map(|i| &i.x), Some(Activations::Fp8 { .. })),
    }
}

/// Reads every rank's inputs from `dir/rank{r}/*.npy`, checking dtypes, dimensions, shapes
/// within a rank and across ranks, and expert ids against `num_experts`.
pub fn read_inputs(dir: &Path, num_experts: usize) -> Result<Vec<RankInputs>, IoError> {
    let ranks = rank_dirs(dir)?;
    let mut out: Vec<RankInputs> = Vec::with_capacity(ranks);
    for r in 0..ranks {
        let inp = read_rank(dir, r, num_experts)?;
        check_finite(&rank_dir(dir, r), &inp.x)?;
        if let Some(first) = out.first() {
            agree_with_rank0(dir, r, first, &inp)?;
        }
        out.push(inp);
    }
    Ok(out)
}

/// Activations must be finite: NaN or infinity would make every comparison of the outputs
/// meaningless (NaN != NaN), so they are refused as what they are, naming the first one.
fn check_finite(rank_dir: &Path, x: &Activations) -> Result<(), IoError> {
    let first = |path: std::path::PathBuf, cols: usize, at: Option<usize>, value: String| match at {
        Some(i) => Err(IoError::NonFinite {
            path,
            token: i / cols.max(1),
            channel: i % cols.max(1),
            value,
        }),
        None => Ok(()),
    };
    match x {
        Activations::Bf16(t) => {
            let at = t.data().iter().position(|v| !v.is_finite());
            let value = at.map(|i| t.data()[i].to_string()).unwrap_or_default();
            first(rank_dir.join(X), t.cols(), at, value)
        }
        Activations::Fp8 { data, scales } => {
            // e4m3 has no infinities; 0x7f and 0xff are its NaNs.
            let at = data.data().iter().position(|&b| b & 0x7f == 0x7f);
            let value = at.map(|i| format!("{:#04x} (e4m3 NaN)", data.data()[i]));
            first(
                rank_dir.join(X_FP8),
                data.cols(),
                at,
                value.unwrap_or_default(),
            )?;
            let at = scales.data().iter().position(|v| !v.is_finite());
            let value = at.map(|i| scales.data()[i].to_string()).unwrap_or_default();
            first(rank_dir.join(X_SCALES), scales.cols(), at, value)
        }
    }
}

/// Number of rank directories, checking they are `rank0..rank{R-1}` without gaps.
fn rank_dirs(dir: &Path) -> Result<usize, IoError> {
    let entries = std::fs::read_dir(dir).map_err(|e| IoError::io(dir, "listing", e))?;
    let mut found = BTreeSet::new();
    for entry in entries {
        let entry = entry.map_err(|e| IoError::io(dir, "listing", e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        // Hidden entries (editors', file managers') are not the user's data.
        if name.starts_with('.') {
            continue;
        }
        // Only the canonical spelling (`rank1`, not `rank01`) is a rank directory; anything
        // else would silently be a rank fewer.
        let rank = name
            .strip_prefix("rank")
            .and_then(|d| d.parse::<usize>().ok())
            .filter(|n| format!("rank{n}") == name);
        match rank {
            Some(n) if entry.path().is_dir() => {
                found.insert(n);
            }
            Some(_) => {
                return Err(IoError::NotARankDir {
                    path: entry.path(),
                    why: "is not a directory",
                });
            }
            None => {
                return Err(IoError::NotARankDir {
                    path: entry.path(),
                    why: "is not a rank directory name (rank0, rank1, ... without leading \
                          zeros)",
                });
            }
        }
    }
    let Some(&last) = found.last() else {
        return Err(IoError::NoRanks {
            dir: dir.to_path_buf(),
        });
    };
    if let Some(missing) = (0..=last).find(|r| !found.contains(r)) {
        return Err(IoError::MissingRankDir {
            dir: dir.to_path_buf(),
            missing,
            found: found.into_iter().collect(),
        });
    }
    Ok(last + 1)
}

fn shape_error(path: &Path, shape: &[u64], expected: String, why: String) -> IoError {
    IoError::ShapeMismatch {
        path: path.to_path_buf(),
        shape: shape.to_vec(),
        expected,
        why,
    }
}

fn read_rank(dir: &Path, rank: usize, num_experts: usize) -> Result<RankInputs, IoError> {
    let rd = rank_dir(dir, rank);
    let idx_path = rd.join(TOPK_IDX);
    let idx = Npy::open(&idx_path, "top-k expert ids, int64 [T, K], -1 = masked")?;
    idx.expect_ndim(&idx_path, 2, "[T, K] expert ids")?;
    let data = idx.read::<i64>(&idx_path, "int64")?;
    let (t, k) = (idx.shape[0] as usize, idx.shape[1] as usize);
    let topk_idx = tensor(&idx_path, t, k, data)?;
    validate_routing(&topk_idx, num_experts, rank).map_err(|source| IoError::Invalid {
        path: idx_path.clone(),
        source: Box::new(source),
    })?;

    let w_path = rd.join(TOPK_WEIGHTS);
    let w = Npy::open(&w_path, "top-k weights, float32 [T, K]")?;
    w.expect_ndim(&w_path, 2, "[T, K] top-k weights")?;
    let data = w.read::<f32>(&w_path, "float32")?;
    if w.shape != idx.shape {
        return Err(shape_error(
            &w_path,
            &w.shape,
            format!("[T, K] = {:?}", idx.shape),
            format!("must match rank{rank}/{TOPK_IDX}"),
        ));
    }
    let topk_weights = tensor(&w_path, t, k, data)?;

    let x = read_activations(&rd, rank, t)?;
    Ok(RankInputs {
        x,
        topk_idx,
        topk_weights,
    })
}

fn tensor<T>(path: &Path, rows: usize, cols: usize, data: Vec<T>) -> Result<Tensor2<T>, IoError> {
    Tensor2::new(rows, cols, data).map_err(|source| IoError::Invalid {
        path: path.to_path_buf(),
        source: Box::new(source),
    })
}

fn read_activations(rd: &Path, rank: usize, t: usize) -> Result<Activations, IoError> {
    let (x_path, fp8_path) = (rd.join(X), rd.join(X_FP8));
    let row_check = |path: &Path, shape: &[u64]| {
        if shape[0] as usize != t {
            return Err(shape_error(
                path,
                shape,
                format!("[T, H] with T = {t}"),
                format!("T must match rank{rank}/{TOPK_IDX}"),
            ));
        }
        Ok(())
    };
    match (x_path.exists(), fp8_path.exists()) {
        (true, true) => Err(IoError::AmbiguousActivations {
            path: rd.to_path_buf(),
            detail: format!("both {X} (BF16) and {X_FP8} (FP8) exist; keep the one to dispatch"),
        }),
        (false, false) => Err(IoError::MissingFile {
            path: x_path,
            what: "activations: float32 or uint16 (raw BF16 bits) [T, H]; or x_fp8.npy (uint8 \
                   e4m3 [T, H]) with x_scales.npy (float32 [T, H/128])",
        }),
        (true, false) => {
            let x = Npy::open(&x_path, "activations [T, H]")?;
            x.expect_ndim(&x_path, 2, "[T, H] activations")?;
            let data: Vec<bf16> = match x.kind() {
                "u2" => x
                    .read::<u16>(&x_path, "float32 or uint16 (raw BF16 bits)")?
                    .into_iter()
                    .map(bf16::from_bits)
                    .collect(),
                _ => x
                    .read::<f32>(&x_path, "float32 or uint16 (raw BF16 bits)")?
                    .into_iter()
                    .map(bf16::from_f32)
                    .collect(),
            };
            row_check(&x_path, &x.shape)?;
            let h = x.shape[1] as usize;
            Ok(Activations::Bf16(tensor(&x_path, t, h, data)?))
        }
        (false, true) => {
            let q = Npy::open(&fp8_path, "FP8 activations, uint8 e4m3 [T, H]")?;
            q.expect_ndim(&fp8_path, 2, "[T, H] raw e4m3 bytes")?;
            let data = q.read::<u8>(&fp8_path, "uint8 (raw e4m3 bytes)")?;
            row_check(&fp8_path, &q.shape)?;
            let h = q.shape[1] as usize;
            let s_path = rd.join(X_SCALES);
            let s = Npy::open(&s_path, "FP8 scales, float32 [T, H/128]")?;
            s.expect_ndim(&s_path, 2, "[T, H/128] FP8 scales")?;
            let scales = s.read::<f32>(&s_path, "float32")?;
            let want = [t as u64, h.div_ceil(FP8_BLOCK) as u64];
            if s.shape != want {
                return Err(shape_error(
                    &s_path,
                    &s.shape,
                    format!("[T, ceil(H/128)] = {want:?}"),
                    format!("one scale per 128 channels of rank{rank}/{X_FP8}"),
                ));
            }
            Ok(Activations::Fp8 {
                data: tensor(&fp8_path, t, h, data)?,
                scales: tensor(&s_path, want[0] as usize, want[1] as usize, scales)?,
            })
        }
    }
}

/// `K`, `H` and the activation kind must be rank 0's.
fn agree_with_rank0(
    dir: &Path,
    rank: usize,
    first: &RankInputs,
    inp: &RankInputs,
) -> Result<(), IoError> {
    let rd = rank_dir(dir, rank);
    if inp.num_topk() != first.num_topk() {
        let (t, k) = inp.topk_idx.shape();
        return Err(shape_error(
            &rd.join(TOPK_IDX),
            &[t as u64, k as u64],
            format!("[T, {}]", first.num_topk()),
            format!("K must match rank0/{TOPK_IDX}"),
        ));
    }
    let kind = |a: &Activations| matches!(a, Activations::Fp8 { .. });
    if kind(&inp.x) != kind(&first.x) {
        let name = |fp8| {
            if fp8 {
                "FP8 (x_fp8.npy)"
            } else {
                "BF16 (x.npy)"
            }
        };
        return Err(IoError::AmbiguousActivations {
            path: rd,
            detail: format!(
                "{} here but {} on rank 0; every rank must send the same kind",
                name(kind(&inp.x)),
                name(kind(&first.x))
            ),
        });
    }
    if inp.x.hidden() != first.x.hidden() {
        let file = if kind(&inp.x) { X_FP8 } else { X };
        return Err(shape_error(
            &rd.join(file),
            &[inp.x.num_tokens() as u64, inp.x.hidden() as u64],
            format!("[T, {}]", first.x.hidden()),
            format!("H must match rank0/{file}"),
        ));
    }
    Ok(())
}

/// Writes every rank's inputs to `dir/rank{r}/` in the format [`read_inputs`] reads: BF16
/// activations as float32 `x.npy` (exact), FP8 as `x_fp8.npy` + `x_scales.npy`. Files of the
/// other activation kind left in a rank directory are removed (the reader would refuse both).
/// Fails if `dir/rank{R}` exists, since a reader would take it for one more rank.
pub fn write_inputs(dir: &Path, inputs: &[RankInputs]) -> Result<(), IoError> {
    create_dir(dir)?;
    let stale = rank_dir(dir, inputs.len());
    if stale.exists() {
        return Err(IoError::StaleRankDir {
            path: stale,
            num_ranks: inputs.len(),
        });
    }
    for (r, inp) in inputs.iter().enumerate() {
        let rd = rank_dir(dir, r);
        create_dir(&rd)?;
        let (t, k) = inp.topk_idx.shape();
        npy::write(&rd.join(TOPK_IDX), &[t, k], inp.topk_idx.data())?;
        let (wt, wk) = inp.topk_weights.shape();
        npy::write(&rd.join(TOPK_WEIGHTS), &[wt, wk], inp.topk_weights.data())?;
        match &inp.x {
            Activations::Bf16(x) => {
                let v: Vec<f32> = x.data().iter().map(|v| v.to_f32()).collect();
                npy::write(&rd.join(X), &[x.rows(), x.cols()], &v)?;
                remove_if_present(&rd.join(X_FP8))?;
                remove_if_present(&rd.join(X_SCALES))?;
            }
            Activations::Fp8 { data, scales } => {
                npy::write(&rd.join(X_FP8), &[data.rows(), data.cols()], data.data())?;
                npy::write(
                    &rd.join(X_SCALES),
                    &[scales.rows(), scales.cols()],
                    scales.data(),
                )?;
                remove_if_present(&rd.join(X))?;
            }
        }
    }
    Ok(())
}

fn remove_if_present(path: &Path) -> Result<(), IoError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(IoError::io(path, "removing", e)),
    }
}
