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
    ("combined_x", 0, "[T, H] BF16 combine output."),
    ("combined_weights", 0, "[T, K] f32 combine output (0: none)."),
    ("bias0", 0, "[T, H] BF16 combine bias (0: none)."),
    ("bias1", 0, "[T, H] BF16 combine bias (0: none)."),
    ("mailbox", 0, "Host-mapped EpMailbox of this rank (num_recv and the expert list)."),
    ("err", 0, "Host-mapped EpErrBlock shared by the process's ranks."),
    ("timeout_ns", 0, "Bound of every wait (%globaltimer ns)."),
    ("hold_ns", 0, "ep_spin (the timing gate): the least time it holds its stream (ns)."),
    ("dst_rows", 0, "Ceiling kernel: [T, R] i32 final rows (-1: not sent)."),
    ("phase_times", 0, "0, or [grid][EP_PHASE_SLOTS] u64 %globaltimer stamps per block (measurement)."),
    ("trace", 0, "Traced kernels (EP_TRACE): this rank's ep_trace_header, or 0 (record nothing)."),
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
    ("peer_signals", 8, "ll.signals base of every rank, as this rank addresses it (variant (a): a pointer; (b): a symmetric address)."),
    ("peer_data", 8, "ll.data base of every rank, as this rank addresses it."),
    ("peer_pe", 8, "Variant (b): the NVSHMEM PE holding each rank (peer_* are then symmetric addresses of this PE's heap)."),
    ("trace", 0, "Traced kernels (EP_TRACE): this rank's ep_trace_header, or 0 (record nothing)."),
    ("mask", 0, "int32[R] shrink mask (non-zero: masked), or 0."),
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
    ("sm_before", 0, "Offset: [E] u32 entries of the tokens before the send group."),
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
    ("detail", 0, "Extra (EP_ERR_CAPACITY: rows needed; EP_ERR_LAYOUT: the destination rank)."),
    ("abort", 0, "Set once any wait failed: every other wait gives up."),
];

/// What a dispatch tells the host (block 1; host-mapped, one per rank).
pub(crate) const MAILBOX: Fields = &[
    ("num_recv", 0, "(call << 32) | rows received."),
    ("expert_counts", 1024, "(call << 32) | received (token, slot) pairs per local expert, aligned (the host takes the list when every word carries the call)."),
];

/// `(name, value, doc)` constants shared by both sides.
pub(crate) const CONSTANTS: &[(&str, u64, &str)] = &[
    ("EP_GPU_MAX_RANKS", 8, "Ranks a normal-mode kernel addresses (peer tables)."),
    ("EP_GPU_THREADS", 512, "Threads per block of the normal-mode kernels."),
    ("EP_NORMAL_ROW_UNROLL", 4, "16-byte chunks per lane in one pass of the normal dispatch's row copy (the SASS-shape test reads it too)."),
    ("EP_FLAG_TOPK", 1, "Top-k is dispatched / weights are combined."),
    ("EP_FLAG_CACHED", 2, "Cached dispatch: offsets from the handle, ready handshake."),
    ("EP_FLAG_FP8", 4, "Rows are e4m3 with f32 scales."),
    ("EP_FLAG_IN_PLACE", 8, "Combine reads the dispatch rows' x parts (else the combine rows)."),
    ("EP_FLAG_ROUND_SCALE", 16, "FP8 scales rounded to powers of two."),
    ("EP_FLAG_UE8M0", 32, "FP8 scales packed as UE8M0 bytes (implies round_scale)."),
    ("EP_FLAG_LL_SEND", 64, "Low-latency kernel: run the send part."),
    ("EP_FLAG_LL_RECV", 128, "Low-latency kernel: run the receive part."),
    ("EP_FLAG_SAME_GPU", 256, "Every peer is on this GPU: GPU-scope fences suffice."),
    ("EP_FLAG_LOGFMT", 512, "Low-latency combine: partials travel LogFMT-10 encoded (use_logfmt)."),
    ("EP_FLAG_TEST_SKIP_FENCE", 2048, "Test only, traced kernels: the send part's blocks skip their fence before their signals (low-latency), the second CTA of each channel its fence before its done release (normal dispatch): a planted missing fence."),
    ("EP_FLAG_SHRINK", 1024, "Low-latency shrink mode: a source that never signals is masked (mask[src] = 1), not an error."),
    ("EP_ERR_TIMEOUT", 1, "A wait ran past timeout_ns."),
    ("EP_ERR_CAPACITY", 2, "Received rows exceed the arena (or num_worst_tokens)."),
    ("EP_ERR_EXPERT", 3, "An expert id outside [-1, E) (detail: token * K + slot, last_seen: the id)."),
    ("EP_ERR_EPOCH", 4, "A counted word (a low-latency signal, a normal head word) carried another call's epoch (detail: source rank)."),
    ("EP_ERR_COUNT", 5, "A combine signal announced another message count (detail: source rank)."),
    ("EP_ERR_LAYOUT", 6, "Normal dispatch: num_tokens_per_rank[d] is not the count of is_token_in_rank[., d] (word_rank, detail: d; expected: the input; last_seen: the count)."),
    ("EP_KERNEL_LL_DISPATCH", 4, "ep_ll_dispatch."),
    ("EP_KERNEL_LL_COMBINE", 5, "ep_ll_combine."),
    ("EP_KERNEL_LAYOUT", 3, "ep_normal_layout."),
    ("EP_KERNEL_DISPATCH", 1, "ep_normal_dispatch."),
    ("EP_KERNEL_COMBINE", 2, "ep_normal_combine."),
    ("EP_PHASE_SLOTS", 16, "Stamps per block: start, offsets known, rows stored, done released, done acquired, end; the normal dispatch's every block also 7 (every notify acquired) and 15 (its own channel start counted), its notify block 6 (record heads fenced), 8 and 11 (its steps) and 12..14 (the table, cuda/normal.cu); the low-latency dispatch 0..6 (cuda/low_latency.cu) and 7, 9, 10 (expert ids loaded, rows sent, positions computed), 11 and 8 (thread 0's first expert id and warp 0's first rows unit arrived)."),
];

/// The device trace of debug builds (`ep_kernels::gpu::trace`, judged by
/// `ep_sim::device_trace`): per rank, one `ep_trace_header` followed by `num_blocks x capacity`
/// records of 4 u64 words, block `b`'s records at `[b * capacity, (b + 1) * capacity)`.
///
/// Record words (little-endian u64):
/// - `word0` = `kind | aux << 8 | region << 16 | block << 32` (aux: the fence's scope, the
///   counter arrival's EP_TRACE_FLAG_LAST);
/// - `word1` = `rank | len << 32` (the rank whose memory the event touches; a put's destination;
///   a counter arrival's counter id, len 0);
/// - `word2` = byte offset in the region (a put's destination offset; a counter arrival's
///   ticket, the value its atomic add returned);
/// - `word3` = the value (release, acquire, signal), a put's source offset in this rank's
///   ll.data, else 0.
///
/// A put with signal is two consecutive records of one reservation: EP_TRACE_PUT_SIGNAL (the
/// put) then EP_TRACE_SIGNAL (`word1` = destination rank, `word2` = the signal word's offset,
/// `word3` = the value set).
pub(crate) const TRACE_CONSTANTS: &[(&str, u64, &str)] = &[
    ("EP_TRACE_MAGIC", 0x3145_4341_5254_5045, "ep_trace_header.magic: \"EPTRACE1\" little-endian."),
    ("EP_TRACE_MAX_BLOCKS", 256, "Blocks a trace header has write indices for."),
    ("EP_TRACE_RECORD_BYTES", 32, "Bytes of one ep_trace_record."),
    ("EP_TRACE_STORE", 1, "Record kind: ordinary stores of len bytes at offset of rank's region."),
    ("EP_TRACE_LOAD", 2, "Record kind: ordinary loads of len bytes at offset of rank's region."),
    ("EP_TRACE_FENCE", 3, "Record kind: a fence of the block (aux: EP_TRACE_SCOPE_*)."),
    ("EP_TRACE_RELEASE", 4, "Record kind: release store of value to the signal word at offset of rank."),
    ("EP_TRACE_ACQUIRE", 5, "Record kind: an acquire (end of a wait) that saw value at the signal word offset of rank."),
    ("EP_TRACE_COUNTER", 6, "Record kind: arrival at counter (word1) with ticket (word2); aux EP_TRACE_FLAG_LAST."),
    ("EP_TRACE_PUT", 7, "Record kind: NVSHMEM put of len bytes from this rank's ll.data word3 to rank's ll.data offset."),
    ("EP_TRACE_PUT_SIGNAL", 8, "Record kind: the put of a put-with-signal (an EP_TRACE_SIGNAL record follows)."),
    ("EP_TRACE_SIGNAL", 9, "Record kind: the signal of the EP_TRACE_PUT_SIGNAL record before it."),
    ("EP_TRACE_CLUSTER_BARRIER", 10, "Record kind: the block arrives at its cluster's barrier (normal mode: a cluster of CTAs is one agent); its later records follow the barrier."),
    ("EP_TRACE_REGION_SIGNALS", 0, "Region: the signal words (ll.signals; normal.ctrl in normal mode)."),
    ("EP_TRACE_REGION_DATA", 1, "Region: the data arena (ll.data; normal.data in normal mode)."),
    ("EP_TRACE_SCOPE_GPU", 0, "Fence scope: this GPU (__threadfence, fence.acq_rel.gpu)."),
    ("EP_TRACE_SCOPE_SYSTEM", 1, "Fence scope: system (__threadfence_system, nvshmem_fence)."),
    ("EP_TRACE_FLAG_LAST", 1, "Counter arrival aux bit: this block was the last arrival."),
];

/// The trace header (see TRACE_CONSTANTS), written by the host before a traced launch
/// (magic, rank, capacity, num_blocks; next and overflow zero) and by the blocks during it.
pub(crate) const TRACE_HEADER: Fields = &[
    ("magic", 0, "EP_TRACE_MAGIC."),
    ("rank", 0, "The rank whose kernel records here."),
    ("capacity", 0, "Records per block."),
    ("num_blocks", 0, "Blocks of the launch (at most EP_TRACE_MAX_BLOCKS)."),
    ("overflow", 0, "Set non-zero by a block that found no room for a record (the record is lost)."),
    ("reserved", 3, "Zero (records start 32-byte aligned)."),
    ("next", 256, "Per block: records reserved so far (atomicAdd); more than capacity means some were lost."),
];

/// One trace record (see TRACE_CONSTANTS for the words).
pub(crate) const TRACE_RECORD: Fields = &[
    ("word0", 0, "kind | aux << 8 | region << 16 | block << 32."),
    ("word1", 0, "rank | len << 32."),
    ("word2", 0, "Offset (a counter arrival: its ticket)."),
    ("word3", 0, "Value, or a put's source offset."),
];
