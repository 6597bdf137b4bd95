//! ep-core's `Buffer` in low-latency mode over the GPU executor (`Buffer<Gpu>`) against the
//! same `Buffer` over the simulator (`Buffer<Sim>`), co-resident ranks on one GPU: dispatch
//! (BF16, FP8, rounded scales, UE8M0) and combine (copying, zero-copy from the caller's tensor
//! and from the region itself; BF16 or LogFMT-10 partials), with and without hooks, a masked
//! rank — the canonical digest of every rank's outputs equal to the simulator's, combined rows
//! bit for bit, LogFMT partials' bytes in the arenas equal; back-to-back
//! rounds with fresh routings; bad inputs as typed errors that leave the buffer usable; an
//! absent rank as a typed device timeout that poisons the buffer until `reset`. Outputs are
//! poisoned before each round; activations span a wide range of binades.
//!
//! Variant (a) by default; `EP_LL_VARIANT=nvshmem` runs every test over one NVSHMEM PE holding
//! every rank (variant (b), kernels linked at run time), as `gpu_low_latency` does.
//!
//! These tests need a GPU: they are `#[ignore]`d, and `scripts/gpu-run.sh` runs them with
//! `--include-ignored` on the GPU machine. Without a GPU they fail (they never pass unrun).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::device_at;
use common::ll::{Case, inputs_of, session, variant, wide_tensor};
use ep_core::buffer::LlCombineOptions;
use ep_core::config::BufferConfig;
use ep_core::digest;
use ep_core::plan::low_latency::LlParams;
use ep_core::transport::FabricParams;
use ep_core::workload::Routing;
use ep_core::{Activations, Buffer, Error as CoreError, Executor, RankInputs, Tensor2, Tensor3};
use ep_kernels::Error;
use ep_kernels::gpu::{
    DType, DevTensor, Device, Gpu, GpuExpertOut, GpuInputs, LlGpuDispatch, LlPoison, LlVariant,
};
use ep_sim::{Sim, SimConfig};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The Buffer's configuration for a case: low-latency mode, shrink mode, sized by the hint.
fn buffer_config(case: &Case) -> BufferConfig {
    let mut c = BufferConfig::new(case.ranks);
    c.low_latency_mode = true;
    c.enable_shrink = true;
    c.num_qps_per_rank = (case.experts / case.ranks) as u32;
    c.num_rdma_bytes = Buffer::<Sim>::low_latency_size_hint(
        case.max_tokens,
        case.hidden,
        case.ranks,
        case.experts,
    )
    .div_ceil(128)
        * 128;
    c
}

fn device() -> Arc<Device> {
    device_at(0)
}

fn gpu_buffer(dev: &Arc<Device>, case: &Case) -> Buffer<Gpu> {
    gpu_buffer_with(dev, case, buffer_config(case))
}

fn gpu_buffer_with(dev: &Arc<Device>, case: &Case, cfg: BufferConfig) -> Buffer<Gpu> {
    let mut g = Gpu::co_resident(dev.clone(), case.ranks, case.sms);
    if variant() == LlVariant::Nvshmem {
        g = g.with_nvshmem(session(), LlVariant::Nvshmem);
    }
    g.set_timeout(Duration::from_secs(5));
    Buffer::new(g, cfg).expect("Buffer<Gpu>")
}

fn sim_buffer(case: &Case) -> Buffer<Sim> {
    let sim = Sim::new(SimConfig::new(
        FabricParams::single_node(case.ranks),
        case.seed,
    ));
    Buffer::new(sim, buffer_config(case)).expect("Buffer<Sim>")
}

fn upload(dev: &Device, inputs: &[RankInputs]) -> Vec<GpuInputs> {
    let ctx = dev.context();
    inputs
        .iter()
        .map(|inp| {
            let Activations::Bf16(x) = &inp.x else {
                panic!("low-latency inputs are BF16")
            };
            GpuInputs {
                x: DevTensor::upload(ctx, x).unwrap(),
                x_scales: None,
                topk_idx: Some(DevTensor::upload(ctx, &inp.topk_idx).unwrap()),
                topk_weights: Some(DevTensor::upload(ctx, &inp.topk_weights).unwrap()),
            }
        })
        .collect()
}

/// Random expert outputs `[L, R·N, H]` per unmasked rank (only the received rows matter).
fn expert_outputs(case: &Case, masked: &[bool]) -> Vec<Option<Tensor3<bf16>>> {
    let (l, rows, h) = (
        case.experts / case.ranks,
        case.ranks * case.max_tokens,
        case.hidden,
    );
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0xc0);
    (0..case.ranks)
        .map(|d| {
            let y = wide_tensor(&mut rng, l * rows, h);
            (!masked[d]).then(|| Tensor3::new(l, rows, h, y.data().to_vec()).expect("shape"))
        })
        .collect()
}

fn poison(buf: &mut Buffer<Gpu>) {
    if let Some(g) = buf.transport_mut().low_latency_mut() {
        g.poison_for_test(LlPoison::Dispatch, 0xa5).unwrap();
        g.poison_for_test(LlPoison::Combine, 0x5a).unwrap();
    }
}

/// One dispatch + combine through both Buffers under the buffers' mask; the GPU's canonical
/// digest per local rank (dispatch and combined rows) equal to the simulator's (which runs every
/// rank), combined rows bit for bit.
fn round(gbuf: &mut Buffer<Gpu>, sbuf: &mut Buffer<Sim>, dev: &Arc<Device>, case: &Case) {
    let ys = expert_outputs(case, sbuf.masked_ranks());
    round_with(gbuf, sbuf, dev, case, &ys);
}

/// [`round`] with the expert outputs `ys` (`[L, R·N, H]` per rank, `None` for masked ones).
fn round_with(
    gbuf: &mut Buffer<Gpu>,
    sbuf: &mut Buffer<Sim>,
    dev: &Arc<Device>,
    case: &Case,
    ys: &[Option<Tensor3<bf16>>],
) {
    let masked = sbuf.masked_ranks().to_vec();
    assert_eq!(gbuf.masked_ranks(), &masked[..]);
    let local = gbuf.transport().local_ranks();
    let inputs = inputs_of(case);
    let mine: Vec<RankInputs> = local.iter().map(|&d| inputs[d].clone()).collect();
    let dins = upload(dev, &mine);
    let p = case.params(&[]);
    poison(gbuf);
    // The simulator: the reference.
    let want = sbuf
        .low_latency_dispatch(&inputs, &p)
        .expect("sim dispatch");
    let want_x = sbuf
        .low_latency_combine(&want.routes, ys, &inputs, case.combine_options())
        .expect("sim combine");
    // The GPU, with or without hooks.
    let got: Vec<Option<LlGpuDispatch>> = if case.hook {
        let hook = gbuf.low_latency_dispatch_send(&dins, &p).expect("gpu send");
        gbuf.low_latency_dispatch_recv(hook).expect("gpu recv")
    } else {
        gbuf.low_latency_dispatch(&dins, &p).expect("gpu dispatch")
    };
    let handles: Vec<_> = got
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    // Zero-copy from the region itself (written there, not copied) on even seeds, from the
    // caller's tensor (copied into the region) on odd ones.
    let l = case.experts / case.ranks;
    let gys: Vec<Option<GpuExpertOut>> = local
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            ys[d].as_ref().map(|y| {
                let flat = Tensor2::new(y.matrices() * y.rows(), y.cols(), y.data().to_vec())
                    .expect("flat");
                if case.zero_copy && case.seed.is_multiple_of(2) {
                    let region = gbuf.transport().next_combine_buffer(i).expect("region");
                    region.y.write(&flat).expect("write region");
                    region
                } else {
                    GpuExpertOut {
                        y: DevTensor::upload(dev.context(), &flat).unwrap(),
                        num_local_experts: l,
                    }
                }
            })
        })
        .collect();
    let got_x = if case.hook {
        let hook = gbuf
            .low_latency_combine_send(&handles, &gys, &dins, case.combine_options())
            .expect("gpu combine send");
        gbuf.low_latency_combine_recv(hook)
            .expect("gpu combine recv")
    } else {
        gbuf.low_latency_combine(&handles, &gys, &dins, case.combine_options())
            .expect("gpu combine")
    };
    gbuf.sync().expect("sync");
    let cfg = case.config();
    for (i, &d) in local.iter().enumerate() {
        assert_eq!(got[i].is_none(), masked[d], "rank {d}: mask");
        assert_eq!(got_x[i].is_none(), masked[d], "rank {d}: mask");
        let host = got[i].as_ref().map(|o| o.download(&cfg).expect("download"));
        let hx: Option<Tensor2<bf16>> = got_x[i].as_ref().map(|t| t.download().expect("x"));
        if let (Some(a), Some(b)) = (&hx, &want_x[d]) {
            let diff = a
                .data()
                .iter()
                .zip(b.data())
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(diff, 0, "rank {d}: combined elements differ ({case:?})");
        }
        let g = digest::low_latency_rank(d, host.as_ref(), hx.as_ref()).unwrap();
        let s = digest::low_latency_rank(d, want.outputs[d].as_ref(), want_x[d].as_ref()).unwrap();
        assert_eq!(g, s, "rank {d}: canonical digest ({case:?})");
    }
}

fn run(dev: &Arc<Device>, case: &Case) {
    let mut g = gpu_buffer(dev, case);
    let mut s = sim_buffer(case);
    round(&mut g, &mut s, dev, case);
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn buffer_gpu_low_latency_equals_buffer_sim() {
    let dev = device();
    for &(ranks, tokens, hidden, topk, experts) in &[
        (2, 128, 7168, 8, 32),
        (2, 64, 2048, 8, 32),
        (4, 48, 4096, 6, 64),
        (8, 32, 1024, 8, 64),
        (3, 40, 512, 11, 33),
    ] {
        for (i, fp8) in [
            None,
            Some((false, false)),
            Some((true, false)),
            Some((true, true)),
        ]
        .into_iter()
        .enumerate()
        {
            if fp8.is_some() && hidden % 512 != 0 {
                continue;
            }
            let mut c = Case::new(ranks, tokens, hidden, topk, experts);
            c.fp8 = fp8;
            c.sms = (132 / ranks).min(24);
            c.hook = i % 2 == 1;
            c.zero_copy = i >= 2;
            c.seed = (ranks * 1000 + tokens + i) as u64;
            eprintln!("case {c:?}");
            run(&dev, &c);
        }
    }
    // Skewed routings, fewer tokens than N.
    let mut c = Case::new(2, 100, 2048, 8, 64);
    c.max_tokens = 128;
    c.fp8 = Some((false, false));
    for routing in [
        Routing::Zipf { exponent: 1.2 },
        Routing::Hot { fraction: 0.8 },
    ] {
        c.routing = routing;
        eprintln!("case {c:?}");
        run(&dev, &c);
    }
}

/// Expert outputs whose LogFMT chunks are of both kinds: chunk `k` of rank `d` small (below
/// `scale` in magnitude, DeepEP's `randn * 0.1`-like inputs: its partials' chunks are cast)
/// unless `(k + d) % 3 == 2`, then of the wide range (raw); all small with `mixed` false.
fn logfmt_expert_outputs(
    case: &Case,
    masked: &[bool],
    scale: f32,
    mixed: bool,
) -> Vec<Option<Tensor3<bf16>>> {
    let (l, rows, h) = (
        case.experts / case.ranks,
        case.ranks * case.max_tokens,
        case.hidden,
    );
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0x1f);
    (0..case.ranks)
        .map(|d| {
            let data = (0..l * rows * h)
                .map(|i| {
                    let k = i % h / 512;
                    if mixed && (k + d) % 3 == 2 {
                        common::wide_bf16_within(&mut rng, 30)
                    } else {
                        let (u, v): (f32, f32) =
                            (rng.random_range(-1.0..1.0), rng.random_range(0.0..1.0));
                        bf16::from_f32(u * v * scale)
                    }
                })
                .collect();
            (!masked[d]).then(|| Tensor3::new(l, rows, h, data).expect("shape"))
        })
        .collect()
}

/// After a LogFMT round on fresh Buffers (its combine: operation 1, half 1), every partial's
/// bytes in the GPU's arena equal the simulator's (docs/protocol.md §3.12): on each token's
/// rank `s`, for each expert rank `d` and slot `i`, the `4S` meta bytes at `crecv_meta[d][i]`
/// and each chunk's bytes (`10/8 · channels` cast, `2 · channels` raw, from the metas) at its
/// place `1024 k` of `crecv[d][i]`. Returns the cast and raw chunks compared.
fn compare_logfmt_slots(
    gbuf: &Buffer<Gpu>,
    sbuf: &mut Buffer<Sim>,
    case: &Case,
    inputs: &[RankInputs],
) -> (usize, usize) {
    use ep_core::numerics::logfmt::Layout;
    use ep_core::protocol::layout::LlLayout;
    let l_count = case.experts / case.ranks;
    let lay = LlLayout {
        num_ranks: case.ranks,
        num_local_experts: l_count,
        hidden: case.hidden,
        num_max_tokens: case.max_tokens,
    };
    let (half, base) = (1, lay.half_base(1));
    let codec = Layout::new(case.hidden).expect("H % 128 == 0");
    let masked = sbuf.masked_ranks().to_vec();
    let data = sbuf
        .debug_low_latency_arena()
        .expect("the simulator's arena")
        .data()
        .clone();
    let (mut cast, mut raw) = (0, 0);
    for (i, &s) in gbuf.transport().local_ranks().iter().enumerate() {
        if masked[s] {
            continue;
        }
        // The GPU's data allocation of rank s: the zero-copy region's buffer; the region of the
        // next operation (index 2, half 0) sits where the layout says.
        let region = gbuf.transport().next_combine_buffer(i).expect("region").y;
        let dbuf = region.buffer().clone();
        assert_eq!(
            region.ptr() - dbuf.ptr(),
            lay.half_base(1 - half) + lay.cy(0, 0),
            "the GPU's layout is the simulator's"
        );
        let gpu = |off: u64, len: usize| {
            let mut b = vec![0u8; len];
            dbuf.read(off as usize, &mut b)
                .expect("read the GPU's arena");
            b
        };
        let mut slot = vec![0usize; case.ranks];
        for t in 0..inputs[s].num_tokens() {
            let mut to = vec![false; case.ranks];
            for &e in inputs[s].topk_idx.row(t) {
                if let Ok(e) = usize::try_from(e) {
                    to[e / l_count] = true;
                }
            }
            for d in (0..case.ranks).filter(|&d| to[d] && !masked[d]) {
                let j = slot[d];
                slot[d] += 1;
                let what = format!("rank {s}: partial {j} from rank {d} (token {t}, {case:?})");
                let n_meta = 4 * codec.num_divisions();
                let at = base + lay.crecv_meta(d, j);
                let sim_meta = sbuf
                    .transport_mut()
                    .host_read(s, data.at(at), n_meta as u64);
                let sim_meta = sim_meta.expect("read the simulator's arena");
                assert_eq!(gpu(at, n_meta), sim_meta, "{what}: metas");
                let meta: Vec<u32> = sim_meta
                    .chunks_exact(4)
                    .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                    .collect();
                for k in 0..codec.num_chunks() {
                    let is_cast = codec.chunk_cast(&meta, k);
                    let len = Layout::chunk_bytes(codec.chunk_channels(k).len(), is_cast);
                    let at = base + lay.crecv(d, j) + 1024 * k as u64;
                    let want = sbuf.transport_mut().host_read(s, data.at(at), len as u64);
                    assert_eq!(
                        gpu(at, len),
                        want.expect("read the simulator's arena"),
                        "{what}: chunk {k} ({})",
                        if is_cast { "cast" } else { "raw" }
                    );
                    if is_cast {
                        cast += 1;
                    } else {
                        raw += 1;
                    }
                }
            }
        }
    }
    (cast, raw)
}

/// LogFMT-10 combine (`LlCombineOptions::use_logfmt`) through both Buffers: combined rows bit
/// for bit and the canonical digests equal ([`round`]), with and without hooks, zero-copy from
/// the region itself and from the caller's tensor, a masked rank; expert outputs whose chunks
/// are cast (small values) and raw (the wide range); and the partials' bytes in the GPU's arena
/// equal the simulator's ([`compare_logfmt_slots`]). Then a BF16 round on the same Buffers.
#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn logfmt_combine_equals_buffer_sim_and_its_slots_the_simulators() {
    let dev = device();
    let (mut cast, mut raw) = (0, 0);
    for (i, (ranks, tokens, hidden, topk, experts, mixed, masked)) in [
        (2, 128, 7168, 8, 32, false, None),
        (4, 48, 4096, 6, 64, true, None),
        (3, 40, 640, 9, 33, true, Some(1)),
        (8, 32, 1024, 8, 64, true, None),
        (2, 64, 2048, 1, 32, false, Some(0)),
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = Case::new(ranks, tokens, hidden, topk, experts);
        c.sms = (132 / ranks).min(24);
        c.logfmt = true;
        c.hook = i % 2 == 1;
        c.zero_copy = i >= 2;
        c.seed = (ranks * 1000 + tokens + i) as u64;
        eprintln!("case {c:?} (mixed {mixed}, masked {masked:?})");
        let mut g = gpu_buffer(&dev, &c);
        let mut s = sim_buffer(&c);
        if let Some(r) = masked {
            g.mask(r, true);
            s.mask(r, true);
        }
        let ys = logfmt_expert_outputs(&c, s.masked_ranks(), 0.2, mixed);
        round_with(&mut g, &mut s, &dev, &c, &ys);
        let (a, b) = compare_logfmt_slots(&g, &mut s, &c, &inputs_of(&c));
        cast += a;
        raw += b;
        c.logfmt = false;
        round(&mut g, &mut s, &dev, &c);
    }
    assert!(
        cast > 0 && raw > 0,
        "{cast} cast and {raw} raw chunks compared"
    );
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn a_masked_rank_and_many_rounds_with_fresh_routings() {
    let dev = device();
    let mut c = Case::new(4, 24, 512, 4, 16);
    c.max_tokens = 32;
    c.sms = 8;
    let mut g = gpu_buffer(&dev, &c);
    let mut s = sim_buffer(&c);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let rounds = 1_000;
    for i in 0..rounds {
        // A masked rank for a stretch of rounds, as shrink mode's caller sets it.
        let masked = (i / 250) % 4 == 1;
        for b in [&mut g as &mut dyn MaskSet, &mut s] {
            b.mask(2, masked);
        }
        c.seed = 1000 + i;
        c.tokens = rng.random_range(0..=32);
        c.fp8 = match i % 3 {
            0 => None,
            1 => Some((false, false)),
            _ => Some((true, true)),
        };
        c.hook = i % 5 == 0;
        c.zero_copy = i % 2 == 0;
        round(&mut g, &mut s, &dev, &c);
    }
    let stats = g
        .transport_mut()
        .low_latency_mut()
        .expect("group")
        .stats()
        .unwrap();
    assert!(
        stats
            .iter()
            .all(|st| st.local_expert_recv.iter().sum::<i32>() > 0)
    );
}

/// Both Buffers' `update_mask`.
trait MaskSet {
    fn mask(&mut self, rank: usize, on: bool);
}

impl MaskSet for Buffer<Gpu> {
    fn mask(&mut self, rank: usize, on: bool) {
        self.update_mask(rank, on).unwrap();
    }
}

impl MaskSet for Buffer<Sim> {
    fn mask(&mut self, rank: usize, on: bool) {
        self.update_mask(rank, on).unwrap();
    }
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn bad_inputs_are_typed_errors_and_leave_the_buffer_usable() {
    let dev = device();
    let c = Case::new(2, 32, 512, 4, 16);
    let mut g = gpu_buffer(&dev, &c);
    let mut s = sim_buffer(&c);
    round(&mut g, &mut s, &dev, &c);
    let inputs = inputs_of(&c);
    let dins = upload(&dev, &inputs);
    let p = c.params(&[]);
    // More tokens than N: a shape rule, before any launch.
    let mut big = c.clone();
    big.tokens = 40;
    let bins = upload(&dev, &inputs_of(&big));
    let err = g.low_latency_dispatch(&bins, &p).unwrap_err();
    assert!(g.poisoned().is_none(), "{err}");
    // x of the wrong dtype: refused by the backend's shape check.
    let mut wrong = dins.clone();
    wrong[1].x = DevTensor::zeros(dev.context(), DType::F32, 32, 512).unwrap();
    let err = g.low_latency_dispatch(&wrong, &p).unwrap_err();
    assert!(
        matches!(err.backend::<Error>(), Some(Error::TensorMismatch { .. })),
        "{err}"
    );
    assert!(g.poisoned().is_none());
    // Another N than the kernels run: refused, usable after.
    let other = LlParams::new(64, c.experts);
    let err = g.low_latency_dispatch(&dins, &other).unwrap_err();
    assert!(matches!(err, CoreError::InputRefused { .. }), "{err}");
    // A combine with expert outputs of the wrong shape.
    let d = g.low_latency_dispatch(&dins, &p).unwrap();
    let handles: Vec<_> = d
        .iter()
        .map(|o| o.as_ref().map(|o| o.handle.clone()))
        .collect();
    let bad_y: Vec<Option<GpuExpertOut>> = (0..2)
        .map(|_| {
            Some(GpuExpertOut {
                y: DevTensor::zeros(dev.context(), DType::Bf16, 7, 512).unwrap(),
                num_local_experts: 8,
            })
        })
        .collect();
    let err = g
        .low_latency_combine(&handles, &bad_y, &dins, LlCombineOptions::default())
        .unwrap_err();
    assert!(g.poisoned().is_none(), "{err}");
    // A stale handle (a later dispatch on the same half reused its buffers) is refused.
    let _ = g.low_latency_dispatch(&dins, &p).unwrap();
    let _ = g.low_latency_dispatch(&dins, &p).unwrap();
    let ys = expert_outputs(&c, &[false, false]);
    let gys: Vec<Option<GpuExpertOut>> = ys
        .iter()
        .map(|y| {
            y.as_ref().map(|y| GpuExpertOut {
                y: DevTensor::upload(
                    dev.context(),
                    &Tensor2::new(y.matrices() * y.rows(), y.cols(), y.data().to_vec()).unwrap(),
                )
                .unwrap(),
                num_local_experts: y.matrices(),
            })
        })
        .collect();
    let err = g
        .low_latency_combine(&handles, &gys, &dins, LlCombineOptions::default())
        .unwrap_err();
    assert!(matches!(err, CoreError::InputRefused { .. }), "{err}");
    assert!(g.poisoned().is_none());
    // A hook pending refuses the next send, then the round goes on.
    let hook = g.low_latency_dispatch_send(&dins, &p).unwrap();
    let err = g.low_latency_dispatch_send(&dins, &p).unwrap_err();
    assert!(
        matches!(err, CoreError::LowLatencyHookPending { .. }),
        "{err}"
    );
    let _ = g.low_latency_dispatch_recv(hook).unwrap();
    g.sync().unwrap();
    let mut s = sim_buffer(&c);
    round(&mut g, &mut s, &dev, &c);
    // Clean, then a round.
    g.clean_low_latency_buffer().unwrap();
    round(&mut g, &mut s, &dev, &c);
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-run.sh"]
fn an_absent_rank_times_out_naming_it_and_reset_recovers() {
    let dev = device();
    let c = Case::new(2, 32, 512, 4, 16);
    let dins = upload(&dev, &inputs_of(&c));
    let absent = |g: &mut Buffer<Gpu>, rank: Option<usize>| {
        g.transport_mut()
            .low_latency_mut()
            .expect("group")
            .set_absent_rank_for_test(rank);
    };
    // Shrink mode: the kernels mask the rank that never arrives instead of failing, and the
    // Buffer adopts it into its mask at the next sync.
    {
        let mut g = gpu_buffer(&dev, &c);
        let mut s = sim_buffer(&c);
        round(&mut g, &mut s, &dev, &c);
        g.transport_mut().set_timeout(Duration::from_millis(200));
        absent(&mut g, Some(1));
        let _ = g.low_latency_dispatch(&dins, &c.params(&[])).unwrap();
        g.sync().expect("shrink mode: no error");
        assert!(g.poisoned().is_none());
        assert_eq!(g.query_mask().unwrap(), vec![0, 1]);
    }
    // Without shrink mode: a typed timeout naming the rank, the Buffer poisoned until reset.
    let mut cfg = buffer_config(&c);
    cfg.enable_shrink = false;
    let mut g = gpu_buffer_with(&dev, &c, cfg);
    let mut s = sim_buffer(&c);
    round(&mut g, &mut s, &dev, &c);
    g.transport_mut().set_timeout(Duration::from_millis(200));
    absent(&mut g, Some(1));
    let _ = g.low_latency_dispatch(&dins, &c.params(&[])).unwrap();
    let err = g.sync().unwrap_err();
    match err.backend::<Error>() {
        Some(Error::DeviceWaitTimeout {
            rank, writer, word, ..
        }) => {
            assert_eq!(*rank, 0, "{err}");
            assert_eq!(*writer, Some(1), "{err}");
            assert!(word.starts_with("disp_sig"), "{err}");
        }
        _ => panic!("expected a device timeout, got {err}"),
    }
    assert!(g.poisoned().is_some());
    assert!(matches!(
        g.low_latency_dispatch(&dins, &c.params(&[])),
        Err(CoreError::BufferPoisoned { .. })
    ));
    absent(&mut g, None);
    g.transport_mut().set_timeout(Duration::from_secs(5));
    g.reset().unwrap();
    let mut s = sim_buffer(&c);
    round(&mut g, &mut s, &dev, &c);
}

/// One `Buffer<Gpu>` per process (the deployment shape), over NVSHMEM with one PE per rank:
/// variant (b) through the device API and variant (a) by `nvshmem_ptr`; each process checks
/// its rank against the simulator of the whole world.
#[test]
#[ignore = "needs a GPU and NVSHMEM: run by scripts/gpu-run.sh"]
fn a_buffer_per_process_over_nvshmem_equals_buffer_sim() {
    common::procs::spawn_or_run(
        "a_buffer_per_process_over_nvshmem_equals_buffer_sim",
        2,
        |rank| {
            let ordinal = common::procs::my_ordinal();
            let session = common::ll::rank_session(rank, 2)?;
            let dev = Device::open(ordinal)?;
            let mut c = Case::new(2, 64, 2048, 8, 32);
            c.fp8 = Some((true, true));
            c.sms = 16;
            for v in [LlVariant::Nvshmem, LlVariant::Pointers] {
                // Collective: both processes make (and drop) their Buffers in the same order.
                let mut exec = Gpu::process_over_nvshmem(dev.clone(), c.sms, session.clone(), v);
                exec.set_timeout(Duration::from_secs(20));
                let mut g = Buffer::new(exec, buffer_config(&c)).expect("Buffer<Gpu>");
                assert_eq!(g.transport().local_ranks(), vec![rank as usize]);
                let mut s = sim_buffer(&c);
                for (i, (hook, zero_copy)) in [(false, false), (true, true), (false, true)]
                    .into_iter()
                    .enumerate()
                {
                    let mut f = c.clone();
                    f.hook = hook;
                    f.zero_copy = zero_copy;
                    f.seed = 7 + i as u64;
                    round(&mut g, &mut s, &dev, &f);
                }
                g.clean_low_latency_buffer().expect("clean");
                round(&mut g, &mut s, &dev, &c);
                eprintln!(
                    "rank {rank}: {}",
                    g.transport()
                        .low_latency()
                        .expect("group")
                        .transport_report()
                );
            }
            Ok(())
        },
    );
}
