//! Starting one process per rank with the environment plan applied at spawn (no `set_var` in a
//! threaded process), a loopback rendezvous, and a bounded wait. Used by the self-spawning GPU
//! tests and by launch helpers.

use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::env::{Applied, EnvEntry, apply_to_command};
use super::rendezvous::{SessionToken, env_names};
use crate::error::{Error, Result};

/// Variables every rank process receives besides the plan.
pub mod vars {
    /// This process's rank.
    pub const RANK: &str = "RANK";
    /// Number of ranks.
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    /// Rank on this node.
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    /// Marks a process started by [`super::launch_ranks`] (value `child`).
    pub const ROLE: &str = "EP_RANK_ROLE";
}

/// What to start.
#[derive(Clone, Debug)]
pub struct RankLaunch {
    /// The program (often `std::env::current_exe()`).
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Number of ranks.
    pub world: u32,
    /// The NVSHMEM environment plan.
    pub plan: Vec<EnvEntry>,
    /// Other variables for every rank.
    pub extra_env: Vec<(String, String)>,
    /// Bound on the whole run; ranks still running then are killed.
    pub timeout: Duration,
}

/// How one rank ended.
#[derive(Clone, Debug)]
pub struct RankOutcome {
    /// The rank.
    pub rank: u32,
    /// Exit code (`None`: killed by a signal).
    pub code: Option<i32>,
    /// Its stdout and stderr, interleaved by line.
    pub output: String,
}

/// The plan as applied to each rank (the same for all), and how they ended.
#[derive(Clone, Debug)]
pub struct LaunchResult {
    /// The variables as the ranks saw them.
    pub applied: Vec<Applied>,
    /// One per rank, in rank order.
    pub outcomes: Vec<RankOutcome>,
}

/// A free TCP port on 127.0.0.1 (bound, then released for the rank 0 process to take).
pub fn free_loopback_port() -> Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|source| Error::RendezvousIo {
        op: "bind a free port",
        addr: (Ipv4Addr::LOCALHOST, 0).into(),
        source,
    })?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|source| Error::RendezvousIo {
            op: "local_addr",
            addr: (Ipv4Addr::LOCALHOST, 0).into(),
            source,
        })
}

fn pump(rank: u32, r: impl Read + Send + 'static, tag: &'static str) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(r).lines().map_while(std::io::Result::ok) {
            eprintln!("[rank {rank} {tag}] {line}");
            all.push_str(&line);
            all.push('\n');
        }
        all
    })
}

/// Starts `world` processes with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, a loopback rendezvous
/// (`EP_RENDEZVOUS_PORT`, a fresh `EP_RENDEZVOUS_TOKEN`) and the plan, echoes their output
/// prefixed by rank, and waits for all of them within the timeout.
pub fn launch_ranks(l: &RankLaunch) -> Result<LaunchResult> {
    let port = free_loopback_port()?;
    let token = SessionToken::random()?;
    let mut children: Vec<(u32, Child, JoinHandle<String>, JoinHandle<String>)> = Vec::new();
    let mut applied = Vec::new();
    for rank in 0..l.world {
        let mut cmd = Command::new(&l.program);
        cmd.args(&l.args)
            .env(vars::RANK, rank.to_string())
            .env(vars::WORLD_SIZE, l.world.to_string())
            .env(vars::LOCAL_RANK, rank.to_string())
            .env(vars::ROLE, "child")
            .env(env_names::PORT, port.to_string())
            .env(env_names::TOKEN, token.as_str())
            .env(env_names::TIMEOUT_MS, l.timeout.as_millis().to_string())
            .envs(l.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        applied = apply_to_command(&mut cmd, &l.plan);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                return Err(Error::RankProcess {
                    rank,
                    what: format!("could not be spawned ({}): {e}", l.program.display()),
                });
            }
        };
        let out = pump(rank, child.stdout.take().expect("piped"), "out");
        let err = pump(rank, child.stderr.take().expect("piped"), "err");
        children.push((rank, child, out, err));
    }
    let deadline = Instant::now() + l.timeout;
    let mut codes: Vec<Option<Option<i32>>> = vec![None; children.len()];
    while codes.iter().any(Option::is_none) {
        for (i, (_, child, _, _)) in children.iter_mut().enumerate() {
            if codes[i].is_none()
                && let Ok(Some(status)) = child.try_wait()
            {
                codes[i] = Some(status.code());
            }
        }
        if codes.iter().all(Option::is_some) {
            break;
        }
        if Instant::now() >= deadline {
            let running: Vec<u32> = children
                .iter()
                .zip(&codes)
                .filter(|(_, c)| c.is_none())
                .map(|(c, _)| c.0)
                .collect();
            kill_all(&mut children);
            return Err(Error::RankProcess {
                rank: running.first().copied().unwrap_or(0),
                what: format!(
                    "did not finish within {:?} (ranks still running: {running:?}); all ranks killed",
                    l.timeout
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut outcomes = Vec::new();
    for ((rank, _, out, err), code) in children.into_iter().zip(codes) {
        let mut output = out.join().unwrap_or_default();
        output.push_str(&err.join().unwrap_or_default());
        outcomes.push(RankOutcome {
            rank,
            code: code.flatten(),
            output,
        });
    }
    Ok(LaunchResult { applied, outcomes })
}

fn kill_all(children: &mut [(u32, Child, JoinHandle<String>, JoinHandle<String>)]) {
    for (_, c, _, _) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// This process's rank and world when started by [`launch_ranks`] (or any launcher setting
/// `RANK` and `WORLD_SIZE`).
pub fn rank_from_env() -> Result<(u32, u32)> {
    let get = |v: &str| -> Result<u32> {
        let s = std::env::var(v).map_err(|_| Error::Env {
            var: v.into(),
            reason: "not set".into(),
        })?;
        s.parse().map_err(|e| Error::Env {
            var: v.into(),
            reason: format!("{s:?}: {e}"),
        })
    };
    let (rank, world) = (get(vars::RANK)?, get(vars::WORLD_SIZE)?);
    if rank >= world {
        return Err(Error::BadRank { rank, world });
    }
    Ok((rank, world))
}

/// Whether this process is a rank started by [`launch_ranks`].
pub fn is_rank_process() -> bool {
    std::env::var(vars::ROLE).is_ok_and(|v| v == "child")
}
