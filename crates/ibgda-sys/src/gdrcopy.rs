//! `libgdrapi.so.2` (GDRCopy): CPU mappings of GPU memory, which CPU-assisted IBGDA needs.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use crate::error::{Error, Result, errno};
use crate::generated::gdr::{Gdr, gdr, gdr_mh_t};
use crate::handle::DropError;
use crate::loader::{missing, open};
use crate::search::{LIBGDRAPI, SearchEnv};

/// The loaded GDRCopy library.
pub struct GdrApi {
    /// Entry points under their C names.
    pub raw: Gdr,
    path: PathBuf,
    /// The first failure of a handle's drop ([`GdrApi::take_drop_error`]).
    pub(crate) drop_error: DropError,
}

impl std::fmt::Debug for GdrApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GdrApi").field("path", &self.path).finish()
    }
}

fn status(op: &'static str, code: i32) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::Call {
            op,
            code: code.into(),
            errno: errno(),
        })
    }
}

impl GdrApi {
    /// Searches and loads `libgdrapi.so.2`.
    pub fn load(explicit: Option<&Path>) -> Result<Self> {
        Self::load_with(explicit, &SearchEnv::from_process(&LIBGDRAPI))
    }

    /// [`GdrApi::load`] with a given search environment.
    pub fn load_with(explicit: Option<&Path>, env: &SearchEnv) -> Result<Self> {
        let (lib, path) = open(&LIBGDRAPI, explicit, env)?;
        // SAFETY: signatures of the GDRCopy 2.x ABI (gen/gdrapi_abi.h).
        let raw = unsafe { Gdr::from_library(lib) }.map_err(missing(&path))?;
        Ok(Self {
            raw,
            path,
            drop_error: DropError::default(),
        })
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The first error a [`crate::GdrHandle`]'s drop met since the last call, if any.
    pub fn take_drop_error(&self) -> Option<Error> {
        self.drop_error.take()
    }

    /// `gdr_runtime_get_version`: (major, minor) of libgdrapi.
    pub fn runtime_version(&self) -> (i32, i32) {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out-pointers; needs no driver.
        unsafe { self.raw.gdr_runtime_get_version(&mut a, &mut b) };
        (a, b)
    }

    /// `gdr_open`: connects to the gdrdrv kernel module. [`Error::GdrOpen`] when it is absent.
    /// [`crate::GdrHandle::open`] is the owning form, closed on drop.
    pub fn open(&self) -> Result<NonNull<gdr>> {
        // SAFETY: no arguments; returns NULL on failure.
        NonNull::new(unsafe { self.raw.gdr_open() }).ok_or(Error::GdrOpen)
    }

    /// `gdr_close`.
    ///
    /// # Safety
    /// `g` came from [`GdrApi::open`]; every buffer pinned through it is unpinned.
    pub unsafe fn close(&self, g: NonNull<gdr>) -> Result<()> {
        // SAFETY: forwarded contract.
        status("gdr_close", unsafe { self.raw.gdr_close(g.as_ptr()) })
    }

    /// `gdr_driver_get_version`: (major, minor) of gdrdrv.
    ///
    /// # Safety
    /// `g` is open.
    pub unsafe fn driver_version(&self, g: NonNull<gdr>) -> Result<(i32, i32)> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: forwarded contract; valid out-pointers.
        status("gdr_driver_get_version", unsafe {
            self.raw.gdr_driver_get_version(g.as_ptr(), &mut a, &mut b)
        })?;
        Ok((a, b))
    }

    /// `gdr_pin_buffer` (GPU-page aligned `addr`, 64 KiB).
    ///
    /// # Safety
    /// `g` is open; `[addr, addr + size)` is device memory alive until unpinned.
    pub unsafe fn pin_buffer(&self, g: NonNull<gdr>, addr: u64, size: usize) -> Result<gdr_mh_t> {
        let mut mh = gdr_mh_t { h: 0 };
        // SAFETY: forwarded contract; token 0 and VA space 0 as GDRCopy documents.
        let code = unsafe {
            self.raw
                .gdr_pin_buffer(g.as_ptr(), addr as _, size, 0, 0, &mut mh)
        };
        status("gdr_pin_buffer", code)?;
        Ok(mh)
    }

    /// `gdr_unpin_buffer`.
    ///
    /// # Safety
    /// `mh` is pinned through `g` and unmapped.
    pub unsafe fn unpin_buffer(&self, g: NonNull<gdr>, mh: gdr_mh_t) -> Result<()> {
        // SAFETY: forwarded contract.
        status("gdr_unpin_buffer", unsafe {
            self.raw.gdr_unpin_buffer(g.as_ptr(), mh)
        })
    }

    /// `gdr_map`: a CPU mapping of a pinned buffer.
    ///
    /// # Safety
    /// `mh` is pinned through `g` with at least `size` bytes.
    pub unsafe fn map(
        &self,
        g: NonNull<gdr>,
        mh: gdr_mh_t,
        size: usize,
    ) -> Result<NonNull<c_void>> {
        let mut va = std::ptr::null_mut();
        // SAFETY: forwarded contract; `va` is a valid out-pointer.
        status("gdr_map", unsafe {
            self.raw.gdr_map(g.as_ptr(), mh, &mut va, size)
        })?;
        NonNull::new(va).ok_or(Error::Null {
            op: "gdr_map",
            errno: errno(),
        })
    }

    /// `gdr_unmap`.
    ///
    /// # Safety
    /// `va` came from [`GdrApi::map`] of `mh` with `size`, and is no longer accessed.
    pub unsafe fn unmap(
        &self,
        g: NonNull<gdr>,
        mh: gdr_mh_t,
        va: NonNull<c_void>,
        size: usize,
    ) -> Result<()> {
        // SAFETY: forwarded contract.
        status("gdr_unmap", unsafe {
            self.raw.gdr_unmap(g.as_ptr(), mh, va.as_ptr(), size)
        })
    }
}
