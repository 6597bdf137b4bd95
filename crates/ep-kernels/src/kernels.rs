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

/// The normal-mode module compiled with `EP_TRACE` (its kernels record their protocol events),
/// or why it was not built.
pub(crate) fn normal_trace_cubin() -> Result<&'static [u8]> {
    cubin("normal_trace", built::NORMAL_TRACE)
}

/// The low-latency module (`cuda/low_latency.cu`), or why it was not built.
pub(crate) fn low_latency_cubin() -> Result<&'static [u8]> {
    cubin("low_latency", built::LOW_LATENCY)
}

/// The low-latency module compiled with `EP_TRACE` (its kernels record their protocol events),
/// or why it was not built.
pub(crate) fn low_latency_trace_cubin() -> Result<&'static [u8]> {
    cubin("low_latency_trace", built::LOW_LATENCY_TRACE)
}

/// Variant (b) of the low-latency module: `cuda/low_latency.cu` compiled relocatable with
/// `EP_LL_NVSHMEM` (every peer through NVSHMEM's device API), still to be linked against
/// `libnvshmem_device.a` ([`crate::nvshmem::device_link`]); or why it was not built.
pub(crate) fn low_latency_nvshmem_cubin() -> Result<&'static [u8]> {
    cubin("low_latency_nvshmem", built::LOW_LATENCY_NVSHMEM)
}

/// Variant (b) compiled with `EP_TRACE` (its kernels record their protocol events), still to
/// be linked; or why it was not built.
pub(crate) fn low_latency_nvshmem_trace_cubin() -> Result<&'static [u8]> {
    cubin(
        "low_latency_nvshmem_trace",
        built::LOW_LATENCY_NVSHMEM_TRACE,
    )
}

/// The version of the NVSHMEM headers the NVSHMEM variant of the low-latency kernels was
/// compiled with (`None` when build.rs found none). Only the `libnvshmem_device.a`, and so the
/// host library, of exactly this version can be linked with it.
pub fn nvshmem_headers_version() -> Option<nvshmem_sys::Version> {
    built::NVSHMEM_HEADERS.map(|(major, minor, patch)| nvshmem_sys::Version {
        major,
        minor,
        patch,
    })
}

/// The NVSHMEM include directory build.rs compiled against, if any.
pub fn nvshmem_include_dir() -> Option<&'static str> {
    built::NVSHMEM_INCLUDE
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

#[cfg(test)]
mod sass_shape;

#[cfg(test)]
mod tests {
    use super::*;

    /// `e_type` of an ELF header: 1 relocatable, 2 executable.
    fn elf_type(bytes: &[u8]) -> u16 {
        assert!(bytes.len() > 20, "{} bytes is no ELF file", bytes.len());
        assert_eq!(&bytes[..4], b"\x7fELF", "not an ELF file");
        u16::from_le_bytes([bytes[16], bytes[17]])
    }

    /// `e_machine`: 190 is EM_CUDA.
    fn elf_machine(bytes: &[u8]) -> u16 {
        u16::from_le_bytes([bytes[18], bytes[19]])
    }

    #[test]
    fn nvshmem_variant_is_built_whenever_it_can_be() {
        if built::NVCC.is_some() && built::NVSHMEM_HEADERS.is_some() {
            assert!(
                low_latency_nvshmem_cubin().is_ok(),
                "nvcc and the NVSHMEM headers were found, yet: {:?}",
                built::LOW_LATENCY_NVSHMEM.err()
            );
        }
        if built::NVSHMEM_HEADERS.is_none() {
            assert!(built::NVSHMEM_INCLUDE.is_none());
            assert!(built::LOW_LATENCY_NVSHMEM.is_err());
        }
    }

    #[test]
    fn nvshmem_variant_is_a_relocatable_cuda_cubin_unlike_variant_a() {
        let Ok(rdc) = low_latency_nvshmem_cubin() else {
            eprintln!(
                "skipped: variant (b) not built: {:?}",
                built::LOW_LATENCY_NVSHMEM.err()
            );
            return;
        };
        assert_eq!(elf_type(rdc), 1, "variant (b) must be relocatable (ET_REL)");
        assert_eq!(elf_machine(rdc), 190, "variant (b) must be a CUDA ELF");
        let plain = low_latency_cubin().expect("variant (a) is built whenever (b) is");
        assert_eq!(
            elf_type(plain),
            2,
            "variant (a) is a linked cubin (ET_EXEC)"
        );
        assert_ne!(rdc, plain);
    }

    #[test]
    fn headers_version_matches_the_include_dir() {
        let (Some(v), Some(dir)) = (nvshmem_headers_version(), nvshmem_include_dir()) else {
            eprintln!("skipped: no NVSHMEM headers at build time");
            return;
        };
        let text = std::fs::read_to_string(format!("{dir}/non_abi/nvshmem_version.h"))
            .expect("the include dir build.rs used still exists");
        for (name, value) in [("MAJOR", v.major), ("MINOR", v.minor), ("PATCH", v.patch)] {
            let line = format!("#define NVSHMEM_VENDOR_{name}_VERSION {value}");
            assert!(
                text.lines().any(|l| l.trim() == line),
                "{line} not in {dir}"
            );
        }
    }
}
