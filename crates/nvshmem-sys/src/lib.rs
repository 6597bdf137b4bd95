//! # nvshmem-sys
//!
//! The NVSHMEM host API (`libnvshmem_host.so.3`) loaded at run time with libloading
//! (`RTLD_NOW | RTLD_GLOBAL`, absolute path), `#[repr(C)]` mirrors of its unique id and init
//! attributes, and thin wrappers turning return codes into errors. Building needs no system
//! library; a missing library is an [`Error::LibraryNotFound`] listing every place searched
//! (see [`search`] for the order).
//!
//! Initialisation goes through `nvshmemx_hostlib_init_attr` / `nvshmemx_hostlib_finalize`:
//! `nvshmem_init` and `nvshmemx_init_attr` are header inlines over `libnvshmem_device.a` and do
//! not exist in the host library.
//!
//! ```no_run
//! let lib = nvshmem_sys::Nvshmem::load(None)?;
//! println!("NVSHMEM {} at {}", lib.vendor_version(), lib.path().display());
//! # Ok::<(), nvshmem_sys::Error>(())
//! ```
//!
//! The library is never unloaded: NVSHMEM's proxy and bootstrap threads may outlive any handle.

mod api;
mod error;
pub mod search;
pub mod types;

pub use api::{Fns, MIN_VERSION, Nvshmem, Version};
pub use error::{Error, Result};
pub use types::*;
