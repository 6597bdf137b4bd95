//! [`Gpu`]: the GPU executor of ep-core's [`Buffer`](ep_core::Buffer) (docs/buffer-api.md,
//! step 3). `Buffer<Gpu>` runs the host logic every backend shares (shape-level checks, sizing,
//! call numbers, poisoning and reset) and hands each phase to this executor, which runs the
//! protocol's kernels for it over device tensors ([`DevTensors`]) — the same `Buffer` that
//! drives the simulator, with the same outputs.
//!
//! Normal mode (docs/protocol.md §2) runs here; the kernels and their launches are
//! [`NormalGroup`]'s, created when the `Buffer` allocates its arena. Low-latency mode
//! (docs/protocol.md §3) is [`LlGroup`]'s kernels under the `Buffer`'s
//! operations (`low_latency`): variant (a) for co-resident ranks, or over an NVSHMEM session
//! ([`Gpu::with_nvshmem`]: variant (b), or one rank per process).
//!
//! Errors: the shape-level ones are ep-core's; the GPU's own keep their type inside
//! [`ep_core::Error::Backend`] (a failed phase: the `Buffer` is poisoned until `reset`) or
//! [`ep_core::Error::InputRefused`] (an input refused before any launch, or by the device in an
//! earlier call: the `Buffer` stays usable); [`ep_core::Error::backend`] gives them back.

use std::sync::Arc;
use std::time::Duration;

use ep_core::Executor;
use ep_core::buffer::check::HandleShapes;
use ep_core::error::BackendError;
use ep_core::executor::{
    CachedDispatchJob, CombineShapes, ExpertJob, LlAttempt, LlCleanJob, LlCombineCheck,
    LlCombineRecvJob, LlCombineSendJob, LlDispatchRecvJob, LlDispatchSendJob, LlExpertOutputJob,
    NormalCombineCheck, NormalCombineJob, NormalDispatchCheck, NormalDispatchJob, ResetJob,
    Tensors,
};
use ep_core::plan::low_latency::LlParams;
use ep_core::protocol::{LlArena, NormalArena};
use ep_core::routing::InputShapes;
use ep_core::transport::{
    AllocRequest, FabricParams, Init, Phase, PhaseReport, Region, SymAddr, SymAlloc, Team,
    Transport,
};

mod low_latency;

pub use low_latency::GpuExpertOut;
use low_latency::{LlExec, LlPeers};

use super::device::Device;
use super::low_latency::{LlGpuDispatch, LlGpuHandle, LlGroup, LlVariant};
use super::normal::{
    CombineSource, GpuCombineArgs, GpuCombined, GpuDispatch, GpuDispatchArgs, GpuHandle, GpuLayout,
    GpuRankInputs, NormalGroup,
};
use super::tensor::{DType, DevTensor, copy_2d};
use crate::error::Error;
use crate::exchange::Exchange;
use crate::nvshmem::NvshmemSession;

/// One rank's dispatch inputs on the device (owned views: cloning a [`DevTensor`] shares its
/// memory).
#[derive(Clone, Debug)]
pub struct GpuInputs {
    /// `[T, H]` BF16, or e4m3 with `x_scales`.
    pub x: DevTensor,
    /// `[T, ceil(H / 128)]` f32 for FP8 rows.
    pub x_scales: Option<DevTensor>,
    /// `[T, K]` i64 expert ids (`-1` masked); needed when top-k is dispatched.
    pub topk_idx: Option<DevTensor>,
    /// `[T, K]` f32.
    pub topk_weights: Option<DevTensor>,
}

impl GpuInputs {
    fn view(&self, with_topk: bool) -> GpuRankInputs<'_> {
        GpuRankInputs {
            x: &self.x,
            x_scales: self.x_scales.as_ref(),
            topk_idx: self.topk_idx.as_ref().filter(|_| with_topk),
            topk_weights: self.topk_weights.as_ref().filter(|_| with_topk),
        }
    }
}

/// Rows of a cached dispatch on the device, in (the caller's) and out (views into the arena,
/// valid until the next call).
#[derive(Clone, Debug)]
pub struct GpuRows {
    /// `[rows, H]` BF16 or e4m3.
    pub x: DevTensor,
    /// `[rows, ceil(H / 128)]` f32 for FP8 rows.
    pub x_scales: Option<DevTensor>,
}

/// One rank's combine inputs on the device.
///
/// `x` is read in place (no copy) when it is the rank's `recv_x` of the last dispatch (BF16
/// rows the expert overwrote) and `topk_weights` is absent or that dispatch's
/// `recv_topk_weights`; otherwise `x` and the weights are copied into the arena's combine
/// rows first (one device copy, as DeepEP does).
#[derive(Clone, Copy, Debug)]
pub struct GpuCombineIn<'a> {
    /// `[num_recv, H]` BF16, row `j` aligned with row `j` of the dispatch's `recv_x`.
    pub x: &'a DevTensor,
    /// `[num_recv, K]` f32, aligned like `x`; combined (plain sum) when given.
    pub topk_weights: Option<&'a DevTensor>,
    /// 0–2 BF16 `[T, H]` biases over the rank's own tokens.
    pub bias: &'a [DevTensor],
}

/// Device tensors: the [`Tensors`] family of `Buffer<Gpu>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevTensors;

fn shape(t: &DevTensor) -> (usize, usize) {
    (t.rows(), t.cols())
}

/// A GPU error of a check (before any launch) as ep-core's: shape rules as they are, the
/// rest refused inputs.
fn refused(e: Error) -> ep_core::Error {
    match e {
        Error::Shape(e) => e,
        e => ep_core::Error::InputRefused {
            source: BackendError::new(e),
        },
    }
}

/// A GPU error of a phase as ep-core's (docs/buffer-api.md, "Errors"): inputs refused before
/// a launch, or by the device in an earlier call, leave the `Buffer` usable; the rest
/// (CUDA calls, device and host wait timeouts, a poisoned group) are failed phases.
pub(crate) fn core(e: Error) -> ep_core::Error {
    match e {
        Error::Shape(e) => e,
        e @ (Error::TensorMismatch { .. }
        | Error::WrongDevice { .. }
        | Error::RankCountMismatch { .. }
        | Error::DeviceCapacity { .. }
        | Error::ExpertOutOfRange { .. }
        | Error::NotCapturable { .. }
        | Error::OutOfBounds { .. }
        | Error::Unsupported(_)) => ep_core::Error::InputRefused {
            source: BackendError::new(e),
        },
        e => ep_core::Error::Backend {
            source: BackendError::new(e),
        },
    }
}

impl Tensors for DevTensors {
    type Idx = DevTensor;
    type Layout = GpuLayout;
    type Inputs = GpuInputs;
    type Dispatched = GpuDispatch;
    type Dispatch = GpuDispatch;
    type Handle = GpuHandle;
    type Rows = GpuRows;
    type CombineIn<'a> = GpuCombineIn<'a>;
    type Combined = GpuCombined;
    type LlKeep = ();
    type LlRecv = LlGpuDispatch;
    type LlSpare = ();
    type LlDispatched = Vec<Option<LlGpuDispatch>>;
    type LlHandle = LlGpuHandle;
    type LlExpertOut = GpuExpertOut;
    type LlCombined = DevTensor;

    fn idx_shape(idx: &DevTensor, rank: usize) -> ep_core::Result<(usize, usize)> {
        idx.expect(&format!("topk_idx of rank {rank}"), DType::I64, None, None)
            .map_err(refused)?;
        Ok(shape(idx))
    }

    fn input_shapes(x: &GpuInputs, rank: usize, with_topk: bool) -> ep_core::Result<InputShapes> {
        let fp8 = match x.x.dtype() {
            DType::Bf16 => false,
            DType::F8E4M3 => true,
            d => {
                return Err(refused(Error::TensorMismatch {
                    what: format!("x of rank {rank}"),
                    expected: "Bf16 or F8E4M3".into(),
                    found: format!("{d:?}"),
                }));
            }
        };
        let typed = |t: Option<&DevTensor>, name: &str, dtype: DType| {
            t.map(|t| {
                t.expect(&format!("{name} of rank {rank}"), dtype, None, None)
                    .map(|()| shape(t))
            })
            .transpose()
            .map_err(refused)
        };
        Ok(InputShapes {
            x: shape(&x.x),
            fp8,
            x_scales: if fp8 {
                typed(x.x_scales.as_ref(), "x_scales", DType::F32)?
            } else {
                x.x_scales.as_ref().map(shape)
            },
            topk_idx: if with_topk {
                typed(x.topk_idx.as_ref(), "topk_idx", DType::I64)?
            } else {
                None
            },
            topk_weights: if with_topk {
                typed(x.topk_weights.as_ref(), "topk_weights", DType::F32)?
            } else {
                None
            },
        })
    }

    fn rows_shapes(x: &GpuRows, rank: usize) -> ep_core::Result<InputShapes> {
        let inputs = GpuInputs {
            x: x.x.clone(),
            x_scales: x.x_scales.clone(),
            topk_idx: None,
            topk_weights: None,
        };
        Self::input_shapes(&inputs, rank, false)
    }

    fn handle_shapes(h: &GpuHandle, rank: usize) -> ep_core::Result<HandleShapes> {
        h.check_dtypes(rank).map_err(refused)?;
        Ok(h.shapes())
    }

    fn combine_shapes(a: &GpuCombineIn<'_>, rank: usize) -> ep_core::Result<CombineShapes> {
        a.x.expect(
            &format!("combine x of rank {rank}"),
            DType::Bf16,
            None,
            None,
        )
        .map_err(refused)?;
        if let Some(w) = a.topk_weights {
            w.expect(
                &format!("combine topk_weights of rank {rank}"),
                DType::F32,
                None,
                None,
            )
            .map_err(refused)?;
        }
        for (i, b) in a.bias.iter().enumerate() {
            b.expect(&format!("bias {i} of rank {rank}"), DType::Bf16, None, None)
                .map_err(refused)?;
        }
        Ok(CombineShapes {
            x: shape(a.x),
            topk_weights: a.topk_weights.map(shape),
            bias: a.bias.iter().map(shape).collect(),
        })
    }

    fn finish_dispatch(d: GpuDispatch, _rank: usize) -> ep_core::Result<GpuDispatch> {
        Ok(d)
    }

    fn ll_keep(_x: &GpuInputs) {}

    fn ll_collect(out: Vec<Option<LlGpuDispatch>>) -> Vec<Option<LlGpuDispatch>> {
        out
    }

    fn ll_spares(d: Vec<Option<LlGpuDispatch>>) -> Vec<Option<()>> {
        // The outputs are views of the group's buffers: nothing to reuse.
        d.iter().map(|_| None).collect()
    }

    fn ll_expert_shape(y: &GpuExpertOut, rank: usize) -> ep_core::Result<(usize, usize, usize)> {
        y.shape(rank).map_err(refused)
    }
}

/// Where the ranks of a [`Gpu`] live.
enum Placement {
    /// Every rank of the world, co-resident on the device.
    CoResident,
    /// This process's ranks, the others in other processes of the exchange (taken when the
    /// arena is made).
    Process {
        local: Vec<usize>,
        exchange: Option<Box<dyn Exchange>>,
    },
}

/// The GPU executor of a `Buffer` (module docs): one device, its local ranks, their arenas,
/// streams and kernels.
pub struct Gpu {
    dev: Arc<Device>,
    fabric: FabricParams,
    num_sms: usize,
    timeout: Option<Duration>,
    placement: Placement,
    normal: Option<NormalGroup>,
    /// How a low-latency group reaches its peers.
    ll_peers: LlPeers,
    ll: Option<LlExec>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("device", &self.dev.ordinal())
            .field("num_ranks", &self.fabric.num_ranks)
            .field("num_sms", &self.num_sms)
            .field("local_ranks", &self.local_ranks())
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// `num_ranks` co-resident ranks on `dev`, each running its kernels on `num_sms` SMs (the
    /// `Config::num_sms` of every dispatch). The `Buffer` made over it checks that every rank's
    /// kernels can be resident at once (`num_ranks × num_sms ≤` the device's SMs).
    #[must_use]
    pub fn co_resident(dev: Arc<Device>, num_ranks: usize, num_sms: usize) -> Self {
        Self::with_placement(
            dev,
            num_ranks,
            num_sms,
            Placement::CoResident,
            LlPeers::Pointers,
        )
    }

    /// One rank per process, the deployment shape: this process is rank `exchange.rank()` of
    /// `exchange.world()`; the peers' arenas are mapped with CUDA IPC when the `Buffer` is made
    /// (collective: every process makes its `Buffer` with the same configuration).
    #[must_use]
    pub fn process(dev: Arc<Device>, num_sms: usize, exchange: Box<dyn Exchange>) -> Self {
        let (rank, world) = (exchange.rank() as usize, exchange.world() as usize);
        let placement = Placement::Process {
            local: vec![rank],
            exchange: Some(exchange),
        };
        Self::with_placement(dev, world, num_sms, placement, LlPeers::Pointers)
    }

    /// One rank per process for low-latency mode only: this process is PE `session.my_pe()`
    /// of the session's `n_pes` ranks, reached through NVSHMEM (`variant` as in
    /// [`Gpu::with_nvshmem`]). Normal mode needs [`Gpu::process`] (its peers are mapped over an
    /// exchange).
    #[must_use]
    pub fn process_over_nvshmem(
        dev: Arc<Device>,
        num_sms: usize,
        session: Arc<NvshmemSession>,
        variant: LlVariant,
    ) -> Self {
        let (rank, world) = (session.my_pe() as usize, session.n_pes() as usize);
        let placement = Placement::Process {
            local: vec![rank],
            exchange: None,
        };
        Self::with_placement(
            dev,
            world,
            num_sms,
            placement,
            LlPeers::Nvshmem(session, variant),
        )
    }

    fn with_placement(
        dev: Arc<Device>,
        world: usize,
        num_sms: usize,
        placement: Placement,
        ll_peers: LlPeers,
    ) -> Self {
        Self {
            dev,
            fabric: FabricParams::single_node(world),
            num_sms,
            timeout: None,
            placement,
            normal: None,
            ll_peers,
            ll: None,
        }
    }

    /// Low-latency mode over `session` (docs/protocol.md §3.11): with
    /// [`LlVariant::Nvshmem`] every put, signal, fence and quiet goes through NVSHMEM's device
    /// API (variant (b); co-resident ranks are regions of the one PE's heap, or one PE per
    /// process); with [`LlVariant::Pointers`] and one rank per process, variant (a) over the
    /// session's symmetric heap (peers by `nvshmem_ptr`). Without it, co-resident ranks run
    /// variant (a) over plain device memory. Set before the `Buffer` is made.
    #[must_use]
    pub fn with_nvshmem(mut self, session: Arc<NvshmemSession>, variant: LlVariant) -> Self {
        self.ll_peers = LlPeers::Nvshmem(session, variant);
        self
    }

    /// The low-latency kernels' group, once the first low-latency dispatch made it (its
    /// statistics, phase times, traces, CUDA-graph capture). Calls made on it directly are
    /// not the `Buffer`'s.
    pub fn low_latency(&self) -> Option<&LlGroup> {
        self.ll.as_ref().and_then(LlExec::group)
    }

    /// The group, mutably.
    pub fn low_latency_mut(&mut self) -> Option<&mut LlGroup> {
        self.ll.as_mut().and_then(LlExec::group_mut)
    }

    /// `get_next_low_latency_combine_buffer` of local rank `i`: the zero-copy region of the
    /// next low-latency operation, `[L·R·N, H]` BF16. Write the expert outputs there and pass
    /// it to `Buffer::low_latency_combine` with `LlCombineOptions::zero_copy` (it is then not
    /// copied).
    pub fn next_combine_buffer(&self, i: usize) -> ep_core::Result<GpuExpertOut> {
        let g = self.low_latency().ok_or_else(|| {
            ep_core::Error::Unsupported(
                "no low-latency dispatch yet: the zero-copy region exists after the first".into(),
            )
        })?;
        Ok(GpuExpertOut {
            y: g.next_combine_buffer(i).map_err(core)?,
            num_local_experts: g.config().num_local_experts(),
        })
    }

    /// Bound of every device wait (and of the host's wait for `num_recv`); the group's default
    /// until set.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = Some(timeout);
        if let Some(g) = &mut self.normal {
            g.set_timeout(timeout);
        }
        if let Some(l) = &mut self.ll {
            l.set_timeout(timeout);
        }
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// SMs per rank.
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }

    /// The normal-mode kernels' group (after the `Buffer` allocated its arena): streams,
    /// measurement, the copy ceiling.
    pub fn normal(&self) -> Option<&NormalGroup> {
        self.normal.as_ref()
    }

    /// The group, mutably. Calls made on it directly are not the `Buffer`'s (its call numbers
    /// stay ahead of them).
    pub fn normal_mut(&mut self) -> Option<&mut NormalGroup> {
        self.normal.as_mut()
    }

    fn ll(&self) -> ep_core::Result<&LlExec> {
        self.ll.as_ref().ok_or(ep_core::Error::ArenaMissing {
            what: "low-latency buffer",
            fix: "set low_latency_mode and num_rdma_bytes (Buffer::low_latency_size_hint)",
        })
    }

    /// `f` on the low-latency state, or an attempt that failed before any launch.
    fn with_ll<X>(&mut self, f: impl FnOnce(&mut LlExec) -> LlAttempt<X>) -> LlAttempt<X> {
        match self.ll_mut() {
            Ok(l) => f(l),
            Err(e) => LlAttempt {
                result: Err(e),
                gave_up: Vec::new(),
                out: Vec::new(),
            },
        }
    }

    fn ll_mut(&mut self) -> ep_core::Result<&mut LlExec> {
        self.ll.as_mut().ok_or(ep_core::Error::ArenaMissing {
            what: "low-latency buffer",
            fix: "set low_latency_mode and num_rdma_bytes (Buffer::low_latency_size_hint)",
        })
    }

    fn group(&self) -> ep_core::Result<&NormalGroup> {
        self.normal.as_ref().ok_or(ep_core::Error::ArenaMissing {
            what: "normal-mode arena",
            fix: "set num_nvl_bytes (Buffer::normal_size_hint)",
        })
    }

    fn group_mut(&mut self) -> ep_core::Result<&mut NormalGroup> {
        self.normal.as_mut().ok_or(ep_core::Error::ArenaMissing {
            what: "normal-mode arena",
            fix: "set num_nvl_bytes (Buffer::normal_size_hint)",
        })
    }

    /// Local index of world rank `rank`.
    fn local_index(&self, rank: usize) -> ep_core::Result<usize> {
        self.local_ranks()
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| {
                ep_core::Error::Unsupported(format!(
                    "rank {rank} is not one of this process's ranks {:?}",
                    self.local_ranks()
                ))
            })
    }

    /// The device buffer and offset of `[addr, addr + len)` of local rank `local`'s arena.
    fn locate(
        &self,
        rank: usize,
        addr: SymAddr,
        len: u64,
    ) -> ep_core::Result<(&Arc<super::mem::DevBuf>, usize)> {
        let g = self.group()?;
        let (ctrl, data) = g.arena(self.local_index(rank)?);
        let ctrl_len = ctrl.len() as u64;
        let (buf, off) = if addr.0 + len <= ctrl_len {
            (ctrl, addr.0)
        } else if addr.0 >= ctrl_len && addr.0 - ctrl_len + len <= data.len() as u64 {
            (data, addr.0 - ctrl_len)
        } else {
            return Err(ep_core::Error::BadAccess {
                rank,
                what: "host access outside the normal-mode arena",
                addr: addr.0,
                len,
            });
        };
        Ok((buf, off as usize))
    }

    /// The combine's source and its per-rank group arguments; copies `x` (and the weights)
    /// into the combine rows unless every rank's `x` is its dispatch rows.
    fn combine_inputs<'a>(
        &mut self,
        job: &'a NormalCombineJob<'_, DevTensors>,
    ) -> ep_core::Result<(CombineSource, Vec<GpuCombineArgs<'a>>)> {
        let args = job.args().ok_or_else(|| {
            ep_core::Error::Unsupported(
                "combine from rows the host left in the arena: a simulator call".into(),
            )
        })?;
        // Every input on this executor's GPU, before any copy (a peer GPU's memory would be
        // copied silently).
        let ordinal = self.dev.ordinal();
        for (a, s) in args.iter().zip(self.local_ranks()) {
            for t in std::iter::once(a.x).chain(a.topk_weights).chain(a.bias) {
                if t.device() != ordinal {
                    return Err(refused(Error::WrongDevice {
                        rank: s,
                        expected: ordinal,
                        found: t.device(),
                    }));
                }
            }
        }
        let g = self.group_mut()?;
        let (fmt, k) = g.last_dispatch().ok_or_else(|| {
            core(Error::Unsupported(
                "combine before any dispatch on this Buffer".into(),
            ))
        })?;
        // The kernels combine rows of the dispatch's hidden size.
        if let Some(a) = args.iter().find(|a| a.x.cols() != fmt.hidden) {
            return Err(refused(Error::Unsupported(format!(
                "combine x of hidden {} after a dispatch of hidden {}: on the GPU the expert \
                 outputs have the dispatched rows' hidden size",
                a.x.cols(),
                fmt.hidden
            ))));
        }
        let in_place = args.iter().enumerate().all(|(i, a)| {
            g.is_dispatch_rows(i, a.x)
                && a.topk_weights.is_none_or(|w| {
                    g.topk_views(i, fmt, a.x.rows()).is_ok_and(|(_, dw)| {
                        dw.ptr() == w.ptr() && dw.row_stride() == w.row_stride()
                    })
                })
        });
        if !in_place {
            for (i, a) in args.iter().enumerate() {
                let (y, w) = g.combine_rows(i, a.x.rows(), a.x.cols(), k).map_err(core)?;
                copy_2d(g.stream(i), a.x, &y).map_err(core)?;
                if let (Some(src), Some(w)) = (a.topk_weights, w) {
                    copy_2d(g.stream(i), src, &w).map_err(core)?;
                }
            }
        }
        let source = if in_place {
            CombineSource::InPlace
        } else {
            CombineSource::Rows
        };
        let handles = job.handles();
        let gargs = args
            .iter()
            .zip(handles)
            .map(|(a, h)| GpuCombineArgs {
                handle: h,
                with_weights: job.with_weights(),
                bias: [a.bias.first(), a.bias.get(1)],
            })
            .collect();
        Ok((source, gargs))
    }
}

/// The `Buffer`'s view of an arena the executor allocated: `first` bytes of zeroed words at 0,
/// then `second` bytes of poisoned data.
fn regions(first_name: &str, first: u64, second_name: &str, second: u64) -> (SymAlloc, SymAlloc) {
    let alloc = |name: &str, addr: u64, len: u64, init| SymAlloc {
        name: name.into(),
        region: Region::new(SymAddr(addr), len),
        init,
    };
    (
        alloc(first_name, 0, first, Init::Zero),
        alloc(second_name, first, second, Init::Poison),
    )
}

impl Transport for Gpu {
    fn fabric(&self) -> &FabricParams {
        &self.fabric
    }

    fn alloc(&mut self, req: AllocRequest) -> ep_core::Result<SymAlloc> {
        Err(ep_core::Error::Unsupported(format!(
            "symmetric allocation {:?} on the GPU executor: its arenas are made by \
             Executor::alloc_normal",
            req.name
        )))
    }

    fn barrier(&mut self, _team: &Team) -> ep_core::Result<()> {
        match (&mut self.normal, &mut self.placement) {
            (Some(g), _) => g.barrier().map_err(core),
            (
                None,
                Placement::Process {
                    exchange: Some(ex), ..
                },
            ) => ex.barrier().map_err(core),
            _ => Ok(()),
        }
    }

    fn read_local(&self, rank: usize, addr: SymAddr, out: &mut [u8]) -> ep_core::Result<()> {
        self.group()?.sync_streams().map_err(core)?;
        let (buf, off) = self.locate(rank, addr, out.len() as u64)?;
        buf.read(off, out).map_err(core)
    }

    fn write_local(&mut self, rank: usize, addr: SymAddr, bytes: &[u8]) -> ep_core::Result<()> {
        self.group()?.sync_streams().map_err(core)?;
        let (buf, off) = self.locate(rank, addr, bytes.len() as u64)?;
        buf.write(off, bytes).map_err(core)
    }

    fn run_phase(&mut self, phase: Phase<'_>) -> ep_core::Result<PhaseReport> {
        Err(ep_core::Error::Unsupported(format!(
            "a {:?} phase of agent closures (call {}): the GPU executor runs kernels",
            phase.kind, phase.call
        )))
    }
}

impl Executor for Gpu {
    type T = DevTensors;

    fn local_ranks(&self) -> Vec<usize> {
        match (&self.normal, &self.placement) {
            (Some(g), _) => g.local_ranks(),
            (None, Placement::CoResident) => (0..self.fabric.num_ranks).collect(),
            (None, Placement::Process { local, .. }) => local.clone(),
        }
    }

    fn alloc_normal(&mut self, ctrl: u64, data: u64) -> ep_core::Result<NormalArena> {
        if self.normal.is_some() {
            return Err(ep_core::Error::Unsupported(
                "a second normal-mode arena on one Gpu executor: make one Buffer per Gpu".into(),
            ));
        }
        let r = self.fabric.num_ranks;
        let bytes = ctrl + data;
        let mut g = match &mut self.placement {
            Placement::CoResident => NormalGroup::new(self.dev.clone(), r, self.num_sms, bytes),
            Placement::Process { local, exchange } => {
                let ex = exchange.take().ok_or_else(|| {
                    ep_core::Error::Unsupported(
                        "normal mode with one rank per process maps its peers over an exchange: \
                         make the executor with Gpu::process (Gpu::process_over_nvshmem has none)"
                            .into(),
                    )
                })?;
                NormalGroup::with_peers(self.dev.clone(), r, local, self.num_sms, bytes, ex)
            }
        }
        .map_err(refused)?;
        if g.arena(0).0.len() as u64 != ctrl {
            return Err(ep_core::Error::Unsupported(format!(
                "the kernels' control words take {} bytes, the Buffer's layout {ctrl}",
                g.arena(0).0.len()
            )));
        }
        if let Some(t) = self.timeout {
            g.set_timeout(t);
        }
        self.normal = Some(g);
        let (ctrl, data) = regions("normal.ctrl", ctrl, "normal.data", data);
        Ok(NormalArena::new(r, ctrl, data))
    }

    fn alloc_low_latency(&mut self, signals: u64, data: u64) -> ep_core::Result<LlArena> {
        if self.ll.is_some() {
            return Err(ep_core::Error::Unsupported(
                "a second low-latency buffer on one Gpu executor: make one Buffer per Gpu".into(),
            ));
        }
        if matches!(self.placement, Placement::Process { .. })
            && matches!(self.ll_peers, LlPeers::Pointers)
        {
            return Err(refused(Error::Unsupported(
                "low-latency mode with one rank per process runs over NVSHMEM: make the \
                 executor with Gpu::process(..).with_nvshmem(session, variant)"
                    .into(),
            )));
        }
        let r = self.fabric.num_ranks;
        // The group's memory is allocated at the first dispatch, for its shape (the Buffer
        // checked it fits num_rdma_bytes); the regions here are the Buffer's view of it.
        self.ll = Some(LlExec::new(
            self.dev.clone(),
            r,
            self.num_sms,
            self.local_ranks(),
            self.ll_peers.clone(),
            self.timeout,
        ));
        let (signals, data) = regions("ll.signals", signals, "ll.data", data);
        Ok(LlArena::new(r, signals, data))
    }

    fn poll(&mut self) -> ep_core::Result<()> {
        if let Some(g) = &mut self.normal {
            g.check_ready().map_err(core)?;
        }
        match &mut self.ll {
            Some(l) => l.poll(),
            None => Ok(()),
        }
    }

    fn sync(&mut self) -> ep_core::Result<()> {
        if let Some(g) = &mut self.normal {
            g.sync().map_err(core)?;
        }
        match &mut self.ll {
            Some(l) => l.sync(),
            None => Ok(()),
        }
    }

    fn run_layout(
        &mut self,
        topk_idx: &[DevTensor],
        num_experts: usize,
    ) -> ep_core::Result<Vec<GpuLayout>> {
        let refs: Vec<&DevTensor> = topk_idx.iter().collect();
        self.group_mut()?.layout(&refs, num_experts).map_err(core)
    }

    fn check_normal_dispatch(
        &self,
        job: &NormalDispatchCheck<'_, DevTensors>,
    ) -> ep_core::Result<Option<usize>> {
        let g = self.group()?;
        let with_topk = job.inputs().first().is_some_and(|i| i.topk_idx.is_some());
        let inputs: Vec<_> = job.inputs().iter().map(|i| i.view(with_topk)).collect();
        let args = GpuDispatchArgs {
            expert_alignment: 1,
            num_worst_tokens: job.num_worst_tokens(),
        };
        g.check_dispatch(&inputs, job.layouts(), job.num_experts(), &args)
            .map_err(refused)?;
        // The exact rows are known on the device only (EP_ERR_CAPACITY).
        Ok(None)
    }

    fn run_normal_dispatch(
        &mut self,
        job: &NormalDispatchJob<'_, DevTensors>,
    ) -> ep_core::Result<Vec<ep_core::Result<GpuDispatch>>> {
        let g = self.group_mut()?;
        if job.num_channels() != g.num_channels() {
            return Err(refused(Error::Unsupported(format!(
                "a dispatch with {} channels (Config::num_sms {}) on a Gpu executor of {} SMs \
                 per rank: use Config::num_sms = {}",
                job.num_channels(),
                2 * job.num_channels(),
                g.num_sms(),
                g.num_sms()
            ))));
        }
        let inputs: Vec<_> = job
            .inputs()
            .iter()
            .map(|i| i.view(job.with_topk()))
            .collect();
        let args = GpuDispatchArgs {
            expert_alignment: job.expert_alignment(),
            num_worst_tokens: job.num_worst_tokens(),
        };
        g.set_next_call(job.call());
        let out = g
            .dispatch(&inputs, job.layouts(), job.num_experts(), &args)
            .map_err(core)?;
        Ok(out.into_iter().map(Ok).collect())
    }

    fn run_cached_dispatch(
        &mut self,
        job: &CachedDispatchJob<'_, DevTensors>,
    ) -> ep_core::Result<Vec<ep_core::Result<GpuRows>>> {
        let g = self.group_mut()?;
        let inputs: Vec<_> = job
            .xs()
            .iter()
            .map(|x| GpuRankInputs {
                x: &x.x,
                x_scales: x.x_scales.as_ref(),
                topk_idx: None,
                topk_weights: None,
            })
            .collect();
        let handles: Vec<&GpuHandle> = job.handles().iter().collect();
        g.check_cached(&inputs, &handles).map_err(refused)?;
        g.set_next_call(job.call());
        let out = g.dispatch_cached(&inputs, &handles).map_err(core)?;
        Ok(out
            .into_iter()
            .map(|d| {
                Ok(GpuRows {
                    x: d.recv_x,
                    x_scales: d.recv_x_scales,
                })
            })
            .collect())
    }

    fn check_normal_combine(
        &self,
        job: &NormalCombineCheck<'_, DevTensors>,
    ) -> ep_core::Result<()> {
        let g = self.group()?;
        let (r, c) = (g.num_ranks(), g.num_channels());
        for (h, s) in job.handles().iter().zip(g.local_ranks()) {
            h.check(s, r, c).map_err(refused)?;
        }
        Ok(())
    }

    fn run_normal_combine(
        &mut self,
        job: &NormalCombineJob<'_, DevTensors>,
    ) -> ep_core::Result<Vec<GpuCombined>> {
        let (source, args) = self.combine_inputs(job)?;
        let g = self.group_mut()?;
        g.check_combine(source, &args).map_err(refused)?;
        g.set_next_call(job.call());
        g.combine(source, &args).map_err(core)
    }

    fn run_expert(&mut self, _job: &ExpertJob<'_>) -> ep_core::Result<()> {
        Err(ep_core::Error::Unsupported(
            "a host expert over the arena's rows: on the GPU the expert reads recv_x (a view \
             of the arena) and combine takes its output"
                .into(),
        ))
    }

    fn check_ll_dispatch(&self, inputs: &[GpuInputs], params: &LlParams) -> ep_core::Result<()> {
        let l = self.ll()?;
        // Expert ids are checked by the kernels (a typed error at the next call).
        l.check_dispatch(
            inputs,
            params.num_max_dispatch_tokens_per_rank,
            params.num_experts,
        )
    }

    fn run_ll_dispatch_send(&mut self, job: &LlDispatchSendJob<'_, DevTensors>) -> LlAttempt<()> {
        self.with_ll(|l| l.dispatch_send(job))
    }

    fn run_ll_dispatch_recv(
        &mut self,
        job: &LlDispatchRecvJob<'_, DevTensors>,
        _spare: &mut [Option<()>],
    ) -> LlAttempt<LlGpuDispatch> {
        self.with_ll(|l| l.dispatch_recv(job))
    }

    fn run_ll_expert_output(&mut self, job: &LlExpertOutputJob<'_, DevTensors>) -> LlAttempt<()> {
        self.with_ll(|l| l.expert_output(job))
    }

    fn check_ll_combine(&self, _job: &LlCombineCheck<'_, DevTensors>) -> ep_core::Result<()> {
        // The routing is the handle's: the group refuses a handle that is not the latest
        // dispatch of its rank on its half (an identity check, no tensor contents).
        self.ll().map(drop)
    }

    fn run_ll_combine_send(&mut self, job: &LlCombineSendJob<'_, DevTensors>) -> LlAttempt<()> {
        self.with_ll(|l| l.combine_send(job))
    }

    fn run_ll_combine_recv(
        &mut self,
        job: &LlCombineRecvJob<'_, DevTensors>,
    ) -> LlAttempt<DevTensor> {
        self.with_ll(|l| l.combine_recv(job))
    }

    fn take_masked_by_device(&mut self) -> Vec<usize> {
        self.ll.as_mut().map(LlExec::take_lost).unwrap_or_default()
    }

    fn run_ll_clean(&mut self, _job: &LlCleanJob<'_>) -> ep_core::Result<()> {
        self.ll_mut()?.clean()
    }

    fn run_reset(&mut self, _job: &ResetJob<'_>) -> ep_core::Result<()> {
        if let Some(g) = &mut self.normal {
            g.reset().map_err(core)?;
        }
        match &mut self.ll {
            Some(l) => l.reset(),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device timeout is a failed phase (it poisons the Buffer) and keeps its type; a value
    /// the device refused is an input error (the Buffer stays usable); a shape rule stays
    /// ep-core's own error.
    #[test]
    fn gpu_errors_map_to_failed_phases_or_refused_inputs() {
        let timeout = Error::DeviceWaitTimeout {
            rank: 0,
            kernel: "dispatch",
            block: 3,
            word: "notify[0][1]".into(),
            writer: Some(1),
            expected: 7,
            last_seen: 6,
            timeout: Duration::from_millis(200),
        };
        let e = core(timeout);
        assert!(matches!(e, ep_core::Error::Backend { .. }), "{e}");
        assert!(
            matches!(
                e.backend::<Error>(),
                Some(Error::DeviceWaitTimeout {
                    writer: Some(1),
                    ..
                })
            ),
            "{e}"
        );
        let e = core(Error::ExpertOutOfRange {
            rank: 1,
            index: 21,
            expert: 999,
        });
        assert!(matches!(e, ep_core::Error::InputRefused { .. }), "{e}");
        assert!(
            matches!(
                e.backend::<Error>(),
                Some(Error::ExpertOutOfRange { expert: 999, .. })
            ),
            "{e}"
        );
        // A layout the device found disagreeing with its membership poisons (a failed phase).
        let e = core(Error::DeviceLayoutMismatch {
            rank: 0,
            dest: 1,
            given: 3,
            counted: 4,
        });
        assert!(matches!(e, ep_core::Error::Backend { .. }), "{e}");
        let shape = ep_core::Error::ZeroExpertAlignment;
        assert_eq!(core(Error::Shape(shape.clone())), shape);
        assert_eq!(refused(Error::Shape(shape.clone())), shape);
        let e = refused(Error::HostWaitTimeout {
            rank: 0,
            what: "x".into(),
            timeout: Duration::from_secs(1),
        });
        assert!(
            matches!(e, ep_core::Error::InputRefused { .. }),
            "a check's error: {e}"
        );
        // Inside a poisoned Buffer's error the backend's error is still found.
        let poisoned = ep_core::Error::BufferPoisoned {
            call: 4,
            failed_rank: Some(1),
            cause: Box::new(core(Error::HostWaitTimeout {
                rank: 1,
                what: "num_recv".into(),
                timeout: Duration::from_secs(1),
            })),
        };
        assert!(matches!(
            poisoned.backend::<Error>(),
            Some(Error::HostWaitTimeout { rank: 1, .. })
        ));
    }
}
