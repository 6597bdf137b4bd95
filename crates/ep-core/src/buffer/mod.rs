//! `Buffer`: DeepEP's `deep_ep.Buffer` (spec §1) over any [`Transport`], driving the protocol's
//! phases (docs/protocol.md).
//!
//! The API is collective, like the simulator: one call handles every rank's inputs and returns
//! every rank's outputs (`Vec` indexed by rank). On the GPU each process drives its own rank with
//! the same sequence of calls.
//!
//! | DeepEP | ep-rs |
//! |---|---|
//! | `Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, ...)` | [`Buffer::new`] with a [`BufferConfig`] |
//! | `get_dispatch_layout` | [`Buffer::get_dispatch_layout`] |
//! | `dispatch(x, num_tokens_per_rank=..., topk_idx=..., ...)` | [`Buffer::dispatch`] |
//! | `dispatch(x, handle=...)` | [`Buffer::dispatch_cached`] |
//! | `combine(x, handle, topk_weights, bias)` | [`Buffer::combine`] |
//! | `low_latency_dispatch(..., return_recv_hook)` | [`Buffer::low_latency_dispatch`] / [`Buffer::low_latency_dispatch_send`] + [`Buffer::low_latency_dispatch_recv`] |
//! | `low_latency_combine(..., zero_copy, return_recv_hook)` | [`Buffer::low_latency_combine`] / `_send` + `_recv` |
//! | `clean_low_latency_buffer` | [`Buffer::clean_low_latency_buffer`] |
//! | `low_latency_update_mask_buffer` / `query` / `clean` | [`Buffer::update_mask`] / [`Buffer::query_mask`] / [`Buffer::clean_mask`] |
//! | `get_low_latency_rdma_size_hint` | [`Buffer::low_latency_size_hint`] |
//!
//! Differences, each documented in docs/protocol.md: low-latency dispatch takes the top-k
//! weights (they travel with dispatch; combine checks it gets the same), and reduces partial sums
//! on the expert's rank (numerics §5).

use std::sync::Mutex;

use half::bf16;

use crate::config::{BufferConfig, Config};
use crate::error::{Error, Result};
use crate::plan::combine::{CombineArgs, CombineOutput, check_combine_args};
use crate::plan::intranode::{
    DispatchOptions, IntranodeDispatch, IntranodeHandle, check_dispatch,
    check_same_activation_kind, handle_mismatch,
};
use crate::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use crate::plan::low_latency::{LlDispatchOutput, LlParams, validate_dispatch};
use crate::protocol::layout::{
    LlLayout, MAX_CHANNELS, MAX_LOCAL_EXPERTS, NormalCtrl, NormalData, REGION_ALIGN, RowFormat,
    align128, ll_half, ll_signal_bytes,
};
use crate::protocol::low_latency::{self as ll, ExpertOut, LlArena, LlOp, LlRows};
use crate::protocol::normal::{self, NormalArena, take_slot};
use crate::protocol::{LlRoutes, ProtocolMutation};
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::Tensor2;
use crate::transport::{AllocRequest, Init, Team, Transport};

/// Options of a normal dispatch (spec §1.8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalDispatchArgs {
    /// Chunking; `C = num_sms / 2` channels.
    pub config: Config,
    /// Rounds the expert list (≥ 1).
    pub expert_alignment: usize,
    /// `> 0`: outputs sized to this many rows, no host sync (spec §1.8).
    pub num_worst_tokens: usize,
    /// Whether top-k is dispatched.
    pub with_topk: bool,
}

impl NormalDispatchArgs {
    /// `config`, alignment 1, no worst-case sizing, with top-k.
    #[must_use]
    pub fn new(config: Config) -> Self {
        Self {
            config,
            expert_alignment: 1,
            num_worst_tokens: 0,
            with_topk: true,
        }
    }
}

/// What a low-latency dispatch returns: the plan's per-rank outputs (`None` for masked ranks)
/// and the routes its combine needs.
#[derive(Clone, Debug, PartialEq)]
pub struct LlDispatched {
    /// `outputs[d]`: receiver `d`'s outputs (spec §2.4), `None` if masked.
    pub outputs: Vec<Option<LlDispatchOutput>>,
    /// `routes[d]`: what combine needs on `d`, `None` if masked.
    pub routes: Vec<Option<LlRoutes>>,
}

/// A pending low-latency dispatch receive half (the hook). Run it with
/// [`Buffer::low_latency_dispatch_recv`] before the next low-latency operation.
#[must_use = "a pending hook must be run before the next low-latency operation"]
#[derive(Debug)]
pub struct LlDispatchHook {
    op: LlOp,
    rows: LlRows,
    topk: Vec<(Tensor2<ExpertIdx>, Tensor2<f32>)>,
}

impl LlDispatchHook {
    /// The call this hook belongs to.
    #[must_use]
    pub fn call(&self) -> u64 {
        self.op.call
    }
}

/// A pending low-latency combine receive half (the hook).
#[must_use = "a pending hook must be run before the next low-latency operation"]
#[derive(Debug)]
pub struct LlCombineHook {
    op: LlOp,
    topk: Vec<Tensor2<ExpertIdx>>,
}

impl LlCombineHook {
    /// The call this hook belongs to.
    #[must_use]
    pub fn call(&self) -> u64 {
        self.op.call
    }
}

/// State of the low-latency signal words (docs/protocol.md §1.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LlMem {
    /// Zero: allocated or cleaned, no LL operation since.
    Fresh,
    /// Written only by LL operations since the last clean.
    Used,
    /// Used by something else since the last clean.
    Dirty,
}

/// DeepEP's `Buffer` over a [`Transport`] (module docs).
pub struct Buffer<T: Transport> {
    transport: T,
    config: BufferConfig,
    last_call: u64,
    normal: Option<NormalArena>,
    ll: Option<LlArena>,
    ll_ops: u64,
    /// Per rank.
    ll_mem: Vec<LlMem>,
    pending_hooks: Vec<u64>,
    mask: Vec<bool>,
    mutation: ProtocolMutation,
}

impl<T: Transport> std::fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("config", &self.config)
            .field("last_call", &self.last_call)
            .field("ll_ops", &self.ll_ops)
            .field("pending_hooks", &self.pending_hooks)
            .finish_non_exhaustive()
    }
}

fn rows_of(x: &Activations) -> RowFormat {
    match x {
        Activations::Bf16(t) => RowFormat {
            hidden: t.cols(),
            elem_bytes: 2,
            num_scales: 0,
            num_topk: 0,
        },
        Activations::Fp8 { data, scales } => RowFormat {
            hidden: data.cols(),
            elem_bytes: 1,
            num_scales: scales.cols(),
            num_topk: 0,
        },
    }
}

impl<T: Transport> Buffer<T> {
    /// Validates `config` (DeepEP's constructor checks) and allocates the arenas collectively:
    /// normal mode when `num_nvl_bytes > 0`, low-latency when `low_latency_mode` and
    /// `num_rdma_bytes > 0` (docs/protocol.md §2.1, §3.1).
    pub fn new(mut transport: T, config: BufferConfig) -> Result<Self> {
        config.validate()?;
        let r = config.num_ranks;
        if transport.fabric().num_ranks != r {
            return Err(Error::RankCountMismatch {
                expected: r,
                found: transport.fabric().num_ranks,
            });
        }
        let mut normal = None;
        if config.num_nvl_bytes > 0 {
            let ctrl_bytes = align128(NormalCtrl { num_ranks: r }.bytes());
            let min = ctrl_bytes
                + NormalData {
                    num_ranks: r,
                    data_bytes: 0,
                }
                .rows_base()
                + 256;
            if config.num_nvl_bytes < min {
                return Err(Error::ArenaTooSmall {
                    what: "normal-mode arena (control words, count records, tables)".into(),
                    needed: min,
                    available: config.num_nvl_bytes,
                    fix: "raise num_nvl_bytes (Buffer::normal_size_hint)".into(),
                });
            }
            let ctrl = transport.alloc(AllocRequest {
                name: "normal.ctrl".into(),
                bytes: ctrl_bytes,
                align: REGION_ALIGN,
                init: Init::Zero,
            })?;
            let data = transport.alloc(AllocRequest {
                name: "normal.data".into(),
                bytes: config.num_nvl_bytes - ctrl_bytes,
                align: REGION_ALIGN,
                init: Init::Poison,
            })?;
            normal = Some(NormalArena {
                num_ranks: r,
                ctrl,
                data,
            });
        }
        let mut ll = None;
        if config.low_latency_mode && config.num_rdma_bytes > 0 {
            let sig = ll_signal_bytes(r);
            if config.num_rdma_bytes <= sig {
                return Err(Error::ArenaTooSmall {
                    what: "low-latency buffer (signals)".into(),
                    needed: sig + REGION_ALIGN,
                    available: config.num_rdma_bytes,
                    fix: "use Buffer::low_latency_size_hint".into(),
                });
            }
            let signals = transport.alloc(AllocRequest {
                name: "ll.signals".into(),
                bytes: sig,
                align: REGION_ALIGN,
                init: Init::Zero,
            })?;
            let data = transport.alloc(AllocRequest {
                name: "ll.data".into(),
                bytes: config.num_rdma_bytes - sig,
                align: REGION_ALIGN,
                init: Init::Poison,
            })?;
            ll = Some(LlArena {
                num_ranks: r,
                signals,
                data,
            });
        }
        Ok(Self {
            transport,
            mask: vec![false; r],
            config,
            last_call: 0,
            normal,
            ll,
            ll_ops: 0,
            ll_mem: vec![LlMem::Fresh; r],
            pending_hooks: Vec::new(),
            mutation: ProtocolMutation::None,
        })
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport, mutably (e.g. to read simulator statistics).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The configuration.
    pub fn config(&self) -> &BufferConfig {
        &self.config
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.config.num_ranks
    }

    /// The number of the last call made (calls number from 1; both modes share the counter).
    pub fn last_call(&self) -> u64 {
        self.last_call
    }

    /// Plants a bug in the protocol's agents (mutation suite). Test support only.
    #[doc(hidden)]
    pub fn set_mutation_for_test(&mut self, m: ProtocolMutation) {
        self.mutation = m;
    }

    fn next_call(&mut self) -> u64 {
        self.last_call += 1;
        self.last_call
    }

    /// `num_nvl_bytes` that holds normal-mode calls of up to `max_recv_rows` rows per rank with
    /// hidden `hidden`, `elem_bytes` per element, `num_topk` top-k (FP8: scales included).
    #[must_use]
    pub fn normal_size_hint(
        num_ranks: usize,
        max_recv_rows: usize,
        hidden: usize,
        elem_bytes: usize,
        num_topk: usize,
    ) -> u64 {
        let fmt = RowFormat {
            hidden,
            elem_bytes,
            num_scales: if elem_bytes == 1 {
                hidden.div_ceil(128)
            } else {
                0
            },
            num_topk,
        };
        align128(NormalCtrl { num_ranks }.bytes())
            + NormalData::data_bytes_for(
                num_ranks,
                max_recv_rows as u64,
                fmt.dispatch_record(),
                fmt.combine_record(),
            )
    }

    /// `num_rdma_bytes` for low-latency calls with `(N, H, R, E)` (docs/protocol.md §3.1); ep-rs's
    /// own layout, not DeepEP's (`config::low_latency_rdma_size_hint`).
    #[must_use]
    pub fn low_latency_size_hint(
        num_max_dispatch_tokens_per_rank: usize,
        hidden: usize,
        num_ranks: usize,
        num_experts: usize,
    ) -> u64 {
        LlLayout {
            num_ranks,
            num_local_experts: num_experts / num_ranks.max(1),
            hidden,
            num_max_tokens: num_max_dispatch_tokens_per_rank,
        }
        .total_bytes()
    }

    // ---- normal mode ------------------------------------------------------------------------

    /// `get_dispatch_layout` of every rank (spec §1.7).
    pub fn get_dispatch_layout(
        &self,
        topk_idx: &[Tensor2<ExpertIdx>],
        num_experts: usize,
    ) -> Result<Vec<DispatchLayout>> {
        let r = self.num_ranks();
        if topk_idx.len() != r {
            return Err(Error::RankCountMismatch {
                expected: r,
                found: topk_idx.len(),
            });
        }
        topk_idx
            .iter()
            .enumerate()
            .map(|(s, t)| get_dispatch_layout_for_rank(s, t, num_experts, r))
            .collect()
    }

    fn normal_arena(&self) -> Result<&NormalArena> {
        let r = self.num_ranks();
        for s in 0..r {
            for d in 0..r {
                if !self.transport.reach(s, d).load_store() {
                    return Err(Error::Unsupported(format!(
                        "normal mode between rank {s} and rank {d}, which are not NVLink peers: \
                         normal internode mode is not implemented yet (docs/protocol.md §4)"
                    )));
                }
            }
        }
        self.normal.as_ref().ok_or_else(|| Error::ArenaTooSmall {
            what: "normal-mode arena".into(),
            needed: 1,
            available: 0,
            fix: "set num_nvl_bytes (Buffer::normal_size_hint)".into(),
        })
    }

    fn check_capacity(arena: &NormalArena, rows: usize, rec: u64, dispatch: bool) -> Result<()> {
        let data = arena.data_layout();
        let cap = if dispatch {
            data.dispatch_capacity(rec)
        } else {
            data.combine_capacity(rec)
        };
        if rows as u64 > cap {
            return Err(Error::ArenaTooSmall {
                what: format!(
                    "normal-mode {} rows ({rows} rows of {rec} bytes)",
                    if dispatch { "dispatch" } else { "combine" }
                ),
                needed: rows as u64 * rec,
                available: cap * rec,
                fix: "raise num_nvl_bytes (Buffer::normal_size_hint)".into(),
            });
        }
        Ok(())
    }

    /// Normal dispatch of every rank (spec §1.8, docs/protocol.md §2.3): one phase, rows written
    /// directly at their final place. Outputs equal `plan::intranode::intranode_dispatch_all`.
    pub fn dispatch(
        &mut self,
        inputs: &[RankInputs],
        layouts: &[DispatchLayout],
        num_experts: usize,
        args: &NormalDispatchArgs,
    ) -> Result<Vec<IntranodeDispatch>> {
        let opts = DispatchOptions {
            num_channels: args.config.num_channels(),
            expert_alignment: args.expert_alignment,
            num_worst_tokens: args.num_worst_tokens,
            with_topk: args.with_topk,
        };
        if inputs.len() != self.num_ranks() {
            return Err(Error::RankCountMismatch {
                expected: self.num_ranks(),
                found: inputs.len(),
            });
        }
        let shape = check_dispatch(inputs, layouts, num_experts, &opts)?;
        if opts.num_channels > MAX_CHANNELS {
            return Err(Error::ProtocolLimit {
                what: "channels (num_sms / 2)",
                value: opts.num_channels,
                max: MAX_CHANNELS,
                fix: "use at most 128 SMs for normal mode",
            });
        }
        if shape.num_local_experts > MAX_LOCAL_EXPERTS {
            return Err(Error::ProtocolLimit {
                what: "local experts",
                value: shape.num_local_experts,
                max: MAX_LOCAL_EXPERTS,
                fix: "use more ranks or fewer experts",
            });
        }
        let r = self.num_ranks();
        let mut fmt = rows_of(&inputs[0].x);
        fmt.num_topk = shape.num_topk;
        let mut max_rows = 0usize;
        for d in 0..r {
            let recv: usize = layouts
                .iter()
                .map(|l| l.num_tokens_per_rank[d] as usize)
                .sum();
            if opts.num_worst_tokens > 0 && recv > opts.num_worst_tokens {
                return Err(Error::WorstTokensTooSmall {
                    rank: d,
                    num_worst_tokens: opts.num_worst_tokens,
                    needed: recv,
                });
            }
            max_rows = max_rows.max(recv.max(opts.num_worst_tokens));
        }
        let call = self.next_call();
        let mutation = self.mutation;
        let arena = self.normal_arena()?.clone();
        Self::check_capacity(&arena, max_rows, fmt.dispatch_record(), true)?;
        let job = normal::DispatchJob {
            inputs,
            layouts,
            num_local_experts: shape.num_local_experts,
            num_channels: opts.num_channels,
            expert_alignment: opts.expert_alignment,
            num_worst_tokens: opts.num_worst_tokens,
            with_topk: opts.with_topk,
            fmt,
        };
        let slots = normal::DispatchSlots::new(r);
        let phase = normal::dispatch_phase(&arena, &job, call, mutation, &slots);
        self.transport.run_phase(phase)?;
        (0..r)
            .map(|d| {
                let n = take_slot(&slots.notify[d], "notify")?;
                let v = take_slot(&slots.recv[d], "receiver")?;
                Ok(IntranodeDispatch {
                    recv_x: v.recv_x,
                    recv_topk_idx: v.topk_idx,
                    recv_topk_weights: v.topk_weights,
                    num_recv_tokens_per_expert_list: n.expert_list,
                    handle: IntranodeHandle {
                        rank_prefix_matrix: n.rank_prefix_matrix,
                        channel_prefix_matrix: n.channel_prefix_matrix,
                        recv_channel_prefix_matrix: n.recv_channel_prefix_matrix,
                        recv_src_idx: v.src_idx,
                        is_token_in_rank: layouts[d].is_token_in_rank.clone(),
                        send_head: n.send_head,
                        num_recv_tokens: n.num_recv,
                    },
                })
            })
            .collect()
    }

    /// Cached dispatch (handle given, no top-k, spec §1.8; docs/protocol.md §2.4). Equals
    /// `plan::intranode::intranode_dispatch_cached`.
    pub fn dispatch_cached(
        &mut self,
        xs: &[&Activations],
        handles: &[IntranodeHandle],
    ) -> Result<Vec<Activations>> {
        let r = self.num_ranks();
        for len in [xs.len(), handles.len()] {
            if len != r {
                return Err(Error::RankCountMismatch {
                    expected: r,
                    found: len,
                });
            }
        }
        let mut max_rows = 0;
        for (s, (x, h)) in xs.iter().zip(handles).enumerate() {
            check_same_activation_kind(xs[0], x, s)?;
            let c = h.channel_prefix_matrix.cols();
            if h.rank_prefix_matrix.shape() != (r, r)
                || h.channel_prefix_matrix.rows() != r
                || h.is_token_in_rank.shape() != (x.num_tokens(), r)
                || c == 0
                || c > MAX_CHANNELS
                || h.num_recv_tokens > h.recv_src_idx.len()
            {
                return Err(handle_mismatch(
                    s,
                    "cached dispatch: handle shapes do not match x and the rank count".into(),
                ));
            }
            max_rows = max_rows.max(h.recv_src_idx.len());
        }
        let fmt = rows_of(xs[0]);
        let call = self.next_call();
        let mutation = self.mutation;
        let arena = self.normal_arena()?.clone();
        Self::check_capacity(&arena, max_rows, fmt.dispatch_record(), true)?;
        let job = normal::CachedJob { xs, handles, fmt };
        let out: Vec<Mutex<Option<normal::RecvResult>>> =
            (0..r).map(|_| Mutex::new(None)).collect();
        let phase = normal::cached_phase(&arena, &job, call, mutation, &out);
        self.transport.run_phase(phase)?;
        out.iter()
            .map(|o| take_slot(o, "receiver").map(|v| v.recv_x))
            .collect()
    }

    /// Normal combine of every rank (spec §1.8, docs/protocol.md §2.5): each rank publishes its
    /// expert outputs in its combine rows, owners pull and reduce. Equals
    /// `plan::intranode::intranode_combine` bit for bit.
    pub fn combine(
        &mut self,
        handles: &[IntranodeHandle],
        args: &[CombineArgs<'_>],
    ) -> Result<Vec<CombineOutput>> {
        let r = self.num_ranks();
        for len in [handles.len(), args.len()] {
            if len != r {
                return Err(Error::RankCountMismatch {
                    expected: r,
                    found: len,
                });
            }
        }
        let num_tokens: Vec<usize> = handles.iter().map(|h| h.send_head.rows()).collect();
        let num_recv: Vec<usize> = handles.iter().map(|h| h.recv_src_idx.len()).collect();
        let (hidden, num_topk) = check_combine_args(args, &num_tokens, &num_recv)?;
        for (s, h) in handles.iter().enumerate() {
            let c = h.channel_prefix_matrix.cols();
            if h.rank_prefix_matrix.shape() != (r, r)
                || h.channel_prefix_matrix.rows() != r
                || h.send_head.cols() != r
                || c == 0
                || c > MAX_CHANNELS
            {
                return Err(handle_mismatch(s, "combine: handle shapes".into()));
            }
            // Every pulled row must exist on its rank.
            for t in 0..h.send_head.rows() {
                let ch = (0..c)
                    .find(|&ch| {
                        crate::plan::layout::channel_range(h.send_head.rows(), c, ch).contains(&t)
                    })
                    .unwrap_or(0);
                for d in 0..r {
                    let slot = h.send_head.get(t, d);
                    if slot < 0 {
                        continue;
                    }
                    let j = (if s == 0 {
                        0
                    } else {
                        h.rank_prefix_matrix.get(s - 1, d)
                    }) + (if ch == 0 {
                        0
                    } else {
                        h.channel_prefix_matrix.get(d, ch - 1)
                    }) + slot;
                    if j < 0 || j as usize >= handles[d].num_recv_tokens.min(num_recv[d]) {
                        return Err(handle_mismatch(
                            s,
                            format!(
                                "token {t} maps to row {j} of rank {d}, past its received rows"
                            ),
                        ));
                    }
                }
            }
        }
        let k = num_topk.unwrap_or(0);
        let fmt = RowFormat {
            hidden,
            elem_bytes: 2,
            num_scales: 0,
            num_topk: k,
        };
        let call = self.next_call();
        let mutation = self.mutation;
        let arena = self.normal_arena()?.clone();
        Self::check_capacity(
            &arena,
            num_recv.iter().copied().max().unwrap_or(0),
            fmt.combine_record(),
            false,
        )?;
        let job = normal::CombineJob {
            handles,
            args,
            hidden,
            num_topk: k,
        };
        let out: Vec<Vec<Mutex<Option<normal::ReducedRows>>>> = handles
            .iter()
            .map(|h| {
                (0..h.channel_prefix_matrix.cols())
                    .map(|_| Mutex::new(None))
                    .collect()
            })
            .collect();
        let phase = normal::combine_phase(&arena, &job, call, mutation, &out);
        self.transport.run_phase(phase)?;
        let mut res = Vec::with_capacity(r);
        for (s, chans) in out.iter().enumerate() {
            let t = num_tokens[s];
            let mut x = Tensor2::filled(t, hidden, bf16::ZERO);
            let mut w = Tensor2::filled(t, k, 0.0f32);
            for o in chans {
                let (first, rows_x, rows_w) = take_slot(o, "reducer")?;
                let n = rows_x.len() / hidden.max(1);
                for i in 0..n {
                    x.row_mut(first + i)
                        .copy_from_slice(&rows_x[i * hidden..(i + 1) * hidden]);
                    if k > 0 {
                        w.row_mut(first + i)
                            .copy_from_slice(&rows_w[i * k..(i + 1) * k]);
                    }
                }
            }
            res.push(CombineOutput {
                combined_x: x,
                combined_topk_weights: num_topk.map(|_| w),
            });
        }
        Ok(res)
    }

    // ---- low-latency mode -------------------------------------------------------------------

    fn ll_arena(&self) -> Result<LlArena> {
        if !self.config.low_latency_mode {
            return Err(Error::NotLowLatencyMode);
        }
        self.ll.clone().ok_or_else(|| Error::ArenaTooSmall {
            what: "low-latency buffer".into(),
            needed: 1,
            available: 0,
            fix: "set num_rdma_bytes (Buffer::low_latency_size_hint)".into(),
        })
    }

    /// Checks the hook contract and the clean state before a low-latency send.
    fn ll_precheck(&self) -> Result<()> {
        if let Some(&p) = self.pending_hooks.first()
            && self.mutation != ProtocolMutation::SkipHookCheck
        {
            return Err(Error::LowLatencyHookPending { pending_call: p });
        }
        let live = |d: &usize| !self.mask[*d];
        if (0..self.num_ranks())
            .filter(live)
            .any(|d| self.ll_mem[d] == LlMem::Dirty)
            && self.mutation != ProtocolMutation::SkipCleanCheck
        {
            return Err(Error::LowLatencyNeedsClean);
        }
        Ok(())
    }

    /// Marks the unmasked ranks' signal words as written by low-latency operations.
    fn ll_used(&mut self) {
        for d in 0..self.num_ranks() {
            if !self.mask[d] {
                self.ll_mem[d] = LlMem::Used;
            }
        }
    }

    fn ll_op(&mut self, layout: LlLayout, num_experts: usize) -> Result<LlOp> {
        let arena = self.ll_arena()?;
        let need = layout.total_bytes();
        if need > self.config.num_rdma_bytes {
            return Err(Error::ArenaTooSmall {
                what: format!(
                    "low-latency buffer for N={}, H={}, R={}, L={}",
                    layout.num_max_tokens,
                    layout.hidden,
                    layout.num_ranks,
                    layout.num_local_experts
                ),
                needed: need,
                available: self.config.num_rdma_bytes,
                fix: "use Buffer::low_latency_size_hint".into(),
            });
        }
        let _ = arena;
        let num_qps = self
            .config
            .num_qps_per_rank
            .min(u32::from(self.transport.fabric().rc_per_pe))
            .max(1) as u16;
        let call = self.next_call();
        let half = ll_half(self.ll_ops);
        self.ll_ops += 1;
        Ok(LlOp {
            call,
            half,
            layout,
            masked: self.mask.clone(),
            num_qps,
            num_experts,
        })
    }

    fn assume_signals_zero<'a>(
        &self,
        mut phase: crate::transport::Phase<'a>,
        arena: &LlArena,
    ) -> crate::transport::Phase<'a> {
        // Ranks cleaned (or never used) since their last low-latency operation: their words are
        // zero (docs/protocol.md §1.1). Masked ranks run no agents and are not checked.
        for d in (0..self.num_ranks()).filter(|&d| !self.mask[d] && self.ll_mem[d] != LlMem::Used) {
            phase = phase.assume_zero(d, arena.signals.region);
        }
        phase
    }

    /// Low-latency dispatch send half (docs/protocol.md §3.3). `inputs[s].topk_weights` travel
    /// with the rows. Returns the hook; run [`Buffer::low_latency_dispatch_recv`] before the next
    /// low-latency operation.
    pub fn low_latency_dispatch_send(
        &mut self,
        inputs: &[RankInputs],
        params: &LlParams,
    ) -> Result<LlDispatchHook> {
        let params = params.clone().with_masked_ranks(self.mask.clone());
        let shape = validate_dispatch(inputs, &params)?;
        self.ll_precheck()?;
        let arena = self.ll_arena()?;
        let layout = LlLayout {
            num_ranks: shape.num_ranks,
            num_local_experts: shape.num_local_experts,
            hidden: shape.hidden,
            num_max_tokens: shape.num_max_dispatch_tokens_per_rank,
        };
        let op = self.ll_op(layout, params.num_experts)?;
        let rows = LlRows {
            use_fp8: params.use_fp8,
            round_scale: params.round_scale,
            use_ue8m0: params.use_ue8m0,
        };
        let xs: Vec<&Tensor2<bf16>> = inputs
            .iter()
            .enumerate()
            .map(|(s, i)| match &i.x {
                Activations::Bf16(x) => Ok(x),
                Activations::Fp8 { .. } => Err(Error::LlExpectsBf16 { rank: s }),
            })
            .collect::<Result<_>>()?;
        let topk: Vec<(&Tensor2<ExpertIdx>, &Tensor2<f32>)> = inputs
            .iter()
            .map(|i| (&i.topk_idx, &i.topk_weights))
            .collect();
        let phase = ll::dispatch_send_phase(&arena, &op, &xs, &topk, rows, self.mutation);
        let phase = self.assume_signals_zero(phase, &arena);
        self.ll_used();
        self.transport.run_phase(phase)?;
        self.pending_hooks.push(op.call);
        Ok(LlDispatchHook {
            topk: inputs
                .iter()
                .map(|i| (i.topk_idx.clone(), i.topk_weights.clone()))
                .collect(),
            op,
            rows,
        })
    }

    fn take_hook(&mut self, call: u64) -> Result<()> {
        let i = self
            .pending_hooks
            .iter()
            .position(|&c| c == call)
            .ok_or(Error::LowLatencyHookNotPending { call })?;
        self.pending_hooks.remove(i);
        Ok(())
    }

    /// Low-latency dispatch receive half, the hook (docs/protocol.md §3.4).
    pub fn low_latency_dispatch_recv(&mut self, hook: LlDispatchHook) -> Result<LlDispatched> {
        self.take_hook(hook.op.call)?;
        let arena = self.ll_arena()?;
        let r = self.num_ranks();
        let out: Vec<Mutex<Option<ll::LlRecvOut>>> = (0..r).map(|_| Mutex::new(None)).collect();
        let phase =
            ll::dispatch_recv_phase(&arena, &hook.op, hook.rows, &hook.topk, self.mutation, &out);
        self.transport.run_phase(phase)?;
        let mut outputs = Vec::with_capacity(r);
        let mut routes = Vec::with_capacity(r);
        for (d, o) in out.iter().enumerate() {
            if hook.op.masked[d] {
                outputs.push(None);
                routes.push(None);
            } else {
                let (a, b) = take_slot(o, "ll-receiver")?;
                outputs.push(Some(a));
                routes.push(Some(b));
            }
        }
        Ok(LlDispatched { outputs, routes })
    }

    /// Low-latency dispatch without hook: send then receive.
    pub fn low_latency_dispatch(
        &mut self,
        inputs: &[RankInputs],
        params: &LlParams,
    ) -> Result<LlDispatched> {
        let hook = self.low_latency_dispatch_send(inputs, params)?;
        self.low_latency_dispatch_recv(hook)
    }

    /// Low-latency combine send half (docs/protocol.md §3.5): each expert rank reduces a token's
    /// local experts and sends one partial per (token, expert rank). `expert_out[d]` is `d`'s
    /// `[L][R·N, H]` outputs in its packed layout; with `zero_copy` they are first written into
    /// the operation's registered region (what the caller's GEMM does on the GPU) and read from
    /// there. `inputs` give each rank's `topk_idx`/`topk_weights`, which must equal its
    /// dispatch's (`x` is not read).
    pub fn low_latency_combine_send(
        &mut self,
        routes: &[Option<LlRoutes>],
        expert_out: &[Option<Vec<Tensor2<bf16>>>],
        inputs: &[RankInputs],
        zero_copy: bool,
    ) -> Result<LlCombineHook> {
        let r = self.num_ranks();
        for len in [routes.len(), expert_out.len(), inputs.len()] {
            if len != r {
                return Err(Error::RankCountMismatch {
                    expected: r,
                    found: len,
                });
            }
        }
        let mut layout = None;
        for s in (0..r).filter(|&s| !self.mask[s]) {
            let rt = routes[s].as_ref().ok_or(Error::ShapeMismatch {
                what: "low-latency combine routes",
                expected: format!("routes for unmasked rank {s}"),
                found: "None".into(),
            })?;
            if rt.topk_idx != inputs[s].topk_idx
                || rt
                    .topk_weights
                    .data()
                    .iter()
                    .map(|w| w.to_bits())
                    .ne(inputs[s].topk_weights.data().iter().map(|w| w.to_bits()))
            {
                return Err(Error::LowLatencyRoutingChanged { rank: s });
            }
            let y = expert_out[s].as_ref().ok_or(Error::ShapeMismatch {
                what: "low-latency combine expert outputs",
                expected: format!("outputs for unmasked rank {s}"),
                found: "None".into(),
            })?;
            let l_count = y.len();
            let (rows, h) = y.first().map_or((0, 0), Tensor2::shape);
            if l_count == 0 || rows % r != 0 || y.iter().any(|t| t.shape() != (rows, h)) {
                return Err(Error::ShapeMismatch {
                    what: "low-latency combine expert outputs",
                    expected: "[L][R*N, H] on every rank".into(),
                    found: format!(
                        "{:?} on rank {s}",
                        y.iter().map(Tensor2::shape).collect::<Vec<_>>()
                    ),
                });
            }
            let lay = LlLayout {
                num_ranks: r,
                num_local_experts: l_count,
                hidden: h,
                num_max_tokens: rows / r,
            };
            if layout.is_some_and(|l| l != lay) {
                return Err(Error::ShapeMismatch {
                    what: "low-latency combine expert outputs (must agree across ranks)",
                    expected: format!("{layout:?}"),
                    found: format!("{lay:?} on rank {s}"),
                });
            }
            layout = Some(lay);
        }
        self.ll_precheck()?;
        let arena = self.ll_arena()?;
        let layout = layout.unwrap_or(LlLayout {
            num_ranks: r,
            num_local_experts: 1,
            hidden: 128,
            num_max_tokens: 1,
        });
        let op = self.ll_op(layout, layout.num_local_experts * r)?;
        let zero_ranks: Vec<bool> = (0..r).map(|d| self.ll_mem[d] != LlMem::Used).collect();
        self.ll_used();
        let y = if zero_copy {
            let phase = ll::expert_output_phase(&arena, &op, expert_out);
            self.transport.run_phase(phase)?;
            ExpertOut::ZeroCopy
        } else {
            ExpertOut::Host(expert_out)
        };
        let mut phase = ll::combine_send_phase(&arena, &op, routes, y);
        for d in (0..r).filter(|&d| !op.masked[d] && zero_ranks[d]) {
            phase = phase.assume_zero(d, arena.signals.region);
        }
        self.transport.run_phase(phase)?;
        self.pending_hooks.push(op.call);
        Ok(LlCombineHook {
            topk: inputs.iter().map(|i| i.topk_idx.clone()).collect(),
            op,
        })
    }

    /// Low-latency combine receive half, the hook (docs/protocol.md §3.6): `out[s]` is `[T_s, H]`
    /// BF16, `None` for masked ranks.
    pub fn low_latency_combine_recv(
        &mut self,
        hook: LlCombineHook,
    ) -> Result<Vec<Option<Tensor2<bf16>>>> {
        self.take_hook(hook.op.call)?;
        let arena = self.ll_arena()?;
        let r = self.num_ranks();
        let out: Vec<Mutex<Option<Tensor2<bf16>>>> = (0..r).map(|_| Mutex::new(None)).collect();
        let phase = ll::combine_recv_phase(&arena, &hook.op, &hook.topk, &out);
        self.transport.run_phase(phase)?;
        (0..r)
            .map(|s| {
                if hook.op.masked[s] {
                    Ok(None)
                } else {
                    take_slot(&out[s], "ll-reducer").map(Some)
                }
            })
            .collect()
    }

    /// Low-latency combine without hook: send then receive.
    pub fn low_latency_combine(
        &mut self,
        routes: &[Option<LlRoutes>],
        expert_out: &[Option<Vec<Tensor2<bf16>>>],
        inputs: &[RankInputs],
        zero_copy: bool,
    ) -> Result<Vec<Option<Tensor2<bf16>>>> {
        let hook = self.low_latency_combine_send(routes, expert_out, inputs, zero_copy)?;
        self.low_latency_combine_recv(hook)
    }

    /// `clean_low_latency_buffer` (docs/protocol.md §3.7): zeroes every low-latency signal word
    /// of both halves on every unmasked rank, then a barrier. Refused while a hook is pending.
    pub fn clean_low_latency_buffer(&mut self) -> Result<()> {
        if let Some(&p) = self.pending_hooks.first() {
            return Err(Error::LowLatencyHookPending { pending_call: p });
        }
        let arena = self.ll_arena()?;
        let call = self.next_call();
        let mask = self.mask.clone();
        self.transport
            .run_phase(ll::clean_phase(&arena, call, &mask))?;
        let team = Team {
            ranks: (0..self.num_ranks()).filter(|&d| !mask[d]).collect(),
        };
        self.transport.barrier(&team)?;
        for d in team.ranks {
            self.ll_mem[d] = LlMem::Fresh;
        }
        Ok(())
    }

    /// Models another kernel using the low-latency memory (DeepEP: normal internode kernels on
    /// the RDMA buffer, spec case 20): garbage in every signal word. Test support only.
    #[doc(hidden)]
    pub fn debug_foreign_use_of_low_latency_memory(&mut self) -> Result<()> {
        let arena = self.ll_arena()?;
        let call = self.next_call();
        let garbage = crate::protocol::signal::ll_encode(call + 1_000, 7);
        self.transport
            .run_phase(ll::scribble_phase(&arena, call, garbage))?;
        self.ll_mem.iter_mut().for_each(|m| *m = LlMem::Dirty);
        Ok(())
    }

    fn check_shrink(&self) -> Result<()> {
        if self.config.enable_shrink {
            Ok(())
        } else {
            Err(Error::ShrinkNotEnabled)
        }
    }

    /// `low_latency_update_mask_buffer(rank, mask)` (spec §2.7), on every rank's view.
    pub fn update_mask(&mut self, rank: usize, mask: bool) -> Result<()> {
        self.check_shrink()?;
        let r = self.num_ranks();
        let m = self
            .mask
            .get_mut(rank)
            .ok_or(Error::RankOutOfRange { rank, num_ranks: r })?;
        *m = mask;
        Ok(())
    }

    /// `low_latency_query_mask_buffer` (spec §2.7): `1` for masked ranks.
    pub fn query_mask(&self) -> Result<Vec<i32>> {
        self.check_shrink()?;
        Ok(self.mask.iter().map(|&m| i32::from(m)).collect())
    }

    /// `low_latency_clean_mask_buffer` (spec §2.7).
    pub fn clean_mask(&mut self) -> Result<()> {
        self.check_shrink()?;
        self.mask.iter_mut().for_each(|m| *m = false);
        Ok(())
    }

    /// The masked ranks (`true` = masked).
    pub fn masked_ranks(&self) -> &[bool] {
        &self.mask
    }
}
