/*
 * ep_protocol.cuh — the per-token rules of ep-rs's protocol (docs/protocol.md) for CUDA kernels
 * and for the host: offsets, slots, signal encodings, QP choice.
 *
 * Mirrors `ep_core::protocol::{layout, signal}` function for function; `build.rs` compiles a host
 * shim of this header with `cc` and `tests/protocol_rules.rs` property-tests it against the Rust
 * functions through FFI, so the two cannot drift. Constants come from the generated
 * `ep_protocol_constants.h` (emitted by build.rs from ep-core).
 *
 * Plain C-compatible inline functions over 64-bit integers; `__host__ __device__` under nvcc.
 */
#ifndef EP_PROTOCOL_CUH
#define EP_PROTOCOL_CUH

#include <stdint.h>

#include "ep_protocol_constants.h"

#ifdef __CUDACC__
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD static inline
#endif

/* ---- common --------------------------------------------------------------------------------- */

EP_HD uint64_t ep_align16(uint64_t x) { return (x + 15u) / 16u * 16u; }
EP_HD uint64_t ep_align128(uint64_t x) { return (x + 127u) / 128u * 128u; }

/* chan(T, C, c) of spec §2.1: per = ceil(T/C), start = min(per*c, T), end = min(start+per, T). */
EP_HD void ep_channel_range(uint64_t t, uint64_t c_count, uint64_t c, uint64_t *start, uint64_t *end) {
    uint64_t per = (t + c_count - 1u) / c_count;
    uint64_t s = per * c < t ? per * c : t;
    *start = s;
    *end = s + per < t ? s + per : t;
}

/* Half h of chan(T, C, c): [start, mid) and [mid, end) with mid = start + ceil((end - start) / 2);
 * each published by its own done[s][c][h] (docs/protocol.md §2.3). */
EP_HD void ep_channel_half(uint64_t t, uint64_t c_count, uint64_t c, uint64_t h, uint64_t *start, uint64_t *end) {
    uint64_t s, e;
    ep_channel_range(t, c_count, c, &s, &e);
    uint64_t mid = s + (e - s + 1u) / 2u;
    *start = h == 0u ? s : mid;
    *end = h == 0u ? mid : e;
}

EP_HD uint64_t ep_parity(uint64_t call) { return call & 1u; }

/* ---- signals (docs/protocol.md §1.1): counted words, bits 63..32 = call, 31..0 = count ------ */

EP_HD uint64_t ep_epoch_word(uint64_t call) { return call; }
EP_HD uint64_t ep_counted(uint64_t call, uint32_t count) { return (call << 32) | (uint64_t)count; }
EP_HD uint64_t ep_ll_encode(uint64_t call, uint32_t count) { return ep_counted(call, count); }
EP_HD uint64_t ep_ll_threshold(uint64_t call) { return call << 32; }
EP_HD uint64_t ep_ll_epoch(uint64_t value) { return value >> 32; }
EP_HD uint32_t ep_ll_count(uint64_t value) { return (uint32_t)(value & 0xffffffffu); }

/* ---- normal intranode: control words (allocation normal.ctrl) ------------------------------- */

EP_HD uint64_t ep_normal_ctrl_bytes(uint64_t r) {
    return EP_WORD_STRIDE * (4u * r + 2u + 3u * r * EP_MAX_CHANNELS + 2u * r * r);
}
EP_HD uint64_t ep_normal_notify(uint64_t r, uint64_t p, uint64_t s) { return EP_WORD_STRIDE * (p * r + s); }
EP_HD uint64_t ep_normal_table_ready(uint64_t r, uint64_t p) { return EP_WORD_STRIDE * (2u * r + p); }
/* done[s][c][h]: the rows of half h of sender (s, c)'s channel (ep_channel_half) are in place. */
EP_HD uint64_t ep_normal_done(uint64_t r, uint64_t s, uint64_t c, uint64_t h) {
    return EP_WORD_STRIDE * (2u * r + 2u + 2u * (s * EP_MAX_CHANNELS + c) + h);
}
EP_HD uint64_t ep_normal_pulled(uint64_t r, uint64_t s, uint64_t c) {
    return EP_WORD_STRIDE * (2u * r + 2u + 2u * r * EP_MAX_CHANNELS + s * EP_MAX_CHANNELS + c);
}
EP_HD uint64_t ep_normal_ready(uint64_t r, uint64_t d) {
    return EP_WORD_STRIDE * (2u * r + 2u + 3u * r * EP_MAX_CHANNELS + d);
}
EP_HD uint64_t ep_normal_y_ready(uint64_t r, uint64_t d) {
    return EP_WORD_STRIDE * (3u * r + 2u + 3u * r * EP_MAX_CHANNELS + d);
}
/* head[p][s][e]: n_s[e] of the call, as ep_counted(call, n) (docs/protocol.md §2.3). */
EP_HD uint64_t ep_normal_head(uint64_t r, uint64_t p, uint64_t s, uint64_t e) {
    return EP_WORD_STRIDE * (4u * r + 2u + 3u * r * EP_MAX_CHANNELS + (p * r + s) * r + e);
}

/* ---- normal intranode: data (allocation normal.data) ---------------------------------------- */

EP_HD uint64_t ep_count_record_bytes(void) {
    return EP_WORD_STRIDE * EP_MAX_CHANNELS + ep_align16(4u * EP_MAX_LOCAL_EXPERTS);
}
EP_HD uint64_t ep_table_bytes(uint64_t r) { return ep_align16(4u * (2u * r + 1u)); }
/* Fields of a count record: the channel prefix part at 0 (one 16-byte granule per channel c:
 * [start, end] i32 of c's tokens towards the record's destination), then e_s[d*L..d*L+L] i32.
 * The expert part is stored by the notify agent before notify[p][s], channel c's entry by sender
 * (s, c) before done[s][c]; the rank counts travel in the head words (docs/protocol.md §2.3). */
EP_HD uint64_t ep_count_record_experts(void) { return EP_WORD_STRIDE * EP_MAX_CHANNELS; }
/* Channel c's prefix entry [start, end] i32 (8 bytes of its own granule). */
EP_HD uint64_t ep_count_record_channel(uint64_t c) { return EP_WORD_STRIDE * c; }
/* Fields of a table: send_base[R] i32 at 0, recv_begin[R + 1] i32. */
EP_HD uint64_t ep_table_recv_begin(uint64_t r) { return 4u * r; }
EP_HD uint64_t ep_normal_count_record(uint64_t r, uint64_t p, uint64_t s) {
    return (p * r + s) * ep_count_record_bytes();
}
EP_HD uint64_t ep_normal_table(uint64_t r, uint64_t p) {
    return 2u * r * ep_count_record_bytes() + p * ep_table_bytes(r);
}
EP_HD uint64_t ep_normal_rows_base(uint64_t r) {
    return ep_align128(2u * r * ep_count_record_bytes() + 2u * ep_table_bytes(r));
}
EP_HD uint64_t ep_normal_half(uint64_t r, uint64_t data_bytes) {
    uint64_t base = ep_normal_rows_base(r);
    return data_bytes > base ? (data_bytes - base) / 256u * 128u : 0u;
}
EP_HD uint64_t ep_normal_dispatch_row(uint64_t r, uint64_t row, uint64_t drec) {
    return ep_normal_rows_base(r) + row * drec;
}
EP_HD uint64_t ep_normal_combine_row(uint64_t r, uint64_t data_bytes, uint64_t row, uint64_t yrec) {
    return ep_normal_rows_base(r) + ep_normal_half(r, data_bytes) + row * yrec;
}

/* Row records: dispatch [x][scales][src_idx, pad, topk_idx i64 xK, weights f32 xK]; combine [y][w]. */
EP_HD uint64_t ep_row_scales_offset(uint64_t hidden, uint64_t elem_bytes) { return ep_align16(hidden * elem_bytes); }
EP_HD uint64_t ep_row_meta_offset(uint64_t hidden, uint64_t elem_bytes, uint64_t num_scales) {
    return ep_row_scales_offset(hidden, elem_bytes) + ep_align16(4u * num_scales);
}
EP_HD uint64_t ep_row_topk_idx_offset(uint64_t hidden, uint64_t elem_bytes, uint64_t num_scales) {
    return ep_row_meta_offset(hidden, elem_bytes, num_scales) + EP_ROW_META_PAIR_BYTES;
}
EP_HD uint64_t ep_row_topk_weights_offset(uint64_t hidden, uint64_t elem_bytes, uint64_t num_scales, uint64_t k) {
    return ep_row_topk_idx_offset(hidden, elem_bytes, num_scales) + EP_ROW_TOPK_ID_BYTES * k;
}
EP_HD uint64_t ep_row_dispatch_record(uint64_t hidden, uint64_t elem_bytes, uint64_t num_scales, uint64_t k) {
    return ep_row_meta_offset(hidden, elem_bytes, num_scales) +
           ep_align16(EP_ROW_META_PAIR_BYTES + (EP_ROW_TOPK_ID_BYTES + EP_ROW_TOPK_WEIGHT_BYTES) * k);
}
EP_HD uint64_t ep_row_combine_record(uint64_t hidden, uint64_t k) { return ep_align16(2u * hidden) + ep_align16(4u * k); }

/* Final row of a token on its receiver: rpm[s-1][d] + cpm_s[d][c-1] + index in channel. */
EP_HD uint32_t ep_normal_final_row(uint32_t block_begin, uint32_t channel_start, uint32_t index) {
    return block_begin + channel_start + index;
}

/* ---- low-latency (docs/protocol.md §3) ------------------------------------------------------ */

EP_HD uint64_t ep_ll_signal_bytes(uint64_t r) { return ep_align128(EP_WORD_STRIDE * 4u * r * EP_LL_MAX_SEND_GROUPS); }
/* disp_sig[h][s][b]: send group b of source s. */
EP_HD uint64_t ep_ll_dispatch_signal(uint64_t r, uint64_t half, uint64_t s, uint64_t b) {
    return EP_WORD_STRIDE * ((half * r + s) * EP_LL_MAX_SEND_GROUPS + b);
}
/* comb_sig[h][d][b]: the partials of send group b's messages, from expert rank d. */
EP_HD uint64_t ep_ll_combine_signal(uint64_t r, uint64_t half, uint64_t d, uint64_t b) {
    return EP_WORD_STRIDE * (2u * r * EP_LL_MAX_SEND_GROUPS + (half * r + d) * EP_LL_MAX_SEND_GROUPS + b);
}
EP_HD uint64_t ep_ll_half(uint64_t op) { return op & 1u; }
/* Tokens [start, end) of send group b of g: the channel split. */
EP_HD void ep_ll_send_group(uint64_t t, uint64_t g, uint64_t b, uint64_t *start, uint64_t *end) {
    ep_channel_range(t, g, b, start, end);
}
EP_HD uint16_t ep_ll_data_qp(uint32_t run, uint16_t num_qps) {
    return num_qps <= 1u ? (uint16_t)0 : (uint16_t)((run + 1u) % (uint32_t)num_qps);
}

/* The layout for (R, L, H, N). */
typedef struct ep_ll_layout {
    uint64_t num_ranks;
    uint64_t num_local_experts;
    uint64_t hidden;
    uint64_t num_max_tokens;
} ep_ll_layout;

EP_HD uint64_t ep_ll_row(ep_ll_layout l) { return ep_align16(2u * l.hidden); }
EP_HD uint64_t ep_ll_fp8_scales_offset(ep_ll_layout l) { return ep_align16(l.hidden); }
/* One send group's header copy [first slot u32][messages from the source u32][c(l) u32 x L]; the header holds
   EP_LL_MAX_SEND_GROUPS of them, group b's at b * ep_ll_header_copy. */
EP_HD uint64_t ep_ll_header_copy(ep_ll_layout l) {
    return ep_align16(4u * (EP_LL_HEADER_COUNTS_WORD + l.num_local_experts));
}
/* Offset of send group b's header copy in a per-peer block (drecv[s], dsend_meta[d]). */
EP_HD uint64_t ep_ll_header_copy_at(ep_ll_layout l, uint64_t b) { return b * ep_ll_header_copy(l); }
EP_HD uint64_t ep_ll_header(ep_ll_layout l) { return EP_LL_MAX_SEND_GROUPS * ep_ll_header_copy(l); }
EP_HD uint64_t ep_ll_meta(ep_ll_layout l) {
    (void)l;
    return ep_align16(8u + EP_LL_META_ENTRY_BYTES * EP_LL_MAX_TOPK);
}
EP_HD uint64_t ep_ll_block(ep_ll_layout l) { return ep_ll_header(l) + l.num_max_tokens * ep_ll_meta(l); }
EP_HD uint64_t ep_ll_dsend_row(ep_ll_layout l, uint64_t t) { return t * ep_ll_row(l); }
EP_HD uint64_t ep_ll_dsend_meta(ep_ll_layout l, uint64_t d) {
    return l.num_max_tokens * ep_ll_row(l) + d * ep_ll_block(l);
}
EP_HD uint64_t ep_ll_drecv(ep_ll_layout l, uint64_t s) {
    return l.num_max_tokens * ep_ll_row(l) + l.num_ranks * ep_ll_block(l) +
           s * (ep_ll_block(l) + l.num_max_tokens * ep_ll_row(l));
}
EP_HD uint64_t ep_ll_drecv_row(ep_ll_layout l, uint64_t s, uint64_t i) {
    return ep_ll_drecv(l, s) + ep_ll_block(l) + i * ep_ll_row(l);
}
EP_HD uint64_t ep_ll_csend(ep_ll_layout l, uint64_t s, uint64_t i) { return (s * l.num_max_tokens + i) * ep_ll_row(l); }
EP_HD uint64_t ep_ll_crecv(ep_ll_layout l, uint64_t d, uint64_t i) {
    return l.num_ranks * l.num_max_tokens * ep_ll_row(l) + (d * l.num_max_tokens + i) * ep_ll_row(l);
}
EP_HD uint64_t ep_ll_cy(ep_ll_layout l, uint64_t e, uint64_t row) {
    return 2u * l.num_ranks * l.num_max_tokens * ep_ll_row(l) +
           (e * l.num_ranks * l.num_max_tokens + row) * 2u * l.hidden;
}
EP_HD uint64_t ep_ll_logfmt_meta(ep_ll_layout l) { return ep_align16(4u * (l.hidden / 128u)); }
EP_HD uint64_t ep_ll_csend_meta(ep_ll_layout l, uint64_t s, uint64_t i) {
    return ep_ll_cy(l, l.num_local_experts, 0) + (s * l.num_max_tokens + i) * ep_ll_logfmt_meta(l);
}
EP_HD uint64_t ep_ll_crecv_meta(ep_ll_layout l, uint64_t d, uint64_t i) {
    return ep_ll_csend_meta(l, l.num_ranks, 0) + (d * l.num_max_tokens + i) * ep_ll_logfmt_meta(l);
}
EP_HD uint64_t ep_ll_half_bytes(ep_ll_layout l) {
    uint64_t n = l.num_max_tokens, r = l.num_ranks, row = ep_ll_row(l), blk = ep_ll_block(l);
    uint64_t dispatch = n * row + r * blk + r * (blk + n * row);
    uint64_t combine = 2u * r * n * row + l.num_local_experts * r * n * 2u * l.hidden +
                       2u * r * n * ep_ll_logfmt_meta(l);
    return ep_align128(dispatch > combine ? dispatch : combine);
}
EP_HD uint64_t ep_ll_half_base(ep_ll_layout l, uint64_t h) { return h * ep_ll_half_bytes(l); }
EP_HD uint64_t ep_ll_total_bytes(ep_ll_layout l) {
    return ep_ll_signal_bytes(l.num_ranks) + 2u * ep_ll_half_bytes(l);
}

/* Meta entry (l u16, pos u16, w f32 bits), little-endian, as one u64. */
EP_HD uint64_t ep_ll_meta_entry(uint16_t l, uint16_t pos, uint32_t w_bits) {
    return (uint64_t)l | ((uint64_t)pos << 16) | ((uint64_t)w_bits << 32);
}

/* ... and its fields. */
EP_HD uint32_t ep_ll_entry_expert(uint64_t e) { return (uint32_t)(e & 0xffffu); }
EP_HD uint32_t ep_ll_entry_pos(uint64_t e) { return (uint32_t)((e >> 16) & 0xffffu); }
EP_HD uint32_t ep_ll_entry_weight_bits(uint64_t e) { return (uint32_t)(e >> 32); }

/* Head of a meta record (t u32, n u32), little-endian, as one u64; and its fields. */
EP_HD uint64_t ep_ll_meta_head(uint32_t t, uint32_t n) { return (uint64_t)t | ((uint64_t)n << 32); }
EP_HD uint32_t ep_ll_head_token(uint64_t h) { return (uint32_t)(h & 0xffffffffu); }
EP_HD uint32_t ep_ll_head_count(uint64_t h) { return (uint32_t)(h >> 32); }

/* packed_recv_layout_range entry: (begin << 32) | count (spec §2.4). */
EP_HD int64_t ep_pack_layout_range(uint32_t begin, uint32_t count) {
    return (int64_t)(((uint64_t)begin << 32) | (uint64_t)count);
}
EP_HD uint32_t ep_layout_range_begin(int64_t v) { return (uint32_t)((uint64_t)v >> 32); }
EP_HD uint32_t ep_layout_range_count(int64_t v) { return (uint32_t)((uint64_t)v & 0xffffffffu); }

#endif /* EP_PROTOCOL_CUH */
