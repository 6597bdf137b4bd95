//! Parsers for the text the kernel, the driver and the tools write. Pure functions over `&str`.

use super::facts::{GpuLink, PcieDistance, Topology, Version, parse_int};

/// `options nvidia A=1 B="x y"` lines of one modprobe configuration file: returns the
/// `(name, value)` pairs for `module`, quotes removed, in order. Handles `#` comments and
/// backslash line continuations.
pub(crate) fn modprobe_options(text: &str, module: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let joined = text.replace("\\\n", " ");
    for line in joined.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let mut words = split_shell_words(line).into_iter();
        if words.next().as_deref() != Some("options") {
            continue;
        }
        if words
            .next()
            .is_none_or(|m| m.replace('-', "_") != module.replace('-', "_"))
        {
            continue;
        }
        for w in words {
            if w.starts_with('#') {
                break;
            }
            match w.split_once('=') {
                Some((k, v)) => out.push((k.to_string(), v.to_string())),
                None => out.push((w, String::new())),
            }
        }
    }
    out
}

/// Splits on whitespace outside double quotes and removes the quotes.
fn split_shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_quotes = false;
    let mut any = false;
    for c in line.chars() {
        match c {
            '"' => {
                in_quotes = !in_quotes;
                any = true;
            }
            c if c.is_whitespace() && !in_quotes => {
                if any {
                    words.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        words.push(cur);
    }
    words
}

/// `/proc/driver/nvidia/params`: `(EnableStreamMemOPs, RegistryDwords)`.
pub(crate) fn driver_params(text: &str) -> (Option<u64>, Option<String>) {
    let mut memops = None;
    let mut dwords = None;
    for line in text.lines() {
        let Some((k, v)) = line.split_once(':') else {
            continue;
        };
        match k.trim() {
            "EnableStreamMemOPs" => memops = parse_int(v),
            "RegistryDwords" => dwords = Some(v.trim().trim_matches('"').to_string()),
            _ => {}
        }
    }
    (memops, dwords)
}

/// `/proc/driver/nvidia/version`: `(NVRM line, version, open module?)`.
pub(crate) fn driver_version(text: &str) -> (Option<String>, Option<String>, Option<bool>) {
    let Some(line) = text.lines().find(|l| l.starts_with("NVRM version:")) else {
        return (None, None, None);
    };
    let version = line
        .split_whitespace()
        .find(|w| w.split('.').count() >= 2 && w.split('.').all(|p| p.parse::<u32>().is_ok()))
        .map(str::to_string);
    let open = line.contains("Open Kernel Module");
    (Some(line.trim().to_string()), version, Some(open))
}

/// `/proc/modules`: loaded module names, and for `nvidia` its taint flags (`P`: proprietary).
pub(crate) fn proc_modules(text: &str) -> (Vec<String>, Option<String>) {
    let mut names = Vec::new();
    let mut nvidia_taint = None;
    for line in text.lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if name == "nvidia" {
            nvidia_taint = line
                .rsplit_once('(')
                .and_then(|(_, t)| t.strip_suffix(')'))
                .map(str::to_string);
        }
        names.push(name.to_string());
    }
    (names, nvidia_taint)
}

/// `/proc/devices`: the character major of `name`.
pub(crate) fn char_major(text: &str, name: &str) -> Option<u32> {
    let chars = text.split("Block devices:").next().unwrap_or(text);
    chars.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        let major = w.next()?.parse().ok()?;
        (w.next()? == name).then_some(major)
    })
}

/// `/proc/self/limits`: `Max locked memory` as `(soft, hard)` bytes, `None` for unlimited.
/// Returns `None` when the line is absent.
#[allow(
    clippy::type_complexity,
    reason = "a pair of optional limits reads plainly"
)]
pub(crate) fn memlock(text: &str) -> Option<(Option<u64>, Option<u64>)> {
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    let rest = line
        .trim_start_matches("Max locked memory")
        .split_whitespace();
    let vals: Vec<&str> = rest.take(2).collect();
    let v = |s: &str| -> Option<u64> {
        if s == "unlimited" {
            None
        } else {
            s.parse().ok()
        }
    };
    Some((v(vals.first()?), v(vals.get(1)?)))
}

/// `/etc/os-release`: the value of `key`, quotes removed.
pub(crate) fn os_release(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches(['"', '\'']).to_string())
    })
}

/// `include/non_abi/nvshmem_version.h`: `NVSHMEM_VENDOR_{MAJOR,MINOR,PATCH}_VERSION`.
pub fn nvshmem_version_header(text: &str) -> Option<Version> {
    let get = |name: &str| -> Option<u32> {
        text.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "#define" && w.next()? == name).then_some(())?;
            w.next()?.parse().ok()
        })
    };
    Some(Version::new(
        get("NVSHMEM_VENDOR_MAJOR_VERSION")?,
        get("NVSHMEM_VENDOR_MINOR_VERSION")?,
        get("NVSHMEM_VENDOR_PATCH_VERSION").unwrap_or(0),
    ))
}

/// NVSHMEM's stderr: `(transports up, transports failed)`. Failures are the
/// `init failed for transport: X` lines; with `NVSHMEM_DEBUG=INFO`, lines naming a transport
/// as initialised or selected count as up.
pub fn nvshmem_log(text: &str) -> (Vec<String>, Vec<String>) {
    let mut up: Vec<String> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    let push = |v: &mut Vec<String>, t: &str| {
        let t = t
            .trim()
            .trim_matches(|c: char| !c.is_ascii_alphanumeric())
            .to_ascii_uppercase();
        if !t.is_empty() && !v.contains(&t) {
            v.push(t);
        }
    };
    for line in text.lines() {
        if let Some((_, rest)) = line.split_once("init failed for transport:")
            && let Some(t) = rest.split_whitespace().next()
        {
            push(&mut failed, t);
        }
    }
    for line in text.lines() {
        let lower = line.to_ascii_lowercase();
        if lower.contains("failed") || lower.contains("error") {
            continue;
        }
        for t in ["P2P", "IBGDA", "IBRC", "IBDEVX", "UCX", "LIBFABRIC"] {
            let tl = t.to_ascii_lowercase();
            let names_it = lower.contains(&format!("transport {tl}"))
                || lower.contains(&format!("transport: {tl}"))
                || lower.contains(&format!("{tl} transport"));
            let good = ["init", "enabled", "selected", "active", "up"]
                .iter()
                .any(|w| lower.contains(w));
            if names_it && good && !failed.iter().any(|f| f == t) {
                push(&mut up, t);
            }
        }
    }
    (up, failed)
}

/// `nvidia-smi topo -m`: GPU↔GPU links, GPU↔NIC distances and the NIC legend.
/// Returns `None` when the text has no GPU matrix.
pub fn nvidia_smi_topo(text: &str) -> Option<Topology> {
    let clean = strip_ansi(text);
    let mut lines = clean.lines();
    let header = lines
        .by_ref()
        .find(|l| l.split_whitespace().any(|w| w == "GPU0"))?;
    let cols: Vec<&str> = header
        .split_whitespace()
        .take_while(|w| is_dev_label(w))
        .collect();
    let gpu_cols: Vec<usize> = (0..cols.len())
        .filter(|&i| cols[i].starts_with("GPU"))
        .collect();
    let nic_cols: Vec<usize> = (0..cols.len())
        .filter(|&i| !cols[i].starts_with("GPU"))
        .collect();
    let mut rows: Vec<(String, Vec<String>)> = Vec::new();
    let mut legend: Vec<(String, String)> = Vec::new();
    for line in lines {
        let mut w = line.split_whitespace();
        let Some(first) = w.next() else { continue };
        if is_dev_label(first) {
            let cells: Vec<String> = w.take(cols.len()).map(str::to_string).collect();
            if cells.len() == cols.len() {
                rows.push((first.to_string(), cells));
            }
        } else if let Some(nic) = first.strip_suffix(':') {
            // NIC legend: "  NIC0: mlx5_0"
            if let Some(name) = w.next() {
                legend.push((nic.to_string(), name.to_string()));
            }
        }
    }
    let gpu_rows: Vec<&(String, Vec<String>)> =
        rows.iter().filter(|(n, _)| n.starts_with("GPU")).collect();
    if gpu_rows.is_empty() {
        return None;
    }
    let links = gpu_rows
        .iter()
        .map(|(_, cells)| gpu_cols.iter().map(|&c| gpu_link(&cells[c])).collect())
        .collect();
    let nic_distance = gpu_rows
        .iter()
        .map(|(_, cells)| {
            nic_cols
                .iter()
                .map(|&c| PcieDistance::from_label(&cells[c]).unwrap_or(PcieDistance::Sys))
                .collect()
        })
        .collect();
    let nics = nic_cols
        .iter()
        .map(|&c| {
            let label = cols[c];
            legend
                .iter()
                .find(|(k, _)| k == label)
                .map_or_else(|| label.to_string(), |(_, v)| v.clone())
        })
        .collect();
    Some(Topology {
        source: "nvidia-smi topo -m".to_string(),
        links,
        nics,
        nic_distance,
    })
}

fn is_dev_label(w: &str) -> bool {
    ["GPU", "NIC", "mlx5_"].iter().any(|p| {
        w.strip_prefix(p)
            .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
    })
}

fn gpu_link(cell: &str) -> GpuLink {
    if cell == "X" {
        return GpuLink::Same;
    }
    if let Some(n) = cell.strip_prefix("NV").and_then(|n| n.parse().ok()) {
        return GpuLink::NvLink(n);
    }
    match PcieDistance::from_label(cell) {
        Some(distance) => GpuLink::Pcie {
            distance,
            p2p: None,
        },
        None => GpuLink::None,
    }
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// PCIe extended configuration space (a sysfs `config` file): the ACS Control register, if the
/// device has an ACS capability and the file holds the extended space (root can read it).
pub(crate) fn acs_control(config: &[u8]) -> Option<u16> {
    const ACS_ID: u16 = 0x000d;
    let mut off = 0x100usize;
    for _ in 0..64 {
        let hdr = u32::from_le_bytes(config.get(off..off + 4)?.try_into().ok()?);
        if hdr == 0 || hdr == 0xffff_ffff {
            return None;
        }
        if (hdr & 0xffff) as u16 == ACS_ID {
            let ctl = config.get(off + 6..off + 8)?;
            return Some(u16::from_le_bytes([ctl[0], ctl[1]]));
        }
        let next = (hdr >> 20) as usize & 0xffc;
        if next < 0x100 {
            return None;
        }
        off = next;
    }
    None
}

/// PCIe device/port type from the PCI Express capability of a `config` file (`6`: switch
/// downstream port, `5`: switch upstream port, `4`: root port).
pub(crate) fn pcie_port_type(config: &[u8]) -> Option<u8> {
    const PCIE_ID: u8 = 0x10;
    let status = u16::from_le_bytes([*config.get(6)?, *config.get(7)?]);
    if status & 0x10 == 0 {
        return None;
    }
    let mut off = (*config.get(0x34)? & 0xfc) as usize;
    for _ in 0..48 {
        if off < 0x40 {
            return None;
        }
        let id = *config.get(off)?;
        if id == PCIE_ID {
            return Some((config.get(off + 2)? >> 4) & 0xf);
        }
        off = (*config.get(off + 1)? & 0xfc) as usize;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modprobe_lines() {
        let text = "# c\noptions nvidia NVreg_EnableStreamMemOPs=1 \\\n NVreg_RegistryDwords=\"PeerMappingOverride=1;\"\noptions nvidia-drm modeset=1\n";
        let o = modprobe_options(text, "nvidia");
        assert_eq!(
            o,
            vec![
                ("NVreg_EnableStreamMemOPs".into(), "1".into()),
                (
                    "NVreg_RegistryDwords".into(),
                    "PeerMappingOverride=1;".into()
                )
            ]
        );
        assert_eq!(modprobe_options(text, "nvidia_drm").len(), 1);
    }

    #[test]
    fn params_and_version() {
        let (m, d) = driver_params("EnableStreamMemOPs: 0\nRegistryDwords: \"\"\n");
        assert_eq!((m, d.as_deref()), (Some(0), Some("")));
        let (_, v, open) = driver_version(
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16)  Thu\nGCC version: gcc 13\n",
        );
        assert_eq!(v.as_deref(), Some("580.159.04"));
        assert_eq!(open, Some(true));
    }

    #[test]
    fn limits() {
        let t = "Limit                     Soft Limit           Hard Limit           Units     \nMax locked memory         8388608              8388608              bytes     \n";
        assert_eq!(memlock(t), Some((Some(8388608), Some(8388608))));
        let t = "Max locked memory         unlimited            unlimited            bytes\n";
        assert_eq!(memlock(t), Some((None, None)));
    }

    #[test]
    fn log_lines() {
        let (up, failed) = nvshmem_log(
            "/dvs/p4/build/src/host/transport/transport.cpp:417: init failed for transport: IBGDA\n",
        );
        assert!(up.is_empty());
        assert_eq!(failed, vec!["IBGDA".to_string()]);
    }

    #[test]
    fn acs_parse() {
        let mut cfg = vec![0u8; 0x200];
        // extended cap at 0x100: AER (id 1) -> next 0x148; ACS (id 0xd) at 0x148.
        cfg[0x100..0x104].copy_from_slice(&(0x0001u32 | (1 << 16) | (0x148 << 20)).to_le_bytes());
        cfg[0x148..0x14c].copy_from_slice(&(0x000du32 | (1 << 16)).to_le_bytes());
        cfg[0x14e..0x150].copy_from_slice(&0x001du16.to_le_bytes());
        assert_eq!(acs_control(&cfg), Some(0x1d));
        assert_eq!(acs_control(&cfg[..0x100]), None);
    }
}
