//! # ep-setup
//!
//! The logic of `ep doctor`: setup checks for driver keys, GDRCopy, NVSHMEM, NICs, GPUs and
//! limits; every check reads its files under a sysroot so verdicts are testable from fixture
//! trees. Pure Rust: it opens no device and loads no library (the `ep` binary does the live
//! probing through the sys crates and hands the results in), and it depends on no other ep-rs
//! crate.
//!
//! Three steps, each usable alone:
//! 1. [`gather`] reads [`Facts`] from `/proc`, `/sys`, `/etc`, `/dev` under a directory (`/` on
//!    the machine itself, a fixture tree in tests). No device is opened, no library loaded.
//! 2. The caller adds what only live libraries can tell: the loaded NVSHMEM's own version
//!    (nvshmem-sys), the `--probe` result ([`ProbeResult`]), `nvidia-smi`'s [`Topology`], and
//!    the live probes: CUDA's devices and peer access ([`CudaFacts`]), rdma-core's devices,
//!    ports and DevX ([`VerbsFacts`]), `gdr_open` ([`GdrcopyLive`]) and the GPU memory
//!    registration ([`RegistrationProbe`]). Checks reading live facts are skipped without them.
//! 3. [`diagnose`] turns facts into a [`Report`]: checks (pass / warn / fail / skip, each with
//!    its exact fix), one [`Verdict`] per [`Capability`], and the [`IbgdaMode`] ep-rs will use.
//!
//! A capability is unusable when any check it needs fails; checks that warn make it usable
//! with caveats. Check ids are stable (`driver.ibgda-keys`, `gdrcopy`, `nic.roce-gid`...) and
//! listed in `diagnose.rs`.
//!
//! Module order (each uses only those before it): `gid` (a GID table entry), `live` (what live
//! libraries report), `facts` (everything known about the machine), `parse` and `gather` (reading
//! it from files), `report`, `checks`, `diagnose`.

mod checks;
mod diagnose;
mod facts;
mod gather;
mod gid;
mod live;
mod parse;
mod report;

pub use checks::driver::{IBGDA_MODPROBE_FILE, IBGDA_MODPROBE_LINE};
pub use checks::gpu::closest_nics;
pub use checks::system::MEMLOCK_MIN;
pub use diagnose::diagnose;
pub use facts::{
    AcsBridge, ContainerFacts, DevNodes, DriverFacts, Facts, GdrcopyFacts, GpuLink, GpuPci,
    LibraryFacts, MemlockLimit, ModprobeFacts, ModprobeFile, NicFacts, NvshmemFacts, OsFacts,
    PciFacts, PcieDistance, PortFacts, ProbeResult, Topology, Version,
    registry_has_peer_mapping_override,
};
pub use gather::{
    GatherOptions, SAVED_TOPO, Sysroot, find_nvshmem, gather, inspect_nvshmem, nvshmem_dirs,
};
pub use gid::GidEntry;
pub use live::{
    Attempt, CudaDevice, CudaFacts, CudaPeer, DevxOpen, GdrcopyLive, RegistrationProbe,
    VerbsDevice, VerbsFacts, VerbsPort, format_gid, gid_type_name, link_layer_name,
    port_state_name,
};
pub use parse::{nvidia_smi_topo, nvshmem_log, nvshmem_version_header};
pub use report::{Capability, Check, IbgdaMode, IbgdaModeReport, Report, Status, Verdict};
