//! Normal-mode calls of [`Buffer`] (docs/protocol.md §2): layout, dispatch, cached dispatch,
//! combine. Each is one phase of the executor; a failed phase poisons the buffer (`fault`).

use super::in_place::InPlaceRows;
use super::{Buffer, NormalDispatchArgs};
use crate::error::{Error, Result};
use crate::executor::{
    CachedDispatchJob, Executor, NormalCombineCheck, NormalCombineJob, NormalDispatchCheck,
    NormalDispatchJob,
};
use crate::plan::combine::{CombineArgs, CombineOutput, check_combine_args};
use crate::plan::intranode::InPlaceDispatch;
use crate::plan::intranode::{
    DispatchOptions, IntranodeDispatch, IntranodeHandle, check_dispatch_shapes,
    check_same_activation_kind,
};
use crate::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use crate::protocol::layout::RowFormat;
use crate::protocol::normal::{self, NormalArena};
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::Tensor2;

/// The shapes of a host handle, for the checks every backend shares.
fn handle_shapes(h: &IntranodeHandle) -> super::check::HandleShapes {
    super::check::HandleShapes {
        rank_prefix_matrix: h.rank_prefix_matrix.shape(),
        channel_prefix_matrix: h.channel_prefix_matrix.shape(),
        recv_channel_prefix_matrix: h.recv_channel_prefix_matrix.shape(),
        send_head: h.send_head.shape(),
        is_token_in_rank: h.is_token_in_rank.shape(),
        num_rows: h.recv_src_idx.len(),
        num_recv: Some(h.num_recv_tokens),
    }
}

fn rows_of(x: &Activations) -> RowFormat {
    match x {
        Activations::Bf16(t) => RowFormat {
            hidden: t.cols(),
            elem_bytes: 2,
            num_scales: 0,
            num_topk: 0,
        },
        Activations::Fp8 { data, scales } => RowFormat {
            hidden: data.cols(),
            elem_bytes: 1,
            num_scales: scales.cols(),
            num_topk: 0,
        },
    }
}

impl<E: Executor> Buffer<E> {
    /// `get_dispatch_layout` of every local rank (spec §1.7): `topk_idx[i]` is local rank
    /// `i`'s routing.
    pub fn get_dispatch_layout(
        &self,
        topk_idx: &[Tensor2<ExpertIdx>],
        num_experts: usize,
    ) -> Result<Vec<DispatchLayout>> {
        let r = self.num_ranks();
        self.check_local(&[topk_idx.len()])?;
        topk_idx
            .iter()
            .zip(self.transport.local_ranks())
            .map(|(t, s)| get_dispatch_layout_for_rank(s, t, num_experts, r))
            .collect()
    }

    pub(super) fn normal_arena(&self) -> Result<&NormalArena> {
        let r = self.num_ranks();
        for s in 0..r {
            for d in 0..r {
                if !self.transport.reach(s, d).load_store() {
                    return Err(Error::Unsupported(format!(
                        "normal mode between rank {s} and rank {d}, which are not NVLink peers: \
                         normal internode mode is not implemented yet (docs/protocol.md §4)"
                    )));
                }
            }
        }
        self.normal.as_ref().ok_or(Error::ArenaMissing {
            what: "normal-mode arena",
            fix: "set num_nvl_bytes (Buffer::normal_size_hint)",
        })
    }

    pub(super) fn check_capacity(
        arena: &NormalArena,
        rows: usize,
        rec: u64,
        dispatch: bool,
    ) -> Result<()> {
        let data = arena.data_layout();
        let cap = if dispatch {
            data.dispatch_capacity(rec)
        } else {
            data.combine_capacity(rec)
        };
        if rows as u64 > cap {
            return Err(Error::ArenaTooSmall {
                what: format!(
                    "normal-mode {} rows ({rows} rows of {rec} bytes)",
                    if dispatch { "dispatch" } else { "combine" }
                ),
                needed: rows as u64 * rec,
                available: cap * rec,
                fix: "raise num_nvl_bytes (Buffer::normal_size_hint)".into(),
            });
        }
        Ok(())
    }

    /// Normal dispatch of every local rank (spec §1.8, docs/protocol.md §2.3): one phase, rows
    /// written directly at their final place. Outputs equal
    /// `plan::intranode::intranode_dispatch_all`.
    pub fn dispatch(
        &mut self,
        inputs: &[RankInputs],
        layouts: &[DispatchLayout],
        num_experts: usize,
        args: &NormalDispatchArgs,
    ) -> Result<Vec<IntranodeDispatch>> {
        let out = self.run_dispatch(inputs, layouts, num_experts, args, false)?;
        out.into_iter()
            .enumerate()
            .map(|(rank, (d, x))| {
                let recv_x = x.ok_or_else(|| Error::AgentFailed {
                    rank,
                    agent: "receiver".into(),
                    detail: "the receiver returned no rows".into(),
                })?;
                Ok(d.with_recv_x(recv_x))
            })
            .collect()
    }

    /// The dispatch phase; `in_place`: the received rows stay in the arena (§2.6).
    pub(super) fn run_dispatch(
        &mut self,
        inputs: &[RankInputs],
        layouts: &[DispatchLayout],
        num_experts: usize,
        args: &NormalDispatchArgs,
        in_place: bool,
    ) -> Result<Vec<(InPlaceDispatch, Option<Activations>)>> {
        self.check_poison()?;
        self.in_place = None;
        let opts = DispatchOptions {
            num_channels: args.config.num_channels(),
            expert_alignment: args.expert_alignment,
            num_worst_tokens: args.num_worst_tokens,
            with_topk: args.with_topk,
        };
        self.check_local(&[inputs.len()])?;
        // The shape-level checks (inputs, options, protocol limits), then the executor's
        // per-token ones (routing in range, layouts equal to it, worst-token rows).
        let shapes: Vec<_> = inputs.iter().map(RankInputs::shapes).collect();
        let shape = check_dispatch_shapes(&shapes, layouts.len(), num_experts, &opts)?;
        super::check::normal_dispatch(self.num_ranks(), num_experts, &opts)?;
        let max_rows = self.transport.check_normal_dispatch(&NormalDispatchCheck {
            inputs,
            layouts,
            num_experts,
            num_worst_tokens: opts.num_worst_tokens,
        })?;
        let mut fmt = rows_of(&inputs[0].x);
        fmt.num_topk = shape.num_topk;
        let call = self.next_call();
        let arena = self.normal_arena()?.clone();
        // The worst-token rows are a shape-level bound; the exact rows only the executor knows.
        if let Some(rows) =
            max_rows.or((opts.num_worst_tokens > 0).then_some(opts.num_worst_tokens))
        {
            Self::check_capacity(&arena, rows, fmt.dispatch_record(), true)?;
        }
        let job = NormalDispatchJob {
            arena,
            call,
            mutation: self.mutation,
            work: normal::DispatchJob {
                inputs,
                layouts,
                num_local_experts: shape.num_local_experts,
                num_channels: opts.num_channels,
                expert_alignment: opts.expert_alignment,
                num_worst_tokens: opts.num_worst_tokens,
                with_topk: opts.with_topk,
                fmt,
                in_place,
            },
        };
        let res = self.transport.run_normal_dispatch(&job);
        // A rank's missing outputs, after a phase that succeeded, do not poison.
        let out = self
            .ran(call, res)?
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        if in_place {
            self.in_place = Some(InPlaceRows {
                call,
                fmt,
                with_topk: opts.with_topk,
                rows: out.iter().map(|(d, _)| d.num_rows).collect(),
            });
        }
        Ok(out)
    }

    /// Cached dispatch of every local rank (handle given, no top-k, spec §1.8;
    /// docs/protocol.md §2.4). Equals `plan::intranode::intranode_dispatch_cached`.
    pub fn dispatch_cached(
        &mut self,
        xs: &[&Activations],
        handles: &[IntranodeHandle],
    ) -> Result<Vec<Activations>> {
        self.check_poison()?;
        let r = self.num_ranks();
        self.check_local(&[xs.len(), handles.len()])?;
        self.in_place = None;
        let mut max_rows = 0;
        for (s, (x, h)) in xs.iter().zip(handles).enumerate() {
            check_same_activation_kind(xs[0], x, s)?;
            super::check::normal_handle(s, r, Some(x.num_tokens()), None, &handle_shapes(h))?;
            max_rows = max_rows.max(h.recv_src_idx.len());
        }
        let fmt = rows_of(xs[0]);
        let call = self.next_call();
        let arena = self.normal_arena()?.clone();
        Self::check_capacity(&arena, max_rows, fmt.dispatch_record(), true)?;
        let job = CachedDispatchJob {
            arena,
            call,
            mutation: self.mutation,
            work: normal::CachedJob { xs, handles, fmt },
        };
        let res = self.transport.run_cached_dispatch(&job);
        self.ran(call, res)?.into_iter().collect()
    }

    /// Normal combine of every local rank (spec §1.8, docs/protocol.md §2.5): each rank
    /// publishes its expert outputs in its combine rows, owners pull and reduce. Equals
    /// `plan::intranode::intranode_combine` bit for bit.
    pub fn combine(
        &mut self,
        handles: &[IntranodeHandle],
        args: &[CombineArgs<'_>],
    ) -> Result<Vec<CombineOutput>> {
        self.check_poison()?;
        self.check_local(&[handles.len(), args.len()])?;
        let num_tokens: Vec<usize> = handles.iter().map(|h| h.send_head.rows()).collect();
        let num_recv: Vec<usize> = handles.iter().map(|h| h.recv_src_idx.len()).collect();
        let (hidden, num_topk) = check_combine_args(args, &num_tokens, &num_recv)?;
        self.check_combine_handles(handles, &num_recv)?;
        let k = num_topk.unwrap_or(0);
        let fmt = RowFormat {
            hidden,
            elem_bytes: 2,
            num_scales: 0,
            num_topk: k,
        };
        Self::check_capacity(
            self.normal_arena()?,
            num_recv.iter().copied().max().unwrap_or(0),
            fmt.combine_record(),
            false,
        )?;
        let work = normal::CombineJob {
            handles,
            source: normal::CombineSource::Host(args),
            hidden,
            num_topk: k,
        };
        self.run_combine(work, num_topk.is_some())
    }

    /// The handles of a combine: their shapes (`check::normal_handle`), then the executor's
    /// check that every row a handle pulls exists on its rank (`num_recv[d]` rows on `d`).
    pub(super) fn check_combine_handles(
        &self,
        handles: &[IntranodeHandle],
        num_recv: &[usize],
    ) -> Result<()> {
        let r = handles.len();
        for (s, h) in handles.iter().enumerate() {
            super::check::normal_handle(s, r, None, None, &handle_shapes(h))?;
        }
        self.transport
            .check_normal_combine(&NormalCombineCheck { handles, num_recv })
    }

    /// The combine phase of a checked job; the outputs assembled per rank.
    pub(super) fn run_combine(
        &mut self,
        work: normal::CombineJob<'_>,
        with_weights: bool,
    ) -> Result<Vec<CombineOutput>> {
        let call = self.next_call();
        let job = NormalCombineJob {
            arena: self.normal_arena()?.clone(),
            call,
            mutation: self.mutation,
            work,
            with_weights,
        };
        let res = self.transport.run_normal_combine(&job);
        self.ran(call, res)
    }
}
