//! Skewed routings run and verify (plan == oracle) in both modes: every token to one expert,
//! one rank receiving nothing, a rank with every slot masked (crafted input directories), and
//! the generated `zipf:S` and `hot:F` routings.

mod io_support;

use std::path::Path;

use ep_cli::io;
use ep_core::workload::WorkloadSpec;
use ep_core::{RankInputs, Tensor2};
use io_support::{layout_ok, npy_shape, s, scratch};

const MODES: [&str; 2] = ["normal", "low-latency"];

fn read_i32(path: &Path) -> Vec<i32> {
    let bytes = std::fs::read(path).unwrap();
    npyz::NpyFile::new(&bytes[..]).unwrap().into_vec().unwrap()
}

/// Replaces every rank's routing with `f(rank, token)`.
fn with_routing(mut w: Vec<RankInputs>, f: impl Fn(usize, usize) -> Vec<i64>) -> Vec<RankInputs> {
    for (r, inp) in w.iter_mut().enumerate() {
        let (t, k) = inp.topk_idx.shape();
        inp.topk_idx = Tensor2::from_fn(t, k, |tok, slot| f(r, tok)[slot]);
    }
    w
}

#[test]
fn every_token_to_one_expert() {
    let base = WorkloadSpec::new(4, 12, 128, 2, 16, 3).generate().unwrap();
    let w = with_routing(base, |_, _| vec![5, -1]);
    let dir = scratch("one-expert");
    let inp = dir.join("in");
    io::write_inputs(&inp, &w).unwrap();
    for mode in MODES {
        let out = dir.join(mode);
        // BF16 low-latency dispatch: hidden 128 is not a multiple of FP8's 512.
        layout_ok(&[
            "--mode",
            mode,
            "--no-fp8",
            "--inputs",
            s(&inp),
            "--experts",
            "16",
            "--dump",
            s(&out),
        ]);
        if mode == "normal" {
            // Expert 5 lives on rank 1 (4 experts per rank): it receives all 48 tokens.
            for r in 0..4 {
                let rows = npy_shape(&out.join(format!("rank{r}/recv_x.npy")))[0];
                assert_eq!(rows, if r == 1 { 48 } else { 0 }, "rank {r}");
            }
            let list = read_i32(&out.join("rank1/num_recv_tokens_per_expert_list.npy"));
            assert_eq!(list, [0, 48, 0, 0]);
        } else {
            let count = read_i32(&out.join("rank1/packed_recv_count.npy"));
            assert_eq!(count, [0, 48, 0, 0]);
            assert_eq!(read_i32(&out.join("rank0/packed_recv_count.npy")), [0; 4]);
        }
    }
}

#[test]
fn one_rank_receives_nothing() {
    // Routed over experts 0..12 only: rank 3 (experts 12..16) gets nothing.
    let w = WorkloadSpec {
        masked_per_rank: 2,
        ..WorkloadSpec::new(4, 16, 128, 4, 12, 8)
    }
    .generate()
    .unwrap();
    let dir = scratch("starved");
    let inp = dir.join("in");
    io::write_inputs(&inp, &w).unwrap();
    for mode in MODES {
        let out = dir.join(mode);
        // BF16 low-latency dispatch: hidden 128 is not a multiple of FP8's 512.
        layout_ok(&[
            "--mode",
            mode,
            "--no-fp8",
            "--inputs",
            s(&inp),
            "--experts",
            "16",
            "--dump",
            s(&out),
        ]);
        if mode == "normal" {
            assert_eq!(npy_shape(&out.join("rank3/recv_x.npy")), [0, 128]);
            assert_eq!(npy_shape(&out.join("rank3/recv_src_idx.npy")), [0]);
            assert!(npy_shape(&out.join("rank2/recv_x.npy"))[0] > 0);
        } else {
            assert_eq!(read_i32(&out.join("rank3/packed_recv_count.npy")), [0; 4]);
        }
    }
}

#[test]
fn a_rank_with_every_slot_masked() {
    let base = WorkloadSpec::new(2, 8, 128, 3, 8, 4).generate().unwrap();
    let w = with_routing(base, |r, t| {
        if r == 0 {
            vec![-1; 3]
        } else {
            vec![(t % 8) as i64, ((t + 1) % 8) as i64, -1]
        }
    });
    let dir = scratch("masked-rank");
    io::write_inputs(&dir, &w).unwrap();
    for mode in MODES {
        layout_ok(&[
            "--mode",
            mode,
            "--no-fp8",
            "--inputs",
            s(&dir),
            "--experts",
            "8",
        ]);
    }
}

#[test]
fn generated_skewed_routings_run_and_verify() {
    for routing in ["zipf:1.2", "hot:0.5", "hot:1", "zipf:3"] {
        for mode in MODES {
            let hidden = if mode == "normal" { "128" } else { "512" };
            let mut args = vec![
                "--mode",
                mode,
                "--routing",
                routing,
                "--ranks",
                "4",
                "--tokens",
                "32",
                "--hidden",
                hidden,
                "--topk",
                "4",
                "--experts",
                "32",
            ];
            if routing == "zipf:1.2" {
                args.push("--fp8");
            }
            let out = layout_ok(&args);
            assert!(out.contains(&format!("routing {routing}")), "{out}");
        }
    }
}
