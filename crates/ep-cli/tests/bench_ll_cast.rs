//! `--round-scale` and `--ue8m0` (low-latency FP8, DeepEP's `round_scale` / `use_ue8m0`): each
//! is applied on every simulator backend (it changes the digest, and the dump holds rounded or
//! UE8M0 scales), `ep layout` gives `ep bench`'s digest, `--dump-inputs` + `--inputs` with the
//! same flags reproduces it, the options are recorded in `--json` and `--dump` manifests, and
//! every combination that cannot apply exits 2 naming the fix.

mod bench_support;

use std::path::Path;

use bench_support::{SMALL, bench_fails, bench_ok, cat, digest, ep, layout_digest, s, scratch};
use ep_cli::io;

/// Low-latency FP8 at a hidden size FP8 accepts.
const LL: &[&str] = &["--mode", "low-latency", "--hidden", "512"];

/// Plain FP8, rounded scales, rounded scales stored as UE8M0.
const CASTS: [&[&str]; 3] = [&[], &["--round-scale"], &["--round-scale", "--ue8m0"]];

/// `(round_scale, use_ue8m0)` a cast's flags select.
fn flags(cast: &[&str]) -> (bool, bool) {
    (cast.contains(&"--round-scale"), cast.contains(&"--ue8m0"))
}

fn f32s(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    npyz::NpyFile::new(&bytes[..])
        .unwrap()
        .into_vec::<f32>()
        .unwrap()
}

/// Every received scale of a low-latency dump (all ranks' `packed_recv_x_scales.npy`, the
/// logical float32 scales in every FP8 format), and whether any rank wrote the UE8M0 packing.
fn dumped_scales(dir: &Path) -> (Vec<f32>, bool) {
    let m = io::read_manifest(dir).unwrap();
    let (mut scales, mut ue8m0) = (Vec::new(), false);
    for r in &m.ranks {
        let rd = io::rank_dir(dir, r.rank);
        if r.files.iter().any(|f| f == "packed_recv_x_scales.npy") {
            scales.extend(f32s(&rd.join("packed_recv_x_scales.npy")));
        }
        ue8m0 |= r
            .files
            .iter()
            .any(|f| f == "packed_recv_x_scales_ue8m0.npy");
    }
    (scales, ue8m0)
}

fn is_power_of_two(v: f32) -> bool {
    v > 0.0 && v.is_finite() && v.to_bits() & 0x007f_ffff == 0
}

#[test]
fn each_flag_changes_the_digest_on_every_backend_and_layout_agrees() {
    let dir = scratch("cast-digest");
    let mut seen: Vec<String> = Vec::new();
    for (i, cast) in CASTS.iter().enumerate() {
        let args = cat(&cat(SMALL, LL), cast);
        let a = bench_ok(
            &cat(&args, &["--iters", "1"]),
            &dir.join(format!("{i}-sim.json")),
        );
        let b = bench_ok(
            &cat(
                &args,
                &["--backend", "sim-checked", "--iters", "1", "--warmup", "0"],
            ),
            &dir.join(format!("{i}-checked.json")),
        );
        assert_eq!(digest(&a), digest(&b), "{cast:?}: sim vs sim-checked");
        assert_eq!(
            layout_digest(&args),
            digest(&a),
            "{cast:?}: layout vs bench"
        );
        let (round, ue8m0) = flags(cast);
        for r in [&a, &b] {
            assert_eq!(r["options"]["fp8"], true, "{r:#}");
            assert_eq!(r["options"]["round_scale"], round, "{cast:?}");
            assert_eq!(r["options"]["use_ue8m0"], ue8m0, "{cast:?}");
        }
        assert!(
            !seen.contains(&digest(&a)),
            "{cast:?} gives the digest of an earlier cast: the flag was not applied"
        );
        seen.push(digest(&a));
    }
    // Normal mode records both as false.
    let n = bench_ok(
        &cat(
            SMALL,
            &["--mode", "normal", "--hidden", "256", "--iters", "1"],
        ),
        &dir.join("normal.json"),
    );
    assert_eq!(n["options"]["round_scale"], false);
    assert_eq!(n["options"]["use_ue8m0"], false);
}

#[test]
fn dump_and_replay_with_the_flags_reproduce_the_digest() {
    let dir = scratch("cast-replay");
    for (i, cast) in CASTS.iter().enumerate() {
        let (round, ue8m0) = flags(cast);
        let inputs = dir.join(format!("{i}-inputs"));
        let (out_a, out_b, out_l) = (
            dir.join(format!("{i}-a")),
            dir.join(format!("{i}-b")),
            dir.join(format!("{i}-layout")),
        );
        let a = bench_ok(
            &cat(
                &cat(&cat(SMALL, LL), cast),
                &[
                    "--iters",
                    "1",
                    "--dump-inputs",
                    s(&inputs),
                    "--dump",
                    s(&out_a),
                ],
            ),
            &dir.join(format!("{i}-a.json")),
        );
        // Replay: shapes from the files, the cast from the same flags.
        let replay = cat(
            &[
                "--mode",
                "low-latency",
                "--inputs",
                s(&inputs),
                "--experts",
                "16",
            ],
            cast,
        );
        let b = bench_ok(
            &cat(&replay, &["--iters", "1", "--dump", s(&out_b)]),
            &dir.join(format!("{i}-b.json")),
        );
        assert_eq!(digest(&a), digest(&b), "{cast:?}: replay");
        assert_eq!(
            layout_digest(&cat(&replay, &["--dump", s(&out_l)])),
            digest(&a),
            "{cast:?}: ep layout --inputs"
        );
        for out in [&out_a, &out_b, &out_l] {
            let m = io::read_manifest(out).unwrap();
            assert_eq!(m.digest, digest(&a), "{}", out.display());
            assert_eq!(m.run.options["round_scale"], round, "{}", out.display());
            assert_eq!(m.run.options["use_ue8m0"], ue8m0, "{}", out.display());
        }
        // What was dumped is what the flags ask for: rounded scales are powers of two (plain
        // FP8's, amax / 448, almost never are), UE8M0 adds the packed bytes.
        let (scales, packed) = dumped_scales(&out_a);
        let valid: Vec<f32> = scales.into_iter().filter(|&v| v != 0.0).collect();
        assert!(valid.len() > 100, "{cast:?}: {} scales", valid.len());
        let pow2 = valid.iter().filter(|&&v| is_power_of_two(v)).count();
        if round {
            assert_eq!(pow2, valid.len(), "{cast:?}: a scale is not a power of two");
        } else {
            assert!(
                pow2 < valid.len() / 10,
                "{cast:?}: {pow2} of {}",
                valid.len()
            );
        }
        assert_eq!(packed, ue8m0, "{cast:?}: packed_recv_x_scales_ue8m0.npy");
    }
}

#[test]
fn combinations_that_cannot_apply_exit_2_with_the_fix() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--mode", "low-latency", "--hidden", "512", "--ue8m0"],
            "--ue8m0 requires --round-scale",
        ),
        (
            &[
                "--mode",
                "low-latency",
                "--hidden",
                "512",
                "--no-fp8",
                "--round-scale",
            ],
            "drop --no-fp8 or drop --round-scale",
        ),
        (
            &[
                "--mode",
                "low-latency",
                "--hidden",
                "512",
                "--no-fp8",
                "--ue8m0",
            ],
            "drop --no-fp8 or drop --ue8m0",
        ),
        (
            &["--mode", "normal", "--hidden", "256", "--round-scale"],
            "add --mode low-latency or drop --round-scale",
        ),
        (
            &[
                "--mode",
                "normal",
                "--hidden",
                "256",
                "--fp8",
                "--round-scale",
                "--ue8m0",
            ],
            "add --mode low-latency or drop --round-scale",
        ),
        (
            &[
                "--mode",
                "low-latency",
                "--hidden",
                "256",
                "--round-scale",
                "--ue8m0",
            ],
            "--hidden 256 is not a multiple of 512",
        ),
        (
            &["--mode", "low-latency", "--hidden", "640", "--round-scale"],
            "use --hidden 1024",
        ),
    ];
    for (extra, want) in cases {
        let args = cat(SMALL, extra);
        let e = bench_fails(&args, 2);
        assert!(e.contains(want), "{extra:?}: {e}");
        assert!(!e.contains(" { "), "a raw Debug dump in {e}");
        let e = bench_fails(&cat(&args, &["--backend", "sim-checked"]), 2);
        assert!(e.contains(want), "sim-checked {extra:?}: {e}");
        let out = ep(&cat(&["layout"], &args));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "layout {extra:?}: {stderr}");
        assert!(stderr.contains(want), "layout {extra:?}: {stderr}");
    }
    // The GPU backend refuses them before it opens a GPU (so on any machine).
    let e = bench_fails(
        &cat(
            SMALL,
            &[
                "--backend",
                "gpu",
                "--mode",
                "low-latency",
                "--hidden",
                "512",
                "--ue8m0",
            ],
        ),
        2,
    );
    assert!(e.contains("add --round-scale"), "{e}");
}

#[test]
fn inputs_whose_hidden_size_ue8m0_cannot_take_exit_2() {
    let dir = scratch("cast-inputs");
    let inputs = dir.join("inputs");
    bench_ok(
        &cat(
            SMALL,
            &[
                "--mode",
                "low-latency",
                "--hidden",
                "256",
                "--no-fp8",
                "--iters",
                "1",
                "--dump-inputs",
                s(&inputs),
            ],
        ),
        &dir.join("bf16.json"),
    );
    let replay = [
        "--mode",
        "low-latency",
        "--inputs",
        s(&inputs),
        "--experts",
        "16",
        "--round-scale",
        "--ue8m0",
    ];
    let e = bench_fails(&replay, 2);
    assert!(e.contains("use --hidden 512"), "{e}");
    let out = ep(&cat(&["layout"], &replay));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("use --hidden 512"), "{stderr}");
}
