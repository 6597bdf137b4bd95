// The dispatch (ep_ll_dispatch, docs/protocol.md §3.3, §3.4): routing, messages and signals
// (send part), placement at begin(l, s) + pos (receive part).
// Part of cuda/low_latency.cu (one translation unit): included there in order, after the parts
// it uses.
#pragma once

// ---- dispatch ----------------------------------------------------------------------------------

// Shared-memory arrays of the dispatch send part (offsets from the host, Args.sm_*).
struct SendSmem {
    int16_t *expert; // [T*K] expert id; -1: masked entry or masked destination
    uint16_t *pos;   // [T*K] row of the entry within its (local expert, source) block (the group's)
    uint32_t *before; // [E] entries of the tokens before the send group per expert, then a running count
    uint32_t *tot;   // [E] entries of this rank per expert
    uint8_t *dmask;  // [T] destination ranks of the token (bit d)
    uint16_t *slot;  // [T][R] slot of the token in d's drecv[s] (0xffff: none)
};

__device__ __forceinline__ SendSmem send_smem(const Args &a, uint8_t *base) {
    SendSmem s;
    s.expert = (int16_t *)(base + a.sm_expert);
    s.pos = (uint16_t *)(base + a.sm_pos);
    s.before = (uint32_t *)(base + a.sm_before);
    s.tot = (uint32_t *)(base + a.sm_tot);
    s.dmask = (uint8_t *)(base + a.sm_dmask);
    s.slot = (uint16_t *)(base + a.sm_slot);
    return s;
}

// Routing of this rank's tokens, computed by every block (T*K entries: small), in two steps so
// that the rows can go out between them. `send_slots`: expert ids (validated), each token's
// destination ranks and its slot on each, and per expert the rank's entries (`tot`, the headers)
// and those of the tokens before the send group (`before`); `ncnt[d]` gets the messages to d.
// An expert id outside [-1, E) is recorded (EP_ERR_EXPERT) and treated as -1, so the protocol
// still completes and the group stays usable.
// `gfirst[d]` / `gcnt[d]`: the first slot and the messages to d of this block's send group,
// tokens [tb, te) (docs/protocol.md §3.3).
__device__ void send_slots(const Args &a, SendSmem sm, uint32_t *ncnt, uint32_t tb, uint32_t te, uint32_t *gfirst,
                           uint32_t *gcnt) {
    const uint32_t T = a.num_tokens, K = a.num_topk, E = a.num_experts, L = a.num_local_experts;
    const uint32_t R = a.num_ranks;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    // dmask as 32-bit words (4 tokens each, bit 8 (t % 4) + d; the carve-out pads it to 16 bytes).
    uint32_t *dmask_w = (uint32_t *)sm.dmask;
    for (uint32_t i = threadIdx.x; i < E; i += NT) sm.tot[i] = 0, sm.before[i] = 0;
    for (uint32_t i = threadIdx.x; i < (T + 3) / 4; i += NT) dmask_w[i] = 0;
    const int64_t *idx = (const int64_t *)a.topk_idx;
    // Entry j = t K + k of the rank, NT apart per thread (loads coalesced, ~T K / NT entries each:
    // every thread shares the counting); the first two are loaded before the counters' barrier, so
    // their latency runs under it.
    const uint32_t TK = T * K, j0 = threadIdx.x;
    const int64_t id0 = j0 < TK ? idx[j0] : -1, id1 = j0 + NT < TK ? idx[j0 + NT] : -1;
    __syncthreads();
    // Stamp 11: thread 0's first id has arrived (a branch on it: the timer is read after the load).
    if (a.phase_times != 0 && threadIdx.x == 0 && id0 != INT64_MIN) stamp(a, 11);
    for (uint32_t j = j0; j < TK; j += NT) {
        int64_t e = j == j0 ? id0 : j == j0 + NT ? id1 : idx[j];
        const uint32_t t = j / K;
        if (e < -1 || e >= (int64_t)E) {
            if (blockIdx.x == 0)
                ep_fail((ep_err_block *)a.err, EP_ERR_EXPERT, a.rank, EP_KERNEL_LL_DISPATCH, a.rank, 0, E,
                        (uint64_t)e, j);
            e = -1;
        }
        // e in [-1, E): one 32-bit division for the destination and its mask bit.
        const uint32_t d = e >= 0 ? (uint32_t)e / L : 0u;
        if (e >= 0 && masked(a, d)) e = -1;
        sm.expert[j] = (int16_t)e;
        if (e >= 0) {
            atomicOr(&dmask_w[t / 4], 1u << (8 * (t % 4) + d));
            atomicAdd(&sm.tot[e], 1u);
            if (t < tb) atomicAdd(&sm.before[e], 1u);
        }
    }
    __syncthreads();
    stamp(a, 7);
    // Slots: warp d ranks the tokens with an expert on d.
    if (warp < R) {
        const uint32_t d = warp;
        uint32_t run = 0, first = 0, mine = 0;
        for (uint32_t b = 0; b < T; b += 32) {
            uint32_t t = b + lane;
            bool to_d = t < T && ((sm.dmask[t] >> d) & 1u);
            uint32_t bal = __ballot_sync(FULL, to_d);
            if (t < T) sm.slot[t * R + d] = to_d ? (uint16_t)(run + __popc(bal & lanemask_lt())) : 0xffffu;
            run += __popc(bal);
            first += __popc(__ballot_sync(FULL, to_d && t < tb));
            mine += __popc(__ballot_sync(FULL, to_d && t >= tb && t < te));
        }
        if (lane == 0) ncnt[d] = run, gfirst[d] = first, gcnt[d] = mine;
    }
    __syncthreads();
}

// `send_positions`: the row of each entry of the send group's tokens [tb, te) within its
// (expert, source) block: `before[e]` (the entries of earlier tokens) plus its rank among the
// group's entries of e in (t, k) order — the numbers a rank-wide ranking in (t, k) order gives.
// Warp 0 ranks them (lanes with the same expert by __match_any_sync), 32 entries a step.
__device__ void send_positions(const Args &a, SendSmem sm, uint32_t tb, uint32_t te) {
    const uint32_t K = a.num_topk, lane = threadIdx.x % 32;
    if (threadIdx.x < 32) {
        for (uint32_t j0 = tb * K; j0 < te * K; j0 += 32) {
            const uint32_t j = j0 + lane;
            const int32_t e = j < te * K ? sm.expert[j] : -1;
            const uint32_t same = __match_any_sync(FULL, e);
            const uint32_t rank_in = __popc(same & lanemask_lt());
            const uint32_t base = e >= 0 ? sm.before[e] : 0u;
            __syncwarp();
            if (e >= 0) {
                sm.pos[j] = (uint16_t)(base + rank_in);
                if (rank_in == 0) sm.before[e] = base + __popc(same);
            }
            __syncwarp();
        }
    }
    __syncthreads();
}

// FP8 cast of 8 consecutive values of a 128-channel block whose 16 lanes (a half warp) hold the
// block: amax over the half warp, DeepEP's scales (numerics/fp8.rs), e4m3 with satfinite.
__device__ __forceinline__ uint2 cast8(int4 raw, bool round_scale, float *scale_inv) {
    const __nv_bfloat162 *h2 = (const __nv_bfloat162 *)&raw;
    float v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(h2[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
    float amax = 1e-4f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
    for (int o = 8; o >= 1; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, o));
    float scale, sinv;
    if (round_scale) {
        uint32_t bits = __float_as_uint(amax * (1.0f / 448.0f));
        int32_t e = (int32_t)((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
        scale = __uint_as_float((uint32_t)(-e + 127) << 23);
        sinv = __uint_as_float((uint32_t)(e + 127) << 23);
    } else {
        scale = 448.0f / amax;
        sinv = amax * (1.0f / 448.0f);
    }
    *scale_inv = sinv;
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t q = __nv_cvt_float_to_fp8(__fmul_rn(v[i], scale), __NV_SATFINITE, __NV_E4M3);
        lo |= (q & 0xffu) << (8 * i);
        uint32_t q2 = __nv_cvt_float_to_fp8(__fmul_rn(v[4 + i], scale), __NV_SATFINITE, __NV_E4M3);
        hi |= (q2 & 0xffu) << (8 * i);
    }
    return make_uint2(lo, hi);
}

// Rows units of a token's row: BF16, UNITS x 32 chunks of 16 bytes; FP8, 2 x UNITS 128-channel
// blocks (a half warp each).
__device__ __forceinline__ uint32_t units_per_row(uint32_t H, bool fp8) {
    return fp8 ? (H / 128 + 2 * UNITS - 1) / (2 * UNITS) : (H * 2 / 16 + 32 * UNITS - 1) / (32 * UNITS);
}

// The loads of rows unit i of token `t` (units_per_row): BF16, chunks from i x 32 x UNITS; FP8,
// blocks from i x 2 x UNITS (zero past the row). Loaded once: the row is cast (FP8) and stored
// to each destination from these registers.
__device__ __forceinline__ void load_unit(const Args &a, bool fp8, uint32_t t, uint32_t i, uint32_t lane,
                                          int4 (&v)[UNITS]) {
    const uint32_t H = a.hidden;
    const int4 *src = (const int4 *)((const uint8_t *)a.x + (uint64_t)t * H * 2);
    if (!fp8) {
        const uint32_t C = H * 2 / 16, c0 = i * 32 * UNITS;
#pragma unroll
        for (uint32_t k = 0; k < UNITS; ++k) {
            const uint32_t c = c0 + k * 32 + lane;
            if (c < C) v[k] = ep_ld_nc(src + c);
        }
    } else {
        const uint32_t S = H / 128, b0 = i * 2 * UNITS;
#pragma unroll
        for (uint32_t k = 0; k < UNITS; ++k) {
            const uint32_t blk = b0 + 2 * k + lane / 16;
            v[k] = blk < S ? ep_ld_nc(src + blk * 16 + lane % 16) : make_int4(0, 0, 0, 0);
        }
    }
}

// Variant (b): this rank's staged copy of token `t`'s message, dsend_rows[t] of the call's half.
__device__ __forceinline__ uint8_t *staged_row(const Args &a, const ep_ll_layout &ly, uint32_t t) {
    return half_of(a, a.rank, a.half) + ep_ll_dsend_row(ly, t);
}

// Where this rank's message of token `t` lands on destination `d`: its row in d's drecv[rank].
__device__ __forceinline__ uint8_t *message_row(const Args &a, const ep_ll_layout &ly,
                                                const SendSmem &sm, uint32_t R, uint32_t t,
                                                uint32_t d) {
    return half_of(a, d, a.half) + ep_ll_drecv_row(ly, a.rank, sm.slot[t * R + d]);
}

// Where this rank writes the header and meta records of its messages to `d`: (a) d's
// `drecv[rank]` itself; (b) this rank's `dsend_meta[d]` (a send group's records in one put, the
// header with the signal).
__device__ __forceinline__ uint8_t *meta_block_out(const Args &a, const ep_ll_layout &ly, uint32_t d) {
#ifdef EP_LL_NVSHMEM
    return half_of(a, a.rank, a.half) + ep_ll_dsend_meta(ly, d);
#else
    return half_of(a, d, a.half) + ep_ll_drecv(ly, a.rank);
#endif
}

// The send part of send group b = blockIdx.x (docs/protocol.md §3.3, §3.10): the messages of the
// block's tokens [tb, te) (ep_ll_send_group) into their destinations' drecv[s], their meta
// records, and on each destination the group's header copy, then one fence and the group's
// signal disp_sig[h][s][b]. Every block routes the whole rank (it needs every entry's pos and the
// per-expert totals); no block waits for another.
__device__ void dispatch_send(const Args &a, uint64_t call_k, uint8_t *smem) {
    __shared__ uint32_t ncnt[MAXR], gfirst[MAXR], gcnt[MAXR];
    SendSmem sm = send_smem(a, smem);
    const ep_ll_layout ly = layout_of(a);
    const uint32_t T = a.num_tokens, K = a.num_topk, R = a.num_ranks, L = a.num_local_experts;
    const uint32_t H = a.hidden, b = blockIdx.x;
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const bool fp8 = (a.flags & EP_FLAG_FP8) != 0;
    const bool round_scale = (a.flags & EP_FLAG_ROUND_SCALE) != 0;
    uint32_t tb, te;
    {
        uint64_t gs, ge;
        ep_ll_send_group(T, gridDim.x, b, &gs, &ge);
        tb = (uint32_t)gs, te = (uint32_t)ge;
    }
    const uint32_t nt = te - tb;
    const uint32_t per_row = units_per_row(H, fp8);
    const float *weights = (const float *)a.topk_weights;
    // This warp's first rows unit and the weights of its first meta token, loaded before the
    // routing (neither depends on it), so their latency runs under the routing's.
    int4 v[UNITS];
    if (warp < nt * per_row) load_unit(a, fp8, tb + warp / per_row, warp % per_row, lane, v);
    const float w_first = tb + warp < te && lane < K ? weights[(uint64_t)(tb + warp) * K + lane] : 0.0f;
    stamp(a, 0);
    send_slots(a, sm, ncnt, tb, te, gfirst, gcnt);
    stamp(a, 1);
    if (blockIdx.x == 0) {
        int32_t *slots = (int32_t *)a.slots;
        for (uint32_t i = threadIdx.x; i < T * R; i += NT)
            slots[i] = sm.slot[i] == 0xffffu ? -1 : (int32_t)sm.slot[i];
        if (threadIdx.x < R) ((int32_t *)a.send_counts)[threadIdx.x] = (int32_t)ncnt[threadIdx.x];
    }
    const uint64_t meta_bytes = ep_ll_meta(ly), hdr = ep_ll_header(ly), hc = ep_ll_header_copy(ly);
    const uint64_t copy_at = ep_ll_header_copy_at(ly, b);
    // Rows: units of one of the group's tokens (load_unit) over the block's warps, the unit's
    // loads issued before its stores (short dependency chains; the first unit's before the
    // routing); each row loaded once, cast once, stored to each destination.
    if (!fp8) {
        const uint32_t C = H * 2 / 16;
        for (uint32_t u = warp; u < nt * per_row; u += WARPS) {
            const uint32_t t = tb + u / per_row, c0 = (u % per_row) * 32 * UNITS;
            if (u != warp) load_unit(a, false, t, u % per_row, lane, v);
            else if (a.phase_times != 0 && threadIdx.x == 0 && (uint32_t)v[0].x != 0x7fc17fc1u) stamp(a, 8);
            const uint32_t dm = sm.dmask[t];
            if (dm == 0) continue;
#ifdef EP_LL_NVSHMEM
            // Staged once in dsend_rows[t], then put to each destination.
            int4 *stage = (int4 *)staged_row(a, ly, t);
#pragma unroll
            for (uint32_t k = 0; k < UNITS; ++k) {
                const uint32_t c = c0 + k * 32 + lane;
                if (c < C) stage[c] = v[k];
            }
            const uint64_t bytes = 16ull * min(32u * UNITS, C - c0);
            for (uint32_t d = 0; d < R; ++d)
                if ((dm >> d) & 1u) put_warp(a, d, message_row(a, ly, sm, R, t, d) + 16ull * c0, stage + c0, bytes);
#else
            for (uint32_t d = 0; d < R; ++d) {
                if (!((dm >> d) & 1u)) continue;
                int4 *dst = (int4 *)message_row(a, ly, sm, R, t, d);
#pragma unroll
                for (uint32_t k = 0; k < UNITS; ++k) {
                    const uint32_t c = c0 + k * 32 + lane;
                    if (c < C) dst[c] = v[k];
                }
                if (TRACED && lane == 0)
                    TRACE_STORE(d, ep_ll_half_base(ly, a.half) + ep_ll_drecv_row(ly, a.rank, sm.slot[t * R + d]) + 16ull * c0,
                                16ull * min(32u * UNITS, C - c0));
            }
#endif
        }
    } else {
        // A half warp per 128-channel block: a unit is 2 x UNITS blocks of one token.
        const uint32_t S = H / 128;
        const uint64_t soff = ep_ll_fp8_scales_offset(ly);
        const uint32_t half_id = lane / 16, sub = lane % 16;
        for (uint32_t u = warp; u < nt * per_row; u += WARPS) {
            const uint32_t t = tb + u / per_row, b0 = (u % per_row) * 2 * UNITS;
            if (u != warp) load_unit(a, true, t, u % per_row, lane, v);
            // Stamp 8: warp 0's first rows unit has arrived (a branch on it, as stamp 11).
            else if (a.phase_times != 0 && threadIdx.x == 0 && (uint32_t)v[0].x != 0x7fc17fc1u) stamp(a, 8);
            const uint32_t dm = sm.dmask[t];
            if (dm == 0) continue;
#pragma unroll
            for (uint32_t k = 0; k < UNITS; ++k) {
                const uint32_t blk = b0 + 2 * k + half_id;
                float sinv;
                const uint2 q = cast8(v[k], round_scale, &sinv); // every lane: it shuffles
                if (blk >= S) continue;
#ifdef EP_LL_NVSHMEM
                uint8_t *stage = staged_row(a, ly, t);
                *(uint2 *)(stage + blk * 128 + sub * 8) = q;
                if (sub == 0) *(float *)(stage + soff + 4ull * blk) = sinv;
#else
                for (uint32_t d = 0; d < R; ++d) {
                    if (!((dm >> d) & 1u)) continue;
                    uint8_t *dst = message_row(a, ly, sm, R, t, d);
                    *(uint2 *)(dst + blk * 128 + sub * 8) = q;
                    if (sub == 0) *(float *)(dst + soff + 4ull * blk) = sinv;
                }
#endif
            }
#if !defined(EP_LL_NVSHMEM) && defined(EP_TRACE)
            if (lane == 0) {
                const uint32_t b1 = min(b0 + 2 * UNITS, S);
                for (uint32_t d = 0; d < R; ++d) {
                    if (!((dm >> d) & 1u)) continue;
                    const uint64_t row = ep_ll_half_base(ly, a.half) + ep_ll_drecv_row(ly, a.rank, sm.slot[t * R + d]);
                    TRACE_STORE(d, row + 128ull * b0, 128ull * (b1 - b0));
                    TRACE_STORE(d, row + soff + 4ull * b0, 4ull * (b1 - b0));
                }
            }
#endif
#ifdef EP_LL_NVSHMEM
            // The unit's e4m3 blocks, staged, then put to each destination (its scales, staged
            // too, go with the row's others in one put: below, after the positions' barrier).
            const uint8_t *stage = staged_row(a, ly, t);
            const uint32_t b1 = min(b0 + 2 * UNITS, S);
            for (uint32_t d = 0; d < R; ++d) {
                if (!((dm >> d) & 1u)) continue;
                uint8_t *dst = message_row(a, ly, sm, R, t, d);
                put_warp(a, d, dst + 128ull * b0, stage + 128ull * b0, 128ull * (b1 - b0));
            }
#endif
        }
    }
    // While the rows drain: positions, then the group's meta records (receivers read them only
    // after the signal). Warp w writes those of tokens tb + w, tb + w + WARPS, ... (lane k = top-k
    // slot k).
    stamp(a, 9);
    send_positions(a, sm, tb, te);
    stamp(a, 10);
#ifdef EP_LL_NVSHMEM
    // Variant (b), FP8: each row's scales, staged by its units' warps (in the block's view since
    // the positions' barrier), in one put per (token, destination), on the warps counted from the
    // last while the first ones write the meta records (one put where a row's units took one each).
    if (fp8) {
        const uint64_t soff = ep_ll_fp8_scales_offset(ly);
        for (uint32_t i = WARPS - 1 - warp; i < nt * R; i += WARPS) {
            const uint32_t t = tb + i / R, d = i % R;
            if (!((sm.dmask[t] >> d) & 1u)) continue;
            const uint8_t *stage = staged_row(a, ly, t);
            put_warp(a, d, message_row(a, ly, sm, R, t, d) + soff, stage + soff, 4ull * (H / 128));
        }
    }
#endif
    for (uint32_t t = tb + warp; t < te; t += WARPS) {
        const uint32_t dm = sm.dmask[t];
        const int32_t e = lane < K ? sm.expert[t * K + lane] : -1;
        for (uint32_t d = 0; d < R; ++d) {
            if (!((dm >> d) & 1u)) continue;
            uint8_t *meta = meta_block_out(a, ly, d) + hdr + (uint64_t)sm.slot[t * R + d] * meta_bytes;
            const bool on_d = e >= 0 && (uint32_t)e / L == d;
            const uint32_t bal = __ballot_sync(FULL, on_d);
            if (on_d) {
                const uint32_t i = __popc(bal & lanemask_lt());
                const uint32_t l = (uint32_t)e - d * L;
                const uint32_t w = __float_as_uint(t == tb + warp ? w_first : weights[t * K + lane]);
                *(uint64_t *)(meta + 8 + 8ull * i) = ep_ll_meta_entry((uint16_t)l, sm.pos[t * K + lane], w);
            }
            if (lane == 0) *(uint64_t *)meta = ep_ll_meta_head(t, __popc(bal));
            if (TRACED && lane == 0)
                TRACE_STORE(d, ep_ll_half_base(ly, a.half) + ep_ll_drecv(ly, a.rank) + hdr + (uint64_t)sm.slot[t * R + d] * meta_bytes,
                            8ull + 8ull * __popc(bal));
        }
    }
    // The group's header copy b on every unmasked destination: [first slot, the rank's messages
    // to d, c(l, s) for l < L].
    const uint32_t words = EP_LL_HEADER_COUNTS_WORD + L;
    for (uint32_t i = threadIdx.x; i < R * words; i += NT) {
        const uint32_t d = i / words, j = i % words;
        if (masked(a, d)) continue;
        uint32_t *copy = (uint32_t *)(meta_block_out(a, ly, d) + copy_at);
        copy[j] = j == EP_LL_HEADER_FIRST_WORD      ? gfirst[d]
                  : j == EP_LL_HEADER_MESSAGES_WORD ? ncnt[d]
                                                    : sm.tot[d * L + j - EP_LL_HEADER_COUNTS_WORD];
    }
    stamp(a, 2);
    __syncthreads();
    // Traced kernels only: a planted missing fence (the checker must catch it).
    const bool skip_fence = TRACED && (a.flags & EP_FLAG_TEST_SKIP_FENCE) != 0;
#ifdef EP_LL_NVSHMEM
    // Warp d: the group's meta records to d (slots gfirst[d] .. + gcnt[d], contiguous on both
    // sides) in one put (§3.3), then fence (every row, scale and meta put of this block before
    // what follows), then one put_signal of the header copy carrying disp_sig[h][rank][b]. The
    // quiet that frees the staging (§3.7) is in the receive part (quiet_if_idle_thread).
    if (warp < R && !masked(a, warp)) {
        const uint32_t d = warp;
        const uint64_t sig = ep_ll_dispatch_signal(R, a.half, a.rank, b);
        uint8_t *staged = meta_block_out(a, ly, d), *remote = half_of(a, d, a.half) + ep_ll_drecv(ly, a.rank);
        uint8_t *copy = staged + copy_at, *dst = remote + copy_at;
        if (gcnt[d] > 0) {
            const uint64_t at = hdr + (uint64_t)gfirst[d] * meta_bytes;
            put_warp(a, d, remote + at, staged + at, (uint64_t)gcnt[d] * meta_bytes);
            __syncwarp();  // every lane's part of that put, before lane 0's fence
        }
        if (lane == 0) {
            if (!skip_fence) {
                nvshmem_fence();
                TRACE_FENCE(EP_TRACE_SCOPE_SYSTEM);
            }
#ifdef EP_TRACE
            TRACE_STORE(a.rank, data_offset(a, a.rank, copy), hc);
            trace_put_signal(a, d, data_offset(a, d, dst), data_offset(a, a.rank, copy), hc, sig,
                             ep_ll_encode(call_k, gcnt[d]));
#endif
        }
        __syncwarp();
        nvshmemx_putmem_signal_nbi_warp(dst, copy, hc, signal_of(a, d, sig), ep_ll_encode(call_k, gcnt[d]),
                                        NVSHMEM_SIGNAL_SET, pe_of(a, d));
    }
#else
    if (TRACED && threadIdx.x == 0)
        for (uint32_t d = 0; d < R; ++d)
            if (!masked(a, d)) TRACE_STORE(d, ep_ll_half_base(ly, a.half) + ep_ll_drecv(ly, a.rank) + copy_at, hc);
    signal_destinations(a, !skip_fence, ep_ll_dispatch_signal(R, a.half, a.rank, b),
                        [&](uint32_t d) { return ep_ll_encode(call_k, gcnt[d]); });
#endif
    stamp(a, 3);
}

// A message's meta record (§3.3: a head word, then up to MAXK entries) in one round trip: every
// lane loads the head, lane j < MAXK entry j (past the head's count: whatever the record held,
// not to be used), both before either is used. Returns the head, *ent lane's entry.
__device__ __forceinline__ uint64_t meta_record(const uint8_t *meta, uint32_t lane, uint64_t *ent) {
    *ent = lane < MAXK ? __ldcg((const unsigned long long *)(meta + 8 + 8ull * lane)) : 0ull;
    return __ldcg((const unsigned long long *)meta);
}

// The receive part of block b on rank d (docs/protocol.md §3.4, §3.10): wait for send group b of
// every unmasked source, read its header copy, place its messages.
__device__ void dispatch_recv(const Args &a, uint64_t call_k, uint8_t *smem) {
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, b = blockIdx.x;
    __shared__ uint32_t count[MAXR];
    __shared__ uint32_t first_msg[MAXR + 1];
    __shared__ uint32_t first_slot[MAXR];
    __shared__ uint32_t from[MAXR];
    __shared__ int bad;
    const ep_ll_layout ly = layout_of(a);
    const uint32_t R = a.num_ranks, L = a.num_local_experts, H = a.hidden;
    const uint32_t N = a.num_max_tokens, rows = R * N;
    const bool fp8 = (a.flags & EP_FLAG_FP8) != 0, ue8m0 = (a.flags & EP_FLAG_UE8M0) != 0;
    uint32_t *begin = (uint32_t *)(smem + a.sm_begin); // [R][L]
    const uint64_t hc = ep_ll_header_copy(ly), copy_at = ep_ll_header_copy_at(ly, b);
    stamp(a, 4);
    if (!wait_sources(a, call_k, EP_KERNEL_LL_DISPATCH, a.half, false, count, nullptr)) return;
    stamp(a, 5);
    uint8_t *mine = half_of(a, a.rank, a.half);
    if (threadIdx.x == 0) bad = 0;
    for (uint32_t i = threadIdx.x; i < R * L; i += NT) {
        const uint32_t s = i / L, l = i % L;
        begin[i] = masked(a, s) ? 0u
                                : __ldcg((const uint32_t *)(mine + ep_ll_drecv(ly, s) + copy_at) + EP_LL_HEADER_COUNTS_WORD + l);
    }
    if (threadIdx.x < R) {
        const uint32_t s = threadIdx.x;
        const uint32_t *copy = (const uint32_t *)(mine + ep_ll_drecv(ly, s) + copy_at);
        first_slot[s] = masked(a, s) ? 0u : __ldcg(copy + EP_LL_HEADER_FIRST_WORD);
        from[s] = masked(a, s) ? 0u : __ldcg(copy + EP_LL_HEADER_MESSAGES_WORD);
        // The group's slots must lie within the source's messages, and those within N.
        if (!masked(a, s) && (from[s] > N || first_slot[s] + count[s] > from[s])) {
            ep_fail((ep_err_block *)a.err, EP_ERR_COUNT, a.rank, EP_KERNEL_LL_DISPATCH, a.rank,
                    ep_ll_dispatch_signal(R, a.half, s, b), from[s], first_slot[s] + count[s], s);
            bad = 1;
        }
    }
    if (threadIdx.x == 0) {
        first_msg[0] = 0;
        for (uint32_t s = 0; s < R; ++s) first_msg[s + 1] = first_msg[s] + count[s];
    }
    __syncthreads();
    if (bad) return;
    if (TRACED && threadIdx.x == 0)
        for (uint32_t s = 0; s < R; ++s)
            if (!masked(a, s)) TRACE_LOAD(a.rank, ep_ll_half_base(ly, a.half) + ep_ll_drecv(ly, s) + copy_at, hc);
    // Counts → running begin per expert (ascending source), and the handle outputs.
    for (uint32_t l = threadIdx.x; l < L; l += NT) {
        uint32_t run = 0;
        for (uint32_t s = 0; s < R; ++s) {
            const uint32_t c = begin[s * L + l];
            begin[s * L + l] = run;
            if (blockIdx.x == 0)
                ((int64_t *)a.recv_layout_range)[l * R + s] = ep_pack_layout_range(run, c);
            run += c;
        }
        if (blockIdx.x == 0) {
            ((int32_t *)a.recv_count)[l] = (int32_t)run;
            if (a.recv_stats != 0) ((int32_t *)a.recv_stats)[l] += (int32_t)run;
        }
    }
    if (blockIdx.x == 0 && threadIdx.x < R) ((int32_t *)a.recv_counts)[threadIdx.x] = (int32_t)from[threadIdx.x];
    __syncthreads();
    const uint64_t meta_bytes = ep_ll_meta(ly), hdr = ep_ll_header(ly);
    const uint32_t S = H / 128, S4 = (S + 3) / 4;
    const uint32_t total = first_msg[R];
    // Units of UNITS x 32 chunks of one of the group's messages over the block's warps: the warp
    // reads the meta record once (lane j: entry j), then copies its chunks to each entry's place;
    // the message's first unit also writes src_info and the scales.
    const uint64_t xbytes = fp8 ? H : 2ull * H;
    const uint32_t C = (uint32_t)(xbytes / 16), per_msg = (C + 32 * UNITS - 1) / (32 * UNITS);
    for (uint32_t u = warp; u < total * per_msg; u += WARPS) {
        const uint32_t q = u / per_msg, c0 = (u % per_msg) * 32 * UNITS;
        uint32_t s = 0;
        while (q >= first_msg[s + 1]) ++s;
        const uint32_t i = first_slot[s] + q - first_msg[s];
        const uint8_t *recv = mine + ep_ll_drecv(ly, s);
        const uint8_t *meta = recv + hdr + (uint64_t)i * meta_bytes;
        const uint8_t *row = mine + ep_ll_drecv_row(ly, s, i);
        // One round trip: the row's loads, the meta record (meta_record) and, for an FP8
        // message's first unit, its first 64 scales (lane j: scales j and 32 + j) are all issued
        // before any is used.
        int4 v[UNITS];
#pragma unroll
        for (uint32_t k = 0; k < UNITS; ++k) {
            const uint32_t c = c0 + k * 32 + lane;
            if (c < C) v[k] = ld_cg16(row + 16ull * c);
        }
        uint64_t ent;
        const uint64_t head = meta_record(meta, lane, &ent);
        const float *sc = (const float *)(row + ep_ll_fp8_scales_offset(ly));
        const bool first_sc = fp8 && c0 == 0; // warp-uniform
        const float sc_lo = first_sc && lane < S ? __ldcg(sc + lane) : 0.0f;
        const float sc_hi = first_sc && 32 + lane < S ? __ldcg(sc + 32 + lane) : 0.0f;
        const uint32_t t = ep_ll_head_token(head), n = min(ep_ll_head_count(head), (uint32_t)MAXK);
        if (TRACED && lane == 0) {
            const uint64_t base = ep_ll_half_base(ly, a.half);
            TRACE_LOAD(a.rank, base + ep_ll_drecv_row(ly, s, i) + 16ull * c0, 16ull * min(32u * UNITS, C - c0));
            TRACE_LOAD(a.rank, base + ep_ll_drecv(ly, s) + hdr + (uint64_t)i * meta_bytes, 8ull + 8ull * n);
        }
        uint32_t my_l = 0, my_row = 0;
        if (lane < n) {
            my_l = ep_ll_entry_expert(ent);
            my_row = begin[s * L + my_l] + ep_ll_entry_pos(ent);
            if (c0 == 0) ((int32_t *)a.recv_src_info)[(uint64_t)my_l * rows + my_row] = (int32_t)t;
        }
        uint32_t el[MAXK], er[MAXK];
#pragma unroll
        for (uint32_t j = 0; j < MAXK; ++j) {
            el[j] = __shfl_sync(FULL, my_l, j);
            er[j] = __shfl_sync(FULL, my_row, j);
        }
#pragma unroll
        for (uint32_t j = 0; j < MAXK; ++j) {
            if (j >= n) continue;
            int4 *dst = (int4 *)((uint8_t *)a.recv_x + ((uint64_t)el[j] * rows + er[j]) * xbytes);
#pragma unroll
            for (uint32_t k = 0; k < UNITS; ++k) {
                const uint32_t c = c0 + k * 32 + lane;
                if (c < C) dst[c] = v[k];
            }
        }
        if (first_sc) {
            // Scales, in DeepEP's memory order [L][S][R*N] (f32) or [L][S/4][R*N] (UE8M0 words).
            if (!ue8m0) {
                for (uint32_t k = lane; k < S; k += 32) {
                    const float x = k < 32 ? sc_lo : k < 64 ? sc_hi : __ldcg(sc + k);
#pragma unroll
                    for (uint32_t j = 0; j < MAXK; ++j)
                        if (j < n) ((float *)a.recv_scales)[((uint64_t)el[j] * S + k) * rows + er[j]] = x;
                }
            } else {
                // Word k packs scales 4k..4k+3; those below 64 come from the lanes holding them.
                for (uint32_t k0 = 0; k0 < S4; k0 += 32) {
                    const uint32_t k = k0 + lane;
                    uint32_t word = 0;
#pragma unroll
                    for (uint32_t b = 0; b < 4; ++b) {
                        const uint32_t idx = 4 * k + b;
                        float x;
                        if (k0 == 0 && S <= 64) { // warp-uniform: every lane shuffles
                            const float lo = __shfl_sync(FULL, sc_lo, idx & 31u);
                            const float hi = __shfl_sync(FULL, sc_hi, idx & 31u);
                            x = idx < 32 ? lo : hi;
                        } else {
                            x = k < S4 && idx < S ? __ldcg(sc + idx) : 0.0f;
                        }
                        if (k < S4 && idx < S) word |= ((__float_as_uint(x) >> 23) & 0xffu) << (8 * b);
                    }
                    if (k >= S4) continue;
#pragma unroll
                    for (uint32_t j = 0; j < MAXK; ++j)
                        if (j < n) ((uint32_t *)a.recv_scales)[((uint64_t)el[j] * S4 + k) * rows + er[j]] = word;
                }
            }
            if (TRACED && lane == 0)
                TRACE_LOAD(a.rank, ep_ll_half_base(ly, a.half) + ep_ll_drecv_row(ly, s, i) + ep_ll_fp8_scales_offset(ly),
                           4ull * S);
        }
    }
    stamp(a, 6);
}

extern "C" __global__ void __launch_bounds__(NT, 1) ep_ll_dispatch(const Args a) {
    extern __shared__ __align__(16) uint8_t smem[];
    const uint64_t call_k = op_epoch(a);
    load_mask(a);
    if (masked(a, a.rank)) return;
    const bool send = (a.flags & EP_FLAG_LL_SEND) != 0;
    if (send) dispatch_send(a, call_k, smem);
    if (a.flags & EP_FLAG_LL_RECV) dispatch_recv(a, call_k, smem);
}
