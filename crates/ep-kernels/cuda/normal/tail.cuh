// The row record's tail: scales, meta pair, top-k ids and weights as the destination sees them.
// Part of cuda/normal.cu (one translation unit): included there in order, after the parts it
// uses.
#pragma once

// ---- the row record's tail -----------------------------------------------------------------------

// After a row's x part its record holds (§2.2, ep_protocol.cuh) the scales, the meta pair
// (src_idx, 0), the top-k ids and weights as the destination sees them, and zero padding: one
// contiguous run of 16-byte chunks from scales_off to the record's end (21 chunks at H = 7168
// FP8, top-8). A lane stores one chunk per destination — one store instruction where the scales,
// meta, ids and weights took five (the FP8 dispatch is bound by a block's requests in flight,
// not its bytes, at few SMs). Chunks [0, nsc) are scales (words past S zero), the rest meta words.
struct TailSrc {
    int4 sc;        // scale chunk `lane` (chunks 32 and up are loaded at store time)
    int64_t e;      // lane j < K: the token's top-k id j (else -1)
    float wt;       // ... and its weight
};

// Scale chunk q of token `tok`: words 4q..4q+3 of its S scales, zero past S; one 16-byte load
// when the rows are 16-byte aligned (`vec`: x_scales aligned, S a multiple of 4).
__device__ __forceinline__ int4 scale_chunk(const Args &a, uint64_t tok, uint32_t q, bool vec) {
    const uint32_t S = (uint32_t)a.num_scales;
    const float *row = (const float *)a.x_scales + tok * S;
    if (vec) return 4u * q < S ? *(const int4 *)(row + 4u * q) : make_int4(0, 0, 0, 0);
    int w[4];
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) w[i] = 4u * q + i < S ? __float_as_int(row[4u * q + i]) : 0;
    return make_int4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ TailSrc tail_load(const Args &a, uint64_t tok, uint32_t lane, uint32_t nsc, bool vec,
                                             bool topk) {
    TailSrc t;
    t.sc = lane < nsc ? scale_chunk(a, tok, lane, vec) : make_int4(0, 0, 0, 0);
    t.e = -1;
    t.wt = 0.0f;
    if (topk && lane < (uint32_t)a.num_topk) {
        t.e = ((const int64_t *)a.topk_idx)[tok * a.num_topk + lane];
        t.wt = ((const float *)a.topk_weights)[tok * a.num_topk + lane];
    }
    return t;
}

// Which tail a kernel stores: the ceiling the scales only (the bytes DeepEP counts), a dispatch
// without top-k the scales and the meta pair (its ids and weights are left as they are), a
// dispatch with top-k all of it.
enum TailParts { TAIL_SCALES, TAIL_META, TAIL_ALL };

// The tail's meta part in 4-byte words, from ep_protocol.cuh's field sizes (folded at compile
// time: the per-row, per-destination loop below cannot afford run-time offsets, BENCHMARKS.md
// 2026-12-06): the meta pair, then K ids of ID_WORDS words (lo, hi), then K weights of one word.
constexpr uint32_t META_PAIR_WORDS = EP_ROW_META_PAIR_BYTES / 4u;
constexpr uint32_t META_ID_WORDS = EP_ROW_TOPK_ID_BYTES / 4u;
static_assert(META_PAIR_WORDS * 4u == EP_ROW_META_PAIR_BYTES && META_ID_WORDS == 2u &&
                  EP_ROW_TOPK_WEIGHT_BYTES == 4u,
              "tail_store packs i64 ids as two words and f32 weights as one");

// Word m of the tail's meta part on destination d, whose local experts are [lo, lo + L): (ee,
// ww) is the entry that word comes from (meta_entry).
__device__ __forceinline__ int32_t meta_word(uint32_t m, uint32_t K, int32_t tok, int64_t ee, float ww, int64_t lo,
                                             int64_t L) {
    const bool local = ee >= lo && ee < lo + L;
    if (m == 0) return tok;  // src_idx, the pair's first word; its second is zero
    if (m < META_PAIR_WORDS) return 0;
    if (m < META_PAIR_WORDS + META_ID_WORDS * K) {
        const int64_t id = local ? ee - lo : -1;
        return (int32_t)((m - META_PAIR_WORDS) & 1u ? (uint64_t)id >> 32 : (uint64_t)id);
    }
    if (m < META_PAIR_WORDS + (META_ID_WORDS + 1u) * K) return local ? __float_as_int(ww) : 0;
    return 0;
}

// The top-k entry whose id or weight meta word m holds (0 for the pair and the padding).
__device__ __forceinline__ uint32_t meta_entry(uint32_t m, uint32_t K) {
    return m < META_PAIR_WORDS                    ? 0u
           : m < META_PAIR_WORDS + META_ID_WORDS * K ? (m - META_PAIR_WORDS) >> 1
                                                   : m - META_PAIR_WORDS - META_ID_WORDS * K;
}

// Stores the tail of token `tok` (loaded by tail_load) to every non-null destination d < n_dst
// (lane_dst(mine, d)): chunk q = lane + 32i, nch chunks, each lane building its meta words from
// the lanes holding their entries (shuffles, once per chunk pass, every lane taking part).
template <TailParts P>
__device__ __forceinline__ void tail_store(const Args &a, const TailSrc &t, uint8_t *mine, uint32_t n_dst,
                                           uint64_t tok, uint32_t lane, uint64_t scales_off, uint32_t nsc,
                                           uint32_t nch, bool vec) {
    const uint32_t K = (uint32_t)a.num_topk;
    const int64_t L = (int64_t)a.num_local_experts;
    const uint32_t n = P == TAIL_SCALES ? nsc : nch;
    for (uint32_t q0 = 0; q0 < n; q0 += 32) {
        const uint32_t q = q0 + lane;
        const int4 sv = q0 == 0 ? t.sc : q < nsc ? scale_chunk(a, tok, q, vec) : make_int4(0, 0, 0, 0);
        int64_t ee[4];
        float ww[4];
#pragma unroll
        for (uint32_t i = 0; i < 4; ++i) {
            const uint32_t m = q >= nsc ? 4u * (q - nsc) + i : 0u;
            const uint32_t j = meta_entry(m, K);
            ee[i] = __shfl_sync(0xffffffffu, t.e, j & 31u);
            ww[i] = __shfl_sync(0xffffffffu, t.wt, j & 31u);
        }
#pragma unroll 1
        for (uint32_t d = 0; d < n_dst; ++d) {
            uint8_t *out = lane_dst(mine, d);  // every lane shuffles before any skips
            if (!out || q >= n) continue;
            int4 *dst = (int4 *)(out + scales_off + 16u * q);
            if (q < nsc) {
                *dst = sv;
            } else if (P == TAIL_ALL) {
                const int64_t lo = (int64_t)d * L;
                const uint32_t m = 4u * (q - nsc);
                *dst = make_int4(meta_word(m, K, (int32_t)tok, ee[0], ww[0], lo, L),
                                 meta_word(m + 1, K, (int32_t)tok, ee[1], ww[1], lo, L),
                                 meta_word(m + 2, K, (int32_t)tok, ee[2], ww[2], lo, L),
                                 meta_word(m + 3, K, (int32_t)tok, ee[3], ww[3], lo, L));
            } else if (q == nsc) {
                *(int2 *)dst = make_int2((int32_t)tok, 0);
            }
        }
    }
}
