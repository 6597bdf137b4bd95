//! The simulator's low-latency phases (docs/protocol.md §3): one attempt each, the agents of
//! `protocol::low_latency` run over the transport; which peers the receive agents gave up on
//! is reported for the `Buffer` to mask.

use std::sync::{Mutex, PoisonError};

use half::bf16;

use crate::error::{Error, Result};
use crate::executor::jobs::{
    LlAttempt, LlCleanJob, LlCombineCheck, LlCombineRecvJob, LlCombineSendJob, LlDispatchRecvJob,
    LlDispatchSendJob, LlExpertOutputJob, LlRecvOut,
};
use crate::plan::low_latency::LlDispatchOutput;
use crate::protocol::low_latency::{self as ll, ExpertOut, Expired, LlArena, LlOp};
use crate::protocol::normal::take_slot;
use crate::routing::{Activations, ExpertIdx};
use crate::tensor::Tensor2;
use crate::transport::{Phase, Transport};

/// The attempt of `phase` with receive agents reporting in `expired`; when it succeeded with
/// no peer given up on, each unmasked rank's result taken from `out` (agent `what`).
fn attempt<X>(
    t: &mut impl Transport,
    phase: Phase<'_>,
    op: &LlOp,
    expired: &Expired,
    out: &[Mutex<Option<X>>],
    what: &str,
) -> LlAttempt<X> {
    let result = t.run_phase(phase).map(drop);
    let gave_up = expired.ranks();
    let out = if result.is_ok() && gave_up.iter().all(|&r| op.masked[r]) {
        out.iter()
            .enumerate()
            .map(|(d, o)| (!op.masked[d]).then(|| take_slot(o, d, what)))
            .collect()
    } else {
        Vec::new()
    };
    LlAttempt {
        result,
        gave_up,
        out,
    }
}

/// Declares the signal words of the ranks in `fresh` zero at the phase's start.
fn assume_zero<'a>(mut phase: Phase<'a>, arena: &LlArena, fresh: &[bool]) -> Phase<'a> {
    for (d, _) in fresh.iter().enumerate().filter(|(_, z)| **z) {
        phase = phase.assume_zero(d, arena.signals.region);
    }
    phase
}

pub(super) fn dispatch_send(t: &mut impl Transport, job: &LlDispatchSendJob<'_>) -> LlAttempt<()> {
    let expired = Expired::new(job.arena.num_ranks);
    let xs: Result<Vec<&Tensor2<bf16>>> = job
        .inputs
        .iter()
        .enumerate()
        .map(|(s, i)| match &i.x {
            Activations::Bf16(x) => Ok(x),
            Activations::Fp8 { .. } => Err(Error::LlExpectsBf16 { rank: s }),
        })
        .collect();
    let xs = match xs {
        Ok(xs) => xs,
        Err(e) => {
            return LlAttempt {
                result: Err(e),
                gave_up: Vec::new(),
                out: Vec::new(),
            };
        }
    };
    let topk: Vec<(&Tensor2<ExpertIdx>, &Tensor2<f32>)> = job
        .inputs
        .iter()
        .map(|i| (&i.topk_idx, &i.topk_weights))
        .collect();
    let phase = ll::dispatch_send_phase(job.arena, job.op, &xs, &topk, job.rows, job.mutation);
    let phase = assume_zero(phase, job.arena, job.fresh);
    attempt(t, phase, job.op, &expired, &[], "ll-sender")
}

pub(super) fn dispatch_recv(
    t: &mut impl Transport,
    job: &LlDispatchRecvJob<'_>,
    spare: &mut [Option<LlDispatchOutput>],
) -> LlAttempt<LlRecvOut> {
    let r = job.arena.num_ranks;
    let lent: Vec<Mutex<Option<LlDispatchOutput>>> =
        spare.iter_mut().map(|s| Mutex::new(s.take())).collect();
    let out: Vec<Mutex<Option<ll::LlRecvOut>>> = (0..r).map(|_| Mutex::new(None)).collect();
    let expired = Expired::new(r);
    let phase = ll::dispatch_recv_phase(
        job.arena,
        job.op,
        job.rows,
        job.keep,
        job.mutation,
        &out,
        &lent,
        &expired,
    );
    let res = attempt(t, phase, job.op, &expired, &out, "ll-receiver");
    for (s, m) in spare.iter_mut().zip(lent) {
        *s = m.into_inner().unwrap_or_else(PoisonError::into_inner);
    }
    res
}

pub(super) fn expert_output(t: &mut impl Transport, job: &LlExpertOutputJob<'_>) -> LlAttempt<()> {
    let expired = Expired::new(job.arena.num_ranks);
    let phase = ll::expert_output_phase(job.arena, job.op, job.expert_out);
    attempt(t, phase, job.op, &expired, &[], "expert-gemm")
}

/// Each unmasked rank's `topk_idx` and `topk_weights` (bit for bit) equal to its dispatch's.
pub(super) fn check_combine(job: &LlCombineCheck<'_>) -> Result<()> {
    for s in (0..job.masked.len()).filter(|&s| !job.masked[s]) {
        let (Some(rt), Some(inp)) = (&job.handles[s], job.inputs.get(s)) else {
            continue;
        };
        if rt.topk_idx != inp.topk_idx
            || rt.topk_weights.data().iter().map(|w| w.to_bits()).ne(inp
                .topk_weights
                .data()
                .iter()
                .map(|w| w.to_bits()))
        {
            return Err(Error::LowLatencyRoutingChanged { rank: s });
        }
    }
    Ok(())
}

pub(super) fn combine_send(t: &mut impl Transport, job: &LlCombineSendJob<'_>) -> LlAttempt<()> {
    let expired = Expired::new(job.arena.num_ranks);
    let y = match job.expert_out {
        Some(y) => ExpertOut::Host(y),
        None => ExpertOut::ZeroCopy,
    };
    let phase = ll::combine_send_phase(job.arena, job.op, job.handles, y, job.use_logfmt);
    let phase = assume_zero(phase, job.arena, job.fresh);
    attempt(t, phase, job.op, &expired, &[], "ll-combiner")
}

pub(super) fn combine_recv(
    t: &mut impl Transport,
    job: &LlCombineRecvJob<'_>,
) -> LlAttempt<Tensor2<bf16>> {
    let r = job.arena.num_ranks;
    let out: Vec<Mutex<Option<Tensor2<bf16>>>> = (0..r).map(|_| Mutex::new(None)).collect();
    let expired = Expired::new(r);
    let phase = ll::combine_recv_phase(job.arena, job.op, job.keep, &out, &expired, job.use_logfmt);
    attempt(t, phase, job.op, &expired, &out, "ll-reducer")
}

pub(super) fn clean(t: &mut impl Transport, job: &LlCleanJob<'_>) -> Result<()> {
    t.run_phase(ll::clean_phase(job.arena, job.call, job.masked))
        .map(drop)
}

#[cfg(feature = "test-support")]
pub(super) fn foreign_use(
    t: &mut impl Transport,
    job: &crate::executor::jobs::LlForeignUseJob<'_>,
) -> Result<()> {
    t.run_phase(ll::scribble_phase(job.arena, job.call, job.value))
        .map(drop)
}

#[cfg(feature = "test-support")]
pub(super) fn poison_data(
    t: &mut impl Transport,
    job: &crate::executor::jobs::LlPoisonDataJob<'_>,
) -> Result<()> {
    t.run_phase(ll::poison_data_phase(
        job.arena, job.call, job.byte, job.masked,
    ))
    .map(drop)
}
