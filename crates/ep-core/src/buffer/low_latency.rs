//! Low-latency calls of [`Buffer`] (docs/protocol.md §3): the send and receive halves of
//! dispatch and combine, the hooks, and the clean, over the local ranks' tensors of any
//! executor ([`Tensors`]: host tensors on the simulator, device views on the GPU). Every
//! attempt of the executor's phases goes through [`Buffer::ll_settle`] (`mask`), which masks
//! failed peers in shrink mode and poisons otherwise.

use super::{Buffer, LlMem};
use crate::error::{Error, Result};
use crate::executor::{
    Executor, Host, LlAttempt, LlCleanJob, LlCombineCheck, LlCombineRecvJob, LlCombineSendJob,
    LlDispatchRecvJob, LlDispatchSendJob, LlExpertOutputJob, Tensors,
};
use crate::plan::low_latency::{LlDispatchOutput, LlParams, validate_local_dispatch_shapes};
use crate::protocol::LlRoutes;
use crate::protocol::ProtocolMutation;
use crate::protocol::layout::{LlLayout, ll_half};
use crate::protocol::low_latency::{LlArena, LlOp, LlRows, partial_codec};
use crate::transport::Team;

type T<E> = <E as Executor>::T;

/// What a low-latency dispatch returns on the simulator ([`Host`]): the plan's per-rank
/// outputs (`None` for masked ranks) and the routes its combine needs.
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
pub struct LlDispatchHook<X: Tensors = Host> {
    op: LlOp,
    rows: LlRows,
    keep: Vec<X::LlKeep>,
}

impl<X: Tensors> std::fmt::Debug for LlDispatchHook<X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlDispatchHook")
            .field("call", &self.op.call)
            .field("half", &self.op.half)
            .finish_non_exhaustive()
    }
}

impl<X: Tensors> LlDispatchHook<X> {
    /// The call this hook belongs to.
    #[must_use]
    pub fn call(&self) -> u64 {
        self.op.call
    }
}

/// Options of a low-latency combine (DeepEP's `low_latency_combine(..., use_logfmt, zero_copy)`;
/// its `return_recv_hook` is [`Buffer::low_latency_combine_send`] + [`Buffer::low_latency_combine_recv`]).
/// The default is DeepEP's: BF16 partials from the caller's tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlCombineOptions {
    /// The expert outputs are first written into the operation's registered region (what the
    /// caller's GEMM does on the GPU: `get_next_low_latency_combine_buffer`; a GPU tensor that
    /// is the region itself is not copied) and combine reads them from there.
    pub zero_copy: bool,
    /// The partials travel LogFMT-10 encoded (spec §2.6, docs/protocol.md §3.12): lossy, fewer
    /// bytes when chunks are cast. The result is
    /// `plan::low_latency::combine_reduced_on_expert_rank` with `PartialPrecision::LogFmt10`,
    /// bit for bit, on every backend; `H` must be a multiple of 128. Unlike DeepEP it combines
    /// with `zero_copy` too (the encoded partials do not overwrite the zero-copy region).
    pub use_logfmt: bool,
}

impl LlCombineOptions {
    /// These options with `zero_copy` set to `on`.
    #[must_use]
    pub const fn with_zero_copy(self, on: bool) -> Self {
        Self {
            zero_copy: on,
            ..self
        }
    }

    /// These options with `use_logfmt` set to `on`.
    #[must_use]
    pub const fn with_logfmt(self, on: bool) -> Self {
        Self {
            use_logfmt: on,
            ..self
        }
    }
}

/// A pending low-latency combine receive half (the hook).
#[must_use = "a pending hook must be run before the next low-latency operation"]
pub struct LlCombineHook<X: Tensors = Host> {
    op: LlOp,
    keep: Vec<X::LlKeep>,
    use_logfmt: bool,
}

impl<X: Tensors> std::fmt::Debug for LlCombineHook<X> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlCombineHook")
            .field("call", &self.op.call)
            .field("half", &self.op.half)
            .field("use_logfmt", &self.use_logfmt)
            .finish_non_exhaustive()
    }
}

impl<X: Tensors> LlCombineHook<X> {
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
        let index = self.ll_ops;
        let half = ll_half(index);
        self.ll_ops += 1;
        Ok(LlOp {
            call,
            index,
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

    /// Low-latency dispatch send half (docs/protocol.md §3.3) of the local ranks
    /// (`inputs[i]`: local rank `i`'s, BF16 `x` with its top-k ids and weights, which travel
    /// with the rows). Returns the hook; run [`Buffer::low_latency_dispatch_recv`] before the
    /// next low-latency operation.
    pub fn low_latency_dispatch_send(
        &mut self,
        inputs: &[<T<E> as Tensors>::Inputs],
        params: &LlParams,
    ) -> Result<LlDispatchHook<T<E>>> {
        self.ll_dispatch_send(inputs, params, false)
    }

    fn ll_dispatch_send(
        &mut self,
        inputs: &[<T<E> as Tensors>::Inputs],
        params: &LlParams,
        recv_follows: bool,
    ) -> Result<LlDispatchHook<T<E>>> {
        self.ready()?;
        let params = params.clone().with_masked_ranks(self.mask.clone());
        self.check_local(&[inputs.len()])?;
        let ranks = self.transport.local_ranks();
        // `params` carry one mask entry per rank: the rank count is checked against it.
        let shapes = inputs
            .iter()
            .zip(&ranks)
            .map(|(x, &s)| T::<E>::input_shapes(x, s, true))
            .collect::<Result<Vec<_>>>()?;
        let shape = validate_local_dispatch_shapes(self.num_ranks(), &ranks, &shapes, &params)?;
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
        let mut op = self.ll_op(layout, params.num_experts)?;
        let mut fresh = self.fresh_ranks();
        self.ll_used();
        loop {
            let job = LlDispatchSendJob {
                arena: &arena,
                op: &op,
                inputs,
                rows,
                mutation: self.mutation,
                fresh: &fresh,
                recv_follows,
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
            keep: inputs.iter().map(T::<E>::ll_keep).collect(),
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
    pub fn low_latency_dispatch_recv(
        &mut self,
        hook: LlDispatchHook<T<E>>,
    ) -> Result<<T<E> as Tensors>::LlDispatched> {
        self.low_latency_dispatch_recv_reusing(hook, None)
    }

    /// [`Buffer::low_latency_dispatch_recv`] that may reuse the packed arrays of earlier outputs
    /// `reuse` (of this or another low-latency dispatch) instead of allocating new ones: the
    /// rows they counted as valid are zeroed and the new rows written, so the results are the
    /// same as without `reuse`, provided its arrays hold zeros past each expert's count, as
    /// dispatch returned them (read them freely; write only rows below the counts). Outputs of
    /// another format or shape are dropped. (On the GPU the outputs are views of the buffer's
    /// half and `reuse` is not needed.)
    pub fn low_latency_dispatch_recv_reusing(
        &mut self,
        hook: LlDispatchHook<T<E>>,
        reuse: Option<<T<E> as Tensors>::LlDispatched>,
    ) -> Result<<T<E> as Tensors>::LlDispatched> {
        self.check_poison()?;
        self.take_hook(hook.op.call)?;
        let arena = self.ll_arena()?;
        let n = self.transport.local_ranks().len();
        let LlDispatchHook { mut op, rows, keep } = hook;
        self.apply_mask(&mut op);
        let mut spare: Vec<Option<<T<E> as Tensors>::LlSpare>> =
            reuse.map(T::<E>::ll_spares).unwrap_or_default();
        spare.resize_with(n, || None);
        let out = loop {
            let job = LlDispatchRecvJob {
                arena: &arena,
                op: &op,
                rows,
                keep: &keep,
                mutation: self.mutation,
            };
            let att = self.transport.run_ll_dispatch_recv(&job, &mut spare);
            if let Some(out) = self.ll_settled(&mut op, att)? {
                break out;
            }
        };
        let out = out
            .into_iter()
            .map(Option::transpose)
            .collect::<Result<Vec<_>>>()?;
        Ok(T::<E>::ll_collect(out))
    }

    /// Low-latency dispatch without hook: send then receive.
    pub fn low_latency_dispatch(
        &mut self,
        inputs: &[<T<E> as Tensors>::Inputs],
        params: &LlParams,
    ) -> Result<<T<E> as Tensors>::LlDispatched> {
        self.low_latency_dispatch_reusing(inputs, params, None)
    }

    /// [`Buffer::low_latency_dispatch`] reusing the packed arrays of earlier outputs, as
    /// [`Buffer::low_latency_dispatch_recv_reusing`].
    pub fn low_latency_dispatch_reusing(
        &mut self,
        inputs: &[<T<E> as Tensors>::Inputs],
        params: &LlParams,
        reuse: Option<<T<E> as Tensors>::LlDispatched>,
    ) -> Result<<T<E> as Tensors>::LlDispatched> {
        let hook = self.ll_dispatch_send(inputs, params, true)?;
        self.low_latency_dispatch_recv_reusing(hook, reuse)
    }

    /// Low-latency combine send half (docs/protocol.md §3.5): each expert rank reduces a token's
    /// local experts and sends one partial per (token, expert rank). Per local rank `i`:
    /// `handles[i]` from its dispatch (`routes` on the simulator), `expert_out[i]` its
    /// `[L, R·N, H]` outputs in the packed layout; with `opts.zero_copy` they are first written
    /// into the operation's registered region and read from there; with `opts.use_logfmt` the
    /// partials travel LogFMT-10 encoded (docs/protocol.md §3.12; [`LlCombineOptions`]).
    /// `inputs` give each rank's `topk_idx`/`topk_weights`, which must equal its dispatch's
    /// (`x` is not read).
    pub fn low_latency_combine_send(
        &mut self,
        handles: &[Option<<T<E> as Tensors>::LlHandle>],
        expert_out: &[Option<<T<E> as Tensors>::LlExpertOut>],
        inputs: &[<T<E> as Tensors>::Inputs],
        opts: LlCombineOptions,
    ) -> Result<LlCombineHook<T<E>>> {
        self.ll_combine_send(handles, expert_out, inputs, opts, false)
    }

    fn ll_combine_send(
        &mut self,
        handles: &[Option<<T<E> as Tensors>::LlHandle>],
        expert_out: &[Option<<T<E> as Tensors>::LlExpertOut>],
        inputs: &[<T<E> as Tensors>::Inputs],
        opts: LlCombineOptions,
        recv_follows: bool,
    ) -> Result<LlCombineHook<T<E>>> {
        self.ready()?;
        let r = self.num_ranks();
        self.check_local(&[handles.len(), expert_out.len(), inputs.len()])?;
        let ranks = self.transport.local_ranks();
        let mut layout = None;
        for (i, &s) in ranks.iter().enumerate().filter(|&(_, &s)| !self.mask[s]) {
            if handles[i].is_none() {
                return Err(Error::ShapeMismatch {
                    what: "low-latency combine routes",
                    expected: format!("routes for unmasked rank {s}"),
                    found: "None".into(),
                });
            }
            let y = expert_out[i].as_ref().ok_or(Error::ShapeMismatch {
                what: "low-latency combine expert outputs",
                expected: format!("outputs for unmasked rank {s}"),
                found: "None".into(),
            })?;
            let (l_count, rows, h) = T::<E>::ll_expert_shape(y, s)?;
            if l_count == 0 || rows % r != 0 {
                return Err(Error::ShapeMismatch {
                    what: "low-latency combine expert outputs",
                    expected: "[L, R*N, H] on every rank".into(),
                    found: format!("{:?} on rank {s}", (l_count, rows, h)),
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
        if let Some(lay) = layout {
            // LogFMT keeps one meta word per 128 channels: refused before any phase.
            partial_codec(lay, opts.use_logfmt)?;
        }
        self.transport.check_ll_combine(&LlCombineCheck {
            handles,
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
        let y = if opts.zero_copy {
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
            None
        } else {
            Some(expert_out)
        };
        loop {
            let job = LlCombineSendJob {
                arena: &arena,
                op: &op,
                handles,
                expert_out: y,
                fresh: &fresh,
                recv_follows,
                use_logfmt: opts.use_logfmt,
            };
            let att = self.transport.run_ll_combine_send(&job);
            fresh.fill(false);
            if self.ll_settled(&mut op, att)?.is_some() {
                break;
            }
        }
        self.pending_hooks.push(op.call);
        Ok(LlCombineHook {
            keep: inputs.iter().map(T::<E>::ll_keep).collect(),
            op,
            use_logfmt: opts.use_logfmt,
        })
    }

    /// Low-latency combine receive half, the hook (docs/protocol.md §3.6): `out[i]` is local
    /// rank `i`'s `[T, H]` BF16, `None` for masked ranks.
    pub fn low_latency_combine_recv(
        &mut self,
        hook: LlCombineHook<T<E>>,
    ) -> Result<Vec<Option<<T<E> as Tensors>::LlCombined>>> {
        self.check_poison()?;
        self.take_hook(hook.op.call)?;
        let arena = self.ll_arena()?;
        let LlCombineHook {
            mut op,
            keep,
            use_logfmt,
        } = hook;
        self.apply_mask(&mut op);
        let out = loop {
            let job = LlCombineRecvJob {
                arena: &arena,
                op: &op,
                keep: &keep,
                use_logfmt,
            };
            let att = self.transport.run_ll_combine_recv(&job);
            if let Some(out) = self.ll_settled(&mut op, att)? {
                break out;
            }
        };
        out.into_iter().map(Option::transpose).collect()
    }

    /// Low-latency combine without hook: send then receive ([`LlCombineOptions`]).
    pub fn low_latency_combine(
        &mut self,
        handles: &[Option<<T<E> as Tensors>::LlHandle>],
        expert_out: &[Option<<T<E> as Tensors>::LlExpertOut>],
        inputs: &[<T<E> as Tensors>::Inputs],
        opts: LlCombineOptions,
    ) -> Result<Vec<Option<<T<E> as Tensors>::LlCombined>>> {
        let hook = self.ll_combine_send(handles, expert_out, inputs, opts, true)?;
        self.low_latency_combine_recv(hook)
    }

    /// The start of an operation that rewrites the low-latency memory outside the protocol's
    /// phases (clean, test poisoning): refused while a hook is pending (its receive half reads
    /// what the send half wrote); the arena, the call number it takes and the mask.
    fn ll_maintenance(&mut self) -> Result<(LlArena, u64, Vec<bool>)> {
        self.ready()?;
        if let Some(&p) = self.pending_hooks.first() {
            return Err(Error::LowLatencyHookPending { pending_call: p });
        }
        let arena = self.ll_arena()?;
        Ok((arena, self.next_call(), self.mask.clone()))
    }

    /// `clean_low_latency_buffer` (docs/protocol.md §3.7): zeroes every low-latency signal word
    /// of both halves on every unmasked rank, then a barrier. Refused while a hook is pending.
    pub fn clean_low_latency_buffer(&mut self) -> Result<()> {
        let (arena, call, mask) = self.ll_maintenance()?;
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

    /// The low-latency memory (`None` before it is allocated), to inspect what the phases left
    /// there (on the simulator: `Sim::host_read`). With the `test-support` feature.
    #[cfg(feature = "test-support")]
    pub fn debug_low_latency_arena(&self) -> Option<&LlArena> {
        self.ll.as_ref()
    }

    /// Fills every unmasked rank's low-latency data (both halves; the signal words untouched)
    /// with `byte`: a later low-latency phase that reads bytes its operation did not write then
    /// reads garbage, as the GPU tests' `poison_for_test` does. Refused while a hook is pending
    /// (its receive half reads what the send half wrote). With the `test-support` feature.
    #[cfg(feature = "test-support")]
    pub fn debug_poison_low_latency_data(&mut self, byte: u8) -> Result<()> {
        let (arena, call, masked) = self.ll_maintenance()?;
        let res =
            self.transport
                .run_poison_low_latency_data(&crate::executor::jobs::LlPoisonDataJob {
                    arena: &arena,
                    call,
                    byte,
                    masked: &masked,
                });
        self.ran(call, res)
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
