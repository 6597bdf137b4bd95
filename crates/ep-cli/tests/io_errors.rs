//! Malformed inputs: each class gives its typed error naming the file (wrong dtype, wrong
//! number of dimensions, truncated or corrupt file, missing rank directory or file, T/K/H
//! inconsistent within a rank or across ranks, FP8 scales shape, expert ids out of range, two
//! activation kinds), and `ep layout` reports them with a non-zero exit.

mod io_support;

use std::path::{Path, PathBuf};

use ep_cli::io::{self, IoError};
use ep_core::workload::WorkloadSpec;
use io_support::{ep, s, scratch};
use npyz::WriterBuilder;

const EXPERTS: usize = 9;

/// A valid 3-rank inputs directory (`T = 6`, `K = 2`, `H = 256`); FP8 when asked.
fn good(name: &str, fp8: bool) -> PathBuf {
    let dir = scratch(name);
    let w = WorkloadSpec {
        fp8,
        ..WorkloadSpec::new(3, 6, 256, 2, EXPERTS, 1)
    }
    .generate()
    .unwrap();
    io::write_inputs(&dir, &w).unwrap();
    io::read_inputs(&dir, EXPERTS).unwrap();
    dir
}

fn write_npy<T: npyz::AutoSerialize + Copy>(path: &Path, shape: &[u64], data: &[T]) {
    assert_eq!(shape.iter().product::<u64>() as usize, data.len());
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    w.extend(data.iter().copied()).unwrap();
    w.finish().unwrap();
    std::fs::write(path, buf).unwrap();
}

fn err(dir: &Path) -> IoError {
    match io::read_inputs(dir, EXPERTS) {
        Ok(_) => panic!("{} read without error", dir.display()),
        Err(e) => e,
    }
}

fn ends_with(path: &Path, tail: &str) -> bool {
    path.ends_with(tail)
}

#[test]
fn wrong_dtype() {
    let dir = good("dtype-idx", false);
    write_npy(&dir.join("rank1/topk_idx.npy"), &[6, 2], &[1.0f64; 12]);
    match err(&dir) {
        IoError::WrongDtype { path, found, .. } => {
            assert!(ends_with(&path, "rank1/topk_idx.npy"), "{}", path.display());
            assert_eq!(found, "<f8");
        }
        e => panic!("{e}"),
    }
    let dir = good("dtype-w", false);
    write_npy(&dir.join("rank0/topk_weights.npy"), &[6, 2], &[1i64; 12]);
    assert!(
        matches!(err(&dir), IoError::WrongDtype { path, .. } if ends_with(&path, "rank0/topk_weights.npy"))
    );
    // x as int32: neither float32 nor uint16.
    let dir = good("dtype-x", false);
    write_npy(&dir.join("rank2/x.npy"), &[6, 256], &[1i32; 6 * 256]);
    let e = err(&dir);
    assert!(
        matches!(&e, IoError::WrongDtype { path, .. } if ends_with(path, "rank2/x.npy")),
        "{e}"
    );
    assert!(e.to_string().contains("float32 or uint16"), "{e}");
    // FP8 bytes as int8.
    let dir = good("dtype-fp8", true);
    write_npy(&dir.join("rank1/x_fp8.npy"), &[6, 256], &[1i8; 6 * 256]);
    assert!(
        matches!(err(&dir), IoError::WrongDtype { path, .. } if ends_with(&path, "rank1/x_fp8.npy"))
    );
}

#[test]
fn wrong_number_of_dimensions() {
    let dir = good("ndim-idx", false);
    write_npy(&dir.join("rank1/topk_idx.npy"), &[12], &[1i64; 12]);
    match err(&dir) {
        IoError::WrongNdim {
            path,
            shape,
            expected,
            ..
        } => {
            assert!(ends_with(&path, "rank1/topk_idx.npy"));
            assert_eq!(shape, [12]);
            assert_eq!(expected, 2);
        }
        e => panic!("{e}"),
    }
    let dir = good("ndim-x", false);
    write_npy(&dir.join("rank0/x.npy"), &[6, 2, 128], &[0.5f32; 6 * 256]);
    assert!(
        matches!(err(&dir), IoError::WrongNdim { path, shape, .. } if ends_with(&path, "rank0/x.npy") && shape == [6, 2, 128])
    );
}

#[test]
fn truncated_and_corrupt_files() {
    let dir = good("trunc", false);
    let path = dir.join("rank2/x.npy");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let e = err(&dir);
    assert!(
        matches!(&e, IoError::Corrupt { path, .. } if ends_with(path, "rank2/x.npy")),
        "{e}"
    );
    assert!(e.to_string().contains("[6, 256]"), "{e}");
    // Header cut short.
    std::fs::write(&path, &bytes[..20]).unwrap();
    assert!(matches!(err(&dir), IoError::Corrupt { .. }));
    // Not an .npy at all.
    let dir = good("garbage", false);
    std::fs::write(dir.join("rank0/topk_weights.npy"), b"hello, world").unwrap();
    assert!(
        matches!(err(&dir), IoError::Corrupt { path, .. } if ends_with(&path, "rank0/topk_weights.npy"))
    );
}

#[test]
fn missing_rank_directory_or_file() {
    let dir = good("gap", false);
    std::fs::remove_dir_all(dir.join("rank1")).unwrap();
    match err(&dir) {
        IoError::MissingRankDir { missing, found, .. } => {
            assert_eq!(missing, 1);
            assert_eq!(found, [0, 2]);
        }
        e => panic!("{e}"),
    }
    let empty = scratch("empty");
    assert!(matches!(err(&empty), IoError::NoRanks { .. }));
    // Entries that are not rank directories are named, not skipped (io_strict.rs has more).
    std::fs::create_dir(empty.join("rank01")).unwrap();
    assert!(matches!(err(&empty), IoError::NotARankDir { path, .. } if ends_with(&path, "rank01")));
    std::fs::remove_dir(empty.join("rank01")).unwrap();
    std::fs::write(empty.join("rank0"), b"a file, not a directory").unwrap();
    assert!(matches!(err(&empty), IoError::NotARankDir { path, .. } if ends_with(&path, "rank0")));
    assert!(matches!(
        err(&empty.join("nope")),
        IoError::Io { op: "listing", .. }
    ));

    let dir = good("nofile", false);
    std::fs::remove_file(dir.join("rank2/topk_weights.npy")).unwrap();
    assert!(
        matches!(err(&dir), IoError::MissingFile { path, .. } if ends_with(&path, "rank2/topk_weights.npy"))
    );
    let dir = good("nox", false);
    std::fs::remove_file(dir.join("rank0/x.npy")).unwrap();
    assert!(
        matches!(err(&dir), IoError::MissingFile { path, .. } if ends_with(&path, "rank0/x.npy"))
    );
    let dir = good("noscales", true);
    std::fs::remove_file(dir.join("rank1/x_scales.npy")).unwrap();
    assert!(
        matches!(err(&dir), IoError::MissingFile { path, .. } if ends_with(&path, "rank1/x_scales.npy"))
    );
}

#[test]
fn inconsistent_shapes() {
    // T of topk_weights differs from topk_idx within a rank.
    let dir = good("t-w", false);
    write_npy(&dir.join("rank1/topk_weights.npy"), &[5, 2], &[0.5f32; 10]);
    match err(&dir) {
        IoError::ShapeMismatch {
            path,
            shape,
            expected,
            ..
        } => {
            assert!(ends_with(&path, "rank1/topk_weights.npy"));
            assert_eq!(shape, [5, 2]);
            assert!(expected.contains("[6, 2]"), "{expected}");
        }
        e => panic!("{e}"),
    }
    // K of topk_weights differs.
    let dir = good("k-w", false);
    write_npy(&dir.join("rank0/topk_weights.npy"), &[6, 3], &[0.5f32; 18]);
    assert!(matches!(err(&dir), IoError::ShapeMismatch { shape, .. } if shape == [6, 3]));
    // T of x differs.
    let dir = good("t-x", false);
    write_npy(&dir.join("rank2/x.npy"), &[7, 256], &[0.5f32; 7 * 256]);
    assert!(
        matches!(err(&dir), IoError::ShapeMismatch { path, shape, .. } if ends_with(&path, "rank2/x.npy") && shape == [7, 256])
    );
    // K differs across ranks (consistent within rank 2).
    let dir = good("k-ranks", false);
    write_npy(&dir.join("rank2/topk_idx.npy"), &[6, 3], &[1i64; 18]);
    write_npy(&dir.join("rank2/topk_weights.npy"), &[6, 3], &[0.5f32; 18]);
    let e = err(&dir);
    assert!(
        matches!(&e, IoError::ShapeMismatch { path, shape, why, .. }
            if ends_with(path, "rank2/topk_idx.npy") && *shape == [6, 3] && why.contains("rank0")),
        "{e}"
    );
    // H differs across ranks.
    let dir = good("h-ranks", false);
    write_npy(&dir.join("rank1/x.npy"), &[6, 128], &[0.5f32; 6 * 128]);
    assert!(
        matches!(err(&dir), IoError::ShapeMismatch { path, .. } if ends_with(&path, "rank1/x.npy"))
    );
    // FP8 scales not [T, H/128].
    let dir = good("scales", true);
    write_npy(&dir.join("rank0/x_scales.npy"), &[6, 3], &[1.0f32; 18]);
    let e = err(&dir);
    assert!(
        matches!(&e, IoError::ShapeMismatch { path, shape, expected, .. }
            if ends_with(path, "rank0/x_scales.npy") && *shape == [6, 3] && expected.contains("[6, 2]")),
        "{e}"
    );
    // T may differ across ranks (DeepEP allows it) when a rank's files agree.
    let dir = good("t-ranks", false);
    let w = WorkloadSpec::new(1, 4, 256, 2, EXPERTS, 2)
        .generate()
        .unwrap();
    let tmp = scratch("t-ranks-one");
    io::write_inputs(&tmp, &w).unwrap();
    for f in ["topk_idx.npy", "topk_weights.npy", "x.npy"] {
        std::fs::copy(tmp.join("rank0").join(f), dir.join("rank1").join(f)).unwrap();
    }
    let read = io::read_inputs(&dir, EXPERTS).unwrap();
    assert_eq!(io::summarize(&read).tokens, [6, 4, 6]);
}

#[test]
fn activation_kinds_and_expert_ids() {
    let dir = good("both", false);
    write_npy(&dir.join("rank1/x_fp8.npy"), &[6, 256], &[0u8; 6 * 256]);
    assert!(matches!(err(&dir), IoError::AmbiguousActivations { .. }));
    // Rank 1 FP8, the others BF16.
    let dir = good("mixed", false);
    std::fs::remove_file(dir.join("rank1/x.npy")).unwrap();
    write_npy(&dir.join("rank1/x_fp8.npy"), &[6, 256], &[0u8; 6 * 256]);
    write_npy(&dir.join("rank1/x_scales.npy"), &[6, 2], &[1.0f32; 12]);
    let e = err(&dir);
    assert!(matches!(&e, IoError::AmbiguousActivations { .. }), "{e}");
    assert!(e.to_string().contains("rank 0"), "{e}");
    // Expert id out of range.
    let dir = good("range", false);
    let mut ids = vec![0i64; 12];
    ids[7] = EXPERTS as i64;
    write_npy(&dir.join("rank2/topk_idx.npy"), &[6, 2], &ids);
    match err(&dir) {
        IoError::Invalid { path, source } => {
            assert!(ends_with(&path, "rank2/topk_idx.npy"));
            assert!(matches!(
                *source,
                ep_core::Error::ExpertOutOfRange {
                    rank: 2,
                    token: 3,
                    slot: 1,
                    ..
                }
            ));
        }
        e => panic!("{e}"),
    }
}

#[test]
fn writing_over_more_ranks_is_refused() {
    let dir = good("stale", false);
    let w = WorkloadSpec::new(2, 6, 256, 2, 8, 1).generate().unwrap();
    assert!(matches!(
        io::write_inputs(&dir, &w),
        Err(IoError::StaleRankDir { num_ranks: 2, .. })
    ));
}

fn layout_err(args: &[&str]) -> String {
    let mut all = vec!["layout"];
    all.extend_from_slice(args);
    let out = ep(&all);
    assert!(!out.status.success(), "ep {all:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn layout_reports_bad_inputs_and_options() {
    let dir = good("cli", false);
    // --experts is required.
    assert!(layout_err(&["--inputs", s(&dir)]).contains("--experts"));
    // Options that disagree with the files name the file and both shapes.
    let e = layout_err(&["--inputs", s(&dir), "--experts", "9", "--tokens", "5"]);
    assert!(
        e.contains("topk_idx.npy") && e.contains("[6, 2]") && e.contains("--tokens 5"),
        "{e}"
    );
    let e = layout_err(&["--inputs", s(&dir), "--experts", "9", "--hidden", "128"]);
    assert!(e.contains("x.npy") && e.contains("--hidden 128"), "{e}");
    let e = layout_err(&["--inputs", s(&dir), "--experts", "9", "--topk", "3"]);
    assert!(e.contains("--topk 3"), "{e}");
    let e = layout_err(&["--inputs", s(&dir), "--experts", "9", "--ranks", "4"]);
    assert!(e.contains("3 rank directories"), "{e}");
    let e = layout_err(&["--inputs", s(&dir), "--experts", "9", "--fp8"]);
    assert!(e.contains("--fp8"), "{e}");
    // Generation options conflict with --inputs.
    layout_err(&[
        "--inputs",
        s(&dir),
        "--experts",
        "9",
        "--routing",
        "hot:0.5",
    ]);
    // A malformed file: the error names it.
    write_npy(&dir.join("rank1/topk_idx.npy"), &[12], &[1i64; 12]);
    let e = layout_err(&["--inputs", s(&dir), "--experts", "9"]);
    assert!(
        e.contains("rank1/topk_idx.npy") && e.contains("[12]"),
        "{e}"
    );
    // Expert count that the files exceed.
    let dir = good("cli-range", false);
    let e = layout_err(&["--inputs", s(&dir), "--experts", "3"]);
    assert!(
        e.contains("topk_idx.npy") && e.contains("outside [-1, 3)"),
        "{e}"
    );
    // A bad routing is a usage error.
    let e = layout_err(&["--routing", "zipf:-1"]);
    assert!(e.contains("zipf"), "{e}");
}
