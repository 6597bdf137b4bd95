//! `ep doctor` verdicts over fixture trees (`tests/fixtures/doctor/<scenario>`): each tree is a
//! machine's `/proc`, `/sys`, `/etc`, `/dev` (device nodes as empty files, sysfs links as
//! symlinks), plus `ep-doctor/nvidia-smi-topo-m.txt` and an NVSHMEM install under `/opt`.

use std::path::PathBuf;

use ep_setup::{
    Capability, GatherOptions, GpuLink, IbgdaMode, ProbeResult, Report, Status, Version, diagnose,
    gather,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/doctor/{name}"))
}

fn report(name: &str) -> Report {
    let root = fixture(name);
    assert!(root.is_dir(), "missing fixture {}", root.display());
    diagnose(&gather(&root, &GatherOptions::default()))
}

fn status(r: &Report, id: &str) -> Status {
    r.check(id)
        .unwrap_or_else(|| panic!("no check {id}"))
        .status
}

fn fix(r: &Report, id: &str) -> String {
    r.check(id)
        .and_then(|c| c.fix.clone())
        .unwrap_or_else(|| panic!("check {id} has no fix"))
}

fn usable(r: &Report, cap: Capability) -> bool {
    r.verdict(cap).usable
}

fn dump(r: &Report) -> String {
    r.checks
        .iter()
        .map(|c| format!("{} {}: {}", c.status.label(), c.id, c.detail))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn driver_enabled_ibgda() {
    let r = report("ibgda-driver-enabled");
    let d = dump(&r);
    assert_eq!(status(&r, "driver.loaded"), Status::Pass, "{d}");
    assert_eq!(status(&r, "driver.ibgda-keys"), Status::Pass, "{d}");
    assert_eq!(status(&r, "gpu.topology"), Status::Pass, "{d}");
    assert_eq!(status(&r, "nic.roce-gid"), Status::Pass, "{d}");
    assert!(
        r.check("nic.roce-gid")
            .unwrap()
            .detail
            .contains("NVSHMEM_IB_GID_INDEX=3"),
        "{d}"
    );
    // No GDRCopy, but NVSHMEM 3.4.5 has the host-memory CPU proxy: usable, with a warning.
    assert_eq!(status(&r, "gdrcopy"), Status::Warn, "{d}");
    assert!(usable(&r, Capability::IntranodeNvlink));
    assert!(usable(&r, Capability::LowLatencyNvlink));
    assert_eq!(
        r.verdict(Capability::IbgdaGpuInitiated).status,
        Status::Pass,
        "{d}"
    );
    assert_eq!(
        r.verdict(Capability::IbgdaCpuAssisted).status,
        Status::Warn,
        "{d}"
    );
    assert_eq!(r.ibgda.selected, IbgdaMode::GpuInitiated);
    assert_eq!(
        r.ibgda.possible,
        vec![IbgdaMode::GpuInitiated, IbgdaMode::CpuAssisted]
    );
    // NVSHMEM found under /opt, version from its headers, plugins listed.
    let n = r.facts.nvshmem.as_ref().unwrap();
    assert_eq!(n.version().unwrap().0, Version::new(3, 4, 5));
    assert!(n.has_ibgda_plugin());
    assert_eq!(status(&r, "nvshmem.consistency"), Status::Pass, "{d}");
    // GPU0 sits under the same switch as mlx5_0.
    let aff = &r.check("gpu.nic-affinity").unwrap().detail;
    assert!(
        aff.contains("GPU0 -> mlx5_0 (PXB)") && aff.contains("GPU1 -> mlx5_1 (PXB)"),
        "{aff}"
    );
    assert_eq!(r.exit_code(&[Capability::IbgdaGpuInitiated]), 0);
    assert_eq!(r.exit_code(&[Capability::IbgdaCpuAssisted]), 0);
}

#[test]
fn keys_set_reboot_pending() {
    let r = report("reboot-pending");
    let d = dump(&r);
    let c = r.check("driver.ibgda-keys").unwrap();
    assert_eq!(c.status, Status::Fail, "{d}");
    assert!(c.detail.contains("reboot pending"), "{}", c.detail);
    assert!(
        c.detail.contains("/etc/modprobe.d/nvidia-ibgda.conf"),
        "{}",
        c.detail
    );
    let f = fix(&r, "driver.ibgda-keys");
    assert_eq!(f, "sudo update-initramfs -u\nsudo reboot");
    assert!(!usable(&r, Capability::IbgdaGpuInitiated));
    assert!(
        r.verdict(Capability::IbgdaGpuInitiated)
            .because
            .contains(&"driver.ibgda-keys")
    );
    assert!(usable(&r, Capability::IntranodeNvlink));
    // Meanwhile NVSHMEM 3.4.5's host-memory CPU proxy carries IBGDA.
    assert_eq!(r.ibgda.selected, IbgdaMode::CpuAssisted);
    assert!(
        r.check("ibgda.mode")
            .unwrap()
            .detail
            .contains("CPU-assisted (CUDA host memory)")
    );
}

#[test]
fn gdrcopy_only_is_cpu_assisted() {
    let r = report("gdrcopy-only");
    let d = dump(&r);
    assert_eq!(status(&r, "gdrcopy"), Status::Pass, "{d}");
    assert_eq!(status(&r, "driver.ibgda-keys"), Status::Fail, "{d}");
    assert!(!usable(&r, Capability::IbgdaGpuInitiated));
    assert_eq!(
        r.verdict(Capability::IbgdaCpuAssisted).status,
        Status::Pass,
        "{d}"
    );
    assert_eq!(r.ibgda.possible, vec![IbgdaMode::CpuAssisted]);
    assert_eq!(r.ibgda.selected, IbgdaMode::CpuAssisted);
    assert!(
        r.check("ibgda.mode")
            .unwrap()
            .detail
            .contains("ep-rs will use CPU-assisted (GDRCopy)"),
        "{d}"
    );
    assert_eq!(r.exit_code(&[Capability::IbgdaCpuAssisted]), 0);
}

#[test]
fn nothing_configured() {
    let r = report("nothing-configured");
    let d = dump(&r);
    assert_eq!(status(&r, "driver.ibgda-keys"), Status::Fail, "{d}");
    // An existing file already sets RegistryDwords: the fix edits it and keeps its keys.
    let f = fix(&r, "driver.ibgda-keys");
    assert!(f.contains("Edit /etc/modprobe.d/nvidia.conf"), "{f}");
    assert!(
        f.contains(
            "options nvidia NVreg_PreserveVideoMemoryAllocations=1 NVreg_EnableStreamMemOPs=1 \
             NVreg_RegistryDwords=\"RMForceStaticBar1=1;PeerMappingOverride=1;\""
        ),
        "{f}"
    );
    assert!(f.contains("sudo update-initramfs -u\nsudo reboot"), "{f}");
    let g = fix(&r, "gdrcopy");
    assert!(
        g.contains("https://github.com/NVIDIA/gdrcopy") && g.contains("sudo modprobe gdrdrv"),
        "{g}"
    );
    assert!(usable(&r, Capability::IntranodeNvlink));
    assert!(usable(&r, Capability::LowLatencyNvlink));
    assert!(!usable(&r, Capability::IbgdaGpuInitiated));
    assert!(!usable(&r, Capability::IbgdaCpuAssisted));
    // NVSHMEM 3.3.20: no host-memory fallback, so no IBGDA mode at all.
    assert_eq!(status(&r, "gdrcopy"), Status::Fail, "{d}");
    assert_eq!(r.ibgda.selected, IbgdaMode::None);
    assert_eq!(status(&r, "ibgda.mode"), Status::Fail);
    assert_eq!(r.exit_code(&[]), 0);
    assert_eq!(r.exit_code(&[Capability::IbgdaGpuInitiated]), 2);
}

#[test]
fn no_driver() {
    let r = report("no-driver");
    let d = dump(&r);
    assert_eq!(status(&r, "driver.loaded"), Status::Fail, "{d}");
    assert!(fix(&r, "driver.loaded").contains("sudo modprobe nvidia"));
    assert_eq!(status(&r, "gpu.device-nodes"), Status::Fail, "{d}");
    // Keys not set either: the fix writes the new file.
    let f = fix(&r, "driver.ibgda-keys");
    assert!(
        f.starts_with(
            "echo 'options nvidia NVreg_EnableStreamMemOPs=1 \
             NVreg_RegistryDwords=\"PeerMappingOverride=1;\"' | sudo tee \
             /etc/modprobe.d/nvidia-ibgda.conf\nsudo update-initramfs -u\nsudo reboot"
        ),
        "{f}"
    );
    for cap in Capability::ALL {
        assert!(!usable(&r, cap), "{cap} usable without a driver");
    }
    assert_eq!(r.exit_code(&[]), 1);
}

#[test]
fn no_nic() {
    let r = report("no-nic");
    let d = dump(&r);
    assert_eq!(status(&r, "nic.present"), Status::Fail, "{d}");
    assert_eq!(status(&r, "nic.mlx5"), Status::Skip, "{d}");
    assert_eq!(status(&r, "nic.device-nodes"), Status::Skip, "{d}");
    assert_eq!(status(&r, "gpu.nic-affinity"), Status::Skip, "{d}");
    assert!(usable(&r, Capability::IntranodeNvlink));
    assert_eq!(
        r.verdict(Capability::LowLatencyNvlink).status,
        Status::Pass,
        "{d}"
    );
    assert!(!usable(&r, Capability::IbgdaGpuInitiated));
    assert!(
        r.verdict(Capability::IbgdaGpuInitiated)
            .because
            .contains(&"nic.present")
    );
    assert_eq!(r.exit_code(&[Capability::LowLatencyNvlink]), 0);
}

#[test]
fn roce_without_gid() {
    let r = report("roce-no-gid");
    let d = dump(&r);
    let c = r.check("nic.roce-gid").unwrap();
    assert_eq!(c.status, Status::Fail, "{d}");
    let f = fix(&r, "nic.roce-gid");
    assert!(
        f.contains("sudo ip addr add <ip>/<prefix> dev ens1f0np0"),
        "{f}"
    );
    assert!(f.contains("NVSHMEM_IB_GID_INDEX"), "{f}");
    assert_eq!(status(&r, "driver.ibgda-keys"), Status::Pass, "{d}");
    assert!(!usable(&r, Capability::IbgdaGpuInitiated));
    assert_eq!(
        r.verdict(Capability::IbgdaGpuInitiated).because,
        vec!["nic.roce-gid"]
    );
}

#[test]
fn memlock_too_low() {
    let r = report("memlock-low");
    let d = dump(&r);
    let c = r.check("limits.memlock").unwrap();
    assert_eq!(c.status, Status::Fail, "{d}");
    assert!(c.detail.contains("soft 8 MiB, hard 8 MiB"), "{}", c.detail);
    let f = fix(&r, "limits.memlock");
    assert!(
        f.contains("* soft memlock unlimited\n* hard memlock unlimited"),
        "{f}"
    );
    assert_eq!(
        r.verdict(Capability::IbgdaGpuInitiated).because,
        vec!["limits.memlock"]
    );
    assert!(usable(&r, Capability::IntranodeNvlink));
}

#[test]
fn container_without_device_nodes() {
    let r = report("container-no-devices");
    let d = dump(&r);
    assert!(r.facts.container.in_container);
    assert_eq!(status(&r, "nic.device-nodes"), Status::Fail, "{d}");
    assert!(fix(&r, "nic.device-nodes").contains("--device /dev/infiniband"));
    assert_eq!(status(&r, "gdrcopy"), Status::Warn, "{d}");
    let g = fix(&r, "gdrcopy");
    assert!(g.contains("--device /dev/gdrdrv"), "{g}");
    assert!(r.check("gdrcopy").unwrap().detail.contains("/dev/gdrdrv"));
    // Keys active on the host; the container only lacks the nodes.
    assert_eq!(status(&r, "driver.ibgda-keys"), Status::Pass, "{d}");
    assert!(!usable(&r, Capability::IbgdaGpuInitiated));
    assert!(!usable(&r, Capability::IbgdaCpuAssisted));
    assert!(usable(&r, Capability::IntranodeNvlink));
}

#[test]
fn acs_and_iommu() {
    let r = report("acs-iommu");
    let d = dump(&r);
    let c = r.check("pci.iommu-acs").unwrap();
    assert_eq!(c.status, Status::Fail, "{d}");
    assert!(c.detail.contains("0000:19:00.0"), "{}", c.detail);
    assert!(fix(&r, "pci.iommu-acs").contains("sudo setpci -s 0000:19:00.0 ECAP_ACS+0x6.w=0000"));
    assert_eq!(r.facts.gpus[0].iommu_group, Some(20));
    assert!(!usable(&r, Capability::IbgdaGpuInitiated));
}

#[test]
fn report_serialises() {
    let r = report("ibgda-driver-enabled");
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["verdicts"][2]["capability"], "ibgda-gpu-initiated");
    assert_eq!(v["ibgda"]["selected"], "gpu-initiated");
    assert_eq!(v["checks"][0]["status"], "pass");
}

/// Captured on the project's GPU machine by `scripts/capture-sysroot.sh` (2x H200, driver
/// 580.159.04, NVSHMEM 3.4.5 in /opt/torch/.venv, no RDMA NIC, no GDRCopy, in a container).
#[test]
fn captured_gpu_machine() {
    let r = report("gpu-machine");
    let d = dump(&r);
    assert!(r.facts.container.in_container);
    assert_eq!(r.facts.driver.version.as_deref(), Some("580.159.04"));
    assert_eq!(r.facts.driver.open_module, Some(true));
    assert_eq!(r.facts.driver.enable_stream_memops, Some(0));
    assert_eq!(r.facts.driver.registry_dwords.as_deref(), Some(""));
    // NVSHMEM 3.4.5 found where the pip package put it.
    let n = r.facts.nvshmem.as_ref().unwrap();
    assert_eq!(n.version().unwrap().0, Version::new(3, 4, 5));
    assert!(
        n.host_library
            .as_deref()
            .unwrap()
            .ends_with("nvidia/nvshmem/lib/libnvshmem_host.so.3")
    );
    assert_eq!(status(&r, "nvshmem.found"), Status::Pass, "{d}");
    assert_eq!(status(&r, "nvshmem.ibgda-plugin"), Status::Pass, "{d}");
    // Driver keys not set, no GDRCopy, no NIC.
    assert_eq!(status(&r, "driver.ibgda-keys"), Status::Fail, "{d}");
    assert!(fix(&r, "driver.ibgda-keys").starts_with("Run these on the host"));
    assert_ne!(status(&r, "gdrcopy"), Status::Pass, "{d}");
    assert!(!r.facts.gdrcopy.module_loaded && !r.facts.gdrcopy.dev_node);
    assert_eq!(status(&r, "nic.present"), Status::Fail, "{d}");
    // NVLink P2P between the 2 GPUs (nvidia-smi topo -m, ANSI underline and all).
    assert_eq!(r.facts.gpus.len(), 2);
    let t = r.facts.topology.as_ref().unwrap();
    assert_eq!(t.links[0][1], GpuLink::NvLink(18));
    assert_eq!(status(&r, "gpu.topology"), Status::Pass, "{d}");
    assert_eq!(r.verdict(Capability::IntranodeNvlink).status, Status::Pass);
    assert_eq!(r.verdict(Capability::LowLatencyNvlink).status, Status::Pass);
    assert!(!usable(&r, Capability::IbgdaGpuInitiated));
    assert!(!usable(&r, Capability::IbgdaCpuAssisted));
    // A failed capability names only its blockers: GDRCopy merely warns (NVSHMEM 3.4.5 has
    // the host-memory proxy), the missing NIC blocks.
    assert_eq!(
        r.verdict(Capability::IbgdaCpuAssisted).because,
        vec!["nic.present"],
        "{d}"
    );
    assert_eq!(r.ibgda.selected, IbgdaMode::None);
    assert_eq!(r.exit_code(&[]), 0);
}

/// What `ep doctor --probe` saw there: NVSHMEM up over P2P, IBGDA requested and failed. The
/// fallback must fail the IBGDA verdicts and leave low-latency over NVLink usable.
#[test]
fn probe_fallback_is_loud() {
    let mut facts = gather(&fixture("gpu-machine"), &GatherOptions::default());
    facts.probe = Some(ProbeResult {
        env: vec![("NVSHMEM_IB_ENABLE_IBGDA".into(), "1".into())],
        initialized: true,
        ibgda_requested: true,
        transports_up: vec!["P2P".into()],
        transports_failed: vec!["IBGDA".into()],
        error: None,
        log: vec![
            "transport.cpp:nvshmemi_transport_init:282: init failed for transport: IBGDA".into(),
        ],
    });
    let r = diagnose(&facts);
    assert_eq!(status(&r, "probe.init"), Status::Pass);
    let c = r.check("probe.ibgda").unwrap();
    assert_eq!(c.status, Status::Fail);
    assert!(
        c.detail.contains("init failed for transport: IBGDA"),
        "{}",
        c.detail
    );
    assert!(
        r.verdict(Capability::IbgdaGpuInitiated)
            .because
            .contains(&"probe.ibgda")
    );
    assert_eq!(r.verdict(Capability::LowLatencyNvlink).status, Status::Pass);

    // A probe whose init failed blocks low-latency too.
    facts.probe.as_mut().unwrap().initialized = false;
    facts.probe.as_mut().unwrap().error =
        Some("nvshmemx_hostlib_init_attr failed with status 7".into());
    let r = diagnose(&facts);
    assert!(!usable(&r, Capability::LowLatencyNvlink));
}
