// Moving rows: the L2 prefetch of a dispatch block's first rows, and a warp's row copy to
// every destination (two passes in flight).
// Part of cuda/normal.cu (one translation unit): included there in order, after the parts it
// uses.
#pragma once

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
