//! Number formats: BF16 rounding, FP8 e4m3 casts with per-128-channel scales (spec §2.4), and
//! the LogFMT-10 combine payload codec (spec §2.6).

pub mod bf16;
pub mod fp8;
pub mod logfmt;
