//! The bench's printed rows (per SM count: every call against its ceiling).

use super::timing::Figure;

#[derive(Clone, Default, serde::Serialize)]
pub(super) struct SmRow {
    pub(super) sms_per_rank: usize,
    pub(super) dispatch: Figure,
    pub(super) dispatch_with_layout: Figure,
    /// The dispatch without top-k (no meta but src_idx): isolates the count exchange against
    /// `cached`, which has none.
    pub(super) dispatch_no_topk: Figure,
    pub(super) cached: Figure,
    pub(super) combine: Figure,
    pub(super) ceiling_dispatch: Figure,
    pub(super) ceiling_combine: Figure,
    pub(super) layout_us: f64,
    /// Dispatch, one measured call: median over blocks of each phase (offsets known, rows
    /// stored, done released, done acquired, meta copied), and the whole kernel (first start to
    /// last end over every rank), microseconds.
    pub(super) dispatch_phases_us: Vec<f64>,
    /// Combine likewise: y_ready acquired, rows reduced, pulled exchanged; whole kernel.
    pub(super) combine_phases_us: Vec<f64>,
    /// Host time to enqueue every local rank's call (median over all calls, warm-up included),
    /// microseconds: cached dispatch, combine. Neither waits on the device.
    pub(super) host_enqueue_us: [f64; 2],
}

pub(super) fn print_row(row: &SmRow, fp8: bool) {
    let p = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);
    println!(
        "[gpu {} SMs/rank] dispatch phases (median over blocks, us): offsets {:.1}, rows {:.1}, done release {:.1}, done wait {:.1}, meta {:.1}; kernel span {:.1} | combine: y_ready {:.1}, reduce {:.1}, pulled {:.1}; span {:.1}",
        row.sms_per_rank,
        p(&row.dispatch_phases_us, 0),
        p(&row.dispatch_phases_us, 1),
        p(&row.dispatch_phases_us, 2),
        p(&row.dispatch_phases_us, 3),
        p(&row.dispatch_phases_us, 4),
        p(&row.dispatch_phases_us, 5),
        p(&row.combine_phases_us, 0),
        p(&row.combine_phases_us, 1),
        p(&row.combine_phases_us, 2),
        p(&row.combine_phases_us, 3),
    );
    let ratio = |ceil: Figure, f: Figure| {
        if f.median_us > 0.0 {
            ceil.median_us / f.median_us
        } else {
            0.0
        }
    };
    println!(
        "[gpu {} SMs/rank] dispatch {}: {:.1} GB/s per rank, {:.1} us ({:.0}% of the same-run ceiling {:.1} GB/s) | with layout {:.1} us ({:.0}%) | layout {:.1} us | no top-k {:.1} us | cached {:.1} GB/s, {:.1} us ({:.0}%)",
        row.sms_per_rank,
        if fp8 { "FP8" } else { "BF16" },
        row.dispatch.gb_per_s,
        row.dispatch.median_us,
        100.0 * ratio(row.ceiling_dispatch, row.dispatch),
        row.ceiling_dispatch.gb_per_s,
        row.dispatch_with_layout.median_us,
        100.0 * ratio(row.ceiling_dispatch, row.dispatch_with_layout),
        row.layout_us,
        row.dispatch_no_topk.median_us,
        row.cached.gb_per_s,
        row.cached.median_us,
        100.0 * ratio(row.ceiling_dispatch, row.cached),
    );
    println!("{}", combine_line(row));
    println!(
        "[gpu {} SMs/rank] host enqueue of every local rank's call (p50): cached dispatch {:.1} us, combine {:.1} us",
        row.sms_per_rank, row.host_enqueue_us[0], row.host_enqueue_us[1]
    );
}

/// The combine's figure line: its ratio to the same-run ceiling, or why there is none (after an
/// FP8 dispatch the combine ceiling, which reads BF16 dispatch rows, is not measured).
pub(super) fn combine_line(row: &SmRow) -> String {
    let head = format!(
        "[gpu {} SMs/rank] combine BF16: {:.1} GB/s per rank, {:.1} us",
        row.sms_per_rank, row.combine.gb_per_s, row.combine.median_us
    );
    if row.ceiling_combine.median_us > 0.0 && row.combine.median_us > 0.0 {
        format!(
            "{head} ({:.0}% of the same-run ceiling {:.1} GB/s)",
            100.0 * row.ceiling_combine.median_us / row.combine.median_us,
            row.ceiling_combine.gb_per_s
        )
    } else {
        format!("{head} (no same-run ceiling: it reads BF16 dispatch rows, this run's are FP8)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_combine_line_says_why_it_has_no_ratio() {
        let fig = |us: f64, gbs: f64| Figure {
            median_us: us,
            gb_per_s: gbs,
        };
        let mut row = SmRow {
            sms_per_rank: 24,
            combine: fig(138.1, 847.3),
            ..SmRow::default()
        };
        let line = combine_line(&row);
        assert!(
            line.contains("847.3 GB/s per rank, 138.1 us (no same-run ceiling"),
            "{line}"
        );
        assert!(!line.contains("NaN"), "{line}");
        row.ceiling_combine = fig(121.5, 963.0);
        let line = combine_line(&row);
        assert!(
            line.ends_with("(88% of the same-run ceiling 963.0 GB/s)"),
            "{line}"
        );
    }
}
