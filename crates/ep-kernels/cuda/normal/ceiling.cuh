// The copy kernels of the same bytes (the ceilings) and the timing kernels (flag round trip,
// spin).
// Part of cuda/normal.cu (one translation unit): included there in order, after the parts it
// uses.
#pragma once

// ---- ceilings and timing ------------------------------------------------------------------------------------

// The data movement of a dispatch alone: each of this rank's rows — x and, FP8, its scales
// (a.num_scales; the bytes DeepEP counts) — read once and stored to its final row on every
// destination (dst_rows from the plan), no protocol, no meta. gridDim.x blocks.
extern "C" __global__ void __launch_bounds__(NT, 1) ep_copy_ceiling(const Args a) {
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, R = (uint32_t)a.num_ranks;
    const uint32_t S = (uint32_t)a.num_scales, nsc = (uint32_t)(ep_align16(4u * S) / 16u);
    const uint64_t scales_off = ep_align16(a.x_bytes);
    const bool scales_vec = S % 4u == 0 && ((uintptr_t)a.x_scales & 15u) == 0;
    const int32_t *dst_rows = (const int32_t *)a.dst_rows;
    const uint64_t per = (a.num_tokens + gridDim.x - 1) / gridDim.x;
    const uint64_t t0 = per * blockIdx.x, t1 = min(a.num_tokens, t0 + per);
    // Lane d < R holds the next token's row on d, loaded while the current token is copied.
    int32_t next = lane < R && t0 + warp < t1 ? dst_rows[(t0 + warp) * R + lane] : -1;
    for (uint64_t t = t0 + warp; t < t1; t += WARPS) {
        const int32_t mine = next;
        if (lane < R && t + WARPS < t1) next = dst_rows[(t + WARPS) * R + lane];
        uint8_t *const dst = mine < 0 ? nullptr : data_at(a, lane, ep_normal_dispatch_row(R, (uint64_t)mine, a.drec));
        const TailSrc ts = tail_load(a, t, lane, nsc, scales_vec, false);
        warp_copy_fanout((const uint8_t *)a.x + t * a.x_bytes, dst, R, a.x_bytes, lane);
        if (nsc > 0) tail_store<TAIL_SCALES>(a, ts, dst, R, t, lane, scales_off, nsc, nsc, scales_vec);
    }
}

// The data movement of a combine alone: every token of this rank loads each of its rows from
// the ranks holding them (dst_rows: the token's row on each rank, from the plan, -1 = none; the
// BF16 x parts of the dispatch records) once and stores one row (their bitwise XOR: the byte
// pattern of the combine with no arithmetic), no signals, no biases. gridDim.x blocks.
extern "C" __global__ void __launch_bounds__(NT, 1) ep_copy_ceiling_gather(const Args a) {
    const uint32_t lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, R = (uint32_t)a.num_ranks;
    const int32_t *dst_rows = (const int32_t *)a.dst_rows;
    const uint64_t per = (a.num_tokens + gridDim.x - 1) / gridDim.x;
    const uint64_t t0 = per * blockIdx.x, t1 = min(a.num_tokens, t0 + per);
    const uint64_t bytes = 2 * a.hidden;
    auto row_at = [&](uint32_t d, int32_t row) -> const uint8_t * {
        return data_at(a, d, ep_normal_dispatch_row(R, (uint64_t)row, a.drec));
    };
    // The same token loop as the combine's: next token's rows prefetched, pipelined gather.
    int32_t next = lane < R && t0 + warp < t1 ? dst_rows[(t0 + warp) * R + lane] : -1;
    for (uint64_t t = t0 + warp; t < t1; t += WARPS) {
        const int32_t mine = next;
        if (lane < R && t + WARPS < t1) next = dst_rows[(t + WARPS) * R + lane];
        const uint8_t *src[MAXR];
        const uint32_t n = holders(mine, R, src, row_at);
        gather_checked(src, n, (uint8_t *)a.combined_x + t * bytes, bytes, lane, XorRows{});
    }
}

// The latency part of the low-latency floor (BASELINES.md): flag round trips between two
// resident kernels. Role a.rank == 0 stores round i to word 0 (release) and waits (acquire) for
// word 16 to reach i; role 1 waits for word 0 and answers on word 16 (words: `dst_rows`, two
// 128-byte lines). `num_tokens` rounds; the first is not timed (the other kernel may still be
// starting). Role 0 writes the %globaltimer ns of the timed rounds to combined_x[0], or ~0 when
// a wait ran past `timeout_ns` (then both roles return: bounded). System scope (the protocol's
// signals, ep_device.cuh), or GPU scope when `flags` has EP_FLAG_SAME_GPU.
extern "C" __global__ void ep_flag_pingpong(const Args a) {
    uint64_t *words = (uint64_t *)a.dst_rows;
    uint64_t *mine = words + (a.rank == 0 ? 0 : 16), *theirs = words + (a.rank == 0 ? 16 : 0);
    const bool gpu = (a.flags & EP_FLAG_SAME_GPU) != 0;
    uint64_t start = 0;
    for (uint64_t i = 1; i <= a.num_tokens; ++i) {
        if (a.rank == 0) ep_st_release_at(gpu, mine, i);
        const uint64_t t0 = ep_now_ns();
        for (uint32_t polls = 1; ep_ld_acquire_at(gpu, theirs) < i; ++polls) {
            if ((polls & 255u) == 0u && ep_now_ns() - t0 > a.timeout_ns) {
                if (a.rank == 0) *(volatile uint64_t *)a.combined_x = ~0ull;
                return;
            }
        }
        if (a.rank != 0) ep_st_release_at(gpu, mine, i);
        if (i == 1) start = ep_now_ns();
    }
    if (a.rank == 0) *(volatile uint64_t *)a.combined_x = ep_now_ns() - start;
}

// The timing gate (gpu/gate.rs): holds its stream at least `hold_ns`, then until the
// host-mapped word at `mailbox` reaches `call` (the host opens it once every rank's work is
// enqueued), at most `timeout_ns` in all (a bound); with mailbox 0, for timeout_ns.
extern "C" __global__ void ep_spin(const Args a) {
    const uint64_t t0 = ep_now_ns();
    const uint64_t *word = (const uint64_t *)a.mailbox;
    for (uint64_t dt = 0; dt < a.timeout_ns; dt = ep_now_ns() - t0)
        if (dt >= a.hold_ns && word != nullptr && ep_ld_volatile(word) >= a.call) break;
}
