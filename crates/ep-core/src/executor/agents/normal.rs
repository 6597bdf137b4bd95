//! The simulator's normal-mode phases (docs/protocol.md §2): the per-token checks, then the
//! agents of `protocol::normal` run over the transport, their results assembled per rank.

use std::sync::Mutex;

use half::bf16;

use crate::error::{Error, Result};
use crate::executor::jobs::{
    CachedDispatchJob, CombineFrom, ExpertJob, InArenaRows, NormalCombineCheck, NormalCombineJob,
    NormalDispatchCheck, NormalDispatchJob, NormalDispatched,
};
use crate::plan::combine::CombineOutput;
use crate::plan::intranode::{
    InPlaceDispatch, IntranodeHandle, check_dispatch_routing, handle_mismatch,
};
use crate::plan::layout::channel_range;
use crate::protocol::normal::{self, take_slot};
use crate::routing::Activations;
use crate::tensor::Tensor2;
use crate::transport::Transport;

/// Expert ids in range and layouts equal to the routing (§1.7), then, from the layouts'
/// counts, the rows each rank receives: within `num_worst_tokens` when it is set. Returns the
/// most rows any rank holds (its received rows, or the worst-token rows).
pub(super) fn check_dispatch(job: &NormalDispatchCheck<'_>) -> Result<usize> {
    check_dispatch_routing(job.inputs, job.layouts, job.num_experts)?;
    let worst = job.num_worst_tokens;
    let mut max_rows = 0usize;
    for d in 0..job.inputs.len() {
        let recv: usize = job
            .layouts
            .iter()
            .map(|l| l.num_tokens_per_rank[d] as usize)
            .sum();
        if worst > 0 && recv > worst {
            return Err(Error::WorstTokensTooSmall {
                rank: d,
                num_worst_tokens: worst,
                needed: recv,
            });
        }
        max_rows = max_rows.max(recv.max(worst));
    }
    Ok(max_rows)
}

/// The dispatch phase; each rank's outputs from its notify and receiver agents (or the error
/// naming the one that left none).
pub(super) fn dispatch(
    t: &mut impl Transport,
    job: &NormalDispatchJob<'_>,
) -> Result<Vec<Result<NormalDispatched>>> {
    let r = job.arena.num_ranks;
    let slots = normal::DispatchSlots::new(r);
    let work = normal::DispatchJob {
        inputs: job.inputs,
        layouts: job.layouts,
        num_local_experts: job.num_local_experts,
        num_channels: job.num_channels,
        expert_alignment: job.expert_alignment,
        num_worst_tokens: job.num_worst_tokens,
        with_topk: job.with_topk,
        fmt: job.fmt,
        in_place: job.in_place,
    };
    let phase = normal::dispatch_phase(&job.arena, &work, job.call, job.mutation, &slots);
    t.run_phase(phase)?;
    Ok((0..r)
        .map(|d| {
            let n = take_slot(&slots.notify[d], d, "notify")?;
            let v = take_slot(&slots.recv[d], d, "receiver")?;
            let recv_cpm = take_slot(&slots.recv_cpm[d], d, "receiver")?;
            let disp = InPlaceDispatch {
                num_rows: v.src_idx.len(),
                recv_topk_idx: v.topk_idx,
                recv_topk_weights: v.topk_weights,
                num_recv_tokens_per_expert_list: n.expert_list,
                handle: IntranodeHandle {
                    rank_prefix_matrix: n.rank_prefix_matrix,
                    channel_prefix_matrix: n.channel_prefix_matrix,
                    recv_channel_prefix_matrix: recv_cpm,
                    recv_src_idx: v.src_idx,
                    is_token_in_rank: job.layouts[d].is_token_in_rank.clone(),
                    send_head: n.send_head,
                    num_recv_tokens: n.num_recv,
                },
            };
            Ok((disp, v.recv_x))
        })
        .collect())
}

/// The cached dispatch phase; each rank's received rows (or the error naming its receiver).
pub(super) fn cached(
    t: &mut impl Transport,
    job: &CachedDispatchJob<'_>,
) -> Result<Vec<Result<Activations>>> {
    let r = job.arena.num_ranks;
    let out: Vec<Mutex<Option<normal::RecvResult>>> = (0..r).map(|_| Mutex::new(None)).collect();
    let work = normal::CachedJob {
        xs: job.xs,
        handles: job.handles,
        fmt: job.fmt,
    };
    let phase = normal::cached_phase(&job.arena, &work, job.call, job.mutation, &out);
    t.run_phase(phase)?;
    Ok(out
        .iter()
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
        .collect())
}

/// Every row a handle pulls exists on its rank (`num_recv[d]` rows on `d`): `send_head`'s
/// slots read against the prefix matrices.
pub(super) fn check_combine(job: &NormalCombineCheck<'_>) -> Result<()> {
    let (handles, num_recv) = (job.handles, job.num_recv);
    let r = handles.len();
    for (s, h) in handles.iter().enumerate() {
        let c = h.channel_prefix_matrix.cols();
        let t_count = h.send_head.rows();
        for t in 0..t_count {
            let ch = (0..c)
                .find(|&ch| channel_range(t_count, c, ch).contains(&t))
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
                        format!("token {t} maps to row {j} of rank {d}, past its received rows"),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The combine phase; each reducer writes its channel's rows (a contiguous token range) of
/// its rank's outputs in place.
pub(super) fn combine(
    t: &mut impl Transport,
    job: &NormalCombineJob<'_>,
) -> Result<Vec<CombineOutput>> {
    let (handles, hidden, k) = (job.handles, job.hidden, job.num_topk);
    let work = normal::CombineJob {
        handles,
        source: match job.source {
            CombineFrom::Args(a) => normal::CombineSource::Host(a),
            CombineFrom::InArena(InArenaRows(src)) => src,
        },
        hidden,
        num_topk: k,
    };
    let num_tokens: Vec<usize> = handles.iter().map(|h| h.send_head.rows()).collect();
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
                        let n = channel_range(t, c_count, c).len();
                        let (a, b) = std::mem::take(&mut rx).split_at_mut(n * hidden);
                        let (c2, d2) = std::mem::take(&mut rw).split_at_mut(n * k);
                        rx = b;
                        rw = d2;
                        Mutex::new(Some((a, c2)))
                    })
                    .collect()
            })
            .collect();
        let phase = normal::combine_phase(&job.arena, &work, job.call, job.mutation, &out);
        t.run_phase(phase)?;
    }
    Ok(xs
        .into_iter()
        .zip(ws)
        .map(|(x, w)| CombineOutput {
            combined_x: x,
            combined_topk_weights: job.with_weights.then_some(w),
        })
        .collect())
}

/// The expert phase; the agents get an empty tensor of the rows' kind to fill.
pub(super) fn expert(t: &mut impl Transport, job: &ExpertJob<'_>) -> Result<()> {
    let like = match job.fmt.elem_bytes {
        2 => Activations::Bf16(Tensor2::zeros(0, job.fmt.hidden)),
        _ => Activations::Fp8 {
            data: Tensor2::filled(0, job.fmt.hidden, 0u8),
            scales: Tensor2::filled(0, job.fmt.num_scales, 0.0f32),
        },
    };
    let work = normal::ExpertJob {
        fmt: job.fmt,
        out: job.out,
        rows: job.rows,
        with_topk: job.with_topk,
        like: &like,
        expert: job.expert,
    };
    t.run_phase(normal::expert_phase(&job.arena, work, job.call))
        .map(drop)
}
