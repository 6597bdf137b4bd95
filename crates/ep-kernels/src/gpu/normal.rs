//! Normal intranode mode (docs/protocol.md §2) over `R` ranks: each rank has its own arena
//! (`normal.ctrl` + `normal.data`, laid out by `ep_core::protocol::layout`), its own stream and
//! its own kernels, which run concurrently and see each other only through the table of peer
//! pointers in their arguments.
//!
//! A [`NormalGroup`] drives the **local ranks** of one process: all `R` of them co-resident on
//! one GPU ([`NormalGroup::new`]), or one rank per process — the deployment shape —
//! ([`NormalGroup::new_process`]), or any subset ([`NormalGroup::with_peers`]). The arenas of
//! ranks in other processes are mapped with CUDA IPC (`gpu::ipc`), exchanged over an
//! [`Exchange`]; the kernels never know which case they are in.
//!
//! Calls take and return device tensors ([`DevTensor`]) of every **local** rank: each per-rank
//! slice has one entry per local rank, in [`NormalGroup::local_ranks`] order (length
//! [`NormalGroup::num_local_ranks`]), and so does each returned `Vec`; a `rank` argument
//! ([`NormalGroup::stream`], [`NormalGroup::combine_rows`], ...) is a local index. Shapes and
//! expert counts are those of the world (`R = num_ranks()`). Every process calls the same
//! collective calls (`layout`, `dispatch`, `dispatch_cached`, `combine`, `ceiling*`, `reset`) in
//! the same order: the kernels' signal values count the calls. Received rows are
//! views into the rank's arena (row stride = the dispatch record), valid until the next dispatch
//! on the group; the received meta outputs (`recv_src_idx`, `recv_topk_*`) are views of the
//! same records, valid as long. Handles own their tensors.
//!
//! Host synchronisation: a non-worst-token dispatch waits (bounded) for each rank's dispatch
//! (its block 1) to publish `num_recv` and the expert list in host-mapped memory — the only host
//! sync of a call; with `num_worst_tokens > 0` there is none. Errors from the device (a wait that timed
//! out, rows that do not fit, a bad expert id, a `num_tokens_per_rank` that disagrees with its
//! `is_token_in_rank`) surface at the next call or [`NormalGroup::sync`]; a timeout or a
//! disagreeing layout poisons the group until [`NormalGroup::reset`].
//!
//! Calls without a host wait can be captured in CUDA graphs and replayed
//! ([`NormalGroup::capture`]; the kernels then take their call number from device-resident epoch
//! words), and any call can be ordered against the caller's streams by events
//! ([`NormalGroup::with_streams`]); see `graph`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use ep_core::buffer::check::{HandleShapes, normal_handle};
use ep_core::plan::intranode::DispatchOptions;
use ep_core::protocol::layout::{NormalCtrl, NormalData, REGION_ALIGN, RowFormat, align128};
use ep_core::routing::InputShapes;

use super::abi::{self, ErrBlock, Mailbox, NormalArgs};
use super::device::{Device, stream_fault};
use super::gate::{Gate, close, elapsed};
use super::mem::{DevBuf, HostMapped};
use super::peers::{self, Peer, Shape};
use super::tensor::{DType, DevTensor};
use crate::error::{Error, Result};
use crate::exchange::Exchange;

mod graph;
mod trace;
pub use graph::{CallStreams, NormalGraph};

/// u64 epoch words per rank: one per block of the largest dispatch or combine grid.
const EPOCH_WORDS: usize = 2 * ep_core::protocol::layout::MAX_CHANNELS;

/// Ranks a normal-mode kernel can address.
pub const MAX_RANKS: usize = abi::EP_GPU_MAX_RANKS as usize;
/// Threads per block of the normal-mode kernels.
const THREADS: u32 = abi::EP_GPU_THREADS as u32;
const _: () = assert!(
    ep_core::protocol::layout::MAX_LOCAL_EXPERTS < std::mem::size_of::<Mailbox>() / 8,
    "the mailbox holds every local expert's count"
);

/// Top-k a kernel handles (one lane per slot).
pub const MAX_TOPK: usize = 32;

/// One local rank's resources.
#[derive(Debug)]
struct Rank {
    /// Its rank in the world (what the kernels call `rank`).
    world_rank: usize,
    stream: Arc<CudaStream>,
    ctrl: Arc<DevBuf>,
    data: Arc<DevBuf>,
    mailbox: HostMapped<Mailbox>,
    /// `[2 * MAX_CHANNELS]` u64: each block's last call number (the device-resident epoch a
    /// captured graph reads, docs/protocol.md §2.7); only this rank's kernels touch it.
    epoch: DevBuf,
}

/// What [`NormalGroup::layout`] gives one rank (spec §1.7), on the device.
#[derive(Clone, Debug)]
pub struct GpuLayout {
    /// `[1, R]` i32.
    pub num_tokens_per_rank: DevTensor,
    /// `[1, E]` i32.
    pub num_tokens_per_expert: DevTensor,
    /// `[T, R]` u8 (bool).
    pub is_token_in_rank: DevTensor,
}

/// One rank's dispatch inputs, on the device.
#[derive(Clone, Copy, Debug)]
pub struct GpuRankInputs<'a> {
    /// `[T, H]` BF16, or e4m3 bytes with `x_scales`.
    pub x: &'a DevTensor,
    /// `[T, ceil(H / 128)]` f32 for FP8 rows.
    pub x_scales: Option<&'a DevTensor>,
    /// `[T, K]` i64 expert ids (`-1` masked); `None`: no top-k dispatched.
    pub topk_idx: Option<&'a DevTensor>,
    /// `[T, K]` f32.
    pub topk_weights: Option<&'a DevTensor>,
}

/// Options of a GPU dispatch (spec §1.8); the channel count is the group's `num_sms / 2`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuDispatchArgs {
    /// Rounds the expert list (≥ 1).
    pub expert_alignment: usize,
    /// `> 0`: outputs sized to this many rows, no host sync.
    pub num_worst_tokens: usize,
}

impl Default for GpuDispatchArgs {
    fn default() -> Self {
        Self {
            expert_alignment: 1,
            num_worst_tokens: 0,
        }
    }
}

/// The intranode handle on the device (spec §2.2).
#[derive(Clone, Debug)]
pub struct GpuHandle {
    /// `[R, R]` i32, inclusive.
    pub rank_prefix_matrix: DevTensor,
    /// `[R, C]` i32, sender side, inclusive.
    pub channel_prefix_matrix: DevTensor,
    /// `[R, C]` i32, receiver side, exclusive.
    pub recv_channel_prefix_matrix: DevTensor,
    /// `[T, R]` i32 (slot of token `t` in `(channel, d)`, or -1).
    pub send_head: DevTensor,
    /// `[T, R]` u8 (from the layout).
    pub is_token_in_rank: DevTensor,
    /// Rows received (`None` in worst-token mode: not known on the host).
    pub num_recv_tokens: Option<usize>,
    /// Output rows (`num_recv_tokens`, or `num_worst_tokens`).
    pub num_rows: usize,
    /// Tokens of this rank.
    pub num_tokens: usize,
}

impl GpuHandle {
    /// The shapes the rules every backend shares read (`ep_core::buffer::check`).
    #[must_use]
    pub fn shapes(&self) -> HandleShapes {
        let shape = |t: &DevTensor| (t.rows(), t.cols());
        HandleShapes {
            rank_prefix_matrix: shape(&self.rank_prefix_matrix),
            channel_prefix_matrix: shape(&self.channel_prefix_matrix),
            recv_channel_prefix_matrix: shape(&self.recv_channel_prefix_matrix),
            send_head: shape(&self.send_head),
            is_token_in_rank: shape(&self.is_token_in_rank),
            num_rows: self.num_rows,
            num_recv: self.num_recv_tokens,
        }
    }

    /// Checks every matrix's dtype (rank `rank` named in the error).
    pub fn check_dtypes(&self, rank: usize) -> Result<()> {
        let what = |m: &str| format!("handle of rank {rank}: {m}");
        for (name, t, dtype) in [
            ("rank_prefix_matrix", &self.rank_prefix_matrix, DType::I32),
            (
                "channel_prefix_matrix",
                &self.channel_prefix_matrix,
                DType::I32,
            ),
            (
                "recv_channel_prefix_matrix",
                &self.recv_channel_prefix_matrix,
                DType::I32,
            ),
            ("send_head", &self.send_head, DType::I32),
            ("is_token_in_rank", &self.is_token_in_rank, DType::U8),
        ] {
            t.expect(&what(name), dtype, None, None)?;
        }
        Ok(())
    }

    /// Checks every matrix's dtype and shape for rank `rank` of `num_ranks` with `num_channels`
    /// channels (a handle from another group or call shape is a typed error, not a bad read).
    /// The dtypes here, the shapes by the rules every backend shares
    /// (`ep_core::buffer::check::normal_handle`).
    pub fn check(&self, rank: usize, num_ranks: usize, num_channels: usize) -> Result<()> {
        self.check_dtypes(rank)?;
        let shapes = self.shapes();
        normal_handle(
            rank,
            num_ranks,
            Some(self.num_tokens),
            Some(num_channels),
            &shapes,
        )?;
        Ok(())
    }
}

/// What one rank receives from a GPU dispatch.
#[derive(Clone, Debug)]
pub struct GpuDispatch {
    /// `[rows, H]` view into the arena (BF16 or e4m3), row stride = the dispatch record.
    pub recv_x: DevTensor,
    /// `[rows, S]` f32 view into the arena (FP8 only).
    pub recv_x_scales: Option<DevTensor>,
    /// `[rows, K]` i64 local expert ids (with top-k): a view into the arena's records (row
    /// stride = the record), valid until the next dispatch, like `recv_x`.
    pub recv_topk_idx: Option<DevTensor>,
    /// `[rows, K]` f32 (with top-k), a view like `recv_topk_idx`.
    pub recv_topk_weights: Option<DevTensor>,
    /// `[rows, 1]` i32 source token of each row: a view into the arena's records (row stride =
    /// the record), valid until the next dispatch, like `recv_x`.
    pub recv_src_idx: DevTensor,
    /// `[L]` aligned received counts per local expert (empty in worst-token mode).
    pub num_recv_tokens_per_expert_list: Vec<i32>,
    /// For combine and cached dispatch.
    pub handle: GpuHandle,
}

/// Where a combine finds the expert outputs of a rank (docs/protocol.md §2.5, §2.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CombineSource {
    /// The BF16 x parts of the last dispatch's rows (the expert wrote over its input), with the
    /// dispatched weights.
    InPlace,
    /// The combine rows, written through [`NormalGroup::combine_rows`] or
    /// [`NormalGroup::write_combine_rows`].
    Rows,
}

/// One rank's combine arguments.
#[derive(Clone, Copy, Debug)]
pub struct GpuCombineArgs<'a> {
    /// The rank's handle from the dispatch.
    pub handle: &'a GpuHandle,
    /// Whether to combine the top-k weights (`[T, K]` out).
    pub with_weights: bool,
    /// 0–2 BF16 `[T, H]` biases.
    pub bias: [Option<&'a DevTensor>; 2],
}

impl<'a> GpuCombineArgs<'a> {
    /// Every rank's combine of what `out` delivered, with its weights and no bias: the identity
    /// expert's combine (the rows themselves with `CombineSource::InPlace`).
    pub fn of_dispatch(out: &'a [GpuDispatch]) -> Vec<Self> {
        out.iter()
            .map(|d| Self {
                handle: &d.handle,
                with_weights: true,
                bias: [None, None],
            })
            .collect()
    }
}

/// What combine gives one rank.
#[derive(Clone, Debug)]
pub struct GpuCombined {
    /// `[T, H]` BF16.
    pub combined_x: DevTensor,
    /// `[T, K]` f32 when weights were combined.
    pub combined_topk_weights: Option<DevTensor>,
}

/// What a dispatch's checks settled ([`NormalGroup::check_dispatch`]).
pub(crate) struct DispatchChecked {
    r: usize,
    n: usize,
    with_topk: bool,
    l: usize,
    fmt: RowFormat,
    tokens: Vec<usize>,
    drec: u64,
    cap: u64,
    c: usize,
}

/// What a cached dispatch's checks settled ([`NormalGroup::check_cached`]).
pub(crate) struct CachedChecked {
    n: usize,
    fmt: RowFormat,
    tokens: Vec<usize>,
    c: usize,
    drec: u64,
    cap: u64,
}

/// What a combine's checks settled ([`NormalGroup::check_combine`]).
pub(crate) struct CombineChecked {
    n: usize,
    c: usize,
    last: LastDispatch,
    hidden: usize,
    k: usize,
}

/// The row format of the last dispatch (what the arena holds).
#[derive(Clone, Copy, Debug)]
struct LastDispatch {
    fmt: RowFormat,
    num_topk: usize,
}

/// The local ranks of one process running normal mode over a world of `R` ranks (module docs).
#[derive(Debug)]
pub struct NormalGroup {
    dev: Arc<Device>,
    /// `R`, the ranks the kernels address.
    world: usize,
    /// The local ranks, ascending world rank.
    ranks: Vec<Rank>,
    /// The other processes' ranks, mapped here (alive while kernels may address them).
    peers: Vec<Peer>,
    /// Every world rank's `normal.ctrl` / `normal.data` address in this process: the kernels'
    /// peer table (local buffers or mappings).
    table_ctrl: [u64; MAX_RANKS],
    table_data: [u64; MAX_RANKS],
    /// Bytes of every rank's `normal.data`.
    data_bytes: u64,
    /// The processes' host collectives (`None`: every rank is local).
    exchange: Option<Box<dyn Exchange>>,
    num_sms: usize,
    call: u64,
    timeout: Duration,
    poison: Option<String>,
    last: Option<LastDispatch>,
    /// Test hook: a rank whose kernels are not launched (a rank that never arrives).
    absent: Option<usize>,
    /// The gate of timed calls ([`NormalGroup::timed`]).
    gate: Option<Gate>,
    /// Host time of the last [`NormalGroup::timed`] closure (enqueueing every local rank's work).
    last_enqueue: Duration,
    /// Per rank: where the kernels stamp their phase times, when measuring.
    phase_times: Option<Vec<DevTensor>>,
    /// Tells graphs which group they were captured from.
    id: u64,
    /// Set while [`NormalGroup::capture`] records the calls.
    capture: Option<graph::Capture>,
    /// Set while [`NormalGroup::with_streams`] runs the calls on the caller's streams.
    swapped: bool,
    /// Protocol traces ([`NormalGroup::set_trace`]).
    tracing: Option<trace::Tracing>,
}

/// The kernels of `cuda/normal.cu` a group launches (the traced build's for dispatch and
/// combine while tracing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Layout,
    Dispatch,
    Combine,
    Ceiling,
    CeilingGather,
}

/// Launches `f(args)` on `stream` with programmatic stream serialization (PDL): the kernel may
/// be scheduled while the stream's previous kernel still runs — the layout kernel lets its
/// dependent start at once — and waits for that kernel's end and memory itself
/// (`ep_pdl_wait`, ep_device.cuh) before it reads anything. What overlaps is the launch: the
/// dispatch's blocks are launched and resident when the layout ends.
fn launch_programmatic(
    stream: &CudaStream,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &NormalArgs,
) -> Result<()> {
    use cudarc::driver::sys;
    stream
        .context()
        .bind_to_thread()
        .map_err(Error::cuda("cuCtxSetCurrent"))?;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            programmaticStreamSerializationAllowed: 1,
        },
    };
    let lc = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    let mut params = [std::ptr::from_ref(args)
        .cast_mut()
        .cast::<std::ffi::c_void>()];
    // SAFETY: the kernel takes one `ep_normal_args` by value (generated from the same table as
    // `NormalArgs`), passed as the one entry of `params`, which the driver copies before this
    // returns; `attr` and `lc` outlive the call; the stream and function belong to the context
    // bound above. The addresses inside `args` are live for the kernel as `launch` says.
    unsafe {
        sys::cuLaunchKernelEx(
            &lc,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(Error::cuda("cuLaunchKernelEx"))
}

fn launch_cfg(blocks: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl NormalGroup {
    /// `num_ranks` co-resident ranks, each with `num_nvl_bytes` of arena and `num_sms` SMs
    /// (`num_sms / 2` channels). Fails unless every rank's kernel can be resident at once:
    /// `num_ranks × num_sms ≤` the GPU's SMs.
    pub fn new(
        dev: Arc<Device>,
        num_ranks: usize,
        num_sms: usize,
        num_nvl_bytes: u64,
    ) -> Result<Self> {
        let local: Vec<usize> = (0..num_ranks).collect();
        Self::local_part(dev, num_ranks, &local, num_sms, num_nvl_bytes)
    }

    /// One rank per process (the deployment shape): this process is rank `exchange.rank()` of
    /// `exchange.world()`, each process calls this with the same `num_sms` and
    /// `num_nvl_bytes`. Collective: returns once every process has mapped every other's arena
    /// (bounded by the exchange's timeout).
    pub fn new_process(
        dev: Arc<Device>,
        num_sms: usize,
        num_nvl_bytes: u64,
        exchange: Box<dyn Exchange>,
    ) -> Result<Self> {
        let (rank, world) = (exchange.rank() as usize, exchange.world() as usize);
        Self::with_peers(dev, world, &[rank], num_sms, num_nvl_bytes, exchange)
    }

    /// This process's `local_ranks` (ascending) of a world of `num_ranks`, co-resident on
    /// `dev` (`local_ranks.len() × num_sms ≤` its SMs), the other ranks held by the other
    /// processes of `exchange` (each world rank in exactly one process; the exchange's ranks
    /// are process indices). Collective like [`NormalGroup::new_process`].
    ///
    /// Processes sharing one GPU take turns without MPS (a cross-process flag round trip takes
    /// milliseconds, GPU.md): give them generous timeouts, or run under MPS, where the blocks of
    /// every process's kernels must fit the GPU at once.
    pub fn with_peers(
        dev: Arc<Device>,
        num_ranks: usize,
        local_ranks: &[usize],
        num_sms: usize,
        num_nvl_bytes: u64,
        mut exchange: Box<dyn Exchange>,
    ) -> Result<Self> {
        let mut g = Self::local_part(dev, num_ranks, local_ranks, num_sms, num_nvl_bytes)?;
        let shape = Shape {
            world: num_ranks,
            num_sms,
            ctrl_bytes: g.ranks[0].ctrl.len() as u64,
            data_bytes: g.data_bytes,
        };
        let local: Vec<(usize, &DevBuf, &DevBuf)> = g
            .ranks
            .iter()
            .map(|r| (r.world_rank, &*r.ctrl, &*r.data))
            .collect();
        let peers = peers::map_peers(&mut *exchange, g.dev.context(), shape, &local)?;
        for p in &peers {
            g.table_ctrl[p.world_rank] = p.ctrl.ptr();
            g.table_data[p.world_rank] = p.data.ptr();
        }
        g.peers = peers;
        g.exchange = Some(exchange);
        Ok(g)
    }

    /// The local ranks' resources, their entries of the peer table filled.
    fn local_part(
        dev: Arc<Device>,
        num_ranks: usize,
        local_ranks: &[usize],
        num_sms: usize,
        num_nvl_bytes: u64,
    ) -> Result<Self> {
        if num_ranks == 0 || num_ranks > MAX_RANKS {
            return Err(Error::Unsupported(format!(
                "{num_ranks} ranks: the normal-mode kernels address 1 to {MAX_RANKS} ranks"
            )));
        }
        if local_ranks.is_empty()
            || local_ranks.windows(2).any(|w| w[0] >= w[1])
            || local_ranks.iter().any(|&r| r >= num_ranks)
        {
            return Err(Error::Unsupported(format!(
                "local ranks {local_ranks:?}: give at least one rank of 0..{num_ranks}, ascending, each once"
            )));
        }
        if num_sms < 2
            || !num_sms.is_multiple_of(2)
            || num_sms / 2 > ep_core::protocol::layout::MAX_CHANNELS
        {
            return Err(Error::Unsupported(format!(
                "num_sms {num_sms}: use an even number from 2 to {} (two SMs per channel)",
                2 * ep_core::protocol::layout::MAX_CHANNELS
            )));
        }
        // The co-resident ranks (this process's, on this device) must all be resident at once.
        if local_ranks.len() * num_sms > dev.num_sms() {
            return Err(Error::NotEnoughSms {
                ranks: local_ranks.len(),
                sms_per_rank: num_sms,
                device_sms: dev.num_sms(),
            });
        }
        let ctrl_bytes = align128(NormalCtrl { num_ranks }.bytes());
        let min = ctrl_bytes
            + NormalData {
                num_ranks,
                data_bytes: 0,
            }
            .rows_base()
            + 256;
        if num_nvl_bytes < min {
            return Err(Error::ArenaTooSmall {
                needed: min,
                available: num_nvl_bytes,
            });
        }
        let ctx = dev.context().clone();
        let mut ranks = Vec::with_capacity(local_ranks.len());
        let (mut table_ctrl, mut table_data) = ([0; MAX_RANKS], [0; MAX_RANKS]);
        for &world_rank in local_ranks {
            let stream = ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?;
            let ctrl = Arc::new(DevBuf::zeroed(&ctx, ctrl_bytes as usize)?);
            let data = Arc::new(DevBuf::new(&ctx, (num_nvl_bytes - ctrl_bytes) as usize)?);
            debug_assert!(data.ptr() % REGION_ALIGN == 0);
            table_ctrl[world_rank] = ctrl.ptr();
            table_data[world_rank] = data.ptr();
            ranks.push(Rank {
                world_rank,
                stream,
                ctrl,
                data,
                mailbox: HostMapped::new(&ctx)?,
                epoch: DevBuf::zeroed(&ctx, 8 * EPOCH_WORDS)?,
            });
        }
        Ok(Self {
            dev,
            world: num_ranks,
            ranks,
            peers: Vec::new(),
            table_ctrl,
            table_data,
            data_bytes: num_nvl_bytes - ctrl_bytes,
            exchange: None,
            num_sms,
            call: 0,
            timeout: Duration::from_secs(10),
            poison: None,
            last: None,
            absent: None,
            gate: None,
            last_enqueue: Duration::ZERO,
            phase_times: None,
            tracing: None,
            id: graph::next_group_id(),
            capture: None,
            swapped: false,
        })
    }

    /// Ranks of the world (`R`, what shapes and expert counts are relative to).
    pub fn num_ranks(&self) -> usize {
        self.world
    }

    /// Ranks this process drives (the length of every per-rank slice of a call).
    pub fn num_local_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The world ranks of the local ranks, in the order of every per-rank slice.
    pub fn local_ranks(&self) -> Vec<usize> {
        self.ranks.iter().map(|r| r.world_rank).collect()
    }

    /// The world rank of local rank `local`.
    pub fn world_rank(&self, local: usize) -> Option<usize> {
        self.ranks.get(local).map(|r| r.world_rank)
    }

    /// Waits until every process of the group has called it (nothing to wait for when every
    /// rank is local). Host only: enqueued work is not waited for.
    pub fn barrier(&mut self) -> Result<()> {
        match &mut self.exchange {
            Some(ex) => ex.barrier(),
            None => Ok(()),
        }
    }

    /// Collective teardown: waits for the local ranks' work, then for every process
    /// ([`NormalGroup::barrier`]), so no peer's kernel still addresses this process's arenas
    /// when they are freed. Dropping a group without it is safe for this process but may pull
    /// the memory from under a peer's running kernels.
    pub fn close(mut self) -> Result<()> {
        let synced = self.sync_streams();
        let met = self.barrier();
        synced.and(met)
    }

    pub(crate) fn sync_streams(&self) -> Result<()> {
        // Work behind a closed timing gate would only start when the gate ran out.
        self.open_gate();
        for r in &self.ranks {
            r.stream
                .synchronize()
                .map_err(Error::cuda("cuStreamSynchronize"))?;
        }
        Ok(())
    }

    /// SMs per rank.
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }

    /// Channels `C = num_sms / 2`.
    pub fn num_channels(&self) -> usize {
        self.num_sms / 2
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Local rank `r`'s stream (every call of the group enqueues that rank's work on it).
    pub fn stream(&self, r: usize) -> &Arc<CudaStream> {
        &self.ranks[r].stream
    }

    /// The number of the last call.
    pub fn last_call(&self) -> u64 {
        self.call
    }

    /// Makes the next call number at least `call` (a `Buffer` driving the group: its call
    /// counter; the numbers only ever grow, so every process, making the same calls, uses the
    /// same ones).
    pub(crate) fn set_next_call(&mut self, call: u64) {
        self.call = self.call.max(call.saturating_sub(1));
    }

    /// Local rank `local`'s `normal.ctrl` and `normal.data`.
    pub(crate) fn arena(&self, local: usize) -> (&Arc<DevBuf>, &Arc<DevBuf>) {
        (&self.ranks[local].ctrl, &self.ranks[local].data)
    }

    /// The row format and top-k of the last dispatch, if any since the last reset.
    pub(crate) fn last_dispatch(&self) -> Option<(RowFormat, usize)> {
        self.last.map(|l| (l.fmt, l.num_topk))
    }

    /// Whether `t` is local rank `local`'s received-rows view of the last dispatch (`recv_x`
    /// of BF16 rows), so a combine can read it in place.
    pub(crate) fn is_dispatch_rows(&self, local: usize, t: &DevTensor) -> bool {
        let Some((fmt, _)) = self.last_dispatch() else {
            return false;
        };
        let base = self.ranks[local].data.ptr() + self.data_layout().rows_base();
        fmt.elem_bytes == 2
            && t.dtype() == DType::Bf16
            && t.ptr() == base
            && t.row_stride() == fmt.dispatch_record()
            && t.cols() == fmt.hidden
    }

    /// Bound of every device wait (and of the host's wait for `num_recv`).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn data_layout(&self) -> NormalData {
        NormalData {
            num_ranks: self.num_ranks(),
            data_bytes: self.data_bytes,
        }
    }

    /// Rank `rank`'s received rows as views into its dispatch region: x (BF16 or e4m3) and,
    /// for FP8, the f32 scales, `rows` records of `fmt`'s dispatch record each.
    fn recv_views(
        &self,
        rank: usize,
        fmt: RowFormat,
        rows: usize,
    ) -> Result<(DevTensor, Option<DevTensor>)> {
        let data = &self.ranks[rank].data;
        let base = self.data_layout().rows_base();
        let drec = fmt.dispatch_record();
        let fp8 = fmt.elem_bytes == 1;
        let xdt = if fp8 { DType::F8E4M3 } else { DType::Bf16 };
        let x = DevTensor::strided(data.clone(), base, xdt, rows, fmt.hidden, drec)?;
        let scales = fp8
            .then(|| {
                DevTensor::strided(
                    data.clone(),
                    base + fmt.scales_offset(),
                    DType::F32,
                    rows,
                    fmt.num_scales,
                    drec,
                )
            })
            .transpose()?;
        Ok((x, scales))
    }

    /// `[rows, 1]` i32 `recv_src_idx` of local rank `rank`: the records' `src_idx` field as a
    /// view (row stride = the record), like the top-k views; the kernels copy nothing out.
    fn src_view(&self, rank: usize, fmt: RowFormat, rows: usize) -> Result<DevTensor> {
        DevTensor::strided(
            self.ranks[rank].data.clone(),
            self.data_layout().rows_base() + fmt.meta_offset(),
            DType::I32,
            rows,
            1,
            fmt.dispatch_record(),
        )
    }

    /// Rows of `rec` bytes the dispatch region holds.
    pub fn dispatch_capacity(&self, rec: u64) -> u64 {
        self.data_layout().dispatch_capacity(rec)
    }

    pub(crate) fn check_ready(&mut self) -> Result<()> {
        if let Some(cause) = &self.poison {
            return Err(Error::Poisoned {
                cause: cause.clone(),
            });
        }
        if self.capture.is_some() {
            // Nothing runs while capturing, and a capturing stream cannot be synchronised: device
            // errors of earlier calls surface at the replay or the next sync.
            return Ok(());
        }
        self.check_device_error()
    }

    /// Turns the process's error record into a typed error (after syncing every stream).
    /// Timeouts and layouts that disagree with their membership (rows stored at wrong places)
    /// poison the group; refused inputs (capacity, expert ids) do not: the record is cleared and
    /// the group stays usable.
    fn check_device_error(&mut self) -> Result<()> {
        let e = self.dev.err.read();
        if e.status == 0 {
            return Ok(());
        }
        self.sync_streams()?;
        let e = self.dev.err.read();
        let err = self.decode(&e);
        if matches!(e.status, abi::EP_ERR_TIMEOUT | abi::EP_ERR_LAYOUT) {
            self.poison = Some(err.to_string());
        } else {
            self.dev.err.write(ErrBlock::default());
        }
        Err(err)
    }

    fn decode(&self, e: &ErrBlock) -> Error {
        decode_record(e, self.num_ranks(), self.timeout)
    }

    /// Waits for every local rank's stream and reports any device error
    /// ([`Error::Poisoned`] once a timeout poisoned the group).
    pub fn sync(&mut self) -> Result<()> {
        self.not_capturing("sync")?;
        if let Some(cause) = &self.poison {
            return Err(Error::Poisoned {
                cause: cause.clone(),
            });
        }
        self.sync_streams()?;
        self.check_device_error()
    }

    /// Collective reset after a device timeout (docs/protocol.md §7.2): waits for the local
    /// ranks, then for every process (no kernel anywhere still writes a control word), zeroes
    /// the local ranks' control words, waits for every process again (nobody launches before
    /// every word is zero), clears the error record. The call counter goes on (the local ranks'
    /// device epoch words are set to it).
    pub fn reset(&mut self) -> Result<()> {
        self.not_capturing("reset")?;
        self.sync_streams()?;
        self.barrier()?;
        for r in &self.ranks {
            r.ctrl.memset_async(&r.stream, 0, 0, r.ctrl.len())?;
        }
        self.sync_streams()?;
        // A rank whose kernels did not all run (the failure being reset) left its epoch words
        // behind the host's counter: set them to it, so a graph replayed next counts on.
        let words: Vec<u8> = std::iter::repeat_n(self.call.to_le_bytes(), EPOCH_WORDS)
            .flatten()
            .collect();
        for r in &self.ranks {
            r.epoch.write(0, &words)?;
        }
        self.barrier()?;
        self.dev.err.write(ErrBlock::default());
        self.poison = None;
        self.last = None;
        Ok(())
    }

    /// The arguments every kernel of local rank `local` starts from.
    fn base_args(&self, local: usize) -> NormalArgs {
        NormalArgs {
            rank: self.ranks[local].world_rank as u64,
            num_ranks: self.num_ranks() as u64,
            num_channels: self.num_channels() as u64,
            data_bytes: self.data_bytes,
            // A captured kernel must not freeze its call number: 0 makes it take the next one
            // from its epoch word at every replay.
            call: if self.capture.is_some() { 0 } else { self.call },
            epoch: self.ranks[local].epoch.ptr(),
            err: self.dev.err.dev_ptr(),
            timeout_ns: self.timeout.as_nanos().min(u64::MAX as u128) as u64,
            mailbox: self.ranks[local].mailbox.dev_ptr(),
            peer_ctrl: self.table_ctrl,
            peer_data: self.table_data,
            // Co-resident ranks: every peer is on this GPU, GPU-scope fences and signals
            // suffice; ranks in other processes may be on other GPUs (system scope).
            flags: if self.ranks.len() == self.num_ranks() {
                abi::EP_FLAG_SAME_GPU
            } else {
                0
            },
            ..NormalArgs::default()
        }
    }

    /// World rank of local rank `local` (for messages).
    fn who(&self, local: usize) -> usize {
        self.ranks[local].world_rank
    }

    /// Test hook: `Some(r)` stops launching local rank `r`'s kernels, as if that rank never
    /// arrived (its peers' waits must then time out, naming it).
    #[doc(hidden)]
    pub fn set_absent_rank_for_test(&mut self, rank: Option<usize>) {
        self.absent = rank;
    }

    /// Test support: fills every local rank's `normal.data` with `byte` (poisons received
    /// rows, count records and tables before a call, so a row the kernels failed to write
    /// shows). Collective: returns when every process has filled its arenas, so no fill lands
    /// on rows a peer already stored.
    #[doc(hidden)]
    pub fn fill_arenas_for_test(&mut self, byte: u8) -> Result<()> {
        self.not_capturing("fill_arenas_for_test")?;
        for r in &self.ranks {
            r.data.memset_async(&r.stream, byte, 0, r.data.len())?;
        }
        self.sync_streams()?;
        self.barrier()
    }

    /// Measurement: from now on (`on`) the dispatch and combine kernels stamp `%globaltimer` at
    /// their phase boundaries ([`NormalGroup::phase_times`]); off again with `false`.
    pub fn measure_phases(&mut self, on: bool) -> Result<()> {
        self.not_capturing("measure_phases")?;
        self.phase_times = if on {
            let rows = 2 * ep_core::protocol::layout::MAX_CHANNELS;
            let slots = abi::EP_PHASE_SLOTS as usize;
            Some(
                (0..self.num_local_ranks())
                    .map(|_| DevTensor::zeros(self.dev.context(), DType::I64, rows, slots))
                    .collect::<Result<_>>()?,
            )
        } else {
            None
        };
        Ok(())
    }

    /// The stamps of the last measured kernel of each local rank: per block, `EP_PHASE_SLOTS`
    /// `%globaltimer` values (ns; 0 = not reached). Dispatch: start, offsets known, rows stored,
    /// done released, done acquired, end; combine: start, y_ready acquired, rows reduced, -, -,
    /// end. Call after [`NormalGroup::sync`].
    pub fn phase_times(&self) -> Result<Vec<Vec<Vec<u64>>>> {
        let Some(bufs) = &self.phase_times else {
            return Ok(Vec::new());
        };
        let blocks = 2 * self.num_channels();
        bufs.iter()
            .map(|b| {
                let t = b.download::<i64>()?;
                Ok((0..blocks)
                    .map(|i| t.row(i).iter().map(|&v| v as u64).collect())
                    .collect())
            })
            .collect()
    }

    fn launch(&self, rank: usize, kernel: Kernel, blocks: u32, args: &NormalArgs) -> Result<()> {
        if self.absent == Some(rank) {
            return Ok(());
        }
        let protocol = matches!(kernel, Kernel::Dispatch | Kernel::Combine);
        let set = match &self.tracing {
            Some(_) if protocol => &self.dev.normal_trace,
            _ => &self.dev.normal,
        };
        let f = match kernel {
            Kernel::Layout => &set.layout,
            Kernel::Dispatch => &set.dispatch,
            Kernel::Combine => &set.combine,
            Kernel::Ceiling => &set.ceiling,
            Kernel::CeilingGather => &set.ceiling_gather,
        };
        let mut a = *args;
        if let Some(bufs) = &self.phase_times
            && blocks as usize <= bufs[rank].rows()
        {
            a.phase_times = bufs[rank].ptr();
        }
        if protocol && let Some(t) = &self.tracing {
            t.apply(rank, &mut a);
        }
        let args = &a;
        if matches!(kernel, Kernel::Dispatch) {
            return launch_programmatic(&self.ranks[rank].stream, f, launch_cfg(blocks), args);
        }
        let mut b = self.ranks[rank].stream.launch_builder(f);
        b.arg(args);
        // SAFETY: the kernel takes one `ep_normal_args` by value (generated from the same table
        // as `NormalArgs`); every address in it is a live device allocation of this group or a
        // tensor the caller keeps alive until the stream passes the kernel (the group's calls
        // return owned tensors or views of its own arenas), and writes stay within the shapes
        // validated by the caller of `launch`.
        unsafe { b.launch(launch_cfg(blocks)) }
            .map(|_| ())
            .map_err(Error::cuda("cuLaunchKernel"))
    }

    /// `get_dispatch_layout` of every local rank on the device (spec §1.7). `topk_idx[i]` is
    /// local rank `i`'s `[T, K]` i64.
    pub fn layout(
        &mut self,
        topk_idx: &[&DevTensor],
        num_experts: usize,
    ) -> Result<Vec<GpuLayout>> {
        self.check_ready()?;
        let r = self.num_ranks();
        check_rank_count(self.num_local_ranks(), topk_idx.len())?;
        ep_core::plan::layout::local_experts(num_experts, r)?;
        let mut out = Vec::with_capacity(topk_idx.len());
        for (s, t) in topk_idx.iter().enumerate() {
            let w = self.who(s);
            t.expect(&format!("topk_idx of rank {w}"), DType::I64, None, None)?;
            check_device(t, &self.dev, w)?;
            if t.cols() > MAX_TOPK || !t.is_contiguous() {
                return Err(Error::Unsupported(format!(
                    "topk_idx of rank {w}: {} columns (at most {MAX_TOPK}), contiguous rows needed",
                    t.cols()
                )));
            }
            self.keep(Some(t));
            // Both counts in one allocation, zeroed by one memset (each stream operation before
            // the kernel costs the call a launch gap).
            let counts = self.alloc(s, DType::I32, 1, r + num_experts)?;
            counts
                .buffer()
                .memset_async(&self.ranks[s].stream, 0, 0, 4 * (r + num_experts))?;
            let buf = counts.buffer().clone();
            let per_rank = DevTensor::strided(buf.clone(), 0, DType::I32, 1, r, 4 * r as u64)?;
            let per_expert = DevTensor::strided(
                buf,
                4 * r as u64,
                DType::I32,
                1,
                num_experts,
                4 * num_experts as u64,
            )?;
            let in_rank = self.alloc(s, DType::U8, t.rows(), r)?;
            let mut a = self.base_args(s);
            a.num_tokens = t.rows() as u64;
            a.num_topk = t.cols() as u64;
            a.num_experts = num_experts as u64;
            a.num_local_experts = (num_experts / r) as u64;
            a.topk_idx = t.ptr();
            a.num_tokens_per_rank = per_rank.ptr();
            a.num_tokens_per_expert = per_expert.ptr();
            a.is_token_in_rank = in_rank.ptr();
            // Two ids a lane (the kernel's lanes per token round that up to a power of two, and
            // its grid-stride loop covers whatever this grid leaves).
            let lanes = t.cols().div_ceil(2) as u64;
            let blocks = (t.rows() as u64 * lanes)
                .div_ceil(u64::from(THREADS))
                .clamp(1, 132) as u32;
            self.launch(s, Kernel::Layout, blocks, &a)?;
            out.push(GpuLayout {
                num_tokens_per_rank: per_rank,
                num_tokens_per_expert: per_expert,
                is_token_in_rank: in_rank,
            });
        }
        Ok(out)
    }

    /// The row format of `inputs` (checked equal across ranks) and each rank's token count.
    fn check_inputs(
        &self,
        inputs: &[GpuRankInputs<'_>],
        with_topk: bool,
    ) -> Result<(RowFormat, Vec<usize>)> {
        let first = inputs[0].x;
        let fp8 = match first.dtype() {
            DType::Bf16 => false,
            DType::F8E4M3 => true,
            d => {
                return Err(Error::TensorMismatch {
                    what: format!("x of rank {}", self.who(0)),
                    expected: "Bf16 or F8E4M3".into(),
                    found: format!("{d:?}"),
                });
            }
        };
        let shape = |t: &DevTensor| (t.rows(), t.cols());
        let shapes_of = |inp: &GpuRankInputs<'_>| InputShapes {
            x: shape(inp.x),
            fp8: inp.x.dtype() == DType::F8E4M3,
            x_scales: inp.x_scales.map(shape),
            topk_idx: inp.topk_idx.map(shape),
            topk_weights: inp.topk_weights.map(shape),
        };
        let first_shapes = shapes_of(&inputs[0]);
        let mut tokens = Vec::with_capacity(inputs.len());
        for (i, inp) in inputs.iter().enumerate() {
            let s = self.who(i);
            // Dtypes, devices and layout here; shapes by the rules every backend shares.
            inp.x
                .expect(&format!("x of rank {s}"), first.dtype(), None, None)?;
            check_device(inp.x, &self.dev, s)?;
            if !inp.x.is_contiguous() {
                return Err(Error::Unsupported(format!(
                    "x of rank {s}: rows must be contiguous"
                )));
            }
            let typed = |t: Option<&DevTensor>, name: &str, dtype: DType| -> Result<()> {
                if let Some(x) = t {
                    x.expect(&format!("{name} of rank {s}"), dtype, None, None)?;
                    check_device(x, &self.dev, s)?;
                }
                Ok(())
            };
            if fp8 {
                typed(inp.x_scales, "x_scales", DType::F32)?;
            }
            if with_topk {
                typed(inp.topk_idx, "topk_idx", DType::I64)?;
                typed(inp.topk_weights, "topk_weights", DType::F32)?;
            }
            let shapes = shapes_of(inp);
            shapes.check(s, with_topk)?;
            shapes.agree(&first_shapes, s, with_topk)?;
            tokens.push(inp.x.rows());
        }
        let hidden = first.cols();
        let num_scales = if fp8 { hidden.div_ceil(128) } else { 0 };
        let elem = if fp8 { 1 } else { 2 };
        if hidden == 0 || !(hidden * elem).is_multiple_of(16) {
            return Err(Error::Unsupported(format!(
                "hidden {hidden}: rows must be a multiple of 16 bytes (hidden a multiple of {})",
                16 / elem
            )));
        }
        let num_topk = if with_topk {
            first_shapes.topk_idx.map_or(0, |(_, k)| k)
        } else {
            0
        };
        if num_topk > MAX_TOPK {
            return Err(Error::Unsupported(format!(
                "top-k {num_topk}: at most {MAX_TOPK}"
            )));
        }
        let fmt = RowFormat {
            hidden,
            elem_bytes: elem,
            num_scales,
            num_topk,
        };
        Ok((fmt, tokens))
    }

    /// The top-k ids (`[rows, K]` i64, local ids, -1 elsewhere) and weights (`[rows, K]` f32) of
    /// local rank `rank`'s received rows: views of the dispatch records in the arena (row
    /// stride = the record), valid until the next dispatch, like `recv_x`.
    pub(crate) fn topk_views(
        &self,
        rank: usize,
        fmt: RowFormat,
        rows: usize,
    ) -> Result<(DevTensor, DevTensor)> {
        let data = &self.ranks[rank].data;
        let base = self.data_layout().rows_base();
        let drec = fmt.dispatch_record();
        let k = fmt.num_topk;
        Ok((
            DevTensor::strided(
                data.clone(),
                base + fmt.topk_idx_offset(),
                DType::I64,
                rows,
                k,
                drec,
            )?,
            DevTensor::strided(
                data.clone(),
                base + fmt.topk_weights_offset(),
                DType::F32,
                rows,
                k,
                drec,
            )?,
        ))
    }

    /// The checks of a dispatch before anything is enqueued (no side effect): counts, dtypes,
    /// devices, shapes, options, capacity for the worst-token rows.
    pub(crate) fn check_dispatch(
        &self,
        inputs: &[GpuRankInputs<'_>],
        layouts: &[GpuLayout],
        num_experts: usize,
        args: &GpuDispatchArgs,
    ) -> Result<DispatchChecked> {
        let r = self.num_ranks();
        let n = self.num_local_ranks();
        check_rank_count(n, inputs.len())?;
        check_rank_count(n, layouts.len())?;
        let with_topk = inputs.first().is_some_and(|i| i.topk_idx.is_some());
        // The shape-level rules every backend applies (ep-core's, the simulator's Buffer's).
        let l = ep_core::buffer::check::normal_dispatch(
            r,
            num_experts,
            &DispatchOptions {
                num_channels: self.num_channels(),
                expert_alignment: args.expert_alignment,
                num_worst_tokens: args.num_worst_tokens,
                with_topk,
            },
        )?;
        if self.capture.is_some() && args.num_worst_tokens == 0 {
            return Err(Error::NotCapturable {
                what: "a dispatch without num_worst_tokens".into(),
                fix: "the host waits for num_recv mid-call; capture worst-token dispatches (num_worst_tokens > 0) only".into(),
            });
        }
        let (fmt, tokens) = self.check_inputs(inputs, with_topk)?;
        for (i, lay) in layouts.iter().enumerate() {
            let s = self.who(i);
            lay.num_tokens_per_rank.expect(
                &format!("num_tokens_per_rank of rank {s}"),
                DType::I32,
                Some(1),
                Some(r),
            )?;
            lay.num_tokens_per_expert.expect(
                &format!("num_tokens_per_expert of rank {s}"),
                DType::I32,
                Some(1),
                Some(num_experts),
            )?;
            lay.is_token_in_rank.expect(
                &format!("is_token_in_rank of rank {s}"),
                DType::U8,
                Some(tokens[i]),
                Some(r),
            )?;
        }
        let drec = fmt.dispatch_record();
        let cap = self.dispatch_capacity(drec);
        if args.num_worst_tokens as u64 > cap {
            return Err(Error::DeviceCapacity {
                rank: self.who(0),
                rows: args.num_worst_tokens as u64,
                capacity: cap,
            });
        }
        let c = self.num_channels();
        Ok(DispatchChecked {
            r,
            n,
            with_topk,
            l,
            fmt,
            tokens,
            drec,
            cap,
            c,
        })
    }

    /// Normal dispatch of every local rank (spec §1.8, docs/protocol.md §2.3): layout counts
    /// in, every row stored once at its final row on each destination. `inputs[i]` and
    /// `layouts[i]` are local rank `i`'s.
    pub fn dispatch(
        &mut self,
        inputs: &[GpuRankInputs<'_>],
        layouts: &[GpuLayout],
        num_experts: usize,
        args: &GpuDispatchArgs,
    ) -> Result<Vec<GpuDispatch>> {
        self.check_ready()?;
        let DispatchChecked {
            r,
            n,
            with_topk,
            l,
            fmt,
            tokens,
            drec,
            cap,
            c,
        } = self.check_dispatch(inputs, layouts, num_experts, args)?;
        self.begin_traced(trace::TracedOp::Dispatch)?;
        self.call += 1;
        let k = fmt.num_topk;
        let mut handles = Vec::with_capacity(n);
        // Every allocation (and release) before the first launch: a synchronous one would
        // wait for kernels already launched, which wait for ranks not launched yet.
        for (s, &t) in tokens.iter().enumerate() {
            handles.push((
                self.alloc(s, DType::I32, r, r)?,
                self.alloc(s, DType::I32, r, c)?,
                self.alloc(s, DType::I32, r, c)?,
                self.alloc(s, DType::I32, t, r)?,
            ));
            let inp = inputs[s];
            for t in [Some(inp.x), inp.x_scales, inp.topk_idx, inp.topk_weights] {
                self.keep(t);
            }
            let lay = &layouts[s];
            for t in [
                &lay.num_tokens_per_rank,
                &lay.num_tokens_per_expert,
                &lay.is_token_in_rank,
            ] {
                self.keep(Some(t));
            }
        }
        for s in 0..n {
            let (rpm, cpm, rcpm, send_head) = &handles[s];
            let inp = &inputs[s];
            let mut a = self.base_args(s);
            a.num_tokens = tokens[s] as u64;
            a.num_topk = k as u64;
            a.num_experts = num_experts as u64;
            a.num_local_experts = l as u64;
            a.x_bytes = (fmt.hidden * fmt.elem_bytes) as u64;
            a.num_scales = fmt.num_scales as u64;
            a.hidden = fmt.hidden as u64;
            a.drec = drec;
            a.capacity = cap;
            a.expert_alignment = args.expert_alignment as u64;
            a.num_worst_tokens = args.num_worst_tokens as u64;
            a.flags |= if with_topk { abi::EP_FLAG_TOPK } else { 0 }
                | if fmt.elem_bytes == 1 {
                    abi::EP_FLAG_FP8
                } else {
                    0
                };
            a.x = inp.x.ptr();
            a.x_scales = inp.x_scales.map_or(0, DevTensor::ptr);
            a.topk_idx = inp.topk_idx.map_or(0, DevTensor::ptr);
            a.topk_weights = inp.topk_weights.map_or(0, DevTensor::ptr);
            a.is_token_in_rank = layouts[s].is_token_in_rank.ptr();
            a.num_tokens_per_rank = layouts[s].num_tokens_per_rank.ptr();
            a.num_tokens_per_expert = layouts[s].num_tokens_per_expert.ptr();
            a.rank_prefix_matrix = rpm.ptr();
            a.channel_prefix_matrix = cpm.ptr();
            a.recv_channel_prefix_matrix = rcpm.ptr();
            a.send_head = send_head.ptr();
            self.launch(s, Kernel::Dispatch, 2 * c as u32, &a)?;
        }
        self.last = Some(LastDispatch { fmt, num_topk: k });
        // The only host sync: num_recv and the expert list from each rank's block 1, every word
        // tagged with the call number (no system fence orders them on the device).
        let mut recv = vec![(None, Vec::new()); n];
        if args.num_worst_tokens == 0 {
            // Inside `timed`, the kernels are still behind the gate.
            self.open_gate();
            let deadline = Instant::now() + self.timeout + Duration::from_secs(1);
            for (s, slot) in recv.iter_mut().enumerate() {
                let mut polls = 0u32;
                let got = loop {
                    // The whole mailbox is read only once num_recv carries this call.
                    if self.ranks[s].mailbox.word(0) >> 32 == self.call
                        && let Some(got) = published(&self.ranks[s].mailbox.read(), self.call, l)
                    {
                        break got;
                    }
                    if self.dev.err.read().status != 0 {
                        self.check_device_error()?;
                    }
                    polls = polls.wrapping_add(1);
                    if polls.is_multiple_of(4096)
                        && let Err(e) =
                            stream_fault(&self.ranks[s].stream, "dispatch (a kernel faulted)")
                    {
                        self.poison = Some(format!("rank {}'s stream faulted: {e}", self.who(s)));
                        return Err(e);
                    }
                    if Instant::now() > deadline {
                        self.poison = Some(format!(
                            "rank {}'s dispatch of call {} never published num_recv",
                            self.who(s),
                            self.call
                        ));
                        return Err(Error::HostWaitTimeout {
                            rank: self.who(s),
                            what: format!(
                                "num_recv of call {} from the dispatch's block 1",
                                self.call
                            ),
                            timeout: self.timeout,
                        });
                    }
                    std::hint::spin_loop();
                };
                *slot = (Some(got.0), got.1);
            }
        }
        let mut out = Vec::with_capacity(n);
        for (s, (rpm, cpm, rcpm, send_head)) in handles.into_iter().enumerate() {
            let (num_recv, experts) = recv[s].clone();
            let rows = num_recv.unwrap_or(args.num_worst_tokens);
            let (recv_x, recv_x_scales) = self.recv_views(s, fmt, rows)?;
            let topk = with_topk
                .then(|| self.topk_views(s, fmt, rows))
                .transpose()?;
            let (recv_topk_idx, recv_topk_weights) =
                topk.map_or((None, None), |(i, w)| (Some(i), Some(w)));
            out.push(GpuDispatch {
                recv_x,
                recv_x_scales,
                recv_topk_idx,
                recv_topk_weights,
                recv_src_idx: self.src_view(s, fmt, rows)?,
                num_recv_tokens_per_expert_list: experts,
                handle: GpuHandle {
                    rank_prefix_matrix: rpm,
                    channel_prefix_matrix: cpm,
                    recv_channel_prefix_matrix: rcpm,
                    send_head,
                    is_token_in_rank: layouts[s].is_token_in_rank.clone(),
                    num_recv_tokens: num_recv,
                    num_rows: rows,
                    num_tokens: tokens[s],
                },
            });
        }
        Ok(out)
    }

    /// The checks of a cached dispatch before anything is enqueued (no side effect).
    pub(crate) fn check_cached(
        &self,
        inputs: &[GpuRankInputs<'_>],
        handles: &[&GpuHandle],
    ) -> Result<CachedChecked> {
        let r = self.num_ranks();
        let n = self.num_local_ranks();
        check_rank_count(n, inputs.len())?;
        check_rank_count(n, handles.len())?;
        let (fmt, tokens) = self.check_inputs(inputs, false)?;
        let c = self.num_channels();
        let drec = fmt.dispatch_record();
        let cap = self.dispatch_capacity(drec);
        for (i, h) in handles.iter().enumerate() {
            let s = self.who(i);
            h.check(s, r, c)?;
            if h.num_tokens != tokens[i] {
                return Err(Error::TensorMismatch {
                    what: format!("x of rank {s} for a cached dispatch"),
                    expected: format!("{} rows (the handle's tokens)", h.num_tokens),
                    found: format!("{} rows", tokens[i]),
                });
            }
            let rows = h.num_recv_tokens.ok_or_else(|| {
                Error::Unsupported(
                    "a cached dispatch needs a handle from a dispatch without num_worst_tokens"
                        .into(),
                )
            })?;
            if rows as u64 > cap {
                return Err(Error::DeviceCapacity {
                    rank: s,
                    rows: rows as u64,
                    capacity: cap,
                });
            }
        }
        Ok(CachedChecked {
            n,
            fmt,
            tokens,
            c,
            drec,
            cap,
        })
    }

    /// Cached dispatch (spec §1.8 with a handle, docs/protocol.md §2.4): no count exchange, the
    /// offsets come from each local rank's handle; no top-k. The handles must come from a
    /// dispatch of this group with the same channel count.
    pub fn dispatch_cached(
        &mut self,
        inputs: &[GpuRankInputs<'_>],
        handles: &[&GpuHandle],
    ) -> Result<Vec<GpuDispatch>> {
        self.check_ready()?;
        let CachedChecked {
            n,
            fmt,
            tokens,
            c,
            drec,
            cap,
        } = self.check_cached(inputs, handles)?;
        self.begin_traced(trace::TracedOp::Dispatch)?;
        self.call += 1;
        for s in 0..n {
            self.keep(Some(inputs[s].x));
            self.keep(inputs[s].x_scales);
            self.keep_handle(handles[s]);
        }
        for s in 0..n {
            let h = handles[s];
            let mut a = self.base_args(s);
            a.num_tokens = tokens[s] as u64;
            a.x_bytes = (fmt.hidden * fmt.elem_bytes) as u64;
            a.num_scales = fmt.num_scales as u64;
            a.hidden = fmt.hidden as u64;
            a.drec = drec;
            a.capacity = cap;
            a.flags |= abi::EP_FLAG_CACHED
                | if fmt.elem_bytes == 1 {
                    abi::EP_FLAG_FP8
                } else {
                    0
                };
            a.x = inputs[s].x.ptr();
            a.x_scales = inputs[s].x_scales.map_or(0, DevTensor::ptr);
            a.is_token_in_rank = h.is_token_in_rank.ptr();
            a.rank_prefix_matrix = h.rank_prefix_matrix.ptr();
            a.channel_prefix_matrix = h.channel_prefix_matrix.ptr();
            a.recv_channel_prefix_matrix = h.recv_channel_prefix_matrix.ptr();
            self.launch(s, Kernel::Dispatch, 2 * c as u32, &a)?;
        }
        self.last = Some(LastDispatch { fmt, num_topk: 0 });
        let mut out = Vec::with_capacity(n);
        for (s, h) in handles.iter().enumerate() {
            let rows = h.num_rows;
            let (recv_x, recv_x_scales) = self.recv_views(s, fmt, rows)?;
            out.push(GpuDispatch {
                recv_x,
                recv_x_scales,
                recv_topk_idx: None,
                recv_topk_weights: None,
                recv_src_idx: self.src_view(s, fmt, rows)?,
                num_recv_tokens_per_expert_list: Vec::new(),
                handle: (*h).clone(),
            });
        }
        Ok(out)
    }

    /// Local rank `rank`'s combine rows as views for the expert to write into (zero-copy combine
    /// input, docs/protocol.md §2.6): `[rows, H]` BF16 and, with `num_topk > 0`, `[rows, K]` f32
    /// weights, both with the combine record as row stride.
    pub fn combine_rows(
        &self,
        rank: usize,
        rows: usize,
        hidden: usize,
        num_topk: usize,
    ) -> Result<(DevTensor, Option<DevTensor>)> {
        let fmt = RowFormat {
            hidden,
            elem_bytes: 2,
            num_scales: 0,
            num_topk,
        };
        let yrec = fmt.combine_record();
        let d = self.data_layout();
        if rank >= self.num_local_ranks() {
            return Err(Error::Unsupported(format!(
                "local rank {rank}: the group drives {} local ranks (index them from 0)",
                self.num_local_ranks()
            )));
        }
        if rows as u64 > d.combine_capacity(yrec) {
            return Err(Error::DeviceCapacity {
                rank: self.who(rank),
                rows: rows as u64,
                capacity: d.combine_capacity(yrec),
            });
        }
        let base = d.combine_row(0, yrec);
        let data = self.ranks[rank].data.clone();
        let y = DevTensor::strided(data.clone(), base, DType::Bf16, rows, hidden, yrec)?;
        let w = (num_topk > 0)
            .then(|| {
                DevTensor::strided(
                    data,
                    base + ep_core::protocol::layout::align16(2 * hidden as u64),
                    DType::F32,
                    rows,
                    num_topk,
                    yrec,
                )
            })
            .transpose()?;
        Ok((y, w))
    }

    /// Copies expert outputs `y` (`[rows, H]` BF16) and weights (`[rows, K]` f32) of local
    /// rank `rank` into its combine rows, on its stream (the copying path of combine).
    pub fn write_combine_rows(
        &mut self,
        rank: usize,
        y: &DevTensor,
        weights: Option<&DevTensor>,
    ) -> Result<()> {
        let k = weights.map_or(0, DevTensor::cols);
        let (dy, dw) = self.combine_rows(rank, y.rows(), y.cols(), k)?;
        y.expect("combine input x", DType::Bf16, None, None)?;
        self.keep(Some(y));
        self.keep(weights);
        copy_2d(&self.ranks[rank].stream, y, &dy)?;
        if let (Some(w), Some(dw)) = (weights, dw) {
            w.expect(
                "combine input topk_weights",
                DType::F32,
                Some(y.rows()),
                None,
            )?;
            copy_2d(&self.ranks[rank].stream, w, &dw)?;
        }
        Ok(())
    }

    /// The checks of a combine before anything is enqueued (no side effect).
    pub(crate) fn check_combine(
        &self,
        source: CombineSource,
        args: &[GpuCombineArgs<'_>],
    ) -> Result<CombineChecked> {
        let r = self.num_ranks();
        let n = self.num_local_ranks();
        check_rank_count(n, args.len())?;
        let c = self.num_channels();
        let last = self
            .last
            .ok_or_else(|| Error::Unsupported("combine before any dispatch".into()))?;
        let hidden = last.fmt.hidden;
        let k = last.num_topk;
        if source == CombineSource::InPlace && last.fmt.elem_bytes != 2 {
            return Err(Error::Unsupported(
                "an in-place combine needs BF16 dispatch rows (FP8 rows have no room for BF16 outputs): write the outputs with write_combine_rows and combine from Rows".into(),
            ));
        }
        for (i, a) in args.iter().enumerate() {
            let s = self.who(i);
            let h = a.handle;
            h.check(s, r, c)?;
            if a.with_weights && k == 0 {
                return Err(Error::Unsupported(format!(
                    "rank {s}: weights asked for, but the last dispatch carried no top-k"
                )));
            }
            for (i, b) in a.bias.iter().enumerate() {
                if let Some(b) = b {
                    b.expect(
                        &format!("bias {i} of rank {s}"),
                        DType::Bf16,
                        Some(h.num_tokens),
                        Some(hidden),
                    )?;
                    check_device(b, &self.dev, s)?;
                    if !b.is_contiguous() {
                        return Err(Error::Unsupported(format!(
                            "bias {i} of rank {s}: rows must be contiguous"
                        )));
                    }
                }
            }
        }
        Ok(CombineChecked {
            n,
            c,
            last,
            hidden,
            k,
        })
    }

    /// Combine of every local rank (spec §1.8, docs/protocol.md §2.5): each rank pulls its
    /// tokens' rows from every rank holding them and reduces in DeepEP's order.
    pub fn combine(
        &mut self,
        source: CombineSource,
        args: &[GpuCombineArgs<'_>],
    ) -> Result<Vec<GpuCombined>> {
        self.check_ready()?;
        let CombineChecked {
            n,
            c,
            last,
            hidden,
            k,
        } = self.check_combine(source, args)?;
        self.begin_traced(trace::TracedOp::Combine)?;
        self.call += 1;
        let fmt = RowFormat {
            hidden,
            elem_bytes: 2,
            num_scales: 0,
            num_topk: k,
        };
        // Every allocation before the first launch (see `dispatch`).
        let mut out = Vec::with_capacity(n);
        for (s, a) in args.iter().enumerate() {
            let t = a.handle.num_tokens;
            let combined_x = self.alloc(s, DType::Bf16, t, hidden)?;
            let combined_topk_weights = if a.with_weights {
                Some(self.alloc(s, DType::F32, t, k)?)
            } else {
                None
            };
            out.push(GpuCombined {
                combined_x,
                combined_topk_weights,
            });
            self.keep_handle(a.handle);
            for b in a.bias {
                self.keep(b);
            }
        }
        for (s, a) in args.iter().enumerate() {
            let t = a.handle.num_tokens;
            let (x, w) = (&out[s].combined_x, &out[s].combined_topk_weights);
            let mut g = self.base_args(s);
            g.num_tokens = t as u64;
            g.num_topk = k as u64;
            g.hidden = hidden as u64;
            g.drec = last.fmt.dispatch_record();
            g.yrec = fmt.combine_record();
            g.flags |= if a.with_weights { abi::EP_FLAG_TOPK } else { 0 }
                | if source == CombineSource::InPlace {
                    abi::EP_FLAG_IN_PLACE
                } else {
                    0
                };
            g.rank_prefix_matrix = a.handle.rank_prefix_matrix.ptr();
            g.channel_prefix_matrix = a.handle.channel_prefix_matrix.ptr();
            g.send_head = a.handle.send_head.ptr();
            g.combined_x = x.ptr();
            g.combined_weights = w.as_ref().map_or(0, DevTensor::ptr);
            g.bias0 = a.bias[0].map_or(0, DevTensor::ptr);
            g.bias1 = a.bias[1].map_or(0, DevTensor::ptr);
            self.launch(s, Kernel::Combine, 2 * c as u32, &g)?;
        }
        Ok(out)
    }

    /// The ceiling of a dispatch's data movement (BASELINES.md): on every local rank `i`,
    /// `blocks` blocks load each row of `x[i]` — and of `scales[i]` (FP8: `[T, S]` f32, the
    /// bytes DeepEP counts with the row) — once and store it to each of its final rows
    /// `dst_rows[i]` (`[T, R]` i32, `-1` = not sent) on the destinations' arenas, records of
    /// `drec` bytes, the scales where a dispatch puts them. No protocol, no signals, no meta.
    pub fn ceiling(
        &mut self,
        x: &[&DevTensor],
        scales: &[Option<&DevTensor>],
        dst_rows: &[&DevTensor],
        drec: u64,
        blocks: u32,
    ) -> Result<()> {
        self.check_ready()?;
        let r = self.num_ranks();
        check_rank_count(self.num_local_ranks(), x.len())?;
        check_rank_count(self.num_local_ranks(), scales.len())?;
        check_rank_count(self.num_local_ranks(), dst_rows.len())?;
        for s in 0..x.len() {
            let row_bytes = (x[s].cols() * x[s].dtype().size()) as u64;
            let num_scales = match scales[s] {
                Some(t) => {
                    t.expect(
                        &format!("scales of rank {}", self.who(s)),
                        DType::F32,
                        Some(x[s].rows()),
                        None,
                    )?;
                    let tail =
                        row_bytes.div_ceil(16) * 16 + (4 * t.cols() as u64).div_ceil(16) * 16;
                    if !t.is_contiguous() || tail > drec {
                        return Err(Error::Unsupported(format!(
                            "ceiling scales of rank {}: {} columns",
                            self.who(s),
                            t.cols()
                        )));
                    }
                    t.cols() as u64
                }
                None => 0,
            };
            dst_rows[s].expect(
                &format!("dst_rows of rank {}", self.who(s)),
                DType::I32,
                Some(x[s].rows()),
                Some(r),
            )?;
            if !row_bytes.is_multiple_of(16) || row_bytes > drec || !x[s].is_contiguous() {
                return Err(Error::Unsupported(format!(
                    "ceiling rows of rank {}: {row_bytes} bytes",
                    self.who(s)
                )));
            }
            let mut a = self.base_args(s);
            a.num_tokens = x[s].rows() as u64;
            a.x_bytes = row_bytes;
            a.drec = drec;
            a.x = x[s].ptr();
            a.num_scales = num_scales;
            a.x_scales = scales[s].map_or(0, DevTensor::ptr);
            a.dst_rows = dst_rows[s].ptr();
            self.launch(s, Kernel::Ceiling, blocks, &a)?;
        }
        Ok(())
    }
}

/// The typed error of a process's error record (`R` ranks, waits bounded by `timeout`).
fn decode_record(e: &ErrBlock, num_ranks: usize, timeout: Duration) -> Error {
    let kernel = match e.kernel {
        abi::EP_KERNEL_DISPATCH => "dispatch",
        abi::EP_KERNEL_COMBINE => "combine",
        abi::EP_KERNEL_LAYOUT => "layout",
        _ => "?",
    };
    match e.status {
        abi::EP_ERR_TIMEOUT => {
            let ctrl = NormalCtrl { num_ranks };
            Error::DeviceWaitTimeout {
                rank: e.rank as usize,
                kernel,
                block: e.block as usize,
                word: ctrl_word_name(ctrl, e.word_offset),
                writer: ctrl.writer(e.word_offset, e.word_rank as usize),
                expected: e.expected,
                last_seen: e.last_seen,
                timeout,
            }
        }
        abi::EP_ERR_CAPACITY => Error::DeviceCapacity {
            rank: e.word_rank as usize,
            rows: e.last_seen,
            capacity: e.expected,
        },
        abi::EP_ERR_EXPERT => Error::ExpertOutOfRange {
            rank: e.rank as usize,
            index: e.detail,
            expert: e.last_seen as i64,
        },
        abi::EP_ERR_LAYOUT => Error::DeviceLayoutMismatch {
            rank: e.rank as usize,
            dest: e.detail as usize,
            given: e.expected as i64,
            counted: e.last_seen as i64,
        },
        s => Error::Unsupported(format!("unknown device error status {s}")),
    }
}

impl NormalGroup {
    /// The ceiling of a combine's data movement: every token of local rank `i` reduces its
    /// rows of the last dispatch (BF16 x parts; `src_rows[i]` `[T, R]` i32, the token's row on
    /// each rank or -1) into `out[i]` (`[T, H]` BF16), `blocks` blocks per rank, no signals.
    pub fn ceiling_combine(
        &mut self,
        src_rows: &[&DevTensor],
        out: &[&DevTensor],
        blocks: u32,
    ) -> Result<()> {
        self.check_ready()?;
        let r = self.num_ranks();
        check_rank_count(self.num_local_ranks(), src_rows.len())?;
        check_rank_count(self.num_local_ranks(), out.len())?;
        let last = self.last.ok_or_else(|| {
            Error::Unsupported(
                "a combine ceiling reads the rows of a dispatch: dispatch first".into(),
            )
        })?;
        if last.fmt.elem_bytes != 2 {
            return Err(Error::Unsupported(
                "the combine ceiling reads BF16 dispatch rows".into(),
            ));
        }
        for s in 0..out.len() {
            out[s].expect(
                &format!("ceiling output of rank {}", self.who(s)),
                DType::Bf16,
                None,
                Some(last.fmt.hidden),
            )?;
            src_rows[s].expect(
                &format!("src_rows of rank {}", self.who(s)),
                DType::I32,
                Some(out[s].rows()),
                Some(r),
            )?;
            let mut a = self.base_args(s);
            a.num_tokens = out[s].rows() as u64;
            a.hidden = last.fmt.hidden as u64;
            a.drec = last.fmt.dispatch_record();
            a.dst_rows = src_rows[s].ptr();
            a.combined_x = out[s].ptr();
            self.launch(s, Kernel::CeilingGather, blocks, &a)?;
        }
        Ok(())
    }

    /// Opens the timing gate, if one holds the streams: any call that is about to wait on the
    /// device (its work must not stay behind the gate).
    pub(crate) fn open_gate(&self) {
        if let Some(g) = &self.gate {
            g.open();
        }
    }

    /// Host time the last [`Self::timed`] closure took: enqueueing every local rank's work (and,
    /// for a dispatch, the host's wait for num_recv), while the ranks' streams stood behind the
    /// gate.
    pub fn last_enqueue(&self) -> Duration {
        self.last_enqueue
    }

    /// Runs `f`, which enqueues work on every local rank's stream, with every local rank
    /// released at the same moment (their streams wait behind a spin on a gate stream until the
    /// host has enqueued), and returns each rank's device time from that release to the end of its work,
    /// in seconds (CUDA events).
    pub fn timed<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<(T, Vec<f64>)> {
        self.not_capturing("timed")?;
        if self.gate.is_none() {
            self.gate = Some(Gate::new(&self.dev)?);
        }
        let starts = match &mut self.gate {
            Some(g) => g.hold(&self.dev, self.ranks.iter().map(|r| &r.stream))?,
            None => Vec::new(),
        };
        let t0 = Instant::now();
        let out = f(self);
        self.last_enqueue = t0.elapsed();
        let ends = close(self.gate.as_ref(), self.ranks.iter().map(|r| &r.stream));
        let (out, ends) = (out?, ends?);
        self.sync()?;
        Ok((out, elapsed(&starts, &ends)?))
    }
}

fn check_rank_count(expected: usize, found: usize) -> Result<()> {
    if expected != found {
        return Err(Error::RankCountMismatch { expected, found });
    }
    Ok(())
}

fn check_device(t: &DevTensor, dev: &Device, rank: usize) -> Result<()> {
    if t.device() != dev.ordinal() {
        return Err(Error::WrongDevice {
            rank,
            expected: dev.ordinal(),
            found: t.device(),
        });
    }
    Ok(())
}

/// A 2-D copy of `src` into `dst` (same shape and dtype, any row strides) on `stream`.
pub(crate) fn copy_2d(stream: &CudaStream, src: &DevTensor, dst: &DevTensor) -> Result<()> {
    if src.shape() != dst.shape() || src.dtype() != dst.dtype() {
        return Err(Error::TensorMismatch {
            what: "2-D copy".into(),
            expected: format!("{:?} {:?}", dst.dtype(), dst.shape()),
            found: format!("{:?} {:?}", src.dtype(), src.shape()),
        });
    }
    if src.rows() == 0 {
        return Ok(());
    }
    use cudarc::driver::sys;
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src.ptr(),
        srcArray: std::ptr::null_mut(),
        srcPitch: src.row_stride() as usize,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst.ptr(),
        dstArray: std::ptr::null_mut(),
        dstPitch: dst.row_stride() as usize,
        WidthInBytes: src.cols() * src.dtype().size(),
        Height: src.rows(),
    };
    // SAFETY: both views were bounds-checked against their buffers when made, and the shapes
    // are equal, so the copy stays inside both; the buffers outlive the enqueued copy (callers
    // hold the tensors until the stream is synchronised or passed).
    unsafe { sys::cuMemcpy2DAsync_v2(&p, stream.cu_stream()) }
        .result()
        .map_err(Error::cuda("cuMemcpy2DAsync"))
}

/// `notify[p][s]`, `head[p][s][e]`, `done[s][c]`, ... for a control-word offset.
fn ctrl_word_name(ctrl: NormalCtrl, off: u64) -> String {
    let r = ctrl.num_ranks;
    for s in 0..r {
        for p in 0..2 {
            if ctrl.notify(p, s) == off {
                return format!("notify[{p}][{s}]");
            }
            for e in 0..r {
                if ctrl.head(p, s, e) == off {
                    return format!("head[{p}][{s}][{e}]");
                }
            }
        }
        if ctrl.ready(s) == off {
            return format!("ready[{s}]");
        }
        if ctrl.y_ready(s) == off {
            return format!("y_ready[{s}]");
        }
        for c in 0..ep_core::protocol::layout::MAX_CHANNELS {
            for h in 0..2 {
                if ctrl.done(s, c, h) == off {
                    return format!("done[{s}][{c}][{h}]");
                }
            }
            if ctrl.pulled(s, c) == off {
                return format!("pulled[{s}][{c}]");
            }
        }
    }
    for p in 0..2 {
        if ctrl.table_ready(p) == off {
            return format!("table_ready[{p}]");
        }
    }
    format!("control word at offset {off}")
}

/// What a dispatch's block 1 published for call `call` (docs/protocol.md §2.7): num_recv and the
/// first `l` expert counts, once every one of those words carries the call in its high half
/// (the device orders them with no fence); `None` while any is from an earlier call.
fn published(mb: &Mailbox, call: u64, l: usize) -> Option<(usize, Vec<i32>)> {
    let of_call = |w: u64| w >> 32 == call;
    let experts = mb.expert_counts.get(..l)?;
    if !of_call(mb.num_recv) || !experts.iter().all(|&w| of_call(w)) {
        return None;
    }
    let low = |w: u64| (w & 0xffff_ffff) as u32;
    Some((
        low(mb.num_recv) as usize,
        experts.iter().map(|&w| low(w) as i32).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_control_word_is_named_by_its_offset() {
        for r in [1, 2, 8] {
            let ctrl = NormalCtrl { num_ranks: r };
            for s in 0..r {
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.notify(1, s)),
                    format!("notify[1][{s}]")
                );
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.head(0, s, r - 1)),
                    format!("head[0][{s}][{}]", r - 1)
                );
                assert_eq!(ctrl_word_name(ctrl, ctrl.ready(s)), format!("ready[{s}]"));
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.y_ready(s)),
                    format!("y_ready[{s}]")
                );
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.done(s, 5, 1)),
                    format!("done[{s}][5][1]")
                );
                assert_eq!(
                    ctrl_word_name(ctrl, ctrl.pulled(s, 63)),
                    format!("pulled[{s}][63]")
                );
            }
            assert_eq!(ctrl_word_name(ctrl, ctrl.table_ready(0)), "table_ready[0]");
            assert!(ctrl_word_name(ctrl, ctrl.bytes() + 16).starts_with("control word at"));
        }
    }

    /// The notify block's record of a layout that disagrees with its membership (EP_ERR_LAYOUT)
    /// is a typed error naming both ranks and both counts.
    #[test]
    fn a_layout_record_is_a_typed_error() {
        let e = ErrBlock {
            status: abi::EP_ERR_LAYOUT,
            rank: 1,
            kernel: abi::EP_KERNEL_DISPATCH,
            word_rank: 3,
            expected: 17,
            last_seen: 19,
            detail: 3,
            ..ErrBlock::default()
        };
        let err = decode_record(&e, 4, Duration::from_secs(1));
        assert!(
            matches!(
                err,
                Error::DeviceLayoutMismatch {
                    rank: 1,
                    dest: 3,
                    given: 17,
                    counted: 19
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("poisoned until reset"), "{err}");
    }

    /// The host takes a dispatch's num_recv and expert list only when every word it reads
    /// carries the call (block 1 stores them with no fence between): a stale word from the
    /// previous call, in num_recv or in any one expert, keeps it waiting.
    #[test]
    fn the_mailbox_is_taken_only_when_every_word_carries_the_call() {
        let call = 7u64;
        let mut mb = Mailbox::default();
        let counts = [5u64, 0, 128, 3];
        for (w, c) in mb.expert_counts.iter_mut().zip(counts) {
            *w = (call << 32) | c;
        }
        mb.num_recv = ((call - 1) << 32) | 99;
        assert_eq!(
            published(&mb, call, 4),
            None,
            "num_recv of the previous call"
        );
        mb.num_recv = (call << 32) | 136;
        assert_eq!(published(&mb, call, 4), Some((136, vec![5, 0, 128, 3])));
        mb.expert_counts[2] = ((call - 1) << 32) | 128;
        assert_eq!(
            published(&mb, call, 4),
            None,
            "one expert of the previous call"
        );
        // Words past the rank's local experts are not looked at.
        assert_eq!(published(&mb, call, 2), Some((136, vec![5, 0])));
        assert_eq!(
            published(&mb, call, 2000),
            None,
            "more experts than the mailbox holds"
        );
    }

    /// A dispatch CTA that timed out on a `head` word names the word and its writer, the rank
    /// whose counts it waited for.
    #[test]
    fn a_head_word_timeout_names_the_word_and_its_writer() {
        let ctrl = NormalCtrl { num_ranks: 4 };
        let e = ErrBlock {
            status: abi::EP_ERR_TIMEOUT,
            rank: 2,
            kernel: abi::EP_KERNEL_DISPATCH,
            block: 4,
            word_rank: 3,
            word_offset: ctrl.head(1, 3, 0),
            expected: 9 << 32,
            last_seen: 7 << 32,
            ..ErrBlock::default()
        };
        let err = decode_record(&e, 4, Duration::from_secs(1));
        match &err {
            Error::DeviceWaitTimeout {
                rank: 2,
                block: 4,
                word,
                writer: Some(3),
                ..
            } => assert_eq!(word, "head[1][3][0]", "{err}"),
            other => panic!("not the head word's timeout: {other}"),
        }
    }
}
