//! How a [`NormalGroup`] launches the kernels of `cuda/normal.cu`: the traced build's while
//! tracing, phase stamps when measuring, the dispatch with programmatic dependent launch.

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use super::{NormalGroup, THREADS};
use crate::error::{Error, Result};
use crate::gpu::abi::NormalArgs;

/// The kernels of `cuda/normal.cu` a group launches (the traced build's for dispatch and
/// combine while tracing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernel {
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
    pub(super) fn launch(
        &self,
        rank: usize,
        kernel: Kernel,
        blocks: u32,
        args: &NormalArgs,
    ) -> Result<()> {
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
}
