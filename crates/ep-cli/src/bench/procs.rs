//! `ep bench --backend gpu --procs N`: one rank per process, the deployment shape. The command
//! started by the user is the launcher: it starts N copies of itself (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, a loopback rendezvous with a session token: `ep_kernels::nvshmem::launch`),
//! waits for them (bounded) and prints what each said. Each copy is one rank: its GPU
//! (`LOCAL_RANK % GPUs`), its `NormalGroup::new_process` over the TCP exchange, its figures.

use std::sync::Arc;
use std::time::Duration;

use ep_kernels::exchange::{Exchange, TcpExchange};
use ep_kernels::gpu::Device;
use ep_kernels::nvshmem::env::EnvEntry;
use ep_kernels::nvshmem::launch::{RankLaunch, launch_ranks, rank_from_env, vars};

use super::error::BenchError;
use super::gpu::gpu_err;

/// Bound on the whole multi-process run (the launcher kills ranks still running then).
const RUN_BOUND: Duration = Duration::from_secs(1200);

/// What this process is in a `--procs` run.
pub(super) enum Role {
    /// Started by the user: starts the ranks.
    Launcher,
    /// One rank, started by the launcher.
    Rank { rank: usize, world: usize },
}

/// The role from the environment the launcher sets.
pub(super) fn role() -> Role {
    if std::env::var(vars::ROLE).is_ok_and(|v| v == "child")
        && let Ok((rank, world)) = rank_from_env()
    {
        return Role::Rank {
            rank: rank as usize,
            world: world as usize,
        };
    }
    Role::Launcher
}

/// Starts `n` rank processes running this command (with the environment `plan`: NVSHMEM's, for
/// low-latency mode; user values kept) and prints their outputs in rank order; the
/// exit code is the first non-zero one (3 for a rank killed by a signal or the bound).
pub(super) fn launch(n: usize, plan: Vec<EnvEntry>) -> Result<i32, BenchError> {
    if n == 0 || n > ep_kernels::gpu::normal::MAX_RANKS {
        return Err(BenchError::Usage(format!(
            "--procs {n}: use 1 to {} (one rank per process)",
            ep_kernels::gpu::normal::MAX_RANKS
        )));
    }
    let program = std::env::current_exe().map_err(|e| {
        BenchError::Usage(format!(
            "--procs: cannot find this program to start its ranks: {e}"
        ))
    })?;
    let l = RankLaunch {
        program,
        args: std::env::args().skip(1).collect(),
        world: n as u32,
        plan,
        extra_env: Vec::new(),
        timeout: RUN_BOUND,
    };
    println!("ep bench: starting {n} rank processes (one rank each)");
    let res = launch_ranks(&l).map_err(gpu_err("starting the rank processes"))?;
    let mut code = 0;
    for o in &res.outcomes {
        println!(
            "--- rank {} ({})",
            o.rank,
            match o.code {
                Some(c) => format!("exit {c}"),
                None => "killed".into(),
            }
        );
        print!("{}", o.output);
        if code == 0 {
            code = o.code.unwrap_or(3);
        }
    }
    Ok(code)
}

/// This rank's GPU: `LOCAL_RANK % GPUs` (several ranks share a GPU when there are fewer GPUs).
pub(super) fn device() -> ep_kernels::Result<Arc<Device>> {
    let local: usize = std::env::var(vars::LOCAL_RANK)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Device::open(local % Device::count()?.max(1))
}

/// This rank's exchange with the others (the launcher's rendezvous).
pub(super) fn exchange() -> Result<Box<dyn Exchange>, BenchError> {
    TcpExchange::from_env()
        .map(|x| Box::new(x) as Box<dyn Exchange>)
        .map_err(gpu_err("joining the other rank processes"))
}
