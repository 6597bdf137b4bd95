//! Every offset, size and per-token rule of the protocol (docs/protocol.md §2.1, §2.2, §3.1,
//! §3.2), in one place. Agents and `Buffer` use only these; `ep_protocol.cuh` mirrors them for
//! CUDA and `crates/ep-kernels/tests/protocol_rules.rs` checks the two agree.
//!
//! All offsets are bytes from the start of their allocation.

use std::ops::Range;

/// Spacing of signal words: each word in its own 16-byte granule (docs/protocol.md §1.2).
pub const WORD_STRIDE: u64 = 16;
/// Most channels a normal-mode call may use (`Config::num_channels()`); sizes the control words.
pub const MAX_CHANNELS: usize = 64;
/// Most local experts a normal-mode call may have; sizes the count records.
pub const MAX_LOCAL_EXPERTS: usize = 1024;
/// Top-k entries a low-latency meta record has room for (spec §0, `kNumMaxTopK`).
pub const LL_MAX_TOPK: usize = 11;
/// Most send groups a low-latency dispatch may have (docs/protocol.md §3.3: a GPU rank's
/// blocks, `num_sms`); sizes the dispatch signals and the header copies.
pub const LL_MAX_SEND_GROUPS: usize = 160;
/// u32 words of a send group's header copy (docs/protocol.md §3.2): its first slot, the source's
/// messages to the destination, then `c(l, s)` for `l < L` from word `LL_HEADER_COUNTS_WORD`.
pub const LL_HEADER_FIRST_WORD: usize = 0;
/// See [`LL_HEADER_FIRST_WORD`].
pub const LL_HEADER_MESSAGES_WORD: usize = 1;
/// See [`LL_HEADER_FIRST_WORD`].
pub const LL_HEADER_COUNTS_WORD: usize = 2;
/// Bytes of one low-latency meta entry `(l u16, pos u16, w f32)`.
pub const LL_META_ENTRY_BYTES: u64 = 8;
/// Alignment of allocations and regions.
pub const REGION_ALIGN: u64 = 128;
/// Bytes of a normal dispatch record's meta pair (`src_idx` i32, pad i32), the first field of
/// its meta part.
pub const ROW_META_PAIR_BYTES: u64 = 8;
/// Bytes of one `topk_idx` entry (i64) in a normal dispatch record.
pub const ROW_TOPK_ID_BYTES: u64 = 8;
/// Bytes of one `topk_weights` entry (f32) in a normal dispatch record.
pub const ROW_TOPK_WEIGHT_BYTES: u64 = 4;

/// `x` rounded up to a multiple of 16.
#[must_use]
pub const fn align16(x: u64) -> u64 {
    x.div_ceil(16) * 16
}

/// `x` rounded up to a multiple of 128.
#[must_use]
pub const fn align128(x: u64) -> u64 {
    x.div_ceil(128) * 128
}

/// `chan(T, C, c)` (spec §2.1): channel `c`'s contiguous token range.
#[must_use]
pub fn channel_range(num_tokens: usize, num_channels: usize, channel: usize) -> Range<usize> {
    crate::plan::layout::channel_range(num_tokens, num_channels, channel)
}

/// Half `h` (0 or 1) of channel `c`'s tokens: `[start, mid)` and `[mid, end)` of
/// `chan(T, C, c)` with `mid = start + ⌈(end − start) / 2⌉`. A normal dispatch sender publishes
/// each half with its own `done[s][c][h]` (on the GPU each half is one CTA, docs/protocol.md
/// §2.3, §2.7).
#[must_use]
pub fn channel_half(
    num_tokens: usize,
    num_channels: usize,
    channel: usize,
    h: usize,
) -> Range<usize> {
    let r = channel_range(num_tokens, num_channels, channel);
    let mid = r.start + (r.end - r.start).div_ceil(2);
    if h == 0 { r.start..mid } else { mid..r.end }
}

/// Call parity: which half of a double-buffered region call `call` uses.
#[must_use]
pub const fn parity(call: u64) -> u64 {
    call & 1
}

// ---- normal intranode: control words (allocation `normal.ctrl`) ---------------------------------

/// Word offsets of the normal-mode control allocation of `num_ranks` ranks
/// (docs/protocol.md §2.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalCtrl {
    /// `R`.
    pub num_ranks: usize,
}

impl NormalCtrl {
    fn r(self) -> u64 {
        self.num_ranks as u64
    }
    /// Bytes of the control allocation: `16 · (4R + 2 + 3R·MAX_CHANNELS + 2R²)`.
    #[must_use]
    pub fn bytes(self) -> u64 {
        WORD_STRIDE
            * (4 * self.r() + 2 + 3 * self.r() * MAX_CHANNELS as u64 + 2 * self.r() * self.r())
    }
    /// `notify[p][s]`: source `s`'s count record of parity `p` (its expert part) is in place.
    #[must_use]
    pub fn notify(self, p: u64, s: usize) -> u64 {
        WORD_STRIDE * (p * self.r() + s as u64)
    }
    /// `table_ready[p]` (local): the owner's table of parity `p` is in place.
    #[must_use]
    pub fn table_ready(self, p: u64) -> u64 {
        WORD_STRIDE * (2 * self.r() + p)
    }
    /// `done[s][c][h]`: sender `(s, c)` stored the rows of half `h` of its channel into this rank
    /// ([`channel_half`]; half 1 also its channel's prefix entry).
    #[must_use]
    pub fn done(self, s: usize, c: usize, h: usize) -> u64 {
        WORD_STRIDE * (2 * self.r() + 2 + (2 * (s * MAX_CHANNELS + c) + h) as u64)
    }
    /// `pulled[s][c]`: combine reducer `(s, c)` finished reading this rank's combine rows.
    #[must_use]
    pub fn pulled(self, s: usize, c: usize) -> u64 {
        WORD_STRIDE
            * (2 * self.r()
                + 2
                + 2 * self.r() * MAX_CHANNELS as u64
                + (s * MAX_CHANNELS + c) as u64)
    }
    /// `ready[d]`: rank `d` accepts rows of the current cached dispatch.
    #[must_use]
    pub fn ready(self, d: usize) -> u64 {
        WORD_STRIDE * (2 * self.r() + 2 + 3 * self.r() * MAX_CHANNELS as u64 + d as u64)
    }
    /// `y_ready[d]`: rank `d`'s combine rows of the current combine are in place.
    #[must_use]
    pub fn y_ready(self, d: usize) -> u64 {
        WORD_STRIDE * (3 * self.r() + 2 + 3 * self.r() * MAX_CHANNELS as u64 + d as u64)
    }
    /// `head[p][s][e]`: `n_s[e]`, the tokens source `s` sends to rank `e` in the call of parity
    /// `p`, as a counted word `(call << 32) | n` ([`super::signal::counted`]): the value travels
    /// in the word, so a waiter needs no second load (docs/protocol.md §2.3).
    #[must_use]
    pub fn head(self, p: u64, s: usize, e: usize) -> u64 {
        let r = self.r();
        WORD_STRIDE * (4 * r + 2 + 3 * r * MAX_CHANNELS as u64 + (p * r + s as u64) * r + e as u64)
    }
    /// The rank that writes the word at byte offset `off` of `owner`'s control allocation: the
    /// peer a waiter on that word depends on (`owner` itself for `table_ready`). `None` past the
    /// words. Used to name the suspect of a wait timeout (docs/protocol.md §7).
    #[must_use]
    pub fn writer(self, off: u64, owner: usize) -> Option<usize> {
        let (r, cm) = (self.r(), MAX_CHANNELS as u64);
        let w = off / WORD_STRIDE;
        let s = if w < 2 * r {
            w % r
        } else if w < 2 * r + 2 {
            return Some(owner);
        } else if w < 2 * r + 2 + 2 * r * cm {
            (w - 2 * r - 2) / (2 * cm)
        } else if w < 2 * r + 2 + 3 * r * cm {
            (w - 2 * r - 2 - 2 * r * cm) / cm
        } else if w < 4 * r + 2 + 3 * r * cm {
            (w - 2 * r - 2 - 3 * r * cm) % r
        } else if w < 4 * r + 2 + 3 * r * cm + 2 * r * r {
            ((w - 4 * r - 2 - 3 * r * cm) / r) % r
        } else {
            return None;
        };
        Some(s as usize)
    }
}

// ---- normal intranode: data (allocation `normal.data`) --------------------------------------------

/// Offsets of the normal-mode data allocation (docs/protocol.md §2.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalData {
    /// `R`.
    pub num_ranks: usize,
    /// Bytes of the data allocation.
    pub data_bytes: u64,
}

/// Bytes of a count record: `16·MAX_CHANNELS + a16(4·MAX_LOCAL_EXPERTS)`
/// ([`count_record_fields`]).
#[must_use]
pub const fn count_record_bytes() -> u64 {
    let (_, fe) = count_record_fields();
    fe + align16(4 * MAX_LOCAL_EXPERTS as u64)
}

/// Bytes of a table of `num_ranks` ranks: `a16(4·(2R + 1))`.
#[must_use]
pub fn table_bytes(num_ranks: usize) -> u64 {
    align16(4 * (2 * num_ranks + 1) as u64)
}

/// Byte offsets inside a count record: `(channel prefix, expert counts)`. Its channel prefix
/// part, one 16-byte granule per channel (`[start, end]` i32 of channel `c`'s tokens towards
/// the record's destination, at `cpm + 16·c`), is stored by sender `(s, c)` before `done[s][c]`;
/// its expert part by the notify agent before `notify` (docs/protocol.md §2.3). No two writers
/// share a granule (docs/protocol.md §1.2). The rank counts are not in the record: they travel
/// in the `head` words ([`NormalCtrl::head`]).
#[must_use]
pub const fn count_record_fields() -> (u64, u64) {
    (0, WORD_STRIDE * MAX_CHANNELS as u64)
}

/// Offset inside a count record of channel `c`'s prefix entry `[start, end]` (8 bytes of its own
/// 16-byte granule; docs/protocol.md §2.1).
#[must_use]
pub const fn count_record_channel(c: usize) -> u64 {
    count_record_fields().0 + WORD_STRIDE * c as u64
}

/// Byte offsets inside a table: `(send_base, recv_begin)`. `send_base[e]` (R i32),
/// `recv_begin[s]` (R + 1 i32, the last one = rows received).
#[must_use]
pub fn table_fields(num_ranks: usize) -> (u64, u64) {
    (0, 4 * num_ranks as u64)
}

impl NormalData {
    /// `counts[p][s]`.
    #[must_use]
    pub fn count_record(self, p: u64, s: usize) -> u64 {
        (p * self.num_ranks as u64 + s as u64) * count_record_bytes()
    }
    /// `table[p]`.
    #[must_use]
    pub fn table(self, p: u64) -> u64 {
        2 * self.num_ranks as u64 * count_record_bytes() + p * table_bytes(self.num_ranks)
    }
    /// Start of the dispatch rows (128-aligned).
    #[must_use]
    pub fn rows_base(self) -> u64 {
        align128(2 * self.num_ranks as u64 * count_record_bytes() + 2 * table_bytes(self.num_ranks))
    }
    /// Bytes of each of the two row regions (dispatch, combine): `⌊(data − rows_base) / 256⌋ · 128`.
    #[must_use]
    pub fn half(self) -> u64 {
        self.data_bytes.saturating_sub(self.rows_base()) / 256 * 128
    }
    /// Offset of dispatch row `row` with records of `drec` bytes.
    #[must_use]
    pub fn dispatch_row(self, row: u64, drec: u64) -> u64 {
        self.rows_base() + row * drec
    }
    /// Offset of combine row `row` with records of `yrec` bytes.
    #[must_use]
    pub fn combine_row(self, row: u64, yrec: u64) -> u64 {
        self.rows_base() + self.half() + row * yrec
    }
    /// Rows the dispatch region holds.
    #[must_use]
    pub fn dispatch_capacity(self, drec: u64) -> u64 {
        self.half() / drec.max(1)
    }
    /// Rows the combine region holds.
    #[must_use]
    pub fn combine_capacity(self, yrec: u64) -> u64 {
        self.half() / yrec.max(1)
    }
    /// Data bytes needed for `rows` rows of both kinds.
    #[must_use]
    pub fn data_bytes_for(num_ranks: usize, rows: u64, drec: u64, yrec: u64) -> u64 {
        let base = NormalData {
            num_ranks,
            data_bytes: 0,
        }
        .rows_base();
        base + 2 * align128(rows * drec.max(yrec))
    }
}

/// The row formats of one normal-mode call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowFormat {
    /// `H`.
    pub hidden: usize,
    /// Bytes per element of `x`: 2 (BF16) or 1 (FP8).
    pub elem_bytes: usize,
    /// FP8 scales per row (`ceil(H/128)`), 0 for BF16.
    pub num_scales: usize,
    /// `K` (0 without top-k).
    pub num_topk: usize,
}

impl RowFormat {
    /// Offset of the scales in a dispatch record: `a16(H·elt)`.
    #[must_use]
    pub fn scales_offset(self) -> u64 {
        align16((self.hidden * self.elem_bytes) as u64)
    }
    /// Offset of the meta part (`src_idx`, pad, `topk_idx` i64 ×K, weights f32 ×K).
    #[must_use]
    pub fn meta_offset(self) -> u64 {
        self.scales_offset() + align16(4 * self.num_scales as u64)
    }
    /// Offset of the `topk_idx` field (`i64 ×K`) in a dispatch record: `meta_offset + 8`
    /// ([`ROW_META_PAIR_BYTES`]).
    #[must_use]
    pub fn topk_idx_offset(self) -> u64 {
        self.meta_offset() + ROW_META_PAIR_BYTES
    }
    /// Offset of the `topk_weights` field (`f32 ×K`) in a dispatch record:
    /// `meta_offset + 8 + 8K`.
    #[must_use]
    pub fn topk_weights_offset(self) -> u64 {
        self.topk_idx_offset() + ROW_TOPK_ID_BYTES * self.num_topk as u64
    }
    /// Dispatch record bytes `drec = a16(H·elt) + a16(4S) + a16(8 + 12K)`.
    #[must_use]
    pub fn dispatch_record(self) -> u64 {
        self.meta_offset()
            + align16(
                ROW_META_PAIR_BYTES
                    + (ROW_TOPK_ID_BYTES + ROW_TOPK_WEIGHT_BYTES) * self.num_topk as u64,
            )
    }
    /// Combine record bytes `yrec = a16(2H) + a16(4K)`.
    #[must_use]
    pub fn combine_record(self) -> u64 {
        align16(2 * self.hidden as u64) + align16(4 * self.num_topk as u64)
    }
}

/// Final row of a token on its receiver (docs/protocol.md §2.2):
/// `rpm[s−1][d] + cpm_s[d][c−1] + i`.
#[must_use]
pub const fn normal_final_row(block_begin: u32, channel_start: u32, index_in_channel: u32) -> u32 {
    block_begin + channel_start + index_in_channel
}

// ---- low-latency ----------------------------------------------------------------------------------

/// Bytes of the low-latency signal allocation: `a128(16·4R·G)`, `G` = [`LL_MAX_SEND_GROUPS`].
#[must_use]
pub fn ll_signal_bytes(num_ranks: usize) -> u64 {
    align128(WORD_STRIDE * 4 * num_ranks as u64 * LL_MAX_SEND_GROUPS as u64)
}

/// `disp_sig[h][s][b]` in the signal allocation: send group `b` of source `s`.
#[must_use]
pub fn ll_dispatch_signal(num_ranks: usize, half: u64, s: usize, b: usize) -> u64 {
    WORD_STRIDE * ((half * num_ranks as u64 + s as u64) * LL_MAX_SEND_GROUPS as u64 + b as u64)
}

/// `comb_sig[h][d][b]` in the signal allocation (after every dispatch signal): the partials of
/// send group `b`'s messages, from expert rank `d`.
#[must_use]
pub fn ll_combine_signal(num_ranks: usize, half: u64, d: usize, b: usize) -> u64 {
    let (r, g) = (num_ranks as u64, LL_MAX_SEND_GROUPS as u64);
    WORD_STRIDE * (2 * r * g + (half * r + d as u64) * g + b as u64)
}

/// The rank that writes the low-latency signal word at byte offset `off` of the signal
/// allocation (`disp_sig[h][s][b]`: `s`; `comb_sig[h][d][b]`: `d`); `None` past the words.
#[must_use]
pub fn ll_signal_writer(num_ranks: usize, off: u64) -> Option<usize> {
    ll_signal_of(num_ranks, off).map(|(_, _, r, _)| r)
}

/// `(combine, half, writer, group)` of the signal word at `off`: `disp_sig[half][writer][group]`
/// (`combine` false) or `comb_sig[half][writer][group]`; `None` past the words.
#[must_use]
pub fn ll_signal_of(num_ranks: usize, off: u64) -> Option<(bool, u64, usize, usize)> {
    let (w, r, g) = (
        off / WORD_STRIDE,
        num_ranks as u64,
        LL_MAX_SEND_GROUPS as u64,
    );
    if w >= 4 * r * g {
        return None;
    }
    let (combine, w) = if w < 2 * r * g {
        (false, w)
    } else {
        (true, w - 2 * r * g)
    };
    Some((
        combine,
        w / (r * g),
        ((w / g) % r) as usize,
        (w % g) as usize,
    ))
}

/// Tokens of send group `b` of `g` on a rank with `num_tokens` tokens (docs/protocol.md §3.3):
/// the channel split of normal mode ([`channel_range`]), contiguous and ascending.
#[must_use]
pub fn ll_send_group(num_tokens: usize, groups: usize, b: usize) -> Range<usize> {
    channel_range(num_tokens, groups, b)
}

/// Half used by low-latency operation number `op` (docs/protocol.md §3.7).
#[must_use]
pub const fn ll_half(op: u64) -> u64 {
    op & 1
}

/// QP of data run `run` (RDMA-fence orders them all before the signal on QP 0).
#[must_use]
pub const fn ll_data_qp(run: u32, num_qps: u16) -> u16 {
    if num_qps <= 1 {
        0
    } else {
        ((run + 1) % num_qps as u32) as u16
    }
}

/// QP of the low-latency signals (and of the metadata put that carries the dispatch signal).
pub const LL_SIGNAL_QP: u16 = 0;

/// The low-latency data layout for `(N, H, R, L)` (docs/protocol.md §3.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlLayout {
    /// `R`.
    pub num_ranks: usize,
    /// `L`.
    pub num_local_experts: usize,
    /// `H`.
    pub hidden: usize,
    /// `N`.
    pub num_max_tokens: usize,
}

impl LlLayout {
    fn r(self) -> u64 {
        self.num_ranks as u64
    }
    fn n(self) -> u64 {
        self.num_max_tokens as u64
    }
    /// Row slot bytes `a16(2H)`.
    #[must_use]
    pub fn row(self) -> u64 {
        align16(2 * self.hidden as u64)
    }
    /// Offset of the FP8 scales inside a row slot: `a16(H)`.
    #[must_use]
    pub fn fp8_scales_offset(self) -> u64 {
        align16(self.hidden as u64)
    }
    /// One send group's header copy `a16(8 + 4L)`: `[first slot u32][messages u32][c(l) u32 × L]`
    /// (docs/protocol.md §3.2).
    #[must_use]
    pub fn header_copy(self) -> u64 {
        align16(4 * (LL_HEADER_COUNTS_WORD + self.num_local_experts) as u64)
    }
    /// Offset of send group `b`'s header copy in a per-peer block (`drecv[s]`, `dsend_meta[d]`).
    #[must_use]
    pub fn header_copy_at(self, b: usize) -> u64 {
        b as u64 * self.header_copy()
    }
    /// Header bytes: [`LL_MAX_SEND_GROUPS`] copies, group `b`'s at `b·header_copy()`.
    #[must_use]
    pub fn header(self) -> u64 {
        LL_MAX_SEND_GROUPS as u64 * self.header_copy()
    }
    /// Meta record bytes `a16(8 + 8·LL_MAX_TOPK)`.
    #[must_use]
    pub fn meta(self) -> u64 {
        align16(8 + LL_META_ENTRY_BYTES * LL_MAX_TOPK as u64)
    }
    /// Per-peer block `hdr + N·meta`.
    #[must_use]
    pub fn block(self) -> u64 {
        self.header() + self.n() * self.meta()
    }
    /// `dsend_rows[t]`.
    #[must_use]
    pub fn dsend_row(self, t: usize) -> u64 {
        t as u64 * self.row()
    }
    /// `dsend_meta[d]` (header; meta slot `i` at `+ header() + i·meta()`).
    #[must_use]
    pub fn dsend_meta(self, d: usize) -> u64 {
        self.n() * self.row() + d as u64 * self.block()
    }
    /// `drecv[s]` (header; meta slot `i` at `+ header() + i·meta()`; row `i` at `+ block() + i·row()`).
    #[must_use]
    pub fn drecv(self, s: usize) -> u64 {
        self.n() * self.row()
            + self.r() * self.block()
            + s as u64 * (self.block() + self.n() * self.row())
    }
    /// Row slot `i` of `drecv[s]`.
    #[must_use]
    pub fn drecv_row(self, s: usize, i: usize) -> u64 {
        self.drecv(s) + self.block() + i as u64 * self.row()
    }
    /// `csend[s][i]`.
    #[must_use]
    pub fn csend(self, s: usize, i: usize) -> u64 {
        (s as u64 * self.n() + i as u64) * self.row()
    }
    /// `crecv[d][i]`.
    #[must_use]
    pub fn crecv(self, d: usize, i: usize) -> u64 {
        self.r() * self.n() * self.row() + (d as u64 * self.n() + i as u64) * self.row()
    }
    /// `cy[l][row]` (BF16 `[L][R·N][H]`).
    #[must_use]
    pub fn cy(self, l: usize, row: usize) -> u64 {
        2 * self.r() * self.n() * self.row()
            + (l as u64 * self.r() * self.n() + row as u64) * 2 * self.hidden as u64
    }
    /// LogFMT division metas of one combine partial: `a16(4·H/128)` (one u32 per 128
    /// channels, `numerics::logfmt`).
    #[must_use]
    pub fn logfmt_meta(self) -> u64 {
        align16(4 * (self.hidden as u64 / 128))
    }
    /// `csend_meta[s][i]`: the LogFMT division metas of partial `csend[s][i]` (after `cy`).
    #[must_use]
    pub fn csend_meta(self, s: usize, i: usize) -> u64 {
        self.cy(self.num_local_experts, 0) + (s as u64 * self.n() + i as u64) * self.logfmt_meta()
    }
    /// `crecv_meta[d][i]`: those of `crecv[d][i]`.
    #[must_use]
    pub fn crecv_meta(self, d: usize, i: usize) -> u64 {
        self.csend_meta(self.num_ranks, 0) + (d as u64 * self.n() + i as u64) * self.logfmt_meta()
    }

    /// Bytes of one half.
    #[must_use]
    pub fn half_bytes(self) -> u64 {
        let dispatch = self.n() * self.row()
            + self.r() * self.block()
            + self.r() * (self.block() + self.n() * self.row());
        let combine = 2 * self.r() * self.n() * self.row()
            + self.num_local_experts as u64 * self.r() * self.n() * 2 * self.hidden as u64
            + 2 * self.r() * self.n() * self.logfmt_meta();
        align128(dispatch.max(combine))
    }
    /// Offset of half `h` in the data allocation.
    #[must_use]
    pub fn half_base(self, h: u64) -> u64 {
        h * self.half_bytes()
    }
    /// Bytes `num_rdma_bytes` must hold: signals plus both halves.
    #[must_use]
    pub fn total_bytes(self) -> u64 {
        ll_signal_bytes(self.num_ranks) + 2 * self.half_bytes()
    }
}

/// Channels of a LogFMT-10 chunk in a combine partial (`numerics::logfmt::CHUNK`; the kernels'
/// `EP_LOGFMT_CHUNK`).
pub const LL_LOGFMT_CHUNK: usize = crate::numerics::logfmt::CHUNK;

/// Chunks of one unit of the LogFMT-10 combine (docs/protocol.md §3.12): a GPU warp's 1024
/// channels, which decides and encodes its chunks alone; its chunks are put one by one, then its
/// division metas in one put.
pub const LL_LOGFMT_UNIT_CHUNKS: usize = 2;

/// Offset of LogFMT-10 chunk `k` inside a combine partial's slot (`csend[s][i]`,
/// `crecv[d][i]`): its raw place `2 · 512 · k` (docs/protocol.md §3.12; the kernels'
/// `2 * EP_LOGFMT_CHUNK * chunk`). A raw chunk fills its place; a cast one its first
/// `10/8 · channels` bytes, the rest of the place is not written.
#[must_use]
pub const fn ll_logfmt_chunk_place(k: usize) -> u64 {
    2 * (LL_LOGFMT_CHUNK * k) as u64
}

/// Offset of division `v`'s meta word (u32) inside a partial's `csend_meta` / `crecv_meta`
/// record: `4v`.
#[must_use]
pub const fn ll_logfmt_meta_word(v: usize) -> u64 {
    4 * v as u64
}

/// Encodes one low-latency meta entry `(l, pos, w)` into 8 bytes.
#[must_use]
pub fn ll_meta_entry(l: u16, pos: u16, w: f32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..2].copy_from_slice(&l.to_le_bytes());
    b[2..4].copy_from_slice(&pos.to_le_bytes());
    b[4..8].copy_from_slice(&w.to_bits().to_le_bytes());
    b
}

/// Encodes the head of a low-latency meta record: token `t`, then `n` entries (two u32).
#[must_use]
pub fn ll_meta_head(t: u32, n: u32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..4].copy_from_slice(&t.to_le_bytes());
    b[4..8].copy_from_slice(&n.to_le_bytes());
    b
}

/// Decodes the head of a meta record: `(t, n)`.
#[must_use]
pub fn ll_meta_head_decode(b: &[u8]) -> (u32, u32) {
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    (u32_at(0), u32_at(4))
}

/// Decodes one low-latency meta entry.
#[must_use]
pub fn ll_meta_entry_decode(b: &[u8]) -> (u16, u16, f32) {
    let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let w = f32::from_bits(u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
    (u16_at(0), u16_at(2), w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_words_are_distinct_and_inside() {
        let c = NormalCtrl { num_ranks: 3 };
        let mut all = vec![c.table_ready(0), c.table_ready(1)];
        for s in 0..3 {
            all.extend([c.notify(0, s), c.notify(1, s), c.ready(s), c.y_ready(s)]);
            for e in 0..3 {
                all.extend([c.head(0, s, e), c.head(1, s, e)]);
            }
            for ch in 0..MAX_CHANNELS {
                all.extend([c.done(s, ch, 0), c.done(s, ch, 1), c.pulled(s, ch)]);
            }
        }
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n);
        assert!(all.iter().all(|&w| w % 16 == 0 && w + 8 <= c.bytes()));
    }

    /// A count record's expert part (notify agent) and prefix part (the senders) never share
    /// a 16-byte granule, and both fit the record; the table fits, for every rank count.
    #[test]
    fn count_record_parts_have_their_own_granules() {
        let (cpm, e) = count_record_fields();
        assert_eq!(cpm, 0);
        assert_eq!(e, cpm + WORD_STRIDE * MAX_CHANNELS as u64);
        assert!(e % 16 == 0);
        assert!(e + 4 * MAX_LOCAL_EXPERTS as u64 <= count_record_bytes());
        for r in 1..=160 {
            let (b, rb) = table_fields(r);
            assert!(b == 0 && rb + 4 * (r as u64 + 1) <= table_bytes(r));
        }
    }

    #[test]
    fn every_word_names_its_writer() {
        let c = NormalCtrl { num_ranks: 3 };
        for s in 0..3 {
            for p in 0..2 {
                assert_eq!(c.writer(c.notify(p, s), 7), Some(s));
                assert_eq!(c.writer(c.table_ready(p), 7), Some(7));
            }
            assert_eq!(c.writer(c.ready(s), 7), Some(s));
            assert_eq!(c.writer(c.y_ready(s), 7), Some(s));
            for e in 0..3 {
                assert_eq!(c.writer(c.head(0, s, e), 7), Some(s));
                assert_eq!(c.writer(c.head(1, s, e), 7), Some(s));
            }
            for ch in [0, 5, MAX_CHANNELS - 1] {
                assert_eq!(c.writer(c.done(s, ch, 0), 7), Some(s));
                assert_eq!(c.writer(c.done(s, ch, 1), 7), Some(s));
                assert_eq!(c.writer(c.pulled(s, ch), 7), Some(s));
            }
            for h in 0..2 {
                for b in [0, 1, LL_MAX_SEND_GROUPS - 1] {
                    let off = ll_dispatch_signal(3, h, s, b);
                    assert_eq!(ll_signal_writer(3, off), Some(s));
                    assert_eq!(ll_signal_of(3, off), Some((false, h, s, b)));
                    let off = ll_combine_signal(3, h, s, b);
                    assert_eq!(ll_signal_writer(3, off), Some(s));
                    assert_eq!(ll_signal_of(3, off), Some((true, h, s, b)));
                }
            }
        }
        assert_eq!(c.writer(c.bytes(), 7), None);
        let words = 4 * 3 * LL_MAX_SEND_GROUPS as u64;
        assert_eq!(ll_signal_writer(3, (words - 1) * WORD_STRIDE), Some(2));
        assert_eq!(ll_signal_writer(3, words * WORD_STRIDE), None);
        assert!(ll_signal_bytes(3) >= words * WORD_STRIDE);
    }

    #[test]
    fn ll_regions_do_not_overlap() {
        let l = LlLayout {
            num_ranks: 3,
            num_local_experts: 2,
            hidden: 128,
            num_max_tokens: 4,
        };
        assert!(l.dsend_meta(0) >= l.dsend_row(4));
        assert!(l.drecv(0) >= l.dsend_meta(3));
        assert!(l.drecv_row(2, 4) <= l.half_bytes());
        assert!(l.cy(2, 0) <= l.half_bytes());
        assert_eq!(l.crecv(0, 0), l.csend(3, 0));
        assert_eq!(
            ll_meta_entry_decode(&ll_meta_entry(7, 9, -1.5)),
            (7, 9, -1.5)
        );
        assert_eq!(ll_data_qp(0, 1), 0);
        assert_eq!(ll_data_qp(0, 2), 1);
        assert_eq!(ll_data_qp(1, 2), 0);
    }
}
