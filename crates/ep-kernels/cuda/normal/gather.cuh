// Gathers: a token's rows from the ranks holding them, reduced (the combine) or XORed (its
// ceiling).
// Part of cuda/normal.cu (one translation unit): included there in order, after the parts it
// uses.
#pragma once

// ---- gathers (combine and its ceiling) ----------------------------------------------------------

// A warp gathers the n <= NS source rows of a token, 16 bytes x U per lane and source a pass,
// and stores op's combination of each pass to out. NS = 2 keeps two passes of U = 2 in flight
// (as warp_copy_fanout: 8 loads per lane at n = 2); NS = MAXR one pass of n loads. Two variants
// only, and no more than that: their registers add up in the kernel (with U = 2 at NS = MAXR, a
// third variant NS = 4, or nine exact-n ones, the combine spilled; the two unchecked NS = 2
// loops of gather_n, n = 1 and n = 2, fit: 128 registers, no spill). CHECKED compares every
// 16-byte access with `bytes` (any multiple of 16); without it `bytes` is a whole number of
// passes (gather_n decides) and the loop carries no per-access test.
template <int NS> struct Gather {
    static constexpr int U = NS <= 2 ? 2 : 1;
    static constexpr bool TWO = NS <= 2;  // two passes in flight
    static constexpr uint64_t STEP = 32ull * 16 * U;  // bytes of a warp's pass
};

template <int NS, bool CHECKED>
__device__ __forceinline__ void gather_load(int4 (&v)[NS][Gather<NS>::U], const uint8_t *const (&src)[MAXR],
                                            uint32_t n, uint64_t base, uint64_t bytes) {
#pragma unroll
    for (int i = 0; i < NS; ++i)
#pragma unroll
        for (int u = 0; u < Gather<NS>::U; ++u) {
            const uint64_t off = base + (uint64_t)u * 32 * 16;
            if (i < (int)n && (!CHECKED || off < bytes)) v[i][u] = ep_ld_cg((const int4 *)(src[i] + off));
        }
}

template <int NS, bool CHECKED, class Op>
__device__ __forceinline__ void gather_store(const int4 (&v)[NS][Gather<NS>::U], uint32_t n, uint8_t *out,
                                             uint64_t base, uint64_t bytes, const Op &op) {
#pragma unroll
    for (int u = 0; u < Gather<NS>::U; ++u) {
        const uint64_t off = base + (uint64_t)u * 32 * 16;
        if (!CHECKED || off < bytes) *(int4 *)(out + off) = op.template apply<NS>(v, n, u, off);
    }
}

template <int NS, bool CHECKED, class Op>
__device__ __forceinline__ void gather_token(const uint8_t *const (&src)[MAXR], uint32_t n, uint8_t *out,
                                             uint64_t bytes, uint32_t lane, const Op &op) {
    constexpr uint64_t step = Gather<NS>::STEP;
    int4 va[NS][Gather<NS>::U];
    uint64_t base = (uint64_t)lane * 16;
    if constexpr (!Gather<NS>::TWO) {
        for (; base < bytes; base += step) {
            gather_load<NS, CHECKED>(va, src, n, base, bytes);
            gather_store<NS, CHECKED>(va, n, out, base, bytes, op);
        }
        return;
    }
    int4 vb[NS][Gather<NS>::U];
    if constexpr (!CHECKED) {
        // Whole passes: a pass's loads are issued only when it exists (one uniform test per pass,
        // not one per access); `end` is the lane's first offset past the row.
        const uint64_t end = bytes + base;
        gather_load<NS, false>(va, src, n, base, bytes);
        for (;;) {
            const bool more = base + step < end;
            if (more) gather_load<NS, false>(vb, src, n, base + step, bytes);
            gather_store<NS, false>(va, n, out, base, bytes, op);
            if (!more) break;
            base += step;
            const bool more2 = base + step < end;
            if (more2) gather_load<NS, false>(va, src, n, base + step, bytes);
            gather_store<NS, false>(vb, n, out, base, bytes, op);
            if (!more2) break;
            base += step;
        }
        return;
    }
    gather_load<NS, true>(va, src, n, base, bytes);
    while (base < bytes) {
        gather_load<NS, true>(vb, src, n, base + step, bytes);
        gather_store<NS, true>(va, n, out, base, bytes, op);
        base += step;
        if (base >= bytes) break;
        gather_load<NS, true>(va, src, n, base + step, bytes);
        gather_store<NS, true>(vb, n, out, base, bytes, op);
        base += step;
    }
}

// gather_token for a token held by n ranks (src[0..n), n <= MAXR), every access checked.
template <class Op>
__device__ __forceinline__ void gather_checked(const uint8_t *const (&src)[MAXR], uint32_t n, uint8_t *out,
                                               uint64_t bytes, uint32_t lane, const Op &op) {
    if (n <= 2)
        gather_token<2, true>(src, n, out, bytes, lane, op);
    else
        gather_token<MAXR, true>(src, n, out, bytes, lane, op);
}

// The combine's gather: a row of whole passes held by one or two ranks (R = 2's case; 2H is a
// multiple of the 1 KiB pass at every hidden size DeepEP uses) takes a loop with n a constant
// and no bounds tests — measured on the H200 (R = 2, DeepEP's shape), the reduce phase 288 ->
// 259 us at 8 SMs per rank, 122 -> 116 us at 24: the 8-SM combine was bound by the
// instructions between a warp's passes (docs/normal-combine-pulled.md). Not for the ceiling's
// XOR: in that loop ptxas schedules the XOR of a pass before the next pass's loads (one pass in
// flight instead of two; its 8-SM gather measured 472 -> 382 GB/s), so the ceiling keeps
// gather_checked, the faster loop for its op.
template <class Op>
__device__ __forceinline__ void gather_n(const uint8_t *const (&src)[MAXR], uint32_t n, uint8_t *out,
                                         uint64_t bytes, uint32_t lane, const Op &op) {
    const bool whole = bytes % Gather<2>::STEP == 0;
    if (whole && n == 2)
        gather_token<2, false>(src, 2u, out, bytes, lane, op);
    else if (whole && n == 1)
        gather_token<2, false>(src, 1u, out, bytes, lane, op);
    else
        gather_checked(src, n, out, bytes, lane, op);
}

// bf16 -> f32 of both halves of a word (exact): the low element is the word shifted up, the
// high one the word with its low half cleared (one instruction each; __bfloat162float of a
// high half is two).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4 &v) {
    const uint32_t w[4] = {(uint32_t)v.x, (uint32_t)v.y, (uint32_t)v.z, (uint32_t)v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        acc[2 * q] += bf16_lo(w[q]);
        acc[2 * q + 1] += bf16_hi(w[q]);
    }
}

// The combine's reduction of a pass (§2.6): bf16(f32(b0) + f32(b1) + f32(src[0]) + ... +
// f32(src[n-1])), element by element in that order (an absent bias reads as +0.0).
struct SumBf16 {
    const uint8_t *b0, *b1;  // this token's bias rows, or null
    template <int NS>
    __device__ __forceinline__ int4 apply(const int4 (&v)[NS][Gather<NS>::U], uint32_t n, int u, uint64_t off) const {
        float acc[8];
        if (b0 == nullptr && b1 == nullptr) {
            // (+0.0) + (+0.0) is +0.0: the same bits as the general case, 16 conversions and 8
            // adds fewer per 16 bytes (the combine's arithmetic is on its critical path).
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
        } else {
            const int4 v0 = b0 ? *(const int4 *)(b0 + off) : make_int4(0, 0, 0, 0);
            const int4 v1 = b1 ? *(const int4 *)(b1 + off) : make_int4(0, 0, 0, 0);
            const uint32_t w0[4] = {(uint32_t)v0.x, (uint32_t)v0.y, (uint32_t)v0.z, (uint32_t)v0.w};
            const uint32_t w1[4] = {(uint32_t)v1.x, (uint32_t)v1.y, (uint32_t)v1.z, (uint32_t)v1.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                acc[2 * q] = bf16_lo(w0[q]) + bf16_lo(w1[q]);
                acc[2 * q + 1] = bf16_hi(w0[q]) + bf16_hi(w1[q]);
            }
        }
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            if (i >= (int)n) break;
            add_bf16x8(acc, v[i][u]);
        }
        int4 o;
        __nv_bfloat162 *po = (__nv_bfloat162 *)&o;
#pragma unroll
        for (int q = 0; q < 4; ++q) po[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
        return o;
    }
};

// The combine ceiling's pass: the bitwise XOR of the sources (the byte pattern, no arithmetic).
struct XorRows {
    template <int NS>
    __device__ __forceinline__ int4 apply(const int4 (&v)[NS][Gather<NS>::U], uint32_t n, int u, uint64_t) const {
        int4 o = make_int4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < NS; ++i) {
            if (i >= (int)n) break;
            o.x ^= v[i][u].x; o.y ^= v[i][u].y; o.z ^= v[i][u].z; o.w ^= v[i][u].w;
        }
        return o;
    }
};

// The ranks holding a token, ascending, as pointers src[0..n): lane d < R holds the token's row
// on d (-1: none); ptr(d, row) gives its address. Built with constant indices only, so src stays
// in registers (a src[n++] store is an indexed local-memory array).
template <class Ptr>
__device__ __forceinline__ uint32_t holders(int32_t my_row, uint32_t R, const uint8_t *(&src)[MAXR], const Ptr &ptr) {
    uint32_t n = 0;
#pragma unroll
    for (uint32_t d = 0; d < MAXR; ++d) {
        const int32_t row = __shfl_sync(0xffffffffu, my_row, d);
        if (d >= R || row < 0) continue;
        const uint8_t *p = ptr(d, row);
#pragma unroll
        for (uint32_t j = 0; j <= d; ++j)
            if (j == n) src[j] = p;
        ++n;
    }
    return n;
}
