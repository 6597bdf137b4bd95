//! # ep-sim
//!
//! The CPU simulator of the GPU fabric: agents on a deterministic executor, owner-applied
//! delivery, virtual time, QPs with depth, heap chunks, shadow memory and vector clocks. It
//! implements ep-core's [`Transport`], so the protocol runs here unchanged.
//!
//! What it models (DESIGN.md, "The simulator"; the promises are in
//! [`ep_core::transport::vocab`]):
//! - **Executor** ([`Sim`]): each agent (rank × role) runs on its own OS thread, but only the one
//!   holding the baton computes; at every vocabulary call it hands the baton back and the executor
//!   picks the next event — serve an agent, deliver a work request, complete one — with a
//!   ChaCha8 RNG seeded by [`SimConfig::seed`] under a [`Policy`]. Same seed, same trace
//!   ([`Sim::trace`]) and same memory ([`Sim::memory_digest`]), bit for bit.
//! - **Owner-applied delivery**: RDMA operations are work requests queued per QP `(source, peer,
//!   index)`; the target applies them when delivered. Sources are read at delivery. Completions
//!   come after delivery and free the QP slot; a post to a full QP waits (or is a violation under
//!   [`ep_core::transport::QpFullPolicy::Error`]). An operation crossing a heap chunk becomes
//!   one work request per chunk, each taking a slot.
//! - **Time**: virtual, one tick per event. Waits park (cost nothing) and are bounded by
//!   [`SimConfig::wait_timeout_ticks`]; when every live agent is parked and nothing in flight can
//!   wake one, the wait-for graph is reported as [`Violation::Deadlock`].
//! - **Shadow memory**: valid bits per byte in 16-byte granules (poison on allocation, and before
//!   every phase for [`ep_core::transport::Init::Scratch`]), and the last writer of each granule
//!   with its vector-clock epoch. Ordinary loads are checked against the reader's vector clock
//!   (release/acquire for the load/store class, per-QP streams, fences and quiets for the RDMA
//!   class); every finding is a typed [`Violation`].
//! - **Lazy memory**: 64 KiB pages materialise on first touch; a 2 GiB allocation on a 512 MiB
//!   granularity costs what is touched.
//! - **Threads mode** ([`ThreadSim`]): the same agent code on real threads, for throughput
//!   (`ep bench`), without the checks: lazily allocated 256 KiB pages with one short-held lock
//!   each, bulk copies, and parking waits ([`park`]) that cost writers nothing when nobody waits.
//!   `benches/data_movement.rs` measures its row stores and puts against a plain memcpy
//!   (`cargo bench -p ep-sim --bench data_movement -- --warm-up-time 1 --measurement-time 3`).
//! - **Faults** ([`fault`], [`SimConfig::faults`], [`Sim::set_faults`], [`ThreadSim::set_faults`]):
//!   a dead or stalled rank, a QP in error state, a dropped completion, each ending in bounded
//!   (virtual) time in a typed error naming the rank, the QP and what was awaited; clearing them
//!   ([`Sim::clear_faults`]) and [`Transport::recover`] model the repair a `Buffer::reset` follows
//!   ([`ep_core::transport::fault`] says what the Buffer does with them; shrink mode uses
//!   [`ep_core::transport::AgentCtx::wait_or_expire`]).
//! - **Cost model** ([`cost`]): each phase's actual traffic ([`Sim::records`],
//!   [`ThreadSim::records`]) over NVLink, RDMA NIC and PCIe, giving a predicted time per phase.
//! - **GPU traces** ([`device_trace`]): the events a debug build's kernel blocks recorded,
//!   replayed as agents here, so the same memory-model rules judge the GPU kernels.
//! - **Ring offsets**: [`SimConfig::ring_offset`] gives protocol code a seeded start for each
//!   ring counter, so wraparound is exercised (DESIGN.md).
//!
//! Thread safety: [`Sim`] is `Send`; one phase runs at a time (`&mut self`).
//!
//! # Limits and rules of use
//! - **An agent must call the vocabulary to make progress.** The executor only regains control
//!   at a vocabulary call: an agent that spins on ordinary Rust state (or loops forever between
//!   calls) blocks the whole simulator, and no wait bound can fire. Poll with `wait`, never with
//!   a Rust loop around `load`.
//! - **Shadow granule**: 16 bytes. Words written by different agents should not share a granule
//!   (the last writer of a granule is all the checker remembers); pad signal words as DeepEP does.
//! - **A put is not a signal**: acquiring a word written by a put longer than 64 bytes gives no
//!   visibility of anything; publish with `put_signal` or a same-QP `amo_add`
//!   ([`ep_core::transport::AgentCtx::put`]).
//! - **Scratch is per phase**: [`ep_core::transport::Init::Scratch`] memory is poisoned before
//!   every phase, so a send half and its hook cannot share scratch.
//! - **Host barrier** ([`Transport::barrier`]) honours its team: it completes what the team's
//!   ranks posted and joins only their knowledge.
//! - Threads mode does not check the memory model and reads fresh memory as zeros.
//!
//! # Model checking (loom)
//! The parking protocol of threads mode is model-checked with loom (crossbeam's shim: the
//! `sync` module re-exports loom's types under `--cfg loom`):
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target-loom cargo test -p ep-sim --test loom --release`.
//!
//! # Example: a signal that overtakes its data
//! ```
//! use ep_core::transport::*;
//! use ep_sim::{Sim, SimConfig, Violation};
//!
//! let mut fabric = FabricParams::single_node(2);
//! fabric.ranks_per_node = 1; // two nodes: RDMA only
//! fabric.rc_per_pe = 2;
//! let mut sim = Sim::new(SimConfig::new(fabric, 42));
//! let mut alloc = |name: &str, init| {
//!     sim.alloc(AllocRequest { name: name.into(), bytes: 64, align: 128, init }).unwrap()
//! };
//! let (data, src, flag) = (alloc("data", Init::Poison), alloc("src", Init::Poison), alloc("flag", Init::Zero));
//! let (d, f) = (data.clone(), flag.clone());
//! let phase = Phase::new(PhaseKind::Custom("demo".into()), 1)
//!     .agent(0, 0, "sender", move |c: &mut dyn AgentCtx| {
//!         c.store(0, src.at(0), &[7; 64])?;
//!         c.put(1, QpIndex(0), data.at(0), src.at(0), 64)?;
//!         // Bug: the signal goes on QP 1 with no fence, so it may overtake the data.
//!         c.amo_add(1, QpIndex(1), flag.at(0), 1)?;
//!         c.quiet()
//!     })
//!     .agent(1, 0, "receiver", move |c: &mut dyn AgentCtx| {
//!         let until = WaitUntil { rank: 1, word: f.at(0), cmp: Cmp::Eq, value: 1, what: "flag".into() };
//!         c.wait(&until)?;
//!         let mut row = [0u8; 64];
//!         c.load(1, d.at(0), &mut row)
//!     });
//! let err = sim.run(phase).unwrap_err();
//! assert!(matches!(err.violation(), Some(Violation::SignalBeforeData { .. })));
//! ```

pub mod alloc;
mod clock;
mod config;
pub mod cost;
mod ctx;
pub mod device_trace;
mod exec;
pub mod fault;
mod memory;
pub mod park;
mod proto;
mod recovery;
mod sync;
mod threads;
mod tmem;
mod violation;
mod world;

use ep_core::transport::{
    AllocRequest, FabricParams, Phase, PhaseReport, SymAddr, SymAlloc, Team, Transport,
};

pub use config::{Policy, SimConfig, ring_offset};
pub use fault::{Fault, Trigger};
pub use threads::ThreadSim;
pub use violation::{AgentRef, SimError, Violation, Waiting};
pub use world::{Stats, TraceEvent};

/// The deterministic simulator.
pub struct Sim {
    cfg: SimConfig,
    world: world::World,
    chooser: exec::Chooser,
    /// Test hook: agents past this many per phase are refused a thread.
    spawn_limit: Option<usize>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Sim {
    /// A simulator of `cfg.fabric`, seeded by `cfg.seed`.
    #[must_use]
    pub fn new(cfg: SimConfig) -> Sim {
        let world = world::World::new(
            cfg.fabric.clone(),
            cfg.wait_timeout_ticks,
            cfg.trace,
            cfg.faults.clone(),
        );
        let chooser = exec::Chooser::new(cfg.seed, cfg.policy);
        Sim {
            cfg,
            world,
            chooser,
            spawn_limit: None,
        }
    }

    /// Test hook: from the `limit`-th agent of a phase on, spawning its thread fails as when the
    /// system refuses one (`ulimit -u`, `-v`); the phase must end at once in
    /// `Error::AgentSpawnFailed`. `None` lifts it.
    pub fn limit_agent_threads(&mut self, limit: Option<usize>) {
        self.spawn_limit = limit;
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    /// Runs a phase; errors are typed ([`SimError::Violation`] for protocol findings).
    pub fn run(&mut self, phase: Phase<'_>) -> Result<PhaseReport, SimError> {
        exec::run_phase(&mut self.world, &mut self.chooser, phase, self.spawn_limit)
    }

    /// Host write into `rank`'s heap (like a `cudaMemcpy` before a launch): defined bytes,
    /// visible to every agent.
    pub fn host_write(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> ep_core::Result<()> {
        self.world.host_write(rank, addr.0, bytes)
    }

    /// Host read from `rank`'s heap.
    pub fn host_read(&mut self, rank: usize, addr: SymAddr, len: u64) -> ep_core::Result<Vec<u8>> {
        self.world.host_read(rank, addr.0, len)
    }

    /// Host read of one little-endian u64.
    pub fn host_read_u64(&mut self, rank: usize, addr: SymAddr) -> ep_core::Result<u64> {
        let b = self.host_read(rank, addr, 8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// The event trace (empty unless [`SimConfig::trace`]).
    #[must_use]
    pub fn trace(&self) -> &[TraceEvent] {
        self.world.trace.as_deref().unwrap_or(&[])
    }

    /// FNV-1a digest of every rank's materialised memory and valid bits.
    #[must_use]
    pub fn memory_digest(&self) -> u64 {
        self.world.digest()
    }

    /// Bytes of heap materialised, all ranks together.
    #[must_use]
    pub fn resident_bytes(&self) -> u64 {
        self.world.resident_bytes()
    }

    /// Counters so far.
    #[must_use]
    pub fn stats(&self) -> &Stats {
        &self.world.stats
    }

    /// What each phase run so far moved, in order, for the cost model ([`cost`]).
    #[must_use]
    pub fn records(&self) -> &[cost::PhaseRecord] {
        self.world.records()
    }

    /// Virtual time so far, in ticks.
    #[must_use]
    pub fn now(&self) -> u64 {
        self.world.now
    }
}

/// `Sim` runs every phase as the protocol's agents, every rank local: ep-core's simulator
/// executor drives it.
impl ep_core::RunsAgents for Sim {}

impl Transport for Sim {
    fn fabric(&self) -> &FabricParams {
        &self.cfg.fabric
    }

    fn alloc(&mut self, req: AllocRequest) -> ep_core::Result<SymAlloc> {
        self.world.alloc(req)
    }

    fn barrier(&mut self, team: &Team) -> ep_core::Result<()> {
        self.world.barrier(&team.ranks)
    }

    fn recover(&mut self, team: &Team) -> ep_core::Result<()> {
        self.world.recover(&team.ranks)
    }

    fn read_local(&self, rank: usize, addr: SymAddr, out: &mut [u8]) -> ep_core::Result<()> {
        self.world.host_read_into(rank, addr.0, out)
    }

    fn write_local(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> ep_core::Result<()> {
        self.world.host_write(rank, addr.0, bytes)
    }

    fn run_phase(&mut self, phase: Phase<'_>) -> ep_core::Result<PhaseReport> {
        self.run(phase).map_err(Into::into)
    }
}
