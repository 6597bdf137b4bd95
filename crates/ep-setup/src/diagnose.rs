//! `diagnose`: facts in, checks and verdicts out. Pure; every branch is exercised by the fixture
//! trees under `tests/fixtures/doctor`.

use super::checks::cuda::gpu_cuda;
use super::checks::driver::{
    driver_ibgda_keys, driver_kernel_module, driver_loaded, gdrcopy, gpu_memory_registration,
};
use super::checks::gpu::{gpu_count, gpu_device_nodes, gpu_nic_affinity, gpu_topology};
use super::checks::live_rdma::{
    gdrcopy_open, nic_devx, nic_verbs_ports, probe_registration, rdma_verbs_consistency,
};
use super::checks::nvshmem::{nvjitlink, nvshmem_consistency, nvshmem_found, nvshmem_ibgda_plugin};
use super::checks::rdma::{
    nic_device_nodes, nic_mlx5, nic_port_active, nic_present, nic_roce_gid, rdma_libraries,
};
use super::checks::system::{memlock, pci_iommu_acs};
use super::checks::{CPU, GPU, check, probe::probe};
use super::facts::Facts;
use super::report::{Capability, Check, IbgdaMode, IbgdaModeReport, Report, Status, Verdict};

/// Computes every check and verdict from `facts`.
pub fn diagnose(facts: &Facts) -> Report {
    let f = facts;
    let mut checks = vec![
        driver_loaded(f),
        gpu_count(f),
        gpu_cuda(f),
        gpu_device_nodes(f),
        gpu_topology(f),
        driver_ibgda_keys(f),
        driver_kernel_module(f),
        gpu_memory_registration(f),
        gdrcopy(f),
        gdrcopy_open(f),
        nvshmem_found(f),
        nvshmem_consistency(f),
        nvshmem_ibgda_plugin(f),
        nvjitlink(f),
        rdma_libraries(f),
        rdma_verbs_consistency(f),
        nic_present(f),
        nic_mlx5(f),
        nic_devx(f),
        nic_port_active(f),
        nic_verbs_ports(f),
        nic_roce_gid(f),
        nic_device_nodes(f),
        memlock(f),
        pci_iommu_acs(f),
        gpu_nic_affinity(f),
    ];
    checks.extend(probe(f));
    checks.push(probe_registration(f));
    let verdicts: Vec<Verdict> = Capability::ALL
        .iter()
        .map(|&cap| verdict(cap, &checks))
        .collect();
    let usable = |c: Capability| verdicts.iter().any(|v| v.capability == c && v.usable);
    let mut possible = Vec::new();
    if usable(GPU) {
        possible.push(IbgdaMode::GpuInitiated);
    }
    if usable(CPU) {
        possible.push(IbgdaMode::CpuAssisted);
    }
    let selected = possible.first().copied().unwrap_or(IbgdaMode::None);
    let gdr = checks
        .iter()
        .any(|c| c.id == "gdrcopy" && c.status == Status::Pass);
    checks.push(ibgda_mode_check(&possible, &verdicts, gdr));
    Report {
        checks,
        verdicts,
        ibgda: IbgdaModeReport { possible, selected },
        facts: facts.clone(),
    }
}

fn verdict(cap: Capability, checks: &[Check]) -> Verdict {
    let relevant: Vec<&Check> = checks
        .iter()
        .filter(|c| c.needed_for.contains(&cap))
        .collect();
    let ids = |st: Status| -> Vec<&'static str> {
        relevant
            .iter()
            .filter(|c| c.status == st)
            .map(|c| c.id)
            .collect()
    };
    let (fails, warns) = (ids(Status::Fail), ids(Status::Warn));
    // A failed capability names only what blocks it; a usable one names its caveats.
    let (status, because) = if !fails.is_empty() {
        (Status::Fail, fails)
    } else if !warns.is_empty() {
        (Status::Warn, warns)
    } else {
        (Status::Pass, Vec::new())
    };
    Verdict {
        capability: cap,
        status,
        usable: status != Status::Fail,
        because,
    }
}

fn ibgda_mode_check(possible: &[IbgdaMode], verdicts: &[Verdict], gdrcopy: bool) -> Check {
    const ID: &str = "ibgda.mode";
    const T: &str = "IBGDA mode";
    let blockers = |c: Capability| {
        verdicts
            .iter()
            .find(|v| v.capability == c)
            .map(|v| v.because.join(", "))
            .unwrap_or_default()
    };
    if possible.is_empty() {
        return check(
            ID,
            T,
            &[],
            Status::Fail,
            format!(
                "none possible: GPU-initiated blocked by {}; CPU-assisted blocked by {}",
                blockers(GPU),
                blockers(CPU)
            ),
            None,
        );
    }
    let names: Vec<String> = possible
        .iter()
        .map(|m| match m {
            IbgdaMode::CpuAssisted if gdrcopy => "CPU-assisted (GDRCopy)".to_string(),
            IbgdaMode::CpuAssisted => "CPU-assisted (CUDA host memory)".to_string(),
            m => m.name().to_string(),
        })
        .collect();
    check(
        ID,
        T,
        &[],
        Status::Pass,
        format!(
            "possible: {}; ep-rs will use {} (NVSHMEM's NIC handler is left at auto)",
            names.join(", "),
            names[0]
        ),
        None,
    )
}
