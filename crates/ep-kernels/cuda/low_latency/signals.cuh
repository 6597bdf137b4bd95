// Signals: fences towards the peers, a block's signals to its destinations, the bounded waits
// of the receive parts, and each block's call number.
// Part of cuda/low_latency.cu (one translation unit): included there in order, after the parts
// it uses.
#pragma once

// Orders this thread's (and, after a barrier, its block's) stores before what follows for the
// peers: GPU scope when every peer is on this GPU (cheaper), system scope for peers on other GPUs.
__device__ __forceinline__ void fence_for_peers(const Args &a) {
    if (a.flags & EP_FLAG_SAME_GPU)
        __threadfence();
    else
        __threadfence_system();
}

// The scope fence_for_peers orders at, as a trace records it.
#define PEER_FENCE_SCOPE(a) (((a).flags & EP_FLAG_SAME_GPU) ? EP_TRACE_SCOPE_GPU : EP_TRACE_SCOPE_SYSTEM)

// One read of this rank's signal word: (a) an acquire load, at GPU scope when every peer is on
// this GPU (EP_FLAG_SAME_GPU), system scope otherwise; (b) NVSHMEM's signal_fetch (a relaxed
// read; wait_ge fences once it has seen the value it waits for).
__device__ __forceinline__ uint64_t load_signal(const Args &a, const uint64_t *word) {
#ifdef EP_LL_NVSHMEM
    (void)a;
    return nvshmem_signal_fetch((uint64_t *)word);
#else
    return ep_ld_acquire_at((a.flags & EP_FLAG_SAME_GPU) != 0, word);
#endif
}

// Variant (a): a block's signals to its destinations, after its stores (every thread's, behind
// the caller's barrier). Warp 0 fences once (fence_for_peers, unless a test plants a missing
// fence), then lane d < R stores destination d's signal word (offset `sig`, the same on every
// destination) with `value(d)`: the fence and each strong store form a release pattern at the
// scope load_signal acquires, so the R signals leave together. (One release store after
// another, each with its own fence, waited for the one before it: R round trips on thread 0.)
// Masked destinations get none. Traced kernels record the fence and the releases on thread 0.
template <typename Value>
__device__ __forceinline__ void signal_destinations(const Args &a, bool fence, uint64_t sig, Value value) {
    if (TRACED && threadIdx.x == 0 && fence) TRACE_FENCE(PEER_FENCE_SCOPE(a));
    if (threadIdx.x < 32) {
        if (fence) fence_for_peers(a);
        const uint32_t d = threadIdx.x;
        if (d < a.num_ranks && !masked(a, d))
            ep_st_relaxed_at((a.flags & EP_FLAG_SAME_GPU) != 0, signal_of(a, d, sig), value(d));
    }
    if (TRACED && threadIdx.x == 0)
        for (uint32_t d = 0; d < a.num_ranks; ++d)
            if (!masked(a, d)) TRACE_RELEASE(d, sig, value(d));
}

// After load_signal saw the awaited value: orders the reads of what the signal covers after it.
__device__ __forceinline__ void signal_seen() {
#ifdef EP_LL_NVSHMEM
    __threadfence();
#endif
}

// Returned by wait_ge when a wait ran out in shrink mode (no error recorded).
#define EP_LL_GAVE_UP 0xffffffffffffffffull

// Variant (b): quiet-before-reuse (docs/protocol.md §3.7). NVSHMEM's device quiet completes
// every put of the PE (over IBGDA it drains every QP, over P2P it is a system-scope fence), and
// the hook contract puts a receive part between any two send parts of a rank, so one quiet in
// each block's receive part — on a thread the signal waits leave idle (wait_sources), hidden
// under them — completes operation m's puts before operation m + 2 writes half m mod 2's
// staging again. Not at the kernel's end, where every block waited for it before the kernel
// could finish, nor at the send part's start, where it held the routing's barriers. The host
// completes the last operations' puts before it writes or frees the arenas
// (LlGroup::complete_puts).
__device__ __forceinline__ void quiet_if_idle_thread() {
#ifdef EP_LL_NVSHMEM
    static_assert(MAXR <= NT - 32, "the quieting thread is never a waiter (thread src < R waits)");
    if (threadIdx.x == NT - 32) nvshmem_quiet();
#endif
}

// Waits until `*word >= want` (acquire), bounded like ep_wait_eq; returns the value, 0 on failure.
// In shrink mode (EP_FLAG_SHRINK) a wait that runs out returns EP_LL_GAVE_UP instead of failing.
__device__ uint64_t wait_ge(const Args &a, const uint64_t *word, uint64_t want, uint64_t kernel,
                            uint64_t word_offset, uint64_t *waited_ns) {
    ep_err_block *err = (ep_err_block *)a.err;
    uint64_t v = load_signal(a, word);
    *waited_ns = 0;
    if (v >= want) {
        signal_seen();
        return v;
    }
    uint64_t start = ep_now_ns();
    for (uint32_t polls = 1;; ++polls) {
        v = load_signal(a, word);
        if (v >= want) {
            signal_seen();
            *waited_ns = ep_now_ns() - start;
            return v;
        }
        if ((polls & 1023u) == 0u) {
            if (ep_aborted(err)) return 0;
            if (ep_now_ns() - start > a.timeout_ns) {
                if (a.flags & EP_FLAG_SHRINK) return EP_LL_GAVE_UP;
                ep_fail(err, EP_ERR_TIMEOUT, a.rank, kernel, a.rank, word_offset, want, v, 0);
                return 0;
            }
        }
    }
}

// Waits for the signal of send group blockIdx.x of every unmasked source (thread `src` waits
// for `src`: disp_sig[half][src][b], or comb_sig[half][src][b]) and checks its epoch; `count[src]`
// gets the group's message count (0 for masked sources). `expect` (optional, shared memory): the
// count each source must announce. Returns false if any check failed.
__device__ bool wait_sources(const Args &a, uint64_t call_k, uint64_t kernel, uint64_t half, bool combine,
                             uint32_t *count, const uint32_t *expect) {
    __shared__ int ok;
    if (threadIdx.x == 0) ok = 1;
    __syncthreads();
    const uint32_t src = threadIdx.x;
    if (src < a.num_ranks) {
        count[src] = 0;
        if (!masked(a, src)) {
            uint64_t off = combine ? ep_ll_combine_signal(a.num_ranks, half, src, blockIdx.x)
                                   : ep_ll_dispatch_signal(a.num_ranks, half, src, blockIdx.x);
            uint64_t waited = 0;
            uint64_t v = wait_ge(a, signal_of(a, a.rank, off), ep_ll_threshold(call_k), kernel, off, &waited);
            ep_err_block *err = (ep_err_block *)a.err;
            if (v == EP_LL_GAVE_UP) {
                // Shrink mode: `src` never arrived. Masked from here on, in this block (its
                // messages count as none, §3.8) and for the group's next calls (mask[src]).
                atomicOr(&mask_bits, 1u << src);
                atomicExch((int32_t *)a.mask + src, 1);
            } else if (v == 0) {
                ok = 0;
            } else if (ep_ll_epoch(v) != call_k) {
                ep_fail(err, EP_ERR_EPOCH, a.rank, kernel, a.rank, off, ep_ll_threshold(call_k), v, src);
                ok = 0;
            } else if (expect != nullptr && ep_ll_count(v) != expect[src]) {
                ep_fail(err, EP_ERR_COUNT, a.rank, kernel, a.rank, off, (uint64_t)expect[src], v, src);
                ok = 0;
            } else {
                count[src] = ep_ll_count(v);
                TRACE_ACQUIRE(a.rank, off, v);
                if (blockIdx.x == 0 && a.wait_stats != 0)
                    ((unsigned long long *)a.wait_stats)[src] += waited;
            }
        }
    } else {
        quiet_if_idle_thread();  // variant (b): quiet-before-reuse, under the waits (§3.7)
    }
    __syncthreads();
    return ok != 0;
}

// The operation's call number k (docs/protocol.md §3.10): by value, or (a captured graph, call ==
// 0) from this block's epoch word, ep_block_epoch. A launch with the send part starts the
// operation (word + 1); a receive-only launch (the hook) continues its send part's (the word).
// Every LL kernel of a rank has num_sms blocks, so each word advances once per operation.
__device__ __forceinline__ uint64_t op_epoch(const Args &a) {
    return ep_block_epoch(a.call, a.epoch, (a.flags & EP_FLAG_LL_SEND) != 0);
}
