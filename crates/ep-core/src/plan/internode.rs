//! Internode normal-mode dispatch and combine (spec §2.3, §3.5), computed along the protocol's
//! path: a token goes once per destination node over RDMA to the *forwarder* — the GPU of that
//! node with the sender's local index — which passes it over NVLink to every GPU of its node
//! that needs it. Received rows are written straight at their final offsets:
//! `recv_gbl_channel_prefix_matrix[s][c] + sequence number in the forward stream`.
//!
//! Combine reverses the path with two BF16 roundings (spec §2.3, derived from §3.5):
//! 1. the forwarder `(n, i)` sums, per RDMA-received token, the contributions of the GPUs of
//!    node `n` that got it — `0.0 + Σ_{j ascending NVL rank} f32(y_(n,j)[row])` — and rounds
//!    to BF16 (its weights partial is the f32 sum in the same order, not rounded);
//! 2. the original owner adds `f32(b0) + f32(b1)` and then the node partials in ascending node
//!    order, `Σ_{n ascending} f32(partial_n)`, and rounds again (weights: `0.0 + Σ_n partial`).
//!
//! This is the association DeepEP's kernels use: `combine_token` walks the participating NVL
//! ranks (forwarder) or RDMA ranks (receiver) in ascending order after the bias.

use half::bf16;

use crate::error::{Error, Result};
use crate::plan::combine::{
    CombineArgs, CombineOutput, check_combine_args, combine_row, combine_weights, rewrite_heads,
};
use crate::plan::intranode::{
    DispatchOptions, DispatchOutput, DispatchShape, check_cached_args, check_dispatch, copy_row,
    empty_like, expert_list, handle_mismatch, output_rows, remap_topk, scatter_cached,
    sender_channels,
};
use crate::plan::layout::{DispatchLayout, NUM_MAX_NVL_PEERS, channel_range};
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::Tensor2;

/// Per-token source metadata carried with every RDMA message (spec §2.3, §3.5;
/// DeepEP's `SourceMeta`, 8 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceMeta {
    /// Node (RDMA rank) of the token's original owner.
    pub src_rdma_rank: i32,
    /// Bit `j` set when NVL rank `j` of the destination node receives the token.
    pub is_token_in_nvl_ranks: i32,
}

const _: () = assert!(std::mem::size_of::<SourceMeta>() == 8);

impl SourceMeta {
    /// Whether NVL rank `nvl_rank` of the destination node receives the token.
    pub fn is_token_in_nvl_rank(&self, nvl_rank: usize) -> bool {
        (self.is_token_in_nvl_ranks >> nvl_rank) & 1 == 1
    }
}

/// The internode handle (spec §2.3): DeepEP's 10-tuple plus the two received row counts.
#[derive(Clone, Debug, PartialEq)]
pub struct InternodeHandle {
    /// `[T, R]`, sender side: the layout's membership matrix.
    pub is_token_in_rank: Tensor2<bool>,
    /// `[RR, C]`, sender side: inclusive per-channel prefix of tokens with ≥ 1 destination on
    /// node `n`.
    pub rdma_channel_prefix_matrix: Tensor2<i32>,
    /// `[R, C]`, sender side: inclusive per-channel prefix of tokens to rank `r`.
    pub gbl_channel_prefix_matrix: Tensor2<i32>,
    /// `[RR, C]`, forwarder side: source `(n, my NVL rank)`'s `rdma_channel_prefix_matrix[my
    /// node][c]` (inclusive end, unlike intranode's exclusive start).
    pub recv_rdma_channel_prefix_matrix: Tensor2<i32>,
    /// `[RR]`, forwarder side: inclusive prefix over source nodes of tokens that rank
    /// `(n, my NVL rank)` sends to my node.
    pub recv_rdma_rank_prefix_sum: Vec<i32>,
    /// `[R, C]`, receiver side: absolute start row in `recv_x` of source `r`'s channel `c`.
    pub recv_gbl_channel_prefix_matrix: Tensor2<i32>,
    /// `[R]`, receiver side: inclusive prefix over global source ranks of received tokens.
    pub recv_gbl_rank_prefix_sum: Vec<i32>,
    /// `[num_recv]`, receiver side: each row's [`SourceMeta`] (tail rows:
    /// `{src_rdma_rank: -1, mask: 0}`).
    pub recv_src_meta: Vec<SourceMeta>,
    /// `[T, RR]`, sender side: sequence number of token `t` in the `(channel, node)` RDMA
    /// stream, or `-1`; rewritten by combine.
    pub send_rdma_head: Tensor2<i32>,
    /// `[num_rdma_recv_tokens, 8]`, forwarder side: sequence number of each RDMA-received token
    /// in the `(channel, source node, NVL rank)` forward stream, or `-1`; rewritten by combine.
    /// Sized exactly, also under `num_worst_tokens` (a GPU backend may pad it; padding rows
    /// belong to no segment and are never read).
    pub send_nvl_head: Tensor2<i32>,
    /// Tokens received over RDMA as forwarder (last entry of `recv_rdma_rank_prefix_sum`).
    pub num_rdma_recv_tokens: usize,
    /// Rows actually received (last entry of `recv_gbl_rank_prefix_sum`).
    pub num_recv_tokens: usize,
}

/// Internode dispatch output.
pub type InternodeDispatch = DispatchOutput<InternodeHandle>;

impl InternodeHandle {
    /// Rewrites `send_rdma_head` and `send_nvl_head` in place as internode combine does
    /// (spec §3.5 `cached_notify`, §7.1). Idempotent.
    pub fn rewrite_heads(&mut self) {
        let c_count = self.rdma_channel_prefix_matrix.cols();
        let t = self.send_rdma_head.rows();
        let segs: Vec<_> = (0..c_count).map(|c| channel_range(t, c_count, c)).collect();
        rewrite_heads(&mut self.send_rdma_head, &segs);
        let segs = forward_segments(
            &self.recv_rdma_rank_prefix_sum,
            &self.recv_rdma_channel_prefix_matrix,
        );
        let segs: Vec<_> = segs.into_iter().map(|(_, _, r)| r).collect();
        rewrite_heads(&mut self.send_nvl_head, &segs);
    }
}

/// Row ranges of a forwarder's RDMA-received tokens, as `(source node, channel, rows)`:
/// source node `n`'s block starts at `recv_rdma_rank_prefix_sum[n-1]`, its channel `c` at
/// `recv_rdma_channel_prefix_matrix[n][c-1]` within the block (§2.3 `send_nvl_head`).
fn forward_segments(
    rank_prefix: &[i32],
    channel_prefix: &Tensor2<i32>,
) -> Vec<(usize, usize, std::ops::Range<usize>)> {
    let mut out = Vec::new();
    for (n, _) in rank_prefix.iter().enumerate() {
        let block = if n == 0 { 0 } else { rank_prefix[n - 1] };
        for c in 0..channel_prefix.cols() {
            let lo = if c == 0 {
                0
            } else {
                channel_prefix.get(n, c - 1)
            };
            let hi = channel_prefix.get(n, c);
            let (lo, hi) = ((block + lo).max(0) as usize, (block + hi).max(0) as usize);
            out.push((n, c, lo..hi.max(lo)));
        }
    }
    out
}

/// Sender-side handle parts of one rank (§3.5 notify blocks `1+n`, RDMA sender warps).
#[derive(Clone, Debug)]
struct Sender {
    rdma_cpm: Tensor2<i32>,
    gbl_cpm: Tensor2<i32>,
    send_rdma_head: Tensor2<i32>,
}

fn plan_sender(layout: &DispatchLayout, num_nodes: usize, num_channels: usize) -> Sender {
    let itr = &layout.is_token_in_rank;
    let on_node = Tensor2::from_fn(itr.rows(), num_nodes, |t, n| {
        (0..NUM_MAX_NVL_PEERS).any(|j| itr.get(t, n * NUM_MAX_NVL_PEERS + j))
    });
    let (rdma_cpm, send_rdma_head) = sender_channels(&on_node, num_channels);
    let (gbl_cpm, _) = sender_channels(itr, num_channels);
    Sender {
        rdma_cpm,
        gbl_cpm,
        send_rdma_head,
    }
}

/// What a forwarder `(n_f, i_f)` holds after the RDMA stage (§3.5 forwarder warps).
#[derive(Clone, Debug)]
struct Forwarder {
    rank_prefix: Vec<i32>,
    channel_prefix: Tensor2<i32>,
    /// `(source rank, source token)` of each RDMA-received row.
    tokens: Vec<(usize, usize)>,
    meta: Vec<SourceMeta>,
    send_nvl_head: Tensor2<i32>,
}

fn plan_forwarder(
    layouts: &[DispatchLayout],
    senders: &[Sender],
    f: usize,
    num_channels: usize,
) -> Forwarder {
    let num_nodes = layouts.len() / NUM_MAX_NVL_PEERS;
    let (node_f, nvl_f) = (f / NUM_MAX_NVL_PEERS, f % NUM_MAX_NVL_PEERS);
    // Count exchange (§3.5 notify): each same-index peer's per-node count.
    let mut rank_prefix = Vec::with_capacity(num_nodes);
    let mut channel_prefix = Tensor2::filled(num_nodes, num_channels, 0i32);
    let mut acc = 0;
    for n in 0..num_nodes {
        let src = n * NUM_MAX_NVL_PEERS + nvl_f;
        acc += layouts[src]
            .num_tokens_per_rdma_rank
            .as_ref()
            .map_or(0, |v| v[node_f]);
        rank_prefix.push(acc);
        for c in 0..num_channels {
            channel_prefix.set(n, c, senders[src].rdma_cpm.get(node_f, c));
        }
    }
    let rows = acc as usize;
    let mut tokens = vec![(0, 0); rows];
    let mut meta = vec![SourceMeta::default(); rows];
    let mut send_nvl_head = Tensor2::filled(rows, NUM_MAX_NVL_PEERS, -1i32);
    for (n, c, seg) in forward_segments(&rank_prefix, &channel_prefix) {
        let src = n * NUM_MAX_NVL_PEERS + nvl_f;
        let itr = &layouts[src].is_token_in_rank;
        let head = &senders[src].send_rdma_head;
        let mut nvl_seq = [0i32; NUM_MAX_NVL_PEERS];
        for t in channel_range(itr.rows(), num_channels, c) {
            let seq = head.get(t, node_f);
            if seq < 0 {
                continue;
            }
            let row = seg.start + seq as usize;
            tokens[row] = (src, t);
            let mut mask = 0i32;
            for (j, next) in nvl_seq.iter_mut().enumerate() {
                if itr.get(t, node_f * NUM_MAX_NVL_PEERS + j) {
                    mask |= 1 << j;
                    send_nvl_head.set(row, j, *next);
                    *next += 1;
                }
            }
            meta[row] = SourceMeta {
                src_rdma_rank: n as i32,
                is_token_in_nvl_ranks: mask,
            };
        }
    }
    Forwarder {
        rank_prefix,
        channel_prefix,
        tokens,
        meta,
        send_nvl_head,
    }
}

fn check_internode_ranks(num_ranks: usize) -> Result<()> {
    if num_ranks < 2 * NUM_MAX_NVL_PEERS || !num_ranks.is_multiple_of(NUM_MAX_NVL_PEERS) {
        return Err(Error::InvalidRankCount {
            num_ranks,
            need: "internode mode: at least 2 nodes of 8 ranks (a multiple of 8, >= 16)",
        });
    }
    Ok(())
}

/// Internode dispatch as seen by global rank `rank`, given every rank's inputs and layout
/// (spec §2.3). Same `recv_x` / top-k / expert-list semantics as intranode with global ranks.
pub fn internode_dispatch(
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    num_experts: usize,
    rank: usize,
    opts: &DispatchOptions,
) -> Result<InternodeDispatch> {
    check_internode_ranks(inputs.len())?;
    let shape = check_dispatch(inputs, layouts, num_experts, opts)?;
    if rank >= shape.num_ranks {
        return Err(Error::RankOutOfRange {
            rank,
            num_ranks: shape.num_ranks,
        });
    }
    let senders = plan_senders(layouts, opts.num_channels);
    let node = rank / NUM_MAX_NVL_PEERS;
    let forwarders: Vec<_> = (0..NUM_MAX_NVL_PEERS)
        .map(|i| {
            plan_forwarder(
                layouts,
                &senders,
                node * NUM_MAX_NVL_PEERS + i,
                opts.num_channels,
            )
        })
        .collect();
    receive(inputs, layouts, &senders, &forwarders, rank, shape, opts)
}

/// [`internode_dispatch`] for every rank at once (sender and forwarder work done once).
pub fn internode_dispatch_all(
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    num_experts: usize,
    opts: &DispatchOptions,
) -> Result<Vec<InternodeDispatch>> {
    check_internode_ranks(inputs.len())?;
    let shape = check_dispatch(inputs, layouts, num_experts, opts)?;
    let senders = plan_senders(layouts, opts.num_channels);
    let forwarders: Vec<_> = (0..shape.num_ranks)
        .map(|f| plan_forwarder(layouts, &senders, f, opts.num_channels))
        .collect();
    (0..shape.num_ranks)
        .map(|d| {
            let node = d / NUM_MAX_NVL_PEERS;
            let local = &forwarders[node * NUM_MAX_NVL_PEERS..(node + 1) * NUM_MAX_NVL_PEERS];
            receive(inputs, layouts, &senders, local, d, shape, opts)
        })
        .collect()
}

fn plan_senders(layouts: &[DispatchLayout], num_channels: usize) -> Vec<Sender> {
    let num_nodes = layouts.len() / NUM_MAX_NVL_PEERS;
    layouts
        .iter()
        .map(|l| plan_sender(l, num_nodes, num_channels))
        .collect()
}

/// The NVL receiver (§3.5 odd-SM warps 8–15): rows forwarded by the 8 GPUs of my node
/// (`forwarders[i]` = NVL rank `i`) land at `recv_gbl_channel_prefix_matrix[src][c] +
/// send_nvl_head[row][me]`.
fn receive(
    inputs: &[RankInputs],
    layouts: &[DispatchLayout],
    senders: &[Sender],
    forwarders: &[Forwarder],
    d: usize,
    shape: DispatchShape,
    opts: &DispatchOptions,
) -> Result<InternodeDispatch> {
    let r = shape.num_ranks;
    let c_count = opts.num_channels;
    let nvl_d = d % NUM_MAX_NVL_PEERS;
    let mut recv_gbl_rank_prefix_sum = vec![0i32; r];
    let mut acc = 0;
    for (s, lay) in layouts.iter().enumerate() {
        acc += lay.num_tokens_per_rank[d];
        recv_gbl_rank_prefix_sum[s] = acc;
    }
    let num_recv = acc as usize;
    let rows = output_rows(d, num_recv, opts)?;
    let mut rgcpm = Tensor2::filled(r, c_count, 0i32);
    for s in 0..r {
        let block = if s == 0 {
            0
        } else {
            recv_gbl_rank_prefix_sum[s - 1]
        };
        for c in 0..c_count {
            let start = if c == 0 {
                0
            } else {
                senders[s].gbl_cpm.get(d, c - 1)
            };
            rgcpm.set(s, c, block + start);
        }
    }

    let k = shape.num_topk;
    let mut recv_x = empty_like(&inputs[0].x, rows);
    let mut recv_src_meta = vec![
        SourceMeta {
            src_rdma_rank: -1,
            is_token_in_nvl_ranks: 0
        };
        rows
    ];
    let mut recv_topk_idx = Tensor2::filled(rows, k, -1 as ExpertIdx);
    let mut recv_topk_weights = Tensor2::filled(rows, k, 0.0f32);
    for fwd in forwarders {
        for (_, c, seg) in forward_segments(&fwd.rank_prefix, &fwd.channel_prefix) {
            for row in seg {
                let m = fwd.meta[row];
                if !m.is_token_in_nvl_rank(nvl_d) {
                    continue;
                }
                let (src, t) = fwd.tokens[row];
                let j = (rgcpm.get(src, c) + fwd.send_nvl_head.get(row, nvl_d)) as usize;
                let inp = &inputs[src];
                copy_row(&mut recv_x, j, &inp.x, t);
                recv_src_meta[j] = m;
                if opts.with_topk {
                    // RDMA carries global ids; the final receiver converts (§2.3).
                    remap_topk(
                        inp.topk_idx.row(t),
                        inp.topk_weights.row(t),
                        d,
                        shape.num_local_experts,
                        recv_topk_idx.row_mut(j),
                        recv_topk_weights.row_mut(j),
                    );
                }
            }
        }
    }

    let me = &forwarders[nvl_d];
    let sender = senders[d].clone();
    Ok(DispatchOutput {
        recv_x,
        recv_topk_idx: opts.with_topk.then_some(recv_topk_idx),
        recv_topk_weights: opts.with_topk.then_some(recv_topk_weights),
        num_recv_tokens_per_expert_list: expert_list(layouts, d, shape.num_local_experts, opts),
        handle: InternodeHandle {
            is_token_in_rank: layouts[d].is_token_in_rank.clone(),
            rdma_channel_prefix_matrix: sender.rdma_cpm,
            gbl_channel_prefix_matrix: sender.gbl_cpm,
            recv_rdma_channel_prefix_matrix: me.channel_prefix.clone(),
            recv_rdma_rank_prefix_sum: me.rank_prefix.clone(),
            recv_gbl_channel_prefix_matrix: rgcpm,
            recv_gbl_rank_prefix_sum,
            recv_src_meta,
            send_rdma_head: sender.send_rdma_head,
            send_nvl_head: me.send_nvl_head.clone(),
            num_rdma_recv_tokens: me.tokens.len(),
            num_recv_tokens: num_recv,
        },
    })
}

/// Cached internode dispatch (spec §1.8): re-sends `xs` along all ranks' handles, no top-k,
/// no count exchange. Rows = the handle's `recv_src_meta` length; bit-equal to the earlier
/// `recv_x` for the same rows.
pub fn internode_dispatch_cached(
    xs: &[&Activations],
    handles: &[InternodeHandle],
    rank: usize,
) -> Result<Activations> {
    let r = handles.len();
    check_internode_ranks(r)?;
    check_cached_args(xs.len(), r, rank)?;
    let own = &handles[rank];
    let c_count = own.recv_gbl_channel_prefix_matrix.cols();
    if own.recv_gbl_channel_prefix_matrix.rows() != r {
        return Err(handle_mismatch(
            rank,
            "recv_gbl_channel_prefix_matrix is not [R, C]".into(),
        ));
    }
    let itr: Vec<&Tensor2<bool>> = handles.iter().map(|h| &h.is_token_in_rank).collect();
    let start = |s: usize, c: usize| own.recv_gbl_channel_prefix_matrix.get(s, c) as usize;
    let rows = own.recv_src_meta.len();
    scatter_cached(xs, &itr, rank, rows, own.num_recv_tokens, c_count, start)
}

/// Internode combine for every rank (spec §2.3) with the two roundings described in the module
/// docs. Heads may be raw or rewritten.
pub fn internode_combine(
    handles: &[InternodeHandle],
    args: &[CombineArgs<'_>],
) -> Result<Vec<CombineOutput>> {
    let r = handles.len();
    check_internode_ranks(r)?;
    if args.len() != r {
        return Err(Error::RankCountMismatch {
            expected: r,
            found: args.len(),
        });
    }
    let num_nodes = r / NUM_MAX_NVL_PEERS;
    let num_tokens: Vec<usize> = handles.iter().map(|h| h.send_rdma_head.rows()).collect();
    let num_recv: Vec<usize> = handles.iter().map(|h| h.recv_src_meta.len()).collect();
    let (hidden, num_topk) = check_combine_args(args, &num_tokens, &num_recv)?;
    let c_count = handles[0].rdma_channel_prefix_matrix.cols();
    for (d, h) in handles.iter().enumerate() {
        if h.rdma_channel_prefix_matrix.shape() != (num_nodes, c_count)
            || h.recv_rdma_channel_prefix_matrix.shape() != (num_nodes, c_count)
            || h.recv_gbl_channel_prefix_matrix.shape() != (r, c_count)
            || h.recv_rdma_rank_prefix_sum.len() != num_nodes
            || h.send_rdma_head.cols() != num_nodes
            || h.send_nvl_head.shape() != (h.num_rdma_recv_tokens, NUM_MAX_NVL_PEERS)
        {
            return Err(handle_mismatch(
                d,
                "handle matrices have inconsistent shapes".into(),
            ));
        }
    }
    let partials: Vec<_> = (0..r)
        .map(|f| forward_combine(handles, args, f, hidden, num_topk))
        .collect::<Result<_>>()?;
    (0..r)
        .map(|s| final_combine(handles, args, &partials, s, hidden, num_topk))
        .collect()
}

/// First stage (§3.5 combine forwarders): node-local sum per RDMA-received token, rounded.
fn forward_combine(
    handles: &[InternodeHandle],
    args: &[CombineArgs<'_>],
    f: usize,
    hidden: usize,
    num_topk: Option<usize>,
) -> Result<(Tensor2<bf16>, Option<Tensor2<f32>>)> {
    let me = &handles[f];
    let (node_f, nvl_f) = (f / NUM_MAX_NVL_PEERS, f % NUM_MAX_NVL_PEERS);
    let rows = me.num_rdma_recv_tokens;
    let mut px = Tensor2::filled(rows, hidden, bf16::ZERO);
    let mut pw = num_topk.map(|k| Tensor2::filled(rows, k, 0.0f32));
    let mut acc = vec![0.0f32; hidden];
    let mut xs: Vec<&[bf16]> = Vec::with_capacity(NUM_MAX_NVL_PEERS);
    let mut ws: Vec<&[f32]> = Vec::with_capacity(NUM_MAX_NVL_PEERS);
    for (n, c, seg) in forward_segments(
        &me.recv_rdma_rank_prefix_sum,
        &me.recv_rdma_channel_prefix_matrix,
    ) {
        let src = n * NUM_MAX_NVL_PEERS + nvl_f;
        for row in seg {
            if row >= rows {
                return Err(handle_mismatch(
                    f,
                    format!("forwarded row {row} past {rows}"),
                ));
            }
            xs.clear();
            ws.clear();
            for j in 0..NUM_MAX_NVL_PEERS {
                let seq = me.send_nvl_head.get(row, j);
                if seq < 0 {
                    continue;
                }
                let d = node_f * NUM_MAX_NVL_PEERS + j;
                let hd = &handles[d];
                let jrow = (hd.recv_gbl_channel_prefix_matrix.get(src, c) + seq) as usize;
                if jrow >= hd.num_recv_tokens.min(args[d].x.rows()) {
                    return Err(handle_mismatch(
                        f,
                        format!(
                            "forwarded row {row} maps to row {jrow} of rank {d}, past its received rows"
                        ),
                    ));
                }
                xs.push(args[d].x.row(jrow));
                if let Some(w) = args[d].topk_weights {
                    ws.push(w.row(jrow));
                }
            }
            combine_row(None, None, &xs, &mut acc, px.row_mut(row));
            if let Some(pw) = pw.as_mut() {
                combine_weights(&ws, pw.row_mut(row));
            }
        }
    }
    Ok((px, pw))
}

/// Second stage (§3.5 combine RDMA receivers): bias plus node partials, rounded again.
fn final_combine(
    handles: &[InternodeHandle],
    args: &[CombineArgs<'_>],
    partials: &[(Tensor2<bf16>, Option<Tensor2<f32>>)],
    s: usize,
    hidden: usize,
    num_topk: Option<usize>,
) -> Result<CombineOutput> {
    let own = &handles[s];
    let (node_s, nvl_s) = (s / NUM_MAX_NVL_PEERS, s % NUM_MAX_NVL_PEERS);
    let num_nodes = own.send_rdma_head.cols();
    let num_tokens = own.send_rdma_head.rows();
    let c_count = own.rdma_channel_prefix_matrix.cols();
    let mut combined_x = Tensor2::filled(num_tokens, hidden, bf16::ZERO);
    let mut combined_w = num_topk.map(|k| Tensor2::filled(num_tokens, k, 0.0f32));
    let mut acc = vec![0.0f32; hidden];
    let mut xs: Vec<&[bf16]> = Vec::with_capacity(num_nodes);
    let mut ws: Vec<&[f32]> = Vec::with_capacity(num_nodes);
    let b0 = args[s].bias.first();
    let b1 = args[s].bias.get(1);
    for c in 0..c_count {
        for t in channel_range(num_tokens, c_count, c) {
            xs.clear();
            ws.clear();
            for n in 0..num_nodes {
                let seq = own.send_rdma_head.get(t, n);
                if seq < 0 {
                    continue;
                }
                let f = n * NUM_MAX_NVL_PEERS + nvl_s;
                let hf = &handles[f];
                let block = if node_s == 0 {
                    0
                } else {
                    hf.recv_rdma_rank_prefix_sum[node_s - 1]
                };
                let start = if c == 0 {
                    0
                } else {
                    hf.recv_rdma_channel_prefix_matrix.get(node_s, c - 1)
                };
                let frow = (block + start + seq) as usize;
                let (px, pw) = &partials[f];
                if frow >= px.rows() {
                    return Err(handle_mismatch(
                        s,
                        format!(
                            "token {t} maps to forwarded row {frow} of rank {f}, past {}",
                            px.rows()
                        ),
                    ));
                }
                xs.push(px.row(frow));
                if let Some(pw) = pw {
                    ws.push(pw.row(frow));
                }
            }
            combine_row(
                b0.map(|b| b.row(t)),
                b1.map(|b| b.row(t)),
                &xs,
                &mut acc,
                combined_x.row_mut(t),
            );
            if let Some(cw) = combined_w.as_mut() {
                combine_weights(&ws, cw.row_mut(t));
            }
        }
    }
    Ok(CombineOutput {
        combined_x,
        combined_topk_weights: combined_w,
    })
}
