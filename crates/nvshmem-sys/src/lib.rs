//! # nvshmem-sys
//!
//! The NVSHMEM host API (`libnvshmem_host.so.3`) loaded at run time with libloading
//! (`RTLD_NOW | RTLD_GLOBAL`), `#[repr(C)]` mirrors of its unique id and init attributes, and
//! thin wrappers turning return codes into errors. Building needs no system library.
