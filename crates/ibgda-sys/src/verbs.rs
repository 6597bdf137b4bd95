//! `libibverbs.so.1`: devices, ports, GIDs, protection domains, memory registration.

use std::ffi::{CStr, c_int, c_void};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use crate::error::{Error, Result, errno};
use crate::generated::rdma_types::*;
use crate::generated::verbs::Verbs;
use crate::generated::verbs_ext::VerbsExt;
use crate::handle::DropError;
use crate::loader::{missing, open, open_path};
use crate::search::{LIBIBVERBS, SearchEnv};

/// The loaded verbs library: [`IbVerbs::raw`] holds every required entry point under its C
/// name; the wrappers below turn statuses into errors.
pub struct IbVerbs {
    /// Required entry points (rdma-core >= 1.x).
    pub raw: Verbs,
    /// Entry points of newer rdma-core (`_ibv_query_gid_ex`, `_ibv_query_gid_table` v32+,
    /// `ibv_reg_dmabuf_mr` v34+); `None` on older ones.
    pub ext: Option<VerbsExt>,
    path: PathBuf,
    /// The first failure of a handle's drop ([`IbVerbs::take_drop_error`]).
    pub(crate) drop_error: DropError,
}

impl std::fmt::Debug for IbVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbVerbs")
            .field("path", &self.path)
            .field("ext", &self.ext.is_some())
            .finish()
    }
}

/// The device array of `ibv_get_device_list`, freed on drop.
pub struct DeviceList<'a> {
    verbs: &'a IbVerbs,
    list: NonNull<*mut ibv_device>,
    len: usize,
}

impl DeviceList<'_> {
    /// The devices (valid while the list lives).
    pub fn as_slice(&self) -> &[*mut ibv_device] {
        // SAFETY: `ibv_get_device_list` returned `len` valid entries, alive until freed in drop.
        unsafe { std::slice::from_raw_parts(self.list.as_ptr(), self.len) }
    }

    /// Number of devices.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The library the list came from.
    pub(crate) fn verbs(&self) -> &IbVerbs {
        self.verbs
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        // SAFETY: the array came from ibv_get_device_list of the same library; freed once.
        unsafe { self.verbs.raw.ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// `ENOSYS` on Linux.
const ENOSYS: i32 = 38;

fn status(op: &'static str, code: c_int) -> Result<()> {
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

impl IbVerbs {
    /// Searches and loads `libibverbs.so.1`.
    pub fn load(explicit: Option<&Path>) -> Result<Self> {
        Self::load_with(explicit, &SearchEnv::from_process(&LIBIBVERBS))
    }

    /// [`IbVerbs::load`] with a given search environment.
    pub fn load_with(explicit: Option<&Path>, env: &SearchEnv) -> Result<Self> {
        let (lib, path) = open(&LIBIBVERBS, explicit, env)?;
        // SAFETY: the generated signatures come from the rdma-core headers of this ABI
        // (libibverbs.so.1, stable since rdma-core 13).
        let raw = unsafe { Verbs::from_library(lib) }.map_err(missing(&path))?;
        // SAFETY: as above, for the newer entry points; absent ones leave `ext` empty.
        let ext = open_path(&path)
            .ok()
            .and_then(|l| unsafe { VerbsExt::from_library(l) }.ok());
        Ok(Self {
            raw,
            ext,
            path,
            drop_error: DropError::default(),
        })
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The first error a handle's drop met (closing a [`crate::Context`], freeing a
    /// [`crate::ProtectionDomain`]) since the last call, if any.
    pub fn take_drop_error(&self) -> Option<Error> {
        self.drop_error.take()
    }

    fn ext(&self, symbol: &'static str) -> Result<&VerbsExt> {
        self.ext.as_ref().ok_or_else(|| Error::Unsupported {
            symbol,
            path: self.path.clone(),
        })
    }

    /// `ibv_get_device_list`.
    pub fn get_device_list(&self) -> Result<DeviceList<'_>> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        let list = unsafe { self.raw.ibv_get_device_list(&mut n) };
        let list = NonNull::new(list).ok_or_else(|| match errno() {
            e if e == ENOSYS => Error::NoRdmaSubsystem,
            errno => Error::Null {
                op: "ibv_get_device_list",
                errno,
            },
        })?;
        Ok(DeviceList {
            verbs: self,
            list,
            len: usize::try_from(n).unwrap_or(0),
        })
    }

    /// `ibv_get_device_name`.
    ///
    /// # Safety
    /// `dev` comes from a live [`DeviceList`].
    pub unsafe fn get_device_name(&self, dev: *mut ibv_device) -> String {
        // SAFETY: forwarded contract; the name is a NUL-terminated string owned by the device.
        let p = unsafe { self.raw.ibv_get_device_name(dev) };
        if p.is_null() {
            return String::new();
        }
        // SAFETY: non-NULL, NUL-terminated (rdma-core's `name[IBV_SYSFS_NAME_MAX]`).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `ibv_get_device_guid`, in host byte order.
    ///
    /// # Safety
    /// `dev` comes from a live [`DeviceList`].
    pub unsafe fn get_device_guid(&self, dev: *mut ibv_device) -> u64 {
        // SAFETY: forwarded contract.
        u64::from_be(unsafe { self.raw.ibv_get_device_guid(dev) })
    }

    /// `ibv_open_device`.
    ///
    /// # Safety
    /// `dev` comes from a live [`DeviceList`]; close the context with
    /// [`IbVerbs::close_device`].
    pub unsafe fn open_device(&self, dev: *mut ibv_device) -> Result<NonNull<ibv_context>> {
        // SAFETY: forwarded contract.
        let ctx = unsafe { self.raw.ibv_open_device(dev) };
        NonNull::new(ctx).ok_or(Error::Null {
            op: "ibv_open_device",
            errno: errno(),
        })
    }

    /// `ibv_close_device`.
    ///
    /// # Safety
    /// `ctx` is open and nothing allocated from it is still in use.
    pub unsafe fn close_device(&self, ctx: NonNull<ibv_context>) -> Result<()> {
        // SAFETY: forwarded contract.
        status("ibv_close_device", unsafe {
            self.raw.ibv_close_device(ctx.as_ptr())
        })
    }

    /// `ibv_query_device`.
    ///
    /// # Safety
    /// `ctx` is open.
    pub unsafe fn query_device(&self, ctx: NonNull<ibv_context>) -> Result<ibv_device_attr> {
        let mut attr = ibv_device_attr::default();
        // SAFETY: forwarded contract; `attr` is a valid out-parameter.
        status("ibv_query_device", unsafe {
            self.raw.ibv_query_device(ctx.as_ptr(), &mut attr)
        })?;
        Ok(attr)
    }

    /// `ibv_query_port` (the exported entry point, which fills the fields every rdma-core has:
    /// state, MTU, GID table length, link layer, ...; the rest stays zero).
    ///
    /// # Safety
    /// `ctx` is open.
    pub unsafe fn query_port(&self, ctx: NonNull<ibv_context>, port: u8) -> Result<ibv_port_attr> {
        let mut attr = ibv_port_attr::default();
        // SAFETY: forwarded contract; the full struct is at least as large as the compat
        // struct the exported symbol writes.
        let code = unsafe {
            self.raw
                .ibv_query_port(ctx.as_ptr(), port, (&mut attr as *mut ibv_port_attr).cast())
        };
        status("ibv_query_port", code)?;
        Ok(attr)
    }

    /// `ibv_query_gid`.
    ///
    /// # Safety
    /// `ctx` is open.
    pub unsafe fn query_gid(
        &self,
        ctx: NonNull<ibv_context>,
        port: u8,
        index: i32,
    ) -> Result<ibv_gid> {
        let mut gid = ibv_gid::default();
        // SAFETY: forwarded contract; `gid` is a valid out-parameter.
        status("ibv_query_gid", unsafe {
            self.raw.ibv_query_gid(ctx.as_ptr(), port, index, &mut gid)
        })?;
        Ok(gid)
    }

    /// `ibv_query_gid_ex` (GID with its type: IB, RoCE v1, RoCE v2).
    ///
    /// # Safety
    /// `ctx` is open.
    pub unsafe fn query_gid_ex(
        &self,
        ctx: NonNull<ibv_context>,
        port: u32,
        index: u32,
    ) -> Result<ibv_gid_entry> {
        let ext = self.ext("_ibv_query_gid_ex")?;
        let mut e = ibv_gid_entry::default();
        // SAFETY: forwarded contract; `e` is a valid out-parameter of the size passed.
        let code = unsafe {
            ext._ibv_query_gid_ex(
                ctx.as_ptr(),
                port,
                index,
                &mut e,
                0,
                size_of::<ibv_gid_entry>(),
            )
        };
        status("ibv_query_gid_ex", code)?;
        Ok(e)
    }

    /// `ibv_query_gid_table`: every valid GID of every port.
    ///
    /// # Safety
    /// `ctx` is open.
    pub unsafe fn query_gid_table(
        &self,
        ctx: NonNull<ibv_context>,
        max_entries: usize,
    ) -> Result<Vec<ibv_gid_entry>> {
        let ext = self.ext("_ibv_query_gid_table")?;
        let mut v = vec![ibv_gid_entry::default(); max_entries];
        // SAFETY: forwarded contract; `v` holds `max_entries` entries of the size passed.
        let n = unsafe {
            ext._ibv_query_gid_table(
                ctx.as_ptr(),
                v.as_mut_ptr(),
                max_entries,
                0,
                size_of::<ibv_gid_entry>(),
            )
        };
        if n < 0 {
            return Err(Error::Call {
                op: "ibv_query_gid_table",
                code: n as i64,
                errno: errno(),
            });
        }
        v.truncate(n as usize);
        Ok(v)
    }

    /// `ibv_alloc_pd`.
    ///
    /// # Safety
    /// `ctx` is open; free the PD with [`IbVerbs::dealloc_pd`] before closing it.
    pub unsafe fn alloc_pd(&self, ctx: NonNull<ibv_context>) -> Result<NonNull<ibv_pd>> {
        // SAFETY: forwarded contract.
        NonNull::new(unsafe { self.raw.ibv_alloc_pd(ctx.as_ptr()) }).ok_or(Error::Null {
            op: "ibv_alloc_pd",
            errno: errno(),
        })
    }

    /// `ibv_dealloc_pd`.
    ///
    /// # Safety
    /// No MR or QP of `pd` remains.
    pub unsafe fn dealloc_pd(&self, pd: NonNull<ibv_pd>) -> Result<()> {
        // SAFETY: forwarded contract.
        status("ibv_dealloc_pd", unsafe {
            self.raw.ibv_dealloc_pd(pd.as_ptr())
        })
    }

    /// `ibv_reg_mr`. On a GPU address this succeeds only with a peer-memory client
    /// (`nvidia-peermem`); `EFAULT`/`EINVAL` otherwise.
    ///
    /// # Safety
    /// `pd` is live; `[addr, addr + len)` stays mapped until [`IbVerbs::dereg_mr`].
    pub unsafe fn reg_mr(
        &self,
        pd: NonNull<ibv_pd>,
        addr: *mut c_void,
        len: usize,
        access: u32,
    ) -> Result<NonNull<ibv_mr>> {
        // SAFETY: forwarded contract.
        let mr = unsafe { self.raw.ibv_reg_mr(pd.as_ptr(), addr, len, access as c_int) };
        NonNull::new(mr).ok_or(Error::Null {
            op: "ibv_reg_mr",
            errno: errno(),
        })
    }

    /// `ibv_reg_dmabuf_mr`: registers memory exported as a dma-buf (for GPU memory:
    /// `cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`).
    ///
    /// # Safety
    /// `pd` is live; `fd` is a dma-buf covering `[offset, offset + len)`, kept until
    /// [`IbVerbs::dereg_mr`].
    pub unsafe fn reg_dmabuf_mr(
        &self,
        pd: NonNull<ibv_pd>,
        offset: u64,
        len: usize,
        iova: u64,
        fd: i32,
        access: u32,
    ) -> Result<NonNull<ibv_mr>> {
        let ext = self.ext("ibv_reg_dmabuf_mr")?;
        // SAFETY: forwarded contract.
        let mr =
            unsafe { ext.ibv_reg_dmabuf_mr(pd.as_ptr(), offset, len, iova, fd, access as c_int) };
        NonNull::new(mr).ok_or(Error::Null {
            op: "ibv_reg_dmabuf_mr",
            errno: errno(),
        })
    }

    /// `ibv_dereg_mr`.
    ///
    /// # Safety
    /// `mr` is registered and no work request uses it.
    pub unsafe fn dereg_mr(&self, mr: NonNull<ibv_mr>) -> Result<()> {
        // SAFETY: forwarded contract.
        status("ibv_dereg_mr", unsafe {
            self.raw.ibv_dereg_mr(mr.as_ptr())
        })
    }
}
