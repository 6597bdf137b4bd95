//! Configuration: DeepEP's `Config` and size hints (spec §1.4, §1.5, §1.9), `BufferConfig`
//! (spec §1.1) with validation, and the NVSHMEM environment plan (spec §1.2).
//!
//! - [`Config`]: the chunking of normal-mode kernels, DeepEP's constructor checks, the tuned
//!   tables ([`Config::dispatch_for`], [`Config::combine_for`]) and the normal-mode buffer size
//!   hints ([`Config::nvl_buffer_size_hint`], [`Config::rdma_buffer_size_hint`]).
//! - [`LowLatencyLayout`] and [`low_latency_rdma_size_hint`]: the low-latency RDMA buffer.
//! - [`BufferConfig`]: the options of DeepEP's `Buffer` constructor, [`BufferConfig::validate`],
//!   and the call-level checks of both modes ([`BufferConfig::check_low_latency`],
//!   [`BufferConfig::check_normal`]).
//! - [`nvshmem_env_plan`]: the NVSHMEM environment, as data ([`EnvPlan`]).

mod buffer;
mod deepep;
mod env_plan;
mod low_latency;
mod size_hint;

pub use buffer::{BufferConfig, NormalCall};
pub use deepep::Config;
pub use env_plan::{
    EnvEntry, EnvPlan, IbgdaNicHandler, NvshmemResources, NvshmemWorld, nvshmem_env_plan,
    parse_nvshmem_size,
};
pub use low_latency::{DEEPEP_LOW_LATENCY_HIDDEN_SIZES, LowLatencyCall, check_deepep_ll_hidden};
pub use size_hint::{
    LowLatencyHalf, LowLatencyLayout, hidden_bytes_for_hint, low_latency_rdma_size_hint,
};

/// GPUs per NVLink domain (spec §0 `NUM_MAX_NVL_PEERS`).
pub const NUM_MAX_NVL_PEERS: usize = 8;
/// Most nodes the normal kernels support: `8 * 20 = 160` ranks (spec §0 `NUM_MAX_RDMA_PEERS`).
pub const NUM_MAX_RDMA_PEERS: usize = 20;
/// Alignment of `num_nvl_bytes` / `num_rdma_bytes` and of NVSHMEM allocations (spec §0).
pub const NUM_BUFFER_ALIGNMENT_BYTES: u64 = 128;
/// Largest top-k of normal mode (spec §0).
pub const NUM_MAX_TOPK_NORMAL: usize = 32;
/// Largest top-k of low-latency mode (spec §0, `kNumMaxTopK`).
pub const NUM_MAX_TOPK_LOW_LATENCY: usize = 11;
/// Largest `num_max_dispatch_tokens_per_rank` (spec §3.6: the per-expert finish counter uses
/// 1024 as its tag, so at most 1024 tokens per rank and expert).
pub const NUM_MAX_DISPATCH_TOKENS_PER_RANK: usize = 1024;
/// `NVSHMEM_QP_DEPTH` when the user sets none (spec §1.2, §4).
pub const DEFAULT_NVSHMEM_QP_DEPTH: u32 = 1024;
/// `NVSHMEM_CUMEM_GRANULARITY` DeepEP sets: 512 MiB (spec §1.2, §4).
pub const DEEPEP_CUMEM_GRANULARITY: u64 = 1 << 29;
/// `NVSHMEM_MAX_TEAMS` DeepEP sets: 6 default teams + 1 (spec §1.2).
pub const DEEPEP_NVSHMEM_MAX_TEAMS: u32 = 7;
/// `Buffer.num_sms` default (spec §1.1); the tuned tables use it (spec §1.4).
pub const DEFAULT_NUM_SMS: usize = 20;
/// Bytes of `SourceMeta` in NVSHMEM builds (spec §1.5).
pub const SOURCE_META_BYTES: usize = 8;
/// `sizeof(topk_idx_t)`: int64 by default (spec §0).
pub const TOPK_IDX_BYTES: usize = 8;
/// `INT_MAX`, the limit of DeepEP's 32-bit buffer offsets (spec §1.1).
pub const INT_MAX: u64 = i32::MAX as u64;

/// `max(R / 8, 1)`: nodes (RDMA ranks) of an EP group of `num_ranks` (spec conventions).
pub fn num_rdma_ranks(num_ranks: usize) -> usize {
    (num_ranks / NUM_MAX_NVL_PEERS).max(1)
}

/// `min(R, 8)`: NVLink peers of a rank, itself included (spec conventions).
pub fn num_nvl_ranks(num_ranks: usize) -> usize {
    num_ranks.min(NUM_MAX_NVL_PEERS)
}
