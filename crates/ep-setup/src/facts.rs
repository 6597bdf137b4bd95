//! What `ep doctor` knows about a machine: plain data, gathered from files under a sysroot
//! ([`super::gather`]) plus what only live libraries can tell (NVSHMEM's loaded version, a
//! topology from CUDA, the probe), filled by the caller so ep-core stays free of CUDA and
//! NVSHMEM.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::gid::GidEntry;
use super::live::{CudaFacts, GdrcopyLive, RegistrationProbe, VerbsFacts};

/// A `major.minor.patch` version (driver, NVSHMEM, kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Version {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Patch (0 when the string had only two fields).
    pub patch: u32,
}

impl Version {
    /// The oldest NVSHMEM ep-rs supports (spec §5: "NVSHMEM v3.3.9 or later").
    pub const NVSHMEM_MIN: Version = Version::new(3, 3, 9);

    /// A version from its three fields.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

impl FromStr for Version {
    type Err = String;

    /// Parses `3.4.5`, `3.4`, `5.15.0-91-generic` (the leading numeric fields count).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut fields = s.trim().split(['.', '-', '+', '_']).map(|f| {
            let digits: String = f.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u32>().ok()
        });
        let major = fields
            .next()
            .flatten()
            .ok_or_else(|| format!("not a version: {s:?}"))?;
        let minor = fields.next().flatten().unwrap_or(0);
        let patch = fields.next().flatten().unwrap_or(0);
        Ok(Self::new(major, minor, patch))
    }
}

/// Everything `diagnose` looks at. Every field can be built by hand in tests.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Facts {
    /// The directory `/proc`, `/sys`, `/etc`, `/dev` were read under (`/` on a live machine).
    pub sysroot: String,
    /// Distribution and kernel.
    pub os: OsFacts,
    /// Container detection.
    pub container: ContainerFacts,
    /// The loaded NVIDIA kernel driver.
    pub driver: DriverFacts,
    /// `options nvidia ...` lines found in modprobe configuration.
    pub modprobe: ModprobeFacts,
    /// Names of loaded kernel modules (`/proc/modules`, `/sys/module`).
    pub modules: Vec<String>,
    /// GDRCopy (CPU-assisted IBGDA).
    pub gdrcopy: GdrcopyFacts,
    /// Shared libraries found in the loader's directories under the sysroot.
    pub libraries: LibraryFacts,
    /// RDMA devices under `/sys/class/infiniband`.
    pub nics: Vec<NicFacts>,
    /// Device nodes under `/dev`.
    pub dev: DevNodes,
    /// NVIDIA GPUs found on the PCI bus.
    pub gpus: Vec<GpuPci>,
    /// IOMMU settings and PCIe bridges whose ACS redirects peer-to-peer traffic.
    pub pci: PciFacts,
    /// `Max locked memory` of this process (`/proc/self/limits`); `None` when unreadable.
    pub memlock: Option<MemlockLimit>,
    /// GPU↔GPU and GPU↔NIC topology (CUDA, or `nvidia-smi topo -m`); `None` when unknown.
    pub topology: Option<Topology>,
    /// NVSHMEM: found under the sysroot by [`super::gather`]; the loaded library's own
    /// version is the caller's to add (nvshmem-sys). `None` when not looked for.
    pub nvshmem: Option<NvshmemFacts>,
    /// Result of `--probe` (a real NVSHMEM start-up in a child process); `None` when not run.
    pub probe: Option<ProbeResult>,
    /// CUDA's device and peer view (live only; `None` with `--sysroot`).
    #[serde(default)]
    pub cuda: Option<CudaFacts>,
    /// rdma-core's device list, ports, GIDs and mlx5 DevX (live only).
    #[serde(default)]
    pub verbs: Option<VerbsFacts>,
    /// GDRCopy loaded and `gdr_open` called (live only).
    #[serde(default)]
    pub gdrcopy_live: Option<GdrcopyLive>,
    /// `--probe` registration of GPU memory with a NIC (live only).
    #[serde(default)]
    pub registration: Option<RegistrationProbe>,
}

impl Facts {
    /// Whether a kernel module of this name (dashes and underscores alike) is loaded.
    pub fn module_loaded(&self, name: &str) -> bool {
        let want = name.replace('-', "_");
        self.modules.iter().any(|m| m.replace('-', "_") == want)
    }
}

/// Distribution and kernel version.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OsFacts {
    /// `ID=` of `/etc/os-release` (`ubuntu`, `rhel`, ...).
    pub id: Option<String>,
    /// `ID_LIKE=` of `/etc/os-release`, split on spaces.
    pub id_like: Vec<String>,
    /// `PRETTY_NAME=` of `/etc/os-release`.
    pub pretty_name: Option<String>,
    /// `/proc/sys/kernel/osrelease`.
    pub kernel_release: Option<String>,
}

impl OsFacts {
    /// Whether the distribution rebuilds its initramfs with dracut (RHEL family, SUSE, Fedora).
    pub fn uses_dracut(&self) -> bool {
        const DRACUT: [&str; 8] = [
            "rhel",
            "centos",
            "fedora",
            "rocky",
            "almalinux",
            "ol",
            "suse",
            "sles",
        ];
        self.id
            .iter()
            .chain(self.id_like.iter())
            .any(|id| DRACUT.contains(&id.as_str()))
    }

    /// The exact command that rebuilds the initramfs on this distribution.
    pub fn initramfs_command(&self) -> &'static str {
        if self.uses_dracut() {
            "sudo dracut -f"
        } else {
            "sudo update-initramfs -u"
        }
    }
}

/// Whether we run inside a container, and why we think so.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContainerFacts {
    /// A container marker was found.
    pub in_container: bool,
    /// Which marker (`/.dockerenv`, `/run/.containerenv`, `container=` in PID 1's environment...).
    pub evidence: Option<String>,
}

/// The NVIDIA kernel driver as the running kernel sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DriverFacts {
    /// `/proc/driver/nvidia/version` or `/sys/module/nvidia` exists.
    pub loaded: bool,
    /// Driver version (`/sys/module/nvidia/version`, else parsed from the NVRM line).
    pub version: Option<String>,
    /// The NVRM line of `/proc/driver/nvidia/version`.
    pub nvrm_line: Option<String>,
    /// `Some(true)` for the open kernel module ("Open Kernel Module" in the NVRM line, or no
    /// proprietary taint), `Some(false)` for the proprietary one.
    pub open_module: Option<bool>,
    /// `EnableStreamMemOPs` from `/proc/driver/nvidia/params`.
    pub enable_stream_memops: Option<u64>,
    /// `RegistryDwords` from `/proc/driver/nvidia/params`, quotes removed.
    pub registry_dwords: Option<String>,
}

impl DriverFacts {
    /// Both IBGDA keys are active in the running driver.
    pub fn ibgda_keys_active(&self) -> bool {
        self.enable_stream_memops == Some(1)
            && self
                .registry_dwords
                .as_deref()
                .is_some_and(registry_has_peer_mapping_override)
    }
}

/// Whether a `RegistryDwords` string (`"A=1;PeerMappingOverride=1;"`) sets
/// `PeerMappingOverride=1`.
pub fn registry_has_peer_mapping_override(dwords: &str) -> bool {
    dwords
        .trim_matches('"')
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .any(|(k, v)| k.trim() == "PeerMappingOverride" && parse_int(v.trim()) == Some(1))
}

/// Parses a decimal or `0x` hexadecimal integer.
pub(crate) fn parse_int(s: &str) -> Option<u64> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// `options nvidia ...` as configured for the next module load.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModprobeFacts {
    /// Every file that sets options for `nvidia`, in the order modprobe reads them.
    pub files: Vec<ModprobeFile>,
}

impl ModprobeFacts {
    /// The value the next load of `nvidia` gets for `param` (the last setting wins), with the
    /// file that sets it.
    pub fn effective(&self, param: &str) -> Option<(&str, &str)> {
        self.files.iter().rev().find_map(|f| {
            f.options
                .iter()
                .rev()
                .find(|(k, _)| k == param)
                .map(|(_, v)| (f.path.as_str(), v.as_str()))
        })
    }

    /// Both IBGDA keys are configured for the next load.
    pub fn ibgda_keys_configured(&self) -> bool {
        self.effective("NVreg_EnableStreamMemOPs")
            .is_some_and(|(_, v)| parse_int(v.trim_matches('"')) == Some(1))
            && self
                .effective("NVreg_RegistryDwords")
                .is_some_and(|(_, v)| registry_has_peer_mapping_override(v))
    }
}

/// One modprobe configuration file's `options nvidia` settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModprobeFile {
    /// Path as seen on the machine (without the sysroot prefix).
    pub path: String,
    /// `(name, value)` pairs, quotes kept off the value.
    pub options: Vec<(String, String)>,
}

/// GDRCopy: kernel module, device node, user library.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GdrcopyFacts {
    /// `gdrdrv` is loaded.
    pub module_loaded: bool,
    /// Character-device major of `gdrdrv` from `/proc/devices`.
    pub char_major: Option<u32>,
    /// `/dev/gdrdrv` exists.
    pub dev_node: bool,
    /// Path of `libgdrapi.so*` if found.
    pub library: Option<String>,
}

/// Libraries the GPU-initiated path loads at run time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LibraryFacts {
    /// `libibverbs.so.1`.
    pub ibverbs: Option<String>,
    /// `libmlx5.so.1` (the mlx5 direct-verbs provider NVSHMEM's IBGDA transport uses).
    pub mlx5: Option<String>,
    /// `libnvJitLink.so*` (run-time linking against `libnvshmem_device.a`).
    pub nvjitlink: Option<String>,
    /// Directories that were searched.
    pub searched: Vec<String>,
}

/// One RDMA device.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NicFacts {
    /// `mlx5_0`, `irdma0`, ...
    pub name: String,
    /// Kernel driver bound to the PCI function (`mlx5_core`), if the `driver` link resolves.
    pub driver: Option<String>,
    /// PCI address of the function.
    pub pci_address: Option<String>,
    /// PCI path from the root complex down to the device (`pci0000:00`, bridges..., device).
    pub pci_path: Vec<String>,
    /// NUMA node of the PCI function (`-1` when the platform has none).
    pub numa_node: Option<i64>,
    /// `uverbsN` device of this NIC, if sysfs names it.
    pub uverbs: Option<String>,
    /// Network interfaces of the PCI function (`device/net/*`), for RoCE.
    pub netdevs: Vec<String>,
    /// Ports.
    pub ports: Vec<PortFacts>,
}

impl NicFacts {
    /// An mlx5 device (ConnectX/BlueField): what NVSHMEM's IBGDA transport drives.
    pub fn is_mlx5(&self) -> bool {
        self.name.starts_with("mlx5") || self.driver.as_deref() == Some("mlx5_core")
    }
}

/// One port of an RDMA device.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PortFacts {
    /// Port number (from 1).
    pub port: u32,
    /// `state` as written by the kernel (`4: ACTIVE`).
    pub state: String,
    /// `link_layer`: `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: String,
    /// Non-zero GID table entries.
    pub gids: Vec<GidEntry>,
}

impl PortFacts {
    /// The port is ACTIVE.
    pub fn active(&self) -> bool {
        self.state.contains("ACTIVE")
    }

    /// The port runs RoCE (Ethernet link layer).
    pub fn is_roce(&self) -> bool {
        self.link_layer.eq_ignore_ascii_case("ethernet")
    }

    /// The GID index NVSHMEM should use on a RoCE port: RoCE v2 with an IPv4-mapped address
    /// first, then any RoCE v2 entry.
    pub fn preferred_roce_gid(&self) -> Option<&GidEntry> {
        let v2 = |g: &&GidEntry| g.kind.as_deref().is_some_and(|k| k.contains("v2"));
        self.gids
            .iter()
            .filter(v2)
            .find(|g| g.is_ipv4_mapped())
            .or_else(|| self.gids.iter().find(v2))
    }
}

/// Device nodes the GPU and RDMA paths open.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DevNodes {
    /// `/dev/nvidia*` names (`nvidia0`, `nvidiactl`, `nvidia-uvm`, ...).
    pub nvidia: Vec<String>,
    /// `/dev/infiniband/*` names (`uverbs0`, `rdma_cm`, ...).
    pub infiniband: Vec<String>,
}

/// One NVIDIA GPU on the PCI bus.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuPci {
    /// PCI address (`0000:18:00.0`).
    pub pci_address: String,
    /// PCI device id (`0x2335` for H200).
    pub device_id: Option<String>,
    /// NUMA node.
    pub numa_node: Option<i64>,
    /// PCI path from the root complex down to the device.
    pub pci_path: Vec<String>,
    /// IOMMU group number, when the IOMMU is on.
    pub iommu_group: Option<u32>,
}

/// IOMMU and ACS state relevant to peer-to-peer DMA.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PciFacts {
    /// `/proc/cmdline`.
    pub cmdline: Option<String>,
    /// Number of entries under `/sys/kernel/iommu_groups` (0: IOMMU off or absent).
    pub iommu_groups: usize,
    /// PCIe switch downstream ports with ACS P2P request or completion redirect enabled.
    pub acs_redirecting: Vec<AcsBridge>,
    /// Bridges whose extended configuration space could not be read (needs root).
    pub acs_unreadable: usize,
}

/// A PCIe bridge whose ACS control redirects peer-to-peer requests upstream.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AcsBridge {
    /// PCI address of the bridge.
    pub pci_address: String,
    /// ACS Control register value.
    pub acs_control: u16,
}

/// `Max locked memory` limits; `None` means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemlockLimit {
    /// Soft limit in bytes.
    pub soft: Option<u64>,
    /// Hard limit in bytes.
    pub hard: Option<u64>,
}

/// PCIe distance classes as `nvidia-smi topo -m` names them, closest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum PcieDistance {
    /// At most a single PCIe bridge.
    Pix,
    /// Multiple PCIe bridges, no host bridge.
    Pxb,
    /// Through a PCIe host bridge (same root complex).
    Phb,
    /// Across host bridges within one NUMA node.
    Node,
    /// Across NUMA nodes (SMP interconnect).
    Sys,
}

impl PcieDistance {
    /// The `nvidia-smi topo -m` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Pix => "PIX",
            Self::Pxb => "PXB",
            Self::Phb => "PHB",
            Self::Node => "NODE",
            Self::Sys => "SYS",
        }
    }

    /// Parses a label (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`; `SOC` is the old name of `SYS`).
    pub fn from_label(s: &str) -> Option<Self> {
        Some(match s {
            "PIX" => Self::Pix,
            "PXB" => Self::Pxb,
            "PHB" => Self::Phb,
            "NODE" => Self::Node,
            "SYS" | "SOC" => Self::Sys,
            _ => return None,
        })
    }
}

/// How two GPUs reach each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuLink {
    /// The diagonal.
    Same,
    /// NVLink with this many links (`NV18`: 18).
    NvLink(u32),
    /// PCIe only; `p2p` says whether CUDA allows peer access (`None`: unknown).
    Pcie {
        /// Distance class.
        distance: PcieDistance,
        /// CUDA peer access, when known.
        p2p: Option<bool>,
    },
    /// No peer-to-peer path.
    None,
}

/// GPU↔GPU links and GPU↔NIC distances.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Where this came from (`nvidia-smi topo -m`, `cuda`).
    pub source: String,
    /// `links[i][j]` between GPU i and GPU j.
    pub links: Vec<Vec<GpuLink>>,
    /// NIC names in column order of `nic_distance` (`mlx5_0`...).
    pub nics: Vec<String>,
    /// `nic_distance[gpu][nic]`.
    pub nic_distance: Vec<Vec<PcieDistance>>,
}

impl Topology {
    /// Number of GPUs described.
    pub fn gpu_count(&self) -> usize {
        self.links.len()
    }
}

/// NVSHMEM installation and library.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NvshmemFacts {
    /// `libnvshmem_host.so*` that was (or would be) loaded.
    pub host_library: Option<String>,
    /// Version reported by the loaded host library (`nvshmemx_vendor_get_version_info`).
    pub host_version: Option<Version>,
    /// Why the host library could not be found or loaded.
    pub load_error: Option<String>,
    /// Whether ep-rs's own library search (nvshmem-sys: `NVSHMEM_DIR`, pip layouts of the
    /// Pythons on `PATH`, `LD_LIBRARY_PATH`, system directories) reaches `host_library`;
    /// `None` when not asked (fixture trees).
    pub on_search_path: Option<bool>,
    /// `libnvshmem_device.a` next to the host library.
    pub device_library: Option<String>,
    /// Version of the headers that ship with it (`include/non_abi/nvshmem_version.h`).
    pub header_version: Option<Version>,
    /// Version of the pip/conda package holding it (`*.dist-info` name), if any.
    pub package_version: Option<Version>,
    /// Transport plugins next to the host library (`nvshmem_transport_ibgda.so.3`, ...).
    pub transports: Vec<String>,
    /// Bootstrap plugins next to the host library.
    pub bootstraps: Vec<String>,
}

impl NvshmemFacts {
    /// The best-known version: the loaded library's, else the headers', else the package's.
    pub fn version(&self) -> Option<(Version, &'static str)> {
        self.host_version
            .map(|v| (v, "host library"))
            .or(self.header_version.map(|v| (v, "headers")))
            .or(self.package_version.map(|v| (v, "package")))
    }

    /// The IBGDA transport plugin is installed.
    pub fn has_ibgda_plugin(&self) -> bool {
        self.transports.iter().any(|t| t.contains("ibgda"))
    }
}

/// What a real NVSHMEM initialisation (in a child process) brought up.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// The environment it ran under (the plan's variables).
    pub env: Vec<(String, String)>,
    /// NVSHMEM initialised.
    pub initialized: bool,
    /// IBGDA was requested (`NVSHMEM_IB_ENABLE_IBGDA=1`).
    pub ibgda_requested: bool,
    /// Transports that came up (`P2P`, `IBGDA`, `IBRC`, ...).
    pub transports_up: Vec<String>,
    /// Transports NVSHMEM reported as failed (`init failed for transport: X`).
    pub transports_failed: Vec<String>,
    /// Error text when the probe could not run or init failed.
    pub error: Option<String>,
    /// NVSHMEM's own lines that mattered.
    pub log: Vec<String>,
}
