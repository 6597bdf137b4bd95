//! What a backend's tensors are (docs/buffer-api.md, "The types"): the types a
//! [`Buffer`](crate::Buffer) call takes and returns for one local rank, and the shape-level
//! facts its checks read. Host tensors on the simulator ([`Host`]), device views on the GPU
//! (`ep_kernels::gpu::DevTensors`). The `Buffer` reads shapes, dtypes and devices only, never
//! contents, so its host logic runs unchanged over device memory without a copy.

use half::bf16;

use crate::buffer::LlDispatched;
use crate::buffer::check::HandleShapes;
use crate::error::Result;
use crate::executor::jobs::{LlRecvOut, NormalDispatched};
use crate::plan::combine::{CombineArgs, CombineOutput};
use crate::plan::intranode::{IntranodeDispatch, IntranodeHandle};
use crate::plan::layout::DispatchLayout;
use crate::plan::low_latency::LlDispatchOutput;
use crate::protocol::LlRoutes;
use crate::protocol::layout::RowFormat;
use crate::routing::{Activations, ExpertIdx, InputShapes, RankInputs};
use crate::tensor::{Tensor2, Tensor3};

/// The shapes of one rank's combine inputs (spec §1.8).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CombineShapes {
    /// `x`: `[num_recv, H]` BF16.
    pub x: (usize, usize),
    /// `topk_weights`: `[num_recv, K]` (`None`: not given).
    pub topk_weights: Option<(usize, usize)>,
    /// Each bias: `[T, H]`.
    pub bias: Vec<(usize, usize)>,
}

/// The tensor family of a backend: per local rank, what each `Buffer` call takes and returns.
/// The associated functions give the shape-level facts (and check dtypes and devices, the
/// backend's own part of a shape-level check); a failure is a typed error before any launch.
pub trait Tensors {
    /// `[T, K]` expert ids (`-1` masked): `get_dispatch_layout`'s input.
    type Idx;
    /// `get_dispatch_layout`'s output.
    type Layout;
    /// A dispatch's inputs: `x` (BF16, or e4m3 with scales), top-k ids and weights.
    type Inputs;
    /// What the dispatch phase gives a rank (its executor's form).
    type Dispatched;
    /// What `Buffer::dispatch` returns for a rank: received rows, top-k, counts, handle.
    type Dispatch;
    /// The intranode handle (spec §2.2).
    type Handle;
    /// Rows of a cached dispatch, in and out.
    type Rows;
    /// A combine's inputs: expert outputs, weights, biases.
    type CombineIn<'a>;
    /// What combine gives a rank.
    type Combined;

    /// Low-latency: what a dispatch keeps of a rank's inputs for its receive half and for the
    /// combine's receive half (host: the top-k ids and weights; GPU: nothing, the device keeps
    /// what it needs).
    type LlKeep;
    /// Low-latency: what a dispatch receive half gives one rank.
    type LlRecv;
    /// Low-latency: an earlier output whose arrays a dispatch receive half may reuse.
    type LlSpare;
    /// Low-latency: what `Buffer::low_latency_dispatch` returns for the local ranks.
    type LlDispatched;
    /// Low-latency: what one rank's combine needs from its dispatch.
    type LlHandle;
    /// Low-latency: one rank's expert outputs, `[L, R·N, H]` BF16 in the packed layout.
    type LlExpertOut;
    /// Low-latency: one rank's combined tokens, `[T, H]` BF16.
    type LlCombined;

    /// `[T, K]` of rank `rank`'s expert ids (dtype and device checked).
    fn idx_shape(idx: &Self::Idx, rank: usize) -> Result<(usize, usize)>;

    /// The shapes of rank `rank`'s dispatch inputs (dtypes and devices checked; `with_topk`:
    /// the top-k tensors are dispatched).
    fn input_shapes(x: &Self::Inputs, rank: usize, with_topk: bool) -> Result<InputShapes>;

    /// The shapes of rank `rank`'s cached-dispatch rows (no top-k).
    fn rows_shapes(x: &Self::Rows, rank: usize) -> Result<InputShapes>;

    /// The shapes of rank `rank`'s handle (dtypes checked).
    fn handle_shapes(h: &Self::Handle, rank: usize) -> Result<HandleShapes>;

    /// The shapes of rank `rank`'s combine inputs (dtypes and devices checked).
    fn combine_shapes(a: &Self::CombineIn<'_>, rank: usize) -> Result<CombineShapes>;

    /// The dispatch output of rank `rank` from its phase's.
    fn finish_dispatch(d: Self::Dispatched, rank: usize) -> Result<Self::Dispatch>;

    /// What a low-latency dispatch keeps of a rank's inputs (shapes checked).
    fn ll_keep(x: &Self::Inputs) -> Self::LlKeep;

    /// The local ranks' low-latency dispatch outputs (`None`: masked) as the call returns them.
    fn ll_collect(out: Vec<Option<Self::LlRecv>>) -> Self::LlDispatched;

    /// The arrays of earlier outputs `d` a receive half may reuse, per local rank.
    fn ll_spares(d: Self::LlDispatched) -> Vec<Option<Self::LlSpare>>;

    /// `(L, R·N, H)` of rank `rank`'s expert outputs (dtype and device checked).
    fn ll_expert_shape(y: &Self::LlExpertOut, rank: usize) -> Result<(usize, usize, usize)>;
}

/// The row format of inputs of shapes `s` (top-k not counted).
#[must_use]
pub fn row_format(s: &InputShapes) -> RowFormat {
    let hidden = s.x.1;
    RowFormat {
        hidden,
        elem_bytes: if s.fp8 { 1 } else { 2 },
        num_scales: s.x_scales.map_or(0, |(_, c)| c),
        num_topk: 0,
    }
}

/// Host tensors: the simulator's family (every `RunsAgents` executor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Host;

impl Tensors for Host {
    type Idx = Tensor2<ExpertIdx>;
    type Layout = DispatchLayout;
    type Inputs = RankInputs;
    type Dispatched = NormalDispatched;
    type Dispatch = IntranodeDispatch;
    type Handle = IntranodeHandle;
    type Rows = Activations;
    type CombineIn<'a> = CombineArgs<'a>;
    type Combined = CombineOutput;
    type LlKeep = (Tensor2<ExpertIdx>, Tensor2<f32>);
    type LlRecv = LlRecvOut;
    type LlSpare = LlDispatchOutput;
    type LlDispatched = LlDispatched;
    type LlHandle = LlRoutes;
    type LlExpertOut = Tensor3<bf16>;
    type LlCombined = Tensor2<bf16>;

    fn idx_shape(idx: &Self::Idx, _rank: usize) -> Result<(usize, usize)> {
        Ok(idx.shape())
    }

    fn input_shapes(x: &Self::Inputs, _rank: usize, _with_topk: bool) -> Result<InputShapes> {
        Ok(x.shapes())
    }

    fn rows_shapes(x: &Self::Rows, _rank: usize) -> Result<InputShapes> {
        Ok(x.shapes())
    }

    fn handle_shapes(h: &Self::Handle, _rank: usize) -> Result<HandleShapes> {
        Ok(HandleShapes {
            rank_prefix_matrix: h.rank_prefix_matrix.shape(),
            channel_prefix_matrix: h.channel_prefix_matrix.shape(),
            recv_channel_prefix_matrix: h.recv_channel_prefix_matrix.shape(),
            send_head: h.send_head.shape(),
            is_token_in_rank: h.is_token_in_rank.shape(),
            num_rows: h.recv_src_idx.len(),
            num_recv: Some(h.num_recv_tokens),
        })
    }

    fn combine_shapes(a: &Self::CombineIn<'_>, _rank: usize) -> Result<CombineShapes> {
        Ok(CombineShapes {
            x: a.x.shape(),
            topk_weights: a.topk_weights.map(Tensor2::shape),
            bias: a.bias.iter().map(Tensor2::shape).collect(),
        })
    }

    fn finish_dispatch(d: Self::Dispatched, rank: usize) -> Result<Self::Dispatch> {
        let (d, x) = d;
        let recv_x = x.ok_or_else(|| crate::error::Error::AgentFailed {
            rank,
            agent: "receiver".into(),
            detail: "the receiver returned no rows".into(),
        })?;
        Ok(d.with_recv_x(recv_x))
    }

    fn ll_keep(x: &RankInputs) -> Self::LlKeep {
        (x.topk_idx.clone(), x.topk_weights.clone())
    }

    fn ll_collect(out: Vec<Option<LlRecvOut>>) -> LlDispatched {
        let (outputs, routes) = out.into_iter().map(|o| o.unzip()).unzip();
        LlDispatched { outputs, routes }
    }

    fn ll_spares(d: LlDispatched) -> Vec<Option<LlDispatchOutput>> {
        d.outputs
    }

    fn ll_expert_shape(y: &Tensor3<bf16>, _rank: usize) -> Result<(usize, usize, usize)> {
        Ok(y.shape())
    }
}
