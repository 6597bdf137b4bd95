/*
 * ep_trace.cuh — recording protocol events in traced builds (EP_TRACE; docs/protocol.md §3.13):
 * the format of gpu_abi.rs (one ep_trace_header per rank, then `num_blocks x capacity` records;
 * block b owns its own), decoded by gpu/trace.rs and judged by ep-sim's memory-model checker.
 * Each event is recorded after it happened, by the thread that did it (or, for a block's stores,
 * by one thread after them). A block's records are its program order: records of different
 * threads are ordered only by a barrier between them. Device only; both kernel modules.
 */
#ifndef EP_TRACE_CUH
#define EP_TRACE_CUH

#include <stdint.h>

#include "ep_gpu_abi.h"

#ifdef EP_TRACE
/* Reserves `n` consecutive records of this block in the trace at `trace` (an ep_trace_header's
 * address, 0: tracing off); null when off or full (then `overflow` is raised: decode fails). */
__device__ inline ep_trace_record *ep_trace_reserve(uint64_t trace, uint32_t n) {
    ep_trace_header *h = (ep_trace_header *)trace;
    if (h == nullptr) return nullptr;
    const unsigned long long i = atomicAdd((unsigned long long *)&h->next[blockIdx.x], (unsigned long long)n);
    if (i + n > h->capacity) {
        *(volatile uint64_t *)&h->overflow = 1;
        return nullptr;
    }
    return (ep_trace_record *)(h + 1) + (uint64_t)blockIdx.x * h->capacity + i;
}

/* One record: kind, aux (fence scope, counter flags), region, the rank whose memory it touches,
 * bytes, offset in the region, value. */
__device__ inline void ep_trace_rec(uint64_t trace, uint64_t kind, uint64_t aux, uint64_t region, uint64_t rank,
                                    uint64_t len, uint64_t off, uint64_t value) {
    ep_trace_record *r = ep_trace_reserve(trace, 1);
    if (r == nullptr) return;
    r->word0 = kind | aux << 8 | region << 16 | (uint64_t)blockIdx.x << 32;
    r->word1 = rank | len << 32;
    r->word2 = off;
    r->word3 = value;
}
#endif

#endif
