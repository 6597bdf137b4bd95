//! Reference oracle for normal mode, internode (spec §2.3): every handle field from its
//! definition, and combine with the two BF16 roundings (node partial, then final sum),
//! written as plain loops over ranks, nodes and tokens. Shares no code with [`crate::plan`].

#![allow(
    clippy::needless_range_loop,
    reason = "the oracle indexes by rank and token, as the spec's formulas do"
)]

use half::bf16;

use crate::error::{Error, Result};
use crate::oracle::normal::{
    chan, channel_of, check, check_combine, goes_table, receive, row_maps,
};
use crate::plan::combine::{CombineArgs, CombineOutput};
use crate::plan::internode::{InternodeDispatch, InternodeHandle, SourceMeta};
use crate::plan::intranode::{DispatchOptions, DispatchOutput};
use crate::routing::RankInputs;
use crate::tensor::Tensor2;

const NVL: usize = 8;

fn check_nodes(r: usize) -> Result<usize> {
    if r < 16 || !r.is_multiple_of(NVL) {
        return Err(Error::InvalidRankCount {
            num_ranks: r,
            need: "internode mode: at least 2 nodes of 8 ranks",
        });
    }
    Ok(r / NVL)
}

/// Internode dispatch for every rank (spec §2.3).
pub fn internode_dispatch(
    inputs: &[RankInputs],
    num_experts: usize,
    opts: &DispatchOptions,
) -> Result<Vec<InternodeDispatch>> {
    let num_nodes = check_nodes(inputs.len())?;
    let num_local = check(inputs, num_experts, opts)?;
    let r = inputs.len();
    let c_count = opts.num_channels;
    let table = goes_table(inputs, num_local);
    let goes = |s: usize, t: usize, d: usize| table[s].get(t, d);
    let on_node = |s: usize, t: usize, n: usize| (0..NVL).any(|i| goes(s, t, n * NVL + i));
    let ntok = |s: usize| inputs[s].num_tokens();

    // Sender-side prefix over channels 0..=c of tokens satisfying `pred`.
    let prefix = |s: usize, c: usize, pred: &dyn Fn(usize) -> bool| -> i32 {
        let mut sum = 0;
        for cc in 0..=c {
            let (start, end) = chan(ntok(s), c_count, cc);
            for t in start..end {
                if pred(t) {
                    sum += 1;
                }
            }
        }
        sum
    };
    // Number of earlier tokens in t's channel satisfying `pred`.
    let seq = |s: usize, t: usize, pred: &dyn Fn(usize) -> bool| -> i32 {
        let (start, _) = chan(ntok(s), c_count, channel_of(ntok(s), c_count, t));
        (start..t).filter(|&u| pred(u)).count() as i32
    };

    let mut out = Vec::new();
    for d in 0..r {
        let (node_d, nvl_d) = (d / NVL, d % NVL);
        let got = receive(inputs, d, num_local, opts)?;

        let rdma_cpm = Tensor2::from_fn(num_nodes, c_count, |n, c| {
            prefix(d, c, &|t| on_node(d, t, n))
        });
        let gbl_cpm = Tensor2::from_fn(r, c_count, |dst, c| prefix(d, c, &|t| goes(d, t, dst)));
        let send_rdma_head = Tensor2::from_fn(ntok(d), num_nodes, |t, n| {
            if on_node(d, t, n) {
                seq(d, t, &|u| on_node(d, u, n))
            } else {
                -1
            }
        });

        // Forwarder side: sources are the same-index ranks of every node.
        let mut recv_rdma_rank_prefix_sum = Vec::new();
        let mut sum = 0;
        for n in 0..num_nodes {
            let src = n * NVL + nvl_d;
            sum += (0..ntok(src)).filter(|&t| on_node(src, t, node_d)).count() as i32;
            recv_rdma_rank_prefix_sum.push(sum);
        }
        let recv_rdma_cpm = Tensor2::from_fn(num_nodes, c_count, |n, c| {
            let src = n * NVL + nvl_d;
            prefix(src, c, &|t| on_node(src, t, node_d))
        });
        let mut rdma_rows = Vec::new();
        for n in 0..num_nodes {
            let src = n * NVL + nvl_d;
            for t in 0..ntok(src) {
                if on_node(src, t, node_d) {
                    rdma_rows.push((src, t));
                }
            }
        }
        let send_nvl_head = Tensor2::from_fn(rdma_rows.len(), NVL, |row, i| {
            let (src, t) = rdma_rows[row];
            let dst = node_d * NVL + i;
            if goes(src, t, dst) {
                seq(src, t, &|u| goes(src, u, dst))
            } else {
                -1
            }
        });

        // Receiver side.
        let mut recv_gbl_rank_prefix_sum = Vec::new();
        let mut sum = 0;
        for s in 0..r {
            sum += (0..ntok(s)).filter(|&t| goes(s, t, d)).count() as i32;
            recv_gbl_rank_prefix_sum.push(sum);
        }
        let recv_gbl_cpm = Tensor2::from_fn(r, c_count, |s, c| {
            let mut row = if s == 0 {
                0
            } else {
                recv_gbl_rank_prefix_sum[s - 1]
            };
            for cc in 0..c {
                let (start, end) = chan(ntok(s), c_count, cc);
                row += (start..end).filter(|&t| goes(s, t, d)).count() as i32;
            }
            row
        });
        let mut recv_src_meta = vec![
            SourceMeta {
                src_rdma_rank: -1,
                is_token_in_nvl_ranks: 0,
            };
            got.rows
        ];
        for (j, &(s, t)) in got.list.iter().enumerate() {
            let mut mask = 0;
            for i in 0..NVL {
                if goes(s, t, node_d * NVL + i) {
                    mask |= 1 << i;
                }
            }
            recv_src_meta[j] = SourceMeta {
                src_rdma_rank: (s / NVL) as i32,
                is_token_in_nvl_ranks: mask,
            };
        }

        out.push(DispatchOutput {
            recv_x: got.recv_x,
            recv_topk_idx: got.recv_topk_idx,
            recv_topk_weights: got.recv_topk_weights,
            num_recv_tokens_per_expert_list: got.expert_list,
            handle: InternodeHandle {
                is_token_in_rank: table[d].clone(),
                rdma_channel_prefix_matrix: rdma_cpm,
                gbl_channel_prefix_matrix: gbl_cpm,
                recv_rdma_channel_prefix_matrix: recv_rdma_cpm,
                recv_rdma_rank_prefix_sum,
                recv_gbl_channel_prefix_matrix: recv_gbl_cpm,
                recv_gbl_rank_prefix_sum,
                recv_src_meta,
                send_rdma_head,
                send_nvl_head,
                num_rdma_recv_tokens: rdma_rows.len(),
                num_recv_tokens: got.list.len(),
            },
        });
    }
    Ok(out)
}

/// Internode combine for every rank (spec §2.3): per node `n` ascending that token `t` reached,
/// `p_n = bf16(0.0 + Σ_{d in node n ascending, t went to d} f32(y_d[j_d(t)]))`; then
/// `combined_s[t] = bf16(f32(b0) + f32(b1) + Σ_n f32(p_n))`. Weights: per-node f32 partials
/// (not rounded), summed over nodes from `0.0`.
pub fn internode_combine(
    inputs: &[RankInputs],
    num_experts: usize,
    args: &[CombineArgs<'_>],
) -> Result<Vec<CombineOutput>> {
    let num_nodes = check_nodes(inputs.len())?;
    let num_local = check(inputs, num_experts, &DispatchOptions::default())?;
    check_combine(inputs, args)?;
    let maps = row_maps(inputs, num_local);
    let h = args[0].x.cols();
    let mut out = Vec::new();
    for (s, inp) in inputs.iter().enumerate() {
        let t_s = inp.num_tokens();
        let mut x = Tensor2::filled(t_s, h, bf16::ZERO);
        let k = args[s].topk_weights.map(|w| w.cols());
        let mut w = k.map(|k| Tensor2::filled(t_s, k, 0.0f32));
        for t in 0..t_s {
            // Per node, (rank, row) of every rank of that node the token reached, ascending.
            let mut per_node: Vec<Vec<(usize, usize)>> = vec![Vec::new(); num_nodes];
            for (d, map) in maps.iter().enumerate() {
                if let Some(&j) = map.get(&(s, t)) {
                    per_node[d / NVL].push((d, j));
                }
            }
            for col in 0..h {
                let b0 = args[s].bias.first().map_or(0.0, |b| b.get(t, col).to_f32());
                let b1 = args[s].bias.get(1).map_or(0.0, |b| b.get(t, col).to_f32());
                let mut acc = b0 + b1;
                for node in &per_node {
                    if node.is_empty() {
                        continue;
                    }
                    // Node-local partial, rounded to BF16 once.
                    let mut partial = 0.0f32;
                    for &(d, j) in node {
                        partial += args[d].x.get(j, col).to_f32();
                    }
                    acc += bf16::from_f32(partial).to_f32();
                }
                x.set(t, col, bf16::from_f32(acc));
            }
            if let Some(w) = w.as_mut() {
                for kk in 0..w.cols() {
                    let mut acc = 0.0f32;
                    for node in &per_node {
                        let mut partial = 0.0f32;
                        for &(d, j) in node {
                            if let Some(wd) = args[d].topk_weights {
                                partial += wd.get(j, kk);
                            }
                        }
                        acc += partial;
                    }
                    w.set(t, kk, acc);
                }
            }
        }
        out.push(CombineOutput {
            combined_x: x,
            combined_topk_weights: w,
        });
    }
    Ok(out)
}
