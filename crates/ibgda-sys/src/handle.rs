//! Safe owning handles over the raw wrappers, rust-ibverbs style: a handle is opened by a
//! constructor, closed in `Drop`, borrows what it was made from (so teardown follows dependency
//! order: the protection domain, then the context, then the device list and the library), and
//! gives its raw pointer through `as_raw()` for everything the safe surface does not cover. Failures in `Drop` are recorded on the library
//! ([`IbVerbs::take_drop_error`], [`GdrApi::take_drop_error`]), not lost and never a panic.

use std::marker::PhantomData;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::generated::gdr::gdr;
use crate::generated::rdma_types::*;
use crate::{DeviceList, GdrApi, IbVerbs, Mlx5Dv};

/// The first failure of a handle's `Drop`, kept until taken (cudarc's `record_err`).
#[derive(Debug, Default)]
pub(crate) struct DropError(Mutex<Option<Error>>);

impl DropError {
    /// Keeps `r`'s error unless an earlier one is kept already.
    pub(crate) fn record(&self, r: Result<()>) {
        if let Err(e) = r {
            // A poisoned lock still holds a usable slot; a drop must not panic.
            let mut slot = self.0.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(e);
        }
    }

    /// The kept error, if any, leaving the slot empty.
    pub(crate) fn take(&self) -> Option<Error> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl ibv_gid {
    /// The 16 bytes of the GID (network order), as `ibv_gid.raw` holds them.
    pub fn bytes(&self) -> [u8; 16] {
        // SAFETY: both members of the union are plain bytes of the same 16-byte size (size
        // asserted in lib.rs), so any value is a valid `raw` view.
        unsafe { self.raw }
    }
}

impl DeviceList<'_> {
    /// The devices, as handles borrowing the list.
    pub fn iter(&self) -> impl Iterator<Item = Device<'_>> + '_ {
        self.as_slice().iter().filter_map(|&dev| {
            Some(Device {
                verbs: self.verbs(),
                dev: NonNull::new(dev)?,
                _list: PhantomData,
            })
        })
    }
}

/// One device of a live [`DeviceList`] (`struct ibv_device *`); valid while the list lives.
#[derive(Clone, Copy)]
pub struct Device<'l> {
    verbs: &'l IbVerbs,
    dev: NonNull<ibv_device>,
    _list: PhantomData<&'l DeviceList<'l>>,
}

impl std::fmt::Debug for Device<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name())
            .finish()
    }
}

impl<'l> Device<'l> {
    /// `ibv_get_device_name`.
    pub fn name(&self) -> String {
        // SAFETY: `dev` comes from the list this handle borrows, which is alive.
        unsafe { self.verbs.get_device_name(self.dev.as_ptr()) }
    }

    /// `ibv_get_device_guid`, in host byte order.
    pub fn guid(&self) -> u64 {
        // SAFETY: as in `name`.
        unsafe { self.verbs.get_device_guid(self.dev.as_ptr()) }
    }

    /// `ibv_open_device`: a context closed on drop.
    pub fn open(&self) -> Result<Context<'l>> {
        // SAFETY: as in `name`; the context is closed once, by `Context`'s drop.
        let ctx = unsafe { self.verbs.open_device(self.dev.as_ptr()) }?;
        Ok(Context {
            verbs: self.verbs,
            ctx,
            _device: PhantomData,
        })
    }

    /// `mlx5dv_is_supported` (`mlx5` loaded from the same rdma-core as the list).
    pub fn is_mlx5(&self, mlx5: &Mlx5Dv) -> bool {
        // SAFETY: as in `name`.
        unsafe { mlx5.is_supported(self.dev.as_ptr()) }
    }

    /// `mlx5dv_open_device` with DevX (see [`Mlx5Dv::open_device_devx`]): a context closed on
    /// drop.
    pub fn open_devx(&self, mlx5: &Mlx5Dv) -> Result<Context<'l>> {
        // SAFETY: as in `name`; the context is closed once, by `Context`'s drop
        // (`ibv_close_device` closes mlx5dv contexts too).
        let ctx = unsafe { mlx5.open_device_devx(self.dev.as_ptr()) }?;
        Ok(Context {
            verbs: self.verbs,
            ctx,
            _device: PhantomData,
        })
    }

    /// The raw `struct ibv_device *`, valid while the list lives.
    pub fn as_raw(&self) -> *mut ibv_device {
        self.dev.as_ptr()
    }
}

/// An open device context (`struct ibv_context *`), closed with `ibv_close_device` on drop.
///
/// It borrows the device list (and through it the library), so it cannot outlive them:
///
/// ```compile_fail,E0597
/// let verbs = ibgda_sys::IbVerbs::load(None)?;
/// let ctx = {
///     let list = verbs.get_device_list()?;
///     list.iter().next().expect("a device").open()?
/// }; // error: `list` dropped while still borrowed
/// # drop(ctx);
/// # Ok::<(), ibgda_sys::Error>(())
/// ```
pub struct Context<'l> {
    verbs: &'l IbVerbs,
    ctx: NonNull<ibv_context>,
    _device: PhantomData<Device<'l>>,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("ctx", &self.ctx).finish()
    }
}

impl Context<'_> {
    /// `ibv_query_device`.
    pub fn query_device(&self) -> Result<ibv_device_attr> {
        // SAFETY: the context is open while `self` lives.
        unsafe { self.verbs.query_device(self.ctx) }
    }

    /// `ibv_query_port` (see [`IbVerbs::query_port`]).
    pub fn query_port(&self, port: u8) -> Result<ibv_port_attr> {
        // SAFETY: as in `query_device`.
        unsafe { self.verbs.query_port(self.ctx, port) }
    }

    /// `ibv_query_gid`.
    pub fn query_gid(&self, port: u8, index: i32) -> Result<ibv_gid> {
        // SAFETY: as in `query_device`.
        unsafe { self.verbs.query_gid(self.ctx, port, index) }
    }

    /// `ibv_query_gid_ex` (rdma-core v32+; [`Error::Unsupported`] before).
    pub fn query_gid_ex(&self, port: u32, index: u32) -> Result<ibv_gid_entry> {
        // SAFETY: as in `query_device`.
        unsafe { self.verbs.query_gid_ex(self.ctx, port, index) }
    }

    /// `ibv_query_gid_table` (rdma-core v32+; [`Error::Unsupported`] before).
    pub fn query_gid_table(&self, max_entries: usize) -> Result<Vec<ibv_gid_entry>> {
        // SAFETY: as in `query_device`.
        unsafe { self.verbs.query_gid_table(self.ctx, max_entries) }
    }

    /// `ibv_alloc_pd`: a protection domain freed on drop, before this context closes.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain<'_>> {
        // SAFETY: as in `query_device`; the PD is freed once, by `ProtectionDomain`'s drop,
        // which the borrow orders before this context's.
        let pd = unsafe { self.verbs.alloc_pd(self.ctx) }?;
        Ok(ProtectionDomain {
            verbs: self.verbs,
            pd,
            _ctx: PhantomData,
        })
    }

    /// The raw `struct ibv_context *`, open while `self` lives. Whatever is allocated from it
    /// through the pointer must be freed before `self` drops.
    pub fn as_raw(&self) -> NonNull<ibv_context> {
        self.ctx
    }
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // SAFETY: opened by `Device::open`/`open_devx` and closed only here; every protection
        // domain borrowed from it has dropped (the borrow checker orders them), and the safe
        // surface allocates nothing else from it.
        let r = unsafe { self.verbs.close_device(self.ctx) };
        self.verbs.drop_error.record(r);
    }
}

/// A protection domain (`struct ibv_pd *`), freed with `ibv_dealloc_pd` on drop.
///
/// It borrows its context, so it cannot outlive it:
///
/// ```compile_fail,E0597
/// let verbs = ibgda_sys::IbVerbs::load(None)?;
/// let list = verbs.get_device_list()?;
/// let dev = list.iter().next().expect("a device");
/// let pd = {
///     let ctx = dev.open()?;
///     ctx.alloc_pd()?
/// }; // error: `ctx` dropped while still borrowed
/// # drop(pd);
/// # Ok::<(), ibgda_sys::Error>(())
/// ```
pub struct ProtectionDomain<'c> {
    verbs: &'c IbVerbs,
    pd: NonNull<ibv_pd>,
    _ctx: PhantomData<&'c Context<'c>>,
}

impl std::fmt::Debug for ProtectionDomain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("pd", &self.pd)
            .finish()
    }
}

impl ProtectionDomain<'_> {
    /// Whether `ibv_reg_mr` accepts `[addr, addr + len)`: registers and deregisters at once.
    /// On a GPU address this succeeds only with a peer-memory client (`nvidia-peermem`).
    ///
    /// Safe because the region lives only inside this call: the kernel checks the range (an
    /// unmapped one is `EFAULT`), nothing is read or written through it, and no queue pair of
    /// this domain exists for a peer to reach it (the safe surface creates none).
    pub fn try_register(&self, addr: u64, len: usize, access: u32) -> Result<()> {
        // SAFETY: the range only needs to stay mapped until the deregistration just below,
        // and the kernel refuses one that is not mapped.
        let mr = unsafe {
            self.verbs
                .reg_mr(self.pd, addr as *mut std::ffi::c_void, len, access)
        }?;
        // SAFETY: `mr` was just registered and no work request uses it.
        unsafe { self.verbs.dereg_mr(mr) }
    }

    /// Whether `ibv_reg_dmabuf_mr` accepts `[offset, offset + len)` of the dma-buf `fd` at
    /// `iova` (rdma-core v34+; [`Error::Unsupported`] before): registers and deregisters at
    /// once, safe for the reasons of [`ProtectionDomain::try_register`]; `fd` is borrowed for
    /// the whole call.
    pub fn try_register_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: u32,
    ) -> Result<()> {
        // SAFETY: `fd` stays open for the whole call, past the deregistration just below; the
        // kernel checks that it is a dma-buf covering the range.
        let mr = unsafe {
            self.verbs
                .reg_dmabuf_mr(self.pd, offset, len, iova, fd.as_raw_fd(), access)
        }?;
        // SAFETY: `mr` was just registered and no work request uses it.
        unsafe { self.verbs.dereg_mr(mr) }
    }

    /// The raw `struct ibv_pd *`, live while `self` lives. Every MR or QP made from it through
    /// the pointer must be destroyed before `self` drops.
    pub fn as_raw(&self) -> NonNull<ibv_pd> {
        self.pd
    }
}

impl Drop for ProtectionDomain<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated by `Context::alloc_pd` and freed only here; the safe surface leaves
        // no MR or QP on it (`try_register*` deregister before returning).
        let r = unsafe { self.verbs.dealloc_pd(self.pd) };
        self.verbs.drop_error.record(r);
    }
}

/// An open GDRCopy handle (`gdr_t`), closed with `gdr_close` on drop.
pub struct GdrHandle<'a> {
    api: &'a GdrApi,
    g: NonNull<gdr>,
}

impl std::fmt::Debug for GdrHandle<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GdrHandle").field("g", &self.g).finish()
    }
}

impl<'a> GdrHandle<'a> {
    /// `gdr_open`: connects to the gdrdrv kernel module. [`Error::GdrOpen`] when it is absent.
    pub fn open(api: &'a GdrApi) -> Result<Self> {
        Ok(Self {
            api,
            g: api.open()?,
        })
    }

    /// `gdr_driver_get_version`: (major, minor) of gdrdrv.
    pub fn driver_version(&self) -> Result<(i32, i32)> {
        // SAFETY: the handle is open while `self` lives.
        unsafe { self.api.driver_version(self.g) }
    }

    /// The raw `gdr_t`, open while `self` lives. Every buffer pinned through it must be
    /// unpinned before `self` drops.
    pub fn as_raw(&self) -> NonNull<gdr> {
        self.g
    }
}

impl Drop for GdrHandle<'_> {
    fn drop(&mut self) {
        // SAFETY: opened by `GdrHandle::open` and closed only here; the safe surface pins nothing.
        let r = unsafe { self.api.close(self.g) };
        self.api.drop_error.record(r);
    }
}
