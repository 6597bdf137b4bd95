// The low-latency kernels' shared ground: arguments, phase stamps, protocol traces, the
// shrink mask, the halves' addresses and the variants' peer operations.
// Part of cuda/low_latency.cu (one translation unit): included there in order, after the parts
// it uses.
#pragma once

#define NT EP_GPU_THREADS
#define WARPS (EP_GPU_THREADS / 32)
#define MAXR EP_GPU_MAX_RANKS
#define MAXK EP_LL_MAX_TOPK
#define FULL 0xffffffffu
// 32-lane chunks a warp moves per unit of work (loads in flight per lane).
#define UNITS 4

typedef ep_ll_args Args;

__device__ __forceinline__ uint32_t lanemask_lt() {
    uint32_t m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

__device__ __forceinline__ void stamp(const Args &a, uint32_t i) {
    if (a.phase_times != 0 && threadIdx.x == 0)
        ((uint64_t *)a.phase_times)[blockIdx.x * EP_PHASE_SLOTS + i] = ep_now_ns();
}

// ---- protocol traces (EP_TRACE builds only; docs/protocol.md §3.13) --------------------------
// Each event is recorded after it happened, by the thread that did it (or, for a block's
// stores, by one thread after them), into this block's records of the rank's ep_trace_header;
// the host decodes them (gpu/trace.rs) and ep-sim's memory-model checker judges them. Offsets are
// relative to the rank's ll.signals / ll.data base.
#ifdef EP_TRACE
__device__ __forceinline__ void trace_rec(const Args &a, uint64_t kind, uint64_t aux, uint64_t region, uint64_t rank,
                                          uint64_t len, uint64_t off, uint64_t value) {
    ep_trace_rec(a.trace, kind, aux, region, rank, len, off, value);
}
#define TRACE_STORE(rank, off, len) trace_rec(a, EP_TRACE_STORE, 0, EP_TRACE_REGION_DATA, (rank), (len), (off), 0)
#define TRACE_LOAD(rank, off, len) trace_rec(a, EP_TRACE_LOAD, 0, EP_TRACE_REGION_DATA, (rank), (len), (off), 0)
#define TRACE_FENCE(scope) trace_rec(a, EP_TRACE_FENCE, (scope), 0, 0, 0, 0, 0)
#define TRACE_RELEASE(rank, off, v) trace_rec(a, EP_TRACE_RELEASE, 0, EP_TRACE_REGION_SIGNALS, (rank), 8, (off), (v))
#define TRACE_ACQUIRE(rank, off, v) trace_rec(a, EP_TRACE_ACQUIRE, 0, EP_TRACE_REGION_SIGNALS, (rank), 8, (off), (v))
// A put with signal: two records of one reservation (the put, then its signal).
__device__ void trace_put_signal(const Args &a, uint64_t rank, uint64_t dst_off, uint64_t src_off, uint64_t len,
                                 uint64_t sig_off, uint64_t value) {
    ep_trace_record *r = ep_trace_reserve(a.trace, 2);
    if (r == nullptr) return;
    const uint64_t blk = (uint64_t)blockIdx.x << 32;
    r[0].word0 = EP_TRACE_PUT_SIGNAL | EP_TRACE_REGION_DATA << 16 | blk;
    r[0].word1 = rank | len << 32;
    r[0].word2 = dst_off;
    r[0].word3 = src_off;
    r[1].word0 = EP_TRACE_SIGNAL | EP_TRACE_REGION_SIGNALS << 16 | blk;
    r[1].word1 = rank | 8ull << 32;
    r[1].word2 = sig_off;
    r[1].word3 = value;
}
#define TRACED 1
#else
#define TRACE_STORE(rank, off, len) ((void)0)
#define TRACE_LOAD(rank, off, len) ((void)0)
#define TRACE_FENCE(scope) ((void)0)
#define TRACE_RELEASE(rank, off, v) ((void)0)
#define TRACE_ACQUIRE(rank, off, v) ((void)0)
#define TRACED 0
#endif

__device__ __forceinline__ ep_ll_layout layout_of(const Args &a) {
    ep_ll_layout l;
    l.num_ranks = a.num_ranks;
    l.num_local_experts = a.num_local_experts;
    l.hidden = a.hidden;
    l.num_max_tokens = a.num_max_tokens;
    return l;
}

// The shrink mask, read once per block at launch (load_mask): bit r = rank r masked.
__shared__ uint32_t mask_bits;

__device__ __forceinline__ void load_mask(const Args &a) {
    if (threadIdx.x == 0) {
        uint32_t bits = 0;
        if (a.mask != 0)
            for (uint32_t r = 0; r < a.num_ranks; ++r)
                if (((const volatile int32_t *)a.mask)[r] != 0) bits |= 1u << r;
        mask_bits = bits;
    }
    __syncthreads();
}

__device__ __forceinline__ bool masked(const Args &a, uint64_t r) {
    (void)a;
    return (mask_bits >> r) & 1u;
}

// Base of half `h` of rank `r`'s ll.data, as this rank addresses it.
__device__ __forceinline__ uint8_t *half_of(const Args &a, uint64_t r, uint64_t h) {
    return (uint8_t *)(a.peer_data[r] + ep_ll_half_base(layout_of(a), h));
}

__device__ __forceinline__ uint64_t *signal_of(const Args &a, uint64_t r, uint64_t off) {
    return (uint64_t *)(a.peer_signals[r] + off);
}

#ifdef EP_LL_NVSHMEM
__device__ __forceinline__ int pe_of(const Args &a, uint64_t r) { return (int)a.peer_pe[r]; }

// Offset of `p` in rank `r`'s ll.data (as this rank addresses it), for traces.
__device__ __forceinline__ uint64_t data_offset(const Args &a, uint64_t r, const void *p) {
    return (uint64_t)((const uint8_t *)p - (const uint8_t *)a.peer_data[r]);
}

// Variant (b): the warp puts `bytes` of this rank's staged `src` to `dst` (a symmetric address of
// rank `d`'s region) after every lane's staging stores. Traced: the block's staging stores of
// `src`, then the put.
__device__ __forceinline__ void put_warp(const Args &a, uint64_t d, void *dst, const void *src, uint64_t bytes) {
    __syncwarp();
#ifdef EP_TRACE
    if (threadIdx.x % 32 == 0) {
        TRACE_STORE(a.rank, data_offset(a, a.rank, src), bytes);
        trace_rec(a, EP_TRACE_PUT, 0, EP_TRACE_REGION_DATA, d, bytes, data_offset(a, d, dst),
                  data_offset(a, a.rank, src));
    }
#endif
    nvshmemx_putmem_nbi_warp(dst, src, bytes, pe_of(a, d));
}
#endif

__device__ __forceinline__ int4 ld_cg16(const void *p) { return __ldcg((const int4 *)p); }
