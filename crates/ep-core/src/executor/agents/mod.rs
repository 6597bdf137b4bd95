//! The simulator's [`Executor`]: every phase built from the protocol's agents and run with
//! [`Transport::run_phase`], for every [`RunsAgents`] transport (every rank local, so the jobs'
//! per-rank slices are indexed by rank). `normal` holds the normal-mode phases, `low_latency`
//! the low-latency ones; this file the trait's impl, which hands each call to them.
//!
//! [`Transport::run_phase`]: crate::transport::Transport::run_phase

mod low_latency;
mod normal;

use half::bf16;

use super::jobs::{
    CachedDispatchJob, ExpertJob, LlAttempt, LlCleanJob, LlCombineCheck, LlCombineRecvJob,
    LlCombineSendJob, LlDispatchRecvJob, LlDispatchSendJob, LlExpertOutputJob, LlRecvOut,
    NormalCombineCheck, NormalCombineJob, NormalDispatchCheck, NormalDispatchJob, NormalDispatched,
    ResetJob,
};
use super::tensors::Host;
use super::{Executor, RunsAgents};
use crate::error::Result;
use crate::plan::combine::CombineOutput;
use crate::plan::layout::{DispatchLayout, get_dispatch_layout_for_rank};
use crate::plan::low_latency::{LlDispatchOutput, LlParams, validate_dispatch_routing};
use crate::protocol::layout::REGION_ALIGN;
use crate::protocol::low_latency::LlArena;
use crate::protocol::normal::NormalArena;
use crate::protocol::reset::reset_phase;
use crate::routing::{Activations, ExpertIdx, RankInputs};
use crate::tensor::Tensor2;
use crate::transport::{AllocRequest, Init};

impl<T: RunsAgents> Executor for T {
    type T = Host;

    fn local_ranks(&self) -> Vec<usize> {
        (0..self.fabric().num_ranks).collect()
    }

    fn alloc_normal(&mut self, ctrl: u64, data: u64) -> Result<NormalArena> {
        let r = self.fabric().num_ranks;
        let ctrl = self.alloc(AllocRequest {
            name: "normal.ctrl".into(),
            bytes: ctrl,
            align: REGION_ALIGN,
            init: Init::Zero,
        })?;
        let data = self.alloc(AllocRequest {
            name: "normal.data".into(),
            bytes: data,
            align: REGION_ALIGN,
            init: Init::Poison,
        })?;
        Ok(NormalArena {
            num_ranks: r,
            ctrl,
            data,
        })
    }

    fn alloc_low_latency(&mut self, signals: u64, data: u64) -> Result<LlArena> {
        let r = self.fabric().num_ranks;
        let signals = self.alloc(AllocRequest {
            name: "ll.signals".into(),
            bytes: signals,
            align: REGION_ALIGN,
            init: Init::Zero,
        })?;
        let data = self.alloc(AllocRequest {
            name: "ll.data".into(),
            bytes: data,
            align: REGION_ALIGN,
            init: Init::Poison,
        })?;
        Ok(LlArena {
            num_ranks: r,
            signals,
            data,
        })
    }

    fn run_layout(
        &mut self,
        topk_idx: &[Tensor2<ExpertIdx>],
        num_experts: usize,
    ) -> Result<Vec<DispatchLayout>> {
        let r = self.fabric().num_ranks;
        topk_idx
            .iter()
            .enumerate()
            .map(|(s, t)| get_dispatch_layout_for_rank(s, t, num_experts, r))
            .collect()
    }

    fn check_normal_dispatch(&self, job: &NormalDispatchCheck<'_>) -> Result<Option<usize>> {
        normal::check_dispatch(job).map(Some)
    }

    fn run_normal_dispatch(
        &mut self,
        job: &NormalDispatchJob<'_>,
    ) -> Result<Vec<Result<NormalDispatched>>> {
        normal::dispatch(self, job)
    }

    fn run_cached_dispatch(
        &mut self,
        job: &CachedDispatchJob<'_>,
    ) -> Result<Vec<Result<Activations>>> {
        normal::cached(self, job)
    }

    fn check_normal_combine(&self, job: &NormalCombineCheck<'_>) -> Result<()> {
        normal::check_combine(job)
    }

    fn run_normal_combine(&mut self, job: &NormalCombineJob<'_>) -> Result<Vec<CombineOutput>> {
        normal::combine(self, job)
    }

    fn run_expert(&mut self, job: &ExpertJob<'_>) -> Result<()> {
        normal::expert(self, job)
    }

    fn check_ll_dispatch(&self, inputs: &[RankInputs], params: &LlParams) -> Result<()> {
        validate_dispatch_routing(inputs, params)
    }

    fn run_ll_dispatch_send(&mut self, job: &LlDispatchSendJob<'_>) -> LlAttempt<()> {
        low_latency::dispatch_send(self, job)
    }

    fn run_ll_dispatch_recv(
        &mut self,
        job: &LlDispatchRecvJob<'_>,
        spare: &mut [Option<LlDispatchOutput>],
    ) -> LlAttempt<LlRecvOut> {
        low_latency::dispatch_recv(self, job, spare)
    }

    fn run_ll_expert_output(&mut self, job: &LlExpertOutputJob<'_>) -> LlAttempt<()> {
        low_latency::expert_output(self, job)
    }

    fn check_ll_combine(&self, job: &LlCombineCheck<'_>) -> Result<()> {
        low_latency::check_combine(job)
    }

    fn run_ll_combine_send(&mut self, job: &LlCombineSendJob<'_>) -> LlAttempt<()> {
        low_latency::combine_send(self, job)
    }

    fn run_ll_combine_recv(&mut self, job: &LlCombineRecvJob<'_>) -> LlAttempt<Tensor2<bf16>> {
        low_latency::combine_recv(self, job)
    }

    fn run_ll_clean(&mut self, job: &LlCleanJob<'_>) -> Result<()> {
        low_latency::clean(self, job)
    }

    fn run_reset(&mut self, job: &ResetJob<'_>) -> Result<()> {
        self.run_phase(reset_phase(job.words, job.call, &job.team.ranks))
            .map(drop)
    }

    #[cfg(feature = "test-support")]
    fn run_foreign_use_of_low_latency(
        &mut self,
        job: &super::jobs::LlForeignUseJob<'_>,
    ) -> Result<()> {
        low_latency::foreign_use(self, job)
    }

    #[cfg(feature = "test-support")]
    fn run_poison_low_latency_data(
        &mut self,
        job: &super::jobs::LlPoisonDataJob<'_>,
    ) -> Result<()> {
        low_latency::poison_data(self, job)
    }
}
