//! The loaded library: raw entry points under their C names ([`Fns`]) and thin wrappers.

use std::ffi::{c_int, c_long, c_uint, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use crate::error::{Error, Result};
use crate::search::{SearchEnv, locate};
use crate::types::*;

macro_rules! entry_points {
    ($( $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// The entry points ep-rs uses, under their C names, resolved at load time.
        #[derive(Clone, Copy)]
        #[allow(non_snake_case, reason = "C names verbatim")]
        pub struct Fns {
            $(
                #[doc = concat!("`", stringify!($name), "` (NVSHMEM host API).")]
                pub $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?,
            )*
        }

        impl Fns {
            fn resolve(lib: &Library, path: &Path) -> Result<Self> {
                Ok(Self {
                    $(
                        $name: {
                            // SAFETY: the function type is the one declared in the NVSHMEM
                            // 3.4.5 host headers (unchanged since 3.3.9); the library is never
                            // unloaded, so the copied pointer stays valid.
                            let sym = unsafe {
                                lib.get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(
                                    concat!(stringify!($name), "\0").as_bytes(),
                                )
                            };
                            *sym.map_err(|e| Error::MissingSymbol {
                                symbol: stringify!($name),
                                path: path.to_path_buf(),
                                reason: e.to_string(),
                            })?
                        },
                    )*
                })
            }
        }
    };
}

entry_points! {
    nvshmemx_vendor_get_version_info: fn(*mut c_int, *mut c_int, *mut c_int);
    nvshmem_info_get_version: fn(*mut c_int, *mut c_int);
    nvshmemx_init_status: fn() -> c_int;
    nvshmemx_get_uniqueid: fn(*mut nvshmemx_uniqueid_t) -> c_int;
    nvshmemx_set_attr_uniqueid_args: fn(c_int, c_int, *const nvshmemx_uniqueid_t, *mut nvshmemx_init_attr_t) -> c_int;
    nvshmemx_set_attr_mpi_comm_args: fn(*mut c_void, *mut nvshmemx_init_attr_t) -> c_int;
    nvshmemx_hostlib_init_attr: fn(c_uint, *mut nvshmemx_init_attr_t) -> c_int;
    nvshmemx_hostlib_finalize: fn();
    nvshmem_my_pe: fn() -> c_int;
    nvshmem_n_pes: fn() -> c_int;
    nvshmem_malloc: fn(usize) -> *mut c_void;
    nvshmem_align: fn(usize, usize) -> *mut c_void;
    nvshmem_free: fn(*mut c_void);
    nvshmem_ptr: fn(*const c_void, c_int) -> *mut c_void;
    nvshmem_barrier_all: fn();
    nvshmem_barrier: fn(nvshmem_team_t) -> c_int;
    nvshmem_quiet: fn();
    nvshmemx_barrier_all_on_stream: fn(cudaStream_t);
    nvshmemx_barrier_on_stream: fn(nvshmem_team_t, cudaStream_t) -> c_int;
    nvshmemx_quiet_on_stream: fn(cudaStream_t);
    nvshmemx_putmem_on_stream: fn(*mut c_void, *const c_void, usize, c_int, cudaStream_t);
    nvshmemx_putmem_signal_on_stream: fn(*mut c_void, *const c_void, usize, *mut u64, u64, c_int, c_int, cudaStream_t);
    nvshmemx_signal_op_on_stream: fn(*mut u64, u64, c_int, c_int, cudaStream_t);
    nvshmemx_signal_wait_until_on_stream: fn(*mut u64, c_int, u64, cudaStream_t);
    nvshmemx_cumodule_init: fn(CUmodule) -> c_int;
    nvshmemx_cumodule_finalize: fn(CUmodule) -> c_int;
    nvshmem_team_split_strided: fn(nvshmem_team_t, c_int, c_int, c_int, *const nvshmem_team_config_t, c_long, *mut nvshmem_team_t) -> c_int;
    nvshmem_team_destroy: fn(nvshmem_team_t);
    nvshmem_team_my_pe: fn(nvshmem_team_t) -> c_int;
    nvshmem_team_n_pes: fn(nvshmem_team_t) -> c_int;
}

/// An NVSHMEM vendor version (`nvshmemx_vendor_get_version_info`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch.
    pub patch: u32,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The oldest NVSHMEM DeepEP V1 works with (spec §5).
pub const MIN_VERSION: Version = Version {
    major: 3,
    minor: 3,
    patch: 9,
};

/// The loaded host library. Cheap to copy around by reference; never unloaded.
pub struct Nvshmem {
    path: PathBuf,
    fns: Fns,
}

impl fmt::Debug for Nvshmem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nvshmem")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

fn check(op: &'static str, code: c_int) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Call { op, code })
    }
}

impl Nvshmem {
    /// Searches (see [`crate::search`]) and loads the host library.
    pub fn load(explicit: Option<&Path>) -> Result<Self> {
        Self::load_with(explicit, &SearchEnv::from_process())
    }

    /// [`Nvshmem::load`] with a given search environment.
    pub fn load_with(explicit: Option<&Path>, env: &SearchEnv) -> Result<Self> {
        let path = locate(explicit, env).map_err(|searched| Error::LibraryNotFound { searched })?;
        Self::load_path(&path)
    }

    /// Loads exactly this file.
    pub fn load_path(path: &Path) -> Result<Self> {
        // SAFETY: loading NVSHMEM runs its static initialisers, which only set up internal
        // state; RTLD_GLOBAL lets its bootstrap and transport plugins resolve host symbols.
        let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| {
            Error::Load {
                path: path.to_path_buf(),
                reason: e.to_string(),
            }
        })?;
        let fns = Fns::resolve(&lib, path)?;
        // Never dlclose: NVSHMEM threads may still run library code after the last handle.
        std::mem::forget(lib);
        Ok(Self {
            path: path.to_path_buf(),
            fns,
        })
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory holding the library and its bootstrap/transport plugins.
    pub fn lib_dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("/"))
    }

    /// The raw entry points (escape hatch).
    pub fn fns(&self) -> &Fns {
        &self.fns
    }

    /// `nvshmemx_vendor_get_version_info`: the library version; valid before init.
    pub fn vendor_version(&self) -> Version {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three valid out-pointers; the call needs no initialised state.
        unsafe { (self.fns.nvshmemx_vendor_get_version_info)(&mut a, &mut b, &mut c) };
        let u = |x: c_int| u32::try_from(x).unwrap_or(0);
        Version {
            major: u(a),
            minor: u(b),
            patch: u(c),
        }
    }

    /// `nvshmem_info_get_version`: the OpenSHMEM specification level (not the library
    /// version); valid before init.
    pub fn info_get_version(&self) -> (i32, i32) {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out-pointers; the call needs no initialised state.
        unsafe { (self.fns.nvshmem_info_get_version)(&mut a, &mut b) };
        (a, b)
    }

    /// `nvshmemx_init_status`: 0 not initialised, 1 bootstrapped, 2 initialised, 3/4 limited/full
    /// multi-process-per-GPU.
    pub fn init_status(&self) -> i32 {
        // SAFETY: a status query with no arguments, valid in every state.
        unsafe { (self.fns.nvshmemx_init_status)() }
    }

    /// `nvshmemx_get_uniqueid`: a fresh bootstrap unique id (rank 0 only).
    pub fn get_uniqueid(&self) -> Result<nvshmemx_uniqueid_t> {
        let mut uid = nvshmemx_uniqueid_t::default();
        // SAFETY: `uid` is a valid, versioned 128-byte out-parameter.
        check("nvshmemx_get_uniqueid", unsafe {
            (self.fns.nvshmemx_get_uniqueid)(&mut uid)
        })?;
        Ok(uid)
    }

    /// `nvshmemx_set_attr_uniqueid_args`: fills `attr` for a unique-id bootstrap.
    ///
    /// # Safety
    /// `attr` keeps a pointer to `uid`: `uid` must stay alive and unmoved until
    /// [`Nvshmem::hostlib_init_attr`] with this `attr` has returned.
    pub unsafe fn set_attr_uniqueid_args(
        &self,
        rank: i32,
        nranks: i32,
        uid: *const nvshmemx_uniqueid_t,
        attr: &mut nvshmemx_init_attr_t,
    ) -> Result<()> {
        // SAFETY: `attr` is a valid out-parameter; the caller keeps `uid` alive (contract).
        let code = unsafe { (self.fns.nvshmemx_set_attr_uniqueid_args)(rank, nranks, uid, attr) };
        check("nvshmemx_set_attr_uniqueid_args", code)
    }

    /// `nvshmemx_set_attr_mpi_comm_args`: bootstrap over an MPI communicator.
    ///
    /// # Safety
    /// `mpi_comm` points at a live `MPI_Comm` of the MPI library NVSHMEM's MPI bootstrap plugin
    /// uses, alive until init returns.
    pub unsafe fn set_attr_mpi_comm_args(
        &self,
        mpi_comm: *mut c_void,
        attr: &mut nvshmemx_init_attr_t,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        let code = unsafe { (self.fns.nvshmemx_set_attr_mpi_comm_args)(mpi_comm, attr) };
        check("nvshmemx_set_attr_mpi_comm_args", code)
    }

    /// `nvshmemx_hostlib_init_attr`: initialises NVSHMEM (collective over all ranks).
    ///
    /// # Safety
    /// Once per process; the CUDA device of this rank is current on the calling thread; the
    /// `NVSHMEM_*` environment was final before the call (no thread may change it during init);
    /// pointers inside `attr` are valid.
    pub unsafe fn hostlib_init_attr(
        &self,
        flags: u32,
        attr: &mut nvshmemx_init_attr_t,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        let code = unsafe { (self.fns.nvshmemx_hostlib_init_attr)(flags, attr) };
        check("nvshmemx_hostlib_init_attr", code)
    }

    /// `nvshmemx_hostlib_finalize` (collective).
    ///
    /// # Safety
    /// After a successful init, once; no symmetric pointer is used afterwards.
    pub unsafe fn hostlib_finalize(&self) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmemx_hostlib_finalize)() }
    }

    /// `nvshmem_my_pe`.
    ///
    /// # Safety
    /// NVSHMEM is initialised.
    pub unsafe fn my_pe(&self) -> Result<i32> {
        // SAFETY: forwarded contract.
        let v = unsafe { (self.fns.nvshmem_my_pe)() };
        if v < 0 {
            Err(Error::OutOfRange {
                op: "nvshmem_my_pe",
                value: v.into(),
            })
        } else {
            Ok(v)
        }
    }

    /// `nvshmem_n_pes`.
    ///
    /// # Safety
    /// NVSHMEM is initialised.
    pub unsafe fn n_pes(&self) -> Result<i32> {
        // SAFETY: forwarded contract.
        let v = unsafe { (self.fns.nvshmem_n_pes)() };
        if v <= 0 {
            Err(Error::OutOfRange {
                op: "nvshmem_n_pes",
                value: v.into(),
            })
        } else {
            Ok(v)
        }
    }

    /// `nvshmem_malloc` (collective; same size on every rank).
    ///
    /// # Safety
    /// NVSHMEM is initialised; every rank calls it with the same size in the same order.
    pub unsafe fn malloc(&self, size: usize) -> Result<NonNull<c_void>> {
        // SAFETY: forwarded contract.
        let p = unsafe { (self.fns.nvshmem_malloc)(size) };
        NonNull::new(p).ok_or_else(|| Error::Null {
            op: "nvshmem_malloc",
            what: format!("{size} bytes"),
        })
    }

    /// `nvshmem_align` (collective).
    ///
    /// # Safety
    /// As [`Nvshmem::malloc`]; `alignment` is a power of two.
    pub unsafe fn align(&self, alignment: usize, size: usize) -> Result<NonNull<c_void>> {
        // SAFETY: forwarded contract.
        let p = unsafe { (self.fns.nvshmem_align)(alignment, size) };
        NonNull::new(p).ok_or_else(|| Error::Null {
            op: "nvshmem_align",
            what: format!("{size} bytes aligned to {alignment}"),
        })
    }

    /// `nvshmem_free` (collective).
    ///
    /// # Safety
    /// `ptr` came from this library's malloc/align and no pending work uses it on any rank.
    pub unsafe fn free(&self, ptr: *mut c_void) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmem_free)(ptr) }
    }

    /// `nvshmem_ptr`: the address through which this process's GPU can load/store `pe`'s copy
    /// of the symmetric object `ptr`; `None` when `pe` is not reachable that way.
    ///
    /// # Safety
    /// NVSHMEM is initialised and `ptr` points into the symmetric heap.
    pub unsafe fn ptr(&self, ptr: *const c_void, pe: i32) -> Option<NonNull<c_void>> {
        // SAFETY: forwarded contract.
        NonNull::new(unsafe { (self.fns.nvshmem_ptr)(ptr, pe) })
    }

    /// `nvshmem_barrier_all` (host, collective; also completes this rank's puts).
    ///
    /// # Safety
    /// NVSHMEM is initialised; every rank reaches it.
    pub unsafe fn barrier_all(&self) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmem_barrier_all)() }
    }

    /// `nvshmem_barrier` over a team.
    ///
    /// # Safety
    /// NVSHMEM is initialised; every member of `team` reaches it.
    pub unsafe fn barrier(&self, team: nvshmem_team_t) -> Result<()> {
        // SAFETY: forwarded contract.
        check("nvshmem_barrier", unsafe {
            (self.fns.nvshmem_barrier)(team)
        })
    }

    /// `nvshmem_quiet` (host).
    ///
    /// # Safety
    /// NVSHMEM is initialised.
    pub unsafe fn quiet(&self) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmem_quiet)() }
    }

    /// `nvshmemx_barrier_all_on_stream`.
    ///
    /// # Safety
    /// NVSHMEM is initialised; `stream` is a live stream of this rank's context.
    pub unsafe fn barrier_all_on_stream(&self, stream: cudaStream_t) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmemx_barrier_all_on_stream)(stream) }
    }

    /// `nvshmemx_barrier_on_stream`.
    ///
    /// # Safety
    /// As [`Nvshmem::barrier_all_on_stream`]; every member of `team` enqueues it.
    pub unsafe fn barrier_on_stream(
        &self,
        team: nvshmem_team_t,
        stream: cudaStream_t,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        check("nvshmemx_barrier_on_stream", unsafe {
            (self.fns.nvshmemx_barrier_on_stream)(team, stream)
        })
    }

    /// `nvshmemx_quiet_on_stream`.
    ///
    /// # Safety
    /// NVSHMEM is initialised; `stream` is live.
    pub unsafe fn quiet_on_stream(&self, stream: cudaStream_t) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmemx_quiet_on_stream)(stream) }
    }

    /// `nvshmemx_putmem_on_stream`.
    ///
    /// # Safety
    /// `dest` is symmetric, `src` is device memory readable until the put completes (a quiet
    /// or barrier on `stream`), `bytes` fits both, `pe` is a valid PE, `stream` is live.
    pub unsafe fn putmem_on_stream(
        &self,
        dest: *mut c_void,
        src: *const c_void,
        bytes: usize,
        pe: i32,
        stream: cudaStream_t,
    ) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmemx_putmem_on_stream)(dest, src, bytes, pe, stream) }
    }

    /// `nvshmemx_putmem_signal_on_stream`: put, then update `sig_addr` on `pe` with `sig_op`
    /// ([`NVSHMEM_SIGNAL_SET`] / [`NVSHMEM_SIGNAL_ADD`]) after the data is delivered.
    ///
    /// # Safety
    /// As [`Nvshmem::putmem_on_stream`]; `sig_addr` is a symmetric `u64`.
    #[allow(clippy::too_many_arguments, reason = "mirrors the C signature")]
    pub unsafe fn putmem_signal_on_stream(
        &self,
        dest: *mut c_void,
        src: *const c_void,
        bytes: usize,
        sig_addr: *mut u64,
        signal: u64,
        sig_op: i32,
        pe: i32,
        stream: cudaStream_t,
    ) {
        // SAFETY: forwarded contract.
        unsafe {
            (self.fns.nvshmemx_putmem_signal_on_stream)(
                dest, src, bytes, sig_addr, signal, sig_op, pe, stream,
            )
        }
    }

    /// `nvshmemx_signal_op_on_stream`.
    ///
    /// # Safety
    /// `sig_addr` is a symmetric `u64`, `pe` valid, `stream` live.
    pub unsafe fn signal_op_on_stream(
        &self,
        sig_addr: *mut u64,
        signal: u64,
        sig_op: i32,
        pe: i32,
        stream: cudaStream_t,
    ) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmemx_signal_op_on_stream)(sig_addr, signal, sig_op, pe, stream) }
    }

    /// `nvshmemx_signal_wait_until_on_stream`: the stream waits until `*sig_addr cmp value`.
    /// This wait is unbounded on the device; callers bound it from the host (stream query
    /// with a deadline).
    ///
    /// # Safety
    /// `sig_addr` is a local symmetric `u64`; `stream` live.
    pub unsafe fn signal_wait_until_on_stream(
        &self,
        sig_addr: *mut u64,
        cmp: i32,
        value: u64,
        stream: cudaStream_t,
    ) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmemx_signal_wait_until_on_stream)(sig_addr, cmp, value, stream) }
    }

    /// `nvshmemx_cumodule_init`: binds NVSHMEM's device state into a module linked against
    /// `libnvshmem_device.a`.
    ///
    /// # Safety
    /// NVSHMEM is initialised; `module` is a live `CUmodule` of this rank's context.
    pub unsafe fn cumodule_init(&self, module: CUmodule) -> Result<()> {
        // SAFETY: forwarded contract.
        match unsafe { (self.fns.nvshmemx_cumodule_init)(module) } {
            0 => Ok(()),
            7 => Err(Error::ModuleNotLinked),
            code => Err(Error::Call {
                op: "nvshmemx_cumodule_init",
                code,
            }),
        }
    }

    /// `nvshmemx_cumodule_finalize`.
    ///
    /// # Safety
    /// `module` was passed to [`Nvshmem::cumodule_init`] and is still loaded.
    pub unsafe fn cumodule_finalize(&self, module: CUmodule) -> Result<()> {
        // SAFETY: forwarded contract.
        check("nvshmemx_cumodule_finalize", unsafe {
            (self.fns.nvshmemx_cumodule_finalize)(module)
        })
    }

    /// `nvshmem_team_split_strided` with the default configuration. Returns
    /// [`NVSHMEM_TEAM_INVALID`] on PEs outside the new team.
    ///
    /// # Safety
    /// NVSHMEM is initialised; every member of `parent` calls it with the same arguments.
    pub unsafe fn team_split_strided(
        &self,
        parent: nvshmem_team_t,
        start: i32,
        stride: i32,
        size: i32,
    ) -> Result<nvshmem_team_t> {
        let mut team = NVSHMEM_TEAM_INVALID;
        // SAFETY: forwarded contract; NULL config with mask 0 selects the defaults.
        let code = unsafe {
            (self.fns.nvshmem_team_split_strided)(
                parent,
                start,
                stride,
                size,
                std::ptr::null(),
                0,
                &mut team,
            )
        };
        check("nvshmem_team_split_strided", code)?;
        Ok(team)
    }

    /// `nvshmem_team_destroy`.
    ///
    /// # Safety
    /// `team` came from a split and is destroyed once, collectively.
    pub unsafe fn team_destroy(&self, team: nvshmem_team_t) {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmem_team_destroy)(team) }
    }

    /// `nvshmem_team_my_pe` (-1 outside the team).
    ///
    /// # Safety
    /// NVSHMEM is initialised.
    pub unsafe fn team_my_pe(&self, team: nvshmem_team_t) -> i32 {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmem_team_my_pe)(team) }
    }

    /// `nvshmem_team_n_pes` (-1 for an invalid team).
    ///
    /// # Safety
    /// NVSHMEM is initialised.
    pub unsafe fn team_n_pes(&self, team: nvshmem_team_t) -> i32 {
        // SAFETY: forwarded contract.
        unsafe { (self.fns.nvshmem_team_n_pes)(team) }
    }
}
