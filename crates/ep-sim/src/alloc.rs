//! A caching global allocator for the `ep` binary (kept here, in the simulator backend whose
//! owned outputs it serves, so the CLI holds no `unsafe`): large blocks freed by one benchmark
//! iteration are handed back, unchanged, to the next iteration's allocations of the same size.
//!
//! Why: `ep bench` on the simulator returns owned output tensors every call (hundreds of MiB per
//! rank at DeepEP's sizes). The system allocator returns such blocks to the kernel on free and
//! maps fresh pages on the next allocation, so every iteration would pay a page fault per 4 KiB
//! page — on a virtual machine about as much as copying the bytes twice. PyTorch, which DeepEP's
//! benchmarks run on, keeps freed device blocks in its caching allocator for the same reason.
//!
//! Rules: only blocks of at least [`MIN_CACHED`] bytes are cached, at most [`SLOTS`] of them and
//! [`MAX_CACHED_BYTES`] in all (a block that does not fit is freed at once); a request takes a
//! cached block of exactly its size and alignment (`alloc_zeroed` clears it: writing zeros
//! costs a small fraction of faulting fresh pages in). Every block comes from and finally goes
//! back to [`System`].

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;

/// Smallest block kept for reuse.
pub const MIN_CACHED: usize = 4 << 20;
/// Number of cache slots.
pub const SLOTS: usize = 1024;
/// Most bytes kept in the cache at once.
pub const MAX_CACHED_BYTES: usize = 12 << 30;

/// One cached block: address, size, alignment.
#[derive(Clone, Copy)]
struct Slot {
    addr: usize,
    size: usize,
    align: usize,
}

struct Cache {
    slots: [Option<Slot>; SLOTS],
    bytes: usize,
}

/// The caching allocator (module docs). Install with `#[global_allocator]`.
pub struct CachingAlloc {
    // std's Mutex does not allocate (futex based), so it is usable inside an allocator.
    cache: Mutex<Cache>,
}

impl CachingAlloc {
    /// An empty cache.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            cache: Mutex::new(Cache {
                slots: [None; SLOTS],
                bytes: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a cached block for `layout`, if one of exactly its size and alignment is kept.
    fn take(&self, layout: Layout) -> Option<*mut u8> {
        let mut c = self.lock();
        let i = c.slots.iter().position(|s| {
            s.is_some_and(|s| s.size == layout.size() && s.align == layout.align())
        })?;
        let s = c.slots[i].take()?;
        c.bytes -= s.size;
        Some(s.addr as *mut u8)
    }

    /// Keeps a freed block; false when the cache is full (the caller frees it).
    fn keep(&self, ptr: *mut u8, layout: Layout) -> bool {
        let mut c = self.lock();
        if c.bytes + layout.size() > MAX_CACHED_BYTES {
            return false;
        }
        let Some(i) = c.slots.iter().position(Option::is_none) else {
            return false;
        };
        c.slots[i] = Some(Slot {
            addr: ptr as usize,
            size: layout.size(),
            align: layout.align(),
        });
        c.bytes += layout.size();
        true
    }
}

/// Tunes the system allocator for benchmark runs (glibc on Linux; elsewhere a no-op): blocks
/// below 32 MiB come from the heap, which grows in 64 MiB steps and is never trimmed, instead of
/// one `mmap` each. Threads mode materialises its memory in 256 KiB pages from many threads at
/// once; with one `mmap` per page they serialise on the kernel's address-space lock and every
/// page fault waits behind them. Blocks from 32 MiB up
/// ([`ep_core::plan::low_latency::FRESH_MAPPING_BYTES`], glibc's highest threshold) are still
/// mapped afresh: ep-core's mostly empty packed arrays rely on it. Call before the threads start.
pub fn tune_system_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
        }
        // glibc's <malloc.h>.
        const M_TRIM_THRESHOLD: std::ffi::c_int = -1;
        const M_TOP_PAD: std::ffi::c_int = -2;
        const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
        // 32 MiB: the packed arrays' rule (`FRESH_MAPPING_BYTES`), which fits a c_int.
        let fresh = ep_core::plan::low_latency::FRESH_MAPPING_BYTES as std::ffi::c_int;
        for (param, value) in [
            (M_MMAP_THRESHOLD, fresh),
            (M_TOP_PAD, 64 << 20),
            (M_TRIM_THRESHOLD, std::ffi::c_int::MAX),
        ] {
            // SAFETY: `mallopt` only changes glibc's allocation policy; any value is accepted or
            // refused with 0, and no memory is touched. (Policy changes are safe at any time;
            // calling it early just makes them apply to everything.)
            let _ = unsafe { mallopt(param, value) };
        }
    }
}

impl Default for CachingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every block handed out is either fresh from `System` or a block previously allocated
// by `System` with the same size and alignment and since freed by its user (it sits in exactly
// one cache slot until taken); blocks are returned to `System` with the layout they were
// allocated with. The cache itself is behind a mutex.
unsafe impl GlobalAlloc for CachingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= MIN_CACHED
            && let Some(p) = self.take(layout)
        {
            return p;
        }
        // SAFETY: the caller's contract (non-zero size) is passed on unchanged.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() >= MIN_CACHED
            && let Some(p) = self.take(layout)
        {
            // SAFETY: `p` is a block of `layout.size()` bytes owned by the caller from now on.
            unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
            return p;
        }
        // SAFETY: as for `alloc`; fresh system pages are zero.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() >= MIN_CACHED && self.keep(ptr, layout) {
            return;
        }
        // SAFETY: `ptr` was allocated by `System` with `layout` (directly, or cached and handed
        // out again for the same layout).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` is a `System` block of `layout` (see `dealloc`); the caller guarantees
        // `new_size` is valid for `layout.align()`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_large_blocks_come_back_for_the_same_layout_only() {
        let a = CachingAlloc::new();
        let big = Layout::from_size_align(MIN_CACHED, 64).unwrap();
        let other = Layout::from_size_align(MIN_CACHED + 4096, 64).unwrap();
        // SAFETY: non-zero layouts; every block is freed with its layout.
        unsafe {
            let p = a.alloc(big);
            p.write(7);
            a.dealloc(p, big);
            let q = a.alloc(other);
            assert_ne!(p, q, "a block of another size is not reused");
            let r = a.alloc(big);
            assert_eq!(p, r, "the freed block is reused");
            assert_eq!(r.read(), 7, "reused blocks keep their bytes");
            let z = a.alloc_zeroed(big);
            assert_eq!(z.read(), 0);
            a.dealloc(q, other);
            a.dealloc(r, big);
            a.dealloc(z, big);
            // Small blocks are never cached.
            let small = Layout::from_size_align(64, 8).unwrap();
            let s = a.alloc(small);
            a.dealloc(s, small);
        }
        assert!(a.lock().bytes <= MAX_CACHED_BYTES);
    }
}
