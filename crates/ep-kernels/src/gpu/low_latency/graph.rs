//! CUDA graphs of low-latency operations ([`LlGroup::capture`], [`LlGraph::replay`]),
//! docs/protocol.md §3.10.
//!
//! **Epochs.** A captured kernel's arguments are frozen, so captured launches get `call = 0` and
//! each block takes its call number from its rank's device epoch words (`ep_block_epoch`): the
//! word plus one for a launch with the send part (an operation starts), the word itself for a
//! receive-only launch (the hook continues its send part's operation). Eager launches store the
//! `k` they are given, so eager operations and replays mix; the host adds a graph's operation
//! count to its counters at each replay.
//!
//! **Halves.** Operation `m` uses half `m mod 2`, and the halves a captured kernel addresses
//! (its `half`, a combine's `disp_half`, the output views the capture returned) are frozen too.
//! They stay right because a graph replays only when the group's next operation has the parity
//! the capture started at ([`Error::GraphOutOfStep`] otherwise): a graph of an even number of
//! operations replays back to back, one of an odd number alternates with other work of an odd
//! number of operations (a dispatch graph with a combine graph, or eager calls). A captured
//! combine must use the handle of the operation just before it (at every replay the previous
//! operation's half holds its routing); when that operation precedes the capture, each replay
//! checks that the operation before it is again a dispatch of the same tokens.

use std::collections::HashSet;
use std::sync::Arc;

use cudarc::driver::CudaGraph;
use ep_core::protocol::layout::ll_half;

use super::{LlGroup, hook_pending};
use crate::error::{Error, Result};
use crate::gpu::graph::{capture_streams, launch_graphs, not_capturable};
use crate::gpu::mem::DevBuf;

/// What a capture in progress collects.
#[derive(Debug, Default)]
pub(super) struct LlCapture {
    /// The group's operation number when the capture began.
    pub(super) op0: u64,
    /// Buffers the captured kernels address that the group does not own (the inputs).
    pub(super) keep: Vec<Arc<DevBuf>>,
    /// Per rank, the tokens of the dispatch just before the capture that its first operation
    /// (a combine) reads.
    pub(super) prev: Option<Vec<usize>>,
}

/// A sequence of low-latency operations captured by [`LlGroup::capture`]: one executable CUDA
/// graph per launched rank, the buffers its kernels address, and what the capture's closure
/// returned (the operations' outputs: views of the group's per-half buffers, rewritten by every
/// replay).
///
/// Replays read the input tensors the operations were given at capture time (and, for a
/// zero-copy combine, the zero-copy region of its half): write fresh values and routings into
/// them (e.g. [`DevTensor::write`](crate::gpu::DevTensor::write)) while no replay or call is in
/// flight, not into new tensors. Drop it once its replays' work is done (after an
/// [`LlGroup::sync`]). Not `Send` (cudarc's graph handles are not).
pub struct LlGraph<T> {
    /// The graph of local rank `ranks[i]` (dropped before the buffers it addresses).
    execs: Vec<CudaGraph>,
    /// The ranks launched at capture (unmasked, present).
    ranks: Vec<usize>,
    outputs: T,
    /// Buffers the graphs address, alive as long as they are.
    keep: Vec<Arc<DevBuf>>,
    /// Operations per replay (what the host's counters advance by).
    ops: u64,
    /// The half of the capture's first operation.
    half: u64,
    /// The mask and absent rank at capture (a replay runs under the same).
    mask: Vec<bool>,
    absent: Option<usize>,
    /// See [`LlCapture::prev`].
    prev: Option<Vec<usize>>,
    /// Per rank and half: the dispatch a replay leaves there, `(op − first op, tokens)`.
    dispatched: Vec<[Option<(u64, usize)>; 2]>,
    /// The group it was captured from.
    group: u64,
}

impl<T: std::fmt::Debug> std::fmt::Debug for LlGraph<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlGraph")
            .field("ranks", &self.ranks)
            .field("ops", &self.ops)
            .field("half", &self.half)
            .field("buffers", &self.keep.len())
            .field("outputs", &self.outputs)
            .finish()
    }
}

fn out_of_step(what: String, fix: &str) -> Error {
    Error::GraphOutOfStep {
        what,
        fix: fix.into(),
    }
}

impl<T> LlGraph<T> {
    /// What the capture's closure returned: the outputs every replay rewrites (valid once the
    /// replay's work is done, e.g. after [`LlGroup::sync`]).
    pub fn outputs(&self) -> &T {
        &self.outputs
    }

    /// Low-latency operations (dispatches and combines) in one replay.
    pub fn ops(&self) -> u64 {
        self.ops
    }

    /// Enqueues the captured operations once more on every launched rank's stream, taking the
    /// next call and operation numbers as eager calls would. No host sync; errors surface like
    /// those of eager calls. Refused ([`Error::GraphOutOfStep`]) when the group's next
    /// operation uses the other half than the capture's first, when the mask changed since the
    /// capture, or when the graph starts with a combine and the operation before is not a
    /// dispatch of the same tokens (module docs).
    pub fn replay(&self, g: &mut LlGroup) -> Result<()> {
        if g.id != self.group {
            return Err(out_of_step(
                "it was captured from another LlGroup".into(),
                "replay it on that group",
            ));
        }
        if g.capture.is_some() {
            return Err(not_capturable("a graph replay"));
        }
        g.check_ready()?;
        if g.pending.is_some() {
            return Err(hook_pending());
        }
        let half = ll_half(g.op);
        if half != self.half {
            return Err(out_of_step(
                format!(
                    "its first operation was captured on half {} and the group's next operation \
                     uses half {half}",
                    self.half
                ),
                "replay it after an even number of operations since the point it was captured at \
                 (graphs of an even number of operations replay back to back)",
            ));
        }
        if g.mask != self.mask || g.absent != self.absent {
            return Err(out_of_step(
                "the shrink mask changed since the capture".into(),
                "capture it again under the current mask",
            ));
        }
        if let Some(tokens) = &self.prev {
            let prev_op = g.op.checked_sub(1);
            for (s, &t) in tokens.iter().enumerate() {
                let want = prev_op.map(|p| (p, t));
                let found = prev_op.and_then(|p| g.ranks[s].halves[ll_half(p) as usize].dispatch);
                if want.is_none() || found != want {
                    return Err(out_of_step(
                        format!(
                            "its first combine reads the dispatch of the operation before the \
                             replay, and on rank {s} that is not a dispatch of {t} tokens"
                        ),
                        "replay it right after a dispatch (eager or replayed) like the one its \
                         capture followed",
                    ));
                }
            }
        }
        g.dev
            .context()
            .bind_to_thread()
            .map_err(Error::cuda("cuCtxSetCurrent"))?;
        // The graphs were captured from this group (ids checked): their kernels address its
        // buffers, epoch words and error record, alive while it is, and the buffers in
        // `self.keep`.
        let streams = self.ranks.iter().map(|&r| &g.ranks[r].stream);
        if let Err((i, e)) = launch_graphs(&self.execs, streams) {
            if i > 0 {
                // Ranks already launched wait for this one: they will time out.
                g.poison = Some(format!(
                    "graph launch of rank {} failed: {e}",
                    self.ranks[i]
                ));
            }
            return Err(e);
        }
        let base = g.op;
        g.call += self.ops;
        g.op += self.ops;
        for (r, recs) in g.ranks.iter_mut().zip(&self.dispatched) {
            for (h, rec) in r.halves.iter_mut().zip(recs) {
                if let Some((rel, t)) = rec {
                    h.dispatch = Some((base + rel, *t));
                }
            }
        }
        Ok(())
    }
}

impl LlGroup {
    /// Records the operations `f` makes (dispatch, `recv_hook`, combine, with any options) as
    /// one CUDA graph per launched rank, without running them, and returns them with `f`'s
    /// result (see [`LlGraph`]). What needs the host mid-sequence ([`LlGroup::sync`],
    /// [`LlGroup::stats`], [`LlGroup::clean`], [`LlGroup::update_mask`],
    /// [`LlGroup::poison_for_test`], [`LlGroup::timed`], a nested capture, ...) is
    /// [`Error::NotCapturable`], as are a combine whose handle is not from the operation just
    /// before it and a capture that ends with a receive hook pending. An error ends every
    /// rank's capture and drops the graphs; the group's counters and state are as before the
    /// capture either way. Nothing is allocated: the operations' outputs are the group's
    /// per-half buffers.
    pub fn capture<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<LlGraph<T>> {
        if self.capture.is_some() {
            return Err(not_capturable("a capture"));
        }
        self.check_ready()?;
        if self.pending.is_some() {
            return Err(hook_pending());
        }
        let (call0, op0) = (self.call, self.op);
        let records = |g: &Self| -> Vec<[Option<(u64, usize)>; 2]> {
            g.ranks
                .iter()
                .map(|r| [r.halves[0].dispatch, r.halves[1].dispatch])
                .collect()
        };
        let before = records(self);
        // Local indices of the ranks whose kernels run.
        let ranks: Vec<usize> = (0..self.ranks.len())
            .filter(|&i| {
                let r = self.ranks[i].rank;
                self.absent != Some(r) && !self.mask[r]
            })
            .collect();
        let streams: Vec<_> = ranks
            .iter()
            .map(|&r| self.ranks[r].stream.clone())
            .collect();
        let captured = capture_streams(&streams, || {
            self.capture = Some(LlCapture {
                op0,
                ..LlCapture::default()
            });
            f(self)
        });
        let cap = self.capture.take().unwrap_or_default();
        let ops = self.op - op0;
        let hook_left = self.pending.take().is_some();
        let after = records(self);
        (self.call, self.op) = (call0, op0);
        for (r, recs) in self.ranks.iter_mut().zip(&before) {
            for (h, rec) in r.halves.iter_mut().zip(recs) {
                h.dispatch = *rec;
            }
        }
        let (outputs, execs) = captured;
        let outputs = outputs?;
        if hook_left {
            return Err(Error::NotCapturable {
                what: "a capture that ends with a receive hook pending".into(),
                fix: "call recv_hook() inside the capture, after the send it belongs to".into(),
            });
        }
        if ops == 0 {
            return Err(Error::NotCapturable {
                what: "a capture without operations".into(),
                fix: "capture at least one dispatch or combine".into(),
            });
        }
        let execs = execs?;
        let dispatched = before
            .iter()
            .zip(&after)
            .map(|(b, a)| {
                let rel = |h: usize| {
                    (a[h] != b[h])
                        .then_some(a[h])
                        .flatten()
                        .map(|(op, t)| (op - op0, t))
                };
                [rel(0), rel(1)]
            })
            .collect();
        let mut keep = cap.keep;
        if let Some(p) = &self.phase_times {
            keep.extend(p.iter().map(|t| t.buffer().clone()));
        }
        let mut seen = HashSet::new();
        keep.retain(|b| seen.insert(Arc::as_ptr(b)));
        Ok(LlGraph {
            execs,
            ranks,
            outputs,
            keep,
            ops,
            half: ll_half(op0),
            mask: self.mask.clone(),
            absent: self.absent,
            prev: cap.prev,
            dispatched,
            group: self.id,
        })
    }

    /// `Err(NotCapturable)` while a capture is recording.
    pub(super) fn not_capturing(&self, what: &str) -> Result<()> {
        match self.capture {
            None => Ok(()),
            Some(_) => Err(not_capturable(what)),
        }
    }

    /// While capturing: the graph holds `bufs`.
    pub(super) fn keep<'a>(&mut self, bufs: impl IntoIterator<Item = &'a Arc<DevBuf>>) {
        if let Some(cap) = &mut self.capture {
            cap.keep.extend(bufs.into_iter().cloned());
        }
    }

    /// Test support: every rank's device epoch words (one per block), after a
    /// [`LlGroup::sync`]. Each equals the group's call count when eager calls and replays kept
    /// count.
    #[doc(hidden)]
    pub fn epochs_for_test(&mut self) -> Result<Vec<Vec<u64>>> {
        self.sync()?;
        self.ranks
            .iter()
            .map(|r| {
                let mut b = vec![0u8; r.epoch.len()];
                r.epoch.read(0, &mut b)?;
                Ok(b.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect())
            })
            .collect()
    }

    /// Low-latency operations since the group was made (its next operation's number).
    pub fn num_ops(&self) -> u64 {
        self.op
    }
}
