//! Loom model of threads mode's parking protocol ([`ep_sim::park`]): a writer changes memory under
//! its lock and notifies only when waiters exist; a waiter registers, re-checks under the gate and
//! sleeps. Loom explores every interleaving (and treats a lost wake-up as a deadlock), so these
//! pass only if no wake-up can be lost. Timeouts are set beyond reach: progress must come from
//! notifications. (Checked to have teeth: without the waiter's second check under the gate,
//! loom reports the lost wake-up as a deadlock in the first two models.)
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p ep-sim --test loom --release`
//! (a separate `CARGO_TARGET_DIR` keeps the normal build's cache).

#![cfg(loom)]

use std::time::Duration;

use ep_sim::park::{Parked, Parker};
use loom::sync::atomic::AtomicBool;
use loom::sync::{Arc, Mutex};
use loom::thread;

const NEVER: Duration = Duration::from_secs(3600);

/// Every interleaving with up to 3 preemptions (loom's usual bound; unbounded, the model with
/// three threads does not finish in minutes).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

fn read(m: &Mutex<u64>) -> u64 {
    *m.lock().unwrap()
}

#[test]
fn a_write_wakes_a_parked_waiter() {
    model(|| {
        let word = Arc::new(Mutex::new(0u64));
        let park = Arc::new(Parker::new());
        let abort = AtomicBool::new(false);
        let writer = {
            let (word, park) = (word.clone(), park.clone());
            thread::spawn(move || {
                *word.lock().unwrap() = 7;
                park.notify();
            })
        };
        let got = park.wait(&abort, NEVER, NEVER, || {
            let v = read(&word);
            (v == 7).then_some(v)
        });
        assert_eq!(got, Parked::Ready(7));
        writer.join().unwrap();
    });
}

#[test]
fn two_writers_each_counted_once() {
    model(|| {
        let word = Arc::new(Mutex::new(0u64));
        let park = Arc::new(Parker::new());
        let abort = AtomicBool::new(false);
        let writers: Vec<_> = (0..2)
            .map(|_| {
                let (word, park) = (word.clone(), park.clone());
                thread::spawn(move || {
                    *word.lock().unwrap() += 1;
                    park.notify();
                })
            })
            .collect();
        let got = park.wait(&abort, NEVER, NEVER, || {
            let v = read(&word);
            (v == 2).then_some(v)
        });
        assert_eq!(got, Parked::Ready(2));
        for w in writers {
            w.join().unwrap();
        }
    });
}

#[test]
fn abort_wakes_a_waiter_whose_condition_never_holds() {
    model(|| {
        let park = Arc::new(Parker::new());
        let abort = Arc::new(AtomicBool::new(false));
        let aborter = {
            let (park, abort) = (park.clone(), abort.clone());
            thread::spawn(move || Parker::abort(&abort, [&*park]))
        };
        let got = park.wait(&abort, NEVER, NEVER, || None::<u64>);
        assert_eq!(got, Parked::Aborted);
        aborter.join().unwrap();
    });
}
