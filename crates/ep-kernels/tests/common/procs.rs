//! Tests whose ranks live in separate processes: the test binary spawns itself as the rank
//! processes (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, a loopback rendezvous with a session token) and
//! each rank process runs the test's rank body.

use std::sync::Arc;
use std::time::Duration;

use ep_kernels::gpu::Device;
use ep_kernels::nvshmem::launch::{RankLaunch, is_rank_process, launch_ranks, rank_from_env};

/// The whole multi-process run (below gpu-run.sh's bound on the test binary).
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// In the parent: spawns `world` copies of this test binary running only `test`, waits for
/// them (bounded), and fails with every rank's output unless each one exited 0 saying
/// `RANK r OK`. In a rank process: runs `rank_main` and says so.
pub(crate) fn spawn_or_run(test: &str, world: u32, rank_main: fn(u32) -> ep_kernels::Result<()>) {
    if is_rank_process() {
        let (rank, _) = rank_from_env().expect("RANK and WORLD_SIZE");
        if let Err(e) = rank_main(rank) {
            panic!("rank {rank} failed: {e}");
        }
        println!("RANK {rank} OK");
        return;
    }
    assert!(
        driver_present(),
        "{test} needs a CUDA driver, and there is none here"
    );
    let launch = RankLaunch {
        program: std::env::current_exe().unwrap(),
        args: vec![
            test.into(),
            "--exact".into(),
            "--include-ignored".into(),
            "--nocapture".into(),
            "--test-threads=1".into(),
        ],
        world,
        plan: Vec::new(),
        extra_env: Vec::new(),
        timeout: RUN_TIMEOUT,
    };
    let res = launch_ranks(&launch)
        .unwrap_or_else(|e| panic!("{test}: {e} (each rank's output is above, prefixed [rank r])"));
    let mut failed = Vec::new();
    for o in &res.outcomes {
        if o.code != Some(0) || !o.output.contains(&format!("RANK {} OK", o.rank)) {
            failed.push(format!(
                "rank {} exited {:?}; its output:\n{}",
                o.rank, o.code, o.output
            ));
        }
    }
    assert!(failed.is_empty(), "{test}:\n{}", failed.join("\n"));
}

pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// This process's GPU: `LOCAL_RANK`'s, modulo the GPUs there are (one GPU: all share it).
pub(crate) fn my_device() -> Arc<Device> {
    let local: usize = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(
        driver_present(),
        "these tests need a CUDA driver, and there is none here"
    );
    let n = cudarc::driver::CudaContext::device_count().expect("cuDeviceGetCount") as usize;
    assert!(n >= 1, "these tests need a GPU, and there is none here");
    let ordinal = local % n;
    eprintln!("LOCAL_RANK {local}: GPU {ordinal} of {n}");
    super::device_at(ordinal)
}

/// `LOCAL_RANK`'s GPU ordinal, modulo the GPUs there are.
pub(crate) fn my_ordinal() -> usize {
    let local: usize = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let n = cudarc::driver::CudaContext::device_count().expect("cuDeviceGetCount") as usize;
    local % n.max(1)
}
