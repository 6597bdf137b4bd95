//! Facts only live libraries can give, filled by the caller on the machine itself (`ep doctor`
//! without `--sysroot`): CUDA's device and peer view, rdma-core's device list, port and GID
//! view and mlx5 DevX, GDRCopy's `gdr_open`, and the `--probe` GPU memory registration. Every
//! field of [`super::Facts`] holding them is optional; the checks reading them are skipped when
//! they are absent, so fixture trees (another machine's files) give the same verdicts as before.

use serde::{Deserialize, Serialize};

use super::gid::GidEntry;

/// What the CUDA driver API reported (ep-kernels' `topology::gpu_topology`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CudaFacts {
    /// `libcuda.so.1` could not be loaded.
    pub library_missing: bool,
    /// Why the query failed (`None` when it succeeded).
    pub error: Option<String>,
    /// The `CUresult` name of a failed call (`CUDA_ERROR_NO_DEVICE`, ...).
    pub error_code: Option<String>,
    /// `cuDriverGetVersion` (`13000` for CUDA 13.0).
    pub driver_version: Option<i32>,
    /// `CUDA_VISIBLE_DEVICES` of the process, when set.
    pub visible_devices: Option<String>,
    /// Devices in CUDA ordinal order.
    pub devices: Vec<CudaDevice>,
    /// `peers[i][j]` between CUDA ordinals `i != j`; `None` on the diagonal.
    pub peers: Vec<Vec<Option<CudaPeer>>>,
}

impl CudaFacts {
    /// `13.0` from `13000`.
    pub fn version_string(&self) -> Option<String> {
        self.driver_version
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
    }

    /// The pair `src -> dst` by CUDA ordinal.
    pub fn peer(&self, src: usize, dst: usize) -> Option<&CudaPeer> {
        self.peers.get(src)?.get(dst)?.as_ref()
    }

    /// The CUDA ordinal of the device at this PCI address (any domain width, any case).
    pub fn ordinal_of(&self, pci_address: &str) -> Option<usize> {
        let want = normalize_pci(pci_address)?;
        self.devices
            .iter()
            .position(|d| normalize_pci(&d.pci_bus_id) == Some(want))
    }
}

/// `(domain, bus, device, function)` of `0000:18:00.0` or `00000000:18:00.0`.
pub(crate) fn normalize_pci(s: &str) -> Option<(u32, u32, u32, u32)> {
    let s = s.trim();
    let (dom, rest) = s.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let h = |x: &str| u32::from_str_radix(x, 16).ok();
    Some((h(dom)?, h(bus)?, h(dev)?, h(func)?))
}

/// One CUDA device.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CudaDevice {
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetPCIBusId`.
    pub pci_bus_id: String,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpu_direct_rdma: Option<bool>,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf: Option<bool>,
}

/// CUDA's answer for one ordered pair of devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaPeer {
    /// `cuDeviceCanAccessPeer`.
    pub can_access_peer: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED`.
    pub access_supported: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED` (NVLink-class paths have it).
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`.
    pub performance_rank: i32,
}

/// What rdma-core (libibverbs, libmlx5) reported.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VerbsFacts {
    /// The `libibverbs.so.1` loaded.
    pub library: Option<String>,
    /// Why it could not be loaded.
    pub load_error: Option<String>,
    /// `ibv_get_device_list` failed with `ENOSYS`: no kernel RDMA (uverbs) support.
    pub no_rdma_subsystem: bool,
    /// Another `ibv_get_device_list` failure.
    pub list_error: Option<String>,
    /// The `libmlx5.so.1` loaded.
    pub mlx5_library: Option<String>,
    /// Why it could not be loaded.
    pub mlx5_error: Option<String>,
    /// `ibv_reg_dmabuf_mr` is exported (rdma-core v34+).
    pub dmabuf_mr: bool,
    /// The devices `ibv_get_device_list` returned.
    pub devices: Vec<VerbsDevice>,
}

/// One device of `ibv_get_device_list`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VerbsDevice {
    /// `ibv_get_device_name`.
    pub name: String,
    /// `mlx5dv_is_supported` (`None` without libmlx5).
    pub mlx5: Option<bool>,
    /// Why `ibv_open_device` failed.
    pub open_error: Option<String>,
    /// Its `errno`.
    pub open_errno: Option<i32>,
    /// `mlx5dv_open_device(MLX5DV_CONTEXT_FLAGS_DEVX)`: `None` when not tried (not mlx5).
    pub devx: Option<DevxOpen>,
    /// Ports from `ibv_query_port` and the GID table.
    pub ports: Vec<VerbsPort>,
}

/// Result of opening a DevX context.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DevxOpen {
    /// It opened.
    pub opened: bool,
    /// `errno` of the failure.
    pub errno: Option<i32>,
    /// The error text.
    pub error: Option<String>,
}

/// One port as verbs reports it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VerbsPort {
    /// Port number (from 1).
    pub port: u32,
    /// State in sysfs's words (`4: ACTIVE`).
    pub state: String,
    /// `InfiniBand` or `Ethernet`.
    pub link_layer: String,
    /// `gid_tbl_len`.
    pub gid_table_len: u32,
    /// Non-zero GID entries, formatted as sysfs prints them.
    pub gids: Vec<GidEntry>,
}

impl VerbsPort {
    /// The port is ACTIVE.
    pub fn active(&self) -> bool {
        self.state.contains("ACTIVE")
    }
}

/// `ibv_port_state` in sysfs's words (`4: ACTIVE`).
pub fn port_state_name(state: u32) -> String {
    let name = match state {
        0 => "NOP",
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "UNKNOWN",
    };
    format!("{state}: {name}")
}

/// `link_layer` of `ibv_port_attr` in sysfs's words (unspecified reads as InfiniBand, as the
/// kernel reports it).
pub fn link_layer_name(link_layer: u8) -> &'static str {
    match link_layer {
        2 => "Ethernet",
        _ => "InfiniBand",
    }
}

/// `ibv_gid_type` in sysfs's words (`gid_attrs/types/N`).
pub fn gid_type_name(kind: u32) -> &'static str {
    match kind {
        2 => "RoCE v2",
        _ => "IB/RoCE v1",
    }
}

/// A raw GID as sysfs prints it (`fe80:0000:...`, eight groups of four hex digits).
pub fn format_gid(raw: &[u8; 16]) -> String {
    raw.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// What loading GDRCopy and `gdr_open` did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GdrcopyLive {
    /// The `libgdrapi.so.2` loaded.
    pub library: Option<String>,
    /// Why it could not be loaded.
    pub library_error: Option<String>,
    /// `gdr_runtime_get_version` (`2.4`).
    pub runtime_version: Option<String>,
    /// `gdr_open` returned a handle.
    pub opened: bool,
    /// `gdr_driver_get_version` after a successful open.
    pub driver_version: Option<String>,
    /// Opening `/dev/gdrdrv` read-write ourselves: `None` when it worked, else the OS error.
    pub dev_access_error: Option<String>,
}

/// The `--probe` registration of a small GPU buffer with a NIC.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RegistrationProbe {
    /// Why the probe did not run (no NIC, no GPU, no CUDA...): a Skip with this reason.
    pub skipped: Option<String>,
    /// The NIC used.
    pub nic: Option<String>,
    /// The CUDA device used.
    pub gpu: Option<u32>,
    /// dma-buf (`cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`); `None` when not tried.
    pub dmabuf: Option<Attempt>,
    /// Peer memory (`ibv_reg_mr` on the device pointer, needs nvidia_peermem); `None` when
    /// not tried.
    pub peermem: Option<Attempt>,
}

/// One registration attempt.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    /// It worked.
    pub ok: bool,
    /// What failed.
    pub error: Option<String>,
}
