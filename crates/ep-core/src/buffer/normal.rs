//! Normal-mode calls of [`Buffer`] (docs/protocol.md §2): layout, dispatch, cached dispatch,
//! combine. Each is one phase; a failed phase poisons the buffer (`fault`).

use std::sync::Mutex;

use half::bf16;

use super::in_place::InPlaceRows;
use super::{Buffer, NormalDispatchArgs};
use crate::error::{Error, Result};
use crate::plan::combine::{CombineArgs, CombineOutput, check_combine_args};
use crate::plan::intranode::InPlaceDispatch;
use crate::plan::intranode::{
    DispatchOptions, IntranodeDispatch, IntranodeHandle, check_dispatch,
    check_same_activation_kind, handle_mismatch,
};
use crate::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use crate::protocol::layout::RowFormat;
use crate::protocol::normal::{self, NormalArena, take_slot};
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::Tensor2;
use crate::transport::Transport;

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

impl<T: Transport> Buffer<T> {
    /// `get_dispatch_layout` of every rank (spec §1.7).
    pub fn get_dispatch_layout(
        &self,
        topk_idx: &[Tensor2<ExpertIdx>],
        num_experts: usize,
    ) -> Result<Vec<DispatchLayout>> {
        let r = self.num_ranks();
        if topk_idx.len() != r {
            return Err(Error::RankCountMismatch {
                expected: r,
                found: topk_idx.len(),
            });
        }
        topk_idx
            .iter()
            .enumerate()
            .map(|(s, t)| get_dispatch_layout_for_rank(s, t, num_experts, r))
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

    /// Normal dispatch of every rank (spec §1.8, docs/protocol.md §2.3): one phase, rows written
    /// directly at their final place. Outputs equal `plan::intranode::intranode_dispatch_all`.
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
        if inputs.len() != self.num_ranks() {
            return Err(Error::RankCountMismatch {
                expected: self.num_ranks(),
                found: inputs.len(),
            });
        }
        // The data-level checks (routing in range, layouts equal to it), then the shape-level
        // ones every backend runs (`check`).
        let shape = check_dispatch(inputs, layouts, num_experts, &opts)?;
        super::check::normal_dispatch(self.num_ranks(), num_experts, &opts)?;
        let r = self.num_ranks();
        let mut fmt = rows_of(&inputs[0].x);
        fmt.num_topk = shape.num_topk;
        let mut max_rows = 0usize;
        for d in 0..r {
            let recv: usize = layouts
                .iter()
                .map(|l| l.num_tokens_per_rank[d] as usize)
                .sum();
            if opts.num_worst_tokens > 0 && recv > opts.num_worst_tokens {
                return Err(Error::WorstTokensTooSmall {
                    rank: d,
                    num_worst_tokens: opts.num_worst_tokens,
                    needed: recv,
                });
            }
            max_rows = max_rows.max(recv.max(opts.num_worst_tokens));
        }
        let call = self.next_call();
        let mutation = self.mutation;
        let arena = self.normal_arena()?.clone();
        Self::check_capacity(&arena, max_rows, fmt.dispatch_record(), true)?;
        let job = normal::DispatchJob {
            inputs,
            layouts,
            num_local_experts: shape.num_local_experts,
            num_channels: opts.num_channels,
            expert_alignment: opts.expert_alignment,
            num_worst_tokens: opts.num_worst_tokens,
            with_topk: opts.with_topk,
            fmt,
            in_place,
        };
        let slots = normal::DispatchSlots::new(r);
        let phase = normal::dispatch_phase(&arena, &job, call, mutation, &slots);
        self.run(phase)?;
        let out: Vec<_> = (0..r)
            .map(|d| {
                let n = take_slot(&slots.notify[d], d, "notify")?;
                let v = take_slot(&slots.recv[d], d, "receiver")?;
                let disp = InPlaceDispatch {
                    num_rows: v.src_idx.len(),
                    recv_topk_idx: v.topk_idx,
                    recv_topk_weights: v.topk_weights,
                    num_recv_tokens_per_expert_list: n.expert_list,
                    handle: IntranodeHandle {
                        rank_prefix_matrix: n.rank_prefix_matrix,
                        channel_prefix_matrix: n.channel_prefix_matrix,
                        recv_channel_prefix_matrix: n.recv_channel_prefix_matrix,
                        recv_src_idx: v.src_idx,
                        is_token_in_rank: layouts[d].is_token_in_rank.clone(),
                        send_head: n.send_head,
                        num_recv_tokens: n.num_recv,
                    },
                };
                Ok((disp, v.recv_x))
            })
            .collect::<Result<_>>()?;
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

    /// Cached dispatch (handle given, no top-k, spec §1.8; docs/protocol.md §2.4). Equals
    /// `plan::intranode::intranode_dispatch_cached`.
    pub fn dispatch_cached(
        &mut self,
        xs: &[&Activations],
        handles: &[IntranodeHandle],
    ) -> Result<Vec<Activations>> {
        self.check_poison()?;
        let r = self.num_ranks();
        for len in [xs.len(), handles.len()] {
            if len != r {
                return Err(Error::RankCountMismatch {
                    expected: r,
                    found: len,
                });
            }
        }
        self.in_place = None;
        let mut max_rows = 0;
        for (s, (x, h)) in xs.iter().zip(handles).enumerate() {
            check_same_activation_kind(xs[0], x, s)?;
            super::check::normal_handle(s, r, Some(x.num_tokens()), None, &handle_shapes(h))?;
            max_rows = max_rows.max(h.recv_src_idx.len());
        }
        let fmt = rows_of(xs[0]);
        let call = self.next_call();
        let mutation = self.mutation;
        let arena = self.normal_arena()?.clone();
        Self::check_capacity(&arena, max_rows, fmt.dispatch_record(), true)?;
        let job = normal::CachedJob { xs, handles, fmt };
        let out: Vec<Mutex<Option<normal::RecvResult>>> =
            (0..r).map(|_| Mutex::new(None)).collect();
        let phase = normal::cached_phase(&arena, &job, call, mutation, &out);
        self.run(phase)?;
        out.iter()
            .enumerate()
            .map(|(rank, o)| {
                take_slot(o, rank, "receiver")?
                    .recv_x
                    .ok_or_else(|| Error::AgentFailed {
                        rank,
                        agent: "receiver".into(),
                        detail: "the receiver returned no rows".into(),
                    })
            })
            .collect()
    }

    /// Normal combine of every rank (spec §1.8, docs/protocol.md §2.5): each rank publishes its
    /// expert outputs in its combine rows, owners pull and reduce. Equals
    /// `plan::intranode::intranode_combine` bit for bit.
    pub fn combine(
        &mut self,
        handles: &[IntranodeHandle],
        args: &[CombineArgs<'_>],
    ) -> Result<Vec<CombineOutput>> {
        self.check_poison()?;
        let r = self.num_ranks();
        for len in [handles.len(), args.len()] {
            if len != r {
                return Err(Error::RankCountMismatch {
                    expected: r,
                    found: len,
                });
            }
        }
        let num_tokens: Vec<usize> = handles.iter().map(|h| h.send_head.rows()).collect();
        let num_recv: Vec<usize> = handles.iter().map(|h| h.recv_src_idx.len()).collect();
        let (hidden, num_topk) = check_combine_args(args, &num_tokens, &num_recv)?;
        Self::check_combine_handles(handles, &num_recv)?;
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
        let job = normal::CombineJob {
            handles,
            source: normal::CombineSource::Host(args),
            hidden,
            num_topk: k,
        };
        self.run_combine(&job, num_topk.is_some())
    }

    /// Every row a handle pulls exists on its rank (`num_recv[d]` rows on `d`).
    pub(super) fn check_combine_handles(
        handles: &[IntranodeHandle],
        num_recv: &[usize],
    ) -> Result<()> {
        let r = handles.len();
        for (s, h) in handles.iter().enumerate() {
            let c = super::check::normal_handle(s, r, None, None, &handle_shapes(h))?;
            // Every pulled row must exist on its rank.
            for t in 0..h.send_head.rows() {
                let ch = (0..c)
                    .find(|&ch| {
                        crate::plan::layout::channel_range(h.send_head.rows(), c, ch).contains(&t)
                    })
                    .unwrap_or(0);
                for d in 0..r {
                    let slot = h.send_head.get(t, d);
                    if slot < 0 {
                        continue;
                    }
                    let j = h.rank_start(s, d) + h.channel_start(d, ch) + slot;
                    if j < 0 || j as usize >= handles[d].num_recv_tokens.min(num_recv[d]) {
                        return Err(handle_mismatch(
                            s,
                            format!(
                                "token {t} maps to row {j} of rank {d}, past its received rows"
                            ),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The combine phase of a checked job; the outputs assembled per rank.
    pub(super) fn run_combine(
        &mut self,
        job: &normal::CombineJob<'_>,
        with_weights: bool,
    ) -> Result<Vec<CombineOutput>> {
        let (handles, hidden, k) = (job.handles, job.hidden, job.num_topk);
        let num_tokens: Vec<usize> = handles.iter().map(|h| h.send_head.rows()).collect();
        let call = self.next_call();
        let mutation = self.mutation;
        let arena = self.normal_arena()?.clone();
        // Each reducer writes its channel's rows (a contiguous token range) in place.
        let mut xs: Vec<Tensor2<bf16>> = num_tokens
            .iter()
            .map(|&t| Tensor2::zeros(t, hidden))
            .collect();
        let mut ws: Vec<Tensor2<f32>> = num_tokens
            .iter()
            .map(|&t| Tensor2::filled(t, k, 0.0f32))
            .collect();
        {
            let out: Vec<Vec<normal::ReducedRows<'_>>> = xs
                .iter_mut()
                .zip(ws.iter_mut())
                .zip(handles)
                .map(|((x, w), h)| {
                    let c_count = h.channel_prefix_matrix.cols();
                    let t = h.send_head.rows();
                    let (mut rx, mut rw) = (x.data_mut(), w.data_mut());
                    (0..c_count)
                        .map(|c| {
                            let n = crate::plan::layout::channel_range(t, c_count, c).len();
                            let (a, b) = std::mem::take(&mut rx).split_at_mut(n * hidden);
                            let (c2, d2) = std::mem::take(&mut rw).split_at_mut(n * k);
                            rx = b;
                            rw = d2;
                            Mutex::new(Some((a, c2)))
                        })
                        .collect()
                })
                .collect();
            let phase = normal::combine_phase(&arena, job, call, mutation, &out);
            self.run(phase)?;
        }
        let res = xs
            .into_iter()
            .zip(ws)
            .map(|(x, w)| CombineOutput {
                combined_x: x,
                combined_topk_weights: with_weights.then_some(w),
            })
            .collect();
        Ok(res)
    }
}
