//! The latency parts of the low-latency floor, measured on the device in the bench's own run
//! (`../shared/BASELINES.md`, "Low-latency floor on one GPU": one graph launch, one flag round
//! trip between co-resident kernels, and the phase's bytes at the copy ceiling): an empty
//! one-kernel CUDA graph per rank stream, replayed like a captured phase, and flag round trips
//! between two resident kernels of this process.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaGraph, CudaStream, LaunchConfig, PushKernelArg};

use super::abi::{self, NormalArgs};
use super::device::Device;
use super::graph::{capture_streams, launch_graphs};
use super::mem::DevBuf;
use crate::error::{Error, Result};

/// One empty-kernel graph per stream: the launch part of the floor of a replayed phase.
pub struct EmptyGraphs {
    execs: Vec<CudaGraph>,
    streams: Vec<Arc<CudaStream>>,
}

impl std::fmt::Debug for EmptyGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmptyGraphs")
            .field("graphs", &self.execs.len())
            .finish()
    }
}

impl EmptyGraphs {
    /// Captures, on each of `streams`, a graph of one empty kernel (one thread).
    pub fn capture(dev: &Device, streams: &[Arc<CudaStream>]) -> Result<Self> {
        let empty = NormalArgs::default();
        let (out, execs) = capture_streams(streams, || {
            for s in streams {
                launch_one(s, &dev.normal.spin, &empty, "cuLaunchKernel(ep_spin)")?;
            }
            Ok(())
        });
        out?;
        Ok(Self {
            execs: execs?,
            streams: streams.to_vec(),
        })
    }

    /// Replays every stream's graph on its stream (asynchronous).
    pub fn replay(&self) -> Result<()> {
        launch_graphs(&self.execs, &self.streams).map_err(|(_, e)| e)
    }
}

/// The mean time of one flag round trip between two kernels resident at once on `dev` (one
/// block each, on two streams of their own: a release store answered by a release store, each
/// awaited with acquire loads, at system scope as the protocol's signals are, or at GPU scope
/// with `gpu_scope`), over `rounds` timed rounds after one untimed. Every wait of the kernels is
/// bounded by `timeout`.
pub fn flag_round_trip(
    dev: &Device,
    rounds: u64,
    gpu_scope: bool,
    timeout: Duration,
) -> Result<Duration> {
    let ctx = dev.context();
    let words = DevBuf::zeroed(ctx, 256)?;
    let out = DevBuf::zeroed(ctx, 8)?;
    let streams = [
        ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?,
        ctx.new_stream().map_err(Error::cuda("cuStreamCreate"))?,
    ];
    let rounds = rounds.max(1);
    // The answering side first, so that it is resident when the first store comes.
    for role in [1u64, 0] {
        let a = NormalArgs {
            rank: role,
            num_tokens: rounds + 1,
            dst_rows: words.ptr(),
            combined_x: out.ptr(),
            timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
            flags: if gpu_scope { abi::EP_FLAG_SAME_GPU } else { 0 },
            ..NormalArgs::default()
        };
        launch_one(
            &streams[role as usize],
            &dev.normal.pingpong,
            &a,
            "cuLaunchKernel(ep_flag_pingpong)",
        )?;
    }
    for s in &streams {
        s.synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
    }
    let mut ns = [0u8; 8];
    out.read(0, &mut ns)?;
    let ns = u64::from_le_bytes(ns);
    if ns == u64::MAX {
        return Err(Error::MeasurementTimeout {
            what: "the flag round trip (ep_flag_pingpong)",
            timeout,
            why: "its two one-block kernels were not resident at once: is another process filling the GPU?",
        });
    }
    Ok(Duration::from_nanos(ns / rounds))
}

fn launch_one(
    stream: &Arc<CudaStream>,
    f: &cudarc::driver::CudaFunction,
    a: &NormalArgs,
    op: &'static str,
) -> Result<()> {
    let mut b = stream.launch_builder(f);
    b.arg(a);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: ep_spin reads only its argument and the clock; ep_flag_pingpong reads and writes
    // only `dst_rows` (256 bytes) and `combined_x` (8 bytes), both alive until the streams are
    // synchronised above.
    unsafe { b.launch(cfg) }.map_err(Error::cuda(op))?;
    Ok(())
}
