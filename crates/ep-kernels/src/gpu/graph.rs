//! The CUDA-graph plumbing both groups share ([`NormalGroup::capture`](super::NormalGroup::capture),
//! [`LlGroup::capture`](super::LlGroup::capture)): one graph per local rank, captured from the
//! rank's stream and replayed on it.
//!
//! **One graph per local rank.** Co-resident ranks' kernels spin on each other, so they must run
//! concurrently: each rank's calls are captured from its own stream into its own graph and
//! replayed on its own stream, exactly as eager calls are enqueued (independent branches of one
//! graph may be serialised by the driver, which would deadlock them).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys;
use cudarc::driver::{CudaGraph, CudaStream};

use crate::error::{Error, Result};

/// A fresh group identity (graphs replay only on the group they were captured from).
pub(crate) fn next_group_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// `Error::NotCapturable` for `what`, a call that needs the host mid-sequence.
pub(crate) fn not_capturable(what: &str) -> Error {
    Error::NotCapturable {
        what: what.into(),
        fix: "it needs the host or a finished stream mid-sequence; call it before or after the capture".into(),
    }
}

/// Begins a capture on every stream of `streams`, runs `f` (which enqueues the calls), ends
/// every capture begun whatever happened (a stream left capturing is unusable), and returns
/// `f`'s result (or the failure to begin) and, separately, one instantiated, uploaded graph per
/// stream (or the first failure to end a capture): callers report `f`'s error first.
///
/// Relaxed mode: the calls may allocate (`cuMemAlloc`) while capturing, which the stricter modes
/// refuse; nothing else they do touches a capturing stream outside the capture.
pub(crate) fn capture_streams<T>(
    streams: &[Arc<CudaStream>],
    f: impl FnOnce() -> Result<T>,
) -> (Result<T>, Result<Vec<CudaGraph>>) {
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    let mut begun = 0;
    let mut out = Ok(());
    for s in streams {
        if let Err(e) = s.begin_capture(mode) {
            out = Err(Error::Cuda {
                op: "cuStreamBeginCapture",
                source: e,
            });
            break;
        }
        begun += 1;
    }
    let out = out.and_then(|()| f());
    let mut execs = Vec::with_capacity(begun);
    let mut ended = Ok(());
    for (i, s) in streams[..begun].iter().enumerate() {
        let e = match s.end_capture(sys::CUgraphInstantiate_flags(0)) {
            Ok(Some(g)) => {
                execs.push(g);
                continue;
            }
            Ok(None) => {
                Error::Unsupported(format!("the capture of local rank {i} produced no graph"))
            }
            Err(source) => Error::Cuda {
                op: "cuStreamEndCapture / cuGraphInstantiate",
                source,
            },
        };
        if ended.is_ok() {
            ended = Err(e);
        }
    }
    let execs = ended.and_then(|()| {
        for g in &execs {
            g.upload().map_err(Error::cuda("cuGraphUpload"))?;
        }
        Ok(execs)
    });
    (out, execs)
}

/// Launches `execs[i]` on `streams[i]`, in order. On a failure returns the index of the rank
/// whose launch failed with the error: ranks launched before it wait for it (they will time out),
/// so the caller poisons its group when the index is not 0.
pub(crate) fn launch_graphs<'a>(
    execs: &[CudaGraph],
    streams: impl IntoIterator<Item = &'a Arc<CudaStream>>,
) -> std::result::Result<(), (usize, Error)> {
    for (i, (exec, s)) in execs.iter().zip(streams).enumerate() {
        // SAFETY: the exec is alive (borrowed) and its kernels address memory its owner keeps
        // alive (the group's buffers and the graph's kept buffers, the callers' contract); the
        // stream is a live stream of the same context.
        unsafe { sys::cuGraphLaunch(exec.cu_graph_exec(), s.cu_stream()) }
            .result()
            .map_err(|e| (i, Error::cuda("cuGraphLaunch")(e)))?;
    }
    Ok(())
}
