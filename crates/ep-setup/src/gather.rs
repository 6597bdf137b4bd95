//! Reading [`Facts`] from files under a sysroot. Nothing here opens a device or loads a
//! library: every fact is a file read, a directory listing or a symlink, so a fixture tree
//! stands in for a machine.
//!
//! A sysroot may also hold `ep-doctor/nvidia-smi-topo-m.txt`, the saved output of
//! `nvidia-smi topo -m` (written by `scripts/capture-sysroot.sh`); it is used for the topology.

use std::fs;
use std::path::{Component, Path, PathBuf};

use super::facts::{
    AcsBridge, ContainerFacts, DevNodes, DriverFacts, Facts, GdrcopyFacts, GpuPci, LibraryFacts,
    MemlockLimit, ModprobeFacts, ModprobeFile, NicFacts, NvshmemFacts, OsFacts, PciFacts,
    PortFacts,
};
use super::gid::GidEntry;
use super::parse;

/// Where the saved `nvidia-smi topo -m` output lives inside a captured sysroot.
pub const SAVED_TOPO: &str = "ep-doctor/nvidia-smi-topo-m.txt";

/// Library directories searched under the sysroot, besides `/etc/ld.so.conf.d`.
const LIB_DIRS: [&str; 12] = [
    "/lib",
    "/lib64",
    "/usr/lib",
    "/usr/lib64",
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/local/lib",
    "/usr/local/cuda/lib64",
    "/usr/local/cuda/targets/x86_64-linux/lib",
    "/usr/local/cuda/targets/sbsa-linux/lib",
];

/// Modprobe configuration directories, in the order modprobe gives precedence (a file in an
/// earlier directory hides a same-named file in a later one).
const MODPROBE_DIRS: [&str; 4] = [
    "/etc/modprobe.d",
    "/run/modprobe.d",
    "/usr/local/lib/modprobe.d",
    "/lib/modprobe.d",
];

/// Where NVSHMEM is looked for under the sysroot when the caller names no directory; `*`
/// matches one path component.
const NVSHMEM_DIRS: [&str; 12] = [
    "/usr/lib/x86_64-linux-gnu/nvshmem/13",
    "/usr/lib/x86_64-linux-gnu/nvshmem/12",
    "/usr/lib/sbsa-linux-gnu/nvshmem/13",
    "/usr/lib64/nvshmem/13",
    "/usr/lib64/nvshmem/12",
    "/opt/nvidia/nvshmem/lib",
    "/usr/local/nvshmem/lib",
    "/usr/local/lib/python3*/dist-packages/nvidia/nvshmem/lib",
    "/usr/lib/python3/dist-packages/nvidia/nvshmem/lib",
    "/opt/*/.venv/lib/python3*/site-packages/nvidia/nvshmem/lib",
    "/opt/*/lib/python3*/site-packages/nvidia/nvshmem/lib",
    "/opt/conda/lib",
];

/// What `gather` needs besides the sysroot.
#[derive(Debug, Clone, Default)]
pub struct GatherOptions {
    /// Extra library directories (machine paths, joined under the sysroot), e.g. the entries
    /// of `LD_LIBRARY_PATH` on a live machine.
    pub extra_lib_dirs: Vec<String>,
    /// NVSHMEM library directories to try first (machine paths, `*` allowed), e.g.
    /// `$NVSHMEM_DIR/lib`.
    pub nvshmem_dirs: Vec<String>,
}

/// A directory standing in for `/`.
#[derive(Debug, Clone)]
pub struct Sysroot {
    root: PathBuf,
}

impl Sysroot {
    /// A sysroot at `root` (`/` for the live machine).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The machine path `p` (absolute) under the sysroot.
    pub fn path(&self, p: &str) -> PathBuf {
        self.root.join(p.trim_start_matches('/'))
    }

    fn read(&self, p: &str) -> Option<String> {
        fs::read_to_string(self.path(p)).ok()
    }

    fn read_trim(&self, p: &str) -> Option<String> {
        self.read(p).map(|s| s.trim().to_string())
    }

    fn exists(&self, p: &str) -> bool {
        self.path(p).symlink_metadata().is_ok()
    }

    /// Sorted entry names of a directory (empty when absent).
    fn list(&self, p: &str) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.path(p))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Machine path of `p` after following symlinks inside the sysroot (relative links and
    /// absolute ones alike).
    fn resolve(&self, p: &str) -> String {
        let mut parts: Vec<String> = Vec::new();
        let mut todo: Vec<String> = p
            .split('/')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .rev()
            .collect();
        let mut hops = 0;
        while let Some(c) = todo.pop() {
            match c.as_str() {
                "." => continue,
                ".." => {
                    parts.pop();
                    continue;
                }
                _ => {}
            }
            parts.push(c);
            let here = format!("/{}", parts.join("/"));
            if let Ok(target) = fs::read_link(self.path(&here)) {
                hops += 1;
                if hops > 64 {
                    break;
                }
                parts.pop();
                if target.is_absolute() {
                    parts.clear();
                }
                for comp in target.components().rev() {
                    if let Component::Normal(s) = comp {
                        todo.push(s.to_string_lossy().into_owned());
                    } else if comp == Component::ParentDir {
                        todo.push("..".to_string());
                    }
                }
            }
        }
        format!("/{}", parts.join("/"))
    }

    /// PCI path (`pci0000:00`, bridges..., device) of a sysfs device path.
    fn pci_path(&self, p: &str) -> Vec<String> {
        let real = self.resolve(p);
        let comps: Vec<&str> = real.split('/').filter(|s| !s.is_empty()).collect();
        match comps.iter().position(|c| c.starts_with("pci")) {
            Some(i) => comps[i..]
                .iter()
                .take_while(|c| c.starts_with("pci") || is_bdf(c))
                .map(|c| c.to_string())
                .collect(),
            None => Vec::new(),
        }
    }
}

fn is_bdf(s: &str) -> bool {
    // 0000:3b:00.0
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// Gathers every file-based fact under `root`. The loaded NVSHMEM version, the probe and a
/// topology from CUDA are the caller's to add.
pub fn gather(root: &Path, opts: &GatherOptions) -> Facts {
    let s = Sysroot::new(root);
    let mut f = Facts {
        sysroot: root.display().to_string(),
        ..Facts::default()
    };
    f.os = os(&s);
    f.container = container(&s);
    let (modules, nvidia_taint) = modules(&s);
    f.modules = modules;
    f.driver = driver(&s, nvidia_taint.as_deref());
    f.modprobe = modprobe(&s);
    f.libraries = libraries(&s, opts);
    f.gdrcopy = gdrcopy(&s, &f);
    f.dev = DevNodes {
        nvidia: s
            .list("/dev")
            .into_iter()
            .filter(|n| n.starts_with("nvidia"))
            .collect(),
        infiniband: s.list("/dev/infiniband"),
    };
    f.nics = nics(&s);
    f.gpus = gpus(&s);
    f.pci = pci(&s, &f);
    f.memlock = s
        .read("/proc/self/limits")
        .and_then(|t| parse::memlock(&t))
        .map(|(soft, hard)| MemlockLimit { soft, hard });
    f.topology = s
        .read(&format!("/{SAVED_TOPO}"))
        .and_then(|t| parse::nvidia_smi_topo(&t));
    f.nvshmem = Some(find_nvshmem(root, &opts.nvshmem_dirs));
    f
}

/// NVSHMEM as installed under the sysroot: the first directory of [`nvshmem_dirs`],
/// inspected; when none, facts with `load_error` naming where it looked.
pub fn find_nvshmem(root: &Path, preferred: &[String]) -> NvshmemFacts {
    match nvshmem_dirs(root, preferred).first() {
        Some(dir) => inspect_nvshmem(root, dir),
        None => NvshmemFacts {
            load_error: Some(format!(
                "no libnvshmem_host.so* in {}",
                preferred
                    .iter()
                    .map(String::as_str)
                    .chain(NVSHMEM_DIRS)
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            ..NvshmemFacts::default()
        },
    }
}

fn os(s: &Sysroot) -> OsFacts {
    let rel = s
        .read("/etc/os-release")
        .or_else(|| s.read("/usr/lib/os-release"))
        .unwrap_or_default();
    OsFacts {
        id: parse::os_release(&rel, "ID"),
        id_like: parse::os_release(&rel, "ID_LIKE")
            .map(|v| v.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default(),
        pretty_name: parse::os_release(&rel, "PRETTY_NAME"),
        kernel_release: s.read_trim("/proc/sys/kernel/osrelease"),
    }
}

fn container(s: &Sysroot) -> ContainerFacts {
    let marker = |e: &str| ContainerFacts {
        in_container: true,
        evidence: Some(e.to_string()),
    };
    for p in ["/.dockerenv", "/run/.containerenv"] {
        if s.exists(p) {
            return marker(p);
        }
    }
    if let Ok(env) = fs::read(s.path("/proc/1/environ"))
        && env
            .split(|&b| b == 0)
            .any(|kv| kv.starts_with(b"container="))
    {
        return marker("container= in the environment of PID 1");
    }
    if let Some(cg) = s.read("/proc/1/cgroup") {
        for k in ["docker", "kubepods", "containerd", "lxc", "libpod"] {
            if cg.contains(k) {
                return marker(&format!("/proc/1/cgroup mentions {k}"));
            }
        }
    }
    ContainerFacts::default()
}

fn modules(s: &Sysroot) -> (Vec<String>, Option<String>) {
    let (mut names, taint) = s
        .read("/proc/modules")
        .map(|t| parse::proc_modules(&t))
        .unwrap_or_default();
    // Built-in or /proc-less trees: /sys/module/<name>/initstate marks a loaded module.
    for m in s.list("/sys/module") {
        if s.exists(&format!("/sys/module/{m}/initstate")) && !names.contains(&m) {
            names.push(m);
        }
    }
    (names, taint)
}

fn driver(s: &Sysroot, taint: Option<&str>) -> DriverFacts {
    let mut d = DriverFacts::default();
    let version_text = s.read("/proc/driver/nvidia/version");
    d.loaded = version_text.is_some() || s.exists("/sys/module/nvidia/version");
    if let Some(t) = &version_text {
        let (line, version, open) = parse::driver_version(t);
        d.nvrm_line = line;
        d.version = version;
        d.open_module = open;
    }
    if let Some(v) = s.read_trim("/sys/module/nvidia/version") {
        d.version = Some(v);
    }
    if d.open_module.is_none() || d.open_module == Some(false) {
        // The NVRM line is authoritative when it says "Open"; otherwise a `P` taint flag
        // marks the proprietary module.
        if let Some(t) = taint {
            d.open_module = Some(!t.contains('P'));
        } else if let Some(t) = s.read_trim("/sys/module/nvidia/taint") {
            d.open_module = Some(!t.contains('P'));
        }
    }
    if let Some(t) = s.read("/proc/driver/nvidia/params") {
        let (memops, dwords) = parse::driver_params(&t);
        d.enable_stream_memops = memops;
        d.registry_dwords = dwords;
    }
    d
}

fn modprobe(s: &Sysroot) -> ModprobeFacts {
    // modprobe reads all *.conf files of all directories sorted by name; a name in an earlier
    // directory hides the same name in later ones.
    let mut by_name: Vec<(String, String)> = Vec::new();
    for dir in MODPROBE_DIRS {
        for name in s.list(dir) {
            if name.ends_with(".conf") && !by_name.iter().any(|(n, _)| *n == name) {
                by_name.push((name.clone(), format!("{dir}/{name}")));
            }
        }
    }
    by_name.sort();
    let mut files: Vec<ModprobeFile> = Vec::new();
    for (_, path) in by_name {
        let Some(text) = s.read(&path) else { continue };
        let options = parse::modprobe_options(&text, "nvidia");
        if !options.is_empty() {
            files.push(ModprobeFile { path, options });
        }
    }
    if let Some(cmd) = s.read("/proc/cmdline") {
        // nvidia.NVreg_X=... on the kernel command line applies too.
        let options: Vec<(String, String)> = cmd
            .split_whitespace()
            .filter_map(|w| w.strip_prefix("nvidia."))
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
            .collect();
        if !options.is_empty() {
            files.push(ModprobeFile {
                path: "/proc/cmdline".to_string(),
                options,
            });
        }
    }
    ModprobeFacts { files }
}

fn lib_dirs(s: &Sysroot, opts: &GatherOptions) -> Vec<String> {
    let mut dirs: Vec<String> = opts.extra_lib_dirs.clone();
    let mut conf = s.read("/etc/ld.so.conf").unwrap_or_default();
    for name in s.list("/etc/ld.so.conf.d") {
        if name.ends_with(".conf") {
            conf.push('\n');
            conf.push_str(
                &s.read(&format!("/etc/ld.so.conf.d/{name}"))
                    .unwrap_or_default(),
            );
        }
    }
    for line in conf.lines() {
        let l = line.trim();
        if l.starts_with('/') {
            dirs.push(l.to_string());
        }
    }
    dirs.extend(LIB_DIRS.iter().map(|d| d.to_string()));
    let mut seen = Vec::new();
    dirs.retain(|d| {
        let keep = !seen.contains(d);
        seen.push(d.clone());
        keep
    });
    dirs
}

fn find_lib(s: &Sysroot, dirs: &[String], prefix: &str) -> Option<String> {
    dirs.iter().find_map(|d| {
        s.list(d)
            .into_iter()
            .find(|n| n.starts_with(prefix))
            .map(|n| format!("{}/{n}", d.trim_end_matches('/')))
    })
}

fn libraries(s: &Sysroot, opts: &GatherOptions) -> LibraryFacts {
    let dirs = lib_dirs(s, opts);
    LibraryFacts {
        ibverbs: find_lib(s, &dirs, "libibverbs.so"),
        mlx5: find_lib(s, &dirs, "libmlx5.so"),
        nvjitlink: find_lib(s, &dirs, "libnvJitLink.so"),
        searched: dirs,
    }
}

fn gdrcopy(s: &Sysroot, f: &Facts) -> GdrcopyFacts {
    let dirs = &f.libraries.searched;
    GdrcopyFacts {
        module_loaded: f.module_loaded("gdrdrv"),
        char_major: s
            .read("/proc/devices")
            .and_then(|t| parse::char_major(&t, "gdrdrv")),
        dev_node: s.exists("/dev/gdrdrv"),
        library: find_lib(s, dirs, "libgdrapi.so"),
    }
}

fn nics(s: &Sysroot) -> Vec<NicFacts> {
    let mut uverbs: Vec<(String, String)> = Vec::new();
    for u in s.list("/sys/class/infiniband_verbs") {
        if let Some(dev) = s.read_trim(&format!("/sys/class/infiniband_verbs/{u}/ibdev")) {
            uverbs.push((dev, u));
        }
    }
    let mut out = Vec::new();
    for name in s.list("/sys/class/infiniband") {
        let base = format!("/sys/class/infiniband/{name}");
        let uevent = s.read(&format!("{base}/device/uevent")).unwrap_or_default();
        let uevent_get = |k: &str| {
            uevent
                .lines()
                .find_map(|l| l.strip_prefix(k).map(|v| v.trim().to_string()))
        };
        let pci_path = s.pci_path(&format!("{base}/device"));
        let pci_address =
            uevent_get("PCI_SLOT_NAME=").or_else(|| pci_path.last().filter(|c| is_bdf(c)).cloned());
        let driver = uevent_get("DRIVER=").or_else(|| {
            let r = s.resolve(&format!("{base}/device/driver"));
            r.rsplit('/')
                .next()
                .filter(|d| !d.is_empty() && *d != "driver")
                .map(str::to_string)
        });
        let mut ports = Vec::new();
        for p in s.list(&format!("{base}/ports")) {
            let Ok(port) = p.parse::<u32>() else { continue };
            let pb = format!("{base}/ports/{p}");
            let mut gids = Vec::new();
            for g in s.list(&format!("{pb}/gids")) {
                let Ok(index) = g.parse::<u32>() else {
                    continue;
                };
                let Some(gid) = s.read_trim(&format!("{pb}/gids/{g}")) else {
                    continue;
                };
                if gid.chars().all(|c| c == '0' || c == ':') {
                    continue;
                }
                gids.push(GidEntry {
                    index,
                    gid,
                    kind: s.read_trim(&format!("{pb}/gid_attrs/types/{g}")),
                    ndev: s.read_trim(&format!("{pb}/gid_attrs/ndevs/{g}")),
                });
            }
            gids.sort_by_key(|g| g.index);
            ports.push(PortFacts {
                port,
                state: s.read_trim(&format!("{pb}/state")).unwrap_or_default(),
                link_layer: s.read_trim(&format!("{pb}/link_layer")).unwrap_or_default(),
                gids,
            });
        }
        ports.sort_by_key(|p| p.port);
        out.push(NicFacts {
            uverbs: uverbs
                .iter()
                .find(|(d, _)| *d == name)
                .map(|(_, u)| u.clone()),
            numa_node: s
                .read_trim(&format!("{base}/device/numa_node"))
                .and_then(|v| v.parse().ok()),
            netdevs: s.list(&format!("{base}/device/net")),
            name,
            driver,
            pci_address,
            pci_path,
            ports,
        });
    }
    out
}

fn gpus(s: &Sysroot) -> Vec<GpuPci> {
    let mut out = Vec::new();
    for bdf in s.list("/sys/bus/pci/devices") {
        let base = format!("/sys/bus/pci/devices/{bdf}");
        if s.read_trim(&format!("{base}/vendor")).as_deref() != Some("0x10de") {
            continue;
        }
        let class = s.read_trim(&format!("{base}/class")).unwrap_or_default();
        // 0x0302xx: 3D controller (data-centre GPUs); 0x0300xx: VGA controller.
        if !(class.starts_with("0x0302") || class.starts_with("0x0300")) {
            continue;
        }
        let group = s.resolve(&format!("{base}/iommu_group"));
        out.push(GpuPci {
            device_id: s.read_trim(&format!("{base}/device")),
            numa_node: s
                .read_trim(&format!("{base}/numa_node"))
                .and_then(|v| v.parse().ok()),
            pci_path: s.pci_path(&base),
            iommu_group: group
                .strip_prefix("/sys/kernel/iommu_groups/")
                .and_then(|g| g.parse().ok()),
            pci_address: bdf,
        });
    }
    out
}

fn pci(s: &Sysroot, f: &Facts) -> PciFacts {
    let mut p = PciFacts {
        cmdline: s.read_trim("/proc/cmdline"),
        iommu_groups: s.list("/sys/kernel/iommu_groups").len(),
        ..PciFacts::default()
    };
    // Bridges on the way to a GPU or NIC; all bridges when no path is known.
    let mut on_path: Vec<&String> = f
        .gpus
        .iter()
        .flat_map(|g| g.pci_path.iter())
        .chain(f.nics.iter().flat_map(|n| n.pci_path.iter()))
        .collect();
    on_path.sort();
    on_path.dedup();
    for bdf in s.list("/sys/bus/pci/devices") {
        let base = format!("/sys/bus/pci/devices/{bdf}");
        let class = s.read_trim(&format!("{base}/class")).unwrap_or_default();
        if !class.starts_with("0x0604") || (!on_path.is_empty() && !on_path.contains(&&bdf)) {
            continue;
        }
        let Ok(cfg) = fs::read(s.path(&format!("{base}/config"))) else {
            continue;
        };
        if cfg.len() <= 256 {
            p.acs_unreadable += 1;
            continue;
        }
        // Switch downstream ports (type 6) decide whether peers below them talk directly.
        if parse::pcie_port_type(&cfg) != Some(6) {
            continue;
        }
        if let Some(ctl) = parse::acs_control(&cfg) {
            // Bit 2: P2P Request Redirect, bit 3: P2P Completion Redirect (PCIe base spec,
            // ACS Control register).
            if ctl & 0b1100 != 0 {
                p.acs_redirecting.push(AcsBridge {
                    pci_address: bdf,
                    acs_control: ctl,
                });
            }
        }
    }
    p
}

/// Candidate NVSHMEM library directories under the sysroot: `preferred` (machine paths, e.g.
/// `$NVSHMEM_DIR/lib`) first, then the usual install locations. Only directories holding a
/// `libnvshmem_host.so*` are returned.
pub fn nvshmem_dirs(root: &Path, preferred: &[String]) -> Vec<String> {
    let s = Sysroot::new(root);
    let mut out: Vec<String> = Vec::new();
    let patterns = preferred
        .iter()
        .map(String::as_str)
        .chain(NVSHMEM_DIRS.iter().copied());
    for pat in patterns {
        for dir in expand(&s, pat) {
            let has_host = s
                .list(&dir)
                .iter()
                .any(|n| n.starts_with("libnvshmem_host.so"));
            if has_host && !out.contains(&dir) {
                out.push(dir);
            }
        }
    }
    out
}

/// Expands `*` path components against the sysroot.
fn expand(s: &Sysroot, pattern: &str) -> Vec<String> {
    let mut acc = vec![String::new()];
    for comp in pattern.split('/').filter(|c| !c.is_empty()) {
        let mut next = Vec::new();
        for base in &acc {
            if let Some((pre, post)) = comp.split_once('*') {
                for n in s.list(if base.is_empty() { "/" } else { base }) {
                    if n.starts_with(pre) && n.ends_with(post) && n.len() >= pre.len() + post.len()
                    {
                        next.push(format!("{base}/{n}"));
                    }
                }
            } else {
                next.push(format!("{base}/{comp}"));
            }
        }
        acc = next;
    }
    acc
}

/// File-based facts about the NVSHMEM installation in `lib_dir` (a machine path under the
/// sysroot): host and device libraries, plugins, header and package versions. The loaded
/// library's own version (`host_version`) is the caller's to fill.
pub fn inspect_nvshmem(root: &Path, lib_dir: &str) -> NvshmemFacts {
    let s = Sysroot::new(root);
    let names = s.list(lib_dir);
    let dir = lib_dir.trim_end_matches('/');
    let pick = |prefix: &str| -> Option<String> {
        // Prefer the versioned soname (`.so.3`) over a bare `.so` or a full `.so.3.4.5`.
        let mut c: Vec<&String> = names.iter().filter(|n| n.starts_with(prefix)).collect();
        c.sort_by_key(|n| (n.matches('.').count() != 2, n.len()));
        c.first().map(|n| format!("{dir}/{n}"))
    };
    let parent = dir.rsplit_once('/').map_or("", |(p, _)| p);
    let header_version = s
        .read(&format!("{parent}/include/non_abi/nvshmem_version.h"))
        .or_else(|| s.read(&format!("{parent}/include/nvshmem_version.h")))
        .and_then(|t| parse::nvshmem_version_header(&t));
    // pip: <site-packages>/nvidia/nvshmem/lib → <site-packages>/nvidia_nvshmem_cu13-3.4.5.dist-info
    let package_version = parent.rsplit_once('/').map(|(p, _)| p).and_then(|site| {
        s.list(site).into_iter().find_map(|n| {
            let rest = n
                .strip_prefix("nvidia_nvshmem")?
                .strip_suffix(".dist-info")?;
            rest.rsplit_once('-')?.1.parse().ok()
        })
    });
    NvshmemFacts {
        host_library: pick("libnvshmem_host.so"),
        host_version: None,
        load_error: None,
        on_search_path: None,
        device_library: names
            .iter()
            .find(|n| *n == "libnvshmem_device.a")
            .map(|n| format!("{dir}/{n}")),
        header_version,
        package_version,
        transports: names
            .iter()
            .filter(|n| n.starts_with("nvshmem_transport_"))
            .cloned()
            .collect(),
        bootstraps: names
            .iter()
            .filter(|n| n.starts_with("nvshmem_bootstrap_"))
            .cloned()
            .collect(),
    }
}
