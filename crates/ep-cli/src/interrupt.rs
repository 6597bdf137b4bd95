//! SIGINT and SIGTERM: the first one asks the run to stop at its next step boundary (an
//! iteration, a set-up step), where it finishes its progress output and returns a typed error;
//! the second one ends the process at once, as the default action would.
//!
//! Nothing is left half-written that looks complete either way: a step boundary is never in
//! the middle of a dump, and a dump writes its manifest last (`crate::io`).

use std::sync::atomic::{AtomicI32, Ordering};

/// The signal received, 0 while none.
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    // An atomic store is async-signal-safe; `SA_RESETHAND` already restored the default action.
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// Installs the handlers (the `ep` binary calls this once, before `ep bench` starts).
pub fn install() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: all-zero is a valid `sigaction` (an empty mask, no flags), completed below.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // One-shot (the second signal gets the default action) and restarting interrupted
        // system calls, so no read or write of the run fails with EINTR.
        action.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
        // SAFETY: `action` is initialised and its handler only performs an atomic store, which
        // is async-signal-safe; the old action is not asked for (null).
        let _ = unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) };
    }
}

/// The signal received since [`install`], if any.
#[must_use]
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// `SIGINT` or `SIGTERM` (or the number).
#[must_use]
pub fn name(signal: i32) -> String {
    match signal {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}
