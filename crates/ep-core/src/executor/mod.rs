//! The executor of a [`Buffer`](crate::Buffer)'s phases (docs/buffer-api.md, step 2): the
//! per-token half of every call, below the host logic the `Buffer` runs once for every backend
//! (validation of shapes, sizing, call and low-latency operation counters, hooks, poisoning and
//! reset, the shrink-mode mask).
//!
//! Each call has up to two entry points: `check_*` (`&self`, no side effect: the per-token
//! input checks — expert ids, layouts equal to the routing — whose error leaves the `Buffer`
//! usable) and `run_*` (`&mut self`: the phase itself, under the call number the `Buffer` took
//! between the two; its error poisons the `Buffer`, while a rank whose agent finished without
//! its outputs, after a phase that succeeded, is an error of that rank's entry, returned as
//! is). A low-latency `run_*` is one attempt ([`LlAttempt`]); the `Buffer` decides whether a
//! peer is masked and the phase runs again.
//!
//! - [`jobs`]: what each phase is handed;
//! - `agents`: the simulator's executor, for every [`RunsAgents`] transport: it builds the
//!   protocol's agents (`protocol::normal`, `protocol::low_latency`, `protocol::reset`) and runs
//!   them with [`Transport::run_phase`].
//!
//! The inputs and outputs are those of the executor's local ranks ([`Executor::local_ranks`]),
//! in that order. A [`RunsAgents`] executor holds every rank, so there they are indexed by rank.

pub mod jobs;

mod agents;

pub use jobs::{
    CachedDispatchJob, ExpertJob, LlAttempt, LlCleanJob, LlCombineCheck, LlCombineRecvJob,
    LlCombineSendJob, LlDispatchRecvJob, LlDispatchSendJob, LlExpertOutputJob, LlRecvOut,
    NormalCombineCheck, NormalCombineJob, NormalDispatchCheck, NormalDispatchJob, NormalDispatched,
    ResetJob,
};

use half::bf16;

use crate::error::Result;
use crate::plan::combine::CombineOutput;
use crate::plan::low_latency::{LlDispatchOutput, LlParams};
use crate::routing::{Activations, RankInputs};
use crate::tensor::Tensor2;
use crate::transport::Transport;

/// A transport that executes every phase as the protocol's agents over
/// [`Transport::run_phase`], with every rank local: the simulators (`ep_sim::Sim`,
/// `ep_sim::ThreadSim`) and test transports. Implementing it gives the [`Executor`] of this
/// module; a backend that runs kernels instead implements [`Executor`] itself (a marker rather
/// than a blanket impl over every [`Transport`], so that the two cannot conflict).
pub trait RunsAgents: Transport {}

/// The executor of phases, implemented by every backend (module docs). Its methods are called
/// by [`Buffer`](crate::Buffer) only, after its own checks.
pub trait Executor: Transport {
    /// The ranks whose inputs and outputs this process handles, ascending.
    fn local_ranks(&self) -> Vec<usize>;

    /// The per-token checks of a normal dispatch; returns the most rows any local rank
    /// receives when the executor knows it before the phase (`None`: the phase checks the
    /// arena's capacity itself).
    fn check_normal_dispatch(&self, job: &NormalDispatchCheck<'_>) -> Result<Option<usize>>;

    /// The normal dispatch phase (its error poisons the `Buffer`): per local rank its outputs
    /// but `recv_x`, and `recv_x` unless the rows stay in the arena (`in_place`), or the error
    /// of an agent that finished without them (returned as is).
    fn run_normal_dispatch(
        &mut self,
        job: &NormalDispatchJob<'_>,
    ) -> Result<Vec<Result<NormalDispatched>>>;

    /// The cached normal dispatch phase: per local rank its received rows, or the error of an
    /// agent that finished without them (as in [`Executor::run_normal_dispatch`]).
    fn run_cached_dispatch(
        &mut self,
        job: &CachedDispatchJob<'_>,
    ) -> Result<Vec<Result<Activations>>>;

    /// The per-token checks of a normal combine's handles.
    fn check_normal_combine(&self, job: &NormalCombineCheck<'_>) -> Result<()>;

    /// The normal combine phase: per local rank its combined outputs.
    fn run_normal_combine(&mut self, job: &NormalCombineJob<'_>) -> Result<Vec<CombineOutput>>;

    /// The expert phase over the in-place rows ([`Buffer::apply_expert`](crate::Buffer::apply_expert)).
    fn run_expert(&mut self, job: &ExpertJob<'_>) -> Result<()>;

    /// The per-token checks of a low-latency dispatch whose shapes the `Buffer` checked
    /// (`plan::low_latency::validate_dispatch_routing`: expert ids in range, at most `N`
    /// entries of a rank to one expert).
    fn check_ll_dispatch(&self, inputs: &[RankInputs], params: &LlParams) -> Result<()>;

    /// One attempt of the low-latency dispatch send half.
    fn run_ll_dispatch_send(&mut self, job: &LlDispatchSendJob<'_>) -> LlAttempt<()>;

    /// One attempt of the low-latency dispatch receive half. `spare[d]`: earlier outputs of
    /// rank `d` whose arrays the attempt may reuse; what it did not take stays there.
    fn run_ll_dispatch_recv(
        &mut self,
        job: &LlDispatchRecvJob<'_>,
        spare: &mut [Option<LlDispatchOutput>],
    ) -> LlAttempt<LlRecvOut>;

    /// One attempt of writing zero-copy expert outputs into the operation's region.
    fn run_ll_expert_output(&mut self, job: &LlExpertOutputJob<'_>) -> LlAttempt<()>;

    /// The per-token checks of a low-latency combine.
    fn check_ll_combine(&self, job: &LlCombineCheck<'_>) -> Result<()>;

    /// One attempt of the low-latency combine send half.
    fn run_ll_combine_send(&mut self, job: &LlCombineSendJob<'_>) -> LlAttempt<()>;

    /// One attempt of the low-latency combine receive half: per rank `[T, H]` BF16.
    fn run_ll_combine_recv(&mut self, job: &LlCombineRecvJob<'_>) -> LlAttempt<Tensor2<bf16>>;

    /// The clean phase of `clean_low_latency_buffer` (the `Buffer` runs the barrier after it).
    fn run_ll_clean(&mut self, job: &LlCleanJob<'_>) -> Result<()>;

    /// The zeroing phase of a collective reset (the `Buffer` runs the barrier after it).
    fn run_reset(&mut self, job: &ResetJob<'_>) -> Result<()>;

    /// Garbage of call `call` in every low-latency signal word of every rank: another kernel
    /// using that memory (spec case 20). With the `test-support` feature.
    #[cfg(feature = "test-support")]
    fn run_foreign_use_of_low_latency(&mut self, job: &jobs::LlForeignUseJob<'_>) -> Result<()>;
}
