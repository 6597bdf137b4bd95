//! Intranode normal mode (spec §2.1, §2.2, §3.4, §7.1): plan versus oracle on random cases
//! (bit-equal), cached dispatch, combine with biases and weights, the send_head rewrite, the
//! dispatch → combine identity, spec §10 cases 3–10 (data parts), and typed errors.

mod normal_support;

use ep_core::plan::combine::{CombineArgs, SEND_HEAD_SENTINEL};
use ep_core::plan::intranode::{
    DispatchOptions, IntranodeDispatch, intranode_combine, intranode_dispatch,
    intranode_dispatch_all, intranode_dispatch_cached, rewrite_send_head,
};
use ep_core::plan::layout::{channel_range, get_dispatch_layout};
use ep_core::{Activations, Error, RankInputs, Tensor2, oracle};
use half::bf16;
use normal_support::{
    Case, Routing, bf16_rows, dispatch_options, gen_inputs, layouts, rand_bf16_tensor,
    rand_f32_tensor, routing_from,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A random intranode case and dispatch options.
fn case_strategy() -> impl Strategy<Value = (Case, DispatchOptions)> {
    (
        (
            any::<u64>(),
            1usize..=16,
            0usize..=10,
            1usize..=3,
            1usize..=9,
        ),
        (
            1usize..=8,
            any::<bool>(),
            0.0f64..0.5,
            any::<u8>(),
            any::<usize>(),
        ),
        (1usize..=12, 1usize..=5, any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(
                (seed, num_ranks, max_tokens, num_local, num_topk),
                (h8, fp8, mask, code, victim),
                (num_channels, expert_alignment, worst, with_topk),
            )| {
                let case = Case {
                    seed,
                    num_ranks,
                    max_tokens,
                    num_local,
                    num_topk,
                    hidden: 8 * h8,
                    fp8,
                    mask,
                    routing: routing_from(code, victim),
                };
                let opts = dispatch_options(
                    num_channels,
                    expert_alignment,
                    worst,
                    with_topk,
                    max_tokens.max(1) * num_ranks,
                );
                (case, opts)
            },
        )
}

/// Per-rank expert outputs, per-rank weights, and per-rank biases.
type CombineInputs = (
    Vec<Tensor2<bf16>>,
    Vec<Tensor2<f32>>,
    Vec<Vec<Tensor2<bf16>>>,
);

/// Random per-rank combine inputs aligned with each rank's dispatch rows.
fn combine_inputs(
    seed: u64,
    inputs: &[RankInputs],
    outs: &[IntranodeDispatch],
    hidden: usize,
    num_biases: usize,
    with_weights: bool,
) -> CombineInputs {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let k = inputs[0].num_topk();
    let ys = outs
        .iter()
        .map(|o| rand_bf16_tensor(&mut rng, o.handle.recv_src_idx.len(), hidden))
        .collect();
    let ws = if with_weights {
        outs.iter()
            .map(|o| rand_f32_tensor(&mut rng, o.handle.recv_src_idx.len(), k))
            .collect()
    } else {
        Vec::new()
    };
    let biases = inputs
        .iter()
        .map(|inp| {
            (0..num_biases)
                .map(|_| rand_bf16_tensor(&mut rng, inp.num_tokens(), hidden))
                .collect()
        })
        .collect();
    (ys, ws, biases)
}

fn args<'a>(
    ys: &'a [Tensor2<bf16>],
    ws: &'a [Tensor2<f32>],
    biases: &'a [Vec<Tensor2<bf16>>],
) -> Vec<CombineArgs<'a>> {
    (0..ys.len())
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: ws.get(d),
            bias: biases.get(d).map_or(&[], |b| b.as_slice()),
        })
        .collect()
}

fn num_ranks_reached(topk: &[i64], num_ranks: usize, num_local: usize) -> usize {
    (0..num_ranks)
        .filter(|&d| topk.iter().any(|&e| e >= 0 && e as usize / num_local == d))
        .count()
}

proptest! {
    /// Plan dispatch (all ranks, and rank by rank) equals the oracle bit for bit; cached
    /// dispatch reproduces `recv_x`.
    #[test]
    fn dispatch_plan_matches_oracle((case, opts) in case_strategy(), pick in any::<usize>()) {
        let inputs = gen_inputs(&case);
        let e = case.num_experts();
        let lays = layouts(&inputs, e);
        let plan = intranode_dispatch_all(&inputs, &lays, e, &opts).unwrap();
        let want = oracle::normal::intranode_dispatch(&inputs, e, &opts).unwrap();
        prop_assert_eq!(&plan, &want);
        let d = pick % case.num_ranks;
        let one = intranode_dispatch(&inputs, &lays, e, d, &opts).unwrap();
        prop_assert_eq!(&one, &plan[d]);
        let handles: Vec<_> = plan.iter().map(|o| o.handle.clone()).collect();
        let xs: Vec<&Activations> = inputs.iter().map(|i| &i.x).collect();
        let cached = intranode_dispatch_cached(&xs, &handles, d).unwrap();
        prop_assert_eq!(&cached, &plan[d].recv_x);
    }

    /// Plan combine equals the oracle bit for bit (random expert outputs, weights, 0–2
    /// biases), before and after the send_head rewrite; the rewrite is idempotent.
    #[test]
    fn combine_plan_matches_oracle(
        (case, opts) in case_strategy(),
        num_biases in 0usize..=2,
        with_weights in any::<bool>(),
    ) {
        let case = Case { fp8: false, ..case };
        let opts = DispatchOptions { with_topk: true, ..opts };
        let inputs = gen_inputs(&case);
        let e = case.num_experts();
        let lays = layouts(&inputs, e);
        let outs = intranode_dispatch_all(&inputs, &lays, e, &opts).unwrap();
        let (ys, ws, bs) =
            combine_inputs(case.seed, &inputs, &outs, case.hidden, num_biases, with_weights);
        let a = args(&ys, &ws, &bs);
        let mut handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
        let plan = intranode_combine(&handles, &a).unwrap();
        let want = oracle::normal::intranode_combine(&inputs, e, &a).unwrap();
        prop_assert_eq!(&plan, &want);

        for h in &mut handles {
            h.rewrite_send_head();
        }
        let once: Vec<_> = handles.iter().map(|h| h.send_head.clone()).collect();
        prop_assert_eq!(&intranode_combine(&handles, &a).unwrap(), &want);
        for h in &mut handles {
            h.rewrite_send_head();
        }
        for (h, o) in handles.iter().zip(&once) {
            prop_assert_eq!(&h.send_head, o);
        }
    }

    /// Dispatch then combine of the unchanged rows: `combined[t] = bf16(count_t * x[t])`
    /// exactly (the f32 sum of ≤ 16 equal BF16 values is exact), and the unchanged received
    /// weights give back the original weights of unmasked slots (0.0 for masked ones).
    #[test]
    fn round_trip_identity((case, opts) in case_strategy()) {
        let case = Case { fp8: false, ..case };
        let opts = DispatchOptions { with_topk: true, ..opts };
        let inputs = gen_inputs(&case);
        let e = case.num_experts();
        let outs = intranode_dispatch_all(&inputs, &layouts(&inputs, e), e, &opts).unwrap();
        let ys: Vec<_> = outs.iter().map(|o| bf16_rows(&o.recv_x).clone()).collect();
        let ws: Vec<_> = outs.iter().map(|o| o.recv_topk_weights.clone().unwrap()).collect();
        let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
        let got = intranode_combine(&handles, &args(&ys, &ws, &[])).unwrap();
        for (s, inp) in inputs.iter().enumerate() {
            let x = bf16_rows(&inp.x);
            for t in 0..inp.num_tokens() {
                let count = num_ranks_reached(inp.topk_idx.row(t), case.num_ranks, case.num_local);
                for col in 0..case.hidden {
                    // A token that reached no rank sums to +0.0 (the accumulator starts there).
                    let want = bf16::from_f32(0.0 + count as f32 * x.get(t, col).to_f32());
                    prop_assert_eq!(got[s].combined_x.get(t, col).to_bits(), want.to_bits());
                }
                let cw = got[s].combined_topk_weights.as_ref().unwrap();
                for k in 0..case.num_topk {
                    let want = if inp.topk_idx.get(t, k) >= 0 { inp.topk_weights.get(t, k) } else { 0.0 };
                    prop_assert_eq!(cw.get(t, k).to_bits(), want.to_bits());
                }
            }
        }
    }

    /// The rewrite turns each skipped head into `-(next valid head in its channel) - 1`
    /// (sentinel `2^25` when none), keeps valid heads, and is idempotent.
    #[test]
    fn send_head_rewrite_decodes_to_next_valid(
        seed in any::<u64>(), t in 0usize..30, r in 1usize..6, c_count in 1usize..8, p in 0.0f64..1.0,
    ) {
        use rand::Rng;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let member = Tensor2::from_fn(t, r, |_, _| rng.random_bool(p));
        // Raw heads: running count per (channel, column).
        let mut raw = Tensor2::filled(t, r, -1i32);
        for c in 0..c_count {
            for d in 0..r {
                let mut n = 0;
                for u in channel_range(t, c_count, c) {
                    if member.get(u, d) { raw.set(u, d, n); n += 1; }
                }
            }
        }
        let mut heads = raw.clone();
        rewrite_send_head(&mut heads, c_count);
        for c in 0..c_count {
            let range = channel_range(t, c_count, c);
            for u in range.clone() {
                for d in 0..r {
                    if raw.get(u, d) >= 0 {
                        prop_assert_eq!(heads.get(u, d), raw.get(u, d));
                    } else {
                        let next = (u + 1..range.end).map(|v| raw.get(v, d)).find(|&h| h >= 0)
                            .unwrap_or(SEND_HEAD_SENTINEL);
                        prop_assert_eq!(heads.get(u, d), -next - 1);
                    }
                }
            }
        }
        let once = heads.clone();
        rewrite_send_head(&mut heads, c_count);
        prop_assert_eq!(heads, once);
    }
}

// ---- spec §10 fixed cases -------------------------------------------------------------------

/// `x = rank` in every column but the last, which holds the token id.
fn structured_inputs(num_ranks: usize, t: usize, k: usize, e: usize, seed: u64) -> Vec<RankInputs> {
    let mut base = gen_inputs(&Case {
        seed,
        num_ranks,
        max_tokens: t,
        num_local: e / num_ranks,
        num_topk: k,
        hidden: 16,
        fp8: false,
        mask: 0.1,
        routing: Routing::Random,
    });
    for (s, inp) in base.iter_mut().enumerate() {
        let rows = inp.num_tokens();
        inp.x = Activations::Bf16(Tensor2::from_fn(rows, 16, |row, col| {
            bf16::from_f32(if col == 15 { row as f32 } else { s as f32 })
        }));
    }
    base
}

fn dispatch_all(inputs: &[RankInputs], e: usize, opts: &DispatchOptions) -> Vec<IntranodeDispatch> {
    intranode_dispatch_all(inputs, &layouts(inputs, e), e, opts).unwrap()
}

/// Case 3: blocks follow `rank_prefix_matrix[:, me]`, block s holds s's tokens ascending.
#[test]
fn case3_ordering() {
    let inputs = structured_inputs(4, 40, 4, 16, 3);
    let outs = dispatch_all(&inputs, 16, &DispatchOptions::default());
    for (d, o) in outs.iter().enumerate() {
        let rpm = &o.handle.rank_prefix_matrix;
        let x = bf16_rows(&o.recv_x);
        assert_eq!(x.rows() as i32, rpm.get(3, d));
        for s in 0..4 {
            let lo = if s == 0 { 0 } else { rpm.get(s - 1, d) } as usize;
            let hi = rpm.get(s, d) as usize;
            let mut prev = -1i32;
            for j in lo..hi {
                assert!(x.row(j)[..15].iter().all(|v| v.to_f32() == s as f32));
                let t = o.handle.recv_src_idx[j];
                assert!(t > prev, "src idx strictly increasing in a block");
                assert_eq!(x.get(j, 15).to_f32(), t as f32);
                prev = t;
            }
        }
    }
}

/// Case 4: `recv_topk_idx ∈ {-1} ∪ [0, L)`, counts match the list, weights exact.
#[test]
fn case4_topk_remap() {
    let inputs = structured_inputs(4, 40, 4, 16, 4);
    let outs = dispatch_all(&inputs, 16, &DispatchOptions::default());
    for (d, o) in outs.iter().enumerate() {
        let idx = o.recv_topk_idx.as_ref().unwrap();
        let w = o.recv_topk_weights.as_ref().unwrap();
        for l in 0..4 {
            let n = idx.data().iter().filter(|&&v| v == l).count();
            assert_eq!(n as i32, o.num_recv_tokens_per_expert_list[l as usize]);
        }
        for j in 0..idx.rows() {
            let (s, t) = (
                (0..4)
                    .find(|&s| o.handle.rank_prefix_matrix.get(s, d) as usize > j)
                    .unwrap(),
                o.handle.recv_src_idx[j] as usize,
            );
            for k in 0..4 {
                let v = idx.get(j, k);
                assert!(v == -1 || (0..4).contains(&v));
                if v == -1 {
                    assert_eq!(w.get(j, k).to_bits(), 0.0f32.to_bits());
                } else {
                    assert_eq!(inputs[s].topk_idx.get(t, k), v + 4 * d as i64);
                    assert_eq!(
                        w.get(j, k).to_bits(),
                        inputs[s].topk_weights.get(t, k).to_bits()
                    );
                }
            }
        }
    }
}

/// Case 5: expert alignment rounds the list only.
#[test]
fn case5_expert_alignment() {
    let inputs = structured_inputs(4, 40, 4, 16, 5);
    let plain = dispatch_all(&inputs, 16, &DispatchOptions::default());
    let opts = DispatchOptions {
        expert_alignment: 4,
        ..Default::default()
    };
    let aligned = dispatch_all(&inputs, 16, &opts);
    for (p, a) in plain.iter().zip(&aligned) {
        for (&n, &m) in p
            .num_recv_tokens_per_expert_list
            .iter()
            .zip(&a.num_recv_tokens_per_expert_list)
        {
            assert_eq!(m, (n + 3) / 4 * 4);
        }
        assert_eq!(p.recv_x, a.recv_x);
    }
}

/// Cases 6 and 7: round trip with and without bias; a token that reached no rank gets
/// exactly `b0 + b1`.
#[test]
fn case6_case7_round_trip_and_bias() {
    let mut inputs = structured_inputs(4, 40, 4, 16, 6);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for inp in &mut inputs {
        inp.x = Activations::Bf16(rand_bf16_tensor(&mut rng, inp.num_tokens(), 16));
    }
    // Token 0 of rank 1 reaches no rank.
    inputs[1].topk_idx.row_mut(0).fill(-1);
    let outs = dispatch_all(&inputs, 16, &DispatchOptions::default());
    let ys: Vec<_> = outs.iter().map(|o| bf16_rows(&o.recv_x).clone()).collect();
    let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
    let biases: Vec<Vec<_>> = inputs
        .iter()
        .map(|inp| {
            let t = inp.num_tokens();
            vec![
                Tensor2::filled(t, 16, bf16::ONE),
                rand_bf16_tensor(&mut rng, t, 16),
            ]
        })
        .collect();
    let got = intranode_combine(&handles, &args(&ys, &[], &biases)).unwrap();
    for (s, inp) in inputs.iter().enumerate() {
        let x = bf16_rows(&inp.x);
        for t in 0..inp.num_tokens() {
            let count = num_ranks_reached(inp.topk_idx.row(t), 4, 4) as f32;
            for col in 0..16 {
                let b = 1.0 + biases[s][1].get(t, col).to_f32();
                let want = bf16::from_f32(b + count * x.get(t, col).to_f32());
                assert_eq!(got[s].combined_x.get(t, col), want);
            }
        }
    }
    let t0 = &got[1].combined_x;
    for col in 0..16 {
        assert_eq!(
            t0.get(0, col),
            bf16::from_f32(1.0 + biases[1][1].get(0, col).to_f32())
        );
    }
}

/// Case 8: FP8 bytes and scales pass through verbatim.
#[test]
fn case8_fp8_passthrough() {
    let case = Case {
        seed: 8,
        num_ranks: 4,
        max_tokens: 30,
        num_local: 2,
        num_topk: 3,
        hidden: 256,
        fp8: true,
        mask: 0.1,
        routing: Routing::Random,
    };
    let inputs = gen_inputs(&case);
    let outs = dispatch_all(&inputs, 8, &DispatchOptions::default());
    for (d, o) in outs.iter().enumerate() {
        let Activations::Fp8 { data, scales } = &o.recv_x else {
            panic!("FP8 expected")
        };
        assert_eq!(scales.cols(), 2);
        for j in 0..data.rows() {
            let s = (0..4)
                .find(|&s| o.handle.rank_prefix_matrix.get(s, d) as usize > j)
                .unwrap();
            let t = o.handle.recv_src_idx[j] as usize;
            let Activations::Fp8 {
                data: sd,
                scales: ss,
            } = &inputs[s].x
            else {
                unreachable!()
            };
            assert_eq!(data.row(j), sd.row(t));
            assert_eq!(scales.row(j), ss.row(t));
        }
    }
}

/// Case 9: cached dispatch (no top-k, no count exchange) is bit-equal to the original.
#[test]
fn case9_cached_dispatch() {
    let inputs = structured_inputs(8, 50, 8, 64, 9);
    let opts = DispatchOptions {
        num_channels: 5,
        ..Default::default()
    };
    let outs = dispatch_all(&inputs, 64, &opts);
    let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
    let xs: Vec<&Activations> = inputs.iter().map(|i| &i.x).collect();
    for (d, o) in outs.iter().enumerate() {
        assert_eq!(
            intranode_dispatch_cached(&xs, &handles, d).unwrap(),
            o.recv_x
        );
    }
}

/// Case 10: `num_worst_tokens = T * R`: prefix equals the normal result, tail ids `-1`,
/// empty expert list; tail policy: zero rows, `-1` source index, `0.0` weights.
#[test]
fn case10_num_worst_tokens() {
    let inputs = structured_inputs(4, 30, 4, 16, 10);
    let normal = dispatch_all(&inputs, 16, &DispatchOptions::default());
    let opts = DispatchOptions {
        num_worst_tokens: 30 * 4,
        ..Default::default()
    };
    let worst = dispatch_all(&inputs, 16, &opts);
    for (n, w) in normal.iter().zip(&worst) {
        let m = n.handle.num_recv_tokens;
        assert_eq!(w.handle.num_recv_tokens, m);
        assert!(w.num_recv_tokens_per_expert_list.is_empty());
        let (xn, xw) = (bf16_rows(&n.recv_x), bf16_rows(&w.recv_x));
        assert_eq!(xw.rows(), 120);
        assert_eq!(&xw.data()[..m * 16], xn.data());
        assert!(xw.data()[m * 16..].iter().all(|v| v.to_bits() == 0));
        let (iw, ww) = (
            w.recv_topk_idx.as_ref().unwrap(),
            w.recv_topk_weights.as_ref().unwrap(),
        );
        assert_eq!(
            &iw.data()[..m * 4],
            n.recv_topk_idx.as_ref().unwrap().data()
        );
        assert!(iw.data()[m * 4..].iter().all(|&v| v == -1));
        assert!(ww.data()[m * 4..].iter().all(|&v| v == 0.0));
        assert!(w.handle.recv_src_idx[m..].iter().all(|&v| v == -1));
    }
    // Combine over worst-case-sized rows ignores the tail.
    let ys: Vec<_> = worst.iter().map(|o| bf16_rows(&o.recv_x).clone()).collect();
    let yn: Vec<_> = normal
        .iter()
        .map(|o| bf16_rows(&o.recv_x).clone())
        .collect();
    let hw: Vec<_> = worst.iter().map(|o| o.handle.clone()).collect();
    let hn: Vec<_> = normal.iter().map(|o| o.handle.clone()).collect();
    assert_eq!(
        intranode_combine(&hw, &args(&ys, &[], &[])).unwrap(),
        intranode_combine(&hn, &args(&yn, &[], &[])).unwrap()
    );
}

#[test]
fn empty_batches_and_starved_rank() {
    let case = Case {
        seed: 11,
        num_ranks: 4,
        max_tokens: 0,
        num_local: 2,
        num_topk: 2,
        hidden: 8,
        fp8: false,
        mask: 0.0,
        routing: Routing::Random,
    };
    let inputs = gen_inputs(&case);
    let outs = dispatch_all(&inputs, 8, &DispatchOptions::default());
    assert!(outs.iter().all(|o| o.recv_x.num_tokens() == 0));
    assert!(
        outs.iter()
            .all(|o| o.num_recv_tokens_per_expert_list == vec![0, 0])
    );

    let inputs = gen_inputs(&Case {
        max_tokens: 20,
        routing: Routing::Starve(2),
        ..case
    });
    let outs = dispatch_all(&inputs, 8, &DispatchOptions::default());
    assert_eq!(outs[2].recv_x.num_tokens(), 0);
    assert_eq!(outs[2].handle.rank_prefix_matrix.get(3, 2), 0);
}

// ---- typed errors ---------------------------------------------------------------------------

/// Two ranks, E = 4, three tokens each, every token on both ranks (rank 1's token 2 masked).
fn small() -> (Vec<RankInputs>, Vec<ep_core::plan::layout::DispatchLayout>) {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let routing = [[0, 3, 1, 2, 0, 2], [3, 0, 2, 1, -1, -1]];
    let inputs: Vec<RankInputs> = routing
        .iter()
        .map(|r| RankInputs {
            x: Activations::Bf16(rand_bf16_tensor(&mut rng, 3, 16)),
            topk_idx: Tensor2::new(3, 2, r.to_vec()).unwrap(),
            topk_weights: rand_f32_tensor(&mut rng, 3, 2),
        })
        .collect();
    let lays = layouts(&inputs, 4);
    (inputs, lays)
}

#[test]
fn error_rank_out_of_range() {
    let (inputs, lays) = small();
    let err = intranode_dispatch(&inputs, &lays, 4, 2, &DispatchOptions::default()).unwrap_err();
    assert_eq!(
        err,
        Error::RankOutOfRange {
            rank: 2,
            num_ranks: 2
        }
    );
}

#[test]
fn error_rank_count_mismatch() {
    let (inputs, lays) = small();
    let err =
        intranode_dispatch_all(&inputs, &lays[..1], 4, &DispatchOptions::default()).unwrap_err();
    assert_eq!(
        err,
        Error::RankCountMismatch {
            expected: 2,
            found: 1
        }
    );
}

#[test]
fn error_layout_mismatch() {
    let (inputs, mut lays) = small();
    lays[1] = get_dispatch_layout(&inputs[0].topk_idx, 4, 2).unwrap();
    let err = intranode_dispatch_all(&inputs, &lays, 4, &DispatchOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::LayoutMismatch { rank: 1, .. }),
        "{err:?}"
    );
}

#[test]
fn error_worst_tokens_too_small() {
    let (inputs, lays) = small();
    let need = (0..2)
        .map(|d| lays.iter().map(|l| l.num_tokens_per_rank[d]).sum::<i32>())
        .max()
        .unwrap();
    assert!(need >= 2, "case must receive rows");
    let opts = DispatchOptions {
        num_worst_tokens: 1,
        ..Default::default()
    };
    let err = intranode_dispatch_all(&inputs, &lays, 4, &opts).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorstTokensTooSmall {
                num_worst_tokens: 1,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn error_invalid_options() {
    let (inputs, lays) = small();
    for (opts, field) in [
        (
            DispatchOptions {
                num_channels: 0,
                ..Default::default()
            },
            "num_channels",
        ),
        (
            DispatchOptions {
                expert_alignment: 0,
                ..Default::default()
            },
            "expert_alignment",
        ),
        (
            DispatchOptions {
                num_worst_tokens: 8,
                with_topk: false,
                ..Default::default()
            },
            "num_worst_tokens",
        ),
    ] {
        let err = intranode_dispatch_all(&inputs, &lays, 4, &opts).unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig { field: f, .. } if f == field),
            "{err:?}"
        );
    }
}

#[test]
fn error_mixed_activations() {
    let (mut inputs, lays) = small();
    let t = inputs[1].num_tokens();
    inputs[1].x = Activations::Fp8 {
        data: Tensor2::filled(t, 16, 0u8),
        scales: Tensor2::filled(t, 1, 1.0),
    };
    let err = intranode_dispatch_all(&inputs, &lays, 4, &DispatchOptions::default()).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
}

#[test]
fn error_too_many_biases() {
    let (inputs, lays) = small();
    let outs = intranode_dispatch_all(&inputs, &lays, 4, &DispatchOptions::default()).unwrap();
    let ys: Vec<_> = outs.iter().map(|o| bf16_rows(&o.recv_x).clone()).collect();
    let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
    let three: Vec<Vec<_>> = inputs
        .iter()
        .map(|i| vec![Tensor2::filled(i.num_tokens(), 16, bf16::ONE); 3])
        .collect();
    let err = intranode_combine(&handles, &args(&ys, &[], &three)).unwrap_err();
    assert_eq!(err, Error::TooManyBiases { rank: 0, found: 3 });
}

#[test]
fn error_combine_shapes() {
    let (inputs, lays) = small();
    let outs = intranode_dispatch_all(&inputs, &lays, 4, &DispatchOptions::default()).unwrap();
    let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
    // One row too many on rank 0.
    let ys: Vec<_> = outs
        .iter()
        .enumerate()
        .map(|(d, o)| Tensor2::filled(o.recv_x.num_tokens() + usize::from(d == 0), 16, bf16::ONE))
        .collect();
    let err = intranode_combine(&handles, &args(&ys, &[], &[])).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
    // Weights on one rank only.
    let ys: Vec<_> = outs.iter().map(|o| bf16_rows(&o.recv_x).clone()).collect();
    let w = vec![outs[0].recv_topk_weights.clone().unwrap()];
    let err = intranode_combine(&handles, &args(&ys, &w, &[])).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err:?}");
}

#[test]
fn error_cached_handle_mismatch() {
    let (inputs, lays) = small();
    let outs = intranode_dispatch_all(&inputs, &lays, 4, &DispatchOptions::default()).unwrap();
    let mut handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
    let xs: Vec<&Activations> = inputs.iter().map(|i| &i.x).collect();
    // Corrupt the receiver's channel starts: rows land past what was received.
    handles[0]
        .recv_channel_prefix_matrix
        .data_mut()
        .iter_mut()
        .for_each(|v| *v += 1000);
    let err = intranode_dispatch_cached(&xs, &handles, 0).unwrap_err();
    assert!(
        matches!(
            err,
            Error::LayoutMismatch {
                field: "handle",
                ..
            }
        ),
        "{err:?}"
    );
}
