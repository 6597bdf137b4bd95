//! TEMPORARY stub (replaced by the helper's module).
use super::NvshmemSession;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction};
use std::path::PathBuf;
use std::sync::Arc;
#[derive(Debug)]
pub struct LinkedLl {
    pub dispatch: CudaFunction,
    pub combine: CudaFunction,
    pub cubin_path: PathBuf,
    pub from_cache: bool,
}
pub(crate) fn link_ll_module(_ctx: &Arc<CudaContext>, _s: &NvshmemSession) -> Result<LinkedLl> {
    Err(Error::Unsupported("stub".into()))
}
