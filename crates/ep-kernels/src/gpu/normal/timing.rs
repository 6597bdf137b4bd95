//! Measurement on a [`NormalGroup`]: calls released together behind a gate and timed with
//! events, and the kernels' phase stamps.

use std::time::{Duration, Instant};

use super::NormalGroup;
use crate::error::Result;
use crate::gpu::abi;
use crate::gpu::gate::{close, elapsed, hold_all};
use crate::gpu::tensor::rows_u64;
use crate::gpu::tensor::{DType, DevTensor};

impl NormalGroup {
    /// Measurement: from now on (`on`) the dispatch and combine kernels stamp `%globaltimer` at
    /// their phase boundaries ([`NormalGroup::phase_times`]); off again with `false`.
    pub fn measure_phases(&mut self, on: bool) -> Result<()> {
        self.not_capturing("measure_phases")?;
        self.phase_times = if on {
            let rows = 2 * ep_core::protocol::layout::MAX_CHANNELS;
            let slots = abi::EP_PHASE_SLOTS as usize;
            Some(
                (0..self.num_local_ranks())
                    .map(|_| DevTensor::zeros(self.dev.context(), DType::I64, rows, slots))
                    .collect::<Result<_>>()?,
            )
        } else {
            None
        };
        Ok(())
    }

    /// The stamps of the last measured kernel of each local rank: per block, `EP_PHASE_SLOTS`
    /// `%globaltimer` values (ns; 0 = not reached). Dispatch: start, offsets known, rows stored,
    /// done released, done acquired, end; combine: start, y_ready acquired, rows reduced, -, -,
    /// end. Call after [`NormalGroup::sync`].
    pub fn phase_times(&self) -> Result<Vec<Vec<Vec<u64>>>> {
        let Some(bufs) = &self.phase_times else {
            return Ok(Vec::new());
        };
        let blocks = 2 * self.num_channels();
        rows_u64(bufs, |_| blocks)
    }

    /// Opens the timing gate, if one holds the streams: any call that is about to wait on the
    /// device (its work must not stay behind the gate).
    pub(crate) fn open_gate(&self) {
        if let Some(g) = &self.gate {
            g.open();
        }
    }

    /// Host time the last [`Self::timed`] closure took: enqueueing every local rank's work (and,
    /// for a dispatch, the host's wait for num_recv), while the ranks' streams stood behind the
    /// gate.
    pub fn last_enqueue(&self) -> Duration {
        self.last_enqueue
    }

    /// Runs `f`, which enqueues work on every local rank's stream, with every local rank
    /// released at the same moment (their streams wait behind a spin on a gate stream until the
    /// host has enqueued), and returns each rank's device time from that release to the end of its work,
    /// in seconds (CUDA events).
    pub fn timed<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<(T, Vec<f64>)> {
        self.not_capturing("timed")?;
        let starts = hold_all(
            &mut self.gate,
            &self.dev,
            self.ranks.iter().map(|r| &r.stream),
        )?;
        let t0 = Instant::now();
        let out = f(self);
        self.last_enqueue = t0.elapsed();
        let ends = close(self.gate.as_ref(), self.ranks.iter().map(|r| &r.stream));
        let (out, ends) = (out?, ends?);
        self.sync()?;
        Ok((out, elapsed(&starts, &ends)?))
    }
}
