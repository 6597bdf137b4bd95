// The normal kernels' shared ground: arguments and peer addresses, protocol traces, phase
// stamps, fences, the token ranges of a block.
// Part of cuda/normal.cu (one translation unit): included there in order, after the parts it
// uses.
#pragma once

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
