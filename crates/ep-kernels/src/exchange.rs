//! Small collectives between the processes of a job on the host: an all-gather of byte blobs
//! (IPC handles, arena sizes) and a barrier. Not NVSHMEM-specific: the normal mode uses it to
//! map the arenas of ranks in other processes ([`crate::gpu::NormalGroup::with_peers`]).
//!
//! - [`Exchange`]: what a group needs (implement it over torch.distributed, MPI, ... to reuse
//!   the job's own channel);
//! - [`TcpExchange`]: a star over TCP set up by the same rendezvous as NVSHMEM's unique id
//!   ([`TcpRendezvous`]: address, session token, timeout; loopback by default). Process 0 keeps
//!   one connection per other process for the exchange's lifetime.
//!
//! Wire protocol (little endian), after the rendezvous hello with magic `b"EPXCH001"`:
//! client → root: `op u64`, `len u32`, `len` bytes; root → client: status `u8`, then (0) `op
//! u64` and per process `len u32` + bytes, or (1) a `u16` length and a UTF-8 reason (the root
//! failed the op, e.g. another process never sent its blob). `op` counts the collectives from
//! 1, so processes out of step are an error, not a mixed-up result.
//!
//! Every wait is bounded by the timeout (per collective); the error names who was awaited. An
//! exchange that failed once stays failed ([`Error::ExchangeFailed`]): its streams may be
//! mid-frame.

use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::nvshmem::rendezvous::{
    TcpRendezvous, is_timeout, put_reason, read_exact_by, read_reason, write_all_by,
};

/// Largest blob one process may contribute (the protocol's sanity bound).
pub const MAX_BLOB_BYTES: usize = 1 << 20;

const MAGIC: &[u8; 8] = b"EPXCH001";

/// Host collectives among `world()` processes, this one being `rank()`. Every process calls
/// the same collectives in the same order.
pub trait Exchange: std::fmt::Debug + Send {
    /// This process's index.
    fn rank(&self) -> u32;
    /// Number of processes.
    fn world(&self) -> u32;
    /// Every process's `blob` (at most [`MAX_BLOB_BYTES`]), in process order.
    fn all_gather(&mut self, blob: &[u8]) -> Result<Vec<Vec<u8>>>;
    /// Returns once every process has called it.
    fn barrier(&mut self) -> Result<()> {
        self.all_gather(&[]).map(drop)
    }
}

#[derive(Debug)]
enum Role {
    /// Process 0: the streams of processes `1..world`, in order.
    Root(Vec<TcpStream>),
    /// Every other process: the stream to process 0.
    Client(TcpStream),
    /// A world of one.
    Alone,
}

/// [`Exchange`] over a TCP star (module docs).
#[derive(Debug)]
pub struct TcpExchange {
    rdv: TcpRendezvous,
    rank: u32,
    world: u32,
    role: Role,
    op: u64,
    timeout: Duration,
    failed: Option<String>,
}

/// What a collective's errors name.
struct Op<'a> {
    rdv: &'a TcpRendezvous,
    rank: u32,
    world: u32,
    op: u64,
    timeout: Duration,
    deadline: Instant,
}

impl Op<'_> {
    fn failed(&self, reason: String) -> Error {
        Error::ExchangeFailed {
            rank: self.rank,
            op: self.op,
            reason,
        }
    }

    /// A socket error while waiting for `who`: a timeout names it, an EOF says it went away.
    fn io_err(&self, who: &str, op: &'static str) -> impl FnOnce(std::io::Error) -> Error + '_ {
        let who = who.to_string();
        move |e| {
            if is_timeout(&e) {
                Error::RendezvousTimeout {
                    rank: self.rank,
                    waiting_for: who,
                    addr: self.rdv.addr(),
                    timeout: self.timeout,
                }
            } else if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
            ) {
                self.failed(format!(
                    "waiting for {who}: the connection closed ({e}); that process failed or exited"
                ))
            } else {
                self.rdv.io(op)(e)
            }
        }
    }

    /// Reads a `u64` op number and a `u32` length, checked.
    fn read_head(&self, s: &mut TcpStream, who: &str) -> Result<(u64, usize)> {
        let mut op = [0u8; 8];
        let mut len = [0u8; 4];
        read_exact_by(s, &mut op, self.deadline).map_err(self.io_err(who, "read"))?;
        read_exact_by(s, &mut len, self.deadline).map_err(self.io_err(who, "read"))?;
        Ok((u64::from_le_bytes(op), u32::from_le_bytes(len) as usize))
    }

    fn read_blob(&self, s: &mut TcpStream, len: usize, who: &str) -> Result<Vec<u8>> {
        if len > MAX_BLOB_BYTES {
            return Err(self.failed(format!("{who} has {len} bytes, at most {MAX_BLOB_BYTES}")));
        }
        let mut b = vec![0u8; len];
        read_exact_by(s, &mut b, self.deadline).map_err(self.io_err(who, "read"))?;
        Ok(b)
    }

    fn out_of_step(&self, who: &str, theirs: u64) -> Error {
        self.failed(format!(
            "{who} is for exchange #{theirs}, this is #{}: the processes do not call the same collectives in the same order",
            self.op
        ))
    }

    fn root(&self, clients: &mut [TcpStream], mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut blobs = vec![mine.to_vec()];
        let mut err = None;
        for (i, s) in clients.iter_mut().enumerate() {
            let who = format!("rank {}'s blob of exchange #{}", i + 1, self.op);
            let got = self.read_head(s, &who).and_then(|(op, len)| {
                if op != self.op {
                    return Err(self.out_of_step(&who, op));
                }
                self.read_blob(s, len, &who)
            });
            match got {
                Ok(b) => blobs.push(b),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let mut reply = Vec::new();
        match &err {
            None => {
                reply.push(0);
                reply.extend_from_slice(&self.op.to_le_bytes());
                for b in &blobs {
                    reply.extend_from_slice(&(b.len() as u32).to_le_bytes());
                    reply.extend_from_slice(b);
                }
            }
            Some(e) => {
                reply.push(1);
                put_reason(&mut reply, &format!("rank 0 reports: {e}"));
            }
        }
        // Everyone hears the outcome, a failure included (best effort then: some may be gone).
        let send_by = match err {
            None => self.deadline,
            Some(_) => Instant::now() + Duration::from_secs(1),
        };
        for (i, s) in clients.iter_mut().enumerate() {
            if let Err(e) = write_all_by(s, &reply, send_by)
                && err.is_none()
            {
                err = Some(self
                    .io_err(&format!("rank {} to take the blobs", i + 1), "send")(
                    e
                ));
            }
        }
        match err {
            None => Ok(blobs),
            Some(e) => Err(e),
        }
    }

    fn client(&self, s: &mut TcpStream, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let who = format!(
            "rank 0 (the root) to answer exchange #{} (it waits for every process's blob)",
            self.op
        );
        let mut frame = Vec::with_capacity(12 + mine.len());
        frame.extend_from_slice(&self.op.to_le_bytes());
        frame.extend_from_slice(&(mine.len() as u32).to_le_bytes());
        frame.extend_from_slice(mine);
        write_all_by(s, &frame, self.deadline).map_err(self.io_err(&who, "send blob"))?;
        let mut status = [0u8; 1];
        read_exact_by(s, &mut status, self.deadline).map_err(self.io_err(&who, "read status"))?;
        if status[0] != 0 {
            let reason = read_reason(s, self.deadline).map_err(self.io_err(&who, "read reason"))?;
            return Err(self.failed(reason));
        }
        let mut op = [0u8; 8];
        read_exact_by(s, &mut op, self.deadline).map_err(self.io_err(&who, "read blobs"))?;
        let op = u64::from_le_bytes(op);
        if op != self.op {
            return Err(self.out_of_step("the root's answer", op));
        }
        let mut blobs = Vec::with_capacity(self.world as usize);
        for r in 0..self.world {
            let mut len = [0u8; 4];
            read_exact_by(s, &mut len, self.deadline).map_err(self.io_err(&who, "read blobs"))?;
            let what = format!("rank {r}'s blob from the root");
            blobs.push(self.read_blob(s, u32::from_le_bytes(len) as usize, &what)?);
        }
        Ok(blobs)
    }
}

impl TcpExchange {
    /// Connects process `rank` of `world`: process 0 listens on the rendezvous address until
    /// every other process joined, the others connect (retrying until it listens). Bounded by
    /// the rendezvous timeout.
    pub fn connect(rdv: &TcpRendezvous, rank: u32, world: u32) -> Result<Self> {
        if rank >= world {
            return Err(Error::BadRank { rank, world });
        }
        let role = if world == 1 {
            Role::Alone
        } else if rank == 0 {
            Role::Root(
                rdv.accept_clients(MAGIC, world, &[])?
                    .into_iter()
                    .flatten()
                    .collect(),
            )
        } else {
            let waiting_for = "rank 0 (the root) to accept the exchange connection";
            Role::Client(rdv.join(MAGIC, rank, world, waiting_for)?.0)
        };
        Ok(Self {
            rdv: rdv.clone(),
            rank,
            world,
            role,
            op: 0,
            timeout: rdv.timeout(),
            failed: None,
        })
    }

    /// From the launcher's environment: the rendezvous of [`TcpRendezvous::from_env`], rank and
    /// world from `RANK` and `WORLD_SIZE` ([`crate::nvshmem::launch::rank_from_env`]).
    pub fn from_env() -> Result<Self> {
        let (rank, world) = crate::nvshmem::launch::rank_from_env()?;
        Self::connect(&TcpRendezvous::from_env()?, rank, world)
    }

    /// The bound on each collective (default: the rendezvous timeout).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
}

impl Exchange for TcpExchange {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    fn all_gather(&mut self, blob: &[u8]) -> Result<Vec<Vec<u8>>> {
        if let Some(cause) = &self.failed {
            return Err(Error::ExchangeFailed {
                rank: self.rank,
                op: self.op,
                reason: format!("an earlier collective failed ({cause}); create a new exchange"),
            });
        }
        if blob.len() > MAX_BLOB_BYTES {
            return Err(Error::ExchangeFailed {
                rank: self.rank,
                op: self.op + 1,
                reason: format!("a blob of {} bytes, at most {MAX_BLOB_BYTES}", blob.len()),
            });
        }
        self.op += 1;
        let op = Op {
            rdv: &self.rdv,
            rank: self.rank,
            world: self.world,
            op: self.op,
            timeout: self.timeout,
            deadline: Instant::now() + self.timeout,
        };
        let res = match &mut self.role {
            Role::Alone => Ok(vec![blob.to_vec()]),
            Role::Root(clients) => op.root(clients, blob),
            Role::Client(s) => op.client(s, blob),
        };
        if let Err(e) = &res {
            self.failed = Some(e.to_string());
        }
        res
    }
}
