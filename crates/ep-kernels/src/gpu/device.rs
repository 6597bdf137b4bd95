//! [`Device`]: one GPU as the backend uses it — the context, every kernel of the normal-mode
//! and low-latency modules loaded **eagerly** (GPU.md: with lazy loading, kernels of co-resident ranks that wait
//! on each other never overlap), the SM count, and the process's error record.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use super::abi::ErrBlock;
use super::mem::{HostMapped, MemPool};
use crate::error::{Error, Result};
use crate::kernels;

/// The functions of `cuda/normal.cu`.
#[derive(Debug, Clone)]
pub(crate) struct NormalKernels {
    pub(crate) layout: CudaFunction,
    pub(crate) dispatch: CudaFunction,
    pub(crate) combine: CudaFunction,
    pub(crate) ceiling: CudaFunction,
    pub(crate) ceiling_gather: CudaFunction,
    pub(crate) spin: CudaFunction,
    pub(crate) pingpong: CudaFunction,
}

/// The functions of `cuda/low_latency.cu`.
#[derive(Debug, Clone)]
pub(crate) struct LlKernels {
    pub(crate) dispatch: CudaFunction,
    pub(crate) combine: CudaFunction,
    /// The combine with LogFMT-10 partials (`use_logfmt`).
    pub(crate) combine_logfmt: CudaFunction,
}

/// One GPU, ready to launch the backend's kernels.
#[derive(Debug)]
pub struct Device {
    ctx: Arc<CudaContext>,
    pub(crate) normal: NormalKernels,
    /// The same kernels recording their protocol events (`EP_TRACE`).
    pub(crate) normal_trace: NormalKernels,
    pub(crate) ll: LlKernels,
    /// The same kernels recording their protocol events (`EP_TRACE`).
    pub(crate) ll_trace: LlKernels,
    num_sms: usize,
    max_dynamic_smem: usize,
    pub(crate) err: HostMapped<ErrBlock>,
    /// Where per-call outputs come from (memory kept mapped across calls).
    pub(crate) pool: MemPool,
}

impl Device {
    /// Opens GPU `ordinal`: checks the driver, loads and eagerly loads every kernel.
    pub fn open(ordinal: usize) -> Result<Arc<Self>> {
        // SAFETY: is_culib_present only tries to dlopen libcuda; cudarc would panic later without it.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CudaDriverMissing);
        }
        let bytes = kernels::normal_cubin()?;
        let ll_bytes = kernels::low_latency_cubin()?;
        let ctx =
            CudaContext::new(ordinal).map_err(Error::cuda("cuCtxCreate (primary context)"))?;
        // SAFETY: the backend passes raw device addresses to its kernels and orders streams
        // itself with events; cudarc's per-slice event tracking would only add waits.
        unsafe { ctx.disable_event_tracking() };
        let module = ctx
            .load_module(Ptx::from_binary(bytes.to_vec()))
            .map_err(Error::cuda("cuModuleLoadData(normal)"))?;
        let ll_module = ctx
            .load_module(Ptx::from_binary(ll_bytes.to_vec()))
            .map_err(Error::cuda("cuModuleLoadData(low_latency)"))?;
        let ll_trace_module = ctx
            .load_module(Ptx::from_binary(
                kernels::low_latency_trace_cubin()?.to_vec(),
            ))
            .map_err(Error::cuda("cuModuleLoadData(low_latency_trace)"))?;
        let normal_trace_module = ctx
            .load_module(Ptx::from_binary(kernels::normal_trace_cubin()?.to_vec()))
            .map_err(Error::cuda("cuModuleLoadData(normal_trace)"))?;
        let get_in = load_function_eager;
        let normal_of = |m: &Arc<CudaModule>| -> Result<NormalKernels> {
            Ok(NormalKernels {
                layout: get_in(m, "ep_normal_layout")?,
                dispatch: get_in(m, "ep_normal_dispatch")?,
                combine: get_in(m, "ep_normal_combine")?,
                ceiling: get_in(m, "ep_copy_ceiling")?,
                ceiling_gather: get_in(m, "ep_copy_ceiling_gather")?,
                spin: get_in(m, "ep_spin")?,
                pingpong: get_in(m, "ep_flag_pingpong")?,
            })
        };
        let normal = normal_of(&module)?;
        let normal_trace = normal_of(&normal_trace_module)?;
        let ll_of = |m: &Arc<cudarc::driver::CudaModule>| -> Result<LlKernels> {
            Ok(LlKernels {
                dispatch: get_in(m, "ep_ll_dispatch")?,
                combine: get_in(m, "ep_ll_combine")?,
                combine_logfmt: get_in(m, "ep_ll_combine_logfmt")?,
            })
        };
        let ll = ll_of(&ll_module)?;
        let ll_trace = ll_of(&ll_trace_module)?;
        let max_dynamic_smem = opt_in_dynamic_smem(
            &ctx,
            &[
                &ll.dispatch,
                &ll.combine,
                &ll.combine_logfmt,
                &ll_trace.dispatch,
                &ll_trace.combine,
                &ll_trace.combine_logfmt,
            ],
        )?;
        let num_sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(Error::cuda("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"))?
            as usize;
        let err = HostMapped::new(&ctx)?;
        let pool = MemPool::new(&ctx)?;
        Ok(Arc::new(Self {
            ctx,
            normal,
            normal_trace,
            ll,
            ll_trace,
            num_sms,
            max_dynamic_smem,
            err,
            pool,
        }))
    }

    /// GPUs this process sees.
    pub fn count() -> Result<usize> {
        // SAFETY: is_culib_present only tries to dlopen libcuda; cudarc would panic later without it.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CudaDriverMissing);
        }
        CudaContext::device_count()
            .map(|n| n.max(0) as usize)
            .map_err(Error::cuda("cuDeviceGetCount"))
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Streaming multiprocessors of the GPU.
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }

    /// Dynamic shared memory a block may opt in to.
    pub(crate) fn max_dynamic_smem(&self) -> usize {
        self.max_dynamic_smem
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
}

/// `name` of `module`, loaded onto the device now rather than at its first launch (GPU.md: with
/// lazy loading, kernels of co-resident ranks that wait on each other never overlap).
pub(crate) fn load_function_eager(
    module: &Arc<CudaModule>,
    name: &'static str,
) -> Result<CudaFunction> {
    let f = module
        .load_function(name)
        .map_err(Error::cuda("cuModuleGetFunction"))?;
    // SAFETY: `f` is a function of a module loaded in this context.
    unsafe { sys::cuFuncLoad(f.cu_function()) }
        .result()
        .map_err(Error::cuda("cuFuncLoad"))?;
    Ok(f)
}

/// The fault of `stream`'s work so far, if any: a kernel that faulted (a bad address, an illegal
/// instruction) leaves the context's sticky error, which a host wait on device-written memory
/// would otherwise only see as a timeout. Unfinished work is not a fault.
pub(crate) fn stream_fault(stream: &CudaStream, op: &'static str) -> Result<()> {
    // SAFETY: `stream` is a live stream of this process's context; the query only reads its state.
    match unsafe { sys::cuStreamQuery(stream.cu_stream()) }.result() {
        Err(e) if e.0 != sys::cudaError_enum::CUDA_ERROR_NOT_READY => {
            Err(Error::Cuda { op, source: e })
        }
        _ => Ok(()),
    }
}

/// The LL kernels size their shared memory per call (LlGroup checks it against the result):
/// each of `fns` may opt in to the device's limit less its static shared memory. Returns the
/// dynamic shared memory every one of them may use.
pub(crate) fn opt_in_dynamic_smem(ctx: &CudaContext, fns: &[&CudaFunction]) -> Result<usize> {
    let optin = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(Error::cuda(
            "cuDeviceGetAttribute(MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)",
        ))? as usize;
    let mut max_dynamic_smem = optin;
    for f in fns {
        max_dynamic_smem = max_dynamic_smem.min(set_max_dynamic_smem(f, max_dynamic_smem)?);
    }
    Ok(max_dynamic_smem)
}

/// Lets `f` launch with as much dynamic shared memory as `optin` (the device's per-block opt-in
/// limit) leaves beside its static shared memory; returns that amount.
fn set_max_dynamic_smem(f: &CudaFunction, optin: usize) -> Result<usize> {
    let mut fixed = 0i32;
    // SAFETY: `f` is a loaded function of this context; the attribute is written to `fixed`.
    unsafe {
        sys::cuFuncGetAttribute(
            &mut fixed,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            f.cu_function(),
        )
    }
    .result()
    .map_err(Error::cuda("cuFuncGetAttribute(SHARED_SIZE_BYTES)"))?;
    let avail = optin.saturating_sub(usize::try_from(fixed).unwrap_or(0));
    let bytes = i32::try_from(avail)
        .map_err(|_| Error::Unsupported(format!("{avail} bytes of shared memory per block")))?;
    // SAFETY: `f` is a loaded function of this context; `bytes` is the device's opt-in maximum
    // (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN) less the function's static
    // shared memory, a value the attribute accepts.
    unsafe {
        sys::cuFuncSetAttribute(
            f.cu_function(),
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes,
        )
    }
    .result()
    .map_err(Error::cuda(
        "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
    ))?;
    Ok(avail)
}
