//! Size hints (spec §1.5, §1.9): conformance case 13's vectors, the low-latency layout, and
//! monotonicity.

use ep_core::Error;
use ep_core::config::{
    Config, LowLatencyLayout, hidden_bytes_for_hint, low_latency_rdma_size_hint,
};
use proptest::prelude::*;

const H_BF16: usize = 7168 * 2;

/// Conformance case 13, §1.5 (DeepEP's tests run with `Buffer.num_sms = 24`).
#[test]
fn case_13_normal_vectors() {
    assert_eq!(hidden_bytes_for_hint(7168, 2).unwrap(), H_BF16);
    assert_eq!(
        hidden_bytes_for_hint(7168, 1).unwrap(),
        H_BF16,
        "FP8 sized like BF16"
    );

    // R = 8, default configs: max over dispatch and combine.
    let d = Config::dispatch_for_num_sms(8, 24).unwrap();
    let c = Config::combine_for_num_sms(8, 24).unwrap();
    let nvl = d
        .nvl_buffer_size_hint(H_BF16, 8)
        .unwrap()
        .max(c.nvl_buffer_size_hint(H_BF16, 8).unwrap());
    assert_eq!(nvl, 402_851_712);
    assert_eq!(d.rdma_buffer_size_hint(H_BF16, 8).unwrap(), 0);

    let d16 = Config::dispatch_for_num_sms(16, 24).unwrap();
    assert_eq!(d16.nvl_buffer_size_hint(H_BF16, 16).unwrap(), 453_208_704);
    assert_eq!(d16.rdma_buffer_size_hint(H_BF16, 16).unwrap(), 110_265_216);

    let d32 = Config::dispatch_for_num_sms(32, 24).unwrap();
    assert_eq!(d32.nvl_buffer_size_hint(H_BF16, 32).unwrap(), 453_210_240);
    assert_eq!(d32.rdma_buffer_size_hint(H_BF16, 32).unwrap(), 201_628_416);
}

/// Conformance case 13, §1.9.
#[test]
fn case_13_low_latency_vectors() {
    let l = LowLatencyLayout::new(128, 7168, 8, 288).unwrap();
    assert_eq!(l.total_bytes, 2_146_961_664);
    assert_eq!(l.size_hint().unwrap(), 2_146_961_792);
    assert_eq!(
        low_latency_rdma_size_hint(128, 7168, 8, 288).unwrap(),
        2_146_961_792
    );
    assert_eq!(
        low_latency_rdma_size_hint(128, 7168, 8, 256).unwrap(),
        1_908_410_496
    );
    assert_eq!(
        low_latency_rdma_size_hint(128, 7168, 16, 256).unwrap(),
        1_908_410_496
    );
    assert_eq!(
        low_latency_rdma_size_hint(16, 5120, 8, 256).unwrap(),
        170_395_776
    );
}

#[test]
fn low_latency_layout_regions() {
    let l = LowLatencyLayout::new(128, 7168, 8, 288).unwrap();
    assert_eq!(l.num_scales, 56);
    assert_eq!(l.dispatch_msg_bytes, 16 + 2 * 7168);
    assert_eq!(l.combine_msg_bytes, 4 * 56 + 2 * 7168);
    assert_eq!(l.signaling_bytes, 1152);
    assert_eq!(l.send_bytes, 288 * 128 * l.combine_msg_bytes);
    assert_eq!(l.recv_bytes, 288 * 128 * l.combine_msg_bytes);
    // [signal_0][signal_1][send_0][send_1][recv_0][recv_1]
    let [a, b] = l.halves;
    assert_eq!(a.signal_offset, 0);
    assert_eq!(b.signal_offset, l.signaling_bytes);
    assert_eq!(a.send_offset, 2 * l.signaling_bytes);
    assert_eq!(b.send_offset, a.send_offset + l.send_bytes);
    assert_eq!(a.recv_offset, b.send_offset + l.send_bytes);
    assert_eq!(b.recv_offset, a.recv_offset + l.recv_bytes);
    assert_eq!(b.recv_offset + l.recv_bytes, l.total_bytes);
    for h in l.halves {
        assert_eq!(h.signal_offset % 128, 0);
        assert_eq!(h.send_offset % 16, 0);
        assert_eq!(h.recv_offset % 16, 0);
    }
    // FP8 message (H + 4S) wins over BF16 only when 4S > H: never for H >= 128.
    let small = LowLatencyLayout::new(4, 128, 2, 4).unwrap();
    assert_eq!(small.dispatch_msg_bytes, 16 + 256);
}

#[test]
fn hint_adds_128_even_when_aligned() {
    let l = LowLatencyLayout::new(16, 5120, 8, 256).unwrap();
    assert_eq!(l.total_bytes % 128, 0);
    assert_eq!(l.size_hint().unwrap(), l.total_bytes + 128);
}

#[test]
fn normal_hints_check_ranks_and_sms() {
    let c = Config::new(24, 6, 256, 6, 128).unwrap();
    for r in [0, 9, 12, 20] {
        assert!(matches!(
            c.nvl_buffer_size_hint(H_BF16, r),
            Err(Error::UnsupportedNumRanks { .. })
        ));
        assert!(matches!(
            c.rdma_buffer_size_hint(H_BF16, r),
            Err(Error::UnsupportedNumRanks { .. })
        ));
    }
    let odd = Config::new(23, 6, 256, 6, 128).unwrap();
    assert!(
        odd.nvl_buffer_size_hint(H_BF16, 8).is_ok(),
        "R <= 8 allows odd num_sms, as DeepEP"
    );
    assert_eq!(
        odd.nvl_buffer_size_hint(H_BF16, 16),
        Err(Error::OddNumSms { num_sms: 23 })
    );
    assert_eq!(
        odd.rdma_buffer_size_hint(H_BF16, 16),
        Err(Error::OddNumSms { num_sms: 23 })
    );
}

#[test]
fn hints_are_128_aligned_and_overflow_is_an_error() {
    let c = Config::dispatch_for_num_sms(16, 24).unwrap();
    for hb in [1, 2, 100, 7168 * 2 + 2] {
        for r in [2, 4, 8, 16, 32] {
            assert_eq!(c.nvl_buffer_size_hint(hb, r).unwrap() % 128, 0);
            assert_eq!(c.rdma_buffer_size_hint(hb, r).unwrap() % 128, 0);
        }
    }
    assert!(matches!(
        c.nvl_buffer_size_hint(usize::MAX / 2, 16),
        Err(Error::SizeOverflow { .. })
    ));
    assert!(matches!(
        low_latency_rdma_size_hint(usize::MAX / 4, 7168, 8, 288),
        Err(Error::SizeOverflow { .. })
    ));
}

const VALID_R: [usize; 14] = [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 64, 128, 160];

proptest! {
    #[test]
    fn normal_hints_monotone_in_hidden_bytes(hb in 1usize..100_000, d in 0usize..10_000, ri in 0usize..VALID_R.len()) {
        let r = VALID_R[ri];
        let c = Config::dispatch_for_num_sms(16, 24).unwrap();
        prop_assert!(c.nvl_buffer_size_hint(hb, r).unwrap() <= c.nvl_buffer_size_hint(hb + d, r).unwrap());
        prop_assert!(c.rdma_buffer_size_hint(hb, r).unwrap() <= c.rdma_buffer_size_hint(hb + d, r).unwrap());
    }

    #[test]
    fn normal_hints_monotone_in_ranks(hb in 1usize..100_000, i in 0usize..VALID_R.len(), j in 0usize..VALID_R.len()) {
        let (a, b) = (VALID_R[i.min(j)], VALID_R[i.max(j)]);
        let c = Config::new(24, 8, 288, 8, 128).unwrap();
        prop_assert!(c.nvl_buffer_size_hint(hb, a).unwrap() <= c.nvl_buffer_size_hint(hb, b).unwrap());
        prop_assert!(c.rdma_buffer_size_hint(hb, a).unwrap() <= c.rdma_buffer_size_hint(hb, b).unwrap());
    }

    #[test]
    fn low_latency_hint_monotone(
        n in 1usize..1025, dn in 0usize..64,
        h in 1usize..16_384, dh in 0usize..4096,
        e in 1usize..1024, de in 0usize..256,
        r in 1usize..512, r2 in 1usize..512,
    ) {
        let base = low_latency_rdma_size_hint(n, h, r, e).unwrap();
        prop_assert!(base <= low_latency_rdma_size_hint(n + dn, h, r, e).unwrap());
        prop_assert!(base <= low_latency_rdma_size_hint(n, h + dh, r, e).unwrap());
        prop_assert!(base <= low_latency_rdma_size_hint(n, h, r, e + de).unwrap());
        // R does not enter DeepEP's formula.
        prop_assert_eq!(base, low_latency_rdma_size_hint(n, h, r2, e).unwrap());
        prop_assert_eq!(base % 128, 0);
    }
}
