//! # ep-kernels
//!
//! The GPU backend: CUDA sources compiled by build.rs to sm_90 cubins, the shared
//! `__host__ __device__` header of per-token protocol rules, and the `Transport` implementation
//! over CUDA (cudarc) and NVSHMEM. Without nvcc the crate builds and launches return a typed
//! error.
