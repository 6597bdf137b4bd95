//! Reference oracle for normal mode, intranode (spec §1.7, §2.1, §2.2).
//!
//! Everything here is written straight from the spec's definitions with nested loops, from the
//! routing alone (no layout, no prefix-sum bookkeeping), and shares no code with
//! [`crate::plan`] — only its output types — so that a mistake in one shows up as a
//! disagreement with the other.

#![allow(
    clippy::needless_range_loop,
    reason = "the oracle indexes by rank and token, as the spec's formulas do"
)]

use std::collections::BTreeMap;

use half::bf16;

use crate::error::{Error, Result};
use crate::plan::combine::{CombineArgs, CombineOutput};
use crate::plan::intranode::{DispatchOptions, DispatchOutput, IntranodeDispatch, IntranodeHandle};
use crate::plan::layout::DispatchLayout;
use crate::routing::{Activations, ExpertIdx, RankInputs, validate_inputs, validate_routing};
use crate::tensor::Tensor2;

/// `chan(T, C, c)` (spec §2.1), written out again on purpose: `(start, end)`.
pub(crate) fn chan(num_tokens: usize, num_channels: usize, c: usize) -> (usize, usize) {
    let per = num_tokens.div_ceil(num_channels);
    let start = std::cmp::min(per * c, num_tokens);
    let end = std::cmp::min(start + per, num_tokens);
    (start, end)
}

/// The channel token `t` falls in.
pub(crate) fn channel_of(num_tokens: usize, num_channels: usize, t: usize) -> usize {
    for c in 0..num_channels {
        let (start, end) = chan(num_tokens, num_channels, c);
        if start <= t && t < end {
            return c;
        }
    }
    unreachable!("token {t} of {num_tokens} is in no channel")
}

/// Whether token row `topk` (of a rank) has an expert on rank `d` (`L` experts per rank).
pub(crate) fn goes_to(topk: &[ExpertIdx], d: usize, num_local: usize) -> bool {
    let mut any = false;
    for &e in topk {
        if e >= 0 && (e as usize) / num_local == d {
            any = true;
        }
    }
    any
}

/// Checks what the oracle needs to run without panicking; returns `L`.
pub(crate) fn check(
    inputs: &[RankInputs],
    num_experts: usize,
    opts: &DispatchOptions,
) -> Result<usize> {
    let r = inputs.len();
    if r == 0 {
        return Err(Error::InvalidRankCount {
            num_ranks: 0,
            need: "at least 1 rank",
        });
    }
    if !num_experts.is_multiple_of(r) {
        return Err(Error::ExpertsNotDivisible {
            num_experts,
            num_ranks: r,
        });
    }
    if opts.num_channels == 0 || opts.expert_alignment == 0 {
        return Err(Error::InvalidConfig {
            field: "num_channels / expert_alignment",
            value: format!("{} / {}", opts.num_channels, opts.expert_alignment),
            fix: "both must be at least 1".into(),
        });
    }
    for (s, inp) in inputs.iter().enumerate() {
        validate_inputs(inp, num_experts, s)?;
        let same_kind = matches!(
            (&inputs[0].x, &inp.x),
            (Activations::Bf16(_), Activations::Bf16(_))
                | (Activations::Fp8 { .. }, Activations::Fp8 { .. })
        );
        if !same_kind || inp.x.hidden() != inputs[0].x.hidden() {
            return Err(Error::ShapeMismatch {
                what: "activations",
                expected: "one dtype and hidden size".into(),
                found: format!("rank {s} differs"),
            });
        }
        if opts.with_topk && inp.num_topk() != inputs[0].num_topk() {
            return Err(Error::ShapeMismatch {
                what: "top-k",
                expected: inputs[0].num_topk().to_string(),
                found: format!("{} on rank {s}", inp.num_topk()),
            });
        }
    }
    Ok(num_experts / r)
}

/// `get_dispatch_layout` straight from spec §1.7's four definitions.
pub fn layout(
    topk_idx: &Tensor2<ExpertIdx>,
    num_experts: usize,
    num_ranks: usize,
) -> Result<DispatchLayout> {
    if num_ranks == 0 || !num_experts.is_multiple_of(num_ranks) {
        return Err(Error::ExpertsNotDivisible {
            num_experts,
            num_ranks,
        });
    }
    validate_routing(topk_idx, num_experts, 0)?;
    let num_local = num_experts / num_ranks;
    let t_count = topk_idx.rows();
    let mut num_tokens_per_expert = vec![0i32; num_experts];
    for t in 0..t_count {
        for &e in topk_idx.row(t) {
            for (x, count) in num_tokens_per_expert.iter_mut().enumerate() {
                if e == x as ExpertIdx {
                    *count += 1;
                }
            }
        }
    }
    let is_token_in_rank = Tensor2::from_fn(t_count, num_ranks, |t, r| {
        goes_to(topk_idx.row(t), r, num_local)
    });
    let mut num_tokens_per_rank = vec![0i32; num_ranks];
    for (r, count) in num_tokens_per_rank.iter_mut().enumerate() {
        for t in 0..t_count {
            if is_token_in_rank.get(t, r) {
                *count += 1;
            }
        }
    }
    let num_tokens_per_rdma_rank = if num_ranks > 8 {
        // Node n holds ranks 8n..8n+7 (a partial last node when R % 8 != 0).
        let mut per_node = vec![0i32; num_ranks.div_ceil(8)];
        for (n, count) in per_node.iter_mut().enumerate() {
            for t in 0..t_count {
                if (8 * n..std::cmp::min(8 * n + 8, num_ranks)).any(|r| is_token_in_rank.get(t, r))
                {
                    *count += 1;
                }
            }
        }
        Some(per_node)
    } else {
        None
    };
    Ok(DispatchLayout {
        num_tokens_per_rank,
        num_tokens_per_rdma_rank,
        num_tokens_per_expert,
        is_token_in_rank,
    })
}

/// `[T_s, R]` per rank: whether token `t` of rank `s` has an expert on rank `d`.
pub(crate) fn goes_table(inputs: &[RankInputs], num_local: usize) -> Vec<Tensor2<bool>> {
    let r = inputs.len();
    let mut table = Vec::new();
    for inp in inputs {
        table.push(Tensor2::from_fn(inp.num_tokens(), r, |t, d| {
            goes_to(inp.topk_idx.row(t), d, num_local)
        }));
    }
    table
}

/// The rank-independent part of what receiver `d` gets (spec §2.1, §2.2): the list of
/// `(source rank, token)` in receive order, `recv_x`, top-k and the expert list.
pub(crate) struct Received {
    pub(crate) list: Vec<(usize, usize)>,
    pub(crate) recv_x: Activations,
    pub(crate) recv_topk_idx: Option<Tensor2<ExpertIdx>>,
    pub(crate) recv_topk_weights: Option<Tensor2<f32>>,
    pub(crate) expert_list: Vec<i32>,
    pub(crate) rows: usize,
}

/// Receive order: for `s` in `0..R`, for `t` in `0..T_s`, if any expert of `t` lives on `d`,
/// push. Tail rows (worst-case sizing): zero data and scales, `-1` ids, `0.0` weights.
pub(crate) fn receive(
    inputs: &[RankInputs],
    d: usize,
    num_local: usize,
    opts: &DispatchOptions,
) -> Result<Received> {
    let mut list = Vec::new();
    for (s, inp) in inputs.iter().enumerate() {
        for t in 0..inp.num_tokens() {
            if goes_to(inp.topk_idx.row(t), d, num_local) {
                list.push((s, t));
            }
        }
    }
    let rows = if opts.num_worst_tokens > 0 {
        if list.len() > opts.num_worst_tokens {
            return Err(Error::WorstTokensTooSmall {
                rank: d,
                num_worst_tokens: opts.num_worst_tokens,
                needed: list.len(),
            });
        }
        opts.num_worst_tokens
    } else {
        list.len()
    };

    let mut recv_x = match &inputs[0].x {
        Activations::Bf16(x) => Activations::Bf16(Tensor2::filled(0, x.cols(), bf16::ZERO)),
        Activations::Fp8 { data, scales } => Activations::Fp8 {
            data: Tensor2::filled(0, data.cols(), 0u8),
            scales: Tensor2::filled(0, scales.cols(), 0.0f32),
        },
    };
    for &(s, t) in &list {
        match (&mut recv_x, &inputs[s].x) {
            (Activations::Bf16(out), Activations::Bf16(x)) => out.push_row(x.row(t))?,
            (
                Activations::Fp8 { data, scales },
                Activations::Fp8 {
                    data: xd,
                    scales: xs,
                },
            ) => {
                data.push_row(xd.row(t))?;
                scales.push_row(xs.row(t))?;
            }
            _ => unreachable!("kinds checked"),
        }
    }
    while list.len() < rows && recv_x.num_tokens() < rows {
        match &mut recv_x {
            Activations::Bf16(out) => out.push_row(&vec![bf16::ZERO; out.cols()])?,
            Activations::Fp8 { data, scales } => {
                data.push_row(&vec![0u8; data.cols()])?;
                scales.push_row(&vec![0.0f32; scales.cols()])?;
            }
        }
    }

    let (recv_topk_idx, recv_topk_weights) = if opts.with_topk {
        let k = inputs[0].num_topk();
        let mut idx = Tensor2::filled(rows, k, -1 as ExpertIdx);
        let mut w = Tensor2::filled(rows, k, 0.0f32);
        for (j, &(s, t)) in list.iter().enumerate() {
            for kk in 0..k {
                let e = inputs[s].topk_idx.get(t, kk);
                let lo = (d * num_local) as ExpertIdx;
                let hi = ((d + 1) * num_local) as ExpertIdx;
                if lo <= e && e < hi {
                    idx.set(j, kk, e - lo);
                    w.set(j, kk, inputs[s].topk_weights.get(t, kk));
                }
            }
        }
        (Some(idx), Some(w))
    } else {
        (None, None)
    };

    let mut expert_list = Vec::new();
    if opts.num_worst_tokens == 0 {
        for l in 0..num_local {
            let e = (d * num_local + l) as ExpertIdx;
            let mut count = 0usize;
            for inp in inputs {
                for t in 0..inp.num_tokens() {
                    for &x in inp.topk_idx.row(t) {
                        if x == e {
                            count += 1;
                        }
                    }
                }
            }
            let a = opts.expert_alignment;
            expert_list.push((count.div_ceil(a) * a) as i32);
        }
    }
    Ok(Received {
        list,
        recv_x,
        recv_topk_idx,
        recv_topk_weights,
        expert_list,
        rows,
    })
}

/// Intranode dispatch for every rank (spec §2.2), handle fields from their definitions.
pub fn intranode_dispatch(
    inputs: &[RankInputs],
    num_experts: usize,
    opts: &DispatchOptions,
) -> Result<Vec<IntranodeDispatch>> {
    let num_local = check(inputs, num_experts, opts)?;
    let r = inputs.len();
    let c_count = opts.num_channels;
    let table = goes_table(inputs, num_local);
    let goes = |s: usize, t: usize, d: usize| table[s].get(t, d);

    // rank_prefix_matrix[i][j] = Σ_{s ≤ i} #{t of s going to j} (the same on every rank).
    let mut rpm = Tensor2::filled(r, r, 0i32);
    for i in 0..r {
        for j in 0..r {
            let mut sum = 0;
            for s in 0..=i {
                for t in 0..inputs[s].num_tokens() {
                    if goes(s, t, j) {
                        sum += 1;
                    }
                }
            }
            rpm.set(i, j, sum);
        }
    }

    let mut out = Vec::new();
    for d in 0..r {
        let got = receive(inputs, d, num_local, opts)?;
        let t_d = inputs[d].num_tokens();
        // channel_prefix_matrix (sender d)[dst][c] = #{t in channels 0..=c going to dst}.
        let mut cpm = Tensor2::filled(r, c_count, 0i32);
        for dst in 0..r {
            for c in 0..c_count {
                let mut sum = 0;
                for cc in 0..=c {
                    let (start, end) = chan(t_d, c_count, cc);
                    for t in start..end {
                        if goes(d, t, dst) {
                            sum += 1;
                        }
                    }
                }
                cpm.set(dst, c, sum);
            }
        }
        // recv_channel_prefix_matrix (receiver d)[s][c] = #{t of s in channels < c going to d}.
        let mut recv_cpm = Tensor2::filled(r, c_count, 0i32);
        for s in 0..r {
            for c in 0..c_count {
                let mut sum = 0;
                for cc in 0..c {
                    let (start, end) = chan(inputs[s].num_tokens(), c_count, cc);
                    for t in start..end {
                        if goes(s, t, d) {
                            sum += 1;
                        }
                    }
                }
                recv_cpm.set(s, c, sum);
            }
        }
        // send_head (sender d)[t][dst] = #{earlier tokens of t's channel going to dst}, or -1.
        let mut send_head = Tensor2::filled(t_d, r, -1i32);
        for t in 0..t_d {
            for dst in 0..r {
                if goes(d, t, dst) {
                    let (start, _) = chan(t_d, c_count, channel_of(t_d, c_count, t));
                    let earlier = (start..t).filter(|&u| goes(d, u, dst)).count();
                    send_head.set(t, dst, earlier as i32);
                }
            }
        }
        let mut recv_src_idx = vec![-1i32; got.rows];
        for (j, &(_, t)) in got.list.iter().enumerate() {
            recv_src_idx[j] = t as i32;
        }
        out.push(DispatchOutput {
            recv_x: got.recv_x,
            recv_topk_idx: got.recv_topk_idx,
            recv_topk_weights: got.recv_topk_weights,
            num_recv_tokens_per_expert_list: got.expert_list,
            handle: IntranodeHandle {
                rank_prefix_matrix: rpm.clone(),
                channel_prefix_matrix: cpm,
                recv_channel_prefix_matrix: recv_cpm,
                recv_src_idx,
                is_token_in_rank: Tensor2::from_fn(t_d, r, |t, dst| goes(d, t, dst)),
                send_head,
                num_recv_tokens: got.list.len(),
            },
        });
    }
    Ok(out)
}

/// Checks combine arguments enough to run without panicking.
pub(crate) fn check_combine(inputs: &[RankInputs], args: &[CombineArgs<'_>]) -> Result<()> {
    if args.len() != inputs.len() {
        return Err(Error::RankCountMismatch {
            expected: inputs.len(),
            found: args.len(),
        });
    }
    for (s, a) in args.iter().enumerate() {
        if a.bias.len() > 2 {
            return Err(Error::TooManyBiases {
                rank: s,
                found: a.bias.len(),
            });
        }
        let h = args[0].x.cols();
        let bias_ok = a
            .bias
            .iter()
            .all(|b| b.shape() == (inputs[s].num_tokens(), h));
        let w_ok = a.topk_weights.is_some() == args[0].topk_weights.is_some()
            && a.topk_weights.is_none_or(|w| w.rows() == a.x.rows());
        if a.x.cols() != h || !bias_ok || !w_ok {
            return Err(Error::ShapeMismatch {
                what: "combine arguments",
                expected: "one hidden size, [T, H] biases, weights on all ranks or none".into(),
                found: format!("rank {s} differs"),
            });
        }
    }
    Ok(())
}

/// For every receiver `d`, where each `(source rank, token)` landed: row `j` of `d`'s output.
pub(crate) fn row_maps(
    inputs: &[RankInputs],
    num_local: usize,
) -> Vec<BTreeMap<(usize, usize), usize>> {
    let mut maps = Vec::new();
    for d in 0..inputs.len() {
        let mut map = BTreeMap::new();
        let mut j = 0;
        for (s, inp) in inputs.iter().enumerate() {
            for t in 0..inp.num_tokens() {
                if goes_to(inp.topk_idx.row(t), d, num_local) {
                    map.insert((s, t), j);
                    j += 1;
                }
            }
        }
        maps.push(map);
    }
    maps
}

/// Intranode combine for every rank (spec §2.2): `combined_s[t] = bf16(f32(b0) + f32(b1) +
/// Σ_{d ascending, t went to d} f32(y_d[j_d(t)]))`, weights `Σ_d w_d[j_d(t)]` in f32.
/// `inputs` is the routing of the dispatch that `args` answer.
pub fn intranode_combine(
    inputs: &[RankInputs],
    num_experts: usize,
    args: &[CombineArgs<'_>],
) -> Result<Vec<CombineOutput>> {
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
            // (rank, row) of every rank the token reached, ascending rank.
            let mut reached = Vec::new();
            for (d, map) in maps.iter().enumerate() {
                if let Some(&j) = map.get(&(s, t)) {
                    reached.push((d, j));
                }
            }
            for col in 0..h {
                let b0 = args[s].bias.first().map_or(0.0, |b| b.get(t, col).to_f32());
                let b1 = args[s].bias.get(1).map_or(0.0, |b| b.get(t, col).to_f32());
                let mut acc = b0 + b1;
                for &(d, j) in &reached {
                    acc += args[d].x.get(j, col).to_f32();
                }
                x.set(t, col, bf16::from_f32(acc));
            }
            if let Some(w) = w.as_mut() {
                for kk in 0..w.cols() {
                    let mut acc = 0.0f32;
                    for &(d, j) in &reached {
                        if let Some(wd) = args[d].topk_weights {
                            acc += wd.get(j, kk);
                        }
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
