//! The kernels' phase stamps as figures: medians per phase, the critical path to the offsets,
//! and the last-ending block's tail split into its steps.

use crate::bench::report::median;

/// Median over blocks (of every rank) of the time from stamp `slots[i-1]` (0 first) to
/// `slots[i]`, then the whole span (earliest start to latest end), in microseconds.
pub(in crate::bench) fn phase_split(stamps: &[Vec<Vec<u64>>], slots: &[usize]) -> Vec<f64> {
    let blocks: Vec<&Vec<u64>> = stamps.iter().flatten().filter(|b| b[0] != 0).collect();
    let mut out = Vec::with_capacity(slots.len() + 1);
    let mut prev = 0;
    for &s in slots {
        let d: Vec<f64> = blocks
            .iter()
            .filter(|b| b[s] >= b[prev] && b[s] != 0)
            .map(|b| (b[s] - b[prev]) as f64 * 1e-3)
            .collect();
        out.push(median(&d));
        prev = s;
    }
    let start = blocks.iter().map(|b| b[0]).min().unwrap_or(0);
    let end = blocks
        .iter()
        .map(|b| b[*slots.last().unwrap_or(&0)])
        .max()
        .unwrap_or(0);
    out.push(end.saturating_sub(start) as f64 * 1e-3);
    out
}

/// Microseconds from the earliest block start (stamp 0) of any rank to a stamp.
pub(in crate::bench) fn since_first_start(stamps: &[Vec<Vec<u64>>]) -> impl Fn(u64) -> f64 {
    let t0 = stamps
        .iter()
        .flatten()
        .map(|b| b[0])
        .filter(|&v| v != 0)
        .min()
        .unwrap_or(0);
    move |v: u64| v.saturating_sub(t0) as f64 * 1e-3
}

/// Where a measured dispatch's offsets become known, per rank, in microseconds from the
/// earliest block start of any rank: the rank's first block start, its notify block's expert
/// parts fenced (stamp 6), every head word acquired (7) and table ready (1), then over its blocks
/// the median and last "offsets known" (1), the median "rows stored" (2) and the last end (5).
pub(in crate::bench) fn dispatch_path(stamps: &[Vec<Vec<u64>>]) -> String {
    let us = since_first_start(stamps);
    stamps
        .iter()
        .enumerate()
        .map(|(r, blocks)| {
            let live: Vec<&Vec<u64>> = blocks.iter().filter(|b| b[0] != 0).collect();
            let Some(b0) = live.first() else {
                return format!("rank {r}: no stamps");
            };
            let col = |s: usize| -> Vec<f64> {
                live.iter().filter(|b| b[s] != 0).map(|b| us(b[s])).collect()
            };
            let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
            let first = col(0).iter().copied().fold(f64::INFINITY, f64::min);
            let steps: Vec<String> = (0..b0.len())
                .map(|i| format!("{i}:{:.1}", if b0[i] == 0 { 0.0 } else { us(b0[i]) }))
                .collect();
            format!(
                "rank {r} [block 0 stamps {}]: start {first:.1}..{:.1}, experts {:.1}, heads {:.1}, table {:.1}, offsets median {:.1} last {:.1}, rows median {:.1}, end {:.1}",
                steps.join(" "),
                max(&col(0)),
                us(b0[6]),
                us(b0[7]),
                us(b0[1]),
                median(&col(1)),
                max(&col(1)),
                median(&col(2)),
                max(&col(5)),
            )
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// Where a measured dispatch's last blocks spend their time, per rank: the quantiles over blocks
/// of the rows phase (stamp 1 to 2) and of the receive wait (3 to 4), then the rank's
/// last-ending block (stamp 5) split into its start, offsets known, rows stored, done released,
/// done acquired and end, in microseconds from the earliest block start of any rank. Says
/// whether the blocks' spread comes from their row work, from waiting for another rank's
/// channel, or from a late start.
pub(in crate::bench) fn dispatch_tail(stamps: &[Vec<Vec<u64>>]) -> String {
    let us = since_first_start(stamps);
    let q = |v: &mut Vec<f64>, f: f64| -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * f).round() as usize]
    };
    stamps
        .iter()
        .enumerate()
        .map(|(r, blocks)| {
            let live: Vec<(usize, &Vec<u64>)> = blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| b[0] != 0 && b[5] != 0)
                .collect();
            let Some(&(last, lb)) = live.iter().max_by_key(|(_, b)| b[5]) else {
                return format!("rank {r}: no stamps");
            };
            let span = |a: usize, b: usize| -> Vec<f64> {
                live.iter()
                    .filter(|(_, x)| x[b] >= x[a] && x[a] != 0)
                    .map(|(_, x)| (x[b] - x[a]) as f64 * 1e-3)
                    .collect()
            };
            let (mut rows, mut wait) = (span(1, 2), span(3, 4));
            format!(
                "rank {r}: rows took p10 {:.1} p50 {:.1} p90 {:.1} max {:.1}, done wait p50 {:.1} max {:.1}; last block {last}: start {:.1}, offsets {:.1}, rows {:.1}, released {:.1}, acquired {:.1}, end {:.1}",
                q(&mut rows, 0.1),
                q(&mut rows, 0.5),
                q(&mut rows, 0.9),
                q(&mut rows, 1.0),
                q(&mut wait, 0.5),
                q(&mut wait, 1.0),
                us(lb[0]),
                us(lb[1]),
                us(lb[2]),
                us(lb[3]),
                us(lb[4]),
                us(lb[5]),
            )
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stamps of one block: slot i at `base + at[i]` ns (0 = not reached).
    fn block(base: u64, at: &[u64]) -> Vec<u64> {
        let mut b = vec![0u64; 16];
        for (i, &t) in at.iter().enumerate() {
            b[i] = if t == u64::MAX { 0 } else { base + t };
        }
        b
    }

    #[test]
    fn phases_are_medians_over_blocks_and_the_span_covers_every_rank() {
        // Two ranks of two blocks; rank 1 starts 1 us later.
        let stamps = vec![
            vec![
                block(10_000, &[0, 2_000, 9_000]),
                block(10_000, &[0, 4_000, 11_000]),
            ],
            vec![
                block(11_000, &[0, 2_000, 8_000]),
                block(11_000, &[0, 2_000, 8_000]),
            ],
        ];
        let p = phase_split(&stamps, &[1, 2]);
        // Phase 1 durations 2, 4, 2, 2 us; phase 2: 7, 7, 6, 6.
        assert_eq!(p.len(), 3);
        assert!((p[0] - 2.0).abs() < 1e-9, "{p:?}");
        assert!((p[1] - 6.5).abs() < 1e-9, "{p:?}");
        // First start 10 us, last slot-2 stamp 21 us.
        assert!((p[2] - 11.0).abs() < 1e-9, "{p:?}");
    }

    #[test]
    fn the_tail_names_the_last_block_and_splits_it() {
        // Rank 0: block 1 ends last (25 us) because it waited 12 us for done; block 0's rows
        // took 8 us, block 1's 4 us. Times in us from the first start (rank 0, block 0).
        let ranks = vec![vec![
            block(1_000, &[0, 2_000, 10_000, 11_000, 12_000, 14_000]),
            block(1_000, &[1_000, 3_000, 7_000, 8_000, 20_000, 25_000]),
        ]];
        let line = dispatch_tail(&ranks);
        assert!(
            line.contains("rows took p10 4.0 p50 8.0 p90 8.0 max 8.0"),
            "{line}"
        );
        assert!(line.contains("done wait p50 12.0 max 12.0"), "{line}");
        assert!(
            line.contains("last block 1: start 1.0, offsets 3.0, rows 7.0, released 8.0, acquired 20.0, end 25.0"),
            "{line}"
        );
        assert!(dispatch_tail(&[vec![vec![0u64; 16]]]).contains("rank 0: no stamps"));
    }

    #[test]
    fn the_critical_path_is_relative_to_the_first_start_of_any_rank() {
        let mut b0 = block(5_000, &[0, 9_000, 20_000, 0, 0, 30_000, 4_000, 6_000]);
        b0[3] = 0;
        b0[4] = 0;
        let stamps = vec![
            vec![b0, block(5_000, &[500, 7_000, 19_000, 0, 0, 31_000])],
            vec![block(
                4_000,
                &[0, 8_000, 18_000, 0, 0, 29_000, 3_000, 6_500],
            )],
        ];
        let line = dispatch_path(&stamps);
        let ranks: Vec<&str> = line.split(" | ").collect();
        assert_eq!(ranks.len(), 2, "{line}");
        // Rank 0 starts 1 us after rank 1; its notify block fenced its expert parts at 5 us and
        // had every head word at 7 us; its blocks knew their offsets at 10 and 8 us (median 9).
        assert!(ranks[0].contains("start 1.0..1.5"), "{line}");
        assert!(
            ranks[0].contains("experts 5.0, heads 7.0, table 10.0"),
            "{line}"
        );
        assert!(ranks[0].contains("offsets median 9.0 last 10.0"), "{line}");
        assert!(ranks[0].contains("end 32.0"), "{line}");
        assert!(
            ranks[1].starts_with("rank 1 [block 0 stamps 0:0.0 1:8.0"),
            "{line}"
        );
        // A rank with no stamps says so.
        assert!(dispatch_path(&[vec![vec![0u64; 16]]]).contains("rank 0: no stamps"));
    }
}
