//! Driver checks: loaded, open or proprietary module, the IBGDA keys (with the reboot-pending
//! case), GPU memory registration with the NIC, GDRCopy.

use crate::facts::{Facts, NvshmemFacts, Version};
use crate::report::{Capability, Check, Status};

use super::{CPU, GPU, check, in_container, nvshmem};

/// The file `ep doctor` proposes for the driver keys when no existing file sets them.
pub const IBGDA_MODPROBE_FILE: &str = "/etc/modprobe.d/nvidia-ibgda.conf";

/// The modprobe line that enables GPU-initiated IBGDA (spec §5, option 2.1).
pub const IBGDA_MODPROBE_LINE: &str =
    "options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords=\"PeerMappingOverride=1;\"";

pub(crate) fn driver_loaded(f: &Facts) -> Check {
    const ID: &str = "driver.loaded";
    const T: &str = "NVIDIA driver loaded";
    let all = &Capability::ALL;
    if f.driver.loaded {
        let v = f.driver.version.as_deref().unwrap_or("unknown version");
        let kind = match f.driver.open_module {
            Some(true) => ", open kernel module",
            Some(false) => ", proprietary kernel module",
            None => "",
        };
        return check(ID, T, all, Status::Pass, format!("driver {v}{kind}"), None);
    }
    let fix = if in_container(f) {
        "The container does not see the host's NVIDIA driver. Start it with the NVIDIA \
         Container Toolkit: `docker run --gpus all ...` (Kubernetes: the NVIDIA device plugin), \
         and check that `nvidia-smi` works on the host."
            .to_string()
    } else if f.gpus.is_empty() {
        "No NVIDIA GPU is on the PCI bus either: run on a machine with NVIDIA GPUs.".to_string()
    } else {
        "Load the driver: `sudo modprobe nvidia`. If the module is missing, install the open \
         driver (Ubuntu: `sudo apt install nvidia-driver-580-server-open`; RHEL: \
         `sudo dnf module install nvidia-driver:580-open`) and `sudo reboot`."
            .to_string()
    };
    check(
        ID,
        T,
        all,
        Status::Fail,
        "no NVIDIA kernel driver: /proc/driver/nvidia/version and /sys/module/nvidia are absent",
        Some(fix),
    )
}

pub(crate) fn driver_kernel_module(f: &Facts) -> Check {
    const ID: &str = "driver.kernel-module";
    const T: &str = "open or proprietary kernel module";
    if !f.driver.loaded {
        return check(ID, T, &[], Status::Skip, "no driver loaded", None);
    }
    let peermem = f.module_loaded("nvidia_peermem") || f.module_loaded("nv_peer_mem");
    match f.driver.open_module {
        Some(true) => check(
            ID,
            T,
            &[],
            Status::Pass,
            "open kernel module: dma-buf registration of GPU memory is available",
            None,
        ),
        Some(false) if peermem => check(
            ID,
            T,
            &[],
            Status::Pass,
            "proprietary kernel module; GPU memory registration goes through nvidia_peermem \
             (dma-buf would need the open module)",
            None,
        ),
        Some(false) => check(
            ID,
            T,
            &[],
            Status::Warn,
            "proprietary kernel module: dma-buf registration of GPU memory needs the open one, \
             so RDMA depends on nvidia_peermem",
            Some(
                "Either `sudo modprobe nvidia_peermem`, or switch to the open kernel module \
                 (Ubuntu: `sudo apt install nvidia-driver-580-server-open`) and `sudo reboot`."
                    .to_string(),
            ),
        ),
        None => check(
            ID,
            T,
            &[],
            Status::Warn,
            "could not tell open from proprietary (no NVRM line, no taint flags)",
            None,
        ),
    }
}

/// The modprobe file to edit and the full `options nvidia` line it must hold.
pub(crate) fn ibgda_keys_fix(f: &Facts) -> (String, String) {
    let sets_keys = |k: &str| k == "NVreg_EnableStreamMemOPs" || k == "NVreg_RegistryDwords";
    let existing = f
        .modprobe
        .files
        .iter()
        .rev()
        .find(|m| m.path != "/proc/cmdline" && m.options.iter().any(|(k, _)| sets_keys(k)));
    let Some(file) = existing else {
        return (
            IBGDA_MODPROBE_FILE.to_string(),
            IBGDA_MODPROBE_LINE.to_string(),
        );
    };
    let mut words: Vec<String> = Vec::new();
    let mut dwords: Vec<String> = Vec::new();
    for (k, v) in &file.options {
        match k.as_str() {
            "NVreg_EnableStreamMemOPs" => {}
            "NVreg_RegistryDwords" => dwords.extend(
                v.split(';')
                    .filter(|kv| !kv.trim().is_empty())
                    .filter(|kv| kv.split('=').next().map(str::trim) != Some("PeerMappingOverride"))
                    .map(|kv| kv.trim().to_string()),
            ),
            _ if v.is_empty() => words.push(k.clone()),
            _ if v.contains(char::is_whitespace) => words.push(format!("{k}=\"{v}\"")),
            _ => words.push(format!("{k}={v}")),
        }
    }
    dwords.push("PeerMappingOverride=1".to_string());
    let mut line = String::from("options nvidia");
    for w in &words {
        line.push(' ');
        line.push_str(w);
    }
    line.push_str(" NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords=\"");
    for d in &dwords {
        line.push_str(d);
        line.push(';');
    }
    line.push('"');
    (file.path.clone(), line)
}

pub(crate) fn driver_ibgda_keys(f: &Facts) -> Check {
    const ID: &str = "driver.ibgda-keys";
    const T: &str = "driver keys for GPU-initiated IBGDA";
    let host_note = if in_container(f) {
        "Run these on the host, not in the container (the driver belongs to the host):\n"
    } else {
        ""
    };
    let initramfs = f.os.initramfs_command();
    let running = format!(
        "EnableStreamMemOPs: {}, RegistryDwords: \"{}\"",
        f.driver
            .enable_stream_memops
            .map_or_else(|| "?".to_string(), |v| v.to_string()),
        f.driver.registry_dwords.as_deref().unwrap_or("?")
    );
    if f.driver.loaded && f.driver.ibgda_keys_active() {
        return check(
            ID,
            T,
            &[GPU],
            Status::Pass,
            format!("active in the running driver ({running})"),
            None,
        );
    }
    if f.modprobe.ibgda_keys_configured() {
        let (file, _) = f
            .modprobe
            .effective("NVreg_RegistryDwords")
            .unwrap_or(("modprobe configuration", ""));
        let detail = if f.driver.loaded {
            format!(
                "reboot pending: {file} sets NVreg_EnableStreamMemOPs=1 and \
                 PeerMappingOverride=1, but the running driver has {running}; it was loaded \
                 before the change"
            )
        } else {
            format!("{file} sets both keys; the driver is not loaded")
        };
        return check(
            ID,
            T,
            &[GPU],
            Status::Fail,
            detail,
            Some(format!("{host_note}{initramfs}\nsudo reboot")),
        );
    }
    let (file, line) = ibgda_keys_fix(f);
    let detail = if f.driver.loaded {
        format!("not set: running driver has {running}; no modprobe file sets both keys")
    } else {
        "not set in any modprobe file".to_string()
    };
    let write = if file == IBGDA_MODPROBE_FILE {
        format!("echo '{line}' | sudo tee {file}")
    } else {
        format!("Edit {file} so that its `options nvidia` line reads:\n{line}")
    };
    let fix = format!(
        "{host_note}{write}\n{initramfs}\nsudo reboot\n(Without these keys, GDRCopy gives the \
         CPU-assisted IBGDA path instead.)"
    );
    check(ID, T, &[GPU], Status::Fail, detail, Some(fix))
}

pub(crate) fn gpu_memory_registration(f: &Facts) -> Check {
    const ID: &str = "gpu.memory-registration";
    const T: &str = "GPU memory registration with the NIC (nvidia_peermem or dma-buf)";
    let caps = &[GPU, CPU];
    let peermem = f.module_loaded("nvidia_peermem") || f.module_loaded("nv_peer_mem");
    let kernel =
        f.os.kernel_release
            .as_deref()
            .and_then(|k| k.parse::<Version>().ok());
    let dmabuf_kernel = kernel.is_some_and(|k| k >= Version::new(5, 12, 0));
    let dmabuf = f.driver.loaded && f.driver.open_module == Some(true) && dmabuf_kernel;
    let kernel_s = kernel.map_or_else(|| "unknown".to_string(), |k| k.to_string());
    if peermem || dmabuf {
        let mut ways = Vec::new();
        if peermem {
            ways.push("nvidia_peermem loaded".to_string());
        }
        if dmabuf {
            ways.push(format!("dma-buf (open module, kernel {kernel_s})"));
        }
        return check(ID, T, caps, Status::Pass, ways.join("; "), None);
    }
    let why = if !f.driver.loaded {
        "no driver".to_string()
    } else if f.driver.open_module != Some(true) {
        "nvidia_peermem not loaded, and dma-buf needs the open kernel module".to_string()
    } else {
        format!("nvidia_peermem not loaded, and dma-buf needs kernel >= 5.12 (have {kernel_s})")
    };
    let host = if in_container(f) { "On the host: " } else { "" };
    check(
        ID,
        T,
        caps,
        Status::Fail,
        why,
        Some(format!(
            "{host}`sudo modprobe nvidia_peermem`, and keep it across reboots: \
             `echo nvidia_peermem | sudo tee /etc/modules-load.d/nvidia-peermem.conf`"
        )),
    )
}

pub(crate) fn gdrcopy(f: &Facts) -> Check {
    const ID: &str = "gdrcopy";
    const T: &str = "GDRCopy (CPU-assisted IBGDA)";
    let g = &f.gdrcopy;
    let caps = &[CPU];
    if g.module_loaded && g.dev_node && g.library.is_some() {
        return check(
            ID,
            T,
            caps,
            Status::Pass,
            format!(
                "gdrdrv loaded, /dev/gdrdrv present, {}",
                g.library.as_deref().unwrap_or_default()
            ),
            None,
        );
    }
    let mut missing = Vec::new();
    let mut fix = Vec::new();
    if g.library.is_none() && !g.module_loaded {
        fix.push(
            "Install GDRCopy (https://github.com/NVIDIA/gdrcopy: packages `gdrdrv-dkms` and \
             `libgdrapi`, or `make && sudo make install && sudo ./insmod.sh` from source)."
                .to_string(),
        );
    }
    if g.library.is_none() {
        missing.push("libgdrapi.so");
        if g.module_loaded {
            fix.push(
                "Install the GDRCopy user library (`libgdrapi` package) where the loader finds \
                 it, then `sudo ldconfig`."
                    .to_string(),
            );
        }
    }
    if !g.module_loaded {
        missing.push("gdrdrv module");
        let host = if in_container(f) { "On the host: " } else { "" };
        fix.push(format!("{host}sudo modprobe gdrdrv"));
    }
    if !g.dev_node {
        missing.push("/dev/gdrdrv");
        if g.module_loaded && in_container(f) {
            fix.push("Start the container with `--device /dev/gdrdrv`.".to_string());
        } else if g.module_loaded {
            let major = g.char_major.map_or_else(
                || "$(awk '$2==\"gdrdrv\"{print $1}' /proc/devices)".to_string(),
                |m| m.to_string(),
            );
            fix.push(format!("sudo mknod -m 666 /dev/gdrdrv c {major} 0"));
        } else if in_container(f) {
            fix.push("Then start the container with `--device /dev/gdrdrv`.".to_string());
        }
    }
    // NVSHMEM 3.4.5 added CPU-assisted IBGDA through CUDA host memory, without GDRCopy, and
    // falls back to it by itself (NVSHMEM 3.4.5 release notes).
    if let Some(v) = nvshmem(f)
        .and_then(NvshmemFacts::version)
        .map(|(v, _)| v)
        .filter(|v| *v >= HOST_MEMORY_PROXY)
    {
        return check(
            ID,
            T,
            caps,
            Status::Warn,
            format!(
                "missing {}; NVSHMEM {v} falls back to CPU-assisted IBGDA through CUDA host \
                 memory (NVSHMEM_IBGDA_NIC_HANDLER=cpu_host_memory), slower than GDRCopy",
                missing.join(", ")
            ),
            Some(fix.join("\n")),
        );
    }
    check(
        ID,
        T,
        caps,
        Status::Fail,
        format!("missing {}", missing.join(", ")),
        Some(fix.join("\n")),
    )
}

/// First NVSHMEM whose CPU-assisted IBGDA works without GDRCopy (`cpu_host_memory`).
const HOST_MEMORY_PROXY: Version = Version::new(3, 4, 5);
