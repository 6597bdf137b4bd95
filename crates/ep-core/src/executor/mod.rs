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
pub mod tensors;

mod agents;

pub use jobs::{
    CachedDispatchJob, ExpertJob, LlAttempt, LlCleanJob, LlCombineCheck, LlCombineRecvJob,
    LlCombineSendJob, LlDispatchRecvJob, LlDispatchSendJob, LlExpertOutputJob, LlOpView, LlRecvOut,
    LlRowFormat, NormalCombineCheck, NormalCombineJob, NormalDispatchCheck, NormalDispatchJob,
    NormalDispatched, ResetJob,
};
pub use jobs::{CombineFrom, InArenaRows};
pub use tensors::{CombineShapes, Host, Tensors};

use crate::error::Result;
use crate::plan::low_latency::LlParams;
use crate::protocol::low_latency::LlArena;
use crate::protocol::normal::NormalArena;
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
    /// The tensors its calls take and return ([`Host`] on the simulator).
    type T: Tensors;

    /// The ranks whose inputs and outputs this process handles, ascending.
    fn local_ranks(&self) -> Vec<usize>;

    /// Allocates every local rank's normal-mode arena (collective): `ctrl` bytes of control
    /// words, zeroed, then `data` bytes of data, poisoned (docs/protocol.md §2.1).
    fn alloc_normal(&mut self, ctrl: u64, data: u64) -> Result<NormalArena>;

    /// Allocates every local rank's low-latency buffer (collective): `signals` bytes of signal
    /// words, zeroed, then `data` bytes, poisoned (docs/protocol.md §3.1).
    fn alloc_low_latency(&mut self, signals: u64, data: u64) -> Result<LlArena>;

    /// Reports what earlier calls' work found since (a device error record) as a typed
    /// error; the host executors have nothing to report. Called before each call.
    fn poll(&mut self) -> Result<()> {
        Ok(())
    }

    /// Waits for the local ranks' outstanding work, then reports as [`Executor::poll`].
    fn sync(&mut self) -> Result<()> {
        self.poll()
    }

    /// `get_dispatch_layout` of every local rank (spec §1.7); the shapes were checked.
    fn run_layout(
        &mut self,
        topk_idx: &[<Self::T as Tensors>::Idx],
        num_experts: usize,
    ) -> Result<Vec<<Self::T as Tensors>::Layout>>;

    /// The per-token checks of a normal dispatch; returns the most rows any local rank
    /// receives when the executor knows it before the phase (`None`: the phase checks the
    /// arena's capacity itself).
    fn check_normal_dispatch(
        &self,
        job: &NormalDispatchCheck<'_, Self::T>,
    ) -> Result<Option<usize>>;

    /// The normal dispatch phase (its error poisons the `Buffer`): per local rank what the
    /// phase gave it, or the error of an agent that finished without it (returned as is).
    #[allow(clippy::type_complexity)]
    fn run_normal_dispatch(
        &mut self,
        job: &NormalDispatchJob<'_, Self::T>,
    ) -> Result<Vec<Result<<Self::T as Tensors>::Dispatched>>>;

    /// The cached normal dispatch phase: per local rank its received rows, or the error of an
    /// agent that finished without them (as in [`Executor::run_normal_dispatch`]).
    #[allow(clippy::type_complexity)]
    fn run_cached_dispatch(
        &mut self,
        job: &CachedDispatchJob<'_, Self::T>,
    ) -> Result<Vec<Result<<Self::T as Tensors>::Rows>>>;

    /// The per-token checks of a normal combine's handles.
    fn check_normal_combine(&self, job: &NormalCombineCheck<'_, Self::T>) -> Result<()>;

    /// The normal combine phase: per local rank its combined outputs.
    fn run_normal_combine(
        &mut self,
        job: &NormalCombineJob<'_, Self::T>,
    ) -> Result<Vec<<Self::T as Tensors>::Combined>>;

    /// The expert phase over the in-place rows ([`Buffer::apply_expert`](crate::Buffer::apply_expert)).
    fn run_expert(&mut self, job: &ExpertJob<'_>) -> Result<()>;

    /// The per-token checks of a low-latency dispatch whose shapes the `Buffer` checked
    /// (`plan::low_latency::validate_dispatch_routing`: expert ids in range, at most `N`
    /// entries of a rank to one expert), over the local ranks' inputs.
    fn check_ll_dispatch(
        &self,
        inputs: &[<Self::T as Tensors>::Inputs],
        params: &LlParams,
    ) -> Result<()>;

    /// One attempt of the low-latency dispatch send half.
    fn run_ll_dispatch_send(&mut self, job: &LlDispatchSendJob<'_, Self::T>) -> LlAttempt<()>;

    /// One attempt of the low-latency dispatch receive half. `spare[i]`: earlier outputs of
    /// local rank `i` whose arrays the attempt may reuse; what it did not take stays there.
    fn run_ll_dispatch_recv(
        &mut self,
        job: &LlDispatchRecvJob<'_, Self::T>,
        spare: &mut [Option<<Self::T as Tensors>::LlSpare>],
    ) -> LlAttempt<<Self::T as Tensors>::LlRecv>;

    /// One attempt of writing zero-copy expert outputs into the operation's region.
    fn run_ll_expert_output(&mut self, job: &LlExpertOutputJob<'_, Self::T>) -> LlAttempt<()>;

    /// The per-token checks of a low-latency combine.
    fn check_ll_combine(&self, job: &LlCombineCheck<'_, Self::T>) -> Result<()>;

    /// One attempt of the low-latency combine send half.
    fn run_ll_combine_send(&mut self, job: &LlCombineSendJob<'_, Self::T>) -> LlAttempt<()>;

    /// One attempt of the low-latency combine receive half: per local rank `[T, H]` BF16.
    fn run_ll_combine_recv(
        &mut self,
        job: &LlCombineRecvJob<'_, Self::T>,
    ) -> LlAttempt<<Self::T as Tensors>::LlCombined>;

    /// Ranks the executor's kernels masked on their own (shrink mode) since the last call of
    /// it, found by [`Executor::sync`]; the `Buffer` adopts them into its mask. The host
    /// executors report a lost peer in the attempt instead ([`LlAttempt::gave_up`]).
    fn take_masked_by_device(&mut self) -> Vec<usize> {
        Vec::new()
    }

    /// The clean phase of `clean_low_latency_buffer` (the `Buffer` runs the barrier after it).
    fn run_ll_clean(&mut self, job: &LlCleanJob<'_>) -> Result<()>;

    /// The zeroing phase of a collective reset (the `Buffer` runs the barrier after it).
    fn run_reset(&mut self, job: &ResetJob<'_>) -> Result<()>;

    /// Garbage of call `call` in every low-latency signal word of every rank: another kernel
    /// using that memory (spec case 20). With the `test-support` feature.
    /// (Defaults to a typed refusal, for executors that cannot plant it.)
    #[cfg(feature = "test-support")]
    fn run_foreign_use_of_low_latency(&mut self, job: &jobs::LlForeignUseJob<'_>) -> Result<()> {
        let _ = job;
        Err(crate::error::Error::Unsupported(
            "this executor cannot plant a foreign use of the low-latency memory".into(),
        ))
    }

    /// Poisons the low-latency data of the job's ranks ([`jobs::LlPoisonDataJob`]). With the
    /// `test-support` feature. (Defaults to a typed refusal, for executors that cannot.)
    #[cfg(feature = "test-support")]
    fn run_poison_low_latency_data(&mut self, job: &jobs::LlPoisonDataJob<'_>) -> Result<()> {
        let _ = job;
        Err(crate::error::Error::Unsupported(
            "this executor cannot poison the low-latency data".into(),
        ))
    }
}
