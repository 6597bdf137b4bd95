//! The host face: collective allocation, reachability, teams and barriers, fabric resources, and
//! execution of a protocol phase.

use super::types::{AllocRequest, FabricParams, Reach, Region, SymAddr, SymAlloc, Team};
use super::vocab::AgentCtx;
use crate::Result;

/// The body of one agent: ordinary Rust over the vocabulary. Runs once per phase.
pub type AgentBody<'a> = Box<dyn FnOnce(&mut dyn AgentCtx) -> Result<()> + Send + 'a>;

/// Which protocol phase this is. CPU executors run the agents' bodies; the GPU backend maps the
/// kind to its kernel (the bodies then serve as the host reference of that kernel).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PhaseKind {
    /// Notify / count exchange (spec §3.2).
    Notify,
    /// Normal dispatch, send half.
    DispatchSend,
    /// Normal dispatch, receive half.
    DispatchRecv,
    /// Normal combine, send half.
    CombineSend,
    /// Normal combine, receive half.
    CombineRecv,
    /// Low-latency dispatch send half (spec §3.6).
    LowLatencyDispatchSend,
    /// Low-latency dispatch receive half (the hook).
    LowLatencyDispatchRecv,
    /// Low-latency combine send half (spec §3.7).
    LowLatencyCombineSend,
    /// Low-latency combine receive half (the hook).
    LowLatencyCombineRecv,
    /// Buffer cleaning.
    Clean,
    /// Anything else (tests, small protocols).
    Custom(String),
}

/// One agent of a phase.
pub struct AgentSpec<'a> {
    /// Rank it runs on.
    pub rank: usize,
    /// Block on that rank (agents of one block share `block_barrier`).
    pub block: usize,
    /// Role name for diagnostics ("sender", "forwarder", ...).
    pub role: String,
    /// What it does.
    pub body: AgentBody<'a>,
}

impl std::fmt::Debug for AgentSpec<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentSpec")
            .field("rank", &self.rank)
            .field("block", &self.block)
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// A ring buffer the protocol declares, so a checker can judge its use.
///
/// Layout: `capacity` slots of `slot_bytes` at `slots` on `rank`. The counters are 64-bit
/// monotonically increasing entry counts (never wrapped modulo capacity): entry `i` lives in slot
/// `i % capacity`. `tail` (on `rank`, written by the producer) counts entries published; `head`
/// (on `head_rank`, written by the consumer) counts entries consumed. Live entries are
/// `[head, tail)`; the producer may write entry `i` only when `i - head < capacity`, and the
/// consumer may read entry `i` only when `i < tail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingDecl {
    /// Name for diagnostics.
    pub name: String,
    /// Rank holding the slots and the tail word.
    pub rank: usize,
    /// First slot.
    pub slots: SymAddr,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Number of slots.
    pub capacity: u64,
    /// Tail word on `rank`.
    pub tail: SymAddr,
    /// Rank holding the head word (the producer's rank when the consumer reports back over RDMA).
    pub head_rank: usize,
    /// Head word on `head_rank`.
    pub head: SymAddr,
}

/// A protocol phase: its kind, the call it belongs to, its agents, and what the protocol assumes.
#[derive(Debug)]
pub struct Phase<'a> {
    /// Which phase.
    pub kind: PhaseKind,
    /// The call this phase belongs to (a receive half run later as a hook carries its send
    /// half's call). Calls number from 1; 0 means "not part of a call". A checker may report an
    /// ordinary load in a phase of call `k` that reads bytes written by a later call: a hook run
    /// after the next call on its buffer.
    pub call: u64,
    /// The agents.
    pub agents: Vec<AgentSpec<'a>>,
    /// Words the protocol assumes zero when the phase starts (counters it resets itself).
    pub assume_zero: Vec<(usize, Region)>,
    /// Rings the phase uses.
    pub rings: Vec<RingDecl>,
}

impl<'a> Phase<'a> {
    /// An empty phase of `kind` in `call`.
    #[must_use]
    pub fn new(kind: PhaseKind, call: u64) -> Phase<'a> {
        Phase {
            kind,
            call,
            agents: Vec::new(),
            assume_zero: Vec::new(),
            rings: Vec::new(),
        }
    }

    /// Adds an agent.
    #[must_use]
    pub fn agent(
        mut self,
        rank: usize,
        block: usize,
        role: &str,
        body: impl FnOnce(&mut dyn AgentCtx) -> Result<()> + Send + 'a,
    ) -> Phase<'a> {
        self.agents.push(AgentSpec {
            rank,
            block,
            role: role.to_owned(),
            body: Box::new(body),
        });
        self
    }

    /// Declares that `region` on `rank` is zero when the phase starts.
    #[must_use]
    pub fn assume_zero(mut self, rank: usize, region: Region) -> Phase<'a> {
        self.assume_zero.push((rank, region));
        self
    }

    /// Declares a ring.
    #[must_use]
    pub fn ring(mut self, ring: RingDecl) -> Phase<'a> {
        self.rings.push(ring);
        self
    }
}

/// What running one phase cost, in the backend's units (counts are for this phase only).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PhaseReport {
    /// Duration of the phase: virtual ticks in the simulator (one per event), measured
    /// nanoseconds on the GPU.
    pub time_ns: u64,
    /// Agent operations executed.
    pub operations: u64,
    /// Work requests delivered.
    pub work_requests: u64,
    /// Posts that waited for a full QP.
    pub qp_full_waits: u64,
}

/// The host face both backends implement (DESIGN.md, "One logic, two executors").
///
/// Calls are collective: the host drives all ranks of the job through one value (the simulator)
/// or each process drives its own rank with the same sequence of calls (the GPU backend).
pub trait Transport {
    /// The fabric's resources: ranks, granularity, QP depth, RC QPs per peer.
    fn fabric(&self) -> &FabricParams;

    /// How `from` reaches `to`.
    fn reach(&self, from: usize, to: usize) -> Reach {
        self.fabric().reach(from, to)
    }

    /// Collective allocation in the symmetric heap: the same region on every rank. The heap is
    /// made of `granularity`-sized chunks; an allocation may span chunks.
    fn alloc(&mut self, req: AllocRequest) -> Result<SymAlloc>;

    /// The team of all ranks.
    fn world(&self) -> Team {
        Team::world(self.fabric().num_ranks)
    }

    /// Host barrier over `team` (`nvshmem_barrier`): completes every outstanding operation issued
    /// by the team's ranks and orders everything before it on those ranks before everything after.
    fn barrier(&mut self, team: &Team) -> Result<()>;

    /// Collective recovery after a failed phase (`Buffer::reset`, shrink masking): operations in
    /// flight between ranks of `team` complete (as [`Transport::barrier`]); operations between a
    /// team rank and a rank outside the team are flushed (as a QP's error completions would);
    /// what agents torn down mid-operation left behind, and error completions not yet reported,
    /// are forgotten; then the team is synchronised as by a barrier. Fails, naming the rank or QP,
    /// when a team rank is dead or an operation between team ranks can never complete.
    ///
    /// The default is [`Transport::barrier`], right for backends whose operations complete before
    /// a phase ends (threads mode).
    fn recover(&mut self, team: &Team) -> Result<()> {
        self.barrier(team)
    }

    /// Host read of `rank`'s own symmetric memory between phases (a `cudaMemcpy` from the
    /// device after the stream's last kernel): fills `out` from `addr`. Used by calls whose
    /// outputs stay in the arena (docs/protocol.md §2.6). Fails with a typed error naming the
    /// rank when `[addr, addr + out.len())` is outside every allocation. Takes `&self`: reads
    /// of different ranks may run on several host threads at once.
    fn read_local(&self, rank: usize, addr: SymAddr, out: &mut [u8]) -> Result<()>;

    /// Hands `[addr, addr + len)` of `rank`'s own symmetric memory to `f` between phases, as
    /// consecutive pieces in address order (their lengths sum to `len`), without copying where
    /// the backend can lend its memory. The default copies 1 MiB at a time through
    /// [`Transport::read_local`]. `f` must not call back into the transport (a lending backend
    /// may hold a lock on the piece while `f` runs).
    fn visit_local(
        &self,
        rank: usize,
        addr: SymAddr,
        len: u64,
        f: &mut dyn FnMut(&[u8]),
    ) -> Result<()> {
        let mut buf = vec![0u8; len.min(1 << 20) as usize];
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            self.read_local(rank, SymAddr(addr.0 + done), &mut buf[..n])?;
            f(&buf[..n]);
            done += n as u64;
        }
        Ok(())
    }

    /// Host write into `rank`'s own symmetric memory between phases (a `cudaMemcpy` to the
    /// device before the next kernel): defined bytes, visible to every agent of later phases.
    fn write_local(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()>;

    /// Executes one protocol phase on all ranks and returns when every agent has finished.
    /// Operations still in flight at the end (non-blocking puts without `quiet`) stay in flight.
    fn run_phase(&mut self, phase: Phase<'_>) -> Result<PhaseReport>;
}
