//! `ep bench`'s typed errors and their exit codes.

use std::path::PathBuf;

use crate::io::IoError;
use crate::preflight::PreflightError;
use crate::workload::OptionsError;

/// Everything that stops `ep bench` before it can say "verified" or "mismatch". Each variant
/// says what to do; [`BenchError::exit_code`] gives the process exit code (2 usage, 3 other,
/// 128 + the signal when interrupted).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// Options that contradict each other or the backend.
    #[error("{0}")]
    Usage(String),
    /// The workload options (reading or generating the inputs, `--dump-inputs`).
    #[error(transparent)]
    Options(#[from] OptionsError),
    /// Refused before any work (a shape beyond the protocol's limits, more memory or disk than
    /// the machine has, an output path that cannot be written).
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    /// SIGINT or SIGTERM: the run stopped at a step boundary (nothing half-written).
    #[error(
        "interrupted by {} {where_}; stopped cleanly (a --dump or --json is either complete or \
         absent)",
        crate::interrupt::name(*signal)
    )]
    Interrupted {
        /// The signal.
        signal: i32,
        /// Where the run was (`before iteration 3`, `after the workload`).
        where_: String,
    },
    /// A `Buffer<Gpu>` call failed (ep-core's error, the GPU's own inside when it is one).
    #[error("GPU: {what}")]
    GpuBuffer {
        /// What was being done.
        what: &'static str,
        /// ep-core's error.
        #[source]
        source: Box<ep_core::Error>,
    },
    /// The GPU backend failed (no GPU, kernels not built, a device error).
    #[error("GPU: {what}")]
    Gpu {
        /// What was being done.
        what: &'static str,
        /// ep-kernels' error (it says what to do).
        #[source]
        source: Box<ep_kernels::Error>,
    },
    /// The `Buffer` could not be constructed for these options.
    #[error("setting up the {mode} Buffer on the {backend} backend")]
    Setup {
        /// `normal` or `low-latency`.
        mode: &'static str,
        /// The backend.
        backend: &'static str,
        /// ep-core's error (it says which limit or check failed).
        #[source]
        source: Box<ep_core::Error>,
    },
    /// A call on the `Buffer` failed (a protocol error, a timeout, a violation found by the
    /// checked simulator).
    #[error("{what} failed in iteration {iteration}")]
    Call {
        /// The call (`normal dispatch`, `low-latency combine`, ...).
        what: &'static str,
        /// The iteration (0 = the first warm-up).
        iteration: usize,
        /// What failed.
        #[source]
        source: Box<ep_core::Error>,
    },
    /// The oracle or the plan refused the inputs (they decide what "correct" means).
    #[error("computing the reference ({what})")]
    Reference {
        /// Which reference.
        what: &'static str,
        /// ep-core's error.
        #[source]
        source: Box<ep_core::Error>,
    },
    /// Digesting or dumping the outputs failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// `--json PATH` could not be written.
    #[error("{}: writing the JSON report failed; check the directory exists and is writable", path.display())]
    Json {
        /// The path.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
    /// An internal invariant of `ep bench` broke (a bug, not the user's doing): report it.
    #[error("internal error in ep bench: {0}; please report it")]
    Internal(&'static str),
}

impl BenchError {
    /// 2 for usage errors, 3 for everything else (1 is a verification mismatch, which is not an
    /// error but an outcome).
    #[must_use]
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Usage(_)
            | Self::Options(
                OptionsError::ExpertsRequired | OptionsError::Generate(_) | OptionsError::Cast(_),
            ) => 2,
            Self::Preflight(e) => e.exit_code(),
            // As a shell reports a process ended by the signal.
            Self::Interrupted { signal, .. } => 128 + signal,
            _ => 3,
        }
    }

    /// `Err(Interrupted)` once SIGINT or SIGTERM was received ([`crate::interrupt`]).
    pub(crate) fn check_interrupt(where_: impl FnOnce() -> String) -> Result<(), Self> {
        match crate::interrupt::received() {
            Some(signal) => Err(Self::Interrupted {
                signal,
                where_: where_(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn setup(mode: &'static str, backend: &'static str, e: ep_core::Error) -> Self {
        Self::Setup {
            mode,
            backend,
            source: Box::new(e),
        }
    }

    pub(crate) fn call(what: &'static str, iteration: usize, e: ep_core::Error) -> Self {
        Self::Call {
            what,
            iteration,
            source: Box::new(e),
        }
    }

    pub(crate) fn reference(what: &'static str, e: ep_core::Error) -> Self {
        Self::Reference {
            what,
            source: Box::new(e),
        }
    }
}

/// The error and its sources, joined with `: ` (what `anyhow`'s `{:#}` prints).
#[must_use]
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
