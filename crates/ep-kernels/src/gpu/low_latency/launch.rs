//! How an [`LlGroup`](super::LlGroup) launches `cuda/low_latency.cu`'s kernels: the variant's
//! (and the traced build's) functions, the shared-memory carve-out of the dispatch's routing.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::{LlConfig, LlGroup, Peers, THREADS};
use crate::error::{Error, Result};
use crate::gpu::abi::{self, LlArgs};
use crate::gpu::device::LlKernels;

/// Where each shared-memory array of a kernel starts, and the bytes needed.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Smem {
    expert: u64,
    pos: u64,
    before: u64,
    tot: u64,
    dmask: u64,
    slot: u64,
    begin: u64,
    pub(super) bytes: u64,
}

impl Smem {
    /// The carve-out for `T` tokens with top-`K` (`cuda/low_latency.cu`, `SendSmem`).
    pub(super) fn new(cfg: &LlConfig, t: u64, k: u64) -> Self {
        let (e, r, l) = (
            cfg.num_experts as u64,
            cfg.num_ranks as u64,
            cfg.num_local_experts() as u64,
        );
        let mut at = 0u64;
        let mut take = |bytes: u64| {
            let off = at;
            at = (at + bytes).div_ceil(16) * 16;
            off
        };
        let mut s = Smem {
            expert: take(2 * t * k),
            pos: take(2 * t * k),
            before: take(4 * e),
            tot: take(4 * e),
            dmask: take(t),
            slot: take(2 * t * r),
            begin: take(4 * r * l),
            bytes: 0,
        };
        s.bytes = at;
        s
    }
}

fn launch_cfg(blocks: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem,
    }
}

impl LlGroup {
    /// The combine kernel of the flavour `args` asks for (EP_FLAG_LOGFMT).
    pub(super) fn combine_fn(&self, args: Option<&LlArgs>) -> &CudaFunction {
        match args {
            Some(a) if a.flags & abi::EP_FLAG_LOGFMT != 0 => &self.fns().combine_logfmt,
            _ => &self.fns().combine,
        }
    }

    pub(super) fn fns(&self) -> &LlKernels {
        if self.tracing.is_some() {
            return match &self.peers {
                Peers::Nvshmem(n) => n.traced.as_ref().map_or(&n.kernels, |t| &t.1),
                _ => &self.dev.ll_trace,
            };
        }
        match &self.peers {
            Peers::Pointers | Peers::PointersOverNvshmem(_) => &self.dev.ll,
            Peers::Nvshmem(n) => &n.kernels,
        }
    }

    pub(super) fn launch(&self, i: usize, f: &CudaFunction, args: &LlArgs) -> Result<()> {
        let rank = self.ranks[i].rank;
        if self.absent == Some(rank) || self.mask[rank] {
            return Ok(());
        }
        let mut measured;
        let args = match &self.phase_times {
            Some(bufs) => {
                measured = *args;
                measured.phase_times = bufs[i].ptr();
                &measured
            }
            None => args,
        };
        let smem = Smem::new(&self.cfg, args.num_tokens, args.num_topk.max(1));
        debug_assert!(smem.bytes as usize <= self.smem_limit);
        let mut b = self.ranks[i].stream.launch_builder(f);
        b.arg(args);
        // SAFETY: the kernel takes one `ep_ll_args` by value (generated from the same table as
        // `LlArgs`); every address in it is a live allocation of this group or a tensor whose
        // shape, dtype and device the caller of `launch` checked, kept alive by the caller until
        // the stream passes the kernel; the dynamic shared memory matches the offsets in `args`
        // and is within the function's limit (set in `new`).
        unsafe { b.launch(launch_cfg(self.cfg.num_sms as u32, smem.bytes as u32)) }
            .map(|_| ())
            .map_err(Error::cuda("cuLaunchKernel"))
    }

    pub(super) fn with_smem(&self, mut a: LlArgs) -> LlArgs {
        let s = Smem::new(&self.cfg, a.num_tokens, a.num_topk.max(1));
        a.sm_expert = s.expert;
        a.sm_pos = s.pos;
        a.sm_before = s.before;
        a.sm_tot = s.tot;
        a.sm_dmask = s.dmask;
        a.sm_slot = s.slot;
        a.sm_begin = s.begin;
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_arrays_do_not_overlap() {
        let cfg = LlConfig {
            num_ranks: 8,
            num_max_dispatch_tokens_per_rank: 1024,
            hidden: 7168,
            num_experts: 288,
            num_sms: 16,
        };
        let s = Smem::new(&cfg, 1000, 11);
        let spans = [
            (s.expert, 2 * 1000 * 11),
            (s.pos, 2 * 1000 * 11),
            (s.before, 4 * 288),
            (s.tot, 4 * 288),
            (s.dmask, 1000),
            (s.slot, 2 * 1000 * 8),
            (s.begin, 4 * 8 * 36),
        ];
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{spans:?}");
            assert_eq!(w[1].0 % 16, 0);
        }
        let last = spans[spans.len() - 1];
        assert!(last.0 + last.1 <= s.bytes);
    }
}
