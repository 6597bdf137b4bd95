//! Low-latency agents (docs/protocol.md §3): one message per (token, destination rank) with
//! local fan-out, partial sums reduced on the expert's rank, epoch-coded signals, two halves.

#![allow(
    clippy::needless_range_loop,
    reason = "indices name ranks, experts and channels, as the protocol document does"
)]

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use half::bf16;

use super::ProtocolMutation;
use super::bytes::{get_bf16_row, get_f32s, get_u32, put_bf16_row, put_f32s, put_u32};
use super::layout::{
    LL_HEADER_COUNTS_WORD, LL_HEADER_FIRST_WORD, LL_HEADER_MESSAGES_WORD, LL_META_ENTRY_BYTES,
    LL_SIGNAL_QP, LlLayout, ll_combine_signal, ll_data_qp, ll_dispatch_signal, ll_meta_entry,
    ll_meta_entry_decode, ll_meta_head, ll_meta_head_decode, ll_send_group,
};
use super::logfmt_slot::SlotCodec;
use super::normal::put_slot;
use super::signal::{counted_until, counted_value, ll_encode};
use crate::error::{Error, Result};
use crate::numerics::fp8;
use crate::plan::low_latency::{
    LlDispatchOutput, LlHandle, LlRecvX, fma_row, pack_layout_range, packed_zeros_bf16,
    packed_zeros_f32, packed_zeros_i32, packed_zeros_u8,
};
use crate::routing::ExpertIdx;
use crate::tensor::{Tensor2, Tensor3};
use crate::transport::{AgentCtx, Phase, PhaseKind, QpIndex, SignalOp, SymAddr, SymAlloc};

/// The low-latency memory of a `Buffer` (docs/protocol.md §3.1).
#[derive(Clone, Debug)]
pub struct LlArena {
    pub(crate) num_ranks: usize,
    pub(crate) signals: SymAlloc,
    pub(crate) data: SymAlloc,
}

impl LlArena {
    /// The arena of `num_ranks` ranks: `signals` (zeroed) then `data` (poisoned), as an
    /// executor allocated them ([`Executor::alloc_low_latency`](crate::Executor::alloc_low_latency)).
    #[must_use]
    pub fn new(num_ranks: usize, signals: SymAlloc, data: SymAlloc) -> Self {
        Self {
            num_ranks,
            signals,
            data,
        }
    }

    /// The signal words (`ll_signal_bytes`).
    #[must_use]
    pub fn signals(&self) -> &SymAlloc {
        &self.signals
    }

    /// The data: both halves (`LlLayout::half_base`).
    #[must_use]
    pub fn data(&self) -> &SymAlloc {
        &self.data
    }
}

/// Where combine finds each token's expert rows on an expert rank: what the dispatch hook
/// recorded per (source rank, message slot). Returned beside the dispatch outputs; pass it to
/// the combine of the same dispatch.
#[derive(Clone, Debug, PartialEq)]
pub struct LlRoutes {
    /// `msg_start[s]..msg_start[s + 1]`: the messages received from source `s`.
    msg_start: Vec<u32>,
    /// `group_start[s][b]..group_start[s][b + 1]`: the slots of source `s`'s send group `b`
    /// (from its header copies; all zero for a masked source). Combine returns each group's
    /// partials with the group's own signal (docs/protocol.md §3.5).
    group_start: Vec<[u32; SEND_GROUPS + 1]>,
    /// Source token of each message.
    msg_token: Vec<u32>,
    /// `entry_start[m]..entry_start[m + 1]`: the entries of message `m`, in top-k order.
    entry_start: Vec<u32>,
    /// `(local expert, row in the packed layout, weight)`.
    entries: Vec<(u16, u32, f32)>,
    /// This rank's own dispatch routing (combine must use the same).
    pub(crate) topk_idx: Tensor2<ExpertIdx>,
    /// This rank's own dispatch weights (combine must use the same).
    pub(crate) topk_weights: Tensor2<f32>,
}

impl LlRoutes {
    /// Messages received from source `s`.
    #[must_use]
    pub fn num_messages(&self, s: usize) -> usize {
        (self.msg_start[s + 1] - self.msg_start[s]) as usize
    }
}

/// The format of dispatched rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LlRows {
    pub(crate) use_fp8: bool,
    pub(crate) round_scale: bool,
    pub(crate) use_ue8m0: bool,
}

/// One low-latency operation's fixed facts.
#[derive(Clone, Debug)]
pub(crate) struct LlOp {
    pub(crate) call: u64,
    /// Its index among the `Buffer`'s low-latency operations; `half = index % 2`.
    pub(crate) index: u64,
    pub(crate) half: u64,
    pub(crate) layout: LlLayout,
    pub(crate) masked: Vec<bool>,
    pub(crate) num_qps: u16,
    pub(crate) num_experts: usize,
    /// Shrink mode (spec §2.7): receive agents give up on a silent peer (`wait_or_expire`) and
    /// report it in [`Expired`] instead of failing the phase.
    pub(crate) shrink: bool,
}

/// The peers receive agents gave up on during one phase (shrink mode): the `Buffer` masks them
/// and runs the phase again under the new mask (docs/protocol.md §7.3).
#[derive(Debug)]
pub(crate) struct Expired(Vec<AtomicBool>);

impl Expired {
    pub(crate) fn new(num_ranks: usize) -> Self {
        Self((0..num_ranks).map(|_| AtomicBool::new(false)).collect())
    }
    fn mark(&self, r: usize) {
        if let Some(b) = self.0.get(r) {
            b.store(true, Ordering::Relaxed);
        }
    }
    /// The ranks given up on, ascending.
    pub(crate) fn ranks(&self) -> Vec<usize> {
        (0..self.0.len())
            .filter(|&r| self.0[r].load(Ordering::Relaxed))
            .collect()
    }
}

impl LlOp {
    fn at(&self, arena: &LlArena, off: u64) -> SymAddr {
        arena.data.at(self.layout.half_base(self.half) + off)
    }
    fn dsig(&self, arena: &LlArena, s: usize, b: usize) -> SymAddr {
        arena
            .signals
            .at(ll_dispatch_signal(arena.num_ranks, self.half, s, b))
    }
    fn csig(&self, arena: &LlArena, d: usize, b: usize) -> SymAddr {
        arena
            .signals
            .at(ll_combine_signal(arena.num_ranks, self.half, d, b))
    }
    fn live(&self, r: usize) -> bool {
        !self.masked.get(r).copied().unwrap_or(false)
    }
    /// The unmasked destinations of send group `b` on rank `s`, rotated to spread incast.
    fn dests(&self, s: usize, b: usize) -> impl Iterator<Item = usize> + '_ {
        let r = self.layout.num_ranks;
        (0..r)
            .map(move |i| (s + b + i) % r)
            .filter(move |d| self.live(*d))
    }
}

/// Send groups per rank on the simulator (docs/protocol.md §3.3; a GPU rank has one per block).
/// Three, so that the groups' token ranges are uneven and, with fewer than three tokens, empty.
pub(crate) const SEND_GROUPS: usize = 3;

/// Waits for a peer's signal of `call` and returns its message count; in shrink mode `None` when
/// the bound expired (the caller reports the peer in [`Expired`]).
fn wait_signal(
    ctx: &mut dyn AgentCtx,
    shrink: bool,
    rank: usize,
    word: SymAddr,
    call: u64,
    what: impl FnOnce() -> String,
) -> Result<Option<u32>> {
    let until = counted_until(rank, word, call, what());
    let v = if shrink {
        match ctx.wait_or_expire(&until)? {
            Some(v) => v,
            None => return Ok(None),
        }
    } else {
        ctx.wait(&until)?
    };
    counted_value(&until, call, v).map(Some)
}

/// Casts (or copies) token `t` into a row slot.
fn stage_row(row: &[bf16], rows: LlRows, layout: LlLayout, out: &mut [u8]) -> Result<()> {
    if rows.use_fp8 {
        let h = layout.hidden;
        let so = layout.fp8_scales_offset() as usize;
        let mut sc = vec![0f32; h / fp8::FP8_BLOCK];
        fp8::cast_row(row, rows.round_scale, &mut out[..h], &mut sc)?;
        put_f32s(&mut out[so..], &sc);
    } else {
        put_bf16_row(out, row);
    }
    Ok(())
}

/// Dispatch send half (docs/protocol.md §3.3).
pub(crate) fn dispatch_send_phase<'a>(
    arena: &'a LlArena,
    op: &'a LlOp,
    x: &'a [&'a Tensor2<bf16>],
    topk: &'a [(&'a Tensor2<ExpertIdx>, &'a Tensor2<f32>)],
    rows: LlRows,
    mutation: ProtocolMutation,
) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::LowLatencyDispatchSend, op.call);
    for s in (0..arena.num_ranks).filter(|&s| op.live(s)) {
        for b in 0..SEND_GROUPS {
            phase = phase.agent(s, 0, "ll-sender", move |ctx: &mut dyn AgentCtx| {
                dispatch_send(
                    ctx, arena, op, x[s], topk[s].0, topk[s].1, rows, b, mutation,
                )
            });
        }
    }
    phase
}

/// The entries of token `t` on destination `d`: `(k, local expert)` in top-k order.
fn entries_on(idx: &Tensor2<ExpertIdx>, t: usize, d: usize, l_count: usize) -> Vec<(usize, usize)> {
    idx.row(t)
        .iter()
        .enumerate()
        .filter_map(|(k, &e)| usize::try_from(e).ok().map(|e| (k, e)))
        .filter(|&(_, e)| e / l_count == d)
        .map(|(k, e)| (k, e % l_count))
        .collect()
}

/// Send group `b` of rank `s` (docs/protocol.md §3.3): its tokens' rows staged, then per
/// destination its messages' meta records and header copy, the rows in runs, a fence, and the
/// header copy put with `disp_sig[h][s][b]`.
#[allow(clippy::too_many_arguments, reason = "one agent's whole context")]
fn dispatch_send(
    ctx: &mut dyn AgentCtx,
    arena: &LlArena,
    op: &LlOp,
    x: &Tensor2<bf16>,
    idx: &Tensor2<ExpertIdx>,
    weights: &Tensor2<f32>,
    rows: LlRows,
    b: usize,
    mutation: ProtocolMutation,
) -> Result<()> {
    let s = ctx.me().rank;
    let lay = op.layout;
    let l_count = lay.num_local_experts;
    let row_bytes = lay.row() as usize;
    let reuse = mutation == ProtocolMutation::LlStagingReuse;
    let group = ll_send_group(x.rows(), SEND_GROUPS, b);
    let mut buf = vec![0u8; row_bytes];
    // 1. Cast each of the group's tokens once into its staging row.
    if !reuse {
        for t in group.clone() {
            stage_row(x.row(t), rows, lay, &mut buf)?;
            ctx.store(s, op.at(arena, lay.dsend_row(t)), &buf)?;
        }
    }
    // 2. Per destination: meta records, header copy, row puts in runs, fence, header + signal.
    let meta_bytes = lay.meta() as usize;
    let hc = lay.header_copy() as usize;
    let mut header = vec![0u8; hc];
    let mut meta = Vec::new();
    for d in op.dests(s, b) {
        // The rank's whole routing to d: every entry's pos and every expert's count c(l, s);
        // the group's first slot is the messages of the tokens before it.
        let mut pos = vec![0u32; l_count];
        let (mut first, mut n, mut total) = (0usize, 0usize, 0u32);
        meta.clear();
        // Current run: (first slot, first token, length).
        let mut run: Option<(usize, usize, usize)> = None;
        let mut runs = 0u32;
        for t in 0..x.rows() {
            let ent = entries_on(idx, t, d, l_count);
            if ent.is_empty() {
                continue;
            }
            total += 1;
            if !group.contains(&t) {
                if t < group.start {
                    first += 1;
                }
                ent.iter().for_each(|&(_, l)| pos[l] += 1);
                continue;
            }
            let m = meta.len();
            meta.resize(m + meta_bytes, 0);
            let rec = &mut meta[m..];
            rec[..8].copy_from_slice(&ll_meta_head(t as u32, ent.len() as u32));
            for (j, &(k, l)) in ent.iter().enumerate() {
                let o = 8 + j * LL_META_ENTRY_BYTES as usize;
                rec[o..o + 8].copy_from_slice(&ll_meta_entry(
                    l as u16,
                    pos[l] as u16,
                    weights.get(t, k),
                ));
                pos[l] += 1;
            }
            let slot = first + n;
            n += 1;
            if reuse {
                // Planted bug: one staging row reused for every message, no quiet between.
                stage_row(x.row(t), rows, lay, &mut buf)?;
                ctx.store(s, op.at(arena, lay.dsend_row(0)), &buf)?;
                ctx.put(
                    d,
                    QpIndex(ll_data_qp(runs, op.num_qps)),
                    op.at(arena, lay.drecv_row(s, slot)),
                    op.at(arena, lay.dsend_row(0)),
                    row_bytes as u64,
                )?;
                runs += 1;
                continue;
            }
            run = match run {
                Some((s0, t0, len)) if t0 + len == t => Some((s0, t0, len + 1)),
                other => {
                    if let Some(r0) = other {
                        put_run(ctx, arena, op, d, r0, runs)?;
                        runs += 1;
                    }
                    Some((slot, t, 1))
                }
            };
        }
        if let Some(r0) = run {
            put_run(ctx, arena, op, d, r0, runs)?;
        }
        // Planted bug: the group's header copy names the slot after its first.
        let shift = u32::from(mutation == ProtocolMutation::LlGroupFirstOffByOne && b > 0);
        put_u32(&mut header, 4 * LL_HEADER_FIRST_WORD, first as u32 + shift);
        put_u32(&mut header, 4 * LL_HEADER_MESSAGES_WORD, total);
        for (l, &p) in pos.iter().enumerate() {
            put_u32(&mut header, 4 * (LL_HEADER_COUNTS_WORD + l), p);
        }
        let meta_at = lay.header() + (first * meta_bytes) as u64;
        let copy_at = lay.header_copy_at(b);
        if n > 0 {
            ctx.store(s, op.at(arena, lay.dsend_meta(d) + meta_at), &meta)?;
            ctx.put(
                d,
                QpIndex(LL_SIGNAL_QP),
                op.at(arena, lay.drecv(s) + meta_at),
                op.at(arena, lay.dsend_meta(d) + meta_at),
                meta.len() as u64,
            )?;
        }
        ctx.store(s, op.at(arena, lay.dsend_meta(d) + copy_at), &header)?;
        if mutation != ProtocolMutation::LlSignalWithoutFence {
            ctx.fence()?;
        }
        ctx.put_signal(
            d,
            QpIndex(LL_SIGNAL_QP),
            op.at(arena, lay.drecv(s) + copy_at),
            op.at(arena, lay.dsend_meta(d) + copy_at),
            hc as u64,
            op.dsig(arena, s, b),
            SignalOp::Set,
            ll_encode(op.call, n as u32),
        )?;
    }
    ctx.quiet()
}

fn put_run(
    ctx: &mut dyn AgentCtx,
    arena: &LlArena,
    op: &LlOp,
    d: usize,
    (slot, t, len): (usize, usize, usize),
    run: u32,
) -> Result<()> {
    let s = ctx.me().rank;
    let lay = op.layout;
    ctx.put(
        d,
        QpIndex(ll_data_qp(run, op.num_qps)),
        op.at(arena, lay.drecv_row(s, slot)),
        op.at(arena, lay.dsend_row(t)),
        len as u64 * lay.row(),
    )
}

/// What a dispatch hook produced on one rank.
pub(crate) type LlRecvOut = (LlDispatchOutput, LlRoutes);

/// Dispatch receive half, the hook (docs/protocol.md §3.4). `spare[d]`: earlier outputs of
/// receiver `d` whose arrays it may reuse (see [`reuse_recv_x`]).
#[allow(clippy::too_many_arguments, reason = "one phase's whole context")]
pub(crate) fn dispatch_recv_phase<'a>(
    arena: &'a LlArena,
    op: &'a LlOp,
    rows: LlRows,
    topk: &'a [(Tensor2<ExpertIdx>, Tensor2<f32>)],
    mutation: ProtocolMutation,
    out: &'a [Mutex<Option<LlRecvOut>>],
    spare: &'a [Mutex<Option<LlDispatchOutput>>],
    expired: &'a Expired,
) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::LowLatencyDispatchRecv, op.call);
    for d in (0..arena.num_ranks).filter(|&d| op.live(d)) {
        phase = phase.agent(d, 0, "ll-receiver", move |ctx: &mut dyn AgentCtx| {
            let spare = spare.get(d).and_then(|m| {
                m.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .take()
            });
            let res = dispatch_recv(ctx, arena, op, rows, mutation, spare, expired)?;
            let (idx, w) = &topk[d];
            let routes = LlRoutes {
                topk_idx: idx.clone(),
                topk_weights: w.clone(),
                ..res.1
            };
            put_slot(&out[d], (res.0, routes));
            Ok(())
        });
    }
    phase
}

/// Takes the packed arrays of earlier outputs `old` for new outputs of the same format and
/// shape: the rows `old` counted as valid are zeroed again, the others are zero already (the
/// contract of `Buffer::low_latency_dispatch_recv_reusing`). `None` if they do not fit.
fn reuse_recv_x(
    old: LlDispatchOutput,
    rows: LlRows,
    l_count: usize,
    n_rows: usize,
    h: usize,
    scale_cols: usize,
) -> Option<LlRecvX> {
    // Rows `0..counts[l]` of every local expert's matrix zeroed (the shape was checked).
    fn clear<T: Copy>(t: &mut Tensor3<T>, counts: &[usize], zero: T) {
        let cols = t.cols();
        for (l, &c) in counts.iter().enumerate() {
            t.matrix_mut(l)[..c * cols].fill(zero);
        }
    }
    let fits = |s: (usize, usize, usize), cols: usize| s == (l_count, n_rows, cols);
    // FP8 data and scales (f32 or packed UE8M0), valid rows zeroed; `None` if they do not fit.
    fn clear_fp8<S: Copy>(
        (data, scales): (&mut Tensor3<u8>, &mut Tensor3<S>),
        counts: &[usize],
        zero: S,
        (l_count, n_rows, h, scale_cols): (usize, usize, usize, usize),
    ) -> Option<()> {
        let ok =
            data.shape() == (l_count, n_rows, h) && scales.shape() == (l_count, n_rows, scale_cols);
        if ok {
            clear(data, counts, 0);
            clear(scales, counts, zero);
        }
        ok.then_some(())
    }
    let dims = (l_count, n_rows, h, scale_cols);
    let counts: Vec<usize> = old
        .recv_count
        .iter()
        .map(|&c| usize::try_from(c).unwrap_or(0).min(n_rows))
        .collect();
    if counts.len() != l_count {
        return None;
    }
    let mut x = old.recv_x;
    match (&mut x, rows.use_fp8, rows.use_ue8m0) {
        (LlRecvX::Bf16(x), false, _) => {
            if !fits(x.shape(), h) {
                return None;
            }
            clear(x, &counts, bf16::ZERO);
        }
        (LlRecvX::Fp8 { data, scales }, true, false) => {
            clear_fp8((data, scales), &counts, 0.0, dims)?;
        }
        (LlRecvX::Fp8Ue8m0 { data, scales }, true, true) => {
            clear_fp8((data, scales), &counts, 0, dims)?;
        }
        _ => return None,
    }
    Some(x)
}

fn dispatch_recv(
    ctx: &mut dyn AgentCtx,
    arena: &LlArena,
    op: &LlOp,
    rows: LlRows,
    mutation: ProtocolMutation,
    spare: Option<LlDispatchOutput>,
    expired: &Expired,
) -> Result<LlRecvOut> {
    let d = ctx.me().rank;
    let lay = op.layout;
    let r = lay.num_ranks;
    let l_count = lay.num_local_experts;
    let h = lay.hidden;
    let n_rows = r * lay.num_max_tokens;
    let row_bytes = lay.row() as usize;
    let meta_bytes = lay.meta() as usize;
    let hdr = lay.header() as usize;
    let s_count = h / fp8::FP8_BLOCK;
    let packs = s_count.div_ceil(fp8::UE8M0_PER_PACK);
    // The packed layout is mostly empty: earlier outputs handed back are reused (only their
    // valid rows are cleared), otherwise the arrays come from zeroed memory, touched only
    // where rows land.
    let scale_cols = if rows.use_ue8m0 { packs } else { s_count };
    let reused = spare.and_then(|o| reuse_recv_x(o, rows, l_count, n_rows, h, scale_cols));
    let mut recv_x = match (reused, rows.use_fp8, rows.use_ue8m0) {
        (Some(x), _, _) => x,
        (None, false, _) => LlRecvX::Bf16(packed_zeros_bf16(l_count, n_rows, h)),
        (None, true, false) => LlRecvX::Fp8 {
            data: packed_zeros_u8(l_count, n_rows, h),
            scales: packed_zeros_f32(l_count, n_rows, s_count),
        },
        (None, true, true) => LlRecvX::Fp8Ue8m0 {
            data: packed_zeros_u8(l_count, n_rows, h),
            scales: packed_zeros_i32(l_count, n_rows, packs),
        },
    };
    let mut src_info = Tensor2::filled(l_count, n_rows, -1i32);
    let mut layout_range = Tensor2::filled(l_count, r, 0i64);
    let mut begin = vec![0u32; l_count];
    let mut routes = LlRoutes {
        msg_start: vec![0],
        group_start: Vec::new(),
        msg_token: Vec::new(),
        entry_start: vec![0],
        entries: Vec::new(),
        topk_idx: Tensor2::filled(0, 0, 0),
        topk_weights: Tensor2::filled(0, 0, 0.0),
    };
    let mut meta = Vec::new();
    let mut data = Vec::new();
    let mut sc = vec![0f32; s_count];
    let mut bf = vec![bf16::ZERO; h];
    let hc = lay.header_copy() as usize;
    let mut copy = vec![0u8; hc];
    let mut counts = vec![0u8; 4 * l_count];
    for s in 0..r {
        let n = if op.live(s) {
            recv_headers(ctx, arena, op, s, &mut copy, &mut counts)?
        } else {
            None
        };
        let Some(n) = n else {
            // Masked, or given up on (shrink): an empty block at the running offset.
            if op.live(s) {
                expired.mark(s);
            }
            for l in 0..l_count {
                layout_range.set(l, s, pack_layout_range(begin[l], 0));
            }
            routes.msg_start.push(routes.msg_token.len() as u32);
            routes.group_start.push([0; SEND_GROUPS + 1]);
            continue;
        };
        let (n, groups) = n;
        routes.group_start.push(groups);
        meta.resize(n * meta_bytes, 0);
        if n > 0 {
            ctx.load(d, op.at(arena, lay.drecv(s) + hdr as u64), &mut meta)?;
        }
        data.resize(n * row_bytes, 0);
        if n > 0 {
            ctx.load(d, op.at(arena, lay.drecv_row(s, 0)), &mut data)?;
        }
        // Planted bug: blocks after the first start one row late.
        let shift = u32::from(mutation == ProtocolMutation::LlBeginOffByOne && s > 0);
        for i in 0..n {
            let m = i * meta_bytes;
            let (t, cnt) = ll_meta_head_decode(&meta[m..m + 8]);
            let cnt = cnt as usize;
            let row_src = &data[i * row_bytes..(i + 1) * row_bytes];
            routes.msg_token.push(t);
            for j in 0..cnt {
                let o = m + 8 + j * LL_META_ENTRY_BYTES as usize;
                let (l, pos, w) = ll_meta_entry_decode(&meta[o..o + 8]);
                let l = l as usize;
                let row =
                    (begin.get(l).copied().unwrap_or(u32::MAX) + u32::from(pos) + shift) as usize;
                if l >= l_count || row >= n_rows {
                    return Err(Error::LlInvalidLayout {
                        local_expert: l,
                        source_rank: s,
                        detail: format!("entry of token {t} lands on row {row} of {n_rows}"),
                    });
                }
                src_info.set(l, row, t as i32);
                routes.entries.push((l as u16, row as u32, w));
                match &mut recv_x {
                    LlRecvX::Bf16(x) => {
                        get_bf16_row(row_src, &mut bf);
                        x.row_mut(l, row).copy_from_slice(&bf);
                    }
                    LlRecvX::Fp8 { data, scales } => {
                        data.row_mut(l, row).copy_from_slice(&row_src[..h]);
                        get_f32s(&row_src[lay.fp8_scales_offset() as usize..], &mut sc);
                        scales.row_mut(l, row).copy_from_slice(&sc);
                    }
                    LlRecvX::Fp8Ue8m0 { data, scales } => {
                        data.row_mut(l, row).copy_from_slice(&row_src[..h]);
                        get_f32s(&row_src[lay.fp8_scales_offset() as usize..], &mut sc);
                        scales
                            .row_mut(l, row)
                            .copy_from_slice(&fp8::pack_ue8m0(&sc));
                    }
                }
            }
            routes.entry_start.push(routes.entries.len() as u32);
        }
        routes.msg_start.push(routes.msg_token.len() as u32);
        for l in 0..l_count {
            let c = get_u32(&counts, 4 * l);
            layout_range.set(l, s, pack_layout_range(begin[l], c));
            begin[l] += c;
        }
    }
    Ok((
        LlDispatchOutput {
            recv_x,
            recv_count: begin.iter().map(|&c| c as i32).collect(),
            handle: LlHandle {
                src_info,
                layout_range,
                num_max_dispatch_tokens_per_rank: lay.num_max_tokens,
                hidden: h,
                num_experts: op.num_experts,
            },
        },
        routes,
    ))
}

/// Waits for every send group's signal of source `s` and loads its header copy (docs/protocol.md
/// §3.4): the source's message count and its groups' slot ranges, with `c(l, s)` in `counts`;
/// `None` when the source was
/// given up on (shrink). The groups' slot ranges must tile `0..n` and agree on the counts.
fn recv_headers(
    ctx: &mut dyn AgentCtx,
    arena: &LlArena,
    op: &LlOp,
    s: usize,
    copy: &mut [u8],
    counts: &mut [u8],
) -> Result<Option<(usize, [u32; SEND_GROUPS + 1])>> {
    let d = ctx.me().rank;
    let lay = op.layout;
    let mut groups = [0u32; SEND_GROUPS + 1];
    let bad = |detail: String| Error::LlInvalidLayout {
        local_expert: 0,
        source_rank: s,
        detail,
    };
    let (mut n, mut total) = (0usize, 0u32);
    for b in 0..SEND_GROUPS {
        let Some(nb) = wait_signal(ctx, op.shrink, d, op.dsig(arena, s, b), op.call, || {
            format!(
                "dispatch signal of rank {s}, send group {b}, for call {}",
                op.call
            )
        })?
        else {
            return Ok(None);
        };
        ctx.load(d, op.at(arena, lay.drecv(s) + lay.header_copy_at(b)), copy)?;
        let first = get_u32(copy, 4 * LL_HEADER_FIRST_WORD) as usize;
        let t = get_u32(copy, 4 * LL_HEADER_MESSAGES_WORD);
        // Every copy carries the source's totals: the later ones must repeat group 0's.
        let copied = &copy[4 * LL_HEADER_COUNTS_WORD..4 * LL_HEADER_COUNTS_WORD + counts.len()];
        let differs = b > 0 && (t != total || copied != counts);
        if first != n || differs {
            return Err(bad(format!(
                "send group {b}'s header (slots from {first}, {t} messages) disagrees with \
                 the groups before it (slots from {n}, {total} messages)"
            )));
        }
        if b == 0 {
            total = t;
            counts.copy_from_slice(copied);
        }
        n += nb as usize;
        groups[b + 1] = n as u32;
    }
    if n != total as usize || n > lay.num_max_tokens {
        return Err(bad(format!(
            "{n} messages from the groups, {total} announced, N = {}",
            lay.num_max_tokens
        )));
    }
    Ok(Some((n, groups)))
}

/// Where a combine send half reads expert outputs.
#[derive(Clone, Copy)]
pub(crate) enum ExpertOut<'a> {
    /// The zero-copy region `cy` of the operation's half (written before the call).
    ZeroCopy,
    /// The caller's tensors (`[L, R·N, H]` per rank).
    Host(&'a [Option<Tensor3<bf16>>]),
}

/// The phase that writes expert outputs into the zero-copy region (what the caller's GEMM does
/// on the GPU).
pub(crate) fn expert_output_phase<'a>(
    arena: &'a LlArena,
    op: &'a LlOp,
    y: &'a [Option<Tensor3<bf16>>],
) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::Custom("expert_output".into()), op.call);
    for d in (0..arena.num_ranks).filter(|&d| op.live(d)) {
        phase = phase.agent(d, 0, "expert-gemm", move |ctx: &mut dyn AgentCtx| {
            let Some(y) = &y[d] else { return Ok(()) };
            let mut buf = Vec::new();
            for l in 0..y.matrices() {
                let t = y.matrix(l);
                buf.resize(t.len() * 2, 0);
                put_bf16_row(&mut buf, t);
                ctx.store(d, op.at(arena, op.layout.cy(l, 0)), &buf)?;
            }
            Ok(())
        });
    }
    phase
}

/// The codec of a combine's partials: `Some` with `use_logfmt` (docs/protocol.md §3.12), `None`
/// for BF16 partials. Errors unless `H` is a positive multiple of 128 with LogFMT.
pub(crate) fn partial_codec(layout: LlLayout, use_logfmt: bool) -> Result<Option<SlotCodec>> {
    use_logfmt
        .then(|| SlotCodec::new(layout.hidden))
        .transpose()
}

/// Combine send half on the expert ranks (docs/protocol.md §3.5; §3.12 with `use_logfmt`).
pub(crate) fn combine_send_phase<'a>(
    arena: &'a LlArena,
    op: &'a LlOp,
    routes: &'a [Option<LlRoutes>],
    y: ExpertOut<'a>,
    use_logfmt: bool,
) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::LowLatencyCombineSend, op.call);
    for d in (0..arena.num_ranks).filter(|&d| op.live(d)) {
        phase = phase.agent(d, 0, "ll-combiner", move |ctx: &mut dyn AgentCtx| {
            let rt = routes[d].as_ref().ok_or(Error::ShapeMismatch {
                what: "low-latency combine routes",
                expected: format!("routes for unmasked rank {d}"),
                found: "None".into(),
            })?;
            let codec = partial_codec(op.layout, use_logfmt)?;
            combine_send(ctx, arena, op, rt, y, codec.as_ref())
        });
    }
    phase
}

/// Encodes partial `x` of message `i` to source `s` into `csend[s][i]` and its meta record
/// (docs/protocol.md §3.12), then puts them to `s`'s `crecv[me][i]` as the kernels do, unit by
/// unit: each chunk's bytes, then the unit's division metas. `run` numbers the puts to `s`
/// (their QPs); the caller fences before the signal.
#[allow(clippy::too_many_arguments, reason = "one partial's whole context")]
fn put_logfmt_partial(
    ctx: &mut dyn AgentCtx,
    arena: &LlArena,
    op: &LlOp,
    codec: &SlotCodec,
    (s, i): (usize, usize),
    x: &[bf16],
    (slot, metas): (&mut [u8], &mut [u8]),
    run: &mut u32,
) -> Result<()> {
    let d = ctx.me().rank;
    let lay = op.layout;
    let meta = codec.encode(x, slot, metas)?;
    let mut put = |ctx: &mut dyn AgentCtx, dst: u64, src: u64, bytes: &[u8]| -> Result<()> {
        ctx.store(d, op.at(arena, src), bytes)?;
        let qp = QpIndex(ll_data_qp(*run, op.num_qps));
        *run += 1;
        ctx.put(
            s,
            qp,
            op.at(arena, dst),
            op.at(arena, src),
            bytes.len() as u64,
        )
    };
    for unit in codec.units(&meta) {
        for p in &unit.pieces {
            put(
                ctx,
                lay.crecv(d, i) + p.at,
                lay.csend(s, i) + p.at,
                &slot[p.range()],
            )?;
        }
        let m = unit.metas.start as usize..unit.metas.end as usize;
        put(
            ctx,
            lay.crecv_meta(d, i) + unit.metas.start,
            lay.csend_meta(s, i) + unit.metas.start,
            &metas[m],
        )?;
    }
    Ok(())
}

fn combine_send(
    ctx: &mut dyn AgentCtx,
    arena: &LlArena,
    op: &LlOp,
    rt: &LlRoutes,
    y: ExpertOut<'_>,
    codec: Option<&SlotCodec>,
) -> Result<()> {
    let d = ctx.me().rank;
    let lay = op.layout;
    let h = lay.hidden;
    let row_bytes = lay.row() as usize;
    let mut acc = vec![0f32; h];
    let mut yrow = vec![bf16::ZERO; h];
    let mut ybytes = vec![0u8; 2 * h];
    let mut out = vec![bf16::ZERO; h];
    let mut buf = Vec::new();
    let mut metas = vec![0u8; codec.map_or(0, SlotCodec::meta_bytes)];
    for s in op.dests(d, 0) {
        let m0 = rt.msg_start[s] as usize;
        let groups = rt.group_start[s];
        buf.clear();
        buf.resize(rt.num_messages(s) * row_bytes, 0);
        let mut run = 0u32;
        for b in 0..SEND_GROUPS {
            let slots = groups[b] as usize..groups[b + 1] as usize;
            for i in slots.clone() {
                let m = m0 + i;
                let ents = &rt.entries[rt.entry_start[m] as usize..rt.entry_start[m + 1] as usize];
                acc.iter_mut().for_each(|a| *a = 0.0);
                for (j, &(l, _, w)) in ents.iter().enumerate() {
                    // A token naming one expert twice reads the row of its first entry (spec §2.5).
                    let row = ents[..=j].iter().find(|e| e.0 == l).map_or(0, |e| e.1) as usize;
                    let yr: &[bf16] = match y {
                        ExpertOut::ZeroCopy => {
                            ctx.load(d, op.at(arena, lay.cy(l as usize, row)), &mut ybytes)?;
                            get_bf16_row(&ybytes, &mut yrow);
                            &yrow
                        }
                        ExpertOut::Host(t) => t[d]
                            .as_ref()
                            .filter(|t| (l as usize) < t.matrices() && row < t.rows())
                            .map(|t| t.row(l as usize, row))
                            .ok_or(Error::ShapeMismatch {
                                what: "low-latency combine expert outputs",
                                expected: format!("[L, R*N, H] on rank {d}"),
                                found: "missing rows".into(),
                            })?,
                    };
                    fma_row(&mut acc, yr, w);
                }
                for (o, &a) in out.iter_mut().zip(&acc) {
                    *o = crate::numerics::bf16::round(a);
                }
                let slot = &mut buf[i * row_bytes..(i + 1) * row_bytes];
                match codec {
                    None => put_bf16_row(slot, &out),
                    Some(c) => put_logfmt_partial(
                        ctx,
                        arena,
                        op,
                        c,
                        (s, i),
                        &out,
                        (slot, &mut metas),
                        &mut run,
                    )?,
                }
            }
            // BF16: the group's partials in one store and one put with its signal. LogFMT: the
            // pieces are out on the data QPs; a fence orders them before the signal.
            let data = if codec.is_none() {
                slots.len() * row_bytes
            } else {
                0
            };
            let first = slots.start;
            if data > 0 {
                ctx.store(
                    d,
                    op.at(arena, lay.csend(s, first)),
                    &buf[first * row_bytes..first * row_bytes + data],
                )?;
            }
            if codec.is_some() {
                ctx.fence()?;
            }
            ctx.put_signal(
                s,
                QpIndex(LL_SIGNAL_QP),
                op.at(arena, lay.crecv(d, first)),
                op.at(arena, lay.csend(s, first)),
                data as u64,
                op.csig(arena, d, b),
                SignalOp::Set,
                ll_encode(op.call, slots.len() as u32),
            )?;
        }
    }
    ctx.quiet()
}

/// Combine receive half, the hook (docs/protocol.md §3.6; §3.12 with `use_logfmt`).
pub(crate) fn combine_recv_phase<'a>(
    arena: &'a LlArena,
    op: &'a LlOp,
    topk: &'a [(Tensor2<ExpertIdx>, Tensor2<f32>)],
    out: &'a [Mutex<Option<Tensor2<bf16>>>],
    expired: &'a Expired,
    use_logfmt: bool,
) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::LowLatencyCombineRecv, op.call);
    for s in (0..arena.num_ranks).filter(|&s| op.live(s)) {
        phase = phase.agent(s, 0, "ll-reducer", move |ctx: &mut dyn AgentCtx| {
            let codec = partial_codec(op.layout, use_logfmt)?;
            let res = combine_recv(ctx, arena, op, &topk[s].0, expired, codec.as_ref())?;
            put_slot(&out[s], res);
            Ok(())
        });
    }
    phase
}

/// Loads and decodes the LogFMT partials of `slots` rank `d` sent to this rank (docs/protocol.md
/// §3.12): each one's meta words, then only its pieces (the bytes past a cast chunk are not
/// the message's). `H` f32 per partial, in slot order.
fn load_logfmt_partials(
    ctx: &mut dyn AgentCtx,
    arena: &LlArena,
    op: &LlOp,
    codec: &SlotCodec,
    d: usize,
    slots: Range<usize>,
) -> Result<Vec<f32>> {
    let s = ctx.me().rank;
    let lay = op.layout;
    let mut metas = vec![0u8; codec.meta_bytes()];
    let mut slot = vec![0u8; lay.row() as usize];
    let mut out = Vec::with_capacity(slots.len() * lay.hidden);
    for i in slots {
        ctx.load(s, op.at(arena, lay.crecv_meta(d, i)), &mut metas)?;
        for p in codec.pieces(&codec.meta_words(&metas)) {
            ctx.load(
                s,
                op.at(arena, lay.crecv(d, i) + p.at),
                &mut slot[p.range()],
            )?;
        }
        out.extend(codec.decode(&metas, &slot)?);
    }
    Ok(out)
}

fn combine_recv(
    ctx: &mut dyn AgentCtx,
    arena: &LlArena,
    op: &LlOp,
    idx: &Tensor2<ExpertIdx>,
    expired: &Expired,
    codec: Option<&SlotCodec>,
) -> Result<Tensor2<bf16>> {
    let s = ctx.me().rank;
    let lay = op.layout;
    let r = lay.num_ranks;
    let l_count = lay.num_local_experts;
    let h = lay.hidden;
    let row_bytes = lay.row() as usize;
    let t_count = idx.rows();
    // has[t * r + d]: token t has an expert on d.
    let mut has = vec![false; t_count * r];
    for t in 0..t_count {
        for &e in idx.row(t) {
            if let Ok(e) = usize::try_from(e) {
                has[t * r + e / l_count] = true;
            }
        }
    }
    // Per expert rank, its partials as they arrived: BF16 slots, or (LogFMT) decoded to f32.
    let mut parts: Vec<Vec<u8>> = vec![Vec::new(); r];
    let mut decoded: Vec<Vec<f32>> = vec![Vec::new(); r];
    // Ranks whose partials count: unmasked, and not given up on (shrink).
    let mut live: Vec<bool> = (0..r).map(|d| op.live(d)).collect();
    'ranks: for d in (0..r).filter(|&d| op.live(d)) {
        let mut n = 0usize;
        for b in 0..SEND_GROUPS {
            let Some(nb) = wait_signal(ctx, op.shrink, s, op.csig(arena, d, b), op.call, || {
                format!(
                    "combine signal of rank {d}, send group {b}, for call {}",
                    op.call
                )
            })?
            else {
                expired.mark(d);
                live[d] = false;
                continue 'ranks;
            };
            // The group's tokens with an expert on d: the slots it returns, from n on.
            let want = ll_send_group(t_count, SEND_GROUPS, b)
                .filter(|&t| has[t * r + d])
                .count();
            let nb = nb as usize;
            if nb != want {
                return Err(Error::LlInvalidLayout {
                    local_expert: usize::MAX,
                    source_rank: d,
                    detail: format!(
                        "rank {d} returned {nb} partial rows for send group {b}, rank {s} sent it {want} tokens there"
                    ),
                });
            }
            match codec {
                None => {
                    parts[d].resize((n + nb) * row_bytes, 0);
                    if nb > 0 {
                        ctx.load(
                            s,
                            op.at(arena, lay.crecv(d, n)),
                            &mut parts[d][n * row_bytes..],
                        )?;
                    }
                }
                Some(c) => {
                    decoded[d].extend(load_logfmt_partials(ctx, arena, op, c, d, n..n + nb)?)
                }
            }
            n += nb;
        }
    }
    let mut out = Tensor2::zeros(t_count, h);
    let mut acc = vec![0f32; h];
    let mut p = vec![bf16::ZERO; h];
    let mut slot = vec![0usize; r];
    for t in 0..t_count {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for d in 0..r {
            if !has[t * r + d] {
                continue;
            }
            let i = slot[d];
            slot[d] += 1;
            if !live[d] {
                continue;
            }
            if codec.is_some() {
                for (a, v) in acc.iter_mut().zip(&decoded[d][i * h..(i + 1) * h]) {
                    *a += v;
                }
                continue;
            }
            get_bf16_row(&parts[d][i * row_bytes..], &mut p);
            for (a, v) in acc.iter_mut().zip(&p) {
                *a += v.to_f32();
            }
        }
        for (o, &a) in out.row_mut(t).iter_mut().zip(&acc) {
            *o = crate::numerics::bf16::round(a);
        }
    }
    Ok(out)
}

/// The clean phase: zero every low-latency signal word of both halves (docs/protocol.md §3.7).
pub(crate) fn clean_phase<'a>(arena: &'a LlArena, call: u64, masked: &'a [bool]) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::Clean, call);
    for d in (0..arena.num_ranks).filter(|&d| !masked.get(d).copied().unwrap_or(false)) {
        phase = phase.agent(d, 0, "ll-clean", move |ctx: &mut dyn AgentCtx| {
            let zeros = vec![0u8; arena.signals.region.len as usize];
            ctx.store(d, arena.signals.at(0), &zeros)
        });
    }
    phase
}

/// Writes garbage into the low-latency signal words, as other kernels using the same memory
/// would (spec case 20). Test support.
#[cfg(feature = "test-support")]
pub(crate) fn scribble_phase<'a>(arena: &'a LlArena, call: u64, value: u64) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::Custom("foreign-use".into()), call);
    for d in 0..arena.num_ranks {
        phase = phase.agent(d, 0, "foreign", move |ctx: &mut dyn AgentCtx| {
            let words = arena.signals.region.len / 16;
            let mut buf = vec![0u8; arena.signals.region.len as usize];
            for w in 0..words as usize {
                buf[16 * w..16 * w + 8].copy_from_slice(&value.to_le_bytes());
            }
            ctx.store(d, arena.signals.at(0), &buf)
        });
    }
    phase
}

/// Fills the low-latency data of every rank not `masked` with `byte` (both halves; the signal
/// words untouched), so that a later phase reading bytes its operation did not write reads
/// garbage. Test support.
#[cfg(feature = "test-support")]
pub(crate) fn poison_data_phase<'a>(
    arena: &'a LlArena,
    call: u64,
    byte: u8,
    masked: &'a [bool],
) -> Phase<'a> {
    let mut phase = Phase::new(PhaseKind::Custom("poison-data".into()), call);
    for d in (0..arena.num_ranks).filter(|&d| !masked.get(d).copied().unwrap_or(false)) {
        phase = phase.agent(d, 0, "poison", move |ctx: &mut dyn AgentCtx| {
            let bytes = vec![byte; arena.data.region.len as usize];
            ctx.store(d, arena.data.at(0), &bytes)
        });
    }
    phase
}
