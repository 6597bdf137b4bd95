//! Canonical output digests: plan and oracle agree (normal, low-latency with the oracle's other
//! placement), one flipped bit changes the digest, what the spec leaves undefined does not
//! (worst-token padding, rows past the count, other columns of `rank_prefix_matrix`, combine's
//! rewrite of `send_head`), and the format is pinned by a golden digest.

use ep_core::digest::{self, FORMAT_VERSION, RunDigest};
use ep_core::numerics::fp8;
use ep_core::oracle;
use ep_core::plan::combine::{CombineArgs, CombineOutput};
use ep_core::plan::intranode::{self, DispatchOptions, IntranodeDispatch};
use ep_core::plan::layout::get_dispatch_layout_for_rank;
use ep_core::plan::low_latency::{self as ll, LlDispatchOutput, LlParams, LlRecvX};
use ep_core::workload::{Routing, WorkloadSpec};
use ep_core::{Activations, RankInputs, Tensor2, Tensor3};
use half::bf16;

const EXPERTS: usize = 16;

fn inputs(fp8: bool, routing: Routing) -> Vec<RankInputs> {
    WorkloadSpec {
        masked_per_rank: 3,
        fp8,
        routing,
        ..WorkloadSpec::new(4, 24, 512, 4, EXPERTS, 0xd1)
    }
    .generate()
    .unwrap()
}

/// The "expert": identity, as BF16 (FP8 rows dequantised).
fn expert_out(x: &Activations) -> Tensor2<bf16> {
    match x {
        Activations::Bf16(x) => x.clone(),
        Activations::Fp8 { data, scales } => {
            let f = fp8::dequantize(data, scales).unwrap();
            Tensor2::from_fn(f.rows(), f.cols(), |r, c| bf16::from_f32(f.get(r, c)))
        }
    }
}

fn combine_args<'a>(
    plan: &'a [IntranodeDispatch],
    ys: &'a [Tensor2<bf16>],
) -> Vec<CombineArgs<'a>> {
    plan.iter()
        .zip(ys)
        .map(|(o, y)| CombineArgs {
            x: y,
            topk_weights: o.recv_topk_weights.as_ref(),
            bias: &[],
        })
        .collect()
}

fn normal_plan(
    inputs: &[RankInputs],
    opts: &DispatchOptions,
) -> (Vec<IntranodeDispatch>, Vec<CombineOutput>) {
    let r = inputs.len();
    let layouts: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(s, i)| get_dispatch_layout_for_rank(s, &i.topk_idx, EXPERTS, r).unwrap())
        .collect();
    let d = intranode::intranode_dispatch_all(inputs, &layouts, EXPERTS, opts).unwrap();
    let ys: Vec<_> = d.iter().map(|o| expert_out(&o.recv_x)).collect();
    let handles: Vec<_> = d.iter().map(|o| o.handle.clone()).collect();
    let c = intranode::intranode_combine(&handles, &combine_args(&d, &ys)).unwrap();
    (d, c)
}

fn normal_oracle(inputs: &[RankInputs]) -> (Vec<IntranodeDispatch>, Vec<CombineOutput>) {
    let opts = DispatchOptions::default();
    let d = oracle::normal::intranode_dispatch(inputs, EXPERTS, &opts).unwrap();
    let ys: Vec<_> = d.iter().map(|o| expert_out(&o.recv_x)).collect();
    let c = oracle::normal::intranode_combine(inputs, EXPERTS, &combine_args(&d, &ys)).unwrap();
    (d, c)
}

/// A one-bit change of one rank's outputs, in the first row of a tensor or (`true`) its last.
type Mutation = Box<dyn Fn(&mut IntranodeDispatch, &mut CombineOutput, bool)>;

type LlRun = (Vec<Option<LlDispatchOutput>>, Vec<Option<Tensor2<bf16>>>);

fn ll_expert(out: &Option<LlDispatchOutput>) -> Option<Tensor3<bf16>> {
    out.as_ref().map(|o| {
        ll::map_rows(o, |_, row| row.iter().map(|&v| bf16::from_f32(v)).collect()).unwrap()
    })
}

fn ll_run(inputs: &[RankInputs], p: &LlParams, use_oracle: bool) -> LlRun {
    let d = if use_oracle {
        oracle::low_latency::dispatch(inputs, p).unwrap()
    } else {
        ll::dispatch(inputs, p).unwrap()
    };
    let handles: Vec<_> = d
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    let ys: Vec<_> = d.iter().map(ll_expert).collect();
    let c = if use_oracle {
        oracle::low_latency::combine(inputs, &handles, &ys, p).unwrap()
    } else {
        ll::combine(inputs, &handles, &ys, p).unwrap()
    };
    (d, c)
}

fn ll_params(fp8: Option<(bool, bool)>) -> LlParams {
    let p = LlParams::new(24, EXPERTS);
    match fp8 {
        Some((round, ue8m0)) => p.with_fp8(round, ue8m0),
        None => p,
    }
}

fn nd(d: &[IntranodeDispatch], c: &[CombineOutput]) -> RunDigest {
    digest::normal(d, c).unwrap()
}

fn lld(run: &LlRun) -> RunDigest {
    digest::low_latency(&run.0, &run.1).unwrap()
}

#[test]
fn format_version_is_documented() {
    assert_eq!(FORMAT_VERSION, 2);
}

#[test]
fn normal_plan_and_oracle_digests_agree() {
    for fp8 in [false, true] {
        for routing in [Routing::Uniform, Routing::Hot { fraction: 0.7 }] {
            let inp = inputs(fp8, routing);
            let (pd, pc) = normal_plan(&inp, &DispatchOptions::default());
            let (od, oc) = normal_oracle(&inp);
            let a = nd(&pd, &pc);
            assert_eq!(a, nd(&od, &oc), "fp8 {fp8} {routing}");
            assert_eq!(a.ranks.len(), 4);
            // Dispatch-only digests differ from full ones but agree too.
            assert_eq!(nd(&pd, &[]), nd(&od, &[]));
            assert_ne!(nd(&pd, &[]).total, a.total);
            // Repeatable.
            assert_eq!(
                a,
                nd(&normal_plan(&inp, &DispatchOptions::default()).0, &pc)
            );
        }
    }
}

#[test]
fn low_latency_plan_and_oracle_digests_agree() {
    let inp = inputs(false, Routing::Zipf { exponent: 1.0 });
    for fp8 in [
        None,
        Some((false, false)),
        Some((true, false)),
        Some((true, true)),
    ] {
        let p = ll_params(fp8);
        let plan = ll_run(&inp, &p, false);
        let orc = ll_run(&inp, &p, true);
        // The oracle places rows differently: the raw outputs differ, the digests do not.
        assert_ne!(plan.0, orc.0, "{fp8:?}: placements should differ");
        assert_eq!(lld(&plan), lld(&orc), "{fp8:?}");
    }
    // Masked ranks too.
    let p = ll_params(None).with_masked_ranks(vec![false, true, false, false]);
    assert_eq!(lld(&ll_run(&inp, &p, false)), lld(&ll_run(&inp, &p, true)));
    // The format is part of the digest.
    assert_ne!(
        lld(&ll_run(&inp, &ll_params(None), false)).total,
        lld(&ll_run(&inp, &ll_params(Some((false, false))), false)).total
    );
}

fn flip_bf16(t: &mut Tensor2<bf16>, r: usize, c: usize) {
    let v = t.get(r, c);
    t.set(r, c, bf16::from_bits(v.to_bits() ^ 1));
}

#[test]
fn one_bit_changes_the_normal_digest() {
    let inp = inputs(false, Routing::Uniform);
    let (d, c) = normal_plan(&inp, &DispatchOptions::default());
    let base = nd(&d, &c);
    let rank = (0..4).find(|&r| d[r].handle.num_recv_tokens > 0).unwrap();
    // Each mutation flips one bit in the first row (`last == false`) or the last row of its
    // tensor: a digest that skipped rows at either end would miss one of them.
    let pick = |n: usize, last: bool| if last { n - 1 } else { 0 };
    let mutations: Vec<(&str, Mutation)> = vec![
        (
            "recv_x",
            Box::new(move |o, _, last| {
                if let Activations::Bf16(x) = &mut o.recv_x {
                    flip_bf16(x, pick(x.rows(), last), 5);
                }
            }),
        ),
        (
            "recv_topk_weights",
            Box::new(move |o, _, last| {
                let w = o.recv_topk_weights.as_mut().unwrap();
                let t = pick(w.rows(), last);
                w.set(t, 1, f32::from_bits(w.get(t, 1).to_bits() ^ 1));
            }),
        ),
        (
            "recv_topk_idx",
            Box::new(move |o, _, last| {
                let w = o.recv_topk_idx.as_mut().unwrap();
                let t = pick(w.rows(), last);
                w.set(t, 0, w.get(t, 0) ^ 1);
            }),
        ),
        (
            "expert list",
            Box::new(move |o, _, last| {
                let l = &mut o.num_recv_tokens_per_expert_list;
                let i = pick(l.len(), last);
                l[i] ^= 1;
            }),
        ),
        (
            "recv_src_idx",
            Box::new(move |o, _, last| {
                let v = &mut o.handle.recv_src_idx;
                let i = pick(v.len(), last);
                v[i] ^= 1;
            }),
        ),
        (
            "channel_prefix_matrix",
            Box::new(move |o, _, last| {
                let m = &mut o.handle.channel_prefix_matrix;
                let t = pick(m.rows(), last);
                m.set(t, 0, m.get(t, 0) ^ 1);
            }),
        ),
        (
            "recv_channel_prefix_matrix",
            Box::new(move |o, _, last| {
                let m = &mut o.handle.recv_channel_prefix_matrix;
                let t = pick(m.rows(), last);
                m.set(t, 1, m.get(t, 1) ^ 1);
            }),
        ),
        (
            "send_head",
            Box::new(|o, _, last| {
                // The first (last) row with a head: negative entries are "not sent" in any form.
                let m = &mut o.handle.send_head;
                let valid = |t: usize| (0..m.cols()).find(|&d| m.get(t, d) >= 0).map(|d| (t, d));
                let (t, d) = if last {
                    (0..m.rows()).rev().find_map(valid)
                } else {
                    (0..m.rows()).find_map(valid)
                }
                .unwrap();
                m.set(t, d, m.get(t, d) ^ 1);
            }),
        ),
        (
            "combined_x",
            Box::new(move |_, c, last| {
                let t = pick(c.combined_x.rows(), last);
                flip_bf16(&mut c.combined_x, t, 7);
            }),
        ),
        (
            "combined_topk_weights",
            Box::new(move |_, c, last| {
                let w = c.combined_topk_weights.as_mut().unwrap();
                let t = pick(w.rows(), last);
                w.set(t, 0, f32::from_bits(w.get(t, 0).to_bits() ^ 1));
            }),
        ),
    ];
    for (what, m) in &mutations {
        for last in [false, true] {
            let (mut d2, mut c2) = (d.clone(), c.clone());
            m(&mut d2[rank], &mut c2[rank], last);
            let what = format!("{what} ({} row)", if last { "last" } else { "first" });
            let got = nd(&d2, &c2);
            assert_ne!(got.total, base.total, "{what}");
            assert_ne!(got.ranks[rank], base.ranks[rank], "{what}");
            for r in (0..4).filter(|&r| r != rank) {
                assert_eq!(got.ranks[r], base.ranks[r], "{what}: rank {r} untouched");
            }
        }
    }
    // The defined column of rank_prefix_matrix counts; the others do not (stale in DeepEP).
    let mut d2 = d.clone();
    let m = &mut d2[rank].handle.rank_prefix_matrix;
    m.set(0, rank, m.get(0, rank) ^ 1);
    assert_ne!(nd(&d2, &c).total, base.total);
    let mut d2 = d.clone();
    let other = (rank + 1) % 4;
    let m = &mut d2[rank].handle.rank_prefix_matrix;
    m.set(0, other, 12345);
    assert_eq!(nd(&d2, &c), base);
}

#[test]
fn send_head_rewrite_and_worst_token_padding_do_not_count() {
    let inp = inputs(false, Routing::Uniform);
    let (d, c) = normal_plan(&inp, &DispatchOptions::default());
    let base = nd(&d, &c);
    // Combine's in-place rewrite of send_head (spec §7.1).
    let mut d2 = d.clone();
    for o in &mut d2 {
        o.handle.rewrite_send_head();
    }
    assert_ne!(d2[0].handle.send_head, d[0].handle.send_head);
    assert_eq!(nd(&d2, &c), base);

    // Worst-token sizing: padding rows are excluded, so two sizes give one digest, and garbage
    // in the padding changes nothing.
    let most = d.iter().map(|o| o.handle.num_recv_tokens).max().unwrap();
    let worst = |w| DispatchOptions {
        num_worst_tokens: w,
        ..DispatchOptions::default()
    };
    let (wd, wc) = normal_plan(&inp, &worst(most + 3));
    let (wd2, wc2) = normal_plan(&inp, &worst(most + 40));
    let a = nd(&wd, &wc);
    assert_eq!(a, nd(&wd2, &wc2));
    // Only the (empty) expert list tells it apart from the exact-size run.
    assert_ne!(a.total, base.total);
    let mut wd3 = wd.clone();
    for o in &mut wd3 {
        let n = o.handle.num_recv_tokens;
        if let Activations::Bf16(x) = &mut o.recv_x {
            flip_bf16(x, n, 0);
        }
        o.recv_topk_idx.as_mut().unwrap().set(n + 1, 0, 7);
        o.recv_topk_weights.as_mut().unwrap().set(n, 1, 9.0);
        o.handle.recv_src_idx[n + 2] = 3;
    }
    assert_eq!(nd(&wd3, &wc), a);
}

#[test]
fn ll_digest_ignores_rows_past_count_and_sees_one_bit() {
    let inp = inputs(false, Routing::Uniform);
    for fp8 in [None, Some((false, false))] {
        let run = ll_run(&inp, &ll_params(fp8), false);
        let base = lld(&run);
        let rank = 2;
        let l = 1;
        let count = run.0[rank].as_ref().unwrap().recv_count[l] as usize;
        assert!(count > 0);

        // Garbage past the count, and src_info there: ignored.
        let mut r2 = run.clone();
        let o = r2.0[rank].as_mut().unwrap();
        o.handle.src_info.set(l, count, 77);
        match &mut o.recv_x {
            LlRecvX::Bf16(x) => {
                let v = x.get(l, count, 0);
                x.set(l, count, 0, bf16::from_bits(v.to_bits() ^ 1));
            }
            LlRecvX::Fp8 { data, scales } => {
                data.set(l, count, 0, 0x55);
                scales.set(l, count, 0, 3.0);
            }
            LlRecvX::Fp8Ue8m0 { .. } => unreachable!(),
        }
        assert_eq!(lld(&r2), base, "{fp8:?}");

        // Swapping two rows inside a block: ignored (multiset).
        let mut r2 = run.clone();
        let o = r2.0[rank].as_mut().unwrap();
        let (b, c) = o.handle.block(l, 0).unwrap();
        if c >= 2 {
            let (i, j) = (b, b + 1);
            let si = o.handle.src_info.get(l, i);
            o.handle.src_info.set(l, i, o.handle.src_info.get(l, j));
            o.handle.src_info.set(l, j, si);
            match &mut o.recv_x {
                LlRecvX::Bf16(x) => {
                    let (ri, rj) = (x.row(l, i).to_vec(), x.row(l, j).to_vec());
                    x.row_mut(l, i).copy_from_slice(&rj);
                    x.row_mut(l, j).copy_from_slice(&ri);
                }
                LlRecvX::Fp8 { data, scales } => {
                    let (ri, rj) = (data.row(l, i).to_vec(), data.row(l, j).to_vec());
                    data.row_mut(l, i).copy_from_slice(&rj);
                    data.row_mut(l, j).copy_from_slice(&ri);
                    let (si, sj) = (scales.row(l, i).to_vec(), scales.row(l, j).to_vec());
                    scales.row_mut(l, i).copy_from_slice(&sj);
                    scales.row_mut(l, j).copy_from_slice(&si);
                }
                LlRecvX::Fp8Ue8m0 { .. } => unreachable!(),
            }
            assert_eq!(lld(&r2), base, "{fp8:?}: row order inside a block");
        }

        // One bit of a valid row, of its scale, of src_info, of combined_x: seen.
        let mut r2 = run.clone();
        match &mut r2.0[rank].as_mut().unwrap().recv_x {
            LlRecvX::Bf16(x) => {
                let v = x.get(l, 0, 3);
                x.set(l, 0, 3, bf16::from_bits(v.to_bits() ^ 1));
            }
            LlRecvX::Fp8 { data, .. } => {
                let v = data.get(l, 0, 3);
                data.set(l, 0, 3, v ^ 1);
            }
            LlRecvX::Fp8Ue8m0 { .. } => unreachable!(),
        }
        assert_ne!(lld(&r2).ranks[rank], base.ranks[rank]);
        if fp8.is_some() {
            let mut r2 = run.clone();
            if let LlRecvX::Fp8 { scales, .. } = &mut r2.0[rank].as_mut().unwrap().recv_x {
                let v = scales.get(l, 0, 0);
                scales.set(l, 0, 0, f32::from_bits(v.to_bits() ^ 1));
            }
            assert_ne!(lld(&r2).ranks[rank], base.ranks[rank]);
        }
        let mut r2 = run.clone();
        let si = &mut r2.0[rank].as_mut().unwrap().handle.src_info;
        si.set(l, 0, si.get(l, 0) ^ 1);
        assert_ne!(lld(&r2).ranks[rank], base.ranks[rank]);
        let mut r2 = run.clone();
        flip_bf16(r2.1[0].as_mut().unwrap(), 1, 1);
        assert_ne!(lld(&r2).ranks[0], base.ranks[0]);
        assert_eq!(lld(&r2).ranks[rank], base.ranks[rank]);
    }
}

/// Pins the byte format: a change of the serialisation (or of the plan or generator, which
/// have their own pins) shows here. Update only with a `FORMAT_VERSION` bump or a deliberate
/// generator change.
#[test]
fn golden_digests() {
    let inp = inputs(false, Routing::Uniform);
    let (d, c) = normal_plan(&inp, &DispatchOptions::default());
    assert_eq!(nd(&d, &c).total.to_string(), GOLDEN_NORMAL);
    let run = ll_run(&inp, &ll_params(Some((false, false))), false);
    assert_eq!(lld(&run).total.to_string(), GOLDEN_LL);
}

const GOLDEN_NORMAL: &str = "d6ec75f35dd60ecb99c26c11154b959210ec1d29f9c13ddfbd559c541667485d";
const GOLDEN_LL: &str = "477848661bfb572c594a8c632ac84d88aaecc3055f4b61c785226af9b1e113d8";
