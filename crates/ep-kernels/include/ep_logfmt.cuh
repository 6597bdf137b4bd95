/*
 * ep_logfmt.cuh — LogFMT-10, the lossy log-domain payload of low-latency combine (spec §2.6,
 * `use_logfmt`), for CUDA kernels and for the host.
 *
 * The rule is `ep_core::numerics::logfmt` (its module docs define it); this header mirrors it
 * function for function, and `tests/logfmt_rules.rs` checks the host build of this header
 * against the Rust codec bit for bit through the shim of build.rs. In short:
 *
 *   division = 128 channels: meta word = amax_bits | amin_bits << 16 (BF16 bits of max/min |x|,
 *     taken on the bits & 0x7fff as integers, so NaN/inf give amax >= 1);
 *     castable iff 0 < amax < 1 and log_amin < log_amax, log_amin = max(log2 amin, log_amax - 32);
 *   chunk = 512 channels (4 divisions; shorter at the end of the row): cast iff every division
 *     is castable, else raw BF16;
 *   value = sign + 9-bit code, code 0 = zero, code c >= 1 = 2^(log_amin + (c-1) step),
 *     step = (log_amax - log_amin)/510, code = min(511, floor(max(fma(log2|x| - log_amin,
 *     1/step, 2 - log2((1 + 2^step)/2)/step), 0))) (nearest in the linear domain);
 *   16 values = 5 u32: code i at bits 9i..9i+8 of the 160-bit little-endian number, sign i at
 *     bit 16+i of word 4;
 *   message = S = H/128 meta words, zero padding to align16(4S), then the chunks back to back
 *     (cast: 10*channels/8 bytes, raw: 2*channels bytes); slot = align16(4S) + 2H.
 *
 * log2 and exp2 are ours (IEEE add/mul/div/fma only; every multiply through ep_lf_mul, which
 * no compiler fuses into a later add, every fused multiply-add an explicit fmaf), so host C,
 * CUDA and Rust agree on every bit. On the device that needs denormals kept: no
 * --use_fast_math / -ftz=true (nvcc's default is -ftz=false); divisions are __fdiv_rn whatever
 * -prec-div says.
 *
 * Plain C-compatible inline functions (uint16_t BF16 bits, uint32_t words, float); nothing from
 * the C++ standard library.
 */
#ifndef EP_LOGFMT_CUH
#define EP_LOGFMT_CUH

#include <math.h>
#include <stdint.h>

#ifndef EP_HD
#ifdef __CUDACC__
#define EP_HD __host__ __device__ __forceinline__
#else
#define EP_HD static inline
#endif
#endif

#define EP_LOGFMT_DIVISION 128u   /* channels per meta word */
#define EP_LOGFMT_CHUNK 512u      /* channels per cast decision */
#define EP_LOGFMT_GROUP 16u       /* values per packed group */
#define EP_LOGFMT_GROUP_WORDS 5u  /* u32 words per packed group */
#define EP_LOGFMT_MAX_CODE 511u

/* The code grid of a cast division (ep_core::numerics::logfmt::Params). */
typedef struct ep_logfmt_div {
    float log_amin; /* log2 of the value of code 1 */
    float step;     /* (log_amax - log_amin) / 510 */
    float inv_step; /* 510 / (log_amax - log_amin) */
    float bias;     /* 2 - log2((1 + 2^step)/2) / step */
} ep_logfmt_div;

/* ---- bits ---------------------------------------------------------------------------------- */

EP_HD uint32_t ep_lf_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    union { float f; uint32_t u; } v;
    v.f = x;
    return v.u;
#endif
}

EP_HD float ep_lf_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    union { float f; uint32_t u; } v;
    v.u = u;
    return v.f;
#endif
}

/* A multiply that is never fused into a later add (nvcc and GCC contract a*b + c into an fma
 * across inlined calls, e.g. 1 + exp2(step)); every float multiply of the rule goes through it. */
#if defined(__CUDA_ARCH__)
EP_HD float ep_lf_mul(float a, float b) { return __fmul_rn(a, b); }
#elif defined(__GNUC__)
__attribute__((noinline)) static float ep_lf_mul(float a, float b) { return a * b; }
#else
EP_HD float ep_lf_mul(float a, float b) { return a * b; }
#endif

/* IEEE division even under -prec-div=false. */
EP_HD float ep_lf_div(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

EP_HD float ep_lf_bf16_to_float(uint16_t b) { return ep_lf_float((uint32_t)b << 16); }

/* ---- deterministic log2 / exp2 ------------------------------------------------------------- */

/* log2(x) for x >= 0 finite (subnormals included), -inf for 0: x = 2^e m, m in [sqrt2/2, sqrt2),
 * atanh series in u = (m-1)/(m+1) to u^9. Same bits as logfmt::log2. */
EP_HD float ep_logfmt_log2(float x) {
    uint32_t xb = ep_lf_bits(x);
    int subnormal = xb < 0x00800000u;
    uint32_t b = ep_lf_bits(subnormal ? ep_lf_mul(x, 16777216.0f) : x);
    int big = (b & 0x007fffffu) > 0x003504f3u;
    int e = (int)(b >> 23) - 127 - (subnormal ? 24 : 0) + big;
    float m = ep_lf_float((b & 0x007fffffu) | (big ? 0x3f000000u : 0x3f800000u));
    float u = ep_lf_div(m - 1.0f, m + 1.0f);
    float s = ep_lf_mul(u, u);
    float p = fmaf(s, 0x1.484b14p-2f, 0x1.a61762p-2f); /* 2/(9 ln2), 2/(7 ln2) */
    p = fmaf(p, s, 0x1.2776c6p-1f);                    /* 2/(5 ln2) */
    p = fmaf(p, s, 0x1.ec709ep-1f);                    /* 2/(3 ln2) */
    p = fmaf(p, s, 0x1.715476p+1f);                    /* 2/ln2 */
    float r = fmaf(u, p, (float)e);
    return xb == 0u ? ep_lf_float(0xff800000u) : r;
}

/* 2^e for integer -126 <= e <= 127. */
EP_HD float ep_lf_pow2i(int e) { return ep_lf_float((uint32_t)(e + 127) << 23); }

/* 2^t, t clamped to [-252, 127]: n = rint(t), Taylor series of 2^(t-n) to degree 7, two exact
 * power-of-two factors. Same bits as logfmt::exp2. */
EP_HD float ep_logfmt_exp2(float t) {
    t = fminf(fmaxf(t, -252.0f), 127.0f);
    float n = rintf(t);
    float g = t - n;
    float p = fmaf(0x1.ffcbfcp-17f, g, 0x1.430912p-13f); /* ln2^7/7!, ln2^6/6! */
    p = fmaf(p, g, 0x1.5d87fep-10f);
    p = fmaf(p, g, 0x1.3b2ab6p-7f);
    p = fmaf(p, g, 0x1.c6b08ep-5f);
    p = fmaf(p, g, 0x1.ebfbe0p-3f);
    p = fmaf(p, g, 0x1.62e430p-1f);
    p = fmaf(p, g, 1.0f);
    int ni = (int)n;
    int a = ni / 2;
    return ep_lf_mul(ep_lf_mul(p, ep_lf_pow2i(a)), ep_lf_pow2i(ni - a));
}

/* ---- division meta and grid ---------------------------------------------------------------- */

/* |x| as ordered BF16 bits: max/min of these over a division (e.g. __reduce_max_sync /
 * __reduce_min_sync on a warp) give amax/amin. */
EP_HD uint32_t ep_logfmt_abs_bits(uint16_t x) { return (uint32_t)x & 0x7fffu; }

EP_HD uint32_t ep_logfmt_meta_word(uint32_t amax_bits, uint32_t amin_bits) {
    return (amax_bits & 0xffffu) | (amin_bits & 0xffffu) << 16;
}

/* The meta word of n values (a division is 128); the serial reference. */
EP_HD uint32_t ep_logfmt_division_meta(const uint16_t *x, uint32_t n) {
    uint32_t hi = 0u, lo = n == 0u ? 0u : 0xffffu;
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t a = ep_logfmt_abs_bits(x[i]);
        hi = a > hi ? a : hi;
        lo = a < lo ? a : lo;
    }
    return ep_logfmt_meta_word(hi, lo);
}

/* The grid of the division with meta word `meta`; returns 1 if it is castable, else 0 (and
 * *p is zeroed). */
EP_HD int ep_logfmt_params(uint32_t meta, ep_logfmt_div *p) {
    uint32_t amax_bits = meta & 0xffffu;
    float lmax = ep_logfmt_log2(ep_lf_bf16_to_float((uint16_t)amax_bits));
    float lmin = fmaxf(ep_logfmt_log2(ep_lf_bf16_to_float((uint16_t)(meta >> 16))), lmax - 32.0f);
    int cast = amax_bits != 0u && amax_bits < 0x3f80u && lmin < lmax;
    float range = lmax - lmin;
    float step = ep_lf_div(range, 510.0f);
    float inv_step = ep_lf_div(510.0f, range);
    float mid = ep_logfmt_log2(ep_lf_mul(1.0f + ep_logfmt_exp2(step), 0.5f));
    p->log_amin = cast ? lmin : 0.0f;
    p->step = cast ? step : 0.0f;
    p->inv_step = cast ? inv_step : 0.0f;
    p->bias = cast ? fmaf(-mid, inv_step, 2.0f) : 0.0f;
    return cast;
}

EP_HD int ep_logfmt_castable(uint32_t meta) {
    ep_logfmt_div p;
    return ep_logfmt_params(meta, &p);
}

/* ---- values -------------------------------------------------------------------------------- */

/* The 9-bit code of |x| (x = BF16 bits; the sign travels apart). */
EP_HD uint32_t ep_logfmt_code(uint16_t x, const ep_logfmt_div *p) {
    float lx = ep_logfmt_log2(ep_lf_bf16_to_float((uint16_t)(x & 0x7fffu)));
    float y = fmaf(lx - p->log_amin, p->inv_step, p->bias);
    return (uint32_t)fminf(floorf(fmaxf(y, 0.0f)), 511.0f);
}

/* The magnitude code c stands for: 0 for 0, else 2^(log_amin + (c-1) step). */
EP_HD float ep_logfmt_magnitude(uint32_t code, const ep_logfmt_div *p) {
    float t = fmaf((float)(code > 0u ? code - 1u : 0u), p->step, p->log_amin);
    float v = ep_logfmt_exp2(t);
    return code == 0u ? 0.0f : v;
}

/* Packs 16 codes (low 9 bits used) and 16 sign bits (bit i = value i) into w[5]. */
EP_HD void ep_logfmt_pack16(const uint32_t *codes, uint32_t signs, uint32_t *w) {
    uint32_t o[EP_LOGFMT_GROUP_WORDS] = {0u, 0u, 0u, 0u, 0u};
    for (uint32_t i = 0; i < EP_LOGFMT_GROUP; ++i) {
        uint32_t bit = 9u * i, word = bit / 32u, shift = bit % 32u;
        uint64_t v = (uint64_t)(codes[i] & 0x1ffu) << shift;
        o[word] |= (uint32_t)v;
        if (word + 1u < EP_LOGFMT_GROUP_WORDS) o[word + 1u] |= (uint32_t)(v >> 32);
    }
    o[4] |= (signs & 0xffffu) << 16;
    for (uint32_t j = 0; j < EP_LOGFMT_GROUP_WORDS; ++j) w[j] = o[j];
}

/* Code i of a packed group. */
EP_HD uint32_t ep_logfmt_unpack_code(const uint32_t *w, uint32_t i) {
    uint32_t bit = 9u * i, word = bit / 32u, shift = bit % 32u;
    uint64_t hi = word + 1u < EP_LOGFMT_GROUP_WORDS ? w[word + 1u] : 0u;
    return (uint32_t)(((hi << 32) | w[word]) >> shift) & 0x1ffu;
}

/* Encodes 16 consecutive values (BF16 bits) of a cast division into w[5]. */
EP_HD void ep_logfmt_encode16(const uint16_t *x, const ep_logfmt_div *p, uint32_t *w) {
    uint32_t codes[EP_LOGFMT_GROUP];
    uint32_t signs = 0u;
    for (uint32_t i = 0; i < EP_LOGFMT_GROUP; ++i) {
        codes[i] = ep_logfmt_code(x[i], p);
        signs |= (uint32_t)(x[i] >> 15) << i;
    }
    ep_logfmt_pack16(codes, signs, w);
}

/* Decodes w[5] into 16 floats (code 0 gives a zero with its sign). */
EP_HD void ep_logfmt_decode16(const uint32_t *w, const ep_logfmt_div *p, float *out) {
    for (uint32_t i = 0; i < EP_LOGFMT_GROUP; ++i) {
        float m = ep_logfmt_magnitude(ep_logfmt_unpack_code(w, i), p);
        out[i] = ep_lf_float(ep_lf_bits(m) | ((w[4] >> (16u + i)) & 1u) << 31);
    }
}

/* ---- the message of one row ---------------------------------------------------------------- */

EP_HD uint64_t ep_logfmt_num_divisions(uint64_t h) { return h / EP_LOGFMT_DIVISION; }
EP_HD uint64_t ep_logfmt_data_offset(uint64_t h) { return (4u * (h / EP_LOGFMT_DIVISION) + 15u) / 16u * 16u; }
/* Offset of chunk `k` inside a combine partial's slot: its raw place, 2 bytes a channel
 * (docs/protocol.md §3.12; ep_core::protocol::layout::ll_logfmt_chunk_place). */
EP_HD uint64_t ep_logfmt_chunk_place(uint64_t k) { return 2u * EP_LOGFMT_CHUNK * k; }
EP_HD uint64_t ep_logfmt_num_chunks(uint64_t h) { return (h + EP_LOGFMT_CHUNK - 1u) / EP_LOGFMT_CHUNK; }
/* Channels of chunk k; it starts at channel 512 k. */
EP_HD uint64_t ep_logfmt_chunk_channels(uint64_t h, uint64_t k) {
    uint64_t start = k * EP_LOGFMT_CHUNK < h ? k * EP_LOGFMT_CHUNK : h;
    return h - start < EP_LOGFMT_CHUNK ? h - start : EP_LOGFMT_CHUNK;
}
EP_HD uint64_t ep_logfmt_chunk_bytes(uint64_t channels, int cast) { return cast ? channels * 10u / 8u : channels * 2u; }
/* The receive slot: every chunk raw. */
EP_HD uint64_t ep_logfmt_max_bytes(uint64_t h) { return ep_logfmt_data_offset(h) + 2u * h; }
/* What DeepEP's test counts per selection (spec §6.4): 10H/8 + 4H/128. */
EP_HD uint64_t ep_logfmt_deepep_bytes(uint64_t h) { return 10u * h / 8u + h / EP_LOGFMT_DIVISION * 4u; }

/* Whether chunk k is cast, from the row's meta words. */
EP_HD int ep_logfmt_chunk_cast(const uint32_t *meta, uint64_t h, uint64_t k) {
    uint64_t first = k * EP_LOGFMT_CHUNK / EP_LOGFMT_DIVISION;
    uint64_t n = ep_logfmt_chunk_channels(h, k) / EP_LOGFMT_DIVISION;
    int cast = 1;
    for (uint64_t d = 0; d < n; ++d) cast &= ep_logfmt_castable(meta[first + d]);
    return cast;
}

/* Offset of chunk k in the message; k = num_chunks gives the message's size. */
EP_HD uint64_t ep_logfmt_chunk_offset(const uint32_t *meta, uint64_t h, uint64_t k) {
    uint64_t at = ep_logfmt_data_offset(h);
    for (uint64_t j = 0; j < k; ++j)
        at += ep_logfmt_chunk_bytes(ep_logfmt_chunk_channels(h, j), ep_logfmt_chunk_cast(meta, h, j));
    return at;
}

EP_HD uint64_t ep_logfmt_message_bytes(const uint32_t *meta, uint64_t h) {
    return ep_logfmt_chunk_offset(meta, h, ep_logfmt_num_chunks(h));
}

EP_HD void ep_lf_put32(uint8_t *b, uint32_t v) {
    b[0] = (uint8_t)v; b[1] = (uint8_t)(v >> 8); b[2] = (uint8_t)(v >> 16); b[3] = (uint8_t)(v >> 24);
}
EP_HD uint32_t ep_lf_get32(const uint8_t *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* The meta words of an encoded message (little-endian u32 at its start), for chunk_offset. */
EP_HD uint32_t ep_logfmt_meta_at(const uint8_t *msg, uint64_t d) { return ep_lf_get32(msg + 4u * d); }

/* Serial reference encoder of one row of h BF16 values (h % 128 == 0) into out (a slot of
 * ep_logfmt_max_bytes(h)); returns the message size. The meta words are written first and the
 * chunk decisions read back from them, exactly as a receiver sees them. */
EP_HD uint64_t ep_logfmt_encode_row(const uint16_t *x, uint64_t h, uint8_t *out) {
    uint64_t s = ep_logfmt_num_divisions(h);
    for (uint64_t d = 0; d < s; ++d) ep_lf_put32(out + 4u * d, ep_logfmt_division_meta(x + d * EP_LOGFMT_DIVISION, EP_LOGFMT_DIVISION));
    for (uint64_t i = 4u * s; i < ep_logfmt_data_offset(h); ++i) out[i] = 0u;
    uint64_t at = ep_logfmt_data_offset(h);
    for (uint64_t k = 0; k < ep_logfmt_num_chunks(h); ++k) {
        uint64_t c0 = k * EP_LOGFMT_CHUNK, n = ep_logfmt_chunk_channels(h, k);
        int cast = 1;
        for (uint64_t d = c0 / EP_LOGFMT_DIVISION; d < (c0 + n) / EP_LOGFMT_DIVISION; ++d)
            cast &= ep_logfmt_castable(ep_logfmt_meta_at(out, d));
        if (cast) {
            for (uint64_t g = c0; g < c0 + n; g += EP_LOGFMT_GROUP) {
                ep_logfmt_div p;
                uint32_t w[EP_LOGFMT_GROUP_WORDS];
                ep_logfmt_params(ep_logfmt_meta_at(out, g / EP_LOGFMT_DIVISION), &p);
                ep_logfmt_encode16(x + g, &p, w);
                for (uint32_t j = 0; j < EP_LOGFMT_GROUP_WORDS; ++j, at += 4u) ep_lf_put32(out + at, w[j]);
            }
        } else {
            for (uint64_t c = c0; c < c0 + n; ++c, at += 2u) {
                out[at] = (uint8_t)x[c];
                out[at + 1u] = (uint8_t)(x[c] >> 8);
            }
        }
    }
    return at;
}

/* Serial reference decoder: h floats (what the receiver accumulates) from a message. */
EP_HD void ep_logfmt_decode_row(const uint8_t *msg, uint64_t h, float *out) {
    uint64_t at = ep_logfmt_data_offset(h);
    for (uint64_t k = 0; k < ep_logfmt_num_chunks(h); ++k) {
        uint64_t c0 = k * EP_LOGFMT_CHUNK, n = ep_logfmt_chunk_channels(h, k);
        int cast = 1;
        for (uint64_t d = c0 / EP_LOGFMT_DIVISION; d < (c0 + n) / EP_LOGFMT_DIVISION; ++d)
            cast &= ep_logfmt_castable(ep_logfmt_meta_at(msg, d));
        if (cast) {
            for (uint64_t g = c0; g < c0 + n; g += EP_LOGFMT_GROUP) {
                ep_logfmt_div p;
                uint32_t w[EP_LOGFMT_GROUP_WORDS];
                ep_logfmt_params(ep_logfmt_meta_at(msg, g / EP_LOGFMT_DIVISION), &p);
                for (uint32_t j = 0; j < EP_LOGFMT_GROUP_WORDS; ++j, at += 4u) w[j] = ep_lf_get32(msg + at);
                ep_logfmt_decode16(w, &p, out + g);
            }
        } else {
            for (uint64_t c = c0; c < c0 + n; ++c, at += 2u)
                out[c] = ep_lf_bf16_to_float((uint16_t)(msg[at] | msg[at + 1u] << 8));
        }
    }
}

#endif
