//! NVSHMEM checks: found and recent enough, host and device libraries of one version, the IBGDA
//! transport plugin, nvJitLink for run-time linking.

use std::path::Path;

use crate::facts::{Facts, Version};
use crate::report::{Check, Status};

use super::{CPU, GPU, LL, check, nvshmem};

const NVSHMEM_INSTALL: &str = "Install NVSHMEM >= 3.3.9: `pip install nvidia-nvshmem-cu13` \
    (CUDA 13; `nvidia-nvshmem-cu12` for CUDA 12), or point NVSHMEM_DIR at an install whose lib/ \
    holds libnvshmem_host.so.3.";

pub(crate) fn nvshmem_found(f: &Facts) -> Check {
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

pub(crate) fn nvshmem_consistency(f: &Facts) -> Check {
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

pub(crate) fn nvshmem_ibgda_plugin(f: &Facts) -> Check {
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

pub(crate) fn nvjitlink(f: &Facts) -> Check {
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
