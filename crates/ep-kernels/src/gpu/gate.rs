//! Timing several ranks' streams from one moment: a gate stream runs a spin, every rank's stream
//! waits for it and records its start event behind it, and the host opens the gate (a
//! host-mapped word the spin polls) once it has enqueued every rank's work, so that no rank
//! starts before the host is done with the others; end events and elapsed times per rank.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, LaunchConfig, PushKernelArg};

use super::abi::NormalArgs;
use super::device::Device;
use super::mem::HostMapped;
use crate::error::{Error, Result};

/// The longest the gate holds the ranks back (ns) when the host does not open it: a bound (a
/// spin never waits unbounded), far above what enqueueing a call on every rank takes. A fixed
/// 300 us hold alone let R = 8 ranks start up to ~500 us apart (the host had not enqueued the
/// last rank's work when it ran out: BENCHMARKS.md, 2026-12-06).
const MAX_HOLD_NS: u64 = 50_000_000;

/// The least the gate holds the ranks back (ns), opened or not: time for the device to have
/// fetched the launches the host just enqueued, so that a rank's kernel starts at the release
/// and not a submission later (the figures before 2026-12-06 were all measured so).
const MIN_HOLD_NS: u64 = 300_000;

/// The gate stream of a group.
#[derive(Debug)]
pub(crate) struct Gate {
    stream: Arc<CudaStream>,
    /// Host-mapped word the spin polls: the gate is open once it reaches the hold's ticket.
    word: HostMapped<u64>,
    ticket: u64,
}

impl Gate {
    pub(crate) fn new(dev: &Device) -> Result<Self> {
        let stream = dev
            .context()
            .new_stream()
            .map_err(Error::cuda("cuStreamCreate"))?;
        Ok(Self {
            stream,
            word: HostMapped::new(dev.context())?,
            ticket: 0,
        })
    }

    /// Opens the gate of the last [`Gate::hold`]: every rank's work behind it starts. Call it
    /// once the host has enqueued that work, and before the host waits on any of it.
    pub(crate) fn open(&self) {
        self.word.write(self.ticket);
    }

    /// Holds every stream of `streams` behind the gate's spin until [`Gate::open`] (or
    /// `MAX_HOLD_NS`); returns each one's start event.
    pub(crate) fn hold<'a>(
        &mut self,
        dev: &Device,
        streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
    ) -> Result<Vec<CudaEvent>> {
        self.ticket += 1;
        let spin = NormalArgs {
            timeout_ns: MAX_HOLD_NS,
            hold_ns: MIN_HOLD_NS,
            mailbox: self.word.dev_ptr(),
            call: self.ticket,
            ..NormalArgs::default()
        };
        let mut b = self.stream.launch_builder(&dev.normal.spin);
        b.arg(&spin);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ep_spin reads only its argument, the clock and `word` (host-mapped, alive as
        // long as self; the stream is synchronised before the gate is dropped with its group).
        unsafe { b.launch(cfg) }.map_err(Error::cuda("cuLaunchKernel(ep_spin)"))?;
        let open = self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(Error::cuda("cuEventRecord"))?;
        streams
            .into_iter()
            .map(|s| {
                s.wait(&open).map_err(Error::cuda("cuStreamWaitEvent"))?;
                s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(Error::cuda("cuEventRecord"))
            })
            .collect()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // The spin must not outlive the word it polls.
        self.open();
        let _ = self.stream.synchronize();
    }
}

/// The start of a timed call: every stream of `streams` held behind `gate`, which is made on
/// first use; each stream's start event.
pub(crate) fn hold_all<'a>(
    gate: &mut Option<Gate>,
    dev: &Device,
    streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
) -> Result<Vec<CudaEvent>> {
    let g = match gate {
        Some(g) => g,
        None => gate.insert(Gate::new(dev)?),
    };
    g.hold(dev, streams)
}

/// The end of a timed call: an end event on each stream, then the gate (if any) opened, also
/// when recording failed (the streams must not wait for its bound).
pub(crate) fn close<'a>(
    gate: Option<&Gate>,
    streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
) -> Result<Vec<CudaEvent>> {
    let ends = record_ends(streams);
    if let Some(g) = gate {
        g.open();
    }
    ends
}

/// An end event on each stream.
fn record_ends<'a>(
    streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
) -> Result<Vec<CudaEvent>> {
    streams
        .into_iter()
        .map(|s| {
            s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(Error::cuda("cuEventRecord"))
        })
        .collect()
}

/// Seconds from each start to its end (after the streams were synchronised).
pub(crate) fn elapsed(starts: &[CudaEvent], ends: &[CudaEvent]) -> Result<Vec<f64>> {
    starts
        .iter()
        .zip(ends)
        .map(|(s, e)| {
            Ok(f64::from(s.elapsed_ms(e).map_err(Error::cuda("cuEventElapsedTime"))?) * 1e-3)
        })
        .collect()
}
