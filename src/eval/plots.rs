//! An experiment's plots: the answer's error against the failures injected,
//! predictions' accuracy and log-loss over the run (logistic regression), and,
//! for sweeps, backups and throughput against Θ and against L; a distributed
//! learner's loss over items and over time. Each is
//! drawn as SVG (plotters' SVG backend) and rendered to PNG beside it with
//! resvg and the system's fonts.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use resvg::{tiny_skia, usvg};

use super::convergence::{ConvergenceReport, CurvePoint};
use super::exact::{Comparison, PredictionWindow};
use super::experiment::{ExperimentReport, RunOutcome};

/// A named line of (x, y) points.
type Series = (String, Vec<(f64, f64)>);
/// A number read off a run.
type Measure = fn(&RunOutcome) -> f64;
/// The line a run belongs on.
type Label = fn(&RunOutcome) -> String;

/// The one number a run's comparison is plotted by, and its name.
pub fn accuracy(comparison: &Comparison) -> Option<(&'static str, f64)> {
    match comparison {
        Comparison::PerKey { l1_error, .. } => Some(("L1 error of the latest outputs", *l1_error)),
        Comparison::HeavyHitters { f1, .. } => Some(("heavy hitters' F1", *f1)),
        Comparison::Matches { difference, .. } => Some(("output lines off", difference.unsigned_abs() as f64)),
        Comparison::Predictions { accuracy, .. } => Some(("prediction accuracy", *accuracy)),
        Comparison::Join {
            count_relative_error, ..
        } => count_relative_error.map(|e| ("join COUNT relative error", e)),
    }
}

/// Writes the plots the report has data for into `dir`; returns their paths.
pub fn write_plots(report: &ExperimentReport, dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut written = Vec::new();
    let mut plotter = Plotter::new();
    let key = |run: &RunOutcome| format!("Θ={} L={}", run.theta, run.max_uncovered);
    // Error against failures, a line per (Θ, L).
    let mut lines: Vec<Series> = Vec::new();
    let mut metric = "error";
    for run in &report.runs {
        let Some((name, value)) = accuracy(&run.comparison) else {
            continue;
        };
        metric = name;
        let label = key(run);
        match lines.iter_mut().find(|(l, _)| *l == label) {
            Some((_, points)) => points.push((run.failures_injected as f64, value)),
            None => lines.push((label, vec![(run.failures_injected as f64, value)])),
        }
    }
    if lines.iter().any(|(_, points)| points.len() > 1) {
        let path = dir.join("accuracy-vs-failures.svg");
        let title = format!("{}: {metric} against failures", report.kind);
        plotter.plot(path, &title, ("failures injected", metric), &lines, &mut written)?;
    }
    // Predictions over the run, a line per run (logistic regression).
    for (what, file, y) in [
        (
            "prediction accuracy",
            "accuracy-over-time.svg",
            (|w: &PredictionWindow| w.accuracy) as fn(&PredictionWindow) -> f64,
        ),
        ("log-loss", "log-loss-over-time.svg", |w: &PredictionWindow| w.log_loss),
    ] {
        let series: Vec<Series> = report
            .runs
            .iter()
            .filter_map(|run| match &run.comparison {
                Comparison::Predictions { over_time, .. } if !over_time.is_empty() => Some((
                    run.label.clone(),
                    over_time.iter().map(|w| (w.progress, y(w))).collect(),
                )),
                _ => None,
            })
            .collect();
        if !series.is_empty() {
            let title = format!("{}: {what} over the run", report.kind);
            plotter.plot(
                dir.join(file),
                &title,
                ("share of the run", what),
                &series,
                &mut written,
            )?;
        }
    }
    // Failure-free runs against Θ (a line per L) and against L (a line per Θ).
    let clean: Vec<&RunOutcome> = report.runs.iter().filter(|r| r.failures_injected == 0).collect();
    let sweeps: [(&str, Measure, Label); 2] = [
        ("theta", |r| r.theta.log10(), |r| format!("L={}", r.max_uncovered)),
        ("l", |r| (r.max_uncovered as f64).log10(), |r| format!("Θ={}", r.theta)),
    ];
    for (name, x, line) in sweeps {
        let xs: Vec<f64> = clean.iter().map(|r| x(r)).collect();
        if xs.iter().all(|v| (v - xs[0]).abs() < 1e-12) {
            continue;
        }
        let axis = if name == "theta" { "log10 Θ" } else { "log10 L" };
        for (what, y) in [
            ("backups", (|r: &RunOutcome| r.backups as f64) as Measure),
            ("items per second", |r: &RunOutcome| r.items_per_second),
        ] {
            let mut series: Vec<Series> = Vec::new();
            for run in &clean {
                let label = line(run);
                let point = (x(run), y(run));
                match series.iter_mut().find(|(l, _)| *l == label) {
                    Some((_, points)) => points.push(point),
                    None => series.push((label, vec![point])),
                }
            }
            let file = format!("{}-vs-{name}.svg", what.replace(' ', "-"));
            let title = format!("{}, failure-free: {what} against {}", report.kind, &axis[6..]);
            plotter.plot(dir.join(file), &title, (axis, what), &series, &mut written)?;
        }
    }
    Ok(written)
}

/// Draws plots as SVG and renders them to PNG with the system's fonts, loaded once.
struct Plotter {
    options: usvg::Options<'static>,
    warned: bool,
}

impl Plotter {
    fn new() -> Self {
        let mut options = usvg::Options::default();
        let fonts = options.fontdb_mut();
        fonts.load_system_fonts();
        // plotters asks for the generic sans-serif family, which fontdb maps to
        // Arial unless told otherwise: map it (and the default) to a sans-serif
        // family that is installed.
        let family = {
            let families: Vec<&str> = fonts
                .faces()
                .flat_map(|face| face.families.iter().map(|(name, _)| name.as_str()))
                .collect();
            ["DejaVu Sans", "Liberation Sans", "Noto Sans", "FreeSans", "Arial"]
                .into_iter()
                .find(|wanted| families.contains(wanted))
                .or_else(|| {
                    families
                        .iter()
                        .copied()
                        .find(|name| name.contains("Sans") && !name.contains("Mono"))
                })
                .or_else(|| families.first().copied())
                .map(str::to_string)
        };
        if let Some(family) = &family {
            fonts.set_sans_serif_family(family.clone());
            options.font_family = family.clone();
        }
        Plotter { options, warned: false }
    }

    /// Draws the series as SVG at `path` and renders it as PNG beside it;
    /// adds what it wrote to `written` (nothing when there is no point).
    fn plot(
        &mut self,
        path: PathBuf,
        title: &str,
        (x_label, y_label): (&str, &str),
        series: &[Series],
        written: &mut Vec<PathBuf>,
    ) -> Result<(), String> {
        if line_plot(&path, title, x_label, y_label, series)? {
            written.extend(self.render(&path)?);
            written.push(path);
        }
        Ok(())
    }

    /// Whether plotters' labels will find a font.
    fn has_font(&self) -> bool {
        let query = usvg::fontdb::Query {
            families: &[usvg::fontdb::Family::SansSerif],
            ..Default::default()
        };
        self.options.fontdb.query(&query).is_some()
    }

    /// Writes `svg` as PNG beside it and returns the PNG's path; none without
    /// a system font, since every label would be missing (the SVG has them).
    fn render(&mut self, svg: &Path) -> Result<Option<PathBuf>, String> {
        if !self.has_font() {
            if !self.warned {
                self.warned = true;
                tracing::warn!(
                    "no system fonts: the plots are written as SVG only (a sans-serif font such as Debian's \
                     fonts-dejavu-core gives PNG too)"
                );
            }
            return Ok(None);
        }
        let error = |e: &dyn std::fmt::Display| format!("rendering {} as PNG: {e}", svg.display());
        let data = std::fs::read(svg).map_err(|e| error(&e))?;
        let tree = usvg::Tree::from_data(&data, &self.options).map_err(|e| error(&e))?;
        let size = tree.size().to_int_size();
        let mut pixmap =
            tiny_skia::Pixmap::new(size.width(), size.height()).ok_or_else(|| error(&"the plot has no area"))?;
        pixmap.fill(tiny_skia::Color::WHITE);
        resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
        let png = svg.with_extension("png");
        let bytes = pixmap.encode_png().map_err(|e| error(&e))?;
        std::fs::write(&png, bytes).map_err(|e| error(&e))?;
        Ok(Some(png))
    }
}

/// A labelled axis of a convergence plot: what it reads off each point.
type CurveAxis = (&'static str, fn(&CurvePoint) -> f64);

/// A convergence plot: its file, title and axes.
type ConvergencePlot = (&'static str, &'static str, CurveAxis, CurveAxis);

/// A distributed learner's convergence: the workers' loss over items and over
/// time, and the L1 norm of the weights over items, a line per run.
pub fn write_convergence_plots(report: &ConvergenceReport, dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut written = Vec::new();
    let mut plotter = Plotter::new();
    let plots: [ConvergencePlot; 3] = [
        (
            "loss-over-items.svg",
            "training loss over items",
            ("items trained on", |p| p.items as f64),
            ("workers' mean iteration log-loss", |p| p.loss),
        ),
        (
            "loss-over-time.svg",
            "training loss over time",
            ("seconds", |p| p.seconds),
            ("workers' mean iteration log-loss", |p| p.loss),
        ),
        (
            "weights-l1-over-items.svg",
            "L1 norm of the global model over items",
            ("items trained on", |p| p.items as f64),
            ("L1 norm of the weights", |p| p.weights_l1),
        ),
    ];
    for (file, title, (x_label, x), (y_label, y)) in plots {
        let series: Vec<Series> = report
            .runs
            .iter()
            .map(|run| (run.label.clone(), run.curve.iter().map(|p| (x(p), y(p))).collect()))
            .collect();
        let title = format!("distributed SGD: {title}");
        plotter.plot(dir.join(file), &title, (x_label, y_label), &series, &mut written)?;
    }
    Ok(written)
}

/// Draws the series as lines with points; returns false, drawing nothing, when
/// there is no point.
fn line_plot(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Result<bool, String> {
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0f64);
    for &(x, y) in points {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        return Ok(false);
    }
    let pad = ((x1 - x0) * 0.05).max(0.5);
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    let error = |e: &dyn std::fmt::Display| format!("plotting {}: {e}", path.display());
    let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| error(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(75)
        .build_cartesian_2d((x0 - pad)..(x1 + pad), 0f64..y1)
        .map_err(|e| error(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| error(&e))?;
    for (i, (name, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut points = points.clone();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
            .map_err(|e| error(&e))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| error(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| error(&e))?;
    root.present().map_err(|e| error(&e))?;
    Ok(true)
}
