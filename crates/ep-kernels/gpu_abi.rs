// The GPU backend's host/device ABI, written once: build.rs turns these tables into the C header
// `ep_gpu_abi.h` (for the kernels) and the Rust file `gpu_abi.rs` (for the host), so a field is
// never declared twice. Every field is a 64-bit word (pointers as device addresses), so the two
// layouts cannot differ by padding.
//
// This file is `include!`d by build.rs only.

/// `(field, array length (0 = scalar), doc)`.
pub(crate) type Fields = &'static [(&'static str, usize, &'static str)];

/// Kernel arguments of every normal-mode kernel (`cuda/normal.cu`), passed by value.
pub(crate) const NORMAL_ARGS: Fields = &[
    ("rank", 0, "This rank."),
    ("num_ranks", 0, "Ranks R (at most EP_GPU_MAX_RANKS)."),
    ("num_tokens", 0, "Tokens T of this rank."),
    ("num_topk", 0, "Top-k K (0 without top-k)."),
    ("num_experts", 0, "Experts E."),
    ("num_local_experts", 0, "Local experts L = E / R."),
    ("num_channels", 0, "Channels C; the grid has 2C blocks (two per channel)."),
    ("x_bytes", 0, "Bytes of a row's x part (H x element size)."),
    ("num_scales", 0, "FP8 scales per row (0 for BF16)."),
    ("hidden", 0, "Hidden size H."),
    ("drec", 0, "Dispatch row record bytes."),
    ("yrec", 0, "Combine row record bytes."),
    ("data_bytes", 0, "Bytes of the normal.data allocation."),
    ("capacity", 0, "Rows the dispatch region holds."),
    ("call", 0, "Call number k (epoch of every signal); 0: each block takes k = its epoch word + 1 (a captured graph)."),
    ("epoch", 0, "[2 * EP_MAX_CHANNELS] u64 of this rank: block b's last call number, stored by b at its start."),
    ("expert_alignment", 0, "Rounding of the expert list."),
    ("num_worst_tokens", 0, "Worst-case output rows (0: exact, host learns num_recv)."),
    ("flags", 0, "EP_FLAG_* bits."),
    ("x", 0, "Input rows [T, H] (BF16 or e4m3)."),
    ("x_scales", 0, "FP8 scales [T, S] f32."),
    ("topk_idx", 0, "[T, K] i64."),
    ("topk_weights", 0, "[T, K] f32 (dispatch) or received weights [rows, K] (combine)."),
    ("is_token_in_rank", 0, "[T, R] u8."),
    ("num_tokens_per_rank", 0, "[R] i32 (layout output / dispatch input)."),
    ("num_tokens_per_expert", 0, "[E] i32 (layout output / dispatch input)."),
    ("peer_ctrl", 8, "normal.ctrl base of every rank, as this rank addresses it."),
    ("peer_data", 8, "normal.data base of every rank, as this rank addresses it."),
    ("rank_prefix_matrix", 0, "[R, R] i32 handle (dispatch output, cached/combine input)."),
    ("channel_prefix_matrix", 0, "[R, C] i32 handle."),
    ("recv_channel_prefix_matrix", 0, "[R, C] i32 handle."),
    ("send_head", 0, "[T, R] i32 handle."),
    ("recv_src_idx", 0, "[rows] i32 output."),
    ("recv_topk_idx", 0, "[rows, K] i64 output."),
    ("recv_topk_weights", 0, "[rows, K] f32 output."),
    ("combined_x", 0, "[T, H] BF16 combine output."),
    ("combined_weights", 0, "[T, K] f32 combine output (0: none)."),
    ("bias0", 0, "[T, H] BF16 combine bias (0: none)."),
    ("bias1", 0, "[T, H] BF16 combine bias (0: none)."),
    ("mailbox", 0, "Host-mapped EpMailbox of this rank (num_recv and the expert list)."),
    ("err", 0, "Host-mapped EpErrBlock shared by the process's ranks."),
    ("timeout_ns", 0, "Bound of every wait (%globaltimer ns)."),
    ("dst_rows", 0, "Ceiling kernel: [T, R] i32 final rows (-1: not sent)."),
    ("phase_times", 0, "0, or [grid][EP_PHASE_SLOTS] u64 %globaltimer stamps per block (measurement)."),
];

/// Kernel arguments of the low-latency kernels (`cuda/low_latency.cu`), passed by value.
pub(crate) const LL_ARGS: Fields = &[
    ("rank", 0, "This rank."),
    ("num_ranks", 0, "Ranks R (at most EP_GPU_MAX_RANKS)."),
    ("num_tokens", 0, "Tokens T of this rank (at most num_max_tokens)."),
    ("num_topk", 0, "Top-k K (at most EP_LL_MAX_TOPK)."),
    ("num_experts", 0, "Experts E."),
    ("num_local_experts", 0, "Local experts L = E / R."),
    ("hidden", 0, "Hidden size H (a multiple of 128)."),
    ("num_max_tokens", 0, "N: num_max_dispatch_tokens_per_rank."),
    ("call", 0, "Call number k (epoch of every signal); 0: each block takes k from its epoch word (+ 1 when the launch has the send part), a captured graph."),
    ("epoch", 0, "[num_sms] u64 of this rank: block b's last call number, stored by b at its start."),
    ("half", 0, "Half of ll.data this operation uses (op mod 2; a replay runs at the capture's parity)."),
    ("disp_half", 0, "Combine: the half its dispatch used (meta records)."),
    ("flags", 0, "EP_FLAG_* bits."),
    ("x", 0, "Dispatch input rows [T, H] BF16."),
    ("topk_idx", 0, "[T, K] i64."),
    ("topk_weights", 0, "[T, K] f32."),
    ("peer_signals", 8, "ll.signals base of every rank, as this rank addresses it."),
    ("peer_data", 8, "ll.data base of every rank, as this rank addresses it."),
    ("mask", 0, "int32[R] shrink mask (non-zero: masked), or 0."),
    ("counter", 0, "This rank's u64 completion counter of the send part."),
    ("slots", 0, "Handle [T, R] i32: slot of token t in d's drecv[s] (-1: none)."),
    ("send_counts", 0, "Handle [R] i32: messages this rank sent to each rank."),
    ("recv_counts", 0, "Handle [R] i32: messages this rank received from each rank."),
    ("recv_x", 0, "[L, R*N, H] BF16 or e4m3 packed rows."),
    ("recv_scales", 0, "FP8: [L, S, R*N] f32, or [L, S/4, R*N] packed UE8M0 words."),
    ("recv_src_info", 0, "[L, R*N] i32."),
    ("recv_layout_range", 0, "[L, R] i64 (begin << 32 | count)."),
    ("recv_count", 0, "[L] i32."),
    ("recv_stats", 0, "[L] i32 cumulative received tokens per local expert, or 0."),
    ("wait_stats", 0, "[R] u64 cumulative ns waited for each source, or 0."),
    ("combine_y", 0, "Expert outputs [L, R*N, H] BF16 (the zero-copy region or the caller's)."),
    ("combined_x", 0, "[T, H] BF16 combine output."),
    ("err", 0, "Host-mapped EpErrBlock shared by the process's ranks."),
    ("timeout_ns", 0, "Bound of every wait (%globaltimer ns)."),
    ("phase_times", 0, "0, or [grid][EP_PHASE_SLOTS] u64 %globaltimer stamps per block."),
    ("sm_expert", 0, "Dynamic shared memory offset: [T*K] i16 expert ids."),
    ("sm_pos", 0, "Offset: [T*K] u16 rows within the (expert, source) blocks."),
    ("sm_wcnt", 0, "Offset: [warps][E] u16 per-warp counts."),
    ("sm_tot", 0, "Offset: [E] u32 entries per expert."),
    ("sm_dmask", 0, "Offset: [T] u8 destination ranks of each token."),
    ("sm_slot", 0, "Offset: [T][R] u16 slots."),
    ("sm_begin", 0, "Offset: [R][L] u32 block begins."),
];

/// Written by the first wait that times out (host-mapped; the host reads it after a sync).
pub(crate) const ERR_BLOCK: Fields = &[
    ("status", 0, "0 = no error; EP_ERR_* of the first failure."),
    ("rank", 0, "Rank whose kernel failed."),
    ("kernel", 0, "EP_KERNEL_* of that kernel."),
    ("block", 0, "Block index."),
    ("word_rank", 0, "Rank whose memory holds the awaited word."),
    ("word_offset", 0, "Offset of the word in normal.ctrl."),
    ("expected", 0, "Value awaited."),
    ("last_seen", 0, "Last value read."),
    ("detail", 0, "Extra (EP_ERR_CAPACITY: rows needed)."),
    ("abort", 0, "Set once any wait failed: every other wait gives up."),
];

/// What a dispatch's notify block tells the host (host-mapped, one per rank).
pub(crate) const MAILBOX: Fields = &[
    ("num_recv", 0, "(call << 32) | rows received, written after the expert list."),
    ("expert_counts", 1024, "Received (token, slot) pairs per local expert, aligned (i32 in the low half)."),
];

/// `(name, value, doc)` constants shared by both sides.
pub(crate) const CONSTANTS: &[(&str, u64, &str)] = &[
    ("EP_GPU_MAX_RANKS", 8, "Ranks a normal-mode kernel addresses (peer tables)."),
    ("EP_GPU_THREADS", 512, "Threads per block of the normal-mode kernels."),
    ("EP_FLAG_TOPK", 1, "Top-k is dispatched / weights are combined."),
    ("EP_FLAG_CACHED", 2, "Cached dispatch: offsets from the handle, ready handshake."),
    ("EP_FLAG_FP8", 4, "Rows are e4m3 with f32 scales."),
    ("EP_FLAG_IN_PLACE", 8, "Combine reads the dispatch rows' x parts (else the combine rows)."),
    ("EP_FLAG_ROUND_SCALE", 16, "FP8 scales rounded to powers of two."),
    ("EP_FLAG_UE8M0", 32, "FP8 scales packed as UE8M0 bytes (implies round_scale)."),
    ("EP_FLAG_LL_SEND", 64, "Low-latency kernel: run the send part."),
    ("EP_FLAG_LL_RECV", 128, "Low-latency kernel: run the receive part."),
    ("EP_FLAG_SAME_GPU", 256, "Every peer is on this GPU: GPU-scope fences suffice."),
    ("EP_ERR_TIMEOUT", 1, "A wait ran past timeout_ns."),
    ("EP_ERR_CAPACITY", 2, "Received rows exceed the arena (or num_worst_tokens)."),
    ("EP_ERR_EXPERT", 3, "An expert id outside [-1, E) (detail: token * K + slot, last_seen: the id)."),
    ("EP_ERR_EPOCH", 4, "A low-latency signal carried another call's epoch (detail: source rank)."),
    ("EP_ERR_COUNT", 5, "A combine signal announced another message count (detail: source rank)."),
    ("EP_KERNEL_LL_DISPATCH", 4, "ep_ll_dispatch."),
    ("EP_KERNEL_LL_COMBINE", 5, "ep_ll_combine."),
    ("EP_KERNEL_LAYOUT", 3, "ep_normal_layout."),
    ("EP_KERNEL_DISPATCH", 1, "ep_normal_dispatch."),
    ("EP_KERNEL_COMBINE", 2, "ep_normal_combine."),
    ("EP_PHASE_SLOTS", 8, "Stamps per block: start, offsets known, rows stored, done released, done acquired, end."),
];
