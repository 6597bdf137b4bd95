//! Device and host-mapped memory owned by the backend: [`DevBuf`] (`cuMemAlloc`, so it can be
//! exported with `cuIpcGetMemHandle`, unlike pool memory, or stream-ordered from a [`MemPool`])
//! and [`HostMapped`] (pinned host memory the kernels write: error records, mailboxes).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaContext, CudaStream, result, sys};

use crate::error::{Error, Result};

/// Device memory, freed on drop.
#[derive(Debug)]
pub struct DevBuf {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
    bytes: usize,
    /// Stream-ordered memory (`cuMemAllocFromPoolAsync`): freed on this stream.
    stream: Option<Arc<CudaStream>>,
    /// Memory another allocator owns (an NVSHMEM symmetric buffer): kept alive by this handle,
    /// released by its owner's drop, never by `cuMemFree`.
    owner: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

// SAFETY: the allocation is plain device memory addressed by an integer; every access goes
// through the driver with the context bound, which is thread-safe.
unsafe impl Send for DevBuf {}
// SAFETY: as above; `&DevBuf` only exposes the address and driver copies.
unsafe impl Sync for DevBuf {}

impl DevBuf {
    /// `bytes` of device memory (uninitialised).
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // SAFETY: a plain allocation in the bound context; the memory is only used as bytes.
        let ptr =
            unsafe { result::malloc_sync(bytes.max(16)) }.map_err(Error::cuda("cuMemAlloc"))?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            bytes,
            stream: None,
            owner: None,
        })
    }

    /// A view of `bytes` at `ptr` that another allocator owns (`owner`, e.g. an NVSHMEM
    /// symmetric buffer, held until this handle drops; never freed here).
    ///
    /// # Safety
    /// `[ptr, ptr + bytes)` is device memory of `ctx` that stays allocated while `owner` lives.
    pub unsafe fn foreign(
        ctx: &Arc<CudaContext>,
        ptr: u64,
        bytes: usize,
        owner: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Self {
        Self {
            ctx: ctx.clone(),
            ptr,
            bytes,
            stream: None,
            owner: Some(owner),
        }
    }

    /// `bytes` of stream-ordered device memory from `pool` (`cuMemAllocFromPoolAsync` on
    /// `stream`, freed on it when dropped): for per-call tensors, whose allocation and release
    /// must not synchronise the device. Usable by work on `stream` (or ordered after it); not
    /// exportable to other processes.
    pub fn on_stream(pool: &MemPool, stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        let ctx = stream.context().clone();
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: a stream-ordered allocation from a live pool of this context's device on a
        // live stream of this context.
        unsafe {
            sys::cuMemAllocFromPoolAsync(&mut ptr, bytes.max(16), pool.pool, stream.cu_stream())
        }
        .result()
        .map_err(Error::cuda("cuMemAllocFromPoolAsync"))?;
        Ok(Self {
            ctx,
            ptr,
            bytes,
            stream: Some(stream.clone()),
            owner: None,
        })
    }

    /// `bytes` of zeroed device memory.
    pub fn zeroed(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let b = Self::new(ctx, bytes)?;
        // SAFETY: the range is this allocation.
        unsafe { result::memset_d8_sync(b.ptr, 0, b.bytes.max(16)) }
            .map_err(Error::cuda("cuMemsetD8"))?;
        Ok(b)
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The context it lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn check(&self, off: usize, len: usize) -> Result<()> {
        if off.checked_add(len).is_none_or(|end| end > self.bytes) {
            return Err(Error::OutOfBounds {
                what: "device buffer",
                offset: off,
                len,
                size: self.bytes,
            });
        }
        Ok(())
    }

    /// Enqueues `memset(value)` of `[off, off + len)` on `stream`.
    pub fn memset_async(
        &self,
        stream: &CudaStream,
        value: u8,
        off: usize,
        len: usize,
    ) -> Result<()> {
        self.check(off, len)?;
        // SAFETY: the range lies in this allocation (checked); the stream belongs to its context.
        unsafe { result::memset_d8_async(self.ptr + off as u64, value, len, stream.cu_stream()) }
            .map_err(Error::cuda("cuMemsetD8Async"))
    }

    /// Enqueues a device-to-device copy of the first `len` bytes of `src` to the first `len`
    /// bytes of this buffer on `stream` (the copy engine: the yardstick of a phase's bytes).
    pub fn copy_from_async(&self, src: &DevBuf, len: usize, stream: &CudaStream) -> Result<()> {
        self.check(0, len)?;
        src.check(0, len)?;
        self.ctx
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // SAFETY: both ranges lie in their allocations (checked), both of this context; the
        // stream belongs to it.
        unsafe { result::memcpy_dtod_async(self.ptr, src.ptr, len, stream.cu_stream()) }
            .map_err(Error::cuda("cuMemcpyDtoDAsync"))
    }

    /// Copies `src` to `[off, off + src.len())`; returns when the bytes are in device memory.
    pub fn write(&self, off: usize, src: &[u8]) -> Result<()> {
        self.check(off, src.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // SAFETY: the destination range lies in this allocation (checked), `src` is host memory.
        unsafe { result::memcpy_htod_sync(self.ptr + off as u64, src) }
            .map_err(Error::cuda("cuMemcpyHtoD"))?;
        // From pageable memory cuMemcpyHtoD may return once the bytes are staged, before the DMA
        // lands; it runs on the legacy stream, which the non-blocking rank streams do not wait
        // for. Wait for it, so that a kernel launched after `write` returns reads the new bytes.
        // SAFETY: the null stream is the context's legacy stream (the context is current).
        unsafe { result::stream::synchronize(std::ptr::null_mut()) }
            .map_err(Error::cuda("cuStreamSynchronize(legacy)"))
    }

    /// Copies `[off, off + dst.len())` into `dst` (synchronous). Stream-ordered memory (a
    /// call's outputs) is read after its stream's work so far: the copy runs on the legacy
    /// stream, which the non-blocking rank streams do not order against. Other memory (the
    /// arenas, whose rows the outputs view) is read as it is: sync the producing calls first.
    pub fn read(&self, off: usize, dst: &mut [u8]) -> Result<()> {
        self.check(off, dst.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        if let Some(s) = &self.stream {
            s.synchronize()
                .map_err(Error::cuda("cuStreamSynchronize"))?;
        }
        // SAFETY: the source range lies in this allocation (checked), `dst` is host memory.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + off as u64) }
            .map_err(Error::cuda("cuMemcpyDtoH"))
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.owner.is_some() {
            return; // its owner frees it
        }
        // Kernels using it have finished: owners sync their streams before dropping buffers
        // (and cuMemFree itself waits for work using the memory).
        self.ctx.record_err(self.ctx.bind_to_thread());
        match &self.stream {
            // SAFETY: `ptr` came from cuMemAllocFromPoolAsync on this stream and is freed once, after
            // the work enqueued on it so far.
            Some(s) => self
                .ctx
                .record_err(unsafe { result::free_async(self.ptr, s.cu_stream()) }),
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
            None => self.ctx.record_err(unsafe { result::free_sync(self.ptr) }),
        }
    }
}

/// A stream-ordered memory pool of one device that keeps what is freed into it (release
/// threshold `u64::MAX`). The device's default pool has threshold 0: it hands its memory back at
/// every synchronisation, so a per-call output of tens of MB (a combine's `[T, H]` rows) is
/// mapped again on each call, on the host's critical path. A pool of its own leaves the
/// process's default pool as the user set it.
#[derive(Debug)]
pub struct MemPool {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
}

// SAFETY: a driver handle, used only through the driver (thread-safe) with the context bound.
unsafe impl Send for MemPool {}
// SAFETY: as above.
unsafe impl Sync for MemPool {}

impl MemPool {
    /// A pool of device memory on `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // SAFETY: every field of CUmemPoolProps is an integer, a pointer or an array of bytes,
        // for which zero is valid (no handle types, no size limit, no security attributes).
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = ctx.ordinal() as i32;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `props` is fully initialised; `pool` receives the handle.
        unsafe { sys::cuMemPoolCreate(&mut pool, &props) }
            .result()
            .map_err(Error::cuda("cuMemPoolCreate"))?;
        let out = Self {
            ctx: ctx.clone(),
            pool,
        };
        let mut keep: u64 = u64::MAX;
        // SAFETY: the release threshold is a u64 attribute; `keep` outlives the call.
        unsafe {
            sys::cuMemPoolSetAttribute(
                out.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut keep).cast(),
            )
        }
        .result()
        .map_err(Error::cuda("cuMemPoolSetAttribute(RELEASE_THRESHOLD)"))?;
        Ok(out)
    }
}

impl Drop for MemPool {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: the pool is destroyed once; allocations still outstanding keep its memory
        // until they are freed (the driver defers the release).
        self.ctx
            .record_err(unsafe { sys::cuMemPoolDestroy(self.pool) }.result());
    }
}

/// Pinned host memory holding one `T`, mapped into the device's address space: kernels write
/// it, the host reads it with volatile loads.
#[derive(Debug)]
pub struct HostMapped<T: Copy + Default> {
    ctx: Arc<CudaContext>,
    host: *mut T,
    dev: u64,
}

// SAFETY: pinned memory owned by this value; the host accesses it only through volatile
// reads/writes of whole words (the device writes it concurrently by design).
unsafe impl<T: Copy + Default> Send for HostMapped<T> {}
// SAFETY: as above.
unsafe impl<T: Copy + Default> Sync for HostMapped<T> {}

impl<T: Copy + Default> HostMapped<T> {
    /// A zeroed `T` (`T::default()` must be all-zero words, as the generated structs are).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: allocates size_of::<T>() pinned bytes; written below before any use.
        let host = unsafe { result::malloc_host(std::mem::size_of::<T>(), flags) }
            .map_err(Error::cuda("cuMemHostAlloc"))? as *mut T;
        // SAFETY: `host` is a fresh, aligned allocation of one T.
        unsafe { host.write_volatile(T::default()) };
        let mut dev: CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP in this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }
            .result()
            .map_err(Error::cuda("cuMemHostGetDevicePointer"))?;
        Ok(Self {
            ctx: ctx.clone(),
            host,
            dev,
        })
    }

    /// The device address of the `T`.
    pub fn dev_ptr(&self) -> u64 {
        self.dev
    }

    /// A volatile snapshot (the device may be writing it: read a tag word first, then the rest).
    pub fn read(&self) -> T {
        // SAFETY: `host` points to a live, aligned T for the lifetime of self.
        unsafe { self.host.read_volatile() }
    }

    /// Overwrites it (no kernel may be writing it at the time).
    pub fn write(&self, v: T) {
        // SAFETY: as in `read`.
        unsafe { self.host.write_volatile(v) }
    }

    /// A volatile read of the `u64` word at byte offset `off` (a tag the device writes last).
    pub fn word(&self, off: usize) -> u64 {
        assert!(off + 8 <= std::mem::size_of::<T>() && off.is_multiple_of(8));
        // SAFETY: in bounds and 8-aligned (asserted; T is made of u64 words).
        unsafe { (self.host.cast::<u8>().add(off) as *const u64).read_volatile() }
    }
}

impl<T: Copy + Default> Drop for HostMapped<T> {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `host` came from cuMemHostAlloc and is freed once.
        self.ctx
            .record_err(unsafe { result::free_host(self.host.cast()) });
    }
}
