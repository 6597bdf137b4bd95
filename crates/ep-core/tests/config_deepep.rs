//! `Config` (spec §1.4): DeepEP's constructor checks, the tuned tables, conformance case 12.

use ep_core::Error;
use ep_core::config::Config;

#[test]
fn defaults_are_deepeps() {
    let c = Config::default();
    assert_eq!(c.num_sms(), 20);
    assert_eq!(c.num_channels(), 10);
    assert_eq!(c.num_max_nvl_chunked_send_tokens(), 6);
    assert_eq!(c.num_max_nvl_chunked_recv_tokens(), 256);
    assert_eq!(c.num_max_rdma_chunked_send_tokens(), 6);
    assert_eq!(c.num_max_rdma_chunked_recv_tokens(), 256);
    // The defaults pass the constructor's own checks (256 is not a multiple of 6: rounds to 258).
    let built = Config::new(20, 6, 256, 6, 256).unwrap();
    assert_eq!(built.num_max_rdma_chunked_recv_tokens(), 258);
}

/// Conformance case 12.
#[test]
fn case_12_nvl_send_must_be_below_recv() {
    assert_eq!(
        Config::new(24, 8, 8, 6, 256),
        Err(Error::NvlChunkOrder { send: 8, recv: 8 })
    );
    assert!(matches!(
        Config::new(24, 9, 8, 6, 256),
        Err(Error::NvlChunkOrder { .. })
    ));
    assert!(Config::new(24, 7, 8, 6, 256).is_ok());
}

/// Conformance case 12: `rdma_recv = 100, rdma_send = 16` → stored 112, `16 <= 56` holds.
#[test]
fn case_12_rdma_recv_rounded_up_to_send_multiple() {
    let c = Config::new(24, 8, 256, 16, 100).unwrap();
    assert_eq!(c.num_max_rdma_chunked_recv_tokens(), 112);
    assert!(c.num_max_rdma_chunked_send_tokens() <= c.num_max_rdma_chunked_recv_tokens() / 2);
}

#[test]
fn rdma_send_above_half_of_rounded_recv_is_rejected() {
    // Rounding up to a multiple of send makes any recv > send at least 2 * send, so the failing
    // configurations are those with recv <= send: 10 → 16, and 16 > 8.
    assert_eq!(
        Config::new(24, 8, 256, 16, 10),
        Err(Error::RdmaChunkTooLarge {
            send: 16,
            recv: 10,
            rounded_recv: 16
        })
    );
    assert!(matches!(
        Config::new(24, 8, 256, 16, 16),
        Err(Error::RdmaChunkTooLarge {
            rounded_recv: 16,
            ..
        })
    ));
    // Exactly half passes; rounding rescues 17 → 32 (16 <= 16).
    assert!(Config::new(24, 8, 256, 16, 32).is_ok());
    assert_eq!(
        Config::new(24, 8, 256, 16, 17)
            .unwrap()
            .num_max_rdma_chunked_recv_tokens(),
        32
    );
    // send = 1: any recv >= 2 passes, recv = 1 fails.
    assert!(Config::new(24, 8, 256, 1, 2).is_ok());
    assert!(Config::new(24, 8, 256, 1, 1).is_err());
}

#[test]
fn zero_chunks_are_rejected_with_their_name() {
    let cases = [
        ((0, 256, 6, 128), "num_max_nvl_chunked_send_tokens"),
        ((6, 0, 6, 128), "num_max_nvl_chunked_recv_tokens"),
        ((6, 256, 0, 128), "num_max_rdma_chunked_send_tokens"),
        ((6, 256, 6, 0), "num_max_rdma_chunked_recv_tokens"),
    ];
    for ((a, b, c, d), field) in cases {
        assert_eq!(
            Config::new(20, a, b, c, d),
            Err(Error::ZeroChunkSize { field })
        );
    }
}

#[test]
fn odd_num_sms_is_allowed_at_construction_but_not_for_channels() {
    let c = Config::new(21, 6, 256, 6, 128).unwrap();
    assert_eq!(c.num_channels(), 10);
    assert_eq!(
        c.check_even_num_sms(),
        Err(Error::OddNumSms { num_sms: 21 })
    );
    assert_eq!(
        Config::dispatch_for_num_sms(8, 23),
        Err(Error::OddNumSms { num_sms: 23 })
    );
}

/// The tables of spec §1.4, written out again independently of the implementation.
const TABLE: &[(&[usize], [usize; 4], [usize; 4])] = &[
    (&[2], [24, 256, 6, 128], [10, 256, 6, 128]),
    (&[4], [6, 256, 6, 128], [9, 256, 6, 128]),
    (&[8], [6, 256, 6, 128], [4, 256, 6, 128]),
    (&[16], [36, 288, 20, 128], [4, 288, 12, 128]),
    (&[24, 32, 48, 64], [32, 288, 8, 128], [1, 288, 8, 128]),
    (&[96], [20, 480, 12, 128], [1, 480, 8, 128]),
    (&[128], [20, 560, 12, 128], [1, 560, 8, 128]),
    (&[144], [32, 720, 12, 128], [2, 720, 8, 128]),
    (&[160], [28, 720, 12, 128], [2, 720, 8, 128]),
];

fn row(c: &Config) -> [usize; 4] {
    [
        c.num_max_nvl_chunked_send_tokens(),
        c.num_max_nvl_chunked_recv_tokens(),
        c.num_max_rdma_chunked_send_tokens(),
        c.num_max_rdma_chunked_recv_tokens(),
    ]
}

fn rounded(mut r: [usize; 4]) -> [usize; 4] {
    r[3] = r[3].div_ceil(r[2]) * r[2];
    r
}

#[test]
fn tuned_tables_match_the_spec() {
    for (ranks, d, c) in TABLE {
        for &r in *ranks {
            let dc = Config::dispatch_for(r).unwrap();
            let cc = Config::combine_for(r).unwrap();
            assert_eq!(dc.num_sms(), 20, "Buffer.num_sms default");
            assert_eq!(row(&dc), rounded(*d), "dispatch R={r}");
            assert_eq!(row(&cc), rounded(*c), "combine R={r}");
            let d24 = Config::dispatch_for_num_sms(r, 24).unwrap();
            assert_eq!((d24.num_sms(), row(&d24)), (24, rounded(*d)));
            // Every tuned combine config passes DeepEP's internode combine ring checks.
            cc.check_internode_combine(r).unwrap();
        }
    }
}

#[test]
fn unsupported_rank_counts_have_no_table() {
    for r in [0, 1, 3, 5, 6, 7, 9, 12, 40, 72, 80, 112, 136, 168, 256] {
        assert!(
            matches!(Config::dispatch_for(r), Err(Error::UnsupportedNumRanks { num_ranks, .. }) if num_ranks == r),
            "R={r}"
        );
        assert!(matches!(
            Config::combine_for(r),
            Err(Error::UnsupportedNumRanks { .. })
        ));
    }
}

/// Conformance case 12: internode combine rejects `nvl_recv % RR != 0`.
#[test]
fn case_12_internode_combine_needs_nvl_recv_multiple_of_nodes() {
    // R = 24: 3 nodes; 256 % 3 != 0.
    let c = Config::new(24, 4, 256, 8, 128).unwrap();
    assert!(matches!(
        c.check_internode_combine(24),
        Err(Error::InvalidConfig {
            field: "num_max_nvl_chunked_recv_tokens",
            ..
        })
    ));
    // 255 is a multiple of 3 and passes the other checks (85 > 8, 85 - 8 >= 4, 8 >= 8).
    Config::new(24, 4, 255, 8, 128)
        .unwrap()
        .check_internode_combine(24)
        .unwrap();
    // Intranode: nothing to check.
    c.check_internode_combine(8).unwrap();
}

#[test]
fn internode_combine_ring_checks() {
    // R = 16 (RR = 2, 12 warps per forwarder).
    // Sub-ring must exceed both send chunks: 2 * 12 = 24 → sub-ring 12 == rdma_send 12.
    let c = Config::new(24, 4, 24, 12, 128).unwrap();
    assert!(matches!(
        c.check_internode_combine(16),
        Err(Error::InvalidConfig { .. })
    ));
    // Sub-ring minus forwarder warps must hold the NVL send chunk: 14 - 12 = 2 < 4.
    let c = Config::new(24, 4, 28, 12, 128).unwrap();
    assert!(matches!(
        c.check_internode_combine(16),
        Err(Error::InvalidConfig { .. })
    ));
    // RDMA send chunk below the forwarder warps: 11 < 12.
    let c = Config::new(24, 4, 288, 11, 128).unwrap();
    assert!(matches!(
        c.check_internode_combine(16),
        Err(Error::InvalidConfig {
            field: "num_max_rdma_chunked_send_tokens",
            ..
        })
    ));
}

#[test]
fn errors_say_what_to_do() {
    let e = Config::new(24, 8, 8, 6, 128).unwrap_err().to_string();
    assert!(e.contains("lower the send chunk"), "{e}");
    let e = Config::new(24, 6, 8, 16, 10).unwrap_err().to_string();
    assert!(e.contains("2 * send"), "{e}");
}
