//! Bad low-latency inputs give typed errors (spec §1.9), from the plan and — for dispatch —
//! the same error from the independent oracle.

use ep_core::oracle::low_latency as oracle;
use ep_core::plan::low_latency::{
    self as plan, LlHandle, LlParams, canonicalize, map_rows, pack_layout_range,
};
use ep_core::{Activations, Error, RankInputs, Tensor2, Tensor3};
use half::bf16;

/// `r` ranks with `t` tokens each, hidden `h`, top-k `k`; token `i` of rank `s` routes to
/// experts `(s + i + j) % e` for `j < k` (distinct while `k <= e`).
fn inputs(r: usize, t: usize, h: usize, k: usize, e: usize) -> Vec<RankInputs> {
    (0..r)
        .map(|s| RankInputs {
            x: Activations::Bf16(Tensor2::from_fn(t, h, |i, c| {
                bf16::from_f32((s * 7 + i * 3 + c) as f32 * 0.125 - 4.0)
            })),
            topk_idx: Tensor2::from_fn(t, k, |i, j| ((s + i + j) % e) as i64),
            topk_weights: Tensor2::filled(t, k, 0.5),
        })
        .collect()
}

/// Dispatch must fail with `want` in both the plan and the oracle.
fn both_fail(inp: &[RankInputs], params: &LlParams, want: impl Fn(&Error) -> bool) {
    let a = plan::dispatch(inp, params).expect_err("plan accepted bad input");
    assert!(want(&a), "plan: unexpected error {a:?}");
    let b = oracle::dispatch(inp, params).expect_err("oracle accepted bad input");
    assert_eq!(a, b, "plan and oracle disagree");
    // Messages say what to do.
    assert!(!a.to_string().is_empty());
}

#[test]
fn good_inputs_pass() {
    let inp = inputs(4, 3, 512, 2, 8);
    plan::dispatch(&inp, &LlParams::new(4, 8)).unwrap();
    plan::dispatch(&inp, &LlParams::new(4, 8).with_fp8(true, true)).unwrap();
    oracle::dispatch(&inp, &LlParams::new(4, 8).with_fp8(false, false)).unwrap();
}

#[test]
fn too_many_tokens() {
    both_fail(&inputs(4, 5, 128, 2, 8), &LlParams::new(4, 8), |e| {
        matches!(
            e,
            Error::LlTooManyTokens {
                rank: 0,
                num_tokens: 5,
                num_max_dispatch_tokens_per_rank: 4
            }
        )
    });
}

#[test]
fn hidden_not_multiple_of_128() {
    both_fail(&inputs(2, 2, 192, 2, 4), &LlParams::new(2, 4), |e| {
        matches!(
            e,
            Error::HiddenMisaligned {
                value: 192,
                multiple: 128,
                ..
            }
        )
    });
    both_fail(&inputs(2, 2, 0, 2, 4), &LlParams::new(2, 4), |e| {
        matches!(e, Error::HiddenMisaligned { value: 0, .. })
    });
}

#[test]
fn fp8_hidden_not_multiple_of_512() {
    both_fail(
        &inputs(2, 2, 640, 2, 4),
        &LlParams::new(2, 4).with_fp8(false, false),
        |e| {
            matches!(
                e,
                Error::HiddenMisaligned {
                    value: 640,
                    multiple: 512,
                    ..
                }
            )
        },
    );
}

#[test]
fn ue8m0_requires_round_scale() {
    both_fail(
        &inputs(2, 2, 512, 2, 4),
        &LlParams::new(2, 4).with_fp8(false, true),
        |e| matches!(e, Error::Ue8m0WithoutRoundScale),
    );
}

#[test]
fn experts_not_divisible_or_zero() {
    both_fail(&inputs(4, 2, 128, 2, 6), &LlParams::new(2, 6), |e| {
        matches!(
            e,
            Error::ExpertsNotDivisible {
                num_experts: 6,
                num_ranks: 4
            }
        )
    });
    both_fail(&inputs(2, 0, 128, 2, 1), &LlParams::new(2, 0), |e| {
        matches!(
            e,
            Error::InvalidConfig {
                field: "num_experts",
                ..
            }
        )
    });
}

#[test]
fn topk_too_large() {
    both_fail(&inputs(2, 2, 128, 12, 16), &LlParams::new(2, 16), |e| {
        matches!(
            e,
            Error::TopkTooLarge {
                num_topk: 12,
                max: 11,
                ..
            }
        )
    });
}

#[test]
fn packed_rows_not_multiple_of_4() {
    both_fail(&inputs(3, 2, 128, 2, 6), &LlParams::new(3, 6), |e| {
        matches!(
            e,
            Error::PackedRowsMisaligned {
                num_ranks: 3,
                num_max_dispatch_tokens_per_rank: 3
            }
        )
    });
}

#[test]
fn expert_out_of_range() {
    for bad in [8, -2] {
        let mut inp = inputs(2, 2, 128, 2, 8);
        inp[1].topk_idx.set(1, 0, bad);
        both_fail(&inp, &LlParams::new(2, 8), |e| {
            matches!(
                e,
                Error::ExpertOutOfRange {
                    rank: 1,
                    token: 1,
                    slot: 0,
                    ..
                }
            )
        });
    }
}

#[test]
fn fp8_activations_rejected() {
    let mut inp = inputs(2, 2, 128, 2, 4);
    inp[1].x = Activations::Fp8 {
        data: Tensor2::filled(2, 128, 0),
        scales: Tensor2::filled(2, 1, 1.0),
    };
    both_fail(&inp, &LlParams::new(2, 4), |e| {
        matches!(e, Error::LlExpectsBf16 { rank: 1 })
    });
}

#[test]
fn inconsistent_shapes() {
    // Hidden differs across ranks.
    let mut inp = inputs(2, 2, 128, 2, 4);
    inp[1].x = Activations::Bf16(Tensor2::filled(2, 256, bf16::ONE));
    both_fail(&inp, &LlParams::new(2, 4), |e| {
        matches!(e, Error::ShapeMismatch { .. })
    });
    // x rows differ from topk_idx rows.
    let mut inp = inputs(2, 2, 128, 2, 4);
    inp[0].x = Activations::Bf16(Tensor2::filled(1, 128, bf16::ONE));
    both_fail(&inp, &LlParams::new(2, 4), |e| {
        matches!(e, Error::ShapeMismatch { .. })
    });
    // Weights shape differs from topk_idx.
    let mut inp = inputs(2, 2, 128, 2, 4);
    inp[0].topk_weights = Tensor2::filled(2, 3, 1.0);
    both_fail(&inp, &LlParams::new(2, 4), |e| {
        matches!(e, Error::ShapeMismatch { .. })
    });
}

#[test]
fn rank_counts() {
    both_fail(&[], &LlParams::new(4, 8), |e| {
        matches!(e, Error::InvalidRankCount { num_ranks: 0, .. })
    });
    let params = LlParams::new(2, 4).with_masked_ranks(vec![false, true, false]);
    both_fail(&inputs(2, 2, 128, 2, 4), &params, |e| {
        matches!(
            e,
            Error::RankCountMismatch {
                expected: 2,
                found: 3
            }
        )
    });
    assert!(matches!(
        plan::dispatch_rank(&inputs(2, 2, 128, 2, 4), &LlParams::new(2, 4), 2),
        Err(Error::RankOutOfRange {
            rank: 2,
            num_ranks: 2
        })
    ));
    assert!(matches!(
        oracle::dispatch_rank(&inputs(2, 2, 128, 2, 4), &LlParams::new(2, 4), 2),
        Err(Error::RankOutOfRange {
            rank: 2,
            num_ranks: 2
        })
    ));
}

#[test]
fn duplicates_overflowing_slots() {
    // Every token names expert 1 twice: 2·T = 8 entries for 4 slots.
    let mut inp = inputs(2, 4, 128, 2, 4);
    inp[0].topk_idx = Tensor2::filled(4, 2, 1);
    both_fail(&inp, &LlParams::new(4, 4), |e| {
        matches!(
            e,
            Error::LlSlotOverflow {
                rank: 0,
                expert: 1,
                count: 8,
                num_max_dispatch_tokens_per_rank: 4
            }
        )
    });
}

/// Per-rank expert outputs `[L, R·N, H]` (`None` for masked ranks).
type ExpertOut = Vec<Option<Tensor3<bf16>>>;

fn dispatched(inp: &[RankInputs], params: &LlParams) -> (Vec<Option<LlHandle>>, ExpertOut) {
    let outs = plan::dispatch(inp, params).unwrap();
    let handles = outs
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    let y = outs
        .iter()
        .map(|o| {
            o.as_ref().map(|o| {
                map_rows(o, |_, r| r.iter().map(|&v| bf16::from_f32(v)).collect()).unwrap()
            })
        })
        .collect();
    (handles, y)
}

#[test]
fn combine_errors() {
    let inp = inputs(2, 3, 128, 2, 4);
    let params = LlParams::new(4, 4);
    let (handles, y) = dispatched(&inp, &params);
    plan::combine(&inp, &handles, &y, &params).unwrap();
    oracle::combine(&inp, &handles, &y, &params).unwrap();

    // Wrong number of per-rank entries.
    assert!(matches!(
        plan::combine(&inp, &handles[..1], &y, &params),
        Err(Error::RankCountMismatch {
            expected: 2,
            found: 1
        })
    ));
    // Missing outputs for an unmasked rank.
    let mut y_missing = y.clone();
    y_missing[1] = None;
    assert!(matches!(
        plan::combine(&inp, &handles, &y_missing, &params),
        Err(Error::ShapeMismatch { .. })
    ));
    // Expert outputs of the wrong shape.
    let mut y_bad = y.clone();
    if let Some(v) = y_bad[0].as_mut() {
        *v = Tensor3::zeros(v.matrices(), 3, 128);
    }
    assert!(matches!(
        plan::combine(&inp, &handles, &y_bad, &params),
        Err(Error::ShapeMismatch { .. })
    ));
    // A handle from another call (other N).
    let mut h_bad = handles.clone();
    if let Some(h) = h_bad[0].as_mut() {
        h.num_max_dispatch_tokens_per_rank = 8;
    }
    assert!(matches!(
        plan::combine(&inp, &h_bad, &y, &params),
        Err(Error::ShapeMismatch { .. })
    ));
    // Routing changed after dispatch: the handle has no row for the new entry.
    let mut inp2 = inp.clone();
    let old = inp2[0].topk_idx.get(0, 0);
    let other = (0..4)
        .find(|&e| !inp2[0].topk_idx.row(0).contains(&e))
        .unwrap();
    inp2[0].topk_idx.set(0, 0, other);
    let want = Error::LlMissingRow {
        rank: 0,
        token: 0,
        expert: other as usize,
        owner: other as usize / 2,
    };
    assert_eq!(
        plan::combine(&inp2, &handles, &y, &params),
        Err(want.clone())
    );
    assert_eq!(oracle::combine(&inp2, &handles, &y, &params), Err(want));
    assert_ne!(old, other);
    // Bad routing and weights shapes are caught by combine too.
    let mut inp3 = inp.clone();
    inp3[1].topk_weights = Tensor2::filled(3, 1, 1.0);
    assert!(matches!(
        plan::combine(&inp3, &handles, &y, &params),
        Err(Error::ShapeMismatch { .. })
    ));
    let mut inp4 = inp.clone();
    inp4[1].topk_idx.set(0, 0, 4);
    assert!(matches!(
        plan::combine(&inp4, &handles, &y, &params),
        Err(Error::ExpertOutOfRange { .. })
    ));
}

#[test]
fn canonicalize_rejects_invalid_layouts() {
    let inp = inputs(2, 4, 128, 2, 4);
    let params = LlParams::new(4, 4);
    let out = plan::dispatch(&inp, &params).unwrap()[0].clone().unwrap();
    canonicalize(&out).unwrap();
    let l = (0..2).find(|&l| out.recv_count[l] >= 2).unwrap();
    // Count disagrees with the blocks.
    let mut bad = out.clone();
    bad.recv_count[l] += 1;
    assert!(matches!(
        canonicalize(&bad),
        Err(Error::LlInvalidLayout { .. })
    ));
    // Overlapping blocks.
    let mut bad = out.clone();
    let total = out.recv_count[l] as u32;
    bad.handle
        .layout_range
        .set(l, 0, pack_layout_range(0, total - 1));
    bad.handle.layout_range.set(l, 1, pack_layout_range(0, 1));
    assert!(matches!(
        canonicalize(&bad),
        Err(Error::LlInvalidLayout { .. })
    ));
    // A block past the count.
    let mut bad = out.clone();
    bad.handle
        .layout_range
        .set(l, 0, pack_layout_range(1, total - 1));
    bad.handle
        .layout_range
        .set(l, 1, pack_layout_range(total, 1));
    assert!(matches!(
        canonicalize(&bad),
        Err(Error::LlInvalidLayout { .. })
    ));
}
