//! What the low-latency GPU tests share (`gpu_low_latency` on the group, `gpu_buffer_ll` through
//! the `Buffer`): a case and its workload with wide-range activations, the kernel variant
//! `EP_LL_VARIANT` names, and this process's one-PE NVSHMEM session for variant (b).

use std::sync::{Arc, OnceLock};

use ep_core::buffer::LlCombineOptions;
use ep_core::plan::low_latency::LlParams;
use ep_core::routing::{Activations, RankInputs};
use ep_core::tensor::Tensor2;
use ep_core::workload::{Routing, WorkloadSpec};
use ep_kernels::gpu::{LlConfig, LlDispatchArgs, LlVariant};
use ep_kernels::nvshmem::{Bootstrap, BringUp, NvshmemSession, SoloRendezvous, TcpRendezvous};
use half::bf16;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The low-latency tests' activations: BF16 from 2^-30 to 2^30 in magnitude, or signed zeros.
pub(crate) fn wide_tensor(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Tensor2<bf16> {
    Tensor2::from_fn(rows, cols, |_, _| super::wide_bf16_within(rng, 30))
}

#[derive(Clone, Debug)]
pub(crate) struct Case {
    pub(crate) ranks: usize,
    pub(crate) tokens: usize,
    pub(crate) max_tokens: usize,
    pub(crate) hidden: usize,
    pub(crate) topk: usize,
    pub(crate) experts: usize,
    pub(crate) fp8: Option<(bool, bool)>,
    pub(crate) masked_entries: usize,
    pub(crate) routing: Routing,
    pub(crate) sms: usize,
    pub(crate) hook: bool,
    pub(crate) zero_copy: bool,
    /// Combine with LogFMT-10 partials (`use_logfmt`).
    pub(crate) logfmt: bool,
    pub(crate) seed: u64,
}

impl Case {
    pub(crate) fn new(
        ranks: usize,
        tokens: usize,
        hidden: usize,
        topk: usize,
        experts: usize,
    ) -> Self {
        Self {
            ranks,
            tokens,
            max_tokens: tokens,
            hidden,
            topk,
            experts,
            fp8: None,
            masked_entries: tokens / 5,
            routing: Routing::Uniform,
            sms: 16,
            hook: false,
            zero_copy: false,
            logfmt: false,
            seed: 1,
        }
    }

    pub(crate) fn params(&self, masked: &[bool]) -> LlParams {
        let p = LlParams::new(self.max_tokens, self.experts);
        let p = match self.fp8 {
            Some((round, ue8m0)) => p.with_fp8(round, ue8m0),
            None => p,
        };
        if masked.iter().any(|&m| m) {
            p.with_masked_ranks(masked.to_vec())
        } else {
            p
        }
    }

    pub(crate) fn args(&self) -> LlDispatchArgs {
        LlDispatchArgs {
            use_fp8: self.fp8.is_some(),
            round_scale: self.fp8.is_some_and(|f| f.0),
            use_ue8m0: self.fp8.is_some_and(|f| f.1),
            return_recv_hook: self.hook,
        }
    }

    /// The `Buffer`'s combine options of this case.
    pub(crate) fn combine_options(&self) -> LlCombineOptions {
        LlCombineOptions {
            zero_copy: self.zero_copy,
            use_logfmt: self.logfmt,
        }
    }

    pub(crate) fn config(&self) -> LlConfig {
        LlConfig {
            num_ranks: self.ranks,
            num_max_dispatch_tokens_per_rank: self.max_tokens,
            hidden: self.hidden,
            num_experts: self.experts,
            num_sms: self.sms,
        }
    }
}

pub(crate) fn inputs_of(case: &Case) -> Vec<RankInputs> {
    let mut spec = WorkloadSpec::new(
        case.ranks,
        case.tokens,
        case.hidden,
        case.topk,
        case.experts,
        case.seed,
    );
    spec.masked_per_rank = case.masked_entries.min(case.tokens * case.topk);
    spec.routing = case.routing;
    let mut inputs = spec.generate().expect("workload");
    let mut rng = ChaCha8Rng::seed_from_u64(case.seed ^ 0x11);
    for inp in &mut inputs {
        inp.x = Activations::Bf16(wide_tensor(&mut rng, case.tokens, case.hidden));
    }
    inputs
}

/// `EP_LL_VARIANT`: `pointers` (default, variant (a)) or `nvshmem` (variant (b)).
pub(crate) fn variant() -> LlVariant {
    match std::env::var("EP_LL_VARIANT").as_deref() {
        Ok("nvshmem") => LlVariant::Nvshmem,
        Ok("pointers") | Err(_) => LlVariant::Pointers,
        Ok(other) => panic!("EP_LL_VARIANT={other}: use pointers or nvshmem"),
    }
}

/// A rank process's NVSHMEM session (`common::procs::spawn_or_run`): PE `rank` of `world`, the
/// unique id over the launcher's loopback rendezvous, on this process's GPU.
pub(crate) fn rank_session(rank: u32, world: u32) -> ep_kernels::Result<Arc<NvshmemSession>> {
    let rdv = TcpRendezvous::from_env()?;
    let s = BringUp::new(rank, world, Bootstrap::UniqueId(&rdv))
        .device(super::procs::my_ordinal())
        .init()?;
    Ok(Arc::new(s))
}

/// This process's one-PE NVSHMEM session (NVSHMEM initialises once per process).
pub(crate) fn session() -> Arc<NvshmemSession> {
    static S: OnceLock<Arc<NvshmemSession>> = OnceLock::new();
    S.get_or_init(|| {
        let s = BringUp::new(0, 1, Bootstrap::UniqueId(&SoloRendezvous))
            .device(0)
            .init()
            .expect("NVSHMEM with one PE (variant (b) needs NVSHMEM: EP_TEST_NVSHMEM_LIB or NVSHMEM_HOME)");
        eprintln!("{}", s.report());
        Arc::new(s)
    })
    .clone()
}
