//! Low-latency mode on one GPU with `R` co-resident ranks (docs/protocol.md §3,
//! `cuda/low_latency.cu`), in either kernel variant ([`LlVariant`]): (a) peers by pointer
//! ([`LlGroup::new`]), or (b) every peer through NVSHMEM's device API ([`LlGroup::with_nvshmem`]:
//! the ranks are regions of one PE's symmetric heap, the kernels linked at run time against the
//! loaded NVSHMEM's device library). Each rank has its `ll.signals` and `ll.data` (laid out by
//! `ep_core::protocol::layout::LlLayout`), its own stream, and its received-row outputs; nothing
//! on the path synchronises with the host.
//!
//! Operations number from 0 per group (`op`); operation `m` uses half `m mod 2` of `ll.data` and
//! of the group's output buffers, so a dispatch's outputs (views) stay valid until the next
//! operation that uses the same half (with dispatch and combine alternating: the next dispatch).
//!
//! Output shapes (DeepEP's, flattened to 2-D views): `recv_x` `[L·R·N, H]` (expert `l`'s rows
//! from `l·R·N`), FP8 scales in DeepEP's memory order `[L·S, R·N]` f32 (or `[L·S/4, R·N]` packed
//! UE8M0 i32), `src_info` `[L, R·N]`, `layout_range` `[L, R]` i64, `count` `[1, L]` i32. Rows past
//! an expert's count are not written.
//!
//! Weights travel with the dispatch (the meta records carry them, docs/protocol.md §3.2): the
//! combine applies the dispatched weights.
//!
//! This file holds the group's state and life cycle (creation in either variant, sync, reset,
//! clean); each call has its own file: `dispatch` (and its hook), `combine`, `mask` (shrink),
//! `stats`, `timing` (the gate and the phase stamps), `tracing`, `launch` (the kernels and their
//! shared memory), `errors` (the device's error record as a typed error), `types` (what the
//! calls take and give).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaStream;
use ep_core::plan::low_latency::{LlParams, validate_hidden, validate_params};
use ep_core::protocol::layout::{LlLayout, REGION_ALIGN, ll_half, ll_signal_bytes};

mod combine;
mod dispatch;
mod errors;
mod graph;
mod launch;
mod mask;
mod stats;
mod timing;
mod tracing;
mod types;

use dispatch::hook_pending;
pub use graph::LlGraph;
use launch::Smem;
pub use types::{
    LlCombineArgs, LlCombineInput, LlDispatchArgs, LlGpuDispatch, LlGpuHandle, LlPoison,
    LlRankInputs, LlStats, LlVariant,
};

use super::abi::{self, ErrBlock, LlArgs};
use super::device::{Device, LlKernels};
use super::gate::Gate;
use super::mem::DevBuf;
use super::tensor::{DType, DevTensor};
use super::trace::TraceBufs;
use crate::error::{Error, Result};
use crate::nvshmem::NvshmemSession;
use crate::nvshmem::device_link::{LinkedLl, link_ll_module};

/// Ranks a low-latency kernel can address.
pub const MAX_RANKS: usize = abi::EP_GPU_MAX_RANKS as usize;
/// Top-k the meta record holds.
pub const MAX_TOPK: usize = ep_core::protocol::layout::LL_MAX_TOPK;
const THREADS: u32 = abi::EP_GPU_THREADS as u32;

/// The shape a group is built for (DeepEP's `Buffer` + `num_max_dispatch_tokens_per_rank`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlConfig {
    /// Ranks `R`.
    pub num_ranks: usize,
    /// `N`: most tokens a rank dispatches per call.
    pub num_max_dispatch_tokens_per_rank: usize,
    /// Hidden size `H` (a multiple of 128).
    pub hidden: usize,
    /// Experts `E` (a multiple of `R`).
    pub num_experts: usize,
    /// Blocks (SMs) per rank's kernel; `R × num_sms ≤` the GPU's SMs.
    pub num_sms: usize,
}

impl LlConfig {
    /// Local experts `L`.
    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.num_ranks.max(1)
    }

    fn layout(&self) -> LlLayout {
        LlLayout {
            num_ranks: self.num_ranks,
            num_local_experts: self.num_local_experts(),
            hidden: self.hidden,
            num_max_tokens: self.num_max_dispatch_tokens_per_rank,
        }
    }

    /// Rows of each local expert's packed array (`R·N`).
    pub fn rows_per_expert(&self) -> usize {
        self.num_ranks * self.num_max_dispatch_tokens_per_rank
    }
}

/// Which receive halves a hook runs.
#[derive(Clone, Debug)]
enum Pending {
    Dispatch(Vec<Option<LlArgs>>),
    /// The receive parts' arguments (their flags say the flavour: EP_FLAG_LOGFMT).
    Combine(Vec<Option<LlArgs>>),
}

/// Per rank, per half: the outputs and handle arrays of the operation using that half.
#[derive(Debug)]
struct HalfBufs {
    recv_x: Arc<DevBuf>,
    recv_scales: Arc<DevBuf>,
    src_info: Arc<DevBuf>,
    layout_range: Arc<DevBuf>,
    count: Arc<DevBuf>,
    slots: Arc<DevBuf>,
    send_counts: Arc<DevBuf>,
    recv_counts: Arc<DevBuf>,
    combined: Arc<DevBuf>,
    /// What the half's last dispatch produced: `(op, tokens, format flags)`.
    dispatch: Option<(u64, usize)>,
}

#[derive(Debug)]
struct LlRank {
    /// Its rank in the group (`0..R`).
    rank: usize,
    stream: Arc<CudaStream>,
    signals: Arc<DevBuf>,
    data: Arc<DevBuf>,
    /// `int32[R]` shrink mask.
    mask: Arc<DevBuf>,
    /// `[num_sms]` u64: each block's last call number (the device-resident epoch a captured
    /// kernel counts from, docs/protocol.md §3.10).
    epoch: Arc<DevBuf>,
    /// `[L]` i32 cumulative received tokens, `[R]` u64 ns waited per source.
    recv_stats: Arc<DevBuf>,
    wait_stats: Arc<DevBuf>,
    halves: [HalfBufs; 2],
}

/// How the kernels reach the peers.
#[derive(Debug)]
enum Peers {
    Pointers,
    /// Variant (a) with one rank per process: arrays in the session's symmetric heap, peers by
    /// `nvshmem_ptr`.
    PointersOverNvshmem(Arc<NvshmemSession>),
    Nvshmem(Box<NvshmemPeers>),
}

impl Peers {
    /// The NVSHMEM session the arrays live in, if any.
    fn session(&self) -> Option<&Arc<NvshmemSession>> {
        match self {
            Peers::Pointers => None,
            Peers::PointersOverNvshmem(s) => Some(s),
            Peers::Nvshmem(n) => Some(&n.session),
        }
    }
}

/// Variant (b)'s state: the session (one PE holding every co-resident rank's regions), the
/// module linked at run time, each rank's PE.
#[derive(Debug)]
struct NvshmemPeers {
    session: Arc<NvshmemSession>,
    linked: LinkedLl,
    kernels: LlKernels,
    pes: Vec<u64>,
    /// The traced build, linked when tracing is first turned on ([`LlGroup::set_trace`]).
    traced: Option<(LinkedLl, LlKernels)>,
}

/// `R` co-resident ranks on one GPU running low-latency mode (module docs).
#[derive(Debug)]
pub struct LlGroup {
    dev: Arc<Device>,
    cfg: LlConfig,
    /// The ranks this process drives (all `R` co-resident, or one per process), in rank order.
    ranks: Vec<LlRank>,
    /// Every rank's `ll.signals` / `ll.data` as this process's kernels address them (pointers,
    /// or symmetric addresses of this PE's heap).
    peer_signals: Vec<u64>,
    peer_data: Vec<u64>,
    /// After `ranks`: their arenas may live in the session's symmetric heap.
    peers: Peers,
    call: u64,
    op: u64,
    generation: u64,
    timeout: Duration,
    poison: Option<String>,
    pending: Option<Pending>,
    mask: Vec<bool>,
    absent: Option<usize>,
    /// Shrink mode ([`LlGroup::set_shrink`]).
    shrink: bool,
    /// Protocol traces ([`LlGroup::set_trace`]).
    tracing: Option<TraceBufs>,
    gate: Option<Gate>,
    smem_limit: usize,
    /// Per rank: where the kernels stamp their phase times, when measuring.
    phase_times: Option<Vec<DevTensor>>,
    /// Identity (graphs replay on the group they were captured from).
    id: u64,
    /// The capture recording, if any ([`LlGroup::capture`]).
    capture: Option<graph::LlCapture>,
}

impl LlGroup {
    /// `cfg.num_ranks` co-resident ranks with the arenas and outputs for `cfg`. Fails with a
    /// typed error when the shape is outside what the kernels address or the ranks cannot all
    /// be resident at once.
    pub fn new(dev: Arc<Device>, cfg: LlConfig) -> Result<Self> {
        let all: Vec<usize> = (0..cfg.num_ranks).collect();
        Self::build(dev, cfg, Peers::Pointers, &all, &mut |ctx, bytes| {
            DevBuf::new(ctx, bytes)
        })
    }

    /// Variant (b): every put, signal, fence and quiet through NVSHMEM's device API, the ranks'
    /// `ll.signals` and `ll.data` in `session`'s symmetric heap. With one PE, `cfg.num_ranks`
    /// co-resident ranks are regions of it; with `cfg.num_ranks` PEs (one process per rank),
    /// this process drives rank `my_pe` (creation is then collective, like the session's
    /// allocations, and so are [`LlGroup::clean`] and [`LlGroup::reset`]). The kernels are linked at run
    /// time against the `libnvshmem_device.a` of the session's library (cached on disk,
    /// [`link_ll_module`]); a version mismatch or a missing device library is a typed error.
    pub fn with_nvshmem(
        dev: Arc<Device>,
        cfg: LlConfig,
        session: Arc<NvshmemSession>,
    ) -> Result<Self> {
        // One PE holding every rank, or one PE per rank (this process drives rank my_pe).
        let (local, pes): (Vec<usize>, Vec<u64>) = if session.n_pes() == 1 {
            (
                (0..cfg.num_ranks).collect(),
                vec![u64::from(session.my_pe()); cfg.num_ranks],
            )
        } else if session.n_pes() as usize == cfg.num_ranks {
            (
                vec![session.my_pe() as usize],
                (0..cfg.num_ranks as u64).collect(),
            )
        } else {
            return Err(Error::Unsupported(format!(
                "an NVSHMEM session of {} PEs for {} ranks: variant (b) takes one PE holding every rank (co-resident) or one PE per rank",
                session.n_pes(),
                cfg.num_ranks
            )));
        };
        if session.report().device != dev.ordinal() {
            return Err(Error::Unsupported(format!(
                "NVSHMEM runs on GPU {}, the group on GPU {}: open the Device NVSHMEM was initialised on",
                session.report().device,
                dev.ordinal()
            )));
        }
        let linked = link_ll_module(&session)?;
        let kernels = LlKernels {
            dispatch: linked.dispatch().clone(),
            combine: linked.combine().clone(),
            combine_logfmt: linked.combine_logfmt().clone(),
        };
        let peers = Peers::Nvshmem(Box::new(NvshmemPeers {
            session: session.clone(),
            linked,
            kernels,
            pes,
            traced: None,
        }));
        // Collective in rank order: every PE allocates the same arrays in the same order.
        Self::build(dev, cfg, peers, &local, &mut |ctx, bytes| {
            let sym = Arc::new(session.alloc(bytes, REGION_ALIGN as usize)?);
            let ptr = sym.device_ptr();
            // SAFETY: the symmetric buffer is device memory of this GPU (the session's device,
            // checked above) of `bytes` bytes, kept allocated by `sym`, which the view holds.
            Ok(unsafe { DevBuf::foreign(ctx, ptr, bytes, sym) })
        })
    }

    /// Variant (a) with one rank per process (`session` has one PE per rank; this process
    /// drives rank `my_pe`): the arrays in the symmetric heap, every peer addressed by pointer
    /// (`nvshmem_ptr`: NVLink P2P, or this GPU), variant (a)'s kernels. A peer that is not
    /// load/store reachable is [`Error::Unsupported`] (variant (b), [`LlGroup::with_nvshmem`],
    /// reaches it through NVSHMEM's transports). Creation, `clean` and `reset` are collective.
    pub fn with_nvshmem_pointers(
        dev: Arc<Device>,
        cfg: LlConfig,
        session: Arc<NvshmemSession>,
    ) -> Result<Self> {
        let (me, r) = (session.my_pe() as usize, cfg.num_ranks);
        if session.n_pes() as usize != r || r < 2 {
            return Err(Error::Unsupported(format!(
                "an NVSHMEM session of {} PEs for {r} ranks: variant (a) over NVSHMEM takes one PE per rank (co-resident ranks: LlGroup::new)",
                session.n_pes()
            )));
        }
        if session.report().device != dev.ordinal() {
            return Err(Error::Unsupported(format!(
                "NVSHMEM runs on GPU {}, the group on GPU {}: open the Device NVSHMEM was initialised on",
                session.report().device,
                dev.ordinal()
            )));
        }
        let mut syms: Vec<Arc<crate::nvshmem::SymmetricBuffer>> = Vec::new();
        let peers = Peers::PointersOverNvshmem(session.clone());
        let mut g = Self::build(dev, cfg, peers, &[me], &mut |ctx, bytes| {
            let sym = Arc::new(session.alloc(bytes, REGION_ALIGN as usize)?);
            syms.push(sym.clone());
            let ptr = sym.device_ptr();
            // SAFETY: as in `with_nvshmem`: this GPU's memory of `bytes` bytes, kept allocated
            // by `sym`, which the view holds.
            Ok(unsafe { DevBuf::foreign(ctx, ptr, bytes, sym) })
        })?;
        // build allocates the signals, then the data.
        let [signals, data] = &syms[..] else {
            return Err(Error::Unsupported(
                "variant (a) over NVSHMEM: expected two symmetric arrays per rank".into(),
            ));
        };
        for d in 0..r {
            let (Some(s), Some(p)) = (signals.peer_ptr(d as u32), data.peer_ptr(d as u32)) else {
                return Err(Error::Unsupported(format!(
                    "rank {d} (PE {d}) is not load/store reachable from rank {me} (no NVLink P2P): variant (a) addresses peers by pointer; use LlGroup::with_nvshmem (variant (b))"
                )));
            };
            g.peer_signals[d] = s;
            g.peer_data[d] = p;
        }
        Ok(g)
    }

    /// The kernel variant.
    pub fn variant(&self) -> LlVariant {
        match self.peers {
            Peers::Pointers | Peers::PointersOverNvshmem(_) => LlVariant::Pointers,
            Peers::Nvshmem(_) => LlVariant::Nvshmem,
        }
    }

    /// How each rank reaches its peers, and (variant (b)) what NVSHMEM brought up: its
    /// version, the transports, IBGDA's state, and the linked module.
    pub fn transport_report(&self) -> String {
        match &self.peers {
            Peers::Pointers => format!(
                "variant (a): {} co-resident ranks reach each other by pointer (this GPU's memory)",
                self.num_ranks()
            ),
            Peers::PointersOverNvshmem(s) => format!(
                "variant (a): rank {} of {} in this process, peers by pointer into NVSHMEM's symmetric heap (nvshmem_ptr; p2p peers {:?}); NVSHMEM {} ({})",
                self.ranks[0].rank,
                self.num_ranks(),
                s.report().p2p_peers,
                s.report().version,
                s.report().library.display()
            ),
            Peers::Nvshmem(n) => {
                let rep = n.session.report();
                let shape = if self.ranks.len() == self.num_ranks() {
                    format!(
                        "{} co-resident ranks are regions of NVSHMEM PE {} of {}",
                        self.num_ranks(),
                        n.session.my_pe(),
                        n.session.n_pes()
                    )
                } else {
                    format!(
                        "rank {} of {} in this process is NVSHMEM PE {} of {} (p2p peers: {:?}, remote peers: {:?})",
                        self.ranks[0].rank,
                        self.num_ranks(),
                        n.session.my_pe(),
                        n.session.n_pes(),
                        rep.p2p_peers,
                        rep.remote_peers
                    )
                };
                format!(
                    "variant (b): {shape}, every peer through the device API; NVSHMEM {} ({}); transports up: {}; IBGDA: {}; device code {} ({})",
                    rep.version,
                    rep.library.display(),
                    if rep.transports_up().is_empty() {
                        "none needed (one PE: every put is a loopback)".to_string()
                    } else {
                        rep.transports_up().join(", ")
                    },
                    rep.ibgda,
                    n.linked
                        .cubin_path()
                        .map_or_else(|| "(not cached)".into(), |p| p.display().to_string()),
                    if n.linked.from_cache() {
                        "from the cache"
                    } else {
                        "linked now"
                    }
                )
            }
        }
    }

    fn build(
        dev: Arc<Device>,
        cfg: LlConfig,
        peers: Peers,
        local: &[usize],
        arena: &mut dyn FnMut(&Arc<cudarc::driver::CudaContext>, usize) -> Result<DevBuf>,
    ) -> Result<Self> {
        let r = cfg.num_ranks;
        if r == 0 || r > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{r} ranks: the low-latency kernels address 1 to {MAX_RANKS} ranks"
            )));
        }
        if cfg.num_experts == 0 || !cfg.num_experts.is_multiple_of(r) {
            return Err(Error::Unsupported(format!(
                "{} experts over {r} ranks: the experts must divide evenly (and be at least 1)",
                cfg.num_experts
            )));
        }
        if cfg.num_local_experts() > ep_core::protocol::layout::MAX_LOCAL_EXPERTS
            || cfg.num_experts > i16::MAX as usize
        {
            return Err(Error::Unsupported(format!(
                "{} experts ({} per rank): at most {} local experts and {} experts",
                cfg.num_experts,
                cfg.num_local_experts(),
                ep_core::protocol::layout::MAX_LOCAL_EXPERTS,
                i16::MAX
            )));
        }
        validate_hidden(cfg.hidden, false)?;
        validate_params(
            r,
            &LlParams::new(cfg.num_max_dispatch_tokens_per_rank, cfg.num_experts),
        )?;
        let n = cfg.num_max_dispatch_tokens_per_rank;
        if n == 0 || n * MAX_TOPK >= u16::MAX as usize {
            return Err(Error::Unsupported(format!(
                "num_max_dispatch_tokens_per_rank {n}: use 1 to {} (slots and rows are 16-bit)",
                (u16::MAX as usize - 1) / MAX_TOPK
            )));
        }
        let max_groups = ep_core::protocol::layout::LL_MAX_SEND_GROUPS;
        if cfg.num_sms > max_groups {
            return Err(Error::Unsupported(format!(
                "num_sms {}: a low-latency rank runs one send group per block, at most {max_groups} \
                 (docs/protocol.md §3.3): use at most {max_groups} SMs per rank",
                cfg.num_sms
            )));
        }
        if cfg.num_sms == 0 || r * cfg.num_sms > dev.num_sms() {
            return Err(Error::NotEnoughSms {
                ranks: r,
                sms_per_rank: cfg.num_sms,
                device_sms: dev.num_sms(),
            });
        }
        let smem = Smem::new(&cfg, n as u64, MAX_TOPK as u64);
        let smem_limit = match &peers {
            Peers::Pointers | Peers::PointersOverNvshmem(_) => dev.max_dynamic_smem(),
            // The linked functions opt in to what their own static shared memory leaves.
            Peers::Nvshmem(n) => dev.max_dynamic_smem().min(n.linked.max_dynamic_smem()),
        };
        if smem.bytes as usize > smem_limit {
            return Err(Error::Unsupported(format!(
                "{n} tokens x top-{MAX_TOPK} over {} experts need {} bytes of shared memory per block; the GPU allows {smem_limit}: fewer tokens per call or experts",
                cfg.num_experts, smem.bytes
            )));
        }
        let ly = cfg.layout();
        let ctx = dev.context().clone();
        let (l, rows, h) = (cfg.num_local_experts(), cfg.rows_per_expert(), cfg.hidden);
        let s = h / 128;
        let mut ranks = Vec::with_capacity(local.len());
        for &rank in local {
            let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
            let signals = arena(&ctx, ll_signal_bytes(r) as usize)?;
            signals.memset_async(&stream, 0, 0, signals.len())?;
            stream
                .synchronize()
                .map_err(Error::cuda("cuStreamSynchronize"))?;
            let signals = Arc::new(signals);
            let data = Arc::new(arena(&ctx, (2 * ly.half_bytes()) as usize)?);
            debug_assert!(data.ptr() % REGION_ALIGN == 0);
            let half = || -> Result<HalfBufs> {
                Ok(HalfBufs {
                    recv_x: Arc::new(DevBuf::new(&ctx, l * rows * h * 2)?),
                    recv_scales: Arc::new(DevBuf::new(&ctx, l * s * rows * 4)?),
                    src_info: Arc::new(DevBuf::new(&ctx, l * rows * 4)?),
                    layout_range: Arc::new(DevBuf::new(&ctx, l * r * 8)?),
                    count: Arc::new(DevBuf::new(&ctx, l * 4)?),
                    slots: Arc::new(DevBuf::new(&ctx, n * r * 4)?),
                    send_counts: Arc::new(DevBuf::new(&ctx, r * 4)?),
                    recv_counts: Arc::new(DevBuf::new(&ctx, r * 4)?),
                    combined: Arc::new(DevBuf::new(&ctx, n * h * 2)?),
                    dispatch: None,
                })
            };
            ranks.push(LlRank {
                rank,
                stream,
                signals,
                data,
                mask: Arc::new(DevBuf::zeroed(&ctx, 4 * r)?),
                epoch: Arc::new(DevBuf::zeroed(&ctx, 8 * cfg.num_sms)?),
                recv_stats: Arc::new(DevBuf::zeroed(&ctx, 4 * l)?),
                wait_stats: Arc::new(DevBuf::zeroed(&ctx, 8 * r)?),
                halves: [half()?, half()?],
            });
        }
        // Peers by pointer, or regions of one PE: each rank's own arrays; one PE per rank: the
        // symmetric address of this PE's arrays stands for every PE's (with `peer_pe`).
        let (peer_signals, peer_data) = if ranks.len() == r {
            (
                ranks.iter().map(|k| k.signals.ptr()).collect(),
                ranks.iter().map(|k| k.data.ptr()).collect(),
            )
        } else {
            (
                vec![ranks[0].signals.ptr(); r],
                vec![ranks[0].data.ptr(); r],
            )
        };
        // One process per rank: no peer may signal before every process has zeroed its words.
        if let Some(s) = peers.session()
            && ranks.len() < r
        {
            s.barrier_all();
        }
        Ok(Self {
            dev,
            cfg,
            ranks,
            peer_signals,
            peer_data,
            peers,
            call: 0,
            op: 0,
            generation: 0,
            timeout: Duration::from_secs(10),
            poison: None,
            pending: None,
            mask: vec![false; r],
            absent: None,
            shrink: false,
            tracing: None,
            gate: None,
            smem_limit,
            phase_times: None,
            id: super::graph::next_group_id(),
            capture: None,
        })
    }

    /// The shape.
    pub fn config(&self) -> &LlConfig {
        &self.cfg
    }

    /// Ranks of the group.
    pub fn num_ranks(&self) -> usize {
        self.cfg.num_ranks
    }

    /// The ranks this process drives, ascending: every per-rank argument and result of the
    /// calls is indexed like this list (all ranks when co-resident, one in a rank process).
    pub fn local_ranks(&self) -> Vec<usize> {
        self.ranks.iter().map(|k| k.rank).collect()
    }

    /// Local rank `i`'s stream (its kernels run there, in call order).
    pub fn stream(&self, i: usize) -> &Arc<CudaStream> {
        &self.ranks[i].stream
    }

    /// A barrier of the group's processes (one PE per rank), after this process's streams.
    fn barrier_processes(&self) -> Result<()> {
        if let Some(s) = self.peers.session()
            && self.ranks.len() < self.num_ranks()
        {
            self.sync_streams()?;
            s.barrier_all();
        }
        Ok(())
    }

    /// The bound of every device wait (default 10 s).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Test hook: `Some(r)` stops launching rank `r`'s kernels (a rank that never arrives).
    #[doc(hidden)]
    pub fn set_absent_rank_for_test(&mut self, rank: Option<usize>) {
        self.absent = rank;
    }

    /// Test support: fills buffers with `byte` (synchronously) so that anything the kernels
    /// failed to write shows. With one process per rank it is collective (a barrier before and
    /// after: no peer's kernel may write the arenas meanwhile).
    #[doc(hidden)]
    pub fn poison_for_test(&mut self, what: LlPoison, byte: u8) -> Result<()> {
        self.not_capturing("poison_for_test")?;
        // Other processes' kernels may still be writing into these arenas (collective), and
        // variant (b)'s last puts may still read the staging.
        self.complete_puts();
        self.barrier_processes()?;
        for r in &self.ranks {
            let mut bufs: Vec<&Arc<DevBuf>> = Vec::new();
            for h in &r.halves {
                match what {
                    LlPoison::Dispatch => bufs.extend([
                        &h.recv_x,
                        &h.recv_scales,
                        &h.src_info,
                        &h.layout_range,
                        &h.count,
                    ]),
                    LlPoison::Combine => bufs.push(&h.combined),
                }
            }
            if what == LlPoison::Dispatch {
                bufs.push(&r.data);
            }
            for b in bufs {
                b.memset_async(&r.stream, byte, 0, b.len())?;
            }
        }
        self.sync_streams()?;
        self.barrier_processes()
    }

    /// What the device reported since the last call (an error record), as a typed error.
    pub(crate) fn check_ready(&mut self) -> Result<()> {
        if let Some(cause) = &self.poison {
            return Err(Error::Poisoned {
                cause: cause.clone(),
            });
        }
        let e = self.dev.err.read();
        if e.status == 0 {
            return Ok(());
        }
        if self.capture.is_some() {
            // Reading the record needs finished streams, which a capture cannot wait for.
            return Err(Error::NotCapturable {
                what: "a call after a device error".into(),
                fix: "the error surfaces after the capture: sync(), then reset() if it says so"
                    .into(),
            });
        }
        self.sync_streams()?;
        let e = self.dev.err.read();
        let err = self.decode(&e);
        if e.status == abi::EP_ERR_EXPERT {
            self.dev.err.write(ErrBlock::default());
        } else {
            self.poison = Some(err.to_string());
        }
        Err(err)
    }

    /// Variant (b): completes the puts the last operations left in flight — their quiet is the
    /// next operation's receive part's (docs/protocol.md §3.7) — before the host writes or frees
    /// the arenas: `nvshmemx_quiet_on_stream` on each local rank's stream, ahead of what the
    /// caller enqueues or waits for there.
    fn complete_puts(&self) {
        if let Peers::Nvshmem(n) = &self.peers {
            for r in &self.ranks {
                n.session.quiet_on_stream(&r.stream);
            }
        }
    }

    fn sync_streams(&self) -> Result<()> {
        // Work behind a closed timing gate would only start when the gate ran out.
        self.open_gate();
        for r in &self.ranks {
            r.stream
                .synchronize()
                .map_err(Error::cuda("cuStreamSynchronize"))?;
        }
        Ok(())
    }

    /// Waits for every rank's stream and reports any device error.
    pub fn sync(&mut self) -> Result<()> {
        self.not_capturing("sync")?;
        if let Some(cause) = &self.poison {
            return Err(Error::Poisoned {
                cause: cause.clone(),
            });
        }
        self.sync_streams()?;
        self.check_ready()?;
        if self.shrink {
            self.adopt_device_masks()?;
        }
        Ok(())
    }

    /// Collective reset after a failure (docs/protocol.md §7.2): waits for every rank, zeroes
    /// the signals, clears the error record and any pending hook;
    /// earlier handles become invalid.
    pub fn reset(&mut self) -> Result<()> {
        self.not_capturing("reset")?;
        self.complete_puts();
        self.sync_streams()?;
        // Every process's kernels have stopped before any zeroes a word the others may write.
        self.barrier_processes()?;
        for r in &self.ranks {
            r.signals.memset_async(&r.stream, 0, 0, r.signals.len())?;
        }
        self.sync_streams()?;
        self.barrier_processes()?;
        // A rank whose kernels did not all run left its epoch words behind the counter.
        self.write_epochs()?;
        self.dev.err.write(ErrBlock::default());
        self.poison = None;
        self.pending = None;
        self.generation += 1;
        for r in &mut self.ranks {
            for h in &mut r.halves {
                h.dispatch = None;
            }
        }
        Ok(())
    }

    /// `clean_low_latency_buffer` (docs/protocol.md §3.7): zeroes every rank's signal words of
    /// both halves, then waits for all ranks (the barrier).
    pub fn clean(&mut self) -> Result<()> {
        self.not_capturing("clean")?;
        self.check_ready()?;
        if self.pending.is_some() {
            return Err(hook_pending());
        }
        // Every process's puts complete before any zeroes a signal word they may still set (the
        // barrier waits for the streams; in one process, the memsets follow on the same streams).
        self.complete_puts();
        self.barrier_processes()?;
        for r in &self.ranks {
            r.signals.memset_async(&r.stream, 0, 0, r.signals.len())?;
        }
        self.sync_streams()?;
        self.barrier_processes()
    }

    /// The next operation is the `Buffer`'s low-latency operation `index` (its half is
    /// `index % 2`): the `Buffer` owns the operation counter (docs/buffer-api.md, step 3b).
    pub(crate) fn set_next_op(&mut self, index: u64) {
        self.op = index;
    }

    /// Sets every rank's epoch words to the call counter (the streams must be idle).
    fn write_epochs(&self) -> Result<()> {
        let words: Vec<u8> = std::iter::repeat_n(self.call.to_le_bytes(), self.cfg.num_sms)
            .flatten()
            .collect();
        for r in &self.ranks {
            r.epoch.write(0, &words)?;
        }
        Ok(())
    }

    /// `get_next_low_latency_combine_buffer`: local rank `i`'s zero-copy expert-output region
    /// for the next operation, `[L·R·N, H]` BF16 (write the expert outputs there, then combine
    /// with [`LlCombineInput::ZeroCopy`]).
    pub fn next_combine_buffer(&self, i: usize) -> Result<DevTensor> {
        let rank = self.ranks.get(i).ok_or(Error::RankOutOfRange {
            rank: i,
            num_ranks: self.ranks.len(),
        })?;
        let ly = self.cfg.layout();
        let off = ly.half_base(ll_half(self.op)) + ly.cy(0, 0);
        Ok(DevTensor::contiguous(
            rank.data.clone(),
            off,
            DType::Bf16,
            self.cfg.num_local_experts() * self.cfg.rows_per_expert(),
            self.cfg.hidden,
        ))
    }

    fn base_args(&self, i: usize, half: u64) -> LlArgs {
        let cfg = &self.cfg;
        let rank = i;
        let mut a = LlArgs {
            rank: self.ranks[i].rank as u64,
            num_ranks: cfg.num_ranks as u64,
            num_experts: cfg.num_experts as u64,
            num_local_experts: cfg.num_local_experts() as u64,
            hidden: cfg.hidden as u64,
            num_max_tokens: cfg.num_max_dispatch_tokens_per_rank as u64,
            // A captured kernel must not freeze its call number: 0 makes it take the next one
            // from its epoch words at every replay.
            call: if self.capture.is_some() { 0 } else { self.call },
            epoch: self.ranks[rank].epoch.ptr(),
            half,
            // Co-resident ranks: every peer is on this GPU (GPU-scope fences suffice); ranks
            // in other processes may be on other GPUs (system scope).
            flags: if self.ranks.len() == cfg.num_ranks {
                abi::EP_FLAG_SAME_GPU
            } else {
                0
            } | if self.shrink { abi::EP_FLAG_SHRINK } else { 0 },
            mask: self.ranks[rank].mask.ptr(),
            recv_stats: self.ranks[rank].recv_stats.ptr(),
            wait_stats: self.ranks[rank].wait_stats.ptr(),
            err: self.dev.err.dev_ptr(),
            timeout_ns: self.timeout.as_nanos().min(u128::from(u64::MAX)) as u64,
            ..LlArgs::default()
        };
        a.peer_signals[..cfg.num_ranks].copy_from_slice(&self.peer_signals);
        a.peer_data[..cfg.num_ranks].copy_from_slice(&self.peer_data);
        if let Peers::Nvshmem(n) = &self.peers {
            a.peer_pe[..n.pes.len()].copy_from_slice(&n.pes);
        }
        if let Some(t) = &self.tracing {
            let (trace, flags) = t.args(rank);
            a.trace = trace;
            a.flags |= flags;
        }
        a
    }
}

impl Drop for LlGroup {
    fn drop(&mut self) {
        // The arenas may be NVSHMEM symmetric memory, whose free does not wait for kernels, nor
        // for variant (b)'s last puts (a capture being recorded cannot take the quiet).
        if self.capture.is_none() {
            self.complete_puts();
        }
        let _ = self.sync_streams();
    }
}
