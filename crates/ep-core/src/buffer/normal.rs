//! Normal-mode calls of [`Buffer`] (docs/protocol.md §2): layout, dispatch, cached dispatch,
//! combine. Each is one phase of the executor; a failed phase poisons the buffer (`fault`).

use super::check::HandleShapes;
use super::{Buffer, NormalDispatchArgs};
use crate::error::{Error, Result};
use crate::executor::tensors::row_format;
use crate::executor::{
    CachedDispatchJob, CombineFrom, Executor, NormalCombineCheck, NormalCombineJob,
    NormalDispatchCheck, NormalDispatchJob, Tensors,
};
use crate::plan::combine::check_combine_shapes;
use crate::plan::intranode::{DispatchOptions, check_dispatch_shapes};
use crate::plan::layout::local_experts;
use crate::protocol::layout::RowFormat;
use crate::protocol::normal::NormalArena;

type T<E> = <E as Executor>::T;

impl<E: Executor> Buffer<E> {
    /// `get_dispatch_layout` of every local rank (spec §1.7): `topk_idx[i]` is local rank
    /// `i`'s routing.
    pub fn get_dispatch_layout(
        &mut self,
        topk_idx: &[<T<E> as Tensors>::Idx],
        num_experts: usize,
    ) -> Result<Vec<<T<E> as Tensors>::Layout>> {
        // No phase, no call number: the layout is the caller's own routing counted (a host
        // computation on the simulator, which works on a poisoned buffer too); only what the
        // executor found since the last call is reported.
        let res = self.transport.poll();
        self.ran(self.last_call, res)?;
        self.check_local(&[topk_idx.len()])?;
        local_experts(num_experts, self.num_ranks())?;
        for (t, s) in topk_idx.iter().zip(self.transport.local_ranks()) {
            T::<E>::idx_shape(t, s)?;
        }
        self.transport.run_layout(topk_idx, num_experts)
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
        inputs: &[<T<E> as Tensors>::Inputs],
        layouts: &[<T<E> as Tensors>::Layout],
        num_experts: usize,
        args: &NormalDispatchArgs,
    ) -> Result<Vec<<T<E> as Tensors>::Dispatch>> {
        let out = self.run_dispatch(inputs, layouts, num_experts, args, false)?;
        let ranks = self.transport.local_ranks();
        out.into_iter()
            .zip(ranks)
            .map(|(d, rank)| T::<E>::finish_dispatch(d, rank))
            .collect()
    }

    /// The dispatch phase; `in_place`: the received rows stay in the arena (§2.6).
    pub(super) fn run_dispatch(
        &mut self,
        inputs: &[<T<E> as Tensors>::Inputs],
        layouts: &[<T<E> as Tensors>::Layout],
        num_experts: usize,
        args: &NormalDispatchArgs,
        in_place: bool,
    ) -> Result<Vec<<T<E> as Tensors>::Dispatched>> {
        self.ready()?;
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
        let shapes = inputs
            .iter()
            .zip(self.transport.local_ranks())
            .map(|(x, s)| T::<E>::input_shapes(x, s, opts.with_topk))
            .collect::<Result<Vec<_>>>()?;
        let shape = check_dispatch_shapes(&shapes, layouts.len(), num_experts, &opts)?;
        super::check::normal_dispatch(self.num_ranks(), num_experts, &opts)?;
        let max_rows = self.transport.check_normal_dispatch(&NormalDispatchCheck {
            inputs,
            layouts,
            num_experts,
            num_worst_tokens: opts.num_worst_tokens,
        })?;
        let mut fmt = row_format(&shapes[0]);
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
            inputs,
            layouts,
            num_experts,
            num_local_experts: shape.num_local_experts,
            num_channels: opts.num_channels,
            expert_alignment: opts.expert_alignment,
            num_worst_tokens: opts.num_worst_tokens,
            with_topk: opts.with_topk,
            fmt,
            in_place,
        };
        let res = self.transport.run_normal_dispatch(&job);
        // A rank's missing outputs, after a phase that succeeded, do not poison.
        self.ran(call, res)?.into_iter().collect()
    }

    /// Cached dispatch of every local rank (handle given, no top-k, spec §1.8;
    /// docs/protocol.md §2.4). Equals `plan::intranode::intranode_dispatch_cached`.
    pub fn dispatch_cached(
        &mut self,
        xs: &[&<T<E> as Tensors>::Rows],
        handles: &[<T<E> as Tensors>::Handle],
    ) -> Result<Vec<<T<E> as Tensors>::Rows>> {
        self.ready()?;
        let r = self.num_ranks();
        self.check_local(&[xs.len(), handles.len()])?;
        self.in_place = None;
        let mut max_rows = 0;
        let mut first = None;
        for ((x, h), s) in xs.iter().zip(handles).zip(self.transport.local_ranks()) {
            let shapes = T::<E>::rows_shapes(x, s)?;
            shapes.check(s, false)?;
            let first = *first.get_or_insert(shapes);
            shapes.agree(&first, s, false)?;
            let hs = T::<E>::handle_shapes(h, s)?;
            super::check::normal_handle(s, r, Some(shapes.x.0), None, &hs)?;
            max_rows = max_rows.max(hs.num_rows);
        }
        let Some(first) = first else {
            return Ok(Vec::new());
        };
        let fmt = row_format(&first);
        let call = self.next_call();
        let arena = self.normal_arena()?.clone();
        Self::check_capacity(&arena, max_rows, fmt.dispatch_record(), true)?;
        let job = CachedDispatchJob {
            arena,
            call,
            mutation: self.mutation,
            xs,
            handles,
            fmt,
        };
        let res = self.transport.run_cached_dispatch(&job);
        self.ran(call, res)?.into_iter().collect()
    }

    /// Normal combine of every local rank (spec §1.8, docs/protocol.md §2.5): each rank
    /// publishes its expert outputs in its combine rows, owners pull and reduce. Equals
    /// `plan::intranode::intranode_combine` bit for bit.
    pub fn combine<'a>(
        &mut self,
        handles: &'a [<T<E> as Tensors>::Handle],
        args: &'a [<T<E> as Tensors>::CombineIn<'a>],
    ) -> Result<Vec<<T<E> as Tensors>::Combined>> {
        self.ready()?;
        self.check_local(&[handles.len(), args.len()])?;
        let ranks = self.transport.local_ranks();
        let hs = handles
            .iter()
            .zip(&ranks)
            .map(|(h, &s)| T::<E>::handle_shapes(h, s))
            .collect::<Result<Vec<_>>>()?;
        let shapes = args
            .iter()
            .zip(&ranks)
            .map(|(a, &s)| T::<E>::combine_shapes(a, s))
            .collect::<Result<Vec<_>>>()?;
        let num_tokens: Vec<usize> = hs.iter().map(|h| h.send_head.0).collect();
        let num_recv: Vec<usize> = hs.iter().map(|h| h.num_rows).collect();
        let (hidden, num_topk) = check_combine_shapes(&shapes, &num_tokens, &num_recv)?;
        self.check_combine_handles(handles, &hs, &num_recv)?;
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
        self.run_combine(
            handles,
            CombineFrom::Args(args),
            (hidden, k),
            num_topk.is_some(),
        )
    }

    /// The handles of a combine: their shapes (`check::normal_handle`), then the executor's
    /// check that every row a handle pulls exists on its rank (`num_recv[i]` rows on local
    /// rank `i`).
    pub(super) fn check_combine_handles(
        &self,
        handles: &[<T<E> as Tensors>::Handle],
        shapes: &[HandleShapes],
        num_recv: &[usize],
    ) -> Result<()> {
        let r = self.num_ranks();
        for (h, s) in shapes.iter().zip(self.transport.local_ranks()) {
            super::check::normal_handle(s, r, None, None, h)?;
        }
        self.transport
            .check_normal_combine(&NormalCombineCheck { handles, num_recv })
    }

    /// The combine phase of a checked job (`shape`: hidden, top-k); the outputs assembled per
    /// rank.
    pub(super) fn run_combine<'a>(
        &mut self,
        handles: &'a [<T<E> as Tensors>::Handle],
        source: CombineFrom<'a, T<E>>,
        (hidden, num_topk): (usize, usize),
        with_weights: bool,
    ) -> Result<Vec<<T<E> as Tensors>::Combined>> {
        let call = self.next_call();
        let job = NormalCombineJob {
            arena: self.normal_arena()?.clone(),
            call,
            mutation: self.mutation,
            handles,
            source,
            hidden,
            num_topk,
            with_weights,
        };
        let res = self.transport.run_normal_combine(&job);
        self.ran(call, res)
    }
}
