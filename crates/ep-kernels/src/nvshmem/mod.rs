//! NVSHMEM bring-up for the GPU backend: load and version-check the host library, apply the
//! environment plan before init ([`env`](mod@env)), bootstrap through a [`Rendezvous`] (unique id) or
//! NVSHMEM's own MPI/PMIx/PMI launcher integration, initialise, report what came up
//! ([`report`]), allocate symmetric memory, hand out peer pointers, finalise.
//!
//! One process per GPU; NVSHMEM initialises once per process. [`launch`] starts such processes
//! with the plan in their environment.
//!
//! ```no_run
//! use ep_kernels::nvshmem::{BringUp, Bootstrap, rendezvous::TcpRendezvous};
//! let rdv = TcpRendezvous::from_env()?; // EP_RENDEZVOUS_PORT / _TOKEN set by the launcher
//! let session = BringUp::new(0, 2, Bootstrap::UniqueId(&rdv)).device(0).init()?;
//! println!("{}", session.report());
//! let buf = session.alloc(1 << 20, 128)?; // holds the session; freed on drop (collective)
//! let _peer = buf.peer_ptr(1);
//! session.barrier_all();
//! drop(buf);
//! session.finalize()?; // refused while a buffer is alive
//! # Ok::<(), ep_kernels::Error>(())
//! ```
//!
//! Teardown order, which the types enforce: symmetric buffers are freed (each holds the
//! session's inner state), then NVSHMEM is finalised, then the CUDA context it ran on is
//! released. A session dropped without `finalize` leaves NVSHMEM running and so keeps its context
//! (and the library, never unloaded) alive until the process exits.

pub mod device_link;
pub mod env;
pub mod launch;
pub mod rendezvous;
pub mod report;

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaContext, CudaStream};
use nvshmem_sys::{
    MIN_VERSION, NVSHMEMX_INIT_WITH_UNIQUEID, Nvshmem, nvshmemx_init_attr_t, nvshmemx_uniqueid_t,
};

use crate::error::{Error, Result};
pub use rendezvous::{
    CallerFedRendezvous, Rendezvous, SessionToken, SoloRendezvous, TcpRendezvous, UniqueId,
};
pub use report::{IbgdaState, InitReport};

/// Set once the process has started an NVSHMEM init (successful or not).
static INIT_STARTED: AtomicBool = AtomicBool::new(false);

/// Loads NVSHMEM and checks its version (>= 3.3.9, spec §5).
pub fn load_checked(library: Option<&Path>) -> Result<Nvshmem> {
    let lib = Nvshmem::load(library)?;
    check_version(&lib)?;
    Ok(lib)
}

/// [`Error::NvshmemTooOld`] when the loaded library is older than [`MIN_VERSION`].
pub fn check_version(lib: &Nvshmem) -> Result<()> {
    let found = lib.vendor_version();
    if found < MIN_VERSION {
        return Err(Error::NvshmemTooOld {
            found,
            need: MIN_VERSION,
            path: lib.path().display().to_string(),
        });
    }
    Ok(())
}

/// Creates the root's unique id (rank 0), for callers that carry it themselves
/// ([`CallerFedRendezvous`]). The id stays valid until init; create it once per job.
pub fn create_unique_id(lib: &Nvshmem) -> Result<UniqueId> {
    Ok(UniqueId(lib.get_uniqueid()?.to_bytes()))
}

/// NVSHMEM's own launcher integrations (a bootstrap plugin next to the host library).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NativeBootstrap {
    /// `MPI_COMM_WORLD` through `nvshmem_bootstrap_mpi.so.3`.
    Mpi,
    /// PMIx through `nvshmem_bootstrap_pmix.so.3`.
    Pmix,
    /// PMI-2 through `nvshmem_bootstrap_pmi2.so.3`.
    Pmi2,
    /// PMI through `nvshmem_bootstrap_pmi.so.3`.
    Pmi,
}

impl NativeBootstrap {
    /// The plugin file that must sit next to `libnvshmem_host.so.3`.
    pub fn plugin(self) -> &'static str {
        match self {
            Self::Mpi => "nvshmem_bootstrap_mpi.so.3",
            Self::Pmix => "nvshmem_bootstrap_pmix.so.3",
            Self::Pmi2 => "nvshmem_bootstrap_pmi2.so.3",
            Self::Pmi => "nvshmem_bootstrap_pmi.so.3",
        }
    }

    /// The `NVSHMEM_BOOTSTRAP` value selecting it (set in the rank's environment at launch).
    pub fn env_value(self) -> &'static str {
        match self {
            Self::Mpi => "MPI",
            Self::Pmix => "PMIX",
            Self::Pmi2 => "PMI-2",
            Self::Pmi => "PMI",
        }
    }

    /// Whether the loaded library ships this plugin.
    pub fn available(self, lib: &Nvshmem) -> bool {
        lib.lib_dir().join(self.plugin()).is_file()
    }
}

/// How the ranks find each other.
#[derive(Clone, Copy)]
pub enum Bootstrap<'a> {
    /// Unique id from rank 0, carried by a [`Rendezvous`].
    UniqueId(&'a dyn Rendezvous),
    /// NVSHMEM's own launcher integration; rank and world come from the launcher.
    Native(NativeBootstrap),
}

/// Builder of one rank's NVSHMEM session.
pub struct BringUp<'a> {
    rank: u32,
    world: u32,
    device: Option<usize>,
    library: Option<PathBuf>,
    bootstrap: Bootstrap<'a>,
    capture_init_log: bool,
}

impl<'a> BringUp<'a> {
    /// Rank `rank` of `world` processes (one per GPU).
    pub fn new(rank: u32, world: u32, bootstrap: Bootstrap<'a>) -> Self {
        Self {
            rank,
            world,
            device: None,
            library: None,
            bootstrap,
            capture_init_log: true,
        }
    }

    /// CUDA device ordinal (default: `rank % device count`).
    pub fn device(mut self, ordinal: usize) -> Self {
        self.device = Some(ordinal);
        self
    }

    /// An explicit `libnvshmem_host.so.3` (or install directory); the only place searched.
    pub fn library(mut self, path: impl Into<PathBuf>) -> Self {
        self.library = Some(path.into());
        self
    }

    /// Capture NVSHMEM's stdout and stderr during init for the transport report (default on; the output
    /// is still forwarded to stderr).
    pub fn capture_init_log(mut self, on: bool) -> Self {
        self.capture_init_log = on;
        self
    }

    /// Loads, checks, bootstraps and initialises NVSHMEM on this rank (collective).
    pub fn init(self) -> Result<NvshmemSession> {
        if self.rank >= self.world {
            return Err(Error::BadRank {
                rank: self.rank,
                world: self.world,
            });
        }
        // SAFETY: is_culib_present only tries to dlopen libcuda.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::CudaDriverMissing);
        }
        let lib = load_checked(self.library.as_deref())?;
        if let Bootstrap::Native(m) = self.bootstrap {
            if !m.available(&lib) {
                return Err(Error::BootstrapPluginMissing {
                    plugin: m.plugin(),
                    dir: lib.lib_dir().display().to_string(),
                });
            }
            let found = env::var("NVSHMEM_BOOTSTRAP");
            if found.as_deref().map(str::to_ascii_uppercase).as_deref() != Some(m.env_value()) {
                return Err(Error::BootstrapEnv {
                    method: m.env_value(),
                    need: m.env_value(),
                    found,
                });
            }
        }
        if INIT_STARTED.swap(true, Ordering::SeqCst) || lib.init_status() != 0 {
            return Err(Error::AlreadyInitialized);
        }
        let device = match self.device {
            Some(d) => d,
            None => {
                let n = CudaContext::device_count().map_err(Error::cuda("cuDeviceGetCount"))?;
                self.rank as usize % (n.max(1) as usize)
            }
        };
        // Retains the primary context and makes it current: NVSHMEM uses the current context.
        let ctx = CudaContext::new(device).map_err(Error::cuda("CudaContext::new"))?;

        let env_seen = env::nvshmem_vars();
        let tees = if self.capture_init_log {
            [report::FdTee::stdout(), report::FdTee::stderr()]
        } else {
            [None, None]
        };
        let bootstrap_desc;
        let init = match self.bootstrap {
            Bootstrap::UniqueId(rdv) => {
                let mut make = || create_unique_id(&lib);
                let id = rdv.unique_id(self.rank, self.world, &mut make)?;
                bootstrap_desc = "unique id".to_string();
                // Boxed so the pointer stored in `attr` stays valid until init returns.
                let uid = Box::new(nvshmemx_uniqueid_t::from_bytes(&id.0));
                let mut attr = nvshmemx_init_attr_t::default();
                let rank = self.rank as i32;
                let world = self.world as i32;
                // SAFETY: `uid` outlives the init call below, which is the last use of `attr`.
                unsafe { lib.set_attr_uniqueid_args(rank, world, &*uid, &mut attr) }?;
                // SAFETY: first and only init in this process (INIT_STARTED); this rank's
                // context is current; the environment was fixed at process start (env module).
                unsafe { lib.hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &mut attr) }
            }
            Bootstrap::Native(m) => {
                bootstrap_desc = format!("NVSHMEM {} bootstrap", m.env_value());
                let mut attr = nvshmemx_init_attr_t::default();
                // SAFETY: as above; flags 0 selects the bootstrap named by NVSHMEM_BOOTSTRAP.
                unsafe { lib.hostlib_init_attr(0, &mut attr) }
            }
        };
        let logs: Vec<String> = tees
            .into_iter()
            .flatten()
            .map(report::FdTee::finish)
            .collect();
        let init_log = self.capture_init_log.then(|| logs.concat());
        init?;

        // SAFETY: NVSHMEM is initialised.
        let (pe, n_pes) = unsafe { (lib.my_pe()?, lib.n_pes()?) };
        if let Bootstrap::UniqueId(_) = self.bootstrap
            && (pe as u32 != self.rank || n_pes as u32 != self.world)
        {
            // NVSHMEM is up in this context and nobody will finalise it: keep the context (as
            // a session dropped without finalize does).
            std::mem::forget(ctx);
            return Err(Error::PeMismatch {
                pe,
                n_pes,
                rank: self.rank,
                world: self.world,
            });
        }
        let plugins = report::mapped_transport_plugins();
        let failed = init_log
            .as_deref()
            .map(report::failed_transports)
            .unwrap_or_default();
        let requested = report::env_true(
            env_seen
                .iter()
                .find(|(k, _)| k == "NVSHMEM_IB_ENABLE_IBGDA")
                .map(|(_, v)| v.as_str()),
        );
        let ibgda = report::ibgda_state(requested, &plugins, &failed);
        let mut session = NvshmemSession {
            inner: Arc::new(SessionInner {
                lib: Arc::new(lib),
                ctx: ManuallyDrop::new(ctx),
                pe: pe as u32,
                finalized: AtomicBool::new(false),
            }),
            n_pes: n_pes as u32,
            report: InitReport {
                version: MIN_VERSION,
                library: PathBuf::new(),
                bootstrap: bootstrap_desc,
                pe: pe as u32,
                n_pes: n_pes as u32,
                device,
                env: env_seen,
                plugins_loaded: plugins,
                failed_transports: failed,
                p2p_peers: Vec::new(),
                remote_peers: Vec::new(),
                ibgda,
                init_log,
            },
        };
        session.report.version = session.inner.lib.vendor_version();
        session.report.library = session.inner.lib.path().to_path_buf();
        session.probe_peers()?;
        Ok(session)
    }
}

/// What a session and its symmetric buffers share: the library, the CUDA context NVSHMEM was
/// initialised on, and whether it has been finalised. The last holder drops it, after every
/// buffer is gone.
struct SessionInner {
    lib: Arc<Nvshmem>,
    /// Released only after a finalize (see `Drop`): an NVSHMEM still running uses it.
    ctx: ManuallyDrop<Arc<CudaContext>>,
    pe: u32,
    /// Set by [`NvshmemSession::finalize`] once `nvshmemx_hostlib_finalize` has returned.
    finalized: AtomicBool,
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        if self.finalized.load(Ordering::Acquire) {
            // SAFETY: dropped once, here; NVSHMEM is finalised, so nothing uses the context.
            unsafe { ManuallyDrop::drop(&mut self.ctx) };
        } else {
            // NVSHMEM still runs (its proxy thread, its heap in this context): releasing the
            // primary context under it would reset it. Keep it until the process exits (the
            // library is never unloaded either: nvshmem-sys).
            if !std::thread::panicking() {
                eprintln!(
                    "ep-kernels: NVSHMEM session of PE {} dropped without finalize()",
                    self.pe
                );
            }
        }
    }
}

/// An initialised NVSHMEM on this rank. Finalise explicitly with [`NvshmemSession::finalize`]
/// (collective) once every [`SymmetricBuffer`] is dropped; dropping the session without it does
/// not finalise (that would block on absent peers) and keeps NVSHMEM and its CUDA context alive
/// until the process exits.
pub struct NvshmemSession {
    inner: Arc<SessionInner>,
    n_pes: u32,
    report: InitReport,
}

impl std::fmt::Debug for NvshmemSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvshmemSession")
            .field("pe", &self.inner.pe)
            .field("n_pes", &self.n_pes)
            .finish_non_exhaustive()
    }
}

impl NvshmemSession {
    fn probe_peers(&mut self) -> Result<()> {
        // A one-byte symmetric probe; NVSHMEM maps whole heap chunks per peer, so reachability
        // of this object is that of the heap.
        let probe = self.alloc(128, 128)?;
        for pe in (0..self.n_pes).filter(|p| *p != self.inner.pe) {
            if probe.peer_ptr(pe).is_some() {
                self.report.p2p_peers.push(pe);
            } else {
                self.report.remote_peers.push(pe);
            }
        }
        drop(probe);
        Ok(())
    }

    /// The loaded library (raw calls: `nvshmem_sys`).
    pub fn lib(&self) -> &Arc<Nvshmem> {
        &self.inner.lib
    }

    /// The CUDA context NVSHMEM was initialised on.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// This PE.
    pub fn my_pe(&self) -> u32 {
        self.inner.pe
    }

    /// Number of PEs.
    pub fn n_pes(&self) -> u32 {
        self.n_pes
    }

    /// What came up at init.
    pub fn report(&self) -> &InitReport {
        &self.report
    }

    /// `nvshmem_align`: symmetric device memory, uninitialised, holding this session until it
    /// drops. Collective: every PE calls it with the same sizes in the same order (and drops the
    /// buffers in the same order).
    pub fn alloc(&self, bytes: usize, align: usize) -> Result<SymmetricBuffer> {
        // SAFETY: initialised (not finalised: `finalize` consumes the session); collective
        // order is this method's documented contract (a violation hangs in NVSHMEM, it does not
        // corrupt memory).
        let ptr = unsafe {
            self.inner
                .lib
                .align(align.max(1).next_power_of_two(), bytes.max(1))
        }
        .map_err(|e| alloc_error(e, self.inner.pe, bytes))?;
        Ok(SymmetricBuffer {
            session: Arc::clone(&self.inner),
            ptr,
            len: bytes,
        })
    }

    /// `nvshmem_free` (collective): the same as dropping `buf`, spelled out.
    pub fn free(&self, buf: SymmetricBuffer) {
        drop(buf);
    }

    /// `nvshmem_barrier_all` (collective; completes this PE's outstanding puts).
    pub fn barrier_all(&self) {
        // SAFETY: initialised.
        unsafe { self.inner.lib.barrier_all() }
    }

    /// `nvshmemx_quiet_on_stream`: on `stream`, completes every put this PE's device code issued
    /// before (not collective).
    pub fn quiet_on_stream(&self, stream: &CudaStream) {
        // SAFETY: initialised; `stream` belongs to this session's context and outlives the call.
        unsafe { self.inner.lib.quiet_on_stream(stream.cu_stream() as _) }
    }

    /// `nvshmemx_barrier_all_on_stream` (collective).
    pub fn barrier_all_on_stream(&self, stream: &CudaStream) {
        // SAFETY: initialised; `stream` belongs to this session's context and outlives the call.
        unsafe {
            self.inner
                .lib
                .barrier_all_on_stream(stream.cu_stream() as _)
        }
    }

    /// `nvshmemx_hostlib_finalize` (collective), after synchronising the context; the context
    /// is released after it. [`Error::SymmetricBuffersAlive`] (and nothing finalised) while a
    /// [`SymmetricBuffer`] of this session is alive: drop them first, on every PE.
    pub fn finalize(self) -> Result<()> {
        // Only buffers hold the inner besides the session, and none can be made any more.
        let alive = Arc::strong_count(&self.inner) - 1;
        if alive > 0 {
            return Err(Error::SymmetricBuffersAlive {
                pe: self.inner.pe,
                alive,
            });
        }
        self.inner
            .ctx
            .synchronize()
            .map_err(Error::cuda("cuCtxSynchronize before finalize"))?;
        // SAFETY: initialised once, finalised once (this consumes the session, and no buffer
        // is left to free into the finalised heap).
        unsafe { self.inner.lib.hostlib_finalize() };
        self.inner.finalized.store(true, Ordering::Release);
        Ok(())
    }
}

/// Symmetric device memory from [`NvshmemSession::alloc`]. It holds its session, so NVSHMEM
/// cannot be finalised under it, and frees itself on drop with `nvshmem_free`, which is
/// collective: every PE drops its buffers in the same order. A drop during a panic skips the
/// free (the peers may never reach theirs); the memory is released at finalize or exit.
pub struct SymmetricBuffer {
    session: Arc<SessionInner>,
    ptr: NonNull<c_void>,
    len: usize,
}

impl std::fmt::Debug for SymmetricBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricBuffer")
            .field("pe", &self.session.pe)
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: a device address plus a shared handle to the session state (itself only read, or
// an atomic); the buffer's content is only touched through CUDA/NVSHMEM calls whose own
// contracts order accesses.
unsafe impl Send for SymmetricBuffer {}
// SAFETY: as above; `&SymmetricBuffer` exposes only the address, the length and peer lookups.
unsafe impl Sync for SymmetricBuffer {}

impl SymmetricBuffer {
    /// The local device address (`CUdeviceptr`).
    pub fn device_ptr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `nvshmem_ptr`: the address of `pe`'s copy usable by this GPU's loads/stores (NVLink
    /// P2P), or `None` when `pe` is reachable only through a network transport.
    pub fn peer_ptr(&self, pe: u32) -> Option<u64> {
        // SAFETY: initialised and not finalised (the buffer holds the session, and `finalize`
        // refuses while it lives); `ptr` is in the symmetric heap.
        unsafe { self.session.lib.ptr(self.ptr.as_ptr(), pe as i32) }.map(|p| p.as_ptr() as u64)
    }
}

impl Drop for SymmetricBuffer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        // SAFETY: `ptr` came from `nvshmem_align` of this session and is freed once, here;
        // NVSHMEM is not finalised (`finalize` refuses while this buffer holds the session);
        // callers synchronise device work using it before dropping it (as with any device
        // allocation), and drop in the same order on every PE (the type's contract).
        unsafe { self.session.lib.free(self.ptr.as_ptr()) }
    }
}

/// An `nvshmem_align` failure as this crate's error: NULL (no room) is
/// [`Error::SymmetricHeapFull`], naming what to change.
fn alloc_error(e: nvshmem_sys::Error, pe: u32, bytes: usize) -> Error {
    match e {
        nvshmem_sys::Error::Null { .. } => Error::SymmetricHeapFull {
            pe,
            bytes,
            heap: heap_env(),
        },
        e => e.into(),
    }
}

/// The symmetric heap's settings as this process sees them, for [`Error::SymmetricHeapFull`].
fn heap_env() -> String {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| "unset".into());
    format!(
        "NVSHMEM_SYMMETRIC_SIZE={}, NVSHMEM_DISABLE_CUDA_VMM={}",
        var("NVSHMEM_SYMMETRIC_SIZE"),
        var("NVSHMEM_DISABLE_CUDA_VMM")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_heap_names_the_bytes_and_the_variables_to_change() {
        let null = nvshmem_sys::Error::Null {
            op: "nvshmem_align",
            what: "1071874048 bytes aligned to 128".into(),
        };
        let e = alloc_error(null, 3, 1_071_874_048);
        assert!(
            matches!(
                e,
                Error::SymmetricHeapFull {
                    pe: 3,
                    bytes: 1_071_874_048,
                    ..
                }
            ),
            "{e:?}"
        );
        let msg = e.to_string();
        for want in [
            "PE 3",
            "1071874048 bytes",
            "NVSHMEM_SYMMETRIC_SIZE=",
            "NVSHMEM_DISABLE_CUDA_VMM=",
            "fix:",
        ] {
            assert!(msg.contains(want), "{want:?} missing from: {msg}");
        }
        // Other failures keep their own error.
        let other = alloc_error(nvshmem_sys::Error::ModuleNotLinked, 0, 8);
        assert!(matches!(other, Error::Nvshmem(_)), "{other:?}");
    }
}
