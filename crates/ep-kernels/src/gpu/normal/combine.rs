//! The combine of a [`NormalGroup`] (docs/protocol.md §2.5, §2.6) and the combine rows the
//! expert writes its outputs into.

use ep_core::protocol::layout::RowFormat;

use super::launch::Kernel;
use super::types::{CombineSource, GpuCombineArgs, GpuCombined};
use super::{LastDispatch, NormalGroup, check_device, check_rank_count};
use crate::error::{Error, Result};
use crate::gpu::abi;
use crate::gpu::tensor::{DType, DevTensor, copy_2d};

/// What a combine's checks settled ([`NormalGroup::check_combine`]).
pub(crate) struct CombineChecked {
    n: usize,
    c: usize,
    last: LastDispatch,
    hidden: usize,
    k: usize,
}

impl NormalGroup {
    /// Local rank `rank`'s combine rows as views for the expert to write into (zero-copy combine
    /// input, docs/protocol.md §2.6): `[rows, H]` BF16 and, with `num_topk > 0`, `[rows, K]` f32
    /// weights, both with the combine record as row stride.
    pub fn combine_rows(
        &self,
        rank: usize,
        rows: usize,
        hidden: usize,
        num_topk: usize,
    ) -> Result<(DevTensor, Option<DevTensor>)> {
        let fmt = RowFormat {
            hidden,
            elem_bytes: 2,
            num_scales: 0,
            num_topk,
        };
        let yrec = fmt.combine_record();
        let d = self.data_layout();
        if rank >= self.num_local_ranks() {
            return Err(Error::Unsupported(format!(
                "local rank {rank}: the group drives {} local ranks (index them from 0)",
                self.num_local_ranks()
            )));
        }
        if rows as u64 > d.combine_capacity(yrec) {
            return Err(Error::DeviceCapacity {
                rank: self.who(rank),
                rows: rows as u64,
                capacity: d.combine_capacity(yrec),
            });
        }
        let base = d.combine_row(0, yrec);
        let data = self.ranks[rank].data.clone();
        let y = DevTensor::strided(data.clone(), base, DType::Bf16, rows, hidden, yrec)?;
        let w = (num_topk > 0)
            .then(|| {
                DevTensor::strided(
                    data,
                    base + ep_core::protocol::layout::align16(2 * hidden as u64),
                    DType::F32,
                    rows,
                    num_topk,
                    yrec,
                )
            })
            .transpose()?;
        Ok((y, w))
    }

    /// Copies expert outputs `y` (`[rows, H]` BF16) and weights (`[rows, K]` f32) of local
    /// rank `rank` into its combine rows, on its stream (the copying path of combine).
    pub fn write_combine_rows(
        &mut self,
        rank: usize,
        y: &DevTensor,
        weights: Option<&DevTensor>,
    ) -> Result<()> {
        let k = weights.map_or(0, DevTensor::cols);
        let (dy, dw) = self.combine_rows(rank, y.rows(), y.cols(), k)?;
        y.expect("combine input x", DType::Bf16, None, None)?;
        self.keep(Some(y));
        self.keep(weights);
        copy_2d(&self.ranks[rank].stream, y, &dy)?;
        if let (Some(w), Some(dw)) = (weights, dw) {
            w.expect(
                "combine input topk_weights",
                DType::F32,
                Some(y.rows()),
                None,
            )?;
            copy_2d(&self.ranks[rank].stream, w, &dw)?;
        }
        Ok(())
    }

    /// The checks of a combine before anything is enqueued (no side effect).
    pub(crate) fn check_combine(
        &self,
        source: CombineSource,
        args: &[GpuCombineArgs<'_>],
    ) -> Result<CombineChecked> {
        let r = self.num_ranks();
        let n = self.num_local_ranks();
        check_rank_count(n, args.len())?;
        let c = self.num_channels();
        let last = self
            .last
            .ok_or_else(|| Error::Unsupported("combine before any dispatch".into()))?;
        let hidden = last.fmt.hidden;
        let k = last.num_topk;
        if source == CombineSource::InPlace && last.fmt.elem_bytes != 2 {
            return Err(Error::Unsupported(
                "an in-place combine needs BF16 dispatch rows (FP8 rows have no room for BF16 outputs): write the outputs with write_combine_rows and combine from Rows".into(),
            ));
        }
        for (i, a) in args.iter().enumerate() {
            let s = self.who(i);
            let h = a.handle;
            h.check(s, r, c)?;
            if a.with_weights && k == 0 {
                return Err(Error::Unsupported(format!(
                    "rank {s}: weights asked for, but the last dispatch carried no top-k"
                )));
            }
            for (i, b) in a.bias.iter().enumerate() {
                if let Some(b) = b {
                    b.expect(
                        &format!("bias {i} of rank {s}"),
                        DType::Bf16,
                        Some(h.num_tokens),
                        Some(hidden),
                    )?;
                    check_device(b, &self.dev, s)?;
                    if !b.is_contiguous() {
                        return Err(Error::Unsupported(format!(
                            "bias {i} of rank {s}: rows must be contiguous"
                        )));
                    }
                }
            }
        }
        Ok(CombineChecked {
            n,
            c,
            last,
            hidden,
            k,
        })
    }

    /// Combine of every local rank (spec §1.8, docs/protocol.md §2.5): each rank pulls its
    /// tokens' rows from every rank holding them and reduces in DeepEP's order.
    pub fn combine(
        &mut self,
        source: CombineSource,
        args: &[GpuCombineArgs<'_>],
    ) -> Result<Vec<GpuCombined>> {
        self.check_ready()?;
        let CombineChecked {
            n,
            c,
            last,
            hidden,
            k,
        } = self.check_combine(source, args)?;
        self.begin_traced(super::trace::TracedOp::Combine)?;
        self.call += 1;
        let fmt = RowFormat {
            hidden,
            elem_bytes: 2,
            num_scales: 0,
            num_topk: k,
        };
        // Every allocation before the first launch (see `dispatch`).
        let mut out = Vec::with_capacity(n);
        for (s, a) in args.iter().enumerate() {
            let t = a.handle.num_tokens;
            let combined_x = self.alloc(s, DType::Bf16, t, hidden)?;
            let combined_topk_weights = if a.with_weights {
                Some(self.alloc(s, DType::F32, t, k)?)
            } else {
                None
            };
            out.push(GpuCombined {
                combined_x,
                combined_topk_weights,
            });
            self.keep_handle(a.handle);
            for b in a.bias {
                self.keep(b);
            }
        }
        for (s, a) in args.iter().enumerate() {
            let t = a.handle.num_tokens;
            let (x, w) = (&out[s].combined_x, &out[s].combined_topk_weights);
            let mut g = self.base_args(s);
            g.num_tokens = t as u64;
            g.num_topk = k as u64;
            g.hidden = hidden as u64;
            g.drec = last.fmt.dispatch_record();
            g.yrec = fmt.combine_record();
            g.flags |= if a.with_weights { abi::EP_FLAG_TOPK } else { 0 }
                | if source == CombineSource::InPlace {
                    abi::EP_FLAG_IN_PLACE
                } else {
                    0
                };
            g.rank_prefix_matrix = a.handle.rank_prefix_matrix.ptr();
            g.channel_prefix_matrix = a.handle.channel_prefix_matrix.ptr();
            g.send_head = a.handle.send_head.ptr();
            g.combined_x = x.ptr();
            g.combined_weights = w.as_ref().map_or(0, DevTensor::ptr);
            g.bias0 = a.bias[0].map_or(0, DevTensor::ptr);
            g.bias1 = a.bias[1].map_or(0, DevTensor::ptr);
            self.launch(s, Kernel::Combine, 2 * c as u32, &g)?;
        }
        Ok(out)
    }
}
