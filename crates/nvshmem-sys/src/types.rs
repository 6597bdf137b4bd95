//! `#[repr(C)]` mirrors of the NVSHMEM host ABI structs and the constants the backends use.
//!
//! Source: NVSHMEM 3.4.5 headers (`bootstrap_device_host/nvshmem_uniqueid.h`,
//! `device_host/nvshmem_types.h`, `device_host/nvshmem_common.cuh`,
//! `device_host_transport/nvshmem_constants.h`, `host/nvshmemx_api.h`). These structs are
//! versioned by NVSHMEM (`(major << 16) + sizeof`), unchanged from 3.3.9 to 3.8.

#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    reason = "C names kept verbatim so they can be grepped against the NVSHMEM headers"
)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::size_of;

/// Bytes after the version word of a unique id (`UNIQUEID_PADDING`).
pub const UNIQUEID_PADDING: usize = 124;
/// Bytes of padding in `nvshmemx_init_args_v1` (`INIT_ARGS_PADDING`).
pub const INIT_ARGS_PADDING: usize = 96;
/// Bytes of padding in `nvshmem_team_config_v2` (`TEAM_CONFIG_V2_PADDING`).
pub const TEAM_CONFIG_V2_PADDING: usize = 48;
/// `UNIQUEID_ARGS_INVALID`: rank/size of unset unique-id arguments.
pub const UNIQUEID_ARGS_INVALID: c_int = -1;

/// The bootstrap unique id rank 0 creates and every rank must receive (128 bytes).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct nvshmemx_uniqueid_v1 {
    /// `(1 << 16) + 128`.
    pub version: c_int,
    /// Opaque bootstrap address and session data.
    pub internal: [c_char; UNIQUEID_PADDING],
}
/// Current unique id type.
pub type nvshmemx_uniqueid_t = nvshmemx_uniqueid_v1;

/// `NVSHMEMX_UNIQUEID_INITIALIZER`'s version word.
pub const NVSHMEMX_UNIQUEID_VERSION: c_int = (1 << 16) + size_of::<nvshmemx_uniqueid_v1>() as c_int;

impl Default for nvshmemx_uniqueid_v1 {
    /// `NVSHMEMX_UNIQUEID_INITIALIZER`.
    fn default() -> Self {
        Self {
            version: NVSHMEMX_UNIQUEID_VERSION,
            internal: [0; UNIQUEID_PADDING],
        }
    }
}

impl nvshmemx_uniqueid_v1 {
    /// The 128 bytes as they travel between ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        let mut out = [0u8; 128];
        out[..4].copy_from_slice(&self.version.to_ne_bytes());
        for (o, c) in out[4..].iter_mut().zip(self.internal.iter()) {
            *o = *c as u8;
        }
        out
    }
    /// Rebuilds a unique id from the 128 bytes another rank sent.
    pub fn from_bytes(bytes: &[u8; 128]) -> Self {
        let mut internal = [0 as c_char; UNIQUEID_PADDING];
        for (i, b) in internal.iter_mut().zip(bytes[4..].iter()) {
            *i = *b as c_char;
        }
        Self {
            version: c_int::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            internal,
        }
    }
}

/// Unique-id arguments inside the init attributes (24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvshmemx_uniqueid_args_v1 {
    /// `(1 << 16) + 24`.
    pub version: c_int,
    /// Points at the caller's unique id; it must stay alive until init returns.
    pub id: *mut nvshmemx_uniqueid_v1,
    /// This process's rank.
    pub myrank: c_int,
    /// Number of ranks.
    pub nranks: c_int,
}
/// Current unique-id argument type.
pub type nvshmemx_uniqueid_args_t = nvshmemx_uniqueid_args_v1;

/// Bootstrap arguments (128 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvshmemx_init_args_v1 {
    /// `(1 << 16) + 128`.
    pub version: c_int,
    /// Unique-id bootstrap arguments.
    pub uid_args: nvshmemx_uniqueid_args_v1,
    /// Reserved.
    pub content: [c_char; INIT_ARGS_PADDING],
}
/// Current init-argument type.
pub type nvshmemx_init_args_t = nvshmemx_init_args_v1;

/// Attributes of `nvshmemx_hostlib_init_attr` (144 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvshmemx_init_attr_v1 {
    /// `(1 << 16) + 144`; 3.4.5 and 3.8 accept this v1 identifier.
    pub version: c_int,
    /// `MPI_Comm *` for `NVSHMEMX_INIT_WITH_MPI_COMM`.
    pub mpi_comm: *mut c_void,
    /// Bootstrap arguments.
    pub args: nvshmemx_init_args_v1,
}
/// Current init-attribute type.
pub type nvshmemx_init_attr_t = nvshmemx_init_attr_v1;

/// Version word of `nvshmemx_init_attr_v1`.
pub const NVSHMEMX_INIT_ATTR_VERSION: c_int =
    (1 << 16) + size_of::<nvshmemx_init_attr_v1>() as c_int;
/// Version word of `nvshmemx_init_args_v1`.
pub const NVSHMEMX_INIT_ARGS_VERSION: c_int =
    (1 << 16) + size_of::<nvshmemx_init_args_v1>() as c_int;
/// Version word of `nvshmemx_uniqueid_args_v1`.
pub const NVSHMEMX_UNIQUEID_ARGS_VERSION: c_int =
    (1 << 16) + size_of::<nvshmemx_uniqueid_args_v1>() as c_int;

impl Default for nvshmemx_init_attr_v1 {
    /// `NVSHMEMX_INIT_ATTR_INITIALIZER`.
    fn default() -> Self {
        Self {
            version: NVSHMEMX_INIT_ATTR_VERSION,
            mpi_comm: std::ptr::null_mut(),
            args: nvshmemx_init_args_v1 {
                version: NVSHMEMX_INIT_ARGS_VERSION,
                uid_args: nvshmemx_uniqueid_args_v1 {
                    version: NVSHMEMX_UNIQUEID_ARGS_VERSION,
                    id: std::ptr::null_mut(),
                    myrank: UNIQUEID_ARGS_INVALID,
                    nranks: UNIQUEID_ARGS_INVALID,
                },
                content: [0; INIT_ARGS_PADDING],
            },
        }
    }
}

/// Team handle (`int32_t`).
pub type nvshmem_team_t = i32;
/// `NVSHMEM_TEAM_INVALID`.
pub const NVSHMEM_TEAM_INVALID: nvshmem_team_t = -1;
/// `NVSHMEM_TEAM_WORLD`.
pub const NVSHMEM_TEAM_WORLD: nvshmem_team_t = 0;
/// `NVSHMEM_TEAM_SHARED`.
pub const NVSHMEM_TEAM_SHARED: nvshmem_team_t = 1;
/// `NVSHMEMX_TEAM_NODE`.
pub const NVSHMEMX_TEAM_NODE: nvshmem_team_t = 2;

/// Team configuration (64 bytes, v2 since 3.3). Pass NULL with mask 0 for the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct nvshmem_team_config_v2 {
    /// `(2 << 16) + 64`.
    pub version: c_int,
    /// Contexts to reserve.
    pub num_contexts: c_int,
    /// Team unique id.
    pub uniqueid: u64,
    /// Reserved.
    pub padding: [c_char; TEAM_CONFIG_V2_PADDING],
}
/// Current team configuration type.
pub type nvshmem_team_config_t = nvshmem_team_config_v2;

/// `enum flags` of `nvshmemx_hostlib_init_attr`.
pub const NVSHMEMX_INIT_THREAD_PES: c_uint = 1;
/// Bootstrap over the `MPI_Comm` in the attributes.
pub const NVSHMEMX_INIT_WITH_MPI_COMM: c_uint = 1 << 1;
/// Bootstrap over OpenSHMEM.
pub const NVSHMEMX_INIT_WITH_SHMEM: c_uint = 1 << 2;
/// Bootstrap over the unique id in the attributes.
pub const NVSHMEMX_INIT_WITH_UNIQUEID: c_uint = 1 << 3;

/// `nvshmemx_signal_op_t`: store the signal value.
pub const NVSHMEM_SIGNAL_SET: c_int = 9;
/// `nvshmemx_signal_op_t`: add the signal value.
pub const NVSHMEM_SIGNAL_ADD: c_int = 10;

/// `nvshmemx_cmp_type_t`.
pub const NVSHMEM_CMP_EQ: c_int = 0;
/// Not equal.
pub const NVSHMEM_CMP_NE: c_int = 1;
/// Greater than.
pub const NVSHMEM_CMP_GT: c_int = 2;
/// Less or equal.
pub const NVSHMEM_CMP_LE: c_int = 3;
/// Less than.
pub const NVSHMEM_CMP_LT: c_int = 4;
/// Greater or equal.
pub const NVSHMEM_CMP_GE: c_int = 5;

/// `cudaStream_t` / `CUstream` (the same pointer).
pub type cudaStream_t = *mut c_void;
/// `CUmodule`.
pub type CUmodule = *mut c_void;

const _: () = assert!(size_of::<nvshmemx_uniqueid_v1>() == 128);
const _: () = assert!(size_of::<nvshmemx_uniqueid_args_v1>() == 24);
const _: () = assert!(size_of::<nvshmemx_init_args_v1>() == 128);
const _: () = assert!(size_of::<nvshmemx_init_attr_v1>() == 144);
const _: () = assert!(size_of::<nvshmem_team_config_v2>() == 64);
