//! Drawing a figure with plotters: the title, the grid of panels (axes,
//! bands, lines, markers, the marker lane) and the legend strip.
//!
//! The draw calls run in a fixed order (bands, faint lines, bold lines,
//! marks), which fixes the SVG bytes: keep it.

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::legend::draw_legend;
use super::panel::{Key, Layout, Line, Panel, YRange};
use super::style::{
    run_color, stroke_style, Area, Stroke, FONT, KEY_GREY, LEGEND_W, PLOT_W, TITLE_H,
};
use super::{Figure, PlotError};
use crate::report::{MarkKind, ReportError, Run};

/// A panel's chart: steps on x, values on y.
type Chart<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// A figure's text and structure, before drawing.
pub(super) struct Spec<'a> {
    pub file: &'a str,
    pub title: &'a str,
    pub caption: String,
    pub layout: Layout,
    pub panels: &'a [Panel],
    pub keys: &'a [Key],
}

/// Render one figure: title, panels in a grid, legend on the right. `x`
/// is the step range shared by the figure's panels.
pub(super) fn render(runs: &[Run], spec: Spec<'_>, x: (f64, f64)) -> Result<Figure, ReportError> {
    let Spec {
        file,
        title,
        caption,
        layout,
        panels,
        keys,
    } = spec;
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
        let draw = || -> Result<(), PlotError> {
            root.fill(&WHITE)?;
            let body = root.titled(title, (FONT, 22))?;
            let (plots, legend) = body.split_horizontally(plot_w);
            let cells = plots.split_evenly((layout.rows, layout.cols));
            for (cell, panel) in cells.iter().zip(panels) {
                draw_panel(cell, panel, x)?;
            }
            let any_marks = panels.iter().any(|p| !p.marks.is_empty());
            draw_legend(&legend, runs, keys, any_marks)?;
            root.present()?;
            Ok(())
        };
        draw().map_err(|e| ReportError::Plot {
            figure: file.to_string(),
            msg: e.to_string(),
        })?;
    }
    Ok(Figure {
        file: file.to_string(),
        title: title.to_string(),
        caption,
        svg,
    })
}

/// The y range of a panel's data (before the marker lane).
fn y_bounds(p: &Panel) -> (f64, f64) {
    match p.y_range {
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
    }
}

/// The vertical bounds of a panel: the data range `y0..y1` and the marker
/// lane's height above it.
#[derive(Clone, Copy)]
struct Ys {
    y0: f64,
    y1: f64,
    lane: f64,
}

fn draw_panel(area: &Area, p: &Panel, x: (f64, f64)) -> Result<(), PlotError> {
    let (y0, y1) = y_bounds(p);
    // Room above the data for reload markers and their labels.
    let lane = if p.marks.is_empty() {
        0.0
    } else {
        (y1 - y0) * 0.32
    };
    let ys = Ys { y0, y1, lane };
    let mut chart = axes(area, p, x, ys)?;
    if p.is_empty() {
        chart.plotting_area().draw(&Text::new(
            "no data in these runs",
            ((x.0 + x.1) / 2.0, (y0 + y1) / 2.0),
            TextStyle::from((FONT, 15).into_font())
                .color(&KEY_GREY)
                .pos(Pos::new(HPos::Center, VPos::Center)),
        ))?;
    }
    for b in &p.bands {
        let mut poly = b.lower.clone();
        poly.extend(b.upper.iter().rev());
        chart.draw_series(std::iter::once(Polygon::new(
            poly,
            run_color(b.run).mix(0.16).filled(),
        )))?;
    }
    // Faint lines first so the bold ones sit on top.
    let mut lines: Vec<&Line> = p.lines.iter().collect();
    lines.sort_by_key(|l| l.stroke != Stroke::Faint);
    for l in lines {
        draw_line(&mut chart, l)?;
    }
    draw_marks(&mut chart, p, x, ys)
}

/// The panel's chart with its caption, axes, grid and tick labels.
fn axes<'a, 'b>(
    area: &'a Area<'b>,
    p: &Panel,
    x: (f64, f64),
    ys: Ys,
) -> Result<Chart<'a, 'b>, PlotError> {
    let Ys { y0, y1, lane } = ys;
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
        .build_cartesian_2d(x.0..x.1, y0..top)?;
    let y_fmt = p.y_fmt;
    let hide_above = y1 + (y1 - y0) * 1e-6;
    chart
        .configure_mesh()
        .x_desc(p.x_desc.as_str())
        .y_desc(p.y_desc.as_str())
        .x_labels(10)
        .y_labels(8)
        .x_label_formatter(&super::style::fmt_step)
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
        .draw()?;
    Ok(chart)
}

/// One run's curve, with its markers (filled dots; hollow on dashed lines).
fn draw_line(chart: &mut Chart, l: &Line) -> Result<(), PlotError> {
    let c = run_color(l.run);
    let style = stroke_style(c, l.stroke);
    match l.stroke {
        Stroke::Dashed => {
            chart.draw_series(DashedLineSeries::new(l.points.iter().copied(), 7, 5, style))?;
        }
        _ => {
            chart.draw_series(LineSeries::new(l.points.iter().copied(), style))?;
        }
    }
    if l.markers {
        let hollow = l.stroke == Stroke::Dashed;
        chart.draw_series(l.points.iter().map(|&pt| {
            if hollow {
                Circle::new(pt, 4, ShapeStyle::from(&WHITE).filled())
            } else {
                Circle::new(pt, 4, c.filled())
            }
        }))?;
        if hollow {
            chart.draw_series(
                l.points
                    .iter()
                    .map(|&pt| Circle::new(pt, 4, c.stroke_width(2))),
            )?;
        }
    }
    Ok(())
}

/// The marker lane: its floor, then each script-version mark with its
/// label.
fn draw_marks(chart: &mut Chart, p: &Panel, x: (f64, f64), ys: Ys) -> Result<(), PlotError> {
    let Ys { y0, y1, lane } = ys;
    if !p.marks.is_empty() {
        // The lane's floor.
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(x.0, y1), (x.1, y1)],
            BLACK.mix(0.25),
        )))?;
    }
    for (run, m) in &p.marks {
        let c = run_color(*run);
        let xm = m.step as f64;
        let label_style = TextStyle::from((FONT, 11).into_font())
            .transform(FontTransform::Rotate270)
            .color(&c);
        match m.kind {
            MarkKind::Reload => {
                chart.draw_series(std::iter::once(PathElement::new(
                    vec![(xm, y0), (xm, y1 + lane * 0.08)],
                    c.mix(0.6).stroke_width(1),
                )))?;
            }
            MarkKind::ScriptChange => {
                chart.draw_series(DashedLineSeries::new(
                    vec![(xm, y0), (xm, y1 + lane * 0.08)],
                    2,
                    4,
                    c.mix(0.7).stroke_width(1),
                ))?;
            }
            MarkKind::Rejected | MarkKind::Reverted => {
                chart.draw_series(std::iter::once(Cross::new(
                    (xm, y1 + lane * 0.08),
                    5,
                    c.stroke_width(2),
                )))?;
            }
        }
        // Labels read upwards from just above the lane floor.
        let at = (xm, y1 + lane * 0.16);
        chart.draw_series(std::iter::once(
            EmptyElement::at(at) + Text::new(m.label.clone(), (-1, 0), label_style),
        ))?;
    }
    Ok(())
}
