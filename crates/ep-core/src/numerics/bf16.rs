//! BF16 rounding written on the bits, without branches, so loops over rows vectorise.

use half::bf16;

/// `bf16::from_f32(x)`, bit for bit (round to nearest, ties to even; overflow to infinity; a
/// NaN keeps its sign and top payload bits and becomes quiet), as a branch-free select.
#[inline]
#[must_use]
pub fn round(x: f32) -> bf16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((b >> 16) | 0x40) as u16;
    let is_nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    bf16::from_bits(if is_nan { quiet_nan } else { rounded })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f32 whose low 16 bits take a set of boundary values, across every high half
    /// (NaNs, infinities, subnormals and ties included), rounds as the library does.
    #[test]
    fn round_matches_the_library_everywhere() {
        for hi in 0..=u16::MAX as u32 {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234] {
                let x = f32::from_bits((hi << 16) | lo);
                assert_eq!(
                    round(x).to_bits(),
                    bf16::from_f32(x).to_bits(),
                    "{:#010x}",
                    x.to_bits()
                );
            }
        }
    }
}
