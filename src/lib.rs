//! # ep-rs
//!
//! Mixture-of-Experts expert-parallel communication: DeepEP V1's **dispatch** (tokens to the
//! ranks holding their experts) and **combine** (expert outputs back), with a Rust API, a CPU
//! simulator of the GPU fabric that runs the same protocol, and CUDA/NVSHMEM backends.
//!
//! This crate re-exports the workspace:
//! - [`core`] (`ep-core`): the semantics (`plan`), the reference `oracle`, configuration and the
//!   NVSHMEM environment plan (`config`), the `Transport` trait, the protocol agents,
//!   [`core::Buffer`] and the `Executor` of its phases (the simulator's: every `RunsAgents`
//!   transport);
//! - [`setup`] (`ep-setup`): the logic of `ep doctor` (machine checks over a sysroot);
//! - [`sim`] (`ep-sim`): the simulator backend — `Sim` (deterministic, checks every ordering
//!   rule, injects faults) and `ThreadSim` (real threads, for throughput);
//! - [`kernels`] (`ep-kernels`): the GPU side — the data path (`gpu::NormalGroup`,
//!   `gpu::LlGroup`: co-resident ranks of one GPU, one rank per process over CUDA IPC or NVSHMEM),
//!   device tensors (`gpu::DevTensor`), NVSHMEM bring-up and run-time device linking, CUDA
//!   topology, the `__host__ __device__` protocol header;
//! - [`prelude`]: what a user needs, from one place (`use ep_rs::prelude::*`).
//!
//! [`core::Buffer`] is generic over its [`core::Executor`] and takes the local ranks' inputs:
//! the simulator's executor (every rank local) and the GPU's (`kernels::gpu::Gpu`: co-resident
//! ranks of one GPU, or one rank per process) run the same host logic; each backend's tensors
//! are its executor's [`core::Tensors`] family (host tensors, device views), in both normal
//! and low-latency mode (docs/buffer-api.md).
//!
//! ## Quick start (on the simulator)
//!
//! ```
//! use ep_rs::core::buffer::NormalDispatchArgs;
//! use ep_rs::core::config::{BufferConfig, Config};
//! use ep_rs::core::plan::combine::CombineArgs;
//! use ep_rs::core::transport::FabricParams;
//! use ep_rs::core::workload::WorkloadSpec;
//! use ep_rs::core::{Activations, Buffer};
//! use ep_rs::sim::{Sim, SimConfig};
//!
//! # fn main() -> ep_rs::core::Result<()> {
//! let (ranks, tokens, hidden, topk, experts) = (4, 64, 256, 4, 32);
//! // Every rank's inputs (the simulator drives all ranks from one host).
//! let inputs = WorkloadSpec::new(ranks, tokens, hidden, topk, experts, 7).generate()?;
//!
//! // init: a Buffer over the simulated fabric (one NVLink node), sized by the size hint.
//! let sim = Sim::new(SimConfig::new(FabricParams::single_node(ranks), 7));
//! let mut cfg = BufferConfig::new(ranks);
//! cfg.num_nvl_bytes =
//!     Buffer::<Sim>::normal_size_hint(ranks, ranks * tokens, hidden, 2, topk).div_ceil(128) * 128;
//! let mut buffer = Buffer::new(sim, cfg)?;
//!
//! // layout → dispatch
//! let topk_idx: Vec<_> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
//! let layouts = buffer.get_dispatch_layout(&topk_idx, experts)?;
//! let args = NormalDispatchArgs::new(Config::dispatch_for(ranks)?);
//! let received = buffer.dispatch(&inputs, &layouts, experts, &args)?;
//!
//! // the experts (here: identity) → combine
//! let ys: Vec<_> = received
//!     .iter()
//!     .map(|r| match &r.recv_x {
//!         Activations::Bf16(x) => x.clone(),
//!         Activations::Fp8 { .. } => unreachable!("BF16 workload"),
//!     })
//!     .collect();
//! let handles: Vec<_> = received.iter().map(|r| r.handle.clone()).collect();
//! let combine_args: Vec<_> = received
//!     .iter()
//!     .zip(&ys)
//!     .map(|(r, y)| CombineArgs { x: y, topk_weights: r.recv_topk_weights.as_ref(), bias: &[] })
//!     .collect();
//! let combined = buffer.combine(&handles, &combine_args)?;
//!
//! // the reference oracle says what every rank must get back
//! let expected = ep_rs::core::oracle::normal::intranode_combine(&inputs, experts, &combine_args)?;
//! assert_eq!(combined, expected);
//! # Ok(())
//! # }
//! ```
//!
//! ## Quick start (on a GPU: co-resident ranks of GPU 0)
//!
//! ```no_run
//! use ep_rs::prelude::*;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (ranks, tokens, hidden, topk, experts, sms) = (2, 4096, 7168, 8, 256, 24);
//! let inputs = WorkloadSpec::new(ranks, tokens, hidden, topk, experts, 7).generate()?;
//! let dev = Device::open(0)?;
//! // The same Buffer as on the simulator, over two co-resident ranks of 24 SMs each.
//! let mut cfg = BufferConfig::new(ranks);
//! cfg.num_nvl_bytes = Buffer::<Sim>::normal_size_hint(ranks, ranks * tokens, hidden, 2, topk);
//! let mut buffer = Buffer::new(Gpu::co_resident(dev.clone(), ranks, sms), cfg)?;
//! let up = |i: &RankInputs| -> Result<GpuInputs, ep_rs::kernels::Error> {
//!     let Activations::Bf16(x) = &i.x else { unreachable!("BF16 workload") };
//!     Ok(GpuInputs {
//!         x: DevTensor::upload(dev.context(), x)?,
//!         x_scales: None,
//!         topk_idx: Some(DevTensor::upload(dev.context(), &i.topk_idx)?),
//!         topk_weights: Some(DevTensor::upload(dev.context(), &i.topk_weights)?),
//!     })
//! };
//! let dev_inputs = inputs.iter().map(up).collect::<Result<Vec<_>, _>>()?;
//! let idx: Vec<_> = dev_inputs.iter().map(|i| i.topk_idx.clone().unwrap()).collect();
//! let layouts = buffer.get_dispatch_layout(&idx, experts)?;
//! let args = NormalDispatchArgs::new(Config::new(sms, 8, 256, 6, 128)?);
//! let received = buffer.dispatch(&dev_inputs, &layouts, experts, &args)?;
//! // ... the experts write their outputs over `received[r].recv_x` (views into the arena) ...
//! let handles: Vec<_> = received.iter().map(|d| d.handle.clone()).collect();
//! let combine_args: Vec<_> = received
//!     .iter()
//!     .map(|d| GpuCombineIn { x: &d.recv_x, topk_weights: d.recv_topk_weights.as_ref(), bias: &[] })
//!     .collect();
//! let combined = buffer.combine(&handles, &combine_args)?; // reads recv_x in place
//! buffer.sync()?; // a device timeout or a bad expert id surfaces here as a typed error
//! let _x0: Tensor2<half::bf16> = combined[0].combined_x.download()?;
//! # Ok(())
//! # }
//! ```
//!
//! Low-latency mode is `gpu::LlGroup` (variant (a) by pointer, or `LlGroup::with_nvshmem`:
//! every peer through NVSHMEM's device API); `ep bench --backend gpu` drives both.
//!
//! From the command line: `ep bench` (dispatch + combine on the simulator, verified against the
//! oracle, DeepEP-comparable figures), `ep layout` (plan versus oracle), `ep doctor` (is IBGDA
//! usable on this machine, and the exact fix when it is not).
//!
//! ## DeepEP ↔ ep-rs
//!
//! | DeepEP V1 (`deep_ep`) | ep-rs |
//! |---|---|
//! | `Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank, ...)` | [`core::Buffer::new`]`(transport, `[`core::config::BufferConfig`]`)` |
//! | `Buffer.get_dispatch_layout(topk_idx, num_experts)` | [`core::Buffer::get_dispatch_layout`] (plan: [`core::plan::layout`]) |
//! | `Buffer.dispatch(x, handle=None, ...)` | [`core::Buffer::dispatch`] with [`core::buffer::NormalDispatchArgs`] |
//! | `Buffer.dispatch(x, handle=handle)` (cached) | [`core::Buffer::dispatch_cached`] |
//! | `Buffer.combine(x, handle, topk_weights, bias)` | [`core::Buffer::combine`] with [`core::plan::combine::CombineArgs`] |
//! | `Buffer.low_latency_dispatch(..., return_recv_hook)` | [`core::Buffer::low_latency_dispatch`], or `_send` + `_recv` (the hook) |
//! | `Buffer.low_latency_combine(..., use_logfmt, zero_copy, return_recv_hook)` | [`core::Buffer::low_latency_combine`] with [`core::buffer::LlCombineOptions`] `{ zero_copy, use_logfmt }`, or `_send` + `_recv` |
//! | `Buffer.clean_low_latency_buffer(...)` | [`core::Buffer::clean_low_latency_buffer`] |
//! | `low_latency_update_mask_buffer` / `query_mask_buffer` / `clean_mask_buffer` | [`core::Buffer::update_mask`] / [`core::Buffer::query_mask`] / [`core::Buffer::clean_mask`] |
//! | `Config`, `get_dispatch_config(R)`, `get_combine_config(R)` | [`core::config::Config`], `Config::dispatch_for(R)`, `Config::combine_for(R)` |
//! | `Config.get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint` | `Config::nvl_buffer_size_hint` / `Config::rdma_buffer_size_hint` (DeepEP's formulas); ep-rs's own arena: [`core::Buffer::normal_size_hint`] |
//! | `get_low_latency_rdma_size_hint(N, H, R, E)` | [`core::config::low_latency_rdma_size_hint`] (DeepEP's); [`core::Buffer::low_latency_size_hint`] (ep-rs's) |
//! | environment set in `Buffer.__init__` | [`core::config::nvshmem_env_plan`] (pure; applied when ranks are spawned) |
//! | `handle` tuples | [`core::plan::intranode::IntranodeHandle`], [`core::plan::low_latency::LlHandle`] |
//!
//! ## Features, build and run time
//! No Cargo features yet. Building needs no CUDA, NVSHMEM or rdma-core: the `-sys` crates load
//! their libraries at run time and return typed errors when they are missing. CUDA kernels are
//! compiled by `ep-kernels`' build script when `nvcc` is found (see `GPU.md`), otherwise the
//! crate builds without them and launches return a typed error.
//!
//! ## Thread safety and cleanup
//! A `Buffer` is driven by one host thread (`&mut self` for every collective call); the
//! simulator runs its agents on its own threads. Outputs are owned tensors on the simulator; on
//! the GPU they are views valid until the next call on the same `Buffer` (docs/protocol.md).
//! A call that fails with a fault poisons the `Buffer` until [`core::Buffer::reset`].

pub use ep_core as core;
pub use ep_kernels as kernels;
pub use ep_setup as setup;
pub use ep_sim as sim;

/// What a user of ep-rs needs, from one place: the `Buffer` and its configuration, the inputs and
/// outputs of every call, the simulator, and the GPU data path with its device tensors.
pub mod prelude {
    pub use ep_core::buffer::{
        LlCombineHook, LlCombineOptions, LlDispatchHook, LlDispatched, NormalDispatchArgs,
    };
    pub use ep_core::config::{BufferConfig, Config};
    pub use ep_core::plan::combine::{CombineArgs, CombineOutput};
    pub use ep_core::plan::intranode::{IntranodeDispatch, IntranodeHandle};
    pub use ep_core::plan::layout::DispatchLayout;
    pub use ep_core::plan::low_latency::{LlHandle, LlParams};
    pub use ep_core::transport::FabricParams;
    pub use ep_core::workload::WorkloadSpec;
    pub use ep_core::{
        Activations, Buffer, Executor, ExpertIdx, Host, RankInputs, Tensor2, Tensor3, Tensors,
    };
    pub use ep_kernels::gpu::{
        DType, DevTensor, DevTensors, Device, Gpu, GpuCombineIn, GpuCombined, GpuDispatch,
        GpuExpertOut, GpuHandle, GpuInputs, GpuLayout, GpuRows, LlConfig, LlGpuDispatch,
        LlGpuHandle, LlGroup, LlVariant, NormalGroup,
    };
    pub use ep_sim::{Sim, SimConfig, ThreadSim};
}
