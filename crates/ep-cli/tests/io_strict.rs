//! Cases that used to pass silently and are now typed errors: stray entries beside the rank
//! directories, non-finite activations, a dump over an older dump with more ranks; and a dump
//! that stops half-way never looks complete.

mod io_support;

use std::path::Path;

use ep_cli::io::{self, IoError, Outputs, RunInfo};
use ep_core::plan::intranode::{self, DispatchOptions};
use ep_core::plan::layout::get_dispatch_layout_for_rank;
use ep_core::workload::WorkloadSpec;
use ep_core::{Activations, RankInputs};
use half::bf16;
use io_support::{ep, s, scratch};

const EXPERTS: usize = 8;

fn inputs(ranks: usize) -> Vec<RankInputs> {
    WorkloadSpec::new(ranks, 6, 256, 2, EXPERTS, 1)
        .generate()
        .unwrap()
}

#[test]
fn entries_that_are_not_rank_directories_are_errors() {
    for (name, file) in [
        ("rank03", false),
        ("rank3", true),
        ("notes", false),
        ("x.npy", true),
    ] {
        let dir = scratch(&format!("stray-{name}"));
        io::write_inputs(&dir, &inputs(2)).unwrap();
        let stray = dir.join(name);
        if file {
            std::fs::write(&stray, "x").unwrap();
        } else {
            std::fs::create_dir(&stray).unwrap();
        }
        let e = io::read_inputs(&dir, EXPERTS).unwrap_err();
        assert!(
            matches!(&e, IoError::NotARankDir { path, .. } if path == &stray),
            "{name}: {e}"
        );
        // The commands refuse it too, naming the entry (no run with fewer ranks).
        let out = ep(&["bench", "--quiet", "--inputs", s(&dir), "--experts", "8"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{stderr}");
        assert!(stderr.contains(name), "{stderr}");
    }
    // Hidden entries are not the user's data.
    let dir = scratch("stray-hidden");
    io::write_inputs(&dir, &inputs(2)).unwrap();
    std::fs::write(dir.join(".DS_Store"), "x").unwrap();
    assert_eq!(io::read_inputs(&dir, EXPERTS).unwrap().len(), 2);
}

#[test]
fn non_finite_activations_are_input_errors_in_both_modes() {
    for (bad, what) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf")] {
        let dir = scratch(&format!("nonfinite-{what}"));
        let mut w = inputs(2);
        if let Activations::Bf16(x) = &mut w[1].x {
            let cols = x.cols();
            x.data_mut()[3 * cols + 5] = bf16::from_f32(bad);
        }
        io::write_inputs(&dir, &w).unwrap();
        let e = io::read_inputs(&dir, EXPERTS).unwrap_err();
        assert!(
            matches!(
                &e,
                IoError::NonFinite {
                    token: 3,
                    channel: 5,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("rank1"), "{e}");
        for mode in ["normal", "low-latency"] {
            let out = ep(&[
                "bench",
                "--quiet",
                "--mode",
                mode,
                "--no-fp8",
                "--inputs",
                s(&dir),
                "--experts",
                "8",
            ]);
            let (stdout, stderr) = (
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
            );
            // A typed input error, never "verified" followed by a mismatch.
            assert_eq!(out.status.code(), Some(3), "{mode}: {stdout}\n{stderr}");
            assert!(stderr.contains("must be finite"), "{mode}: {stderr}");
            assert!(!stdout.contains("verified") && !stdout.contains("MISMATCH"));
        }
    }
}

/// The plan's normal-mode outputs of `w` (dispatch only), for dumping.
fn dump(dir: &Path, w: &[RankInputs]) -> Result<io::Manifest, IoError> {
    let r = w.len();
    let layouts: Vec<_> = w
        .iter()
        .enumerate()
        .map(|(s, i)| get_dispatch_layout_for_rank(s, &i.topk_idx, EXPERTS, r).unwrap())
        .collect();
    let opts = DispatchOptions::default();
    let d = intranode::intranode_dispatch_all(w, &layouts, EXPERTS, &opts).unwrap();
    io::dump_outputs(
        dir,
        &Outputs::Normal {
            dispatch: &d,
            combine: &[],
        },
        &RunInfo::default(),
    )
}

#[test]
fn a_dump_over_one_with_more_ranks_is_refused_like_dump_inputs() {
    let dir = scratch("dump-stale");
    dump(&dir, &inputs(4)).unwrap();
    let e = dump(&dir, &inputs(2)).unwrap_err();
    assert!(
        matches!(&e, IoError::StaleRankDir { num_ranks: 2, path } if path.ends_with("rank2")),
        "{e}"
    );
    // Refused before anything changed: the old dump is still whole.
    assert_eq!(io::read_manifest(&dir).unwrap().num_ranks, 4);
    // The same number of ranks (or fewer after removing the extra ones) is fine.
    dump(&dir, &inputs(4)).unwrap();
}

#[test]
fn a_dump_that_stops_half_way_never_looks_complete() {
    let dir = scratch("dump-half");
    dump(&dir, &inputs(4)).unwrap();
    assert!(dir.join(io::MANIFEST).exists());
    // Make rank 1's first file impossible to write (a directory where its temporary goes):
    // the dump stops there, as if interrupted.
    std::fs::create_dir(dir.join("rank1/recv_x.npy.partial")).unwrap();
    dump(&dir, &inputs(4)).unwrap_err();
    assert!(
        !dir.join(io::MANIFEST).exists(),
        "a half-written dump must not keep the old manifest"
    );
    io::read_manifest(&dir).unwrap_err();
    // Files are renamed into place whole: no file of rank 0 is left under a temporary name.
    for f in std::fs::read_dir(dir.join("rank0")).unwrap() {
        let name = f.unwrap().file_name();
        assert!(!name.to_string_lossy().ends_with(".partial"), "{name:?}");
    }
    std::fs::remove_dir(dir.join("rank1/recv_x.npy.partial")).unwrap();
    dump(&dir, &inputs(4)).unwrap();
    assert_eq!(io::read_manifest(&dir).unwrap().num_ranks, 4);
}
