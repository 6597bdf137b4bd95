//! `BufferConfig` (spec §1.1): validation, one test per error class; the call-level checks of
//! low-latency (spec §1.9, §4, conformance case 18) and normal mode (spec §1.8).

use ep_core::Error;
use ep_core::config::{
    BufferConfig, Config, DEEPEP_LOW_LATENCY_HIDDEN_SIZES, IbgdaNicHandler, LowLatencyCall,
    NormalCall, NvshmemResources, check_deepep_ll_hidden,
};

const INT_MAX: u64 = i32::MAX as u64;

fn ll(num_ranks: usize, num_qps_per_rank: u32) -> BufferConfig {
    BufferConfig {
        low_latency_mode: true,
        num_rdma_bytes: 1 << 30,
        num_qps_per_rank,
        ..BufferConfig::new(num_ranks)
    }
}

fn resources(qp_depth: u32, num_rc_per_pe: u32) -> NvshmemResources {
    NvshmemResources {
        qp_depth,
        num_rc_per_pe,
        cumem_granularity: 1 << 29,
        nic_handler: IbgdaNicHandler::Auto,
    }
}

/// DeepEP's test_low_latency.py call: N = 128, H = 7168, E = 288, K = 8 on 8 ranks.
fn ll_call() -> LowLatencyCall {
    LowLatencyCall {
        num_max_dispatch_tokens_per_rank: 128,
        hidden: 7168,
        num_experts: 288,
        num_topk: 8,
        use_fp8: true,
        round_scale: false,
        use_ue8m0: false,
    }
}

#[test]
fn defaults_are_deepeps_and_valid() {
    let c = BufferConfig::new(8);
    assert_eq!(c.num_nvl_bytes, 0);
    assert_eq!(c.num_rdma_bytes, 0);
    assert!(!c.low_latency_mode);
    assert_eq!(c.num_qps_per_rank, 24);
    assert!(c.allow_nvlink_for_low_latency_mode);
    assert!(!c.allow_mnnvl && !c.use_fabric && !c.explicitly_destroy && !c.enable_shrink);
    assert_eq!(c.nvshmem_qp_depth, 1024);
    c.validate().unwrap();
    assert!(!c.uses_nvshmem());
    assert!(BufferConfig::new(16).uses_nvshmem());
    assert!(ll(8, 36).uses_nvshmem());
    // DeepEP's test setups are valid.
    BufferConfig {
        num_nvl_bytes: 1_999_999_872,
        ..BufferConfig::new(8)
    }
    .validate()
    .unwrap();
    BufferConfig {
        num_nvl_bytes: 1_999_999_872,
        num_rdma_bytes: 999_999_872,
        ..BufferConfig::new(16)
    }
    .validate()
    .unwrap();
}

#[test]
fn nvl_allocation_adds_barrier_and_pointer_tables() {
    let c = BufferConfig {
        num_nvl_bytes: 1024,
        ..BufferConfig::new(8)
    };
    assert_eq!(c.nvl_allocation_bytes(), 1024 + 32 + 64 + 64);
    assert_eq!(BufferConfig::new(8).nvl_allocation_bytes(), 0);
}

#[test]
fn rank_count_rules() {
    for r in [1, 2, 3, 7, 8, 16, 160] {
        BufferConfig::new(r).validate().unwrap();
    }
    for r in [0, 9, 12, 17, 100] {
        assert!(
            matches!(BufferConfig::new(r).validate(), Err(Error::UnsupportedNumRanks { num_ranks, .. }) if num_ranks == r),
            "R={r}"
        );
    }
    // More than 160 ranks: low-latency mode only.
    assert!(matches!(
        BufferConfig::new(168).validate(),
        Err(Error::UnsupportedNumRanks { .. })
    ));
    ll(168, 1).validate().unwrap();
    ll(256, 1).validate().unwrap();
}

#[test]
fn misaligned_buffers() {
    let c = BufferConfig {
        num_nvl_bytes: 1000,
        ..BufferConfig::new(8)
    };
    assert_eq!(
        c.validate(),
        Err(Error::BufferMisaligned {
            field: "num_nvl_bytes",
            bytes: 1000,
            alignment: 128
        })
    );
    let c = BufferConfig {
        num_rdma_bytes: 130,
        ..BufferConfig::new(16)
    };
    assert!(matches!(
        c.validate(),
        Err(Error::BufferMisaligned {
            field: "num_rdma_bytes",
            ..
        })
    ));
}

#[test]
fn int_max_rules() {
    let big = (INT_MAX + 1).next_multiple_of(128);
    // NVL above INT_MAX: fine without an RDMA buffer, rejected with one.
    BufferConfig {
        num_nvl_bytes: big,
        ..BufferConfig::new(8)
    }
    .validate()
    .unwrap();
    assert!(matches!(
        BufferConfig {
            num_nvl_bytes: big,
            num_rdma_bytes: 128,
            ..BufferConfig::new(16)
        }
        .validate(),
        Err(Error::BufferTooLarge {
            field: "num_nvl_bytes",
            ..
        })
    ));
    // RDMA above INT_MAX: rejected in normal mode, fine in low-latency mode (2.1 GB hints).
    assert!(matches!(
        BufferConfig {
            num_rdma_bytes: big,
            ..BufferConfig::new(16)
        }
        .validate(),
        Err(Error::BufferTooLarge {
            field: "num_rdma_bytes",
            ..
        })
    ));
    BufferConfig {
        num_rdma_bytes: 2_146_961_792,
        ..ll(8, 36)
    }
    .validate()
    .unwrap();
}

#[test]
fn per_channel_int_max_rule_with_device_sms() {
    let c = BufferConfig {
        num_rdma_bytes: 64 * INT_MAX.next_multiple_of(128),
        ..ll(8, 36)
    };
    c.check_device_sms(132).unwrap(); // 66 channels
    assert!(matches!(
        c.check_device_sms(100),
        Err(Error::BufferTooLarge {
            field: "num_rdma_bytes",
            ..
        })
    ));
    assert!(matches!(
        c.check_device_sms(1),
        Err(Error::InvalidConfig { .. })
    ));
}

#[test]
fn rdma_buffer_needs_internode_or_low_latency() {
    let c = BufferConfig {
        num_rdma_bytes: 128,
        ..BufferConfig::new(8)
    };
    assert_eq!(
        c.validate(),
        Err(Error::RdmaBufferUnused {
            num_rdma_bytes: 128,
            num_ranks: 8
        })
    );
    BufferConfig {
        num_rdma_bytes: 128,
        ..BufferConfig::new(16)
    }
    .validate()
    .unwrap();
    BufferConfig {
        num_rdma_bytes: 128,
        low_latency_mode: true,
        ..BufferConfig::new(8)
    }
    .validate()
    .unwrap();
}

#[test]
fn qps_per_rank_needed_when_nvshmem_is_used() {
    assert_eq!(ll(8, 0).validate(), Err(Error::NoQpsPerRank));
    assert_eq!(
        BufferConfig {
            num_qps_per_rank: 0,
            ..BufferConfig::new(16)
        }
        .validate(),
        Err(Error::NoQpsPerRank)
    );
    // Intranode normal mode does not use NVSHMEM (DeepEP's intranode test passes 1; 0 is fine too).
    BufferConfig {
        num_qps_per_rank: 0,
        ..BufferConfig::new(8)
    }
    .validate()
    .unwrap();
    assert!(matches!(
        BufferConfig {
            nvshmem_qp_depth: 0,
            ..ll(8, 36)
        }
        .validate(),
        Err(Error::InvalidConfig {
            field: "nvshmem_qp_depth",
            ..
        })
    ));
}

#[test]
fn low_latency_reference_call_passes() {
    ll(8, 36)
        .check_low_latency(&ll_call(), &resources(1024, 36))
        .unwrap();
    let bf16 = LowLatencyCall {
        use_fp8: false,
        ..ll_call()
    };
    ll(8, 36)
        .check_low_latency(&bf16, &resources(1024, 36))
        .unwrap();
}

#[test]
fn low_latency_needs_low_latency_mode() {
    let c = BufferConfig {
        num_rdma_bytes: 128,
        ..BufferConfig::new(16)
    };
    assert_eq!(
        c.check_low_latency(&ll_call(), &resources(1024, 36)),
        Err(Error::NotLowLatencyMode)
    );
    // An invalid buffer config is reported first.
    assert_eq!(
        ll(8, 0).check_low_latency(&ll_call(), &resources(1024, 36)),
        Err(Error::NoQpsPerRank)
    );
}

/// Conformance case 18: QP depth 1024 allows N = 511 and rejects N = 512 (needs 1026).
#[test]
fn case_18_qp_depth_guard() {
    let c = ll(8, 36);
    let call = |n| LowLatencyCall {
        num_max_dispatch_tokens_per_rank: n,
        ..ll_call()
    };
    c.check_low_latency(&call(511), &resources(1024, 36))
        .unwrap();
    assert_eq!(
        c.check_low_latency(&call(512), &resources(1024, 36)),
        Err(Error::QpDepthTooSmall {
            depth: 1024,
            needed: 1026,
            num_max_dispatch_tokens_per_rank: 512
        })
    );
    // Raising the depth as downstream projects do fixes it.
    c.check_low_latency(&call(512), &resources(1026, 36))
        .unwrap();
    let msg = c
        .check_low_latency(&call(512), &resources(1024, 36))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("NVSHMEM_QP_DEPTH >= 1026"), "{msg}");
}

#[test]
fn low_latency_dispatch_token_range() {
    let c = ll(8, 36);
    for n in [0, 1025] {
        let call = LowLatencyCall {
            num_max_dispatch_tokens_per_rank: n,
            ..ll_call()
        };
        assert_eq!(
            c.check_low_latency(&call, &resources(4096, 36)),
            Err(Error::DispatchTokensOutOfRange {
                num_max_dispatch_tokens_per_rank: n,
                max: 1024
            })
        );
    }
    let call = LowLatencyCall {
        num_max_dispatch_tokens_per_rank: 1024,
        ..ll_call()
    };
    c.check_low_latency(&call, &resources(2050, 36)).unwrap();
}

#[test]
fn low_latency_qps_per_local_expert() {
    // 288 experts on 8 ranks: 36 local experts, the effective RC count must be >= 36.
    assert_eq!(
        ll(8, 36).check_low_latency(&ll_call(), &resources(1024, 35)),
        Err(Error::TooFewQpsPerRank {
            num_rc_per_pe: 35,
            num_local_experts: 36
        })
    );
}

#[test]
fn low_latency_experts_divisible() {
    let call = LowLatencyCall {
        num_experts: 100,
        ..ll_call()
    };
    assert_eq!(
        ll(8, 36).check_low_latency(&call, &resources(1024, 36)),
        Err(Error::ExpertsNotDivisible {
            num_experts: 100,
            num_ranks: 8
        })
    );
}

#[test]
fn low_latency_packed_rows_multiple_of_4() {
    // R = 2, N = 127: 254 % 4 != 0.
    let call = LowLatencyCall {
        num_max_dispatch_tokens_per_rank: 127,
        num_experts: 2,
        ..ll_call()
    };
    assert_eq!(
        ll(2, 1).check_low_latency(&call, &resources(1024, 1)),
        Err(Error::PackedRowsMisaligned {
            num_ranks: 2,
            num_max_dispatch_tokens_per_rank: 127
        })
    );
    // R = 8 makes any N fine.
    let call = LowLatencyCall {
        num_max_dispatch_tokens_per_rank: 127,
        ..ll_call()
    };
    ll(8, 36)
        .check_low_latency(&call, &resources(1024, 36))
        .unwrap();
}

#[test]
fn low_latency_topk_limit() {
    let call = LowLatencyCall {
        num_topk: 12,
        ..ll_call()
    };
    assert_eq!(
        ll(8, 36).check_low_latency(&call, &resources(1024, 36)),
        Err(Error::TopkTooLarge {
            num_topk: 12,
            max: 11,
            mode: "low-latency"
        })
    );
    let call = LowLatencyCall {
        num_topk: 11,
        ..ll_call()
    };
    ll(8, 36)
        .check_low_latency(&call, &resources(1024, 36))
        .unwrap();
}

#[test]
fn low_latency_hidden_alignment() {
    let c = ll(8, 36);
    let r = resources(1024, 36);
    let bf16 = |hidden| LowLatencyCall {
        hidden,
        use_fp8: false,
        ..ll_call()
    };
    let fp8 = |hidden| LowLatencyCall {
        hidden,
        ..ll_call()
    };
    assert!(matches!(
        c.check_low_latency(&bf16(7000), &r),
        Err(Error::HiddenMisaligned { multiple: 128, .. })
    ));
    assert!(matches!(
        c.check_low_latency(&bf16(0), &r),
        Err(Error::HiddenMisaligned { .. })
    ));
    // 7296 = 57 * 128: fine in BF16, not in FP8 (needs % 512).
    c.check_low_latency(&bf16(7296), &r).unwrap();
    assert!(matches!(
        c.check_low_latency(&fp8(7296), &r),
        Err(Error::HiddenMisaligned { multiple: 512, .. })
    ));
    // Outside DeepEP's compiled list but aligned: ep-rs accepts, the DeepEP check does not.
    c.check_low_latency(&fp8(1024), &r).unwrap();
    assert!(matches!(
        check_deepep_ll_hidden(1024),
        Err(Error::Unsupported(_))
    ));
    for h in DEEPEP_LOW_LATENCY_HIDDEN_SIZES {
        check_deepep_ll_hidden(h).unwrap();
        c.check_low_latency(&fp8(h), &r).unwrap();
    }
}

#[test]
fn ue8m0_requires_round_scale() {
    let c = ll(8, 36);
    let r = resources(1024, 36);
    let call = LowLatencyCall {
        use_ue8m0: true,
        ..ll_call()
    };
    assert_eq!(
        c.check_low_latency(&call, &r),
        Err(Error::Ue8m0WithoutRoundScale)
    );
    let call = LowLatencyCall {
        use_ue8m0: true,
        round_scale: true,
        ..ll_call()
    };
    c.check_low_latency(&call, &r).unwrap();
}

fn normal_call(config: Config) -> NormalCall {
    NormalCall {
        config,
        hidden: 7168,
        elem_bytes: 2,
        num_topk: 8,
        expert_alignment: 1,
        combine: false,
    }
}

#[test]
fn normal_reference_calls_pass() {
    let c = BufferConfig {
        num_nvl_bytes: 1_999_999_872,
        ..BufferConfig::new(8)
    };
    c.check_normal(&normal_call(Config::new(24, 8, 256, 6, 128).unwrap()))
        .unwrap();
    c.check_normal(&NormalCall {
        elem_bytes: 1,
        ..normal_call(Config::dispatch_for(8).unwrap())
    })
    .unwrap();
    let c16 = BufferConfig {
        num_rdma_bytes: 999_999_872,
        ..BufferConfig::new(16)
    };
    c16.check_normal(&NormalCall {
        combine: true,
        ..normal_call(Config::combine_for(16).unwrap())
    })
    .unwrap();
}

#[test]
fn normal_checks() {
    let c = BufferConfig::new(8);
    let cfg = Config::dispatch_for(8).unwrap();
    assert_eq!(
        c.check_normal(&normal_call(Config::new(21, 6, 256, 6, 128).unwrap())),
        Err(Error::OddNumSms { num_sms: 21 })
    );
    assert_eq!(
        c.check_normal(&NormalCall {
            num_topk: 33,
            ..normal_call(cfg)
        }),
        Err(Error::TopkTooLarge {
            num_topk: 33,
            max: 32,
            mode: "normal"
        })
    );
    c.check_normal(&NormalCall {
        num_topk: 32,
        ..normal_call(cfg)
    })
    .unwrap();
    assert_eq!(
        c.check_normal(&NormalCall {
            expert_alignment: 0,
            ..normal_call(cfg)
        }),
        Err(Error::ZeroExpertAlignment)
    );
    // BF16 rows need H % 8, FP8 rows H % 16.
    c.check_normal(&NormalCall {
        hidden: 8,
        ..normal_call(cfg)
    })
    .unwrap();
    assert!(matches!(
        c.check_normal(&NormalCall {
            hidden: 8,
            elem_bytes: 1,
            ..normal_call(cfg)
        }),
        Err(Error::HiddenMisaligned { multiple: 16, .. })
    ));
    // Internode combine applies DeepEP's ring checks.
    let c24 = BufferConfig::new(24);
    let bad = Config::new(24, 4, 256, 8, 128).unwrap();
    c24.check_normal(&normal_call(bad)).unwrap();
    assert!(matches!(
        c24.check_normal(&NormalCall {
            combine: true,
            ..normal_call(bad)
        }),
        Err(Error::InvalidConfig { .. })
    ));
    // An invalid buffer config is reported first.
    assert!(matches!(
        BufferConfig::new(9).check_normal(&normal_call(cfg)),
        Err(Error::UnsupportedNumRanks { .. })
    ));
}
