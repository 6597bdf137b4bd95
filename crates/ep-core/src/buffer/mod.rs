//! `Buffer`: DeepEP's `deep_ep.Buffer` (spec §1) over any [`Executor`], driving the protocol's
//! phases (docs/protocol.md).
//!
//! Each call takes the inputs of the executor's local ranks ([`Executor::local_ranks`]) and
//! returns their outputs, in that order. On the simulator every rank is local, so a call handles
//! every rank's inputs and returns every rank's outputs (`Vec` indexed by rank); a process that
//! drives one rank passes one-element slices.
//!
//! The `Buffer` runs the host logic that reads no tensor contents, once for every backend (the
//! shape-level checks of `check`, sizing, the call and low-latency operation counters, hooks,
//! poisoning and reset, the shrink-mode mask); the executor runs the per-token checks and the
//! phases (`crate::executor`).
//!
//! | DeepEP | ep-rs |
//! |---|---|
//! | `Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, ...)` | [`Buffer::new`] with a [`BufferConfig`] |
//! | `get_dispatch_layout` | [`Buffer::get_dispatch_layout`] |
//! | `dispatch(x, num_tokens_per_rank=..., topk_idx=..., ...)` | [`Buffer::dispatch`] |
//! | `dispatch(x, handle=...)` | [`Buffer::dispatch_cached`] |
//! | `combine(x, handle, topk_weights, bias)` | [`Buffer::combine`] |
//! | (GPU: `recv_x` is a view of the arena; combine of it reads it in place) | [`Buffer::dispatch_in_place`], [`Buffer::read_recv_x`], [`Buffer::write_expert_x`], [`Buffer::combine_in_place`] |
//! | `low_latency_dispatch(..., return_recv_hook)` | [`Buffer::low_latency_dispatch`] / [`Buffer::low_latency_dispatch_send`] + [`Buffer::low_latency_dispatch_recv`] |
//! | `low_latency_combine(..., use_logfmt, zero_copy, return_recv_hook)` | [`Buffer::low_latency_combine`] / `_send` + `_recv`, with [`LlCombineOptions`] `{ zero_copy, use_logfmt }` |
//! | `clean_low_latency_buffer` | [`Buffer::clean_low_latency_buffer`] |
//! | `low_latency_update_mask_buffer` / `query` / `clean` | [`Buffer::update_mask`] / [`Buffer::query_mask`] / [`Buffer::clean_mask`] |
//! | `get_low_latency_rdma_size_hint` | [`Buffer::low_latency_size_hint`] |
//!
//! Differences, each documented in docs/protocol.md: low-latency dispatch takes the top-k
//! weights (they travel with dispatch; combine checks it gets the same), and reduces partial sums
//! on the expert's rank (numerics §5).
//!
//! Faults (docs/protocol.md §7): a call whose phase fails returns the error and leaves the
//! `Buffer` poisoned — every later call returns [`Error::BufferPoisoned`] — until the collective
//! [`Buffer::reset`]. In low-latency shrink mode a silent or failed peer is masked instead and the
//! call returns the plan's result with that rank masked ([`Buffer::query_mask`] reports it).
//!
//! Files: this one holds the struct, its constructor and accessors; `check` the shape-level
//! checks every backend runs (the GPU groups too); `normal` the normal-mode
//! calls; `one` the same calls of a process that drives one rank; `in_place` the normal calls
//! whose rows stay in the arena; `low_latency` the
//! low-latency calls and hooks; `mask` the shrink-mode mask and how a
//! failed peer gets masked; `fault` poisoning and reset. The phases themselves, and the
//! per-token checks, are the executor's (`crate::executor`).

pub mod check;
mod fault;
mod in_place;
mod low_latency;
mod mask;
mod normal;
mod one;

use crate::config::{BufferConfig, Config};
use crate::error::{Error, Result};
use crate::executor::Executor;
use crate::protocol::ProtocolMutation;
use crate::protocol::layout::{
    LlLayout, NormalCtrl, NormalData, REGION_ALIGN, RowFormat, align128, ll_signal_bytes,
};
use crate::protocol::low_latency::LlArena;
use crate::protocol::normal::NormalArena;

pub use crate::plan::intranode::InPlaceDispatch;
pub use crate::protocol::normal::Expert;
pub use low_latency::{LlCombineHook, LlCombineOptions, LlDispatchHook, LlDispatched};

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

/// DeepEP's `Buffer` over an [`Executor`] (module docs).
pub struct Buffer<E: Executor> {
    transport: E,
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
    /// Set by a failed phase, cleared by [`Buffer::reset`].
    poison: Option<fault::Poison>,
    /// What the last in-place dispatch left in the arena (docs/protocol.md §2.6).
    in_place: Option<in_place::InPlaceRows>,
}

impl<E: Executor> std::fmt::Debug for Buffer<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("config", &self.config)
            .field("last_call", &self.last_call)
            .field("ll_ops", &self.ll_ops)
            .field("pending_hooks", &self.pending_hooks)
            .field("poison", &self.poison)
            .finish_non_exhaustive()
    }
}

impl<E: Executor> Buffer<E> {
    /// Validates `config` (DeepEP's constructor checks) and allocates the arenas collectively:
    /// normal mode when `num_nvl_bytes > 0`, low-latency when `low_latency_mode` and
    /// `num_rdma_bytes > 0` (docs/protocol.md §2.1, §3.1).
    pub fn new(mut transport: E, config: BufferConfig) -> Result<Self> {
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
            normal = Some(transport.alloc_normal(ctrl_bytes, config.num_nvl_bytes - ctrl_bytes)?);
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
            ll = Some(transport.alloc_low_latency(sig, config.num_rdma_bytes - sig)?);
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
            poison: None,
            in_place: None,
        })
    }

    /// The executor (its transport face: fabric, memory, statistics).
    pub fn transport(&self) -> &E {
        &self.transport
    }

    /// The executor, mutably (e.g. to read simulator statistics).
    pub fn transport_mut(&mut self) -> &mut E {
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

    /// `Err(RankCountMismatch)` unless every length in `lens` is the number of local ranks (the
    /// per-rank slices a call takes).
    fn check_local(&self, lens: &[usize]) -> Result<()> {
        let n = self.transport.local_ranks().len();
        match lens.iter().find(|&&len| len != n) {
            Some(&found) => Err(Error::RankCountMismatch { expected: n, found }),
            None => Ok(()),
        }
    }

    /// The number of the last call made (calls number from 1; both modes share the counter).
    pub fn last_call(&self) -> u64 {
        self.last_call
    }

    /// Plants a bug in the protocol's agents (mutation suite); with the `test-support` feature.
    #[cfg(feature = "test-support")]
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
}
