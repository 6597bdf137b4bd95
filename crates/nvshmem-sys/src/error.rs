//! The one error type of nvshmem-sys.

use std::path::PathBuf;

/// Result alias of nvshmem-sys.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong loading or calling the NVSHMEM host library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No `libnvshmem_host.so.3` in any place searched.
    #[error(
        "NVSHMEM host library (libnvshmem_host.so.3) not found; searched, in order:\n{}\n\
         install NVSHMEM >= 3.3.9 (`pip install nvidia-nvshmem-cu13` or cu12) or set NVSHMEM_DIR",
        list(.searched)
    )]
    LibraryNotFound {
        /// Every candidate file, in search order.
        searched: Vec<PathBuf>,
    },
    /// The file exists but `dlopen` refused it.
    #[error("dlopen({path}) failed: {reason}")]
    Load {
        /// The library file.
        path: PathBuf,
        /// `dlerror()` text.
        reason: String,
    },
    /// A required entry point is missing (a library older than this crate supports).
    #[error("symbol `{symbol}` missing in {path}: {reason}")]
    MissingSymbol {
        /// The C name.
        symbol: &'static str,
        /// The library file.
        path: PathBuf,
        /// `dlerror()` text.
        reason: String,
    },
    /// A call returned a non-zero status.
    #[error("{op} failed with status {code}")]
    Call {
        /// The C function.
        op: &'static str,
        /// Its return value.
        code: i32,
    },
    /// `nvshmemx_cumodule_init` returned 7: the module was not linked against
    /// `libnvshmem_device.a` of the loaded version.
    #[error(
        "nvshmemx_cumodule_init returned 7: the CUDA module was not linked against the \
         libnvshmem_device.a of the loaded NVSHMEM"
    )]
    ModuleNotLinked,
    /// A call that returns a pointer returned NULL.
    #[error("{op} returned NULL ({what})")]
    Null {
        /// The C function.
        op: &'static str,
        /// What the arguments were.
        what: String,
    },
    /// A call returned a value outside its documented range.
    #[error("{op} returned {value}, outside its documented range")]
    OutOfRange {
        /// The C function.
        op: &'static str,
        /// The value returned.
        value: i64,
    },
}

fn list(paths: &[PathBuf]) -> String {
    if paths.is_empty() {
        return "  (no candidate place: NVSHMEM_DIR, NVSHMEM_HOME, PATH and LD_LIBRARY_PATH empty)"
            .into();
    }
    paths
        .iter()
        .map(|p| format!("  {}", p.display()))
        .collect::<Vec<_>>()
        .join("\n")
}
