//! The synchronisation primitives of threads mode, from std, or from loom under `--cfg loom`
//! (crossbeam's `primitive` shim): what [`crate::park`] is built from, so that the loom model in
//! `tests/loom.rs` checks the code that runs.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

/// Locks `m`, ignoring poison: a panicking agent is reported through its result, and the data
/// behind these locks (heap bytes, counters) stays meaningful.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
