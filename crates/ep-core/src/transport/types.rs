//! Names shared by the host face and the protocol vocabulary: addresses in the symmetric heap,
//! agents, QPs, reachability, fabric resources and wait conditions.

use std::fmt;

/// An address in the symmetric heap: a byte offset from the heap base, the same on every rank
/// (NVSHMEM's symmetric address, minus the base). An operation names the rank separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SymAddr(pub u64);

impl SymAddr {
    /// The address `bytes` further on.
    #[must_use]
    pub const fn add(self, bytes: u64) -> SymAddr {
        SymAddr(self.0 + bytes)
    }
}

impl fmt::Display for SymAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "heap+{:#x}", self.0)
    }
}

/// A byte range of the symmetric heap: `[addr, addr + len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Region {
    /// First byte.
    pub addr: SymAddr,
    /// Length in bytes.
    pub len: u64,
}

impl Region {
    /// The region `[addr, addr + len)`.
    #[must_use]
    pub const fn new(addr: SymAddr, len: u64) -> Region {
        Region { addr, len }
    }
    /// One past the last byte.
    #[must_use]
    pub const fn end(&self) -> u64 {
        self.addr.0 + self.len
    }
    /// Whether the two ranges share a byte.
    #[must_use]
    pub const fn overlaps(&self, other: &Region) -> bool {
        self.addr.0 < other.end() && other.addr.0 < self.end() && self.len > 0 && other.len > 0
    }
    /// The sub-range `[off, off + len)` of this region (offsets relative to `addr`).
    #[must_use]
    pub const fn sub(&self, off: u64, len: u64) -> Region {
        Region {
            addr: SymAddr(self.addr.0 + off),
            len,
        }
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{:#x}, {:#x})", self.addr.0, self.end())
    }
}

/// How a symmetric allocation starts out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// Zero-filled once at allocation (counters and flags the protocol resets itself).
    Zero,
    /// Poison: contents are undefined; reading before writing is a violation.
    Poison,
    /// Scratch: poison at allocation **and again before every phase** (in the simulator). Phases,
    /// not calls: a send half and its receive half (the hook) are different phases, so nothing
    /// written into scratch survives into the next phase, even of the same call. Use `Poison` for
    /// staging that lives from one phase to the next.
    Scratch,
}

/// A collective allocation request: every rank allocates the same bytes at the same offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocRequest {
    /// Name used in diagnostics ("rdma_buffer", "ll_recv_count", ...).
    pub name: String,
    /// Bytes per rank.
    pub bytes: u64,
    /// Alignment of the offset (a power of two; 128 in DeepEP, spec §4).
    pub align: u64,
    /// Initial contents.
    pub init: Init,
}

/// A symmetric allocation: the same `region` on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SymAlloc {
    /// The name it was requested under.
    pub name: String,
    /// Offset and length (same on every rank).
    pub region: Region,
    /// Initial contents.
    pub init: Init,
}

impl SymAlloc {
    /// The address `off` bytes into the allocation.
    #[must_use]
    pub const fn at(&self, off: u64) -> SymAddr {
        SymAddr(self.region.addr.0 + off)
    }
}

/// How one rank reaches another (DeepEP: `nvshmemi_get_p2p_ptr` non-null means load/store).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reach {
    /// The same rank: local loads and stores; RDMA-class operations loop back.
    Local,
    /// Same node: NVLink load/store class and RDMA class both work.
    NvLink,
    /// Another node: RDMA class only.
    Rdma,
}

impl Reach {
    /// Whether the load/store class can reach the peer.
    #[must_use]
    pub const fn load_store(self) -> bool {
        matches!(self, Reach::Local | Reach::NvLink)
    }
}

/// An RC QP index towards one peer: `0..rc_per_pe` (NVSHMEM_IBGDA_NUM_RC_PER_PE, spec §3.8, §4).
/// A QP is identified by (source rank, peer, index); it is shared by the agents of the source
/// rank that choose the same index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct QpIndex(pub u16);

impl fmt::Display for QpIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "qp{}", self.0)
    }
}

/// Whether posting to a full QP waits for completions (NVSHMEM's public API) or is an error
/// (a device layer that reserves slots without checking, like DeepEP V1's IBGDA layer, spec §3.8:
/// the protocol itself must keep in-flight work requests within the depth).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QpFullPolicy {
    /// A post to a full QP waits until completions free slots.
    #[default]
    Wait,
    /// A post to a full QP is a violation (the protocol must count its work requests).
    Error,
}

/// The resources of the RDMA fabric and the shape of the job (spec §4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricParams {
    /// Number of ranks (PEs).
    pub num_ranks: usize,
    /// Ranks per node: ranks `r` and `s` are NVLink peers iff `r / ranks_per_node == s / ranks_per_node`.
    pub ranks_per_node: usize,
    /// Symmetric heap chunk size in bytes (`NVSHMEM_CUMEM_GRANULARITY`, default 2^29): an RDMA
    /// operation crossing a multiple of it becomes one work request per chunk touched.
    pub granularity: u64,
    /// Outstanding work requests per QP (`NVSHMEM_QP_DEPTH`).
    pub qp_depth: u32,
    /// RC QPs per peer (`NVSHMEM_IBGDA_NUM_RC_PER_PE`).
    pub rc_per_pe: u16,
    /// What a post to a full QP does.
    pub qp_full: QpFullPolicy,
    /// Symmetric heap size per rank in bytes (an upper bound; memory is materialised lazily).
    pub heap_bytes: u64,
}

impl FabricParams {
    /// One node of `num_ranks` NVLink peers with NVSHMEM's defaults as DeepEP sets them.
    #[must_use]
    pub fn single_node(num_ranks: usize) -> FabricParams {
        FabricParams {
            num_ranks,
            ranks_per_node: num_ranks.max(1),
            granularity: 1 << 29,
            qp_depth: 1024,
            rc_per_pe: 1,
            qp_full: QpFullPolicy::Wait,
            heap_bytes: 1 << 40,
        }
    }

    /// How `from` reaches `to`.
    #[must_use]
    pub fn reach(&self, from: usize, to: usize) -> Reach {
        if from == to {
            Reach::Local
        } else if from / self.ranks_per_node.max(1) == to / self.ranks_per_node.max(1) {
            Reach::NvLink
        } else {
            Reach::Rdma
        }
    }

    /// Work requests an RDMA transfer of `len` bytes from `src` to `dst` becomes: one per piece
    /// between consecutive heap chunk boundaries of either side (spec §3.8: `put_nbi_warp` splits
    /// at lkey and rkey chunk boundaries). At least one.
    #[must_use]
    pub fn work_requests(&self, dst: SymAddr, src: SymAddr, len: u64) -> u32 {
        chunk_pieces(self.granularity, dst, src, len).len().max(1) as u32
    }
}

/// The pieces of a transfer of `len` bytes from `src` to `dst` that lie in one heap chunk on both
/// sides, as `(offset, length)` from the start of the transfer.
#[must_use]
pub fn chunk_pieces(granularity: u64, dst: SymAddr, src: SymAddr, len: u64) -> Vec<(u64, u64)> {
    let g = granularity.max(1);
    let mut out = Vec::new();
    let mut off = 0;
    while off < len {
        let (d, s) = (dst.0 + off, src.0 + off);
        let n = (len - off).min(g - d % g).min(g - s % g);
        out.push((off, n));
        off += n;
    }
    out
}

/// A team of ranks for host barriers (NVSHMEM teams).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Team {
    /// Member ranks, ascending.
    pub ranks: Vec<usize>,
}

impl Team {
    /// All ranks `0..n`.
    #[must_use]
    pub fn world(n: usize) -> Team {
        Team {
            ranks: (0..n).collect(),
        }
    }
}

/// Which agent: a rank and the agent's index among that rank's agents in the phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AgentId {
    /// The rank the agent runs on.
    pub rank: usize,
    /// Index among the rank's agents in the phase, in the order the phase lists them.
    pub index: usize,
}

impl fmt::Display for AgentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank{}/agent{}", self.rank, self.index)
    }
}

/// A comparison for `wait`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    /// `word == value`.
    Eq,
    /// `word != value`.
    Ne,
    /// `word >= value` (unsigned).
    Ge,
    /// `word > value` (unsigned).
    Gt,
    /// `word <= value` (unsigned).
    Le,
    /// `word < value` (unsigned).
    Lt,
}

impl Cmp {
    /// Whether `word cmp value` holds.
    #[must_use]
    pub const fn holds(self, word: u64, value: u64) -> bool {
        match self {
            Cmp::Eq => word == value,
            Cmp::Ne => word != value,
            Cmp::Ge => word >= value,
            Cmp::Gt => word > value,
            Cmp::Le => word <= value,
            Cmp::Lt => word < value,
        }
    }
}

impl fmt::Display for Cmp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Cmp::Eq => "==",
            Cmp::Ne => "!=",
            Cmp::Ge => ">=",
            Cmp::Gt => ">",
            Cmp::Le => "<=",
            Cmp::Lt => "<",
        })
    }
}

/// What a bounded wait waits for: a 64-bit word on a rank the agent can load from, a condition,
/// and a label naming it for diagnostics ("tail of channel 3 from rank 5").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitUntil {
    /// Rank holding the word (the agent's own, or an NVLink peer).
    pub rank: usize,
    /// The word (8-byte aligned, little-endian u64).
    pub word: SymAddr,
    /// The condition.
    pub cmp: Cmp,
    /// The operand.
    pub value: u64,
    /// What is awaited, for the timeout or deadlock report.
    pub what: String,
}

/// How a signal word is updated by `put_signal` (NVSHMEM_SIGNAL_SET / NVSHMEM_SIGNAL_ADD).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalOp {
    /// Store the value.
    Set,
    /// Add the value (wrapping).
    Add,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_split_at_chunk_boundaries_of_either_side() {
        let f = FabricParams {
            granularity: 100,
            ..FabricParams::single_node(2)
        };
        assert_eq!(f.work_requests(SymAddr(0), SymAddr(0), 100), 1);
        assert_eq!(f.work_requests(SymAddr(50), SymAddr(0), 100), 2);
        assert_eq!(f.work_requests(SymAddr(50), SymAddr(20), 100), 3);
        assert_eq!(f.work_requests(SymAddr(0), SymAddr(0), 0), 1);
        assert_eq!(
            chunk_pieces(100, SymAddr(50), SymAddr(20), 100),
            vec![(0, 50), (50, 30), (80, 20)]
        );
    }

    #[test]
    fn reach_follows_nodes_and_regions_overlap() {
        let f = FabricParams {
            ranks_per_node: 2,
            ..FabricParams::single_node(4)
        };
        assert_eq!(f.reach(1, 1), Reach::Local);
        assert_eq!(f.reach(0, 1), Reach::NvLink);
        assert_eq!(f.reach(1, 2), Reach::Rdma);
        assert!(!Reach::Rdma.load_store());
        let a = Region::new(SymAddr(0), 16);
        assert!(a.overlaps(&Region::new(SymAddr(15), 1)));
        assert!(!a.overlaps(&Region::new(SymAddr(16), 4)));
        assert!(Cmp::Ge.holds(5, 5) && !Cmp::Gt.holds(5, 5) && Cmp::Ne.holds(1, 2));
    }
}
