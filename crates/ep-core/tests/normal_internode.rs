//! Internode normal mode (spec §2.3, §3.5): plan versus oracle on random cases for 16..=64
//! ranks (bit-equal, handle included), cached dispatch, combine with the two BF16 roundings,
//! the head rewrites, the dispatch → combine identity, spec §10 case 11, and typed errors.

mod normal_support;

use ep_core::plan::combine::{CombineArgs, SEND_HEAD_SENTINEL};
use ep_core::plan::internode::{
    InternodeDispatch, internode_combine, internode_dispatch, internode_dispatch_all,
    internode_dispatch_cached,
};
use ep_core::plan::intranode::DispatchOptions;
use ep_core::{Activations, Error, RankInputs, Tensor2, oracle};
use half::bf16;
use normal_support::{
    Case, Routing, bf16_rows, dispatch_options, gen_inputs, layouts, rand_bf16_tensor,
    rand_f32_tensor, routing_from,
};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A random internode case (2..=8 nodes, small batches) and dispatch options.
fn case_strategy() -> impl Strategy<Value = (Case, DispatchOptions)> {
    (
        (any::<u64>(), 2usize..=8, 0usize..=5, 1usize..=2, 1usize..=9),
        (
            1usize..=3,
            any::<bool>(),
            0.0f64..0.5,
            any::<u8>(),
            any::<usize>(),
        ),
        (1usize..=12, 1usize..=5, any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(
                (seed, nodes, max_tokens, num_local, num_topk),
                (h8, fp8, mask, code, victim),
                (num_channels, expert_alignment, worst, with_topk),
            )| {
                let num_ranks = 8 * nodes;
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

fn dispatch_all(inputs: &[RankInputs], e: usize, opts: &DispatchOptions) -> Vec<InternodeDispatch> {
    internode_dispatch_all(inputs, &layouts(inputs, e), e, opts).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig {
        // Each case plans up to 64 ranks: keep the default count but cap shrinking time.
        max_shrink_iters: 256,
        ..ProptestConfig::default()
    })]

    /// Plan dispatch (all ranks, and one rank alone) equals the oracle bit for bit, the
    /// 10-field handle included; cached dispatch reproduces `recv_x`.
    #[test]
    fn dispatch_plan_matches_oracle((case, opts) in case_strategy(), pick in any::<usize>()) {
        let inputs = gen_inputs(&case);
        let e = case.num_experts();
        let lays = layouts(&inputs, e);
        let plan = internode_dispatch_all(&inputs, &lays, e, &opts).unwrap();
        let want = oracle::internode::internode_dispatch(&inputs, e, &opts).unwrap();
        prop_assert_eq!(&plan, &want);
        let d = pick % case.num_ranks;
        prop_assert_eq!(&internode_dispatch(&inputs, &lays, e, d, &opts).unwrap(), &plan[d]);
        let handles: Vec<_> = plan.iter().map(|o| o.handle.clone()).collect();
        let xs: Vec<&Activations> = inputs.iter().map(|i| &i.x).collect();
        prop_assert_eq!(&internode_dispatch_cached(&xs, &handles, d).unwrap(), &plan[d].recv_x);
    }

    /// Plan combine (forwarder partial rounded to BF16, then final sum) equals the oracle bit
    /// for bit, with random outputs, weights and 0–2 biases, before and after the head
    /// rewrite; the rewrite is idempotent.
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
        let outs = dispatch_all(&inputs, e, &opts);
        let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0xc0b1);
        let rows: Vec<usize> = outs.iter().map(|o| o.recv_x.num_tokens()).collect();
        let ys: Vec<_> = rows.iter().map(|&n| rand_bf16_tensor(&mut rng, n, case.hidden)).collect();
        let ws: Vec<_> = if with_weights {
            rows.iter().map(|&n| rand_f32_tensor(&mut rng, n, case.num_topk)).collect()
        } else {
            Vec::new()
        };
        let bs: Vec<Vec<_>> = inputs
            .iter()
            .map(|i| (0..num_biases).map(|_| rand_bf16_tensor(&mut rng, i.num_tokens(), case.hidden)).collect())
            .collect();
        let a = args(&ys, &ws, &bs);
        let mut handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
        let want = oracle::internode::internode_combine(&inputs, e, &a).unwrap();
        prop_assert_eq!(&internode_combine(&handles, &a).unwrap(), &want);

        for h in &mut handles {
            h.rewrite_heads();
        }
        prop_assert_eq!(&internode_combine(&handles, &a).unwrap(), &want);
        let once = handles.clone();
        for h in &mut handles {
            h.rewrite_heads();
        }
        prop_assert_eq!(&handles, &once);
    }

    /// Dispatch then combine of unchanged rows: within BF16 rounding of `count_t * x[t]`
    /// (two roundings: per node, then final), and exactly `bf16(count * x)` when all the
    /// token's ranks are on one node; unchanged weights give back the original weights.
    #[test]
    fn round_trip_identity((case, opts) in case_strategy()) {
        let case = Case { fp8: false, ..case };
        let opts = DispatchOptions { with_topk: true, ..opts };
        let inputs = gen_inputs(&case);
        let e = case.num_experts();
        let outs = dispatch_all(&inputs, e, &opts);
        let ys: Vec<_> = outs.iter().map(|o| bf16_rows(&o.recv_x).clone()).collect();
        let ws: Vec<_> = outs.iter().map(|o| o.recv_topk_weights.clone().unwrap()).collect();
        let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
        let got = internode_combine(&handles, &args(&ys, &ws, &[])).unwrap();
        for (s, inp) in inputs.iter().enumerate() {
            let x = bf16_rows(&inp.x);
            for t in 0..inp.num_tokens() {
                let ranks: Vec<usize> = (0..case.num_ranks)
                    .filter(|&d| inp.topk_idx.row(t).iter().any(|&e| e >= 0 && e as usize / case.num_local == d))
                    .collect();
                let count = ranks.len() as f32;
                let one_node = ranks.windows(2).all(|w| w[0] / 8 == w[1] / 8);
                for col in 0..case.hidden {
                    let exact = 0.0 + count * x.get(t, col).to_f32();
                    let g = got[s].combined_x.get(t, col);
                    if one_node {
                        prop_assert_eq!(g.to_bits(), bf16::from_f32(exact).to_bits());
                    } else {
                        // Two roundings, each ≤ half a BF16 ulp (2^-8 relative).
                        prop_assert!((g.to_f32() - exact).abs() <= exact.abs() / 128.0,
                            "rank {} token {} col {}: {} vs {}", s, t, col, g, exact);
                    }
                }
                let cw = got[s].combined_topk_weights.as_ref().unwrap();
                for k in 0..case.num_topk {
                    let want = if inp.topk_idx.get(t, k) >= 0 { inp.topk_weights.get(t, k) } else { 0.0 };
                    prop_assert_eq!(cw.get(t, k).to_bits(), want.to_bits());
                }
            }
        }
    }
}

/// The forwarder-side rewrite decodes to the next valid head within each
/// `(source node, channel)` segment, or the sentinel.
#[test]
fn send_nvl_head_rewrite_segments() {
    let case = Case {
        seed: 21,
        num_ranks: 24,
        max_tokens: 20,
        num_local: 2,
        num_topk: 4,
        hidden: 8,
        fp8: false,
        mask: 0.2,
        routing: Routing::Random,
    };
    let inputs = gen_inputs(&case);
    let opts = DispatchOptions {
        num_channels: 3,
        ..Default::default()
    };
    for o in dispatch_all(&inputs, 48, &opts) {
        let mut h = o.handle.clone();
        h.rewrite_heads();
        let raw = &o.handle.send_nvl_head;
        for n in 0..3 {
            let block = if n == 0 {
                0
            } else {
                h.recv_rdma_rank_prefix_sum[n - 1]
            };
            for c in 0..3 {
                let lo = block
                    + if c == 0 {
                        0
                    } else {
                        h.recv_rdma_channel_prefix_matrix.get(n, c - 1)
                    };
                let hi = block + h.recv_rdma_channel_prefix_matrix.get(n, c);
                for row in lo as usize..hi as usize {
                    for j in 0..8 {
                        let v = raw.get(row, j);
                        if v >= 0 {
                            assert_eq!(h.send_nvl_head.get(row, j), v);
                        } else {
                            let next = (row + 1..hi as usize)
                                .map(|r| raw.get(r, j))
                                .find(|&x| x >= 0)
                                .unwrap_or(SEND_HEAD_SENTINEL);
                            assert_eq!(h.send_nvl_head.get(row, j), -next - 1);
                        }
                    }
                }
            }
        }
    }
}

/// Spec §10 case 11 (R = 16): blocks per `recv_gbl_rank_prefix_sum`, ascending tokens, round
/// trip, determinism over 20 repeats, and `num_rdma_recv_tokens`.
#[test]
fn case11_internode_r16() {
    let mut inputs = gen_inputs(&Case {
        seed: 11,
        num_ranks: 16,
        max_tokens: 40,
        num_local: 2,
        num_topk: 4,
        hidden: 16,
        fp8: false,
        mask: 0.1,
        routing: Routing::Random,
    });
    for (s, inp) in inputs.iter_mut().enumerate() {
        let rows = inp.num_tokens();
        inp.x = Activations::Bf16(Tensor2::from_fn(rows, 16, |row, col| {
            bf16::from_f32(if col == 15 { row as f32 } else { s as f32 })
        }));
    }
    let opts = DispatchOptions::default();
    let outs = dispatch_all(&inputs, 32, &opts);
    let hash = |outs: &[InternodeDispatch]| -> i64 {
        outs.iter()
            .flat_map(|o| bf16_rows(&o.recv_x).data().iter())
            .map(|v| i64::from(v.to_bits()))
            .sum()
    };
    let h0 = hash(&outs);
    for _ in 0..20 {
        assert_eq!(hash(&dispatch_all(&inputs, 32, &opts)), h0);
    }
    for (d, o) in outs.iter().enumerate() {
        let x = bf16_rows(&o.recv_x);
        let prefix = &o.handle.recv_gbl_rank_prefix_sum;
        for s in 0..16 {
            let lo = if s == 0 { 0 } else { prefix[s - 1] } as usize;
            let mut prev = -1.0f32;
            for j in lo..prefix[s] as usize {
                assert!(x.row(j)[..15].iter().all(|v| v.to_f32() == s as f32));
                assert!(x.get(j, 15).to_f32() > prev);
                prev = x.get(j, 15).to_f32();
                assert_eq!(o.handle.recv_src_meta[j].src_rdma_rank, (s / 8) as i32);
                assert!(o.handle.recv_src_meta[j].is_token_in_nvl_rank(d % 8));
            }
        }
        // Same-index senders' tokens touching my node.
        let want: usize = (0..2)
            .map(|n| {
                let src = &inputs[n * 8 + d % 8];
                (0..src.num_tokens())
                    .filter(|&t| {
                        src.topk_idx
                            .row(t)
                            .iter()
                            .any(|&e| e >= 0 && e as usize / 2 / 8 == d / 8)
                    })
                    .count()
            })
            .sum();
        assert_eq!(o.handle.num_rdma_recv_tokens, want);
        assert_eq!(
            o.handle.recv_rdma_rank_prefix_sum[1] as usize,
            o.handle.num_rdma_recv_tokens
        );
    }
    // Round trip of the structured rows: every count * s is exact in BF16 here.
    let ys: Vec<_> = outs.iter().map(|o| bf16_rows(&o.recv_x).clone()).collect();
    let handles: Vec<_> = outs.iter().map(|o| o.handle.clone()).collect();
    let got = internode_combine(&handles, &args(&ys, &[], &[])).unwrap();
    for (s, inp) in inputs.iter().enumerate() {
        for t in 0..inp.num_tokens() {
            let count = (0..16)
                .filter(|&d| {
                    inp.topk_idx
                        .row(t)
                        .iter()
                        .any(|&e| e >= 0 && e as usize / 2 == d)
                })
                .count() as f32;
            assert_eq!(got[s].combined_x.get(t, 0).to_f32(), count * s as f32);
        }
    }
    // Case 10 internode: worst-case sizing keeps the prefix and empties the expert list.
    let worst = dispatch_all(
        &inputs,
        32,
        &DispatchOptions {
            num_worst_tokens: 40 * 16,
            ..opts
        },
    );
    for (n, w) in outs.iter().zip(&worst) {
        let m = n.handle.num_recv_tokens;
        assert_eq!(
            &bf16_rows(&w.recv_x).data()[..m * 16],
            bf16_rows(&n.recv_x).data()
        );
        assert!(w.num_recv_tokens_per_expert_list.is_empty());
        let idx = w.recv_topk_idx.as_ref().unwrap();
        assert!(idx.data()[m * 4..].iter().all(|&v| v == -1));
        assert!(
            w.handle.recv_src_meta[m..]
                .iter()
                .all(|s| s.src_rdma_rank == -1)
        );
    }
}

#[test]
fn error_internode_rank_count() {
    for r in [8usize, 20] {
        let inputs = gen_inputs(&Case {
            seed: 1,
            num_ranks: r,
            max_tokens: 3,
            num_local: 1,
            num_topk: 2,
            hidden: 8,
            fp8: false,
            mask: 0.0,
            routing: Routing::Random,
        });
        let lays = layouts(&inputs, r);
        let err =
            internode_dispatch_all(&inputs, &lays, r, &DispatchOptions::default()).unwrap_err();
        assert!(
            matches!(err, Error::InvalidRankCount { num_ranks, .. } if num_ranks == r),
            "{err:?}"
        );
    }
}
