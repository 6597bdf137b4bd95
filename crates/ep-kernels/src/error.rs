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
    /// `nvshmem_align` found no room: the symmetric heap is full or the GPU is out of memory.
    #[error(
        "PE {pe}: NVSHMEM could not allocate {bytes} bytes of symmetric memory ({heap}); \
         fix: free GPU memory, or raise NVSHMEM_SYMMETRIC_SIZE above what the buffers need (with \
         NVSHMEM_DISABLE_CUDA_VMM=1 the heap is fixed at that size, 1 GiB by default), before \
         NVSHMEM initialises"
    )]
    SymmetricHeapFull {
        /// This PE.
        pe: u32,
        /// The allocation asked for.
        bytes: usize,
        /// NVSHMEM_SYMMETRIC_SIZE / NVSHMEM_DISABLE_CUDA_VMM as this process sees them.
        heap: String,
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
    /// A host collective between processes failed (a process out of step, gone, or an earlier
    /// failure of the same exchange).
    #[error("exchange #{op} failed on rank {rank}: {reason}")]
    ExchangeFailed {
        /// This process's rank in the exchange.
        rank: u32,
        /// The collective's number (counted from 1).
        op: u64,
        /// What happened, naming the process awaited.
        reason: String,
    },
    /// A peer process described its ranks' arenas in a way this process cannot map.
    #[error(
        "the arenas of exchange process {process} cannot be mapped here: {reason}; every process must create its group with the same world size, num_sms and num_nvl_bytes, each world rank in exactly one process"
    )]
    PeerArena {
        /// The describing process (its exchange rank).
        process: usize,
        /// What is wrong.
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
    /// A byte range outside a device buffer.
    #[error("{what}: bytes [{offset}, {offset} + {len}) are outside its {size} bytes")]
    OutOfBounds {
        /// What was addressed.
        what: &'static str,
        /// Start.
        offset: usize,
        /// Length.
        len: usize,
        /// Buffer size.
        size: usize,
    },
    /// A device tensor of the wrong dtype or shape.
    #[error("{what}: expected {expected}, found {found}")]
    TensorMismatch {
        /// Which tensor.
        what: String,
        /// What the call needs.
        expected: String,
        /// What was passed.
        found: String,
    },
    /// A tensor on another GPU than the rank's.
    #[error(
        "a tensor of rank {rank} is on GPU {found}, the rank runs on GPU {expected}: move it there first"
    )]
    WrongDevice {
        /// The rank.
        rank: usize,
        /// The rank's GPU.
        expected: usize,
        /// The tensor's GPU.
        found: usize,
    },
    /// The protocol's own shape rules refused the call (the plan's checks, shared).
    #[error("{0}")]
    Shape(#[from] ep_core::Error),
    /// A rank number outside the group.
    #[error("rank {rank} is outside the group of {num_ranks} ranks")]
    RankOutOfRange {
        /// The rank given.
        rank: usize,
        /// Ranks of the group.
        num_ranks: usize,
    },
    /// Per-rank inputs for a different number of ranks.
    #[error(
        "inputs for {found} ranks, the group has {expected} local ranks: pass one per rank this process drives (NormalGroup::local_ranks)"
    )]
    RankCountMismatch {
        /// Local ranks of the group.
        expected: usize,
        /// Inputs given.
        found: usize,
    },
    /// Co-resident ranks whose kernels cannot all be resident at once.
    #[error(
        "{ranks} co-resident ranks x {sms_per_rank} SMs need {} SMs, the GPU has {device_sms}: use fewer SMs per rank or fewer ranks (their kernels wait on each other, so all must run at once)",
        ranks * sms_per_rank
    )]
    NotEnoughSms {
        /// Ranks on the GPU.
        ranks: usize,
        /// SMs each.
        sms_per_rank: usize,
        /// SMs of the GPU.
        device_sms: usize,
    },
    /// The arena cannot hold the control words.
    #[error(
        "num_nvl_bytes {available} is too small: at least {needed} (use Buffer::normal_size_hint)"
    )]
    ArenaTooSmall {
        /// Bytes needed.
        needed: u64,
        /// Bytes given.
        available: u64,
    },
    /// Received rows that do not fit the arena (or num_worst_tokens): nothing was written, the
    /// group stays usable.
    #[error(
        "rank {rank} would receive {rows} rows, room for {capacity}: raise num_nvl_bytes (Buffer::normal_size_hint) or num_worst_tokens"
    )]
    DeviceCapacity {
        /// The receiving rank.
        rank: usize,
        /// Rows it would receive.
        rows: u64,
        /// Rows that fit.
        capacity: u64,
    },
    /// An expert id outside `[-1, E)` seen by the layout kernel.
    #[error(
        "rank {rank}: topk_idx element {index} (token * K + slot) is {expert}, outside [-1, num_experts)"
    )]
    ExpertOutOfRange {
        /// The rank.
        rank: usize,
        /// Flat index of the element.
        index: u64,
        /// The id.
        expert: i64,
    },
    /// A normal dispatch's `num_tokens_per_rank` disagrees with its `is_token_in_rank`, seen by
    /// the notify block's membership scan (`EP_ERR_LAYOUT`): rows landed at wrong places (every
    /// store inside the arena), so the group is poisoned until `reset`.
    #[error(
        "rank {rank}'s num_tokens_per_rank[{dest}] is {given} but its is_token_in_rank sends {counted} tokens to rank {dest}: pass the layout get_dispatch_layout gives for these topk_idx; the group is poisoned until reset()"
    )]
    DeviceLayoutMismatch {
        /// The sending rank whose layout disagrees.
        rank: usize,
        /// The destination rank whose count differs.
        dest: usize,
        /// `num_tokens_per_rank[dest]` as given.
        given: i64,
        /// Tokens `is_token_in_rank` sends to `dest`.
        counted: i64,
    },
    /// A device wait ran out (the group is poisoned until `reset`).
    #[error(
        "rank {rank}'s {kernel} kernel (block {block}) waited {timeout:?} for {word} == {expected} (last seen {last_seen}), written by rank {}: that rank did not arrive; the group is poisoned until reset()",
        writer.map_or("?".to_string(), |w| w.to_string())
    )]
    DeviceWaitTimeout {
        /// The waiting rank.
        rank: usize,
        /// Its kernel.
        kernel: &'static str,
        /// Its block.
        block: usize,
        /// The word awaited.
        word: String,
        /// The rank that writes it.
        writer: Option<usize>,
        /// Value awaited.
        expected: u64,
        /// Last value read.
        last_seen: u64,
        /// The bound.
        timeout: Duration,
    },
    /// The host's bounded wait for a device result ran out.
    #[error("waited {timeout:?} for {what} of rank {rank}; the group is poisoned until reset()")]
    HostWaitTimeout {
        /// The rank.
        rank: usize,
        /// What was awaited.
        what: String,
        /// The bound.
        timeout: Duration,
    },
    /// A measurement kernel's bounded wait ran out (the low-latency floor's flag round trip).
    #[error("{what} waited {timeout:?} and gave up: {why}")]
    MeasurementTimeout {
        /// What was measured.
        what: &'static str,
        /// The bound.
        timeout: Duration,
        /// The likely cause.
        why: &'static str,
    },
    /// A call after a device timeout.
    #[error(
        "the GPU group is poisoned by an earlier failure ({cause}): call reset() on every rank"
    )]
    Poisoned {
        /// The failure.
        cause: String,
    },
    /// A call made while [`crate::gpu::NormalGroup::capture`] records, that a CUDA graph
    /// cannot hold (it needs the host mid-sequence).
    #[error("{what} cannot be captured in a CUDA graph: {fix}")]
    NotCapturable {
        /// The call.
        what: String,
        /// Why, and what to do instead.
        fix: String,
    },
    /// A captured graph cannot replay in the group's current state (docs/protocol.md §3.10).
    #[error("this graph cannot replay now: {what}; {fix}")]
    GraphOutOfStep {
        /// What does not match the capture.
        what: String,
        /// What to do.
        fix: String,
    },
    /// A request the GPU backend does not support, with what to do instead.
    #[error("{0}")]
    Unsupported(String),
    /// The NVSHMEM variant of the low-latency kernels was compiled with NVSHMEM headers of
    /// another version than the host library loaded: its device code can only be linked against
    /// the `libnvshmem_device.a` of the version it was compiled with.
    #[error(
        "the NVSHMEM low-latency kernels were compiled with NVSHMEM {compiled} headers, but the NVSHMEM loaded is {loaded} ({library}): install NVSHMEM {compiled} (e.g. pip install nvidia-nvshmem-cu13=={compiled}) and point ep-rs at its libnvshmem_host.so.3 (BringUp::library or the NVSHMEM search path), or rebuild ep-kernels against NVSHMEM {loaded} (NVSHMEM_HOME=<its install dir> cargo build)"
    )]
    NvshmemDeviceMismatch {
        /// Version of the headers build.rs compiled with.
        compiled: Version,
        /// Version of the host library loaded.
        loaded: Version,
        /// The host library loaded.
        library: String,
    },
    /// The loaded NVSHMEM ships no device library to link the kernels against.
    #[error(
        "libnvshmem_device.a not found in {dir} (NVSHMEM {version}): the NVSHMEM low-latency kernels are linked against it at run time; use an NVSHMEM {version} install that ships it beside libnvshmem_host.so.3 (the pip wheel nvidia-nvshmem-cu13=={version} does)"
    )]
    NvshmemDeviceLibraryMissing {
        /// The directory of the loaded host library.
        dir: String,
        /// Its version.
        version: Version,
    },
    /// The CUDA driver's linker failed on the NVSHMEM low-latency kernels.
    #[error(
        "linking the NVSHMEM low-latency kernels against {library} failed in {op}: {source}; linker log:\n{log}\nthe device library must be the one of the NVSHMEM ep-kernels was compiled with; rebuild ep-kernels against it (NVSHMEM_HOME) if the log names undefined symbols"
    )]
    NvshmemDeviceLink {
        /// The driver call that failed.
        op: &'static str,
        /// The device library linked.
        library: String,
        /// The driver error.
        #[source]
        source: cudarc::driver::DriverError,
        /// The linker's error and info log.
        log: String,
    },
    /// `nvshmemx_cumodule_init` refused the linked low-latency module.
    #[error(
        "nvshmemx_cumodule_init on the NVSHMEM low-latency module (linked with {library}) failed: {source}; the module must be linked against the libnvshmem_device.a of the NVSHMEM that is initialised (delete the cached cubin, {cubin}, if it came from another NVSHMEM)"
    )]
    NvshmemModuleInit {
        /// The device library linked.
        library: String,
        /// The linked cubin used (`-` when not cached).
        cubin: String,
        /// NVSHMEM's error (`ModuleNotLinked` for code 7).
        #[source]
        source: nvshmem_sys::Error,
    },
    /// A device trace's per-block record space ran out: records were dropped, so the trace cannot
    /// be judged.
    #[error(
        "device trace of rank {rank}: {lost} event(s) lost (block {block} needed {needed} records, capacity {capacity} per block); raise the trace capacity to at least {needed} records per block"
    )]
    TraceOverflow {
        /// Rank whose trace overflowed.
        rank: usize,
        /// Events lost, all blocks together.
        lost: u64,
        /// The block that needed the most records.
        block: usize,
        /// Records that block reserved.
        needed: u64,
        /// Records per block the trace had.
        capacity: u64,
    },
    /// A device trace's bytes are not a trace of this format (`gpu::trace`).
    #[error(
        "device trace of rank {rank} is malformed: {detail}; pass the header and every record as the kernel wrote them, after the launch completed"
    )]
    TraceMalformed {
        /// Rank whose trace it should be.
        rank: usize,
        /// What is wrong.
        detail: String,
    },
}

impl Error {
    pub(crate) fn cuda(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> Self {
        move |source| Error::Cuda { op, source }
    }
}
