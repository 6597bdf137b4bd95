//! # ep-kernels
//!
//! The GPU backend: CUDA sources compiled by build.rs to sm_90 cubins, the shared
//! `__host__ __device__` header of per-token protocol rules, and the `Transport` implementation
//! over CUDA (cudarc) and NVSHMEM. Without nvcc the crate builds and launches return a typed
//! error ([`Error::KernelsNotBuilt`]).
//!
//! - [`nvshmem`]: NVSHMEM bring-up (version check, environment plan, rendezvous, init, report,
//!   symmetric memory, peer pointers, finalize) and the one-process-per-rank launcher.
//! - [`gpu`]: the GPU data path: device tensors, kernels, normal mode with co-resident ranks
//!   and ranks of other processes mapped through CUDA IPC, calls captured in CUDA graphs
//!   (`NormalGroup::capture`) or ordered by the caller's events (`NormalGroup::with_streams`).
//! - [`exchange`]: host all-gather and barrier between the processes of a job (TCP star).
//! - [`kernels`]: the embedded cubins.
//!
//! Build time: nvcc optional (see `build.rs`). Run time: the NVIDIA driver (`libcuda.so.1`,
//! checked before use) and NVSHMEM >= 3.3.9 (`libnvshmem_host.so.3`, searched as
//! `nvshmem_sys::search` says).

mod error;
pub mod exchange;
pub mod gpu;
pub mod kernels;
pub mod nvshmem;
pub mod rules;
pub mod topology;

pub use error::{Error, Result};
