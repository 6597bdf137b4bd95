//! Protocol traces of an [`LlGroup`](super::LlGroup)'s kernels (docs/protocol.md §3.13).

use super::{LlGroup, Peers};
use crate::error::Result;
use crate::gpu::device::LlKernels;
use crate::gpu::trace::{TraceBufs, not_tracing};

impl LlGroup {
    /// Protocol traces (docs/protocol.md §3.13): with `Some(capacity)` every following
    /// operation runs the traced kernels (`EP_TRACE`), each block of each local rank recording up
    /// to `capacity` protocol events (stores, loads, fences, releases, acquires);
    /// [`LlGroup::trace`] returns the last operation's, for ep-sim's memory-model
    /// checker (`ep_sim::device_trace`). `None` turns it off. For debugging and tests: each traced
    /// operation waits for the previous one. Both variants (variant (b)'s traced build is linked
    /// at run time when tracing is first turned on).
    pub fn set_trace(&mut self, capacity: Option<u64>) -> Result<()> {
        self.not_capturing("set_trace")?;
        self.sync_streams()?;
        let Some(capacity) = capacity else {
            self.tracing = None;
            return Ok(());
        };
        if let Peers::Nvshmem(n) = &mut self.peers
            && n.traced.is_none()
        {
            // Variant (b)'s traced build, linked against the loaded NVSHMEM like the other.
            let linked = crate::nvshmem::device_link::link_ll_trace_module(&n.session)?;
            let kernels = LlKernels {
                dispatch: linked.dispatch().clone(),
                combine: linked.combine().clone(),
                combine_logfmt: linked.combine_logfmt().clone(),
            };
            n.traced = Some((linked, kernels));
        }
        self.tracing = Some(TraceBufs::new(
            self.dev.context(),
            self.ranks.len(),
            self.cfg.num_sms,
            capacity,
        )?);
        Ok(())
    }

    /// Test switch of traced kernels (docs/protocol.md §6): the send parts' blocks skip their
    /// fence before their signals — a planted missing fence, which the trace checker
    /// must report. [`Error::Unsupported`] unless tracing is on.
    #[doc(hidden)]
    pub fn plant_missing_fence_for_test(&mut self, on: bool) -> Result<()> {
        let t = self.tracing.as_mut().ok_or_else(|| {
            not_tracing("the planted missing fence exists only in the traced kernels")
        })?;
        t.plant(on);
        Ok(())
    }

    /// The protocol events the last traced operation recorded, every local rank's blocks (after
    /// waiting for it). [`Error::TraceOverflow`](crate::error::Error::TraceOverflow) when a block
    /// had more than the capacity.
    pub fn trace(&mut self) -> Result<Vec<ep_core::transport::device_trace::AgentEvents>> {
        self.not_capturing("trace")?;
        self.sync_streams()?;
        let t = self
            .tracing
            .as_ref()
            .ok_or_else(|| not_tracing("no trace"))?;
        let mut all = Vec::new();
        for (i, k) in self.ranks.iter().enumerate() {
            all.extend(crate::gpu::trace::decode(k.rank, &t.read(i)?)?);
        }
        Ok(all)
    }

    /// Empty trace headers for the next operation (the streams are idle).
    pub(super) fn reset_traces(&mut self) -> Result<()> {
        self.sync_streams()?;
        if let Some(t) = &self.tracing {
            t.reset(self.ranks.iter().map(|k| k.rank))?;
        }
        Ok(())
    }
}
