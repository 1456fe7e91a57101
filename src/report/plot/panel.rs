//! What a figure is made of, before drawing: panels of lines, bands and
//! script-version marks, the legend's keys, and the grid of panels.

use super::style::{fmt_auto, Stroke, PANEL_H};
use crate::report::Mark;

/// One run's curve in a panel.
pub(super) struct Line {
    pub(super) run: usize,
    pub(super) points: Vec<(f64, f64)>,
    pub(super) stroke: Stroke,
    pub(super) markers: bool,
}

/// A filled range between two curves over one contiguous stretch of steps.
pub(super) struct Band {
    pub(super) run: usize,
    pub(super) lower: Vec<(f64, f64)>,
    pub(super) upper: Vec<(f64, f64)>,
}

#[derive(Clone, Copy)]
pub(super) enum YRange {
    /// Success rates and ratios.
    Unit,
    /// From 0 to a little above the largest value.
    FromZero,
}

/// One chart of a figure: its axes and what it plots.
pub(super) struct Panel {
    pub(super) title: String,
    pub(super) x_desc: String,
    pub(super) y_desc: String,
    pub(super) y_range: YRange,
    pub(super) y_fmt: fn(f64) -> String,
    pub(super) lines: Vec<Line>,
    pub(super) bands: Vec<Band>,
    pub(super) marks: Vec<(usize, Mark)>,
}

impl Panel {
    pub(super) fn new(
        title: impl Into<String>,
        y_desc: impl Into<String>,
        y_range: YRange,
    ) -> Self {
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

    pub(super) fn line(
        &mut self,
        run: usize,
        points: Vec<(f64, f64)>,
        stroke: Stroke,
        markers: bool,
    ) {
        if !points.is_empty() {
            self.lines.push(Line {
                run,
                points,
                stroke,
                markers,
            });
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.lines.is_empty() && self.bands.is_empty()
    }
}

/// What the legend strip explains besides the run colours.
#[derive(Clone, Copy)]
pub(super) enum Key {
    Line(Stroke, &'static str),
    Markers(&'static str),
    Band(&'static str),
}

/// The grid of a figure's panels.
pub(super) struct Layout {
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Pixel height of one panel row.
    pub(super) panel_h: u32,
}

impl Layout {
    pub(super) fn single() -> Self {
        Layout {
            rows: 1,
            cols: 1,
            panel_h: PANEL_H,
        }
    }

    pub(super) fn pair() -> Self {
        Layout {
            rows: 1,
            cols: 2,
            panel_h: PANEL_H,
        }
    }
}
