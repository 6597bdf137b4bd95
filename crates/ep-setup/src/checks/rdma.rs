//! RDMA checks: rdma-core libraries, NIC present and mlx5, port active, RoCE GID, device nodes.

use crate::facts::Facts;
use crate::report::{Check, Status};

use super::{CPU, GPU, check, in_container};

pub(crate) fn rdma_libraries(f: &Facts) -> Check {
    const ID: &str = "rdma.libraries";
    const T: &str = "rdma-core libraries (libibverbs, libmlx5)";
    let caps = &[GPU, CPU];
    let l = &f.libraries;
    if let (Some(a), Some(b)) = (&l.ibverbs, &l.mlx5) {
        return check(ID, T, caps, Status::Pass, format!("{a}, {b}"), None);
    }
    let mut missing = Vec::new();
    if l.ibverbs.is_none() {
        missing.push("libibverbs.so.1");
    }
    if l.mlx5.is_none() {
        missing.push("libmlx5.so.1");
    }
    let install = if f.os.uses_dracut() {
        "sudo dnf install rdma-core libibverbs"
    } else {
        "sudo apt install libibverbs1 ibverbs-providers"
    };
    check(
        ID,
        T,
        caps,
        Status::Fail,
        format!("missing {}", missing.join(", ")),
        Some(install.to_string()),
    )
}

pub(crate) fn nic_present(f: &Facts) -> Check {
    const ID: &str = "nic.present";
    const T: &str = "RDMA NIC";
    let caps = &[GPU, CPU];
    if !f.nics.is_empty() {
        let names: Vec<&str> = f.nics.iter().map(|n| n.name.as_str()).collect();
        return check(ID, T, caps, Status::Pass, names.join(", "), None);
    }
    let fix = if f.module_loaded("mlx5_core") && !f.module_loaded("mlx5_ib") {
        "mlx5_core is loaded but not its RDMA half: `sudo modprobe mlx5_ib`".to_string()
    } else if in_container(f) {
        "If the host has RDMA NICs, the container does not see them: run it with \
         `--network host --device /dev/infiniband` (Kubernetes: the RDMA shared device \
         plugin). Intranode paths work without a NIC."
            .to_string()
    } else {
        "No RDMA device. Inter-node traffic needs a ConnectX NIC with the mlx5 driver \
         (`sudo modprobe mlx5_ib`; check with `ibv_devices`). Intranode paths work without one."
            .to_string()
    };
    check(
        ID,
        T,
        caps,
        Status::Fail,
        "no RDMA device under /sys/class/infiniband",
        Some(fix),
    )
}

pub(crate) fn nic_mlx5(f: &Facts) -> Check {
    const ID: &str = "nic.mlx5";
    const T: &str = "mlx5 NIC (what IBGDA drives)";
    if f.nics.is_empty() {
        return check(ID, T, &[], Status::Skip, "no RDMA device", None);
    }
    let mlx5: Vec<&str> = f
        .nics
        .iter()
        .filter(|n| n.is_mlx5())
        .map(|n| n.name.as_str())
        .collect();
    if mlx5.is_empty() {
        let others: Vec<&str> = f.nics.iter().map(|n| n.name.as_str()).collect();
        return check(
            ID,
            T,
            &[GPU, CPU],
            Status::Fail,
            format!(
                "only non-mlx5 RDMA devices ({}): NVSHMEM's IBGDA transport drives \
                 ConnectX/BlueField (mlx5) NICs",
                others.join(", ")
            ),
            Some(
                "Use a ConnectX-6 or newer NIC, or fall back to NVSHMEM's IBRC transport \
                 (NVSHMEM_IB_ENABLE_IBGDA=0), which ep-rs does not tune for."
                    .to_string(),
            ),
        );
    }
    check(ID, T, &[GPU, CPU], Status::Pass, mlx5.join(", "), None)
}

pub(crate) fn nic_port_active(f: &Facts) -> Check {
    const ID: &str = "nic.port-active";
    const T: &str = "NIC port active";
    let mlx5: Vec<_> = f.nics.iter().filter(|n| n.is_mlx5()).collect();
    if mlx5.is_empty() {
        return check(ID, T, &[], Status::Skip, "no mlx5 device", None);
    }
    let mut lines = Vec::new();
    let mut any_active = false;
    let mut down = Vec::new();
    for n in &mlx5 {
        for p in &n.ports {
            lines.push(format!(
                "{} port {}: {} ({})",
                n.name, p.port, p.state, p.link_layer
            ));
            if p.active() {
                any_active = true;
            } else {
                down.push((n, p));
            }
        }
    }
    if any_active {
        let status = if down.is_empty() {
            Status::Pass
        } else {
            Status::Warn
        };
        return check(ID, T, &[GPU, CPU], status, lines.join("; "), None);
    }
    let mut fix = vec!["Bring a link up: check cable and switch port (`ibstat`).".to_string()];
    for (n, p) in down {
        if p.is_roce() {
            for nd in &n.netdevs {
                fix.push(format!("sudo ip link set {nd} up"));
            }
        } else {
            fix.push(format!(
                "{} port {}: an InfiniBand port stays INIT without a subnet manager: \
                 `sudo systemctl start opensm` on one node of the fabric.",
                n.name, p.port
            ));
        }
    }
    fix.dedup();
    check(
        ID,
        T,
        &[GPU, CPU],
        Status::Fail,
        if lines.is_empty() {
            "mlx5 devices have no ports in sysfs".to_string()
        } else {
            lines.join("; ")
        },
        Some(fix.join("\n")),
    )
}

pub(crate) fn nic_roce_gid(f: &Facts) -> Check {
    const ID: &str = "nic.roce-gid";
    const T: &str = "RoCE GID index";
    let roce: Vec<_> = f
        .nics
        .iter()
        .filter(|n| n.is_mlx5())
        .flat_map(|n| n.ports.iter().map(move |p| (n, p)))
        .filter(|(_, p)| p.is_roce() && p.active())
        .collect();
    if roce.is_empty() {
        return check(ID, T, &[], Status::Skip, "no active RoCE port", None);
    }
    let ib_active = f
        .nics
        .iter()
        .filter(|n| n.is_mlx5())
        .flat_map(|n| n.ports.iter())
        .any(|p| p.active() && !p.is_roce());
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for (n, p) in &roce {
        match p.preferred_roce_gid() {
            Some(g) => good.push(format!(
                "{} port {}: RoCE v2 GID index {} ({}{})",
                n.name,
                p.port,
                g.index,
                g.gid,
                g.ndev
                    .as_deref()
                    .map(|d| format!(" on {d}"))
                    .unwrap_or_default()
            )),
            None => bad.push((n, p)),
        }
    }
    let gid_index = roce
        .iter()
        .find_map(|(_, p)| p.preferred_roce_gid())
        .map(|g| g.index);
    if bad.is_empty() {
        let idx = gid_index.unwrap_or(0);
        return check(
            ID,
            T,
            &[GPU, CPU],
            Status::Pass,
            format!("{}; NVSHMEM_IB_GID_INDEX={idx}", good.join("; ")),
            None,
        );
    }
    let mut fix = Vec::new();
    for (n, p) in &bad {
        let nd = n.netdevs.first().map_or("<netdev>", String::as_str);
        fix.push(format!(
            "{} port {}: give {nd} an IP address: `sudo ip addr add <ip>/<prefix> dev {nd}`",
            n.name, p.port
        ));
    }
    fix.push(
        "then set NVSHMEM_IB_GID_INDEX to the index of the RoCE v2 entry with that address \
         (`show_gids` lists them)."
            .to_string(),
    );
    let names: Vec<String> = bad
        .iter()
        .map(|(n, p)| format!("{} port {}", n.name, p.port))
        .collect();
    let status = if good.is_empty() && !ib_active {
        Status::Fail
    } else {
        Status::Warn
    };
    check(
        ID,
        T,
        &[GPU, CPU],
        status,
        format!(
            "no RoCE v2 GID on {} (the netdev has no IP address): queue pairs cannot connect",
            names.join(", ")
        ),
        Some(fix.join("\n")),
    )
}

pub(crate) fn nic_device_nodes(f: &Facts) -> Check {
    const ID: &str = "nic.device-nodes";
    const T: &str = "RDMA device nodes (/dev/infiniband)";
    if f.nics.is_empty() {
        return check(ID, T, &[], Status::Skip, "no RDMA device", None);
    }
    let have = |n: &str| f.dev.infiniband.iter().any(|d| d == n);
    let mut missing: Vec<String> = f
        .nics
        .iter()
        .filter_map(|n| n.uverbs.as_deref())
        .filter(|u| !have(u))
        .map(|u| format!("/dev/infiniband/{u}"))
        .collect();
    if !f.dev.infiniband.iter().any(|d| d.starts_with("uverbs")) && missing.is_empty() {
        missing.push("/dev/infiniband/uverbs*".to_string());
    }
    if missing.is_empty() {
        return check(
            ID,
            T,
            &[GPU, CPU],
            Status::Pass,
            format!(
                "/dev/infiniband/{}",
                f.dev.infiniband.join(", /dev/infiniband/")
            ),
            None,
        );
    }
    let fix = if in_container(f) {
        "Start the container with `--device /dev/infiniband --cap-add IPC_LOCK \
         --ulimit memlock=-1:-1` (Kubernetes: the RDMA shared device plugin)."
    } else {
        "`sudo modprobe ib_uverbs` (it creates /dev/infiniband/uverbsN)."
    };
    check(
        ID,
        T,
        &[GPU, CPU],
        Status::Fail,
        format!("missing {}", missing.join(", ")),
        Some(fix.to_string()),
    )
}
