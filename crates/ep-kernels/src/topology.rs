//! GPU count and peer-to-peer topology as the CUDA driver API sees it: devices, their PCI bus
//! ids, and per ordered pair `cuDeviceCanAccessPeer` plus the `cuDeviceGetP2PAttribute`
//! attributes (access supported, native atomics, performance rank).
//!
//! The driver API does not name the link (NVLink or PCIe) or count NVLinks; `nvidia-smi topo
//! -m` does, and `ep doctor` keeps it as the source of link types. What CUDA adds is whether
//! peer access is actually allowed, which is what the intranode kernels rely on. Native atomics
//! between two GPUs are in practice an NVLink (or NVSwitch) property: PCIe peer-to-peer does
//! not carry them, so [`PeerInfo::native_atomics`] is reported as a hint, not a link type.
//!
//! No context is created: every query here is a device query, so it is cheap and leaves no
//! state behind.
//!
//! ```no_run
//! let t = ep_kernels::topology::gpu_topology()?;
//! for (i, g) in t.devices.iter().enumerate() {
//!     println!("GPU{i}: {} at {}", g.name, g.pci_bus_id);
//! }
//! if let Some(p) = t.peer(0, 1) {
//!     println!("0 -> 1: access {}, native atomics {}", p.can_access_peer, p.native_atomics);
//! }
//! # Ok::<(), ep_kernels::Error>(())
//! ```

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdevice, CUdevice_P2PAttribute, CUdevice_attribute};
use cudarc::driver::{CudaContext, result};

use crate::error::{Error, Result};

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// CUDA ordinal (after `CUDA_VISIBLE_DEVICES`, in `CUDA_DEVICE_ORDER`).
    pub ordinal: u32,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetPCIBusId` (`0000:18:00.0`).
    pub pci_bus_id: String,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED` (`None` when the query failed).
    pub gpu_direct_rdma: Option<bool>,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: GPU memory can be exported as a dma-buf for
    /// `ibv_reg_dmabuf_mr` (`None` when the query failed).
    pub dma_buf: Option<bool>,
}

/// What CUDA says about one ordered pair of devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// `cuDeviceCanAccessPeer`.
    pub can_access_peer: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
    pub access_supported: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED` (NVLink-class paths have it; PCIe
    /// peer-to-peer does not).
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (relative; lower is better).
    pub performance_rank: i32,
}

/// Devices and peer attributes as the CUDA driver API reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuTopology {
    /// `cuDriverGetVersion` (`13000` for CUDA 13.0).
    pub driver_version: i32,
    /// Devices in CUDA ordinal order.
    pub devices: Vec<DeviceInfo>,
    /// `peers[i][j]` for `i != j`; `None` on the diagonal.
    pub peers: Vec<Vec<Option<PeerInfo>>>,
}

impl GpuTopology {
    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// The pair `src -> dst` (`None` on the diagonal or out of range).
    pub fn peer(&self, src: usize, dst: usize) -> Option<&PeerInfo> {
        self.peers.get(src)?.get(dst)?.as_ref()
    }
}

/// Queries devices and peer attributes. [`Error::CudaDriverMissing`] when `libcuda.so.1` is
/// absent (never a panic); [`Error::Cuda`] naming the call when the driver refuses (e.g.
/// `cuInit` with `CUDA_ERROR_NO_DEVICE`).
pub fn gpu_topology() -> Result<GpuTopology> {
    // SAFETY: is_culib_present only tries to dlopen libcuda; cudarc would panic later without it.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::CudaDriverMissing);
    }
    result::init().map_err(Error::cuda("cuInit"))?;
    let mut driver_version = 0;
    // SAFETY: a valid out-pointer; cuInit succeeded.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(Error::cuda("cuDriverGetVersion"))?;
    let count = result::device::get_count().map_err(Error::cuda("cuDeviceGetCount"))?;
    let mut handles = Vec::new();
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(Error::cuda("cuDeviceGet"))?;
        let name = result::device::get_name(dev).map_err(Error::cuda("cuDeviceGetName"))?;
        devices.push(DeviceInfo {
            ordinal: ordinal as u32,
            name,
            pci_bus_id: pci_bus_id(dev)?,
            gpu_direct_rdma: flag(
                dev,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED,
            ),
            dma_buf: flag(
                dev,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            ),
        });
        handles.push(dev);
    }
    let mut peers = Vec::with_capacity(handles.len());
    for (i, &a) in handles.iter().enumerate() {
        let mut row = Vec::with_capacity(handles.len());
        for (j, &b) in handles.iter().enumerate() {
            row.push(if i == j { None } else { Some(peer(a, b)?) });
        }
        peers.push(row);
    }
    Ok(GpuTopology {
        driver_version,
        devices,
        peers,
    })
}

fn pci_bus_id(dev: CUdevice) -> Result<String> {
    // "dddd:bb:dd.f" plus NUL fits in 13 bytes; the driver documents 13 as enough, 64 is ample.
    let mut buf = [0 as std::ffi::c_char; 64];
    // SAFETY: `buf` is writable for the length passed; `dev` came from cuDeviceGet.
    unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, dev) }
        .result()
        .map_err(Error::cuda("cuDeviceGetPCIBusId"))?;
    // SAFETY: on success the driver wrote a NUL-terminated string into `buf` (zeroed beforehand,
    // so a terminator exists within bounds either way).
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(s.to_string_lossy().to_ascii_lowercase())
}

fn flag(dev: CUdevice, attr: CUdevice_attribute) -> Option<bool> {
    // SAFETY: `dev` came from cuDeviceGet.
    unsafe { result::device::get_attribute(dev, attr) }
        .ok()
        .map(|v| v != 0)
}

fn peer(a: CUdevice, b: CUdevice) -> Result<PeerInfo> {
    let mut can = 0;
    // SAFETY: valid out-pointer; both devices came from cuDeviceGet.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) }
        .result()
        .map_err(Error::cuda("cuDeviceCanAccessPeer"))?;
    let attr = |which: CUdevice_P2PAttribute| -> Result<i32> {
        let mut v = 0;
        // SAFETY: valid out-pointer; both devices came from cuDeviceGet.
        unsafe { sys::cuDeviceGetP2PAttribute(&mut v, which, a, b) }
            .result()
            .map_err(Error::cuda("cuDeviceGetP2PAttribute"))?;
        Ok(v)
    };
    Ok(PeerInfo {
        can_access_peer: can != 0,
        access_supported: attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)?
            != 0,
        native_atomics: attr(
            CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
        )? != 0,
        performance_rank: attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
    })
}

/// A small device allocation (`cuMemAlloc`, outside cudarc's memory pool) for `ep doctor
/// --probe`'s registration of GPU memory with a NIC: the device pointer for `ibv_reg_mr`
/// (peer memory) and a dma-buf file descriptor for `ibv_reg_dmabuf_mr`. Freed on drop:
/// deregister every memory region over it first.
pub struct RegistrationBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for RegistrationBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrationBuffer")
            .field("ordinal", &self.ctx.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl RegistrationBuffer {
    /// Allocates `len` bytes (rounded up to 2 MiB, the GPU page size dma-buf export needs) on
    /// device `ordinal`. [`Error::CudaDriverMissing`] without libcuda.
    pub fn alloc(ordinal: usize, len: usize) -> Result<Self> {
        // SAFETY: is_culib_present only tries to dlopen libcuda.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CudaDriverMissing);
        }
        let len = len.max(1).next_multiple_of(2 << 20);
        let ctx = CudaContext::new(ordinal).map_err(Error::cuda("cuDevicePrimaryCtxRetain"))?;
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // SAFETY: the context is current on this thread; the allocation is freed in drop.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(Error::cuda("cuMemAlloc"))?;
        Ok(Self { ctx, ptr, len })
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never empty (kept for the `len` convention).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)` over the whole
    /// buffer: fails on drivers or kernels without dma-buf (proprietary module, kernel < 5.12).
    pub fn dmabuf_fd(&self) -> Result<OwnedFd> {
        self.ctx
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: `fd` is a valid out-parameter for an int handle; the range is one live
        // allocation of this context.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                self.ptr,
                self.len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .map_err(Error::cuda("cuMemGetHandleForAddressRange(DMA_BUF_FD)"))?;
        // SAFETY: on success the driver returned a new file descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

impl Drop for RegistrationBuffer {
    fn drop(&mut self) {
        // A failure here leaks device memory of a process about to exit; nothing to surface.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from malloc_sync in this context and is freed once; the
            // type's contract has the caller deregister its memory regions before the drop.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_driver_is_a_typed_error_or_a_topology() {
        // Runs everywhere: without libcuda a typed error, with a driver a consistent matrix.
        match gpu_topology() {
            Err(Error::CudaDriverMissing) | Err(Error::Cuda { op: "cuInit", .. }) => {}
            Err(e) => panic!("unexpected error: {e}"),
            Ok(t) => {
                assert_eq!(t.peers.len(), t.device_count());
                for (i, row) in t.peers.iter().enumerate() {
                    assert_eq!(row.len(), t.device_count());
                    assert!(row[i].is_none());
                }
                for d in &t.devices {
                    assert_eq!(d.pci_bus_id.matches(':').count(), 2, "{}", d.pci_bus_id);
                }
            }
        }
    }
}
