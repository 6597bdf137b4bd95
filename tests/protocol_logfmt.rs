//! LogFMT-10 combine through `Buffer<Sim>` (`LlCombineOptions::use_logfmt`, docs/protocol.md
//! §3.12): bit for bit with the plan's reduction with `PartialPrecision::LogFmt10` over R = 2, 3,
//! 4, hidden 512..=7168 (one not a multiple of 512), top-k 1..=9, with and without hooks,
//! zero-copy and copying, a masked rank; on DeepEP's LogFMT inputs (`randn * 0.5 * rand` through
//! the identity expert) and on expert outputs whose 512-channel chunks are of every kind the
//! codec tells apart (cast: small, tiny, with zeros; raw: an outlier >= 1, all zero, wide range).
//! The low-latency data is poisoned before every dispatch and every combine. Against the BF16
//! combine: within DeepEP's bound, really lossy, fewer bytes moved. An `H` that is not a
//! multiple of 128 is refused before any phase.

mod protocol_support;

use ep_rs::core::buffer::LlCombineOptions;
use ep_rs::core::plan::low_latency::{
    LlDispatchOutput, LlParams, PartialPrecision, combine_reduced_on_expert_rank, dispatch,
};
use ep_rs::core::transport::PhaseKind;
use ep_rs::core::{Activations, Buffer, Error, RankInputs, Tensor2, Tensor3};
use ep_rs::sim::Sim;
use half::bf16;
use protocol_support::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// What the expert outputs are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Values {
    /// DeepEP's LogFMT test inputs: `x = randn * 0.5 * rand`, the identity expert.
    DeepEp,
    /// Per (rank, 512-channel chunk) one kind for all the rank's rows (so its partials keep
    /// it): small, tiny, small with zeros (cast), an outlier >= 1, all zero, wide (raw).
    Chunks,
}

#[derive(Clone, Debug)]
struct Case {
    ranks: usize,
    /// `N` (every rank sends `N` tokens).
    n: usize,
    local_experts: usize,
    topk: usize,
    hidden: usize,
    hook: bool,
    zero_copy: bool,
    masked: Option<usize>,
    values: Values,
    seed: u64,
}

impl Case {
    fn experts(&self) -> usize {
        self.ranks * self.local_experts
    }
    fn masked(&self) -> Vec<bool> {
        (0..self.ranks).map(|r| Some(r) == self.masked).collect()
    }
    fn params(&self) -> LlParams {
        LlParams::new(self.n, self.experts()).with_masked_ranks(self.masked())
    }
}

fn randn(rng: &mut ChaCha8Rng) -> f32 {
    // Box–Muller.
    let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}

/// Every rank's inputs: the routing of [`gen_inputs`] (distinct experts, some `-1`, weights in
/// `±[0.01, 1)`), `x` as `values` wants it.
fn inputs(c: &Case) -> Vec<RankInputs> {
    let g = Gen {
        num_ranks: c.ranks,
        max_tokens: c.n,
        num_experts: c.experts(),
        num_topk: c.topk,
        hidden: c.hidden,
        fp8: false,
        mask: 0.1,
        full: true,
    };
    let mut inputs = gen_inputs(&g, c.seed, true);
    if c.values == Values::DeepEp {
        let mut rng = ChaCha8Rng::seed_from_u64(c.seed ^ 0xdee9);
        for inp in &mut inputs {
            inp.x = Activations::Bf16(Tensor2::from_fn(c.n, c.hidden, |_, _| {
                let r: f32 = rng.random();
                bf16::from_f32(randn(&mut rng) * 0.5 * r)
            }));
        }
    }
    inputs
}

/// Rank `d`'s `[L, R·N, H]` expert outputs for [`Values::Chunks`]: chunk `k` of kind
/// `(k·R + d + first) % 6`, so that any four chunks of the world hold a cast kind (0..=2) and a
/// raw one (3..=5).
fn chunked_outputs(
    rng: &mut ChaCha8Rng,
    (d, r, first): (usize, usize, usize),
    (l, rows, h): (usize, usize, usize),
) -> Tensor3<bf16> {
    let data = (0..l * rows * h)
        .map(|i| {
            let c = i % h;
            let v = match (c / 512 * r + d + first) % 6 {
                0 => randn(rng) * 0.05,
                1 => rng.random_range(-1.0f32..1.0) * 2f32.powi(-rng.random_range(20..40)),
                2 if rng.random_range(0..3) == 0 => 0.0,
                2 => rng.random_range(-0.3f32..0.3),
                3 if c % 512 == 77 => 3.5,
                3 => randn(rng) * 0.05,
                4 => 0.0,
                _ => return rand_bf16(rng),
            };
            bf16::from_f32(v)
        })
        .collect();
    Tensor3::new(l, rows, h, data).expect("shape")
}

/// The expert outputs of `c` for the plan's dispatch `plan` (`None` for masked ranks).
fn expert_outputs(c: &Case, plan: &[Option<LlDispatchOutput>]) -> Vec<Option<Tensor3<bf16>>> {
    match c.values {
        Values::DeepEp => ll_identity_outputs(plan),
        Values::Chunks => {
            let mut rng = ChaCha8Rng::seed_from_u64(c.seed ^ 0xc4a9);
            let first = rng.random_range(0..6);
            let shape = (c.local_experts, c.ranks * c.n, c.hidden);
            (0..c.ranks)
                .map(|d| {
                    let y = chunked_outputs(&mut rng, (d, c.ranks, first), shape);
                    plan[d].as_ref().map(|_| y)
                })
                .collect()
        }
    }
}

fn buffer(c: &Case) -> Buffer<Sim> {
    let s = sim(fabric(c.ranks, 1 << 16, 4, 2), c.seed, policy(c.seed as u8));
    let mut buf = ll_buffer(s, c.n, c.hidden, c.ranks, c.experts(), 2);
    for (r, m) in c.masked().into_iter().enumerate() {
        buf.update_mask(r, m).expect("mask");
    }
    buf
}

/// One dispatch and one combine of `c` on `buf` (the arena poisoned before each), with or
/// without LogFMT: the combined outputs and the bytes the combine's send half recorded.
fn run(
    buf: &mut Buffer<Sim>,
    c: &Case,
    inputs: &[RankInputs],
    y: &[Option<Tensor3<bf16>>],
    use_logfmt: bool,
) -> (Vec<Option<Tensor2<bf16>>>, u64) {
    let p = c.params();
    buf.debug_poison_low_latency_data(0xa5).expect("poison");
    let got = if c.hook {
        let h = buf.low_latency_dispatch_send(inputs, &p).expect("send");
        buf.low_latency_dispatch_recv(h).expect("recv")
    } else {
        buf.low_latency_dispatch(inputs, &p).expect("dispatch")
    };
    assert_eq!(
        got.outputs,
        dispatch(inputs, &p).unwrap(),
        "dispatch ({c:?})"
    );
    // The simulator's combine takes its routes from the dispatch's hook, not from the arena:
    // poisoning here leaves it only what this combine writes.
    buf.debug_poison_low_latency_data(0x5a).expect("poison");
    let opts = LlCombineOptions {
        zero_copy: c.zero_copy,
        use_logfmt,
    };
    let out = if c.hook {
        let h = buf
            .low_latency_combine_send(&got.routes, y, inputs, opts)
            .expect("combine send");
        buf.low_latency_combine_recv(h).expect("combine recv")
    } else {
        buf.low_latency_combine(&got.routes, y, inputs, opts)
            .expect("combine")
    };
    let sent = buf
        .transport()
        .records()
        .iter()
        .rev()
        .find(|r| r.kind == PhaseKind::LowLatencyCombineSend)
        .map_or(0, |r| r.bytes());
    (out, sent)
}

fn bits(t: &Tensor2<bf16>) -> Vec<u16> {
    t.data().iter().map(|v| v.to_bits()).collect()
}

/// `got` equals `want` bit for bit; otherwise a panic naming how many elements differ and the
/// first.
fn assert_same(got: Option<&Tensor2<bf16>>, want: &Tensor2<bf16>, what: impl std::fmt::Display) {
    let Some(got) = got else {
        panic!("{what}: no output")
    };
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let differ: Vec<usize> = (0..want.data().len())
        .filter(|&i| got.data()[i].to_bits() != want.data()[i].to_bits())
        .collect();
    if let Some(&i) = differ.first() {
        panic!(
            "{what}: {} of {} elements differ, the first at {i}: {} vs {}",
            differ.len(),
            want.data().len(),
            got.data()[i],
            want.data()[i]
        );
    }
}

/// Runs `c` with LogFMT and with BF16 partials and checks everything the module docs list.
fn check(c: &Case) {
    let inputs = inputs(c);
    let p = c.params();
    let plan = dispatch(&inputs, &p).expect("plan dispatch");
    let handles: Vec<_> = plan
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    let y = expert_outputs(c, &plan);
    let reduce = |precision| {
        combine_reduced_on_expert_rank(&inputs, &handles, &y, &p, precision).expect("plan")
    };
    let (want, want_bf16) = (
        reduce(PartialPrecision::LogFmt10),
        reduce(PartialPrecision::Bf16),
    );
    let mut buf = buffer(c);
    let (got, lf_bytes) = run(&mut buf, c, &inputs, &y, true);
    // The same Buffer, the other half and flavour next: then LogFMT again on the first half.
    let (got_bf16, bf16_bytes) = run(&mut buf, c, &inputs, &y, false);
    let (again, _) = run(&mut buf, c, &inputs, &y, true);
    let mut differ = 0usize;
    for s in 0..c.ranks {
        let (g, w) = (&got[s], &want[s]);
        assert_eq!(g.is_none(), Some(s) == c.masked, "rank {s}: mask ({c:?})");
        let (Some(g), Some(w)) = (g, w) else { continue };
        assert_same(
            Some(g),
            w,
            format!("rank {s}: LogFMT combine vs plan ({c:?})"),
        );
        assert_same(
            again[s].as_ref(),
            w,
            format!("rank {s}: LogFMT again ({c:?})"),
        );
        let b = want_bf16[s].as_ref().expect("unmasked");
        assert_same(got_bf16[s].as_ref(), b, format!("rank {s}: BF16 ({c:?})"));
        differ += bits(g)
            .iter()
            .zip(bits(b))
            .filter(|(x, y)| **x != *y)
            .count();
        // DeepEP holds its LogFMT combine to the FP8 bound against the BF16 one.
        let diff = calc_diff(g, b);
        assert!(diff < 9e-4, "rank {s}: calc_diff {diff} to BF16 ({c:?})");
        if c.values == Values::DeepEp {
            // DeepEP's own check: the identity expert gives x · Σ w over unmasked experts.
            let Activations::Bf16(x) = &inputs[s].x else {
                unreachable!()
            };
            let l = c.local_experts;
            let want_x = Tensor2::from_fn(c.n, c.hidden, |t, j| {
                let sw: f32 = (0..c.topk)
                    .filter(|&k| {
                        let e = inputs[s].topk_idx.get(t, k);
                        e >= 0 && Some(e as usize / l) != c.masked
                    })
                    .map(|k| inputs[s].topk_weights.get(t, k))
                    .sum();
                bf16::from_f32(x.get(t, j).to_f32() * sw)
            });
            let diff = calc_diff(g, &want_x);
            assert!(diff < 9e-4, "rank {s}: calc_diff {diff} to x·Σw ({c:?})");
        }
    }
    // Lossy for real, and fewer bytes: chunks were cast.
    assert!(differ > 0, "no LogFMT chunk was cast ({c:?})");
    assert!(
        lf_bytes < bf16_bytes,
        "LogFMT combine moved {lf_bytes} bytes, BF16 {bf16_bytes} ({c:?})"
    );
}

#[test]
fn logfmt_combine_equals_the_plan_bit_for_bit() {
    use Values::*;
    #[rustfmt::skip]
    let cases = [
        // ranks, N, L, top-k, H, hook, zero-copy, masked, values
        (2, 8, 2, 1, 7168, false, false, None, DeepEp),
        (2, 4, 4, 6, 640, true, false, None, Chunks),
        (3, 4, 3, 9, 2560, true, true, Some(1), Chunks),
        (3, 8, 2, 3, 1536, false, true, Some(2), DeepEp),
        (4, 4, 2, 4, 512, false, true, None, Chunks),
        (4, 3, 3, 8, 7168, true, false, None, Chunks),
        (4, 4, 2, 2, 4096, true, true, Some(0), DeepEp),
        (2, 6, 5, 9, 1024, false, false, None, Chunks),
    ];
    for (i, &(ranks, n, local_experts, topk, hidden, hook, zero_copy, masked, values)) in
        cases.iter().enumerate()
    {
        let c = Case {
            ranks,
            n,
            local_experts,
            topk,
            hidden,
            hook,
            zero_copy,
            masked,
            values,
            seed: 40 + i as u64,
        };
        eprintln!("case {c:?}");
        check(&c);
    }
}

/// LogFMT keeps one meta word per 128 channels: expert outputs whose `H` is not a multiple of
/// 128 are refused before any phase (no call taken, the buffer not poisoned); the same combine
/// with valid outputs runs after.
#[test]
fn logfmt_refuses_a_hidden_size_not_a_multiple_of_128() {
    let c = Case {
        ranks: 2,
        n: 4,
        local_experts: 2,
        topk: 2,
        hidden: 256,
        hook: false,
        zero_copy: false,
        masked: None,
        values: Values::Chunks,
        seed: 3,
    };
    let inputs = inputs(&c);
    let mut buf = buffer(&c);
    let got = buf
        .low_latency_dispatch(&inputs, &c.params())
        .expect("dispatch");
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let bad: Vec<_> = (0..c.ranks)
        .map(|_| Some(rand_bf16_tensor3(&mut rng, 2, c.ranks * c.n, 200)))
        .collect();
    let opts = LlCombineOptions::default().with_logfmt(true);
    let before = buf.last_call();
    for zero_copy in [false, true] {
        let err = buf
            .low_latency_combine(&got.routes, &bad, &inputs, opts.with_zero_copy(zero_copy))
            .expect_err("H = 200 with LogFMT");
        assert!(
            matches!(
                err,
                Error::HiddenMisaligned {
                    value: 200,
                    multiple: 128,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(buf.poisoned().is_none(), "{err}");
        assert_eq!(buf.last_call(), before, "no call taken");
    }
    let plan = dispatch(&inputs, &c.params()).unwrap();
    let y = expert_outputs(&c, &plan);
    let out = buf
        .low_latency_combine(&got.routes, &y, &inputs, opts)
        .expect("the valid combine runs");
    let handles: Vec<_> = plan
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    let want = combine_reduced_on_expert_rank(
        &inputs,
        &handles,
        &y,
        &c.params(),
        PartialPrecision::LogFmt10,
    )
    .unwrap();
    assert_eq!(out, want);
}

/// The bytes in the simulator's arena after a LogFMT combine are the slot form of
/// docs/protocol.md §3.12, checked from the codec's message alone: for each partial
/// `crecv[d][i]` on its token's rank, the message's `4S` meta bytes at `crecv_meta[d][i]` and
/// chunk `k`'s bytes (`10/8 · channels` cast, `2 · channels` raw) at byte `1024 k` of the slot.
/// One entry per token of weight `w` makes each partial `bf16(fma(y, w, 0))` of the expert's
/// row, computed here from the plan's handle. (The kernels write the same bytes:
/// `gpu_buffer_ll` compares the GPU's arena with the simulator's.)
#[test]
fn the_slots_hold_the_codec_bytes_at_their_places() {
    use ep_rs::core::numerics::logfmt::{self, Layout};
    use ep_rs::core::plan::low_latency::unpack_layout_range;
    use ep_rs::core::protocol::layout::LlLayout;
    for (i, &(ranks, hidden)) in [(3usize, 2560usize), (2, 640), (4, 7168)]
        .iter()
        .enumerate()
    {
        let c = Case {
            ranks,
            n: 4,
            local_experts: 2,
            topk: 1,
            hidden,
            hook: i == 1,
            zero_copy: i == 2,
            masked: None,
            values: Values::Chunks,
            seed: 70 + i as u64,
        };
        let inputs = inputs(&c);
        let p = c.params();
        let plan = dispatch(&inputs, &p).expect("plan dispatch");
        let y = expert_outputs(&c, &plan);
        let mut buf = buffer(&c);
        // A fresh buffer: dispatch is operation 0 (half 0), the combine operation 1 (half 1).
        let _ = run(&mut buf, &c, &inputs, &y, true);
        let data = buf.debug_low_latency_arena().expect("arena").data().clone();
        let lay = LlLayout {
            num_ranks: ranks,
            num_local_experts: c.local_experts,
            hidden,
            num_max_tokens: c.n,
        };
        let base = lay.half_base(1);
        let codec = Layout::new(hidden).unwrap();
        let (mut cast, mut raw) = (0, 0);
        for (s, inp) in inputs.iter().enumerate() {
            let mut slot = vec![0usize; ranks];
            for t in 0..c.n {
                let Ok(e) = usize::try_from(inp.topk_idx.get(t, 0)) else {
                    continue;
                };
                let (d, l) = (e / c.local_experts, e % c.local_experts);
                let i = slot[d];
                slot[d] += 1;
                let h = &plan[d].as_ref().expect("unmasked").handle;
                let (begin, count) = unpack_layout_range(h.layout_range.get(l, s));
                let row = (begin..begin + count)
                    .map(|r| r as usize)
                    .find(|&r| h.src_info.get(l, r) == t as i32)
                    .expect("the token's row");
                let w = inp.topk_weights.get(t, 0);
                let y_row = y[d].as_ref().expect("unmasked").row(l, row);
                let partial: Vec<bf16> = y_row
                    .iter()
                    .map(|v| bf16::from_f32(v.to_f32().mul_add(w, 0.0)))
                    .collect();
                let msg = logfmt::encode_row(&partial).unwrap();
                let meta = logfmt::row_meta(&partial);
                let sim = buf.transport_mut();
                let metas = sim
                    .host_read(
                        s,
                        data.at(base + lay.crecv_meta(d, i)),
                        4 * meta.len() as u64,
                    )
                    .unwrap();
                let what = format!("H {hidden}: rank {s}'s partial {i} from {d} (token {t})");
                assert_eq!(metas, msg[..4 * meta.len()], "{what}: metas");
                for k in 0..codec.num_chunks() {
                    let channels = codec.chunk_channels(k).len();
                    let is_cast = codec.chunk_cast(&meta, k);
                    let len = Layout::chunk_bytes(channels, is_cast);
                    let at = codec.chunk_offset(&meta, k);
                    let place = base + lay.crecv(d, i) + 1024 * k as u64;
                    let got = sim.host_read(s, data.at(place), len as u64).unwrap();
                    assert_eq!(got, msg[at..at + len], "{what}: chunk {k}");
                    if is_cast {
                        cast += 1;
                    } else {
                        raw += 1;
                    }
                }
            }
        }
        assert!(
            cast > 0 && raw > 0,
            "H {hidden}: {cast} cast, {raw} raw chunks"
        );
    }
}
