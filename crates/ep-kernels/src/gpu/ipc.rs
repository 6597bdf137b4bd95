//! Sharing device memory with other processes: a [`DevBuf`] is exported as an [`IpcExport`]
//! (the 64-byte `cuIpcGetMemHandle` handle of its allocation, the buffer's offset in it and
//! its length; 80 bytes on the wire) and mapped in another process as an [`IpcMapping`]
//! (`cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, closed on drop).
//!
//! Why CUDA IPC rather than VMM (`cuMemCreate` + POSIX fd export + `cuMemMap`): the arenas are
//! already `cuMemAlloc` memory (never pool memory, which `cuIpcGetMemHandle` refuses, GPU.md),
//! the handle is plain bytes that travel over any channel (an fd needs a Unix socket and
//! `SCM_RIGHTS`), and same-device IPC across processes is measured to work on the GPU machine.
//! The costs: a handle opens once per process (a second open of the same handle fails), and
//! the exporting process must keep the memory until every importer closed it (the group's
//! teardown barrier, [`super::NormalGroup::close`]).

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUdeviceptr, CUipcMem_flags, CUipcMemHandle};

use super::mem::DevBuf;
use crate::error::{Error, Result};

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;
const _: () = assert!(std::mem::size_of::<CUipcMemHandle>() == IPC_HANDLE_BYTES);

/// A buffer as another process maps it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    handle: [u8; IPC_HANDLE_BYTES],
    offset: u64,
    len: u64,
}

impl std::fmt::Debug for IpcExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The handle names another process's memory: show only a fingerprint.
        let sum = self
            .handle
            .iter()
            .fold(0u32, |a, b| a.rotate_left(5) ^ u32::from(*b));
        write!(
            f,
            "IpcExport(#{sum:08x}, offset {}, {} bytes)",
            self.offset, self.len
        )
    }
}

impl IpcExport {
    /// Bytes of [`IpcExport::to_bytes`].
    pub const BYTES: usize = IPC_HANDLE_BYTES + 16;

    /// Exports `buf` (memory from [`DevBuf::new`] / [`DevBuf::zeroed`]; stream-ordered
    /// buffers are refused by the driver).
    pub fn of(buf: &DevBuf) -> Result<Self> {
        buf.context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let (mut base, mut size): (CUdeviceptr, usize) = (0, 0);
        // SAFETY: `buf.ptr()` is a live allocation of the bound context; the outputs are locals.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, buf.ptr()) }
            .result()
            .map_err(Error::cuda("cuMemGetAddressRange"))?;
        let mut h = CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `base` is the start of a live cuMemAlloc allocation; `h` is a local output.
        unsafe { sys::cuIpcGetMemHandle(&mut h, base) }
            .result()
            .map_err(Error::cuda("cuIpcGetMemHandle"))?;
        Ok(Self {
            handle: h.reserved.map(|c| c as u8),
            offset: buf.ptr() - base,
            len: buf.len() as u64,
        })
    }

    /// The buffer's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Handle, offset and length, little endian.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..IPC_HANDLE_BYTES].copy_from_slice(&self.handle);
        b[IPC_HANDLE_BYTES..IPC_HANDLE_BYTES + 8].copy_from_slice(&self.offset.to_le_bytes());
        b[IPC_HANDLE_BYTES + 8..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// What [`IpcExport::to_bytes`] wrote; `None` unless exactly [`IpcExport::BYTES`].
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let b: &[u8; Self::BYTES] = b.try_into().ok()?;
        let (handle, rest) = b.split_first_chunk::<IPC_HANDLE_BYTES>()?;
        let (offset, len) = rest.split_first_chunk::<8>()?;
        Some(Self {
            handle: *handle,
            offset: u64::from_le_bytes(*offset),
            len: u64::from_le_bytes(len.try_into().ok()?),
        })
    }
}

/// Another process's buffer mapped into this one; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    /// What `cuIpcOpenMemHandle` returned (the allocation's base here).
    base: CUdeviceptr,
    ptr: u64,
    len: usize,
}

// SAFETY: the mapping is device memory addressed by an integer; every access goes through the
// driver or a kernel with the context bound, which is thread-safe.
unsafe impl Send for IpcMapping {}
// SAFETY: as above; `&IpcMapping` only exposes the address.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    /// Maps `e` (exported by another process) in `ctx`, with peer access enabled lazily when
    /// the exporter runs on another GPU.
    pub fn open(ctx: &Arc<CudaContext>, e: &IpcExport) -> Result<Self> {
        let len = e.len as usize;
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let h = CUipcMemHandle {
            reserved: e.handle.map(|b| b as std::ffi::c_char),
        };
        let mut base: CUdeviceptr = 0;
        // SAFETY: `h` holds handle bytes from another process's cuIpcGetMemHandle (the driver
        // validates them and fails on garbage); `base` is a local output.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(Error::cuda("cuIpcOpenMemHandle"))?;
        let m = Self {
            ctx: ctx.clone(),
            base,
            ptr: base + e.offset,
            len,
        };
        // The exporter's offset and length must lie in what was mapped.
        let (mut b, mut size): (CUdeviceptr, usize) = (0, 0);
        // SAFETY: `base` is a live mapping of the bound context; the outputs are locals.
        unsafe { sys::cuMemGetAddressRange_v2(&mut b, &mut size, base) }
            .result()
            .map_err(Error::cuda("cuMemGetAddressRange"))?;
        if e.offset
            .checked_add(e.len)
            .is_none_or(|end| end > size as u64)
        {
            return Err(Error::OutOfBounds {
                what: "IPC mapping",
                offset: e.offset as usize,
                len,
                size,
            });
        }
        Ok(m)
    }

    /// The buffer's address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // Kernels using it have finished: the group syncs its streams before dropping peers.
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `base` came from cuIpcOpenMemHandle in this context and is closed once.
        self.ctx
            .record_err(unsafe { sys::cuIpcCloseMemHandle(self.base) }.result());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_export_round_trips_through_its_bytes() {
        let e = IpcExport {
            handle: std::array::from_fn(|i| (i * 7 + 3) as u8),
            offset: 0x1234_5678_9abc,
            len: 1 << 33,
        };
        let b = e.to_bytes();
        assert_eq!(IpcExport::from_bytes(&b), Some(e));
        assert_eq!(IpcExport::from_bytes(&b[1..]), None);
        assert!(format!("{e:?}").starts_with("IpcExport(#"));
    }
}
