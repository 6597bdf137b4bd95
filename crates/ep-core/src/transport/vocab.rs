//! The protocol vocabulary: what one agent (a block- or warp-role on a rank) may do.
//!
//! Protocol phases are written as ordinary Rust against [`AgentCtx`]; ep-sim runs them over its
//! model of the fabric, and the CUDA device primitives carry the same names and promises
//! (NVSHMEM device API for the RDMA class, PTX release/acquire for the load/store class).
//!
//! # The memory model (DESIGN.md, "The memory model the protocol may rely on")
//!
//! **RDMA class** (NVSHMEM semantics):
//! - operations from one agent to one peer on one QP are delivered in the order they were posted;
//! - nothing orders operations on different QPs except [`AgentCtx::fence`] (per peer) and
//!   [`AgentCtx::quiet`] (all peers);
//! - a non-blocking put may be delivered at any time between its post and the agent's next
//!   `quiet` (or the fence or same-QP signal ordered after it); its source is read when it is
//!   delivered, so the source must not change until the operation **completes** (completion comes
//!   after delivery; `quiet` waits for it);
//! - `put_signal` makes its data visible before its signal; a waiter that sees the signal may read
//!   the data, and everything the same agent posted before on that QP, or before its last fence
//!   to that peer, or before its last quiet;
//! - an operation crossing a heap chunk (granularity) boundary is one work request per chunk, each
//!   taking a slot of the QP's depth until its completion.
//!
//! **Load/store class** (NVLink P2P and local memory):
//! - relaxed `store`s from many agents are unordered;
//! - `store_release` publishes the storing agent's earlier stores (and everything it had acquired)
//!   to whoever `load_acquire`s (or `wait`s on) the value it stored;
//! - `fence` is also a release fence: a relaxed `store` after it publishes what came before it
//!   (PTX `fence.acq_rel.sys` followed by `st.relaxed`);
//! - a block barrier is release/acquire among the agents of the block.
//!
//! **Ordinary reads** ([`AgentCtx::load`]) see only what a release/acquire or signal chain made
//! visible; anything else is a race, which the simulator reports. `wait` and `load_acquire` are
//! the atomic reads that acquire.
//!
//! # Words
//! Signal words, counters and flags are 64-bit little-endian unsigned integers at 8-byte aligned
//! heap addresses. Words written by different agents should not share a 16-byte granule (the
//! simulator's shadow unit); DeepEP pads signal regions to 128 bytes (spec §4).
//!
//! # Errors
//! Every operation returns a `Result`: a bounded wait that expires, an access out of bounds or to
//! an unreachable peer, or a phase being torn down because another agent failed. Agent code
//! propagates them with `?`.

use super::types::{AgentId, QpIndex, SignalOp, SymAddr, WaitUntil};
use crate::Result;

/// The operations one agent may perform. Object safe: phases take `&mut dyn AgentCtx`.
pub trait AgentCtx {
    /// This agent.
    fn me(&self) -> AgentId;
    /// Number of ranks in the job.
    fn num_ranks(&self) -> usize;
    /// The call this phase belongs to (the host's call counter; 0 when not a call).
    fn call(&self) -> u64;
    /// Work requests a put of `len` bytes from `src` to `dst` becomes: one per piece between heap
    /// chunk boundaries of either side ([`super::FabricParams::work_requests`]). A protocol that
    /// budgets QP slots must count these, not puts.
    fn work_requests(&self, dst: SymAddr, src: SymAddr, len: u64) -> u32;

    // ---- RDMA class ------------------------------------------------------------------------

    /// Non-blocking put (`nvshmem_putmem_nbi` / IBGDA RDMA WRITE): copy `len` bytes from this
    /// rank's `src` to `peer`'s `dst` over QP `qp`.
    ///
    /// Ordering: in order with this agent's earlier operations to `peer` on `qp`; unordered with
    /// other QPs unless a `fence` or `quiet` separates them. Visibility: the data is visible to a
    /// reader on `peer` only through a signal or acquire chain that orders it. The source is read
    /// at delivery and must not be written until completion (after the next `quiet`). Posting waits
    /// for a free QP slot when the QP is full (or fails, under [`super::QpFullPolicy::Error`]).
    ///
    /// A put is not a signal. A reader that waits on (acquires) a word a put wrote acquires what the
    /// putting agent had ordered before it only for puts of at most 64 bytes, 8-byte aligned (an
    /// inline write, like IBGDA's `rma_p`); through a longer put it acquires nothing, and reading
    /// the data it published is a race. To publish data, use [`AgentCtx::put_signal`] or an
    /// `amo_add` on the same QP after the put.
    fn put(&mut self, peer: usize, qp: QpIndex, dst: SymAddr, src: SymAddr, len: u64)
    -> Result<()>;

    /// Put with signal (`nvshmem_putmem_signal_nbi`): the data is delivered, then the signal word
    /// on `peer` is updated by `op` with `value`. A waiter that sees the signal's effect may read
    /// the data. Same QP ordering, source and depth rules as [`AgentCtx::put`].
    #[allow(
        clippy::too_many_arguments,
        reason = "mirrors nvshmem_putmem_signal_nbi"
    )]
    fn put_signal(
        &mut self,
        peer: usize,
        qp: QpIndex,
        dst: SymAddr,
        src: SymAddr,
        len: u64,
        signal: SymAddr,
        op: SignalOp,
        value: u64,
    ) -> Result<()>;

    /// Non-fetching atomic add (`nvshmemx_signal_op(ADD)` / IBGDA masked fetch-add) of `value` to
    /// the 64-bit word `word` on `peer`, over QP `qp`. One work request; ordered after this agent's
    /// earlier operations to `peer` on `qp`. A waiter that sees its effect acquires what was
    /// ordered before it (same QP, last fence to `peer`, last quiet, last release).
    fn amo_add(&mut self, peer: usize, qp: QpIndex, word: SymAddr, value: u64) -> Result<()>;

    /// Fence (`nvshmem_fence`): this agent's RDMA operations to each peer posted before are
    /// delivered before those posted after, whatever their QPs. Also a load/store release fence.
    /// Does not wait.
    fn fence(&mut self) -> Result<()>;

    /// Quiet (`nvshmem_quiet`): wait until every RDMA operation this agent posted has completed
    /// (delivered, acknowledged, sources free, QP slots released). Also a release fence.
    fn quiet(&mut self) -> Result<()>;

    // ---- load/store class ------------------------------------------------------------------

    /// Relaxed store of `bytes` at `rank`'s `addr` (local or NVLink peer). Unordered with other
    /// agents' stores; published only by a later release (or a `fence` followed by a store the
    /// reader acquires).
    fn store(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> Result<()>;

    /// Release store of the 64-bit word at `rank`'s `addr` (`st.release.sys`): whoever acquires
    /// this value also sees this agent's earlier stores and everything it had acquired.
    fn store_release(&mut self, rank: usize, addr: SymAddr, value: u64) -> Result<()>;

    /// Release store of the 64-bit word at `rank`'s `addr` as **one thread of a GPU block**
    /// performs it (`st.release.sys`, an acq_rel arrival, an NVSHMEM signal SET), the block
    /// being this agent: it publishes what this agent had acquired and its stores ordered before
    /// its last [`AgentCtx::fence`], but not its stores since (other threads of the block made
    /// them, and GPU stores are weak). With `data`, the `data.1` bytes are first stored at
    /// `rank`'s `data.0` and published by this release (NVSHMEM `putmem_signal`'s own data).
    ///
    /// The GPU trace checker's form of a release (`ep_sim::device_trace`); protocol code uses
    /// [`AgentCtx::store_release`]. The default is that stronger release (for backends that do
    /// not check the memory model).
    fn store_release_after_fence(
        &mut self,
        rank: usize,
        addr: SymAddr,
        value: u64,
        data: Option<(SymAddr, &[u8])>,
    ) -> Result<()> {
        if let Some((at, bytes)) = data {
            self.store(rank, at, bytes)?;
        }
        self.store_release(rank, addr, value)
    }

    /// Ordinary load of `out.len()` bytes from `rank`'s `addr`. Sees only bytes made visible by a
    /// release/acquire or signal chain; anything else is a race (reported by the simulator).
    fn load(&mut self, rank: usize, addr: SymAddr, out: &mut [u8]) -> Result<()>;

    /// Acquire load of the 64-bit word at `rank`'s `addr` (`ld.acquire.sys`): the agent sees what
    /// the writer of the value it reads had published.
    fn load_acquire(&mut self, rank: usize, addr: SymAddr) -> Result<u64>;

    /// Bounded wait until the word satisfies the condition (`nvshmem_signal_wait_until`, or an
    /// acquire spin on an NVLink word); returns the value seen, with acquire semantics. Bounded:
    /// after the backend's timeout it fails with [`crate::Error::WaitTimeout`] naming what it
    /// waited for and the last value seen.
    fn wait(&mut self, until: &WaitUntil) -> Result<u64>;

    /// Bounded wait that hands an expired bound back to the caller instead of failing the phase:
    /// `Ok(Some(value))` when the condition held (acquire, as [`AgentCtx::wait`]), `Ok(None)` when
    /// the bound expired. For low-latency shrink mode (spec §2.7): the agent that built the wait
    /// knows which peer it awaited and masks it ([`super::fault`]). Other errors stay errors.
    ///
    /// The default maps [`crate::Error::WaitTimeout`] from [`AgentCtx::wait`] to `None`; backends
    /// whose timeouts tear the phase down override it.
    fn wait_or_expire(&mut self, until: &WaitUntil) -> Result<Option<u64>> {
        match self.wait(until) {
            Ok(v) => Ok(Some(v)),
            Err(crate::Error::WaitTimeout { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Block barrier among the agents of this agent's block on this rank (`__syncthreads` /
    /// `bar.sync`): release/acquire among them. Bounded like `wait`.
    fn block_barrier(&mut self) -> Result<()>;

    // ---- conveniences ----------------------------------------------------------------------

    /// Relaxed store of one 64-bit word.
    fn store_u64(&mut self, rank: usize, addr: SymAddr, value: u64) -> Result<()> {
        self.store(rank, addr, &value.to_le_bytes())
    }

    /// Ordinary load of one 64-bit word.
    fn load_u64(&mut self, rank: usize, addr: SymAddr) -> Result<u64> {
        let mut b = [0u8; 8];
        self.load(rank, addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}
