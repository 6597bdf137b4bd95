//! Protocol traces of normal mode (docs/protocol.md §3.13; [`NormalGroup::set_trace`]): the
//! traced build of `cuda/normal.cu` records each block's arena events — a dispatch CTA is an
//! agent of its own, the combine's two CTAs of a cluster are merged into the one agent they are
//! (`gpu::trace::decode_clusters`) — for ep-sim's memory-model checker.

use ep_core::transport::device_trace::AgentEvents;
use ep_core::transport::{DeviceEvent, FenceScope, TraceRegion};

use super::NormalGroup;
use crate::error::Result;
use crate::gpu::abi::NormalArgs;
use crate::gpu::trace::{TraceBufs, decode_clusters, not_tracing};

/// CTAs per agent: a dispatch CTA publishes its half-channel alone (`done[s][c][h]`); the
/// combine's pair is a cluster of two (`barrier.cluster` in normal.cu).
const fn cluster(op: TracedOp) -> usize {
    match op {
        TracedOp::Dispatch => 1,
        TracedOp::Combine => 2,
    }
}

/// Which operation the last traced launch was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TracedOp {
    Dispatch,
    Combine,
}

/// The traced kernels' recording: one trace buffer per local rank, and which operation the
/// last traced launch was.
#[derive(Debug)]
pub(super) struct Tracing {
    bufs: TraceBufs,
    last: Option<TracedOp>,
}

impl Tracing {
    /// Points local rank `rank`'s launch at its trace (and the planted fence, when set).
    pub(super) fn apply(&self, rank: usize, a: &mut NormalArgs) {
        let (trace, flags) = self.bufs.args(rank);
        a.trace = trace;
        a.flags |= flags;
    }
}

impl NormalGroup {
    /// Protocol traces (docs/protocol.md §3.13): with `Some(capacity)` every following dispatch,
    /// cached dispatch and combine runs the traced kernels (`EP_TRACE`), each block of each local
    /// rank recording up to `capacity` events (its arena stores and loads, fences, releases,
    /// acquires, the combine's cluster barriers); [`NormalGroup::trace`] returns the last operation's, for
    /// ep-sim's memory-model checker (`ep_sim::device_trace`). `None` turns it off. For debugging
    /// and tests: each traced operation waits for the previous one. Only the arenas are traced
    /// (not the handle tensors, the host-mapped mailbox or the layout kernel).
    pub fn set_trace(&mut self, capacity: Option<u64>) -> Result<()> {
        self.not_capturing("set_trace")?;
        self.sync_streams()?;
        let Some(capacity) = capacity else {
            self.tracing = None;
            return Ok(());
        };
        self.tracing = Some(Tracing {
            bufs: TraceBufs::new(
                self.dev.context(),
                self.ranks.len(),
                2 * self.num_channels(),
                capacity,
            )?,
            last: None,
        });
        Ok(())
    }

    /// Test switch of the traced kernels (docs/protocol.md §6): the second CTA of every dispatch
    /// channel skips its fence before its `done` release — a planted missing fence the trace
    /// checker must report. [`Error::Unsupported`] unless tracing is on.
    #[doc(hidden)]
    pub fn plant_missing_fence_for_test(&mut self, on: bool) -> Result<()> {
        let t = self.tracing.as_mut().ok_or_else(|| {
            not_tracing("the planted missing fence exists only in the traced kernels")
        })?;
        t.bufs.plant(on);
        Ok(())
    }

    /// Bytes of one rank's `normal.ctrl` (the traces' signal region) and `normal.data` (their
    /// data region): the arenas the checker replays on.
    #[must_use]
    pub fn trace_arena_bytes(&self) -> (u64, u64) {
        (self.ranks[0].ctrl.len() as u64, self.data_bytes)
    }

    /// The protocol events the last traced operation recorded, one agent per dispatch CTA or
    /// combine cluster of every local rank (after waiting for it). A combine's trace starts, in each rank's first agent,
    /// with a store of the rank's whole `normal.data` and a system fence: what its stream wrote
    /// there before the launch (the expert outputs, the dispatch's records), which that agent's
    /// `y_ready` release publishes to the peers.
    /// [`Error::TraceOverflow`](crate::error::Error::TraceOverflow) when a block had more events
    /// than the capacity.
    pub fn trace(&mut self) -> Result<Vec<AgentEvents>> {
        self.not_capturing("trace")?;
        self.sync_streams()?;
        let t = self
            .tracing
            .as_ref()
            .ok_or_else(|| not_tracing("no trace"))?;
        let mut all = Vec::new();
        for (i, k) in self.ranks.iter().enumerate() {
            let op = t.last.unwrap_or(TracedOp::Dispatch);
            let mut agents = decode_clusters(k.world_rank, &t.bufs.read(i)?, cluster(op))?;
            if t.last == Some(TracedOp::Combine)
                && let Some(first) = agents.iter_mut().find(|a| a.agent == 0)
            {
                let before = [
                    DeviceEvent::Store {
                        rank: k.world_rank,
                        region: TraceRegion::Data,
                        offset: 0,
                        len: self.data_bytes,
                    },
                    DeviceEvent::Fence {
                        scope: FenceScope::System,
                    },
                ];
                first.events.splice(0..0, before);
            }
            all.extend(agents);
        }
        Ok(all)
    }

    /// Before a traced operation: the streams idle, empty trace headers.
    pub(super) fn begin_traced(&mut self, op: TracedOp) -> Result<()> {
        if self.tracing.is_none() {
            return Ok(());
        }
        self.not_capturing("a traced operation")?;
        self.sync_streams()?;
        if let Some(t) = &mut self.tracing {
            t.bufs.reset(self.ranks.iter().map(|k| k.world_rank))?;
            t.last = Some(op);
        }
        Ok(())
    }
}
