//! Shared helpers of the `io_*` tests: scratch directories, running the built `ep`, reading
//! `.npy` headers.

#![allow(dead_code, reason = "each test file uses a different subset")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh, empty scratch directory under Cargo's per-target temp dir.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("ep-io-{}-{name}", std::process::id()));
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

/// Runs `ep layout` with `args`, asserting success and a plan/oracle match.
pub(crate) fn layout_ok(args: &[&str]) -> String {
    let mut all = vec!["layout"];
    all.extend_from_slice(args);
    let out = ep(&all);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && stdout.contains("plan == oracle: OK"),
        "ep {all:?} failed ({:?})\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The `output digest <hex>` printed by `ep layout`.
pub(crate) fn printed_digest(stdout: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("output digest "))
        .and_then(|l| l.split_whitespace().next())
        .expect("a digest line")
        .to_string()
}

/// Shape of a `.npy` file.
pub(crate) fn npy_shape(path: &Path) -> Vec<u64> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    npyz::NpyFile::new(&bytes[..]).unwrap().shape().to_vec()
}

/// `path` as `&str`.
pub(crate) fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}
