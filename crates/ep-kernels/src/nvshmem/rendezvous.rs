//! Unique-id bootstrap: rank 0 creates NVSHMEM's 128-byte unique id, every rank needs it before
//! `nvshmemx_hostlib_init_attr` (spec §1.2 step 3). [`Rendezvous`] is how it travels:
//!
//! - [`TcpRendezvous`]: rank 0 serves the id over TCP on loopback or a given address (one node,
//!   or a launcher-provided address), never on all interfaces unless asked; every client proves
//!   it belongs to the session with a shared token; every wait is bounded.
//! - [`CallerFedRendezvous`]: the caller carries the id (torch.distributed, MPI, a job
//!   scheduler) and hands the bytes in.
//!
//! Wire protocol (little endian), one connection per non-root rank:
//! client → root: `b"EPRDV001"`, token length `u16`, token bytes, rank `u32`, world `u32`;
//! root → client: status `u8` (0 ok, 1 refused), then 128 id bytes (ok) or a `u16` length and a
//! UTF-8 reason (refused).
//!
//! The star itself (root accepts every client rank after a hello with a magic and the token,
//! clients join with retries, reads and writes bounded by a deadline) is shared with
//! [`crate::exchange::TcpExchange`], which keeps the connections for all-gathers and barriers.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Bytes of an NVSHMEM unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// An NVSHMEM unique id as it travels between ranks.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id holds the root's bootstrap address; show only a fingerprint.
        let sum = self
            .0
            .iter()
            .fold(0u32, |a, b| a.rotate_left(5) ^ u32::from(*b));
        write!(f, "UniqueId(#{sum:08x})")
    }
}

impl UniqueId {
    /// From a caller's buffer (exactly 128 bytes).
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| Error::UniqueId {
            reason: format!(
                "{} bytes given, an NVSHMEM unique id has {UNIQUE_ID_BYTES}",
                bytes.len()
            ),
        })?;
        Ok(Self(arr))
    }
}

/// How the root's unique id reaches every rank.
pub trait Rendezvous {
    /// Returns the id every rank uses. Only rank 0 may call `make_root_id` (it creates the id);
    /// implementations whose id comes from elsewhere never call it.
    fn unique_id(
        &self,
        rank: u32,
        world: u32,
        make_root_id: &mut dyn FnMut() -> Result<UniqueId>,
    ) -> Result<UniqueId>;
}

/// A job of one process (one PE, e.g. co-resident ranks as regions of its heap): it is its own
/// root, so the id is created here and goes nowhere.
#[derive(Clone, Copy, Debug, Default)]
pub struct SoloRendezvous;

impl Rendezvous for SoloRendezvous {
    fn unique_id(
        &self,
        rank: u32,
        world: u32,
        make_root_id: &mut dyn FnMut() -> Result<UniqueId>,
    ) -> Result<UniqueId> {
        if rank != 0 || world != 1 {
            return Err(Error::BadRank { rank, world });
        }
        make_root_id()
    }
}

/// The caller already holds the root's id (it created it with
/// [`crate::nvshmem::create_unique_id`] on rank 0 and broadcast it its own way).
#[derive(Clone, Debug)]
pub struct CallerFedRendezvous {
    id: UniqueId,
}

impl CallerFedRendezvous {
    /// The 128 bytes every rank received.
    pub fn new(bytes: &[u8]) -> Result<Self> {
        Ok(Self {
            id: UniqueId::from_slice(bytes)?,
        })
    }
}

impl Rendezvous for CallerFedRendezvous {
    fn unique_id(
        &self,
        rank: u32,
        world: u32,
        _: &mut dyn FnMut() -> Result<UniqueId>,
    ) -> Result<UniqueId> {
        if rank >= world {
            return Err(Error::BadRank { rank, world });
        }
        Ok(self.id)
    }
}

/// A shared secret proving a connection belongs to this job (at least 16 bytes).
#[derive(Clone, PartialEq, Eq)]
pub struct SessionToken(Vec<u8>);

impl std::fmt::Debug for SessionToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SessionToken(<{} bytes>)", self.0.len())
    }
}

impl SessionToken {
    /// Minimum token length in bytes.
    pub const MIN_LEN: usize = 16;

    /// A token from a launcher-provided string.
    pub fn new(token: impl Into<Vec<u8>>) -> Result<Self> {
        let t = token.into();
        if t.len() < Self::MIN_LEN || t.len() > 1024 {
            return Err(Error::RendezvousToken {
                reason: format!("{} bytes; it must have {}..=1024", t.len(), Self::MIN_LEN),
            });
        }
        Ok(Self(t))
    }

    /// 32 random bytes from the OS, hex encoded (the launcher passes it to every rank).
    pub fn random() -> Result<Self> {
        let mut raw = [0u8; 32];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut raw))
            .map_err(|e| Error::RendezvousToken {
                reason: format!("reading /dev/urandom: {e}"),
            })?;
        Ok(Self(
            raw.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into_bytes(),
        ))
    }

    /// The token as text (for an environment variable).
    pub fn as_str(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    fn matches(&self, other: &[u8]) -> bool {
        // Constant time in the token's content.
        self.0.len() == other.len()
            && self.0.iter().zip(other).fold(0u8, |a, (x, y)| a | (x ^ y)) == 0
    }
}

/// Environment variable names [`TcpRendezvous::from_env`] reads.
pub mod env_names {
    /// `host:port` rank 0 listens on (default `127.0.0.1:$EP_RENDEZVOUS_PORT`).
    pub const ADDR: &str = "EP_RENDEZVOUS_ADDR";
    /// Port on loopback when no address is given.
    pub const PORT: &str = "EP_RENDEZVOUS_PORT";
    /// The session token (required).
    pub const TOKEN: &str = "EP_RENDEZVOUS_TOKEN";
    /// Overall timeout in milliseconds (default 60000).
    pub const TIMEOUT_MS: &str = "EP_RENDEZVOUS_TIMEOUT_MS";
}

const MAGIC: &[u8; 8] = b"EPRDV001";
/// Per-connection I/O bound, well below the overall timeout.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
const POLL: Duration = Duration::from_millis(5);

/// TCP rendezvous: rank 0 listens, the others connect and receive the id.
#[derive(Clone, Debug)]
pub struct TcpRendezvous {
    addr: SocketAddr,
    token: SessionToken,
    timeout: Duration,
    allow_all_interfaces: bool,
}

impl TcpRendezvous {
    /// On `127.0.0.1:port` (one node).
    pub fn loopback(port: u16, token: SessionToken) -> Self {
        Self::new(
            SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)),
            token,
        )
    }

    /// On a given address (e.g. the launcher's master address); rank 0 must own it.
    pub fn new(addr: SocketAddr, token: SessionToken) -> Self {
        Self {
            addr,
            token,
            timeout: Duration::from_secs(60),
            allow_all_interfaces: false,
        }
    }

    /// From `EP_RENDEZVOUS_ADDR` or `EP_RENDEZVOUS_PORT`, `EP_RENDEZVOUS_TOKEN`,
    /// `EP_RENDEZVOUS_TIMEOUT_MS` (see [`env_names`]).
    pub fn from_env() -> Result<Self> {
        let get = |v: &str| std::env::var(v).ok().filter(|s| !s.is_empty());
        let bad = |var: &str, reason: String| Error::Env {
            var: var.into(),
            reason,
        };
        let addr: SocketAddr = match (get(env_names::ADDR), get(env_names::PORT)) {
            (Some(a), _) => a
                .parse()
                .map_err(|e| bad(env_names::ADDR, format!("{a:?}: {e}")))?,
            (None, Some(p)) => {
                let port = p
                    .parse()
                    .map_err(|e| bad(env_names::PORT, format!("{p:?}: {e}")))?;
                SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
            }
            (None, None) => {
                return Err(bad(
                    env_names::ADDR,
                    format!("neither it nor {} is set", env_names::PORT),
                ));
            }
        };
        let token = get(env_names::TOKEN).ok_or_else(|| bad(env_names::TOKEN, "not set".into()))?;
        let mut r = Self::new(addr, SessionToken::new(token)?);
        if let Some(ms) = get(env_names::TIMEOUT_MS) {
            let ms: u64 = ms
                .parse()
                .map_err(|e| bad(env_names::TIMEOUT_MS, format!("{ms:?}: {e}")))?;
            r.timeout = Duration::from_millis(ms);
        }
        Ok(r)
    }

    /// The overall bound on the exchange (default 60 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Allows `0.0.0.0` / `::` (listening on every interface). Off by default.
    pub fn allow_all_interfaces(mut self, allow: bool) -> Self {
        self.allow_all_interfaces = allow;
        self
    }

    /// The address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub(crate) fn io(&self, op: &'static str) -> impl FnOnce(std::io::Error) -> Error + '_ {
        move |source| Error::RendezvousIo {
            op,
            addr: self.addr,
            source,
        }
    }

    /// The overall bound on one exchange.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    fn serve(&self, world: u32, id: &UniqueId) -> Result<()> {
        self.accept_clients(MAGIC, world, &id.0).map(drop)
    }

    /// Root side of a star: listens until every client rank `1..world` has said a valid hello
    /// with `magic` (bad clients are refused and the wait goes on), replies status 0 and
    /// `ok_payload` to each, and returns the streams by rank (`[0]` is `None`). Bounded by the
    /// timeout; the error names the ranks that never connected.
    pub(crate) fn accept_clients(
        &self,
        magic: &[u8; 8],
        world: u32,
        ok_payload: &[u8],
    ) -> Result<Vec<Option<TcpStream>>> {
        if self.addr.ip().is_unspecified() && !self.allow_all_interfaces {
            return Err(Error::RendezvousUnspecifiedAddress { addr: self.addr });
        }
        let listener = TcpListener::bind(self.addr).map_err(self.io("bind"))?;
        listener
            .set_nonblocking(true)
            .map_err(self.io("set_nonblocking"))?;
        let deadline = Instant::now() + self.timeout;
        let mut clients: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let joined = |c: &[Option<TcpStream>]| -> Vec<bool> {
            c.iter()
                .enumerate()
                .map(|(i, s)| i == 0 || s.is_some())
                .collect()
        };
        while joined(&clients).iter().any(|j| !j) {
            match listener.accept() {
                Ok((stream, _)) => {
                    // A bad client is refused and the root keeps waiting for the real ones.
                    let served = joined(&clients);
                    if let Some((rank, s)) =
                        self.serve_one(stream, magic, world, &served, ok_payload)
                    {
                        clients[rank as usize] = Some(s);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = joined(&clients)
                            .iter()
                            .enumerate()
                            .filter(|(_, s)| !**s)
                            .map(|(i, _)| i)
                            .collect();
                        return Err(Error::RendezvousTimeout {
                            rank: 0,
                            waiting_for: format!("ranks {missing:?} to connect"),
                            addr: self.addr,
                            timeout: self.timeout,
                        });
                    }
                    std::thread::sleep(POLL);
                }
                Err(e) => return Err(self.io("accept")(e)),
            }
        }
        Ok(clients)
    }

    /// Handles one connection; `Some((rank, stream))` when that rank was accepted.
    fn serve_one(
        &self,
        mut s: TcpStream,
        magic: &[u8; 8],
        world: u32,
        served: &[bool],
        ok_payload: &[u8],
    ) -> Option<(u32, TcpStream)> {
        let hello = (|| -> std::io::Result<(Vec<u8>, Vec<u8>, u32, u32)> {
            s.set_nonblocking(false)?;
            s.set_read_timeout(Some(IO_TIMEOUT))?;
            s.set_write_timeout(Some(IO_TIMEOUT))?;
            let mut magic = [0u8; 8];
            s.read_exact(&mut magic)?;
            let mut len = [0u8; 2];
            s.read_exact(&mut len)?;
            let len = usize::from(u16::from_le_bytes(len)).min(1024);
            let mut token = vec![0u8; len];
            s.read_exact(&mut token)?;
            let mut rw = [0u8; 8];
            s.read_exact(&mut rw)?;
            let rank = u32::from_le_bytes([rw[0], rw[1], rw[2], rw[3]]);
            let w = u32::from_le_bytes([rw[4], rw[5], rw[6], rw[7]]);
            Ok((magic.to_vec(), token, rank, w))
        })();
        // A client that cannot even say hello is dropped; it is not one of ours or it died.
        let Ok((got_magic, token, rank, w)) = hello else {
            return None;
        };
        let refusal = if got_magic != magic {
            Some("not an ep-rs rendezvous client of this kind".to_string())
        } else if !self.token.matches(&token) {
            Some("wrong session token".to_string())
        } else if w != world {
            Some(format!("world size {w}, the root has {world}"))
        } else if rank == 0 || rank >= world {
            Some(format!(
                "rank {rank} is not a client rank of a world of {world}"
            ))
        } else if served[rank as usize] {
            Some(format!("rank {rank} already connected"))
        } else {
            None
        };
        let mut reply = Vec::with_capacity(1 + ok_payload.len());
        match &refusal {
            None => {
                reply.push(0);
                reply.extend_from_slice(ok_payload);
            }
            Some(reason) => {
                reply.push(1);
                put_reason(&mut reply, reason);
            }
        }
        if s.write_all(&reply).and_then(|_| s.flush()).is_err() {
            return None;
        }
        if refusal.is_none() {
            Some((rank, s))
        } else {
            None
        }
    }

    fn fetch(&self, rank: u32, world: u32) -> Result<UniqueId> {
        let waiting_for = "rank 0 (the root) to serve the unique id";
        let (mut s, deadline) = self.join(MAGIC, rank, world, waiting_for)?;
        let mut id = [0u8; UNIQUE_ID_BYTES];
        read_exact_by(&mut s, &mut id, deadline).map_err(self.client_err(
            rank,
            waiting_for,
            "read unique id",
        ))?;
        Ok(UniqueId(id))
    }

    /// Client side of a star: connects to the root (retrying while it is not listening yet),
    /// says hello with `magic`, and returns the stream once the root accepted it, with the
    /// deadline of the whole join. A refusal is [`Error::RendezvousRefused`]; running out of
    /// time is [`Error::RendezvousTimeout`] naming `waiting_for`.
    pub(crate) fn join(
        &self,
        magic: &[u8; 8],
        rank: u32,
        world: u32,
        waiting_for: &str,
    ) -> Result<(TcpStream, Instant)> {
        let deadline = Instant::now() + self.timeout;
        // The root may not be listening yet: retry connecting until the deadline.
        let mut s = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.timeout_err(rank, waiting_for));
            }
            match TcpStream::connect_timeout(&self.addr, left.min(IO_TIMEOUT)) {
                Ok(s) => break s,
                Err(_) => std::thread::sleep(Duration::from_millis(20).min(left)),
            }
        };
        let mut hello = Vec::new();
        hello.extend_from_slice(magic);
        hello.extend_from_slice(&(self.token.0.len() as u16).to_le_bytes());
        hello.extend_from_slice(&self.token.0);
        hello.extend_from_slice(&rank.to_le_bytes());
        hello.extend_from_slice(&world.to_le_bytes());
        write_all_by(&mut s, &hello, deadline).map_err(self.client_err(
            rank,
            waiting_for,
            "send hello",
        ))?;
        let mut status = [0u8; 1];
        read_exact_by(&mut s, &mut status, deadline).map_err(self.client_err(
            rank,
            waiting_for,
            "read status",
        ))?;
        if status[0] == 0 {
            return Ok((s, deadline));
        }
        let reason = read_reason(&mut s, deadline).map_err(self.client_err(
            rank,
            waiting_for,
            "read refusal",
        ))?;
        Err(Error::RendezvousRefused {
            rank,
            addr: self.addr,
            reason,
        })
    }

    pub(crate) fn timeout_err(&self, rank: u32, waiting_for: &str) -> Error {
        Error::RendezvousTimeout {
            rank,
            waiting_for: waiting_for.into(),
            addr: self.addr,
            timeout: self.timeout,
        }
    }

    /// A socket error of a client as an error: a timeout names who was awaited.
    pub(crate) fn client_err<'a>(
        &'a self,
        rank: u32,
        waiting_for: &'a str,
        op: &'static str,
    ) -> impl FnOnce(std::io::Error) -> Error + 'a {
        move |e| {
            if is_timeout(&e) {
                self.timeout_err(rank, waiting_for)
            } else {
                self.io(op)(e)
            }
        }
    }
}

/// Whether a socket error is a timeout (`SO_RCVTIMEO`/`SO_SNDTIMEO` or our deadline).
pub(crate) fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn left_until(deadline: Instant) -> std::io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    Ok(left)
}

/// `read_exact` that gives up at `deadline` (each read bounded by the time left).
pub(crate) fn read_exact_by(
    s: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.set_read_timeout(Some(left_until(deadline)?))?;
        match s.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `write_all` that gives up at `deadline`.
pub(crate) fn write_all_by(
    s: &mut TcpStream,
    mut buf: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.set_write_timeout(Some(left_until(deadline)?))?;
        match s.write(buf) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    s.flush()
}

/// Appends a refusal or failure reason: `u16` length, UTF-8 (at most 1024 bytes).
pub(crate) fn put_reason(out: &mut Vec<u8>, reason: &str) {
    let mut end = reason.len().min(1024);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&reason.as_bytes()[..end]);
}

/// Reads what [`put_reason`] wrote.
pub(crate) fn read_reason(s: &mut TcpStream, deadline: Instant) -> std::io::Result<String> {
    let mut len = [0u8; 2];
    read_exact_by(s, &mut len, deadline)?;
    let mut reason = vec![0u8; usize::from(u16::from_le_bytes(len))];
    read_exact_by(s, &mut reason, deadline)?;
    Ok(String::from_utf8_lossy(&reason).into())
}

impl Rendezvous for TcpRendezvous {
    fn unique_id(
        &self,
        rank: u32,
        world: u32,
        make_root_id: &mut dyn FnMut() -> Result<UniqueId>,
    ) -> Result<UniqueId> {
        if rank >= world {
            return Err(Error::BadRank { rank, world });
        }
        if rank == 0 {
            let id = make_root_id()?;
            if world > 1 {
                self.serve(world, &id)?;
            }
            Ok(id)
        } else {
            self.fetch(rank, world)
        }
    }
}
