//! `ep bench` with real routings: generate → `--dump-inputs` → `--inputs` gives identical
//! outputs and digest (both modes, BF16 and FP8), malformed inputs give typed errors (exit 3),
//! and skewed routings (every token to one expert, a rank receiving nothing) run and verify.

mod bench_support;

use std::path::Path;

use bench_support::{SMALL, bench_fails, bench_ok, cat, digest, s, scratch};
use ep_cli::io;
use ep_core::{Activations, RankInputs, Tensor2};
use half::bf16;

fn same_files(a: &Path, b: &Path) {
    let list = |d: &Path| {
        let mut v: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.is_dir())
            .flat_map(|r| std::fs::read_dir(r).unwrap().map(|e| e.unwrap().path()))
            .collect();
        v.sort();
        v
    };
    let (fa, fb) = (list(a), list(b));
    assert_eq!(fa.len(), fb.len());
    assert!(!fa.is_empty());
    for (x, y) in fa.iter().zip(&fb) {
        assert_eq!(x.file_name(), y.file_name());
        assert!(
            std::fs::read(x).unwrap() == std::fs::read(y).unwrap(),
            "{x:?} differs"
        );
    }
}

#[test]
fn replaying_dumped_inputs_gives_identical_outputs_and_digest() {
    let dir = scratch("replay");
    let cases: [(&str, &[&str]); 4] = [
        ("normal-bf16", &["--mode", "normal", "--hidden", "256"]),
        (
            "normal-fp8",
            &["--mode", "normal", "--hidden", "256", "--fp8"],
        ),
        ("ll-fp8", &["--mode", "low-latency", "--hidden", "512"]),
        (
            "ll-bf16",
            &["--mode", "low-latency", "--hidden", "256", "--no-fp8"],
        ),
    ];
    for (name, case) in cases {
        let inputs = dir.join(format!("{name}-inputs"));
        let (out_a, out_b) = (dir.join(format!("{name}-a")), dir.join(format!("{name}-b")));
        let gen_args = cat(
            &cat(SMALL, case),
            &[
                "--iters",
                "1",
                "--dump-inputs",
                s(&inputs),
                "--dump",
                s(&out_a),
            ],
        );
        let a = bench_ok(&gen_args, &dir.join(format!("{name}-a.json")));
        // Replay: shapes from the files, --experts given; FP8 normal inputs come back as
        // x_fp8.npy, so --fp8 is not repeated.
        let mode = case[1];
        let mut replay = vec![
            "--mode",
            mode,
            "--inputs",
            s(&inputs),
            "--experts",
            "16",
            "--iters",
            "1",
            "--dump",
            s(&out_b),
        ];
        if case.contains(&"--no-fp8") {
            replay.push("--no-fp8");
        }
        let b = bench_ok(&replay, &dir.join(format!("{name}-b.json")));
        assert_eq!(digest(&a), digest(&b), "{name}");
        same_files(&out_a, &out_b);
        let (ma, mb) = (
            io::read_manifest(&out_a).unwrap(),
            io::read_manifest(&out_b).unwrap(),
        );
        assert_eq!(ma.digest, digest(&a));
        assert_eq!(ma.digest, mb.digest);
        assert_eq!(ma.run.backend, "sim");
        assert_eq!(mb.run.inputs.as_deref(), Some(s(&inputs)));
    }
}

#[test]
fn malformed_inputs_are_typed_errors() {
    let dir = scratch("malformed");
    let good = dir.join("good");
    bench_ok(
        &cat(
            SMALL,
            &["--hidden", "128", "--iters", "1", "--dump-inputs", s(&good)],
        ),
        &dir.join("good.json"),
    );
    // A missing file names the file.
    let missing = dir.join("missing");
    copy_dir(&good, &missing);
    std::fs::remove_file(missing.join("rank2/topk_weights.npy")).unwrap();
    let e = bench_fails(&["--inputs", s(&missing), "--experts", "16"], 3);
    assert!(
        e.contains("rank2/topk_weights.npy") && e.contains("missing"),
        "{e}"
    );
    // A gap in the rank directories.
    let gap = dir.join("gap");
    copy_dir(&good, &gap);
    std::fs::remove_dir_all(gap.join("rank1")).unwrap();
    let e = bench_fails(&["--inputs", s(&gap), "--experts", "16"], 3);
    assert!(e.contains("rank1"), "{e}");
    // Options that disagree with the files name the file and both shapes.
    let e = bench_fails(
        &["--inputs", s(&good), "--experts", "16", "--tokens", "5"],
        3,
    );
    assert!(
        e.contains("topk_idx.npy") && e.contains("--tokens 5"),
        "{e}"
    );
    let e = bench_fails(
        &["--inputs", s(&good), "--experts", "16", "--hidden", "256"],
        3,
    );
    assert!(e.contains("x.npy") && e.contains("[16, 128]"), "{e}");
    // Expert ids outside [-1, E).
    let e = bench_fails(&["--inputs", s(&good), "--experts", "8"], 3);
    assert!(e.contains("topk_idx.npy"), "{e}");
    // A truncated file.
    let bad = dir.join("truncated");
    copy_dir(&good, &bad);
    let f = bad.join("rank0/x.npy");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let e = bench_fails(&["--inputs", s(&bad), "--experts", "16"], 3);
    assert!(e.contains("rank0/x.npy"), "{e}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dst = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &dst);
        } else {
            std::fs::copy(&p, &dst).unwrap();
        }
    }
}

/// Inputs of `r` ranks, `t` tokens, hidden `h`, top-`k`, where `pick(rank, token, slot)` is the
/// expert id (or -1); random-looking activations and weights.
fn crafted(
    r: usize,
    t: usize,
    h: usize,
    k: usize,
    pick: impl Fn(usize, usize, usize) -> i64,
) -> Vec<RankInputs> {
    (0..r)
        .map(|rank| RankInputs {
            x: Activations::Bf16(Tensor2::from_fn(t, h, |i, c| {
                bf16::from_f32(((rank * 131 + i * 17 + c * 7) % 97) as f32 / 13.0 - 3.5)
            })),
            topk_idx: Tensor2::from_fn(t, k, |i, j| pick(rank, i, j)),
            topk_weights: Tensor2::from_fn(t, k, |i, j| 0.25 + ((i + j + rank) % 5) as f32 * 0.125),
        })
        .collect()
}

#[test]
fn skewed_routings_run_and_verify() {
    let dir = scratch("skew");
    // Every token to expert 5 only (rank 1 of 4 receives everything, the others nothing).
    let one = dir.join("one-expert");
    io::write_inputs(
        &one,
        &crafted(4, 16, 512, 4, |_, _, j| if j == 0 { 5 } else { -1 }),
    )
    .unwrap();
    // Experts of ranks 0..2 only: rank 3 receives nothing.
    let starved = dir.join("starved");
    io::write_inputs(
        &starved,
        &crafted(4, 16, 512, 3, |r, t, j| ((r + t + 4 * j) % 12) as i64),
    )
    .unwrap();
    for (name, inputs) in [("one", &one), ("starved", &starved)] {
        for mode in ["normal", "low-latency"] {
            let r = bench_ok(
                &[
                    "--mode",
                    mode,
                    "--inputs",
                    s(inputs),
                    "--experts",
                    "16",
                    "--iters",
                    "1",
                ],
                &dir.join(format!("{name}-{mode}.json")),
            );
            let rows = &r["calls"][0]["deepep"]["bytes_per_rank"];
            assert_eq!(rows.as_array().unwrap().len(), 4, "{name} {mode}");
        }
    }
    // Generated skew: zipf and hot routings.
    for routing in ["zipf:2", "hot:0.9"] {
        bench_ok(
            &cat(
                SMALL,
                &["--hidden", "128", "--routing", routing, "--iters", "1"],
            ),
            &dir.join(format!("{routing}.json").replace(':', "_")),
        );
    }
}
