//! The GPU data path (normal intranode mode): device memory and tensors, the eagerly loaded
//! kernels, and [`NormalGroup`], the co-resident ranks of one process on one GPU.
//!
//! - [`tensor`]: [`DevTensor`], the typed view over device memory calls take and return;
//! - [`mem`]: device buffers and host-mapped memory;
//! - [`device`]: one GPU with its kernels and error record;
//! - [`normal`]: layout, dispatch, cached dispatch, combine and the copy ceiling;
//! - [`low_latency`]: [`LlGroup`], low-latency dispatch and combine (variant (a), peers by pointer).
//! - `host`: downloads of results as ep-core's host types (verification, digests);
//! - [`abi`]: the kernel-argument structs generated with the kernels' header.

pub mod abi;
pub mod device;
mod host;
pub mod low_latency;
pub mod mem;
pub mod normal;
pub mod tensor;

pub use device::Device;
pub use low_latency::{
    LlCombineInput, LlConfig, LlDispatchArgs, LlGpuDispatch, LlGpuHandle, LlGroup, LlPoison,
    LlRankInputs, LlStats,
};
pub use normal::{
    CombineSource, GpuCombineArgs, GpuCombined, GpuDispatch, GpuDispatchArgs, GpuHandle, GpuLayout,
    GpuRankInputs, NormalGroup,
};
pub use tensor::{DType, DevTensor, HostElem};
