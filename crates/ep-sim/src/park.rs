//! Parking for threads mode: how a waiting agent sleeps until a word it polls may have changed,
//! without writers paying for a wake-up when nobody waits.
//!
//! The protocol (model-checked by `tests/loom.rs`):
//! - a **writer** changes memory under that memory's lock, releases the lock, then calls
//!   [`Parker::notify`]: if the waiter count is non-zero it takes the gate and wakes every sleeper;
//!   otherwise it does nothing (the common case: no syscall on the data path);
//! - a **waiter** checks its condition; if false, it registers (increments the waiter count),
//!   takes the gate, checks again, and sleeps on the condition variable (releasing the gate),
//!   for at most a step; then unregisters and starts over, until ready, aborted or past its
//!   deadline.
//!
//! No lost wake-up: if the writer's count load missed the waiter's registration, the waiter's
//! second check came after the writer's write in the memory lock's order (the registration
//! precedes the check, and a check before the write would have ordered the registration before
//! the writer's load), so it sees the write. If the load saw it, the writer takes the gate, which
//! the waiter holds from its second check until it sleeps, so the wake-up finds it asleep.
//! [`Parker::abort`] sets the abort flag, then takes the gate and wakes everyone, with the same
//! argument for the flag.

use std::time::{Duration, Instant};

use crate::sync::{AtomicBool, AtomicUsize, Condvar, Mutex, Ordering, lock};

/// Where waiters of one rank's memory sleep.
#[derive(Debug)]
pub struct Parker {
    waiters: AtomicUsize,
    gate: Mutex<()>,
    cv: Condvar,
}

/// How a [`Parker::wait`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parked<T> {
    /// The condition held, with this value.
    Ready(T),
    /// The abort flag was set.
    Aborted,
    /// The deadline passed.
    TimedOut,
}

impl Default for Parker {
    fn default() -> Self {
        Parker::new()
    }
}

impl Parker {
    /// A parker with no waiters.
    #[must_use]
    pub fn new() -> Parker {
        Parker {
            waiters: AtomicUsize::new(0),
            gate: Mutex::new(()),
            cv: Condvar::new(),
        }
    }

    /// Wakes the waiters, if any; call after the change is visible (its lock released).
    pub fn notify(&self) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            drop(lock(&self.gate));
            self.cv.notify_all();
        }
    }

    /// Sets `flag` and wakes every waiter of every parker in `all`.
    pub fn abort<'a>(flag: &AtomicBool, all: impl IntoIterator<Item = &'a Parker>) {
        flag.store(true, Ordering::SeqCst);
        for p in all {
            drop(lock(&p.gate));
            p.cv.notify_all();
        }
    }

    /// Waits until `ready` returns `Some`, `abort` is set, or `timeout` passes. `ready` may take
    /// the memory's locks (the gate is always taken first). Sleeps at most `step` at a time, so a
    /// notification from a writer that does not follow the protocol costs latency, not progress.
    pub fn wait<T>(
        &self,
        abort: &AtomicBool,
        timeout: Duration,
        step: Duration,
        mut ready: impl FnMut() -> Option<T>,
    ) -> Parked<T> {
        let start = Instant::now();
        loop {
            if let Some(v) = ready() {
                return Parked::Ready(v);
            }
            if abort.load(Ordering::SeqCst) {
                return Parked::Aborted;
            }
            let waited = start.elapsed();
            if waited >= timeout {
                return Parked::TimedOut;
            }
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let g = lock(&self.gate);
            let out = if let Some(v) = ready() {
                Some(Parked::Ready(v))
            } else if abort.load(Ordering::SeqCst) {
                Some(Parked::Aborted)
            } else {
                let nap = (timeout - waited).min(step);
                let r = self.cv.wait_timeout(g, nap);
                drop(r.unwrap_or_else(std::sync::PoisonError::into_inner));
                None
            };
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            if let Some(o) = out {
                return o;
            }
        }
    }
}
