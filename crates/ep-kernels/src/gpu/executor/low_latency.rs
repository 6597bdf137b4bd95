//! Low-latency mode of [`Gpu`](super::Gpu) (docs/buffer-api.md, step 3b): each phase the
//! `Buffer` hands over is [`LlGroup`]'s kernels, launched under the `Buffer`'s operation — its
//! index and half, its mask, shrink mode — so that the operation counter, the hooks, the
//! clean-state bookkeeping and the mask live once, in the `Buffer`.
//!
//! The group is made at the first dispatch, for that dispatch's `(N, H, E)`: DeepEP's buffer
//! is sized by `num_rdma_bytes` and told the shape at each call; the kernels here are built for
//! one shape, so a later call of another shape is refused (make another `Buffer`).
//!
//! A call without hook launches both halves at once (one kernel per rank, as `LlGroup` does);
//! with a hook the send half is launched by the send call and the receive half by the hook.
//! Outputs are views of the group's buffers, valid until the next operation on the same half.

use std::sync::Arc;
use std::time::Duration;

use ep_core::executor::{
    LlAttempt, LlCombineRecvJob, LlCombineSendJob, LlDispatchRecvJob, LlDispatchSendJob,
    LlExpertOutputJob, LlOpView,
};

use super::{DevTensors, GpuInputs, core, refused};
use crate::error::Error;
use crate::gpu::device::Device;
use crate::gpu::low_latency::{
    LlCombineArgs, LlCombineInput, LlConfig, LlDispatchArgs, LlGpuDispatch, LlGroup, LlRankInputs,
    LlVariant,
};
use crate::gpu::tensor::{DType, DevTensor, copy_2d};
use crate::nvshmem::NvshmemSession;

/// One rank's expert outputs for a low-latency combine: `y` is `[L·R·N, H]` BF16, the
/// `[L, R·N, H]` packed layout of its dispatch with the experts' rows one after the other.
#[derive(Clone, Debug)]
pub struct GpuExpertOut {
    /// `[L·R·N, H]` BF16, contiguous.
    pub y: DevTensor,
    /// `L`.
    pub num_local_experts: usize,
}

impl GpuExpertOut {
    /// `(L, R·N, H)` (dtype checked; rows a multiple of `L`).
    pub(crate) fn shape(&self, rank: usize) -> Result<(usize, usize, usize), Error> {
        let what = format!("low-latency expert outputs of rank {rank}");
        self.y.expect(&what, DType::Bf16, None, None)?;
        let l = self.num_local_experts;
        if l == 0 || !self.y.rows().is_multiple_of(l) {
            return Err(Error::TensorMismatch {
                what,
                expected: format!("[L·R·N, H] rows, a multiple of L = {l}"),
                found: format!("{:?}", self.y.shape()),
            });
        }
        Ok((l, self.y.rows() / l, self.y.cols()))
    }
}

/// How the group reaches its peers (variant and, for variant (b) or one rank per process,
/// the NVSHMEM session).
#[derive(Clone)]
pub(crate) enum LlPeers {
    /// Variant (a), every rank co-resident.
    Pointers,
    /// Over an NVSHMEM session: variant (b), or variant (a) with one rank per process.
    Nvshmem(Arc<NvshmemSession>, LlVariant),
}

/// The executor's low-latency state: what the group is made from, the group once made, and
/// what a send half launched for its receive half to return.
pub(crate) struct LlExec {
    dev: Arc<Device>,
    num_ranks: usize,
    num_sms: usize,
    local: Vec<usize>,
    peers: LlPeers,
    timeout: Option<Duration>,
    group: Option<LlGroup>,
    sent: Option<Vec<LlGpuDispatch>>,
    combined: Option<Vec<Option<DevTensor>>>,
    /// Ranks the kernels masked (shrink mode), found at a sync, not yet taken by the Buffer.
    lost: Vec<usize>,
}

fn attempt<X>(res: ep_core::Result<Vec<Option<ep_core::Result<X>>>>) -> LlAttempt<X> {
    match res {
        Ok(out) => LlAttempt {
            result: Ok(()),
            gave_up: Vec::new(),
            out,
        },
        Err(e) => LlAttempt {
            result: Err(e),
            gave_up: Vec::new(),
            out: Vec::new(),
        },
    }
}

fn no_group() -> ep_core::Error {
    refused(Error::Unsupported(
        "a low-latency combine before any low-latency dispatch on this Buffer".into(),
    ))
}

impl LlExec {
    pub(crate) fn new(
        dev: Arc<Device>,
        num_ranks: usize,
        num_sms: usize,
        local: Vec<usize>,
        peers: LlPeers,
        timeout: Option<Duration>,
    ) -> Self {
        Self {
            dev,
            num_ranks,
            num_sms,
            local,
            peers,
            timeout,
            group: None,
            sent: None,
            combined: None,
            lost: Vec::new(),
        }
    }

    /// The group (after the first dispatch).
    pub(crate) fn group(&self) -> Option<&LlGroup> {
        self.group.as_ref()
    }

    /// The group, mutably.
    pub(crate) fn group_mut(&mut self) -> Option<&mut LlGroup> {
        self.group.as_mut()
    }

    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
        if let Some(g) = &mut self.group {
            g.set_timeout(timeout);
        }
    }

    fn config_of(&self, op: &LlOpView<'_>) -> LlConfig {
        let lay = op.layout();
        LlConfig {
            num_ranks: self.num_ranks,
            num_max_dispatch_tokens_per_rank: lay.num_max_tokens,
            hidden: lay.hidden,
            num_experts: op.num_experts(),
            num_sms: self.num_sms,
        }
    }

    /// `Err` unless the group (if made) runs `cfg`.
    fn check_config(&self, cfg: &LlConfig) -> ep_core::Result<()> {
        match &self.group {
            Some(g) if g.config() != cfg => Err(refused(Error::Unsupported(format!(
                "a low-latency call of N = {}, H = {}, E = {} on a Buffer<Gpu> whose kernels run \
                 N = {}, H = {}, E = {} (set at its first dispatch): one Buffer per shape",
                cfg.num_max_dispatch_tokens_per_rank,
                cfg.hidden,
                cfg.num_experts,
                g.config().num_max_dispatch_tokens_per_rank,
                g.config().hidden,
                g.config().num_experts
            )))),
            _ => Ok(()),
        }
    }

    /// The per-call check of a dispatch of `N`, `H`, `E` against the group's shape.
    pub(crate) fn check_dispatch(
        &self,
        inputs: &[GpuInputs],
        num_max_tokens: usize,
        num_experts: usize,
    ) -> ep_core::Result<()> {
        let Some(g) = &self.group else {
            return Ok(());
        };
        let cfg = LlConfig {
            num_max_dispatch_tokens_per_rank: num_max_tokens,
            hidden: inputs.first().map_or(g.config().hidden, |i| i.x.cols()),
            num_experts,
            ..*g.config()
        };
        self.check_config(&cfg)
    }

    /// The group for `op`, made at the first dispatch; its mask, shrink mode and operation
    /// index set from the `Buffer`'s operation.
    fn group_for(&mut self, op: &LlOpView<'_>, make: bool) -> ep_core::Result<&mut LlGroup> {
        let cfg = self.config_of(op);
        if self.group.is_none() {
            if !make {
                return Err(no_group());
            }
            let mut g = match &self.peers {
                LlPeers::Pointers => LlGroup::new(self.dev.clone(), cfg),
                LlPeers::Nvshmem(s, LlVariant::Nvshmem) => {
                    LlGroup::with_nvshmem(self.dev.clone(), cfg, s.clone())
                }
                LlPeers::Nvshmem(s, LlVariant::Pointers) => {
                    LlGroup::with_nvshmem_pointers(self.dev.clone(), cfg, s.clone())
                }
            }
            .map_err(refused)?;
            if g.local_ranks() != self.local {
                return Err(refused(Error::Unsupported(format!(
                    "the low-latency group drives ranks {:?}, this executor's are {:?}",
                    g.local_ranks(),
                    self.local
                ))));
            }
            if let Some(t) = self.timeout {
                g.set_timeout(t);
            }
            self.group = Some(g);
        }
        self.check_config(&cfg)?;
        let g = self.group.as_mut().ok_or_else(no_group)?;
        g.set_shrink(op.shrink());
        g.set_mask(op.masked()).map_err(core)?;
        g.set_next_op(op.index());
        Ok(g)
    }

    /// A receive half: launches the pending receive kernels (a hook; a call without hook
    /// launched both halves at once).
    fn launch_pending_recv(&mut self) -> ep_core::Result<()> {
        let g = self.group.as_mut().ok_or_else(no_group)?;
        if g.hook_pending() {
            g.recv_hook().map_err(core)?;
        }
        Ok(())
    }

    /// Per local rank, `Some` unless masked in `op`.
    fn unmasked<X>(&self, op: &LlOpView<'_>, out: Vec<X>) -> Vec<Option<ep_core::Result<X>>> {
        out.into_iter()
            .zip(&self.local)
            .map(|(x, &s)| (!op.masked()[s]).then_some(Ok(x)))
            .collect()
    }

    pub(crate) fn dispatch_send(
        &mut self,
        job: &LlDispatchSendJob<'_, DevTensors>,
    ) -> LlAttempt<()> {
        let mut run = || -> ep_core::Result<Vec<Option<ep_core::Result<()>>>> {
            let op = job.op();
            let inputs = job
                .inputs()
                .iter()
                .zip(&self.local)
                .map(|(i, &s)| {
                    let missing = |what: &str| {
                        refused(Error::Unsupported(format!(
                            "{what} of rank {s}: a low-latency dispatch needs it"
                        )))
                    };
                    Ok(LlRankInputs {
                        x: &i.x,
                        topk_idx: i.topk_idx.as_ref().ok_or_else(|| missing("topk_idx"))?,
                        topk_weights: i
                            .topk_weights
                            .as_ref()
                            .ok_or_else(|| missing("topk_weights"))?,
                    })
                })
                .collect::<ep_core::Result<Vec<_>>>()?;
            let rows = job.rows();
            let args = LlDispatchArgs {
                use_fp8: rows.use_fp8,
                round_scale: rows.round_scale,
                use_ue8m0: rows.use_ue8m0,
                return_recv_hook: !job.recv_follows(),
            };
            self.sent = None;
            let g = self.group_for(&op, true)?;
            let out = g.dispatch(&inputs, &args).map_err(core)?;
            self.sent = Some(out);
            Ok(Vec::new())
        };
        let res = run();
        attempt(res)
    }

    pub(crate) fn dispatch_recv(
        &mut self,
        job: &LlDispatchRecvJob<'_, DevTensors>,
    ) -> LlAttempt<LlGpuDispatch> {
        let op = job.op();
        let res = (|| {
            self.launch_pending_recv()?;
            let sent = self.sent.take().ok_or_else(|| {
                core(Error::Unsupported(
                    "a low-latency dispatch receive half without its send half".into(),
                ))
            })?;
            Ok(self.unmasked(&op, sent))
        })();
        attempt(res)
    }

    /// Zero-copy combine inputs: each local rank's expert outputs copied into the operation's
    /// region, unless they are that region.
    pub(crate) fn expert_output(
        &mut self,
        job: &LlExpertOutputJob<'_, DevTensors>,
    ) -> LlAttempt<()> {
        let op = job.op();
        let res = (|| {
            let g = self.group_for(&op, false)?;
            for (i, y) in job.expert_out().iter().enumerate() {
                let Some(y) = y else { continue };
                let region = g.next_combine_buffer(i).map_err(core)?;
                if y.y.ptr() == region.ptr() && y.y.shape() == region.shape() {
                    continue;
                }
                if y.y.device() != region.device() {
                    return Err(refused(Error::WrongDevice {
                        rank: g.local_ranks()[i],
                        expected: region.device(),
                        found: y.y.device(),
                    }));
                }
                copy_2d(g.stream(i), &y.y, &region).map_err(refused)?;
            }
            Ok(Vec::new())
        })();
        attempt(res)
    }

    pub(crate) fn combine_send(&mut self, job: &LlCombineSendJob<'_, DevTensors>) -> LlAttempt<()> {
        let op = job.op();
        let res = (|| {
            self.combined = None;
            let handles: Vec<_> = job.handles().iter().map(Option::as_ref).collect();
            let inputs: Vec<LlCombineInput<'_>> = (0..handles.len())
                .map(|i| match job.expert_out().and_then(|ys| ys[i].as_ref()) {
                    Some(y) => LlCombineInput::Tensor(&y.y),
                    None => LlCombineInput::ZeroCopy,
                })
                .collect();
            let args = LlCombineArgs {
                return_recv_hook: !job.recv_follows(),
                use_logfmt: job.use_logfmt(),
            };
            let g = self.group_for(&op, false)?;
            let out = g.combine_ranks(&handles, &inputs, &args).map_err(core)?;
            self.combined = Some(out);
            Ok(Vec::new())
        })();
        attempt(res)
    }

    pub(crate) fn combine_recv(
        &mut self,
        job: &LlCombineRecvJob<'_, DevTensors>,
    ) -> LlAttempt<DevTensor> {
        let op = job.op();
        let res = (|| {
            self.launch_pending_recv()?;
            let out = self.combined.take().ok_or_else(|| {
                core(Error::Unsupported(
                    "a low-latency combine receive half without its send half".into(),
                ))
            })?;
            Ok(out
                .into_iter()
                .zip(&self.local)
                .map(|(t, &s)| t.filter(|_| !op.masked()[s]).map(Ok))
                .collect())
        })();
        attempt(res)
    }

    /// `clean_low_latency_buffer` (nothing to zero before the group exists).
    pub(crate) fn clean(&mut self) -> ep_core::Result<()> {
        match &mut self.group {
            Some(g) => g.clean().map_err(core),
            None => Ok(()),
        }
    }

    pub(crate) fn reset(&mut self) -> ep_core::Result<()> {
        self.sent = None;
        self.combined = None;
        match &mut self.group {
            Some(g) => g.reset().map_err(core),
            None => Ok(()),
        }
    }

    pub(crate) fn poll(&mut self) -> ep_core::Result<()> {
        match &mut self.group {
            Some(g) => g.check_ready().map_err(core),
            None => Ok(()),
        }
    }

    /// Waits for the kernels; in shrink mode records the ranks they masked.
    pub(crate) fn sync(&mut self) -> ep_core::Result<()> {
        let Some(g) = &mut self.group else {
            return Ok(());
        };
        let before = g.query_mask();
        g.sync().map_err(core)?;
        for (r, (was, now)) in before.iter().zip(g.query_mask()).enumerate() {
            if now && !was {
                self.lost.push(r);
            }
        }
        Ok(())
    }

    pub(crate) fn take_lost(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.lost)
    }
}
