//! The CUDA header `include/ep_logfmt.cuh` (compiled for the host by build.rs's shim) is the
//! LogFMT-10 rule of `ep_core::numerics::logfmt`, bit for bit: every function of the header
//! against its Rust counterpart on random inputs, through FFI, no GPU.

use ep_core::numerics::logfmt::{self as lf, DivisionMeta, Layout, Params};
use half::bf16;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

// The shim lives in ep-kernels' static library; naming the crate links it.
use ep_kernels as _;

mod ffi {
    // The shim's functions are arithmetic on their arguments; pointers are read or written for
    // the lengths stated in ep_logfmt.cuh (16 values, 5 words, 4 params, a row, a slot).
    unsafe extern "C" {
        pub(super) fn ep_shim_logfmt_log2(x: f32) -> f32;
        pub(super) fn ep_shim_logfmt_exp2(t: f32) -> f32;
        pub(super) fn ep_shim_logfmt_division_meta(x: *const u16, n: u32) -> u32;
        pub(super) fn ep_shim_logfmt_params(meta: u32, p: *mut f32) -> i32;
        pub(super) fn ep_shim_logfmt_code(x: u16, p: *const f32) -> u32;
        pub(super) fn ep_shim_logfmt_magnitude(c: u32, p: *const f32) -> f32;
        pub(super) fn ep_shim_logfmt_pack16(codes: *const u32, signs: u32, w: *mut u32);
        pub(super) fn ep_shim_logfmt_unpack_code(w: *const u32, i: u32) -> u32;
        pub(super) fn ep_shim_logfmt_encode16(x: *const u16, p: *const f32, w: *mut u32);
        pub(super) fn ep_shim_logfmt_decode16(w: *const u32, p: *const f32, out: *mut f32);
        pub(super) fn ep_shim_logfmt_data_offset(h: u64) -> u64;
        pub(super) fn ep_shim_logfmt_num_chunks(h: u64) -> u64;
        pub(super) fn ep_shim_logfmt_chunk_place(k: u64) -> u64;
        pub(super) fn ep_shim_logfmt_chunk_channels(h: u64, k: u64) -> u64;
        pub(super) fn ep_shim_logfmt_chunk_bytes(ch: u64, cast: i32) -> u64;
        pub(super) fn ep_shim_logfmt_max_bytes(h: u64) -> u64;
        pub(super) fn ep_shim_logfmt_deepep_bytes(h: u64) -> u64;
        pub(super) fn ep_shim_logfmt_chunk_cast(meta: *const u32, h: u64, k: u64) -> i32;
        pub(super) fn ep_shim_logfmt_chunk_offset(meta: *const u32, h: u64, k: u64) -> u64;
        pub(super) fn ep_shim_logfmt_message_bytes(meta: *const u32, h: u64) -> u64;
        pub(super) fn ep_shim_logfmt_encode_row(x: *const u16, h: u64, out: *mut u8) -> u64;
        pub(super) fn ep_shim_logfmt_decode_row(m: *const u8, h: u64, out: *mut f32);
    }
}

// ---- safe wrappers: each checks the lengths the header reads or writes ------------------------

fn c_log2(x: f32) -> f32 {
    // SAFETY: pure arithmetic.
    unsafe { ffi::ep_shim_logfmt_log2(x) }
}

fn c_exp2(t: f32) -> f32 {
    // SAFETY: pure arithmetic.
    unsafe { ffi::ep_shim_logfmt_exp2(t) }
}

fn c_division_meta(x: &[bf16]) -> u32 {
    // SAFETY: reads x.len() values of 16 bits (bf16 is a u16 in memory).
    unsafe { ffi::ep_shim_logfmt_division_meta(x.as_ptr().cast(), x.len() as u32) }
}

fn p4(p: &Params) -> [f32; 4] {
    [p.log_amin, p.step, p.inv_step, p.bias]
}

fn c_params(meta: u32) -> (bool, [f32; 4]) {
    let mut p = [f32::NAN; 4];
    // SAFETY: writes 4 floats into p.
    let cast = unsafe { ffi::ep_shim_logfmt_params(meta, p.as_mut_ptr()) };
    (cast != 0, p)
}

fn c_code(x: bf16, p: &[f32; 4]) -> u32 {
    // SAFETY: reads 4 floats.
    unsafe { ffi::ep_shim_logfmt_code(x.to_bits(), p.as_ptr()) }
}

fn c_magnitude(c: u32, p: &[f32; 4]) -> f32 {
    // SAFETY: reads 4 floats.
    unsafe { ffi::ep_shim_logfmt_magnitude(c, p.as_ptr()) }
}

fn c_pack16(codes: &[u32; 16], signs: u32) -> [u32; 5] {
    let mut w = [0u32; 5];
    // SAFETY: reads 16 codes, writes 5 words.
    unsafe { ffi::ep_shim_logfmt_pack16(codes.as_ptr(), signs, w.as_mut_ptr()) };
    w
}

fn c_unpack_code(w: &[u32; 5], i: u32) -> u32 {
    // SAFETY: reads 5 words; i < 16 (checked by the callers' ranges).
    unsafe { ffi::ep_shim_logfmt_unpack_code(w.as_ptr(), i) }
}

fn c_encode16(x: &[bf16; 16], p: &[f32; 4]) -> [u32; 5] {
    let mut w = [0u32; 5];
    // SAFETY: reads 16 values and 4 floats, writes 5 words.
    unsafe { ffi::ep_shim_logfmt_encode16(x.as_ptr().cast(), p.as_ptr(), w.as_mut_ptr()) };
    w
}

fn c_decode16(w: &[u32; 5], p: &[f32; 4]) -> [f32; 16] {
    let mut out = [f32::NAN; 16];
    // SAFETY: reads 5 words and 4 floats, writes 16 floats.
    unsafe { ffi::ep_shim_logfmt_decode16(w.as_ptr(), p.as_ptr(), out.as_mut_ptr()) };
    out
}

fn c_encode_row(x: &[bf16]) -> Vec<u8> {
    let h = x.len() as u64;
    // SAFETY: pure arithmetic.
    let slot = unsafe { ffi::ep_shim_logfmt_max_bytes(h) } as usize;
    let mut out = vec![0x5au8; slot];
    // SAFETY: reads h values (h % 128 == 0 by the callers), writes at most max_bytes(h) bytes.
    let n = unsafe { ffi::ep_shim_logfmt_encode_row(x.as_ptr().cast(), h, out.as_mut_ptr()) };
    assert!(n as usize <= slot);
    out.truncate(n as usize);
    out
}

fn c_decode_row(msg: &[u8], h: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; h];
    let meta: Vec<u32> = msg[..4 * (h / 128)]
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    // SAFETY: reads h/128 meta words.
    let size = unsafe { ffi::ep_shim_logfmt_message_bytes(meta.as_ptr(), h as u64) };
    assert!(
        msg.len() >= size as usize,
        "message shorter than its meta says"
    );
    // SAFETY: reads the message (size bytes, checked above), writes h floats.
    unsafe { ffi::ep_shim_logfmt_decode_row(msg.as_ptr(), h as u64, out.as_mut_ptr()) };
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

// ---- inputs -----------------------------------------------------------------------------------

/// A random division: mostly castable magnitudes over 1e-2 to 45 octaves (BF16 subnormals now
/// and then), zeros, both signs; sometimes a value >= 1, an infinity, a NaN, all zeros or one
/// repeated magnitude (the raw cases).
fn division(rng: &mut ChaCha8Rng) -> Vec<bf16> {
    let top: f32 = if rng.random_range(0..8) == 0 {
        rng.random_range(-140.0..-100.0)
    } else {
        rng.random_range(-20.0..-0.01)
    };
    let spread = [0.01f32, 0.5, 4.0, 20.0, 45.0][rng.random_range(0..5)];
    let mut d: Vec<bf16> = (0..128)
        .map(|_| {
            let v = if rng.random_range(0..16) == 0 {
                0.0
            } else {
                (top - spread * rng.random::<f32>()).exp2().min(0.99)
            };
            bf16::from_f32(if rng.random() { -v } else { v })
        })
        .collect();
    match rng.random_range(0..24) {
        0 => d[rng.random_range(0..128)] = bf16::from_f32(rng.random_range(1.0f32..300.0)),
        1 => d[rng.random_range(0..128)] = bf16::INFINITY,
        2 => d[rng.random_range(0..128)] = bf16::NAN,
        3 => d.fill(bf16::ZERO),
        4 => {
            let v = bf16::from_f32(rng.random_range(0.001f32..0.99));
            d.fill(v);
        }
        _ => {}
    }
    d
}

fn row(rng: &mut ChaCha8Rng, h: usize) -> Vec<bf16> {
    (0..h / 128).flat_map(|_| division(rng)).collect()
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
        .max(256)
}

/// log2 over every non-negative finite BF16 value and exp2 over the decoder's range, exhaustively
/// on a fine grid: the same bits.
#[test]
fn log2_and_exp2_everywhere_the_codec_uses_them() {
    for b in 0..0x7f80u16 {
        let x = bf16::from_bits(b).to_f32();
        assert_eq!(c_log2(x).to_bits(), lf::log2(x).to_bits(), "log2({x:e})");
    }
    for i in 0..400_000 {
        let t = -260.0 + i as f32 * (400.0 / 400_000.0);
        assert_eq!(c_exp2(t).to_bits(), lf::exp2(t).to_bits(), "exp2({t})");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// log2 / exp2 on arbitrary f32 inputs (positive finite for log2; anything but NaN for exp2,
    /// whose clamp the header does with fmaxf/fminf).
    #[test]
    fn log2_exp2_bits(x in 0u32..0x7f80_0000, t in any::<f32>()) {
        let x = f32::from_bits(x);
        prop_assert_eq!(c_log2(x).to_bits(), lf::log2(x).to_bits());
        let t = if t.is_nan() { 0.0 } else { t };
        prop_assert_eq!(c_exp2(t).to_bits(), lf::exp2(t).to_bits());
    }

    /// Per division: meta word, grid (castable or not), every code and magnitude, and the
    /// 16-value encode/decode, bit for bit.
    #[test]
    fn division_rules(seed in any::<u64>()) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let d = division(&mut rng);
        let meta = DivisionMeta::of(&d).to_word();
        prop_assert_eq!(c_division_meta(&d), meta);
        let (cast, cp) = c_params(meta);
        let rp = DivisionMeta::from_word(meta).params();
        prop_assert_eq!(cast, rp.is_some());
        let Some(rp) = rp else {
            prop_assert_eq!(cp, [0.0; 4]);
            return Ok(());
        };
        prop_assert_eq!(bits(&cp), bits(&p4(&rp)));
        for (i, &v) in d.iter().enumerate() {
            prop_assert_eq!(c_code(v, &cp), rp.code(v), "value {} = {}", i, v);
        }
        for c in 0..=lf::MAX_CODE {
            prop_assert_eq!(c_magnitude(c, &cp).to_bits(), rp.magnitude(c).to_bits(), "code {}", c);
        }
        for g in d.chunks_exact(16) {
            let g: [bf16; 16] = std::array::from_fn(|i| g[i]);
            let w = rp.encode_group(&g);
            prop_assert_eq!(c_encode16(&g, &cp), w);
            prop_assert_eq!(bits(&c_decode16(&w, &cp)), bits(&rp.decode_group(&w)));
        }
    }

    /// Packing of arbitrary codes and signs (high code bits ignored), and unpacking.
    #[test]
    fn packing(codes in prop::array::uniform16(any::<u16>()), signs in any::<u16>()) {
        let c32: [u32; 16] = std::array::from_fn(|i| u32::from(codes[i]));
        let w = lf::pack_group(&codes, signs);
        prop_assert_eq!(c_pack16(&c32, u32::from(signs)), w);
        let (rc, rs) = lf::unpack_group(&w);
        prop_assert_eq!(rs, signs);
        for i in 0..16 {
            prop_assert_eq!(c_unpack_code(&w, i as u32), u32::from(rc[i]));
            prop_assert_eq!(rc[i], codes[i] & 0x1ff);
        }
    }

    /// A whole row: the message offsets from the meta, the bytes of the message (header's
    /// encoder = Rust's), and the decoded values (each decoder on the other's message).
    #[test]
    fn rows(seed in any::<u64>(), h128 in 1usize..=64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let h = 128 * h128;
        let x = row(&mut rng, h);
        let layout = Layout::new(h).unwrap();
        let meta = lf::row_meta(&x);
        let hu = h as u64;
        // SAFETY: every call here is arithmetic or reads the h/128 meta words of `meta`.
        unsafe {
            prop_assert_eq!(ffi::ep_shim_logfmt_data_offset(hu), layout.data_offset() as u64);
            prop_assert_eq!(ffi::ep_shim_logfmt_num_chunks(hu), layout.num_chunks() as u64);
            prop_assert_eq!(ffi::ep_shim_logfmt_max_bytes(hu), layout.max_bytes() as u64);
            prop_assert_eq!(ffi::ep_shim_logfmt_deepep_bytes(hu), layout.deepep_counted_bytes() as u64);
            for k in 0..=layout.num_chunks() {
                let ku = k as u64;
                prop_assert_eq!(ffi::ep_shim_logfmt_chunk_offset(meta.as_ptr(), hu, ku), layout.chunk_offset(&meta, k) as u64);
                prop_assert_eq!(
                    ffi::ep_shim_logfmt_chunk_place(ku),
                    ep_core::protocol::layout::ll_logfmt_chunk_place(k)
                );
                if k < layout.num_chunks() {
                    let ch = layout.chunk_channels(k);
                    prop_assert_eq!(ffi::ep_shim_logfmt_chunk_channels(hu, ku), ch.len() as u64);
                    let cast = layout.chunk_cast(&meta, k);
                    prop_assert_eq!(ffi::ep_shim_logfmt_chunk_cast(meta.as_ptr(), hu, ku) != 0, cast);
                    prop_assert_eq!(ffi::ep_shim_logfmt_chunk_bytes(ch.len() as u64, i32::from(cast)), Layout::chunk_bytes(ch.len(), cast) as u64);
                }
            }
            prop_assert_eq!(ffi::ep_shim_logfmt_message_bytes(meta.as_ptr(), hu), layout.message_bytes(&meta) as u64);
        }
        let msg = lf::encode_row(&x).unwrap();
        prop_assert_eq!(&c_encode_row(&x), &msg);
        let want = bits(&lf::decode_row(&msg, h).unwrap());
        prop_assert_eq!(bits(&c_decode_row(&msg, h)), want);
    }
}
