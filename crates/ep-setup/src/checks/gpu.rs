//! GPU checks: count, device nodes, peer-to-peer / NVLink topology, closest NIC per GPU.

use crate::facts::{Facts, GpuLink, PcieDistance};
use crate::live::CudaFacts;
use crate::report::{Capability, Check, Status};

use super::cuda::cuda_ordinal;
use super::{INTRA, LL, check, in_container};

/// GPUs this process can open: `/dev/nvidiaN` nodes when any exist, else the PCI functions.
pub(crate) fn usable_gpu_count(f: &Facts) -> usize {
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

pub(crate) fn gpu_count(f: &Facts) -> Check {
    const ID: &str = "gpu.count";
    const T: &str = "NVIDIA GPUs";
    let n = usable_gpu_count(f);
    let topo_n = f.topology.as_ref().map_or(0, |t| t.gpu_count());
    let cuda_n = f
        .cuda
        .as_ref()
        .filter(|c| c.error.is_none() && !c.library_missing)
        .map(|c| c.devices.len());
    let n = n.max(topo_n).max(cuda_n.unwrap_or(0));
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
    let mut list = if addrs.is_empty() {
        String::new()
    } else {
        format!(" ({})", addrs.join(", "))
    };
    if let Some(k) = cuda_n {
        list.push_str(&format!("; CUDA sees {k}"));
    }
    check(
        ID,
        T,
        &Capability::ALL,
        Status::Pass,
        format!("{n} GPU{}{list}", if n == 1 { "" } else { "s" }),
        None,
    )
}

pub(crate) fn gpu_device_nodes(f: &Facts) -> Check {
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

/// Both directions of a CUDA pair allow peer access (`None`: CUDA not asked or the pair not
/// mapped).
fn cuda_p2p(
    f: &Facts,
    c: Option<&CudaFacts>,
    n: usize,
    i: usize,
    j: usize,
) -> Option<(bool, bool)> {
    let c = c?;
    let (a, b) = (cuda_ordinal(f, c, n, i)?, cuda_ordinal(f, c, n, j)?);
    let (ab, ba) = (c.peer(a, b)?, c.peer(b, a)?);
    Some((
        ab.can_access_peer && ba.can_access_peer,
        ab.native_atomics && ba.native_atomics,
    ))
}

const NVLINK_FIX: &str = "Use GPUs that share NVLink (set CUDA_VISIBLE_DEVICES to such a set); \
                          check `nvidia-smi nvlink --status` for links that are down.";

pub(crate) fn gpu_topology(f: &Facts) -> Check {
    const ID: &str = "gpu.topology";
    const T: &str = "GPU peer-to-peer / NVLink topology";
    let caps = &[INTRA, LL];
    let cuda = f
        .cuda
        .as_ref()
        .filter(|c| c.error.is_none() && !c.library_missing);
    let cuda_n = cuda.map_or(0, |c| c.devices.len());
    let n = usable_gpu_count(f)
        .max(f.topology.as_ref().map_or(0, |t| t.gpu_count()))
        .max(cuda_n);
    if n == 0 {
        return check(ID, T, &[], Status::Skip, "no GPU", None);
    }
    let Some(t) = &f.topology else {
        if let Some(c) = cuda.filter(|_| cuda_n >= 2) {
            return cuda_only_topology(c);
        }
        if n == 1 || cuda_n == 1 {
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
    // nvidia-smi shows NVLink, CUDA refuses peer access.
    let mut conflicts = Vec::new();
    let (mut cuda_yes, mut cuda_checked) = (0, 0);
    for i in 0..m {
        for j in i + 1..m {
            let p2p = cuda_p2p(f, cuda, m, i, j);
            if let Some((ok, _)) = p2p {
                cuda_checked += 1;
                cuda_yes += usize::from(ok);
            }
            let pair = format!("GPU{i}-GPU{j}");
            match t.links[i][j] {
                GpuLink::NvLink(k) if p2p.is_some_and(|(ok, _)| !ok) => {
                    conflicts.push(format!("{pair} (NV{k})"))
                }
                GpuLink::NvLink(k) => nvlinks.push(k),
                GpuLink::Pcie {
                    p2p: Some(false), ..
                }
                | GpuLink::None => none.push(pair),
                GpuLink::Pcie { p2p: None, .. } if p2p.is_some_and(|(ok, _)| !ok) => {
                    none.push(format!("{pair} (CUDA: no peer access)"))
                }
                GpuLink::Pcie { distance, .. } => {
                    pcie_p2p.push(format!("{pair} ({})", distance.label()))
                }
                GpuLink::Same => {}
            }
        }
    }
    let cuda_note = if cuda_checked == 0 {
        String::new()
    } else if cuda_yes == cuda_checked {
        format!("; P2P via CUDA: yes ({cuda_checked} pairs)")
    } else {
        format!("; P2P via CUDA: yes for {cuda_yes} of {cuda_checked} pairs")
    };
    if !conflicts.is_empty() {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "{} show NVLink in `nvidia-smi topo -m`, but CUDA refuses peer access \
                 (cuDeviceCanAccessPeer = 0){cuda_note}",
                conflicts.join(", ")
            ),
            Some(
                "NVSwitch systems (HGX 8-GPU) need the fabric manager: `sudo systemctl enable \
                 --now nvidia-fabricmanager` (same version as the driver; `nvidia-smi -q | grep \
                 -A2 Fabric` shows its state). Check `nvidia-smi nvlink --status` for links that \
                 are down, and `nvidia-smi topo -p2p r` for what the driver allows; in a VM, the \
                 hypervisor must pass peer-to-peer through."
                    .to_string(),
            ),
        );
    }
    if !none.is_empty() {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "no peer-to-peer path between {} (source: {}){cuda_note}",
                none.join(", "),
                t.source
            ),
            Some(NVLINK_FIX.to_string()),
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
                "PCIe only between {} (source: {}){cuda_note}: DeepEP allows at most 2 ranks \
                 over PCIe, and low-latency writes over PCIe can be reordered",
                pcie_p2p.join(", "),
                t.source
            ),
            Some(NVLINK_FIX.to_string()),
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
            "NVLink between all {m} GPUs ({links}; source: {}){cuda_note}",
            t.source
        ),
        None,
    )
}

/// The topology from CUDA alone (no `nvidia-smi`): peer access per pair, native atomics as the
/// NVLink hint; link counts unknown.
fn cuda_only_topology(c: &CudaFacts) -> Check {
    const ID: &str = "gpu.topology";
    const T: &str = "GPU peer-to-peer / NVLink topology";
    let caps = &[INTRA, LL];
    let m = c.devices.len();
    let (mut none, mut pcie_like, mut nvlink_like) = (Vec::new(), Vec::new(), 0);
    for i in 0..m {
        for j in i + 1..m {
            let (Some(ab), Some(ba)) = (c.peer(i, j), c.peer(j, i)) else {
                continue;
            };
            let pair = format!("CUDA{i}-CUDA{j}");
            if !(ab.can_access_peer && ba.can_access_peer) {
                none.push(pair);
            } else if ab.native_atomics && ba.native_atomics {
                nvlink_like += 1;
            } else {
                pcie_like.push(pair);
            }
        }
    }
    let note = "link types unknown: `nvidia-smi` not found (source: cuda)";
    if !none.is_empty() {
        return check(
            ID,
            T,
            caps,
            Status::Fail,
            format!(
                "CUDA refuses peer access between {} ({note})",
                none.join(", ")
            ),
            Some(NVLINK_FIX.to_string()),
        );
    }
    if !pcie_like.is_empty() {
        let status = if m <= 2 { Status::Warn } else { Status::Fail };
        return check(
            ID,
            T,
            caps,
            status,
            format!(
                "peer access without native atomics between {} (a PCIe path; {note}): DeepEP \
                 allows at most 2 ranks over PCIe",
                pcie_like.join(", ")
            ),
            Some(NVLINK_FIX.to_string()),
        );
    }
    check(
        ID,
        T,
        caps,
        Status::Pass,
        format!(
            "P2P via CUDA: yes between all {m} GPUs ({nvlink_like} pairs), with native atomics \
             (an NVLink-class path); {note}"
        ),
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

pub(crate) fn gpu_nic_affinity(f: &Facts) -> Check {
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
