// The combine (ep_normal_combine, docs/protocol.md §2.5, §2.6): rows pulled in place and reduced.
// Part of cuda/normal.cu (one translation unit): included there in order, after the parts it
// uses.
#pragma once

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
