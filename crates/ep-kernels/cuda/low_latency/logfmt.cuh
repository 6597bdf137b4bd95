// LogFMT-10 for the combine's partials (use_logfmt, docs/protocol.md §3.12; the codec is
// ep_logfmt.cuh's).
// Part of cuda/low_latency.cu (one translation unit): included there in order, after the parts
// it uses.
#pragma once

// ---- LogFMT-10 (use_logfmt: combine partials, ep_logfmt.cuh's codec) -----------------------------
//
// A partial's slot holds its chunks at their raw places (chunk g of 512 channels at byte 1024 g),
// a cast chunk in the first 10/8 of its place; its division metas (one u32 per 128 channels) sit
// in the slot's crecv_meta (docs/protocol.md §3.12). A warp's unit (4 x 32 lanes x 8 channels) is
// two whole chunks, so each unit decides and encodes its chunks alone.

// Lane `lane` holds channels [8c, 8c + 8) of a partial in `v` (valid: c < C). Returns its
// division's meta word (the 16 lanes of a half warp are one division); every lane calls it.
__device__ __forceinline__ uint32_t logfmt_division_meta(int4 v, bool valid) {
    const uint16_t *x = (const uint16_t *)&v;
    uint32_t hi = 0u, lo = 0xffffu;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const uint32_t b = ep_logfmt_abs_bits(x[j]);
        hi = b > hi ? b : hi;
        lo = b < lo ? b : lo;
    }
    if (!valid) hi = 0u, lo = 0xffffu;
#pragma unroll
    for (int o = 8; o >= 1; o /= 2) {
        hi = max(hi, __shfl_xor_sync(FULL, hi, o));
        lo = min(lo, __shfl_xor_sync(FULL, lo, o));
    }
    return ep_logfmt_meta_word(hi, lo);
}

// Encodes one unit of a partial (`out[k]`: chunk c = c0 + 32k + lane, c < C valid) into the slot
// at `slot` (raw places) and its metas at `metas`; returns, per chunk of the unit (bit j), whether
// it was cast. Every lane calls it.
__device__ uint32_t logfmt_store_unit(const int4 *out, uint32_t c0, uint32_t C, uint32_t lane, uint8_t *slot,
                                      uint32_t *metas) {
    uint32_t meta[UNITS];
    int castable[UNITS];
#pragma unroll
    for (uint32_t k = 0; k < UNITS; ++k) {
        const uint32_t c = c0 + k * 32 + lane;
        meta[k] = logfmt_division_meta(out[k], c < C);
        ep_logfmt_div p;
        castable[k] = c >= C || ep_logfmt_params(meta[k], &p);
        if (c < C && lane % 16 == 0) metas[c / 16] = meta[k];
    }
    uint32_t cast_bits = 0;
#pragma unroll
    for (uint32_t j = 0; j < UNITS / 2; ++j) {
        const bool cast = __all_sync(FULL, castable[2 * j] && castable[2 * j + 1]);
        if (cast) cast_bits |= 1u << j;
#pragma unroll
        for (uint32_t kk = 0; kk < 2; ++kk) {
            const uint32_t k = 2 * j + kk, c = c0 + k * 32 + lane;
            const uint16_t *x = (const uint16_t *)&out[k];
            if (!cast) {
                if (c < C) ((int4 *)slot)[c] = out[k];
                continue;
            }
            // A group of 16 values is two lanes' 8: the even lane packs both.
            ep_logfmt_div p;
            ep_logfmt_params(meta[k], &p);
            uint32_t codes[16], signs = 0;
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                codes[q] = ep_logfmt_code(x[q], &p);
                signs |= (uint32_t)(x[q] >> 15) << q;
            }
#pragma unroll
            for (int q = 0; q < 8; ++q) codes[8 + q] = __shfl_down_sync(FULL, codes[q], 1);
            signs |= __shfl_down_sync(FULL, signs, 1) << 8;
            if (c < C && lane % 2 == 0) {
                uint32_t w[EP_LOGFMT_GROUP_WORDS];
                ep_logfmt_pack16(codes, signs, w);
                const uint32_t chunk = c / 64, group = (c % 64) / 2;
                uint32_t *dst = (uint32_t *)(slot + ep_logfmt_chunk_place(chunk) + 4ull * EP_LOGFMT_GROUP_WORDS * group);
#pragma unroll
                for (uint32_t q = 0; q < EP_LOGFMT_GROUP_WORDS; ++q) dst[q] = w[q];
            }
        }
    }
    return cast_bits;
}

// Channels [8c, 8c + 8) of the partial in `slot` (metas at `metas`, H channels), as f32.
__device__ __forceinline__ void logfmt_load8(const uint8_t *slot, const uint32_t *metas, uint32_t c, uint32_t H,
                                             float *v) {
    const uint32_t chunk = c / 64, S = H / 128;
    bool cast = true;
    for (uint32_t dv = 4 * chunk; dv < min(4 * chunk + 4, S); ++dv) cast = cast && ep_logfmt_castable(__ldcg(&metas[dv]));
    if (!cast) {
        const int4 raw = ld_cg16(slot + 16ull * c);
        const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&raw;
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            float2 f = __bfloat1622float2(h2[x]);
            v[2 * x] = f.x;
            v[2 * x + 1] = f.y;
        }
        return;
    }
    ep_logfmt_div p;
    ep_logfmt_params(__ldcg(&metas[c / 16]), &p);
    const uint32_t group = (c % 64) / 2;
    const uint32_t *src = (const uint32_t *)(slot + ep_logfmt_chunk_place(chunk) + 4ull * EP_LOGFMT_GROUP_WORDS * group);
    uint32_t w[EP_LOGFMT_GROUP_WORDS];
#pragma unroll
    for (uint32_t q = 0; q < EP_LOGFMT_GROUP_WORDS; ++q) w[q] = __ldcg(&src[q]);
    float all[16];
    ep_logfmt_decode16(w, &p, all);
#pragma unroll
    for (int q = 0; q < 8; ++q) v[q] = all[8 * (c % 2) + q];
}
