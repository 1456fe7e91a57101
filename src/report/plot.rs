//! The report's SVG figures, drawn with plotters' SVG backend.
//!
//! This module owns what each figure shows (which series, smoothing, bands,
//! markers) and how it is laid out: a title, one or more panels, and a
//! legend strip to the right of the panels, so the legend never covers
//! data. Every run keeps its colour in every figure. Script reloads and
//! version changes are drawn in a "marker lane" above the success range
//! (y > 1), again so labels never cover data.
//!
//! Text stays SVG `<text>` (no font rasterising), so the figures build
//! without system fonts and render in any browser.

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::{
    moving_average, quantile, script_marks, smoothing_window, Mark, MarkKind, ReportError, Run,
};

/// One SVG figure of the report.
#[derive(Debug, Clone)]
pub struct Figure {
    /// File name inside the output folder, e.g. `success_train.svg`.
    pub file: String,
    pub title: String,
    /// What the figure shows, how it is smoothed, what markers mean.
    pub caption: String,
    pub svg: String,
}

/// Tableau 10: distinct, colour-blind-friendly, readable on white.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
];

/// The colour of the i-th run (cycles past ten runs).
pub fn run_color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

const FONT: &str = "sans-serif";
const KEY_GREY: RGBColor = RGBColor(0x55, 0x55, 0x55);
const LEGEND_W: u32 = 250;
const PLOT_W: u32 = 880;
const PANEL_H: u32 = 360;
const TITLE_H: u32 = 44;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stroke {
    Solid,
    Dashed,
    /// Thin and pale: raw per-step values under a smoothed curve.
    Faint,
}

struct Line {
    run: usize,
    points: Vec<(f64, f64)>,
    stroke: Stroke,
    markers: bool,
}

/// A filled range between two curves over one contiguous stretch of steps.
struct Band {
    run: usize,
    lower: Vec<(f64, f64)>,
    upper: Vec<(f64, f64)>,
}

#[derive(Clone, Copy)]
enum YRange {
    /// Success rates and ratios.
    Unit,
    /// From 0 to a little above the largest value.
    FromZero,
}

struct Panel {
    title: String,
    x_desc: String,
    y_desc: String,
    y_range: YRange,
    y_fmt: fn(f64) -> String,
    lines: Vec<Line>,
    bands: Vec<Band>,
    marks: Vec<(usize, Mark)>,
}

impl Panel {
    fn new(title: impl Into<String>, y_desc: impl Into<String>, y_range: YRange) -> Self {
        Panel {
            title: title.into(),
            x_desc: "training step".into(),
            y_desc: y_desc.into(),
            y_range,
            y_fmt: fmt_auto,
            lines: Vec::new(),
            bands: Vec::new(),
            marks: Vec::new(),
        }
    }

    fn line(&mut self, run: usize, points: Vec<(f64, f64)>, stroke: Stroke, markers: bool) {
        if !points.is_empty() {
            self.lines.push(Line {
                run,
                points,
                stroke,
                markers,
            });
        }
    }

    fn is_empty(&self) -> bool {
        self.lines.is_empty() && self.bands.is_empty()
    }
}

/// What the legend strip explains besides the run colours.
#[derive(Clone, Copy)]
enum Key {
    Line(Stroke, &'static str),
    Markers(&'static str),
    Band(&'static str),
}

struct Layout {
    rows: usize,
    cols: usize,
    /// Pixel height of one panel row.
    panel_h: u32,
}

impl Layout {
    fn single() -> Self {
        Layout {
            rows: 1,
            cols: 1,
            panel_h: PANEL_H,
        }
    }

    fn pair() -> Self {
        Layout {
            rows: 1,
            cols: 2,
            panel_h: PANEL_H,
        }
    }
}

fn fmt_auto(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e3 {
        let k = v / 1e3;
        if (k - k.round()).abs() < 1e-9 {
            format!("{k:.0}k")
        } else {
            format!("{k:.1}k")
        }
    } else if v.fract() == 0.0 || a >= 10.0 {
        format!("{v:.0}")
    } else {
        // 0.8, 2.5, 0.25: no trailing zeros.
        let t = if a < 0.1 {
            format!("{v:.3}")
        } else {
            format!("{v:.2}")
        };
        t.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn fmt_step(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{:.0}", v.round())
    } else {
        format!("{v:.1}")
    }
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

fn stroke_style(color: RGBColor, stroke: Stroke) -> ShapeStyle {
    match stroke {
        Stroke::Solid | Stroke::Dashed => ShapeStyle {
            color: color.to_rgba(),
            filled: false,
            stroke_width: 2,
        },
        Stroke::Faint => ShapeStyle {
            color: color.mix(0.3),
            filled: false,
            stroke_width: 1,
        },
    }
}

/// The step range shared by all panels of a figure, so they line up.
fn x_range(runs: &[Run]) -> (f64, f64) {
    let mut hi = 0u64;
    for r in runs {
        let last = r.steps.iter().map(|s| s.step);
        let evals = r.evals.iter().map(|e| e.step);
        let marks = script_marks(r).into_iter().map(|m| m.step);
        hi = hi.max(last.chain(evals).chain(marks).max().unwrap_or(0));
    }
    (0.0, (hi as f64).max(1.0))
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn draw_err(figure: &str) -> impl Fn(String) -> ReportError + '_ {
    move |msg| ReportError::Plot {
        figure: figure.to_string(),
        msg,
    }
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Render one figure: title, panels in a grid, legend on the right.
#[allow(clippy::too_many_arguments)]
fn render(
    runs: &[Run],
    file: &str,
    title: &str,
    caption: String,
    layout: Layout,
    panels: &[Panel],
    keys: &[Key],
    x: (f64, f64),
) -> Result<Figure, ReportError> {
    // Every figure has the same width, so text comes out the same size
    // in every figure of the page.
    let plot_w = PLOT_W;
    let size = (
        plot_w + LEGEND_W,
        TITLE_H + layout.rows as u32 * layout.panel_h,
    );
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        let draw = || -> Result<(), String> {
            root.fill(&WHITE).map_err(s)?;
            let body = root.titled(title, (FONT, 22)).map_err(s)?;
            let (plots, legend) = body.split_horizontally(plot_w);
            let cells = plots.split_evenly((layout.rows, layout.cols));
            for (cell, panel) in cells.iter().zip(panels) {
                draw_panel(cell, panel, x)?;
            }
            let any_marks = panels.iter().any(|p| !p.marks.is_empty());
            draw_legend(&legend, runs, keys, any_marks)?;
            root.present().map_err(s)
        };
        draw().map_err(draw_err(file))?;
    }
    Ok(Figure {
        file: file.to_string(),
        title: title.to_string(),
        caption,
        svg,
    })
}

fn draw_panel(area: &Area, p: &Panel, x: (f64, f64)) -> Result<(), String> {
    let (y0, y1) = match p.y_range {
        YRange::Unit => (0.0, 1.0),
        YRange::FromZero => {
            let max = p
                .lines
                .iter()
                .flat_map(|l| l.points.iter().map(|q| q.1))
                .chain(p.bands.iter().flat_map(|b| b.upper.iter().map(|q| q.1)))
                .fold(0.0f64, f64::max);
            (0.0, if max > 0.0 { max * 1.08 } else { 1.0 })
        }
    };
    // Room above the data for reload markers and their labels.
    let lane = if p.marks.is_empty() {
        0.0
    } else {
        (y1 - y0) * 0.32
    };
    let top = y1 + lane;
    let mut builder = ChartBuilder::on(area);
    // A single-panel figure's title says it all; no panel caption then.
    if !p.title.is_empty() {
        builder.caption(&p.title, (FONT, 16));
    }
    let mut chart = builder
        .margin(10)
        .margin_right(18)
        .x_label_area_size(42)
        .y_label_area_size(62)
        .build_cartesian_2d(x.0..x.1, y0..top)
        .map_err(s)?;
    let y_fmt = p.y_fmt;
    let hide_above = y1 + (y1 - y0) * 1e-6;
    chart
        .configure_mesh()
        .x_desc(p.x_desc.as_str())
        .y_desc(p.y_desc.as_str())
        .x_labels(10)
        .y_labels(8)
        .x_label_formatter(&fmt_step)
        // Ticks in the marker lane would suggest values above the range.
        .y_label_formatter(&|v: &f64| {
            if *v > hide_above {
                String::new()
            } else {
                y_fmt(*v)
            }
        })
        .bold_line_style(BLACK.mix(0.09))
        .light_line_style(BLACK.mix(0.03))
        .axis_desc_style((FONT, 14))
        .label_style((FONT, 12))
        .draw()
        .map_err(s)?;

    if p.is_empty() {
        chart
            .plotting_area()
            .draw(&Text::new(
                "no data in these runs",
                ((x.0 + x.1) / 2.0, (y0 + y1) / 2.0),
                TextStyle::from((FONT, 15).into_font())
                    .color(&KEY_GREY)
                    .pos(Pos::new(HPos::Center, VPos::Center)),
            ))
            .map_err(s)?;
    }

    for b in &p.bands {
        let mut poly = b.lower.clone();
        poly.extend(b.upper.iter().rev());
        chart
            .draw_series(std::iter::once(Polygon::new(
                poly,
                run_color(b.run).mix(0.16).filled(),
            )))
            .map_err(s)?;
    }
    // Faint lines first so the bold ones sit on top.
    let mut lines: Vec<&Line> = p.lines.iter().collect();
    lines.sort_by_key(|l| l.stroke != Stroke::Faint);
    for l in lines {
        let c = run_color(l.run);
        let style = stroke_style(c, l.stroke);
        match l.stroke {
            Stroke::Dashed => {
                chart
                    .draw_series(DashedLineSeries::new(l.points.iter().copied(), 7, 5, style))
                    .map_err(s)?;
            }
            _ => {
                chart
                    .draw_series(LineSeries::new(l.points.iter().copied(), style))
                    .map_err(s)?;
            }
        }
        if l.markers {
            let hollow = l.stroke == Stroke::Dashed;
            chart
                .draw_series(l.points.iter().map(|&pt| {
                    if hollow {
                        Circle::new(pt, 4, ShapeStyle::from(&WHITE).filled())
                    } else {
                        Circle::new(pt, 4, c.filled())
                    }
                }))
                .map_err(s)?;
            if hollow {
                chart
                    .draw_series(
                        l.points
                            .iter()
                            .map(|&pt| Circle::new(pt, 4, c.stroke_width(2))),
                    )
                    .map_err(s)?;
            }
        }
    }

    if !p.marks.is_empty() {
        // The lane's floor.
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(x.0, y1), (x.1, y1)],
                BLACK.mix(0.25),
            )))
            .map_err(s)?;
    }
    for (run, m) in &p.marks {
        let c = run_color(*run);
        let xm = m.step as f64;
        let label_style = TextStyle::from((FONT, 11).into_font())
            .transform(FontTransform::Rotate270)
            .color(&c);
        match m.kind {
            MarkKind::Reload => {
                chart
                    .draw_series(std::iter::once(PathElement::new(
                        vec![(xm, y0), (xm, y1 + lane * 0.08)],
                        c.mix(0.6).stroke_width(1),
                    )))
                    .map_err(s)?;
            }
            MarkKind::ScriptChange => {
                chart
                    .draw_series(DashedLineSeries::new(
                        vec![(xm, y0), (xm, y1 + lane * 0.08)],
                        2,
                        4,
                        c.mix(0.7).stroke_width(1),
                    ))
                    .map_err(s)?;
            }
            MarkKind::Rejected | MarkKind::Reverted => {
                chart
                    .draw_series(std::iter::once(Cross::new(
                        (xm, y1 + lane * 0.08),
                        5,
                        c.stroke_width(2),
                    )))
                    .map_err(s)?;
            }
        }
        // Labels read upwards from just above the lane floor.
        let at = (xm, y1 + lane * 0.16);
        chart
            .draw_series(std::iter::once(
                EmptyElement::at(at) + Text::new(m.label.clone(), (-1, 0), label_style),
            ))
            .map_err(s)?;
    }
    Ok(())
}

fn draw_legend(area: &Area, runs: &[Run], keys: &[Key], marks: bool) -> Result<(), String> {
    fn text<'a>(
        t: &str,
        at: (i32, i32),
        color: &'a RGBColor,
        size: u32,
    ) -> Text<'a, (i32, i32), String> {
        Text::new(
            t.to_string(),
            at,
            TextStyle::from((FONT, size).into_font())
                .color(color)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        )
    }
    let (x0, x1, xt) = (12, 44, 52);
    let mut y = 40;
    area.draw(&text("runs", (x0, y), &BLACK, 14)).map_err(s)?;
    y += 24;
    for (i, r) in runs.iter().enumerate() {
        let c = run_color(i);
        area.draw(&PathElement::new(vec![(x0, y), (x1, y)], c.stroke_width(4)))
            .map_err(s)?;
        area.draw(&text(&truncate(&r.name, 26), (xt, y), &BLACK, 13))
            .map_err(s)?;
        y += 22;
    }
    if !keys.is_empty() || marks {
        y += 12;
        area.draw(&text("key", (x0, y), &BLACK, 14)).map_err(s)?;
        y += 24;
    }
    for k in keys {
        let label = match *k {
            Key::Line(stroke, label) => {
                let mut st = stroke_style(KEY_GREY, stroke);
                if stroke == Stroke::Faint {
                    // Pale grey on white barely shows at legend size.
                    st.color = KEY_GREY.mix(0.5);
                }
                if stroke == Stroke::Dashed {
                    area.draw(&PathElement::new(vec![(x0, y), (x0 + 10, y)], st))
                        .map_err(s)?;
                    area.draw(&PathElement::new(vec![(x0 + 16, y), (x0 + 26, y)], st))
                        .map_err(s)?;
                    area.draw(&PathElement::new(vec![(x0 + 32, y), (x1, y)], st))
                        .map_err(s)?;
                } else {
                    area.draw(&PathElement::new(vec![(x0, y), (x1, y)], st))
                        .map_err(s)?;
                }
                label
            }
            Key::Markers(label) => {
                area.draw(&PathElement::new(
                    vec![(x0, y), (x1, y)],
                    stroke_style(KEY_GREY, Stroke::Solid),
                ))
                .map_err(s)?;
                area.draw(&Circle::new(((x0 + x1) / 2, y), 4, KEY_GREY.filled()))
                    .map_err(s)?;
                label
            }
            Key::Band(label) => {
                area.draw(&Rectangle::new(
                    [(x0, y - 7), (x1, y + 7)],
                    KEY_GREY.mix(0.2).filled(),
                ))
                .map_err(s)?;
                area.draw(&PathElement::new(
                    vec![(x0, y), (x1, y)],
                    stroke_style(KEY_GREY, Stroke::Solid),
                ))
                .map_err(s)?;
                label
            }
        };
        area.draw(&text(label, (xt, y), &BLACK, 12)).map_err(s)?;
        y += 22;
    }
    if marks {
        let grey = KEY_GREY.stroke_width(1);
        let mid = (x0 + x1) / 2;
        area.draw(&PathElement::new(vec![(mid, y - 8), (mid, y + 8)], grey))
            .map_err(s)?;
        area.draw(&text("reload (new hash)", (xt, y), &BLACK, 12))
            .map_err(s)?;
        y += 22;
        for dy in [-8, -2, 4] {
            area.draw(&PathElement::new(
                vec![(mid, y + dy), (mid, y + dy + 2)],
                grey,
            ))
            .map_err(s)?;
        }
        area.draw(&text("hash change, no reload log", (xt, y), &BLACK, 12))
            .map_err(s)?;
        y += 22;
        area.draw(&Cross::new((mid, y), 5, KEY_GREY.stroke_width(2)))
            .map_err(s)?;
        area.draw(&text("rejected / reverted reload", (xt, y), &BLACK, 12))
            .map_err(s)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The figures

/// Marks of every run, tagged with the run's index (colour).
fn all_marks(runs: &[Run]) -> Vec<(usize, Mark)> {
    runs.iter()
        .enumerate()
        .flat_map(|(i, r)| script_marks(r).into_iter().map(move |m| (i, m)))
        .collect()
}

/// The caption sentence about reload markers ("" when no run has any).
fn mark_note(marks: &[(usize, Mark)]) -> &'static str {
    if marks.is_empty() {
        ""
    } else {
        MARK_NOTE
    }
}

const MARK_NOTE: &str = " Above the plotted range: script versions. A solid vertical line is a \
    successful hot reload, drawn at the first step that uses it and labelled with the new \
    version's hash; a dotted line is a script-hash change between consecutive steps that no \
    reload record explains; a cross is a rejected or reverted reload (the old version stayed).";

/// All figures, in report order. Same runs give the same SVG bytes.
pub fn figures(runs: &[Run]) -> Result<Vec<Figure>, ReportError> {
    let x = x_range(runs);
    let longest = runs.iter().map(|r| r.steps.len()).max().unwrap_or(0);
    let w = smoothing_window(longest);
    let marks = all_marks(runs);
    Ok(vec![
        success_train(runs, x, w, &marks)?,
        success_test(runs, x, &marks)?,
        success_regions(runs, x, &marks)?,
        depth(runs, x, w)?,
        rollouts(runs, x)?,
        wall_time(runs, x)?,
        throughput(runs, x, w)?,
    ])
}

fn smoothed(points: &[(f64, f64)], w: usize) -> Vec<(f64, f64)> {
    let ys: Vec<f64> = points.iter().map(|p| p.1).collect();
    points
        .iter()
        .zip(moving_average(&ys, w))
        .map(|(p, m)| (p.0, m))
        .collect()
}

/// How a per-step curve is smoothed, for captions.
fn smoothing_note(w: usize) -> String {
    if w == 1 {
        "unsmoothed (the longest run is too short to average)".into()
    } else {
        format!("smoothed with a trailing moving average over {w} steps (bold; raw values faint)")
    }
}

fn steps_window(w: usize) -> String {
    if w == 1 {
        "1 step (no smoothing)".into()
    } else {
        format!("{w} steps")
    }
}

fn success_train(
    runs: &[Run],
    x: (f64, f64),
    w: usize,
    marks: &[(usize, Mark)],
) -> Result<Figure, ReportError> {
    let mut p = Panel::new("", "success rate", YRange::Unit);
    for (i, r) in runs.iter().enumerate() {
        let raw: Vec<(f64, f64)> = r
            .steps
            .iter()
            .filter_map(|s| Some((s.step as f64, s.success?)))
            .collect();
        p.line(i, smoothed(&raw, w), Stroke::Solid, false);
        if w > 1 {
            p.line(i, raw, Stroke::Faint, false);
        }
    }
    p.marks = marks.to_vec();
    let keys = if w > 1 {
        vec![
            Key::Line(Stroke::Solid, "moving average"),
            Key::Line(Stroke::Faint, "per step"),
        ]
    } else {
        vec![Key::Line(Stroke::Solid, "per step")]
    };
    render(
        runs,
        "success_train.svg",
        "Train success",
        format!(
            "Success of the trained rollouts at each training step (`success`), {}.{}",
            smoothing_note(w),
            mark_note(marks)
        ),
        Layout::single(),
        &[p],
        &keys,
        x,
    )
}

fn success_test(
    runs: &[Run],
    x: (f64, f64),
    marks: &[(usize, Mark)],
) -> Result<Figure, ReportError> {
    let mut p = Panel::new("", "success rate", YRange::Unit);
    for (i, r) in runs.iter().enumerate() {
        let pts: Vec<(f64, f64)> = r
            .evals_of("test")
            .filter_map(|e| Some((e.step as f64, e.success?)))
            .collect();
        p.line(i, pts, Stroke::Solid, true);
    }
    p.marks = marks.to_vec();
    render(
        runs,
        "success_test.svg",
        "Test-panel success",
        format!(
            "Success on the test panel at each evaluation (`eval.jsonl`, panel \"test\"), \
             unsmoothed.{}",
            mark_note(marks)
        ),
        Layout::single(),
        &[p],
        &[Key::Markers("evaluation")],
        x,
    )
}

fn success_regions(
    runs: &[Run],
    x: (f64, f64),
    marks: &[(usize, Mark)],
) -> Result<Figure, ReportError> {
    let has_region = |panel: &str| {
        runs.iter().any(|r| {
            r.evals_of(panel)
                .any(|e| e.success_in_region.is_some() || e.success_out_region.is_some())
        })
    };
    let mut panels_shown = vec!["test"];
    if has_region("train") {
        panels_shown.push("train");
    }
    let mut panels = Vec::new();
    for name in &panels_shown {
        let mut p = Panel::new(format!("{name} panel"), "success rate", YRange::Unit);
        for (i, r) in runs.iter().enumerate() {
            let pts = |f: fn(&super::EvalRow) -> Option<f64>| -> Vec<(f64, f64)> {
                r.evals_of(name)
                    .filter_map(|e| Some((e.step as f64, f(e)?)))
                    .collect()
            };
            p.line(i, pts(|e| e.success_in_region), Stroke::Solid, true);
            p.line(i, pts(|e| e.success_out_region), Stroke::Dashed, true);
        }
        p.marks = marks.to_vec();
        panels.push(p);
    }
    render(
        runs,
        "success_regions.svg",
        "Success in and out of the initial region",
        format!(
            "Evaluation success on tasks the initial policy already solved at least once \
             (in-region, solid, filled dots) and on the rest (out-region, dashed, hollow dots), \
             per evaluation panel; a missing value means the run did not record it.{}",
            mark_note(marks)
        ),
        Layout {
            cols: panels.len(),
            ..Layout::single()
        },
        &panels,
        &[
            Key::Line(Stroke::Solid, "in-region"),
            Key::Line(Stroke::Dashed, "out-region"),
        ],
        x,
    )
}

/// Difficulty clusters in numeric order ("10" after "9").
fn sorted_clusters<'a>(keys: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut v: Vec<String> = keys.cloned().collect();
    v.sort_by(|a, b| match (a.parse::<i64>(), b.parse::<i64>()) {
        (Ok(x), Ok(y)) => x.cmp(&y),
        (Ok(_), Err(_)) => std::cmp::Ordering::Less,
        (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
        _ => a.cmp(b),
    });
    v.dedup();
    v
}

/// Median and 10–90 % band of a run's depths in one cluster, each step
/// pooling the rollouts of the last `w` steps (a step has only a handful of
/// rollouts per cluster, too few for stable quantiles on their own).
fn depth_quantiles(run: &Run, cluster: &str, w: usize) -> (Vec<(f64, f64)>, Vec<Band>, usize) {
    let per_step: Vec<(f64, Option<&Vec<f64>>)> = run
        .steps
        .iter()
        .map(|s| (s.step as f64, s.depths_by_cluster.get(cluster)))
        .collect();
    let mut median = Vec::new();
    let mut bands = Vec::new();
    let mut cur = Band {
        run: 0,
        lower: Vec::new(),
        upper: Vec::new(),
    };
    for i in 0..per_step.len() {
        let here = per_step[i].1.is_some_and(|v| !v.is_empty());
        let mut pool: Vec<f64> = if here {
            per_step[i + 1 - w.min(i + 1)..=i]
                .iter()
                .filter_map(|(_, v)| *v)
                .flatten()
                .copied()
                .collect()
        } else {
            Vec::new()
        };
        pool.sort_by(f64::total_cmp);
        match (
            quantile(&pool, 0.1),
            quantile(&pool, 0.5),
            quantile(&pool, 0.9),
        ) {
            (Some(lo), Some(mid), Some(hi)) => {
                let xs = per_step[i].0;
                median.push((xs, mid));
                cur.lower.push((xs, lo));
                cur.upper.push((xs, hi));
            }
            // A step without rollouts of this cluster breaks the band.
            _ if !cur.lower.is_empty() => bands.push(std::mem::replace(
                &mut cur,
                Band {
                    run: 0,
                    lower: Vec::new(),
                    upper: Vec::new(),
                },
            )),
            _ => {}
        }
    }
    if !cur.lower.is_empty() {
        bands.push(cur);
    }
    let n = median.len();
    (median, bands, n)
}

fn depth(runs: &[Run], x: (f64, f64), w: usize) -> Result<Figure, ReportError> {
    let list_clusters = sorted_clusters(
        runs.iter()
            .flat_map(|r| r.steps.iter().flat_map(|s| s.depths_by_cluster.keys())),
    );
    let ratio_clusters = sorted_clusters(
        runs.iter()
            .flat_map(|r| r.steps.iter().flat_map(|s| s.depth_ratio_by_cluster.keys())),
    );
    let clusters = sorted_clusters(list_clusters.iter().chain(&ratio_clusters));
    // One row per cluster; a column per kind of record present (the
    // per-rollout depths, the per-step mean ratio), so the figure keeps the
    // page width however many clusters there are.
    let kinds = [!list_clusters.is_empty(), !ratio_clusters.is_empty()];
    let cols = kinds.iter().filter(|k| **k).count();
    let mut panels: Vec<Panel> = Vec::new();
    for c in &clusters {
        if kinds[0] {
            let mut p = Panel::new(
                format!("cluster {c}: guidance depth"),
                "depth (actions or plan k)",
                YRange::FromZero,
            );
            for (i, r) in runs.iter().enumerate() {
                let (median, bands, _) = depth_quantiles(r, c, w);
                p.bands
                    .extend(bands.into_iter().map(|b| Band { run: i, ..b }));
                p.line(i, median, Stroke::Solid, false);
            }
            panels.push(p);
        }
        if kinds[1] {
            let mut p = Panel::new(
                format!("cluster {c}: mean depth ratio"),
                "prefix / expert length",
                YRange::Unit,
            );
            for (i, r) in runs.iter().enumerate() {
                let raw: Vec<(f64, f64)> = r
                    .steps
                    .iter()
                    .filter_map(|s| Some((s.step as f64, *s.depth_ratio_by_cluster.get(c)?)))
                    .collect();
                p.line(i, smoothed(&raw, w), Stroke::Solid, false);
            }
            panels.push(p);
        }
    }
    let layout = if panels.is_empty() {
        panels.push(Panel::new("guidance depth", "depth", YRange::FromZero));
        Layout::single()
    } else {
        Layout {
            rows: clusters.len(),
            cols,
            panel_h: 300,
        }
    };
    let mut keys = Vec::new();
    if kinds[0] {
        keys.push(Key::Band("median, 10–90 %"));
    }
    if kinds[1] {
        keys.push(Key::Line(Stroke::Solid, "mean ratio (smoothed)"));
    }
    render(
        runs,
        "depth.svg",
        "Guidance depth by difficulty cluster",
        format!(
            "One row per difficulty cluster. Guidance depth panels (in runs that log \
             `depths_by_cluster`): the depth of every trained rollout (executed expert-prefix \
             actions, or plan k for plan guidance), as median (line) and 10–90 % band, each \
             step pooling the rollouts of the last {}. Mean depth ratio panels \
             (`depth_ratio_by_cluster`, the only depth record of older runs): executed prefix \
             over expert length, averaged per step, trailing moving average over {}.",
            steps_window(w),
            steps_window(w)
        ),
        layout,
        &panels,
        &keys,
        x,
    )
}

fn rollouts(runs: &[Run], x: (f64, f64)) -> Result<Figure, ReportError> {
    let mut per = Panel::new("rollouts per step", "rollouts", YRange::FromZero);
    let mut cum = Panel::new("cumulative rollouts", "rollouts", YRange::FromZero);
    cum.y_fmt = fmt_auto;
    for (i, r) in runs.iter().enumerate() {
        let total: Vec<(f64, f64)> = r
            .steps
            .iter()
            .filter_map(|s| Some((s.step as f64, s.rollouts?)))
            .collect();
        let probes: Vec<(f64, f64)> = r
            .steps
            .iter()
            .filter_map(|s| Some((s.step as f64, s.probe_rollouts?)))
            .collect();
        let cumulate = |pts: &[(f64, f64)]| -> Vec<(f64, f64)> {
            pts.iter()
                .scan(0.0, |acc, &(s, v)| {
                    *acc += v;
                    Some((s, *acc))
                })
                .collect()
        };
        cum.line(i, cumulate(&total), Stroke::Solid, false);
        cum.line(i, cumulate(&probes), Stroke::Dashed, false);
        per.line(i, total, Stroke::Solid, false);
        per.line(i, probes, Stroke::Dashed, false);
    }
    render(
        runs,
        "rollouts.svg",
        "Rollouts spent",
        "Rollouts generated per training step (left) and in total so far (right): all rollouts \
         including probes (`rollouts`, solid) and the probe rollouts alone \
         (`rounds.probe_rollouts`, dashed)."
            .into(),
        Layout::pair(),
        &[per, cum],
        &[
            Key::Line(Stroke::Solid, "all (probes included)"),
            Key::Line(Stroke::Dashed, "probes"),
        ],
        x,
    )
}

fn wall_time(runs: &[Run], x: (f64, f64)) -> Result<Figure, ReportError> {
    // Cumulative seconds per run: each step's time plus each evaluation's
    // at its step (evaluations run between steps and cost real time).
    let series: Vec<Vec<(f64, f64)>> = runs
        .iter()
        .map(|r| {
            // Seconds spent at each step: training and evaluation. The
            // final evaluation usually comes after the last training step
            // (at step = steps), so it gets a point of its own; the curve
            // then ends at the table's wall time.
            let mut spent = std::collections::BTreeMap::<u64, f64>::new();
            for st in &r.steps {
                if let Some(t) = st.step_s {
                    *spent.entry(st.step).or_default() += t;
                }
            }
            for e in &r.evals {
                if let Some(t) = e.eval_s {
                    *spent.entry(e.step).or_default() += t;
                }
            }
            spent
                .into_iter()
                .scan(0.0, |acc, (step, t)| {
                    *acc += t;
                    Some((step as f64, *acc))
                })
                .collect()
        })
        .collect();
    let max = series
        .iter()
        .flat_map(|s| s.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    let (unit, unit_name, div) = if max >= 7200.0 {
        ("h", "hours", 3600.0)
    } else if max >= 300.0 {
        ("min", "minutes", 60.0)
    } else {
        ("s", "seconds", 1.0)
    };
    let mut p = Panel::new("", format!("wall time ({unit})"), YRange::FromZero);
    for (i, pts) in series.into_iter().enumerate() {
        p.line(
            i,
            pts.into_iter().map(|(s, t)| (s, t / div)).collect(),
            Stroke::Solid,
            false,
        );
    }
    render(
        runs,
        "time.svg",
        "Wall time",
        format!(
            "Cumulative wall time in {unit_name}: the sum of `time.step_s` up to each step, plus \
             `time.eval_s` of the evaluations at or before it."
        ),
        Layout::single(),
        &[p],
        &[],
        x,
    )
}

fn throughput(runs: &[Run], x: (f64, f64), w: usize) -> Result<Figure, ReportError> {
    let mut roll = Panel::new("rollout (generation)", "tokens / s", YRange::FromZero);
    let mut train = Panel::new("training", "tokens / s", YRange::FromZero);
    for (i, r) in runs.iter().enumerate() {
        for (p, f) in [
            (
                &mut roll,
                (|s: &super::StepRow| s.rollout_tokens_per_s) as fn(_) -> _,
            ),
            (&mut train, |s: &super::StepRow| s.train_tokens_per_s),
        ] {
            let raw: Vec<(f64, f64)> = r
                .steps
                .iter()
                .filter_map(|s| Some((s.step as f64, f(s)?)))
                .collect();
            p.line(i, smoothed(&raw, w), Stroke::Solid, false);
            if w > 1 {
                p.line(i, raw, Stroke::Faint, false);
            }
        }
    }
    let keys = if w > 1 {
        vec![
            Key::Line(Stroke::Solid, "moving average"),
            Key::Line(Stroke::Faint, "per step"),
        ]
    } else {
        vec![Key::Line(Stroke::Solid, "per step")]
    };
    render(
        runs,
        "throughput.svg",
        "Throughput",
        format!(
            "Tokens per second of rollout generation (`time.rollout_tokens_per_s`, left) and \
             of training (`time.train_tokens_per_s`, right), {}.",
            smoothing_note(w)
        ),
        Layout::pair(),
        &[roll, train],
        &keys,
        x,
    )
}

#[cfg(test)]
mod tests {
    use super::super::StepRow;
    use super::*;
    use std::collections::BTreeMap;

    fn run_with_depths(depths: &[Option<Vec<f64>>]) -> Run {
        Run {
            steps: depths
                .iter()
                .enumerate()
                .map(|(i, d)| StepRow {
                    step: i as u64,
                    depths_by_cluster: d
                        .clone()
                        .map(|v| BTreeMap::from([("0".to_string(), v)]))
                        .unwrap_or_default(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn depth_band_pools_window_and_breaks_on_gaps() {
        let r = run_with_depths(&[
            Some(vec![0.0, 10.0]),
            Some(vec![5.0]),
            None,
            Some(vec![2.0]),
        ]);
        let (median, bands, n) = depth_quantiles(&r, "0", 2);
        assert_eq!(n, 3);
        // Step 1 pools steps 0 and 1: {0, 5, 10}.
        assert_eq!(median, vec![(0.0, 5.0), (1.0, 5.0), (3.0, 2.0)]);
        assert_eq!(bands.len(), 2);
        assert_eq!(bands[0].lower, vec![(0.0, 1.0), (1.0, 1.0)]);
        assert_eq!(bands[0].upper, vec![(0.0, 9.0), (1.0, 9.0)]);
    }

    #[test]
    fn clusters_sort_numerically() {
        let keys = ["10".to_string(), "2".into(), "x".into(), "2".into()];
        assert_eq!(sorted_clusters(keys.iter()), vec!["2", "10", "x"]);
    }

    #[test]
    fn figures_of_empty_runs_do_not_fail() {
        let runs = vec![Run {
            name: "empty".into(),
            ..Default::default()
        }];
        let figs = figures(&runs).unwrap();
        assert_eq!(figs.len(), 7);
        assert!(figs.iter().all(|f| f.svg.starts_with("<svg")));
    }
}
