//! `libmlx5.so.1`: whether a device is an mlx5 device and whether DevX (the raw PRM command
//! interface IBGDA needs to create GPU-visible QPs) can be opened on it.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use crate::error::{Error, Result, errno};
use crate::generated::mlx5::Mlx5;
use crate::generated::rdma_types::*;
use crate::loader::{missing, open};
use crate::search::{LIBMLX5, SearchEnv};

/// `MLX5_CMD_OP_QUERY_HCA_CAP` (PRM "QUERY_HCA_CAP", opcode 0x100), for
/// [`Mlx5Dv::devx_general_cmd`].
pub const MLX5_CMD_OP_QUERY_HCA_CAP: u16 = 0x100;

/// The loaded mlx5 direct-verbs library.
pub struct Mlx5Dv {
    /// Entry points under their C names.
    pub raw: Mlx5,
    path: PathBuf,
}

impl std::fmt::Debug for Mlx5Dv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mlx5Dv").field("path", &self.path).finish()
    }
}

impl Mlx5Dv {
    /// Searches and loads `libmlx5.so.1`.
    pub fn load(explicit: Option<&Path>) -> Result<Self> {
        Self::load_with(explicit, &SearchEnv::from_process(&LIBMLX5))
    }

    /// [`Mlx5Dv::load`] with a given search environment.
    pub fn load_with(explicit: Option<&Path>, env: &SearchEnv) -> Result<Self> {
        let (lib, path) = open(&LIBMLX5, explicit, env)?;
        // SAFETY: signatures generated from rdma-core's mlx5dv.h (libmlx5.so.1, MLX5_1.7+).
        let raw = unsafe { Mlx5::from_library(lib) }.map_err(missing(&path))?;
        Ok(Self { raw, path })
    }

    /// The file loaded.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `mlx5dv_is_supported`.
    ///
    /// # Safety
    /// `dev` comes from a live device list of the same rdma-core.
    pub unsafe fn is_supported(&self, dev: *mut ibv_device) -> bool {
        // SAFETY: forwarded contract.
        unsafe { self.raw.mlx5dv_is_supported(dev) }
    }

    /// `mlx5dv_open_device` with `MLX5DV_CONTEXT_FLAGS_DEVX`: succeeds only where DevX is
    /// available (errno `EOPNOTSUPP`/`EPERM` otherwise). Close with `ibv_close_device`.
    ///
    /// # Safety
    /// `dev` comes from a live device list of the same rdma-core.
    pub unsafe fn open_device_devx(&self, dev: *mut ibv_device) -> Result<NonNull<ibv_context>> {
        let mut attr = mlx5dv_context_attr {
            flags: MLX5DV_CONTEXT_FLAGS_DEVX,
            ..Default::default()
        };
        // SAFETY: forwarded contract; `attr` is valid for the call.
        let ctx = unsafe { self.raw.mlx5dv_open_device(dev, &mut attr) };
        NonNull::new(ctx).ok_or(Error::Null {
            op: "mlx5dv_open_device(DEVX)",
            errno: errno(),
        })
    }

    /// `mlx5dv_devx_general_cmd`: a raw PRM command (big-endian mailboxes as the PRM lays
    /// them out).
    ///
    /// # Safety
    /// `ctx` was opened with DevX; `input` is a well-formed PRM command for `output`'s size.
    pub unsafe fn devx_general_cmd(
        &self,
        ctx: NonNull<ibv_context>,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<()> {
        // SAFETY: forwarded contract; both buffers are valid for their lengths.
        let code = unsafe {
            self.raw.mlx5dv_devx_general_cmd(
                ctx.as_ptr(),
                input.as_ptr().cast::<c_void>(),
                input.len(),
                output.as_mut_ptr().cast::<c_void>(),
                output.len(),
            )
        };
        if code == 0 {
            Ok(())
        } else {
            Err(Error::Call {
                op: "mlx5dv_devx_general_cmd",
                code: code.into(),
                errno: errno(),
            })
        }
    }
}
