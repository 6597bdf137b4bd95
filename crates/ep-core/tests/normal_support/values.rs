//! Test values shared by ep-core's normal-mode tests and the workspace's protocol tests (the
//! latter include this file by path): one generator, so the two cannot drift apart.

use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// A random BF16 spread over the range a combine's f32 sum sees, so that the order of its terms
/// shows in the result: mostly values of magnitude in `[2^-4, 2^3)`, and 1/16 each zeros
/// (either sign), tiny values (`[2^-40, 2^-20)`), and huge powers of two (`±2^24 ..= ±2^27`,
/// which cancel in pairs and swallow the small terms added before them). One draw per value.
pub(crate) fn rand_bf16(rng: &mut ChaCha8Rng) -> bf16 {
    let bits: u32 = rng.random();
    let sign = ((bits >> 31) as u16) << 15;
    let mantissa = (bits & 0x7f) as u16;
    let pick = (bits >> 7) % 7;
    let (exp, mantissa) = match (bits >> 10) & 0xf {
        0 => (0, 0),
        1 => (127 - 40 + (bits >> 14) % 20, mantissa),
        2 => (127 + 24 + (bits >> 14) % 4, 0),
        _ => (127 - 4 + pick, mantissa),
    };
    bf16::from_bits(sign | ((exp as u16) << 7) | mantissa)
}
