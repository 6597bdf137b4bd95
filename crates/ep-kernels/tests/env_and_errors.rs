//! The environment plan's application, the transport report's parsing, and the errors of a
//! machine without the driver or NVSHMEM (CI).

use std::process::Command;

use ep_kernels::Error;
use ep_kernels::nvshmem::env::{EnvEntry, Source, apply_to_command, from_pairs, resolve};
use ep_kernels::nvshmem::report::{IbgdaState, failed_transports, ibgda_state};
use ep_kernels::nvshmem::{Bootstrap, BringUp, CallerFedRendezvous};

#[test]
fn user_values_win_and_are_reported() {
    let plan = vec![
        EnvEntry::new("NVSHMEM_QP_DEPTH", "1024", "depth"),
        EnvEntry::new("NVSHMEM_DISABLE_NVLS", "1", "no SHArP"),
        EnvEntry {
            user_set: true,
            ..EnvEntry::new("NVSHMEM_IB_SL", "3", "user's service level")
        },
    ];
    let applied = resolve(&plan, |v| {
        (v == "NVSHMEM_QP_DEPTH").then(|| "2048".to_string())
    });
    assert_eq!(applied[0].value, "2048");
    assert_eq!(applied[0].planned, "1024");
    assert_eq!(applied[0].source, Source::User);
    assert_eq!(applied[1].source, Source::Plan);
    assert_eq!(applied[2].source, Source::User);
}

#[test]
fn plan_lands_in_the_child_environment_only() {
    let plan = from_pairs(&[
        ("EP_TEST_PLAN_VAR_A", "planned"),
        ("EP_TEST_PLAN_VAR_B", "planned"),
    ]);
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", "echo \"$EP_TEST_PLAN_VAR_A $EP_TEST_PLAN_VAR_B\""]);
    cmd.env("EP_TEST_PLAN_VAR_B", "users");
    let applied = apply_to_command(&mut cmd, &plan);
    assert_eq!(applied[0].source, Source::Plan);
    assert_eq!(applied[1].source, Source::User);
    let out = cmd.output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "planned users");
    assert!(
        std::env::var("EP_TEST_PLAN_VAR_A").is_err(),
        "the parent's environment is untouched"
    );
}

#[test]
fn ibgda_fallback_is_detected() {
    let log = "/src/host/transport/transport.cpp:nvshmemi_transport_init:282: init failed for transport: IBGDA\n";
    let failed = failed_transports(log);
    assert_eq!(failed, vec!["ibgda".to_string()]);
    assert!(matches!(
        ibgda_state(true, &[], &failed),
        IbgdaState::FellBack { .. }
    ));
    assert!(matches!(
        ibgda_state(true, &[], &[]),
        IbgdaState::FellBack { .. }
    ));
    assert_eq!(ibgda_state(true, &["ibgda".into()], &[]), IbgdaState::Live);
    assert_eq!(ibgda_state(false, &[], &failed), IbgdaState::NotRequested);
}

#[test]
fn bring_up_without_driver_or_library_is_a_typed_error() {
    let fed = CallerFedRendezvous::new(&[1u8; 128]).unwrap();
    let missing = std::env::temp_dir().join("ep-kernels-no-such-dir/libnvshmem_host.so.3");
    let err = BringUp::new(0, 1, Bootstrap::UniqueId(&fed))
        .library(&missing)
        .init()
        .unwrap_err();
    // SAFETY: only tries to dlopen libcuda.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        match err {
            Error::Nvshmem(nvshmem_sys::Error::LibraryNotFound { searched }) => {
                assert_eq!(searched, vec![missing])
            }
            other => panic!("unexpected {other}"),
        }
    } else {
        assert!(matches!(err, Error::CudaDriverMissing), "{err}");
    }
    let err = BringUp::new(2, 2, Bootstrap::UniqueId(&fed))
        .init()
        .unwrap_err();
    assert!(matches!(err, Error::BadRank { rank: 2, world: 2 }));
}

#[test]
fn missing_library_error_lists_places() {
    let missing = std::env::temp_dir().join("ep-kernels-none/libnvshmem_host.so.3");
    let err = ep_kernels::nvshmem::load_checked(Some(&missing)).unwrap_err();
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
}

#[test]
fn kernels_are_built_or_explain_why() {
    if !ep_kernels::kernels::available() {
        assert!(ep_kernels::kernels::nvcc().is_none());
    }
}

#[test]
fn ep_core_plan_is_accepted_and_user_values_travel() {
    use ep_core::config::{BufferConfig, IbgdaNicHandler, nvshmem_env_plan};
    use ep_kernels::nvshmem::env::from_plan;
    let mut cfg = BufferConfig::new(2);
    cfg.low_latency_mode = true;
    cfg.num_rdma_bytes = 1 << 28;
    cfg.num_qps_per_rank = 1;
    cfg.allow_nvlink_for_low_latency_mode = true;
    let user =
        std::collections::BTreeMap::from([("NVSHMEM_QP_DEPTH".to_string(), "2048".to_string())]);
    let plan = nvshmem_env_plan(&cfg, &user, IbgdaNicHandler::Auto).unwrap();
    let entries = from_plan(&plan);
    for e in &entries {
        eprintln!(
            "plan {}={} ({}){}",
            e.var,
            e.value,
            e.reason,
            if e.user_set { " [user-set]" } else { "" }
        );
    }
    let qp = entries
        .iter()
        .find(|e| e.var == "NVSHMEM_QP_DEPTH")
        .unwrap();
    assert_eq!((qp.value.as_str(), qp.user_set), ("2048", true));
    assert!(
        entries
            .iter()
            .any(|e| e.var == "NVSHMEM_DISABLE_NVLS" && e.value == "1")
    );
    // A rank started from an environment without the user's variable still gets it.
    let mut cmd = Command::new("/bin/sh");
    cmd.args(["-c", "echo $NVSHMEM_QP_DEPTH"])
        .env_remove("NVSHMEM_QP_DEPTH");
    let applied = apply_to_command(&mut cmd, &entries);
    let a = applied
        .iter()
        .find(|a| a.var == "NVSHMEM_QP_DEPTH")
        .unwrap();
    assert_eq!(a.source, Source::User);
    assert_eq!(
        String::from_utf8_lossy(&cmd.output().unwrap().stdout).trim(),
        "2048"
    );
}
