//! The low-latency dispatch of an [`LlGroup`](super::LlGroup) (docs/protocol.md §3.3, §3.4) and
//! its receive hook.

use ep_core::plan::low_latency::{LlParams, validate_hidden, validate_params};
use ep_core::protocol::layout::ll_half;

use super::types::{LlDispatchArgs, LlGpuDispatch, LlGpuHandle, LlRankInputs};
use super::{LlGroup, MAX_TOPK, Pending};
use crate::error::{Error, Result};
use crate::gpu::abi;
use crate::gpu::tensor::{DType, DevTensor};

impl LlGroup {
    pub(super) fn check_dispatch_inputs(&self, inputs: &[LlRankInputs<'_>]) -> Result<usize> {
        let (r, h, n) = (
            self.ranks.len(),
            self.cfg.hidden,
            self.cfg.num_max_dispatch_tokens_per_rank,
        );
        if inputs.len() != r {
            return Err(Error::RankCountMismatch {
                expected: r,
                found: inputs.len(),
            });
        }
        let mut k_all = None;
        for (li, i) in inputs.iter().enumerate() {
            let s = self.ranks[li].rank;
            let what = |m: &str| format!("{m} of rank {s}");
            i.x.expect(&what("x"), DType::Bf16, None, Some(h))?;
            let t = i.x.rows();
            if t > n {
                return Err(Error::Unsupported(format!(
                    "rank {s} dispatches {t} tokens; the group holds at most {n} (num_max_dispatch_tokens_per_rank)"
                )));
            }
            i.topk_idx
                .expect(&what("topk_idx"), DType::I64, Some(t), None)?;
            let k = i.topk_idx.cols();
            if k == 0 || k > MAX_TOPK {
                return Err(Error::Unsupported(format!(
                    "topk_idx of rank {s}: {k} columns; low-latency mode takes 1 to {MAX_TOPK}"
                )));
            }
            if *k_all.get_or_insert(k) != k {
                return Err(Error::TensorMismatch {
                    what: what("topk_idx"),
                    expected: format!("{} columns like rank 0", k_all.unwrap_or(k)),
                    found: format!("{k} columns"),
                });
            }
            i.topk_weights
                .expect(&what("topk_weights"), DType::F32, Some(t), Some(k))?;
            for (name, tensor) in [
                ("x", i.x),
                ("topk_idx", i.topk_idx),
                ("topk_weights", i.topk_weights),
            ] {
                if !tensor.is_contiguous() {
                    return Err(Error::Unsupported(format!(
                        "{}: rows must be contiguous",
                        what(name)
                    )));
                }
                if tensor.device() != self.dev.ordinal() {
                    return Err(Error::WrongDevice {
                        rank: s,
                        expected: self.dev.ordinal(),
                        found: tensor.device(),
                    });
                }
            }
        }
        Ok(k_all.unwrap_or(1))
    }

    pub(super) fn start_op(&mut self) -> Result<(u64, u64)> {
        self.check_ready()?;
        if self.pending.is_some() {
            return Err(hook_pending());
        }
        if self.tracing.is_some() {
            self.not_capturing("a traced operation")?;
            self.reset_traces()?;
        }
        self.call += 1;
        let op = self.op;
        self.op += 1;
        Ok((op, ll_half(op)))
    }

    /// Low-latency dispatch of every rank (spec §2.4, docs/protocol.md §3.3–3.4). With
    /// `return_recv_hook` only the send halves are launched; [`LlGroup::recv_hook`] launches
    /// the receive halves, and the outputs are valid once it has run.
    pub fn dispatch(
        &mut self,
        inputs: &[LlRankInputs<'_>],
        args: &LlDispatchArgs,
    ) -> Result<Vec<LlGpuDispatch>> {
        let k = self.check_dispatch_inputs(inputs)?;
        let mut params = LlParams::new(
            self.cfg.num_max_dispatch_tokens_per_rank,
            self.cfg.num_experts,
        );
        if args.use_fp8 {
            params = params.with_fp8(args.round_scale, args.use_ue8m0);
        }
        validate_params(self.num_ranks(), &params)?;
        validate_hidden(self.cfg.hidden, args.use_fp8)?;
        if !args.use_fp8 && (args.round_scale || args.use_ue8m0) {
            return Err(Error::Unsupported(
                "round_scale / use_ue8m0 apply to FP8 dispatch: set use_fp8".into(),
            ));
        }
        let (op, half) = self.start_op()?;
        for i in inputs {
            self.keep([i.x, i.topk_idx, i.topk_weights].map(DevTensor::buffer));
        }
        let mut flags = 0;
        if args.use_fp8 {
            flags |= abi::EP_FLAG_FP8;
        }
        if args.round_scale {
            flags |= abi::EP_FLAG_ROUND_SCALE;
        }
        if args.use_ue8m0 {
            flags |= abi::EP_FLAG_UE8M0;
        }
        let cfg = self.cfg;
        let (l, rows, h, r) = (
            cfg.num_local_experts(),
            cfg.rows_per_expert(),
            cfg.hidden,
            cfg.num_ranks,
        );
        let s_count = h / 128;
        let mut recv_args = Vec::with_capacity(r);
        let mut out = Vec::with_capacity(r);
        for (s, inp) in inputs.iter().enumerate() {
            let hb = &self.ranks[s].halves[half as usize];
            let mut a = self.base_args(s, half);
            a.num_tokens = inp.x.rows() as u64;
            a.num_topk = k as u64;
            a.flags |= flags;
            a.x = inp.x.ptr();
            a.topk_idx = inp.topk_idx.ptr();
            a.topk_weights = inp.topk_weights.ptr();
            a.slots = hb.slots.ptr();
            a.send_counts = hb.send_counts.ptr();
            a.recv_counts = hb.recv_counts.ptr();
            a.recv_x = hb.recv_x.ptr();
            a.recv_scales = hb.recv_scales.ptr();
            a.recv_src_info = hb.src_info.ptr();
            a.recv_layout_range = hb.layout_range.ptr();
            a.recv_count = hb.count.ptr();
            let a = self.with_smem(a);
            let elem = if args.use_fp8 {
                DType::F8E4M3
            } else {
                DType::Bf16
            };
            let scales = args.use_fp8.then(|| {
                if args.use_ue8m0 {
                    DevTensor::contiguous(
                        hb.recv_scales.clone(),
                        0,
                        DType::I32,
                        l * s_count.div_ceil(4),
                        rows,
                    )
                } else {
                    DevTensor::contiguous(hb.recv_scales.clone(), 0, DType::F32, l * s_count, rows)
                }
            });
            out.push(LlGpuDispatch {
                recv_x: DevTensor::contiguous(hb.recv_x.clone(), 0, elem, l * rows, h),
                recv_x_scales: scales,
                recv_src_info: DevTensor::contiguous(hb.src_info.clone(), 0, DType::I32, l, rows),
                recv_layout_range: DevTensor::contiguous(
                    hb.layout_range.clone(),
                    0,
                    DType::I64,
                    l,
                    r,
                ),
                recv_count: DevTensor::contiguous(hb.count.clone(), 0, DType::I32, 1, l),
                handle: LlGpuHandle {
                    rank: self.ranks[s].rank,
                    op,
                    generation: self.generation,
                    num_tokens: inp.x.rows(),
                },
            });
            recv_args.push(a);
        }
        for (s, a) in recv_args.iter().enumerate() {
            let mut send = *a;
            send.flags |= abi::EP_FLAG_LL_SEND;
            if !args.return_recv_hook {
                send.flags |= abi::EP_FLAG_LL_RECV;
            }
            self.launch(s, &self.fns().dispatch, &send)?;
        }
        for (s, o) in out.iter().enumerate() {
            self.ranks[s].halves[half as usize].dispatch = Some((op, o.handle.num_tokens));
        }
        if args.return_recv_hook {
            self.pending = Some(Pending::Dispatch(recv_args.into_iter().map(Some).collect()));
        }
        Ok(out)
    }

    /// Runs the pending receive halves (the hook of the last send with `return_recv_hook`).
    pub fn recv_hook(&mut self) -> Result<()> {
        self.check_ready()?;
        let Some(p) = self.pending.take() else {
            return Err(Error::Unsupported(
                "no low-latency send is waiting for its receive hook".into(),
            ));
        };
        let (f, list) = match &p {
            Pending::Dispatch(l) => (&self.fns().dispatch, l),
            Pending::Combine(l) => (self.combine_fn(l.iter().flatten().next()), l),
        };
        for (s, a) in list.iter().enumerate() {
            if let Some(a) = a {
                let mut recv = *a;
                recv.flags |= abi::EP_FLAG_LL_RECV;
                self.launch(s, f, &recv)?;
            }
        }
        Ok(())
    }

    /// Whether a receive hook is pending.
    pub fn hook_pending(&self) -> bool {
        self.pending.is_some()
    }
}

pub(super) fn hook_pending() -> Error {
    Error::Unsupported(
        "a low-latency receive hook is pending: call recv_hook() before the next low-latency \
         operation (docs/protocol.md §3.7)"
            .into(),
    )
}
