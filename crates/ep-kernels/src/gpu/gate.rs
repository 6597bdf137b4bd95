//! Timing several ranks' streams from one moment: a gate stream runs a short spin, every rank's
//! stream waits for it and records its start event behind it, so the host can enqueue every
//! rank's work before any of it starts; end events and elapsed times per rank.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, LaunchConfig, PushKernelArg};

use super::abi::NormalArgs;
use super::device::Device;
use crate::error::{Error, Result};

/// How long the gate holds the ranks back (ns): long enough for the host to enqueue a call on
/// every rank.
const HOLD_NS: u64 = 300_000;

/// The gate stream of a group.
#[derive(Debug)]
pub(crate) struct Gate {
    stream: Arc<CudaStream>,
}

impl Gate {
    pub(crate) fn new(dev: &Device) -> Result<Self> {
        let stream = dev
            .context()
            .new_stream()
            .map_err(Error::cuda("cuStreamCreate"))?;
        Ok(Self { stream })
    }

    /// Holds every stream of `streams` behind the gate's spin; returns each one's start event.
    pub(crate) fn hold<'a>(
        &self,
        dev: &Device,
        streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
    ) -> Result<Vec<CudaEvent>> {
        let spin = NormalArgs {
            timeout_ns: HOLD_NS,
            ..NormalArgs::default()
        };
        let mut b = self.stream.launch_builder(&dev.normal.spin);
        b.arg(&spin);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ep_spin reads only its argument and the clock.
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

/// An end event on each stream.
pub(crate) fn record_ends<'a>(
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
