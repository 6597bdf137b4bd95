//! Runs that cannot succeed are refused before any work, typed, with the exit code the README
//! promises: usage errors (2) name the option; shapes whose memory cannot exist (3) are refused
//! from the estimate alone, without allocating; output paths are checked first.

mod bench_support;

use std::time::{Duration, Instant};

use bench_support::{SMALL, bench_fails, cat, ep, scratch};
use ep_cli::preflight::{Command, Machine, Need, PreflightError, Shape};
use ep_cli::workload::{Defaults, Mode};

/// Runs `ep <args>`, asserts the exit code, returns stderr.
fn fails(args: &[&str], code: i32) -> String {
    let out = ep(args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(code),
        "ep {args:?}\nstdout:\n{}\nstderr:\n{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

/// `ep bench`'s options as parsed from `args`.
fn parse(args: &[&str]) -> ep_cli::bench::BenchArgs {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        bench: ep_cli::bench::BenchArgs,
    }
    let all = std::iter::once("bench").chain(args.iter().copied());
    <Cli as clap::Parser>::parse_from(all).bench
}

/// [`SMALL`] with hidden 512, the options of `extra` replacing its own.
fn small_with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v: Vec<&str> = Vec::new();
    for pair in cat(SMALL, &["--hidden", "512"]).chunks(2) {
        if !extra.contains(&pair[0]) {
            v.extend_from_slice(pair);
        }
    }
    v.extend_from_slice(extra);
    v
}

#[test]
fn usage_errors_exit_2_and_name_the_option() {
    let cases: &[(&[&str], &str)] = &[
        (&["--ranks", "0"], "--ranks 0: must be at least 1"),
        (&["--hidden", "0"], "--hidden 0: must be at least 1"),
        (&["--experts", "0"], "--experts 0: must be at least 1"),
        (&["--topk", "0"], "--topk 0: must be at least 1"),
        (
            &["--topk", "20", "--experts", "16"],
            "--topk 20 exceeds --experts 16",
        ),
        (
            &["--experts", "18"],
            "--experts 18 is not a multiple of --ranks 4",
        ),
        (
            &["--mode", "low-latency", "--hidden", "100"],
            "not a multiple of 128",
        ),
        (&["--num-sms", "300"], "--num-sms 300"),
        (&["--num-sms", "3"], "--num-sms 3"),
        (&["--granularity", "1"], "--granularity 1"),
        (&["--granularity", "3145728"], "--granularity 3145728"),
        (
            &["--experts", "8192"],
            "2048 local experts exceed the protocol's limit of 1024",
        ),
        (
            &["--ranks", "12", "--experts", "24"],
            "12 ranks are not supported",
        ),
        (
            &["--mode", "low-latency", "--tokens", "2000"],
            "--tokens 2000",
        ),
        (&["--mode", "low-latency", "--topk", "12"], "--topk 12"),
    ];
    for (extra, want) in cases {
        let args = small_with(extra);
        let e = bench_fails(&args, 2);
        assert!(e.contains(want), "{extra:?}: {e}");
        assert!(!e.contains(" { "), "a raw Debug dump in {e}");
        // ep layout takes the same workload options and refuses them the same way.
        if !extra.contains(&"--granularity") {
            let mut l = vec!["layout"];
            l.extend(&args);
            let e = fails(&l, 2);
            assert!(e.contains(want), "layout {extra:?}: {e}");
        }
    }
}

#[test]
fn a_huge_shape_is_refused_from_the_estimate_without_allocating() {
    // 10^9 tokens of 7168 BF16 channels per rank: terabytes. The refusal comes at once (no
    // allocation was tried: that would abort with the allocator's message, not exit 3).
    for extra in [
        &["--tokens", "1000000000"][..],
        &["--hidden", "1000000000", "--tokens", "4"],
        &[
            "--mode",
            "low-latency",
            "--ranks",
            "1000000",
            "--tokens",
            "4",
            "--experts",
            "1000000",
            "--hidden",
            "512",
        ],
    ] {
        let t = Instant::now();
        let e = bench_fails(extra, 3);
        assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
        assert!(e.contains("this run needs about"), "{e}");
        assert!(e.contains("available") || e.contains("ulimit -v"), "{e}");
        assert!(e.contains("fits") || e.contains("fewer ranks"), "{e}");
    }
    let mut l = vec!["layout", "--tokens", "1000000000"];
    l.extend(["--hidden", "7168"]);
    let e = fails(&l, 3);
    assert!(e.contains("this run needs about"), "{e}");
}

#[test]
fn the_estimate_names_a_smaller_shape_that_fits() {
    let args = parse(&["--tokens", "4096"]);
    let defaults = Defaults {
        hidden: 7168,
        low_latency_fp8: true,
    };
    let shape = Shape::of_args(&args.workload, &defaults).unwrap();
    assert_eq!(shape.mode, Mode::Normal);
    let need = Need::estimate(&shape, Command::Bench, false);
    // The default shape: inputs 0.47 GB, ~2.5 GB of received rows, 0.47 GB combined.
    let total = need.memory_total();
    assert!((3 << 30..6 << 30).contains(&total), "{need:?}");
    // A machine with 1 GiB is refused, with a --tokens that fits it.
    let small = Machine {
        memory: Some((1 << 30, "1 GiB (test)".into())),
        address_space: None,
    };
    let e = small.check(&shape, Command::Bench, None).unwrap_err();
    let PreflightError::TooLarge { fits, .. } = &e else {
        panic!("{e}")
    };
    let tokens: usize = fits
        .strip_prefix("--tokens ")
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{e}"));
    assert!((1..4096).contains(&tokens), "{e}");
    let mut smaller = args.workload.clone();
    smaller.tokens = Some(tokens);
    let shape = Shape::of_args(&smaller, &defaults).unwrap();
    small.check(&shape, Command::Bench, None).unwrap();
    // An address-space limit is checked as well.
    let limited = Machine {
        memory: None,
        address_space: Some(1 << 30),
    };
    assert!(
        limited
            .check(
                &Shape::of_args(&args.workload, &defaults).unwrap(),
                Command::Bench,
                None
            )
            .is_err()
    );
}

#[test]
fn the_low_latency_estimate_reserves_the_packed_arrays_as_allocated() {
    // The default low-latency run: [L, R·N, H] arrays of 252 MiB (FP8) and 504 MiB (BF16 expert
    // outputs) per rank, one exact mapping each, of which the bench holds two FP8 sets (the
    // oracle's of both signs) and one BF16 set at its peak: ~9.3 GiB of address space as
    // measured, glibc's per-thread malloc arenas (~1 GiB here) included, which the estimate
    // leaves to preflight's 15 % headroom. Not three FP8 and two BF16 sets (~17 GiB), let alone
    // per-expert rounding (~55 GiB).
    let args = parse(&["--mode", "low-latency"]);
    let defaults = Defaults {
        hidden: 7168,
        low_latency_fp8: true,
    };
    let shape = Shape::of_args(&args.workload, &defaults).unwrap();
    let need = Need::estimate(&shape, Command::Bench, false);
    let space = need.memory_total() + need.reserved;
    assert!(
        ((8 << 30) + (1 << 29)..10 << 30).contains(&space),
        "{need:?}"
    );
}

#[test]
fn output_paths_are_checked_before_the_run() {
    let dir = scratch("outputs");
    let file = dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let t = Instant::now();
    let e = bench_fails(&cat(SMALL, &["--json", "/nonexistent-ep/r.json"]), 3);
    assert!(e.contains("--json /nonexistent-ep/r.json"), "{e}");
    let bad = file.join("r.json");
    let e = bench_fails(&cat(SMALL, &["--json", bad.to_str().unwrap()]), 3);
    assert!(e.contains("--json"), "{e}");
    let e = bench_fails(&cat(SMALL, &["--dump", file.to_str().unwrap()]), 3);
    assert!(e.contains("not a directory"), "{e}");
    let e = bench_fails(&cat(SMALL, &["--dump-inputs", file.to_str().unwrap()]), 3);
    assert!(e.contains("--dump-inputs"), "{e}");
    // Checked first: no workload was generated, no memcpy calibrated.
    assert!(t.elapsed() < Duration::from_secs(20));
}

#[test]
fn under_ulimit_v_the_run_is_refused_from_the_estimate_not_aborted() {
    // A real RLIMIT_AS: the default low-latency run maps far more than 4 GiB of zero pages.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 4000000 && exec {} bench --quiet --mode low-latency",
            env!("CARGO_BIN_EXE_ep")
        ))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("of address space"), "{stderr}");
    assert!(stderr.contains("ulimit -v"), "{stderr}");
}

#[test]
fn a_low_latency_run_reserves_the_address_space_it_uses() {
    // A real RLIMIT_AS just above what the run uses (~0.6 GB resident, ~1.4 GB of address space
    // at its peak): one allocation of exactly [L, R·N, H] per rank and packed array
    // (plan::low_latency::packed_zeros_*), two sets of dispatch outputs and one of expert
    // outputs alive at once. Refused by the estimate under this limit when the bench held three
    // and two; per-expert arrays of 1-2 MiB here, which rounding each up to a 32 MiB mapping of
    // its own made ~22 GB.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v 1572864 && exec {} bench --quiet --mode low-latency --ranks 4 --tokens 128 \
             --hidden 2048 --experts 128 --topk 8 --warmup 1 --iters 2",
            env!("CARGO_BIN_EXE_ep")
        ))
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("verified:"), "{stdout}");
}
