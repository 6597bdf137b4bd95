//! The CUDA kernels build.rs compiled (sm_90 cubins), loaded into a context on demand.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::error::{Error, Result};

mod built {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// The nvcc build.rs used, or `None` when the crate was built without kernels.
pub fn nvcc() -> Option<&'static str> {
    built::NVCC
}

/// Whether the kernels are compiled in.
pub fn available() -> bool {
    built::BRINGUP.is_ok() && built::NORMAL.is_ok() && built::LOW_LATENCY.is_ok()
}

fn cubin(
    module: &'static str,
    built: Result<&'static [u8], &'static str>,
) -> Result<&'static [u8]> {
    built.map_err(|reason| Error::KernelsNotBuilt { module, reason })
}

/// The normal-mode module (`cuda/normal.cu`), or why it was not built.
pub(crate) fn normal_cubin() -> Result<&'static [u8]> {
    cubin("normal", built::NORMAL)
}

/// The low-latency module (`cuda/low_latency.cu`), or why it was not built.
pub(crate) fn low_latency_cubin() -> Result<&'static [u8]> {
    cubin("low_latency", built::LOW_LATENCY)
}

/// The bring-up kernel: plain stores through any device pointer (a peer's too).
#[derive(Debug, Clone)]
pub struct BringupKernels {
    fill: CudaFunction,
}

impl BringupKernels {
    /// Loads `cuda/bringup.cu` into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        let bytes = cubin("bringup", built::BRINGUP)?;
        let module = ctx
            .load_module(Ptx::from_binary(bytes.to_vec()))
            .map_err(Error::cuda("cuModuleLoadData(bringup)"))?;
        let fill = module
            .load_function("ep_bringup_fill")
            .map_err(Error::cuda("cuModuleGetFunction(ep_bringup_fill)"))?;
        Ok(Self { fill })
    }

    /// Enqueues `dst[i] = value + i` for `i < n` on `stream`.
    ///
    /// # Safety
    /// `dst` is a device address (local, or a peer's from `nvshmem_ptr`) valid for `n` `u64`
    /// stores until the stream has passed this kernel, and nothing else accesses that range
    /// meanwhile.
    pub unsafe fn fill(&self, stream: &CudaStream, dst: u64, value: u64, n: u64) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (132, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&self.fill);
        b.arg(&dst).arg(&value).arg(&n);
        // SAFETY: the argument types match `ep_bringup_fill(uint64_t*, uint64_t, uint64_t)`;
        // the caller guarantees `dst` (contract above).
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(Error::cuda("launch ep_bringup_fill"))
    }
}
