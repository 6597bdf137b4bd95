//! DeepEP's `Config` (spec §1.4): chunking of the normal-mode kernels, its constructor checks and
//! the tuned tables.

use crate::config::{DEFAULT_NUM_SMS, num_rdma_ranks};
use crate::error::{Error, Result};

/// Chunking of the normal-mode (intranode and internode) kernels, DeepEP's `Config` (spec §1.4).
///
/// Built only through [`Config::new`] (or the tables), so every value satisfies DeepEP's
/// constructor checks. `C = num_sms / 2` channels, each using 2 SMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Config {
    num_sms: usize,
    num_max_nvl_chunked_send_tokens: usize,
    num_max_nvl_chunked_recv_tokens: usize,
    num_max_rdma_chunked_send_tokens: usize,
    num_max_rdma_chunked_recv_tokens: usize,
}

impl Default for Config {
    /// DeepEP's pybind defaults: `Config(20, 6, 256, 6, 256)` (spec §1.4).
    fn default() -> Self {
        Self {
            num_sms: DEFAULT_NUM_SMS,
            num_max_nvl_chunked_send_tokens: 6,
            num_max_nvl_chunked_recv_tokens: 256,
            num_max_rdma_chunked_send_tokens: 6,
            num_max_rdma_chunked_recv_tokens: 256,
        }
    }
}

/// One row of the tuned tables: `(nvl_send, nvl_recv, rdma_send, rdma_recv)` (spec §1.4).
type Row = (usize, usize, usize, usize);

/// `(dispatch, combine)` rows of the tuned tables for `num_ranks`, or `None` (spec §1.4).
fn tuned_rows(num_ranks: usize) -> Option<(Row, Row)> {
    Some(match num_ranks {
        2 => ((24, 256, 6, 128), (10, 256, 6, 128)),
        4 => ((6, 256, 6, 128), (9, 256, 6, 128)),
        8 => ((6, 256, 6, 128), (4, 256, 6, 128)),
        16 => ((36, 288, 20, 128), (4, 288, 12, 128)),
        24 | 32 | 48 | 64 => ((32, 288, 8, 128), (1, 288, 8, 128)),
        96 => ((20, 480, 12, 128), (1, 480, 8, 128)),
        128 => ((20, 560, 12, 128), (1, 560, 8, 128)),
        144 => ((32, 720, 12, 128), (2, 720, 8, 128)),
        160 => ((28, 720, 12, 128), (2, 720, 8, 128)),
        _ => return None,
    })
}

const TUNED_RANKS: &str = "the tuned tables cover 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144 and 160 \
                           ranks; build a Config with Config::new for other sizes";

impl Config {
    /// `Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)` with DeepEP's checks
    /// (spec §1.4): chunk sizes > 0; `nvl_send < nvl_recv`; `rdma_recv` is **rounded up to a
    /// multiple of `rdma_send`**, then `rdma_send < rdma_recv` and `rdma_send <= rdma_recv / 2`
    /// ("RDMA lazy head update, senders always have space to push").
    ///
    /// `num_sms` may be odd here, as in DeepEP; calls that need channels check it
    /// ([`Config::num_channels`] floors, [`Config::check_even_num_sms`]).
    pub fn new(
        num_sms: usize,
        num_max_nvl_chunked_send_tokens: usize,
        num_max_nvl_chunked_recv_tokens: usize,
        num_max_rdma_chunked_send_tokens: usize,
        num_max_rdma_chunked_recv_tokens: usize,
    ) -> Result<Self> {
        let nonzero = [
            (
                "num_max_nvl_chunked_send_tokens",
                num_max_nvl_chunked_send_tokens,
            ),
            (
                "num_max_nvl_chunked_recv_tokens",
                num_max_nvl_chunked_recv_tokens,
            ),
            (
                "num_max_rdma_chunked_send_tokens",
                num_max_rdma_chunked_send_tokens,
            ),
            (
                "num_max_rdma_chunked_recv_tokens",
                num_max_rdma_chunked_recv_tokens,
            ),
        ];
        if let Some((field, _)) = nonzero.iter().find(|(_, v)| *v == 0) {
            return Err(Error::ZeroChunkSize { field });
        }
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens {
            return Err(Error::NvlChunkOrder {
                send: num_max_nvl_chunked_send_tokens,
                recv: num_max_nvl_chunked_recv_tokens,
            });
        }
        let send = num_max_rdma_chunked_send_tokens;
        let rounded = num_max_rdma_chunked_recv_tokens
            .checked_next_multiple_of(send)
            .ok_or(Error::SizeOverflow {
                what: "num_max_rdma_chunked_recv_tokens rounded up to a multiple of the send chunk",
            })?;
        // `send <= rounded / 2` implies `send < rounded` (send >= 1).
        if send > rounded / 2 {
            return Err(Error::RdmaChunkTooLarge {
                send,
                recv: num_max_rdma_chunked_recv_tokens,
                rounded_recv: rounded,
            });
        }
        Ok(Self {
            num_sms,
            num_max_nvl_chunked_send_tokens,
            num_max_nvl_chunked_recv_tokens,
            num_max_rdma_chunked_send_tokens: send,
            num_max_rdma_chunked_recv_tokens: rounded,
        })
    }

    /// `Buffer.get_dispatch_config(R)` with `Buffer.num_sms = 20` (spec §1.4).
    pub fn dispatch_for(num_ranks: usize) -> Result<Self> {
        Self::dispatch_for_num_sms(num_ranks, DEFAULT_NUM_SMS)
    }

    /// `Buffer.get_combine_config(R)` with `Buffer.num_sms = 20` (spec §1.4).
    pub fn combine_for(num_ranks: usize) -> Result<Self> {
        Self::combine_for_num_sms(num_ranks, DEFAULT_NUM_SMS)
    }

    /// The dispatch table row for `num_ranks` after `Buffer.set_num_sms(num_sms)` (which asserts
    /// `num_sms` even) (spec §1.1, §1.4). DeepEP's tests use `num_sms = 24`.
    pub fn dispatch_for_num_sms(num_ranks: usize, num_sms: usize) -> Result<Self> {
        Self::from_table(num_ranks, num_sms, true)
    }

    /// The combine table row for `num_ranks` with `num_sms` SMs (spec §1.4).
    pub fn combine_for_num_sms(num_ranks: usize, num_sms: usize) -> Result<Self> {
        Self::from_table(num_ranks, num_sms, false)
    }

    fn from_table(num_ranks: usize, num_sms: usize, dispatch: bool) -> Result<Self> {
        if !num_sms.is_multiple_of(2) {
            return Err(Error::OddNumSms { num_sms });
        }
        let (d, c) = tuned_rows(num_ranks).ok_or(Error::UnsupportedNumRanks {
            num_ranks,
            rule: TUNED_RANKS,
        })?;
        let (ns, nr, rs, rr) = if dispatch { d } else { c };
        Self::new(num_sms, ns, nr, rs, rr)
    }

    /// SMs the normal kernels use.
    pub fn num_sms(&self) -> usize {
        self.num_sms
    }

    /// `C = num_sms / 2` channels (spec §1.4).
    pub fn num_channels(&self) -> usize {
        self.num_sms / 2
    }

    /// Tokens an NVL sender pushes per chunk.
    pub fn num_max_nvl_chunked_send_tokens(&self) -> usize {
        self.num_max_nvl_chunked_send_tokens
    }

    /// Tokens of an NVL receive ring.
    pub fn num_max_nvl_chunked_recv_tokens(&self) -> usize {
        self.num_max_nvl_chunked_recv_tokens
    }

    /// Tokens an RDMA sender pushes per chunk.
    pub fn num_max_rdma_chunked_send_tokens(&self) -> usize {
        self.num_max_rdma_chunked_send_tokens
    }

    /// Tokens of an RDMA receive ring, as stored: rounded up to a multiple of the send chunk.
    pub fn num_max_rdma_chunked_recv_tokens(&self) -> usize {
        self.num_max_rdma_chunked_recv_tokens
    }

    /// Fails unless `num_sms` is even (channels are SM pairs; DeepEP's normal kernels and
    /// `set_num_sms` assert it, spec §1.1, §1.5).
    pub fn check_even_num_sms(&self) -> Result<()> {
        if self.num_sms.is_multiple_of(2) {
            Ok(())
        } else {
            Err(Error::OddNumSms {
                num_sms: self.num_sms,
            })
        }
    }

    /// DeepEP's host assertions of internode combine (spec §3.5, conformance case 12):
    /// `nvl_recv % RR == 0` (the NVL ring is split into `RR` sub-rings), `nvl_recv / RR >
    /// max(rdma_send, nvl_send)`, `nvl_recv / RR - warps_per_forwarder >= nvl_send`, `rdma_send >=
    /// warps_per_forwarder`, with `warps_per_forwarder = max(24 / RR, 1)`.
    ///
    /// These bound DeepEP's ring protocol; ep-rs checks them so that a `Config` accepted here is
    /// accepted by DeepEP too. Only meaningful for `R > 8`; returns `Ok` otherwise.
    pub fn check_internode_combine(&self, num_ranks: usize) -> Result<()> {
        if num_ranks <= crate::config::NUM_MAX_NVL_PEERS {
            return Ok(());
        }
        let rr = num_rdma_ranks(num_ranks);
        let qn = self.num_max_nvl_chunked_recv_tokens;
        let nvl_send = self.num_max_nvl_chunked_send_tokens;
        let rdma_send = self.num_max_rdma_chunked_send_tokens;
        let warps_per_forwarder = (24 / rr).max(1);
        let invalid = |fix: String| Error::InvalidConfig {
            field: "num_max_nvl_chunked_recv_tokens",
            value: qn.to_string(),
            fix,
        };
        if !qn.is_multiple_of(rr) {
            return Err(invalid(format!(
                "internode combine splits the NVL ring into {rr} sub-rings (one per node), so it \
                 must be a multiple of {rr}; use {}",
                qn.next_multiple_of(rr)
            )));
        }
        let sub = qn / rr;
        if sub <= rdma_send.max(nvl_send) {
            return Err(invalid(format!(
                "each of the {rr} sub-rings holds {sub} tokens, which must exceed both send chunks \
                 (rdma {rdma_send}, nvl {nvl_send}); enlarge the ring"
            )));
        }
        if sub - warps_per_forwarder < nvl_send {
            return Err(invalid(format!(
                "each sub-ring ({sub} tokens) minus {warps_per_forwarder} forwarder warps must hold \
                 the NVL send chunk ({nvl_send}); enlarge the ring or lower the send chunk"
            )));
        }
        if rdma_send < warps_per_forwarder {
            return Err(Error::InvalidConfig {
                field: "num_max_rdma_chunked_send_tokens",
                value: rdma_send.to_string(),
                fix: format!(
                    "internode combine with {rr} nodes uses {warps_per_forwarder} warps per \
                     forwarder and needs at least that many tokens per RDMA chunk"
                ),
            });
        }
        Ok(())
    }
}
