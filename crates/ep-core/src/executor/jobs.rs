//! What each phase of a [`Buffer`](crate::Buffer) call hands its executor: the inputs of the
//! local ranks and the facts the `Buffer` already settled (call number, low-latency operation,
//! row format, arena regions, the planted mutation), so that the executor derives nothing the
//! host logic owns. Built only by the `Buffer`; their fields are crate-private.

use crate::error::Result;
use crate::executor::tensors::{Host, Tensors};
use crate::plan::intranode::InPlaceDispatch;
use crate::plan::low_latency::LlDispatchOutput;
use crate::protocol::layout::LlLayout;
use crate::protocol::layout::RowFormat;
use crate::protocol::low_latency::{LlArena, LlOp, LlRows};
use crate::protocol::normal::{self, Expert, NormalArena};
use crate::protocol::{LlRoutes, ProtocolMutation};
use crate::routing::Activations;
use crate::transport::{SymAlloc, Team};

/// The per-token checks of a normal dispatch whose shapes the `Buffer` checked: the inputs and
/// layouts of the local ranks.
pub struct NormalDispatchCheck<'a, T: Tensors = Host> {
    pub(crate) inputs: &'a [T::Inputs],
    pub(crate) layouts: &'a [T::Layout],
    pub(crate) num_experts: usize,
    pub(crate) num_worst_tokens: usize,
}

impl<T: Tensors> NormalDispatchCheck<'_, T> {
    /// The local ranks' inputs.
    pub fn inputs(&self) -> &[T::Inputs] {
        self.inputs
    }
    /// The local ranks' layouts.
    pub fn layouts(&self) -> &[T::Layout] {
        self.layouts
    }
    /// Experts of the world.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    /// `num_worst_tokens` (0: exact sizing).
    pub fn num_worst_tokens(&self) -> usize {
        self.num_worst_tokens
    }
}

/// A normal dispatch of call `call` (docs/protocol.md §2.3), checked: the settled facts a
/// backend needs, the local ranks' inputs and layouts.
pub struct NormalDispatchJob<'a, T: Tensors = Host> {
    pub(crate) arena: NormalArena,
    pub(crate) call: u64,
    pub(crate) mutation: ProtocolMutation,
    pub(crate) inputs: &'a [T::Inputs],
    pub(crate) layouts: &'a [T::Layout],
    pub(crate) num_experts: usize,
    pub(crate) num_local_experts: usize,
    pub(crate) num_channels: usize,
    pub(crate) expert_alignment: usize,
    pub(crate) num_worst_tokens: usize,
    pub(crate) with_topk: bool,
    pub(crate) fmt: RowFormat,
    /// The received rows stay in the arena (host in-place calls, docs/protocol.md §2.6).
    pub(crate) in_place: bool,
}

impl<T: Tensors> NormalDispatchJob<'_, T> {
    /// The call number (the kernels' signal values count it).
    pub fn call(&self) -> u64 {
        self.call
    }
    /// The local ranks' inputs.
    pub fn inputs(&self) -> &[T::Inputs] {
        self.inputs
    }
    /// The local ranks' layouts.
    pub fn layouts(&self) -> &[T::Layout] {
        self.layouts
    }
    /// Experts of the world.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    /// Channels (`num_sms / 2`).
    pub fn num_channels(&self) -> usize {
        self.num_channels
    }
    /// `expert_alignment` (≥ 1).
    pub fn expert_alignment(&self) -> usize {
        self.expert_alignment
    }
    /// `num_worst_tokens` (0: exact sizing).
    pub fn num_worst_tokens(&self) -> usize {
        self.num_worst_tokens
    }
    /// Whether top-k is dispatched.
    pub fn with_topk(&self) -> bool {
        self.with_topk
    }
    /// The rows' format (top-k included).
    pub fn fmt(&self) -> RowFormat {
        self.fmt
    }
}

/// A cached normal dispatch of call `call` (docs/protocol.md §2.4), checked.
pub struct CachedDispatchJob<'a, T: Tensors = Host> {
    pub(crate) arena: NormalArena,
    pub(crate) call: u64,
    pub(crate) mutation: ProtocolMutation,
    pub(crate) xs: &'a [&'a T::Rows],
    pub(crate) handles: &'a [T::Handle],
    pub(crate) fmt: RowFormat,
}

impl<T: Tensors> CachedDispatchJob<'_, T> {
    /// The call number.
    pub fn call(&self) -> u64 {
        self.call
    }
    /// The local ranks' rows.
    pub fn xs(&self) -> &[&T::Rows] {
        self.xs
    }
    /// The local ranks' handles.
    pub fn handles(&self) -> &[T::Handle] {
        self.handles
    }
}

/// The per-token checks of a normal combine whose handles' shapes the `Buffer` checked:
/// every row a handle pulls exists on its rank (`num_recv[d]` rows on `d`).
pub struct NormalCombineCheck<'a, T: Tensors = Host> {
    pub(crate) handles: &'a [T::Handle],
    pub(crate) num_recv: &'a [usize],
}

impl<T: Tensors> NormalCombineCheck<'_, T> {
    /// The local ranks' handles.
    pub fn handles(&self) -> &[T::Handle] {
        self.handles
    }
    /// Rows each local rank's dispatch delivered.
    pub fn num_recv(&self) -> &[usize] {
        self.num_recv
    }
}

/// Where a normal combine finds the expert outputs.
pub enum CombineFrom<'a, T: Tensors = Host> {
    /// The caller's tensors, one per local rank.
    Args(&'a [T::CombineIn<'a>]),
    /// Already in the arena (host in-place calls, docs/protocol.md §2.6).
    InArena(InArenaRows<'a>),
}

/// Expert outputs a host in-place call left in the arena (docs/protocol.md §2.6).
#[derive(Clone, Copy)]
pub struct InArenaRows<'a>(pub(crate) normal::CombineSource<'a>);

/// A normal combine of call `call` (docs/protocol.md §2.5, §2.6), checked; the combined
/// weights are returned when `with_weights`.
pub struct NormalCombineJob<'a, T: Tensors = Host> {
    pub(crate) arena: NormalArena,
    pub(crate) call: u64,
    pub(crate) mutation: ProtocolMutation,
    pub(crate) handles: &'a [T::Handle],
    pub(crate) source: CombineFrom<'a, T>,
    pub(crate) hidden: usize,
    pub(crate) num_topk: usize,
    pub(crate) with_weights: bool,
}

impl<'a, T: Tensors> NormalCombineJob<'a, T> {
    /// The call number.
    pub fn call(&self) -> u64 {
        self.call
    }
    /// The local ranks' handles.
    pub fn handles(&self) -> &[T::Handle] {
        self.handles
    }
    /// The local ranks' combine inputs (`None`: the outputs are already in the arena).
    pub fn args(&self) -> Option<&'a [T::CombineIn<'a>]> {
        match self.source {
            CombineFrom::Args(a) => Some(a),
            CombineFrom::InArena(_) => None,
        }
    }
    /// Hidden size.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
    /// Whether the weights are combined.
    pub fn with_weights(&self) -> bool {
        self.with_weights
    }
}

/// The expert phase of call `call` over the rows the last in-place dispatch left in the arena
/// (docs/protocol.md §2.6): `rows[s]` rows of format `fmt` on rank `s`, outputs as records of
/// format `out`.
pub struct ExpertJob<'a> {
    pub(crate) arena: NormalArena,
    pub(crate) call: u64,
    pub(crate) fmt: RowFormat,
    pub(crate) out: RowFormat,
    pub(crate) rows: &'a [usize],
    pub(crate) with_topk: bool,
    pub(crate) expert: &'a Expert,
}

/// The facts of a low-latency operation a backend reads (docs/protocol.md §3): its call
/// number, index and half, the ranks masked in it, shrink mode.
pub struct LlOpView<'a>(pub(crate) &'a LlOp);

impl LlOpView<'_> {
    /// The call number.
    pub fn call(&self) -> u64 {
        self.0.call
    }
    /// The operation's index among the `Buffer`'s low-latency operations (from 0); its half is
    /// `index % 2` (docs/protocol.md §3.1).
    pub fn index(&self) -> u64 {
        self.0.index
    }
    /// The half of the low-latency buffer it uses.
    pub fn half(&self) -> u64 {
        self.0.half
    }
    /// Per rank: masked in this operation.
    pub fn masked(&self) -> &[bool] {
        &self.0.masked
    }
    /// Shrink mode.
    pub fn shrink(&self) -> bool {
        self.0.shrink
    }
    /// `(N, H, R, L)` of the operation.
    pub fn layout(&self) -> LlLayout {
        self.0.layout
    }
    /// Experts of the world.
    pub fn num_experts(&self) -> usize {
        self.0.num_experts
    }
}

/// The row format of a low-latency dispatch (spec §2.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlRowFormat {
    /// e4m3 rows with per-128 scales.
    pub use_fp8: bool,
    /// Scales rounded to powers of two.
    pub round_scale: bool,
    /// Scales packed as UE8M0 bytes.
    pub use_ue8m0: bool,
}

impl From<LlRows> for LlRowFormat {
    fn from(r: LlRows) -> Self {
        Self {
            use_fp8: r.use_fp8,
            round_scale: r.round_scale,
            use_ue8m0: r.use_ue8m0,
        }
    }
}

/// One attempt of the low-latency dispatch send half (docs/protocol.md §3.3); `fresh[d]`:
/// rank `d`'s signal words are zero at the start (the `Buffer`'s clean-state bookkeeping).
/// `inputs`: the local ranks'.
pub struct LlDispatchSendJob<'a, T: Tensors = Host> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) inputs: &'a [T::Inputs],
    pub(crate) rows: LlRows,
    pub(crate) mutation: ProtocolMutation,
    pub(crate) fresh: &'a [bool],
    pub(crate) recv_follows: bool,
}

impl<T: Tensors> LlDispatchSendJob<'_, T> {
    /// The operation.
    pub fn op(&self) -> LlOpView<'_> {
        LlOpView(self.op)
    }
    /// The local ranks' inputs.
    pub fn inputs(&self) -> &[T::Inputs] {
        self.inputs
    }
    /// The rows' format.
    pub fn rows(&self) -> LlRowFormat {
        self.rows.into()
    }
    /// The receive half is run right after this one (a call without hook): a backend may
    /// launch both halves at once.
    pub fn recv_follows(&self) -> bool {
        self.recv_follows
    }
}

/// One attempt of the low-latency dispatch receive half, the hook (docs/protocol.md §3.4):
/// `keep` what the send half kept of each local rank's inputs.
pub struct LlDispatchRecvJob<'a, T: Tensors = Host> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) rows: LlRows,
    pub(crate) keep: &'a [T::LlKeep],
    pub(crate) mutation: ProtocolMutation,
}

impl<T: Tensors> LlDispatchRecvJob<'_, T> {
    /// The operation.
    pub fn op(&self) -> LlOpView<'_> {
        LlOpView(self.op)
    }
    /// The rows' format.
    pub fn rows(&self) -> LlRowFormat {
        self.rows.into()
    }
}

/// One attempt of writing zero-copy expert outputs into the operation's registered region
/// (what the caller's GEMM does on the GPU), per local rank (`None`: masked).
pub struct LlExpertOutputJob<'a, T: Tensors = Host> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) expert_out: &'a [Option<T::LlExpertOut>],
}

impl<T: Tensors> LlExpertOutputJob<'_, T> {
    /// The operation.
    pub fn op(&self) -> LlOpView<'_> {
        LlOpView(self.op)
    }
    /// The local ranks' expert outputs.
    pub fn expert_out(&self) -> &[Option<T::LlExpertOut>] {
        self.expert_out
    }
}

/// One attempt of the low-latency combine send half (docs/protocol.md §3.5); `fresh` as in
/// [`LlDispatchSendJob`]. `expert_out`: the local ranks' expert outputs, `None` when they are
/// in the operation's zero-copy region.
pub struct LlCombineSendJob<'a, T: Tensors = Host> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) handles: &'a [Option<T::LlHandle>],
    pub(crate) expert_out: Option<&'a [Option<T::LlExpertOut>]>,
    pub(crate) fresh: &'a [bool],
    pub(crate) recv_follows: bool,
    pub(crate) use_logfmt: bool,
}

impl<T: Tensors> LlCombineSendJob<'_, T> {
    /// The operation.
    pub fn op(&self) -> LlOpView<'_> {
        LlOpView(self.op)
    }
    /// The local ranks' dispatch handles (`None`: masked).
    pub fn handles(&self) -> &[Option<T::LlHandle>] {
        self.handles
    }
    /// The local ranks' expert outputs; `None`: read from the zero-copy region.
    pub fn expert_out(&self) -> Option<&[Option<T::LlExpertOut>]> {
        self.expert_out
    }
    /// The receive half is run right after this one (as [`LlDispatchSendJob::recv_follows`]).
    pub fn recv_follows(&self) -> bool {
        self.recv_follows
    }
    /// The partials travel LogFMT-10 encoded (`LlCombineOptions::use_logfmt`, docs/protocol.md
    /// §3.12).
    pub fn use_logfmt(&self) -> bool {
        self.use_logfmt
    }
}

/// One attempt of the low-latency combine receive half, the hook (docs/protocol.md §3.6).
pub struct LlCombineRecvJob<'a, T: Tensors = Host> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) keep: &'a [T::LlKeep],
    pub(crate) use_logfmt: bool,
}

impl<T: Tensors> LlCombineRecvJob<'_, T> {
    /// The operation.
    pub fn op(&self) -> LlOpView<'_> {
        LlOpView(self.op)
    }
    /// The partials arrive LogFMT-10 encoded (as the send half's
    /// [`LlCombineSendJob::use_logfmt`]): the receive half decodes them.
    pub fn use_logfmt(&self) -> bool {
        self.use_logfmt
    }
}

/// The per-token checks of a low-latency combine: each unmasked local rank's routing equal to
/// its dispatch's (`handles[i]` present for those ranks, the `Buffer` checked).
pub struct LlCombineCheck<'a, T: Tensors = Host> {
    pub(crate) handles: &'a [Option<T::LlHandle>],
    pub(crate) inputs: &'a [T::Inputs],
    pub(crate) masked: &'a [bool],
}

impl<T: Tensors> LlCombineCheck<'_, T> {
    /// The local ranks' dispatch handles.
    pub fn handles(&self) -> &[Option<T::LlHandle>] {
        self.handles
    }
    /// The local ranks' routing inputs.
    pub fn inputs(&self) -> &[T::Inputs] {
        self.inputs
    }
    /// Per rank of the world: masked.
    pub fn masked(&self) -> &[bool] {
        self.masked
    }
}

/// `clean_low_latency_buffer` of call `call` (docs/protocol.md §3.7) on the unmasked ranks.
pub struct LlCleanJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) call: u64,
    pub(crate) masked: &'a [bool],
}

/// The zeroing step of a collective reset of call `call` (docs/protocol.md §7.2): `words`
/// (each allocation whole) on every rank of `team`.
pub struct ResetJob<'a> {
    pub(crate) words: &'a [&'a SymAlloc],
    pub(crate) call: u64,
    pub(crate) team: &'a Team,
}

/// What one attempt of a low-latency phase gave: the phase's result, the peers its receive
/// agents gave up on (shrink mode), and — when the phase succeeded with no peer given up on —
/// each local rank's output (`None` for ranks masked in the job's operation).
#[derive(Debug)]
pub struct LlAttempt<X> {
    /// The phase's result.
    pub result: Result<()>,
    /// Ranks the receive agents gave up on, ascending (a rank may be listed though masked).
    pub gave_up: Vec<usize>,
    /// Per local rank, when the attempt is final; empty otherwise and for the send halves.
    pub out: Vec<Option<Result<X>>>,
}

/// What a normal dispatch phase gives one rank: its outputs but `recv_x`, and `recv_x` unless
/// the rows stay in the arena.
pub type NormalDispatched = (InPlaceDispatch, Option<Activations>);

/// What a low-latency dispatch hook produced on one rank (host tensors).
pub type LlRecvOut = (LlDispatchOutput, LlRoutes);

/// Garbage `value` in every low-latency signal word of every rank, as call `call`.
#[cfg(feature = "test-support")]
pub struct LlForeignUseJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) call: u64,
    pub(crate) value: u64,
}

/// `byte` in every byte of the low-latency data (both halves; the signal words untouched) of
/// every rank not `masked`, as call `call`: what a later phase reads there is garbage unless the
/// protocol wrote it in this operation.
#[cfg(feature = "test-support")]
pub struct LlPoisonDataJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) call: u64,
    pub(crate) byte: u8,
    pub(crate) masked: &'a [bool],
}
