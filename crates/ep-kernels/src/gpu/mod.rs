//! The GPU data path (normal intranode mode): device memory and tensors, the eagerly loaded
//! kernels, and [`NormalGroup`], the co-resident ranks of one process on one GPU.
//!
//! - [`tensor`]: [`DevTensor`], the typed view over device memory calls take and return;
//! - [`mem`]: device buffers and host-mapped memory;
//! - [`ipc`]: device buffers shared with other processes (CUDA IPC);
//! - [`device`]: one GPU with its kernels and error record;
//! - [`normal`]: layout, dispatch, cached dispatch, combine and the copy ceiling.
//! - `host`: downloads of results as ep-core's host types (verification, digests);
//! - [`abi`]: the kernel-argument structs generated with the kernels' header.

pub mod abi;
pub mod device;
mod host;
pub mod ipc;
pub mod mem;
pub mod normal;
mod peers;
pub mod tensor;

pub use device::Device;
pub use normal::{
    CombineSource, GpuCombineArgs, GpuCombined, GpuDispatch, GpuDispatchArgs, GpuHandle, GpuLayout,
    GpuRankInputs, NormalGroup,
};
pub use tensor::{DType, DevTensor, HostElem};
