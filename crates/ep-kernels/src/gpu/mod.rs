//! The GPU data path: device memory and tensors, the eagerly loaded kernels, [`NormalGroup`]
//! (normal mode: co-resident ranks of one process, or one rank per process over CUDA IPC) and
//! [`LlGroup`] (low-latency mode, co-resident ranks).
//!
//! - [`tensor`]: [`DevTensor`], the typed view over device memory calls take and return;
//! - [`mem`]: device buffers and host-mapped memory;
//! - [`ipc`]: device buffers shared with other processes (CUDA IPC);
//! - [`device`]: one GPU with its kernels and error record;
//! - `err_record`: the error record's kinds both groups decode alike (a wait timeout, an
//!   expert id out of range);
//! - [`executor`]: [`Gpu`], the executor of ep-core's `Buffer` over device tensors
//!   ([`DevTensors`]): normal mode through the same `Buffer` as the simulator;
//! - [`floor`]: the latency parts of the low-latency floor (an empty graph launch, a flag round
//!   trip between resident kernels), measured in the bench's run;
//! - `gate`: timing several ranks' streams from one release;
//! - `graph`: the CUDA-graph capture and replay plumbing both groups share;
//! - [`normal`]: layout, dispatch, cached dispatch, combine and the copy ceiling; calls captured
//!   in CUDA graphs and ordered against the caller's streams;
//! - [`low_latency`]: [`LlGroup`], low-latency dispatch and combine (variant (a), peers by pointer).
//! - `host`: downloads of results as ep-core's host types (verification, digests);
//! - [`abi`]: the kernel-argument structs generated with the kernels' header;
//! - [`trace`]: the device trace of debug builds (record format, decoding) for ep-sim's checker.

pub mod abi;
pub mod device;
mod err_record;
pub mod executor;
pub mod floor;
mod gate;
mod graph;
mod host;
pub mod ipc;
pub mod low_latency;
pub mod mem;
pub mod normal;
mod peers;
pub mod tensor;
pub mod trace;

pub use device::Device;
pub use executor::{DevTensors, Gpu, GpuCombineIn, GpuExpertOut, GpuInputs, GpuRows};
pub use low_latency::{
    LlCombineArgs, LlCombineInput, LlConfig, LlDispatchArgs, LlGpuDispatch, LlGpuHandle, LlGraph,
    LlGroup, LlPoison, LlRankInputs, LlStats, LlVariant,
};
pub use normal::{
    CallStreams, CombineSource, GpuCombineArgs, GpuCombined, GpuDispatch, GpuDispatchArgs,
    GpuHandle, GpuLayout, GpuRankInputs, NormalGraph, NormalGroup,
};
pub use tensor::{DType, DevTensor, HostElem};
