// Low-latency mode on GPUs, docs/protocol.md §3, in two variants built from this one source:
// (a) every peer addressed by pointer (co-resident ranks or NVLink P2P): messages are stored
// straight into the destination's `drecv[s]`; (b) `EP_LL_NVSHMEM` (compiled relocatable, linked
// at run time against the loaded libnvshmem_device.a): every peer through NVSHMEM's device API —
// rows and meta records staged in this rank's `dsend` regions, then `put_nbi` / `put_signal_nbi`,
// `fence`, `quiet`, and signals polled with `signal_fetch` (a bounded wait; `signal_wait_until`
// has no bound). Only the peer operations differ (the `#ifdef EP_LL_NVSHMEM` blocks); routing,
// placement, offsets and signal values are shared. One message per (token, destination rank) —
// meta record and row (BF16, or e4m3 + per-128 f32 scales cast once by the sender); the receiver
// fans each message out to the packed per-expert rows at the deterministic place
// `begin(l, s) + pos`. Combine is reduced on the expert's rank: one BF16 partial per (token,
// expert rank), summed in ascending rank order by the token's rank.
//
// Each op kernel has a send part and a receive part (EP_FLAG_LL_SEND / EP_FLAG_LL_RECV): one
// launch with both is the plain call, two launches are the hook halves. Block b of every rank is
// send group b (docs/protocol.md §3.3): its send part never waits; it stores its tokens'
// messages (the combine: the partials of group b's messages), fences once and releases its own
// signal on every unmasked peer (disp_sig[h][s][b], comb_sig[h][d][b]), so a signal covers that
// block's stores and no block waits for another's. Its receive part waits (bounded,
// ep_device.cuh) for group b's signal of every unmasked source, checks its epoch and count, then
// reads that group's messages. Offsets and signal values come from ep_protocol.cuh; the shared-memory
// carve-out comes from the host (Args.sm_*).

#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ep_protocol.cuh"
#include "ep_device.cuh"
#include "ep_logfmt.cuh"
#include "ep_trace.cuh"

#ifdef EP_LL_NVSHMEM
#include <nvshmem.h>
#include <nvshmemx.h>
#endif

// The kernels in parts (low_latency/), each including nothing itself: the shared ground, then
// each part after the parts it uses.
#include "low_latency/common.cuh"
#include "low_latency/signals.cuh"
#include "low_latency/dispatch.cuh"
#include "low_latency/logfmt.cuh"
#include "low_latency/combine.cuh"
