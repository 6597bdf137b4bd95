//! What the normal-mode calls of a [`NormalGroup`](super::NormalGroup) take and give, per local
//! rank.

use ep_core::buffer::check::{HandleShapes, normal_handle};

use crate::error::Result;
use crate::gpu::tensor::{DType, DevTensor};

/// What [`NormalGroup::layout`](super::NormalGroup::layout) gives one rank (spec §1.7), on the
/// device.
#[derive(Clone, Debug)]
pub struct GpuLayout {
    /// `[1, R]` i32.
    pub num_tokens_per_rank: DevTensor,
    /// `[1, E]` i32.
    pub num_tokens_per_expert: DevTensor,
    /// `[T, R]` u8 (bool).
    pub is_token_in_rank: DevTensor,
}

/// One rank's dispatch inputs, on the device.
#[derive(Clone, Copy, Debug)]
pub struct GpuRankInputs<'a> {
    /// `[T, H]` BF16, or e4m3 bytes with `x_scales`.
    pub x: &'a DevTensor,
    /// `[T, ceil(H / 128)]` f32 for FP8 rows.
    pub x_scales: Option<&'a DevTensor>,
    /// `[T, K]` i64 expert ids (`-1` masked); `None`: no top-k dispatched.
    pub topk_idx: Option<&'a DevTensor>,
    /// `[T, K]` f32.
    pub topk_weights: Option<&'a DevTensor>,
}

/// Options of a GPU dispatch (spec §1.8); the channel count is the group's `num_sms / 2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuDispatchArgs {
    /// Rounds the expert list (≥ 1).
    pub expert_alignment: usize,
    /// `> 0`: outputs sized to this many rows, no host sync.
    pub num_worst_tokens: usize,
}

impl Default for GpuDispatchArgs {
    fn default() -> Self {
        Self {
            expert_alignment: 1,
            num_worst_tokens: 0,
        }
    }
}

/// The intranode handle on the device (spec §2.2).
#[derive(Clone, Debug)]
pub struct GpuHandle {
    /// `[R, R]` i32, inclusive.
    pub rank_prefix_matrix: DevTensor,
    /// `[R, C]` i32, sender side, inclusive.
    pub channel_prefix_matrix: DevTensor,
    /// `[R, C]` i32, receiver side, exclusive.
    pub recv_channel_prefix_matrix: DevTensor,
    /// `[T, R]` i32 (slot of token `t` in `(channel, d)`, or -1).
    pub send_head: DevTensor,
    /// `[T, R]` u8 (from the layout).
    pub is_token_in_rank: DevTensor,
    /// Rows received (`None` in worst-token mode: not known on the host).
    pub num_recv_tokens: Option<usize>,
    /// Output rows (`num_recv_tokens`, or `num_worst_tokens`).
    pub num_rows: usize,
    /// Tokens of this rank.
    pub num_tokens: usize,
}

impl GpuHandle {
    /// The shapes the rules every backend shares read (`ep_core::buffer::check`).
    #[must_use]
    pub fn shapes(&self) -> HandleShapes {
        let shape = |t: &DevTensor| (t.rows(), t.cols());
        HandleShapes {
            rank_prefix_matrix: shape(&self.rank_prefix_matrix),
            channel_prefix_matrix: shape(&self.channel_prefix_matrix),
            recv_channel_prefix_matrix: shape(&self.recv_channel_prefix_matrix),
            send_head: shape(&self.send_head),
            is_token_in_rank: shape(&self.is_token_in_rank),
            num_rows: self.num_rows,
            num_recv: self.num_recv_tokens,
        }
    }

    /// Checks every matrix's dtype (rank `rank` named in the error).
    pub fn check_dtypes(&self, rank: usize) -> Result<()> {
        let what = |m: &str| format!("handle of rank {rank}: {m}");
        for (name, t, dtype) in [
            ("rank_prefix_matrix", &self.rank_prefix_matrix, DType::I32),
            (
                "channel_prefix_matrix",
                &self.channel_prefix_matrix,
                DType::I32,
            ),
            (
                "recv_channel_prefix_matrix",
                &self.recv_channel_prefix_matrix,
                DType::I32,
            ),
            ("send_head", &self.send_head, DType::I32),
            ("is_token_in_rank", &self.is_token_in_rank, DType::U8),
        ] {
            t.expect(&what(name), dtype, None, None)?;
        }
        Ok(())
    }

    /// Checks every matrix's dtype and shape for rank `rank` of `num_ranks` with `num_channels`
    /// channels (a handle from another group or call shape is a typed error, not a bad read).
    /// The dtypes here, the shapes by the rules every backend shares
    /// (`ep_core::buffer::check::normal_handle`).
    pub fn check(&self, rank: usize, num_ranks: usize, num_channels: usize) -> Result<()> {
        self.check_dtypes(rank)?;
        let shapes = self.shapes();
        normal_handle(
            rank,
            num_ranks,
            Some(self.num_tokens),
            Some(num_channels),
            &shapes,
        )?;
        Ok(())
    }
}

/// What one rank receives from a GPU dispatch.
#[derive(Clone, Debug)]
pub struct GpuDispatch {
    /// `[rows, H]` view into the arena (BF16 or e4m3), row stride = the dispatch record.
    pub recv_x: DevTensor,
    /// `[rows, S]` f32 view into the arena (FP8 only).
    pub recv_x_scales: Option<DevTensor>,
    /// `[rows, K]` i64 local expert ids (with top-k): a view into the arena's records (row
    /// stride = the record), valid until the next dispatch, like `recv_x`.
    pub recv_topk_idx: Option<DevTensor>,
    /// `[rows, K]` f32 (with top-k), a view like `recv_topk_idx`.
    pub recv_topk_weights: Option<DevTensor>,
    /// `[rows, 1]` i32 source token of each row: a view into the arena's records (row stride =
    /// the record), valid until the next dispatch, like `recv_x`.
    pub recv_src_idx: DevTensor,
    /// `[L]` aligned received counts per local expert (empty in worst-token mode).
    pub num_recv_tokens_per_expert_list: Vec<i32>,
    /// For combine and cached dispatch.
    pub handle: GpuHandle,
}

/// Where a combine finds the expert outputs of a rank (docs/protocol.md §2.5, §2.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CombineSource {
    /// The BF16 x parts of the last dispatch's rows (the expert wrote over its input), with the
    /// dispatched weights.
    InPlace,
    /// The combine rows, written through
    /// [`NormalGroup::combine_rows`](super::NormalGroup::combine_rows) or
    /// [`NormalGroup::write_combine_rows`](super::NormalGroup::write_combine_rows).
    Rows,
}

/// One rank's combine arguments.
#[derive(Clone, Copy, Debug)]
pub struct GpuCombineArgs<'a> {
    /// The rank's handle from the dispatch.
    pub handle: &'a GpuHandle,
    /// Whether to combine the top-k weights (`[T, K]` out).
    pub with_weights: bool,
    /// 0–2 BF16 `[T, H]` biases.
    pub bias: [Option<&'a DevTensor>; 2],
}

impl<'a> GpuCombineArgs<'a> {
    /// Every rank's combine of what `out` delivered, with its weights and no bias: the identity
    /// expert's combine (the rows themselves with `CombineSource::InPlace`).
    pub fn of_dispatch(out: &'a [GpuDispatch]) -> Vec<Self> {
        out.iter()
            .map(|d| Self {
                handle: &d.handle,
                with_weights: true,
                bias: [None, None],
            })
            .collect()
    }
}

/// What combine gives one rank.
#[derive(Clone, Debug)]
pub struct GpuCombined {
    /// `[T, H]` BF16.
    pub combined_x: DevTensor,
    /// `[T, K]` f32 when weights were combined.
    pub combined_topk_weights: Option<DevTensor>,
}
