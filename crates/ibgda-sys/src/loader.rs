//! Opening a library found by [`crate::search`].

use std::path::{Path, PathBuf};

use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};

use crate::error::{Error, Result};
use crate::search::{LibSpec, SearchEnv, locate};

/// Locates and opens `spec` with `RTLD_NOW | RTLD_GLOBAL` (rdma-core's providers and GDRCopy
/// resolve against the global namespace).
pub(crate) fn open(
    spec: &LibSpec,
    explicit: Option<&Path>,
    env: &SearchEnv,
) -> Result<(libloading::Library, PathBuf)> {
    let path = locate(spec, explicit, env).map_err(|searched| Error::LibraryNotFound {
        library: spec.file,
        searched,
        hint: spec.hint,
    })?;
    Ok((open_path(&path)?, path))
}

pub(crate) fn open_path(path: &Path) -> Result<libloading::Library> {
    // SAFETY: these libraries' initialisers only set up internal state (rdma-core reads its
    // provider configuration lazily, at ibv_get_device_list).
    let lib =
        unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map_err(|e| Error::Load {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    Ok(lib.into())
}

pub(crate) fn missing(path: &Path) -> impl FnOnce(libloading::Error) -> Error + '_ {
    move |e| Error::MissingSymbol {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}
