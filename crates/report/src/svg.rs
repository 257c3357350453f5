//! Minimal SVG line charts (metric vs concurrency, or over time), written by hand so reports
//! need no plotting dependency. Output is deterministic: fixed sizes, fixed decimal
//! formatting. [`stack`] puts several charts one above the other in one document.

use std::fmt::Write;

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    /// (x, y); a `None` y leaves a gap.
    pub points: Vec<(f64, Option<f64>)>,
    pub color: &'static str,
    pub dashed: bool,
}

/// A horizontal threshold line (an SLO).
#[derive(Debug, Clone)]
pub struct Threshold {
    pub value: f64,
    pub label: String,
}

/// A chart's text and scale.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    pub threshold: Option<Threshold>,
    /// Start the y axis at zero (otherwise just below the smallest value).
    pub y_from_zero: bool,
}

/// A shaded stretch of the x axis with a label at its top (a phase).
#[derive(Debug, Clone)]
pub struct Band {
    pub from: f64,
    pub to: f64,
    pub label: String,
}

/// A vertical line at `x` with a short label (an event).
#[derive(Debug, Clone)]
pub struct Marker {
    pub x: f64,
    pub label: String,
    pub color: &'static str,
}

/// What a time chart draws besides its series: bands (alternately shaded) under them,
/// markers over them.
#[derive(Debug, Clone, Default)]
pub struct Annotations {
    pub bands: Vec<Band>,
    pub markers: Vec<Marker>,
}

/// Colours for successive routers, then for references.
pub const PALETTE: [&str; 6] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;
/// Up to this many distinct x values each get a tick (concurrency levels); more (a time
/// series) get evenly spaced ticks.
const MAX_DATA_TICKS: usize = 20;
/// Series with more points than this are drawn without a marker per point (a lone point
/// between gaps keeps its marker, or it would not show).
const MAX_MARKED_POINTS: usize = 60;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" step (1, 2 or 5 × 10^k) giving about `n` intervals over `span`.
fn nice_step(span: f64, n: f64) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / n;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn fmt_tick(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10().floor()) as usize
    };
    format!("{v:.decimals$}")
}

/// `charts` one above the other in one SVG document.
pub fn stack(charts: &[Chart]) -> String {
    let height = H * charts.len() as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="12">"#
    );
    for (i, chart) in charts.iter().enumerate() {
        let _ = writeln!(s, r#"<g transform="translate(0 {:.1})">"#, H * i as f64);
        chart.body(&mut s, None);
        s.push_str("</g>\n");
    }
    s.push_str("</svg>\n");
    s
}

/// [`stack`] with the same bands and markers on every chart (their x axes are the same
/// when the charts' series share their x values).
pub fn stack_annotated(charts: &[Chart], annotations: &Annotations) -> String {
    let height = H * charts.len() as f64;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}" font-family="sans-serif" font-size="12">"#
    );
    for (i, chart) in charts.iter().enumerate() {
        let _ = writeln!(s, r#"<g transform="translate(0 {:.1})">"#, H * i as f64);
        chart.body(&mut s, Some(annotations));
        s.push_str("</g>\n");
    }
    s.push_str("</svg>\n");
    s
}

impl Chart {
    /// The chart as a standalone SVG document.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        self.body(&mut s, None);
        s.push_str("</svg>\n");
        s
    }

    /// The chart's elements, drawn in a `W × H` box at the origin.
    fn body(&self, s: &mut String, annotations: Option<&Annotations>) {
        let xs: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        let mut ys: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter_map(|p| p.1))
            .filter(|y| y.is_finite())
            .collect();
        if let Some(t) = &self.threshold {
            ys.push(t.value);
        }
        let (x_min, x_max) = min_max(&xs).unwrap_or((0.0, 1.0));
        let (y_lo, y_hi) = min_max(&ys).unwrap_or((0.0, 1.0));
        let y_span = (y_hi - y_lo).max(y_hi.abs() * 0.05).max(1e-9);
        let step = nice_step(
            if self.y_from_zero {
                y_hi.max(1e-9)
            } else {
                y_span
            },
            5.0,
        );
        let y_min = if self.y_from_zero {
            0.0
        } else {
            let below = ((y_lo - y_span * 0.1) / step).floor() * step;
            // Non-negative data never gets a negative axis.
            if y_lo >= 0.0 { below.max(0.0) } else { below }
        };
        let y_max = ((y_hi + y_span * 0.05) / step).ceil() * step;
        let y_max = if y_max <= y_min { y_min + step } else { y_max };
        let x_span = if x_max > x_min { x_max - x_min } else { 1.0 };
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let px = |x: f64| LEFT + (x - x_min) / x_span * pw;
        let py = |y: f64| TOP + (1.0 - (y - y_min) / (y_max - y_min)) * ph;

        let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let clip = |x: f64| x.clamp(x_min, x_min + x_span);
        for (i, band) in annotations.iter().flat_map(|a| &a.bands).enumerate() {
            let (a, b) = (px(clip(band.from)), px(clip(band.to)));
            if b <= a {
                continue;
            }
            let fill = if i % 2 == 0 { "#f2f2f2" } else { "#ffffff" };
            let _ = writeln!(
                s,
                r#"<rect x="{a:.1}" y="{TOP:.1}" width="{:.1}" height="{ph:.1}" fill="{fill}"/>"#,
                b - a
            );
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" font-size="9" fill="#666" transform="rotate(90 {:.1} {:.1})">{}</text>"##,
                a + 3.0,
                TOP + 4.0,
                a + 3.0,
                TOP + 4.0,
                esc(&band.label)
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="22" font-size="15" font-weight="bold" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            esc(&self.title)
        );
        // Grid and y ticks.
        let mut v = y_min;
        let mut guard = 0;
        while v <= y_max + step * 1e-6 && guard < 50 {
            let y = py(v);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/>"##,
                LEFT + pw
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                y + 4.0,
                fmt_tick(v, step)
            );
            v += step;
            guard += 1;
        }
        // X ticks at the data's x values, or evenly spaced when there are many.
        let mut xt = xs.clone();
        xt.sort_by(f64::total_cmp);
        xt.dedup();
        let mut x_step = 1.0;
        if xt.len() > MAX_DATA_TICKS {
            x_step = nice_step(x_span, 8.0);
            let first = (x_min / x_step).ceil() as i64;
            let last = (x_max / x_step + 1e-9).floor() as i64;
            xt = (first..=last).map(|k| k as f64 * x_step).collect();
        }
        for x in &xt {
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                px(*x),
                TOP + ph + 18.0,
                fmt_tick(*x, x_step)
            );
        }
        let _ = writeln!(
            s,
            r##"<rect x="{LEFT:.1}" y="{TOP:.1}" width="{pw:.1}" height="{ph:.1}" fill="none" stroke="#444"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 12.0,
            esc(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">{}</text>"#,
            TOP + ph / 2.0,
            TOP + ph / 2.0,
            esc(&self.y_label)
        );
        if let Some(t) = &self.threshold {
            let y = py(t.value);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#000" stroke-width="1.5" stroke-dasharray="8 4"/>"##,
                LEFT + pw
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                LEFT + pw - 4.0,
                y - 5.0,
                esc(&t.label)
            );
        }
        for series in &self.series {
            let dash = if series.dashed {
                r#" stroke-dasharray="5 4""#
            } else {
                ""
            };
            let marked = series.points.len() <= MAX_MARKED_POINTS;
            // Consecutive present points form one polyline; a missing y breaks the line.
            for run in series
                .points
                .split(|p| p.1.is_none_or(|y| !y.is_finite()))
                .filter(|r| !r.is_empty())
            {
                let pts: Vec<String> = run
                    .iter()
                    .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y.unwrap_or(0.0))))
                    .collect();
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"{dash}/>"#,
                    pts.join(" "),
                    series.color
                );
                if !marked && run.len() > 1 {
                    continue;
                }
                for &(x, y) in run {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                        px(x),
                        py(y.unwrap_or(0.0)),
                        series.color
                    );
                }
            }
        }
        for marker in annotations.iter().flat_map(|a| &a.markers) {
            let x = px(clip(marker.x));
            let _ = writeln!(
                s,
                r#"<line x1="{x:.1}" y1="{TOP:.1}" x2="{x:.1}" y2="{:.1}" stroke="{}" stroke-width="1.5" stroke-dasharray="2 3"/>"#,
                TOP + ph,
                marker.color
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" font-size="10" fill="{}">{}</text>"#,
                x + 2.0,
                TOP + ph - 4.0,
                marker.color,
                esc(&marker.label)
            );
        }
        // Legend.
        for (i, series) in self.series.iter().enumerate() {
            let y = TOP + 10.0 + 20.0 * i as f64;
            let x = LEFT + pw + 14.0;
            let dash = if series.dashed {
                r#" stroke-dasharray="5 4""#
            } else {
                ""
            };
            let _ = writeln!(
                s,
                r#"<line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{}" stroke-width="2"{dash}/>"#,
                x + 24.0,
                series.color
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
                x + 30.0,
                y + 4.0,
                esc(&series.name)
            );
        }
    }
}

fn min_max(v: &[f64]) -> Option<(f64, f64)> {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo.is_finite() && hi.is_finite()).then_some((lo, hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nice_steps_are_one_two_five() {
        assert_eq!(nice_step(1000.0, 5.0), 200.0);
        assert_eq!(nice_step(3143.0, 5.0), 1000.0);
        assert_eq!(nice_step(0.12, 5.0), 0.05);
    }

    #[test]
    fn gaps_split_lines_and_text_is_escaped() {
        let chart = Chart {
            title: "a < b & c".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![Series {
                name: "s".into(),
                points: vec![
                    (1.0, Some(1.0)),
                    (2.0, None),
                    (3.0, Some(2.0)),
                    (4.0, Some(3.0)),
                ],
                color: PALETTE[0],
                dashed: false,
            }],
            threshold: None,
            y_from_zero: true,
        };
        let svg = chart.render();
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("a &lt; b &amp; c"));
        assert!(svg.ends_with("</svg>\n"));
    }

    #[test]
    fn time_series_get_spaced_ticks_no_markers_and_stack_in_one_document() {
        let series = |color| Series {
            name: "s".into(),
            points: (1..=360)
                .map(|t| (f64::from(t), Some(f64::from(t % 70))))
                .collect(),
            color,
            dashed: false,
        };
        let chart = Chart {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series: vec![series(PALETTE[0])],
            threshold: Some(Threshold {
                value: 64.0,
                label: "max_num_seqs 64".into(),
            }),
            y_from_zero: true,
        };
        let one = chart.render();
        // Ticks every 50 s (50..350), not one per sample; no marker per point.
        let ticks = one.matches(r#"text-anchor="middle">"#).count() - 2; // minus title, x label
        assert_eq!(ticks, 7, "{one}");
        assert_eq!(one.matches("<circle").count(), 0);
        let both = stack(&[chart.clone(), chart]);
        assert_eq!(both.matches("<svg").count(), 1);
        assert_eq!(both.matches("<g transform").count(), 2);
        assert!(both.contains(r#"height="840""#));
        assert!(both.contains(r#"translate(0 420.0)"#));
        assert!(both.ends_with("</g>\n</svg>\n"));
    }
}
