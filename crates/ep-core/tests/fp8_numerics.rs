//! FP8 e4m3 numerics (spec §2.4, §6.1): encoding, decoding, scales, UE8M0, round-trip bounds.

use ep_core::Tensor2;
use ep_core::numerics::fp8::{
    self, BlockScale, E4M3_MAX, E4M3_MAX_CODE, E4M3_NAN, FP8_BLOCK, block_amax, block_scale,
    cast_row, cast_rows, dequantize, dequantize_row, e4m3_decode, e4m3_encode, e4m3_is_nan,
    fp8_abs_error_bound, pack_ue8m0, per_token_cast_to_fp8, ue8m0_byte, ue8m0_to_f32, unpack_ue8m0,
};
use half::bf16;
use proptest::prelude::*;

/// The finite non-negative e4m3 values from the format's definition, by code (0..=0x7e).
fn reference_values() -> Vec<f64> {
    (0u8..=0x7e)
        .map(|c| {
            let e = i32::from(c >> 3);
            let m = f64::from(c & 7);
            if e == 0 {
                m * 2f64.powi(-9)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            }
        })
        .collect()
}

/// Reference encoder: the nearest finite value by linear scan, ties to the even code.
fn reference_encode(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = f64::from(v.abs());
    let values = reference_values();
    let mut best = 0usize;
    for (c, &x) in values.iter().enumerate() {
        let (db, dc) = ((values[best] - a).abs(), (x - a).abs());
        if dc < db || (dc == db && c % 2 == 0) {
            best = c;
        }
    }
    sign | best as u8
}

#[test]
fn decode_matches_the_definition_for_all_256_codes() {
    let values = reference_values();
    for code in 0..=255u8 {
        let v = e4m3_decode(code);
        if code & 0x7f == 0x7f {
            assert!(v.is_nan(), "code {code:#x} must be NaN");
            assert!(e4m3_is_nan(code));
            continue;
        }
        assert!(!e4m3_is_nan(code));
        let expect = values[usize::from(code & 0x7f)];
        let expect = if code & 0x80 != 0 { -expect } else { expect };
        assert_eq!(f64::from(v), expect, "code {code:#x}");
        assert_eq!(
            v.is_sign_negative(),
            code & 0x80 != 0,
            "sign of code {code:#x}"
        );
    }
    assert_eq!(e4m3_decode(E4M3_MAX_CODE), E4M3_MAX);
    assert_eq!(e4m3_decode(0x01), 2f32.powi(-9), "smallest subnormal");
    assert_eq!(e4m3_decode(0x08), 2f32.powi(-6), "smallest normal");
}

#[test]
fn every_code_round_trips_exactly() {
    for code in 0..=255u8 {
        if e4m3_is_nan(code) {
            assert_eq!(e4m3_encode(e4m3_decode(code)), E4M3_NAN);
        } else {
            assert_eq!(e4m3_encode(e4m3_decode(code)), code, "code {code:#x}");
        }
    }
}

#[test]
fn saturation_and_nan_policy() {
    for v in [
        448.0f32,
        448.001,
        463.99,
        464.0,
        480.0,
        1e6,
        f32::MAX,
        f32::INFINITY,
    ] {
        assert_eq!(e4m3_encode(v), 0x7e, "{v}");
        assert_eq!(e4m3_encode(-v), 0xfe, "{}", -v);
    }
    assert_eq!(e4m3_encode(f32::NAN), E4M3_NAN);
    assert_eq!(e4m3_encode(-f32::NAN), E4M3_NAN);
    assert_eq!(e4m3_encode(0.0), 0x00);
    assert_eq!(e4m3_encode(-0.0), 0x80);
    // Below half the smallest subnormal: rounds to a zero of the same sign; exactly half: tie to
    // even (zero); above half: the smallest subnormal.
    assert_eq!(e4m3_encode(2f32.powi(-11)), 0x00);
    assert_eq!(e4m3_encode(-2f32.powi(-11)), 0x80);
    assert_eq!(e4m3_encode(2f32.powi(-10)), 0x00);
    assert_eq!(e4m3_encode(2f32.powi(-10) * 1.0001), 0x01);
}

#[test]
fn ties_round_to_even_code() {
    let values = reference_values();
    for c in 0..0x7e_usize {
        let mid = ((values[c] + values[c + 1]) / 2.0) as f32;
        // Midpoints of adjacent e4m3 values are exact in f32.
        assert_eq!(f64::from(mid), (values[c] + values[c + 1]) / 2.0);
        let even = if c % 2 == 0 { c } else { c + 1 } as u8;
        assert_eq!(
            e4m3_encode(mid),
            even,
            "tie between codes {c:#x} and {:#x}",
            c + 1
        );
        assert_eq!(e4m3_encode(-mid), 0x80 | even);
        // One f32 ulp either side of the tie decides it.
        let below = f32::from_bits(mid.to_bits() - 1);
        let above = f32::from_bits(mid.to_bits() + 1);
        assert_eq!(e4m3_encode(below), c as u8);
        assert_eq!(e4m3_encode(above), c as u8 + 1);
    }
}

#[test]
fn encode_matches_reference_on_all_bf16_values_and_scaled_copies() {
    for bits in 0..=u16::MAX {
        let v = bf16::from_bits(bits).to_f32();
        assert_eq!(
            e4m3_encode(v),
            reference_encode(v),
            "bf16 bits {bits:#x} = {v}"
        );
        // Products with a non-power-of-two scale land between bf16 values.
        let w = v * 1.37;
        assert_eq!(e4m3_encode(w), reference_encode(w), "{w}");
    }
}

proptest! {
    #[test]
    fn encode_matches_reference_on_random_f32(bits in any::<u32>()) {
        let v = f32::from_bits(bits);
        prop_assert_eq!(e4m3_encode(v), reference_encode(v));
    }

    #[test]
    fn encode_matches_reference_in_range(v in -500.0f32..500.0) {
        prop_assert_eq!(e4m3_encode(v), reference_encode(v));
    }
}

#[test]
fn rounded_scales_are_powers_of_two_covering_amax() {
    let mut amax = 1e-4f32;
    while amax < 1e30 {
        let BlockScale { scale, scale_inv } = block_scale(amax, true);
        for s in [scale, scale_inv] {
            assert_eq!(s.to_bits() & 0x7f_ffff, 0, "{s} is not a power of two");
        }
        assert_eq!(scale * scale_inv, 1.0);
        // scale_inv = 2^ceil(log2(amax * f32(1/448))): the smallest power of two not below it.
        let ratio = amax * fp8::E4M3_MAX_INV;
        assert!(scale_inv >= ratio && scale_inv / 2.0 < ratio, "amax {amax}");
        // So the largest scaled value stays within the e4m3 range.
        assert!(amax * scale <= E4M3_MAX);
        assert_eq!(ue8m0_to_f32(ue8m0_byte(scale_inv)), scale_inv);
        assert_eq!(
            i32::from(ue8m0_byte(scale_inv)) - 127,
            scale_inv.log2() as i32
        );
        amax *= 1.0173;
    }
}

#[test]
fn unrounded_scales_follow_the_kernel_formula() {
    let mut amax = 1e-4f32;
    let mut differs_from_division = 0usize;
    let mut samples = 0usize;
    while amax < 1e6 {
        let s = block_scale(amax, false);
        assert_eq!(s.scale, 448.0 / amax);
        assert_eq!(s.scale_inv, amax * (1.0f32 / 448.0));
        // The spec writes amax / 448; the kernel's product differs from it in the last bit for
        // some amax (this is why the plan follows the kernel, and documents it).
        let div = amax / 448.0;
        assert!((s.scale_inv.to_bits() as i64 - div.to_bits() as i64).abs() <= 1);
        differs_from_division += usize::from(s.scale_inv != div);
        samples += 1;
        amax *= 1.0091;
    }
    assert!(differs_from_division > 0 && differs_from_division < samples);
}

#[test]
fn amax_floor_and_nan_are_handled_like_fmaxf() {
    let zeros = vec![bf16::ZERO; FP8_BLOCK];
    assert_eq!(block_amax(&zeros), 1e-4);
    let mut with_nan = zeros.clone();
    with_nan[3] = bf16::NAN;
    with_nan[9] = bf16::from_f32(-2.5);
    assert_eq!(block_amax(&with_nan), 2.5);
    // An all-zero block casts to zeros with scale_inv = 1e-4 * f32(1/448).
    let mut q = vec![0xAAu8; FP8_BLOCK];
    let mut s = vec![0f32; 1];
    cast_row(&zeros, false, &mut q, &mut s).unwrap();
    assert!(q.iter().all(|&b| b == 0));
    assert_eq!(s[0], 1e-4f32 * (1.0f32 / 448.0));
}

#[test]
fn amax_element_maps_to_448() {
    // The block maximum scales to (nearly) 448, which e4m3 represents exactly: it round-trips
    // to amax within f32 rounding.
    for amax in [0.003f32, 1.0, 3.75, 1000.0, 65504.0] {
        let mut row = vec![bf16::from_f32(amax / 3.0); FP8_BLOCK];
        row[17] = bf16::from_f32(-amax);
        let a = row[17].to_f32().abs();
        for round in [false, true] {
            let mut q = vec![0u8; FP8_BLOCK];
            let mut s = vec![0f32; 1];
            cast_row(&row, round, &mut q, &mut s).unwrap();
            if !round {
                assert_eq!(q[17], 0xfe, "amax {amax}");
            }
            let back = dequantize_row(&q, &s).unwrap();
            assert!(
                (back[17] + a).abs() <= fp8_abs_error_bound(a, a),
                "amax {amax}"
            );
        }
    }
}

fn random_rows(seed: u64, rows: usize, cols: usize) -> Tensor2<bf16> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let block_exp: Vec<i32> = (0..rows * cols.div_ceil(128))
        .map(|_| rng.random_range(-20..20))
        .collect();
    Tensor2::from_fn(rows, cols, |r, c| {
        let e = block_exp[r * cols.div_ceil(128) + c / 128];
        let v: f32 = rng.random_range(-1.0..1.0);
        // A few exact zeros and outliers in every block.
        let v = match rng.random_range(0..50) {
            0 => 0.0,
            1 => v * 64.0,
            _ => v,
        };
        bf16::from_f32(v * 2f32.powi(e))
    })
}

proptest! {
    #[test]
    fn round_trip_error_is_within_the_e4m3_bound(
        seed in any::<u64>(),
        rows in 1usize..4,
        blocks in 1usize..5,
        round in any::<bool>(),
    ) {
        let x = random_rows(seed, rows, blocks * 128);
        let (q, s) = cast_rows(&x, round).unwrap();
        let back = dequantize(&q, &s).unwrap();
        for r in 0..rows {
            for b in 0..blocks {
                let block = &x.row(r)[b * 128..(b + 1) * 128];
                let amax = block_amax(block);
                if round {
                    prop_assert_eq!(s.get(r, b).to_bits() & 0x7f_ffff, 0);
                }
                for (c, v) in block.iter().enumerate() {
                    let (v, d) = (v.to_f32(), back.get(r, b * 128 + c));
                    let err = (d - v).abs();
                    prop_assert!(
                        err <= fp8_abs_error_bound(v, amax),
                        "x {} -> {} (err {}, bound {}), amax {}", v, d, err,
                        fp8_abs_error_bound(v, amax), amax
                    );
                    // The coarser, amax-relative form: every element within 2^-4 of amax.
                    prop_assert!(err <= amax * 2f32.powi(-4));
                }
            }
        }
    }

    #[test]
    fn test_helper_bytes_equal_kernel_bytes(seed in any::<u64>(), rows in 1usize..4, blocks in 1usize..4) {
        let x = random_rows(seed, rows, blocks * 128);
        let (q_kernel, s_kernel) = cast_rows(&x, false).unwrap();
        let (q_helper, s_helper) = per_token_cast_to_fp8(&x);
        prop_assert_eq!(q_kernel.data(), q_helper.data());
        for (a, b) in s_kernel.data().iter().zip(s_helper.data()) {
            // Same value up to the last bit (product by f32(1/448) versus division by 448).
            prop_assert!((a.to_bits() as i64 - b.to_bits() as i64).abs() <= 1);
        }
    }

    #[test]
    fn ue8m0_pack_unpack(exps in proptest::collection::vec(-126i32..=127, 0..20)) {
        let scales: Vec<f32> = exps.iter().map(|&e| 2f32.powi(e)).collect();
        let packed = pack_ue8m0(&scales);
        prop_assert_eq!(packed.len(), scales.len().div_ceil(4));
        for (i, &s) in scales.iter().enumerate() {
            let word = packed[i / 4] as u32;
            prop_assert_eq!((word >> (8 * (i % 4))) & 0xff, u32::from(ue8m0_byte(s)));
            prop_assert_eq!(i64::from(ue8m0_byte(s)) - 127, i64::from(exps[i]));
        }
        prop_assert_eq!(unpack_ue8m0(&packed, scales.len()).unwrap(), scales);
    }
}

#[test]
fn helper_handles_a_partial_last_block() {
    let x = random_rows(7, 3, 200);
    let (q, s) = per_token_cast_to_fp8(&x);
    assert_eq!(q.shape(), (3, 200));
    assert_eq!(s.shape(), (3, 2));
    for r in 0..3 {
        let amax = block_amax(&x.row(r)[128..]);
        assert_eq!(s.get(r, 1), amax / 448.0);
    }
}

#[test]
fn shape_errors_are_typed() {
    let x = vec![bf16::ONE; 100];
    let mut q = vec![0u8; 100];
    let mut s = vec![0f32; 1];
    assert!(matches!(
        cast_row(&x, false, &mut q, &mut s),
        Err(ep_core::Error::HiddenMisaligned { .. })
    ));
    let x = vec![bf16::ONE; 256];
    assert!(matches!(
        cast_row(&x, false, &mut q, &mut s),
        Err(ep_core::Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        dequantize_row(&[0u8; 256], &[1.0]),
        Err(ep_core::Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        unpack_ue8m0(&[0], 5),
        Err(ep_core::Error::ShapeMismatch { .. })
    ));
}

/// The table-driven BF16 dequantiser gives the bits of `bf16::from_f32(dequantize_row(..))` for
/// every code under many scales, and refuses mismatched shapes.
#[test]
fn dequantize_row_bf16_matches_the_f32_path() {
    use ep_core::numerics::fp8::{dequantize_row, dequantize_row_bf16};
    let q: Vec<u8> = (0..=255u8).chain(0..=255u8).chain(0..100).collect();
    for scales in [
        vec![1.0f32, 0.5, 3.0e-3, 7.25, 1.0e30],
        vec![-2.0, 1.0e-40, 0.0, f32::INFINITY, 448.0],
    ] {
        let mut out = vec![half::bf16::ZERO; q.len()];
        dequantize_row_bf16(&q, &scales, &mut out).unwrap();
        let want = dequantize_row(&q, &scales).unwrap();
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert_eq!(
                a.to_bits(),
                half::bf16::from_f32(*b).to_bits(),
                "element {i}"
            );
        }
    }
    let mut short = vec![half::bf16::ZERO; 10];
    assert!(dequantize_row_bf16(&q, &[1.0; 5], &mut short).is_err());
    assert!(dequantize_row_bf16(&q, &[1.0; 4], &mut vec![half::bf16::ZERO; q.len()]).is_err());
}
