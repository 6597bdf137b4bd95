//! Two-process NVSHMEM bring-up on real GPUs (GPU.md): unique id over the loopback rendezvous,
//! symmetric allocation, peer pointer, a plain kernel storing into the peer, on-stream put and
//! barrier, finalize.
//!
//! Ignored by default (the ignore says what it needs). On a machine with 2 GPUs and NVSHMEM
//! (`scripts/gpu-run.sh` passes `--include-ignored`):
//! `cargo test -p ep-kernels --test nvshmem_bringup -- --ignored --nocapture`.
//! Run without the hardware, it fails naming what is missing: it never passes untouched.

use std::time::Duration;

use cudarc::driver::CudaContext;
use ep_kernels::kernels::BringupKernels;
use std::collections::BTreeMap;

use ep_core::config::{BufferConfig, IbgdaNicHandler, nvshmem_env_plan};
use ep_kernels::nvshmem::env::{EnvEntry, Source, from_plan};
use ep_kernels::nvshmem::launch::{RankLaunch, is_rank_process, launch_ranks, rank_from_env};
use ep_kernels::nvshmem::{Bootstrap, BringUp, IbgdaState, TcpRendezvous};

const TEST: &str = "two_process_bringup";
const WORDS: usize = 1 << 20; // 8 MiB per slot
const POISON: u64 = 0xDEAD_BEEF_DEAD_BEEF;

fn marker(rank: u32, phase: u64) -> u64 {
    0x5EED_0000_0000_0000 | (phase << 44) | (u64::from(rank) << 32)
}

/// ep-core's NVSHMEM environment plan (spec §1.2) for a 2-rank low-latency buffer that may use
/// NVLink: IBGDA is requested, so the report shows whether it came up.
fn plan() -> Vec<EnvEntry> {
    let mut cfg = BufferConfig::new(2);
    cfg.low_latency_mode = true;
    cfg.num_rdma_bytes = 1 << 28;
    cfg.num_qps_per_rank = 1;
    cfg.allow_nvlink_for_low_latency_mode = true;
    let user: BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("NVSHMEM_"))
        .collect();
    let plan = nvshmem_env_plan(&cfg, &user, IbgdaNicHandler::Auto).expect("env plan");
    let entries = from_plan(&plan);
    for e in &entries {
        eprintln!(
            "plan {}={} ({}){}",
            e.var,
            e.value,
            e.reason,
            if e.user_set { " [user-set]" } else { "" }
        );
    }
    entries
}

#[test]
#[ignore = "needs a GPU, the CUDA kernels (nvcc at build time) and NVSHMEM: cargo test -- --ignored"]
fn two_process_bringup() {
    if is_rank_process() {
        if let Err(e) = rank_main() {
            eprintln!("RANK FAILED: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                eprintln!("  caused by: {s}");
                src = s.source();
            }
            std::process::exit(1);
        }
        return;
    }
    // SAFETY: only tries to dlopen libcuda.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    assert!(driver, "{TEST} needs a CUDA driver, and there is none here");
    // Two ranks on the GPUs there are (rank r on GPU r % n): on one GPU both PEs share it
    // (NVSHMEM's several-PEs-per-GPU mode; nvshmem_ptr and barrier_all work there, GPU.md).
    let n = CudaContext::device_count().expect("cuDeviceGetCount");
    assert!(n >= 1, "{TEST} needs a GPU, and there is none here");
    eprintln!("parent: {n} GPU(s): the 2 ranks run on GPU r % {n}");
    assert!(
        ep_kernels::kernels::available(),
        "ep-kernels was built without nvcc: {:?}",
        BringupKernels::load(&CudaContext::new(0).unwrap()).err()
    );
    let lib = ep_kernels::nvshmem::load_checked(None).expect("NVSHMEM");
    eprintln!(
        "parent: NVSHMEM {} at {}",
        lib.vendor_version(),
        lib.path().display()
    );

    let launch = RankLaunch {
        program: std::env::current_exe().unwrap(),
        args: vec![
            TEST.into(),
            "--exact".into(),
            "--ignored".into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
        ],
        world: 2,
        plan: plan(),
        extra_env: vec![],
        timeout: Duration::from_secs(120),
    };
    let res = launch_ranks(&launch).expect("launch");
    for a in &res.applied {
        let who = match a.source {
            Source::Plan => "plan",
            Source::User => "user (kept)",
        };
        eprintln!(
            "env {}={} from {who}{}{}",
            a.var,
            a.value,
            if a.value != a.planned {
                format!(", plan wanted {}", a.planned)
            } else {
                String::new()
            },
            if a.set_here {
                ""
            } else {
                " (already in the environment)"
            }
        );
    }
    for o in &res.outcomes {
        assert_eq!(o.code, Some(0), "rank {} failed", o.rank);
        assert!(
            o.output.contains(&format!("RANK {} OK", o.rank)),
            "rank {} did not report OK",
            o.rank
        );
    }
}

fn rank_main() -> ep_kernels::Result<()> {
    let (rank, world) = rank_from_env()?;
    let rdv = TcpRendezvous::from_env()?;
    let t0 = std::time::Instant::now();
    let session = BringUp::new(rank, world, Bootstrap::UniqueId(&rdv)).init()?;
    println!("init took {:?}\n{}", t0.elapsed(), session.report());
    let report = session.report();
    let peer = (rank + 1) % world;
    let src = (rank + world - 1) % world;
    assert!(
        report.p2p_peers.contains(&peer),
        "peer {peer} not reachable by load/store: {report}"
    );
    if report
        .env
        .iter()
        .any(|(k, v)| k == "NVSHMEM_IB_ENABLE_IBGDA" && v == "1")
    {
        assert_ne!(report.ibgda, IbgdaState::NotRequested);
    }
    println!(
        "transports up: {:?}, ibgda: {:?}",
        report.transports_up(),
        report.ibgda
    );

    let ctx = session.context().clone();
    let stream = ctx.default_stream();
    let kernels = BringupKernels::load(&ctx)?;
    let slots = world as usize;
    let bytes = slots * WORDS * 8;
    let buf = session.alloc(bytes, 128)?;
    let poison = vec![POISON; slots * WORDS];
    // SAFETY: `buf` is a live device allocation of `bytes` bytes.
    unsafe { cudarc::driver::result::memcpy_htod_sync(buf.device_ptr(), &poison) }
        .map_err(cuda("poison"))?;
    session.barrier_all();

    // Phase 1: a plain kernel stores into slot `rank` of the peer's buffer through nvshmem_ptr.
    let peer_base = buf.peer_ptr(peer).expect("checked above");
    let dst = peer_base + (rank as u64) * (WORDS as u64) * 8;
    // SAFETY: slot `rank` of the peer's buffer is written by this rank only, until the barrier.
    unsafe { kernels.fill(&stream, dst, marker(rank, 1), WORDS as u64) }?;
    stream.synchronize().map_err(cuda("sync after fill"))?;
    session.barrier_all();
    let mut host = vec![0u64; slots * WORDS];
    // SAFETY: `buf` is live and holds `host.len()` words; no kernel writes it now.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, buf.device_ptr()) }
        .map_err(cuda("read back"))?;
    for s in 0..slots {
        let got = &host[s * WORDS..(s + 1) * WORDS];
        if s as u32 == src {
            let bad = got
                .iter()
                .enumerate()
                .find(|(i, v)| **v != marker(src, 1) + *i as u64);
            assert!(
                bad.is_none(),
                "slot {s}: word {:?} wrong (expected rank {src}'s stores)",
                bad
            );
        } else {
            assert!(
                got.iter().all(|v| *v == POISON),
                "slot {s} was written but nobody owns it"
            );
        }
    }
    println!(
        "phase 1 ok: rank {src}'s peer stores arrived ({} MiB)",
        (WORDS * 8) >> 20
    );

    // Phase 2: nvshmemx_putmem_on_stream from a local symmetric region to the peer, then an
    // on-stream barrier.
    let buf2 = session.alloc(2 * WORDS * 8, 128)?;
    let (a, b) = (buf2.device_ptr(), buf2.device_ptr() + (WORDS as u64) * 8);
    // SAFETY: region A of this rank's buf2, written only here.
    unsafe { kernels.fill(&stream, a, marker(rank, 2), WORDS as u64) }?;
    // SAFETY: same poison pattern in region B before anybody puts into it.
    unsafe { cudarc::driver::result::memcpy_htod_sync(b, &poison[..WORDS]) }
        .map_err(cuda("poison B"))?;
    stream.synchronize().map_err(cuda("sync"))?;
    session.barrier_all();
    // SAFETY: A is filled (stream order), B is symmetric, stays alive until after the barrier.
    unsafe {
        session.lib().putmem_on_stream(
            b as *mut _,
            a as *const _,
            WORDS * 8,
            peer as i32,
            stream.cu_stream() as _,
        )
    };
    session.barrier_all_on_stream(&stream);
    stream.synchronize().map_err(cuda("sync after put"))?;
    let mut host_b = vec![0u64; WORDS];
    // SAFETY: region B is live; the barrier completed every put into it.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host_b, b) }.map_err(cuda("read B"))?;
    let bad = host_b
        .iter()
        .enumerate()
        .find(|(i, v)| **v != marker(src, 2) + *i as u64);
    assert!(bad.is_none(), "put_on_stream: word {bad:?} wrong");
    println!("phase 2 ok: putmem_on_stream + barrier_all_on_stream");

    session.free(buf2);
    session.free(buf);
    session.finalize()?;
    println!("RANK {rank} OK");
    Ok(())
}

fn cuda(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> ep_kernels::Error {
    move |source| ep_kernels::Error::Cuda { op, source }
}
