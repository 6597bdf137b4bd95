//! Normal intranode agents (docs/protocol.md §2): count exchange, direct-placement dispatch,
//! cached dispatch, pull combine. Every row moves with one `store` or `load`.

#![allow(
    clippy::needless_range_loop,
    reason = "indices name ranks, experts and channels, as the protocol document does"
)]

use std::sync::Mutex;

use half::bf16;

use super::ProtocolMutation;
use super::bytes::{
    accumulate_bf16_row, get_bf16_row, get_f32, get_f32s, get_i32, get_i64, put_bf16_row, put_f32,
    put_f32s, put_i32, put_i64,
};
use super::layout::{
    NormalCtrl, NormalData, RowFormat, channel_half, channel_range, count_record_channel,
    count_record_fields, normal_final_row, parity, table_fields,
};
use super::signal::{counted, counted_until, counted_value, ll_count};
use crate::error::{Error, Result};
use crate::plan::combine::{init_accumulator, round_row};
use crate::plan::intranode::{IntranodeHandle, before, sender_channels};
use crate::plan::layout::DispatchLayout;
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::Tensor2;
use crate::transport::{AgentCtx, Cmp, Phase, PhaseKind, SymAddr, SymAlloc, WaitUntil};

/// The normal-mode arena of a `Buffer`: control words and data (docs/protocol.md §2.1).
#[derive(Clone, Debug)]
pub struct NormalArena {
    pub(crate) num_ranks: usize,
    pub(crate) ctrl: SymAlloc,
    pub(crate) data: SymAlloc,
}

impl NormalArena {
    /// The arena of `num_ranks` ranks over the allocations `ctrl` and `data` (what an
    /// executor's `alloc_normal` gives).
    #[must_use]
    pub fn new(num_ranks: usize, ctrl: SymAlloc, data: SymAlloc) -> Self {
        Self {
            num_ranks,
            ctrl,
            data,
        }
    }

    pub(crate) fn ctrl_layout(&self) -> NormalCtrl {
        NormalCtrl {
            num_ranks: self.num_ranks,
        }
    }
    pub(crate) fn data_layout(&self) -> NormalData {
        NormalData {
            num_ranks: self.num_ranks,
            data_bytes: self.data.region.len,
        }
    }
    fn word(&self, off: u64) -> SymAddr {
        self.ctrl.at(off)
    }
    fn at(&self, off: u64) -> SymAddr {
        self.data.at(off)
    }
}

fn wait_eq(
    ctx: &mut dyn AgentCtx,
    rank: usize,
    word: SymAddr,
    value: u64,
    what: impl FnOnce() -> String,
) -> Result<u64> {
    ctx.wait(&WaitUntil {
        rank,
        word,
        cmp: Cmp::Eq,
        value,
        what: what(),
    })
}

/// A patient wait, for a word whose writer itself waits (bounded) on other ranks first: the own
/// table (written by the notify agent after every count record), `done` (written by senders
/// after their table or `ready` waits), `pulled` (written by reducers after every `y_ready`). An
/// expiry is re-armed up to `R + 1` times so that when a rank fails, the first-order wait that
/// names it expires first and ends the phase (docs/protocol.md §7.1), rather than this one,
/// which would name a rank that is merely blocked. Still bounded: `R + 2` wait bounds at most.
fn wait_eq_patient(
    ctx: &mut dyn AgentCtx,
    rank: usize,
    word: SymAddr,
    value: u64,
    what: impl FnOnce() -> String,
) -> Result<u64> {
    let until = WaitUntil {
        rank,
        word,
        cmp: Cmp::Eq,
        value,
        what: what(),
    };
    for _ in 0..=ctx.num_ranks() {
        if let Some(v) = ctx.wait_or_expire(&until)? {
            return Ok(v);
        }
    }
    ctx.wait(&until)
}

/// Waits for this rank's `head[p][s2][e]` word of call `call` (released by `s2`'s notify agent)
/// and returns its count `n_{s2}[e]`. A word of another call is
/// [`Error::SignalEpochMismatch`]: an earlier call's stays below the threshold, a later one
/// cannot be there before this rank finished this call (docs/protocol.md §2.3).
fn wait_head(
    ctx: &mut dyn AgentCtx,
    arena: &NormalArena,
    call: u64,
    s2: usize,
    e: usize,
) -> Result<u32> {
    let word = arena.word(arena.ctrl_layout().head(parity(call), s2, e));
    let what = format!("count of rank {s2} for rank {e}, call {call}");
    let until = counted_until(ctx.me().rank, word, call, what);
    let v = ctx.wait(&until)?;
    counted_value(&until, call, v)
}

/// Waits for `table_ready[p] == call` of this rank (patiently: [`wait_eq_patient`]).
fn wait_own_table(ctx: &mut dyn AgentCtx, arena: &NormalArena, call: u64) -> Result<()> {
    let s = ctx.me().rank;
    let word = arena.word(arena.ctrl_layout().table_ready(parity(call)));
    wait_eq_patient(ctx, s, word, call, || format!("own table of call {call}")).map(|_| ())
}

/// What the count exchange of a rank computed (the host-visible part of its outputs; the
/// receiver gives `recv_channel_prefix_matrix`, from the records' channel prefix parts).
#[derive(Clone, Debug)]
pub(crate) struct NotifyResult {
    pub(crate) rank_prefix_matrix: Tensor2<i32>,
    pub(crate) channel_prefix_matrix: Tensor2<i32>,
    pub(crate) send_head: Tensor2<i32>,
    pub(crate) num_recv: usize,
    pub(crate) expert_list: Vec<i32>,
}

/// What a dispatch receiver loaded from its arena.
#[derive(Clone, Debug)]
pub(crate) struct RecvResult {
    /// `None` when the rows stay in the arena (docs/protocol.md §2.6).
    pub(crate) recv_x: Option<Activations>,
    pub(crate) src_idx: Vec<i32>,
    pub(crate) topk_idx: Option<Tensor2<ExpertIdx>>,
    pub(crate) topk_weights: Option<Tensor2<f32>>,
}

/// A non-cached normal dispatch of all ranks.
pub(crate) struct DispatchJob<'a> {
    pub(crate) inputs: &'a [RankInputs],
    pub(crate) layouts: &'a [DispatchLayout],
    pub(crate) num_local_experts: usize,
    pub(crate) num_channels: usize,
    pub(crate) expert_alignment: usize,
    pub(crate) num_worst_tokens: usize,
    pub(crate) with_topk: bool,
    pub(crate) fmt: RowFormat,
    /// The received rows stay in the arena: the receiver loads only their meta parts
    /// (docs/protocol.md §2.6).
    pub(crate) in_place: bool,
}

/// Output slots of a dispatch phase, one per rank.
pub(crate) struct DispatchSlots {
    pub(crate) notify: Vec<Mutex<Option<NotifyResult>>>,
    pub(crate) recv: Vec<Mutex<Option<RecvResult>>>,
    /// The receiver's `recv_channel_prefix_matrix` (`[R, C]`).
    pub(crate) recv_cpm: Vec<Mutex<Option<Tensor2<i32>>>>,
}

impl DispatchSlots {
    pub(crate) fn new(r: usize) -> Self {
        Self {
            notify: (0..r).map(|_| Mutex::new(None)).collect(),
            recv: (0..r).map(|_| Mutex::new(None)).collect(),
            recv_cpm: (0..r).map(|_| Mutex::new(None)).collect(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(crate) fn put_slot<T>(m: &Mutex<Option<T>>, v: T) {
    *lock(m) = Some(v);
}

/// Takes the result that `rank`'s agent `what` left in `m`.
pub(crate) fn take_slot<T>(m: &Mutex<Option<T>>, rank: usize, what: &str) -> Result<T> {
    lock(m).take().ok_or_else(|| Error::AgentFailed {
        rank,
        agent: what.to_owned(),
        detail: "the agent finished without producing its result".into(),
    })
}

/// The parsed table of a rank (its receiver's part: the senders take their block starts from
/// the count records).
struct Table {
    recv_begin: Vec<u32>,
}

fn load_table(ctx: &mut dyn AgentCtx, arena: &NormalArena, rank: usize, p: u64) -> Result<Table> {
    let r = arena.num_ranks;
    let (_, fr) = table_fields(r);
    let mut buf = vec![0u8; 4 * (r + 1)];
    ctx.load(rank, arena.at(arena.data_layout().table(p) + fr), &mut buf)?;
    Ok(Table {
        recv_begin: (0..=r).map(|i| get_i32(&buf, 4 * i) as u32).collect(),
    })
}

/// Encodes the x part (and FP8 scales) of token `t` into a record.
fn put_x(rec: &mut [u8], x: &Activations, t: usize, fmt: RowFormat) {
    match x {
        Activations::Bf16(x) => put_bf16_row(rec, x.row(t)),
        Activations::Fp8 { data, scales } => {
            rec[..fmt.hidden].copy_from_slice(data.row(t));
            let so = fmt.scales_offset() as usize;
            put_f32s(&mut rec[so..], scales.row(t));
        }
    }
}

/// Fills the meta part of a record: `src_idx`, and top-k remapped to `d`'s local experts.
fn put_meta(
    rec: &mut [u8],
    fmt: RowFormat,
    t: usize,
    topk: Option<(&[ExpertIdx], &[f32])>,
    d: usize,
    num_local: usize,
) {
    let mo = fmt.meta_offset() as usize;
    put_i32(rec, mo, t as i32);
    put_i32(rec, mo + 4, 0);
    let k = fmt.num_topk;
    let (ti, wo) = (
        fmt.topk_idx_offset() as usize,
        fmt.topk_weights_offset() as usize,
    );
    if let Some((idx, w)) = topk {
        let lo = (d * num_local) as ExpertIdx;
        let hi = lo + num_local as ExpertIdx;
        for j in 0..k {
            let e = idx[j];
            let (li, wi) = if e >= lo && e < hi {
                (e - lo, w[j])
            } else {
                (-1, 0.0)
            };
            put_i64(rec, ti + 8 * j, li);
            put_f32(rec, wo + 4 * j, wi);
        }
    }
}

/// A tail record (worst-token mode): zero data and scales, `src_idx = -1`, top-k `-1` / `0.0`.
fn tail_record(fmt: RowFormat) -> Vec<u8> {
    let mut rec = vec![0u8; fmt.dispatch_record() as usize];
    let mo = fmt.meta_offset() as usize;
    put_i32(&mut rec, mo, -1);
    for j in 0..fmt.num_topk {
        put_i64(&mut rec, fmt.topk_idx_offset() as usize + 8 * j, -1);
    }
    rec
}

/// Bytes of arena rows a receiver loads (or a publisher stores) per operation: the rows move in
/// chunks through a buffer that stays in cache, never through a second copy of all of them.
const ROW_CHUNK_BYTES: usize = 1 << 20;

/// Zeroed outputs of `rows` rows (`recv_x` only when the rows leave the arena).
fn recv_outputs(
    rows: usize,
    fmt: RowFormat,
    like: &Activations,
    with_topk: bool,
    in_place: bool,
) -> RecvResult {
    let (h, k) = (fmt.hidden, fmt.num_topk);
    let recv_x = (!in_place).then(|| match like {
        Activations::Bf16(_) => Activations::Bf16(Tensor2::zeros(rows, h)),
        Activations::Fp8 { scales, .. } => Activations::Fp8 {
            data: Tensor2::filled(rows, h, 0u8),
            scales: Tensor2::filled(rows, scales.cols(), 0.0f32),
        },
    });
    RecvResult {
        recv_x,
        src_idx: vec![-1i32; rows],
        topk_idx: with_topk.then(|| Tensor2::filled(rows, k, -1 as ExpertIdx)),
        topk_weights: with_topk.then(|| Tensor2::filled(rows, k, 0.0f32)),
    }
}

/// Parses the x part (and FP8 scales) of record `rec` into row `j` of `x`.
pub(crate) fn parse_x(rec: &[u8], j: usize, fmt: RowFormat, x: &mut Activations) {
    match x {
        Activations::Bf16(x) => get_bf16_row(rec, x.row_mut(j)),
        Activations::Fp8 { data, scales } => {
            data.row_mut(j).copy_from_slice(&rec[..fmt.hidden]);
            get_f32s(&rec[fmt.scales_offset() as usize..], scales.row_mut(j));
        }
    }
}

/// Parses the meta part `meta` of a record (`src_idx`, top-k; it starts at
/// `fmt.meta_offset()`) into row `j` of `out`.
fn parse_meta(meta: &[u8], j: usize, fmt: RowFormat, out: &mut RecvResult) {
    let mo = fmt.meta_offset() as usize;
    let (ti, wo) = (
        fmt.topk_idx_offset() as usize - mo,
        fmt.topk_weights_offset() as usize - mo,
    );
    out.src_idx[j] = get_i32(meta, 0);
    if let (Some(idx), Some(w)) = (&mut out.topk_idx, &mut out.topk_weights) {
        for kk in 0..fmt.num_topk {
            idx.set(j, kk, get_i64(meta, ti + 8 * kk));
            w.set(j, kk, get_f32(meta, wo + 4 * kk));
        }
    }
}

/// Parses the dispatch records in `buf` into rows `first..` of `out`.
fn parse_rows(buf: &[u8], first: usize, fmt: RowFormat, out: &mut RecvResult) {
    let drec = fmt.dispatch_record() as usize;
    let mo = fmt.meta_offset() as usize;
    for (i, rec) in buf.chunks_exact(drec).enumerate() {
        let j = first + i;
        if let Some(x) = &mut out.recv_x {
            parse_x(rec, j, fmt, x);
        }
        parse_meta(&rec[mo..], j, fmt, out);
    }
}

/// What a dispatch receiver (of a cached dispatch or not) waits for and loads.
struct Receive<'a> {
    call: u64,
    /// Channels of every source rank: the `done[s][c]` words to wait for.
    num_channels: &'a [usize],
    /// Rows the senders store.
    num_recv: usize,
    /// Rows of the output (`num_recv`, or more in worst-token mode: the tail).
    rows: usize,
    fmt: RowFormat,
    /// Activations of the dispatch's kind (BF16 or FP8 with its scale columns).
    like: &'a Activations,
    with_topk: bool,
    /// The rows stay in the arena: only their meta parts are loaded (docs/protocol.md §2.6).
    in_place: bool,
}

/// The receive side shared by dispatch and cached dispatch: wait every `done[s][c]`, write the
/// tail, load rows `[0, rows)` — whole records, or only their meta parts when the rows stay in
/// the arena (`in_place`, docs/protocol.md §2.6).
fn receive(ctx: &mut dyn AgentCtx, arena: &NormalArena, rx: &Receive<'_>) -> Result<RecvResult> {
    let Receive {
        call,
        num_channels,
        num_recv,
        rows,
        fmt,
        like,
        with_topk,
        in_place,
    } = *rx;
    let d = ctx.me().rank;
    let ctrl = arena.ctrl_layout();
    let data = arena.data_layout();
    for (s, &cs) in num_channels.iter().enumerate() {
        for c in 0..cs {
            for h in 0..2 {
                wait_eq_patient(ctx, d, arena.word(ctrl.done(s, c, h)), call, || {
                    format!("done of rank {s} channel {c} half {h} for call {call}")
                })?;
            }
        }
    }
    let drec = fmt.dispatch_record();
    if rows > num_recv {
        let one = tail_record(fmt);
        let mut tail = Vec::with_capacity(one.len() * (rows - num_recv));
        for _ in num_recv..rows {
            tail.extend_from_slice(&one);
        }
        ctx.store(d, arena.at(data.dispatch_row(num_recv as u64, drec)), &tail)?;
    }
    let mut out = recv_outputs(rows, fmt, like, with_topk, in_place);
    if in_place {
        let mo = fmt.meta_offset();
        let mut meta = vec![0u8; (drec - mo) as usize];
        for j in 0..rows {
            let at = data.dispatch_row(j as u64, drec) + mo;
            ctx.load(d, arena.at(at), &mut meta)?;
            parse_meta(&meta, j, fmt, &mut out);
        }
        return Ok(out);
    }
    let chunk = (ROW_CHUNK_BYTES / drec as usize).clamp(1, rows.max(1));
    let mut buf = vec![0u8; chunk * drec as usize];
    for first in (0..rows).step_by(chunk) {
        let n = chunk.min(rows - first);
        let part = &mut buf[..n * drec as usize];
        ctx.load(d, arena.at(data.dispatch_row(first as u64, drec)), part)?;
        parse_rows(part, first, fmt, &mut out);
    }
    Ok(out)
}

/// The non-cached dispatch phase (docs/protocol.md §2.3).
pub(crate) fn dispatch_phase<'a>(
    arena: &'a NormalArena,
    job: &'a DispatchJob<'a>,
    call: u64,
    mutation: ProtocolMutation,
    slots: &'a DispatchSlots,
) -> Phase<'a> {
    let r = arena.num_ranks;
    let c_count = job.num_channels;
    let mut phase = Phase::new(PhaseKind::DispatchSend, call);
    for s in 0..r {
        phase = phase.agent(s, 0, "notify", move |ctx: &mut dyn AgentCtx| {
            notify(ctx, arena, job, call, mutation, &slots.notify[s])
        });
        for c in 0..c_count {
            phase = phase.agent(s, 1 + c, "sender", move |ctx: &mut dyn AgentCtx| {
                send(ctx, arena, job, call, c, mutation)
            });
        }
        phase = phase.agent(s, 1 + c_count, "receiver", move |ctx: &mut dyn AgentCtx| {
            let p = parity(call);
            wait_own_table(ctx, arena, call)?;
            let table = load_table(ctx, arena, s, p)?;
            let num_recv = table.recv_begin[r] as usize;
            let rows = if job.num_worst_tokens > 0 {
                job.num_worst_tokens
            } else {
                num_recv
            };
            let chans = vec![c_count; r];
            let rx = Receive {
                call,
                num_channels: &chans,
                num_recv,
                rows,
                fmt: job.fmt,
                like: &job.inputs[0].x,
                with_topk: job.with_topk,
                in_place: job.in_place,
            };
            // Planted bug: the channel prefix parts are read before the `done[s'][c]` that publish them.
            let early = mutation == ProtocolMutation::ReceiverReadsPrefixEarly;
            let early_cpm = if early {
                Some(load_recv_cpm(ctx, arena, p, c_count)?)
            } else {
                None
            };
            let res = receive(ctx, arena, &rx)?;
            // Every `done[s'][c]` is acquired: every sender's prefix entry is visible.
            let recv_cpm = match early_cpm {
                Some(m) => m,
                None => load_recv_cpm(ctx, arena, p, c_count)?,
            };
            put_slot(&slots.recv[s], res);
            put_slot(&slots.recv_cpm[s], recv_cpm);
            Ok(())
        });
    }
    phase
}

/// The receiver's `recv_channel_prefix_matrix` (`[R, C]`, `[s][c] = cpm_s[me][c − 1]`, 0 for
/// `c = 0`, the start of channel `c`) from the channel prefix parts of its count records of
/// parity `p`, entry `c` of which sender `(s, c)` stored before its `done[s][c]` release: call
/// only after acquiring every `done[s][c]` (docs/protocol.md §2.3).
fn load_recv_cpm(
    ctx: &mut dyn AgentCtx,
    arena: &NormalArena,
    p: u64,
    c_count: usize,
) -> Result<Tensor2<i32>> {
    let me = ctx.me().rank;
    let r = arena.num_ranks;
    let mut out = Tensor2::filled(r, c_count, 0i32);
    if c_count < 2 {
        return Ok(out);
    }
    // The starts of channels `1..C` (channel `c`'s entry, its own granule: `[start, end]`, the
    // 8 bytes its sender stored).
    let mut buf = [0u8; 8];
    for s2 in 0..r {
        let at = arena.data_layout().count_record(p, s2);
        for c in 1..c_count {
            ctx.load(me, arena.at(at + count_record_channel(c)), &mut buf)?;
            out.set(s2, c, get_i32(&buf, 0));
        }
    }
    Ok(out)
}

fn notify(
    ctx: &mut dyn AgentCtx,
    arena: &NormalArena,
    job: &DispatchJob<'_>,
    call: u64,
    mutation: ProtocolMutation,
    out: &Mutex<Option<NotifyResult>>,
) -> Result<()> {
    let s = ctx.me().rank;
    let r = arena.num_ranks;
    let l_count = job.num_local_experts;
    let c_count = job.num_channels;
    let p = parity(call);
    let ctrl = arena.ctrl_layout();
    let data = arena.data_layout();
    let lay = &job.layouts[s];
    let (_, fe) = count_record_fields();
    // Planted bug: the record goes to the other parity's slot while `notify` says it is here.
    let p_write = if mutation == ProtocolMutation::CountsWrongParity {
        1 - p
    } else {
        p
    };
    // 1. The rank counts `n_s[0..R]` (the whole row, to every rank) as counted `head` words,
    //    the value in the word: a waiter loads nothing after it. Then the record's expert part
    //    `e_s[d·L..d·L+L]` and `notify[p][s]`. Loads of the inputs only, no scan; entry `c` of
    //    the channel prefix part is sender `(s, c)`'s (§2.3).
    for d in 0..r {
        for (e, &n) in lay.num_tokens_per_rank.iter().enumerate() {
            let v = counted(call, n as u32);
            ctx.store_release(d, arena.word(ctrl.head(p_write, s, e)), v)?;
        }
    }
    let mut head_e = vec![0u8; 4 * l_count];
    for d in 0..r {
        for l in 0..l_count {
            put_i32(
                &mut head_e,
                4 * l,
                lay.num_tokens_per_expert[d * l_count + l],
            );
        }
        if l_count > 0 {
            ctx.store(d, arena.at(data.count_record(p_write, s) + fe), &head_e)?;
        }
        ctx.store_release(d, arena.word(ctrl.notify(p, s)), call)?;
    }
    // The membership scan (the handle's `channel_prefix_matrix` and `send_head`, host outputs),
    // after the releases: nobody waits for it (each sender counts its own channel's prefix; the
    // GPU's channels write these outputs themselves).
    let (cpm, send_head) = sender_channels(&lay.is_token_in_rank, c_count);
    // 2. Every rank's counts from its `head` words, its expert part after its `notify` (never
    //    the prefix part: not yet published).
    let mut counts = Tensor2::filled(r, r, 0i32);
    let mut experts = vec![0i64; l_count];
    let mut e_buf = vec![0u8; 4 * l_count];
    for s2 in 0..r {
        for e in 0..r {
            counts.set(s2, e, wait_head(ctx, arena, call, s2, e)? as i32);
        }
        wait_eq(ctx, s, arena.word(ctrl.notify(p, s2)), call, || {
            format!("count record of rank {s2} for call {call}")
        })?;
        if l_count > 0 {
            ctx.load(s, arena.at(data.count_record(p, s2) + fe), &mut e_buf)?;
        }
        for (l, x) in experts.iter_mut().enumerate() {
            *x += i64::from(get_i32(&e_buf, 4 * l));
        }
    }
    let mut rpm = Tensor2::filled(r, r, 0i32);
    for i in 0..r {
        for j in 0..r {
            let above = before(&rpm, i, j);
            rpm.set(i, j, above + counts.get(i, j));
        }
    }
    let before = |i: usize, j: usize| before(&rpm, i, j);
    let num_recv = rpm.get(r - 1, s) as usize;
    // 3. Table: send_base, recv_begin (+ total).
    let (fb, fr) = table_fields(r);
    let mut table = vec![0u8; fr as usize + 4 * (r + 1)];
    for e in 0..r {
        put_i32(&mut table, fb as usize + 4 * e, before(s, e));
    }
    for s2 in 0..r {
        put_i32(&mut table, fr as usize + 4 * s2, before(s2, s));
    }
    put_i32(&mut table, fr as usize + 4 * r, num_recv as i32);
    ctx.store(s, arena.at(data.table(p)), &table)?;
    ctx.store_release(s, arena.word(ctrl.table_ready(p)), call)?;

    let a = job.expert_alignment.max(1) as i64;
    let expert_list = if job.num_worst_tokens > 0 {
        Vec::new()
    } else {
        experts
            .iter()
            .map(|&x| ((x + a - 1) / a * a) as i32)
            .collect()
    };
    // Inputs that disagree (`num_tokens_per_rank` not the count of `is_token_in_rank`) put
    // rows at wrong places; the host refuses them before the phase (`check_dispatch`), the
    // scan's totals refuse them here too, as the GPU's notify block does (EP_ERR_LAYOUT).
    if c_count > 0 {
        for d in 0..r {
            let counted = cpm.get(d, c_count - 1);
            if counted != lay.num_tokens_per_rank[d] {
                return Err(Error::LayoutMismatch {
                    rank: s,
                    field: "num_tokens_per_rank",
                    detail: format!(
                        "{} tokens for rank {d}, is_token_in_rank has {counted} (seen by the \
                         notify agent)",
                        lay.num_tokens_per_rank[d]
                    ),
                });
            }
        }
    }
    put_slot(
        out,
        NotifyResult {
            rank_prefix_matrix: rpm,
            channel_prefix_matrix: cpm,
            send_head,
            num_recv,
            expert_list,
        },
    );
    Ok(())
}

/// Number of tokens before `start` that go to each rank.
fn counts_before(itr: &Tensor2<bool>, start: usize) -> Vec<u32> {
    let mut n = vec![0u32; itr.cols()];
    for t in 0..start {
        for (d, x) in n.iter_mut().enumerate() {
            *x += u32::from(itr.get(t, d));
        }
    }
    n
}

fn send(
    ctx: &mut dyn AgentCtx,
    arena: &NormalArena,
    job: &DispatchJob<'_>,
    call: u64,
    c: usize,
    mutation: ProtocolMutation,
) -> Result<()> {
    let s = ctx.me().rank;
    let r = arena.num_ranks;
    let p = parity(call);
    let inp = &job.inputs[s];
    let itr = &job.layouts[s].is_token_in_rank;
    // Step 1 (docs/protocol.md §2.3): every rank's `head` words, whose counts give this rank's
    // block start on each destination, `send_base[d] = Σ_{s' < s} n_{s'}[d]`; the words from
    // every `d` are also what lets this call's rows into `d` (arena reuse).
    let mut base = vec![0u32; r];
    for s2 in 0..r {
        for (d, b) in base.iter_mut().enumerate() {
            // Planted bug: the counts are read without waiting for their call's words.
            let n = if mutation == ProtocolMutation::SenderSkipsNotify {
                let word = arena.word(arena.ctrl_layout().head(p, s2, d));
                ll_count(ctx.load_u64(s, word)?)
            } else {
                wait_head(ctx, arena, call, s2, d)?
            };
            if s2 < s {
                *b += n;
            }
        }
    }
    let halves = [0, 1].map(|h| channel_half(inp.num_tokens(), job.num_channels, c, h));
    let chan_start = counts_before(itr, halves[0].start);
    let topk = job.with_topk.then_some((&inp.topk_idx, &inp.topk_weights));
    send_rows(
        ctx,
        arena,
        &SendRows {
            call,
            c,
            x: &inp.x,
            itr,
            halves,
            base,
            chan_start,
            fmt: job.fmt,
            topk,
            num_local: job.num_local_experts,
            mutation,
            prefix: Some(p),
        },
    )
}

/// What a sender agent stores: channel `c`'s selected rows, each at its final row on its
/// destination `d` (`base[d] + chan_start[d] + i`, docs/protocol.md §2.3).
struct SendRows<'a> {
    call: u64,
    /// The channel.
    c: usize,
    /// This rank's rows.
    x: &'a Activations,
    /// `[T, R]`: which ranks each token goes to.
    itr: &'a Tensor2<bool>,
    /// The channel's tokens, in its two halves ([`channel_half`]), each published by its own
    /// `done[s][c][h]`.
    halves: [std::ops::Range<usize>; 2],
    /// Per destination, where this rank's block starts.
    base: Vec<u32>,
    /// Per destination, where this channel starts within the block.
    chan_start: Vec<u32>,
    fmt: RowFormat,
    /// The top-k ids and weights that travel with the rows (non-cached dispatch with top-k).
    topk: Option<(&'a Tensor2<ExpertIdx>, &'a Tensor2<f32>)>,
    /// Local experts per rank (to remap the top-k ids).
    num_local: usize,
    mutation: ProtocolMutation,
    /// Non-cached dispatch: the parity of this call's count records, into which the channel's
    /// end prefix `cpm_s[d][c]` goes on every `d` before `done[s][c][1]` (docs/protocol.md §2.3).
    prefix: Option<u64>,
}

/// Stores every selected row of channel `c` at its final row on its destination, releasing
/// `done[s][c][h]` on every rank after the rows of half `h`.
fn send_rows(ctx: &mut dyn AgentCtx, arena: &NormalArena, job: &SendRows<'_>) -> Result<()> {
    let SendRows {
        call,
        c,
        x,
        itr,
        ref halves,
        ref base,
        ref chan_start,
        fmt,
        topk,
        num_local,
        mutation,
        prefix,
    } = *job;
    let s = ctx.me().rank;
    let r = arena.num_ranks;
    let ctrl = arena.ctrl_layout();
    let data = arena.data_layout();
    let drec = fmt.dispatch_record();
    let mut rec = vec![0u8; drec as usize];
    let mut idx = vec![0u32; r];
    // Planted bug: the last row is stored after the releases.
    let mut deferred: Option<(usize, SymAddr, Vec<u8>)> = None;
    for (h, half) in halves.iter().enumerate() {
        for t in half.clone() {
            put_x(&mut rec, x, t, fmt);
            for d in 0..r {
                if !itr.get(t, d) {
                    continue;
                }
                let tk = topk.map(|(idx, w)| (idx.row(t), w.row(t)));
                put_meta(&mut rec, fmt, t, tk, d, num_local);
                let row = normal_final_row(base[d], chan_start[d], idx[d]);
                idx[d] += 1;
                let addr = arena.at(data.dispatch_row(u64::from(row), drec));
                if mutation == ProtocolMutation::ReleaseBeforeLastRow {
                    if let Some((dd, a, b)) = deferred.take() {
                        ctx.store(dd, a, &b)?;
                    }
                    deferred = Some((d, addr, rec.clone()));
                } else {
                    ctx.store(d, addr, &rec)?;
                }
            }
        }
        if let (1, Some(p)) = (h, prefix) {
            // The channel's prefix entry `[start, end]` (its own granule) on every `d`, published
            // by the `done[s][c][1]` below; `d`'s receiver reads it after acquiring that word.
            // The slot's call-`(k − 2)` part was read by `d` inside call `k − 2`, before its head
            // words of call `k`, which this sender waited for (§2.3, arena reuse).
            let at = data.count_record(p, s) + count_record_channel(c);
            for d in 0..r {
                let mut v = [0u8; 8];
                put_i32(&mut v, 0, chan_start[d] as i32);
                put_i32(&mut v, 4, (chan_start[d] + idx[d]) as i32);
                ctx.store(d, arena.at(at), &v)?;
            }
        }
        for d in 0..r {
            ctx.store_release(d, arena.word(ctrl.done(s, c, h)), call)?;
        }
    }
    if let Some((dd, a, b)) = deferred {
        ctx.store(dd, a, &b)?;
    }
    Ok(())
}

/// A cached normal dispatch of all ranks (docs/protocol.md §2.4).
pub(crate) struct CachedJob<'a> {
    pub(crate) xs: &'a [&'a Activations],
    pub(crate) handles: &'a [IntranodeHandle],
    pub(crate) fmt: RowFormat,
}

/// The cached dispatch phase.
pub(crate) fn cached_phase<'a>(
    arena: &'a NormalArena,
    job: &'a CachedJob<'a>,
    call: u64,
    mutation: ProtocolMutation,
    out: &'a [Mutex<Option<RecvResult>>],
) -> Phase<'a> {
    let r = arena.num_ranks;
    let mut phase = Phase::new(PhaseKind::DispatchSend, call);
    let chans: Vec<usize> = job
        .handles
        .iter()
        .map(|h| h.channel_prefix_matrix.cols())
        .collect();
    for d in 0..r {
        phase = phase.agent(d, 0, "ready", move |ctx: &mut dyn AgentCtx| {
            let ctrl = arena.ctrl_layout();
            for s in 0..r {
                ctx.store_release(s, arena.word(ctrl.ready(d)), call)?;
            }
            Ok(())
        });
        let own = &job.handles[d];
        for c in 0..chans[d] {
            phase = phase.agent(d, 1 + c, "sender", move |ctx: &mut dyn AgentCtx| {
                let ctrl = arena.ctrl_layout();
                for e in 0..r {
                    wait_eq(ctx, d, arena.word(ctrl.ready(e)), call, || {
                        format!("ready of rank {e} for cached call {call}")
                    })?;
                }
                let x = job.xs[d];
                let itr = &own.is_token_in_rank;
                let c_count = own.channel_prefix_matrix.cols();
                let halves = [0, 1].map(|h| channel_half(x.num_tokens(), c_count, c, h));
                let send = SendRows {
                    call,
                    c,
                    x,
                    itr,
                    halves,
                    base: (0..r).map(|e| own.rank_start(d, e) as u32).collect(),
                    chan_start: (0..r).map(|e| own.channel_start(e, c) as u32).collect(),
                    fmt: job.fmt,
                    topk: None,
                    num_local: 0,
                    mutation,
                    prefix: None,
                };
                send_rows(ctx, arena, &send)
            });
        }
        let chans = chans.clone();
        phase = phase.agent(
            d,
            1 + chans[d],
            "receiver",
            move |ctx: &mut dyn AgentCtx| {
                let own = &job.handles[d];
                let rx = Receive {
                    call,
                    num_channels: &chans,
                    num_recv: own.num_recv_tokens,
                    rows: own.recv_src_idx.len(),
                    fmt: job.fmt,
                    like: job.xs[0],
                    with_topk: false,
                    in_place: false,
                };
                let res = receive(ctx, arena, &rx)?;
                put_slot(&out[d], res);
                Ok(())
            },
        );
    }
    phase
}

/// An expert applied to received rows: `(rank, first row, rows as dispatched, outputs)` with
/// one BF16 output row per input row (`Buffer::apply_expert`).
pub type Expert = dyn Fn(usize, usize, &Activations, &mut Tensor2<bf16>) -> Result<()> + Sync;

type ExpertFn<'a> = &'a Expert;

/// What the expert phase runs: `expert` over `rows[s]` rows of format `fmt` on each rank `s`,
/// its outputs stored as records of format `out` (with the dispatched weights when
/// `with_topk`); `like` is an empty tensor of the rows' kind.
#[derive(Clone, Copy)]
pub(crate) struct ExpertJob<'a> {
    pub(crate) fmt: RowFormat,
    pub(crate) out: RowFormat,
    pub(crate) rows: &'a [usize],
    pub(crate) with_topk: bool,
    pub(crate) like: &'a Activations,
    pub(crate) expert: ExpertFn<'a>,
}

/// The expert phase (docs/protocol.md §2.6): on each rank one agent loads its received rows
/// `[0, rows[s])` a chunk at a time from its dispatch rows, hands them to `expert`, and stores
/// the outputs — with the rows' dispatched weights when `with_topk` — as records of format
/// `out` in its own combine rows. Local loads and stores only.
pub(crate) fn expert_phase<'a>(arena: &'a NormalArena, job: ExpertJob<'a>, call: u64) -> Phase<'a> {
    let ExpertJob {
        fmt,
        out,
        rows,
        with_topk,
        like,
        expert,
    } = job;
    let mut phase = Phase::new(PhaseKind::Custom("expert".into()), call);
    for (s, &n) in rows.iter().enumerate() {
        phase = phase.agent(s, 0, "expert", move |ctx: &mut dyn AgentCtx| {
            let data = arena.data_layout();
            let (drec, yrec) = (
                fmt.dispatch_record() as usize,
                out.combine_record() as usize,
            );
            let (h, k) = (fmt.hidden, fmt.num_topk);
            let w_in = fmt.topk_weights_offset() as usize;
            let w_out = crate::protocol::layout::align16(2 * h as u64) as usize;
            let chunk = (ROW_CHUNK_BYTES / drec).clamp(1, n.max(1));
            let mut recs = vec![0u8; chunk * drec];
            let mut ys = vec![0u8; chunk * yrec];
            for c0 in (0..n).step_by(chunk) {
                let m = chunk.min(n - c0);
                ctx.load(
                    s,
                    arena.at(data.dispatch_row(c0 as u64, drec as u64)),
                    &mut recs[..m * drec],
                )?;
                let mut x = recv_outputs(m, fmt, like, false, false)
                    .recv_x
                    .ok_or_else(|| Error::AgentFailed {
                        rank: s,
                        agent: "expert".into(),
                        detail: "no row buffer".into(),
                    })?;
                for (i, rec) in recs[..m * drec].chunks_exact(drec).enumerate() {
                    parse_x(rec, i, fmt, &mut x);
                }
                let mut y = Tensor2::zeros(m, h);
                expert(s, c0, &x, &mut y)?;
                for (i, (yr, rec)) in ys[..m * yrec]
                    .chunks_exact_mut(yrec)
                    .zip(recs.chunks_exact(drec))
                    .enumerate()
                {
                    put_bf16_row(yr, y.row(i));
                    if with_topk {
                        yr[w_out..w_out + 4 * k].copy_from_slice(&rec[w_in..w_in + 4 * k]);
                    }
                }
                ctx.store(
                    s,
                    arena.at(data.combine_row(c0 as u64, yrec as u64)),
                    &ys[..m * yrec],
                )?;
            }
            Ok(())
        });
    }
    phase
}

/// Where the expert outputs of a combine are.
#[derive(Clone, Copy)]
pub(crate) enum CombineSource<'a> {
    /// Host tensors: each rank's publish agent stores them in its combine rows (§2.5).
    Host(&'a [crate::plan::combine::CombineArgs<'a>]),
    /// Already in the arena (§2.6): row `j`'s output is the BF16 x part of dispatch record `j`
    /// (format `fmt`), its weights the record's top-k weights; `bias[s]` are rank `s`'s biases.
    DispatchRows {
        fmt: RowFormat,
        bias: &'a [&'a [Tensor2<bf16>]],
    },
    /// Written into the combine rows by the host before the phase (§2.6): records of format
    /// `fmt` (`fmt.num_topk` = the dispatch's `K`, whether or not the weights are read).
    CombineRows {
        fmt: RowFormat,
        bias: &'a [&'a [Tensor2<bf16>]],
    },
}

impl CombineSource<'_> {
    /// Rank `s`'s biases.
    fn bias(&self, s: usize) -> &[Tensor2<bf16>] {
        match self {
            Self::Host(args) => args[s].bias,
            Self::DispatchRows { bias, .. } | Self::CombineRows { bias, .. } => bias[s],
        }
    }
}

/// A normal combine of all ranks (docs/protocol.md §2.5, §2.6).
pub(crate) struct CombineJob<'a> {
    pub(crate) handles: &'a [IntranodeHandle],
    pub(crate) source: CombineSource<'a>,
    pub(crate) hidden: usize,
    pub(crate) num_topk: usize,
}

/// Where expert row `j` lives in its rank's data arena: `(offset, record bytes, offset of the
/// weights in the record)`; the BF16 row is at the record's start.
fn expert_row(job: &CombineJob<'_>, data: NormalData, j: u64) -> (u64, u64, usize) {
    match &job.source {
        CombineSource::Host(_) => {
            let fmt = RowFormat {
                hidden: job.hidden,
                elem_bytes: 2,
                num_scales: 0,
                num_topk: job.num_topk,
            };
            let yrec = fmt.combine_record();
            let wo = crate::protocol::layout::align16(2 * job.hidden as u64) as usize;
            (data.combine_row(j, yrec), yrec, wo)
        }
        CombineSource::CombineRows { fmt, .. } => {
            let yrec = fmt.combine_record();
            let wo = crate::protocol::layout::align16(2 * fmt.hidden as u64) as usize;
            (data.combine_row(j, yrec), yrec, wo)
        }
        CombineSource::DispatchRows { fmt, .. } => {
            let drec = fmt.dispatch_record();
            let wo = fmt.topk_weights_offset() as usize;
            (data.dispatch_row(j, drec), drec, wo)
        }
    }
}

/// One reducer's rows: `(first token, combined rows, combined weights)`.
/// One reducer's output rows: its channel's rows of `combined_x` and of the combined weights
/// (`K` per row), written in place; taken by the reducer (a second take fails).
pub(crate) type ReducedRows<'o> = Mutex<Option<(&'o mut [bf16], &'o mut [f32])>>;

/// The combine phase.
pub(crate) fn combine_phase<'a>(
    arena: &'a NormalArena,
    job: &'a CombineJob<'a>,
    call: u64,
    mutation: ProtocolMutation,
    out: &'a [Vec<ReducedRows<'a>>],
) -> Phase<'a> {
    let r = arena.num_ranks;
    let chans: Vec<usize> = job
        .handles
        .iter()
        .map(|h| h.channel_prefix_matrix.cols())
        .collect();
    let mut phase = Phase::new(PhaseKind::CombineSend, call);
    for d in 0..r {
        let chans_d = chans.clone();
        phase = phase.agent(d, 0, "publish", move |ctx: &mut dyn AgentCtx| {
            let ctrl = arena.ctrl_layout();
            if let CombineSource::Host(args) = &job.source {
                publish_rows(ctx, arena, job, &args[d])?;
            }
            for s in 0..r {
                ctx.store_release(s, arena.word(ctrl.y_ready(d)), call)?;
            }
            for (s, &cs) in chans_d.iter().enumerate() {
                for c in 0..cs {
                    wait_eq_patient(ctx, d, arena.word(ctrl.pulled(s, c)), call, || {
                        format!("pull of rank {s} channel {c} for call {call}")
                    })?;
                }
            }
            Ok(())
        });
        for c in 0..chans[d] {
            let s = d;
            phase = phase.agent(s, 1 + c, "reducer", move |ctx: &mut dyn AgentCtx| {
                let rows = take_slot(&out[s][c], s, "reducer output")?;
                reduce(ctx, arena, job, call, c, mutation, rows)
            });
        }
    }
    phase
}

/// The publish agent's stores of host expert outputs into its combine rows (§2.5).
fn publish_rows(
    ctx: &mut dyn AgentCtx,
    arena: &NormalArena,
    job: &CombineJob<'_>,
    a: &crate::plan::combine::CombineArgs<'_>,
) -> Result<()> {
    let d = ctx.me().rank;
    let data = arena.data_layout();
    let rows = a.x.rows();
    let (_, yrec, wo) = expert_row(job, data, 0);
    let chunk = (ROW_CHUNK_BYTES / yrec as usize).clamp(1, rows.max(1));
    let mut buf = vec![0u8; chunk * yrec as usize];
    for first in (0..rows).step_by(chunk) {
        let n = chunk.min(rows - first);
        let part = &mut buf[..n * yrec as usize];
        for (i, rec) in part.chunks_exact_mut(yrec as usize).enumerate() {
            put_bf16_row(rec, a.x.row(first + i));
            if let Some(w) = a.topk_weights {
                put_f32s(&mut rec[wo..], w.row(first + i));
            }
        }
        ctx.store(d, arena.at(data.combine_row(first as u64, yrec)), part)?;
    }
    Ok(())
}

/// Reducer `c` of this rank: pulls and sums its channel's tokens into `(out_x, out_w)`.
fn reduce(
    ctx: &mut dyn AgentCtx,
    arena: &NormalArena,
    job: &CombineJob<'_>,
    call: u64,
    c: usize,
    mutation: ProtocolMutation,
    (out_x, out_w): (&mut [bf16], &mut [f32]),
) -> Result<()> {
    let s = ctx.me().rank;
    let r = arena.num_ranks;
    let ctrl = arena.ctrl_layout();
    let data = arena.data_layout();
    if mutation != ProtocolMutation::CombineSkipYReady {
        for d in 0..r {
            wait_eq(ctx, s, arena.word(ctrl.y_ready(d)), call, || {
                format!("combine rows of rank {d} for call {call}")
            })?;
        }
    }
    let own = &job.handles[s];
    let h = job.hidden;
    let k = job.num_topk;
    let c_count = own.channel_prefix_matrix.cols();
    let range = channel_range(own.send_head.rows(), c_count, c);
    if out_x.len() != range.len() * h || out_w.len() != range.len() * k {
        return Err(Error::AgentFailed {
            rank: s,
            agent: format!("reducer {c}"),
            detail: "output rows do not match the channel's tokens".into(),
        });
    }
    let mut acc = vec![0.0f32; h];
    let (_, rec_len, wo) = expert_row(job, data, 0);
    debug_assert!((wo + 4 * k).max(2 * h) as u64 <= rec_len);
    // Only the BF16 row and the weights are read (never a padding byte).
    let mut y = vec![0u8; 2 * h];
    let mut wb = vec![0u8; 4 * k];
    let mut w = vec![0.0f32; k];
    let bias = job.source.bias(s);
    let base: Vec<i32> = (0..r)
        .map(|d| own.rank_start(s, d) + own.channel_start(d, c))
        .collect();
    for (i, t) in range.enumerate() {
        init_accumulator(
            &mut acc,
            bias.first().map(|b| b.row(t)),
            bias.get(1).map(|b| b.row(t)),
        );
        let ow = &mut out_w[i * k..(i + 1) * k];
        for d in 0..r {
            let slot = own.send_head.get(t, d);
            if slot < 0 {
                continue;
            }
            let j = (base[d] + slot) as u64;
            let at = expert_row(job, data, j).0;
            ctx.load(d, arena.at(at), &mut y)?;
            accumulate_bf16_row(&mut acc, &y);
            if k > 0 {
                ctx.load(d, arena.at(at + wo as u64), &mut wb)?;
                get_f32s(&wb, &mut w);
                for (o, v) in ow.iter_mut().zip(&w) {
                    *o += v;
                }
            }
        }
        round_row(&acc, &mut out_x[i * h..(i + 1) * h]);
    }
    for d in 0..r {
        ctx.store_release(d, arena.word(ctrl.pulled(s, c)), call)?;
    }
    Ok(())
}
