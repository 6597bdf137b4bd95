//! SIGINT and SIGTERM: the first one asks the run to stop at its next step boundary (an
//! iteration, a set-up step), where it finishes its progress output and returns a typed error;
//! the second one ends the process at once, as the default action would.
//!
//! Nothing is left half-written that looks complete either way: a step boundary is never in
//! the middle of a dump, and a dump writes its manifest last (`crate::io`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::flag;

/// The signal received, 0 while none (signal-hook's handlers store it; they are
/// async-signal-safe and restart interrupted system calls, so no read or write of the run fails
/// with EINTR).
static RECEIVED: std::sync::OnceLock<Arc<AtomicUsize>> = std::sync::OnceLock::new();

/// Installs the handlers (the `ep` binary calls this once, before `ep bench` starts). A second
/// signal of either kind takes the default action (the process ends with that signal).
pub fn install() {
    let received = RECEIVED.get_or_init(|| Arc::new(AtomicUsize::new(0)));
    let seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        // Registered first, so it runs before the flag below is set: a signal after the first
        // one performs the default action. Errors (an invalid signal) cannot happen for these
        // two; without a handler the default action ends the run as before.
        let _ = flag::register_conditional_default(signal, Arc::clone(&seen));
        let _ = flag::register(signal, Arc::clone(&seen));
        let _ = flag::register_usize(signal, Arc::clone(received), signal as usize);
    }
}

/// The signal received since [`install`], if any.
#[must_use]
pub fn received() -> Option<i32> {
    match RECEIVED.get().map_or(0, |r| r.load(Ordering::SeqCst)) {
        0 => None,
        s => Some(s as i32),
    }
}

/// `SIGINT` or `SIGTERM` (or the number).
#[must_use]
pub fn name(signal: i32) -> String {
    match signal {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}
