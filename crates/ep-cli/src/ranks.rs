//! Work over ranks spread on the host's cores (the verification of `ep bench`, the generation
//! of a workload): one helper for the scoped-thread loops, results always in rank order, a panic
//! in the work resumed on the caller. A thread the system refuses (`ulimit -u`, `-v`) is no
//! error: its share of the work runs on the calling thread.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Threads for `n` pieces of work: one per core, at most `n`, at least 1.
fn threads_for(n: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(n)
        .max(1)
}

/// `f(rank)` for every rank `0..n`, each thread taking the next rank not yet taken (ranks differ
/// in cost); the results in rank order.
pub(crate) fn per_rank<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let threads = threads_for(n);
    if threads == 1 {
        return (0..n).map(f).collect();
    }
    let (f, next) = (&f, &AtomicUsize::new(0));
    let work = move || {
        let mut mine = Vec::new();
        loop {
            let d = next.fetch_add(1, Ordering::Relaxed);
            if d >= n {
                break mine;
            }
            mine.push((d, f(d)));
        }
    };
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    std::thread::scope(|sc| {
        // The caller takes ranks too, so ranks of refused threads are still done.
        let handles: Vec<_> = (1..threads)
            .filter_map(|_| std::thread::Builder::new().spawn_scoped(sc, work).ok())
            .collect();
        for (d, v) in work() {
            out[d] = Some(v);
        }
        for h in handles {
            let part = h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            for (d, v) in part {
                out[d] = Some(v);
            }
        }
    });
    out.into_iter().flatten().collect()
}

/// `f(i, &mut items[i])` for every item, the items split into one contiguous run per thread;
/// the results in item order.
pub(crate) fn per_item_mut<T: Send, R: Send>(
    items: &mut [T],
    f: impl Fn(usize, &mut T) -> R + Sync,
) -> Vec<R> {
    let threads = threads_for(items.len());
    let chunk = items.len().div_ceil(threads).max(1);
    let f = &f;
    let queue = std::sync::Mutex::new(items.chunks_mut(chunk).enumerate().collect::<Vec<_>>());
    let queue = &queue;
    let work = move || {
        let mut mine = Vec::new();
        loop {
            let next = queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .pop();
            let Some((c, part)) = next else { break mine };
            let out: Vec<R> = part
                .iter_mut()
                .enumerate()
                .map(|(i, x)| f(c * chunk + i, x))
                .collect();
            mine.push((c, out));
        }
    };
    let mut runs = std::thread::scope(|sc| {
        let handles: Vec<_> = (1..threads)
            .filter_map(|_| std::thread::Builder::new().spawn_scoped(sc, work).ok())
            .collect();
        let mut runs = work();
        for h in handles {
            runs.extend(h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)));
        }
        runs
    });
    runs.sort_by_key(|(c, _)| *c);
    runs.into_iter().flat_map(|(_, v)| v).collect()
}

/// `a()` on this thread and `b()` on another, at once (`b()` after `a()` here when the system
/// refuses the thread).
pub(crate) fn join<A, B: Send>(a: impl FnOnce() -> A, b: impl FnOnce() -> B + Send) -> (A, B) {
    let b = std::sync::Mutex::new(Some(b));
    let b = &b;
    let take = move || {
        b.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    };
    std::thread::scope(|sc| {
        let hb = std::thread::Builder::new()
            .spawn_scoped(sc, move || take().map(|b| b()))
            .ok();
        let ra = a();
        let rb = match hb.map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))) {
            Some(Some(rb)) => rb,
            // Refused (or not yet taken): run it here.
            _ => match take() {
                Some(b) => b(),
                None => unreachable!("b runs exactly once: the thread took it and returned it"),
            },
        };
        (ra, rb)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_in_rank_order() {
        for n in [0, 1, 2, 7, 33] {
            assert_eq!(
                per_rank(n, |d| d * 3),
                (0..n).map(|d| d * 3).collect::<Vec<_>>()
            );
            let mut v: Vec<usize> = (0..n).collect();
            let got = per_item_mut(&mut v, |i, x| {
                *x += 1;
                i
            });
            assert_eq!(got, (0..n).collect::<Vec<_>>());
            assert_eq!(v, (1..=n).collect::<Vec<_>>());
        }
        assert_eq!(join(|| 1, || 2), (1, 2));
    }
}
