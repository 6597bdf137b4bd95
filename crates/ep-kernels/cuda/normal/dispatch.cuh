// The dispatch (ep_normal_dispatch, docs/protocol.md §2.3, §2.4): notify agent, count exchange,
// table, rows stored at their final rows, the receive parts, and the cached dispatch.
// Part of cuda/normal.cu (one translation unit): included there in order, after the parts it
// uses.
#pragma once

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
