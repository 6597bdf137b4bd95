//! `--plot`: GB/s against SMs per rank with the ceilings and DeepEP's one-GPU figures, as SVG.

use std::fmt::Write as _;
use std::path::Path;

use super::report::SmRow;
use crate::bench::error::BenchError;

/// DeepEP V1 on one H200, 2 ranks as 2 processes under MPS (BASELINES.md): (SMs per rank, BF16
/// dispatch, FP8 dispatch, combine) GB/s per rank.
pub(super) const DEEPEP_ONE_GPU: [(usize, f64, f64, f64); 4] = [
    (24, 307.0, 231.0, 252.0),
    (32, 391.0, 286.0, 316.0),
    (48, 445.0, 351.0, 367.0),
    (64, 463.0, 398.0, 428.0),
];

/// GB/s per rank against SMs per rank: ep-rs's calls, the same-run ceilings (dashed) and
/// DeepEP V1's one-GPU figures (BASELINES.md; 2 ranks under MPS) as points.
pub(super) fn plot(path: &Path, rows: &[SmRow], fp8: bool, ranks: usize) -> Result<(), BenchError> {
    let (w, h, m) = (720.0, 440.0, 60.0);
    let max_x = rows
        .iter()
        .map(|r| r.sms_per_rank)
        .max()
        .unwrap_or(64)
        .max(64) as f64;
    let max_y = rows
        .iter()
        .flat_map(|r| {
            [
                r.dispatch.gb_per_s,
                r.combine.gb_per_s,
                r.ceiling_dispatch.gb_per_s,
                r.ceiling_combine.gb_per_s,
            ]
        })
        .fold(500.0, f64::max)
        * 1.1;
    let x = |v: f64| m + v / max_x * (w - 2.0 * m);
    let y = |v: f64| h - m - v / max_y * (h - 2.0 * m);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<line x1="{m}" y1="{}" x2="{}" y2="{}" stroke="black"/><line x1="{m}" y1="{m}" x2="{m}" y2="{}" stroke="black"/>"#,
        h - m,
        w - m,
        h - m,
        h - m
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">SMs per rank</text>"#,
        w / 2.0,
        h - 20.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">GB/s per rank (DeepEP bytes)</text>"#,
        h / 2.0,
        h / 2.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{m}" y="24">ep-rs normal mode, {ranks} co-resident ranks on one GPU ({})</text>"#,
        if fp8 { "FP8 dispatch" } else { "BF16" }
    );
    for i in 0..=4 {
        let v = max_y * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{v:.0}</text>"#,
            m - 6.0,
            y(v) + 4.0
        );
    }
    for r in rows {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            x(r.sms_per_rank as f64),
            h - m + 16.0,
            r.sms_per_rank
        );
    }
    type Series = (&'static str, &'static str, bool, fn(&SmRow) -> f64);
    let series: [Series; 4] = [
        ("dispatch", "#1f77b4", false, |r| r.dispatch.gb_per_s),
        ("combine", "#d62728", false, |r| r.combine.gb_per_s),
        ("ceiling dispatch", "#1f77b4", true, |r| {
            r.ceiling_dispatch.gb_per_s
        }),
        ("ceiling combine", "#d62728", true, |r| {
            r.ceiling_combine.gb_per_s
        }),
    ];
    for (i, (name, color, dashed, f)) in series.iter().enumerate() {
        let pts: Vec<String> = rows
            .iter()
            .filter(|r| f(r) > 0.0)
            .map(|r| format!("{:.1},{:.1}", x(r.sms_per_rank as f64), y(f(r))))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let dash = if *dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
            pts.join(" ")
        );
        let ly = 44.0 + 16.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{}">{name}</text>"#,
            w - 230.0,
            w - 200.0,
            w - 195.0,
            ly + 4.0
        );
    }
    for (sms, bf, f8, comb) in DEEPEP_ONE_GPU {
        for (v, color) in [(if fp8 { f8 } else { bf }, "#1f77b4"), (comb, "#d62728")] {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="none" stroke="{color}"/>"#,
                x(sms as f64),
                y(v)
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<circle cx="{}" cy="108" r="4" fill="none" stroke="black"/><text x="{}" y="112">DeepEP V1, 1 GPU, 2 ranks (MPS)</text>"#,
        w - 215.0,
        w - 195.0
    );
    s.push_str("</svg>\n");
    std::fs::write(path, s)
        .map_err(|e| BenchError::Usage(format!("writing {}: {e}", path.display())))
}
