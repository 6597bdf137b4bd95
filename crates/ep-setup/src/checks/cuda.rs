//! `gpu.cuda`: the CUDA driver API initialises and lists the GPUs (live facts only), and the
//! mapping from `nvidia-smi`'s GPU indices to CUDA ordinals used by the topology cross-check.

use crate::facts::Facts;
use crate::live::CudaFacts;
use crate::report::{Capability, Check, Status};

use super::{check, in_container};

/// The major driver branch (`580`) of the loaded driver, for package names.
fn branch(f: &Facts) -> String {
    f.driver
        .version
        .as_deref()
        .and_then(|v| v.split('.').next())
        .unwrap_or("580")
        .to_string()
}

pub(crate) fn gpu_cuda(f: &Facts) -> Check {
    const ID: &str = "gpu.cuda";
    const T: &str = "CUDA driver API (devices, peer access)";
    let all = &Capability::ALL;
    let Some(c) = f.cuda.as_ref() else {
        return check(
            ID,
            T,
            &[],
            Status::Skip,
            "not queried (live probes run on the machine itself, without --sysroot)",
            None,
        );
    };
    if c.library_missing {
        if !f.driver.loaded {
            return check(
                ID,
                T,
                &[],
                Status::Skip,
                "libcuda.so.1 not found and no driver loaded (see driver.loaded)",
                None,
            );
        }
        let fix = if in_container(f) {
            "The container lacks the driver's user-space libraries: start it with the NVIDIA \
             Container Toolkit (`docker run --gpus all ...`, or \
             `NVIDIA_DRIVER_CAPABILITIES=compute,utility`)."
                .to_string()
        } else {
            let b = branch(f);
            format!(
                "Install the user-space half of driver {b} matching the loaded module \
                 (Ubuntu: `sudo apt install libnvidia-compute-{b}-server`; RHEL: \
                 `sudo dnf install nvidia-driver-cuda-libs`), then `sudo ldconfig`."
            )
        };
        return check(
            ID,
            T,
            all,
            Status::Fail,
            "the kernel driver is loaded but libcuda.so.1 cannot be loaded",
            Some(fix),
        );
    }
    if let Some(err) = &c.error {
        return check(
            ID,
            T,
            all,
            Status::Fail,
            err.clone(),
            Some(cuda_error_fix(f, c)),
        );
    }
    let ver = c.version_string().unwrap_or_else(|| "?".to_string());
    let n = c.devices.len();
    let names: Vec<String> = c
        .devices
        .iter()
        .enumerate()
        .map(|(i, d)| format!("{i}: {} ({})", d.name, d.pci_bus_id))
        .collect();
    let yes_no = |v: Option<bool>| match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "?",
    };
    let rdma: Vec<&str> = c
        .devices
        .iter()
        .map(|d| yes_no(d.gpu_direct_rdma))
        .collect();
    let dmabuf: Vec<&str> = c.devices.iter().map(|d| yes_no(d.dma_buf)).collect();
    let mut detail = format!(
        "CUDA {ver} driver API, {n} device{}: {}; GPUDirect RDMA: {}; dma-buf: {}",
        if n == 1 { "" } else { "s" },
        names.join(", "),
        summarize(&rdma),
        summarize(&dmabuf)
    );
    if let Some(v) = &c.visible_devices {
        detail.push_str(&format!("; CUDA_VISIBLE_DEVICES={v}"));
    }
    let on_bus = f.gpus.len();
    if n < on_bus && c.visible_devices.is_none() {
        return check(
            ID,
            T,
            all,
            Status::Warn,
            format!("{detail}; but {on_bus} NVIDIA GPUs are on the PCI bus"),
            Some(
                "Some GPUs are hidden from CUDA: check `nvidia-smi` for GPUs in an error state \
                 (`nvidia-smi -q | grep -i -e retired -e xid`), and in a container pass them all \
                 (`--gpus all`)."
                    .to_string(),
            ),
        );
    }
    if n == 0 {
        return check(ID, T, all, Status::Fail, detail, Some(cuda_error_fix(f, c)));
    }
    check(ID, T, all, Status::Pass, detail, None)
}

fn summarize(v: &[&str]) -> String {
    if v.is_empty() {
        "-".to_string()
    } else if v.iter().all(|x| *x == v[0]) {
        if v.len() == 1 {
            v[0].to_string()
        } else {
            format!("{} (all)", v[0])
        }
    } else {
        v.join("/")
    }
}

/// The exact fix for a failing CUDA initialisation, by `CUresult`.
fn cuda_error_fix(f: &Facts, c: &CudaFacts) -> String {
    let code = c.error_code.as_deref().unwrap_or("");
    let b = branch(f);
    if code.contains("SYSTEM_DRIVER_MISMATCH") || code.contains("COMPAT_NOT_SUPPORTED") {
        return format!(
            "libcuda.so.1 belongs to another driver version than the loaded kernel module \
             ({}): after a driver upgrade, `sudo reboot`; or reload the module: `sudo rmmod \
             nvidia_uvm nvidia_drm nvidia_modeset nvidia && sudo modprobe nvidia`. Check with \
             `cat /proc/driver/nvidia/version` and `ls -l $(ldconfig -p | awk '/libcuda.so.1/{{print $NF}}')`.",
            f.driver.version.as_deref().unwrap_or("?")
        );
    }
    if code.contains("INSUFFICIENT_DRIVER") {
        return format!(
            "The driver is older than CUDA 13.0, which ep-rs binds: install driver 580 or newer \
             (Ubuntu: `sudo apt install nvidia-driver-580-server-open`) and `sudo reboot` \
             (loaded: {b})."
        );
    }
    if code.contains("SYSTEM_NOT_READY") {
        return "NVSwitch systems need the fabric manager: `sudo systemctl enable --now \
                nvidia-fabricmanager` (its version must equal the driver's; \
                `nvidia-smi -q | grep -A2 Fabric` shows its state)."
            .to_string();
    }
    if code.contains("NO_DEVICE") || c.devices.is_empty() {
        if let Some(v) = &c.visible_devices {
            return format!(
                "CUDA_VISIBLE_DEVICES={v} hides every GPU: `unset CUDA_VISIBLE_DEVICES` or list \
                 valid indices/UUIDs (`nvidia-smi -L`)."
            );
        }
        if in_container(f) {
            return "The container sees no GPU: start it with `--gpus all` (NVIDIA Container \
                    Toolkit)."
                .to_string();
        }
        return "No GPU is usable by CUDA: check `nvidia-smi`, and that this user can open \
                /dev/nvidia* (`ls -l /dev/nvidia*`; add the user to the group owning them)."
            .to_string();
    }
    if code.contains("NOT_PERMITTED") || code.contains("OPERATING_SYSTEM") {
        return "The driver refused this process: check `ls -l /dev/nvidia*` permissions and \
                `dmesg | grep -i nvrm` for the reason."
            .to_string();
    }
    "Run `nvidia-smi`: when it fails too, fix the driver first (`dmesg | grep -i nvrm`); \
     when it works, the error is CUDA's own (see the code above)."
        .to_string()
}

/// CUDA ordinal of `nvidia-smi`'s GPU `i`: `nvidia-smi` numbers GPUs in PCI bus order, which is
/// the order of [`Facts::gpus`]; matched by PCI bus id, else (same count, no PCI facts) by
/// position.
pub(crate) fn cuda_ordinal(f: &Facts, c: &CudaFacts, smi_count: usize, i: usize) -> Option<usize> {
    if f.gpus.len() == smi_count {
        return c.ordinal_of(&f.gpus.get(i)?.pci_address);
    }
    (c.devices.len() == smi_count && f.gpus.is_empty()).then_some(i)
}
