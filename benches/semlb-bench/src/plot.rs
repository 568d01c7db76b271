//! SVG plots of distributions: empirical CDFs of several series on one
//! chart, one chart per panel, side by side (plotters' SVG backend, so no
//! font or image library is needed).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::coord::ranged1d::{Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// One distribution: a label and its samples (any order, any unit).
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// The samples.
    pub values: Vec<f64>,
}

/// One chart: CDFs of its series.
#[derive(Debug, Clone)]
pub struct Panel {
    /// Chart title.
    pub title: String,
    /// X-axis label, with the unit.
    pub x_label: String,
    /// Logarithmic x axis (for latencies spanning decades).
    pub log_x: bool,
    /// The distributions.
    pub series: Vec<Series>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// The points of `values`' empirical CDF, at most about 400 of them.
fn cdf_points(values: &[f64], log_x: bool) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values
        .iter()
        .copied()
        .filter(|x| x.is_finite() && (!log_x || *x > 0.0))
        .collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let step = n.div_ceil(400).max(1);
    let mut out: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (v[i], (i + 1) as f64 / n as f64))
        .collect();
    if let Some(last) = v.last() {
        out.push((*last, 1.0));
    }
    out
}

/// Writes `panels` side by side as one SVG file at `path`.
pub fn cdf_svg(path: &Path, panels: &[Panel]) -> Result<()> {
    if panels.is_empty() {
        return Ok(());
    }
    let width = 560 * panels.len() as u32;
    let root = SVGBackend::new(path, (width, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
    let areas = root.split_evenly((1, panels.len()));
    for (panel, area) in panels.iter().zip(areas) {
        draw(panel, &area).map_err(|e| anyhow!("plot {:?}: {e}", panel.title))?;
    }
    root.present().map_err(|e| anyhow!("plot: {e}"))?;
    Ok(())
}

fn draw<DB: DrawingBackend>(panel: &Panel, area: &DrawingArea<DB, plotters::coord::Shift>) -> Result<(), String> {
    let curves: Vec<(&str, Vec<(f64, f64)>)> = panel
        .series
        .iter()
        .map(|s| (s.label.as_str(), cdf_points(&s.values, panel.log_x)))
        .filter(|(_, p)| !p.is_empty())
        .collect();
    let lo = curves
        .iter()
        .flat_map(|(_, p)| p.first())
        .map(|p| p.0)
        .fold(f64::INFINITY, f64::min);
    let hi = curves
        .iter()
        .flat_map(|(_, p)| p.last())
        .map(|p| p.0)
        .fold(0.0, f64::max);
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (if panel.log_x { 1.0 } else { 0.0 }, 10.0)
    };
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(&panel.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50);
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    if panel.log_x {
        let chart = builder
            .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0)
            .map_err(err)?;
        draw_curves(chart, &panel.x_label, curves)
    } else {
        let chart = builder.build_cartesian_2d(lo..hi, 0.0..1.0).map_err(err)?;
        draw_curves(chart, &panel.x_label, curves)
    }
}

/// Draws the mesh, one line per curve and the legend on `chart`, whatever
/// its x axis (linear or logarithmic).
fn draw_curves<'a, DB: DrawingBackend + 'a, X>(
    mut chart: ChartContext<'a, DB, Cartesian2d<X, RangedCoordf64>>,
    x_label: &str,
    curves: Vec<(&str, Vec<(f64, f64)>)>,
) -> Result<(), String>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc("share of requests")
        .draw()
        .map_err(err)?;
    for (i, (label, points)) in curves.into_iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// `v` with an SI suffix and at most three significant digits: `950`,
/// `12.5k`, `1.2M`, `3G` (axis labels).
pub fn short_number(v: f64) -> String {
    let (scaled, suffix) = match v.abs() {
        a if a >= 1e9 => (v / 1e9, "G"),
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    let text = if scaled.abs() >= 100.0 || scaled.fract() == 0.0 {
        format!("{scaled:.0}")
    } else if scaled.abs() >= 10.0 {
        format!("{scaled:.1}")
    } else {
        format!("{scaled:.2}")
    };
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    };
    format!("{text}{suffix}")
}

/// One curve of a [`line_svg`] chart: a label and its `(x, y)` points.
#[derive(Debug, Clone)]
pub struct Line {
    /// Legend text.
    pub label: String,
    /// The points, in x order.
    pub points: Vec<(f64, f64)>,
}

/// Writes one line chart (with a marker on every point) to `path`: `lines`
/// over a linear x axis, a logarithmic y axis when `log_y` (non-positive
/// values are then left out). For curves such as throughput over process
/// counts.
pub fn line_svg(path: &Path, title: &str, x_label: &str, y_label: &str, log_y: bool, lines: &[Line]) -> Result<()> {
    let root = SVGBackend::new(path, (640, 440)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e}"))?;
    draw_lines(&root, title, x_label, y_label, log_y, lines).map_err(|e| anyhow!("plot {title:?}: {e}"))?;
    root.present().map_err(|e| anyhow!("plot: {e}"))?;
    Ok(())
}

fn draw_lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    log_y: bool,
    lines: &[Line],
) -> Result<(), String> {
    let curves: Vec<(&str, Vec<(f64, f64)>)> = lines
        .iter()
        .map(|l| {
            let points = l
                .points
                .iter()
                .copied()
                .filter(|(x, y)| x.is_finite() && y.is_finite() && (!log_y || *y > 0.0))
                .collect();
            (l.label.as_str(), points)
        })
        .collect();
    let all = || curves.iter().flat_map(|(_, p)| p.iter());
    let (x_lo, x_hi) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.0), hi.max(p.0))
    });
    let (y_lo, y_hi) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let (x_lo, x_hi) = if x_lo.is_finite() && x_hi > x_lo {
        let pad = (x_hi - x_lo) * 0.05;
        (x_lo - pad, x_hi + pad)
    } else if x_lo.is_finite() {
        (x_lo - 1.0, x_hi + 1.0)
    } else {
        (0.0, 1.0)
    };
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70);
    let x_ticks = (2.0 * (x_hi - x_lo)).ceil().clamp(2.0, 40.0) as usize;
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    macro_rules! finish {
        ($chart:expr) => {{
            let chart = &mut $chart;
            chart
                .configure_mesh()
                .x_desc(x_label)
                .y_desc(y_label)
                .x_labels(x_ticks)
                .x_label_formatter(&|x: &f64| {
                    if x.fract() == 0.0 {
                        format!("{x:.0}")
                    } else {
                        String::new()
                    }
                })
                .y_label_formatter(&|y: &f64| short_number(*y))
                .draw()
                .map_err(err)?;
            for (i, (label, points)) in curves.iter().enumerate() {
                let color = COLORS[i % COLORS.len()];
                chart
                    .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
                    .map_err(err)?
                    .label(*label)
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
                chart
                    .draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))
                    .map_err(err)?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::MiddleRight)
                .draw()
                .map_err(err)?;
        }};
    }
    if log_y {
        let (lo, hi) = if y_lo.is_finite() && y_hi >= y_lo {
            (y_lo / 2.0, y_hi * 2.0)
        } else {
            (1.0, 10.0)
        };
        let mut chart = builder
            .build_cartesian_2d(x_lo..x_hi, (lo..hi).log_scale())
            .map_err(err)?;
        finish!(chart);
    } else {
        let hi = if y_hi.is_finite() && y_hi > 0.0 {
            y_hi * 1.1
        } else {
            1.0
        };
        let mut chart = builder.build_cartesian_2d(x_lo..x_hi, 0.0..hi).map_err(err)?;
        finish!(chart);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_points_end_at_one_and_rise() {
        let p = cdf_points(&[3.0, 1.0, 2.0, f64::NAN], false);
        assert_eq!(p, vec![(1.0, 1.0 / 3.0), (2.0, 2.0 / 3.0), (3.0, 1.0), (3.0, 1.0)]);
        assert!(
            cdf_points(&[0.0, -1.0], true).is_empty(),
            "log axes drop non-positive samples"
        );
        let many: Vec<f64> = (0..10_000).map(f64::from).collect();
        assert!(cdf_points(&many, false).len() <= 402);
    }

    #[test]
    fn writes_an_svg_with_every_label() {
        let dir = std::env::temp_dir().join(format!("semlb-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("cdf.svg");
        let panel = |log_x| Panel {
            title: "dispatch".into(),
            x_label: "µs".into(),
            log_x,
            series: vec![
                Series {
                    label: "shm".into(),
                    values: vec![1.0, 2.0, 3.0],
                },
                Series {
                    label: "redis".into(),
                    values: vec![100.0, 120.0, 400.0],
                },
            ],
        };
        cdf_svg(&path, &[panel(true), panel(false)]).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40.min(svg.len())]);
        for label in ["\nshm\n", "\nredis\n", "\ndispatch\n", "\nshare of requests\n"] {
            assert!(svg.contains(label), "{label:?} missing");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    #[test]
    fn writes_a_line_chart_with_every_label() {
        let dir = std::env::temp_dir().join(format!("semlb-plot-lines-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lines.svg");
        let lines = vec![
            Line {
                label: "shm".into(),
                points: vec![(1.0, 2e6), (2.0, 4e6), (4.0, 4.1e6)],
            },
            Line {
                label: "redis".into(),
                points: vec![(1.0, 1e4), (2.0, 0.0), (4.0, 2e4)],
            },
        ];
        for log_y in [true, false] {
            line_svg(&path, "scaling", "processes", "decisions/s", log_y, &lines).unwrap();
            let svg = std::fs::read_to_string(&path).unwrap();
            assert!(svg.starts_with("<svg"));
            for label in ["\nshm\n", "\nredis\n", "\nscaling\n", "\ndecisions/s\n"] {
                assert!(svg.contains(label), "{label:?} missing");
            }
        }
        line_svg(&path, "empty", "x", "y", true, &[]).unwrap();
        assert_eq!(short_number(950.0), "950");
        assert_eq!(short_number(12_500.0), "12.5k");
        assert_eq!(short_number(1_000_000.0), "1M");
        assert_eq!(short_number(2_340_000.0), "2.34M");
        assert_eq!(short_number(0.5), "0.5");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
