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

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use ep_core::plan::low_latency::{LlParams, validate_hidden, validate_params};
use ep_core::protocol::layout::{LlLayout, REGION_ALIGN, ll_half, ll_signal_bytes};

mod graph;

pub use graph::LlGraph;

use super::abi::{self, ErrBlock, LlArgs};
use super::device::{Device, LlKernels};
use super::gate::{Gate, close, elapsed};
use super::mem::DevBuf;
use super::tensor::{DType, DevTensor};
use super::trace::{TraceBufs, not_tracing};
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

/// One rank's low-latency dispatch inputs, on the device.
#[derive(Clone, Copy, Debug)]
pub struct LlRankInputs<'a> {
    /// `[T, H]` BF16, `T ≤ N`.
    pub x: &'a DevTensor,
    /// `[T, K]` i64 expert ids (`-1` masked).
    pub topk_idx: &'a DevTensor,
    /// `[T, K]` f32.
    pub topk_weights: &'a DevTensor,
}

/// Options of a low-latency dispatch (spec §2.4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlDispatchArgs {
    /// Cast rows to e4m3 with per-128 scales.
    pub use_fp8: bool,
    /// Round the scales to powers of two.
    pub round_scale: bool,
    /// Pack the (rounded) scales as UE8M0 bytes.
    pub use_ue8m0: bool,
    /// Launch only the send half; [`LlGroup::recv_hook`] runs the receive half.
    pub return_recv_hook: bool,
}

/// Options of a low-latency combine (spec §2.5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlCombineArgs {
    /// Launch only the send half; [`LlGroup::recv_hook`] runs the receive half.
    pub return_recv_hook: bool,
    /// Partials travel LogFMT-10 encoded (DeepEP's `use_logfmt`, spec §2.6; lossy:
    /// `plan::low_latency::PartialPrecision::LogFmt10` is the reference). Unlike DeepEP it
    /// combines with the zero-copy input too (the encoded partials do not overwrite it).
    pub use_logfmt: bool,
}

/// What a combine needs from its dispatch.
#[derive(Clone, Debug)]
pub struct LlGpuHandle {
    rank: usize,
    op: u64,
    generation: u64,
    num_tokens: usize,
}

impl LlGpuHandle {
    /// The dispatch's tokens on this rank.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }
}

/// What one rank receives from a low-latency dispatch (views valid until the next operation on
/// the same half, module docs).
#[derive(Clone, Debug)]
pub struct LlGpuDispatch {
    /// `[L·R·N, H]` BF16 or e4m3.
    pub recv_x: DevTensor,
    /// FP8: `[L·S, R·N]` f32, or `[L·S/4, R·N]` i32 packed UE8M0 (DeepEP's memory order).
    pub recv_x_scales: Option<DevTensor>,
    /// `[L, R·N]` i32 source token of each row.
    pub recv_src_info: DevTensor,
    /// `[L, R]` i64 `(begin << 32) | count`.
    pub recv_layout_range: DevTensor,
    /// `[1, L]` i32 rows per local expert.
    pub recv_count: DevTensor,
    /// For the combine.
    pub handle: LlGpuHandle,
}

/// Where a combine reads a rank's expert outputs `[L·R·N, H]` BF16.
#[derive(Clone, Copy, Debug)]
pub enum LlCombineInput<'a> {
    /// The zero-copy region of the combine's half ([`LlGroup::next_combine_buffer`]).
    ZeroCopy,
    /// A caller tensor.
    Tensor(&'a DevTensor),
}

/// What [`LlGroup::poison_for_test`] fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlPoison {
    /// Before a dispatch: every rank's `ll.data` and dispatch outputs (both halves).
    Dispatch,
    /// Before a combine: every rank's combine outputs (both halves).
    Combine,
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

/// Per-rank statistics (DeepEP's `cumulative_local_expert_recv_stats` and wait-time stats).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlStats {
    /// Tokens received per local expert, summed over dispatches since the last clear.
    pub local_expert_recv: Vec<i32>,
    /// Nanoseconds the receive halves waited for each source rank.
    pub wait_ns: Vec<u64>,
}

/// The kernel variant a group runs (docs/protocol.md §3.10, §3.11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlVariant {
    /// (a) Peers by pointer.
    Pointers,
    /// (b) Every peer through NVSHMEM's device API.
    Nvshmem,
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

/// Where each shared-memory array of a kernel starts, and the bytes needed.
#[derive(Clone, Copy, Debug, Default)]
struct Smem {
    expert: u64,
    pos: u64,
    before: u64,
    tot: u64,
    dmask: u64,
    slot: u64,
    begin: u64,
    bytes: u64,
}

impl Smem {
    /// The carve-out for `T` tokens with top-`K` (`cuda/low_latency.cu`, `SendSmem`).
    fn new(cfg: &LlConfig, t: u64, k: u64) -> Self {
        let (e, r, l) = (
            cfg.num_experts as u64,
            cfg.num_ranks as u64,
            cfg.num_local_experts() as u64,
        );
        let mut at = 0u64;
        let mut take = |bytes: u64| {
            let off = at;
            at = (at + bytes).div_ceil(16) * 16;
            off
        };
        let mut s = Smem {
            expert: take(2 * t * k),
            pos: take(2 * t * k),
            before: take(4 * e),
            tot: take(4 * e),
            dmask: take(t),
            slot: take(2 * t * r),
            begin: take(4 * r * l),
            bytes: 0,
        };
        s.bytes = at;
        s
    }
}

fn launch_cfg(blocks: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem,
    }
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

    /// The combine kernel of the flavour `args` asks for (EP_FLAG_LOGFMT).
    fn combine_fn(&self, args: Option<&LlArgs>) -> &CudaFunction {
        match args {
            Some(a) if a.flags & abi::EP_FLAG_LOGFMT != 0 => &self.fns().combine_logfmt,
            _ => &self.fns().combine,
        }
    }

    fn fns(&self) -> &LlKernels {
        if self.tracing.is_some() {
            return match &self.peers {
                Peers::Nvshmem(n) => n.traced.as_ref().map_or(&n.kernels, |t| &t.1),
                _ => &self.dev.ll_trace,
            };
        }
        match &self.peers {
            Peers::Pointers | Peers::PointersOverNvshmem(_) => &self.dev.ll,
            Peers::Nvshmem(n) => &n.kernels,
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

    fn decode(&self, e: &ErrBlock) -> Error {
        let kernel = match e.kernel {
            abi::EP_KERNEL_LL_DISPATCH => "low-latency dispatch",
            abi::EP_KERNEL_LL_COMBINE => "low-latency combine",
            _ => "?",
        };
        let word = |off: u64| signal_name(self.num_ranks() as u64, off);
        match e.status {
            abi::EP_ERR_TIMEOUT => {
                let (name, writer) = word(e.word_offset);
                Error::DeviceWaitTimeout {
                    rank: e.rank as usize,
                    kernel,
                    block: e.block as usize,
                    word: name,
                    writer,
                    expected: e.expected,
                    last_seen: e.last_seen,
                    timeout: self.timeout,
                }
            }
            abi::EP_ERR_EXPERT => Error::ExpertOutOfRange {
                rank: e.rank as usize,
                index: e.detail,
                expert: e.last_seen as i64,
            },
            abi::EP_ERR_EPOCH | abi::EP_ERR_COUNT => Error::Unsupported(format!(
                "rank {} ({kernel}): signal {} from rank {} holds {:#x}, expected {} {:#x}: \
                 the ranks' calls are out of step (a rank skipped or repeated a call); reset() every rank",
                e.rank,
                word(e.word_offset).0,
                e.detail,
                e.last_seen,
                if e.status == abi::EP_ERR_EPOCH {
                    "epoch of"
                } else {
                    "count"
                },
                e.expected
            )),
            s => Error::Unsupported(format!("unknown device error status {s}")),
        }
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

    /// Protocol traces (docs/protocol.md §3.13): with `Some(capacity)` every following
    /// operation runs the traced kernels (`EP_TRACE`), each block of each local rank recording up
    /// to `capacity` protocol events (stores, loads, fences, releases, acquires);
    /// [`LlGroup::trace`] returns the last operation's, for ep-sim's memory-model
    /// checker (`ep_sim::device_trace`). `None` turns it off. For debugging and tests: each traced
    /// operation waits for the previous one. Both variants (variant (b)'s traced build is linked
    /// at run time when tracing is first turned on).
    pub fn set_trace(&mut self, capacity: Option<u64>) -> Result<()> {
        self.not_capturing("set_trace")?;
        self.sync_streams()?;
        let Some(capacity) = capacity else {
            self.tracing = None;
            return Ok(());
        };
        if let Peers::Nvshmem(n) = &mut self.peers
            && n.traced.is_none()
        {
            // Variant (b)'s traced build, linked against the loaded NVSHMEM like the other.
            let linked = crate::nvshmem::device_link::link_ll_trace_module(&n.session)?;
            let kernels = LlKernels {
                dispatch: linked.dispatch().clone(),
                combine: linked.combine().clone(),
                combine_logfmt: linked.combine_logfmt().clone(),
            };
            n.traced = Some((linked, kernels));
        }
        self.tracing = Some(TraceBufs::new(
            self.dev.context(),
            self.ranks.len(),
            self.cfg.num_sms,
            capacity,
        )?);
        Ok(())
    }

    /// Test switch of traced kernels (docs/protocol.md §6): the send parts' blocks skip their
    /// fence before their signals — a planted missing fence, which the trace checker
    /// must report. [`Error::Unsupported`] unless tracing is on.
    #[doc(hidden)]
    pub fn plant_missing_fence_for_test(&mut self, on: bool) -> Result<()> {
        let t = self.tracing.as_mut().ok_or_else(|| {
            not_tracing("the planted missing fence exists only in the traced kernels")
        })?;
        t.plant(on);
        Ok(())
    }

    /// The protocol events the last traced operation recorded, every local rank's blocks (after
    /// waiting for it). [`Error::TraceOverflow`] when a block had more than the capacity.
    pub fn trace(&mut self) -> Result<Vec<ep_core::transport::device_trace::AgentEvents>> {
        self.not_capturing("trace")?;
        self.sync_streams()?;
        let t = self
            .tracing
            .as_ref()
            .ok_or_else(|| not_tracing("no trace"))?;
        let mut all = Vec::new();
        for (i, k) in self.ranks.iter().enumerate() {
            all.extend(super::trace::decode(k.rank, &t.read(i)?)?);
        }
        Ok(all)
    }

    /// Empty trace headers for the next operation (the streams are idle).
    fn reset_traces(&mut self) -> Result<()> {
        self.sync_streams()?;
        if let Some(t) = &self.tracing {
            t.reset(self.ranks.iter().map(|k| k.rank))?;
        }
        Ok(())
    }

    /// Shrink mode (DeepEP's `enable_shrink`, spec §2.7, docs/protocol.md §3.8): a source whose
    /// signal never comes within the timeout is masked by the rank that waited for it (its
    /// messages count as none, exactly as a masked rank's) instead of failing the call; the next
    /// [`LlGroup::sync`] adopts every rank's device mask for the group ([`LlGroup::query_mask`]),
    /// and later calls skip the rank. Off by default: a missing rank is then a typed
    /// [`Error::DeviceWaitTimeout`].
    pub fn set_shrink(&mut self, on: bool) {
        self.shrink = on;
    }

    /// The ranks the kernels masked on their own (shrink mode), merged into the group's mask.
    fn adopt_device_masks(&mut self) -> Result<()> {
        let r = self.num_ranks();
        let mut changed = false;
        for k in &self.ranks {
            let mut bytes = vec![0u8; 4 * r];
            k.mask.read(0, &mut bytes)?;
            for (m, w) in self.mask.iter_mut().zip(bytes.chunks_exact(4)) {
                if !*m && w != [0, 0, 0, 0] {
                    *m = true;
                    changed = true;
                }
            }
        }
        if changed {
            self.write_mask()?;
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

    /// `low_latency_update_mask_buffer(rank, mask)`: masks (or unmasks) `rank` for the
    /// following calls of every rank (spec §2.7).
    pub fn update_mask(&mut self, rank: usize, masked: bool) -> Result<()> {
        self.not_capturing("update_mask")?;
        if rank >= self.num_ranks() {
            return Err(Error::RankOutOfRange {
                rank,
                num_ranks: self.num_ranks(),
            });
        }
        self.mask[rank] = masked;
        self.write_mask()
    }

    /// `low_latency_query_mask_buffer`: which ranks are masked.
    pub fn query_mask(&self) -> Vec<bool> {
        self.mask.clone()
    }

    /// Sets the mask to `mask` (one entry per rank) when it differs (a `Buffer`'s operation
    /// carries its mask; the device words follow it).
    pub(crate) fn set_mask(&mut self, mask: &[bool]) -> Result<()> {
        self.not_capturing("set_mask")?;
        if mask.len() != self.num_ranks() {
            return Err(Error::RankCountMismatch {
                expected: self.num_ranks(),
                found: mask.len(),
            });
        }
        if self.mask == mask {
            return Ok(());
        }
        self.mask = mask.to_vec();
        self.write_mask()
    }

    /// The next operation is the `Buffer`'s low-latency operation `index` (its half is
    /// `index % 2`): the `Buffer` owns the operation counter (docs/buffer-api.md, step 3b).
    pub(crate) fn set_next_op(&mut self, index: u64) {
        self.op = index;
    }

    /// `low_latency_clean_mask_buffer`: unmasks every rank.
    pub fn clean_mask(&mut self) -> Result<()> {
        self.not_capturing("clean_mask")?;
        self.mask.iter_mut().for_each(|m| *m = false);
        self.write_mask()
    }

    fn write_mask(&mut self) -> Result<()> {
        self.sync_streams()?;
        let bytes: Vec<u8> = self
            .mask
            .iter()
            .flat_map(|&m| i32::from(m).to_le_bytes())
            .collect();
        for r in &self.ranks {
            r.mask.write(0, &bytes)?;
        }
        // A masked rank's kernels are not launched, so its epoch words fell behind: every mask
        // change sets them to the counter (the streams are idle), and a graph replays only
        // under the mask it was captured with (docs/protocol.md §3.10).
        self.write_epochs()
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

    /// Per-rank statistics since the last [`LlGroup::clear_stats`] (synchronises).
    pub fn stats(&mut self) -> Result<Vec<LlStats>> {
        self.not_capturing("stats")?;
        self.sync()?;
        self.ranks
            .iter()
            .map(|r| {
                let mut recv = vec![0u8; r.recv_stats.len()];
                r.recv_stats.read(0, &mut recv)?;
                let mut wait = vec![0u8; r.wait_stats.len()];
                r.wait_stats.read(0, &mut wait)?;
                Ok(LlStats {
                    local_expert_recv: recv
                        .chunks_exact(4)
                        .map(|c| i32::from_le_bytes(c.try_into().unwrap_or_default()))
                        .collect(),
                    wait_ns: wait
                        .chunks_exact(8)
                        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                        .collect(),
                })
            })
            .collect()
    }

    /// Zeroes the statistics.
    pub fn clear_stats(&mut self) -> Result<()> {
        self.not_capturing("clear_stats")?;
        for r in &self.ranks {
            r.recv_stats
                .memset_async(&r.stream, 0, 0, r.recv_stats.len())?;
            r.wait_stats
                .memset_async(&r.stream, 0, 0, r.wait_stats.len())?;
        }
        self.sync_streams()
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

    /// Measurement: from now on (`on`, which also zeroes the stamps) the kernels stamp
    /// `%globaltimer` at their phase boundaries ([`LlGroup::phase_times`]); off with `false`.
    pub fn measure_phases(&mut self, on: bool) -> Result<()> {
        self.not_capturing("measure_phases")?;
        self.phase_times = if on {
            let slots = abi::EP_PHASE_SLOTS as usize;
            Some(
                (0..self.ranks.len())
                    .map(|_| {
                        DevTensor::zeros(self.dev.context(), DType::I64, self.cfg.num_sms, slots)
                    })
                    .collect::<Result<_>>()?,
            )
        } else {
            None
        };
        Ok(())
    }

    /// The stamps since [`LlGroup::measure_phases`]: per rank, per block, `EP_PHASE_SLOTS`
    /// `%globaltimer` values (ns; 0 = not reached): send start, routing known, rows stored,
    /// signals released (each block its own), receive start, sources acquired, end.
    pub fn phase_times(&mut self) -> Result<Vec<Vec<Vec<u64>>>> {
        self.not_capturing("phase_times")?;
        self.sync()?;
        let Some(bufs) = &self.phase_times else {
            return Ok(Vec::new());
        };
        bufs.iter()
            .map(|b| {
                let t = b.download::<i64>()?;
                Ok((0..t.rows())
                    .map(|i| t.row(i).iter().map(|&v| v as u64).collect())
                    .collect())
            })
            .collect()
    }

    fn launch(&self, i: usize, f: &CudaFunction, args: &LlArgs) -> Result<()> {
        let rank = self.ranks[i].rank;
        if self.absent == Some(rank) || self.mask[rank] {
            return Ok(());
        }
        let mut measured;
        let args = match &self.phase_times {
            Some(bufs) => {
                measured = *args;
                measured.phase_times = bufs[i].ptr();
                &measured
            }
            None => args,
        };
        let smem = Smem::new(&self.cfg, args.num_tokens, args.num_topk.max(1));
        debug_assert!(smem.bytes as usize <= self.smem_limit);
        let mut b = self.ranks[i].stream.launch_builder(f);
        b.arg(args);
        // SAFETY: the kernel takes one `ep_ll_args` by value (generated from the same table as
        // `LlArgs`); every address in it is a live allocation of this group or a tensor whose
        // shape, dtype and device the caller of `launch` checked, kept alive by the caller until
        // the stream passes the kernel; the dynamic shared memory matches the offsets in `args`
        // and is within the function's limit (set in `new`).
        unsafe { b.launch(launch_cfg(self.cfg.num_sms as u32, smem.bytes as u32)) }
            .map(|_| ())
            .map_err(Error::cuda("cuLaunchKernel"))
    }

    fn with_smem(&self, mut a: LlArgs) -> LlArgs {
        let s = Smem::new(&self.cfg, a.num_tokens, a.num_topk.max(1));
        a.sm_expert = s.expert;
        a.sm_pos = s.pos;
        a.sm_before = s.before;
        a.sm_tot = s.tot;
        a.sm_dmask = s.dmask;
        a.sm_slot = s.slot;
        a.sm_begin = s.begin;
        a
    }

    fn check_dispatch_inputs(&self, inputs: &[LlRankInputs<'_>]) -> Result<usize> {
        let (r, h, n) = (
            self.ranks.len(),
            self.cfg.hidden,
            self.cfg.num_max_dispatch_tokens_per_rank,
        );
        if inputs.len() != r {
            return Err(Error::RankCountMismatch {
                expected: r,
                found: inputs.len(),
            });
        }
        let mut k_all = None;
        for (li, i) in inputs.iter().enumerate() {
            let s = self.ranks[li].rank;
            let what = |m: &str| format!("{m} of rank {s}");
            i.x.expect(&what("x"), DType::Bf16, None, Some(h))?;
            let t = i.x.rows();
            if t > n {
                return Err(Error::Unsupported(format!(
                    "rank {s} dispatches {t} tokens; the group holds at most {n} (num_max_dispatch_tokens_per_rank)"
                )));
            }
            i.topk_idx
                .expect(&what("topk_idx"), DType::I64, Some(t), None)?;
            let k = i.topk_idx.cols();
            if k == 0 || k > MAX_TOPK {
                return Err(Error::Unsupported(format!(
                    "topk_idx of rank {s}: {k} columns; low-latency mode takes 1 to {MAX_TOPK}"
                )));
            }
            if *k_all.get_or_insert(k) != k {
                return Err(Error::TensorMismatch {
                    what: what("topk_idx"),
                    expected: format!("{} columns like rank 0", k_all.unwrap_or(k)),
                    found: format!("{k} columns"),
                });
            }
            i.topk_weights
                .expect(&what("topk_weights"), DType::F32, Some(t), Some(k))?;
            for (name, tensor) in [
                ("x", i.x),
                ("topk_idx", i.topk_idx),
                ("topk_weights", i.topk_weights),
            ] {
                if !tensor.is_contiguous() {
                    return Err(Error::Unsupported(format!(
                        "{}: rows must be contiguous",
                        what(name)
                    )));
                }
                if tensor.device() != self.dev.ordinal() {
                    return Err(Error::WrongDevice {
                        rank: s,
                        expected: self.dev.ordinal(),
                        found: tensor.device(),
                    });
                }
            }
        }
        Ok(k_all.unwrap_or(1))
    }

    fn start_op(&mut self) -> Result<(u64, u64)> {
        self.check_ready()?;
        if self.pending.is_some() {
            return Err(hook_pending());
        }
        if self.tracing.is_some() {
            self.not_capturing("a traced operation")?;
            self.reset_traces()?;
        }
        self.call += 1;
        let op = self.op;
        self.op += 1;
        Ok((op, ll_half(op)))
    }

    /// Low-latency dispatch of every rank (spec §2.4, docs/protocol.md §3.3–3.4). With
    /// `return_recv_hook` only the send halves are launched; [`LlGroup::recv_hook`] launches
    /// the receive halves, and the outputs are valid once it has run.
    pub fn dispatch(
        &mut self,
        inputs: &[LlRankInputs<'_>],
        args: &LlDispatchArgs,
    ) -> Result<Vec<LlGpuDispatch>> {
        let k = self.check_dispatch_inputs(inputs)?;
        let mut params = LlParams::new(
            self.cfg.num_max_dispatch_tokens_per_rank,
            self.cfg.num_experts,
        );
        if args.use_fp8 {
            params = params.with_fp8(args.round_scale, args.use_ue8m0);
        }
        validate_params(self.num_ranks(), &params)?;
        validate_hidden(self.cfg.hidden, args.use_fp8)?;
        if !args.use_fp8 && (args.round_scale || args.use_ue8m0) {
            return Err(Error::Unsupported(
                "round_scale / use_ue8m0 apply to FP8 dispatch: set use_fp8".into(),
            ));
        }
        let (op, half) = self.start_op()?;
        for i in inputs {
            self.keep([i.x, i.topk_idx, i.topk_weights].map(DevTensor::buffer));
        }
        let mut flags = 0;
        if args.use_fp8 {
            flags |= abi::EP_FLAG_FP8;
        }
        if args.round_scale {
            flags |= abi::EP_FLAG_ROUND_SCALE;
        }
        if args.use_ue8m0 {
            flags |= abi::EP_FLAG_UE8M0;
        }
        let cfg = self.cfg;
        let (l, rows, h, r) = (
            cfg.num_local_experts(),
            cfg.rows_per_expert(),
            cfg.hidden,
            cfg.num_ranks,
        );
        let s_count = h / 128;
        let mut recv_args = Vec::with_capacity(r);
        let mut out = Vec::with_capacity(r);
        for (s, inp) in inputs.iter().enumerate() {
            let hb = &self.ranks[s].halves[half as usize];
            let mut a = self.base_args(s, half);
            a.num_tokens = inp.x.rows() as u64;
            a.num_topk = k as u64;
            a.flags |= flags;
            a.x = inp.x.ptr();
            a.topk_idx = inp.topk_idx.ptr();
            a.topk_weights = inp.topk_weights.ptr();
            a.slots = hb.slots.ptr();
            a.send_counts = hb.send_counts.ptr();
            a.recv_counts = hb.recv_counts.ptr();
            a.recv_x = hb.recv_x.ptr();
            a.recv_scales = hb.recv_scales.ptr();
            a.recv_src_info = hb.src_info.ptr();
            a.recv_layout_range = hb.layout_range.ptr();
            a.recv_count = hb.count.ptr();
            let a = self.with_smem(a);
            let elem = if args.use_fp8 {
                DType::F8E4M3
            } else {
                DType::Bf16
            };
            let scales = args.use_fp8.then(|| {
                if args.use_ue8m0 {
                    DevTensor::contiguous(
                        hb.recv_scales.clone(),
                        0,
                        DType::I32,
                        l * s_count.div_ceil(4),
                        rows,
                    )
                } else {
                    DevTensor::contiguous(hb.recv_scales.clone(), 0, DType::F32, l * s_count, rows)
                }
            });
            out.push(LlGpuDispatch {
                recv_x: DevTensor::contiguous(hb.recv_x.clone(), 0, elem, l * rows, h),
                recv_x_scales: scales,
                recv_src_info: DevTensor::contiguous(hb.src_info.clone(), 0, DType::I32, l, rows),
                recv_layout_range: DevTensor::contiguous(
                    hb.layout_range.clone(),
                    0,
                    DType::I64,
                    l,
                    r,
                ),
                recv_count: DevTensor::contiguous(hb.count.clone(), 0, DType::I32, 1, l),
                handle: LlGpuHandle {
                    rank: self.ranks[s].rank,
                    op,
                    generation: self.generation,
                    num_tokens: inp.x.rows(),
                },
            });
            recv_args.push(a);
        }
        for (s, a) in recv_args.iter().enumerate() {
            let mut send = *a;
            send.flags |= abi::EP_FLAG_LL_SEND;
            if !args.return_recv_hook {
                send.flags |= abi::EP_FLAG_LL_RECV;
            }
            self.launch(s, &self.fns().dispatch, &send)?;
        }
        for (s, o) in out.iter().enumerate() {
            self.ranks[s].halves[half as usize].dispatch = Some((op, o.handle.num_tokens));
        }
        if args.return_recv_hook {
            self.pending = Some(Pending::Dispatch(recv_args.into_iter().map(Some).collect()));
        }
        Ok(out)
    }

    /// Runs the pending receive halves (the hook of the last send with `return_recv_hook`).
    pub fn recv_hook(&mut self) -> Result<()> {
        self.check_ready()?;
        let Some(p) = self.pending.take() else {
            return Err(Error::Unsupported(
                "no low-latency send is waiting for its receive hook".into(),
            ));
        };
        let (f, list) = match &p {
            Pending::Dispatch(l) => (&self.fns().dispatch, l),
            Pending::Combine(l) => (self.combine_fn(l.iter().flatten().next()), l),
        };
        for (s, a) in list.iter().enumerate() {
            if let Some(a) = a {
                let mut recv = *a;
                recv.flags |= abi::EP_FLAG_LL_RECV;
                self.launch(s, f, &recv)?;
            }
        }
        Ok(())
    }

    /// Whether a receive hook is pending.
    pub fn hook_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Low-latency combine of every rank (spec §2.5, docs/protocol.md §3.5–3.6): `handles[r]`
    /// from rank `r`'s dispatch, `inputs[r]` its expert outputs. Returns each rank's
    /// `[T, H]` BF16 `combined_x`, a view valid until the next operation on the same half.
    pub fn combine(
        &mut self,
        handles: &[&LlGpuHandle],
        inputs: &[LlCombineInput<'_>],
        return_recv_hook: bool,
    ) -> Result<Vec<DevTensor>> {
        let args = LlCombineArgs {
            return_recv_hook,
            ..LlCombineArgs::default()
        };
        self.combine_with(handles, inputs, &args)
    }

    /// [`LlGroup::combine`] with every option ([`LlCombineArgs`]).
    pub fn combine_with(
        &mut self,
        handles: &[&LlGpuHandle],
        inputs: &[LlCombineInput<'_>],
        args: &LlCombineArgs,
    ) -> Result<Vec<DevTensor>> {
        let handles: Vec<Option<&LlGpuHandle>> = handles.iter().copied().map(Some).collect();
        let out = self.combine_ranks(&handles, inputs, args)?;
        Ok(out.into_iter().flatten().collect())
    }

    /// [`LlGroup::combine_with`] where a masked local rank may have no handle (`None`: its
    /// kernels are not launched, its output is `None`).
    pub(crate) fn combine_ranks(
        &mut self,
        handles: &[Option<&LlGpuHandle>],
        inputs: &[LlCombineInput<'_>],
        args: &LlCombineArgs,
    ) -> Result<Vec<Option<DevTensor>>> {
        let return_recv_hook = args.return_recv_hook;
        let r = self.ranks.len();
        for found in [handles.len(), inputs.len()] {
            if found != r {
                return Err(Error::RankCountMismatch { expected: r, found });
            }
        }
        let (rows_all, h) = (
            self.cfg.num_local_experts() * self.cfg.rows_per_expert(),
            self.cfg.hidden,
        );
        for (li, (hd, inp)) in handles.iter().zip(inputs).enumerate() {
            let s = self.ranks[li].rank;
            let Some(hd) = hd else {
                if self.mask[s] {
                    continue;
                }
                return Err(Error::Unsupported(format!(
                    "no dispatch handle for rank {s}, which is not masked"
                )));
            };
            let dhalf = ll_half(hd.op) as usize;
            let live = self.ranks[li].halves[dhalf].dispatch;
            if hd.rank != s || hd.generation != self.generation || live.map(|d| d.0) != Some(hd.op)
            {
                return Err(Error::Unsupported(format!(
                    "handle {} for rank {s}: it is not the latest dispatch of that rank on its half \
                     (a later operation or reset() reused its buffers); combine right after its dispatch",
                    hd.rank
                )));
            }
            if let LlCombineInput::Tensor(t) = inp {
                t.expect(
                    &format!("expert outputs of rank {s}"),
                    DType::Bf16,
                    Some(rows_all),
                    Some(h),
                )?;
                if !t.is_contiguous() {
                    return Err(Error::Unsupported(format!(
                        "expert outputs of rank {s}: rows must be contiguous"
                    )));
                }
                if t.device() != self.dev.ordinal() {
                    return Err(Error::WrongDevice {
                        rank: s,
                        expected: self.dev.ordinal(),
                        found: t.device(),
                    });
                }
            }
        }
        if let Some(cap) = &mut self.capture {
            // A replay's combine finds its routing in the previous operation's half: only a
            // handle of the operation just before can be captured (docs/protocol.md §3.10).
            if handles.iter().flatten().any(|hd| hd.op + 1 != self.op) {
                return Err(Error::NotCapturable {
                    what: "a combine whose handle is not from the operation just before it".into(),
                    fix: "capture the combine right after its dispatch (with only its recv_hook between)"
                        .into(),
                });
            }
            if self.op == cap.op0 {
                cap.prev = Some(
                    handles
                        .iter()
                        .map(|hd| hd.map_or(0, |hd| hd.num_tokens))
                        .collect(),
                );
            }
        }
        let zero_copy: Vec<DevTensor> = (0..r)
            .map(|s| self.next_combine_buffer(s))
            .collect::<Result<_>>()?;
        let (_, half) = self.start_op()?;
        for inp in inputs {
            if let LlCombineInput::Tensor(t) = inp {
                self.keep([t.buffer()]);
            }
        }
        let mut recv_args = Vec::with_capacity(r);
        let mut out = Vec::with_capacity(r);
        for (s, (hd, inp)) in handles.iter().zip(inputs).enumerate() {
            let Some(hd) = hd else {
                recv_args.push(None);
                out.push(None);
                continue;
            };
            let dhalf = ll_half(hd.op);
            let db = &self.ranks[s].halves[dhalf as usize];
            let cb = &self.ranks[s].halves[half as usize];
            let mut a = self.base_args(s, half);
            a.num_tokens = hd.num_tokens as u64;
            a.num_topk = 1;
            if args.use_logfmt {
                a.flags |= abi::EP_FLAG_LOGFMT;
            }
            a.disp_half = dhalf;
            a.slots = db.slots.ptr();
            a.send_counts = db.send_counts.ptr();
            a.recv_counts = db.recv_counts.ptr();
            a.recv_layout_range = db.layout_range.ptr();
            a.combine_y = match inp {
                LlCombineInput::ZeroCopy => zero_copy[s].ptr(),
                LlCombineInput::Tensor(t) => t.ptr(),
            };
            a.combined_x = cb.combined.ptr();
            let a = self.with_smem(a);
            out.push(Some(DevTensor::contiguous(
                cb.combined.clone(),
                0,
                DType::Bf16,
                hd.num_tokens,
                h,
            )));
            recv_args.push(Some(a));
        }
        for (s, a) in recv_args.iter().enumerate() {
            let Some(a) = a else { continue };
            let mut send = *a;
            send.flags |= abi::EP_FLAG_LL_SEND;
            if !return_recv_hook {
                send.flags |= abi::EP_FLAG_LL_RECV;
            }
            self.launch(s, self.combine_fn(Some(&send)), &send)?;
        }
        if return_recv_hook {
            self.pending = Some(Pending::Combine(recv_args));
        }
        Ok(out)
    }

    /// Opens the timing gate, if one holds the streams: any call that is about to wait on the
    /// device (its work must not stay behind the gate).
    pub(crate) fn open_gate(&self) {
        if let Some(g) = &self.gate {
            g.open();
        }
    }

    /// Runs `f`, which enqueues work on every rank's stream, with every rank released at once
    /// behind a gate, and returns each rank's device time (seconds, CUDA events). With one rank
    /// per process it is collective: the processes meet at a barrier first.
    pub fn timed<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<(T, Vec<f64>)> {
        self.not_capturing("timed")?;
        // Ranks in other processes: start together (a barrier of the processes; collective).
        self.barrier_processes()?;
        if self.gate.is_none() {
            self.gate = Some(Gate::new(&self.dev)?);
        }
        let starts = match &mut self.gate {
            Some(g) => g.hold(&self.dev, self.ranks.iter().map(|r| &r.stream))?,
            None => Vec::new(),
        };
        let out = f(self);
        let ends = close(self.gate.as_ref(), self.ranks.iter().map(|r| &r.stream));
        let (out, ends) = (out?, ends?);
        self.sync()?;
        Ok((out, elapsed(&starts, &ends)?))
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

fn hook_pending() -> Error {
    Error::Unsupported(
        "a low-latency receive hook is pending: call recv_hook() before the next low-latency \
         operation (docs/protocol.md §3.7)"
            .into(),
    )
}

/// The name of the signal word at `off` in `ll.signals` and the rank that writes it.
fn signal_name(r: u64, off: u64) -> (String, Option<usize>) {
    match ep_core::protocol::layout::ll_signal_of(r as usize, off) {
        Some((combine, half, w, b)) => {
            let name = if combine { "comb_sig" } else { "disp_sig" };
            (format!("{name}[{half}][{w}][{b}]"), Some(w))
        }
        None => (format!("ll.signals+{off}"), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_words_are_named_with_their_writer() {
        use ep_core::protocol::layout::{ll_combine_signal, ll_dispatch_signal, ll_signal_bytes};
        let r = 4usize;
        let name = |off| signal_name(r as u64, off);
        for (off, want, writer) in [
            (ll_dispatch_signal(r, 0, 0, 0), "disp_sig[0][0][0]", 0),
            (ll_dispatch_signal(r, 0, 3, 7), "disp_sig[0][3][7]", 3),
            (ll_dispatch_signal(r, 1, 1, 63), "disp_sig[1][1][63]", 1),
            (ll_combine_signal(r, 0, 1, 0), "comb_sig[0][1][0]", 1),
            (ll_combine_signal(r, 1, 3, 9), "comb_sig[1][3][9]", 3),
        ] {
            assert_eq!(name(off), (want.into(), Some(writer)));
        }
        assert_eq!(name(ll_signal_bytes(r)).1, None);
    }

    #[test]
    fn shared_memory_arrays_do_not_overlap() {
        let cfg = LlConfig {
            num_ranks: 8,
            num_max_dispatch_tokens_per_rank: 1024,
            hidden: 7168,
            num_experts: 288,
            num_sms: 16,
        };
        let s = Smem::new(&cfg, 1000, 11);
        let spans = [
            (s.expert, 2 * 1000 * 11),
            (s.pos, 2 * 1000 * 11),
            (s.before, 4 * 288),
            (s.tot, 4 * 288),
            (s.dmask, 1000),
            (s.slot, 2 * 1000 * 8),
            (s.begin, 4 * 8 * 36),
        ];
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{spans:?}");
            assert_eq!(w[1].0 % 16, 0);
        }
        let last = spans[spans.len() - 1];
        assert!(last.0 + last.1 <= s.bytes);
    }
}
