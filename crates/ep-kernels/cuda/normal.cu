// Normal intranode mode on GPUs (docs/protocol.md §2): layout, direct-placement dispatch (count
// exchange, rows stored once at their final row on the receiver), cached dispatch (ready
// handshake), pull combine, and the copy kernel that measures the ceiling of the same bytes.
//
// Agents → CTAs (§1.3): the sender agent (s, c) of channel c is a pair of CTAs (blocks 2c and
// 2c + 1), so a kernel of 2C blocks uses the num_sms = 2C SMs of DeepEP's Config. In the
// dispatch each CTA stores one half of the channel's tokens (ep_channel_half) and publishes it
// with its own done[s][c][h]: the two never wait for each other (no cluster either: a cluster's
// CTAs share a GPC, the scheduler then crowded some GPCs with row-copying SMs, and their blocks
// were the stragglers, 24 SMs: slowest rows 120 -> 111 us without clusters, BENCHMARKS.md). The
// combine keeps its cluster of 2 (barrier.cluster), measured the faster there. Block 0 also
// runs the notify agent; every CTA, after sending, runs the receive part of its half-channel
// (waits done[s][c][h] of every source s; the outputs are views of the records), so the kernel
// ends on a rank only when all rows destined to it have landed. Offsets, slots and signal
// values come from ep_protocol.cuh; waits are bounded (ep_device.cuh).

#include <stdint.h>
#include <cuda_bf16.h>

#include "ep_protocol.cuh"
#include "ep_device.cuh"
#include "ep_trace.cuh"

#define NT EP_GPU_THREADS
#define WARPS (EP_GPU_THREADS / 32)
#define MAXR EP_GPU_MAX_RANKS
#define UNROLL EP_NORMAL_ROW_UNROLL

typedef ep_normal_args Args;

__device__ __forceinline__ uint64_t *ctrl_word(const Args &a, uint64_t r, uint64_t off) {
    return (uint64_t *)(a.peer_ctrl[r] + off);
}
__device__ __forceinline__ uint8_t *data_at(const Args &a, uint64_t r, uint64_t off) {
    return (uint8_t *)(a.peer_data[r] + off);
}
__device__ __forceinline__ uint32_t lanemask_lt() {
    uint32_t m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}
__device__ __forceinline__ int32_t ld_i32_cg(const void *p) { return __ldcg((const int32_t *)p); }

// ---- protocol traces (EP_TRACE builds only; docs/protocol.md §3.13, ep_trace.cuh) ------------
// Offsets are relative to the rank's normal.ctrl (signal words) / normal.data base, as
// ctrl_word / data_at take them. A dispatch CTA is an agent of its own; the combine's two CTAs
// of a cluster are one agent (§1.3): each records EP_TRACE_CLUSTER_BARRIER where it arrives at
// the cluster barrier, and the host merges the two blocks' records segment by segment
// (gpu/trace.rs). Only the arenas are traced (not the handle tensors or the host-mapped
// mailbox).
#ifdef EP_TRACE
#define TRACED 1
#define TREC(kind, aux, region, rank, len, off, v) ep_trace_rec(a.trace, (kind), (aux), (region), (rank), (len), (off), (v))
#else
#define TRACED 0
#define TREC(kind, aux, region, rank, len, off, v) ((void)0)
#endif
#define TRACE_STORE(rank, off, len) TREC(EP_TRACE_STORE, 0, EP_TRACE_REGION_DATA, (rank), (len), (off), 0)
#define TRACE_LOAD(rank, off, len) TREC(EP_TRACE_LOAD, 0, EP_TRACE_REGION_DATA, (rank), (len), (off), 0)
#define TRACE_FENCE(scope) TREC(EP_TRACE_FENCE, (scope), 0, 0, 0, 0, 0)
#define TRACE_RELEASE(rank, off, v) TREC(EP_TRACE_RELEASE, 0, EP_TRACE_REGION_SIGNALS, (rank), 8, (off), (v))
#define TRACE_ACQUIRE(rank, off, v) TREC(EP_TRACE_ACQUIRE, 0, EP_TRACE_REGION_SIGNALS, (rank), 8, (off), (v))
#define TRACE_CLUSTER() TREC(EP_TRACE_CLUSTER_BARRIER, 0, 0, 0, 0, 0, 0)

// Measurement: thread 0 of each block stamps %globaltimer into slot `i` of its row when the
// caller asked for phase times (a.phase_times != 0).
__device__ __forceinline__ void stamp(const Args &a, uint32_t i) {
    if (a.phase_times != 0 && threadIdx.x == 0)
        ((uint64_t *)a.phase_times)[blockIdx.x * EP_PHASE_SLOTS + i] = ep_now_ns();
}

// The call number k of this block's dispatch or combine: ep_block_epoch (ep_device.cuh); every
// dispatch and combine kernel of a group has the same 2C blocks, so the words advance once per call.
__device__ __forceinline__ uint64_t block_epoch(const Args &a) { return ep_block_epoch(a.call, a.epoch, true); }

// Fences and signals towards peers: GPU scope when every rank is on this GPU
// (EP_FLAG_SAME_GPU, co-resident ranks), system scope otherwise (NVLink peers, other processes).
__device__ __forceinline__ bool same_gpu(const Args &a) { return (a.flags & EP_FLAG_SAME_GPU) != 0; }
__device__ __forceinline__ void peer_fence(const Args &a) {
    if (same_gpu(a))
        __threadfence();
    else
        __threadfence_system();
}
#define PEER_FENCE_SCOPE(a) (same_gpu(a) ? EP_TRACE_SCOPE_GPU : EP_TRACE_SCOPE_SYSTEM)

// The most rows a rank may receive: the arena's dispatch rows, or num_worst_tokens when smaller.
__device__ __forceinline__ uint64_t recv_rows_cap(const Args &a) {
    return a.num_worst_tokens > 0 && a.num_worst_tokens < a.capacity ? a.num_worst_tokens : a.capacity;
}

// Tokens [t0, t1) of block (c, h): half h of chan(T, C, c) (ep_channel_half; in the dispatch
// published by done[s][c][h]).
__device__ __forceinline__ void block_tokens(const Args &a, uint32_t c, uint32_t h, uint32_t *t0, uint32_t *t1) {
    uint64_t b, e;
    ep_channel_half(a.num_tokens, a.num_channels, c, h, &b, &e);
    *t0 = (uint32_t)b;
    *t1 = (uint32_t)e;
}

// A dispatch block's first rows pulled into L2 while its offsets are exchanged (the rows start
// ~5 us into the call): what the block would copy by then, ~5 us x the rank's copy rate (<= ~0.8
// TB/s on one GPU) / its blocks, so PREFETCH_RANK_BYTES per rank over the grid, at most
// PREFETCH_BLOCK_BYTES a block. More only queues in HBM ahead of the exchange's own loads
// (192 KB a block at 64 SMs delayed the offsets ~2 us: BENCHMARKS.md, 2026-12-06).
#define PREFETCH_RANK_BYTES (4u << 20)
#define PREFETCH_BLOCK_BYTES (192u << 10)

// Fire-and-forget L2 prefetch of the first min(bytes, this block's share) of p: one request per
// 128-byte line, spread over the block's threads (no thread waits for it).
__device__ __forceinline__ void prefetch_l2(const uint8_t *p, uint64_t bytes) {
    const uint64_t share = min((uint64_t)PREFETCH_BLOCK_BYTES, (uint64_t)PREFETCH_RANK_BYTES / gridDim.x);
    const uint64_t n = min(bytes, share);
    for (uint64_t off = (uint64_t)threadIdx.x * 128u; off < n; off += (uint64_t)NT * 128u)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
}

// A row's destinations, one per lane: lane d < n holds destination d's record pointer (null:
// the row does not go to d), the other lanes null. Kept in one register pair per lane instead of
// MAXR pairs in every lane: with MAXR pointers live across the rows loop the dispatch kernel sat
// at its register cap and ptxas sank the next pass's loads below the current pass's stores (one
// pass in flight, not two: BENCHMARKS.md, 2026-12-07). Each store loop takes destination d
// with a shuffle, in a run-time loop over d < n that no load can be sunk into.
__device__ __forceinline__ uint8_t *lane_dst(uint8_t *mine, uint32_t d) {
    return (uint8_t *)__shfl_sync(0xffffffffu, (unsigned long long)mine, d);
}

// Passes of a row copy: 16 bytes x UNROLL per lane (512 x UNROLL bytes per warp), loaded with
// ld.global.nc (the source rows are read once), stored to every non-null destination d < n.
__device__ __forceinline__ void load_row_pass(int4 (&v)[UNROLL], const uint8_t *src, uint64_t base, uint64_t bytes) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const uint64_t off = base + (uint64_t)u * 32 * 16;
        if (off < bytes) v[u] = ep_ld_nc((const int4 *)(src + off));
    }
}
__device__ __forceinline__ void store_row_pass(const int4 (&v)[UNROLL], uint8_t *mine, uint32_t n, uint64_t base,
                                               uint64_t bytes) {
#pragma unroll 1
    for (uint32_t d = 0; d < n; ++d) {
        uint8_t *out = lane_dst(mine, d);
        if (out == nullptr) continue;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint64_t off = base + (uint64_t)u * 32 * 16;
            if (off < bytes) ep_st_v4((int4 *)(out + off), v[u]);
        }
    }
}

// One warp copies `bytes` (a multiple of 16) from src to every non-null destination d < n
// (lane_dst): each 16 bytes loaded once, stored n times. Two passes in flight: pass i + 1's
// loads are issued before pass i is stored, so the stores overlap the next loads' latency
// instead of following it.
__device__ __forceinline__ void warp_copy_fanout(const uint8_t *src, uint8_t *mine, uint32_t n, uint64_t bytes,
                                                 uint32_t lane) {
    const uint64_t step = 32ull * 16 * UNROLL;
    int4 va[UNROLL], vb[UNROLL];
    uint64_t base = (uint64_t)lane * 16;
    load_row_pass(va, src, base, bytes);
    while (base < bytes) {
        load_row_pass(vb, src, base + step, bytes);
        store_row_pass(va, mine, n, base, bytes);
        base += step;
        if (base >= bytes) break;
        load_row_pass(va, src, base + step, bytes);
        store_row_pass(vb, mine, n, base, bytes);
        base += step;
    }
}

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

// ---- layout ------------------------------------------------------------------------------------

// get_dispatch_layout (spec §1.7) of one rank. The host zeroes num_tokens_per_rank and
// num_tokens_per_expert first. An expert id outside [-1, E) is an error record, never a write.
// A token's K ids are read by P lanes (layout_lanes), two ids each — one 16-byte load when K is
// even and the ids 16-byte aligned — so a warp's loads cover 32/P whole tokens contiguously (one
// lane reading a token's K ids in K 8-byte loads touched 16 cache lines per load instruction);
// the P lanes OR their destination masks by shuffles. Any grid covers every token (grid-stride).
#define LAYOUT_SMEM_EXPERTS 4096

// Lanes per token: the least power of two P with 2P >= K (K <= 64 keeps P <= 32).
__device__ __forceinline__ uint32_t layout_lanes(uint32_t K) {
    uint32_t p = 1;
    while (2 * p < K) p *= 2;
    return p;
}

// One top-k entry (flat index i) of the layout: its expert counted, its rank's bit returned.
__device__ __forceinline__ uint32_t layout_entry(const Args &a, int64_t e, uint64_t i, bool local_hist,
                                                 int32_t *s_expert) {
    if (e == -1) return 0;
    if (e < -1 || e >= (int64_t)a.num_experts) {
        ep_fail((ep_err_block *)a.err, EP_ERR_EXPERT, a.rank, EP_KERNEL_LAYOUT, a.rank, 0, 0, (uint64_t)e, i);
        return 0;
    }
    // Two explicit atomics, not one through a selected pointer: that is a generic atomic, this
    // a shared one where the histogram fits.
    if (local_hist)
        atomicAdd(&s_expert[e], 1);
    else
        atomicAdd(&((int32_t *)a.num_tokens_per_expert)[e], 1);
    return 1u << ((uint32_t)e / (uint32_t)a.num_local_experts);  // e < E < 2^31: 32-bit division
}

extern "C" __global__ void __launch_bounds__(NT) ep_normal_layout(const Args a) {
    // The dispatch launched after it may start now: it waits for this kernel's end
    // (ep_pdl_wait) before it reads anything, so only its launch overlaps this kernel.
    ep_pdl_trigger();
    __shared__ int32_t s_rank[MAXR];
    __shared__ int32_t s_expert[LAYOUT_SMEM_EXPERTS];  // per-block histogram (E <= 4096)
    const uint32_t R = (uint32_t)a.num_ranks, K = (uint32_t)a.num_topk;
    const uint32_t E = (uint32_t)a.num_experts;
    const bool local_hist = E <= LAYOUT_SMEM_EXPERTS;
    if (threadIdx.x < MAXR) s_rank[threadIdx.x] = 0;
    if (local_hist)
        for (uint32_t e = threadIdx.x; e < E; e += blockDim.x) s_expert[e] = 0;
    __syncthreads();
    const int64_t *topk = (const int64_t *)a.topk_idx;
    int32_t *per_expert = (int32_t *)a.num_tokens_per_expert;
    uint8_t *in_rank = (uint8_t *)a.is_token_in_rank;
    const uint32_t lane = threadIdx.x & 31u, P = layout_lanes(K), p = threadIdx.x & (P - 1);
    const uint32_t per_block = blockDim.x / P;  // tokens per block and pass
    const bool vec = K % 2 == 0 && ((uintptr_t)topk & 15u) == 0;
    // Warp-uniform trip count (the shuffles and rank counts below take every lane).
    for (uint64_t base = (uint64_t)blockIdx.x * per_block; base < a.num_tokens;
         base += (uint64_t)gridDim.x * per_block) {
        const uint64_t t = base + threadIdx.x / P;
        const bool valid = t < a.num_tokens;
        const uint32_t k = 2 * p;
        const uint64_t i = t * K + k;
        int64_t e0 = -1, e1 = -1;
        if (valid && k < K) {
            if (vec) {
                const longlong2 v = *(const longlong2 *)(topk + i);  // both loads issued before any use
                e0 = v.x;
                e1 = v.y;
            } else {
                e0 = topk[i];
                if (k + 1 < K) e1 = topk[i + 1];
            }
        }
        uint32_t mask = layout_entry(a, e0, i, local_hist, s_expert) | layout_entry(a, e1, i + 1, local_hist, s_expert);
        for (uint32_t o = 1; o < P; o <<= 1) mask |= __shfl_xor_sync(0xffffffffu, mask, o);
        if (valid)
            for (uint32_t d = p; d < R; d += P) in_rank[t * R + d] = (uint8_t)((mask >> d) & 1u);
        const bool lead = valid && p == 0;
        for (uint32_t d = 0; d < R; ++d) {
            // One shared atomic per warp and rank (every thread of a block adds to the same R
            // words: per-thread atomics there serialize).
            const uint32_t bal = __ballot_sync(0xffffffffu, lead && ((mask >> d) & 1u));
            if (lane == 0 && bal != 0) atomicAdd(&s_rank[d], (int32_t)__popc(bal));
        }
    }
    __syncthreads();
    if (threadIdx.x < R) atomicAdd(&((int32_t *)a.num_tokens_per_rank)[threadIdx.x], s_rank[threadIdx.x]);
    if (local_hist)
        for (uint32_t e = threadIdx.x; e < E; e += blockDim.x)
            if (s_expert[e]) atomicAdd(&per_expert[e], s_expert[e]);
}

// ---- dispatch ----------------------------------------------------------------------------------

// Bytes of the shared tile in which membership bytes are staged (the notify scan, every block's
// own channel start): the send part's s_rows, unused until the block's offsets are known.
#define NOTIFY_TILE_BYTES (4 * NT * MAXR)
// Experts per thread whose counts the notify block loads for its record.
#define NOTIFY_PE 4

// Copies nbytes of membership bytes from src (16-aligned when vec) into tile, every load issued
// before any is stored: one round trip per tile (a byte load per (token, d) in a counting loop
// waited for each in turn, 8.6 us at 4096 tokens). The caller barriers before and after.
__device__ __forceinline__ void stage_tile(const uint8_t *src, uint32_t nbytes, uint8_t *tile, bool vec) {
    const uint32_t tid = threadIdx.x;
    if (vec) {
        int4 v[NOTIFY_TILE_BYTES / (16 * NT)];
#pragma unroll
        for (int u = 0; u < NOTIFY_TILE_BYTES / (16 * NT); ++u) {
            const uint32_t i = ((uint32_t)u * NT + tid) * 16u;
            if (i + 16u <= nbytes) v[u] = *(const int4 *)(src + i);
        }
#pragma unroll
        for (int u = 0; u < NOTIFY_TILE_BYTES / (16 * NT); ++u) {
            const uint32_t i = ((uint32_t)u * NT + tid) * 16u;
            if (i + 16u <= nbytes) *(int4 *)(tile + i) = v[u];
        }
        const uint32_t tail = nbytes & ~15u;
        if (tail + tid < nbytes) tile[tail + tid] = src[tail + tid];
    } else {
        for (uint32_t i = tid; i < nbytes; i += NT) tile[i] = src[i];  // a misaligned view
    }
}

// Tokens per staged tile: a multiple of 32, so t0 * R stays 16-aligned.
__device__ __forceinline__ uint32_t tile_tokens(uint32_t R) { return (NOTIFY_TILE_BYTES / R) & ~31u; }

// A block's own channel start (§2.3, sender step 1): the tokens of [lo, split) going to each d
// added into s_a[d], those of [split, hi) into s_b[d] (shared, zeroed by the caller), the
// membership bytes staged in shared memory as in the notify scan. Lanes take tokens strided by
// NT, counts per d in registers, one warp reduction and one shared atomic per (warp, d).
__device__ void count_tokens(const Args &a, uint64_t lo, uint64_t split, uint64_t hi, uint8_t *tile, int32_t *s_a,
                             int32_t *s_b) {
    const uint32_t tid = threadIdx.x, lane = tid & 31u, R = (uint32_t)a.num_ranks;
    const uint8_t *in_rank = (const uint8_t *)a.is_token_in_rank;
    const bool vec = ((uintptr_t)in_rank & 15u) == 0;
    const uint32_t tt = tile_tokens(R);
    int32_t ca[MAXR], cb[MAXR];
#pragma unroll
    for (uint32_t d = 0; d < MAXR; ++d) ca[d] = cb[d] = 0;
    for (uint64_t t0 = lo / tt * tt; t0 < hi; t0 += tt) {
        const uint32_t nt = (uint32_t)min((uint64_t)tt, hi - t0);
        __syncthreads();  // the previous tile is counted
        stage_tile(in_rank + t0 * R, nt * R, tile, vec);
        __syncthreads();
        for (uint32_t j = tid; j < nt; j += NT) {
            const uint64_t t = t0 + j;
            if (t < lo) continue;
            const uint8_t *m = tile + j * R;
            const bool first = t < split;
#pragma unroll
            for (uint32_t d = 0; d < MAXR; ++d) {
                if (d >= R) break;
                const int32_t v = m[d] != 0;
                if (first)
                    ca[d] += v;
                else
                    cb[d] += v;
            }
        }
    }
#pragma unroll
    for (uint32_t d = 0; d < MAXR; ++d) {
        if (d >= R) break;
        const int32_t na = __reduce_add_sync(0xffffffffu, ca[d]);
        const int32_t nb = __reduce_add_sync(0xffffffffu, cb[d]);
        if (lane == 0 && na) atomicAdd(&s_a[d], na);
        if (lane == 0 && nb) atomicAdd(&s_b[d], nb);
    }
    __syncthreads();
}

// The notify agent (§2.3), first part, on block 0 at the kernel's start: this rank's counts
// n_me[e] as counted head words head[p][me][e] on every d (thread i: d = i / R, e = i % R), one
// load of the input and one release each. The value travels in the word: the senders' wait is
// the exchange, with no fence before it and no load after it.
__device__ void publish_heads(const Args &a, uint64_t k) {
    const uint32_t tid = threadIdx.x, R = (uint32_t)a.num_ranks, me = (uint32_t)a.rank;
    const uint64_t p = ep_parity(k);
    const int32_t *per_rank = (const int32_t *)a.num_tokens_per_rank;
    stamp(a, 8);
    for (uint32_t i = tid; i < R * R; i += NT) {
        const uint32_t d = i / R, e = i % R;
        const uint64_t v = ep_counted(k, (uint32_t)per_rank[e]);
        ep_st_release_at(same_gpu(a), ctrl_word(a, d, ep_normal_head(R, p, me, e)), v);
        TRACE_RELEASE(d, ep_normal_head(R, p, me, e), v);
    }
}

// The notify agent's second part, on block 0 after publish_heads: the count record's expert
// part e_s[d*L..d*L+L] to every d (loads of the input only), then notify[p][me] on every d. Only
// block 1's publish_recv (the host's expert list) waits for it, not the senders.
__device__ void notify_experts(const Args &a, uint64_t k) {
    const uint32_t tid = threadIdx.x, R = (uint32_t)a.num_ranks, me = (uint32_t)a.rank;
    const uint32_t L = (uint32_t)a.num_local_experts;
    const uint64_t p = ep_parity(k);
    const int32_t *per_expert = (const int32_t *)a.num_tokens_per_expert;
    const uint64_t ex = ep_normal_count_record(R, p, me) + ep_count_record_experts();
    int32_t pe[NOTIFY_PE];
#pragma unroll
    for (int u = 0; u < NOTIFY_PE; ++u) {
        const uint32_t i = (uint32_t)u * NT + tid;
        pe[u] = i < R * L ? per_expert[i] : 0;
    }
#pragma unroll
    for (int u = 0; u < NOTIFY_PE; ++u) {
        const uint32_t i = (uint32_t)u * NT + tid;
        if (i < R * L) *(int32_t *)data_at(a, i / L, ex + 4u * (i % L)) = pe[u];
    }
    for (uint32_t i = NOTIFY_PE * NT + tid; i < R * L; i += NT)
        *(int32_t *)data_at(a, i / L, ex + 4u * (i % L)) = per_expert[i];
    stamp(a, 11);
    peer_fence(a);
    if (TRACED && tid == 0) {
        // Before the barrier: the releases after it are recorded after these.
        for (uint32_t d = 0; d < R; ++d) TRACE_STORE(d, ex, 4ull * L);
        TRACE_FENCE(PEER_FENCE_SCOPE(a));
    }
    __syncthreads();
    stamp(a, 6);
    if (tid < R) {
        ep_st_release_at(same_gpu(a), ctrl_word(a, tid, ep_normal_notify(R, p, me)), k);
        TRACE_RELEASE(tid, ep_normal_notify(R, p, me), k);
    }
}

// Block 0, once every head word is in (nrec[s * R + e] = n_s[e], acquired by the caller): the
// rank prefix matrix (a handle output), the table (§2.1) of this rank, the capacity check's error
// record, then table_ready (the receive parts wait for it). Returns false when the rows exceed
// the arena (every block refuses the call alike from the same heads).
__device__ bool publish_table(const Args &a, uint64_t k, const int32_t *nrec) {
    const uint32_t tid = threadIdx.x, R = (uint32_t)a.num_ranks, me = (uint32_t)a.rank;
    const uint64_t p = ep_parity(k);
    ep_err_block *err = (ep_err_block *)a.err;
    int32_t *rpm = (int32_t *)a.rank_prefix_matrix;
    __shared__ int32_t s_rpm[MAXR * MAXR];
    __shared__ int s_fit;
    if (tid == 0) s_fit = 1;
    stamp(a, 12);
    if (tid < R) {
        int32_t run = 0;
        for (uint32_t s = 0; s < R; ++s) {
            run += nrec[s * R + tid];
            s_rpm[s * R + tid] = run;
            rpm[s * R + tid] = run;
        }
    }
    __syncthreads();
    stamp(a, 13);
    const uint64_t tab = ep_normal_table(R, p);
    for (uint32_t e = tid; e < R; e += NT)
        *(int32_t *)data_at(a, me, tab + 4u * e) = me == 0 ? 0 : s_rpm[(me - 1) * R + e];
    for (uint32_t s = tid; s <= R; s += NT)
        *(int32_t *)data_at(a, me, tab + ep_table_recv_begin(R) + 4u * s) =
            s == 0 ? 0 : s_rpm[(s - 1) * R + me];
    if (tid < R) {
        uint64_t rows = (uint64_t)s_rpm[(R - 1) * R + tid];
        const uint64_t cap = recv_rows_cap(a);
        if (rows > cap) {
            ep_fail(err, EP_ERR_CAPACITY, me, EP_KERNEL_DISPATCH, tid, 0, cap, rows, rows);
            s_fit = 0;
        }
    }
    __threadfence();
    __syncthreads();
    stamp(a, 14);
    if (!s_fit) return false;
    if (TRACED && tid == 0) {
        TRACE_STORE(me, tab, 4ull * R);
        TRACE_STORE(me, tab + ep_table_recv_begin(R), 4ull * (R + 1));
        TRACE_FENCE(EP_TRACE_SCOPE_GPU);
    }
    if (tid == 0) {
        // A local word read by this rank's blocks only: GPU scope.
        ep_st_release_gpu(ctrl_word(a, me, ep_normal_table_ready(R, p)), k);
        TRACE_RELEASE(me, ep_normal_table_ready(R, p), k);
    }
    return true;
}

// Block 1, once every head word is in (as publish_table): waits for every rank's notify (its
// record's expert part), then the expert list and num_recv to the host-mapped mailbox, each word
// tagged with the call number (the host takes the list when every word it reads carries this
// call's, so no system fence orders them). Nothing in a worst-token dispatch (no host sync).
// Returns false when a wait failed (the error is recorded).
__device__ bool publish_recv(const Args &a, uint64_t k, const int32_t *nrec) {
    const uint32_t tid = threadIdx.x, R = (uint32_t)a.num_ranks, me = (uint32_t)a.rank;
    const uint32_t L = (uint32_t)a.num_local_experts;
    const uint64_t p = ep_parity(k);
    if (a.num_worst_tokens != 0) return true;
    __shared__ int s_notified;
    if (tid == 0) s_notified = 1;
    __syncthreads();
    if (tid < R) {
        const uint64_t off = ep_normal_notify(R, p, tid);
        if (!ep_wait_eq(ctrl_word(a, me, off), k, (ep_err_block *)a.err, a.timeout_ns, me, EP_KERNEL_DISPATCH, tid,
                        off))
            s_notified = 0;
        else
            TRACE_ACQUIRE(me, off, k);
    }
    __syncthreads();
    if (!s_notified) return false;
    ep_mailbox *mb = (ep_mailbox *)a.mailbox;
    const uint64_t ex = ep_count_record_experts();
    for (uint32_t l = tid; l < L; l += NT) {
        int32_t v[MAXR];  // every source's count loaded before any is added
#pragma unroll
        for (uint32_t s = 0; s < MAXR; ++s)
            v[s] = s < R ? ld_i32_cg(data_at(a, me, ep_normal_count_record(R, p, s) + ex + 4u * l)) : 0;
        int64_t sum = 0;
#pragma unroll
        for (uint32_t s = 0; s < MAXR; ++s) sum += v[s];
        const int64_t al = (int64_t)a.expert_alignment;
        *(volatile uint64_t *)&mb->expert_counts[l] = (k << 32) | (uint64_t)((sum + al - 1) / al * al);
    }
    if (TRACED && tid == 0)
        for (uint32_t s = 0; s < R; ++s) TRACE_LOAD(me, ep_normal_count_record(R, p, s) + ex, 4ull * L);
    if (tid == 0) {
        int64_t num_recv = 0;
        for (uint32_t s = 0; s < R; ++s) num_recv += nrec[s * R + me];
        *(volatile uint64_t *)&mb->num_recv = (k << 32) | (uint64_t)num_recv;
    }
    return true;
}

// Dispatch (§2.3) and cached dispatch (§2.4). Grid 2C blocks, pairs (2c, 2c + 1).
extern "C" __global__ void __launch_bounds__(NT, 1)
    ep_normal_dispatch(const Args a) {
    // Launched with programmatic serialization (the layout kernel before it lets it start
    // early): nothing the stream's earlier work wrote is read before this.
    ep_pdl_wait();
    const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const uint32_t R = (uint32_t)a.num_ranks, me = (uint32_t)a.rank, C = (uint32_t)a.num_channels;
    const uint32_t K = (uint32_t)a.num_topk;
    const uint32_t c = blockIdx.x >> 1, h = blockIdx.x & 1u;
    const uint64_t k = block_epoch(a), p = ep_parity(k);
    const bool cached = (a.flags & EP_FLAG_CACHED) != 0, topk = (a.flags & EP_FLAG_TOPK) != 0;
    const uint64_t elt = (a.flags & EP_FLAG_FP8) ? 1 : 2;
    const uint64_t S = a.num_scales, H = a.hidden;
    const uint64_t scales_off = ep_row_scales_offset(H, elt);
    const uint64_t meta_off = ep_row_meta_offset(H, elt, S);
    const uint64_t idx_off = ep_row_topk_idx_offset(H, elt, S);
    const uint64_t w_off = ep_row_topk_weights_offset(H, elt, S, K);
    // The record's tail: nsc scale chunks of nch (the row record's end, not a.drec's stride).
    const uint32_t nsc = (uint32_t)(ep_align16(4u * S) / 16u);
    const uint32_t nch = (uint32_t)((ep_row_dispatch_record(H, elt, S, K) - scales_off) / 16u);
    const bool scales_vec = S % 4u == 0 && ((uintptr_t)a.x_scales & 15u) == 0;
    ep_err_block *err = (ep_err_block *)a.err;
    const int32_t *rpm = (const int32_t *)a.rank_prefix_matrix;
    const int32_t *cpm = (const int32_t *)a.channel_prefix_matrix;

    __shared__ int s_ok, s_fail;
    __shared__ int32_t s_n[MAXR];
    __shared__ int32_t s_slot0[MAXR];   // index in (channel, d) of this block's first token to d
    __shared__ int32_t s_rowbase[MAXR]; // final row of that token on d
    __shared__ int32_t s_warp[WARPS][MAXR];
    __shared__ __align__(16) int32_t s_rows[NT][MAXR];
    static_assert(sizeof(s_rows) >= NOTIFY_TILE_BYTES, "count_tokens' tile lives in s_rows");

    __shared__ int32_t s_before[MAXR];  // tokens of the channel's first half going to d
    __shared__ int32_t s_chan[MAXR];    // tokens before the channel going to d (non-cached)
    __shared__ int32_t s_nrec[MAXR * MAXR];  // n_s[d] of every count record (non-cached)
    __shared__ int32_t s_base[MAXR];         // Σ_{s < me} n_s[d]: this rank's block start on d
    uint32_t t0, t1;
    block_tokens(a, c, h, &t0, &t1);
    const uint8_t *in_rank = (const uint8_t *)a.is_token_in_rank;
    stamp(a, 0);
    if (!cached && blockIdx.x == 0) publish_heads(a, k);
    if (tid == 0) s_ok = 1, s_fail = 0;
    if (tid < MAXR) s_before[tid] = s_chan[tid] = 0;
    __syncthreads();
    {
        // This block's own channel start (§2.3, sender step 1), before the exchange's waits:
        // tokens before the channel (non-cached; a cached dispatch takes it from the handle) and
        // before this half, staged in the s_rows tile. Block 0 (channel 0, first half) counts
        // nothing: it runs the notify agent (publish_heads above, notify_experts below).
        uint64_t cs, ce;
        ep_channel_range(a.num_tokens, C, c, &cs, &ce);
        count_tokens(a, cached ? cs : 0, cs, t0, (uint8_t *)s_rows, s_chan, s_before);
    }
    stamp(a, 15);
    // 1. Offsets: the count exchange, or the handle plus the ready handshake.
    // The block's first rows into L2 while the offsets are exchanged: its first copies then load
    // from L2, not HBM (the wait is not shortened; what follows it is). After the block's own
    // loads (its count, block 0's notify), whose requests would otherwise queue behind these.
    const uint8_t *x_block = (const uint8_t *)a.x + (uint64_t)t0 * a.x_bytes;
    const uint64_t x_block_bytes = (uint64_t)(t1 - t0) * a.x_bytes;
    if (!cached) {
        if (blockIdx.x == 0) notify_experts(a, k);
        prefetch_l2(x_block, x_block_bytes);
        // Sender step 1 (§2.3): every head word head[p][s'][e] (thread i: s' = i / R, e = i % R)
        // — the counts themselves, and from every s' what lets this call's rows into s' — so
        // this rank's block start on each d and the rows each d receives (every block refuses an
        // overflow alike; block 0's publish_table writes the error record). The channel start
        // this block counted itself.
        if (tid < R * R) {
            const uint32_t s2 = tid / R, e = tid % R;
            const uint64_t off = ep_normal_head(R, p, s2, e);
            const uint64_t v = ep_wait_counted(ctrl_word(a, me, off), k, err, a.timeout_ns, me, EP_KERNEL_DISPATCH,
                                               s2, off, s2);
            if (v == 0) {
                s_ok = 0;
            } else {
                s_nrec[tid] = (int32_t)ep_ll_count(v);
                TRACE_ACQUIRE(me, off, v);
            }
        }
        __syncthreads();
        stamp(a, 7);
        // s_ok is read by every thread here, before the next barrier: what fails from here on goes
        // to s_fail, so that blocks 0 and 1 enter publish_table / publish_recv with all threads.
        if (s_ok) {
            if (tid < R) {
                int64_t b = 0, tot = 0;
                for (uint32_t s2 = 0; s2 < R; ++s2) {
                    const int32_t v = s_nrec[s2 * R + tid];
                    if (s2 < me) b += v;
                    tot += v;
                }
                s_base[tid] = (int32_t)b;
                if ((uint64_t)tot > recv_rows_cap(a)) s_fail = 1;
            }
            if (blockIdx.x == 0 && !publish_table(a, k, s_nrec) && tid == 0) s_fail = 1;
            if (blockIdx.x == 1 && !publish_recv(a, k, s_nrec) && tid == 0) s_fail = 1;
        }
    } else {
        if (blockIdx.x == 0 && tid < R) {
            ep_st_release_at(same_gpu(a), ctrl_word(a, tid, ep_normal_ready(R, me)), k);
            TRACE_RELEASE(tid, ep_normal_ready(R, me), k);
        }
        prefetch_l2(x_block, x_block_bytes);
        if (tid < R) {
            uint64_t off = ep_normal_ready(R, tid);
            if (!ep_wait_eq(ctrl_word(a, me, off), k, err, a.timeout_ns, me, EP_KERNEL_DISPATCH, tid, off))
                s_ok = 0;
            else
                TRACE_ACQUIRE(me, off, k);
        }
    }
    __syncthreads();
    const bool ok = s_ok != 0 && s_fail == 0;
    stamp(a, 1);

    if (ok && tid < R) {
        const int32_t before = s_before[tid];
        int32_t send_base = !cached ? s_base[tid] : me == 0 ? 0 : __ldcg(&rpm[(me - 1) * R + tid]);
        int32_t chan_start = !cached ? s_chan[tid] : c == 0 ? 0 : __ldcg(&cpm[tid * C + c - 1]);
        s_slot0[tid] = before;
        s_rowbase[tid] = (int32_t)ep_normal_final_row((uint32_t)send_base, (uint32_t)chan_start, (uint32_t)before);
        s_n[tid] = 0;  // running count of this block
    }
    __syncthreads();

    // 2. Send: every row record stored once, at its final row on each destination. A row past
    //    the arena's rows (inputs that disagree, EP_ERR_LAYOUT) is not stored.
    int32_t *send_head = (int32_t *)a.send_head;
    const int64_t row_cap = (int64_t)recv_rows_cap(a);
    for (uint32_t base = t0; ok && base < t1; base += NT) {
        const uint32_t t = base + tid;
        const bool valid = t < t1;
        int32_t pre[MAXR];
        uint32_t mask = 0;
        for (uint32_t d = 0; d < R; ++d) {
            uint32_t bit = valid ? in_rank[(uint64_t)t * R + d] : 0u;
            mask |= bit << d;
            uint32_t bal = __ballot_sync(0xffffffffu, bit);
            pre[d] = __popc(bal & lanemask_lt());
            if (lane == 0) s_warp[warp][d] = __popc(bal);
        }
        __syncthreads();
        for (uint32_t d = 0; d < R; ++d) {
            int32_t off = s_n[d] + pre[d];
            for (uint32_t w = 0; w < warp; ++w) off += s_warp[w][d];
            const bool bit = (mask >> d) & 1u;
            const int64_t row = (int64_t)s_rowbase[d] + off;
            s_rows[tid][d] = bit && row < row_cap ? (int32_t)row : -1;
            if (!cached && valid) send_head[(uint64_t)t * R + d] = bit ? s_slot0[d] + off : -1;
        }
        __syncthreads();
        if (tid < R) {
            int32_t tot = 0;
            for (uint32_t w = 0; w < WARPS; ++w) tot += s_warp[w][tid];
            s_n[tid] += tot;
        }
        const uint32_t n_chunk = min(t1 - base, (uint32_t)NT);
        for (uint32_t i = warp; i < n_chunk; i += WARPS) {
            const uint64_t tok = base + i;
            const int32_t row = lane < R ? s_rows[i][lane] : -1;
            uint8_t *const mine =
                row < 0 ? nullptr : data_at(a, lane, ep_normal_dispatch_row(R, (uint64_t)row, a.drec));
            // The tail's loads (scales, top-k) are issued before the row's, so their latency
            // hides behind the copy; the tail is stored after it, one 16-byte chunk per lane.
            const TailSrc ts = tail_load(a, tok, lane, nsc, scales_vec, topk);
            warp_copy_fanout((const uint8_t *)a.x + tok * a.x_bytes, mine, R, a.x_bytes, lane);
            if (topk)
                tail_store<TAIL_ALL>(a, ts, mine, R, tok, lane, scales_off, nsc, nch, scales_vec);
            else
                tail_store<TAIL_META>(a, ts, mine, R, tok, lane, scales_off, nsc, nch, scales_vec);
            if (TRACED) {
                __syncwarp();
                if (lane == 0)
                    for (uint32_t d = 0; d < R; ++d)
                        if (s_rows[i][d] >= 0)
                            TRACE_STORE(d, ep_normal_dispatch_row(R, (uint64_t)s_rows[i][d], a.drec), a.drec);
            }
        }
        __syncthreads();
    }

    // The channel's prefix entry (§2.3): the second CTA knows its start and end after its rows
    // (the tokens before the channel, in its first half, in its own). The end goes to the
    // handle's channel_prefix_matrix; [start, end] into this rank's count record on every d, the
    // channel's own granule, published by this CTA's done[me][c][1] below (its fence, then its
    // release). The last channel's end is the total to d: inputs
    // that disagree with it are EP_ERR_LAYOUT (the record poisons the group; every row store
    // above stayed below the arena's rows).
    if (ok && !cached && h == 1 && tid < R) {
        const uint32_t d = tid;
        const int32_t start = s_chan[d], end = s_chan[d] + s_before[d] + s_n[d];
        ((int32_t *)a.channel_prefix_matrix)[d * C + c] = end;
        *(int2 *)data_at(a, d, ep_normal_count_record(R, p, me) + ep_count_record_channel(c)) =
            make_int2(start, end);
        const int32_t given = ((const int32_t *)a.num_tokens_per_rank)[d];
        if (c + 1 == C && end != given)
            ep_fail(err, EP_ERR_LAYOUT, me, EP_KERNEL_DISPATCH, d, 0, (uint64_t)(int64_t)given,
                    (uint64_t)(int64_t)end, d);
    }
    if (TRACED && ok && !cached && h == 1) {
        __syncthreads();
        if (tid == 0)
            for (uint32_t d = 0; d < R; ++d)
                TRACE_STORE(d, ep_normal_count_record(R, p, me) + ep_count_record_channel(c), 8);
    }

    // 3. done[me][c][h] on every d once this CTA stored its half's rows (and, h = 1, the
    //    channel's prefix entry): each CTA publishes its own half, no barrier with the other.
    stamp(a, 2);
    // Traced kernels only: a planted missing fence in the second CTA (the checker must catch it).
    const bool skip_fence = TRACED && h == 1 && (a.flags & EP_FLAG_TEST_SKIP_FENCE) != 0;
    if (!skip_fence) peer_fence(a);
    __syncthreads();
    if (TRACED && tid == 0 && !skip_fence) TRACE_FENCE(PEER_FENCE_SCOPE(a));
    if (ok && tid < R) {
        ep_st_release_at(same_gpu(a), ctrl_word(a, tid, ep_normal_done(R, me, c, h)), k);
        TRACE_RELEASE(tid, ep_normal_done(R, me, c, h), k);
    }
    stamp(a, 3);

    // 4. Receive half h of channel c: wait done[s][c][h] of every source (it publishes those
    //    rows, and for h = 1 the channel's prefix entry), so that the kernel ends on this rank
    //    only when every row destined to it has landed; and table_ready (rpm, which the
    //    worst-token tail reads).
    if (tid == 0) s_ok = ok ? 1 : 0;
    if (ok && !cached && tid == 0) {
        uint64_t off = ep_normal_table_ready(R, p);
        // Second-order word (its writer waits on every rank first): twice the bound.
        if (!ep_wait_eq(ctrl_word(a, me, off), k, err, 2 * a.timeout_ns, me, EP_KERNEL_DISPATCH, me, off))
            s_ok = 0;
        else
            TRACE_ACQUIRE(me, off, k);
    }
    __syncthreads();
    if (ok && tid < R) {
        uint64_t off = ep_normal_done(R, tid, c, h);
        bool got = ep_wait_eq(ctrl_word(a, me, off), k, err, 3 * a.timeout_ns, me, EP_KERNEL_DISPATCH, tid, off);
        if (got) TRACE_ACQUIRE(me, off, k);
        if (!got) s_ok = 0;
    }
    __syncthreads();
    if (!s_ok) return;
    stamp(a, 4);
    // The handle's recv_channel_prefix_matrix, rcpm[s][c] = cpm_s[me][c - 1]: each channel's
    // second CTA writes its own column (thread s, from s's prefix entry, which the done[s][c][1]
    // acquired above published). The
    // rows' src_idx stay in the records, where recv_src_idx views them like the top-k ids
    // (NormalGroup::dispatch): nothing is copied out (a copy-out cost 2.3 us at 24 SMs).
    if (!cached && h == 1 && tid < R) {
        const uint32_t s = tid;
        const uint64_t entry = ep_normal_count_record(R, p, s) + ep_count_record_channel(c);
        ((int32_t *)a.recv_channel_prefix_matrix)[s * C + c] = __ldcg((const int2 *)data_at(a, me, entry)).x;
        if (TRACED) TRACE_LOAD(me, entry, 8);
    }
    // 5. Worst-token tail rows (num_recv <= row < num_worst_tokens): zero x and scales,
    //    src_idx -1, top-k -1 / 0.0, in the record (which the outputs view).
    if (!cached && a.num_worst_tokens > 0) {
        const uint64_t num_recv = (uint64_t)__ldcg(&rpm[(R - 1) * R + me]);
        for (uint64_t j = num_recv + blockIdx.x * WARPS + warp; j < a.num_worst_tokens; j += (uint64_t)gridDim.x * WARPS) {
            uint8_t *rec = data_at(a, me, ep_normal_dispatch_row(R, j, a.drec));
            const int4 z = make_int4(0, 0, 0, 0);
            for (uint64_t off = (uint64_t)lane * 16; off < a.x_bytes; off += 32 * 16) *(int4 *)(rec + off) = z;
            for (uint32_t q = lane; q < S; q += 32) *(float *)(rec + scales_off + 4u * q) = 0.0f;
            if (lane == 0) {
                *(int32_t *)(rec + meta_off) = -1;
                *(int32_t *)(rec + meta_off + 4) = 0;
            }
            if (topk && lane < K) {
                *(int64_t *)(rec + idx_off + 8u * lane) = -1;
                *(float *)(rec + w_off + 4u * lane) = 0.0f;
            }
            if (TRACED) {
                __syncwarp();
                if (lane == 0) TRACE_STORE(me, ep_normal_dispatch_row(R, j, a.drec), a.drec);
            }
        }
    }
    __syncthreads();
    stamp(a, 5);
}

// ---- combine -----------------------------------------------------------------------------------

// Combine (§2.5, §2.6): pull each token's rows from every rank holding it, reduce in f32 after
// the biases in ascending rank order, round once to BF16. Grid 2C blocks, clusters of 2 (unlike
// the dispatch: without the cluster the combine measured 0.2–1.7 us slower at 8, 24 and 64 SMs).
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(NT, 1)
    ep_normal_combine(const Args a) {
    const uint32_t tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    const uint32_t R = (uint32_t)a.num_ranks, me = (uint32_t)a.rank, C = (uint32_t)a.num_channels;
    const uint32_t K = (uint32_t)a.num_topk;
    const uint32_t c = blockIdx.x >> 1, h = blockIdx.x & 1u;
    const uint64_t k = block_epoch(a), H = a.hidden;
    const bool in_place = (a.flags & EP_FLAG_IN_PLACE) != 0;
    const bool weights = (a.flags & EP_FLAG_TOPK) != 0 && a.combined_weights != 0;
    ep_err_block *err = (ep_err_block *)a.err;
    const int32_t *rpm = (const int32_t *)a.rank_prefix_matrix;
    const int32_t *cpm = (const int32_t *)a.channel_prefix_matrix;
    const int32_t *send_head = (const int32_t *)a.send_head;
    // Where expert row j of a rank lives: its dispatch record's x part (in place) or its combine
    // record; the weights after it.
    const uint64_t w_off = in_place ? ep_row_topk_weights_offset(H, 2, 0, K) : ep_align16(2 * H);

    __shared__ int s_ok;
    __shared__ int32_t s_rowbase[MAXR];
    stamp(a, 0);
    if (tid == 0) s_ok = 1;
    if (blockIdx.x == 0 && tid < R) {
        ep_st_release_at(same_gpu(a), ctrl_word(a, tid, ep_normal_y_ready(R, me)), k);
        TRACE_RELEASE(tid, ep_normal_y_ready(R, me), k);
    }
    __syncthreads();
    if (tid < R) {
        uint64_t off = ep_normal_y_ready(R, tid);
        if (!ep_wait_eq(ctrl_word(a, me, off), k, err, a.timeout_ns, me, EP_KERNEL_COMBINE, tid, off))
            s_ok = 0;
        else
            TRACE_ACQUIRE(me, off, k);
        int32_t send_base = me == 0 ? 0 : rpm[(me - 1) * R + tid];
        int32_t chan_start = c == 0 ? 0 : cpm[tid * C + c - 1];
        s_rowbase[tid] = send_base + chan_start;
    }
    __syncthreads();
    const bool ok = s_ok != 0;
    stamp(a, 1);
    uint32_t t0, t1;
    block_tokens(a, c, h, &t0, &t1);
    const __nv_bfloat16 *b0 = (const __nv_bfloat16 *)a.bias0, *b1 = (const __nv_bfloat16 *)a.bias1;
    // Where rank d holds row `sh` of this channel's tokens.
    auto row_at = [&](uint32_t d, int32_t sh) -> const uint8_t * {
        const uint64_t row = (uint64_t)(s_rowbase[d] + sh);
        return data_at(a, d, in_place ? ep_normal_dispatch_row(R, row, a.drec)
                                      : ep_normal_combine_row(R, a.data_bytes, row, a.yrec));
    };
    // Lane d < R holds send_head[t][d] of the warp's next token, loaded while the current one is
    // reduced (one round trip per token less).
    int32_t next_sh = lane < R && t0 + warp < t1 ? send_head[(uint64_t)(t0 + warp) * R + lane] : -1;
    for (uint32_t t = t0 + warp; ok && t < t1; t += WARPS) {
        const int32_t my_sh = next_sh;
        if (lane < R && t + WARPS < t1) next_sh = send_head[(uint64_t)(t + WARPS) * R + lane];
        const uint8_t *src[MAXR];
        const uint32_t n = holders(my_sh, R, src, row_at);
        // The weights' loads are issued before the rows' and summed after them (ascending rank).
        float wv[MAXR];
#pragma unroll
        for (uint32_t i = 0; i < MAXR; ++i)
            wv[i] = weights && lane < K && i < n ? __ldcg((const float *)(src[i] + w_off + 4u * lane)) : 0.0f;
        const SumBf16 op{b0 ? (const uint8_t *)(b0 + (uint64_t)t * H) : nullptr,
                         b1 ? (const uint8_t *)(b1 + (uint64_t)t * H) : nullptr};
        gather_n(src, n, (uint8_t *)a.combined_x + (uint64_t)t * 2 * H, 2 * H, lane, op);
        if (weights && lane < K) {
            float w = 0.0f;
#pragma unroll
            for (uint32_t i = 0; i < MAXR; ++i)
                if (i < n) w += wv[i];
            ((float *)a.combined_weights)[(uint64_t)t * K + lane] = w;
        }
        if (TRACED && lane == 0)
            for (uint32_t d = 0; d < R; ++d) {
                const int32_t sh = send_head[(uint64_t)t * R + d];
                if (sh < 0) continue;
                const uint64_t row = (uint64_t)(s_rowbase[d] + sh);
                const uint64_t off = in_place ? ep_normal_dispatch_row(R, row, a.drec)
                                              : ep_normal_combine_row(R, a.data_bytes, row, a.yrec);
                TRACE_LOAD(d, off, 2 * H);
                if (weights && K > 0) TRACE_LOAD(d, off + w_off, 4ull * K);
            }
    }
    // pulled[me][c] on every d, then wait until every owner pulled from this rank.
    stamp(a, 2);
    peer_fence(a);
    __syncthreads();
    if (TRACED && tid == 0) {
        TRACE_FENCE(PEER_FENCE_SCOPE(a));
        TRACE_CLUSTER();
    }
    ep_cluster_sync();
    if (ok && h == 0 && tid < R) {
        ep_st_release_at(same_gpu(a), ctrl_word(a, tid, ep_normal_pulled(R, me, c)), k);
        TRACE_RELEASE(tid, ep_normal_pulled(R, me, c), k);
    }
    if (ok && h == 0 && tid < R) {
        uint64_t off = ep_normal_pulled(R, tid, c);
        if (ep_wait_eq(ctrl_word(a, me, off), k, err, 2 * a.timeout_ns, me, EP_KERNEL_COMBINE, tid, off))
            TRACE_ACQUIRE(me, off, k);
    }
    __syncthreads();
    stamp(a, 5);
}

// ---- ceilings and timing ------------------------------------------------------------------------------------

// The data movement of a dispatch alone: each of this rank's rows — x and, FP8, its scales
// (a.num_scales; the bytes DeepEP counts) — read once and stored to its final row on every
// destination (dst_rows from the plan), no protocol, no meta. gridDim.x blocks.
extern "C" __global__ void __launch_bounds__(NT, 1) ep_copy_ceiling(const Args a) {
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, R = (uint32_t)a.num_ranks;
    const uint32_t S = (uint32_t)a.num_scales, nsc = (uint32_t)(ep_align16(4u * S) / 16u);
    const uint64_t scales_off = ep_align16(a.x_bytes);
    const bool scales_vec = S % 4u == 0 && ((uintptr_t)a.x_scales & 15u) == 0;
    const int32_t *dst_rows = (const int32_t *)a.dst_rows;
    const uint64_t per = (a.num_tokens + gridDim.x - 1) / gridDim.x;
    const uint64_t t0 = per * blockIdx.x, t1 = min(a.num_tokens, t0 + per);
    // Lane d < R holds the next token's row on d, loaded while the current token is copied.
    int32_t next = lane < R && t0 + warp < t1 ? dst_rows[(t0 + warp) * R + lane] : -1;
    for (uint64_t t = t0 + warp; t < t1; t += WARPS) {
        const int32_t mine = next;
        if (lane < R && t + WARPS < t1) next = dst_rows[(t + WARPS) * R + lane];
        uint8_t *const dst = mine < 0 ? nullptr : data_at(a, lane, ep_normal_dispatch_row(R, (uint64_t)mine, a.drec));
        const TailSrc ts = tail_load(a, t, lane, nsc, scales_vec, false);
        warp_copy_fanout((const uint8_t *)a.x + t * a.x_bytes, dst, R, a.x_bytes, lane);
        if (nsc > 0) tail_store<TAIL_SCALES>(a, ts, dst, R, t, lane, scales_off, nsc, nsc, scales_vec);
    }
}

// The data movement of a combine alone: every token of this rank loads each of its rows from
// the ranks holding them (dst_rows: the token's row on each rank, from the plan, -1 = none; the
// BF16 x parts of the dispatch records) once and stores one row (their bitwise XOR: the byte
// pattern of the combine with no arithmetic), no signals, no biases. gridDim.x blocks.
extern "C" __global__ void __launch_bounds__(NT, 1) ep_copy_ceiling_gather(const Args a) {
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, R = (uint32_t)a.num_ranks;
    const int32_t *dst_rows = (const int32_t *)a.dst_rows;
    const uint64_t per = (a.num_tokens + gridDim.x - 1) / gridDim.x;
    const uint64_t t0 = per * blockIdx.x, t1 = min(a.num_tokens, t0 + per);
    const uint64_t bytes = 2 * a.hidden;
    auto row_at = [&](uint32_t d, int32_t row) -> const uint8_t * {
        return data_at(a, d, ep_normal_dispatch_row(R, (uint64_t)row, a.drec));
    };
    // The same token loop as the combine's: next token's rows prefetched, pipelined gather.
    int32_t next = lane < R && t0 + warp < t1 ? dst_rows[(t0 + warp) * R + lane] : -1;
    for (uint64_t t = t0 + warp; t < t1; t += WARPS) {
        const int32_t mine = next;
        if (lane < R && t + WARPS < t1) next = dst_rows[(t + WARPS) * R + lane];
        const uint8_t *src[MAXR];
        const uint32_t n = holders(mine, R, src, row_at);
        gather_checked(src, n, (uint8_t *)a.combined_x + t * bytes, bytes, lane, XorRows{});
    }
}

// The latency part of the low-latency floor (BASELINES.md): flag round trips between two
// resident kernels. Role a.rank == 0 stores round i to word 0 (release) and waits (acquire) for
// word 16 to reach i; role 1 waits for word 0 and answers on word 16 (words: `dst_rows`, two
// 128-byte lines). `num_tokens` rounds; the first is not timed (the other kernel may still be
// starting). Role 0 writes the %globaltimer ns of the timed rounds to combined_x[0], or ~0 when
// a wait ran past `timeout_ns` (then both roles return: bounded). System scope (the protocol's
// signals, ep_device.cuh), or GPU scope when `flags` has EP_FLAG_SAME_GPU.
extern "C" __global__ void ep_flag_pingpong(const Args a) {
    uint64_t *words = (uint64_t *)a.dst_rows;
    uint64_t *mine = words + (a.rank == 0 ? 0 : 16), *theirs = words + (a.rank == 0 ? 16 : 0);
    const bool gpu = (a.flags & EP_FLAG_SAME_GPU) != 0;
    uint64_t start = 0;
    for (uint64_t i = 1; i <= a.num_tokens; ++i) {
        if (a.rank == 0) ep_st_release_at(gpu, mine, i);
        const uint64_t t0 = ep_now_ns();
        for (uint32_t polls = 1; ep_ld_acquire_at(gpu, theirs) < i; ++polls) {
            if ((polls & 255u) == 0u && ep_now_ns() - t0 > a.timeout_ns) {
                if (a.rank == 0) *(volatile uint64_t *)a.combined_x = ~0ull;
                return;
            }
        }
        if (a.rank != 0) ep_st_release_at(gpu, mine, i);
        if (i == 1) start = ep_now_ns();
    }
    if (a.rank == 0) *(volatile uint64_t *)a.combined_x = ep_now_ns() - start;
}

// The timing gate (gpu/gate.rs): holds its stream at least `hold_ns`, then until the
// host-mapped word at `mailbox` reaches `call` (the host opens it once every rank's work is
// enqueued), at most `timeout_ns` in all (a bound); with mailbox 0, for timeout_ns.
extern "C" __global__ void ep_spin(const Args a) {
    const uint64_t t0 = ep_now_ns();
    const uint64_t *word = (const uint64_t *)a.mailbox;
    for (uint64_t dt = 0; dt < a.timeout_ns; dt = ep_now_ns() - t0)
        if (dt >= a.hold_ns && word != nullptr && ep_ld_volatile(word) >= a.call) break;
}
