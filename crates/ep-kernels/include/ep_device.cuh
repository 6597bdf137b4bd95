/*
 * ep_device.cuh — the device side of the protocol vocabulary (ep_core::transport::AgentCtx) for
 * the load/store class over NVLink / same-GPU peers: relaxed stores, store_release,
 * load_acquire, and the bounded wait. Device only.
 *
 * Scope: system (`.sys`), so a release on one GPU is acquired on another GPU or by another
 * process's kernel on the same GPU (DESIGN.md, "The memory model"); the `_gpu` variants for
 * words that never leave one GPU.
 *
 * Waits are bounded by %globaltimer and never trap (GPU.md: a trap under MPS resets the GPU): a
 * wait that runs out writes the process's error record (host-mapped ep_err_block), raises its
 * `abort` word, and returns false; every other wait sees `abort` and gives up too, so all blocks
 * of all ranks finish and the host turns the record into a typed error.
 */
#ifndef EP_DEVICE_CUH
#define EP_DEVICE_CUH

#include <stdint.h>

#include "ep_gpu_abi.h"
#include "ep_protocol.cuh"

/* Programmatic dependent launch (sm_90). A kernel launched with the programmatic-serialization
 * attribute may start while the kernel before it on the stream still runs: it must read nothing
 * that kernel (or anything before it) wrote until `ep_pdl_wait` returns, which waits for that
 * kernel's completion and its memory. Without the attribute the wait returns at once.
 * `ep_pdl_trigger` lets such a dependent start before this kernel ends. */
__device__ __forceinline__ void ep_pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void ep_pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

__device__ __forceinline__ uint64_t ep_ld_acquire(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ep_st_release(uint64_t *p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* The same at GPU scope, for words whose every reader and writer is on this GPU (co-resident
 * ranks): a flag round trip took 1.09-1.30 us against 1.62-1.83 at system scope on the H200. */
__device__ __forceinline__ uint64_t ep_ld_acquire_gpu(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void ep_st_release_gpu(uint64_t *p, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* A release store / acquire load at GPU scope when `gpu` (every reader and writer of the word
 * is on this GPU), system scope otherwise. */
__device__ __forceinline__ void ep_st_release_at(bool gpu, uint64_t *p, uint64_t v) {
    if (gpu)
        ep_st_release_gpu(p, v);
    else
        ep_st_release(p, v);
}

__device__ __forceinline__ uint64_t ep_ld_acquire_at(bool gpu, const uint64_t *p) {
    return gpu ? ep_ld_acquire_gpu(p) : ep_ld_acquire(p);
}

/* A strong relaxed store at GPU scope when `gpu`, system scope otherwise. After a fence of at
 * least that scope it is a release (PTX memory model: a fence followed by a strong write is a
 * release pattern), so one fence can publish several flags, each without a fence of its own. */
__device__ __forceinline__ void ep_st_relaxed_at(bool gpu, uint64_t *p, uint64_t v) {
    if (gpu)
        asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    else
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ep_ld_volatile(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t ep_now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* Records the first failure of the process (later ones only raise `abort`). */
__device__ inline void ep_fail(ep_err_block *err, uint64_t status, uint64_t rank, uint64_t kernel,
                               uint64_t word_rank, uint64_t word_offset, uint64_t expected,
                               uint64_t last_seen, uint64_t detail) {
    unsigned long long *st = (unsigned long long *)&err->status;
    if (atomicCAS(st, 0ull, (unsigned long long)status) == 0ull) {
        err->rank = rank;
        err->kernel = kernel;
        err->block = blockIdx.x;
        err->word_rank = word_rank;
        err->word_offset = word_offset;
        err->expected = expected;
        err->last_seen = last_seen;
        err->detail = detail;
    }
    __threadfence_system();
    *(volatile uint64_t *)&err->abort = 1;
    __threadfence_system();
}

/* Whether the process gave up (another wait failed). */
__device__ __forceinline__ bool ep_aborted(const ep_err_block *err) {
    return ep_ld_volatile(&err->abort) != 0;
}

/*
 * The bounded poll behind the waits below: acquire-loads `*word` until `done(value)`, at most
 * `timeout_ns`; `*seen` gets the last value. The word lives in `word_rank`'s normal.ctrl at
 * `word_offset` (named in the error record, with `expected`). The abort word is host memory, so
 * it is read only every 1024 polls. Returns false on a timeout (recorded) or an abort.
 */
template <typename Done>
__device__ inline bool ep_poll(const uint64_t *word, Done done, uint64_t expected, uint64_t *seen,
                               ep_err_block *err, uint64_t timeout_ns, uint64_t rank, uint64_t kernel,
                               uint64_t word_rank, uint64_t word_offset) {
    uint64_t v = ep_ld_acquire(word);
    *seen = v;
    if (done(v)) return true;
    const uint64_t start = ep_now_ns();
    for (uint32_t polls = 1;; ++polls) {
        v = ep_ld_acquire(word);
        *seen = v;
        if (done(v)) return true;
        if ((polls & 1023u) == 0u) {
            if (ep_aborted(err)) return false;
            if (ep_now_ns() - start > timeout_ns) {
                ep_fail(err, EP_ERR_TIMEOUT, rank, kernel, word_rank, word_offset, expected, v, 0);
                return false;
            }
        }
    }
}

/* Waits until `*word == want` (acquire), bounded (ep_poll). */
__device__ inline bool ep_wait_eq(const uint64_t *word, uint64_t want, ep_err_block *err,
                                  uint64_t timeout_ns, uint64_t rank, uint64_t kernel,
                                  uint64_t word_rank, uint64_t word_offset) {
    uint64_t v;
    return ep_poll(word, [want](uint64_t x) { return x == want; }, want, &v, err, timeout_ns, rank, kernel,
                   word_rank, word_offset);
}

/*
 * Waits until the counted word `*word` (docs/protocol.md §1.1) carries call `call` (acquire),
 * bounded (ep_poll), and returns its value (0 on failure, with the error recorded). A word of a
 * later call is EP_ERR_EPOCH (detail: `source`); an earlier one stays below
 * ep_ll_threshold(call), so the wait goes on.
 */
__device__ inline uint64_t ep_wait_counted(const uint64_t *word, uint64_t call, ep_err_block *err,
                                           uint64_t timeout_ns, uint64_t rank, uint64_t kernel,
                                           uint64_t word_rank, uint64_t word_offset, uint64_t source) {
    const uint64_t want = ep_ll_threshold(call);
    uint64_t v;
    if (!ep_poll(word, [want](uint64_t x) { return x >= want; }, want, &v, err, timeout_ns, rank, kernel, word_rank,
                 word_offset))
        return 0;
    if (ep_ll_epoch(v) != call) {
        ep_fail(err, EP_ERR_EPOCH, rank, kernel, word_rank, word_offset, want, v, source);
        return 0;
    }
    return v;
}

/* Cluster barrier with release/acquire semantics (all threads of every CTA of the cluster). */
__device__ __forceinline__ void ep_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* 16-byte loads that skip L1 (rows are read once) and plain 16-byte stores. */
__device__ __forceinline__ int4 ep_ld_nc(const int4 *p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ void ep_st_v4(int4 *p, int4 v) {
    asm volatile("st.global.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

/* A 16-byte load of data another rank wrote (no stale L1 line: .cg caches in L2 only). */
__device__ __forceinline__ int4 ep_ld_cg(const int4 *p) { return __ldcg(p); }

/*
 * The call number k of this block's kernel (docs/protocol.md §1.1, §2.7, §3.10): given by value
 * (`call != 0`, eager calls), or, with `call == 0` (a captured CUDA graph, whose arguments are
 * frozen at capture), this block's epoch word + 1 when the launch starts an operation
 * (`advance`), or the word itself when it continues one (a low-latency receive half launched
 * after its send half). Either way thread 0 stores k into the word before the barrier: block b
 * is the only reader and writer of `epoch[b]` (every kernel of a rank that uses the words has the
 * same grid), and the next kernel on the rank's stream reads it after this one ended, so the
 * words advance exactly once per operation, eager or replayed.
 */
__device__ __forceinline__ uint64_t ep_block_epoch(uint64_t call, uint64_t epoch, bool advance) {
    __shared__ uint64_t s_k;
    if (threadIdx.x == 0) {
        volatile uint64_t *w = (volatile uint64_t *)epoch + blockIdx.x;
        const uint64_t k = call != 0 ? call : *w + (advance ? 1u : 0u);
        *w = k;
        s_k = k;
    }
    __syncthreads();
    return s_k;
}

#endif /* EP_DEVICE_CUH */
