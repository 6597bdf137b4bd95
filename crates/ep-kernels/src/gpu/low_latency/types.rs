//! What the low-latency calls of an [`LlGroup`](super::LlGroup) take and give, per local rank.

use crate::gpu::tensor::DevTensor;

/// One rank's low-latency dispatch inputs, on the device.
#[derive(Clone, Copy, Debug)]
pub struct LlRankInputs<'a> {
    /// `[T, H]` BF16, `T ≤ N`.
    pub x: &'a DevTensor,
    /// `[T, K]` i64 expert ids (`-1` masked).
    pub topk_idx: &'a DevTensor,
    /// `[T, K]` f32.
    pub topk_weights: &'a DevTensor,
}

/// Options of a low-latency dispatch (spec §2.4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlDispatchArgs {
    /// Cast rows to e4m3 with per-128 scales.
    pub use_fp8: bool,
    /// Round the scales to powers of two.
    pub round_scale: bool,
    /// Pack the (rounded) scales as UE8M0 bytes.
    pub use_ue8m0: bool,
    /// Launch only the send half; [`LlGroup::recv_hook`](super::LlGroup::recv_hook) runs the
    /// receive half.
    pub return_recv_hook: bool,
}

/// Options of a low-latency combine (spec §2.5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlCombineArgs {
    /// Launch only the send half; [`LlGroup::recv_hook`](super::LlGroup::recv_hook) runs the
    /// receive half.
    pub return_recv_hook: bool,
    /// Partials travel LogFMT-10 encoded (DeepEP's `use_logfmt`, spec §2.6; lossy:
    /// `plan::low_latency::PartialPrecision::LogFmt10` is the reference). Unlike DeepEP it
    /// combines with the zero-copy input too (the encoded partials do not overwrite it).
    pub use_logfmt: bool,
}

/// What a combine needs from its dispatch.
#[derive(Clone, Debug)]
pub struct LlGpuHandle {
    pub(super) rank: usize,
    pub(super) op: u64,
    pub(super) generation: u64,
    pub(super) num_tokens: usize,
}

impl LlGpuHandle {
    /// The dispatch's tokens on this rank.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
}

/// What one rank receives from a low-latency dispatch (views valid until the next operation on
/// the same half, module docs).
#[derive(Clone, Debug)]
pub struct LlGpuDispatch {
    /// `[L·R·N, H]` BF16 or e4m3.
    pub recv_x: DevTensor,
    /// FP8: `[L·S, R·N]` f32, or `[L·S/4, R·N]` i32 packed UE8M0 (DeepEP's memory order).
    pub recv_x_scales: Option<DevTensor>,
    /// `[L, R·N]` i32 source token of each row.
    pub recv_src_info: DevTensor,
    /// `[L, R]` i64 `(begin << 32) | count`.
    pub recv_layout_range: DevTensor,
    /// `[1, L]` i32 rows per local expert.
    pub recv_count: DevTensor,
    /// For the combine.
    pub handle: LlGpuHandle,
}

/// Where a combine reads a rank's expert outputs `[L·R·N, H]` BF16.
#[derive(Clone, Copy, Debug)]
pub enum LlCombineInput<'a> {
    /// The zero-copy region of the combine's half
    /// ([`LlGroup::next_combine_buffer`](super::LlGroup::next_combine_buffer)).
    ZeroCopy,
    /// A caller tensor.
    Tensor(&'a DevTensor),
}

/// What [`LlGroup::poison_for_test`](super::LlGroup::poison_for_test) fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlPoison {
    /// Before a dispatch: every rank's `ll.data` and dispatch outputs (both halves).
    Dispatch,
    /// Before a combine: every rank's combine outputs (both halves).
    Combine,
}

/// Per-rank statistics (DeepEP's `cumulative_local_expert_recv_stats` and wait-time stats).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlStats {
    /// Tokens received per local expert, summed over dispatches since the last clear.
    pub local_expert_recv: Vec<i32>,
    /// Nanoseconds the receive halves waited for each source rank.
    pub wait_ns: Vec<u64>,
}

/// The kernel variant a group runs (docs/protocol.md §3.10, §3.11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlVariant {
    /// (a) Peers by pointer.
    Pointers,
    /// (b) Every peer through NVSHMEM's device API.
    Nvshmem,
}
