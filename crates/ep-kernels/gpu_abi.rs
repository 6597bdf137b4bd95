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
    ("call", 0, "Call number k (epoch of every signal)."),
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
    ("EP_ERR_TIMEOUT", 1, "A wait ran past timeout_ns."),
    ("EP_ERR_CAPACITY", 2, "Received rows exceed the arena (or num_worst_tokens)."),
    ("EP_ERR_EXPERT", 3, "An expert id outside [-1, E) (detail: token * K + slot, last_seen: the id)."),
    ("EP_KERNEL_LAYOUT", 3, "ep_normal_layout."),
    ("EP_KERNEL_DISPATCH", 1, "ep_normal_dispatch."),
    ("EP_KERNEL_COMBINE", 2, "ep_normal_combine."),
];
