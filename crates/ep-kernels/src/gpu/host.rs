//! Device results as ep-core's host types (downloads, for verification against the plan and
//! the oracle, digests and dumps; never on the hot path).

use ep_core::plan::combine::CombineOutput;
use ep_core::plan::intranode::{IntranodeDispatch, IntranodeHandle};
use ep_core::plan::layout::DispatchLayout;
use ep_core::routing::Activations;
use half::bf16;

use super::normal::{GpuCombined, GpuDispatch, GpuLayout};
use super::tensor::{DType, DevTensor};
use crate::error::Result;

impl GpuLayout {
    /// The layout as `plan::layout` returns it (intranode: no per-node counts).
    pub fn download(&self) -> Result<DispatchLayout> {
        Ok(DispatchLayout {
            num_tokens_per_rank: self.num_tokens_per_rank.download::<i32>()?.into_data(),
            num_tokens_per_rdma_rank: None,
            num_tokens_per_expert: self.num_tokens_per_expert.download::<i32>()?.into_data(),
            is_token_in_rank: self.is_token_in_rank.download::<bool>()?,
        })
    }
}

impl GpuDispatch {
    /// Every output as the plan's `IntranodeDispatch`. In worst-token mode the host never
    /// learns the received count: `num_recv_tokens` is then `None` here, and the caller fills it.
    pub fn download(&self) -> Result<(IntranodeDispatch, Option<usize>)> {
        let recv_x = match self.recv_x.dtype() {
            DType::F8E4M3 => {
                let bytes = DevTensor::strided(
                    self.recv_x.buffer().clone(),
                    self.recv_x.ptr() - self.recv_x.buffer().ptr(),
                    DType::U8,
                    self.recv_x.rows(),
                    self.recv_x.cols(),
                    self.recv_x.row_stride(),
                )?;
                Activations::Fp8 {
                    data: bytes.download::<u8>()?,
                    scales: match &self.recv_x_scales {
                        Some(s) => s.download::<f32>()?,
                        None => ep_core::tensor::Tensor2::filled(self.recv_x.rows(), 0, 0.0),
                    },
                }
            }
            _ => Activations::Bf16(self.recv_x.download::<bf16>()?),
        };
        let h = &self.handle;
        let out = IntranodeDispatch {
            recv_x,
            recv_topk_idx: self
                .recv_topk_idx
                .as_ref()
                .map(DevTensor::download)
                .transpose()?,
            recv_topk_weights: self
                .recv_topk_weights
                .as_ref()
                .map(DevTensor::download)
                .transpose()?,
            num_recv_tokens_per_expert_list: self.num_recv_tokens_per_expert_list.clone(),
            handle: IntranodeHandle {
                rank_prefix_matrix: h.rank_prefix_matrix.download()?,
                channel_prefix_matrix: h.channel_prefix_matrix.download()?,
                recv_channel_prefix_matrix: h.recv_channel_prefix_matrix.download()?,
                recv_src_idx: self.recv_src_idx.download::<i32>()?.into_data(),
                is_token_in_rank: h.is_token_in_rank.download::<bool>()?,
                send_head: h.send_head.download()?,
                num_recv_tokens: h.num_recv_tokens.unwrap_or(0),
            },
        };
        Ok((out, h.num_recv_tokens))
    }
}

impl GpuCombined {
    /// The combine's outputs as the plan's `CombineOutput`.
    pub fn download(&self) -> Result<CombineOutput> {
        Ok(CombineOutput {
            combined_x: self.combined_x.download()?,
            combined_topk_weights: self
                .combined_topk_weights
                .as_ref()
                .map(DevTensor::download)
                .transpose()?,
        })
    }
}
