//! What each phase of a [`Buffer`](crate::Buffer) call hands its executor: the inputs of the
//! local ranks and the facts the `Buffer` already settled (call number, low-latency operation,
//! row format, arena regions, the planted mutation), so that the executor derives nothing the
//! host logic owns. Built only by the `Buffer`; their fields are crate-private.

use half::bf16;

use crate::error::Result;
use crate::executor::tensors::{Host, Tensors};
use crate::plan::intranode::InPlaceDispatch;
use crate::plan::low_latency::LlDispatchOutput;
use crate::protocol::layout::RowFormat;
use crate::protocol::low_latency::{ExpertOut, LlArena, LlOp, LlRows};
use crate::protocol::normal::{self, Expert, NormalArena};
use crate::protocol::{LlRoutes, ProtocolMutation};
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::{Tensor2, Tensor3};
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

/// One attempt of the low-latency dispatch send half (docs/protocol.md §3.3); `fresh[d]`:
/// rank `d`'s signal words are zero at the start (the `Buffer`'s clean-state bookkeeping).
pub struct LlDispatchSendJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) xs: &'a [&'a Tensor2<bf16>],
    pub(crate) topk: &'a [(&'a Tensor2<ExpertIdx>, &'a Tensor2<f32>)],
    pub(crate) rows: LlRows,
    pub(crate) mutation: ProtocolMutation,
    pub(crate) fresh: &'a [bool],
}

/// One attempt of the low-latency dispatch receive half, the hook (docs/protocol.md §3.4).
pub struct LlDispatchRecvJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) rows: LlRows,
    pub(crate) topk: &'a [(Tensor2<ExpertIdx>, Tensor2<f32>)],
    pub(crate) mutation: ProtocolMutation,
}

/// One attempt of writing zero-copy expert outputs into the operation's registered region
/// (what the caller's GEMM does on the GPU).
pub struct LlExpertOutputJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) expert_out: &'a [Option<Tensor3<bf16>>],
}

/// One attempt of the low-latency combine send half (docs/protocol.md §3.5); `fresh` as in
/// [`LlDispatchSendJob`].
pub struct LlCombineSendJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) routes: &'a [Option<LlRoutes>],
    pub(crate) expert_out: ExpertOut<'a>,
    pub(crate) fresh: &'a [bool],
}

/// One attempt of the low-latency combine receive half, the hook (docs/protocol.md §3.6).
pub struct LlCombineRecvJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) op: &'a LlOp,
    pub(crate) topk: &'a [Tensor2<ExpertIdx>],
}

/// The per-token checks of a low-latency combine: each unmasked rank's routing equal to its
/// dispatch's (`routes[s]` present for those ranks, the `Buffer` checked).
pub struct LlCombineCheck<'a> {
    pub(crate) routes: &'a [Option<LlRoutes>],
    pub(crate) inputs: &'a [RankInputs],
    pub(crate) masked: &'a [bool],
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
/// each rank's output (`None` for ranks masked in the job's operation).
#[derive(Debug)]
pub struct LlAttempt<X> {
    /// The phase's result.
    pub result: Result<()>,
    /// Ranks the receive agents gave up on, ascending (a rank may be listed though masked).
    pub gave_up: Vec<usize>,
    /// Per rank, when the attempt is final; empty otherwise and for the send halves.
    pub out: Vec<Option<Result<X>>>,
}

/// What a normal dispatch phase gives one rank: its outputs but `recv_x`, and `recv_x` unless
/// the rows stay in the arena.
pub type NormalDispatched = (InPlaceDispatch, Option<Activations>);

/// What a low-latency dispatch hook produced on one rank.
pub type LlRecvOut = (LlDispatchOutput, LlRoutes);

/// Garbage `value` in every low-latency signal word of every rank, as call `call`.
#[cfg(feature = "test-support")]
pub struct LlForeignUseJob<'a> {
    pub(crate) arena: &'a LlArena,
    pub(crate) call: u64,
    pub(crate) value: u64,
}
