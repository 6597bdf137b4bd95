// The combine (ep_ll_combine, ep_ll_combine_logfmt; docs/protocol.md §3.5, §3.6): partials
// reduced on the expert's rank (send part), summed by the token's rank (receive part).
// Part of cuda/low_latency.cu (one translation unit): included there in order, after the parts
// it uses.
#pragma once

// ---- combine -----------------------------------------------------------------------------------

// The combine send part's first loads, of this rank's dispatch records only (neither the epoch nor
// the mask decides them): this thread's first word of the layout range, and for thread s < R the
// bounds of send group b's slots from s's header copies (b's first slot; the next group's, or the
// last group's message count). Issued before the epoch word's and the mask's reads, so that in a
// graph replay (the call number read from the block's epoch word) the two loads' latencies overlap.
struct CombineLoads {
    int64_t range0;
    uint32_t first, end;
};

__device__ __forceinline__ void combine_loads(const Args &a, CombineLoads &p) {
    const uint32_t R = a.num_ranks, L = a.num_local_experts, b = blockIdx.x;
    p.range0 = threadIdx.x < R * L ? ((const int64_t *)a.recv_layout_range)[threadIdx.x] : 0;
    p.first = p.end = 0;
    if (threadIdx.x < R) {
        const ep_ll_layout ly = layout_of(a);
        const uint8_t *block = half_of(a, a.rank, a.disp_half) + ep_ll_drecv(ly, threadIdx.x);
        const uint32_t *copy = (const uint32_t *)(block + ep_ll_header_copy_at(ly, b));
        const uint32_t *next = (const uint32_t *)(block + ep_ll_header_copy_at(ly, b + 1));
        p.first = __ldcg(copy + EP_LL_HEADER_FIRST_WORD);
        p.end = b + 1 < gridDim.x ? __ldcg(next + EP_LL_HEADER_FIRST_WORD) : __ldcg(copy + EP_LL_HEADER_MESSAGES_WORD);
    }
}

// The send part on the expert's rank d: one BF16 partial per message of the dispatch (read from
// its meta records, in the dispatch's half), into the source's crecv[d]; then the signals.
// `pre`: combine_loads's.
template <bool LOGFMT>
__device__ void combine_send(const Args &a, uint64_t call_k, uint8_t *smem, const CombineLoads &pre) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, b = blockIdx.x;
    __shared__ uint32_t count[MAXR];
    __shared__ uint32_t first_msg[MAXR + 1];
    __shared__ uint32_t first_slot[MAXR];
    const ep_ll_layout ly = layout_of(a);
    const uint32_t R = a.num_ranks, L = a.num_local_experts, H = a.hidden;
    const uint32_t N = a.num_max_tokens, rows = R * N;
    uint32_t *begin = (uint32_t *)(smem + a.sm_begin); // [R][L]
    stamp(a, 0);
    const int64_t *range = (const int64_t *)a.recv_layout_range;
    for (uint32_t i = threadIdx.x; i < R * L; i += NT) {
        const uint32_t s = i % R, l = i / R;
        begin[s * L + l] = ep_layout_range_begin(i == threadIdx.x ? pre.range0 : range[l * R + s]);
    }
    const uint8_t *dhalf = half_of(a, a.rank, a.disp_half);
    // Send group b's slots of each source (combine_loads): from its dispatch header copy to the
    // next group's first slot (the last group: to the source's messages); none from a masked one.
    if (threadIdx.x < R) {
        const uint32_t s = threadIdx.x;
        const uint32_t first = masked(a, s) ? 0u : pre.first, end = masked(a, s) ? 0u : pre.end;
        first_slot[s] = first;
        count[s] = end > first ? end - first : 0u;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        first_msg[0] = 0;
        for (uint32_t s = 0; s < R; ++s) first_msg[s + 1] = first_msg[s] + count[s];
    }
    __syncthreads();
    const uint64_t meta_bytes = ep_ll_meta(ly), hdr = ep_ll_header(ly);
    const uint32_t total = first_msg[R];
    const __nv_bfloat16 *y = (const __nv_bfloat16 *)a.combine_y;
    // Units of UNITS x 32 chunks of one of the group's messages over the block's warps: the warp
    // reads the meta record once (lane j: entry j), then reduces its chunks.
    const uint32_t C = H * 2 / 16, per_msg = (C + 32 * UNITS - 1) / (32 * UNITS);
    for (uint32_t u = warp; u < total * per_msg; u += WARPS) {
        const uint32_t q = u / per_msg, c0 = (u % per_msg) * 32 * UNITS;
        uint32_t s = 0;
        while (q >= first_msg[s + 1]) ++s;
        const uint32_t i = first_slot[s] + q - first_msg[s];
        const uint8_t *meta = dhalf + ep_ll_drecv(ly, s) + hdr + (uint64_t)i * meta_bytes;
        uint64_t ent;
        const uint64_t head = meta_record(meta, lane, &ent);
        const uint32_t n = min(ep_ll_head_count(head), (uint32_t)MAXK);
        uint32_t my_l = 0xffffffffu, my_row = 0, my_w = 0;
        if (lane < n) {
            my_l = ep_ll_entry_expert(ent);
            my_row = begin[s * L + my_l] + ep_ll_entry_pos(ent);
            my_w = ep_ll_entry_weight_bits(ent);
        }
        // Duplicates of an expert read the row of its first entry.
        const uint32_t same = __match_any_sync(FULL, my_l);
        const uint32_t src_row = __shfl_sync(FULL, my_row, __ffs(same) - 1);
        uint32_t el[MAXK], er[MAXK];
        float ew[MAXK];
#pragma unroll
        for (uint32_t j = 0; j < MAXK; ++j) {
            el[j] = __shfl_sync(FULL, my_l, j);
            er[j] = __shfl_sync(FULL, src_row, j);
            ew[j] = __uint_as_float(__shfl_sync(FULL, my_w, j));
        }
#ifdef EP_LL_NVSHMEM
        // Staged in csend[s][i], then put to s's crecv[rank] slot i.
        int4 *dst = (int4 *)(half_of(a, a.rank, a.half) + ep_ll_csend(ly, s, i));
        uint32_t *dst_meta = (uint32_t *)(half_of(a, a.rank, a.half) + ep_ll_csend_meta(ly, s, i));
#else
        int4 *dst = (int4 *)(half_of(a, s, a.half) + ep_ll_crecv(ly, a.rank, i));
        uint32_t *dst_meta = (uint32_t *)(half_of(a, s, a.half) + ep_ll_crecv_meta(ly, a.rank, i));
#endif
        // The BF16 path stores each chunk as it is reduced; LogFMT keeps the unit for the encoder.
        int4 outs[LOGFMT ? UNITS : 1];
        for (uint32_t k = 0; k < UNITS; ++k) {
            const uint32_t c = c0 + k * 32 + lane;
            if (LOGFMT) outs[LOGFMT ? k : 0] = make_int4(0, 0, 0, 0);
            if (c >= C) {
                if (LOGFMT) continue;
                break;
            }
            int4 v[MAXK];
#pragma unroll
            for (uint32_t j = 0; j < MAXK; ++j)
                if (j < n) v[j] = ep_ld_nc((const int4 *)(y + ((uint64_t)el[j] * rows + er[j]) * H) + c);
            float acc[8];
#pragma unroll
            for (int x = 0; x < 8; ++x) acc[x] = 0.0f;
#pragma unroll
            for (uint32_t j = 0; j < MAXK; ++j) {
                if (j < n) {
                    const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&v[j];
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        float2 f = __bfloat1622float2(h2[x]);
                        acc[2 * x] = __fmaf_rn(f.x, ew[j], acc[2 * x]);
                        acc[2 * x + 1] = __fmaf_rn(f.y, ew[j], acc[2 * x + 1]);
                    }
                }
            }
            int4 out;
            __nv_bfloat162 *o2 = (__nv_bfloat162 *)&out;
#pragma unroll
            for (int x = 0; x < 4; ++x) o2[x] = __floats2bfloat162_rn(acc[2 * x], acc[2 * x + 1]);
            if (LOGFMT)
                outs[LOGFMT ? k : 0] = out;
            else
                dst[c] = out;
        }
        if (TRACED && !LOGFMT && lane == 0)
            TRACE_STORE(s, ep_ll_half_base(ly, a.half) + ep_ll_crecv(ly, a.rank, i) + 16ull * c0,
                        16ull * min(32u * UNITS, C - c0));
        if (!LOGFMT) {
#ifdef EP_LL_NVSHMEM
            put_warp(a, s, half_of(a, s, a.half) + ep_ll_crecv(ly, a.rank, i) + 16ull * c0, dst + c0,
                     16ull * min(32u * UNITS, C - c0));
#endif
            continue;
        }
        const uint32_t cast = logfmt_store_unit(outs, c0, C, lane, (uint8_t *)dst, dst_meta);
        (void)cast;
#ifdef EP_LL_NVSHMEM
        // Each chunk of the unit (its bytes only), then the unit's division metas.
        uint8_t *remote = half_of(a, s, a.half) + ep_ll_crecv(ly, a.rank, i);
        for (uint32_t j = 0; j < UNITS / 2; ++j) {
            const uint32_t ch0 = c0 * 8 + j * EP_LOGFMT_CHUNK; // first channel of the chunk
            if (ch0 >= H) break;
            const uint64_t channels = min(EP_LOGFMT_CHUNK, H - ch0);
            const uint64_t at = 2ull * ch0;
            put_warp(a, s, remote + at, (uint8_t *)dst + at, ep_logfmt_chunk_bytes(channels, (cast >> j) & 1u));
        }
        const uint32_t dv0 = c0 / 16, dv1 = min((c0 + 32 * UNITS) / 16, H / 128);
        put_warp(a, s, half_of(a, s, a.half) + ep_ll_crecv_meta(ly, a.rank, i) + 4ull * dv0, dst_meta + dv0,
                 4ull * (dv1 - dv0));
#endif
    }
    stamp(a, 2);
    __syncthreads();
    // Traced kernels only: a planted missing fence (the checker must catch it).
    const bool skip_fence = TRACED && (a.flags & EP_FLAG_TEST_SKIP_FENCE) != 0;
#ifdef EP_LL_NVSHMEM
    // Thread s: fence (the block's partial puts first), then the group's signal (the quiet that
    // frees the staging is in the receive part, quiet_if_idle_thread).
    if (threadIdx.x < R && !masked(a, threadIdx.x)) {
        const uint32_t s = threadIdx.x;
        const uint64_t sig = ep_ll_combine_signal(R, a.half, a.rank, b);
        if (!skip_fence) {
            nvshmem_fence();
            TRACE_FENCE(EP_TRACE_SCOPE_SYSTEM);
        }
        nvshmemx_signal_op(signal_of(a, s, sig), ep_ll_encode(call_k, count[s]), NVSHMEM_SIGNAL_SET, pe_of(a, s));
        TRACE_RELEASE(s, sig, ep_ll_encode(call_k, count[s]));
    }
#else
    signal_destinations(a, !skip_fence, ep_ll_combine_signal(R, a.half, a.rank, b),
                        [&](uint32_t s) { return ep_ll_encode(call_k, count[s]); });
#endif
    stamp(a, 3);
}

// The receive part on the token's rank s: wait for every unmasked expert rank, then
// combined[t] = bf16(sum over d ascending of f32(partial_d)).
template <bool LOGFMT>
__device__ void combine_recv(const Args &a, uint64_t call_k) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __shared__ uint32_t count[MAXR], expect[MAXR];
    const ep_ll_layout ly = layout_of(a);
    const uint32_t R = a.num_ranks, H = a.hidden, T = a.num_tokens;
    const int32_t *slots = (const int32_t *)a.slots;
    uint32_t tb, te;
    {
        uint64_t gs, ge;
        ep_ll_send_group(T, gridDim.x, blockIdx.x, &gs, &ge);
        tb = (uint32_t)gs, te = (uint32_t)ge;
    }
    stamp(a, 4);
    // The partials each expert rank d returns for this block's send group: its tokens with a
    // slot on d (warp d counts them).
    if (warp < R) {
        uint32_t n = 0;
        for (uint32_t t0 = tb; t0 < te; t0 += 32) {
            const uint32_t t = t0 + lane;
            n += __popc(__ballot_sync(FULL, t < te && __ldcg(&slots[t * R + warp]) >= 0));
        }
        if (lane == 0) expect[warp] = n;
    }
    __syncthreads();
    if (!wait_sources(a, call_k, EP_KERNEL_LL_COMBINE, a.half, true, count, expect)) return;
    stamp(a, 5);
    const uint8_t *mine = half_of(a, a.rank, a.half);
    const uint32_t n16 = H * 2 / 16;
    // Units of UNITS x 32 chunks of one of the group's tokens over the block's warps.
    const uint32_t per_tok = (n16 + 32 * UNITS - 1) / (32 * UNITS);
    for (uint32_t u = warp; u < (te - tb) * per_tok; u += WARPS) {
        const uint32_t t = tb + u / per_tok, c0 = (u % per_tok) * 32 * UNITS;
        const int32_t my_slot = lane < R && !masked(a, lane) ? __ldcg(&slots[t * R + lane]) : -1;
        int32_t sl[MAXR];
#pragma unroll
        for (uint32_t d = 0; d < MAXR; ++d) sl[d] = __shfl_sync(FULL, my_slot, d);
        int4 *out = (int4 *)((uint8_t *)a.combined_x + (uint64_t)t * H * 2);
        for (uint32_t k = 0; k < UNITS; ++k) {
            const uint32_t c = c0 + k * 32 + lane;
            if (c >= n16) break;
            float acc[8];
#pragma unroll
            for (int x = 0; x < 8; ++x) acc[x] = 0.0f;
            if (LOGFMT) {
                // LogFMT partials, decoded to f32 and summed in ascending rank order.
                for (uint32_t d = 0; d < R; ++d) {
                    if (sl[d] < 0) continue;
                    float pv[8];
                    logfmt_load8(mine + ep_ll_crecv(ly, d, (uint32_t)sl[d]),
                                 (const uint32_t *)(mine + ep_ll_crecv_meta(ly, d, (uint32_t)sl[d])), c, H, pv);
#pragma unroll
                    for (int x = 0; x < 8; ++x) acc[x] = __fadd_rn(acc[x], pv[x]);
                }
            } else {
            int4 v[MAXR];
#pragma unroll
            for (uint32_t d = 0; d < MAXR; ++d)
                if (sl[d] >= 0) v[d] = ld_cg16(mine + ep_ll_crecv(ly, d, (uint32_t)sl[d]) + 16ull * c);
#ifdef EP_TRACE
            if (k == 0 && lane == 0)
                for (uint32_t d = 0; d < R; ++d)
                    if (sl[d] >= 0)
                        TRACE_LOAD(a.rank, ep_ll_half_base(ly, a.half) + ep_ll_crecv(ly, d, (uint32_t)sl[d]) + 16ull * c0,
                                   16ull * min(32u * UNITS, n16 - c0));
#endif
#pragma unroll
            for (uint32_t d = 0; d < MAXR; ++d) {
                if (sl[d] >= 0) {
                    const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&v[d];
#pragma unroll
                    for (int x = 0; x < 4; ++x) {
                        float2 f = __bfloat1622float2(h2[x]);
                        acc[2 * x] = __fadd_rn(acc[2 * x], f.x);
                        acc[2 * x + 1] = __fadd_rn(acc[2 * x + 1], f.y);
                    }
                }
            }
            }
            int4 o;
            __nv_bfloat162 *o2 = (__nv_bfloat162 *)&o;
#pragma unroll
            for (int x = 0; x < 4; ++x) o2[x] = __floats2bfloat162_rn(acc[2 * x], acc[2 * x + 1]);
            out[c] = o;
        }
    }
    stamp(a, 6);
}

// One kernel per combine flavour (LogFMT's encoder would cost the BF16 path registers).
template <bool LOGFMT>
__device__ __forceinline__ void combine_kernel(const Args &a, uint8_t *smem) {
    const bool send = (a.flags & EP_FLAG_LL_SEND) != 0;
    CombineLoads pre;
    if (send) combine_loads(a, pre);
    const uint64_t call_k = op_epoch(a);
    load_mask(a);
    if (masked(a, a.rank)) return;
    if (send) combine_send<LOGFMT>(a, call_k, smem, pre);
    if (a.flags & EP_FLAG_LL_RECV) combine_recv<LOGFMT>(a, call_k);
}

extern "C" __global__ void __launch_bounds__(NT, 1) ep_ll_combine(const Args a) {
    extern __shared__ __align__(16) uint8_t smem[];
    combine_kernel<false>(a, smem);
}

// use_logfmt (EP_FLAG_LOGFMT).
extern "C" __global__ void __launch_bounds__(NT, 1) ep_ll_combine_logfmt(const Args a) {
    extern __shared__ __align__(16) uint8_t smem[];
    combine_kernel<true>(a, smem);
}
