// get_dispatch_layout on the device (ep_normal_layout).
// Part of cuda/normal.cu (one translation unit): included there in order, after the parts it
// uses.
#pragma once

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
