//! Checks on live rdma-core and GDRCopy facts: `rdma.verbs-consistency` (libibverbs lists what
//! sysfs lists), `nic.verbs-ports` (ports and GIDs through verbs versus sysfs), `nic.devx`
//! (mlx5 DevX contexts open: NVSHMEM's IBGDA transport creates its queues through DevX),
//! `gdrcopy.open` (`gdr_open` works), `probe.gpu-registration` (a GPU buffer registered with
//! the NIC). Each is skipped when its facts are absent (`--sysroot`, or not run).

use std::collections::BTreeSet;

use crate::facts::{Facts, NicFacts, NvshmemFacts, Version};
use crate::live::{VerbsDevice, VerbsFacts};
use crate::report::{Check, Status};

use super::{CPU, GPU, check, in_container, nvshmem};

const NOT_QUERIED: &str = "not queried (live probes run on the machine itself, without --sysroot)";

const EPERM: i32 = 1;
const ENOENT: i32 = 2;
const EACCES: i32 = 13;
const EINVAL: i32 = 22;
const EOPNOTSUPP: i32 = 95;

fn install_rdma_core(f: &Facts) -> &'static str {
    if f.os.uses_dracut() {
        "sudo dnf install rdma-core libibverbs"
    } else {
        "sudo apt install libibverbs1 ibverbs-providers"
    }
}

fn uverbs_access_fix(f: &Facts) -> String {
    if in_container(f) {
        "Start the container with `--device /dev/infiniband --cap-add IPC_LOCK --ulimit \
         memlock=-1:-1` (Kubernetes: the RDMA shared device plugin)."
            .to_string()
    } else {
        "Give this user read-write access to /dev/infiniband/uverbs*: a udev rule \
         `echo 'KERNEL==\"uverbs*\", MODE=\"0666\"' | sudo tee /etc/udev/rules.d/90-rdma.rules \
         && sudo udevadm trigger`, or run as a member of the group owning the nodes \
         (`ls -l /dev/infiniband`)."
            .to_string()
    }
}

pub(crate) fn rdma_verbs_consistency(f: &Facts) -> Check {
    const ID: &str = "rdma.verbs-consistency";
    const T: &str = "libibverbs lists the kernel's RDMA devices";
    let caps = &[GPU, CPU];
    let Some(v) = f.verbs.as_ref() else {
        return check(ID, T, &[], Status::Skip, NOT_QUERIED, None);
    };
    let sysfs: BTreeSet<&str> = f.nics.iter().map(|n| n.name.as_str()).collect();
    let sysfs_list = || sysfs.iter().copied().collect::<Vec<_>>().join(", ");
    if let Some(e) = &v.load_error {
        if sysfs.is_empty() {
            return check(
                ID,
                T,
                &[],
                Status::Skip,
                format!("libibverbs not loadable and no RDMA device in sysfs: {e}"),
                None,
            );
        }
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "/sys/class/infiniband lists {} but libibverbs.so.1 could not be loaded: {e}",
                sysfs_list()
            ),
            Some(format!("{}, then `sudo ldconfig`", install_rdma_core(f))),
        );
    }
    if v.no_rdma_subsystem {
        if sysfs.is_empty() {
            return check(
                ID,
                T,
                &[],
                Status::Skip,
                "ibv_get_device_list: ENOSYS (no kernel RDMA support loaded), consistent with \
                 an empty /sys/class/infiniband",
                None,
            );
        }
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "/sys/class/infiniband lists {} but ibv_get_device_list fails with ENOSYS: \
                 the user-verbs interface (ib_uverbs, /sys/class/infiniband_verbs) is not \
                 loaded",
                sysfs_list()
            ),
            Some("sudo modprobe ib_uverbs".to_string()),
        );
    }
    if let Some(e) = &v.list_error {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!("ibv_get_device_list failed: {e}"),
            Some("Run `ibv_devices` to see the same failure; `dmesg | grep -i -e mlx5 -e ib_` shows the kernel's side.".to_string()),
        );
    }
    let verbs: BTreeSet<&str> = v.devices.iter().map(|d| d.name.as_str()).collect();
    let missing: Vec<&NicFacts> = f
        .nics
        .iter()
        .filter(|n| !verbs.contains(n.name.as_str()))
        .collect();
    let extra: Vec<&str> = verbs.difference(&sysfs).copied().collect();
    if sysfs.is_empty() && verbs.is_empty() {
        return check(
            ID,
            T,
            &[],
            Status::Skip,
            "no RDMA device; libibverbs agrees (0 devices)",
            None,
        );
    }
    if !missing.is_empty() {
        let names: Vec<&str> = missing.iter().map(|n| n.name.as_str()).collect();
        let mut fix = Vec::new();
        let no_node: Vec<String> = missing
            .iter()
            .filter_map(|n| n.uverbs.as_deref())
            .filter(|u| !f.dev.infiniband.iter().any(|d| d == u))
            .map(|u| format!("/dev/infiniband/{u}"))
            .collect();
        if !no_node.is_empty() {
            fix.push(format!(
                "libibverbs skips devices whose node is missing ({}): {}",
                no_node.join(", "),
                if in_container(f) {
                    "start the container with `--device /dev/infiniband`"
                } else {
                    "`sudo modprobe ib_uverbs`"
                }
            ));
        }
        if missing.iter().any(|n| n.is_mlx5()) {
            fix.push(format!(
                "rdma-core needs its mlx5 provider (libmlx5.so.1 and /etc/libibverbs.d/mlx5.driver): \
                 {}",
                install_rdma_core(f)
            ));
        } else {
            fix.push(format!(
                "Install the rdma-core provider for these devices: {}",
                install_rdma_core(f)
            ));
        }
        let blocks = missing.iter().any(|n| n.is_mlx5())
            && !v
                .devices
                .iter()
                .any(|d| d.mlx5 == Some(true) || d.name.starts_with("mlx5"));
        return check(
            ID,
            T,
            if blocks { caps } else { &[] },
            if blocks { Status::Fail } else { Status::Warn },
            format!(
                "/sys/class/infiniband lists {} but libibverbs ({}) does not list {}",
                sysfs_list(),
                v.library.as_deref().unwrap_or("?"),
                names.join(", ")
            ),
            Some(fix.join("\n")),
        );
    }
    if !extra.is_empty() {
        return check(
            ID,
            T,
            &[],
            Status::Warn,
            format!(
                "libibverbs lists {} that /sys/class/infiniband does not: the sysfs read belongs \
                 to another view of the machine (a container with the host's /sys?)",
                extra.join(", ")
            ),
            None,
        );
    }
    check(
        ID,
        T,
        caps,
        Status::Pass,
        format!(
            "libibverbs ({}) lists the same {} device{} as sysfs: {}",
            v.library.as_deref().unwrap_or("?"),
            verbs.len(),
            if verbs.len() == 1 { "" } else { "s" },
            sysfs_list()
        ),
        None,
    )
}

fn is_mlx5(f: &Facts, d: &VerbsDevice) -> bool {
    d.mlx5 == Some(true)
        || d.name.starts_with("mlx5")
        || f.nics.iter().any(|n| n.name == d.name && n.is_mlx5())
}

fn listed(v: &VerbsFacts) -> bool {
    v.load_error.is_none() && !v.no_rdma_subsystem && v.list_error.is_none()
}

/// The verbs facts and the mlx5 devices libibverbs listed, or the Skip check (`id`, `title`)
/// saying why there are none: the common start of the per-mlx5-device live checks.
fn listed_mlx5<'a>(
    f: &'a Facts,
    id: &'static str,
    title: &'static str,
) -> Result<(&'a VerbsFacts, Vec<&'a VerbsDevice>), Check> {
    let Some(v) = f.verbs.as_ref().filter(|v| listed(v)) else {
        let why = if f.verbs.is_some() {
            "libibverbs lists no device (see rdma.verbs-consistency)"
        } else {
            NOT_QUERIED
        };
        return Err(check(id, title, &[], Status::Skip, why, None));
    };
    let mlx5: Vec<&VerbsDevice> = v.devices.iter().filter(|d| is_mlx5(f, d)).collect();
    if mlx5.is_empty() {
        return Err(check(id, title, &[], Status::Skip, "no mlx5 device", None));
    }
    Ok((v, mlx5))
}

pub(crate) fn nic_verbs_ports(f: &Facts) -> Check {
    const ID: &str = "nic.verbs-ports";
    const T: &str = "NIC ports through verbs (open, state, GIDs) vs sysfs";
    let caps = &[GPU, CPU];
    let (_, mlx5) = match listed_mlx5(f, ID, T) {
        Ok(found) => found,
        Err(skip) => return skip,
    };
    let mut lines = Vec::new();
    let mut diffs = Vec::new();
    let mut closed = Vec::new();
    for d in &mlx5 {
        if let Some(e) = &d.open_error {
            closed.push((d, e));
            continue;
        }
        let sys = f.nics.iter().find(|n| n.name == d.name);
        for p in &d.ports {
            let v2 = p.gids.iter().find(|g| g.kind.as_deref() == Some("RoCE v2"));
            lines.push(format!(
                "{} port {}: {} ({}), {} GIDs{}",
                d.name,
                p.port,
                p.state,
                p.link_layer,
                p.gids.len(),
                v2.map(|g| format!(", RoCE v2 at index {}", g.index))
                    .unwrap_or_default()
            ));
            let Some(sp) = sys.and_then(|n| n.ports.iter().find(|sp| sp.port == p.port)) else {
                diffs.push(format!("{} port {}: not in sysfs", d.name, p.port));
                continue;
            };
            if sp.active() != p.active() {
                diffs.push(format!(
                    "{} port {}: state {} in verbs, {} in sysfs",
                    d.name, p.port, p.state, sp.state
                ));
            }
            if !sp.link_layer.eq_ignore_ascii_case(&p.link_layer) {
                diffs.push(format!(
                    "{} port {}: link layer {} in verbs, {} in sysfs",
                    d.name, p.port, p.link_layer, sp.link_layer
                ));
            }
            let ours: BTreeSet<(u32, &str)> =
                p.gids.iter().map(|g| (g.index, g.gid.as_str())).collect();
            let theirs: BTreeSet<(u32, &str)> =
                sp.gids.iter().map(|g| (g.index, g.gid.as_str())).collect();
            if ours != theirs {
                diffs.push(format!(
                    "{} port {}: GID table differs ({} entries in verbs, {} in sysfs)",
                    d.name,
                    p.port,
                    ours.len(),
                    theirs.len()
                ));
            }
        }
    }
    if closed.len() == mlx5.len() {
        let d = closed[0].0;
        let perm = matches!(d.open_errno, Some(EACCES) | Some(EPERM));
        let fix = if perm {
            uverbs_access_fix(f)
        } else if d.open_errno == Some(ENOENT) {
            "The device node is missing: `sudo modprobe ib_uverbs` (in a container: \
             `--device /dev/infiniband`)."
                .to_string()
        } else {
            "Run `ibv_devinfo -d <device>` to see the same failure; `dmesg | grep -i mlx5` \
             shows the kernel's side."
                .to_string()
        };
        let names: Vec<String> = closed
            .iter()
            .map(|(d, e)| format!("{}: {e}", d.name))
            .collect();
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "ibv_open_device failed for every mlx5 device ({})",
                names.join("; ")
            ),
            Some(fix),
        );
    }
    for (d, e) in &closed {
        diffs.push(format!("{}: ibv_open_device failed: {e}", d.name));
    }
    if !diffs.is_empty() {
        return check(
            ID,
            T,
            &[],
            Status::Warn,
            format!("{}; differences: {}", lines.join("; "), diffs.join("; ")),
            Some(
                "Verbs and sysfs disagree: a container whose /sys is the host's, or a link \
                 that changed state between the two reads; run `ibv_devinfo -v` and \
                 `show_gids` where the job runs and configure from what they show."
                    .to_string(),
            ),
        );
    }
    check(
        ID,
        T,
        caps,
        Status::Pass,
        format!("{}; same as sysfs", lines.join("; ")),
        None,
    )
}

pub(crate) fn nic_devx(f: &Facts) -> Check {
    const ID: &str = "nic.devx";
    const T: &str = "mlx5 DevX context (IBGDA creates its queues through it)";
    let caps = &[GPU, CPU];
    let (v, mlx5) = match listed_mlx5(f, ID, T) {
        Ok(found) => found,
        Err(skip) => return skip,
    };
    if let Some(e) = &v.mlx5_error {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!("libmlx5.so.1 could not be loaded: {e}"),
            Some(format!("{}, then `sudo ldconfig`", install_rdma_core(f))),
        );
    }
    let mut ok = Vec::new();
    let mut bad: Vec<(String, Option<i32>, String)> = Vec::new();
    for d in &mlx5 {
        match (&d.mlx5, &d.devx) {
            (Some(false), _) => bad.push((
                d.name.clone(),
                None,
                "mlx5dv_is_supported = false (another provider drives it)".to_string(),
            )),
            (_, Some(x)) if x.opened => ok.push(d.name.clone()),
            (_, Some(x)) => bad.push((
                d.name.clone(),
                x.errno,
                x.error.clone().unwrap_or_else(|| "failed".to_string()),
            )),
            (_, None) => bad.push((d.name.clone(), None, "not tried".to_string())),
        }
    }
    if bad.is_empty() {
        return check(
            ID,
            T,
            caps,
            Status::Pass,
            format!("DevX opens on {}", ok.join(", ")),
            None,
        );
    }
    let mut fix = Vec::new();
    for (name, errno, _) in &bad {
        let line = match *errno {
            Some(EPERM) | Some(EACCES) => format!("{name}: {}", uverbs_access_fix(f)),
            Some(EOPNOTSUPP) | Some(EINVAL) => format!(
                "{name}: the firmware or kernel does not offer DevX: update the NIC firmware \
                 (`sudo mlxfwmanager --online -u`), use a ConnectX-6 or newer, and a kernel \
                 whose mlx5_ib has DevX (>= 5.4, or DOCA-OFED/MLNX_OFED)"
            ),
            _ => format!(
                "{name}: install rdma-core's mlx5 provider ({}) and check `dmesg | grep -i \
                 mlx5` for the kernel's reason",
                install_rdma_core(f)
            ),
        };
        fix.push(line);
    }
    let detail: Vec<String> = bad.iter().map(|(n, _, e)| format!("{n}: {e}")).collect();
    let status = if ok.is_empty() {
        Status::Fail
    } else {
        Status::Warn
    };
    let ok_note = if ok.is_empty() {
        String::new()
    } else {
        format!("; DevX opens on {}", ok.join(", "))
    };
    check(
        ID,
        T,
        if ok.is_empty() { caps } else { &[] },
        status,
        format!("DevX context refused: {}{ok_note}", detail.join("; ")),
        Some(fix.join("\n")),
    )
}

/// First NVSHMEM whose CPU-assisted IBGDA works without GDRCopy (`cpu_host_memory`).
const HOST_MEMORY_PROXY: Version = Version::new(3, 4, 5);

pub(crate) fn gdrcopy_open(f: &Facts) -> Check {
    const ID: &str = "gdrcopy.open";
    const T: &str = "GDRCopy opens (gdr_open)";
    let Some(g) = f.gdrcopy_live.as_ref() else {
        return check(ID, T, &[], Status::Skip, NOT_QUERIED, None);
    };
    let host = if in_container(f) { "On the host: " } else { "" };
    let (detail, fix) = if let Some(e) = &g.library_error {
        (
            format!(
                "library missing: {}",
                e.lines()
                    .next()
                    .unwrap_or_default()
                    .split("; searched")
                    .next()
                    .unwrap_or_default()
            ),
            "Install GDRCopy's user library (https://github.com/NVIDIA/gdrcopy: package \
             `libgdrapi`, or `make lib_install` from source) where the loader finds it, then \
             `sudo ldconfig`."
                .to_string(),
        )
    } else if g.opened {
        let detail = format!(
            "{} {}: gdr_open works, gdrdrv {}",
            g.library.as_deref().unwrap_or("libgdrapi"),
            g.runtime_version.as_deref().unwrap_or("?"),
            g.driver_version.as_deref().unwrap_or("?")
        );
        return check(ID, T, &[CPU], Status::Pass, detail, None);
    } else if !f.gdrcopy.module_loaded {
        (
            "driver missing: gdr_open failed and the gdrdrv module is not loaded".to_string(),
            format!(
                "{host}`sudo modprobe gdrdrv` (package `gdrdrv-dkms`, or GDRCopy's \
                 `sudo ./insmod.sh`)"
            ),
        )
    } else if let Some(e) = &g.dev_access_error {
        let fix = if in_container(f) {
            "Start the container with `--device /dev/gdrdrv`.".to_string()
        } else {
            "`sudo chmod 666 /dev/gdrdrv` (GDRCopy's insmod.sh creates it world read-write)"
                .to_string()
        };
        (
            format!("gdrdrv is loaded but /dev/gdrdrv cannot be opened: {e}"),
            fix,
        )
    } else {
        (
            format!(
                "gdrdrv is loaded and /dev/gdrdrv opens, but gdr_open failed: libgdrapi {} \
                 and the loaded gdrdrv are from different GDRCopy releases",
                g.runtime_version.as_deref().unwrap_or("?")
            ),
            format!(
                "{host}install gdrdrv and libgdrapi from the same GDRCopy release and reload \
                 the module: `sudo rmmod gdrdrv && sudo modprobe gdrdrv`"
            ),
        )
    };
    // Only blocks when the file-based `gdrcopy` check saw a complete install (otherwise that
    // check already names the problem), and never when NVSHMEM has the host-memory proxy.
    let looked_complete =
        f.gdrcopy.module_loaded && f.gdrcopy.dev_node && f.gdrcopy.library.is_some();
    let proxy = nvshmem(f)
        .and_then(NvshmemFacts::version)
        .is_some_and(|(v, _)| v >= HOST_MEMORY_PROXY);
    let (status, caps): (Status, &[_]) = if looked_complete && !proxy {
        (Status::Fail, &[CPU])
    } else {
        (Status::Warn, &[])
    };
    check(ID, T, caps, status, detail, Some(fix))
}

pub(crate) fn probe_registration(f: &Facts) -> Check {
    const ID: &str = "probe.gpu-registration";
    const T: &str = "GPU memory registers with the NIC (--probe)";
    let caps = &[GPU, CPU];
    let Some(r) = f.registration.as_ref() else {
        return check(ID, T, &[], Status::Skip, "not run (pass --probe)", None);
    };
    if let Some(why) = &r.skipped {
        return check(ID, T, &[], Status::Skip, why.clone(), None);
    }
    let on = format!(
        "GPU {} on {}",
        r.gpu.map_or_else(|| "?".to_string(), |g| g.to_string()),
        r.nic.as_deref().unwrap_or("?")
    );
    let worked = |a: &Option<crate::live::Attempt>| a.as_ref().is_some_and(|a| a.ok);
    let why = |a: &Option<crate::live::Attempt>| match a {
        None => "not tried".to_string(),
        Some(a) if a.ok => "works".to_string(),
        Some(a) => a.error.clone().unwrap_or_else(|| "failed".to_string()),
    };
    let detail = format!(
        "{on}: dma-buf: {}; peer memory (ibv_reg_mr): {}",
        why(&r.dmabuf),
        why(&r.peermem)
    );
    if worked(&r.dmabuf) || worked(&r.peermem) {
        return check(ID, T, caps, Status::Pass, detail, None);
    }
    let host = if in_container(f) { "On the host: " } else { "" };
    check(
        ID,
        T,
        caps,
        Status::Fail,
        detail,
        Some(format!(
            "{host}`sudo modprobe nvidia_peermem` (proprietary or open module), or use the open \
             kernel module with kernel >= 5.12 and rdma-core >= 34 for dma-buf; see \
             gpu.memory-registration."
        )),
    )
}
