//! `ep doctor` as a user runs it: the built binary over fixture trees (`--sysroot`), its exit
//! codes with and without `--require`, `--json`, and `--plan`.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../ep-setup/tests/fixtures/doctor")
        .join(name)
}

fn ep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ep"))
        .args(args)
        .env_remove("NVSHMEM_QP_DEPTH")
        .output()
        .expect("run ep")
}

fn doctor(scenario: &str, extra: &[&str]) -> Output {
    let root = fixture(scenario);
    let mut args = vec!["doctor", "--sysroot", root.to_str().unwrap()];
    args.extend_from_slice(extra);
    ep(&args)
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn verdict<'a>(v: &'a serde_json::Value, cap: &str) -> &'a serde_json::Value {
    v["report"]["verdicts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["capability"] == cap)
        .unwrap()
}

#[test]
fn text_report_names_fix_and_exits_zero_when_nvlink_works() {
    let out = doctor("reboot-pending", &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("FAIL  driver.ibgda-keys"), "{text}");
    assert!(text.contains("reboot pending"), "{text}");
    assert!(text.contains("sudo update-initramfs -u"), "{text}");
    assert!(text.contains("sudo reboot"), "{text}");
    assert!(text.contains("PASS  intranode-nvlink"), "{text}");
}

#[test]
fn require_sets_exit_code() {
    assert_eq!(
        doctor(
            "ibgda-driver-enabled",
            &["--require", "ibgda-gpu-initiated"]
        )
        .status
        .code(),
        Some(0)
    );
    assert_eq!(
        doctor("nothing-configured", &["--require", "ibgda-gpu-initiated"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(
        doctor(
            "gdrcopy-only",
            &["--require", "ibgda-cpu", "--require", "intranode"]
        )
        .status
        .code(),
        Some(0)
    );
    assert_eq!(
        doctor("no-nic", &["--require", "low-latency-nvlink"])
            .status
            .code(),
        Some(0)
    );
    assert_eq!(
        doctor("no-nic", &["--require", "ibgda-cpu-assisted"])
            .status
            .code(),
        Some(2)
    );
}

#[test]
fn no_gpu_path_exits_one() {
    let out = doctor("no-driver", &[]);
    assert_eq!(out.status.code(), Some(1));
    let out = doctor("no-driver", &["--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    assert_eq!(v["exit_code"], 1);
    assert_eq!(verdict(&v, "intranode-nvlink")["usable"], false);
}

#[test]
fn json_report() {
    let out = doctor("gdrcopy-only", &["--json"]);
    assert_eq!(out.status.code(), Some(0));
    let v = json(&out);
    assert_eq!(v["report"]["ibgda"]["selected"], "cpu-assisted");
    assert_eq!(verdict(&v, "ibgda-gpu-initiated")["status"], "fail");
    assert_eq!(verdict(&v, "ibgda-cpu-assisted")["status"], "pass");
    let keys = v["report"]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "driver.ibgda-keys")
        .unwrap();
    let fix = keys["fix"].as_str().unwrap();
    assert!(fix.contains(
        "echo 'options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords=\"PeerMappingOverride=1;\"' | sudo tee /etc/modprobe.d/nvidia-ibgda.conf"
    ), "{fix}");
    assert_eq!(v["report"]["facts"]["driver"]["version"], "580.159.04");
}

#[test]
fn unknown_capability_is_a_usage_error() {
    let out = doctor("no-nic", &["--require", "warp-drive"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown capability"));
}

#[test]
fn plan_prints_deepep_variables() {
    let out = ep(&[
        "doctor",
        "--plan",
        "--ranks",
        "16",
        "--low-latency",
        "--qps",
        "4",
        "--no-nvlink",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    for line in [
        "export NVSHMEM_DISABLE_P2P=1",
        "export NVSHMEM_IB_ENABLE_IBGDA=1",
        "export NVSHMEM_IBGDA_NUM_RC_PER_PE=4",
        "export NVSHMEM_QP_DEPTH=1024",
        "export NVSHMEM_MAX_TEAMS=7",
        "export NVSHMEM_DISABLE_NVLS=1",
        "export NVSHMEM_CUMEM_GRANULARITY=536870912",
        "export NVSHMEM_DISABLE_MNNVL=1",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

#[test]
fn plan_json_keeps_user_values() {
    let out = Command::new(env!("CARGO_BIN_EXE_ep"))
        .args([
            "doctor",
            "--plan",
            "--ranks",
            "8",
            "--low-latency",
            "--mnnvl",
            "--json",
        ])
        .env("NVSHMEM_QP_DEPTH", "4096")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let depth = v["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "NVSHMEM_QP_DEPTH")
        .unwrap();
    assert_eq!(depth["planned"], "1024");
    assert_eq!(depth["user"], "4096");
    assert_eq!(depth["effective"], "4096");
    assert_eq!(v["qp_depth"], 4096);
    assert!(
        !v["entries"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "NVSHMEM_DISABLE_MNNVL")
    );
}

#[test]
fn captured_gpu_machine() {
    let out = doctor("gpu-machine", &["--json"]);
    assert_eq!(out.status.code(), Some(0));
    let v = json(&out);
    assert_eq!(verdict(&v, "intranode-nvlink")["status"], "pass");
    assert_eq!(verdict(&v, "low-latency-nvlink")["status"], "pass");
    assert_eq!(verdict(&v, "ibgda-gpu-initiated")["usable"], false);
    assert_eq!(v["report"]["ibgda"]["selected"], "none");
    assert_eq!(
        doctor("gpu-machine", &["--require", "low-latency-nvlink"])
            .status
            .code(),
        Some(0)
    );
    assert_eq!(
        doctor("gpu-machine", &["--require", "ibgda-gpu-initiated"])
            .status
            .code(),
        Some(2)
    );
}

const LIVE_CHECKS: [&str; 6] = [
    "gpu.cuda",
    "rdma.verbs-consistency",
    "nic.devx",
    "nic.verbs-ports",
    "gdrcopy.open",
    "probe.gpu-registration",
];

fn check<'a>(v: &'a serde_json::Value, id: &str) -> &'a serde_json::Value {
    v["report"]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no check {id}"))
}

#[test]
fn sysroot_skips_live_probes() {
    let out = doctor("gpu-machine", &["--json"]);
    let v = json(&out);
    for k in ["cuda", "verbs", "gdrcopy_live", "registration"] {
        assert!(
            v["report"]["facts"][k].is_null(),
            "{k}: {}",
            v["report"]["facts"][k]
        );
    }
    for id in LIVE_CHECKS {
        assert_eq!(check(&v, id)["status"], "skip", "{id}");
    }
}

#[test]
fn live_run_queries_cuda_verbs_and_gdrcopy_without_panicking() {
    // On any machine (no GPU, no NIC, no GDRCopy in CI): typed facts, never a panic.
    let out = ep(&["doctor", "--json"]);
    assert!(
        matches!(out.status.code(), Some(0..=2)),
        "{:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v = json(&out);
    let facts = &v["report"]["facts"];
    for k in ["cuda", "verbs", "gdrcopy_live"] {
        assert!(facts[k].is_object(), "{k} missing: {}", facts[k]);
    }
    // Registration runs only with --probe.
    assert!(facts["registration"].is_null());
    for id in LIVE_CHECKS {
        let st = check(&v, id)["status"].as_str().unwrap().to_string();
        assert!(
            ["pass", "warn", "fail", "skip"].contains(&st.as_str()),
            "{id}: {st}"
        );
    }
    // Where CUDA answered, its device count is what gpu.count reports.
    if let Some(devs) = facts["cuda"]["devices"]
        .as_array()
        .filter(|d| !d.is_empty())
    {
        let detail = check(&v, "gpu.count")["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!("CUDA sees {}", devs.len())),
            "{detail}"
        );
    }
}
