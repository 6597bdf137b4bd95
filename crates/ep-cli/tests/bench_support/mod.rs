//! Shared helpers of the `bench_*` tests: scratch directories, running the built `ep bench` at
//! small sizes, reading its JSON report.

#![allow(dead_code, reason = "each test file uses a different subset")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Small shapes: 4 ranks, 16 tokens, top-4, 16 experts (hidden per test).
pub(crate) const SMALL: &[&str] = &[
    "--ranks",
    "4",
    "--tokens",
    "16",
    "--topk",
    "4",
    "--experts",
    "16",
];

/// A fresh, empty scratch directory under Cargo's per-target temp dir.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ep-bench-{}-{name}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the built `ep` with `args`.
pub(crate) fn ep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ep"))
        .args(args)
        .output()
        .expect("run ep")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `ep bench --quiet` with `args` plus `--json`, asserts exit 0 and a verified run, and
/// returns the report.
pub(crate) fn bench_ok(args: &[&str], json: &Path) -> serde_json::Value {
    let mut all = vec!["bench", "--quiet", "--json", s(json)];
    all.extend_from_slice(args);
    let out = ep(&all);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.code() == Some(0) && stdout.contains("verified:"),
        "ep {all:?} failed ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    assert_eq!(report["verified"], true, "{report:#}");
    report
}

/// Runs `ep bench` with `args`, asserts the exit code, returns stderr.
pub(crate) fn bench_fails(args: &[&str], code: i32) -> String {
    let mut all = vec!["bench", "--quiet"];
    all.extend_from_slice(args);
    let out = ep(&all);
    let (stdout, stderr) = text(&out);
    assert_eq!(
        out.status.code(),
        Some(code),
        "ep {all:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    stderr
}

/// The total digest of a report.
pub(crate) fn digest(report: &serde_json::Value) -> String {
    report["digest"]["total"].as_str().unwrap().to_string()
}

/// The `output digest <hex>` printed by `ep layout` with `args`.
pub(crate) fn layout_digest(args: &[&str]) -> String {
    let mut all = vec!["layout"];
    all.extend_from_slice(args);
    let out = ep(&all);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "ep {all:?}\n{stdout}\n{stderr}");
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("output digest "))
        .and_then(|l| l.split_whitespace().next())
        .expect("a digest line")
        .to_string()
}

/// `path` as `&str`.
pub(crate) fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// `a` followed by `b`.
pub(crate) fn cat<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    a.iter().chain(b).copied().collect()
}
