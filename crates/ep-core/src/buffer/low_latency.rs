//! Low-latency calls of [`Buffer`] (docs/protocol.md §3): the send and receive halves of
//! dispatch and combine, the hooks, and the clean. Every attempt of the executor's phases goes
//! through [`Buffer::ll_settle`] (`mask`), which masks failed peers in shrink mode and poisons
//! otherwise.

use half::bf16;

use super::{Buffer, LlMem};
use crate::error::{Error, Result};
use crate::executor::{
    Executor, LlAttempt, LlCleanJob, LlCombineCheck, LlCombineRecvJob, LlCombineSendJob,
    LlDispatchRecvJob, LlDispatchSendJob, LlExpertOutputJob,
};
use crate::plan::low_latency::{LlDispatchOutput, LlParams, validate_dispatch_shapes};
use crate::protocol::LlRoutes;
use crate::protocol::ProtocolMutation;
use crate::protocol::layout::{LlLayout, ll_half};
use crate::protocol::low_latency::{ExpertOut, LlArena, LlOp, LlRows};
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::{Tensor2, Tensor3};
use crate::transport::Team;

/// What a low-latency dispatch returns: the plan's per-rank outputs (`None` for masked ranks)
/// and the routes its combine needs.
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatched {
    /// `outputs[d]`: receiver `d`'s outputs (spec §2.4), `None` if masked.
    pub outputs: Vec<Option<LlDispatchOutput>>,
    /// `routes[d]`: what combine needs on `d`, `None` if masked.
    pub routes: Vec<Option<LlRoutes>>,
}

/// A pending low-latency dispatch receive half (the hook). Run it with
/// [`Buffer::low_latency_dispatch_recv`] before the next low-latency operation.
#[must_use = "a pending hook must be run before the next low-latency operation"]
#[derive(Debug)]
pub struct LlDispatchHook {
    op: LlOp,
    rows: LlRows,
    topk: Vec<(Tensor2<ExpertIdx>, Tensor2<f32>)>,
}

impl LlDispatchHook {
    /// The call this hook belongs to.
    #[must_use]
    pub fn call(&self) -> u64 {
        self.op.call
    }
}

/// A pending low-latency combine receive half (the hook).
#[must_use = "a pending hook must be run before the next low-latency operation"]
#[derive(Debug)]
pub struct LlCombineHook {
    op: LlOp,
    topk: Vec<Tensor2<ExpertIdx>>,
}

impl LlCombineHook {
    /// The call this hook belongs to.
    #[must_use]
    pub fn call(&self) -> u64 {
        self.op.call
    }
}

impl<E: Executor> Buffer<E> {
    fn ll_arena(&self) -> Result<LlArena> {
        if !self.config.low_latency_mode {
            return Err(Error::NotLowLatencyMode);
        }
        self.ll.clone().ok_or(Error::ArenaMissing {
            what: "low-latency buffer",
            fix: "set num_rdma_bytes (Buffer::low_latency_size_hint)",
        })
    }

    /// Checks the hook contract and the clean state before a low-latency send.
    fn ll_precheck(&self) -> Result<()> {
        if let Some(&p) = self.pending_hooks.first()
            && self.mutation != ProtocolMutation::SkipHookCheck
        {
            return Err(Error::LowLatencyHookPending { pending_call: p });
        }
        let live = |d: &usize| !self.mask[*d];
        if (0..self.num_ranks())
            .filter(live)
            .any(|d| self.ll_mem[d] == LlMem::Dirty)
            && self.mutation != ProtocolMutation::SkipCleanCheck
        {
            return Err(Error::LowLatencyNeedsClean);
        }
        Ok(())
    }

    /// Marks the unmasked ranks' signal words as written by low-latency operations.
    fn ll_used(&mut self) {
        for d in 0..self.num_ranks() {
            if !self.mask[d] {
                self.ll_mem[d] = LlMem::Used;
            }
        }
    }

    fn ll_op(&mut self, layout: LlLayout, num_experts: usize) -> Result<LlOp> {
        let arena = self.ll_arena()?;
        let need = layout.total_bytes();
        if need > self.config.num_rdma_bytes {
            return Err(Error::ArenaTooSmall {
                what: format!(
                    "low-latency buffer for N={}, H={}, R={}, L={}",
                    layout.num_max_tokens,
                    layout.hidden,
                    layout.num_ranks,
                    layout.num_local_experts
                ),
                needed: need,
                available: self.config.num_rdma_bytes,
                fix: "use Buffer::low_latency_size_hint".into(),
            });
        }
        let _ = arena;
        let num_qps = self
            .config
            .num_qps_per_rank
            .min(u32::from(self.transport.fabric().rc_per_pe))
            .max(1) as u16;
        let call = self.next_call();
        let half = ll_half(self.ll_ops);
        self.ll_ops += 1;
        Ok(LlOp {
            call,
            half,
            layout,
            masked: self.mask.clone(),
            num_qps,
            num_experts,
            shrink: self.config.enable_shrink,
        })
    }

    /// Unmasked ranks whose signal words no low-latency operation touched since construction or
    /// the last clean or reset: zero, which the first attempt of the next operation declares
    /// (docs/protocol.md §1.1). Masked ranks run no agents and are not checked.
    fn fresh_ranks(&self) -> Vec<bool> {
        (0..self.num_ranks())
            .map(|d| !self.mask[d] && self.ll_mem[d] != LlMem::Used)
            .collect()
    }

    /// Settles one attempt ([`Buffer::ll_settle`]): `Some(outputs)` when it is final, `None`
    /// when the phase runs again under `op`'s grown mask.
    fn ll_settled<X>(
        &mut self,
        op: &mut LlOp,
        att: LlAttempt<X>,
    ) -> Result<Option<Vec<Option<Result<X>>>>> {
        let again = self.ll_settle(op, att.result, att.gave_up)?;
        Ok((!again).then_some(att.out))
    }

    /// Low-latency dispatch send half (docs/protocol.md §3.3). `inputs[s].topk_weights` travel
    /// with the rows. Returns the hook; run [`Buffer::low_latency_dispatch_recv`] before the next
    /// low-latency operation.
    pub fn low_latency_dispatch_send(
        &mut self,
        inputs: &[RankInputs],
        params: &LlParams,
    ) -> Result<LlDispatchHook> {
        self.check_poison()?;
        let params = params.clone().with_masked_ranks(self.mask.clone());
        // `params` carry one mask entry per rank: the inputs' count is checked against it.
        let shapes: Vec<_> = inputs.iter().map(RankInputs::shapes).collect();
        let shape = validate_dispatch_shapes(&shapes, &params)?;
        self.transport.check_ll_dispatch(inputs, &params)?;
        self.ll_precheck()?;
        let arena = self.ll_arena()?;
        let layout = LlLayout {
            num_ranks: shape.num_ranks,
            num_local_experts: shape.num_local_experts,
            hidden: shape.hidden,
            num_max_tokens: shape.num_max_dispatch_tokens_per_rank,
        };
        let rows = LlRows {
            use_fp8: params.use_fp8,
            round_scale: params.round_scale,
            use_ue8m0: params.use_ue8m0,
        };
        let xs: Vec<&Tensor2<bf16>> = inputs
            .iter()
            .enumerate()
            .map(|(s, i)| match &i.x {
                Activations::Bf16(x) => Ok(x),
                Activations::Fp8 { .. } => Err(Error::LlExpectsBf16 { rank: s }),
            })
            .collect::<Result<_>>()?;
        let topk: Vec<(&Tensor2<ExpertIdx>, &Tensor2<f32>)> = inputs
            .iter()
            .map(|i| (&i.topk_idx, &i.topk_weights))
            .collect();
        let mut op = self.ll_op(layout, params.num_experts)?;
        let mut fresh = self.fresh_ranks();
        self.ll_used();
        loop {
            let job = LlDispatchSendJob {
                arena: &arena,
                op: &op,
                xs: &xs,
                topk: &topk,
                rows,
                mutation: self.mutation,
                fresh: &fresh,
            };
            let att = self.transport.run_ll_dispatch_send(&job);
            // Zero only at the first attempt: a re-run sees this call's own signals.
            fresh.fill(false);
            if self.ll_settled(&mut op, att)?.is_some() {
                break;
            }
        }
        self.pending_hooks.push(op.call);
        Ok(LlDispatchHook {
            topk: inputs
                .iter()
                .map(|i| (i.topk_idx.clone(), i.topk_weights.clone()))
                .collect(),
            op,
            rows,
        })
    }

    fn take_hook(&mut self, call: u64) -> Result<()> {
        let i = self
            .pending_hooks
            .iter()
            .position(|&c| c == call)
            .ok_or(Error::LowLatencyHookNotPending { call })?;
        self.pending_hooks.remove(i);
        Ok(())
    }

    /// Low-latency dispatch receive half, the hook (docs/protocol.md §3.4).
    pub fn low_latency_dispatch_recv(&mut self, hook: LlDispatchHook) -> Result<LlDispatched> {
        self.low_latency_dispatch_recv_reusing(hook, None)
    }

    /// [`Buffer::low_latency_dispatch_recv`] that may reuse the packed arrays of earlier outputs
    /// `reuse` (of this or another low-latency dispatch) instead of allocating new ones: the
    /// rows they counted as valid are zeroed and the new rows written, so the results are the
    /// same as without `reuse`, provided its arrays hold zeros past each expert's count, as
    /// dispatch returned them (read them freely; write only rows below the counts). Outputs of
    /// another format or shape are dropped.
    pub fn low_latency_dispatch_recv_reusing(
        &mut self,
        hook: LlDispatchHook,
        reuse: Option<LlDispatched>,
    ) -> Result<LlDispatched> {
        self.check_poison()?;
        self.take_hook(hook.op.call)?;
        let arena = self.ll_arena()?;
        let r = self.num_ranks();
        let LlDispatchHook { mut op, rows, topk } = hook;
        self.apply_mask(&mut op);
        let mut spare: Vec<Option<LlDispatchOutput>> = vec![None; r];
        if let Some(old) = reuse {
            for (m, o) in spare.iter_mut().zip(old.outputs) {
                *m = o;
            }
        }
        let out = loop {
            let job = LlDispatchRecvJob {
                arena: &arena,
                op: &op,
                rows,
                topk: &topk,
                mutation: self.mutation,
            };
            let att = self.transport.run_ll_dispatch_recv(&job, &mut spare);
            if let Some(out) = self.ll_settled(&mut op, att)? {
                break out;
            }
        };
        let mut outputs = Vec::with_capacity(r);
        let mut routes = Vec::with_capacity(r);
        for o in out {
            match o {
                None => {
                    outputs.push(None);
                    routes.push(None);
                }
                Some(res) => {
                    let (a, b) = res?;
                    outputs.push(Some(a));
                    routes.push(Some(b));
                }
            }
        }
        Ok(LlDispatched { outputs, routes })
    }

    /// Low-latency dispatch without hook: send then receive.
    pub fn low_latency_dispatch(
        &mut self,
        inputs: &[RankInputs],
        params: &LlParams,
    ) -> Result<LlDispatched> {
        self.low_latency_dispatch_reusing(inputs, params, None)
    }

    /// [`Buffer::low_latency_dispatch`] reusing the packed arrays of earlier outputs, as
    /// [`Buffer::low_latency_dispatch_recv_reusing`].
    pub fn low_latency_dispatch_reusing(
        &mut self,
        inputs: &[RankInputs],
        params: &LlParams,
        reuse: Option<LlDispatched>,
    ) -> Result<LlDispatched> {
        let hook = self.low_latency_dispatch_send(inputs, params)?;
        self.low_latency_dispatch_recv_reusing(hook, reuse)
    }

    /// Low-latency combine send half (docs/protocol.md §3.5): each expert rank reduces a token's
    /// local experts and sends one partial per (token, expert rank). `expert_out[d]` is `d`'s
    /// `[L, R·N, H]` outputs in its packed layout; with `zero_copy` they are first written into
    /// the operation's registered region (what the caller's GEMM does on the GPU) and read from
    /// there. `inputs` give each rank's `topk_idx`/`topk_weights`, which must equal its
    /// dispatch's (`x` is not read).
    pub fn low_latency_combine_send(
        &mut self,
        routes: &[Option<LlRoutes>],
        expert_out: &[Option<Tensor3<bf16>>],
        inputs: &[RankInputs],
        zero_copy: bool,
    ) -> Result<LlCombineHook> {
        self.check_poison()?;
        let r = self.num_ranks();
        self.check_local(&[routes.len(), expert_out.len(), inputs.len()])?;
        let mut layout = None;
        for s in (0..r).filter(|&s| !self.mask[s]) {
            if routes[s].is_none() {
                return Err(Error::ShapeMismatch {
                    what: "low-latency combine routes",
                    expected: format!("routes for unmasked rank {s}"),
                    found: "None".into(),
                });
            }
            let y = expert_out[s].as_ref().ok_or(Error::ShapeMismatch {
                what: "low-latency combine expert outputs",
                expected: format!("outputs for unmasked rank {s}"),
                found: "None".into(),
            })?;
            let (l_count, rows, h) = y.shape();
            if l_count == 0 || rows % r != 0 {
                return Err(Error::ShapeMismatch {
                    what: "low-latency combine expert outputs",
                    expected: "[L, R*N, H] on every rank".into(),
                    found: format!("{:?} on rank {s}", y.shape()),
                });
            }
            let lay = LlLayout {
                num_ranks: r,
                num_local_experts: l_count,
                hidden: h,
                num_max_tokens: rows / r,
            };
            if layout.is_some_and(|l| l != lay) {
                return Err(Error::ShapeMismatch {
                    what: "low-latency combine expert outputs (must agree across ranks)",
                    expected: format!("{layout:?}"),
                    found: format!("{lay:?} on rank {s}"),
                });
            }
            layout = Some(lay);
        }
        self.transport.check_ll_combine(&LlCombineCheck {
            routes,
            inputs,
            masked: &self.mask,
        })?;
        self.ll_precheck()?;
        let arena = self.ll_arena()?;
        let layout = layout.unwrap_or(LlLayout {
            num_ranks: r,
            num_local_experts: 1,
            hidden: 128,
            num_max_tokens: 1,
        });
        let mut op = self.ll_op(layout, layout.num_local_experts * r)?;
        let mut fresh = self.fresh_ranks();
        self.ll_used();
        let y = if zero_copy {
            loop {
                let job = LlExpertOutputJob {
                    arena: &arena,
                    op: &op,
                    expert_out,
                };
                let att = self.transport.run_ll_expert_output(&job);
                if self.ll_settled(&mut op, att)?.is_some() {
                    break;
                }
            }
            ExpertOut::ZeroCopy
        } else {
            ExpertOut::Host(expert_out)
        };
        loop {
            let job = LlCombineSendJob {
                arena: &arena,
                op: &op,
                routes,
                expert_out: y,
                fresh: &fresh,
            };
            let att = self.transport.run_ll_combine_send(&job);
            fresh.fill(false);
            if self.ll_settled(&mut op, att)?.is_some() {
                break;
            }
        }
        self.pending_hooks.push(op.call);
        Ok(LlCombineHook {
            topk: inputs.iter().map(|i| i.topk_idx.clone()).collect(),
            op,
        })
    }

    /// Low-latency combine receive half, the hook (docs/protocol.md §3.6): `out[s]` is `[T_s, H]`
    /// BF16, `None` for masked ranks.
    pub fn low_latency_combine_recv(
        &mut self,
        hook: LlCombineHook,
    ) -> Result<Vec<Option<Tensor2<bf16>>>> {
        self.check_poison()?;
        self.take_hook(hook.op.call)?;
        let arena = self.ll_arena()?;
        let LlCombineHook { mut op, topk } = hook;
        self.apply_mask(&mut op);
        let out = loop {
            let job = LlCombineRecvJob {
                arena: &arena,
                op: &op,
                topk: &topk,
            };
            let att = self.transport.run_ll_combine_recv(&job);
            if let Some(out) = self.ll_settled(&mut op, att)? {
                break out;
            }
        };
        out.into_iter().map(Option::transpose).collect()
    }

    /// Low-latency combine without hook: send then receive.
    pub fn low_latency_combine(
        &mut self,
        routes: &[Option<LlRoutes>],
        expert_out: &[Option<Tensor3<bf16>>],
        inputs: &[RankInputs],
        zero_copy: bool,
    ) -> Result<Vec<Option<Tensor2<bf16>>>> {
        let hook = self.low_latency_combine_send(routes, expert_out, inputs, zero_copy)?;
        self.low_latency_combine_recv(hook)
    }

    /// `clean_low_latency_buffer` (docs/protocol.md §3.7): zeroes every low-latency signal word
    /// of both halves on every unmasked rank, then a barrier. Refused while a hook is pending.
    pub fn clean_low_latency_buffer(&mut self) -> Result<()> {
        self.check_poison()?;
        if let Some(&p) = self.pending_hooks.first() {
            return Err(Error::LowLatencyHookPending { pending_call: p });
        }
        let arena = self.ll_arena()?;
        let call = self.next_call();
        let mask = self.mask.clone();
        let res = self.transport.run_ll_clean(&LlCleanJob {
            arena: &arena,
            call,
            masked: &mask,
        });
        self.ran(call, res)?;
        let team = Team {
            ranks: (0..self.num_ranks()).filter(|&d| !mask[d]).collect(),
        };
        self.barrier(call, &team)?;
        for d in team.ranks {
            self.ll_mem[d] = LlMem::Fresh;
        }
        Ok(())
    }

    /// Models another kernel using the low-latency memory (DeepEP: normal internode kernels on
    /// the RDMA buffer, spec case 20): garbage in every signal word. With the `test-support`
    /// feature.
    #[cfg(feature = "test-support")]
    pub fn debug_foreign_use_of_low_latency_memory(&mut self) -> Result<()> {
        self.check_poison()?;
        let arena = self.ll_arena()?;
        let call = self.next_call();
        let value = crate::protocol::signal::ll_encode(call + 1_000, 7);
        let res = self.transport.run_foreign_use_of_low_latency(
            &crate::executor::jobs::LlForeignUseJob {
                arena: &arena,
                call,
                value,
            },
        );
        self.ran(call, res)?;
        self.ll_mem.iter_mut().for_each(|m| *m = LlMem::Dirty);
        Ok(())
    }
}
