//! `get_dispatch_layout` (spec §1.7): fixed conformance cases 1 and 2 (spec §10), plan versus
//! oracle on random routings, and its typed errors.

mod normal_support;

use ep_core::plan::layout::{
    NUM_MAX_NVL_PEERS, channel_range, get_dispatch_layout, get_dispatch_layout_for_rank, num_nodes,
};
use ep_core::{Error, ExpertIdx, Tensor2, oracle};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn topk(rows: &[&[ExpertIdx]]) -> Tensor2<ExpertIdx> {
    let k = rows.first().map_or(0, |r| r.len());
    Tensor2::new(rows.len(), k, rows.concat()).unwrap()
}

/// Spec §10 case 1.
#[test]
fn case1_layout_basic() {
    let idx = topk(&[&[0, 3], &[2, -1], &[15, 14], &[-1, -1], &[4, 4]]);
    let lay = get_dispatch_layout(&idx, 16, 8).unwrap();
    assert_eq!(lay.num_tokens_per_expert[4], 2, "duplicate counted twice");
    let mut want_experts = vec![0; 16];
    for e in [0, 3, 2, 15, 14, 4, 4] {
        want_experts[e] += 1;
    }
    assert_eq!(lay.num_tokens_per_expert, want_experts);
    assert!(
        (0..8).all(|r| !lay.is_token_in_rank.get(3, r)),
        "token 3 in no rank"
    );
    let row0: Vec<usize> = (0..8).filter(|&r| lay.is_token_in_rank.get(0, r)).collect();
    assert_eq!(row0, vec![0, 1]);
    let sums: Vec<i32> = (0..8)
        .map(|r| (0..5).filter(|&t| lay.is_token_in_rank.get(t, r)).count() as i32)
        .collect();
    assert_eq!(lay.num_tokens_per_rank, sums);
    assert_eq!(lay.num_tokens_per_rank, vec![1, 2, 1, 0, 0, 0, 0, 1]);
    assert_eq!(lay.num_tokens_per_rdma_rank, None);
}

/// Spec §10 case 2.
#[test]
fn case2_layout_internode() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let idx = Tensor2::from_fn(64, 4, |_, _| rng.random_range(-1i64..32));
    let lay = get_dispatch_layout(&idx, 32, 16).unwrap();
    let per_node = lay.num_tokens_per_rdma_rank.clone().unwrap();
    assert_eq!(per_node.len(), 2);
    for (n, &count) in per_node.iter().enumerate() {
        let any = (0..64)
            .filter(|&t| (8 * n..8 * n + 8).any(|r| lay.is_token_in_rank.get(t, r)))
            .count();
        let direct = (0..64)
            .filter(|&t| {
                idx.row(t)
                    .iter()
                    .any(|&e| e >= 0 && (e / 2) as usize / 8 == n)
            })
            .count();
        assert_eq!(count as usize, any);
        assert_eq!(count as usize, direct);
    }
}

#[test]
fn channel_ranges_tile_the_tokens() {
    for t in 0..40 {
        for c_count in 1..13 {
            let mut next = 0;
            for c in 0..c_count {
                let r = channel_range(t, c_count, c);
                assert_eq!(r.start, next.min(t));
                next = r.end;
            }
            assert_eq!(next, t);
        }
    }
    assert_eq!(channel_range(10, 4, 3), 9..10);
    assert_eq!(channel_range(3, 8, 5), 3..3);
    assert_eq!(num_nodes(8), 1);
    assert_eq!(num_nodes(24), 3);
    assert_eq!(NUM_MAX_NVL_PEERS, 8);
}

#[test]
fn empty_batch() {
    let idx = Tensor2::<ExpertIdx>::new(0, 4, vec![]).unwrap();
    let lay = get_dispatch_layout(&idx, 32, 16).unwrap();
    assert_eq!(lay.num_tokens_per_rank, vec![0; 16]);
    assert_eq!(lay.num_tokens_per_rdma_rank, Some(vec![0; 2]));
    assert_eq!(lay.is_token_in_rank.shape(), (0, 16));
}

#[test]
fn error_expert_out_of_range_names_rank_token_slot() {
    let idx = topk(&[&[0, 1], &[2, 16]]);
    let err = get_dispatch_layout_for_rank(5, &idx, 16, 8).unwrap_err();
    assert_eq!(
        err,
        Error::ExpertOutOfRange {
            rank: 5,
            token: 1,
            slot: 1,
            expert: 16,
            num_experts: 16
        }
    );
    let idx = topk(&[&[-2]]);
    assert!(matches!(
        get_dispatch_layout(&idx, 16, 8),
        Err(Error::ExpertOutOfRange { expert: -2, .. })
    ));
}

#[test]
fn error_experts_not_divisible() {
    let idx = topk(&[&[0]]);
    assert_eq!(
        get_dispatch_layout(&idx, 10, 4).unwrap_err(),
        Error::ExpertsNotDivisible {
            num_experts: 10,
            num_ranks: 4
        }
    );
}

#[test]
fn error_invalid_rank_count() {
    let idx = topk(&[&[0]]);
    assert!(matches!(
        get_dispatch_layout(&idx, 12, 0),
        Err(Error::InvalidRankCount { num_ranks: 0, .. })
    ));
    // Any R >= 1 is planned (a partial last node): 12 ranks = nodes of 8 and 4.
    let lay = get_dispatch_layout(&idx, 12, 12).unwrap();
    assert_eq!(lay.num_tokens_per_rdma_rank, Some(vec![1, 0]));
}

proptest! {
    /// Plan layout equals the oracle's, bit for bit, for intranode and internode rank counts.
    #[test]
    fn layout_plan_matches_oracle(
        seed in any::<u64>(),
        r_code in 0usize..22,
        num_local in 1usize..4,
        t in 0usize..24,
        k in 1usize..10,
        mask in 0.0f64..0.6,
    ) {
        // 1..=16 ranks (intranode-style plan math; 16 is two nodes), then 24..=64.
        let r = if r_code < 16 { r_code + 1 } else { 16 + 8 * (r_code - 15) };
        prop_assume!(r <= 64);
        let e = r * num_local;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let idx = Tensor2::from_fn(t, k, |_, _| {
            if rng.random_bool(mask) { -1 } else { rng.random_range(0..e) as ExpertIdx }
        });
        let plan = get_dispatch_layout(&idx, e, r).unwrap();
        let want = oracle::normal::layout(&idx, e, r).unwrap();
        prop_assert_eq!(&plan, &want);
        prop_assert_eq!(plan.num_tokens_per_expert.iter().sum::<i32>() as usize,
            idx.data().iter().filter(|&&e| e >= 0).count());
    }
}
