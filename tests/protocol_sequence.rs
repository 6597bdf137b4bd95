//! Back-to-back calls on one `Buffer` (docs/protocol.md §1.1, §3.7): 120 steps with fresh
//! routings, normal and low-latency modes interleaved, low-latency hooks run after unrelated
//! normal-mode work but before the next low-latency operation, masks toggled, cleans in between,
//! combines with BF16 or LogFMT-10 partials, every result exact against the plan. Epoch-coded signals are never reset.

mod protocol_support;

use ep_rs::core::buffer::{LlCombineOptions, NormalDispatchArgs};
use ep_rs::core::config::{BufferConfig, Config};
use ep_rs::core::plan::combine::CombineArgs;
use ep_rs::core::plan::intranode::{
    DispatchOptions, intranode_combine, intranode_dispatch_all, intranode_dispatch_cached,
};
use ep_rs::core::plan::low_latency::{
    LlParams, PartialPrecision, combine_reduced_on_expert_rank, dispatch,
};
use ep_rs::core::{Activations, Buffer, Tensor3};
use ep_rs::sim::Sim;
use half::bf16;
use protocol_support::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const R: usize = 4;
const N: usize = 4;
const L: usize = 2;
const K: usize = 3;
const H: usize = 128;

fn buffer(seed: u64) -> Buffer<Sim> {
    let mut cfg = BufferConfig::new(R);
    cfg.low_latency_mode = true;
    cfg.enable_shrink = true;
    cfg.num_qps_per_rank = 2;
    cfg.num_rdma_bytes = Buffer::<Sim>::low_latency_size_hint(N, H, R, R * L).div_ceil(128) * 128;
    cfg.num_nvl_bytes = Buffer::<Sim>::normal_size_hint(R, R * N, H, 2, K).div_ceil(128) * 128;
    let s = sim(fabric(R, 2048, 2, 2), seed, policy(seed as u8));
    Buffer::new(s, cfg).unwrap()
}

fn normal_step(buf: &mut Buffer<Sim>, rng: &mut ChaCha8Rng, step: u64) {
    let g = Gen {
        num_ranks: R,
        max_tokens: N,
        num_experts: R * L,
        num_topk: K,
        hidden: H,
        fp8: rng.random_bool(0.3),
        mask: 0.2,
        full: false,
    };
    let inputs = gen_inputs(&g, rng.random(), false);
    let topk: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let layouts = buf.get_dispatch_layout(&topk, g.num_experts).unwrap();
    let worst = if rng.random_bool(0.3) { R * N } else { 0 };
    let mut args =
        NormalDispatchArgs::new(Config::new(2 * rng.random_range(1..=2), 1, 2, 1, 2).unwrap());
    args.num_worst_tokens = worst;
    let opts = DispatchOptions {
        num_channels: args.config.num_channels(),
        expert_alignment: 1,
        num_worst_tokens: worst,
        with_topk: true,
    };
    let got = buf
        .dispatch(&inputs, &layouts, g.num_experts, &args)
        .unwrap();
    assert_eq!(
        got,
        intranode_dispatch_all(&inputs, &layouts, g.num_experts, &opts).unwrap(),
        "step {step}"
    );
    let handles: Vec<_> = got.iter().map(|o| o.handle.clone()).collect();
    if rng.random_bool(0.5) {
        let xs: Vec<&Activations> = inputs.iter().map(|i| &i.x).collect();
        let c = buf.dispatch_cached(&xs, &handles).unwrap();
        for (d, x) in c.iter().enumerate() {
            assert_eq!(
                x,
                &intranode_dispatch_cached(&xs, &handles, d).unwrap(),
                "step {step}"
            );
        }
    }
    let ys: Vec<_> = handles
        .iter()
        .map(|h| rand_bf16_tensor(rng, h.recv_src_idx.len(), H))
        .collect();
    let ws: Vec<_> = handles
        .iter()
        .map(|h| rand_f32_tensor(rng, h.recv_src_idx.len(), K))
        .collect();
    let cargs: Vec<_> = (0..R)
        .map(|d| CombineArgs {
            x: &ys[d],
            topk_weights: Some(&ws[d]),
            bias: &[],
        })
        .collect();
    assert_eq!(
        buf.combine(&handles, &cargs).unwrap(),
        intranode_combine(&handles, &cargs).unwrap(),
        "step {step}"
    );
}

fn ll_inputs(rng: &mut ChaCha8Rng) -> Vec<ep_rs::core::RankInputs> {
    let g = Gen {
        num_ranks: R,
        max_tokens: N,
        num_experts: R * L,
        num_topk: K,
        hidden: H,
        fp8: false,
        mask: 0.2,
        full: false,
    };
    gen_inputs(&g, rng.random(), true)
}

#[test]
fn one_hundred_twenty_calls_back_to_back() {
    let mut buf = buffer(11);
    let mut rng = ChaCha8Rng::seed_from_u64(2024);
    let mut ll_ops = 0;
    for step in 0..120u64 {
        match rng.random_range(0..10) {
            0..=2 => normal_step(&mut buf, &mut rng, step),
            3 => {
                let r = rng.random_range(0..R);
                let m = rng.random_bool(0.5);
                buf.update_mask(r, m).unwrap();
                if buf.masked_ranks().iter().all(|&x| x) {
                    buf.clean_mask().unwrap();
                }
                assert_eq!(
                    buf.query_mask().unwrap(),
                    buf.masked_ranks()
                        .iter()
                        .map(|&x| i32::from(x))
                        .collect::<Vec<_>>()
                );
            }
            4 => buf.clean_low_latency_buffer().unwrap(),
            _ => {
                // LL dispatch + combine; each hook after unrelated normal work half the time.
                ll_ops += 2;
                let hook = rng.random_bool(0.5);
                let inputs = ll_inputs(&mut rng);
                let p = LlParams::new(N, R * L).with_masked_ranks(buf.masked_ranks().to_vec());
                let want = dispatch(&inputs, &p).unwrap();
                let got = if hook {
                    let hk = buf.low_latency_dispatch_send(&inputs, &p).unwrap();
                    normal_step(&mut buf, &mut rng, step);
                    buf.low_latency_dispatch_recv(hk).unwrap()
                } else {
                    buf.low_latency_dispatch(&inputs, &p).unwrap()
                };
                assert_eq!(got.outputs, want, "step {step}");
                let handles: Vec<_> = got
                    .outputs
                    .iter()
                    .map(|o| o.as_ref().map(|o| o.handle.clone()))
                    .collect();
                let y: Vec<Option<Tensor3<bf16>>> = (0..R)
                    .map(|d| {
                        (!buf.masked_ranks()[d]).then(|| rand_bf16_tensor3(&mut rng, L, R * N, H))
                    })
                    .collect();
                let opts = LlCombineOptions {
                    zero_copy: rng.random_bool(0.5),
                    use_logfmt: rng.random_bool(0.5),
                };
                let out = if hook {
                    let hk = buf
                        .low_latency_combine_send(&got.routes, &y, &inputs, opts)
                        .unwrap();
                    normal_step(&mut buf, &mut rng, step);
                    buf.low_latency_combine_recv(hk).unwrap()
                } else {
                    buf.low_latency_combine(&got.routes, &y, &inputs, opts)
                        .unwrap()
                };
                assert_eq!(
                    out,
                    combine_reduced_on_expert_rank(
                        &inputs,
                        &handles,
                        &y,
                        &p,
                        if opts.use_logfmt {
                            PartialPrecision::LogFmt10
                        } else {
                            PartialPrecision::Bf16
                        }
                    )
                    .unwrap(),
                    "step {step}"
                );
            }
        }
    }
    assert!(ll_ops >= 40, "only {ll_ops} low-latency operations");
    assert!(buf.last_call() >= 120);
}

/// Back-to-back dispatches in hook mode (spec case 17): dispatch, hook, dispatch, hook, ...,
/// results identical to the non-hook path on another buffer with the same seed.
#[test]
fn hook_mode_equals_direct_mode() {
    let mut a = buffer(5);
    let mut b = buffer(5);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for _ in 0..6 {
        let inputs = ll_inputs(&mut rng);
        let p = LlParams::new(N, R * L);
        let hk = a.low_latency_dispatch_send(&inputs, &p).unwrap();
        let x = a.low_latency_dispatch_recv(hk).unwrap();
        let y = b.low_latency_dispatch(&inputs, &p).unwrap();
        assert_eq!(x, y);
    }
}

/// The same agents on real threads (`ThreadSim`, the throughput mode): normal and low-latency
/// results equal the plan.
#[test]
fn threads_mode_equals_plan() {
    let mut cfg = BufferConfig::new(R);
    cfg.low_latency_mode = true;
    cfg.num_qps_per_rank = 2;
    cfg.num_rdma_bytes = Buffer::<Sim>::low_latency_size_hint(N, H, R, R * L).div_ceil(128) * 128;
    cfg.num_nvl_bytes = Buffer::<Sim>::normal_size_hint(R, R * N, H, 2, K).div_ceil(128) * 128;
    let ts = ep_rs::sim::ThreadSim::new(fabric(R, 2048, 2, 2), std::time::Duration::from_secs(20));
    let mut buf = Buffer::new(ts, cfg).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(77);
    for _ in 0..3 {
        let g = Gen {
            num_ranks: R,
            max_tokens: N,
            num_experts: R * L,
            num_topk: K,
            hidden: H,
            fp8: false,
            mask: 0.2,
            full: false,
        };
        let inputs = gen_inputs(&g, rng.random(), false);
        let topk: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
        let layouts = buf.get_dispatch_layout(&topk, g.num_experts).unwrap();
        let (args, opts) = two_channel_dispatch();
        let got = buf
            .dispatch(&inputs, &layouts, g.num_experts, &args)
            .unwrap();
        assert_eq!(
            got,
            intranode_dispatch_all(&inputs, &layouts, g.num_experts, &opts).unwrap()
        );
        let inputs = ll_inputs(&mut rng);
        let p = LlParams::new(N, R * L);
        let got = buf.low_latency_dispatch(&inputs, &p).unwrap();
        assert_eq!(got.outputs, dispatch(&inputs, &p).unwrap());
    }
}

/// Threads mode lends its pages to `Buffer::scan_recv_rows` (no copy): records that straddle
/// its 256 KiB pages are joined, and every row read in place equals the plan's `recv_x` (also
/// through `read_recv_x`), on several host threads at once.
#[test]
fn threads_mode_scans_rows_in_place_across_pages() {
    let (r, n, h, k) = (2, 64, 2048, 4);
    let mut cfg = BufferConfig::new(r);
    cfg.num_nvl_bytes = Buffer::<Sim>::normal_size_hint(r, r * n, h, 2, k).div_ceil(128) * 128;
    let ts =
        ep_rs::sim::ThreadSim::new(fabric(r, 1 << 20, 2, 2), std::time::Duration::from_secs(20));
    let mut buf = Buffer::new(ts, cfg).unwrap();
    let g = Gen {
        num_ranks: r,
        max_tokens: n,
        num_experts: 8,
        num_topk: k,
        hidden: h,
        fp8: false,
        mask: 0.0,
        full: true,
    };
    let inputs = gen_inputs(&g, 5, false);
    let topk: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let layouts = buf.get_dispatch_layout(&topk, g.num_experts).unwrap();
    let (args, opts) = two_channel_dispatch();
    let want = intranode_dispatch_all(&inputs, &layouts, g.num_experts, &opts).unwrap();
    let got = buf
        .dispatch_in_place(&inputs, &layouts, g.num_experts, &args)
        .unwrap();
    let drec = 2 * h + 16 + 16 * (12 * k).div_ceil(16);
    assert!(
        got.iter().any(|d| d.num_rows * drec > 256 << 10),
        "rows span pages"
    );
    let scanned: Vec<Vec<u8>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..r)
            .map(|d| {
                let (buf, rows) = (&buf, got[d].num_rows);
                sc.spawn(move || {
                    let mut out = Vec::new();
                    let mut next = 0;
                    buf.scan_recv_rows(d, 0..rows, |j, rec| {
                        assert_eq!(j, next, "rows in order");
                        next += 1;
                        out.extend_from_slice(&rec[..2 * h]);
                    })
                    .unwrap();
                    assert_eq!(next, rows);
                    out
                })
            })
            .collect();
        hs.into_iter().map(|x| x.join().unwrap()).collect()
    });
    for d in 0..r {
        let ep_rs::core::Activations::Bf16(x) = &want[d].recv_x else {
            unreachable!("BF16 inputs")
        };
        let bytes: Vec<u8> = x
            .data()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        assert_eq!(scanned[d], bytes, "rank {d}");
        let mut read =
            ep_rs::core::Activations::Bf16(ep_rs::core::Tensor2::zeros(got[d].num_rows, h));
        buf.read_recv_x(d, 0, &mut read).unwrap();
        assert_eq!(read, want[d].recv_x, "rank {d} (read_recv_x)");
    }
}
