//! The NVSHMEM environment plan (spec §1.2): equals the spec's table for every option
//! combination; user-set variables are respected and reported; effective resources.

use std::collections::BTreeMap;

use ep_core::Error;
use ep_core::config::{
    BufferConfig, IbgdaNicHandler, NvshmemWorld, low_latency_rdma_size_hint, nvshmem_env_plan,
    parse_nvshmem_size,
};

const HANDLERS: [(IbgdaNicHandler, &str); 4] = [
    (IbgdaNicHandler::Auto, "auto"),
    (IbgdaNicHandler::Gpu, "gpu"),
    (IbgdaNicHandler::Cpu, "cpu"),
    (IbgdaNicHandler::CpuHostMemory, "cpu_host_memory"),
];

fn config(num_ranks: usize, ll: bool, allow_nvlink: bool, allow_mnnvl: bool) -> BufferConfig {
    let num_rdma_bytes = if ll {
        low_latency_rdma_size_hint(128, 7168, num_ranks, 32 * num_ranks).unwrap() as u64
    } else if num_ranks > 8 {
        1 << 30
    } else {
        0
    };
    BufferConfig {
        num_nvl_bytes: 1 << 30,
        num_rdma_bytes,
        low_latency_mode: ll,
        num_qps_per_rank: if ll { 32 } else { 24 },
        allow_nvlink_for_low_latency_mode: allow_nvlink,
        allow_mnnvl,
        ..BufferConfig::new(num_ranks)
    }
}

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The spec §1.2 table, plus ep-rs's explicit NIC handler after `NVSHMEM_IB_ENABLE_IBGDA`.
fn expected(cfg: &BufferConfig, handler: &str, qp_depth: &str) -> Vec<(&'static str, String)> {
    let mut v = vec![
        (
            "NVSHMEM_DISABLE_P2P",
            if cfg.allow_nvlink_for_low_latency_mode {
                "0"
            } else {
                "1"
            }
            .to_string(),
        ),
        ("NVSHMEM_IB_ENABLE_IBGDA", "1".to_string()),
        ("NVSHMEM_IBGDA_NIC_HANDLER", handler.to_string()),
        (
            "NVSHMEM_IBGDA_NUM_RC_PER_PE",
            cfg.num_qps_per_rank.to_string(),
        ),
        ("NVSHMEM_QP_DEPTH", qp_depth.to_string()),
        ("NVSHMEM_MAX_TEAMS", "7".to_string()),
        ("NVSHMEM_DISABLE_NVLS", "1".to_string()),
        ("NVSHMEM_CUMEM_GRANULARITY", "536870912".to_string()),
    ];
    if !cfg.allow_mnnvl {
        v.push(("NVSHMEM_DISABLE_MNNVL", "1".to_string()));
    }
    v
}

#[test]
fn plan_matches_spec_table_for_every_combination() {
    let mut checked = 0;
    for r in [4, 8, 16] {
        for ll in [false, true] {
            for allow_nvlink in [false, true] {
                for allow_mnnvl in [false, true] {
                    for user_qp in [None, Some("2048")] {
                        for (handler, handler_str) in HANDLERS {
                            let cfg = config(r, ll, allow_nvlink, allow_mnnvl);
                            let user = match user_qp {
                                Some(q) => env(&[("NVSHMEM_QP_DEPTH", q), ("UNRELATED", "x")]),
                                None => env(&[("UNRELATED", "x")]),
                            };
                            let plan = nvshmem_env_plan(&cfg, &user, handler).unwrap();
                            checked += 1;
                            let uses = ll || r > 8;
                            assert_eq!(plan.uses_nvshmem, uses, "R={r} ll={ll}");
                            assert_eq!(plan.initialises_nvshmem, uses);
                            if !uses {
                                assert!(
                                    plan.entries.is_empty()
                                        && plan.resources.is_none()
                                        && plan.world.is_none()
                                );
                                assert!(plan.to_apply().is_empty());
                                continue;
                            }
                            let planned: Vec<_> = plan
                                .entries
                                .iter()
                                .map(|e| (e.name, e.planned.clone()))
                                .collect();
                            assert_eq!(planned, expected(&cfg, handler_str, "1024"));
                            for e in &plan.entries {
                                assert!(!e.reason.is_empty());
                                let user_set = e.name == "NVSHMEM_QP_DEPTH" && user_qp.is_some();
                                assert_eq!(
                                    e.user.as_deref(),
                                    if user_set { user_qp } else { None },
                                    "{}",
                                    e.name
                                );
                            }
                            let applied: Vec<_> = plan
                                .to_apply()
                                .into_iter()
                                .map(|(n, v)| (n, v.to_string()))
                                .collect();
                            let want: Vec<_> = expected(&cfg, handler_str, "1024")
                                .into_iter()
                                .filter(|(n, _)| !(user_qp.is_some() && *n == "NVSHMEM_QP_DEPTH"))
                                .collect();
                            assert_eq!(applied, want);

                            let res = plan.resources.unwrap();
                            assert_eq!(res.qp_depth, if user_qp.is_some() { 2048 } else { 1024 });
                            assert_eq!(res.num_rc_per_pe, cfg.num_qps_per_rank);
                            assert_eq!(res.cumem_granularity, 1 << 29);
                            assert_eq!(res.nic_handler, handler);

                            let world = plan.world.unwrap();
                            if ll {
                                assert_eq!(
                                    world,
                                    NvshmemWorld {
                                        num_pes: r,
                                        num_jobs: 1,
                                        strided_rdma_team: r > 8
                                    }
                                );
                                assert_eq!(world.pe_of(13.min(r - 1)), 13.min(r - 1));
                            } else {
                                assert_eq!(
                                    world,
                                    NvshmemWorld {
                                        num_pes: r / 8,
                                        num_jobs: 8,
                                        strided_rdma_team: false
                                    }
                                );
                                assert_eq!(world.pe_of(13), 1);
                            }
                        }
                    }
                }
            }
        }
    }
    assert_eq!(checked, 3 * 2 * 2 * 2 * 2 * 4);
}

#[test]
fn user_set_variables_are_respected_and_reported() {
    let cfg = config(16, true, true, false);
    let user = env(&[
        ("NVSHMEM_DISABLE_P2P", "1"),
        ("NVSHMEM_IBGDA_NUM_RC_PER_PE", "64"),
        ("NVSHMEM_QP_DEPTH", "1024"),
        ("NVSHMEM_CUMEM_GRANULARITY", "1g"),
        ("NVSHMEM_IBGDA_NIC_HANDLER", "gpu"),
        ("NVSHMEM_DISABLE_NVLS", ""), // empty counts as unset
    ]);
    let plan = nvshmem_env_plan(&cfg, &user, IbgdaNicHandler::Cpu).unwrap();
    let p2p = plan.get("NVSHMEM_DISABLE_P2P").unwrap();
    assert_eq!(
        (p2p.planned.as_str(), p2p.user.as_deref(), p2p.effective()),
        ("0", Some("1"), "1")
    );
    assert!(p2p.is_user_set() && p2p.user_overrides() && p2p.to_apply().is_none());
    // Same value as planned: user-set, but not an override.
    let qp = plan.get("NVSHMEM_QP_DEPTH").unwrap();
    assert!(qp.is_user_set() && !qp.user_overrides());
    let nvls = plan.get("NVSHMEM_DISABLE_NVLS").unwrap();
    assert!(!nvls.is_user_set());
    assert_eq!(nvls.to_apply(), Some(("NVSHMEM_DISABLE_NVLS", "1")));

    let res = plan.resources.unwrap();
    assert_eq!(res.num_rc_per_pe, 64);
    assert_eq!(res.qp_depth, 1024);
    assert_eq!(res.cumem_granularity, 1 << 30);
    assert_eq!(
        res.nic_handler,
        IbgdaNicHandler::Gpu,
        "user's handler wins over the argument"
    );
    let names: Vec<_> = plan.to_apply().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "NVSHMEM_IB_ENABLE_IBGDA",
            "NVSHMEM_MAX_TEAMS",
            "NVSHMEM_DISABLE_NVLS",
            "NVSHMEM_DISABLE_MNNVL"
        ]
    );
}

#[test]
fn configured_qp_depth_is_planned_when_the_user_sets_none() {
    let cfg = BufferConfig {
        nvshmem_qp_depth: 2 * (1024 + 1),
        ..config(8, true, true, false)
    };
    let plan = nvshmem_env_plan(&cfg, &BTreeMap::new(), IbgdaNicHandler::Auto).unwrap();
    assert_eq!(plan.get("NVSHMEM_QP_DEPTH").unwrap().planned, "2050");
    assert_eq!(plan.resources.unwrap().qp_depth, 2050);
}

#[test]
fn env_set_but_nvshmem_not_initialised_without_rdma_bytes() {
    // DeepEP sets the variables for RR > 1, but initialises NVSHMEM only with an RDMA buffer.
    let cfg = BufferConfig {
        num_rdma_bytes: 0,
        ..config(16, false, true, false)
    };
    let plan = nvshmem_env_plan(&cfg, &BTreeMap::new(), IbgdaNicHandler::Auto).unwrap();
    assert!(plan.uses_nvshmem && !plan.initialises_nvshmem);
    assert!(plan.world.is_none() && plan.resources.is_some());
}

#[test]
fn invalid_inputs_are_errors() {
    let cfg = config(8, true, true, false);
    for (name, value) in [
        ("NVSHMEM_QP_DEPTH", "deep"),
        ("NVSHMEM_QP_DEPTH", "-1"),
        ("NVSHMEM_IBGDA_NUM_RC_PER_PE", "4x"),
        ("NVSHMEM_CUMEM_GRANULARITY", "lots"),
        ("NVSHMEM_IBGDA_NIC_HANDLER", "GPU"),
    ] {
        let err =
            nvshmem_env_plan(&cfg, &env(&[(name, value)]), IbgdaNicHandler::Auto).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidEnvVar { name: n, .. } if *n == name),
            "{name}={value}: {err}"
        );
    }
    // An invalid buffer config has no plan.
    let bad = BufferConfig {
        num_qps_per_rank: 0,
        ..cfg
    };
    assert_eq!(
        nvshmem_env_plan(&bad, &BTreeMap::new(), IbgdaNicHandler::Auto),
        Err(Error::NoQpsPerRank)
    );
}

#[test]
fn nic_handler_values_round_trip() {
    for (h, s) in HANDLERS {
        assert_eq!(h.as_env_value(), s);
        assert_eq!(IbgdaNicHandler::from_env_value(s), Some(h));
    }
    assert_eq!(IbgdaNicHandler::default(), IbgdaNicHandler::Auto);
    assert_eq!(
        IbgdaNicHandler::CpuHostMemory.min_nvshmem_version(),
        (3, 4, 5)
    );
    assert_eq!(IbgdaNicHandler::from_env_value("none"), None);
}

#[test]
fn nvshmem_size_format() {
    assert_eq!(parse_nvshmem_size("536870912"), Some(536_870_912));
    assert_eq!(parse_nvshmem_size("512m"), Some(1 << 29));
    assert_eq!(parse_nvshmem_size("512M"), Some(1 << 29));
    assert_eq!(parse_nvshmem_size("20m"), Some(20_971_520));
    assert_eq!(parse_nvshmem_size("3.1M"), Some(3_250_586));
    assert_eq!(parse_nvshmem_size(".5m"), Some(524_288));
    assert_eq!(parse_nvshmem_size("0.5m"), Some(524_288));
    assert_eq!(parse_nvshmem_size("1g"), Some(1 << 30));
    assert_eq!(parse_nvshmem_size("2T"), Some(2 << 40));
    assert_eq!(
        parse_nvshmem_size("1kk"),
        Some(1024),
        "characters after the multiplier are ignored"
    );
    assert_eq!(parse_nvshmem_size(" 4k "), Some(4096));
    for bad in ["", "m", ".", "1.2.3", "12x", "-5"] {
        assert_eq!(parse_nvshmem_size(bad), None, "{bad:?}");
    }
}
