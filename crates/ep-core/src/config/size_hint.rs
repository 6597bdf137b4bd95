//! Buffer size hints with DeepEP's exact formulas: normal mode (spec §1.5) and the low-latency
//! RDMA buffer layout (spec §1.9).
//!
//! The hints size DeepEP's ring buffers; they are what a DeepEP user passes as `num_nvl_bytes` /
//! `num_rdma_bytes`, and ep-rs accepts the same numbers. All arithmetic is checked: absurd
//! arguments give [`Error::SizeOverflow`] instead of wrapping.

use crate::config::{
    Config, NUM_MAX_NVL_PEERS, SOURCE_META_BYTES, TOPK_IDX_BYTES, num_nvl_ranks, num_rdma_ranks,
};
use crate::error::{Error, Result};

/// Top-k entries and scales per token the normal-mode hints assume (spec §1.5).
const HINT_MAX_TOPK: usize = 128;
const HINT_MAX_SCALES: usize = 128;

/// Checked product/sum helpers: `None` on overflow becomes a named [`Error::SizeOverflow`].
fn mul(what: &'static str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or(Error::SizeOverflow { what })
}

fn add(what: &'static str, terms: &[usize]) -> Result<usize> {
    terms
        .iter()
        .try_fold(0usize, |acc, &t| acc.checked_add(t))
        .ok_or(Error::SizeOverflow { what })
}

fn align_up(what: &'static str, n: usize, a: usize) -> Result<usize> {
    n.checked_next_multiple_of(a)
        .ok_or(Error::SizeOverflow { what })
}

/// `hidden_bytes` as the README computes it for the hints: `H * max(elem_size, 2)` (spec §1.5),
/// so FP8 activations are sized like BF16 ones.
pub fn hidden_bytes_for_hint(hidden: usize, elem_size: usize) -> Result<usize> {
    mul("hidden_bytes", &[hidden, elem_size.max(2)])
}

fn check_rank_rule(num_ranks: usize) -> Result<()> {
    if num_ranks == 0 {
        return Err(Error::UnsupportedNumRanks {
            num_ranks,
            rule: "an EP group has at least 1 rank",
        });
    }
    if num_ranks >= NUM_MAX_NVL_PEERS && !num_ranks.is_multiple_of(NUM_MAX_NVL_PEERS) {
        return Err(Error::UnsupportedNumRanks {
            num_ranks,
            rule: "use fewer than 8 ranks or a multiple of 8 (whole 8-GPU NVLink domains)",
        });
    }
    Ok(())
}

impl Config {
    /// `Config.get_nvl_buffer_size_hint(hidden_bytes, R)` (spec §1.5), rounded up to 128:
    /// `C*NVLr*(2*RR+3)*4 + C*NVLr*nvl_recv*(hidden_bytes + 8 + 128*8 + 128*4 + 128*4)` with
    /// `NVLr = min(R, 8)`, `RR = max(R/8, 1)`; the `8` is `SourceMeta` (NVSHMEM builds), `128*8`
    /// top-k ids of `topk_idx_t = int64`, then 128 top-k weights and 128 scales (f32).
    ///
    /// Errors: `R >= 8` and not a multiple of 8; `R > 8` with an odd `num_sms` (as DeepEP).
    pub fn nvl_buffer_size_hint(&self, hidden_bytes: usize, num_ranks: usize) -> Result<usize> {
        const WHAT: &str = "NVL buffer size hint";
        check_rank_rule(num_ranks)?;
        if num_ranks > NUM_MAX_NVL_PEERS {
            self.check_even_num_sms()?;
        }
        let c = self.num_channels();
        let nvl = num_nvl_ranks(num_ranks);
        let rr = num_rdma_ranks(num_ranks);
        let per_token = add(
            WHAT,
            &[
                hidden_bytes,
                SOURCE_META_BYTES,
                HINT_MAX_TOPK * TOPK_IDX_BYTES,
                HINT_MAX_TOPK * 4,
                HINT_MAX_SCALES * 4,
            ],
        )?;
        let prefix = mul(WHAT, &[c, nvl, 2 * rr + 3, 4])?;
        let data = mul(
            WHAT,
            &[c, nvl, self.num_max_nvl_chunked_recv_tokens(), per_token],
        )?;
        align_up(WHAT, add(WHAT, &[prefix, data])?, 128)
    }

    /// `Config.get_rdma_buffer_size_hint(hidden_bytes, R)` (spec §1.5), rounded up to 128: `0`
    /// for `R <= 8`, else `C*RR*(8*2+2)*2*4 + 2*C*RR*rdma_recv*(hidden_bytes + 8 + 128*8 + 128*4
    /// + 128*4 + 16)`, with `rdma_recv` as stored (rounded to a multiple of `rdma_send`).
    pub fn rdma_buffer_size_hint(&self, hidden_bytes: usize, num_ranks: usize) -> Result<usize> {
        const WHAT: &str = "RDMA buffer size hint";
        check_rank_rule(num_ranks)?;
        if num_ranks <= NUM_MAX_NVL_PEERS {
            return Ok(0);
        }
        self.check_even_num_sms()?;
        let c = self.num_channels();
        let rr = num_rdma_ranks(num_ranks);
        let per_token = add(
            WHAT,
            &[
                hidden_bytes,
                SOURCE_META_BYTES,
                HINT_MAX_TOPK * TOPK_IDX_BYTES,
                HINT_MAX_TOPK * 4,
                HINT_MAX_SCALES * 4,
                16,
            ],
        )?;
        let meta = mul(WHAT, &[c, rr, NUM_MAX_NVL_PEERS * 2 + 2, 2, 4])?;
        let data = mul(
            WHAT,
            &[2, c, rr, self.num_max_rdma_chunked_recv_tokens(), per_token],
        )?;
        align_up(WHAT, add(WHAT, &[meta, data])?, 128)
    }
}

/// One of the two symmetric halves ("odd/even" buffers) of the low-latency RDMA buffer
/// (spec §1.9). Offsets are bytes from the start of the RDMA buffer.
///
/// In each half the dispatch receive-count ints and the combine receive-flag ints **alias** the
/// same `E` ints at `signal_offset`; dispatch and combine also share the send and receive regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowLatencyHalf {
    /// Start of the `E` signal ints (dispatch counts / combine flags); the region is
    /// `LowLatencyLayout::signaling_bytes` long and zeroed as a whole by the clean.
    pub signal_offset: usize,
    /// Start of the send region (`LowLatencyLayout::send_bytes` long).
    pub send_offset: usize,
    /// Start of the receive region (`LowLatencyLayout::recv_bytes` long).
    pub recv_offset: usize,
}

/// DeepEP's `LowLatencyLayout(N, H, R, E)` (spec §1.9): message sizes, region sizes, and the two
/// halves in memory order `[signal_0][signal_1][send_0][send_1][recv_0][recv_1]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowLatencyLayout {
    /// `S = H / 128` scales per token.
    pub num_scales: usize,
    /// Dispatch message: `16 + max(2H, H + 4S)` (int4 header, then BF16 row or FP8 row + scales).
    pub dispatch_msg_bytes: usize,
    /// Combine message: `4S + 2H` (per-128-channel LogFMT meta, then the BF16 row).
    pub combine_msg_bytes: usize,
    /// Each half's signal region: `align128(E * 4)`.
    pub signaling_bytes: usize,
    /// Each half's send region: `max(N * dispatch_msg, E * N * combine_msg)`.
    pub send_bytes: usize,
    /// Each half's receive region: `max(E * N * dispatch_msg, E * N * combine_msg)`.
    pub recv_bytes: usize,
    /// `2 * (signaling + send + recv)`.
    pub total_bytes: usize,
    /// The two halves; LL op `k` uses `halves[k % 2]`.
    pub halves: [LowLatencyHalf; 2],
}

impl LowLatencyLayout {
    /// The layout for `N = num_max_dispatch_tokens_per_rank`, `H = hidden`, `R`, `E` (spec §1.9).
    /// `R` does not enter DeepEP's formula; it is taken for parity with DeepEP's signature.
    pub fn new(
        num_max_dispatch_tokens_per_rank: usize,
        hidden: usize,
        num_ranks: usize,
        num_experts: usize,
    ) -> Result<Self> {
        const WHAT: &str = "low-latency RDMA layout";
        let _ = num_ranks;
        let n = num_max_dispatch_tokens_per_rank;
        let e = num_experts;
        let num_scales = hidden / 128;
        let two_h = mul(WHAT, &[hidden, 2])?;
        let four_s = num_scales * 4;
        let dispatch_msg_bytes = add(WHAT, &[16, two_h.max(add(WHAT, &[hidden, four_s])?)])?;
        let combine_msg_bytes = add(WHAT, &[four_s, two_h])?;
        let send_bytes =
            mul(WHAT, &[n, dispatch_msg_bytes])?.max(mul(WHAT, &[e, n, combine_msg_bytes])?);
        let recv_bytes =
            mul(WHAT, &[e, n, dispatch_msg_bytes])?.max(mul(WHAT, &[e, n, combine_msg_bytes])?);
        let signaling_bytes = align_up(WHAT, mul(WHAT, &[e, 4])?, 128)?;
        let total_bytes = mul(
            WHAT,
            &[add(WHAT, &[signaling_bytes, send_bytes, recv_bytes])?, 2],
        )?;
        let half = |i: usize| LowLatencyHalf {
            signal_offset: signaling_bytes * i,
            send_offset: signaling_bytes * 2 + send_bytes * i,
            recv_offset: signaling_bytes * 2 + send_bytes * 2 + recv_bytes * i,
        };
        Ok(Self {
            num_scales,
            dispatch_msg_bytes,
            combine_msg_bytes,
            signaling_bytes,
            send_bytes,
            recv_bytes,
            total_bytes,
            halves: [half(0), half(1)],
        })
    }

    /// DeepEP's rounding of the hint: `((total + 128) / 128) * 128`, which adds a full 128 bytes
    /// even when `total` is already aligned (spec §1.9).
    pub fn size_hint(&self) -> Result<usize> {
        let t = self
            .total_bytes
            .checked_add(128)
            .ok_or(Error::SizeOverflow {
                what: "low-latency RDMA size hint",
            })?;
        Ok(t / 128 * 128)
    }
}

/// `Buffer.get_low_latency_rdma_size_hint(N, H, R, E)` (spec §1.9): the `num_rdma_bytes` a
/// low-latency buffer needs. E.g. `(128, 7168, 8, 288)` → 2,146,961,792.
pub fn low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: usize,
    hidden: usize,
    num_ranks: usize,
    num_experts: usize,
) -> Result<usize> {
    LowLatencyLayout::new(
        num_max_dispatch_tokens_per_rank,
        hidden,
        num_ranks,
        num_experts,
    )?
    .size_hint()
}
