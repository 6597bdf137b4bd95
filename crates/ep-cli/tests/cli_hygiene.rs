//! The interface as the README promises it: `ep doctor` refuses impossible options (exit 2),
//! `ep bench` prints a line per step without a terminal and labels what it prints, and
//! SIGINT/SIGTERM stop a run cleanly, never leaving a dump that looks complete but is not.

mod bench_support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bench_support::{SMALL, cat, ep, scratch};

#[test]
fn doctor_refuses_impossible_options() {
    for (args, want) in [
        (
            &["--sysroot", "/nonexistent-ep-sysroot"][..],
            "does not exist",
        ),
        (
            &["--nvshmem", "/nonexistent-ep/libnvshmem_host.so.3"],
            "does not exist",
        ),
        (&["--probe-ranks", "0"], "must be at least 1"),
        (&["--plan", "--ranks", "0"], "must be at least 1"),
    ] {
        let mut all = vec!["doctor"];
        all.extend_from_slice(args);
        let out = ep(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{all:?}: {stderr}");
        assert!(
            stderr.contains(want) && stderr.contains(args[args.len() - 2]),
            "{stderr}"
        );
        assert!(out.stdout.is_empty(), "no report for {all:?}");
    }
    // Plan errors name the configuration in words, not as a Debug dump.
    let out = ep(&["doctor", "--plan", "--ranks", "12"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("BufferConfig {"), "{stderr}");
    assert!(stderr.contains("12 rank(s)"), "{stderr}");
}

#[test]
fn without_a_terminal_each_step_is_a_line_and_the_figures_are_labelled() {
    // stderr is a pipe here: plain progress lines, with the elapsed time.
    let out = ep(&cat(&["bench", "--hidden", "256", "--iters", "2"], SMALL));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for step in ["memcpy calibration", "workload", "warm-up 1", "iteration 2"] {
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with('[') && l.ends_with(step)),
            "no line for {step}: {stderr}"
        );
    }
    // --quiet and --progress none print no progress at all.
    for flag in ["--quiet", "--progress=none"] {
        let out = ep(&cat(
            &["bench", flag, "--hidden", "256", "--iters", "1"],
            SMALL,
        ));
        assert!(out.status.success());
        assert!(
            out.stderr.is_empty(),
            "{flag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The simulator's host rate and the GPU prediction are told apart; "not checked" no longer
    // sits above "verified".
    let line = stdout
        .lines()
        .find(|l| l.starts_with("[normal] dispatch"))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("simulated on this CPU"), "{line}");
    assert!(line.contains("GPU prediction (cost model)"), "{line}");
    assert!(!stdout.contains("not checked"), "{stdout}");
    assert!(stdout.contains("every output is verified"), "{stdout}");
}

#[test]
fn sigint_and_sigterm_stop_cleanly_and_a_dump_is_whole_or_absent() {
    for signal in ["INT", "TERM"] {
        let dir = scratch(&format!("signal-{signal}"));
        let dump = dir.join("dump");
        let mut child = Command::new(env!("CARGO_BIN_EXE_ep"))
            .args(cat(
                &[
                    "bench",
                    "--progress",
                    "plain",
                    "--hidden",
                    "2048",
                    "--iters",
                    "1000",
                    "--dump",
                    dump.to_str().unwrap(),
                ],
                SMALL,
            ))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let mut seen = Vec::new();
        for line in lines.by_ref() {
            let line = line.unwrap();
            let go = line.ends_with("warm-up 1");
            seen.push(line);
            if go {
                break;
            }
        }
        let t = Instant::now();
        let kill = Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
        let rest: Vec<String> = lines.map_while(Result::ok).collect();
        let status = child.wait().unwrap();
        assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
        let code = if signal == "INT" { 130 } else { 143 };
        assert_eq!(status.code(), Some(code), "{seen:?}\n{rest:?}");
        let text = rest.join("\n");
        assert!(
            text.contains(&format!("interrupted by SIG{signal}")),
            "{text}"
        );
        // The dump happens in the first iteration: it is there whole, with its manifest, or
        // not at all; never files without a manifest claiming them, never a .partial.
        if let Ok(m) = ep_cli::io::read_manifest(&dump) {
            for r in &m.ranks {
                for f in &r.files {
                    let p = dump.join(format!("rank{}", r.rank)).join(f);
                    assert!(p.is_file(), "{}", p.display());
                }
            }
        }
        if dump.exists() {
            for e in walk(&dump) {
                assert!(!e.ends_with(".partial"), "{e}");
            }
        }
    }
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        }
        out.push(p.display().to_string());
    }
    out
}

#[test]
fn layout_runs_with_its_defaults_in_both_modes() {
    // One FP8 default: ep layout's low-latency dispatch is FP8 too, so its default hidden size
    // must allow it (default shapes but for the tokens, to keep the test short).
    for mode in ["normal", "low-latency"] {
        let out = ep(&["layout", "--mode", mode, "--tokens", "32"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("plan == oracle: OK"),
            "{mode}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_dump_says_what_it_needs_before_it_starts() {
    let dir = scratch("dump-need");
    let dump = dir.join("out");
    let out = ep(&cat(
        &[
            "bench", "--quiet", "--hidden", "256", "--iters", "1", "--dump",
        ],
        &cat(&[dump.to_str().unwrap()], SMALL),
    ));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let need = stdout.find("of disk").unwrap_or_else(|| panic!("{stdout}"));
    let done = stdout.find("verified:").unwrap();
    assert!(need < done, "the need is printed before the run: {stdout}");
    assert!(ep_cli::io::read_manifest(&dump).is_ok());
}
