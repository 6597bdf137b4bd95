//! Work over ranks spread on the host's cores (the verification of `ep bench`, the generation
//! of a workload): one helper for the scoped-thread loops, results always in rank order, a panic
//! in the work resumed on the caller.

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
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(move || {
                    let mut mine = Vec::new();
                    loop {
                        let d = next.fetch_add(1, Ordering::Relaxed);
                        if d >= n {
                            break mine;
                        }
                        mine.push((d, f(d)));
                    }
                })
            })
            .collect();
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
    let chunk = items.len().div_ceil(threads_for(items.len())).max(1);
    let f = &f;
    std::thread::scope(|sc| {
        let handles: Vec<_> = items
            .chunks_mut(chunk)
            .enumerate()
            .map(|(c, part)| {
                sc.spawn(move || {
                    part.iter_mut()
                        .enumerate()
                        .map(|(i, x)| f(c * chunk + i, x))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// `a()` on this thread and `b()` on another, at once.
pub(crate) fn join<A, B: Send>(a: impl FnOnce() -> A, b: impl FnOnce() -> B + Send) -> (A, B) {
    std::thread::scope(|sc| {
        let hb = sc.spawn(b);
        let ra = a();
        (
            ra,
            hb.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
        )
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
