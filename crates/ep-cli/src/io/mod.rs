//! NumPy I/O: replay real routings and dump every output, tensor by tensor, to compare ep-rs
//! with another implementation.
//!
//! # Inputs (`read_inputs`, `write_inputs`)
//!
//! One directory per rank, `DIR/rank0 .. DIR/rank{R-1}` without gaps (`R` = their number):
//!
//! | file | dtype | shape | meaning |
//! |---|---|---|---|
//! | `topk_idx.npy` | int64 | `[T, K]` | expert ids, `-1` = masked slot |
//! | `topk_weights.npy` | float32 | `[T, K]` | top-k weights |
//! | `x.npy` | float32 or uint16 | `[T, H]` | activations: float32 rounded to BF16 (nearest even) on load, uint16 taken as raw BF16 bits |
//! | `x_fp8.npy` + `x_scales.npy` | uint8 + float32 | `[T, H]` + `[T, ceil(H/128)]` | FP8 instead of `x.npy`: raw e4m3 bytes and per-128-channel `scale_inv` |
//!
//! `K`, `H` and the activation kind must agree across ranks; `T` must agree across a rank's
//! files but may differ between ranks (DeepEP allows it). Arrays may be little- or big-endian,
//! C or (2-D) Fortran order. Expert ids are checked against `num_experts`.
//!
//! Every file is written under a temporary name (`<name>.partial`) and renamed into place, so a
//! file that is there is whole.
//!
//! # Outputs (`dump_outputs`)
//!
//! Every output of a run under the spec's names (`../shared/spec/deepep-v1.md` §1.8, §1.9, §2),
//! one directory per rank, plus `manifest.json` ([`Manifest`]) with the options, seed, routing,
//! backend and the canonical digests of `ep_core::digest`. BF16 tensors are written as float32
//! (exact); FP8 tensors as float32 dequantised plus `<name>_fp8.npy` with the raw bytes.
//! A dump never looks complete before it is: over an older dump, the old manifest is removed
//! first and the new one written last; a directory holding more rank directories than the run
//! has is refused (as `write_inputs` refuses it), so stale ranks never sit beside a manifest.

mod dump;
mod inputs;
mod npy;

use std::path::{Path, PathBuf};

pub use dump::{MANIFEST, Manifest, Outputs, RankManifest, RunInfo, dump_outputs, read_manifest};
pub use inputs::{InputsSummary, read_inputs, summarize, write_inputs};

/// Everything that can go wrong reading inputs or writing dumps. Each variant names the file
/// (or directory) and says what to change; the underlying error, if any, is the `source()`
/// (print with `{:#}` in anyhow to see the chain).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// A file system operation failed.
    #[error("{}: {op} failed", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What was being done (`reading`, `creating`, ...).
        op: &'static str,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The inputs directory has no `rank0` directory.
    #[error(
        "{}: no rank directories; write one directory per rank, rank0, rank1, ..., each with \
         topk_idx.npy, topk_weights.npy and x.npy (or x_fp8.npy + x_scales.npy)",
        dir.display()
    )]
    NoRanks {
        /// The inputs directory.
        dir: PathBuf,
    },
    /// Rank directories with a gap: `rank{missing}` is absent but a later one exists.
    #[error(
        "{}: rank directory rank{missing} is missing but rank directories {found:?} exist; \
         ranks must be rank0..rank{{R-1}} without gaps",
        dir.display()
    )]
    MissingRankDir {
        /// The inputs directory.
        dir: PathBuf,
        /// The first missing rank.
        missing: usize,
        /// The rank directories that exist.
        found: Vec<usize>,
    },
    /// An entry of the inputs directory that is not a rank directory (`rank03`, a file
    /// `rank3`, anything else): refused rather than skipped, which would lose a rank.
    #[error(
        "{}: {why}; the inputs directory holds only rank0, rank1, ... directories (move other \
         entries elsewhere, rename rank03 to rank3)",
        path.display()
    )]
    NotARankDir {
        /// The entry.
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A NaN or infinite activation.
    #[error(
        "{}: activation [{token}, {channel}] is {value}; inputs must be finite (NaN != NaN, so \
         no output could be checked): fix or drop that token",
        path.display()
    )]
    NonFinite {
        /// The file.
        path: PathBuf,
        /// Its row (token).
        token: usize,
        /// Its column (channel, or scale block for `x_scales.npy`).
        channel: usize,
        /// The value found.
        value: String,
    },
    /// A rank count other than the one asked for (e.g. `--ranks`).
    #[error(
        "{}: {found} rank directories, but {expected} ranks were asked for; drop the option \
         or point to the inputs of {expected} ranks",
        dir.display()
    )]
    RankCountMismatch {
        /// The inputs directory.
        dir: PathBuf,
        /// Rank directories found.
        found: usize,
        /// Ranks asked for.
        expected: usize,
    },
    /// A required file is absent.
    #[error("{}: missing; it should hold {what}", path.display())]
    MissingFile {
        /// The file.
        path: PathBuf,
        /// What it should hold.
        what: &'static str,
    },
    /// An array of the wrong dtype.
    #[error(
        "{}: dtype {found}, expected {expected}; convert it before saving (e.g. \
         a.astype(numpy.float32))",
        path.display()
    )]
    WrongDtype {
        /// The file.
        path: PathBuf,
        /// The dtype found (NumPy descr, e.g. `<f8`).
        found: String,
        /// The dtype(s) accepted.
        expected: &'static str,
    },
    /// An array with the wrong number of dimensions.
    #[error(
        "{}: array of shape {shape:?} has {} dimension(s), expected {expected}: {layout}",
        path.display(),
        shape.len()
    )]
    WrongNdim {
        /// The file.
        path: PathBuf,
        /// Its shape.
        shape: Vec<u64>,
        /// The number of dimensions needed.
        expected: usize,
        /// The layout needed, e.g. `[T, K]`.
        layout: &'static str,
    },
    /// Not a readable `.npy` file: bad header, truncated data.
    #[error("{}: not a readable .npy file: {detail}; re-save it with numpy.save", path.display())]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A shape that disagrees with another file of the same rank, another rank, or the options.
    #[error("{}: shape {shape:?}, expected {expected} ({why})", path.display())]
    ShapeMismatch {
        /// The file.
        path: PathBuf,
        /// Its shape.
        shape: Vec<u64>,
        /// The shape needed.
        expected: String,
        /// Which file or option it must agree with.
        why: String,
    },
    /// Both BF16 and FP8 activations (or different kinds on different ranks).
    #[error("{}: {detail}", path.display())]
    AmbiguousActivations {
        /// The rank directory.
        path: PathBuf,
        /// What was found and what to keep.
        detail: String,
    },
    /// Values that ep-core rejects (e.g. an expert id outside `[-1, num_experts)`).
    #[error("{}: invalid contents", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// ep-core's error (boxed: it is large).
        #[source]
        source: Box<ep_core::Error>,
    },
    /// `write_inputs` or `dump_outputs` into a directory holding more rank directories than it
    /// writes.
    #[error(
        "{}: a rank directory beyond the {num_ranks} ranks being written exists; reading the \
         directory back would see it: remove it or write to an empty directory",
        path.display()
    )]
    StaleRankDir {
        /// The extra rank directory.
        path: PathBuf,
        /// The ranks being written.
        num_ranks: usize,
    },
    /// `manifest.json` could not be written or parsed.
    #[error("{}: not a valid manifest", path.display())]
    Json {
        /// The manifest.
        path: PathBuf,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// Outputs that ep-core cannot digest or dequantise (inconsistent shapes or layouts).
    #[error("outputs that cannot be digested or dumped")]
    Outputs(#[source] Box<ep_core::Error>),
}

impl IoError {
    pub(crate) fn outputs(e: ep_core::Error) -> Self {
        Self::Outputs(Box::new(e))
    }

    pub(crate) fn io(path: &Path, op: &'static str, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            op,
            source,
        }
    }
}

/// `DIR/rank{r}`.
pub fn rank_dir(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank{rank}"))
}

/// `path` with `.partial` appended: where a file is written before it is renamed into place.
fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

fn create_dir(path: &Path) -> Result<(), IoError> {
    std::fs::create_dir_all(path).map_err(|e| IoError::io(path, "creating directory", e))
}
