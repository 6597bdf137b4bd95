//! The protocol events a GPU kernel agent (one CUDA block) performs, as debug builds record them
//! (DESIGN.md, "The GPU backend ... record the events they perform so the simulator's invariant
//! checker can judge a GPU trace too"). ep-kernels decodes a device trace into these;
//! `ep_sim::device_trace::check` replays them under the simulator's memory model.
//!
//! Addresses are byte offsets into one rank's low-latency arenas (docs/protocol.md §3.1):
//! [`TraceRegion::Signals`] (`ll.signals`) or [`TraceRegion::Data`] (`ll.data`).
//!
//! # What the events mean (the GPU memory model the checker applies)
//! A block is one agent: its events are in program order, and events of different threads of the
//! block are ordered only where a block barrier (`__syncthreads`) separates them, which is where
//! the kernel records them (see ep-kernels' `gpu::trace`). GPU stores are weak:
//! - a [`DeviceEvent::Store`] (or the store half of a [`DeviceEvent::Put`]) is published to other
//!   blocks only by a [`DeviceEvent::Fence`] of its block followed by a publishing event
//!   ([`DeviceEvent::Release`], [`DeviceEvent::CounterArrive`], [`DeviceEvent::PutSignal`]); a
//!   release by one thread does not publish the stores its block's other threads made after the
//!   block's last fence;
//! - a publishing event does publish everything its block had acquired before it (PTX release is
//!   cumulative; the kernels acquire and release from the same thread);
//! - an ordinary [`DeviceEvent::Load`] may only read bytes that such a chain made visible to its
//!   block: otherwise it is a race, reported as a typed
//!   [`Violation`](super::Violation).

use std::fmt;

/// Which arena of a rank an event addresses (docs/protocol.md §3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TraceRegion {
    /// `ll.signals`: the 64-bit signal words (zero-initialised).
    Signals,
    /// `ll.data`: staging, message rows, headers, meta records (poison until written).
    Data,
}

impl fmt::Display for TraceRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TraceRegion::Signals => "ll.signals",
            TraceRegion::Data => "ll.data",
        })
    }
}

/// The scope of a fence (PTX `fence.acq_rel.gpu` / `__threadfence()` vs `fence.sc.sys` /
/// `__threadfence_system()`, or `nvshmem_fence`, recorded as system scope).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FenceScope {
    /// Orders for observers on this GPU only (enough when every peer is co-resident,
    /// `EP_FLAG_SAME_GPU`).
    Gpu,
    /// Orders for observers anywhere (peers on other GPUs, NVSHMEM).
    System,
}

/// One protocol event of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceEvent {
    /// Ordinary (weak) stores of `len` bytes at `offset` of `rank`'s `region` (possibly a peer).
    Store {
        /// Rank whose memory is written.
        rank: usize,
        /// Arena.
        region: TraceRegion,
        /// Byte offset in the arena.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Ordinary loads of `len` bytes at `offset` of `rank`'s `region`.
    Load {
        /// Rank whose memory is read.
        rank: usize,
        /// Arena.
        region: TraceRegion,
        /// Byte offset in the arena.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// A memory fence by the block (after a block barrier: it orders every thread's earlier
    /// stores before the block's later publishing events).
    Fence {
        /// Its scope.
        scope: FenceScope,
    },
    /// A release store of the 64-bit signal word at `offset` of `rank`'s `ll.signals`
    /// (`st.release`, or an NVSHMEM signal SET without data).
    Release {
        /// Rank holding the word.
        rank: usize,
        /// Byte offset of the word in `ll.signals`.
        offset: u64,
        /// Value stored.
        value: u64,
    },
    /// The end of a successful wait: an acquire load of the signal word at `offset` of `rank`'s
    /// `ll.signals` that saw `value`.
    Acquire {
        /// Rank holding the word.
        rank: usize,
        /// Byte offset of the word in `ll.signals`.
        offset: u64,
        /// Value seen.
        value: u64,
    },
    /// An arrival at a rank's acq_rel completion counter `counter`: the atomic returned
    /// `ticket` (arrivals so far); it publishes like a release and acquires every earlier
    /// arrival. `last`: this block saw every other block's arrival and continues. (The checker's
    /// vocabulary; the low-latency kernels signal per send group since docs/protocol.md §3.3.)
    CounterArrive {
        /// Which counter of the rank (0: the send part's).
        counter: u32,
        /// The value the atomic add returned.
        ticket: u64,
        /// Whether this was the last arrival.
        last: bool,
    },
    /// An NVSHMEM put (variant (b), docs/protocol.md §3.11): a load of this rank's `ll.data`
    /// at `src_offset` and a weak store of those bytes at `dst_rank`'s `ll.data` `dst_offset`.
    Put {
        /// Destination rank.
        dst_rank: usize,
        /// Destination offset in `ll.data`.
        dst_offset: u64,
        /// Source offset in this rank's `ll.data`.
        src_offset: u64,
        /// Bytes.
        len: u64,
    },
    /// An NVSHMEM put with signal (`putmem_signal`, SET): the put, then a release of the signal
    /// word `signal_offset` on `dst_rank` that also publishes the put's own bytes.
    PutSignal {
        /// Destination rank.
        dst_rank: usize,
        /// Destination offset in `ll.data`.
        dst_offset: u64,
        /// Source offset in this rank's `ll.data`.
        src_offset: u64,
        /// Bytes.
        len: u64,
        /// Signal word offset in `dst_rank`'s `ll.signals`.
        signal_offset: u64,
        /// Value set.
        value: u64,
    },
}

/// The events one block of one rank's launch recorded, in program order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AgentEvents {
    /// The rank whose kernel the block belongs to.
    pub rank: usize,
    /// The block index (`blockIdx.x`).
    pub agent: usize,
    /// Its events.
    pub events: Vec<DeviceEvent>,
}
