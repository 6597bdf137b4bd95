//! Measurement on an [`LlGroup`](super::LlGroup): calls released together behind a gate and timed
//! with events, and the kernels' phase stamps.

use super::LlGroup;
use crate::error::Result;
use crate::gpu::abi;
use crate::gpu::gate::{close, elapsed, hold_all};
use crate::gpu::tensor::rows_u64;
use crate::gpu::tensor::{DType, DevTensor};

impl LlGroup {
    /// Measurement: from now on (`on`, which also zeroes the stamps) the kernels stamp
    /// `%globaltimer` at their phase boundaries ([`LlGroup::phase_times`]); off with `false`.
    pub fn measure_phases(&mut self, on: bool) -> Result<()> {
        self.not_capturing("measure_phases")?;
        self.phase_times = if on {
            let slots = abi::EP_PHASE_SLOTS as usize;
            Some(
                (0..self.ranks.len())
                    .map(|_| {
                        DevTensor::zeros(self.dev.context(), DType::I64, self.cfg.num_sms, slots)
                    })
                    .collect::<Result<_>>()?,
            )
        } else {
            None
        };
        Ok(())
    }

    /// The stamps since [`LlGroup::measure_phases`]: per rank, per block, `EP_PHASE_SLOTS`
    /// `%globaltimer` values (ns; 0 = not reached): send start, routing known, rows stored,
    /// signals released (each block its own), receive start, sources acquired, end.
    pub fn phase_times(&mut self) -> Result<Vec<Vec<Vec<u64>>>> {
        self.not_capturing("phase_times")?;
        self.sync()?;
        let Some(bufs) = &self.phase_times else {
            return Ok(Vec::new());
        };
        rows_u64(bufs, |all| all)
    }

    /// Opens the timing gate, if one holds the streams: any call that is about to wait on the
    /// device (its work must not stay behind the gate).
    pub(crate) fn open_gate(&self) {
        if let Some(g) = &self.gate {
            g.open();
        }
    }

    /// Runs `f`, which enqueues work on every rank's stream, with every rank released at once
    /// behind a gate, and returns each rank's device time (seconds, CUDA events). With one rank
    /// per process it is collective: the processes meet at a barrier first.
    pub fn timed<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<(T, Vec<f64>)> {
        self.not_capturing("timed")?;
        // Ranks in other processes: start together (a barrier of the processes; collective).
        self.barrier_processes()?;
        let starts = hold_all(
            &mut self.gate,
            &self.dev,
            self.ranks.iter().map(|r| &r.stream),
        )?;
        let out = f(self);
        let ends = close(self.gate.as_ref(), self.ranks.iter().map(|r| &r.stream));
        let (out, ends) = (out?, ends?);
        self.sync()?;
        Ok((out, elapsed(&starts, &ends)?))
    }
}
