//! The low-latency combine of an [`LlGroup`](super::LlGroup) (docs/protocol.md §3.5, §3.6).

use ep_core::protocol::layout::ll_half;

use super::types::{LlCombineArgs, LlCombineInput, LlGpuHandle};
use super::{LlGroup, Pending};
use crate::error::{Error, Result};
use crate::gpu::abi;
use crate::gpu::tensor::{DType, DevTensor};

impl LlGroup {
    /// Low-latency combine of every rank (spec §2.5, docs/protocol.md §3.5–3.6): `handles[r]`
    /// from rank `r`'s dispatch, `inputs[r]` its expert outputs. Returns each rank's
    /// `[T, H]` BF16 `combined_x`, a view valid until the next operation on the same half.
    pub fn combine(
        &mut self,
        handles: &[&LlGpuHandle],
        inputs: &[LlCombineInput<'_>],
        return_recv_hook: bool,
    ) -> Result<Vec<DevTensor>> {
        let args = LlCombineArgs {
            return_recv_hook,
            ..LlCombineArgs::default()
        };
        self.combine_with(handles, inputs, &args)
    }

    /// [`LlGroup::combine`] with every option ([`LlCombineArgs`]).
    pub fn combine_with(
        &mut self,
        handles: &[&LlGpuHandle],
        inputs: &[LlCombineInput<'_>],
        args: &LlCombineArgs,
    ) -> Result<Vec<DevTensor>> {
        let handles: Vec<Option<&LlGpuHandle>> = handles.iter().copied().map(Some).collect();
        let out = self.combine_ranks(&handles, inputs, args)?;
        Ok(out.into_iter().flatten().collect())
    }

    /// [`LlGroup::combine_with`] where a masked local rank may have no handle (`None`: its
    /// kernels are not launched, its output is `None`).
    pub(crate) fn combine_ranks(
        &mut self,
        handles: &[Option<&LlGpuHandle>],
        inputs: &[LlCombineInput<'_>],
        args: &LlCombineArgs,
    ) -> Result<Vec<Option<DevTensor>>> {
        let return_recv_hook = args.return_recv_hook;
        let r = self.ranks.len();
        for found in [handles.len(), inputs.len()] {
            if found != r {
                return Err(Error::RankCountMismatch { expected: r, found });
            }
        }
        let (rows_all, h) = (
            self.cfg.num_local_experts() * self.cfg.rows_per_expert(),
            self.cfg.hidden,
        );
        for (li, (hd, inp)) in handles.iter().zip(inputs).enumerate() {
            let s = self.ranks[li].rank;
            let Some(hd) = hd else {
                if self.mask[s] {
                    continue;
                }
                return Err(Error::Unsupported(format!(
                    "no dispatch handle for rank {s}, which is not masked"
                )));
            };
            let dhalf = ll_half(hd.op) as usize;
            let live = self.ranks[li].halves[dhalf].dispatch;
            if hd.rank != s || hd.generation != self.generation || live.map(|d| d.0) != Some(hd.op)
            {
                return Err(Error::Unsupported(format!(
                    "handle {} for rank {s}: it is not the latest dispatch of that rank on its half \
                     (a later operation or reset() reused its buffers); combine right after its dispatch",
                    hd.rank
                )));
            }
            if let LlCombineInput::Tensor(t) = inp {
                t.expect(
                    &format!("expert outputs of rank {s}"),
                    DType::Bf16,
                    Some(rows_all),
                    Some(h),
                )?;
                if !t.is_contiguous() {
                    return Err(Error::Unsupported(format!(
                        "expert outputs of rank {s}: rows must be contiguous"
                    )));
                }
                if t.device() != self.dev.ordinal() {
                    return Err(Error::WrongDevice {
                        rank: s,
                        expected: self.dev.ordinal(),
                        found: t.device(),
                    });
                }
            }
        }
        if let Some(cap) = &mut self.capture {
            // A replay's combine finds its routing in the previous operation's half: only a
            // handle of the operation just before can be captured (docs/protocol.md §3.10).
            if handles.iter().flatten().any(|hd| hd.op + 1 != self.op) {
                return Err(Error::NotCapturable {
                    what: "a combine whose handle is not from the operation just before it".into(),
                    fix: "capture the combine right after its dispatch (with only its recv_hook between)"
                        .into(),
                });
            }
            if self.op == cap.op0 {
                cap.prev = Some(
                    handles
                        .iter()
                        .map(|hd| hd.map_or(0, |hd| hd.num_tokens))
                        .collect(),
                );
            }
        }
        let zero_copy: Vec<DevTensor> = (0..r)
            .map(|s| self.next_combine_buffer(s))
            .collect::<Result<_>>()?;
        let (_, half) = self.start_op()?;
        for inp in inputs {
            if let LlCombineInput::Tensor(t) = inp {
                self.keep([t.buffer()]);
            }
        }
        let mut recv_args = Vec::with_capacity(r);
        let mut out = Vec::with_capacity(r);
        for (s, (hd, inp)) in handles.iter().zip(inputs).enumerate() {
            let Some(hd) = hd else {
                recv_args.push(None);
                out.push(None);
                continue;
            };
            let dhalf = ll_half(hd.op);
            let db = &self.ranks[s].halves[dhalf as usize];
            let cb = &self.ranks[s].halves[half as usize];
            let mut a = self.base_args(s, half);
            a.num_tokens = hd.num_tokens as u64;
            a.num_topk = 1;
            if args.use_logfmt {
                a.flags |= abi::EP_FLAG_LOGFMT;
            }
            a.disp_half = dhalf;
            a.slots = db.slots.ptr();
            a.send_counts = db.send_counts.ptr();
            a.recv_counts = db.recv_counts.ptr();
            a.recv_layout_range = db.layout_range.ptr();
            a.combine_y = match inp {
                LlCombineInput::ZeroCopy => zero_copy[s].ptr(),
                LlCombineInput::Tensor(t) => t.ptr(),
            };
            a.combined_x = cb.combined.ptr();
            let a = self.with_smem(a);
            out.push(Some(DevTensor::contiguous(
                cb.combined.clone(),
                0,
                DType::Bf16,
                hd.num_tokens,
                h,
            )));
            recv_args.push(Some(a));
        }
        for (s, a) in recv_args.iter().enumerate() {
            let Some(a) = a else { continue };
            let mut send = *a;
            send.flags |= abi::EP_FLAG_LL_SEND;
            if !return_recv_hook {
                send.flags |= abi::EP_FLAG_LL_RECV;
            }
            self.launch(s, self.combine_fn(Some(&send)), &send)?;
        }
        if return_recv_hook {
            self.pending = Some(Pending::Combine(recv_args));
        }
        Ok(out)
    }
}
