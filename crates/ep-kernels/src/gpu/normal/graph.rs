//! CUDA graphs of normal-mode calls ([`NormalGroup::capture`], [`NormalGraph::replay`]) and
//! calls ordered against the caller's streams ([`NormalGroup::with_streams`]), docs/protocol.md
//! §2.7.
//!
//! **Why a replay counts calls right.** A captured kernel's arguments are frozen, so it cannot
//! carry its call number `k` by value: captured kernels get `call = 0` and each block takes
//! `k = epoch[block] + 1` from its rank's device epoch words and stores `k` back (eager kernels
//! store the `k` they were given). Every dispatch and combine kernel of a group has the same `2C`
//! blocks, each block the only reader and writer of its word, and kernels of one rank run in
//! stream order, so the words advance once per call, eager or replayed, and eager calls and
//! replays mix freely. The host adds the graph's call count to its counter at each replay, so
//! it always knows the epoch (error records, `last_call`).
//!
//! **One graph per local rank** (`gpu/graph.rs`, shared with low-latency mode): each rank's
//! calls are captured from its own stream into its own graph and replayed on its own stream.

use std::collections::HashSet;
use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaEvent, CudaGraph, CudaStream};

use super::{GpuHandle, LastDispatch, NormalGroup, check_rank_count};
use crate::error::{Error, Result};
use crate::gpu::graph::{capture_streams, launch_graphs, not_capturable};
use crate::gpu::mem::DevBuf;
use crate::gpu::tensor::{DType, DevTensor};

pub(super) use crate::gpu::graph::next_group_id;

/// What a capture in progress collects.
#[derive(Debug, Default)]
pub(super) struct Capture {
    /// Every buffer a captured kernel or copy addresses that the group does not own: inputs,
    /// outputs, replaced meta buffers. The graph holds them, so no replay reads freed memory.
    pub(super) keep: Vec<Arc<DevBuf>>,
}

/// A sequence of normal-mode calls captured by [`NormalGroup::capture`]: one executable CUDA
/// graph per local rank, the buffers its kernels address, and what the capture's closure
/// returned (the calls' outputs, rewritten by every replay).
///
/// Replays read the input tensors the calls were given at capture time, wherever they are: write
/// fresh values into them (e.g. [`DevTensor::write`]) while no replay or call is in flight, not
/// into new tensors. Dropping it frees those buffers: drop it once its replays' work is done
/// (after a [`NormalGroup::sync`]). Not `Send` (cudarc's graph handles are not).
pub struct NormalGraph<T> {
    /// Local rank `i`'s graph (dropped before the buffers it addresses).
    execs: Vec<CudaGraph>,
    outputs: T,
    /// Buffers the graphs address, alive as long as they are.
    keep: Vec<Arc<DevBuf>>,
    /// Dispatches and combines per replay (what the host's call counter advances by).
    calls: u64,
    /// The row format the arenas hold after a replay (what a following eager combine needs).
    last: Option<LastDispatch>,
    /// The group it was captured from.
    group: u64,
}

impl<T: std::fmt::Debug> std::fmt::Debug for NormalGraph<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NormalGraph")
            .field("ranks", &self.execs.len())
            .field("calls", &self.calls)
            .field("buffers", &self.keep.len())
            .field("outputs", &self.outputs)
            .finish()
    }
}

impl<T> NormalGraph<T> {
    /// What the capture's closure returned: the outputs every replay rewrites (valid once the
    /// replay's work is done, e.g. after [`NormalGroup::sync`]).
    pub fn outputs(&self) -> &T {
        &self.outputs
    }

    /// Dispatches and combines in one replay (the call numbers a replay takes).
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Enqueues the captured calls once more on every local rank's current stream (the group's,
    /// or the caller's inside [`NormalGroup::with_streams`]), taking the next call numbers as
    /// eager calls would: every process replays its graph (or makes the same calls eagerly) in
    /// the same order. No host sync; errors surface like those of eager calls.
    pub fn replay(&self, g: &mut NormalGroup) -> Result<()> {
        if g.id != self.group {
            return Err(Error::Unsupported(
                "this graph was captured from another NormalGroup: replay it on that group".into(),
            ));
        }
        g.not_capturing("a graph replay")?;
        g.check_ready()?;
        g.dev
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // The graphs were captured from this group (ids checked): their kernels address its
        // arenas, epoch words and error record, alive while it is, and buffers in `self.keep`.
        if let Err((i, e)) = launch_graphs(&self.execs, g.ranks.iter().map(|r| &r.stream)) {
            if i > 0 {
                // Ranks already launched wait for this one: they will time out.
                g.poison = Some(format!("graph launch of local rank {i} failed: {e}"));
            }
            return Err(e);
        }
        g.call += self.calls;
        if self.last.is_some() {
            g.last = self.last;
        }
        Ok(())
    }
}

/// How the calls inside [`NormalGroup::with_streams`] are ordered against the caller's work
/// (DeepEP's `previous_event`, `async_finish`, `allocate_on_comm_stream`).
#[derive(Clone, Copy, Debug, Default)]
pub struct CallStreams<'a> {
    /// DeepEP's `previous_event`: every local rank's stream waits for each of these events
    /// (recorded by the caller, of the group's context) before the calls' work.
    pub after: &'a [&'a CudaEvent],
    /// Run the calls on these streams instead of the group's communication streams: one per
    /// local rank, distinct (co-resident ranks wait on each other), of the group's context.
    /// Rank `i`'s stream first waits for the rank's earlier work, and the rank's own stream
    /// waits for it afterwards, so the rank's calls stay in one order. Per-call outputs are then
    /// stream-ordered memory of the caller's stream (DeepEP's `allocate_on_comm_stream = false`).
    pub streams: Option<&'a [Arc<CudaStream>]>,
    /// DeepEP's `async_finish`: return one event per local rank, recorded after the calls' work
    /// on the stream that ran it; the caller's streams wait on them before using the outputs.
    pub record: bool,
}

impl NormalGroup {
    /// Records the calls `f` makes (layout, worst-token dispatch, cached dispatch, combine,
    /// `write_combine_rows`) as one CUDA graph per local rank, without running them, and returns
    /// them with `f`'s result (see [`NormalGraph`]). Nothing that needs the host mid-sequence can
    /// be captured: a dispatch without `num_worst_tokens`, `sync`, `reset`, `timed`, ... are
    /// [`Error::NotCapturable`]. An error ends every rank's capture and drops the graphs; the
    /// group's call counter and state are as before the capture either way.
    ///
    /// The calls allocate their outputs at capture time (plain allocations the graph owns, never
    /// per replay); every buffer a captured call addresses is held by the graph.
    pub fn capture<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<NormalGraph<T>> {
        self.not_capturing("a capture")?;
        if self.swapped {
            return Err(Error::NotCapturable {
                what: "a capture inside with_streams".into(),
                fix: "capture on the group's streams and replay inside with_streams".into(),
            });
        }
        self.check_ready()?;
        let (call0, last0) = (self.call, self.last);
        let streams: Vec<_> = self.ranks.iter().map(|r| r.stream.clone()).collect();
        let captured = capture_streams(&streams, || {
            self.capture = Some(Capture::default());
            f(self)
        });
        let cap = self.capture.take().unwrap_or_default();
        let (calls, last) = (self.call - call0, self.last);
        (self.call, self.last) = (call0, last0);
        let outputs = captured.0?;
        let execs = captured.1?;
        let mut keep = cap.keep;
        if let Some(p) = &self.phase_times {
            keep.extend(p.iter().map(|t| t.buffer().clone()));
        }
        let mut seen = HashSet::new();
        keep.retain(|b| seen.insert(Arc::as_ptr(b)));
        Ok(NormalGraph {
            execs,
            outputs,
            keep,
            calls,
            last,
            group: self.id,
        })
    }

    /// Runs `f`, whose calls are ordered against the caller's work as `order` says (see
    /// [`CallStreams`]), and returns its result with the `record`ed events (empty unless asked).
    ///
    /// Lifetime rule: the calls' work is asynchronous. The inputs given to the calls must stay
    /// alive and unchanged, and their outputs must be neither read nor dropped by another
    /// stream, until that stream has waited for the returned event (or the rank's stream has
    /// passed the work): a per-call output dropped on the host is freed in the order of the
    /// stream that allocated it, not of the streams still reading it.
    pub fn with_streams<T>(
        &mut self,
        order: &CallStreams<'_>,
        f: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<(T, Vec<CudaEvent>)> {
        self.not_capturing("with_streams")?;
        if self.swapped {
            return Err(Error::Unsupported(
                "with_streams inside with_streams: give all the options to one".into(),
            ));
        }
        let ctx = self.dev.context().clone();
        if order.after.iter().any(|e| e.context() != &ctx) {
            return Err(Error::Unsupported(
                "an event of another CUDA context: record it on a stream of the group's device"
                    .into(),
            ));
        }
        let no_timing = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let mut saved = Vec::new();
        if let Some(streams) = order.streams {
            check_rank_count(self.num_local_ranks(), streams.len())?;
            for (i, s) in streams.iter().enumerate() {
                if s.context() != &ctx {
                    return Err(Error::Unsupported(format!(
                        "the stream for local rank {i} is of another CUDA context: create it on the group's device"
                    )));
                }
                let shared = streams[..i]
                    .iter()
                    .map(|o| o.cu_stream())
                    .chain(
                        self.ranks
                            .iter()
                            .enumerate()
                            .filter(|&(j, _)| j != i)
                            .map(|(_, r)| r.stream.cu_stream()),
                    )
                    .any(|o| o == s.cu_stream());
                if shared {
                    return Err(Error::Unsupported(format!(
                        "the stream for local rank {i} is another local rank's: co-resident ranks wait on each other and need a stream each"
                    )));
                }
            }
            for (r, s) in self.ranks.iter().zip(streams) {
                let ev = r
                    .stream
                    .record_event(no_timing)
                    .map_err(Error::cuda("cuEventRecord"))?;
                s.wait(&ev).map_err(Error::cuda("cuStreamWaitEvent"))?;
            }
            for (r, s) in self.ranks.iter_mut().zip(streams) {
                saved.push(std::mem::replace(&mut r.stream, s.clone()));
            }
            self.swapped = true;
        }
        let mut out = Ok(());
        'wait: for r in &self.ranks {
            for e in order.after {
                if let Err(source) = r.stream.wait(e) {
                    out = Err(Error::Cuda {
                        op: "cuStreamWaitEvent",
                        source,
                    });
                    break 'wait;
                }
            }
        }
        let out = out.and_then(|()| f(self));
        let mut events = Vec::new();
        let mut finish = Ok(());
        if order.record && out.is_ok() {
            for r in &self.ranks {
                match r.stream.record_event(no_timing) {
                    Ok(e) => events.push(e),
                    Err(source) => {
                        finish = Err(Error::Cuda {
                            op: "cuEventRecord",
                            source,
                        });
                        break;
                    }
                }
            }
        }
        // Back to the group's streams, each after its caller stream's work (always: a later
        // call must not overlap this one on the rank).
        if self.swapped {
            for (r, own) in self.ranks.iter_mut().zip(saved) {
                let joined = r
                    .stream
                    .record_event(no_timing)
                    .and_then(|ev| own.wait(&ev));
                if let Err(source) = joined {
                    self.poison = Some(format!(
                        "the group's stream could not be ordered after the caller's: {source}"
                    ));
                    if finish.is_ok() {
                        finish = Err(Error::Cuda {
                            op: "cuStreamWaitEvent",
                            source,
                        });
                    }
                }
                r.stream = own;
            }
            self.swapped = false;
        }
        let out = out?;
        finish?;
        Ok((out, events))
    }

    /// `Err(NotCapturable)` while a capture is recording.
    pub(super) fn not_capturing(&self, what: &str) -> Result<()> {
        if self.capture.is_none() {
            return Ok(());
        }
        Err(not_capturable(what))
    }

    /// A per-call output of local rank `rank`: stream-ordered memory of its stream, or, while
    /// capturing, a plain allocation the graph owns (a stream-ordered one would become a graph
    /// allocation node, which forbids a relaunch until it is freed).
    pub(super) fn alloc(
        &mut self,
        rank: usize,
        dtype: DType,
        rows: usize,
        cols: usize,
    ) -> Result<DevTensor> {
        match &mut self.capture {
            None => DevTensor::on_stream(&self.dev, &self.ranks[rank].stream, dtype, rows, cols),
            Some(cap) => {
                let t = DevTensor::empty(self.dev.context(), dtype, rows, cols)?;
                cap.keep.push(t.buffer().clone());
                Ok(t)
            }
        }
    }

    /// While capturing: the graph holds `t`'s buffer.
    pub(super) fn keep(&mut self, t: Option<&DevTensor>) {
        if let (Some(cap), Some(t)) = (&mut self.capture, t) {
            cap.keep.push(t.buffer().clone());
        }
    }

    /// While capturing: the graph holds the handle's tensors.
    pub(super) fn keep_handle(&mut self, h: &GpuHandle) {
        for t in [
            &h.rank_prefix_matrix,
            &h.channel_prefix_matrix,
            &h.recv_channel_prefix_matrix,
            &h.send_head,
            &h.is_token_in_rank,
        ] {
            self.keep(Some(t));
        }
    }

    /// Test support: every local rank's device epoch words (one per block of a dispatch or
    /// combine, `2C`), after a [`NormalGroup::sync`]. Each equals [`NormalGroup::last_call`]
    /// when eager calls and replays kept count.
    #[doc(hidden)]
    pub fn epochs_for_test(&mut self) -> Result<Vec<Vec<u64>>> {
        self.sync()?;
        let words = 2 * self.num_channels();
        self.ranks
            .iter()
            .map(|r| {
                let mut b = vec![0u8; 8 * words];
                r.epoch.read(0, &mut b)?;
                Ok(b.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect())
            })
            .collect()
    }
}
