//! `get_dispatch_layout` (spec §1.7) and the channel split of a rank's tokens (spec §2.1).
//!
//! The layout is what every normal-mode dispatch starts from: per-rank, per-node and
//! per-expert counts and the `[T, R]` membership matrix that decides where each token goes.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::routing::{ExpertIdx, validate_routing};
use crate::tensor::Tensor2;

/// GPUs per NVLink domain (spec §0): ranks `8n..8n+7` form node `n`. Defined once, in
/// [`crate::config`].
pub use crate::config::NUM_MAX_NVL_PEERS;

/// The output of [`get_dispatch_layout`] (spec §1.7).
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchLayout {
    /// `[R]`: number of tokens with at least one expert on rank `r`.
    pub num_tokens_per_rank: Vec<i32>,
    /// `[RR]`: number of tokens with at least one expert on node `n` (ranks `8n..8n+7`);
    /// `Some` only when `R > 8` (internode), as in DeepEP.
    pub num_tokens_per_rdma_rank: Option<Vec<i32>>,
    /// `[E]`: number of `(token, slot)` pairs routed to expert `e` (duplicates count twice).
    pub num_tokens_per_expert: Vec<i32>,
    /// `[T, R]`: whether token `t` has at least one expert on rank `r`.
    pub is_token_in_rank: Tensor2<bool>,
}

/// Nodes spanned by `num_ranks` ranks, `max(ceil(R / 8), 1)`: the length of
/// `num_tokens_per_rdma_rank`. Equal to [`crate::config::num_rdma_ranks`] (`R / 8`) for every
/// `R` DeepEP accepts (`R % 8 == 0` above 8); layout planning also accepts a partial last node.
pub fn num_nodes(num_ranks: usize) -> usize {
    num_ranks.div_ceil(NUM_MAX_NVL_PEERS).max(1)
}

/// `chan(T, C, c)` of spec §2.1: channel `c`'s contiguous token range,
/// `per = ceil(T/C)`, `start = min(per*c, T)`, `end = min(start+per, T)`.
///
/// `num_channels` must be at least 1 (callers validate it).
pub fn channel_range(num_tokens: usize, num_channels: usize, channel: usize) -> Range<usize> {
    let per = num_tokens.div_ceil(num_channels);
    let start = (per * channel).min(num_tokens);
    let end = (start + per).min(num_tokens);
    start..end
}

/// Checks the rank count a normal-mode plan works with: at least one rank. (Internode plans
/// additionally need whole 8-GPU nodes; they check that themselves.)
pub(crate) fn check_num_ranks(num_ranks: usize) -> Result<()> {
    if num_ranks == 0 {
        return Err(Error::InvalidRankCount {
            num_ranks,
            need: "at least 1 rank",
        });
    }
    Ok(())
}

/// Checks `E >= 1` and `E % R == 0` (every rank holds `L = E / R` experts) and returns `L`: the
/// rule every backend applies before routing (the GPU's layout and dispatch call it too).
pub fn local_experts(num_experts: usize, num_ranks: usize) -> Result<usize> {
    check_num_ranks(num_ranks)?;
    if num_experts == 0 {
        return Err(Error::InvalidConfig {
            field: "num_experts",
            value: "0".into(),
            fix: "use at least one expert (a multiple of the rank count)".into(),
        });
    }
    if !num_experts.is_multiple_of(num_ranks) {
        return Err(Error::ExpertsNotDivisible {
            num_experts,
            num_ranks,
        });
    }
    Ok(num_experts / num_ranks)
}

/// `get_dispatch_layout(topk_idx, num_experts)` on a rank of a group of `num_ranks` (spec §1.7).
///
/// Errors name rank 0; a caller that knows its rank uses [`get_dispatch_layout_for_rank`].
pub fn get_dispatch_layout(
    topk_idx: &Tensor2<ExpertIdx>,
    num_experts: usize,
    num_ranks: usize,
) -> Result<DispatchLayout> {
    get_dispatch_layout_for_rank(0, topk_idx, num_experts, num_ranks)
}

/// [`get_dispatch_layout`] whose errors name `rank`.
///
/// DeepEP silently ignores out-of-range ids; ep-rs rejects them (`Error::ExpertOutOfRange`),
/// since such routing is always a bug upstream. `-1` is a masked slot.
pub fn get_dispatch_layout_for_rank(
    rank: usize,
    topk_idx: &Tensor2<ExpertIdx>,
    num_experts: usize,
    num_ranks: usize,
) -> Result<DispatchLayout> {
    let num_local = local_experts(num_experts, num_ranks)?;
    validate_routing(topk_idx, num_experts, rank)?;
    let num_tokens = topk_idx.rows();
    let rr = num_nodes(num_ranks);

    let mut num_tokens_per_expert = vec![0i32; num_experts];
    let mut num_tokens_per_rank = vec![0i32; num_ranks];
    let mut num_tokens_per_node = vec![0i32; rr];
    let mut is_token_in_rank = Tensor2::filled(num_tokens, num_ranks, false);
    // Scratch flags per token, reset for each row; counting from the flags (not from the
    // slots) is what makes a token with two experts on one rank count once for that rank.
    let mut node_hit = vec![false; rr];
    for t in 0..num_tokens {
        node_hit.iter_mut().for_each(|h| *h = false);
        for &e in topk_idx.row(t) {
            if e < 0 {
                continue;
            }
            // In range: validated above.
            let e = e as usize;
            num_tokens_per_expert[e] += 1;
            let r = e / num_local;
            is_token_in_rank.set(t, r, true);
            node_hit[r / NUM_MAX_NVL_PEERS] = true;
        }
        for (r, count) in num_tokens_per_rank.iter_mut().enumerate() {
            *count += i32::from(is_token_in_rank.get(t, r));
        }
        for (n, count) in num_tokens_per_node.iter_mut().enumerate() {
            *count += i32::from(node_hit[n]);
        }
    }
    Ok(DispatchLayout {
        num_tokens_per_rank,
        num_tokens_per_rdma_rank: (num_ranks > NUM_MAX_NVL_PEERS).then_some(num_tokens_per_node),
        num_tokens_per_expert,
        is_token_in_rank,
    })
}
