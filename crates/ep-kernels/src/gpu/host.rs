//! Device results as ep-core's host types (downloads, for verification against the plan and
//! the oracle, digests and dumps; never on the hot path).

use ep_core::plan::combine::CombineOutput;
use ep_core::plan::intranode::{IntranodeDispatch, IntranodeHandle};
use ep_core::plan::layout::DispatchLayout;
use ep_core::plan::low_latency::{LlDispatchOutput, LlHandle, LlRecvX};
use ep_core::routing::Activations;
use ep_core::tensor::Tensor3;
use half::bf16;

use super::low_latency::{LlConfig, LlGpuDispatch};
use super::normal::{GpuCombined, GpuDispatch, GpuLayout};
use super::tensor::{DType, DevTensor, HostElem};
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

impl LlGpuDispatch {
    /// Every output as the plan's `LlDispatchOutput` (scales back from DeepEP's memory order to
    /// the logical `[L, R·N, S]`; rows past each expert's count are zero and their `src_info`
    /// -1, as the plan leaves them), for `canonicalize`, digests and dumps.
    pub fn download(&self, cfg: &LlConfig) -> Result<LlDispatchOutput> {
        let (l, rows, h) = (cfg.num_local_experts(), cfg.rows_per_expert(), cfg.hidden);
        let count = self.recv_count.download::<i32>()?.into_data();
        let valid = |e: usize, r: usize| (r as i64) < i64::from(count[e]);
        let mut src_info = self.recv_src_info.download::<i32>()?;
        for e in 0..l {
            for r in 0..rows {
                if !valid(e, r) {
                    src_info.set(e, r, -1);
                }
            }
        }
        // The received rows, valid ones only (the rest stay zero).
        fn rows_of<T: HostElem>(
            x: &DevTensor,
            dtype: DType,
            (l, rows, h): (usize, usize, usize),
            valid: &dyn Fn(usize, usize) -> bool,
        ) -> Result<Tensor3<T>> {
            let all = DevTensor::contiguous(
                x.buffer().clone(),
                x.ptr() - x.buffer().ptr(),
                dtype,
                l * rows,
                h,
            )
            .download::<T>()?;
            let mut out = Tensor3::filled(l, rows, h, T::default());
            for e in 0..l {
                for r in (0..rows).filter(|&r| valid(e, r)) {
                    out.row_mut(e, r).copy_from_slice(all.row(e * rows + r));
                }
            }
            Ok(out)
        }
        // Scales `[L·S, R·N]` (DeepEP's order) to `[L, R·N, S]`.
        fn scales_of<T: HostElem>(
            s: &DevTensor,
            (l, rows): (usize, usize),
            valid: &dyn Fn(usize, usize) -> bool,
        ) -> Result<Tensor3<T>> {
            let cols = s.rows() / l.max(1);
            let all = s.download::<T>()?;
            let mut out = Tensor3::filled(l, rows, cols, T::default());
            for e in 0..l {
                for r in (0..rows).filter(|&r| valid(e, r)) {
                    for k in 0..cols {
                        out.row_mut(e, r)[k] = all.get(e * cols + k, r);
                    }
                }
            }
            Ok(out)
        }
        let recv_x = match (
            &self.recv_x_scales,
            self.recv_x_scales.as_ref().map(DevTensor::dtype),
        ) {
            (None, _) => LlRecvX::Bf16(rows_of(&self.recv_x, DType::Bf16, (l, rows, h), &valid)?),
            (Some(s), Some(DType::I32)) => LlRecvX::Fp8Ue8m0 {
                data: rows_of(&self.recv_x, DType::U8, (l, rows, h), &valid)?,
                scales: scales_of(s, (l, rows), &valid)?,
            },
            (Some(s), _) => LlRecvX::Fp8 {
                data: rows_of(&self.recv_x, DType::U8, (l, rows, h), &valid)?,
                scales: scales_of(s, (l, rows), &valid)?,
            },
        };
        Ok(LlDispatchOutput {
            recv_x,
            recv_count: count,
            handle: LlHandle {
                src_info,
                layout_range: self.recv_layout_range.download::<i64>()?,
                num_max_dispatch_tokens_per_rank: cfg.num_max_dispatch_tokens_per_rank,
                hidden: h,
                num_experts: cfg.num_experts,
            },
        })
    }
}
