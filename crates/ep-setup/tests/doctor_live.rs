//! `ep doctor`'s live facts (CUDA's peer view, rdma-core's device list and DevX, `gdr_open`, the
//! GPU memory registration probe) set by hand on top of fixture trees: every live check is
//! skipped without its facts, and each verdict and fix follows from them.

use std::path::PathBuf;

use ep_setup::{
    Attempt, Capability, CudaDevice, CudaFacts, CudaPeer, DevxOpen, Facts, GatherOptions,
    GdrcopyLive, GidEntry, RegistrationProbe, Report, Status, VerbsDevice, VerbsFacts, VerbsPort,
    diagnose, format_gid, gather, link_layer_name, port_state_name,
};

const LIVE_CHECKS: [&str; 6] = [
    "gpu.cuda",
    "rdma.verbs-consistency",
    "nic.devx",
    "nic.verbs-ports",
    "gdrcopy.open",
    "probe.gpu-registration",
];

fn facts(name: &str) -> Facts {
    let root =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/doctor/{name}"));
    assert!(root.is_dir(), "missing fixture {}", root.display());
    gather(&root, &GatherOptions::default())
}

fn dump(r: &Report) -> String {
    r.checks
        .iter()
        .map(|c| format!("{} {}: {}", c.status.label(), c.id, c.detail))
        .collect::<Vec<_>>()
        .join("\n")
}

fn get<'a>(r: &'a Report, id: &str) -> &'a ep_setup::Check {
    r.check(id)
        .unwrap_or_else(|| panic!("no check {id}\n{}", dump(r)))
}

fn fix(r: &Report, id: &str) -> String {
    get(r, id)
        .fix
        .clone()
        .unwrap_or_else(|| panic!("{id} has no fix\n{}", dump(r)))
}

/// CUDA facts for the fixture's GPUs, enumerated in reverse PCI order (CUDA's default
/// FASTEST_FIRST order need not match nvidia-smi's), every pair with `peer`.
fn cuda(f: &Facts, peer: CudaPeer) -> CudaFacts {
    let devices: Vec<CudaDevice> = f
        .gpus
        .iter()
        .rev()
        .map(|g| CudaDevice {
            name: "NVIDIA H200".to_string(),
            // CUDA prints a 4-digit domain in upper case; sysfs an 8-digit one in lower case.
            pci_bus_id: g.pci_address.to_ascii_uppercase(),
            gpu_direct_rdma: Some(true),
            dma_buf: Some(true),
        })
        .collect();
    let n = devices.len();
    let peers = (0..n)
        .map(|i| (0..n).map(|j| (i != j).then_some(peer)).collect())
        .collect();
    CudaFacts {
        driver_version: Some(13000),
        devices,
        peers,
        ..CudaFacts::default()
    }
}

const NVLINK_PEER: CudaPeer = CudaPeer {
    can_access_peer: true,
    access_supported: true,
    native_atomics: true,
    performance_rank: 0,
};

const NO_PEER: CudaPeer = CudaPeer {
    can_access_peer: false,
    access_supported: false,
    native_atomics: false,
    performance_rank: 0,
};

/// Verbs facts mirroring the sysfs NICs, every mlx5 device opening a DevX context.
fn verbs(f: &Facts) -> VerbsFacts {
    VerbsFacts {
        library: Some("/usr/lib/x86_64-linux-gnu/libibverbs.so.1".to_string()),
        mlx5_library: Some("/usr/lib/x86_64-linux-gnu/libmlx5.so.1".to_string()),
        dmabuf_mr: true,
        devices: f
            .nics
            .iter()
            .map(|n| VerbsDevice {
                name: n.name.clone(),
                mlx5: Some(n.is_mlx5()),
                devx: n.is_mlx5().then(|| DevxOpen {
                    opened: true,
                    ..DevxOpen::default()
                }),
                ports: n
                    .ports
                    .iter()
                    .map(|p| VerbsPort {
                        port: p.port,
                        state: p.state.clone(),
                        link_layer: p.link_layer.clone(),
                        gid_table_len: 256,
                        gids: p
                            .gids
                            .iter()
                            .map(|g| GidEntry {
                                ndev: None,
                                ..g.clone()
                            })
                            .collect(),
                    })
                    .collect(),
                ..VerbsDevice::default()
            })
            .collect(),
        ..VerbsFacts::default()
    }
}

#[test]
fn live_checks_skip_on_every_fixture() {
    for name in [
        "acs-iommu",
        "container-no-devices",
        "gdrcopy-only",
        "gpu-machine",
        "ibgda-driver-enabled",
        "memlock-low",
        "no-driver",
        "no-nic",
        "nothing-configured",
        "reboot-pending",
        "roce-no-gid",
    ] {
        let r = diagnose(&facts(name));
        for id in LIVE_CHECKS {
            assert_eq!(
                get(&r, id).status,
                Status::Skip,
                "{name}: {id}\n{}",
                dump(&r)
            );
        }
    }
}

#[test]
fn cuda_confirms_nvlink_matched_by_bus_id() {
    let mut f = facts("gpu-machine");
    f.cuda = Some(cuda(&f, NVLINK_PEER));
    let r = diagnose(&f);
    let d = dump(&r);
    assert_eq!(get(&r, "gpu.cuda").status, Status::Pass, "{d}");
    assert!(get(&r, "gpu.cuda").detail.contains("CUDA 13.0"), "{d}");
    let t = get(&r, "gpu.topology");
    assert_eq!(t.status, Status::Pass, "{d}");
    assert!(t.detail.contains("NV18"), "{d}");
    assert!(t.detail.contains("P2P via CUDA: yes (1 pairs)"), "{d}");
    assert!(get(&r, "gpu.count").detail.contains("CUDA sees 2"), "{d}");
}

#[test]
fn nvlink_without_cuda_peer_access_fails_with_fix() {
    let mut f = facts("gpu-machine");
    f.cuda = Some(cuda(&f, NO_PEER));
    let r = diagnose(&f);
    let d = dump(&r);
    let t = get(&r, "gpu.topology");
    assert_eq!(t.status, Status::Fail, "{d}");
    assert!(t.detail.contains("GPU0-GPU1 (NV18)"), "{d}");
    assert!(t.detail.contains("cuDeviceCanAccessPeer"), "{d}");
    assert!(fix(&r, "gpu.topology").contains("sudo systemctl enable --now nvidia-fabricmanager"));
    assert!(!r.verdict(Capability::IntranodeNvlink).usable);
    assert!(
        r.verdict(Capability::IntranodeNvlink)
            .because
            .contains(&"gpu.topology")
    );
}

#[test]
fn one_way_peer_access_counts_as_none() {
    let mut f = facts("gpu-machine");
    let mut c = cuda(&f, NVLINK_PEER);
    c.peers[1][0] = Some(NO_PEER);
    f.cuda = Some(c);
    let r = diagnose(&f);
    assert_eq!(get(&r, "gpu.topology").status, Status::Fail, "{}", dump(&r));
}

#[test]
fn cuda_subset_leaves_smi_verdict() {
    // CUDA_VISIBLE_DEVICES=1: CUDA sees one GPU, nvidia-smi both; no pair to cross-check.
    let mut f = facts("gpu-machine");
    let mut c = cuda(&f, NVLINK_PEER);
    c.devices.truncate(1);
    c.peers = vec![vec![None]];
    c.visible_devices = Some("1".to_string());
    f.cuda = Some(c);
    let r = diagnose(&f);
    let d = dump(&r);
    assert_eq!(get(&r, "gpu.topology").status, Status::Pass, "{d}");
    assert!(!get(&r, "gpu.topology").detail.contains("via CUDA"), "{d}");
    let c = get(&r, "gpu.cuda");
    assert_eq!(c.status, Status::Pass, "{d}");
    assert!(c.detail.contains("CUDA_VISIBLE_DEVICES=1"), "{d}");
}

#[test]
fn cuda_alone_gives_the_topology_without_nvidia_smi() {
    let mut f = facts("gpu-machine");
    f.topology = None;
    f.cuda = Some(cuda(&f, NVLINK_PEER));
    let r = diagnose(&f);
    let t = get(&r, "gpu.topology");
    assert_eq!(t.status, Status::Pass, "{}", dump(&r));
    assert!(t.detail.contains("P2P via CUDA: yes"), "{}", t.detail);
    assert!(t.detail.contains("source: cuda"), "{}", t.detail);

    let pcie = CudaPeer {
        native_atomics: false,
        ..NVLINK_PEER
    };
    f.cuda = Some(cuda(&f, pcie));
    let r = diagnose(&f);
    assert_eq!(get(&r, "gpu.topology").status, Status::Warn, "{}", dump(&r));

    f.cuda = Some(cuda(&f, NO_PEER));
    let r = diagnose(&f);
    assert_eq!(get(&r, "gpu.topology").status, Status::Fail, "{}", dump(&r));
    assert!(!r.verdict(Capability::LowLatencyNvlink).usable);
}

#[test]
fn cuda_failures_name_their_fix() {
    let mut f = facts("gpu-machine");
    f.cuda = Some(CudaFacts {
        library_missing: true,
        error: Some("libcuda.so.1 is not present".to_string()),
        ..CudaFacts::default()
    });
    let r = diagnose(&f);
    assert_eq!(get(&r, "gpu.cuda").status, Status::Fail, "{}", dump(&r));
    // The GPU machine's capture was taken in a container.
    assert!(fix(&r, "gpu.cuda").contains("--gpus all"));
    f.container.in_container = false;
    let r = diagnose(&f);
    let v = f.driver.version.clone().unwrap();
    let branch = v.split('.').next().unwrap();
    assert!(
        fix(&r, "gpu.cuda").contains(&format!(
            "sudo apt install libnvidia-compute-{branch}-server"
        )),
        "{}",
        fix(&r, "gpu.cuda")
    );
    assert!(!r.verdict(Capability::IntranodeNvlink).usable);

    f.cuda = Some(CudaFacts {
        error: Some("CUDA cuInit failed: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH".to_string()),
        error_code: Some("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH".to_string()),
        ..CudaFacts::default()
    });
    let r = diagnose(&f);
    assert_eq!(get(&r, "gpu.cuda").status, Status::Fail);
    assert!(fix(&r, "gpu.cuda").contains("sudo rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia"));

    f.cuda = Some(CudaFacts {
        error: Some("CUDA cuInit failed: CUDA_ERROR_NO_DEVICE".to_string()),
        error_code: Some("CUDA_ERROR_NO_DEVICE".to_string()),
        visible_devices: Some("7".to_string()),
        ..CudaFacts::default()
    });
    let r = diagnose(&f);
    assert!(fix(&r, "gpu.cuda").contains("unset CUDA_VISIBLE_DEVICES"));

    // No driver at all: driver.loaded says so; gpu.cuda does not repeat it.
    let mut f = facts("no-driver");
    f.cuda = Some(CudaFacts {
        library_missing: true,
        ..CudaFacts::default()
    });
    let r = diagnose(&f);
    assert_eq!(get(&r, "gpu.cuda").status, Status::Skip, "{}", dump(&r));
}

#[test]
fn verbs_agreeing_with_sysfs_pass() {
    let mut f = facts("ibgda-driver-enabled");
    f.verbs = Some(verbs(&f));
    let r = diagnose(&f);
    let d = dump(&r);
    assert_eq!(
        get(&r, "rdma.verbs-consistency").status,
        Status::Pass,
        "{d}"
    );
    assert_eq!(get(&r, "nic.verbs-ports").status, Status::Pass, "{d}");
    assert!(
        get(&r, "nic.verbs-ports")
            .detail
            .contains("mlx5_0 port 1: 4: ACTIVE (Ethernet), 4 GIDs, RoCE v2 at index 1"),
        "{d}"
    );
    assert_eq!(get(&r, "nic.devx").status, Status::Pass, "{d}");
    assert!(get(&r, "nic.devx").detail.contains("mlx5_0, mlx5_1"), "{d}");
    assert_eq!(
        r.verdict(Capability::IbgdaGpuInitiated).status,
        Status::Pass,
        "{d}"
    );
}

#[test]
fn verbs_missing_devices_explained() {
    // One of two mlx5 devices missing: a warning (the other carries traffic).
    let mut f = facts("ibgda-driver-enabled");
    let mut v = verbs(&f);
    v.devices.retain(|d| d.name != "mlx5_1");
    f.verbs = Some(v);
    let r = diagnose(&f);
    let c = get(&r, "rdma.verbs-consistency");
    assert_eq!(c.status, Status::Warn, "{}", dump(&r));
    assert!(c.detail.contains("does not list mlx5_1"), "{}", c.detail);
    assert!(
        fix(&r, "rdma.verbs-consistency")
            .contains("sudo apt install libibverbs1 ibverbs-providers")
    );

    // All missing: GPU-initiated IBGDA is blocked.
    let mut v = verbs(&f);
    v.devices.clear();
    f.verbs = Some(v);
    let r = diagnose(&f);
    assert_eq!(get(&r, "rdma.verbs-consistency").status, Status::Fail);
    assert!(
        r.verdict(Capability::IbgdaGpuInitiated)
            .because
            .contains(&"rdma.verbs-consistency")
    );
    // DevX and port checks have nothing to look at.
    assert_eq!(get(&r, "nic.devx").status, Status::Skip);
    assert_eq!(get(&r, "nic.verbs-ports").status, Status::Skip);
}

#[test]
fn enosys_explained() {
    let mut f = facts("no-nic");
    f.verbs = Some(VerbsFacts {
        no_rdma_subsystem: true,
        ..VerbsFacts::default()
    });
    let r = diagnose(&f);
    let c = get(&r, "rdma.verbs-consistency");
    assert_eq!(c.status, Status::Skip, "{}", dump(&r));
    assert!(c.detail.contains("ENOSYS"), "{}", c.detail);

    let mut f = facts("ibgda-driver-enabled");
    f.verbs = Some(VerbsFacts {
        no_rdma_subsystem: true,
        ..VerbsFacts::default()
    });
    let r = diagnose(&f);
    assert_eq!(get(&r, "rdma.verbs-consistency").status, Status::Fail);
    assert_eq!(fix(&r, "rdma.verbs-consistency"), "sudo modprobe ib_uverbs");

    let mut f = facts("no-nic");
    f.verbs = Some(VerbsFacts {
        load_error: Some("libibverbs.so.1 not found".to_string()),
        ..VerbsFacts::default()
    });
    assert_eq!(
        get(&diagnose(&f), "rdma.verbs-consistency").status,
        Status::Skip
    );
}

#[test]
fn devx_refused_names_the_cause() {
    let mut f = facts("ibgda-driver-enabled");
    let mut v = verbs(&f);
    for d in &mut v.devices {
        d.devx = Some(DevxOpen {
            opened: false,
            errno: Some(95),
            error: Some("mlx5dv_open_device(DEVX) returned NULL, errno 95".to_string()),
        });
    }
    f.verbs = Some(v.clone());
    let r = diagnose(&f);
    assert_eq!(get(&r, "nic.devx").status, Status::Fail, "{}", dump(&r));
    assert!(fix(&r, "nic.devx").contains("sudo mlxfwmanager --online -u"));
    assert!(!r.verdict(Capability::IbgdaGpuInitiated).usable);
    assert!(!r.verdict(Capability::IbgdaCpuAssisted).usable);

    // Permission on one device only: a warning naming the udev rule.
    v.devices[0].devx = Some(DevxOpen {
        opened: true,
        ..DevxOpen::default()
    });
    v.devices[1].devx.as_mut().unwrap().errno = Some(13);
    f.verbs = Some(v.clone());
    let r = diagnose(&f);
    assert_eq!(get(&r, "nic.devx").status, Status::Warn, "{}", dump(&r));
    assert!(fix(&r, "nic.devx").contains("/etc/udev/rules.d/90-rdma.rules"));
    assert!(r.verdict(Capability::IbgdaGpuInitiated).usable);

    v.mlx5_error = Some("libmlx5.so.1 not found".to_string());
    f.verbs = Some(v);
    let r = diagnose(&f);
    assert_eq!(get(&r, "nic.devx").status, Status::Fail);
}

#[test]
fn verbs_ports_cross_checked() {
    let mut f = facts("ibgda-driver-enabled");
    let mut v = verbs(&f);
    v.devices[0].ports[0].gids.pop();
    v.devices[1].ports[0].state = port_state_name(1);
    f.verbs = Some(v.clone());
    let r = diagnose(&f);
    let c = get(&r, "nic.verbs-ports");
    assert_eq!(c.status, Status::Warn, "{}", dump(&r));
    assert!(
        c.detail.contains("mlx5_0 port 1: GID table differs"),
        "{}",
        c.detail
    );
    assert!(
        c.detail.contains("mlx5_1 port 1: state 1: DOWN in verbs"),
        "{}",
        c.detail
    );

    // No mlx5 device opens: blocked, with the permission fix.
    for d in &mut v.devices {
        d.open_error = Some("ibv_open_device returned NULL, errno 13".to_string());
        d.open_errno = Some(13);
    }
    f.verbs = Some(v);
    let r = diagnose(&f);
    assert_eq!(get(&r, "nic.verbs-ports").status, Status::Fail);
    assert!(
        fix(&r, "nic.verbs-ports").contains("MODE=\\\"0666\\\"")
            || fix(&r, "nic.verbs-ports").contains("MODE=\"0666\"")
    );
}

#[test]
fn verbs_words_match_sysfs() {
    assert_eq!(port_state_name(4), "4: ACTIVE");
    assert_eq!(link_layer_name(2), "Ethernet");
    assert_eq!(link_layer_name(0), "InfiniBand");
    let mut raw = [0u8; 16];
    raw[10] = 0xff;
    raw[11] = 0xff;
    raw[12..].copy_from_slice(&[10, 0, 1, 1]);
    assert_eq!(format_gid(&raw), "0000:0000:0000:0000:0000:ffff:0a00:0101");
}

#[test]
fn gdr_open_outcomes() {
    // Library missing.
    let mut f = facts("no-nic");
    f.gdrcopy_live = Some(GdrcopyLive {
        library_error: Some("libgdrapi.so.2 not found".to_string()),
        ..GdrcopyLive::default()
    });
    let r = diagnose(&f);
    let c = get(&r, "gdrcopy.open");
    assert_ne!(c.status, Status::Pass);
    assert!(c.detail.starts_with("library missing"), "{}", c.detail);

    // Driver missing.
    f.gdrcopy_live = Some(GdrcopyLive {
        library: Some("/usr/lib/libgdrapi.so.2".to_string()),
        runtime_version: Some("2.4".to_string()),
        ..GdrcopyLive::default()
    });
    let r = diagnose(&f);
    assert!(get(&r, "gdrcopy.open").detail.starts_with("driver missing"));
    assert!(fix(&r, "gdrcopy.open").contains("sudo modprobe gdrdrv"));

    // Opens.
    let mut f = facts("gdrcopy-only");
    f.gdrcopy_live = Some(GdrcopyLive {
        library: Some("/usr/lib/libgdrapi.so.2".to_string()),
        runtime_version: Some("2.4".to_string()),
        opened: true,
        driver_version: Some("2.4".to_string()),
        ..GdrcopyLive::default()
    });
    let r = diagnose(&f);
    assert_eq!(get(&r, "gdrcopy.open").status, Status::Pass, "{}", dump(&r));

    // Installed by the files' account but gdr_open fails: blocks CPU-assisted IBGDA when
    // NVSHMEM has no host-memory proxy; the device node cannot be opened.
    f.nvshmem = None;
    f.gdrcopy_live = Some(GdrcopyLive {
        library: Some("/usr/lib/libgdrapi.so.2".to_string()),
        runtime_version: Some("2.4".to_string()),
        dev_access_error: Some("Permission denied (os error 13)".to_string()),
        ..GdrcopyLive::default()
    });
    let r = diagnose(&f);
    assert_eq!(get(&r, "gdrcopy.open").status, Status::Fail, "{}", dump(&r));
    assert!(fix(&r, "gdrcopy.open").contains("sudo chmod 666 /dev/gdrdrv"));
    assert!(
        r.verdict(Capability::IbgdaCpuAssisted)
            .because
            .contains(&"gdrcopy.open")
    );
    // Opens the node, still fails: version mismatch.
    f.gdrcopy_live.as_mut().unwrap().dev_access_error = None;
    let r = diagnose(&f);
    assert!(
        get(&r, "gdrcopy.open")
            .detail
            .contains("different GDRCopy releases")
    );
}

#[test]
fn registration_probe() {
    let mut f = facts("no-nic");
    f.registration = Some(RegistrationProbe {
        skipped: Some("no RDMA device (libibverbs lists none)".to_string()),
        ..RegistrationProbe::default()
    });
    let r = diagnose(&f);
    let c = get(&r, "probe.gpu-registration");
    assert_eq!(c.status, Status::Skip);
    assert!(c.detail.contains("no RDMA device"));

    let mut f = facts("ibgda-driver-enabled");
    f.registration = Some(RegistrationProbe {
        nic: Some("mlx5_0".to_string()),
        gpu: Some(0),
        dmabuf: Some(Attempt {
            ok: true,
            error: None,
        }),
        peermem: None,
        ..RegistrationProbe::default()
    });
    let r = diagnose(&f);
    let c = get(&r, "probe.gpu-registration");
    assert_eq!(c.status, Status::Pass);
    assert!(c.detail.contains("dma-buf: works"), "{}", c.detail);

    f.registration = Some(RegistrationProbe {
        nic: Some("mlx5_0".to_string()),
        gpu: Some(0),
        dmabuf: Some(Attempt {
            ok: false,
            error: Some("ibv_reg_dmabuf_mr returned NULL, errno 95".to_string()),
        }),
        peermem: Some(Attempt {
            ok: false,
            error: Some("ibv_reg_mr returned NULL, errno 14".to_string()),
        }),
        ..RegistrationProbe::default()
    });
    let r = diagnose(&f);
    assert_eq!(get(&r, "probe.gpu-registration").status, Status::Fail);
    assert!(fix(&r, "probe.gpu-registration").contains("sudo modprobe nvidia_peermem"));
    assert!(!r.verdict(Capability::IbgdaGpuInitiated).usable);
}

#[test]
fn facts_without_live_fields_still_parse() {
    let f = facts("gpu-machine");
    let mut v = serde_json::to_value(&f).unwrap();
    let o = v.as_object_mut().unwrap();
    for k in ["cuda", "verbs", "gdrcopy_live", "registration"] {
        assert!(o.remove(k).is_some(), "{k}");
    }
    let back: Facts = serde_json::from_value(v).unwrap();
    assert_eq!(back, f);
}
