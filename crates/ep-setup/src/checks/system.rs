//! System checks: the locked-memory limit, PCIe ACS and the IOMMU.

use crate::facts::Facts;
use crate::report::{Check, Status};

use super::{CPU, GPU, check, in_container};

/// Below this many bytes of lockable memory, RDMA setup fails (QPs, CQs, host buffers).
pub const MEMLOCK_MIN: u64 = 64 << 20;

pub(crate) fn fmt_bytes(b: Option<u64>) -> String {
    match b {
        None => "unlimited".to_string(),
        Some(b) if b >= 1 << 20 => format!("{} MiB", b >> 20),
        Some(b) => format!("{} KiB", b >> 10),
    }
}

pub(crate) fn memlock(f: &Facts) -> Check {
    const ID: &str = "limits.memlock";
    const T: &str = "locked-memory limit (ulimit -l)";
    let caps = &[GPU, CPU];
    let Some(l) = f.memlock else {
        return check(
            ID,
            T,
            caps,
            Status::Warn,
            "could not read Max locked memory from /proc/self/limits",
            None,
        );
    };
    let detail = format!("soft {}, hard {}", fmt_bytes(l.soft), fmt_bytes(l.hard));
    if l.soft.is_none() {
        return check(ID, T, caps, Status::Pass, detail, None);
    }
    let fix = if in_container(f) {
        "Start the container with `--ulimit memlock=-1:-1` (Kubernetes: raise it in the \
         container runtime's default ulimits)."
            .to_string()
    } else if l.hard.is_none() {
        "`ulimit -l unlimited` in the shell that launches the job.".to_string()
    } else {
        "Add to /etc/security/limits.conf:\n* soft memlock unlimited\n* hard memlock unlimited\n\
         then log in again (under systemd services: `LimitMEMLOCK=infinity`), and \
         `ulimit -l unlimited` in the launching shell."
            .to_string()
    };
    let status = if l.soft.is_some_and(|s| s < MEMLOCK_MIN) {
        Status::Fail
    } else {
        Status::Warn
    };
    check(
        ID,
        T,
        caps,
        status,
        format!("{detail}: RDMA queue and buffer registration needs unlimited"),
        Some(fix),
    )
}

pub(crate) fn pci_iommu_acs(f: &Facts) -> Check {
    const ID: &str = "pci.iommu-acs";
    const T: &str = "PCIe ACS and IOMMU (peer-to-peer DMA between GPU and NIC)";
    let caps = &[GPU, CPU];
    let p = &f.pci;
    let cmd = p.cmdline.as_deref().unwrap_or("");
    let words: Vec<&str> = cmd.split_whitespace().collect();
    let passthrough = words
        .iter()
        .any(|w| matches!(*w, "iommu=pt" | "iommu.passthrough=1" | "iommu=off"))
        || words
            .iter()
            .any(|w| matches!(*w, "intel_iommu=off" | "amd_iommu=off"));
    let iommu_on = p.iommu_groups > 0 && !passthrough;
    let unreadable = if p.acs_unreadable > 0 {
        format!(
            "; ACS of {} bridge(s) not read (extended config space needs root)",
            p.acs_unreadable
        )
    } else {
        String::new()
    };
    if !p.acs_redirecting.is_empty() {
        let fix: Vec<String> = p
            .acs_redirecting
            .iter()
            .map(|b| format!("sudo setpci -s {} ECAP_ACS+0x6.w=0000", b.pci_address))
            .collect();
        let list: Vec<String> = p
            .acs_redirecting
            .iter()
            .map(|b| format!("{} (ACS control {:#06x})", b.pci_address, b.acs_control))
            .collect();
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "ACS P2P redirect enabled on switch ports {}: peer-to-peer DMA is sent up to \
                 the root complex (slow, or blocked){unreadable}",
                list.join(", ")
            ),
            Some(format!(
                "Disable ACS redirect on those ports (until the next reboot; put it in a boot \
                 script, or disable ACS in the BIOS):\n{}",
                fix.join("\n")
            )),
        );
    }
    if iommu_on {
        let update = if f.os.uses_dracut() {
            "sudo grub2-mkconfig -o /boot/grub2/grub.cfg"
        } else {
            "sudo update-grub"
        };
        return check(
            ID,
            T,
            caps,
            Status::Warn,
            format!(
                "IOMMU on in translated mode ({} groups, no iommu=pt on the kernel command \
                 line): GPUDirect RDMA can fail or slow down{unreadable}",
                p.iommu_groups
            ),
            Some(format!(
                "Add `iommu=pt` to GRUB_CMDLINE_LINUX in /etc/default/grub, then:\n{update}\n\
                 sudo reboot"
            )),
        );
    }
    let iommu = if p.iommu_groups == 0 {
        "IOMMU off"
    } else {
        "IOMMU in passthrough"
    };
    check(
        ID,
        T,
        caps,
        Status::Pass,
        format!("{iommu}; no switch port redirects peer-to-peer traffic{unreadable}"),
        None,
    )
}
