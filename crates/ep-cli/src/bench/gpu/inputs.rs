//! The bench's input sets on the device: set 0 the workload, set `i` its rows rotated (so no call
//! finds the previous call's rows in L2), with the plan's rows for the ceilings and the combine.

use ep_core::numerics::fp8;
use ep_core::plan::intranode::IntranodeDispatch;
use ep_core::plan::layout::{DispatchLayout, channel_range, get_dispatch_layout_for_rank};
use ep_core::routing::Activations;
use ep_core::{RankInputs, Tensor2};
use ep_kernels::gpu::{DType, DevTensor, Device, GpuInputs, GpuRankInputs};
use half::bf16;

use super::timing::gpu_err;
use crate::bench::error::BenchError;
use crate::bench::flip_signs;

/// One set of inputs: every rank's on the host (with its layout, the plan needs them all), the
/// process's local ranks' on the device (`x`, `scales`, `idx`, `w` indexed like `local`).
pub(super) struct Set {
    pub(super) host: Vec<RankInputs>,
    pub(super) layouts: Vec<DispatchLayout>,
    pub(super) local: Vec<usize>,
    pub(super) x: Vec<DevTensor>,
    pub(super) scales: Vec<Option<DevTensor>>,
    pub(super) idx: Vec<DevTensor>,
    pub(super) w: Vec<DevTensor>,
}

impl Set {
    /// The rows alone (cached dispatch, dispatch without top-k).
    pub(super) fn inputs_without_topk(&self) -> Vec<GpuRankInputs<'_>> {
        self.inputs()
            .into_iter()
            .map(|i| GpuRankInputs {
                topk_idx: None,
                topk_weights: None,
                ..i
            })
            .collect()
    }

    /// The inputs as the `Buffer` takes them.
    pub(super) fn buffer_inputs(&self) -> Vec<GpuInputs> {
        (0..self.x.len())
            .map(|r| GpuInputs {
                x: self.x[r].clone(),
                x_scales: self.scales[r].clone(),
                topk_idx: Some(self.idx[r].clone()),
                topk_weights: Some(self.w[r].clone()),
            })
            .collect()
    }

    pub(super) fn inputs(&self) -> Vec<GpuRankInputs<'_>> {
        (0..self.x.len())
            .map(|r| GpuRankInputs {
                x: &self.x[r],
                x_scales: self.scales[r].as_ref(),
                topk_idx: Some(&self.idx[r]),
                topk_weights: Some(&self.w[r]),
            })
            .collect()
    }
}

/// Set `i` of the rotation: the workload's rows moved by `i` tokens, signs flipped for odd `i`.
pub(super) fn rotated(base: &[RankInputs], i: usize) -> Vec<RankInputs> {
    let mut out: Vec<RankInputs> = base
        .iter()
        .map(|inp| {
            let t = inp.num_tokens();
            let x = match &inp.x {
                Activations::Bf16(x) => Activations::Bf16(Tensor2::from_fn(t, x.cols(), |r, c| {
                    x.get((r + i) % t.max(1), c)
                })),
                Activations::Fp8 { data, scales } => Activations::Fp8 {
                    data: Tensor2::from_fn(t, data.cols(), |r, c| data.get((r + i) % t.max(1), c)),
                    scales: Tensor2::from_fn(t, scales.cols(), |r, c| {
                        scales.get((r + i) % t.max(1), c)
                    }),
                },
            };
            RankInputs {
                x,
                topk_idx: inp.topk_idx.clone(),
                topk_weights: inp.topk_weights.clone(),
            }
        })
        .collect();
    if i % 2 == 1 {
        flip_signs(&mut out);
    }
    out
}

pub(super) fn upload_set(
    dev: &Device,
    host: Vec<RankInputs>,
    num_experts: usize,
    local: &[usize],
) -> Result<Set, BenchError> {
    let ctx = dev.context();
    let r = host.len();
    let mut set = Set {
        local: local.to_vec(),
        layouts: Vec::with_capacity(r),
        x: Vec::with_capacity(r),
        scales: Vec::with_capacity(r),
        idx: Vec::with_capacity(r),
        w: Vec::with_capacity(r),
        host: Vec::new(),
    };
    for (s, inp) in host.iter().enumerate() {
        set.layouts.push(
            get_dispatch_layout_for_rank(s, &inp.topk_idx, num_experts, r).map_err(|e| {
                BenchError::Reference {
                    what: "layout",
                    source: Box::new(e),
                }
            })?,
        );
        if !local.contains(&s) {
            continue;
        }
        match &inp.x {
            Activations::Bf16(x) => {
                set.x
                    .push(DevTensor::upload(ctx, x).map_err(gpu_err("upload x"))?);
                set.scales.push(None);
            }
            Activations::Fp8 { data, scales } => {
                let d = DevTensor::upload(ctx, data).map_err(gpu_err("upload x"))?;
                set.x.push(DevTensor::contiguous(
                    d.buffer().clone(),
                    0,
                    DType::F8E4M3,
                    data.rows(),
                    data.cols(),
                ));
                set.scales.push(Some(
                    DevTensor::upload(ctx, scales).map_err(gpu_err("upload scales"))?,
                ));
            }
        }
        set.idx
            .push(DevTensor::upload(ctx, &inp.topk_idx).map_err(gpu_err("upload topk_idx"))?);
        set.w.push(
            DevTensor::upload(ctx, &inp.topk_weights).map_err(gpu_err("upload topk_weights"))?,
        );
    }
    set.host = host;
    Ok(set)
}

/// The identity expert's BF16 output rows of a dispatch (FP8 rows dequantised, as DeepEP's
/// `per_token_cast_back` and `--backend sim`).
pub(super) fn identity_rows(d: &IntranodeDispatch) -> Result<Tensor2<bf16>, BenchError> {
    match &d.recv_x {
        Activations::Bf16(x) => Ok(x.clone()),
        Activations::Fp8 { data, scales } => {
            let mut out = Tensor2::filled(data.rows(), data.cols(), bf16::ZERO);
            for r in 0..data.rows() {
                fp8::dequantize_row_bf16(data.row(r), scales.row(r), out.row_mut(r)).map_err(
                    |e| BenchError::Reference {
                        what: "FP8 dequantisation",
                        source: Box::new(e),
                    },
                )?;
            }
            Ok(out)
        }
    }
}

/// Final row of every (token, destination) of rank `rank` from its handle: what the ceilings copy.
pub(super) fn final_rows(d: &IntranodeDispatch, rank: usize) -> Tensor2<i32> {
    let h = &d.handle;
    let r = h.rank_prefix_matrix.rows();
    let t = h.send_head.rows();
    let c_count = h.channel_prefix_matrix.cols();
    let mut out = Tensor2::filled(t, r, -1i32);
    for c in 0..c_count {
        for tok in channel_range(t, c_count, c) {
            for dst in 0..r {
                let sh = h.send_head.get(tok, dst);
                if sh < 0 {
                    continue;
                }
                let base = if rank == 0 {
                    0
                } else {
                    h.rank_prefix_matrix.get(rank - 1, dst)
                };
                let start = if c == 0 {
                    0
                } else {
                    h.channel_prefix_matrix.get(dst, c - 1)
                };
                out.set(tok, dst, base + start + sh);
            }
        }
    }
    out
}
