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
//!
//! Files, from data to pixels: [`curves`] and [`depth`] build each figure
//! (series, captions) out of [`panel`]s; [`draw`] and [`legend`] draw them
//! in the look of [`style`].

mod curves;
mod depth;
mod draw;
mod legend;
mod panel;
mod style;

pub use style::run_color;

use plotters::drawing::DrawingAreaErrorKind;

use crate::report::{script_marks, smoothing_window, ReportError, Run};

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

/// A plotters drawing failure (its message; plotters' error types are
/// generic over the backend).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct PlotError(pub String);

impl<E: std::error::Error + Send + Sync> From<DrawingAreaErrorKind<E>> for PlotError {
    fn from(e: DrawingAreaErrorKind<E>) -> Self {
        PlotError(e.to_string())
    }
}

/// All figures, in report order. Same runs give the same SVG bytes.
pub fn figures(runs: &[Run]) -> Result<Vec<Figure>, ReportError> {
    let x = x_range(runs);
    let longest = runs.iter().map(|r| r.steps.len()).max().unwrap_or(0);
    let w = smoothing_window(longest);
    let marks = curves::all_marks(runs);
    Ok(vec![
        curves::success_train(runs, x, w, &marks)?,
        curves::success_test(runs, x, &marks)?,
        curves::success_regions(runs, x, &marks)?,
        depth::depth(runs, x, w)?,
        curves::rollouts(runs, x)?,
        curves::wall_time(runs, x)?,
        curves::throughput(runs, x, w)?,
    ])
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

#[cfg(test)]
mod tests {
    use super::*;

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
