//! Typed findings of a checker of the memory model (the simulator's, or one judging a GPU
//! trace): each names the rank, the agent, the QP or word, and the operations involved, so a
//! failing seed says which rule the protocol broke. They live here, beside the vocabulary whose
//! rules they name, so that they cross the [`Transport`](super::Transport) typed
//! ([`crate::Error::ProtocolViolation`]).

use std::fmt;

use super::types::{QpIndex, Region};

/// An agent, as reports name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentRef {
    /// Rank.
    pub rank: usize,
    /// Index among the rank's agents in its phase.
    pub index: usize,
    /// Role name.
    pub role: String,
}

impl fmt::Display for AgentRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank{}/agent{}({})", self.rank, self.index, self.role)
    }
}

/// One parked agent in a deadlock or timeout report: what it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiting {
    /// The agent.
    pub agent: AgentRef,
    /// What it awaits ("tail of ring r1 >= 3", "block barrier", ...).
    pub what: String,
    /// The word it polls, if any: (rank, heap offset).
    pub word: Option<(usize, u64)>,
    /// The last value of that word.
    pub last_seen: Option<u64>,
    /// Who last wrote the word, if anyone did (agent or work request).
    pub last_writer: Option<String>,
    /// Injected faults that had struck when this was reported (empty without fault injection).
    pub faults: Vec<String>,
}

impl fmt::Display for Waiting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} waits for {}", self.agent, self.what)?;
        if let (Some((r, w)), Some(v)) = (self.word, self.last_seen) {
            write!(f, " (rank{r} word {w:#x} = {v}")?;
            match &self.last_writer {
                Some(x) => write!(f, ", last written by {x})")?,
                None => write!(f, ", never written)")?,
            }
        }
        if !self.faults.is_empty() {
            write!(f, "; injected faults: {}", self.faults.join("; "))?;
        }
        Ok(())
    }
}

/// A broken rule of the memory model, of a declared protocol invariant, or of progress.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// A reader acquired a signal and then read data that the same sender put **before** that
    /// signal but on another QP with no fence or quiet between: the signal may overtake its data.
    #[error(
        "signal before data: {reader} on rank {rank} read {data} written by put op {put_op} ({sender}, {put_qp}), \
         after acquiring signal op {signal_op} on {signal_qp} (word {signal_word:#x}) from the same sender; \
         put the signal on the data's QP or fence between them (delivered first by chance: {delivered})"
    )]
    SignalBeforeData {
        /// Rank read.
        rank: usize,
        /// The reader.
        reader: AgentRef,
        /// Bytes read.
        data: Region,
        /// The put whose data was read (operation id).
        put_op: u64,
        /// Its QP.
        put_qp: QpIndex,
        /// The signal (operation id) the reader acquired.
        signal_op: u64,
        /// Its QP.
        signal_qp: QpIndex,
        /// The signal word.
        signal_word: u64,
        /// Who sent both.
        sender: AgentRef,
        /// Whether the data had been delivered anyway (the race did not bite this time).
        delivered: bool,
    },
    /// A read of bytes that an RDMA put still in flight will overwrite.
    #[error(
        "read of undelivered data: {reader} on rank {rank} read {data} while put op {put_op} from {sender} on {qp} \
         was still in flight; wait for its signal first"
    )]
    ReadOfUndelivered {
        /// Rank read.
        rank: usize,
        /// The reader.
        reader: AgentRef,
        /// Bytes read.
        data: Region,
        /// The put in flight.
        put_op: u64,
        /// Its sender.
        sender: AgentRef,
        /// Its QP.
        qp: QpIndex,
    },
    /// A read of poisoned bytes (never written, or scratch from a previous call).
    #[error(
        "read of poison: {reader} on rank {rank} read {data} in '{alloc}', which holds no defined value"
    )]
    ReadOfPoison {
        /// Rank read.
        rank: usize,
        /// The reader.
        reader: AgentRef,
        /// The first poisoned granule's range.
        data: Region,
        /// The allocation.
        alloc: String,
    },
    /// A load/store-class store was read through a flag that did not publish it: the writer
    /// stored, then wrote the flag with no fence (or release) between them.
    #[error(
        "store not published (missing fence before release): {reader} on rank {rank} read {data} stored by {writer} \
         (op {store_op}, epoch {store_epoch}) but only acquired {writer}'s epoch {known_epoch}; \
         fence (or store_release) after the data and before the flag"
    )]
    StoreNotPublished {
        /// Rank read.
        rank: usize,
        /// The reader.
        reader: AgentRef,
        /// Bytes read.
        data: Region,
        /// Who stored them.
        writer: AgentRef,
        /// The store's operation id.
        store_op: u64,
        /// The writer's epoch at the store.
        store_epoch: u64,
        /// The writer's epoch the reader had acquired.
        known_epoch: u64,
    },
    /// A read of bytes whose write no release/acquire or signal chain ordered before the read.
    #[error(
        "data race: {reader} on rank {rank} read {data} last written by {writer} (op {write_op}) with nothing ordering it"
    )]
    DataRace {
        /// Rank read.
        rank: usize,
        /// The reader.
        reader: AgentRef,
        /// Bytes read.
        data: Region,
        /// The writer (agent or RDMA stream).
        writer: String,
        /// The write's operation id.
        write_op: u64,
    },
    /// A write to the source of an RDMA operation that has not completed (the NIC reads the
    /// source at delivery).
    #[error(
        "source written before completion: {writer} wrote {data} on rank {rank}, the source of op {op} \
         ({issuer} -> rank {peer}, {qp}) which had not completed; quiet before reusing a source"
    )]
    SourceWrittenBeforeCompletion {
        /// Rank holding the source.
        rank: usize,
        /// Who wrote.
        writer: String,
        /// Bytes written.
        data: Region,
        /// The incomplete operation.
        op: u64,
        /// Who posted it.
        issuer: AgentRef,
        /// Its target rank.
        peer: usize,
        /// Its QP.
        qp: QpIndex,
    },
    /// A write into a ring slot that holds a live (published, unconsumed) entry.
    #[error(
        "ring overrun: '{ring}' on rank {rank}: {writer} wrote slot {slot} while entries [{head}, {tail}) \
         of capacity {capacity} were live; wait until entry - head < capacity"
    )]
    RingOverrun {
        /// Ring name.
        ring: String,
        /// Rank holding the slots.
        rank: usize,
        /// Slot written.
        slot: u64,
        /// Head (consumed count) at the write.
        head: u64,
        /// Tail (published count) at the write.
        tail: u64,
        /// Capacity.
        capacity: u64,
        /// The writing agent or work request.
        writer: String,
    },
    /// A read of a ring slot that holds no published entry.
    #[error(
        "read past tail: '{ring}' on rank {rank}: {reader} read slot {slot} outside live entries [{head}, {tail})"
    )]
    ReadPastTail {
        /// Ring name.
        ring: String,
        /// Rank holding the slots.
        rank: usize,
        /// The reader.
        reader: AgentRef,
        /// Slot read.
        slot: u64,
        /// Head.
        head: u64,
        /// Tail.
        tail: u64,
    },
    /// A word the protocol assumes zero at a call's start is not (a counter not reset).
    #[error(
        "non-zero at call start: rank {rank} word {word:#x} = {value} when call {call} began \
         (last written by {last_writer} in call {written_in_call}); reset it before the call ends"
    )]
    NonZeroAtCallStart {
        /// Rank.
        rank: usize,
        /// Word.
        word: u64,
        /// Its value.
        value: u64,
        /// The call starting.
        call: u64,
        /// Who wrote it last.
        last_writer: String,
        /// In which call.
        written_in_call: u64,
    },
    /// A receive half (hook) of call `hook_call` read data a later call on the same buffer wrote.
    #[error(
        "hook after next call: {reader} (hook of call {hook_call}) read {data} on rank {rank} written by call \
         {written_in_call} (op {write_op}); run the hook before the next call on that buffer"
    )]
    HookAfterNextCall {
        /// Rank read.
        rank: usize,
        /// The hook's agent.
        reader: AgentRef,
        /// Bytes read.
        data: Region,
        /// The hook's call.
        hook_call: u64,
        /// The later call that overwrote them.
        written_in_call: u64,
        /// The overwriting operation.
        write_op: u64,
    },
    /// A post into a full QP where full QPs are an error: the protocol under-counted its work
    /// requests (often a chunk-straddling put counted as one).
    #[error(
        "QP depth exceeded: {agent} posted op {op} ({work_requests} work requests) to rank {peer} {qp} holding \
         {outstanding} outstanding of depth {depth}; puts split at heap chunk boundaries among them (op, work requests): \
         {split_ops:?}; count every work request (AgentCtx::work_requests) against the depth"
    )]
    QpDepthExceeded {
        /// The poster.
        agent: AgentRef,
        /// Target.
        peer: usize,
        /// QP.
        qp: QpIndex,
        /// Depth.
        depth: u32,
        /// Outstanding work requests at the post.
        outstanding: u32,
        /// The operation.
        op: u64,
        /// Its work requests.
        work_requests: u32,
        /// Outstanding puts on this QP (this one included) that crossed a heap chunk boundary and
        /// so became several work requests: (op, work requests). Non-empty when a chunk-straddling
        /// put was counted as one.
        split_ops: Vec<(u64, u32)>,
    },
    /// Every live agent is parked and nothing in flight can wake any of them.
    #[error("deadlock: {}", waiting.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Deadlock {
        /// The wait-for graph: each parked agent and what it awaits.
        waiting: Vec<Waiting>,
    },
    /// A wait exceeded its virtual-time bound while other agents kept running.
    #[error("wait timeout after {waited} ticks: {waiting}")]
    WaitTimeout {
        /// Who waited for what.
        waiting: Waiting,
        /// Ticks waited.
        waited: u64,
    },
    /// A `quiet`, or a post waiting for a slot of a full QP, saw no completion within the bound
    /// (a dropped completion, a dead peer).
    #[error(
        "completion timeout after {waited} ticks: {agent} in {during} waits for completions on {qp} to rank {peer} \
         ({outstanding} outstanding; oldest: {oldest}){}",
        if faults.is_empty() { String::new() } else { format!("; injected faults: {}", faults.join("; ")) }
    )]
    CompletionTimeout {
        /// The waiting agent.
        agent: AgentRef,
        /// The QP's peer.
        peer: usize,
        /// The QP.
        qp: QpIndex,
        /// `"quiet"` or `"post to a full QP"`.
        during: &'static str,
        /// Work requests outstanding on the QP.
        outstanding: u64,
        /// The oldest of them.
        oldest: String,
        /// Ticks waited.
        waited: u64,
        /// Injected faults that had struck.
        faults: Vec<String>,
    },
}

impl Violation {
    /// The rank the violation is reported on.
    #[must_use]
    pub fn rank(&self) -> usize {
        match self {
            Violation::SignalBeforeData { rank, .. }
            | Violation::ReadOfUndelivered { rank, .. }
            | Violation::ReadOfPoison { rank, .. }
            | Violation::StoreNotPublished { rank, .. }
            | Violation::DataRace { rank, .. }
            | Violation::SourceWrittenBeforeCompletion { rank, .. }
            | Violation::RingOverrun { rank, .. }
            | Violation::ReadPastTail { rank, .. }
            | Violation::NonZeroAtCallStart { rank, .. }
            | Violation::HookAfterNextCall { rank, .. } => *rank,
            Violation::QpDepthExceeded { agent, .. }
            | Violation::CompletionTimeout { agent, .. } => agent.rank,
            Violation::Deadlock { waiting } => waiting.first().map_or(0, |w| w.agent.rank),
            Violation::WaitTimeout { waiting, .. } => waiting.agent.rank,
        }
    }

    /// The variant's name (for tables and tests).
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Violation::SignalBeforeData { .. } => "SignalBeforeData",
            Violation::ReadOfUndelivered { .. } => "ReadOfUndelivered",
            Violation::ReadOfPoison { .. } => "ReadOfPoison",
            Violation::StoreNotPublished { .. } => "StoreNotPublished",
            Violation::DataRace { .. } => "DataRace",
            Violation::SourceWrittenBeforeCompletion { .. } => "SourceWrittenBeforeCompletion",
            Violation::RingOverrun { .. } => "RingOverrun",
            Violation::ReadPastTail { .. } => "ReadPastTail",
            Violation::NonZeroAtCallStart { .. } => "NonZeroAtCallStart",
            Violation::HookAfterNextCall { .. } => "HookAfterNextCall",
            Violation::QpDepthExceeded { .. } => "QpDepthExceeded",
            Violation::Deadlock { .. } => "Deadlock",
            Violation::WaitTimeout { .. } => "WaitTimeout",
            Violation::CompletionTimeout { .. } => "CompletionTimeout",
        }
    }
}
