//! Number formats: BF16 rounding, FP8 e4m3 casts with per-128-channel scales (spec §2.4), and
//! the LogFMT-10 combine payload codec (spec §2.6).

pub mod bf16;
pub mod fp8;
pub mod logfmt;

/// DeepEP's `calc_diff` (spec §6.1): `1 - 2 Σxy / Σ(x² + y²)` over `x + 1`, `y + 1` in f64
/// (0 when the sums are empty).
pub fn calc_diff(x: impl IntoIterator<Item = f64>, y: impl IntoIterator<Item = f64>) -> f64 {
    let (mut xy, mut sq) = (0.0f64, 0.0f64);
    for (a, b) in x.into_iter().zip(y) {
        let (a, b) = (a + 1.0, b + 1.0);
        xy += a * b;
        sq += a * a + b * b;
    }
    if sq == 0.0 { 0.0 } else { 1.0 - 2.0 * xy / sq }
}
