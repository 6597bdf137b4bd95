//! ep-core's error type: one enum for the crate, each variant saying what to do.

/// Result alias for ep-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in ep-core. Variants name the offending value and the fix.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    // ---- shapes and routing -------------------------------------------------------------
    /// A tensor has the wrong shape.
    #[error("{what}: expected {expected}, found {found}; pass tensors of the documented shape")]
    ShapeMismatch {
        /// Which tensor or relation.
        what: &'static str,
        /// The shape that was needed.
        expected: String,
        /// The shape that was given.
        found: String,
    },
    /// An expert id outside `[-1, num_experts)`.
    #[error(
        "rank {rank}: topk_idx[{token}][{slot}] = {expert} is outside [-1, {num_experts}); \
         use -1 for a masked slot and ids below num_experts otherwise"
    )]
    ExpertOutOfRange {
        /// Rank whose routing is wrong.
        rank: usize,
        /// Token row.
        token: usize,
        /// Top-k slot.
        slot: usize,
        /// The offending id.
        expert: i64,
        /// Number of experts the call was made with.
        num_experts: usize,
    },
    /// The inputs given to a multi-rank function disagree on the rank count.
    #[error("expected inputs for {expected} ranks, got {found}; pass one entry per rank")]
    RankCountMismatch {
        /// Ranks the call was configured for.
        expected: usize,
        /// Entries given.
        found: usize,
    },
    /// `num_experts` is not a multiple of the rank count.
    #[error(
        "num_experts {num_experts} is not a multiple of {num_ranks} ranks; every rank must hold the same number of experts"
    )]
    ExpertsNotDivisible {
        /// Experts.
        num_experts: usize,
        /// Ranks.
        num_ranks: usize,
    },
    /// A mode or option combination that is not supported.
    #[error("unsupported: {0}")]
    Unsupported(String),

    // ---- configuration (spec §1.1, §1.4, §4) ---------------------------------------------
    /// A configuration value is invalid.
    #[error("invalid {field} = {value}: {fix}")]
    InvalidConfig {
        /// The option's name, as in DeepEP.
        field: &'static str,
        /// The given value.
        value: String,
        /// What is required, and how to fix it.
        fix: String,
    },
    /// A `Config` chunk size is zero (spec §1.4).
    #[error("{field} = 0; chunk sizes are token counts and must be at least 1")]
    ZeroChunkSize {
        /// The `Config` field, as in DeepEP.
        field: &'static str,
    },
    /// `num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens` (spec §1.4).
    #[error(
        "num_max_nvl_chunked_send_tokens = {send} must be below num_max_nvl_chunked_recv_tokens = {recv}; \
         lower the send chunk or enlarge the receive ring"
    )]
    NvlChunkOrder {
        /// NVL send chunk (tokens).
        send: usize,
        /// NVL receive ring (tokens).
        recv: usize,
    },
    /// `num_max_rdma_chunked_send_tokens > rounded rdma_recv / 2` (spec §1.4: lazy head update).
    #[error(
        "num_max_rdma_chunked_send_tokens = {send} exceeds half of num_max_rdma_chunked_recv_tokens \
         ({recv}, rounded up to a multiple of send: {rounded_recv}); senders must always have room \
         to push, so use a receive ring of at least 2 * send tokens"
    )]
    RdmaChunkTooLarge {
        /// RDMA send chunk (tokens).
        send: usize,
        /// RDMA receive ring as given (tokens).
        recv: usize,
        /// The receive ring rounded up to a multiple of `send`.
        rounded_recv: usize,
    },
    /// `num_sms` is odd where channels (pairs of SMs) are needed (spec §1.4, §1.5).
    #[error("num_sms = {num_sms} is odd; every channel uses 2 SMs, so pass an even number")]
    OddNumSms {
        /// The given SM count.
        num_sms: usize,
    },
    /// A rank count that DeepEP's rules or tuned tables do not support (spec §1.1, §1.4).
    #[error("{num_ranks} ranks are not supported: {rule}")]
    UnsupportedNumRanks {
        /// The EP size.
        num_ranks: usize,
        /// The rule that failed, with the supported values.
        rule: &'static str,
    },
    /// A buffer size that is not a multiple of 128 bytes (spec §0 `NUM_BUFFER_ALIGNMENT_BYTES`).
    #[error("{field} = {bytes} is not a multiple of {alignment} bytes; round it up")]
    BufferMisaligned {
        /// `num_nvl_bytes` or `num_rdma_bytes`.
        field: &'static str,
        /// The given size.
        bytes: u64,
        /// The required alignment (128).
        alignment: u64,
    },
    /// A buffer larger than DeepEP's 32-bit offsets allow (spec §1.1).
    #[error("{field} = {bytes} exceeds {limit} bytes ({why}); use a smaller buffer")]
    BufferTooLarge {
        /// `num_nvl_bytes` or `num_rdma_bytes`.
        field: &'static str,
        /// The given size.
        bytes: u64,
        /// The largest size allowed here.
        limit: u64,
        /// Why the limit applies.
        why: &'static str,
    },
    /// `num_rdma_bytes > 0` without internode ranks or low-latency mode (spec §1.1).
    #[error(
        "num_rdma_bytes = {num_rdma_bytes} with {num_ranks} ranks and low_latency_mode off: the RDMA \
         buffer is only used with more than 8 ranks or in low-latency mode; pass 0 or enable low-latency mode"
    )]
    RdmaBufferUnused {
        /// The given RDMA buffer size.
        num_rdma_bytes: u64,
        /// The EP size.
        num_ranks: usize,
    },
    /// `num_qps_per_rank == 0` although NVSHMEM is used (spec §1.2 step 2).
    #[error(
        "num_qps_per_rank = 0, but NVSHMEM is used (more than 8 ranks or low-latency mode); \
         pass at least 1 (low-latency mode: the number of local experts)"
    )]
    NoQpsPerRank,
    /// A low-latency call on a buffer built without `low_latency_mode` (spec §1.9).
    #[error(
        "low-latency call on a buffer without low_latency_mode; build the buffer with low_latency_mode = true"
    )]
    NotLowLatencyMode,
    /// `NVSHMEM_QP_DEPTH < 2 * (N + 1)` (spec §4, conformance case 18).
    #[error(
        "NVSHMEM_QP_DEPTH = {depth} is below {needed} = 2 * (num_max_dispatch_tokens_per_rank + 1) \
         for num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank}; set \
         NVSHMEM_QP_DEPTH >= {needed} before NVSHMEM initialises, or lower num_max_dispatch_tokens_per_rank"
    )]
    QpDepthTooSmall {
        /// The effective QP depth.
        depth: u32,
        /// The depth this call needs.
        needed: u64,
        /// `N` of the call.
        num_max_dispatch_tokens_per_rank: usize,
    },
    /// Fewer RC QPs per peer than local experts in low-latency mode (spec §1.1, §4).
    #[error(
        "{num_rc_per_pe} RC QPs per peer (num_qps_per_rank / NVSHMEM_IBGDA_NUM_RC_PER_PE) but \
         {num_local_experts} local experts; low-latency mode needs at least one QP per local expert, \
         so pass num_qps_per_rank = {num_local_experts}"
    )]
    TooFewQpsPerRank {
        /// The effective RC QPs per peer PE.
        num_rc_per_pe: u32,
        /// `E / R`.
        num_local_experts: usize,
    },
    /// `num_max_dispatch_tokens_per_rank` outside `1..=max` (spec §3.6).
    #[error(
        "num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank} is outside 1..={max}; \
         split the batch into calls of at most {max} tokens per rank"
    )]
    DispatchTokensOutOfRange {
        /// `N` of the call.
        num_max_dispatch_tokens_per_rank: usize,
        /// The largest supported `N`.
        max: usize,
    },
    /// Top-k larger than the mode supports (spec §0).
    #[error(
        "num_topk = {num_topk} exceeds {max} ({mode} mode); route each token to at most {max} experts"
    )]
    TopkTooLarge {
        /// The given top-k.
        num_topk: usize,
        /// The mode's limit.
        max: usize,
        /// `"normal"` or `"low-latency"`.
        mode: &'static str,
    },
    /// A hidden size (or row size) without the alignment a mode needs (spec §1.8, §1.9, §4).
    #[error("{what} = {value} is not a multiple of {multiple} ({why}); pad the hidden dimension")]
    HiddenMisaligned {
        /// `hidden` or `row bytes`.
        what: &'static str,
        /// The value checked.
        value: usize,
        /// The required multiple.
        multiple: usize,
        /// Why.
        why: &'static str,
    },
    /// `num_ranks * num_max_dispatch_tokens_per_rank` not a multiple of 4 (spec §1.9, "TMA").
    #[error(
        "num_ranks * num_max_dispatch_tokens_per_rank = {num_ranks} * {num_max_dispatch_tokens_per_rank} \
         is not a multiple of 4 (packed receive rows are moved in groups of 4); round N up"
    )]
    PackedRowsMisaligned {
        /// The EP size.
        num_ranks: usize,
        /// `N` of the call.
        num_max_dispatch_tokens_per_rank: usize,
    },
    /// `use_ue8m0` without `round_scale` (spec §1.9): UE8M0 stores only power-of-two scales.
    #[error(
        "use_ue8m0 requires round_scale (UE8M0 holds only powers of two); pass round_scale = true"
    )]
    Ue8m0WithoutRoundScale,
    /// `expert_alignment == 0` (spec §1.8).
    #[error("expert_alignment = 0; pass 1 for no alignment")]
    ZeroExpertAlignment,
    /// An environment variable whose value NVSHMEM would not accept (spec §1.2).
    #[error("environment variable {name} = {value:?} is not {expected}; fix or unset it")]
    InvalidEnvVar {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What NVSHMEM expects.
        expected: &'static str,
    },
    /// A size computation that overflows 64 bits.
    #[error("{what} overflows; the arguments are far beyond any real configuration")]
    SizeOverflow {
        /// The quantity being computed.
        what: &'static str,
    },
    /// A workload that cannot be generated as specified.
    #[error("invalid workload: {0}")]
    InvalidWorkload(String),

    // ---- transport ----
    /// A bounded wait expired (DESIGN.md: no wait is unbounded).
    #[error(
        "rank {rank} {agent}: timed out waiting for {what} (word {word:#x} on rank {word_rank} {expected}); \
         last seen {last_seen}; the peer that should write it stalled or the protocol lost a signal"
    )]
    WaitTimeout {
        /// Rank of the waiting agent.
        rank: usize,
        /// The agent (index and role).
        agent: String,
        /// What was awaited.
        what: String,
        /// Rank holding the word.
        word_rank: usize,
        /// The word's heap offset.
        word: u64,
        /// The condition, e.g. ">= 5".
        expected: String,
        /// The last value seen.
        last_seen: u64,
    },
    /// Agents wait on each other and nothing in flight can wake them.
    #[error("deadlock: {detail}")]
    Deadlock {
        /// The wait-for graph: who waits for what.
        detail: String,
    },
    /// The protocol broke the memory model or a declared invariant (a simulator finding).
    #[error("protocol violation on rank {rank}: {violation}")]
    ProtocolViolation {
        /// The rank where it was detected.
        rank: usize,
        /// The typed finding (match on it; [`Error::violation`]).
        violation: Box<crate::transport::Violation>,
    },
    /// An access outside every symmetric allocation, or a misaligned word.
    #[error(
        "rank {rank}: bad access {what} at {addr:#x}+{len}; access only allocated, aligned memory"
    )]
    BadAccess {
        /// Rank whose heap was addressed.
        rank: usize,
        /// The operation.
        what: &'static str,
        /// Heap offset.
        addr: u64,
        /// Bytes.
        len: u64,
    },
    /// A peer the operation's class cannot reach (load/store to another node).
    #[error("rank {from} cannot reach rank {to} by {class}; use the RDMA class for other nodes")]
    Unreachable {
        /// Issuing rank.
        from: usize,
        /// Target rank.
        to: usize,
        /// "load/store" or "RDMA".
        class: &'static str,
    },
    /// A QP index at or beyond the RC QPs per peer.
    #[error("QP index {qp} out of range: only {rc_per_pe} RC QPs per peer; raise num_qps_per_rank")]
    QpOutOfRange {
        /// The index used.
        qp: u16,
        /// RC QPs per peer.
        rc_per_pe: u16,
    },
    /// The symmetric heap cannot hold the allocation.
    #[error(
        "symmetric heap exhausted: {requested} bytes requested, {available} left; raise the heap size"
    )]
    HeapExhausted {
        /// Bytes asked for.
        requested: u64,
        /// Bytes left.
        available: u64,
    },
    /// The phase was torn down because another agent failed; returned to the other agents.
    #[error("phase aborted: {reason}")]
    PhaseAborted {
        /// Why.
        reason: String,
    },
    /// An agent returned an error or panicked.
    #[error("rank {rank} agent {agent} failed: {detail}")]
    AgentFailed {
        /// Rank.
        rank: usize,
        /// The agent (index and role).
        agent: String,
        /// Its error or panic message.
        detail: String,
    },
    /// The executor could not start an agent's thread (the operating system refused it: a
    /// process/thread limit such as `ulimit -u`, or the address-space limit `ulimit -v`). The
    /// phase was aborted at once: the agents already started were woken and stopped.
    #[error(
        "could not start the thread of rank {rank} agent {agent} ({started} of {total} agents of \
         the phase were running; all were stopped): {detail}; raise the thread limit (ulimit -u) \
         or the address-space limit (ulimit -v), or run fewer ranks or experts"
    )]
    AgentSpawnFailed {
        /// Rank of the agent that could not start.
        rank: usize,
        /// The agent (index and role).
        agent: String,
        /// Agents of the phase already running when the spawn failed.
        started: usize,
        /// Agents in the phase.
        total: usize,
        /// The operating system's error.
        detail: String,
    },
    /// A QP entered the error state (the peer or the link failed): posts kept succeeding locally
    /// but nothing more was delivered, and the agent's `quiet` found the error completions. Which
    /// rank to suspect is `peer`.
    #[error(
        "rank {rank} {agent}: QP qp{qp} to rank {peer} is in error state ({lost} work requests not delivered, \
         first lost: {first_lost}); rank {peer} or the link to it failed: poison the buffer and reset collectively"
    )]
    QpError {
        /// Rank of the agent that found the error.
        rank: usize,
        /// The agent (index and role).
        agent: String,
        /// The peer of the QP.
        peer: usize,
        /// The QP index towards `peer`.
        qp: u16,
        /// Work requests flushed without delivery.
        lost: u64,
        /// What the first lost work request was ("put of 512 bytes to heap+0x80", ...).
        first_lost: String,
    },
    /// A wait for completions (`quiet`, or a post waiting for a slot of a full QP) exceeded its
    /// bound: a completion was lost or the peer stopped acknowledging.
    #[error(
        "rank {rank} {agent}: timed out in {during} waiting for completions on QP qp{qp} to rank {peer} \
         ({outstanding} work requests outstanding, oldest: {oldest}); suspect rank {peer}, its link, or a lost completion"
    )]
    CompletionTimeout {
        /// Rank of the waiting agent.
        rank: usize,
        /// The agent (index and role).
        agent: String,
        /// The peer of the QP.
        peer: usize,
        /// The QP index towards `peer`.
        qp: u16,
        /// `"quiet"` or `"post to a full QP"`.
        during: &'static str,
        /// Work requests still outstanding on the QP.
        outstanding: u64,
        /// The oldest outstanding work request.
        oldest: String,
    },
    /// A rank stopped (its agents never finished the phase); the others finished or timed out.
    /// A Buffer is poisoned by it; in low-latency shrink mode it masks `rank` instead (spec §2.7).
    #[error(
        "rank {rank} failed: {detail}; mask it (shrink mode) or poison the buffer and reset collectively"
    )]
    RankFailed {
        /// The rank that stopped.
        rank: usize,
        /// Where its agents stopped, and why if known.
        detail: String,
    },

    // ---- normal mode ----
    /// A rank count a normal-mode plan cannot work with.
    #[error("{num_ranks} ranks: need {need}")]
    InvalidRankCount {
        /// The rank count given.
        num_ranks: usize,
        /// What is required.
        need: &'static str,
    },
    /// A rank index outside the group.
    #[error("rank {rank} is outside a group of {num_ranks} ranks; pass a rank in [0, {num_ranks})")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// Ranks in the group.
        num_ranks: usize,
    },
    /// A dispatch layout that does not match the routing it is used with (spec §1.7, §2.2):
    /// DeepEP would hang or return garbage; ep-rs refuses.
    #[error(
        "rank {rank}: layout field {field} does not match the routing ({detail}); \
         pass the layout get_dispatch_layout returned for this topk_idx"
    )]
    LayoutMismatch {
        /// Rank whose layout is wrong.
        rank: usize,
        /// The layout field.
        field: &'static str,
        /// What differs.
        detail: String,
    },
    /// `num_worst_tokens` is smaller than what a rank actually receives (spec §1.8).
    #[error(
        "rank {rank} receives {needed} rows but num_worst_tokens = {num_worst_tokens}; \
         use num_worst_tokens >= the worst case (e.g. num_tokens * num_ranks)"
    )]
    WorstTokensTooSmall {
        /// The receiving rank.
        rank: usize,
        /// The option's value.
        num_worst_tokens: usize,
        /// Rows that rank receives.
        needed: usize,
    },
    /// More than two bias tensors given to a combine (spec §1.8: 0, 1 or 2).
    #[error("rank {rank}: {found} bias tensors given to combine; pass at most 2")]
    TooManyBiases {
        /// The rank whose combine got them.
        rank: usize,
        /// How many were given.
        found: usize,
    },

    // ---- low-latency / FP8 ----
    /// A low-latency dispatch with more tokens than `num_max_dispatch_tokens_per_rank` (spec §1.9).
    #[error(
        "rank {rank}: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank = \
         {num_max_dispatch_tokens_per_rank}; split the batch or raise N"
    )]
    LlTooManyTokens {
        /// The rank whose batch is too large.
        rank: usize,
        /// Its `T`.
        num_tokens: usize,
        /// `N` of the call.
        num_max_dispatch_tokens_per_rank: usize,
    },
    /// Low-latency dispatch takes BF16 activations only and casts to FP8 itself (spec §1.9).
    #[error(
        "rank {rank}: low-latency dispatch takes BF16 x; pass BF16 and set use_fp8 to get FP8 rows"
    )]
    LlExpectsBf16 {
        /// The rank whose `x` is not BF16.
        rank: usize,
    },
    /// One rank routes more than `N` (token, top-k) entries to one expert — possible only with
    /// duplicate ids in a row — which overflows that expert's `N` receive slots for the rank
    /// (spec §2.4, §3.6).
    #[error(
        "rank {rank} sends {count} entries to expert {expert}, more than the \
         {num_max_dispatch_tokens_per_rank} slots a rank has per expert; remove duplicate expert \
         ids from topk_idx rows"
    )]
    LlSlotOverflow {
        /// The sending rank.
        rank: usize,
        /// The global expert id.
        expert: usize,
        /// Entries routed there.
        count: usize,
        /// `N` of the call.
        num_max_dispatch_tokens_per_rank: usize,
    },
    /// A low-latency combine whose handle has no row for a (token, expert) of the routing
    /// (spec §2.5): handle, routing and expert outputs are not from the same dispatch.
    #[error(
        "rank {rank}: token {token} chose expert {expert}, but the handle of its owner rank {owner} \
         has no row for it; combine with the topk_idx and handle of the same dispatch"
    )]
    LlMissingRow {
        /// The combining rank.
        rank: usize,
        /// The token.
        token: usize,
        /// The global expert id.
        expert: usize,
        /// The rank holding the expert.
        owner: usize,
    },
    /// Low-latency receive metadata that is not a valid packing (spec §2.4): blocks out of range,
    /// overlapping, or not summing to the expert's count.
    #[error(
        "invalid low-latency layout at local expert {local_expert}, source {source_rank}: {detail}"
    )]
    LlInvalidLayout {
        /// The local expert.
        local_expert: usize,
        /// The source rank (`usize::MAX` when the problem is the expert's total).
        source_rank: usize,
        /// What is wrong.
        detail: String,
    },

    // ---- workload / digest ----
    /// A routing description that cannot be parsed or generated (`uniform`, `zipf:S`,
    /// `hot:F`).
    #[error("invalid routing {routing:?}: {fix}")]
    InvalidRouting {
        /// The routing as given.
        routing: String,
        /// What is wrong and what to write instead.
        fix: String,
    },

    // ---- protocol / buffer ----
    /// A `Buffer` arena too small for a call (docs/protocol.md §2.1, §3.1).
    #[error("{what}: needs {needed} bytes, the buffer has {available}; {fix}")]
    ArenaTooSmall {
        /// Which arena and what it must hold.
        what: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
        /// What to do.
        fix: String,
    },
    /// A call of a mode whose arena the `Buffer` was built without (docs/protocol.md §2.1,
    /// §3.1): the size in `BufferConfig` was zero.
    #[error("{what} was not allocated (its size in BufferConfig is 0); {fix}")]
    ArenaMissing {
        /// Which arena.
        what: &'static str,
        /// What to do.
        fix: &'static str,
    },
    /// A value beyond a fixed protocol limit (channels, local experts, ...).
    #[error("{what} = {value} exceeds the protocol's limit {max}; {fix}")]
    ProtocolLimit {
        /// What.
        what: &'static str,
        /// The value asked for.
        value: usize,
        /// The limit.
        max: usize,
        /// What to do.
        fix: &'static str,
    },
    /// A low-latency operation launched while the receive hook of an earlier one has not run
    /// (docs/protocol.md §3.7).
    #[error(
        "low-latency call {pending_call}'s receive hook has not run; run it before launching the \
         next low-latency operation on this buffer"
    )]
    LowLatencyHookPending {
        /// The call whose hook is pending.
        pending_call: u64,
    },
    /// A hook that is not pending (already run, or of another buffer).
    #[error("no pending low-latency hook of call {call}; each hook runs exactly once")]
    LowLatencyHookNotPending {
        /// The hook's call.
        call: u64,
    },
    /// Low-latency memory used by something else since the last clean (spec case 20).
    #[error(
        "the low-latency buffer was used by other kernels since its last clean; call \
         clean_low_latency_buffer before the next low-latency operation"
    )]
    LowLatencyNeedsClean,
    /// A mask operation on a buffer built without `enable_shrink` (spec §2.7).
    #[error("rank masking needs enable_shrink = true in BufferConfig")]
    ShrinkNotEnabled,
    /// A signal word holds a value of another call than the one awaited: the memory was used by
    /// something else, or a protocol bug.
    #[error(
        "rank {rank}: signal word {word:#x} carries call {found} while call {call} waits; clean the \
         buffer (clean_low_latency_buffer) if other kernels used its memory"
    )]
    SignalEpochMismatch {
        /// Rank of the word.
        rank: usize,
        /// Word offset.
        word: u64,
        /// The waiting call.
        call: u64,
        /// The call in the word.
        found: u64,
    },
    /// A low-latency combine whose routing differs from its dispatch's: ep-rs reduces on the
    /// expert's rank with the weights that travelled with dispatch (docs/protocol.md §3.5).
    #[error(
        "rank {rank}: low-latency combine got other topk_idx/topk_weights than its dispatch; \
         combine with the same routing and weights"
    )]
    LowLatencyRoutingChanged {
        /// The rank.
        rank: usize,
    },
    /// A call on a `Buffer` an earlier call left poisoned: that call's phase failed (a fault, a
    /// timeout, or a protocol error), so ranks may have stopped at different points of it and
    /// operations may still be in flight (docs/protocol.md §7).
    #[error(
        "the buffer is poisoned since call {call} failed{}: {cause}; repair the fault, then call \
         Buffer::reset() (collective) before any other call",
        .failed_rank.map_or(String::new(), |r| format!(" (suspect rank {r})"))
    )]
    BufferPoisoned {
        /// The call that failed.
        call: u64,
        /// The rank the failure points at (the dead, silent or unreachable peer), if known.
        failed_rank: Option<usize>,
        /// The failure.
        cause: Box<Error>,
    },
    /// A collective reset a rank could not take part in (docs/protocol.md §7.2).
    #[error(
        "Buffer::reset needs every rank: rank {rank} cannot take part ({cause}); repair or replace \
         it and reset again (in low-latency shrink mode, mask it and reset the survivors)"
    )]
    ResetNeedsRank {
        /// The rank that cannot take part.
        rank: usize,
        /// Why.
        cause: Box<Error>,
    },

    // ---- backends ---------------------------------------------------------------------------
    /// A backend's own failure (the GPU's: a CUDA call, a device wait that timed out naming
    /// the word and its writer, NVSHMEM), kept typed: [`BackendError::downcast_ref`].
    #[error("{source}")]
    Backend {
        /// The backend's error.
        source: BackendError,
    },
    /// A backend refused an input: before any launch (a dtype, a device, a shape its kernels
    /// cannot take), or on the device in an earlier call (an expert id out of range, rows past
    /// the arena's capacity — that call's outputs are not valid). The buffer stays usable.
    #[error("input refused: {source}; fix the input and call again")]
    InputRefused {
        /// The backend's error, naming the rank and the value.
        source: BackendError,
    },
}

/// A backend's typed error inside an [`Error`]: shared (cheap to clone), compared by message.
#[derive(Clone)]
pub struct BackendError(std::sync::Arc<dyn std::error::Error + Send + Sync>);

impl BackendError {
    /// Wraps `e`.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(e))
    }

    /// The backend's error as its own type, when it is one.
    #[must_use]
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref::<E>()
    }
}

impl std::fmt::Debug for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.0, f)
    }
}

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for BackendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for BackendError {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl Error {
    /// The backend's typed error of a [`Error::Backend`] or [`Error::InputRefused`], also
    /// inside a [`Error::BufferPoisoned`] that one caused.
    #[must_use]
    pub fn backend<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            Error::Backend { source } | Error::InputRefused { source } => source.downcast_ref(),
            Error::BufferPoisoned { cause, .. } => cause.backend(),
            _ => None,
        }
    }

    /// The checker's typed finding, when this is a [`Error::ProtocolViolation`] — also inside a
    /// [`Error::BufferPoisoned`] that one caused.
    #[must_use]
    pub fn violation(&self) -> Option<&crate::transport::Violation> {
        match self {
            Error::ProtocolViolation { violation, .. } => Some(violation),
            Error::BufferPoisoned { cause, .. } => cause.violation(),
            _ => None,
        }
    }
}
