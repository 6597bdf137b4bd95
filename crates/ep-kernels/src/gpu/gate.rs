//! Timing several ranks' streams from one moment: every rank's stream runs a spin of its own
//! that polls one host-mapped word and records its start event behind it, and the host opens
//! the gate (writes the word) once it has enqueued every rank's work and given the device time
//! to fetch it, so that no rank starts before the host is done with the others and all see the
//! opening at once; end events and elapsed times per rank.
//!
//! **One spin per stream, not one gate stream.** Before, one spin ran on a gate stream and every
//! rank's stream waited for an event recorded after it. The streams came out of that wait one
//! after another: in the stamped low-latency dispatch the second rank's blocks started 1.7–2.6 us
//! after the first's (BENCHMARKS.md, 2026-12-07), a skew no deployment's ranks have by
//! construction and that the first rank's receive part then waited out. Now each stream's spin
//! sees the word on its own poll.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, LaunchConfig, PushKernelArg};

use super::abi::NormalArgs;
use super::device::Device;
use super::mem::HostMapped;
use crate::error::{Error, Result};

/// The longest a spin holds its stream (ns) when the host does not open the gate: a bound (a
/// spin never waits unbounded), far above what enqueueing a call on every rank takes. A fixed
/// 300 us hold alone let R = 8 ranks start up to ~500 us apart (the host had not enqueued the
/// last rank's work when it ran out: BENCHMARKS.md, 2026-12-06).
const MAX_HOLD_NS: u64 = 50_000_000;

/// How long the host waits, after the last work is enqueued, before it opens the gate: time for
/// the device to have fetched the launches the host just enqueued, so that a rank's kernel
/// starts at the opening and not a submission later (the figures before 2026-12-06 were all
/// measured so). Waited on the host, not held by each spin: spins that began at different
/// moments would otherwise end their holds at different moments.
const FETCH_WAIT: Duration = Duration::from_micros(300);

/// The gate of a group.
#[derive(Debug)]
pub(crate) struct Gate {
    /// Host-mapped word every spin polls: the gate is open once it reaches the hold's ticket.
    word: HostMapped<u64>,
    ticket: u64,
    /// The last ticket opened (the fetch wait is paid once per hold).
    opened: Cell<u64>,
    /// The streams the spins were launched on (synchronised before the word is freed).
    held: Vec<Arc<CudaStream>>,
}

impl Gate {
    pub(crate) fn new(dev: &Device) -> Result<Self> {
        Ok(Self {
            word: HostMapped::new(dev.context())?,
            ticket: 0,
            opened: Cell::new(0),
            held: Vec::new(),
        })
    }

    /// Opens the gate of the last [`Gate::hold`]: every rank's work behind it starts. Call it
    /// once the host has enqueued that work, and before the host waits on any of it.
    pub(crate) fn open(&self) {
        if self.opened.get() != self.ticket {
            std::thread::sleep(FETCH_WAIT);
            self.opened.set(self.ticket);
        }
        self.word.write(self.ticket);
    }

    /// Holds every stream of `streams` behind a spin of its own until [`Gate::open`] (or
    /// `MAX_HOLD_NS`); returns each one's start event.
    pub(crate) fn hold<'a>(
        &mut self,
        dev: &Device,
        streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
    ) -> Result<Vec<CudaEvent>> {
        self.ticket += 1;
        let spin = NormalArgs {
            timeout_ns: MAX_HOLD_NS,
            hold_ns: 0,
            mailbox: self.word.dev_ptr(),
            call: self.ticket,
            ..NormalArgs::default()
        };
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        streams
            .into_iter()
            .map(|s| {
                if !self.held.iter().any(|h| Arc::ptr_eq(h, s)) {
                    self.held.push(s.clone());
                }
                let mut b = s.launch_builder(&dev.normal.spin);
                b.arg(&spin);
                // SAFETY: ep_spin reads only its argument, the clock and `word` (host-mapped,
                // alive as long as self, whose drop synchronises every stream in `held`).
                unsafe { b.launch(cfg) }.map_err(Error::cuda("cuLaunchKernel(ep_spin)"))?;
                s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(Error::cuda("cuEventRecord"))
            })
            .collect()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // The spins must not outlive the word they poll.
        self.word.write(self.ticket);
        for s in &self.held {
            let _ = s.synchronize();
        }
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
