//! The low-latency dispatch's phase stamps as figures: its steps, the send parts' ends, the
//! signals and the waits.

use crate::bench::report::median;

/// One plain dispatch's steps, median over the blocks of all ranks: the routing split into the
/// expert ids arriving (stamp 0 to 11) and counted (11 to 7) and the slots ranked (7 to 1), the
/// send part into the rows — warp 0's first unit arriving after the routing (1 to 8) and its
/// stores (8 to 9) —, positions (9 to 10) and meta records (10 to 2); then, in microseconds
/// from the earliest block start, when the blocks' send parts end (median and last, stamp 2),
/// when the last block's signals are out (3) and when the receive parts' waits end (median and
/// last, 5): the wait a receiver sees is the send parts' spread plus the signal's trip; and per
/// rank its blocks' starts (0) and receive ends (6), median and last.
pub(super) fn dispatch_detail(stamps: &[Vec<Vec<u64>>]) -> String {
    let blocks: Vec<&Vec<u64>> = stamps.iter().flatten().filter(|b| b[0] != 0).collect();
    let step = |a: usize, b: usize| -> f64 {
        let d: Vec<f64> = blocks
            .iter()
            .filter(|x| x[a] != 0 && x[b] >= x[a])
            .map(|x| (x[b] - x[a]) as f64 * 1e-3)
            .collect();
        median(&d)
    };
    let us = crate::bench::gpu::since_first_start(stamps);
    let (ends, sig, waited) = (
        times(&us, &blocks, 2),
        times(&us, &blocks, 3),
        times(&us, &blocks, 5),
    );
    let per_rank = rank_spread(stamps, 6);
    format!(
        "ids {:.2} (arrived {:.2} + counted {:.2}) + slots {:.2}; rows {:.2} (first unit arrived {:.2} + stored {:.2}) + positions {:.2} + metas {:.2}; send parts end median {:.2} last {:.2}, signals out {:.2}, waits end median {:.2} last {:.2} (us from the first block start); median/last: {}",
        step(0, 7),
        step(0, 11),
        step(11, 7),
        step(7, 1),
        step(1, 9),
        step(1, 8),
        step(8, 9),
        step(9, 10),
        step(10, 2),
        median(&ends),
        last(&ends),
        last(&sig),
        median(&waited),
        last(&waited),
        per_rank,
    )
}

/// Per rank, the spread of its blocks' starts (stamp 0) and ends (stamp `end`: a receive
/// part's end), median/last in us from the earliest block start of any rank: what of a span the
/// median steps do not hold (a late kernel, late blocks, a slow last block). A rank whose
/// kernel starts later than the others' by the same amount in the zero-token dispatch as in the
/// full one is late at its launch, not by its work.
pub(super) fn rank_spread(stamps: &[Vec<Vec<u64>>], end: usize) -> String {
    let us = crate::bench::gpu::since_first_start(stamps);
    stamps
        .iter()
        .enumerate()
        .map(|(r, rank)| {
            let started: Vec<&Vec<u64>> = rank.iter().filter(|b| b[0] != 0).collect();
            let (starts, done) = (times(&us, &started, 0), times(&us, &started, end));
            format!(
                "rank {r} starts {:.2}/{:.2} receive ends {:.2}/{:.2}",
                median(&starts),
                last(&starts),
                median(&done),
                last(&done)
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Stamp `s` of the blocks in `of` that reached it, in us from the first block start (`us`:
/// `since_first_start`).
fn times(us: &impl Fn(u64) -> f64, of: &[&Vec<u64>], s: usize) -> Vec<f64> {
    of.iter().filter(|x| x[s] != 0).map(|x| us(x[s])).collect()
}

/// The latest of `v`, 0 when empty.
fn last(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatch's steps: medians over the blocks of every rank for the step durations, and
    /// times from the first block start for the send ends, the signals and the waits.
    #[test]
    fn the_dispatch_steps_split_the_send_part_and_time_its_ends() {
        // Stamps in ns; slots 0 start, 11 first id arrived, 7 ids counted, 1 slots, 8 first
        // rows unit arrived, 9 rows, 10 positions, 2 metas, 3 the last block's signals, 4
        // receive start, 5 waits end.
        let blk = |at: &[(usize, u64)]| {
            let mut b = vec![0u64; 16];
            for &(i, t) in at {
                b[i] = 100_000 + t;
            }
            b
        };
        let stamps = vec![
            vec![
                blk(&[
                    (0, 0),
                    (11, 1_500),
                    (7, 2_000),
                    (1, 2_500),
                    (8, 3_500),
                    (9, 6_500),
                    (10, 8_500),
                    (2, 9_000),
                    (4, 9_000),
                    (5, 18_000),
                ]),
                blk(&[
                    (0, 0),
                    (11, 2_500),
                    (7, 3_000),
                    (1, 3_500),
                    (8, 4_500),
                    (9, 7_500),
                    (10, 9_500),
                    (2, 10_000),
                    (4, 10_000),
                    (5, 18_500),
                ]),
            ],
            vec![
                // Rank 1 starts 2 us later; its block 0 is the last block (signals at 17 us).
                blk(&[
                    (0, 2_000),
                    (11, 3_500),
                    (7, 4_000),
                    (1, 4_500),
                    (8, 5_500),
                    (9, 9_500),
                    (10, 11_500),
                    (2, 14_000),
                    (3, 17_000),
                    (4, 17_000),
                    (5, 19_000),
                    (6, 20_000),
                ]),
            ],
        ];
        let line = dispatch_detail(&stamps);
        assert!(
            line.contains("ids 2.00 (arrived 1.50 + counted 0.50) + slots 0.50"),
            "{line}"
        );
        assert!(
            line.contains(
                "rows 4.00 (first unit arrived 1.00 + stored 3.00) + positions 2.00 + metas 0.50"
            ),
            "{line}"
        );
        assert!(
            line.contains("send parts end median 10.00 last 14.00"),
            "{line}"
        );
        assert!(line.contains("signals out 17.00"), "{line}");
        assert!(line.contains("waits end median 18.50 last 19.00"), "{line}");
        // Per rank: its blocks' starts and receive ends (rank 0 stamped no receive end: an
        // empty set's median and last are 0).
        assert!(
            line.contains("rank 0 starts 0.00/0.00 receive ends 0.00/0.00"),
            "{line}"
        );
        assert!(
            line.contains("rank 1 starts 2.00/2.00 receive ends 20.00/20.00"),
            "{line}"
        );
    }
}
