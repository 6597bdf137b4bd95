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
//!
//! This file holds the group's state and life cycle (creation, peers, sync, reset); each call
//! has its own file: `dispatch` (layout, dispatch, cached dispatch), `combine`, `ceiling` (the
//! copy kernels of the same bytes), `timing` (the gate and the phase stamps), `launch` (how a
//! kernel is launched), `errors` (the device's error record as a typed error), `types` (what
//! the calls take and give).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaStream;
use ep_core::protocol::layout::{NormalCtrl, NormalData, REGION_ALIGN, RowFormat, align128};

use super::abi::{self, ErrBlock, Mailbox, NormalArgs};
use super::device::Device;
use super::gate::Gate;
use super::mem::{DevBuf, HostMapped};
use super::peers::{self, Peer, Shape};
use super::tensor::{DType, DevTensor};
use crate::error::{Error, Result};
use crate::exchange::Exchange;

mod ceiling;
mod combine;
mod dispatch;
mod errors;
mod graph;
mod launch;
mod timing;
mod trace;
mod types;
pub use graph::{CallStreams, NormalGraph};
pub use types::{
    CombineSource, GpuCombineArgs, GpuCombined, GpuDispatch, GpuDispatchArgs, GpuHandle, GpuLayout,
    GpuRankInputs,
};

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
