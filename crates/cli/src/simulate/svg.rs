//! A hit-rate-versus-capacity chart as a hand-written SVG: one line per policy, the
//! unbounded cache's ceiling dashed, capacity on a log axis when it spans a wide range.

use std::fmt::Write as _;

/// One line of the chart.
pub struct Series {
    /// Legend name.
    pub name: String,
    /// `(capacity in blocks, hit rate)` points, by capacity.
    pub points: Vec<(u64, f64)>,
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 150.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A capacity for an axis label: 8192 → "8K", 49152 → "48K", 1572864 → "1.5M".
fn short(n: u64) -> String {
    let (v, unit) = if n >= 1 << 20 {
        (n as f64 / (1u64 << 20) as f64, "M")
    } else if n >= 1 << 10 {
        (n as f64 / 1024.0, "K")
    } else {
        (n as f64, "")
    };
    if (v - v.round()).abs() < 1e-9 {
        format!("{}{unit}", v.round())
    } else {
        format!("{v:.1}{unit}")
    }
}

/// The chart; `ceiling` draws the unbounded cache's hit rate.
pub fn chart(title: &str, y_label: &str, series: &[Series], ceiling: Option<f64>) -> String {
    let caps: Vec<u64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    let lo = caps.iter().copied().min().unwrap_or(1).max(1) as f64;
    let hi = caps.iter().copied().max().unwrap_or(1).max(1) as f64;
    let log = hi / lo >= 8.0;
    let (x0, x1) = if log {
        (lo.log2(), hi.log2())
    } else {
        (0.0, hi)
    };
    let span = if x1 > x0 { x1 - x0 } else { 1.0 };
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |c: f64| {
        let v = if log { c.log2() } else { c };
        if x1 > x0 {
            LEFT + (v - x0) / span * plot_w
        } else {
            LEFT + plot_w / 2.0
        }
    };
    let top_rate = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(ceiling)
        .fold(0.0f64, f64::max);
    // Some headroom above the highest point, in steps of 0.05.
    let y_max = ((top_rate * 1.04 * 20.0).ceil() / 20.0).clamp(0.1, 1.0);
    let y = |r: f64| TOP + plot_h - r / y_max * plot_h;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        s,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="26" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        LEFT + plot_w / 2.0,
        escape(title)
    );
    // Horizontal grid and y ticks every 0.05 or 0.1.
    let step = if y_max <= 0.5 { 0.05 } else { 0.1 };
    let ticks = (y_max / step).round() as u32;
    for i in 0..=ticks {
        let r = f64::from(i) * step;
        let py = y(r);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#e0e0e0"/>"##,
            LEFT + plot_w
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{r:.2}</text>"#,
            LEFT - 6.0,
            py + 4.0
        );
    }
    // X ticks at the capacities simulated (thinned when crowded).
    let mut distinct = caps.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let mut last_px = f64::NEG_INFINITY;
    for &c in &distinct {
        let px = x(c as f64);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{:.1}" x2="{px:.1}" y2="{:.1}" stroke="#e0e0e0"/>"##,
            TOP,
            TOP + plot_h
        );
        if px - last_px >= 34.0 {
            let _ = writeln!(
                s,
                r#"<text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                TOP + plot_h + 18.0,
                short(c)
            );
            last_px = px;
        }
    }
    // Axes and their labels.
    let _ = writeln!(
        s,
        r##"<path d="M{LEFT},{TOP} V{:.1} H{:.1}" fill="none" stroke="#333333"/>"##,
        TOP + plot_h,
        LEFT + plot_w
    );
    let scale = if log { ", log scale" } else { "" };
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">cache capacity (blocks{scale})</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 16.0
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">{}</text>"#,
        TOP + plot_h / 2.0,
        TOP + plot_h / 2.0,
        escape(y_label)
    );
    let mut legend_y = TOP + 10.0;
    let legend_x = LEFT + plot_w + 18.0;
    if let Some(c) = ceiling {
        let py = y(c);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#777777" stroke-dasharray="6 4"/>"##,
            LEFT + plot_w
        );
        let _ = writeln!(
            s,
            r##"<line x1="{legend_x}" y1="{legend_y}" x2="{:.1}" y2="{legend_y}" stroke="#777777" stroke-dasharray="6 4"/>"##,
            legend_x + 24.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}">ceiling {c:.3}</text>"#,
            legend_x + 30.0,
            legend_y + 4.0
        );
        legend_y += 20.0;
    }
    for (i, line) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let mut pts: Vec<(u64, f64)> = line.points.clone();
        pts.sort_by_key(|p| p.0);
        let path: Vec<String> = pts
            .iter()
            .map(|&(c, r)| format!("{:.1},{:.1}", x(c as f64), y(r)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for &(c, r) in &pts {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"><title>{} at {c} blocks: {r:.4}</title></circle>"#,
                x(c as f64),
                y(r),
                escape(&line.name)
            );
        }
        let _ = writeln!(
            s,
            r#"<line x1="{legend_x}" y1="{legend_y}" x2="{:.1}" y2="{legend_y}" stroke="{color}" stroke-width="2"/>"#,
            legend_x + 24.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
            legend_x + 30.0,
            legend_y + 4.0,
            escape(&line.name)
        );
        legend_y += 20.0;
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_has_a_line_per_series_and_escapes_text() {
        let series = vec![
            Series {
                name: "lru".into(),
                points: vec![(8192, 0.19), (1024, 0.05), (49152, 0.38)],
            },
            Series {
                name: "a<b".into(),
                points: vec![(8192, 0.4)],
            },
        ];
        let svg = chart("hits & misses", "hit rate", &series, Some(0.398));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("hits &amp; misses") && svg.contains("a&lt;b"));
        assert!(svg.contains("log scale") && svg.contains(">48K<"));
        assert_eq!(short(1_572_864), "1.5M");
    }
}
