//! Start-up calibration: this machine's single-thread `memcpy` rate on buffers larger than the
//! last-level cache, the yardstick of the payload rate (`ep bench` prints the ratio).

use std::time::{Duration, Instant};

/// Bytes per copy: larger than the last-level cache of this class of machine (32 MiB per EPYC
/// core complex), small enough to fault in quickly.
const BYTES: usize = 128 << 20;

/// The median rate in GB/s (10^9 bytes per second, bytes copied once) of back-to-back copies of
/// a 128 MiB buffer on this thread, over about `budget` (at least 5 copies, after one warm-up
/// copy that also faults the pages in).
#[must_use]
pub(crate) fn single_thread_gb_per_s(budget: Duration) -> f64 {
    let src = vec![0x5au8; BYTES];
    let mut dst = vec![0u8; BYTES];
    dst.copy_from_slice(&src);
    let mut rates = Vec::new();
    let start = Instant::now();
    while rates.len() < 5 || (start.elapsed() < budget && rates.len() < 1000) {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        let s = t.elapsed().as_secs_f64().max(1e-9);
        rates.push(BYTES as f64 / s / 1e9);
    }
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}
