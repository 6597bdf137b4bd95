//! Number formats: BF16 rounding and FP8 e4m3 casts with per-128-channel scales (spec §2.4).

pub mod bf16;
pub mod fp8;
