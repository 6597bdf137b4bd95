//! NVSHMEM for variant (b) in the bench: the environment plan applied before init, the bring-up
//! in one process or across rank processes, and the doctor's reasons when IBGDA does not come up.

use std::collections::BTreeMap;
use std::sync::Arc;

use ep_core::config::{
    BufferConfig, IbgdaNicHandler, low_latency_rdma_size_hint, nvshmem_env_plan,
};
use ep_kernels::gpu::Device;
use ep_kernels::nvshmem::{
    Bootstrap, BringUp, NvshmemSession, SoloRendezvous, TcpRendezvous, env as nv_env,
};

use crate::bench::error::BenchError;
use crate::bench::gpu::gpu_err;

/// NVSHMEM for variant (b): ep-core's environment plan for an `r`-rank low-latency buffer of
/// this shape (DeepEP's variables; values the user set are kept) set in this process, printed,
/// then NVSHMEM started with one PE (this process) on GPU 0, its init report printed.
pub(super) fn start_nvshmem(
    r: usize,
    n: usize,
    hidden: usize,
    experts: usize,
) -> Result<Arc<NvshmemSession>, BenchError> {
    let plan = env_plan(r, n, hidden, experts)?;
    // SAFETY: called before this process starts NVSHMEM or opens the GPU, from the bench's one
    // thread; nothing else reads or writes the environment meanwhile (set_in_process's contract).
    let applied = unsafe { nv_env::set_in_process(&plan) };
    for a in &applied {
        println!(
            "env {}={} ({:?}{})",
            a.var,
            a.value,
            a.source,
            if a.value != a.planned {
                format!(", the plan wanted {}", a.planned)
            } else {
                String::new()
            }
        );
    }
    let s = BringUp::new(0, 1, Bootstrap::UniqueId(&SoloRendezvous))
        .device(0)
        .init()
        .map_err(gpu_err("starting NVSHMEM (one PE)"))?;
    print!("{}", s.report());
    Ok(Arc::new(s))
}

/// `ep doctor`'s IBGDA verdicts for the machine under `root` (its file-based checks), one line
/// per IBGDA mode with the checks that block it and their fixes.
pub(super) fn ibgda_diagnosis(root: &std::path::Path) -> Vec<String> {
    use ep_setup::{Capability, GatherOptions, diagnose, gather};
    let report = diagnose(&gather(root, &GatherOptions::default()));
    let mut lines = Vec::new();
    for cap in [Capability::IbgdaGpuInitiated, Capability::IbgdaCpuAssisted] {
        let v = report.verdict(cap);
        lines.push(format!(
            "{}: {}",
            cap.title(),
            if v.usable { "usable" } else { "unusable" }
        ));
        for id in &v.because {
            if let Some(c) = report.check(id) {
                lines.push(format!(
                    "  {} ({}): {}{}",
                    c.id,
                    c.status.label(),
                    c.detail,
                    c.fix
                        .as_ref()
                        .map(|f| format!("; fix: {f}"))
                        .unwrap_or_default()
                ));
            }
        }
    }
    lines
}

/// NVSHMEM in a rank process of `--procs`: PE `rank` of `world`, the unique id over the
/// launcher's rendezvous, on this rank's GPU (the launcher set the environment plan).
pub(super) fn join_nvshmem(rank: usize, world: usize) -> Result<Arc<NvshmemSession>, BenchError> {
    let rdv = TcpRendezvous::from_env().map_err(gpu_err("joining the launcher's rendezvous"))?;
    let gpus = Device::count().map_err(gpu_err("counting GPUs"))?.max(1);
    let local: usize = std::env::var(ep_kernels::nvshmem::launch::vars::LOCAL_RANK)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(rank);
    let s = BringUp::new(rank as u32, world as u32, Bootstrap::UniqueId(&rdv))
        .device(local % gpus)
        .init()
        .map_err(gpu_err("starting NVSHMEM (one PE per rank)"))?;
    print!("{}", s.report());
    Ok(Arc::new(s))
}

/// ep-core's NVSHMEM environment plan (DeepEP's variables; values the user set are kept) for an
/// `r`-rank low-latency buffer of this shape.
pub(super) fn env_plan(
    r: usize,
    n: usize,
    hidden: usize,
    experts: usize,
) -> Result<Vec<nv_env::EnvEntry>, BenchError> {
    let mut cfg = BufferConfig::new(r);
    cfg.low_latency_mode = true;
    let bytes =
        low_latency_rdma_size_hint(n, hidden, r, experts).map_err(|e| BenchError::Reference {
            what: "low_latency_rdma_size_hint",
            source: Box::new(e),
        })?;
    cfg.num_rdma_bytes = bytes as u64;
    cfg.num_qps_per_rank = u32::try_from((experts / r).max(1)).unwrap_or(u32::MAX);
    cfg.allow_nvlink_for_low_latency_mode = true;
    let user: BTreeMap<String, String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("NVSHMEM_"))
        .collect();
    let plan = nvshmem_env_plan(&cfg, &user, IbgdaNicHandler::Auto).map_err(|e| {
        BenchError::Reference {
            what: "nvshmem_env_plan",
            source: Box::new(e),
        }
    })?;
    Ok(nv_env::from_plan(&plan))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// When IBGDA does not come up, the bench prints the doctor's reasons: on a machine
    /// without an RDMA NIC (ep-setup's fixture of the GPU machine) both modes are unusable and
    /// the NIC check says why, with its fix.
    #[test]
    fn the_ibgda_diagnosis_names_the_missing_nic() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ep-setup/tests/fixtures/doctor/gpu-machine");
        let lines = ibgda_diagnosis(&root);
        assert!(
            lines.iter().filter(|l| l.ends_with(": unusable")).count() == 2,
            "{lines:#?}"
        );
        assert!(
            lines.iter().any(|l| l.contains("nic") && l.contains("fix")),
            "{lines:#?}"
        );
    }
}
