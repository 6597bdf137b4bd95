//! `diagnose`: facts in, checks and verdicts out. Pure; every branch is exercised by the fixture
//! trees under `tests/fixtures/doctor`.

use std::path::Path;

use super::facts::{Facts, GpuLink, NvshmemFacts, PcieDistance, Version};
use super::report::{Capability, Check, IbgdaMode, IbgdaModeReport, Report, Status, Verdict};

use Capability::{IbgdaCpuAssisted as CPU, IbgdaGpuInitiated as GPU};
use Capability::{IntranodeNvlink as INTRA, LowLatencyNvlink as LL};

/// The file `ep doctor` proposes for the driver keys when no existing file sets them.
pub const IBGDA_MODPROBE_FILE: &str = "/etc/modprobe.d/nvidia-ibgda.conf";

/// The modprobe line that enables GPU-initiated IBGDA (spec §5, option 2.1).
pub const IBGDA_MODPROBE_LINE: &str =
    "options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords=\"PeerMappingOverride=1;\"";

/// Below this many bytes of lockable memory, RDMA setup fails (QPs, CQs, host buffers).
pub const MEMLOCK_MIN: u64 = 64 << 20;

/// Computes every check and verdict from `facts`.
pub fn diagnose(facts: &Facts) -> Report {
    let f = facts;
    let mut checks = vec![
        driver_loaded(f),
        gpu_count(f),
        gpu_device_nodes(f),
        gpu_topology(f),
        driver_ibgda_keys(f),
        driver_kernel_module(f),
        gpu_memory_registration(f),
        gdrcopy(f),
        nvshmem_found(f),
        nvshmem_consistency(f),
        nvshmem_ibgda_plugin(f),
        nvjitlink(f),
        rdma_libraries(f),
        nic_present(f),
        nic_mlx5(f),
        nic_port_active(f),
        nic_roce_gid(f),
        nic_device_nodes(f),
        memlock(f),
        pci_iommu_acs(f),
        gpu_nic_affinity(f),
    ];
    checks.extend(probe(f));
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
    let relevant = checks.iter().filter(|c| c.needed_for.contains(&cap));
    let mut status = Status::Pass;
    let mut because = Vec::new();
    for c in relevant {
        match c.status {
            Status::Fail => {
                status = Status::Fail;
                because.push(c.id);
            }
            Status::Warn => {
                if status == Status::Pass {
                    status = Status::Warn;
                }
                because.push(c.id);
            }
            Status::Pass | Status::Skip => {}
        }
    }
    Verdict {
        capability: cap,
        status,
        usable: status != Status::Fail,
        because,
    }
}

fn check(
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

fn in_container(f: &Facts) -> bool {
    f.container.in_container
}

// ---- driver -------------------------------------------------------------------------------

fn driver_loaded(f: &Facts) -> Check {
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

fn driver_kernel_module(f: &Facts) -> Check {
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
fn ibgda_keys_fix(f: &Facts) -> (String, String) {
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

fn driver_ibgda_keys(f: &Facts) -> Check {
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

// ---- GPUs -----------------------------------------------------------------------------------

/// GPUs this process can open: `/dev/nvidiaN` nodes when any exist, else the PCI functions.
fn usable_gpu_count(f: &Facts) -> usize {
    let nodes = f
        .dev
        .nvidia
        .iter()
        .filter(|n| {
            n.strip_prefix("nvidia")
                .is_some_and(|d| d.parse::<u32>().is_ok())
        })
        .count();
    if nodes > 0 { nodes } else { f.gpus.len() }
}

fn gpu_count(f: &Facts) -> Check {
    const ID: &str = "gpu.count";
    const T: &str = "NVIDIA GPUs";
    let n = usable_gpu_count(f);
    let topo_n = f.topology.as_ref().map_or(0, |t| t.gpu_count());
    let n = n.max(topo_n);
    if n == 0 {
        return check(
            ID,
            T,
            &Capability::ALL,
            Status::Fail,
            "no NVIDIA GPU: no /dev/nvidiaN, no PCI function of vendor 0x10de, class 3D/VGA",
            Some("Run on a machine with NVIDIA GPUs (in a container: `--gpus all`).".to_string()),
        );
    }
    let addrs: Vec<&str> = f.gpus.iter().map(|g| g.pci_address.as_str()).collect();
    let list = if addrs.is_empty() {
        String::new()
    } else {
        format!(" ({})", addrs.join(", "))
    };
    check(
        ID,
        T,
        &Capability::ALL,
        Status::Pass,
        format!("{n} GPU{}{list}", if n == 1 { "" } else { "s" }),
        None,
    )
}

fn gpu_device_nodes(f: &Facts) -> Check {
    const ID: &str = "gpu.device-nodes";
    const T: &str = "GPU device nodes";
    let all = &Capability::ALL;
    if f.gpus.is_empty() && f.dev.nvidia.is_empty() {
        return check(ID, T, &[], Status::Skip, "no GPU", None);
    }
    let mut missing: Vec<String> = ["nvidiactl", "nvidia-uvm"]
        .iter()
        .filter(|n| !f.dev.nvidia.iter().any(|d| d == *n))
        .map(|n| format!("/dev/{n}"))
        .collect();
    let numbered = f
        .dev
        .nvidia
        .iter()
        .filter(|n| {
            n.strip_prefix("nvidia")
                .is_some_and(|d| d.parse::<u32>().is_ok())
        })
        .count();
    if numbered == 0 {
        missing.push("/dev/nvidia0..".to_string());
    }
    if missing.is_empty() {
        return check(
            ID,
            T,
            all,
            Status::Pass,
            format!("/dev/{}", f.dev.nvidia.join(", /dev/")),
            None,
        );
    }
    let fix = if in_container(f) {
        "Start the container with `--gpus all` (NVIDIA Container Toolkit), or pass the nodes: \
         `--device /dev/nvidiactl --device /dev/nvidia-uvm --device /dev/nvidia0 ...`"
    } else {
        "Create the nodes: `sudo nvidia-modprobe -u -c=0` (repeat `-c=N` per GPU), or run \
         `nvidia-smi` once as root."
    };
    check(
        ID,
        T,
        all,
        Status::Fail,
        format!("missing {}", missing.join(", ")),
        Some(fix.to_string()),
    )
}

fn gpu_topology(f: &Facts) -> Check {
    const ID: &str = "gpu.topology";
    const T: &str = "GPU peer-to-peer / NVLink topology";
    let caps = &[INTRA, LL];
    let n = usable_gpu_count(f).max(f.topology.as_ref().map_or(0, |t| t.gpu_count()));
    if n == 0 {
        return check(ID, T, &[], Status::Skip, "no GPU", None);
    }
    let Some(t) = &f.topology else {
        if n == 1 {
            return check(
                ID,
                T,
                caps,
                Status::Warn,
                "one GPU: nothing to reach over NVLink; only 1-rank runs",
                None,
            );
        }
        return check(
            ID,
            T,
            caps,
            Status::Warn,
            format!("{n} GPUs, topology unknown: neither CUDA nor `nvidia-smi topo -m` answered"),
            Some(
                "Run `ep doctor` on the machine itself (not with --sysroot), with nvidia-smi \
                 on PATH."
                    .to_string(),
            ),
        );
    };
    let m = t.gpu_count();
    if m <= 1 {
        return check(
            ID,
            T,
            caps,
            Status::Warn,
            "one GPU: nothing to reach over NVLink; only 1-rank runs",
            None,
        );
    }
    let mut nvlinks = Vec::new();
    let mut pcie_p2p = Vec::new();
    let mut none = Vec::new();
    for i in 0..m {
        for j in i + 1..m {
            match t.links[i][j] {
                GpuLink::NvLink(k) => nvlinks.push(k),
                GpuLink::Pcie {
                    p2p: Some(false), ..
                }
                | GpuLink::None => none.push(format!("GPU{i}-GPU{j}")),
                GpuLink::Pcie { distance, .. } => {
                    pcie_p2p.push(format!("GPU{i}-GPU{j} ({})", distance.label()))
                }
                GpuLink::Same => {}
            }
        }
    }
    if !none.is_empty() {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "no peer-to-peer path between {} (source: {})",
                none.join(", "),
                t.source
            ),
            Some(
                "Use GPUs that share NVLink (set CUDA_VISIBLE_DEVICES to such a set); check \
                 `nvidia-smi nvlink --status` for links that are down."
                    .to_string(),
            ),
        );
    }
    if !pcie_p2p.is_empty() {
        let status = if m <= 2 { Status::Warn } else { Status::Fail };
        return check(
            ID,
            T,
            caps,
            status,
            format!(
                "PCIe only between {} (source: {}): DeepEP allows at most 2 ranks over PCIe, \
                 and low-latency writes over PCIe can be reordered",
                pcie_p2p.join(", "),
                t.source
            ),
            Some(
                "Use GPUs connected by NVLink; check `nvidia-smi nvlink --status` for links \
                 that are down."
                    .to_string(),
            ),
        );
    }
    let min = nvlinks.iter().copied().min().unwrap_or(0);
    let max = nvlinks.iter().copied().max().unwrap_or(0);
    let links = if min == max {
        format!("NV{min}")
    } else {
        format!("NV{min}..NV{max}")
    };
    check(
        ID,
        T,
        caps,
        Status::Pass,
        format!(
            "NVLink between all {m} GPUs ({links}; source: {})",
            t.source
        ),
        None,
    )
}

fn gpu_memory_registration(f: &Facts) -> Check {
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

fn gdrcopy(f: &Facts) -> Check {
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

// ---- NVSHMEM ----------------------------------------------------------------------------------

const NVSHMEM_INSTALL: &str = "Install NVSHMEM >= 3.3.9: `pip install nvidia-nvshmem-cu13` \
    (CUDA 13; `nvidia-nvshmem-cu12` for CUDA 12), or point NVSHMEM_DIR at an install whose lib/ \
    holds libnvshmem_host.so.3.";

fn nvshmem(f: &Facts) -> Option<&NvshmemFacts> {
    f.nvshmem.as_ref()
}

fn nvshmem_found(f: &Facts) -> Check {
    const ID: &str = "nvshmem.found";
    const T: &str = "NVSHMEM >= 3.3.9";
    let caps = &[LL, GPU, CPU];
    let Some(n) = nvshmem(f) else {
        return check(ID, T, caps, Status::Warn, "not looked for", None);
    };
    let Some(lib) = &n.host_library else {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "libnvshmem_host.so not found{}",
                n.load_error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            ),
            Some(NVSHMEM_INSTALL.to_string()),
        );
    };
    if let Some(e) = &n.load_error {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!("{lib} found but does not load: {e}"),
            Some(NVSHMEM_INSTALL.to_string()),
        );
    }
    if n.on_search_path == Some(false) {
        let root = Path::new(lib)
            .parent()
            .and_then(Path::parent)
            .map_or_else(|| lib.clone(), |p| p.display().to_string());
        let v = n
            .version()
            .map_or_else(String::new, |(v, _)| format!("NVSHMEM {v} "));
        return check(
            ID,
            T,
            caps,
            Status::Warn,
            format!(
                "{v}found at {lib}, but ep-rs's library search does not reach it (no \
                 NVSHMEM_DIR, its Python is not on PATH)"
            ),
            Some(format!("export NVSHMEM_DIR={root}")),
        );
    }
    match n.version() {
        Some((v, src)) if v >= Version::NVSHMEM_MIN => check(
            ID,
            T,
            caps,
            Status::Pass,
            format!("NVSHMEM {v} (version from the {src}) at {lib}"),
            None,
        ),
        Some((v, src)) => check(
            ID,
            T,
            caps,
            Status::Fail,
            format!("NVSHMEM {v} (from the {src}) at {lib} is older than 3.3.9"),
            Some(NVSHMEM_INSTALL.to_string()),
        ),
        None => check(
            ID,
            T,
            caps,
            Status::Warn,
            format!("{lib} found, version unknown"),
            None,
        ),
    }
}

fn nvshmem_consistency(f: &Facts) -> Check {
    const ID: &str = "nvshmem.consistency";
    const T: &str = "NVSHMEM host and device library versions agree";
    let caps = &[LL, GPU, CPU];
    let Some(n) = nvshmem(f).filter(|n| n.host_library.is_some()) else {
        return check(
            ID,
            T,
            &[],
            Status::Skip,
            "NVSHMEM not found or not checked",
            None,
        );
    };
    let Some(dev) = &n.device_library else {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            "libnvshmem_device.a is not next to the host library: kernels using the NVSHMEM \
             device API cannot be linked",
            Some(
                "Use a full NVSHMEM install (the pip package nvidia-nvshmem-cu13 ships \
                 lib/libnvshmem_device.a next to libnvshmem_host.so.3) and point NVSHMEM_DIR at it."
                    .to_string(),
            ),
        );
    };
    let known: Vec<(&str, Version)> = [
        ("host library", n.host_version),
        ("headers", n.header_version),
        ("package", n.package_version),
    ]
    .into_iter()
    .filter_map(|(k, v)| v.map(|v| (k, v)))
    .collect();
    let first = known.first().map(|(_, v)| *v);
    if known.iter().any(|(_, v)| Some(*v) != first) {
        let list: Vec<String> = known.iter().map(|(k, v)| format!("{k} {v}")).collect();
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "versions disagree ({}): device code linked against another version than the \
                 host library fails in nvshmemx_cumodule_init",
                list.join(", ")
            ),
            Some(
                "Keep one NVSHMEM: set NVSHMEM_DIR to a single install and remove other \
                 libnvshmem_host.so from LD_LIBRARY_PATH."
                    .to_string(),
            ),
        );
    }
    let v = first.map_or_else(|| "unknown".to_string(), |v| v.to_string());
    check(
        ID,
        T,
        caps,
        Status::Pass,
        format!("{dev} (version {v})"),
        None,
    )
}

fn nvshmem_ibgda_plugin(f: &Facts) -> Check {
    const ID: &str = "nvshmem.ibgda-plugin";
    const T: &str = "NVSHMEM IBGDA transport plugin";
    let Some(n) = nvshmem(f).filter(|n| n.host_library.is_some()) else {
        return check(
            ID,
            T,
            &[],
            Status::Skip,
            "NVSHMEM not found or not checked",
            None,
        );
    };
    if let Some(p) = n.transports.iter().find(|t| t.contains("ibgda")) {
        return check(ID, T, &[GPU, CPU], Status::Pass, p.clone(), None);
    }
    check(
        ID,
        T,
        &[GPU, CPU],
        Status::Fail,
        format!(
            "no nvshmem_transport_ibgda.so* next to the host library (found: {})",
            if n.transports.is_empty() {
                "none".to_string()
            } else {
                n.transports.join(", ")
            }
        ),
        Some(
            "Use an NVSHMEM build with IBGDA (pip nvidia-nvshmem-cu13 and the NVIDIA tarballs \
             ship lib/nvshmem_transport_ibgda.so.3)."
                .to_string(),
        ),
    )
}

fn nvjitlink(f: &Facts) -> Check {
    const ID: &str = "nvjitlink";
    const T: &str = "nvJitLink (run-time linking of NVSHMEM device code)";
    let caps = &[LL, GPU, CPU];
    match &f.libraries.nvjitlink {
        Some(p) => check(ID, T, caps, Status::Pass, p.clone(), None),
        None => check(
            ID,
            T,
            caps,
            Status::Fail,
            "libnvJitLink.so* not found in the loader's directories",
            Some(
                "Install nvJitLink for the driver's CUDA major (`pip install \
                 nvidia-nvjitlink-cu13`, or the CUDA toolkit's libnvjitlink) and make it \
                 findable: add its lib directory to LD_LIBRARY_PATH or to /etc/ld.so.conf.d/ \
                 and run `sudo ldconfig`."
                    .to_string(),
            ),
        ),
    }
}

// ---- RDMA -------------------------------------------------------------------------------------

fn rdma_libraries(f: &Facts) -> Check {
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

fn nic_present(f: &Facts) -> Check {
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

fn nic_mlx5(f: &Facts) -> Check {
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

fn nic_port_active(f: &Facts) -> Check {
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

fn nic_roce_gid(f: &Facts) -> Check {
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

fn nic_device_nodes(f: &Facts) -> Check {
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

// ---- limits, PCI --------------------------------------------------------------------------------

fn fmt_bytes(b: Option<u64>) -> String {
    match b {
        None => "unlimited".to_string(),
        Some(b) if b >= 1 << 20 => format!("{} MiB", b >> 20),
        Some(b) => format!("{} KiB", b >> 10),
    }
}

fn memlock(f: &Facts) -> Check {
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

fn pci_iommu_acs(f: &Facts) -> Check {
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

/// Closest NIC per GPU: `nvidia-smi topo` distances when known, else PCI paths and NUMA nodes.
pub fn closest_nics(f: &Facts) -> Vec<(String, Option<(String, PcieDistance)>)> {
    let mlx5: Vec<_> = f.nics.iter().filter(|n| n.is_mlx5()).collect();
    if let Some(t) = f.topology.as_ref().filter(|t| !t.nics.is_empty()) {
        return (0..t.gpu_count())
            .map(|g| {
                let best = t.nic_distance[g]
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mlx5.is_empty() || mlx5.iter().any(|n| n.name == t.nics[*i]))
                    .min_by_key(|(_, d)| **d)
                    .map(|(i, d)| (t.nics[i].clone(), *d));
                (format!("GPU{g}"), best)
            })
            .collect();
    }
    f.gpus
        .iter()
        .enumerate()
        .map(|(g, gpu)| {
            let best = mlx5
                .iter()
                .map(|n| {
                    let common = gpu
                        .pci_path
                        .iter()
                        .zip(&n.pci_path)
                        .take_while(|(a, b)| a == b)
                        .count();
                    let d = if common >= 3 {
                        // Share a bridge below the root port.
                        if gpu.pci_path.len() - common <= 1 && n.pci_path.len() - common <= 1 {
                            PcieDistance::Pix
                        } else {
                            PcieDistance::Pxb
                        }
                    } else if common >= 1 {
                        PcieDistance::Phb
                    } else if gpu.numa_node.is_some() && gpu.numa_node == n.numa_node {
                        PcieDistance::Node
                    } else {
                        PcieDistance::Sys
                    };
                    (n.name.clone(), d)
                })
                .min_by_key(|(_, d)| *d);
            (format!("GPU{g} ({})", gpu.pci_address), best)
        })
        .collect()
}

fn gpu_nic_affinity(f: &Facts) -> Check {
    const ID: &str = "gpu.nic-affinity";
    const T: &str = "closest NIC per GPU";
    if !f.nics.iter().any(|n| n.is_mlx5()) || (f.gpus.is_empty() && f.topology.is_none()) {
        return check(ID, T, &[], Status::Skip, "no GPU or no mlx5 NIC", None);
    }
    let pairs = closest_nics(f);
    let mut lines = Vec::new();
    let mut far = false;
    for (g, best) in &pairs {
        match best {
            Some((nic, d)) => {
                far |= *d == PcieDistance::Sys;
                lines.push(format!("{g} -> {nic} ({})", d.label()));
            }
            None => lines.push(format!("{g} -> none")),
        }
    }
    if far {
        return check(
            ID,
            T,
            &[],
            Status::Warn,
            format!(
                "{}: a GPU whose closest NIC is across the CPU interconnect (SYS) gets a \
                 fraction of the NIC's bandwidth",
                lines.join("; ")
            ),
            Some(
                "Pin each rank to the NIC on its own PCIe switch or socket \
                 (NVSHMEM_HCA_LIST / NVSHMEM_ENABLE_NIC_PE_MAPPING=1)."
                    .to_string(),
            ),
        );
    }
    check(ID, T, &[], Status::Pass, lines.join("; "), None)
}

// ---- probe and mode -----------------------------------------------------------------------------

fn probe(f: &Facts) -> Vec<Check> {
    let Some(p) = f.probe.as_ref() else {
        return vec![check(
            "probe",
            "NVSHMEM start-up probe",
            &[],
            Status::Skip,
            "not run (pass --probe)",
            None,
        )];
    };
    let up = if p.transports_up.is_empty() {
        "none reported".to_string()
    } else {
        p.transports_up.join(", ")
    };
    let mut out = Vec::new();
    if p.initialized {
        out.push(check(
            "probe.init",
            "NVSHMEM initialises",
            &[LL],
            Status::Pass,
            format!("NVSHMEM initialised; transports up: {up}"),
            None,
        ));
    } else {
        out.push(check(
            "probe.init",
            "NVSHMEM initialises",
            &[LL, GPU, CPU],
            Status::Fail,
            format!(
                "NVSHMEM did not initialise: {}",
                p.error.as_deref().unwrap_or("no error text")
            ),
            Some(
                "Re-run with `NVSHMEM_DEBUG=INFO ep doctor --probe` and read NVSHMEM's log."
                    .to_string(),
            ),
        ));
    }
    let ibgda_up = p.transports_up.iter().any(|t| t == "IBGDA");
    let ibgda_failed = p.transports_failed.iter().any(|t| t == "IBGDA");
    if !p.ibgda_requested {
        out.push(check(
            "probe.ibgda",
            "IBGDA transport came up",
            &[],
            Status::Skip,
            "the probe's plan did not request IBGDA",
            None,
        ));
    } else if p.initialized && ibgda_up && !ibgda_failed {
        out.push(check(
            "probe.ibgda",
            "IBGDA transport came up",
            &[GPU, CPU],
            Status::Pass,
            "IBGDA transport initialised",
            None,
        ));
    } else {
        let detail = if ibgda_failed {
            format!(
                "NVSHMEM printed `init failed for transport: IBGDA` and carried on with {up}: \
                 inter-node traffic would silently use another path"
            )
        } else {
            format!("IBGDA was requested but did not come up (transports up: {up})")
        };
        out.push(check(
            "probe.ibgda",
            "IBGDA transport came up",
            &[GPU, CPU],
            Status::Fail,
            detail,
            Some(
                "Fix the failing checks above (driver keys or GDRCopy, NIC, peer memory)."
                    .to_string(),
            ),
        ));
    }
    out
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
