//! The progress bar of long runs: drawn on a terminal, hidden when stdout is not one or with
//! `--quiet`.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar over the run's steps (set-up steps, then iterations).
pub(crate) struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `len` steps; hidden when `quiet` or stdout is not a terminal.
    pub(crate) fn new(len: u64, quiet: bool) -> Self {
        let bar = ProgressBar::new(len);
        if quiet || !std::io::stdout().is_terminal() {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        } else {
            bar.set_draw_target(ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}",
            ) {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(200));
        }
        Self { bar }
    }

    /// Starts a step described by `msg`.
    pub(crate) fn step(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
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

    /// Removes the bar.
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
