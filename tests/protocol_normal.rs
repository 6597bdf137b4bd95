//! Normal intranode protocol on the simulator (docs/protocol.md §2): `Buffer` dispatch, cached
//! dispatch and combine equal the plan bit for bit, for random ranks (1..=8), experts, top-k with
//! masked entries, hidden sizes, BF16/FP8, channels, alignment, worst-token mode, seeds and all
//! delivery policies; no violation, no deadlock.

mod protocol_support;

use ep_rs::core::Activations;
use ep_rs::core::buffer::NormalDispatchArgs;
use ep_rs::core::config::Config;
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::intranode::{
    DispatchOptions, intranode_combine, intranode_dispatch_all, intranode_dispatch_cached,
};
use proptest::prelude::*;
use protocol_support::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug)]
struct NCase {
    g: Gen,
    seed: u64,
    policy: u8,
    num_sms: usize,
    alignment: usize,
    worst: bool,
    with_topk: bool,
    biases: usize,
}

fn strategy() -> impl Strategy<Value = NCase> {
    (
        (
            1usize..=8,
            0usize..=6,
            1usize..=3,
            1usize..=4,
            1usize..=8,
            any::<bool>(),
        ),
        (
            any::<u64>(),
            any::<u8>(),
            1usize..=3,
            1usize..=3,
            any::<bool>(),
            any::<bool>(),
            0usize..=2,
        ),
        0.0f64..0.4,
    )
        .prop_map(
            |(
                (r, t, l, k, h16, fp8),
                (seed, policy, c, alignment, worst, with_topk, biases),
                mask,
            )| NCase {
                g: Gen {
                    num_ranks: r,
                    max_tokens: t,
                    num_experts: r * l,
                    num_topk: k,
                    hidden: 16 * h16,
                    fp8,
                    mask,
                    full: false,
                },
                seed,
                policy,
                num_sms: 2 * c,
                alignment,
                worst: worst && with_topk,
                with_topk,
                biases,
            },
        )
}

fn run_case(c: &NCase) -> Result<(), TestCaseError> {
    let g = c.g;
    let r = g.num_ranks;
    let inputs = gen_inputs(&g, c.seed, false);
    let layouts: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(s, i)| {
            ep_rs::core::plan::layout::get_dispatch_layout_for_rank(
                s,
                &i.topk_idx,
                g.num_experts,
                r,
            )
            .unwrap()
        })
        .collect();
    let worst = if c.worst { g.max_tokens.max(1) * r } else { 0 };
    let opts = DispatchOptions {
        num_channels: c.num_sms / 2,
        expert_alignment: c.alignment,
        num_worst_tokens: worst,
        with_topk: c.with_topk,
    };
    let want = intranode_dispatch_all(&inputs, &layouts, g.num_experts, &opts).unwrap();

    let elem = if g.fp8 { 1 } else { 2 };
    let fab = fabric(r, 4096, 2, 1);
    let sim = sim(fab, c.seed, policy(c.policy));
    let mut buf = normal_buffer(
        sim,
        r,
        (g.max_tokens * r).max(worst),
        g.hidden,
        elem,
        g.num_topk,
    );
    let mut args = NormalDispatchArgs::new(Config::new(c.num_sms, 1, 2, 1, 2).unwrap());
    args.expert_alignment = c.alignment;
    args.num_worst_tokens = worst;
    args.with_topk = c.with_topk;
    let got = buf.dispatch(&inputs, &layouts, g.num_experts, &args);
    let got = got.map_err(|e| TestCaseError::fail(format!("dispatch: {e}")))?;
    prop_assert_eq!(&got, &want);

    // Cached dispatch along the handles: equals the plan's cached dispatch.
    let handles: Vec<_> = got.iter().map(|o| o.handle.clone()).collect();
    let xs: Vec<&Activations> = inputs.iter().map(|i| &i.x).collect();
    let cached = buf
        .dispatch_cached(&xs, &handles)
        .map_err(|e| TestCaseError::fail(format!("cached: {e}")))?;
    for (d, x) in cached.iter().enumerate() {
        prop_assert_eq!(x, &intranode_dispatch_cached(&xs, &handles, d).unwrap());
    }

    // Combine random expert outputs (weights when top-k was dispatched, biases).
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed ^ 0xc0b1);
    let ys: Vec<_> = handles
        .iter()
        .map(|h| rand_bf16_tensor(&mut rng, h.recv_src_idx.len(), g.hidden))
        .collect();
    let ws: Vec<_> = handles
        .iter()
        .map(|h| rand_f32_tensor(&mut rng, h.recv_src_idx.len(), g.num_topk))
        .collect();
    let bs: Vec<Vec<_>> = inputs
        .iter()
        .map(|i| {
            (0..c.biases)
                .map(|_| rand_bf16_tensor(&mut rng, i.num_tokens(), g.hidden))
                .collect()
        })
        .collect();
    let cargs: Vec<CombineArgs<'_>> = (0..r)
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: c.with_topk.then(|| &ws[d]),
            bias: &bs[d],
        })
        .collect();
    let want_c = intranode_combine(&handles, &cargs).unwrap();
    let got_c = buf
        .combine(&handles, &cargs)
        .map_err(|e| TestCaseError::fail(format!("combine: {e}")))?;
    prop_assert_eq!(got_c, want_c);
    in_place_leg(&mut buf, &inputs, &layouts, &args, &want, &ys, &bs)
}

/// The same dispatch with the rows left in the arena (docs/protocol.md §2.6): every output but
/// `recv_x` equals the plan, `recv_x` read back in two pieces equals the plan's; combine in place
/// of the received rows (identity expert) and of random expert outputs written over them equals
/// the plan's combine with the dispatched weights; FP8 rows refuse the in-place combine with a
/// typed error and leave the buffer usable.
#[allow(clippy::too_many_arguments)]
fn in_place_leg(
    buf: &mut ep_rs::core::Buffer<ep_rs::sim::Sim>,
    inputs: &[ep_rs::core::RankInputs],
    layouts: &[ep_rs::core::plan::layout::DispatchLayout],
    args: &NormalDispatchArgs,
    want: &[ep_rs::core::plan::intranode::IntranodeDispatch],
    ys: &[ep_rs::core::Tensor2<half::bf16>],
    bs: &[Vec<ep_rs::core::Tensor2<half::bf16>>],
) -> Result<(), TestCaseError> {
    let r = inputs.len();
    let e = layouts[0].num_tokens_per_expert.len();
    let got = buf
        .dispatch_in_place(inputs, layouts, e, args)
        .map_err(|e| TestCaseError::fail(format!("dispatch_in_place: {e}")))?;
    for (d, (g, w)) in got.iter().zip(want).enumerate() {
        prop_assert_eq!(g.num_rows, w.recv_x.num_tokens());
        let mut x = w.recv_x.clone();
        poison_activations(&mut x);
        let half = g.num_rows / 2;
        let (mut a, mut b) = split_rows(&x, half);
        buf.read_recv_x(d, 0, &mut a)
            .map_err(|e| TestCaseError::fail(format!("read_recv_x: {e}")))?;
        buf.read_recv_x(d, half, &mut b)
            .map_err(|e| TestCaseError::fail(format!("read_recv_x: {e}")))?;
        let back = g.clone().with_recv_x(join_rows(&a, &b));
        prop_assert_eq!(&back, w);
        if g.num_rows > 0 {
            let past = buf.read_recv_x(d, g.num_rows, &mut split_rows(&x, 1).0);
            prop_assert!(past.is_err(), "a read past the rows must fail");
        }
    }
    let handles: Vec<_> = got.iter().map(|o| o.handle.clone()).collect();
    let bias: Vec<&[_]> = bs.iter().map(Vec::as_slice).collect();
    // Expert outputs written into the combine rows (any dispatch format), with the dispatched
    // weights: equal to the plan's combine of the same outputs.
    for (d, y) in ys.iter().enumerate() {
        buf.write_combine_rows(d, 0, y, want[d].recv_topk_weights.as_ref())
            .map_err(|e| TestCaseError::fail(format!("write_combine_rows: {e}")))?;
    }
    let with_w = want[0].recv_topk_weights.is_some();
    let cargs: Vec<CombineArgs<'_>> = (0..r)
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: want[d].recv_topk_weights.as_ref(),
            bias: &bs[d],
        })
        .collect();
    let got_rows = buf
        .combine_from_rows(&handles, &bias, with_w)
        .map_err(|e| TestCaseError::fail(format!("combine_from_rows: {e}")))?;
    prop_assert_eq!(got_rows, intranode_combine(&handles, &cargs).unwrap());

    // An expert run over the rows in place (a phase) writes the combine rows: doubling each
    // row (FP8 dequantised first) combines like the plan on the doubled rows.
    buf.apply_expert(&|_, _, x, y| {
        for i in 0..x.num_tokens() {
            double_row(x, i, y.row_mut(i));
        }
        Ok(())
    })
    .map_err(|e| TestCaseError::fail(format!("apply_expert: {e}")))?;
    let doubled: Vec<_> = want
        .iter()
        .map(|w| {
            let mut y = ep_rs::core::Tensor2::zeros(w.recv_x.num_tokens(), w.recv_x.hidden());
            for i in 0..y.rows() {
                double_row(&w.recv_x, i, y.row_mut(i));
            }
            y
        })
        .collect();
    let cargs: Vec<CombineArgs<'_>> = (0..r)
        .map(|d| CombineArgs {
            x: &doubled[d],
            topk_weights: want[d].recv_topk_weights.as_ref(),
            bias: &bs[d],
        })
        .collect();
    let got_rows = buf
        .combine_from_rows(&handles, &bias, with_w)
        .map_err(|e| TestCaseError::fail(format!("combine_from_rows after the expert: {e}")))?;
    prop_assert_eq!(got_rows, intranode_combine(&handles, &cargs).unwrap());
    let Activations::Bf16(_) = &inputs[0].x else {
        let err = buf.combine_in_place(&handles, &bias);
        prop_assert!(matches!(err, Err(ep_rs::core::Error::Unsupported(_))));
        let again = buf.dispatch_in_place(inputs, layouts, e, args);
        prop_assert!(again.is_ok(), "the buffer stays usable");
        return Ok(());
    };
    for pass in 0..2 {
        if pass == 1 {
            for (d, y) in ys.iter().enumerate() {
                buf.write_expert_x(d, 0, y)
                    .map_err(|e| TestCaseError::fail(format!("write_expert_x: {e}")))?;
            }
        }
        let cargs: Vec<CombineArgs<'_>> = (0..r)
            .map(|d| CombineArgs {
                x: match (&want[d].recv_x, pass) {
                    (Activations::Bf16(x), 0) => x,
                    _ => &ys[d],
                },
                topk_weights: want[d].recv_topk_weights.as_ref(),
                bias: &bs[d],
            })
            .collect();
        let want_c = intranode_combine(&handles, &cargs).unwrap();
        let got_c = buf
            .combine_in_place(&handles, &bias)
            .map_err(|e| TestCaseError::fail(format!("combine_in_place: {e}")))?;
        prop_assert_eq!(got_c, want_c);
    }
    Ok(())
}

/// Row `i` of `x` times two, rounded to BF16 (FP8 rows dequantised first).
fn double_row(x: &Activations, i: usize, out: &mut [half::bf16]) {
    match x {
        Activations::Bf16(t) => {
            for (o, v) in out.iter_mut().zip(t.row(i)) {
                *o = half::bf16::from_f32(2.0 * v.to_f32());
            }
        }
        Activations::Fp8 { data, scales } => {
            ep_rs::core::numerics::fp8::dequantize_row_bf16(data.row(i), scales.row(i), out)
                .unwrap();
            for o in out.iter_mut() {
                *o = half::bf16::from_f32(2.0 * o.to_f32());
            }
        }
    }
}

/// Every element of `x` set to a value no dispatch writes (NaN bits / 0xff bytes).
fn poison_activations(x: &mut Activations) {
    match x {
        Activations::Bf16(t) => t
            .data_mut()
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_bits(0x7fc1)),
        Activations::Fp8 { data, scales } => {
            data.data_mut().iter_mut().for_each(|v| *v = 0xff);
            scales.data_mut().iter_mut().for_each(|v| *v = f32::NAN);
        }
    }
}

/// Rows `[0, at)` and `[at, rows)` of `x` as two tensors.
fn split_rows(x: &Activations, at: usize) -> (Activations, Activations) {
    fn part<T: Copy>(
        t: &ep_rs::core::Tensor2<T>,
        rows: std::ops::Range<usize>,
    ) -> ep_rs::core::Tensor2<T> {
        ep_rs::core::Tensor2::from_fn(rows.len(), t.cols(), |i, j| t.get(rows.start + i, j))
    }
    let n = x.num_tokens();
    match x {
        Activations::Bf16(t) => (
            Activations::Bf16(part(t, 0..at)),
            Activations::Bf16(part(t, at..n.max(at))),
        ),
        Activations::Fp8 { data, scales } => (
            Activations::Fp8 {
                data: part(data, 0..at),
                scales: part(scales, 0..at),
            },
            Activations::Fp8 {
                data: part(data, at..n.max(at)),
                scales: part(scales, at..n.max(at)),
            },
        ),
    }
}

/// `a` above `b`.
fn join_rows(a: &Activations, b: &Activations) -> Activations {
    fn cat<T: Copy>(
        a: &ep_rs::core::Tensor2<T>,
        b: &ep_rs::core::Tensor2<T>,
    ) -> ep_rs::core::Tensor2<T> {
        let mut v = a.data().to_vec();
        v.extend_from_slice(b.data());
        ep_rs::core::Tensor2::new(a.rows() + b.rows(), a.cols(), v).unwrap()
    }
    match (a, b) {
        (Activations::Bf16(a), Activations::Bf16(b)) => Activations::Bf16(cat(a, b)),
        (
            Activations::Fp8 {
                data: a,
                scales: sa,
            },
            Activations::Fp8 {
                data: b,
                scales: sb,
            },
        ) => Activations::Fp8 {
            data: cat(a, b),
            scales: cat(sa, sb),
        },
        _ => unreachable!("same kind"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Dispatch, cached dispatch and combine on the simulator equal the plan bit for bit.
    #[test]
    fn buffer_equals_plan(c in strategy()) {
        run_case(&c)?;
    }
}

/// The combine's f32 sum is `bias + y_0 + y_1 + y_2`, left to right (spec §2.2: biases first,
/// then ascending rank): one token of rank 0 goes to all three ranks, whose outputs are `2^27`,
/// `-2^27` and `1`, with a bias of `0.5` — in that order the bias is swallowed by `2^27` and the
/// sum is `1`; any order that does not add the cancelling pair before the `1` gives `0`, and one
/// that adds the bias last gives `1.5`. The plan, the oracle and the `Buffer` must all give `1`
/// (weights likewise: `2^30 - 2^30 + 1 = 1`).
#[test]
fn combine_adds_bias_first_then_ascending_ranks() {
    use ep_rs::core::{Activations, RankInputs, Tensor2};
    use half::bf16;
    let (r, h, k) = (3usize, 16usize, 3usize);
    let inputs: Vec<RankInputs> = (0..r)
        .map(|s| {
            let t = usize::from(s == 0);
            RankInputs {
                x: Activations::Bf16(Tensor2::from_fn(t, h, |_, c| {
                    bf16::from_f32(c as f32 + 1.0)
                })),
                topk_idx: Tensor2::from_fn(t, k, |_, j| j as i64),
                topk_weights: Tensor2::filled(t, k, 0.25f32),
            }
        })
        .collect();
    let e = r;
    let mut buf = normal_buffer(sim(fabric(r, 4096, 4, 1), 7, policy(0)), r, 4, h, 2, k);
    let idx: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let layouts = buf.get_dispatch_layout(&idx, e).unwrap();
    let (args, _) = two_channel_dispatch();
    let got = buf.dispatch(&inputs, &layouts, e, &args).unwrap();
    let handles: Vec<_> = got.iter().map(|o| o.handle.clone()).collect();
    let ys: Vec<Tensor2<bf16>> = [2f32.powi(27), -(2f32.powi(27)), 1.0]
        .iter()
        .map(|&v| Tensor2::filled(1, h, bf16::from_f32(v)))
        .collect();
    let ws: Vec<Tensor2<f32>> = [2f32.powi(30), -(2f32.powi(30)), 1.0]
        .iter()
        .map(|&v| Tensor2::filled(1, k, v))
        .collect();
    let bias = [Tensor2::filled(1, h, bf16::from_f32(0.5))];
    let cargs: Vec<CombineArgs<'_>> = (0..r)
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: Some(&ws[d]),
            bias: if d == 0 { &bias } else { &[] },
        })
        .collect();
    let want = Tensor2::filled(1, h, bf16::from_f32(1.0));
    let want_w = Tensor2::filled(1, k, 1.0f32);
    let plan = intranode_combine(&handles, &cargs).unwrap();
    let oracle = ep_rs::core::oracle::normal::intranode_combine(&inputs, e, &cargs).unwrap();
    let ours = buf.combine(&handles, &cargs).unwrap();
    for (who, out) in [("plan", &plan), ("oracle", &oracle), ("Buffer", &ours)] {
        assert_eq!(out[0].combined_x, want, "{who}: combined x of rank 0");
        assert_eq!(
            out[0].combined_topk_weights.as_ref(),
            Some(&want_w),
            "{who}: combined weights of rank 0"
        );
    }
}

/// The one-rank calls (`layout_one`, `dispatch_one`, `dispatch_cached_one`, `combine_one`) are
/// the slice calls of the process's one rank: on a one-rank world they equal the plan, on an
/// executor holding several ranks they are a typed rank-count error that takes no call.
#[test]
fn one_rank_calls_are_the_slice_calls_of_the_one_local_rank() {
    let g = Gen {
        num_ranks: 1,
        max_tokens: 40,
        num_experts: 8,
        num_topk: 3,
        hidden: 256,
        fp8: false,
        mask: 0.1,
        full: true,
    };
    let inputs = gen_inputs(&g, 5, true);
    let mut buf = normal_buffer(
        sim(fabric(1, 1 << 29, 64, 1), 5, policy(1)),
        1,
        64,
        256,
        2,
        3,
    );
    let layout = buf.layout_one(&inputs[0].topk_idx, 8).unwrap();
    let args = NormalDispatchArgs::new(Config::new(4, 8, 256, 6, 128).unwrap());
    let got = buf.dispatch_one(&inputs[0], &layout, 8, &args).unwrap();
    let opts = DispatchOptions {
        num_channels: 2,
        expert_alignment: 1,
        num_worst_tokens: 0,
        with_topk: true,
    };
    let want = intranode_dispatch_all(&inputs, std::slice::from_ref(&layout), 8, &opts).unwrap();
    assert_eq!(got, want[0]);
    let Activations::Bf16(y) = &got.recv_x else {
        unreachable!()
    };
    let cargs = CombineArgs {
        x: y,
        topk_weights: got.recv_topk_weights.as_ref(),
        bias: &[],
    };
    let combined = buf.combine_one(&got.handle, &cargs).unwrap();
    let want_c = intranode_combine(std::slice::from_ref(&got.handle), &[cargs]).unwrap();
    assert_eq!(combined, want_c[0]);
    let cached = buf.dispatch_cached_one(&inputs[0].x, &got.handle).unwrap();
    let want_x =
        intranode_dispatch_cached(&[&inputs[0].x], std::slice::from_ref(&got.handle), 0).unwrap();
    assert_eq!(cached, want_x);

    // Two local ranks: a one-rank call is refused before any call number is taken.
    let g2 = Gen { num_ranks: 2, ..g };
    let inputs = gen_inputs(&g2, 6, true);
    let mut buf = normal_buffer(
        sim(fabric(2, 1 << 29, 64, 1), 6, policy(1)),
        2,
        128,
        256,
        2,
        3,
    );
    let err = buf.layout_one(&inputs[0].topk_idx, 8).unwrap_err();
    assert!(
        matches!(
            err,
            ep_rs::core::Error::RankCountMismatch {
                expected: 2,
                found: 1
            }
        ),
        "{err}"
    );
    assert_eq!(buf.last_call(), 0);
}
