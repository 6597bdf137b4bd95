//! Intranode normal-mode dispatch and combine (spec §2.1, §2.2, §3.2–§3.4), computed the way
//! the protocol computes them: the count exchange gives `rank_prefix_matrix`, each sender's
//! per-channel counts give `channel_prefix_matrix`, and every received row is written straight
//! at its final offset `rank_prefix_matrix[s-1][d] + channel start + index in channel`.
//!
//! Plan math works for any rank count (DeepEP's intranode kernels only launch for 2, 4 and 8).
//!
//! Tail rows (`num_worst_tokens > 0`, rows past the received count): DeepEP leaves them as
//! garbage except `recv_topk_idx = -1` (spec §1.8). ep-rs fixes them so results are
//! deterministic: zero data (BF16 `+0.0`, FP8 byte 0, scale `0.0`), `recv_topk_idx = -1`,
//! `recv_topk_weights = 0.0`, `recv_src_idx = -1` (internode: `recv_src_meta =
//! {src_rdma_rank: -1, mask: 0}`). Combine ignores tail rows.
//!
//! ep-rs rejects what DeepEP trusts (spec §2.2): a layout that is not the routing's own, a
//! `num_worst_tokens` below the real count, handles whose offsets fall outside the outputs.

use half::bf16;

use crate::error::{Error, Result};
use crate::plan::combine::{
    CombineArgs, CombineOutput, check_combine_args, combine_row, combine_weights, rewrite_heads,
};
use crate::plan::layout::{DispatchLayout, channel_range, get_dispatch_layout_for_rank};
use crate::plan::layout::{check_num_ranks, local_experts};
use crate::routing::{Activations, ExpertIdx, InputShapes, RankInputs, validate_routing};
use crate::tensor::Tensor2;

/// Options of a normal-mode dispatch (spec §1.8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchOptions {
    /// Channels `C = num_sms / 2`; each channel carries a contiguous token range (§2.1).
    pub num_channels: usize,
    /// Rounds each entry of `num_recv_tokens_per_expert_list` up to a multiple (≥ 1).
    pub expert_alignment: usize,
    /// `> 0`: outputs sized to this many rows, no host sync, empty expert list (§1.8).
    pub num_worst_tokens: usize,
    /// Whether `topk_idx`/`topk_weights` are passed (and `recv_topk_*` returned).
    pub with_topk: bool,
}

impl Default for DispatchOptions {
    /// DeepEP's defaults: `Buffer.num_sms = 20` → 10 channels, alignment 1, no worst-case
    /// sizing, with top-k.
    fn default() -> Self {
        Self {
            num_channels: 10,
            expert_alignment: 1,
            num_worst_tokens: 0,
            with_topk: true,
        }
    }
}

/// The intranode handle (spec §2.2), DeepEP's 6-tuple plus the received row count.
#[derive(Clone, Debug, PartialEq)]
pub struct IntranodeHandle {
    /// `[R, R]`: `[i][j] = Σ_{s ≤ i} num_tokens_per_rank_s[j]` (inclusive). The plan fills the
    /// whole matrix; DeepEP guarantees only the receiver's column.
    pub rank_prefix_matrix: Tensor2<i32>,
    /// `[R, C]`, sender side: inclusive per-channel prefix of tokens sent to rank `d`.
    pub channel_prefix_matrix: Tensor2<i32>,
    /// `[R, C]`, receiver side: exclusive start of source `s`'s channel `c` within `s`'s block.
    pub recv_channel_prefix_matrix: Tensor2<i32>,
    /// `[num_recv]`: source token index of each received row (`-1` in worst-case tail rows).
    pub recv_src_idx: Vec<i32>,
    /// `[T, R]`, sender side: the layout's membership matrix.
    pub is_token_in_rank: Tensor2<bool>,
    /// `[T, R]`, sender side: slot sequence number of token `t` in the `(channel(t), d)` ring,
    /// or `-1`; rewritten by combine ([`rewrite_send_head`]).
    pub send_head: Tensor2<i32>,
    /// Rows actually received (`rank_prefix_matrix[R-1][d]`), ≤ `recv_src_idx.len()`.
    pub num_recv_tokens: usize,
}

/// Entry `[i - 1][j]` of an inclusive prefix matrix, `0` for `i = 0`: the exclusive prefix
/// (the sum over rows before `i`).
pub(crate) fn before(m: &Tensor2<i32>, i: usize, j: usize) -> i32 {
    if i == 0 { 0 } else { m.get(i - 1, j) }
}

impl IntranodeHandle {
    /// Where rank `s`'s block starts among the rows rank `d` receives: the rows of the ranks
    /// before `s` (`rank_prefix_matrix[s - 1][d]`, `0` for `s = 0`).
    #[must_use]
    pub fn rank_start(&self, s: usize, d: usize) -> i32 {
        before(&self.rank_prefix_matrix, s, d)
    }

    /// Where channel `c`'s rows start within this (sending) rank's block on rank `d`: the
    /// tokens of channels before `c` sent to `d` (`channel_prefix_matrix[d][c - 1]`, `0` for
    /// `c = 0`).
    #[must_use]
    pub fn channel_start(&self, d: usize, c: usize) -> i32 {
        if c == 0 {
            0
        } else {
            self.channel_prefix_matrix.get(d, c - 1)
        }
    }

    /// Rewrites this handle's `send_head` in place as intranode combine does (spec §3.4,
    /// §7.1), over its own channel count. Idempotent.
    pub fn rewrite_send_head(&mut self) {
        rewrite_send_head(&mut self.send_head, self.channel_prefix_matrix.cols());
    }
}

/// What a normal-mode dispatch returns to one rank (spec §1.8), generic over the handle.
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchOutput<H> {
    /// Received rows: BF16, or FP8 bytes plus `recv_x_scales` (copied verbatim).
    pub recv_x: Activations,
    /// `[num_recv, K]` local expert ids (`-1` for experts elsewhere and in tail rows); `None`
    /// without top-k.
    pub recv_topk_idx: Option<Tensor2<ExpertIdx>>,
    /// `[num_recv, K]` weights of local experts (bit-equal), `0.0` elsewhere and in tail rows;
    /// `None` without top-k.
    pub recv_topk_weights: Option<Tensor2<f32>>,
    /// `[L]` received `(token, slot)` pairs per local expert, aligned; empty when
    /// `num_worst_tokens > 0`.
    pub num_recv_tokens_per_expert_list: Vec<i32>,
    /// The handle for combine and cached dispatch.
    pub handle: H,
}

/// Intranode dispatch output.
pub type IntranodeDispatch = DispatchOutput<IntranodeHandle>;

/// Shape facts common to every rank of a dispatch, after validation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DispatchShape {
    pub(crate) num_ranks: usize,
    pub(crate) num_local_experts: usize,
    pub(crate) num_topk: usize,
}

/// Validates a non-cached dispatch: rank count, `E % R`, options, each rank's inputs, one
/// dtype/hidden/top-k across ranks, and each layout equal to the routing's (§1.7): the
/// shape-level rules ([`check_dispatch_shapes`]) first, then the per-token ones
/// ([`check_dispatch_routing`]).
pub(crate) fn check_dispatch(
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    num_experts: usize,
    opts: &DispatchOptions,
) -> Result<DispatchShape> {
    let shapes: Vec<InputShapes> = inputs.iter().map(RankInputs::shapes).collect();
    let shape = check_dispatch_shapes(&shapes, layouts.len(), num_experts, opts)?;
    check_dispatch_routing(inputs, layouts, num_experts)?;
    Ok(shape)
}

/// The shape-level half of [`check_dispatch`], over each rank's input shapes and the number of
/// layouts given: rank count, `E % R`, options, each rank's input shapes and their agreement
/// with rank 0's (dtype, hidden, top-k). Reads no tensor contents.
pub(crate) fn check_dispatch_shapes(
    shapes: &[InputShapes],
    num_layouts: usize,
    num_experts: usize,
    opts: &DispatchOptions,
) -> Result<DispatchShape> {
    let num_ranks = shapes.len();
    check_num_ranks(num_ranks)?;
    if num_layouts != num_ranks {
        return Err(Error::RankCountMismatch {
            expected: num_ranks,
            found: num_layouts,
        });
    }
    let num_local_experts = local_experts(num_experts, num_ranks)?;
    check_dispatch_options(opts)?;
    let first = &shapes[0];
    for (s, sh) in shapes.iter().enumerate() {
        sh.check(s, true)?;
        sh.agree(first, s, opts.with_topk)?;
    }
    Ok(DispatchShape {
        num_ranks,
        num_local_experts,
        num_topk: if opts.with_topk {
            first.topk_idx.map_or(0, |(_, k)| k)
        } else {
            0
        },
    })
}

/// The per-token half of [`check_dispatch`]: every expert id in `[-1, E)` and each rank's
/// layout equal to its routing's (§1.7). Call after [`check_dispatch_shapes`].
pub(crate) fn check_dispatch_routing(
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    num_experts: usize,
) -> Result<()> {
    let num_ranks = inputs.len();
    for (s, inp) in inputs.iter().enumerate() {
        validate_routing(&inp.topk_idx, num_experts, s)?;
        let want = get_dispatch_layout_for_rank(s, &inp.topk_idx, num_experts, num_ranks)?;
        check_layout(s, &layouts[s], &want)?;
    }
    Ok(())
}

/// The options of a dispatch (spec §1.8): at least one channel, alignment >= 1, worst-token
/// sizing only with top-k.
pub fn check_dispatch_options(opts: &DispatchOptions) -> Result<()> {
    if opts.num_channels == 0 {
        return Err(Error::InvalidConfig {
            field: "num_channels",
            value: "0".into(),
            fix: "use at least one channel (num_sms >= 2)".into(),
        });
    }
    if opts.expert_alignment == 0 {
        return Err(Error::InvalidConfig {
            field: "expert_alignment",
            value: "0".into(),
            fix: "use 1 for no alignment".into(),
        });
    }
    if opts.num_worst_tokens > 0 && !opts.with_topk {
        return Err(Error::InvalidConfig {
            field: "num_worst_tokens",
            value: opts.num_worst_tokens.to_string(),
            fix: "worst-case sizing needs topk_idx (spec §1.8); pass top-k or use 0".into(),
        });
    }
    Ok(())
}

/// All ranks must send the same kind of rows: BF16 or FP8, one hidden size.
pub(crate) fn check_same_activation_kind(
    first: &Activations,
    x: &Activations,
    rank: usize,
) -> Result<()> {
    x.shapes().agree(&first.shapes(), rank, false)
}

fn check_layout(rank: usize, got: &DispatchLayout, want: &DispatchLayout) -> Result<()> {
    let mismatch = |field: &'static str, detail: String| Error::LayoutMismatch {
        rank,
        field,
        detail,
    };
    if got.is_token_in_rank.shape() != want.is_token_in_rank.shape() {
        return Err(mismatch(
            "is_token_in_rank",
            format!(
                "shape {:?}, routing needs {:?}",
                got.is_token_in_rank.shape(),
                want.is_token_in_rank.shape()
            ),
        ));
    }
    if got.is_token_in_rank != want.is_token_in_rank {
        return Err(mismatch("is_token_in_rank", "membership differs".into()));
    }
    if got.num_tokens_per_rank != want.num_tokens_per_rank {
        return Err(mismatch(
            "num_tokens_per_rank",
            format!(
                "{:?}, routing gives {:?}",
                got.num_tokens_per_rank, want.num_tokens_per_rank
            ),
        ));
    }
    if got.num_tokens_per_rdma_rank != want.num_tokens_per_rdma_rank {
        return Err(mismatch(
            "num_tokens_per_rdma_rank",
            format!(
                "{:?}, routing gives {:?}",
                got.num_tokens_per_rdma_rank, want.num_tokens_per_rdma_rank
            ),
        ));
    }
    if got.num_tokens_per_expert != want.num_tokens_per_expert {
        return Err(mismatch(
            "num_tokens_per_expert",
            format!(
                "{:?}, routing gives {:?}",
                got.num_tokens_per_expert, want.num_tokens_per_expert
            ),
        ));
    }
    Ok(())
}

/// Rank prefix matrix from the count exchange (§3.2): `[i][j] = Σ_{s ≤ i} counts_s[j]`.
pub(crate) fn rank_prefix_matrix(layouts: &[DispatchLayout]) -> Tensor2<i32> {
    let r = layouts.len();
    let mut rpm = Tensor2::filled(r, r, 0i32);
    for (i, layout) in layouts.iter().enumerate() {
        for j in 0..r {
            let above = before(&rpm, i, j);
            rpm.set(i, j, above + layout.num_tokens_per_rank[j]);
        }
    }
    rpm
}

/// Sender-side per-channel bookkeeping (§3.2 blocks `1+d`, §3.3 sender): for each channel and
/// destination, the running count of selected tokens gives `send_head`; its per-channel totals,
/// prefix-summed, give `channel_prefix_matrix`. `membership` is `[T, D]` over `D` destinations
/// (ranks, or nodes internode).
pub(crate) fn sender_channels(
    membership: &Tensor2<bool>,
    num_channels: usize,
) -> (Tensor2<i32>, Tensor2<i32>) {
    let (num_tokens, num_dst) = membership.shape();
    let mut prefix = Tensor2::filled(num_dst, num_channels, 0i32);
    let mut head = Tensor2::filled(num_tokens, num_dst, -1i32);
    for c in 0..num_channels {
        for d in 0..num_dst {
            let mut count = 0i32;
            for t in channel_range(num_tokens, num_channels, c) {
                if membership.get(t, d) {
                    head.set(t, d, count);
                    count += 1;
                }
            }
            let before = if c == 0 { 0 } else { prefix.get(d, c - 1) };
            prefix.set(d, c, before + count);
        }
    }
    (prefix, head)
}

/// `align_up(Σ_s num_tokens_per_expert_s[d*L + l], alignment)` for every local expert `l`
/// (§2.2), or empty with worst-case sizing (§1.8).
pub(crate) fn expert_list(
    layouts: &[DispatchLayout],
    rank: usize,
    num_local_experts: usize,
    opts: &DispatchOptions,
) -> Vec<i32> {
    if opts.num_worst_tokens > 0 {
        return Vec::new();
    }
    (0..num_local_experts)
        .map(|l| {
            let e = rank * num_local_experts + l;
            let total: i64 = layouts
                .iter()
                .map(|lay| i64::from(lay.num_tokens_per_expert[e]))
                .sum();
            let a = opts.expert_alignment as i64;
            ((total + a - 1) / a * a) as i32
        })
        .collect()
}

/// Output rows of a receiver: `num_worst_tokens` when set (after checking it suffices), else
/// the exact count.
pub(crate) fn output_rows(rank: usize, num_recv: usize, opts: &DispatchOptions) -> Result<usize> {
    if opts.num_worst_tokens == 0 {
        return Ok(num_recv);
    }
    if num_recv > opts.num_worst_tokens {
        return Err(Error::WorstTokensTooSmall {
            rank,
            num_worst_tokens: opts.num_worst_tokens,
            needed: num_recv,
        });
    }
    Ok(opts.num_worst_tokens)
}

/// Empty received activations of `rows` rows, the same kind as `like`. Tail policy: rows that
/// nothing is written to stay zero (bytes 0, scales 0.0).
pub(crate) fn empty_like(like: &Activations, rows: usize) -> Activations {
    match like {
        Activations::Bf16(x) => Activations::Bf16(Tensor2::filled(rows, x.cols(), bf16::ZERO)),
        Activations::Fp8 { data, scales } => Activations::Fp8 {
            data: Tensor2::filled(rows, data.cols(), 0u8),
            scales: Tensor2::filled(rows, scales.cols(), 0.0f32),
        },
    }
}

/// Copies source row `t` of `src` into row `row` of `dst` (BF16 row, or FP8 bytes + scales).
pub(crate) fn copy_row(dst: &mut Activations, row: usize, src: &Activations, t: usize) {
    match (dst, src) {
        (Activations::Bf16(d), Activations::Bf16(s)) => d.row_mut(row).copy_from_slice(s.row(t)),
        (
            Activations::Fp8 { data, scales },
            Activations::Fp8 {
                data: sd,
                scales: ss,
            },
        ) => {
            data.row_mut(row).copy_from_slice(sd.row(t));
            scales.row_mut(row).copy_from_slice(ss.row(t));
        }
        // Kinds are checked equal before any copy.
        _ => unreachable!("activation kinds validated equal"),
    }
}

/// Top-k of a received row on rank `d` (§2.2): local ids `e - d*L` with their weights bit-equal,
/// `-1` and `0.0` for experts elsewhere (and for masked slots).
pub(crate) fn remap_topk(
    idx: &[ExpertIdx],
    weights: &[f32],
    rank: usize,
    num_local_experts: usize,
    out_idx: &mut [ExpertIdx],
    out_weights: &mut [f32],
) {
    let lo = (rank * num_local_experts) as ExpertIdx;
    let hi = lo + num_local_experts as ExpertIdx;
    for k in 0..idx.len() {
        let e = idx[k];
        if e >= lo && e < hi {
            out_idx[k] = e - lo;
            out_weights[k] = weights[k];
        } else {
            out_idx[k] = -1;
            out_weights[k] = 0.0;
        }
    }
}

/// Sender-side handle parts of every rank: `(channel_prefix_matrix, send_head)` per rank.
fn all_senders(
    layouts: &[DispatchLayout],
    num_channels: usize,
) -> Vec<(Tensor2<i32>, Tensor2<i32>)> {
    layouts
        .iter()
        .map(|l| sender_channels(&l.is_token_in_rank, num_channels))
        .collect()
}

/// Intranode dispatch as seen by receiver `rank`, given every rank's inputs and layout
/// (spec §2.2). The layouts must be the ones [`get_dispatch_layout`] gives for the routing
/// (DeepEP trusts the caller and hangs or returns garbage otherwise; ep-rs checks).
///
/// [`get_dispatch_layout`]: crate::plan::layout::get_dispatch_layout
pub fn intranode_dispatch(
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    num_experts: usize,
    rank: usize,
    opts: &DispatchOptions,
) -> Result<IntranodeDispatch> {
    let shape = check_dispatch(inputs, layouts, num_experts, opts)?;
    if rank >= shape.num_ranks {
        return Err(Error::RankOutOfRange {
            rank,
            num_ranks: shape.num_ranks,
        });
    }
    let senders = all_senders(layouts, opts.num_channels);
    let rpm = rank_prefix_matrix(layouts);
    receive(inputs, layouts, &senders, &rpm, rank, shape, opts)
}

/// [`intranode_dispatch`] for every rank at once (sender-side work done once).
pub fn intranode_dispatch_all(
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    num_experts: usize,
    opts: &DispatchOptions,
) -> Result<Vec<IntranodeDispatch>> {
    let shape = check_dispatch(inputs, layouts, num_experts, opts)?;
    let senders = all_senders(layouts, opts.num_channels);
    let rpm = rank_prefix_matrix(layouts);
    (0..shape.num_ranks)
        .map(|d| receive(inputs, layouts, &senders, &rpm, d, shape, opts))
        .collect()
}

/// The receiver half (§3.3 odd blocks): every selected token of every source lands at
/// `rpm[s-1][d] + recv_channel_prefix_matrix[s][c] + send_head_s[t][d]`.
fn receive(
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    senders: &[(Tensor2<i32>, Tensor2<i32>)],
    rpm: &Tensor2<i32>,
    d: usize,
    shape: DispatchShape,
    opts: &DispatchOptions,
) -> Result<IntranodeDispatch> {
    let r = shape.num_ranks;
    let c_count = opts.num_channels;
    let num_recv = rpm.get(r - 1, d) as usize;
    let rows = output_rows(d, num_recv, opts)?;

    let mut recv_cpm = Tensor2::filled(r, c_count, 0i32);
    for (s, (cpm, _)) in senders.iter().enumerate() {
        for c in 1..c_count {
            recv_cpm.set(s, c, cpm.get(d, c - 1));
        }
    }

    let k = shape.num_topk;
    let mut recv_x = empty_like(&inputs[0].x, rows);
    let mut recv_src_idx = vec![-1i32; rows];
    let mut recv_topk_idx = Tensor2::filled(rows, k, -1 as ExpertIdx);
    let mut recv_topk_weights = Tensor2::filled(rows, k, 0.0f32);
    for (s, inp) in inputs.iter().enumerate() {
        let block = before(rpm, s, d) as usize;
        let send_head = &senders[s].1;
        let num_tokens = inp.num_tokens();
        for c in 0..c_count {
            let start = block + recv_cpm.get(s, c) as usize;
            for t in channel_range(num_tokens, c_count, c) {
                let slot = send_head.get(t, d);
                if slot < 0 {
                    continue;
                }
                let row = start + slot as usize;
                copy_row(&mut recv_x, row, &inp.x, t);
                recv_src_idx[row] = t as i32;
                if opts.with_topk {
                    remap_topk(
                        inp.topk_idx.row(t),
                        inp.topk_weights.row(t),
                        d,
                        shape.num_local_experts,
                        recv_topk_idx.row_mut(row),
                        recv_topk_weights.row_mut(row),
                    );
                }
            }
        }
    }

    let (cpm, send_head) = senders[d].clone();
    Ok(DispatchOutput {
        recv_x,
        recv_topk_idx: opts.with_topk.then_some(recv_topk_idx),
        recv_topk_weights: opts.with_topk.then_some(recv_topk_weights),
        num_recv_tokens_per_expert_list: expert_list(layouts, d, shape.num_local_experts, opts),
        handle: IntranodeHandle {
            rank_prefix_matrix: rpm.clone(),
            channel_prefix_matrix: cpm,
            recv_channel_prefix_matrix: recv_cpm,
            recv_src_idx,
            is_token_in_rank: layouts[d].is_token_in_rank.clone(),
            send_head,
            num_recv_tokens: num_recv,
        },
    })
}

/// A handle-derived row offset that falls outside the outputs: the handles do not belong
/// together (or to these inputs).
pub(crate) fn handle_mismatch(rank: usize, detail: String) -> Error {
    Error::LayoutMismatch {
        rank,
        field: "handle",
        detail,
    }
}

/// Cached intranode dispatch (spec §1.8): re-sends `xs` along the handles of an earlier
/// dispatch (all ranks' handles: receiver `rank` needs each sender's `is_token_in_rank`), with
/// no top-k and no count exchange. Rows = the handle's `recv_src_idx` length; the result is
/// bit-equal to the earlier `recv_x` when `xs` are the same rows.
pub fn intranode_dispatch_cached(
    xs: &[&Activations],
    handles: &[IntranodeHandle],
    rank: usize,
) -> Result<Activations> {
    let r = handles.len();
    check_num_ranks(r)?;
    check_cached_args(xs.len(), r, rank)?;
    let own = &handles[rank];
    let c_count = own.recv_channel_prefix_matrix.cols();
    if own.rank_prefix_matrix.shape() != (r, r) || own.recv_channel_prefix_matrix.rows() != r {
        return Err(handle_mismatch(
            rank,
            "prefix matrices are not [R, R] / [R, C]".into(),
        ));
    }
    let itr: Vec<&Tensor2<bool>> = handles.iter().map(|h| &h.is_token_in_rank).collect();
    let start = |s: usize, c: usize| {
        (own.rank_start(s, rank) + own.recv_channel_prefix_matrix.get(s, c)) as usize
    };
    let rows = own.recv_src_idx.len();
    scatter_cached(xs, &itr, rank, rows, own.num_recv_tokens, c_count, start)
}

/// Argument checks shared by intranode and internode cached dispatch: one `x` per rank, and
/// `rank` one of them.
pub(crate) fn check_cached_args(num_xs: usize, num_ranks: usize, rank: usize) -> Result<()> {
    if num_xs != num_ranks {
        return Err(Error::RankCountMismatch {
            expected: num_ranks,
            found: num_xs,
        });
    }
    if rank >= num_ranks {
        return Err(Error::RankOutOfRange { rank, num_ranks });
    }
    Ok(())
}

/// The data path shared by intranode and internode cached dispatch: receiver `rank` takes,
/// per source `s` and channel `c`, the tokens `t ∈ chan(c)` with `itr[s][t][rank]`, in order,
/// into consecutive rows from `start(s, c)`. Checks shapes and that rows stay below
/// `min(num_recv, rows)`.
pub(crate) fn scatter_cached(
    xs: &[&Activations],
    itr: &[&Tensor2<bool>],
    rank: usize,
    rows: usize,
    num_recv: usize,
    c_count: usize,
    start: impl Fn(usize, usize) -> usize,
) -> Result<Activations> {
    let r = itr.len();
    for (s, (x, h)) in xs.iter().zip(itr).enumerate() {
        check_same_activation_kind(xs[0], x, s)?;
        if h.shape() != (x.num_tokens(), r) {
            return Err(Error::ShapeMismatch {
                what: "cached dispatch: handle is_token_in_rank versus x",
                expected: format!("({}, {r}) on rank {s}", x.num_tokens()),
                found: format!("{:?}", h.shape()),
            });
        }
    }
    let mut recv_x = empty_like(xs[0], rows);
    for (s, (x, h)) in xs.iter().zip(itr).enumerate() {
        for c in 0..c_count {
            let mut row = start(s, c);
            for t in channel_range(x.num_tokens(), c_count, c) {
                if !h.get(t, rank) {
                    continue;
                }
                if row >= num_recv.min(rows) {
                    return Err(handle_mismatch(
                        rank,
                        format!("row {row} of source {s} past {num_recv} received rows"),
                    ));
                }
                copy_row(&mut recv_x, row, x, t);
                row += 1;
            }
        }
    }
    Ok(recv_x)
}

/// Rewrites a `send_head` in place as intranode combine does (spec §3.4, §7.1): per
/// destination column and channel `chan(T, C, c)`, skipped tokens get `-(next valid) - 1`.
/// Idempotent.
pub fn rewrite_send_head(send_head: &mut Tensor2<i32>, num_channels: usize) {
    let t = send_head.rows();
    let segments: Vec<_> = (0..num_channels)
        .map(|c| channel_range(t, num_channels, c))
        .collect();
    rewrite_heads(send_head, &segments);
}

/// Intranode combine for every rank (spec §2.2): rank `s` gets, for each original token `t`,
/// `bf16(f32(b0) + f32(b1) + Σ_{d ascending, send_head_s[t][d] ≥ 0} f32(y_d[j_d(t)]))` with
/// `j_d(t) = rpm_d[s-1][d] + recv_channel_prefix_matrix_d[s][c] + send_head_s[t][d]`, and the
/// f32 sum of the weights in the same order. Heads may be raw or rewritten.
pub fn intranode_combine(
    handles: &[IntranodeHandle],
    args: &[CombineArgs<'_>],
) -> Result<Vec<CombineOutput>> {
    let r = handles.len();
    check_num_ranks(r)?;
    if args.len() != r {
        return Err(Error::RankCountMismatch {
            expected: r,
            found: args.len(),
        });
    }
    let num_tokens: Vec<usize> = handles.iter().map(|h| h.send_head.rows()).collect();
    let num_recv: Vec<usize> = handles.iter().map(|h| h.recv_src_idx.len()).collect();
    let (hidden, num_topk) = check_combine_args(args, &num_tokens, &num_recv)?;
    let c_count = handles[0].channel_prefix_matrix.cols();
    for (d, h) in handles.iter().enumerate() {
        if h.rank_prefix_matrix.shape() != (r, r)
            || h.recv_channel_prefix_matrix.shape() != (r, c_count)
            || h.channel_prefix_matrix.shape() != (r, c_count)
            || h.send_head.cols() != r
        {
            return Err(handle_mismatch(
                d,
                "handle matrices have inconsistent shapes".into(),
            ));
        }
    }
    (0..r)
        .map(|s| combine_one(handles, args, s, hidden, num_topk))
        .collect()
}

fn combine_one(
    handles: &[IntranodeHandle],
    args: &[CombineArgs<'_>],
    s: usize,
    hidden: usize,
    num_topk: Option<usize>,
) -> Result<CombineOutput> {
    let r = handles.len();
    let own = &handles[s];
    let num_tokens = own.send_head.rows();
    let c_count = own.channel_prefix_matrix.cols();
    let mut combined_x = Tensor2::filled(num_tokens, hidden, bf16::ZERO);
    let mut combined_w = num_topk.map(|k| Tensor2::filled(num_tokens, k, 0.0f32));
    let mut acc = vec![0.0f32; hidden];
    let mut rows: Vec<&[bf16]> = Vec::with_capacity(r);
    let mut wrows: Vec<&[f32]> = Vec::with_capacity(r);
    let b0 = args[s].bias.first();
    let b1 = args[s].bias.get(1);
    for c in 0..c_count {
        for t in channel_range(num_tokens, c_count, c) {
            rows.clear();
            wrows.clear();
            for (d, hd) in handles.iter().enumerate() {
                let slot = own.send_head.get(t, d);
                if slot < 0 {
                    continue;
                }
                let j =
                    (hd.rank_start(s, d) + hd.recv_channel_prefix_matrix.get(s, c) + slot) as usize;
                if j >= hd.num_recv_tokens.min(args[d].x.rows()) {
                    return Err(handle_mismatch(
                        s,
                        format!("token {t} maps to row {j} of rank {d}, past its received rows"),
                    ));
                }
                rows.push(args[d].x.row(j));
                if let Some(w) = args[d].topk_weights {
                    wrows.push(w.row(j));
                }
            }
            combine_row(
                b0.map(|b| b.row(t)),
                b1.map(|b| b.row(t)),
                &rows,
                &mut acc,
                combined_x.row_mut(t),
            );
            if let Some(cw) = combined_w.as_mut() {
                combine_weights(&wrows, cw.row_mut(t));
            }
        }
    }
    Ok(CombineOutput {
        combined_x,
        combined_topk_weights: combined_w,
    })
}

/// A normal dispatch whose received rows stay in a `Buffer`'s arena (docs/protocol.md §2.6): everything
/// [`IntranodeDispatch`] holds except `recv_x`, which `Buffer::read_recv_x` reads.
#[derive(Clone, Debug, PartialEq)]
pub struct InPlaceDispatch {
    /// Rows of `recv_x` in the arena: `num_recv_tokens`, or `num_worst_tokens` in worst-token
    /// mode (the tail rows included).
    pub num_rows: usize,
    /// As [`IntranodeDispatch::recv_topk_idx`].
    pub recv_topk_idx: Option<Tensor2<ExpertIdx>>,
    /// As [`IntranodeDispatch::recv_topk_weights`].
    pub recv_topk_weights: Option<Tensor2<f32>>,
    /// As [`IntranodeDispatch::num_recv_tokens_per_expert_list`].
    pub num_recv_tokens_per_expert_list: Vec<i32>,
    /// The handle for combine and cached dispatch.
    pub handle: IntranodeHandle,
}

impl InPlaceDispatch {
    /// Everything of `d` but `recv_x` (`num_rows` = its rows), cloned.
    #[must_use]
    pub fn of(d: &IntranodeDispatch) -> Self {
        Self {
            num_rows: d.recv_x.num_tokens(),
            recv_topk_idx: d.recv_topk_idx.clone(),
            recv_topk_weights: d.recv_topk_weights.clone(),
            num_recv_tokens_per_expert_list: d.num_recv_tokens_per_expert_list.clone(),
            handle: d.handle.clone(),
        }
    }

    /// The owned form, with `recv_x` given (e.g. read with `Buffer::read_recv_x`).
    #[must_use]
    pub fn with_recv_x(self, recv_x: Activations) -> IntranodeDispatch {
        IntranodeDispatch {
            recv_x,
            recv_topk_idx: self.recv_topk_idx,
            recv_topk_weights: self.recv_topk_weights,
            num_recv_tokens_per_expert_list: self.num_recv_tokens_per_expert_list,
            handle: self.handle,
        }
    }
}
