//! The progress of long runs: a bar on a terminal, one plain line per step otherwise (a log, a
//! CI job, a pipe), nothing with `--quiet` or `--progress none`.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How progress is shown (`--progress`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum ProgressMode {
    /// A bar when stderr is a terminal, plain lines otherwise.
    #[default]
    Auto,
    /// A bar on stderr.
    Bar,
    /// One line per step on stderr, with the elapsed time.
    Plain,
    /// Nothing (as `--quiet`).
    None,
}

/// A bar over the run's steps (set-up steps, then iterations), or plain lines.
pub(crate) struct Progress {
    bar: ProgressBar,
    /// Plain mode: when the run started.
    plain: Option<Instant>,
}

impl Progress {
    /// Progress over `len` steps shown as `mode` says (`quiet` wins).
    pub(crate) fn new(len: u64, quiet: bool, mode: ProgressMode) -> Self {
        let bar = ProgressBar::new(len);
        let mode = match mode {
            _ if quiet => ProgressMode::None,
            ProgressMode::Auto if std::io::stderr().is_terminal() => ProgressMode::Bar,
            ProgressMode::Auto => ProgressMode::Plain,
            m => m,
        };
        let mut plain = None;
        match mode {
            ProgressMode::Bar => {
                bar.set_draw_target(ProgressDrawTarget::stderr());
                if let Ok(style) = ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
                ) {
                    bar.set_style(style);
                }
                bar.enable_steady_tick(Duration::from_millis(200));
            }
            ProgressMode::Plain => {
                bar.set_draw_target(ProgressDrawTarget::hidden());
                plain = Some(Instant::now());
            }
            _ => bar.set_draw_target(ProgressDrawTarget::hidden()),
        }
        Self { bar, plain }
    }

    /// Starts a step described by `msg`.
    pub(crate) fn step(&self, msg: impl Into<String>) {
        let msg = msg.into();
        if let Some(t0) = self.plain {
            eprintln!("[{:6.2} s] {msg}", t0.elapsed().as_secs_f64());
        }
        self.bar.set_message(msg);
    }

    /// Finishes the current step.
    pub(crate) fn done(&self) {
        self.bar.inc(1);
    }

    /// Prints a line above the bar (or plainly when it is hidden).
    pub(crate) fn println(&self, line: impl AsRef<str>) {
        let line = line.as_ref();
        self.bar.suspend(|| println!("{line}"));
    }

    /// Removes the bar (the line it was on is cleared, so the report starts on a clean line).
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
