//! `ep bench` end to end at small sizes: the JSON report's fields, the same digest on both
//! simulator backends and as `ep layout`'s, QP depth changing the prediction but not the outputs,
//! the typed errors and their exit codes. Timings are printed, never asserted.

mod bench_support;

use bench_support::{SMALL, bench_fails, bench_ok, cat, digest, layout_digest, scratch};

#[test]
fn report_has_every_field_in_both_modes() {
    let dir = scratch("fields");
    for (mode, hidden, calls_format) in [("normal", "256", "BF16"), ("low-latency", "512", "FP8")] {
        let json = dir.join(format!("{mode}.json"));
        let args = cat(SMALL, &["--mode", mode, "--hidden", hidden, "--iters", "3"]);
        let r = bench_ok(&args, &json);
        assert_eq!(r["command"], "bench");
        assert_eq!(r["backend"], "sim");
        assert_eq!(r["mode"], mode);
        assert!(r["ep_rs_version"].as_str().is_some_and(|v| !v.is_empty()));
        for key in [
            "ranks", "tokens", "hidden", "topk", "experts", "fp8", "seed", "iters",
        ] {
            assert!(!r["options"][key].is_null(), "options.{key} missing: {r:#}");
        }
        assert_eq!(r["fabric"]["num_ranks"], 4);
        assert!(r["memcpy_gb_per_s"].as_f64().unwrap() > 0.0);
        let calls = r["calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["name"], "dispatch");
        assert_eq!(calls[0]["format"], calls_format);
        assert_eq!(calls[1]["name"], "combine");
        for c in calls {
            assert_eq!(c["samples_us"].as_array().unwrap().len(), 3);
            for key in [
                "median_us",
                "min_us",
                "max_us",
                "predicted_us",
                "payload_gb_per_s",
            ] {
                assert!(c[key].as_f64().unwrap() > 0.0, "{key}: {c:#}");
            }
            assert!(c["payload_bytes"].as_u64().unwrap() > 0);
            assert_eq!(c["deepep"]["bytes_per_rank"].as_array().unwrap().len(), 4);
            assert!(!c["predicted_phases"].as_array().unwrap().is_empty());
            assert!(c["payload_memcpy_ratio"].as_f64().is_some());
        }
        assert!(r["payload"]["memcpy_ratio"].as_f64().is_some());
        let total = digest(&r);
        assert_eq!(total.len(), 64);
        assert_eq!(r["digest"]["ranks"].as_array().unwrap().len(), 4);
        assert_eq!(r["digest"]["format_version"], 2);
        assert_eq!(r["verification"]["iterations"], 4, "one warm-up + 3");
        assert_eq!(r["verification"]["mismatches"], 0);
    }
}

#[test]
fn sim_and_sim_checked_and_layout_agree_on_the_digest() {
    let dir = scratch("backends");
    let cases: [&[&str]; 3] = [
        &["--mode", "normal", "--hidden", "256"],
        &[
            "--mode",
            "normal",
            "--hidden",
            "256",
            "--fp8",
            "--routing",
            "zipf:1.5",
        ],
        &["--mode", "low-latency", "--hidden", "512"],
    ];
    for (i, case) in cases.iter().enumerate() {
        let args = cat(SMALL, case);
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
        assert_eq!(b["backend"], "sim-checked");
        assert_eq!(digest(&a), digest(&b), "{case:?}");
        assert_eq!(a["digest"]["ranks"], b["digest"]["ranks"]);
        // ep layout's plan gives the same digest for the same flags (one FP8 default).
        assert_eq!(layout_digest(&args), digest(&a), "{case:?}");
    }
}

/// `--logfmt` (LogFMT-10 combine partials, `LlCombineOptions::use_logfmt`) on both simulator
/// backends: verified against the plan's LogFMT reduction, the same digest on both, the combine's
/// format and DeepEP's LogFMT byte count `s * (10H/8 + H/128*4)` against its BF16 `s * 2H`.
#[test]
fn logfmt_runs_on_both_simulators_with_one_digest() {
    let dir = scratch("logfmt");
    let args = cat(SMALL, &["--mode", "low-latency", "--hidden", "1024"]);
    let lf = cat(&args, &["--logfmt"]);
    let a = bench_ok(&cat(&lf, &["--iters", "1"]), &dir.join("sim.json"));
    let b = bench_ok(
        &cat(
            &lf,
            &["--backend", "sim-checked", "--iters", "1", "--warmup", "0"],
        ),
        &dir.join("checked.json"),
    );
    assert_eq!(digest(&a), digest(&b));
    assert_eq!(a["digest"]["ranks"], b["digest"]["ranks"]);
    assert_eq!(a["options"]["logfmt"], true);
    let plain = bench_ok(&cat(&args, &["--iters", "1"]), &dir.join("bf16.json"));
    assert_eq!(plain["options"]["logfmt"], false);
    let (c, p) = (&a["calls"][1], &plain["calls"][1]);
    assert_eq!(c["name"], "combine");
    assert_eq!(c["format"], "LogFMT-10");
    assert_eq!(p["format"], "BF16");
    let per_rank = |c: &serde_json::Value| -> Vec<f64> {
        c["deepep"]["bytes_per_rank"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    for (x, y) in per_rank(c).iter().zip(per_rank(p)) {
        assert!(y > 0.0);
        assert_eq!(*x * 2048.0, y * (1280.0 + 32.0), "{x} vs {y}");
    }
    // Dispatch is the same call either way.
    assert_eq!(
        a["calls"][0]["recorded_bytes"],
        plain["calls"][0]["recorded_bytes"]
    );
}

#[test]
fn smaller_qp_depth_same_outputs_never_faster_prediction() {
    let dir = scratch("qp");
    let base = cat(
        SMALL,
        &[
            "--mode",
            "low-latency",
            "--hidden",
            "512",
            "--ranks-per-node",
            "1",
            "--iters",
            "1",
        ],
    );
    let deep = bench_ok(&cat(&base, &["--qp-depth", "64"]), &dir.join("64.json"));
    let shallow = bench_ok(&cat(&base, &["--qp-depth", "1"]), &dir.join("1.json"));
    assert_eq!(digest(&deep), digest(&shallow));
    assert_eq!(shallow["fabric"]["qp_depth"], 1);
    for i in 0..2 {
        let (a, b) = (
            shallow["calls"][i]["predicted_us"].as_f64().unwrap(),
            deep["calls"][i]["predicted_us"].as_f64().unwrap(),
        );
        assert!(
            a >= b,
            "call {i}: depth 1 predicts {a} us < depth 64 {b} us"
        );
    }
}

#[test]
fn typed_errors_and_exit_codes() {
    // The GPU backend on a machine without a GPU (CI, the development VM): a typed error
    // naming the missing driver, exit 3 (not the mismatch code 1).
    let e = bench_fails(&cat(SMALL, &["--backend", "gpu"]), 3);
    assert!(e.contains("GPU: opening GPU 0"), "{e}");
    assert!(e.contains("libcuda.so.1") || e.contains("CUDA"), "{e}");
    // One rank per process: what cannot run that way is refused before any process starts
    // (SMALL has 4 ranks).
    let e = bench_fails(&cat(SMALL, &["--backend", "gpu", "--procs", "3"]), 2);
    assert!(e.contains("--ranks 3"), "{e}");
    let e = bench_fails(
        &cat(
            SMALL,
            &["--backend", "gpu", "--procs", "4", "--sms-sweep", "8,16"],
        ),
        2,
    );
    assert!(e.contains("one SM count"), "{e}");
    // Low-latency mode one rank per process: --procs must be the rank count.
    let e = bench_fails(
        &cat(
            SMALL,
            &["--backend", "gpu", "--mode", "low-latency", "--procs", "3"],
        ),
        2,
    );
    assert!(e.contains("--ranks 3"), "{e}");
    // CUDA graphs are a GPU low-latency option.
    for extra in [
        &["--graph"][..],
        &["--backend", "gpu", "--mode", "normal", "--graph"][..],
        &["--mode", "low-latency", "--graph"][..],
    ] {
        let e = bench_fails(&cat(SMALL, extra), 2);
        assert!(e.contains("--graph"), "{extra:?}: {e}");
    }
    // So is the kernel variant.
    for extra in [
        &["--variant", "nvshmem"][..],
        &[
            "--backend",
            "gpu",
            "--mode",
            "normal",
            "--variant",
            "nvshmem",
        ][..],
        &["--mode", "low-latency", "--variant", "nvshmem"][..],
    ] {
        let e = bench_fails(&cat(SMALL, extra), 2);
        assert!(e.contains("--variant"), "{extra:?}: {e}");
    }
    // LogFMT is a low-latency option (on every backend).
    for extra in [
        &["--logfmt"][..],
        &["--backend", "gpu", "--mode", "normal", "--logfmt"][..],
    ] {
        let e = bench_fails(&cat(SMALL, extra), 2);
        assert!(e.contains("--logfmt"), "{extra:?}: {e}");
    }
    // Usage errors: exit 2.
    let e = bench_fails(
        &cat(SMALL, &["--hidden", "256", "--ranks-per-node", "3"]),
        2,
    );
    assert!(e.contains("--ranks-per-node 3"), "{e}");
    let e = bench_fails(
        &cat(SMALL, &["--hidden", "256", "--ranks-per-node", "2"]),
        2,
    );
    assert!(
        e.contains("normal mode needs every rank on one NVLink domain"),
        "{e}"
    );
    let e = bench_fails(&cat(SMALL, &["--hidden", "256", "--iters", "0"]), 2);
    assert!(e.contains("--iters 0"), "{e}");
    let e = bench_fails(&["--inputs", "/nonexistent-ep-inputs"], 2);
    assert!(e.contains("--experts is required"), "{e}");
    // clap's own usage errors are exit 2 as well.
    bench_fails(&["--routing", "zipf"], 2);
    // A workload ep-core refuses is a usage error too (exit 2), with the reason.
    let e = bench_fails(
        &[
            "--ranks",
            "4",
            "--experts",
            "18",
            "--tokens",
            "8",
            "--hidden",
            "128",
        ],
        2,
    );
    assert!(
        e.contains("--experts 18 is not a multiple of --ranks 4"),
        "{e}"
    );
}
