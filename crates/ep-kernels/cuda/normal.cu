// Normal intranode mode on GPUs (docs/protocol.md §2): layout, direct-placement dispatch (count
// exchange, rows stored once at their final row on the receiver), cached dispatch (ready
// handshake), pull combine, and the copy kernel that measures the ceiling of the same bytes.
//
// Agents → CTAs (§1.3): the sender agent (s, c) of channel c is a pair of CTAs (blocks 2c and
// 2c + 1), so a kernel of 2C blocks uses the num_sms = 2C SMs of DeepEP's Config. In the
// dispatch each CTA stores one half of the channel's tokens (ep_channel_half) and publishes it
// with its own done[s][c][h]: the two never wait for each other (no cluster either: a cluster's
// CTAs share a GPC, the scheduler then crowded some GPCs with row-copying SMs, and their blocks
// were the stragglers, 24 SMs: slowest rows 120 -> 111 us without clusters, BENCHMARKS.md). The
// combine keeps its cluster of 2 (barrier.cluster), measured the faster there. Block 0 also
// runs the notify agent; every CTA, after sending, runs the receive part of its half-channel
// (waits done[s][c][h] of every source s; the outputs are views of the records), so the kernel
// ends on a rank only when all rows destined to it have landed. Offsets, slots and signal
// values come from ep_protocol.cuh; waits are bounded (ep_device.cuh).

#include <stdint.h>
#include <cuda_bf16.h>

#include "ep_protocol.cuh"
#include "ep_device.cuh"
#include "ep_trace.cuh"

// The kernels in parts (normal/), each including nothing itself: the shared ground, then each
// part after the parts it uses.
#include "normal/common.cuh"
#include "normal/rows.cuh"
#include "normal/tail.cuh"
#include "normal/gather.cuh"
#include "normal/layout.cuh"
#include "normal/dispatch.cuh"
#include "normal/combine.cuh"
#include "normal/ceiling.cuh"
