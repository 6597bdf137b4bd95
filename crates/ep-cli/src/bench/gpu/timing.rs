//! Timing of the GPU bench's calls: samples of gated calls, the slowest rank's time, figures
//! (median and DeepEP's GB/s), and the bench's error conversions.

use ep_kernels::gpu::NormalGroup;

use crate::bench::error::BenchError;
use crate::bench::report::median;

/// A `Buffer<Gpu>` call's error, with the GPU's own inside when there is one.
pub(in crate::bench) fn core_err(what: &'static str) -> impl FnOnce(ep_core::Error) -> BenchError {
    move |e| BenchError::GpuBuffer {
        what,
        source: Box::new(e),
    }
}

pub(in crate::bench) fn gpu_err(
    what: &'static str,
) -> impl FnOnce(ep_kernels::Error) -> BenchError {
    move |e| BenchError::Gpu {
        what,
        source: Box::new(e),
    }
}

/// The slowest rank's time of a call.
pub(in crate::bench) fn slowest(per_rank: &[f64]) -> f64 {
    per_rank.iter().copied().fold(0.0, f64::max)
}

/// One call enqueued by `f`, timed on every rank (`NormalGroup::timed`): each rank's seconds.
pub(super) fn timed<T>(
    g: &mut NormalGroup,
    what: &'static str,
    f: impl FnOnce(&mut NormalGroup) -> ep_kernels::Result<T>,
) -> Result<Vec<f64>, BenchError> {
    // One rank per process: the processes meet before each timed call (a no-op otherwise).
    g.barrier().map_err(gpu_err(what))?;
    g.timed(f).map(|(_, t)| t).map_err(gpu_err(what))
}

/// `step(it)` for `total` iterations; the slowest rank's time of each one from `warm` on.
pub(in crate::bench) fn samples(
    total: usize,
    warm: usize,
    mut step: impl FnMut(usize) -> Result<Vec<f64>, BenchError>,
) -> Result<Vec<f64>, BenchError> {
    let mut out = Vec::with_capacity(total.saturating_sub(warm));
    for it in 0..total {
        let t = step(it)?;
        if it >= warm {
            out.push(slowest(&t));
        }
    }
    Ok(out)
}

/// Median figures of one call kind at one SM count.
#[derive(Clone, Copy, Default, serde::Serialize)]
pub(in crate::bench) struct Figure {
    pub(in crate::bench) median_us: f64,
    pub(in crate::bench) gb_per_s: f64,
}

pub(in crate::bench) fn figure(samples: &[f64], bytes_per_rank: f64) -> Figure {
    let m = median(samples);
    Figure {
        median_us: m * 1e6,
        gb_per_s: if m > 0.0 {
            bytes_per_rank / m * 1e-9
        } else {
            0.0
        },
    }
}
