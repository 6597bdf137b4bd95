//! The one error type of ep-kernels.

use std::net::SocketAddr;
use std::time::Duration;

use nvshmem_sys::Version;

/// Result alias of ep-kernels.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in the GPU backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `libcuda.so.1` could not be loaded (no NVIDIA driver on this machine).
    #[error("the CUDA driver library (libcuda.so.1) is not present: no NVIDIA driver here")]
    CudaDriverMissing,
    /// A CUDA driver call failed.
    #[error("CUDA {op} failed: {source}")]
    Cuda {
        /// What was being done.
        op: &'static str,
        /// The driver error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// The crate was built without the kernel (no nvcc at build time).
    #[error(
        "CUDA kernels were not built into ep-kernels ({module}): {reason}; install nvcc (see GPU.md) and rebuild"
    )]
    KernelsNotBuilt {
        /// The kernel module.
        module: &'static str,
        /// Why build.rs skipped it.
        reason: &'static str,
    },
    /// Loading or calling NVSHMEM failed.
    #[error(transparent)]
    Nvshmem(#[from] nvshmem_sys::Error),
    /// The NVSHMEM found is older than the backends need.
    #[error("NVSHMEM {found} at {path} is too old: ep-rs needs NVSHMEM >= {need}")]
    NvshmemTooOld {
        /// Version loaded.
        found: Version,
        /// Minimum version.
        need: Version,
        /// The library file.
        path: String,
    },
    /// NVSHMEM initialises once per process.
    #[error("NVSHMEM was already initialised in this process (it initialises once per process)")]
    AlreadyInitialized,
    /// `finalize` was called while symmetric buffers of the session were alive.
    #[error(
        "PE {pe}: cannot finalize NVSHMEM while {alive} symmetric buffer(s) are alive: drop them first, in the same order on every PE"
    )]
    SymmetricBuffersAlive {
        /// This PE.
        pe: u32,
        /// Buffers still holding the session.
        alive: usize,
    },
    /// NVSHMEM's view of this process differs from what the launcher said.
    #[error("NVSHMEM says this is PE {pe} of {n_pes}, the launcher said rank {rank} of {world}")]
    PeMismatch {
        /// `nvshmem_my_pe`.
        pe: i32,
        /// `nvshmem_n_pes`.
        n_pes: i32,
        /// Rank given.
        rank: u32,
        /// World size given.
        world: u32,
    },
    /// Bad rank/world arguments.
    #[error("rank {rank} is not in a world of {world}")]
    BadRank {
        /// Rank given.
        rank: u32,
        /// World size given.
        world: u32,
    },
    /// The requested NVSHMEM bootstrap plugin is not shipped with the library.
    #[error("NVSHMEM bootstrap plugin {plugin} not found in {dir}; use the unique-id bootstrap")]
    BootstrapPluginMissing {
        /// The plugin file name.
        plugin: &'static str,
        /// The NVSHMEM library directory.
        dir: String,
    },
    /// The environment does not select the requested native bootstrap.
    #[error(
        "NVSHMEM_BOOTSTRAP is {found:?}, the {method} bootstrap needs NVSHMEM_BOOTSTRAP={need} in the rank's environment at launch"
    )]
    BootstrapEnv {
        /// Method requested.
        method: &'static str,
        /// Value needed.
        need: &'static str,
        /// Value present.
        found: Option<String>,
    },
    /// A rendezvous socket operation failed.
    #[error("rendezvous {op} ({addr}) failed: {source}")]
    RendezvousIo {
        /// What was being done.
        op: &'static str,
        /// The rendezvous address.
        addr: SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A bounded rendezvous wait ran out.
    #[error(
        "rendezvous timed out after {timeout:?} at {addr}: rank {rank} was waiting for {waiting_for}"
    )]
    RendezvousTimeout {
        /// The waiting rank.
        rank: u32,
        /// Who or what it waited for (e.g. "rank 0 (the root)" or "ranks [2, 3]").
        waiting_for: String,
        /// The rendezvous address.
        addr: SocketAddr,
        /// The bound.
        timeout: Duration,
    },
    /// The peer or root refused this rank (wrong token, duplicate rank, world mismatch).
    #[error("rendezvous at {addr} refused rank {rank}: {reason}")]
    RendezvousRefused {
        /// The refused rank.
        rank: u32,
        /// The rendezvous address.
        addr: SocketAddr,
        /// Why.
        reason: String,
    },
    /// An address that listens on every interface was given without opting in.
    #[error(
        "refusing to listen on all interfaces ({addr}); give a specific address or opt in with allow_all_interfaces"
    )]
    RendezvousUnspecifiedAddress {
        /// The address given.
        addr: SocketAddr,
    },
    /// The session token is missing or too short.
    #[error("rendezvous session token invalid: {reason}")]
    RendezvousToken {
        /// Why.
        reason: String,
    },
    /// A caller-fed unique id does not have the right length or root.
    #[error("caller-fed unique id: {reason}")]
    UniqueId {
        /// Why.
        reason: String,
    },
    /// A variable the launcher needs is missing or malformed.
    #[error("environment variable {var}: {reason}")]
    Env {
        /// The variable.
        var: String,
        /// Why.
        reason: String,
    },
    /// A spawned rank process failed.
    #[error("rank process {rank} {what}")]
    RankProcess {
        /// The rank.
        rank: u32,
        /// What happened (exit status, timeout, spawn failure).
        what: String,
    },
}

impl Error {
    pub(crate) fn cuda(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        move |source| Error::Cuda { op, source }
    }
}
