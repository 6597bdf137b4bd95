//! What came up after `nvshmemx_hostlib_init_attr`: which transport plugins NVSHMEM loaded,
//! which it reported failing ("init failed for transport: IBGDA"), which peers are reachable
//! by load/store (P2P over NVLink), and whether IBGDA is live or NVSHMEM fell back.
//!
//! NVSHMEM's public API has no transport query, so the report combines three observations: the
//! `nvshmem_transport_*.so` plugins mapped in this process (`/proc/self/maps`), NVSHMEM's own
//! init messages on stderr (stdout and stderr captured during init by [`FdTee`]), and `nvshmem_ptr` per peer.

use std::fmt;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvshmem_sys::Version;

/// IBGDA after init.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IbgdaState {
    /// `NVSHMEM_IB_ENABLE_IBGDA` was not set to a true value.
    NotRequested,
    /// Requested, its plugin is loaded and NVSHMEM reported no failure.
    Live,
    /// Requested but NVSHMEM fell back to other transports.
    FellBack {
        /// The evidence.
        reason: String,
    },
}

impl fmt::Display for IbgdaState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IbgdaState::NotRequested => f.write_str("not requested"),
            IbgdaState::Live => f.write_str("live"),
            IbgdaState::FellBack { reason } => {
                write!(f, "requested, NVSHMEM fell back ({reason})")
            }
        }
    }
}

/// The state of NVSHMEM after a successful init on this rank.
#[derive(Clone, Debug)]
pub struct InitReport {
    /// Library version.
    pub version: Version,
    /// Library file.
    pub library: PathBuf,
    /// How the ranks found each other.
    pub bootstrap: String,
    /// `nvshmem_my_pe`.
    pub pe: u32,
    /// `nvshmem_n_pes`.
    pub n_pes: u32,
    /// CUDA device ordinal used.
    pub device: usize,
    /// The `NVSHMEM_*` variables this process saw at init.
    pub env: Vec<(String, String)>,
    /// Transport plugins mapped into the process (`ibgda`, `ibrc`, `ucx`, ...).
    pub plugins_loaded: Vec<String>,
    /// Transports NVSHMEM said failed to initialise.
    pub failed_transports: Vec<String>,
    /// Peers this GPU can load/store (`nvshmem_ptr` non-NULL), self excluded.
    pub p2p_peers: Vec<u32>,
    /// Peers reached only through a network transport.
    pub remote_peers: Vec<u32>,
    /// IBGDA's state.
    pub ibgda: IbgdaState,
    /// NVSHMEM's stdout and stderr during init, when captured.
    pub init_log: Option<String>,
}

impl InitReport {
    /// Transports that came up: `p2p` when a peer is load/store reachable, plus every loaded
    /// plugin NVSHMEM did not report failing.
    pub fn transports_up(&self) -> Vec<String> {
        let mut up = Vec::new();
        if !self.p2p_peers.is_empty() {
            up.push("p2p".to_string());
        }
        for p in &self.plugins_loaded {
            if !self
                .failed_transports
                .iter()
                .any(|f| f.eq_ignore_ascii_case(p))
            {
                up.push(p.clone());
            }
        }
        up
    }
}

impl fmt::Display for InitReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "NVSHMEM {} ({}), PE {} of {}, device {}",
            self.version,
            self.library.display(),
            self.pe,
            self.n_pes,
            self.device
        )?;
        writeln!(f, "  bootstrap: {}", self.bootstrap)?;
        writeln!(
            f,
            "  transports up: {:?}; plugins loaded: {:?}; failed: {:?}",
            self.transports_up(),
            self.plugins_loaded,
            self.failed_transports
        )?;
        writeln!(
            f,
            "  p2p peers: {:?}; remote peers: {:?}",
            self.p2p_peers, self.remote_peers
        )?;
        writeln!(f, "  ibgda: {}", self.ibgda)?;
        let env: Vec<String> = self.env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        write!(f, "  env: {}", env.join(" "))
    }
}

/// Transport plugin names mapped into this process, from `/proc/self/maps`.
pub fn mapped_transport_plugins() -> Vec<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    parse_plugins(&maps)
}

pub(crate) fn parse_plugins(maps: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in maps.lines() {
        let Some(path) = line.split_whitespace().nth(5) else {
            continue;
        };
        let file = path.rsplit('/').next().unwrap_or(path);
        if let Some(rest) = file.strip_prefix("nvshmem_transport_") {
            let name = rest.split(".so").next().unwrap_or(rest).to_string();
            if !out.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

/// Transports named in NVSHMEM's "init failed for transport: X" messages, lower-cased.
pub fn failed_transports(log: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in log.lines() {
        if let Some(pos) = line.find("init failed for transport:") {
            let name = line[pos + "init failed for transport:".len()..]
                .trim()
                .split(|c: char| c.is_whitespace() || c == ',')
                .next()
                .unwrap_or("")
                .to_ascii_lowercase();
            if !name.is_empty() && !out.contains(&name) {
                out.push(name);
            }
        }
    }
    out
}

/// Decides IBGDA's state from what was requested and observed.
pub fn ibgda_state(requested: bool, plugins: &[String], failed: &[String]) -> IbgdaState {
    if !requested {
        return IbgdaState::NotRequested;
    }
    if failed.iter().any(|f| f == "ibgda") {
        return IbgdaState::FellBack {
            reason: "NVSHMEM reported: init failed for transport: IBGDA".into(),
        };
    }
    if !plugins.iter().any(|p| p == "ibgda") {
        return IbgdaState::FellBack {
            reason: "the IBGDA transport plugin was not loaded".into(),
        };
    }
    IbgdaState::Live
}

/// Whether an NVSHMEM boolean variable is true (`1`, `true`, `yes`, `y`, `on`).
pub fn env_true(value: Option<&str>) -> bool {
    matches!(
        value.map(|v| v.trim().to_ascii_lowercase()).as_deref(),
        Some("1" | "true" | "yes" | "y" | "on" | "t")
    )
}

/// Copies everything written to a file descriptor (stdout or stderr) into a buffer while still
/// forwarding it to the original destination, until [`FdTee::finish`].
///
/// Redirecting fd 1 or 2 is process-wide: other threads' output during the capture is
/// forwarded too (and lands in the buffer).
pub struct FdTee {
    fd: i32,
    saved: OwnedFd,
    buffer: Arc<Mutex<Vec<u8>>>,
    reader: Option<JoinHandle<()>>,
}

impl FdTee {
    /// Starts capturing stderr.
    pub fn stderr() -> Option<Self> {
        Self::start(2)
    }

    /// Starts capturing stdout (flushing Rust's buffered stdout first).
    pub fn stdout() -> Option<Self> {
        let _ = std::io::stdout().flush();
        Self::start(1)
    }

    /// Starts capturing `fd` (1 or 2); `None` when the pipe cannot be set up (then nothing is
    /// captured).
    fn start(fd: i32) -> Option<Self> {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and owned by us alone.
        let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: duplicating fd 1 or 2, open for the whole process lifetime.
        let saved = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
        if saved < 0 {
            return None;
        }
        // SAFETY: `saved` is a fresh descriptor we own.
        let saved = unsafe { OwnedFd::from_raw_fd(saved) };
        let fwd = saved.try_clone().ok()?;
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let all = Arc::clone(&buffer);
        let reader = std::thread::spawn(move || {
            let mut rd = std::fs::File::from(rd);
            let mut fwd = std::fs::File::from(fwd);
            let mut buf = [0u8; 4096];
            // Ends when every write end is closed (`fd` restored and `wr` dropped).
            while let Ok(n) = rd.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let _ = fwd.write_all(&buf[..n]);
                if let Ok(mut all) = all.lock() {
                    all.extend_from_slice(&buf[..n]);
                }
            }
        });
        use std::os::fd::AsRawFd;
        // SAFETY: both descriptors are open; dup2 atomically makes `fd` the pipe's write end.
        if unsafe { libc::dup2(wr.as_raw_fd(), fd) } < 0 {
            return None;
        }
        drop(wr);
        Some(Self {
            fd,
            saved,
            buffer,
            reader: Some(reader),
        })
    }

    /// Restores the descriptor and returns what was written meanwhile. Waits at most one second for
    /// the pipe to drain (a process that inherited the pipe could keep it open).
    pub fn finish(mut self) -> String {
        self.restore();
        if let Some(r) = self.reader.take() {
            let deadline = Instant::now() + Duration::from_secs(1);
            while !r.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(2));
            }
            if r.is_finished() {
                let _ = r.join();
            }
        }
        let bytes = self.buffer.lock().map(|b| b.clone()).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn restore(&mut self) {
        use std::os::fd::AsRawFd;
        if self.fd == 1 {
            let _ = std::io::stdout().flush();
        }
        // SAFETY: `saved` is the original descriptor, open; this closes the pipe's last write
        // end.
        unsafe { libc::dup2(self.saved.as_raw_fd(), self.fd) };
    }
}

impl Drop for FdTee {
    fn drop(&mut self) {
        if self.reader.is_some() {
            self.restore();
        }
    }
}
