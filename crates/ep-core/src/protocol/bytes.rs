//! Little-endian packing of rows and fields into the byte records agents store and load.

use half::bf16;

/// Writes `v` at `off`.
pub(crate) fn put_i32(buf: &mut [u8], off: usize, v: i32) {
    buf[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// Reads an i32 at `off`.
pub(crate) fn get_i32(buf: &[u8], off: usize) -> i32 {
    i32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
}

/// Writes `v` at `off`.
pub(crate) fn put_u32(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

/// Reads a u32 at `off`.
pub(crate) fn get_u32(buf: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]])
}

/// Writes `v` at `off`.
pub(crate) fn put_i64(buf: &mut [u8], off: usize, v: i64) {
    buf[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Reads an i64 at `off`.
pub(crate) fn get_i64(buf: &[u8], off: usize) -> i64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[off..off + 8]);
    i64::from_le_bytes(b)
}

/// Writes `v` (bits) at `off`.
pub(crate) fn put_f32(buf: &mut [u8], off: usize, v: f32) {
    put_u32(buf, off, v.to_bits());
}

/// Reads an f32 (bits) at `off`.
pub(crate) fn get_f32(buf: &[u8], off: usize) -> f32 {
    f32::from_bits(get_u32(buf, off))
}

/// Writes a BF16 row (little-endian bits) at the start of `out`.
pub(crate) fn put_bf16_row(out: &mut [u8], row: &[bf16]) {
    for (o, v) in out.chunks_exact_mut(2).zip(row) {
        o.copy_from_slice(&v.to_bits().to_le_bytes());
    }
}

/// Reads a BF16 row from the start of `inp` into `row`.
pub(crate) fn get_bf16_row(inp: &[u8], row: &mut [bf16]) {
    for (v, i) in row.iter_mut().zip(inp.chunks_exact(2)) {
        *v = bf16::from_bits(u16::from_le_bytes([i[0], i[1]]));
    }
}

/// Writes f32 values (bits) at the start of `out`.
pub(crate) fn put_f32s(out: &mut [u8], vals: &[f32]) {
    for (o, v) in out.chunks_exact_mut(4).zip(vals) {
        o.copy_from_slice(&v.to_bits().to_le_bytes());
    }
}

/// Reads f32 values (bits) from the start of `inp`.
pub(crate) fn get_f32s(inp: &[u8], vals: &mut [f32]) {
    for (v, i) in vals.iter_mut().zip(inp.chunks_exact(4)) {
        *v = f32::from_bits(u32::from_le_bytes([i[0], i[1], i[2], i[3]]));
    }
}

/// `acc[i] += f32(y[i])` for the BF16 row stored (little-endian bits) at the start of `inp`:
/// the same sum as `plan::combine::accumulate` of that row (BF16 → f32 is exact), without an
/// intermediate BF16 copy.
pub(crate) fn accumulate_bf16_row(acc: &mut [f32], inp: &[u8]) {
    for (a, i) in acc.iter_mut().zip(inp.chunks_exact(2)) {
        *a += f32::from_bits(u32::from(u16::from_le_bytes([i[0], i[1]])) << 16);
    }
}
