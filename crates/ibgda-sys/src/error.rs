//! The one error type of ibgda-sys.

use std::path::PathBuf;

/// Result alias of ibgda-sys.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong loading or calling rdma-core or GDRCopy.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The library is in none of the places searched.
    #[error("{library} not found; searched, in order:\n{}\n{hint}", list(.searched))]
    LibraryNotFound {
        /// File name looked for.
        library: &'static str,
        /// Every candidate file, in search order.
        searched: Vec<PathBuf>,
        /// What installs it.
        hint: &'static str,
    },
    /// `dlopen` refused the file.
    #[error("dlopen({path}) failed: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// `dlerror()` text.
        reason: String,
    },
    /// A required entry point is missing (a library older than ibgda-sys supports).
    #[error("{path} lacks a required entry point: {reason}")]
    MissingSymbol {
        /// The file.
        path: PathBuf,
        /// `dlerror()` text (names the symbol).
        reason: String,
    },
    /// An optional entry point of a newer rdma-core is absent.
    #[error(
        "{symbol} is not provided by {path} (rdma-core too old: dma-buf registration needs v34+, extended GID queries v32+)"
    )]
    Unsupported {
        /// The C name.
        symbol: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// A call returned an error status (`errno` when the library sets it).
    #[error("{op} failed: status {code}, errno {errno} ({})", std::io::Error::from_raw_os_error(*.errno))]
    Call {
        /// The C function.
        op: &'static str,
        /// Its return value.
        code: i64,
        /// `errno` right after the call.
        errno: i32,
    },
    /// A call returning a pointer returned NULL.
    #[error("{op} returned NULL, errno {errno} ({})", std::io::Error::from_raw_os_error(*.errno))]
    Null {
        /// The C function.
        op: &'static str,
        /// `errno` right after the call.
        errno: i32,
    },
    /// `ibv_get_device_list` failed with `ENOSYS`: the kernel has no RDMA (uverbs) support
    /// loaded, so there is no `/sys/class/infiniband`.
    #[error(
        "ibv_get_device_list: no kernel RDMA support (ENOSYS): load the NIC's RDMA driver (e.g. mlx5_ib) and ib_uverbs"
    )]
    NoRdmaSubsystem,
    /// `gdr_open` failed: the gdrdrv kernel module is not loaded (or /dev/gdrdrv is not
    /// accessible).
    #[error(
        "gdr_open failed: the gdrdrv kernel module is not loaded or /dev/gdrdrv is not accessible (load it with `sudo modprobe gdrdrv` / GDRCopy's insmod.sh)"
    )]
    GdrOpen,
}

fn list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| format!("  {}", p.display()))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}
