//! # ep-rs
//!
//! Mixture-of-Experts expert-parallel communication: DeepEP V1's dispatch and combine with a
//! Rust API, a CPU simulator of the fabric, and CUDA/NVSHMEM backends. This crate re-exports
//! the workspace: [`core`] (semantics, oracle, configuration, `Transport`), [`sim`] (the
//! simulator backend) and [`kernels`] (the GPU backend).

pub use ep_core as core;
pub use ep_kernels as kernels;
pub use ep_sim as sim;
