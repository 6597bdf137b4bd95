//! Round trips: generate → `--dump-inputs` → `--inputs` rerun gives identical outputs, file by
//! file, and the same digest (both modes, BF16 and FP8); `read_inputs(write_inputs(x)) == x`;
//! raw BF16 bits (uint16) and Fortran-order files read as the same inputs; the manifest.

mod io_support;

use std::collections::BTreeSet;
use std::path::Path;

use ep_cli::io::{self, Outputs, RunInfo};
use ep_core::workload::{Routing, WorkloadSpec};
use ep_core::{Activations, RankInputs};
use io_support::{layout_ok, npy_shape, printed_digest, s, scratch};
use npyz::WriterBuilder;

fn files(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for r in std::fs::read_dir(dir).unwrap() {
        let r = r.unwrap().path();
        if r.is_dir() {
            for f in std::fs::read_dir(&r).unwrap() {
                let f = f.unwrap().path();
                out.insert(format!(
                    "{}/{}",
                    r.file_name().unwrap().to_str().unwrap(),
                    f.file_name().unwrap().to_str().unwrap()
                ));
            }
        }
    }
    out
}

fn assert_same_outputs(a: &Path, b: &Path) {
    let (fa, fb) = (files(a), files(b));
    assert_eq!(fa, fb, "file sets differ");
    assert!(!fa.is_empty());
    for f in &fa {
        let (x, y) = (
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
        );
        assert!(x == y, "{f} differs");
    }
    let (ma, mb) = (io::read_manifest(a).unwrap(), io::read_manifest(b).unwrap());
    assert_eq!(ma.digest, mb.digest);
    assert_eq!(ma.ranks, mb.ranks);
    assert_eq!(ma.mode, mb.mode);
    assert_eq!(ma.digest_format_version, ep_core::digest::FORMAT_VERSION);
}

#[test]
fn replaying_dumped_inputs_gives_identical_outputs_and_digest() {
    // (name, generation-only options, options of the run itself)
    type Case<'a> = (&'a str, &'a [&'a str], &'a [&'a str]);
    let cases: [Case<'_>; 4] = [
        (
            "normal-bf16",
            &["--hidden", "128", "--masked", "7"],
            &["--mode", "normal"],
        ),
        (
            "normal-fp8",
            &["--hidden", "256", "--fp8"],
            &["--mode", "normal"],
        ),
        (
            "ll-bf16",
            &["--hidden", "128"],
            &["--mode", "low-latency", "--no-fp8"],
        ),
        (
            "ll-fp8",
            &["--hidden", "512"],
            &["--mode", "low-latency", "--fp8"],
        ),
    ];
    for (name, generate, run) in cases {
        let dir = scratch(&format!("rt-{name}"));
        let (inp, out1, out2) = (dir.join("in"), dir.join("out1"), dir.join("out2"));
        let mut args = vec![
            "--ranks",
            "4",
            "--tokens",
            "24",
            "--topk",
            "4",
            "--experts",
            "16",
            "--seed",
            "7",
            "--routing",
            "zipf:0.8",
            "--dump-inputs",
            s(&inp),
            "--dump",
            s(&out1),
        ];
        args.extend_from_slice(generate);
        args.extend_from_slice(run);
        let first = layout_ok(&args);

        let mut replay = vec!["--inputs", s(&inp), "--experts", "16", "--dump", s(&out2)];
        replay.extend_from_slice(run);
        let second = layout_ok(&replay);
        assert_eq!(printed_digest(&first), printed_digest(&second), "{name}");
        assert_same_outputs(&out1, &out2);

        let m1 = io::read_manifest(&out1).unwrap();
        let m2 = io::read_manifest(&out2).unwrap();
        assert_eq!(m1.digest, printed_digest(&first));
        assert_eq!(m1.run.seed, Some(7));
        assert_eq!(m1.run.routing.as_deref(), Some("zipf:0.8"));
        assert_eq!(m1.run.backend, "plan");
        assert_eq!(m2.run.seed, None);
        assert_eq!(m2.run.inputs.as_deref(), Some(s(&inp)));
        assert_eq!(m1.num_ranks, 4);
        // A third run from the same files: same digest again.
        assert_eq!(printed_digest(&layout_ok(&replay)), printed_digest(&first));
    }
}

#[test]
fn dumped_shapes_follow_the_spec() {
    let dir = scratch("shapes");
    let (out_n, out_l) = (dir.join("n"), dir.join("l"));
    layout_ok(&[
        "--ranks",
        "2",
        "--tokens",
        "16",
        "--hidden",
        "256",
        "--topk",
        "3",
        "--experts",
        "8",
        "--fp8",
        "--dump",
        s(&out_n),
    ]);
    let r0 = out_n.join("rank0");
    let rows = npy_shape(&r0.join("recv_src_idx.npy"))[0];
    assert_eq!(npy_shape(&r0.join("recv_x.npy")), [rows, 256]);
    assert_eq!(npy_shape(&r0.join("recv_x_fp8.npy")), [rows, 256]);
    assert_eq!(npy_shape(&r0.join("recv_x_scales.npy")), [rows, 2]);
    assert_eq!(npy_shape(&r0.join("recv_topk_idx.npy")), [rows, 3]);
    assert_eq!(
        npy_shape(&r0.join("num_recv_tokens_per_expert_list.npy")),
        [4]
    );
    assert_eq!(npy_shape(&r0.join("rank_prefix_matrix.npy")), [2, 2]);
    // 12 channels: DeepEP's 24 SMs (--num-sms), the same default as ep bench.
    assert_eq!(npy_shape(&r0.join("channel_prefix_matrix.npy")), [2, 12]);
    assert_eq!(
        npy_shape(&r0.join("recv_channel_prefix_matrix.npy")),
        [2, 12]
    );
    assert_eq!(npy_shape(&r0.join("send_head.npy")), [16, 2]);
    assert_eq!(npy_shape(&r0.join("combined_x.npy")), [16, 256]);
    assert_eq!(npy_shape(&r0.join("combined_topk_weights.npy")), [16, 3]);

    layout_ok(&[
        "--mode",
        "low-latency",
        "--ranks",
        "2",
        "--tokens",
        "16",
        "--hidden",
        "512",
        "--topk",
        "3",
        "--experts",
        "8",
        "--fp8",
        "--dump",
        s(&out_l),
    ]);
    let r1 = out_l.join("rank1");
    assert_eq!(npy_shape(&r1.join("packed_recv_x.npy")), [4, 32, 512]);
    assert_eq!(npy_shape(&r1.join("packed_recv_x_fp8.npy")), [4, 32, 512]);
    assert_eq!(npy_shape(&r1.join("packed_recv_x_scales.npy")), [4, 32, 4]);
    assert_eq!(npy_shape(&r1.join("packed_recv_count.npy")), [4]);
    assert_eq!(npy_shape(&r1.join("packed_recv_src_info.npy")), [4, 32]);
    assert_eq!(npy_shape(&r1.join("packed_recv_layout_range.npy")), [4, 2]);
    assert_eq!(npy_shape(&r1.join("combined_x.npy")), [16, 512]);
    let m = io::read_manifest(&out_l).unwrap();
    assert_eq!(m.mode, "low-latency");
    assert!(
        m.ranks[1]
            .files
            .contains(&"packed_recv_x_scales.npy".to_string())
    );
}

fn workload(fp8: bool) -> Vec<RankInputs> {
    WorkloadSpec {
        fp8,
        masked_per_rank: 4,
        routing: Routing::Hot { fraction: 0.5 },
        ..WorkloadSpec::new(3, 10, 256, 4, 12, 99)
    }
    .generate()
    .unwrap()
}

#[test]
fn write_then_read_is_identity() {
    for fp8 in [false, true] {
        let dir = scratch(&format!("wr-{fp8}"));
        let w = workload(fp8);
        io::write_inputs(&dir, &w).unwrap();
        assert_eq!(io::read_inputs(&dir, 12).unwrap(), w);
        // Rewriting with the other kind replaces the activation files.
        let other = workload(!fp8);
        io::write_inputs(&dir, &other).unwrap();
        assert_eq!(io::read_inputs(&dir, 12).unwrap(), other);
        let sum = io::summarize(&other);
        assert_eq!(
            (sum.num_ranks, sum.hidden, sum.topk, sum.fp8),
            (3, 256, 4, !fp8)
        );
        assert_eq!(sum.tokens, [10, 10, 10]);
    }
}

fn write_npy<T: npyz::AutoSerialize + Copy>(path: &Path, shape: &[u64], data: &[T], fortran: bool) {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .order(if fortran {
            npyz::Order::Fortran
        } else {
            npyz::Order::C
        })
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    w.extend(data.iter().copied()).unwrap();
    w.finish().unwrap();
    std::fs::write(path, buf).unwrap();
}

#[test]
fn raw_bf16_bits_and_fortran_order_read_the_same() {
    let dir = scratch("bits");
    let w = workload(false);
    io::write_inputs(&dir, &w).unwrap();
    for (r, inp) in w.iter().enumerate() {
        let rd = io::rank_dir(&dir, r);
        let Activations::Bf16(x) = &inp.x else {
            unreachable!()
        };
        let bits: Vec<u16> = x.data().iter().map(|v| v.to_bits()).collect();
        write_npy(
            &rd.join("x.npy"),
            &[x.rows() as u64, x.cols() as u64],
            &bits,
            false,
        );
        // topk_weights stored column-major.
        let (t, k) = inp.topk_weights.shape();
        let col_major: Vec<f32> = (0..t * k)
            .map(|i| inp.topk_weights.get(i % t, i / t))
            .collect();
        write_npy(
            &rd.join("topk_weights.npy"),
            &[t as u64, k as u64],
            &col_major,
            true,
        );
    }
    assert_eq!(io::read_inputs(&dir, 12).unwrap(), w);
}

#[test]
fn dump_outputs_records_run_info_and_digests() {
    use ep_core::plan::low_latency::{self as ll, LlParams};
    let w = WorkloadSpec::new(2, 8, 128, 2, 4, 5).generate().unwrap();
    let p = LlParams::new(8, 4).with_masked_ranks(vec![false, true]);
    let d = ll::dispatch(&w, &p).unwrap();
    let view = Outputs::LowLatency {
        dispatch: &d,
        combined_x: &[],
    };
    let dir = scratch("manifest");
    let mut info = RunInfo {
        backend: "sim".into(),
        seed: Some(5),
        ..RunInfo::default()
    };
    info.options.insert("ranks".into(), 2.into());
    let m = io::dump_outputs(&dir, &view, &info).unwrap();
    assert_eq!(m, io::read_manifest(&dir).unwrap());
    assert_eq!(m.run, info);
    assert_eq!(m.digest, view.digest().unwrap().total.to_string());
    assert!(m.ranks[1].masked && m.ranks[1].files.is_empty());
    assert!(!m.ranks[0].masked);
    assert!(!m.ranks[0].files.contains(&"combined_x.npy".to_string()));
    let text = std::fs::read_to_string(dir.join(io::MANIFEST)).unwrap();
    for key in [
        "\"ep_rs_version\"",
        "\"digest_format_version\": 2",
        "\"backend\": \"sim\"",
    ] {
        assert!(text.contains(key), "{key} in {text}");
    }
}
