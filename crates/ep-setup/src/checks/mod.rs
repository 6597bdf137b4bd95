//! The individual checks of `diagnose`, one module per area. Each check says which
//! capabilities its failure blocks (`needed_for`).

pub(crate) mod cuda;
pub(crate) mod driver;
pub(crate) mod gpu;
pub(crate) mod live_rdma;
pub(crate) mod nvshmem;
pub(crate) mod probe;
pub(crate) mod rdma;
pub(crate) mod system;

use super::facts::{Facts, NvshmemFacts};
use super::report::{Capability, Check, Status};

pub(crate) use Capability::{IbgdaCpuAssisted as CPU, IbgdaGpuInitiated as GPU};
pub(crate) use Capability::{IntranodeNvlink as INTRA, LowLatencyNvlink as LL};

pub(crate) fn check(
    id: &'static str,
    title: &'static str,
    needed_for: &[Capability],
    status: Status,
    detail: impl Into<String>,
    fix: Option<String>,
) -> Check {
    Check {
        id,
        title,
        status,
        detail: detail.into(),
        fix,
        needed_for: needed_for.to_vec(),
    }
}

pub(crate) fn in_container(f: &Facts) -> bool {
    f.container.in_container
}

pub(crate) fn nvshmem(f: &Facts) -> Option<&NvshmemFacts> {
    f.nvshmem.as_ref()
}
