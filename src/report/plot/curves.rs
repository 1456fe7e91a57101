//! The report's figures of success, rollouts spent, wall time and
//! throughput: which series each shows, how they are smoothed, and the
//! caption that says so.

use super::draw::{render, Spec};
use super::panel::{Key, Layout, Panel, YRange};
use super::style::{fmt_auto, Stroke};
use super::Figure;
use crate::report::{moving_average, script_marks, EvalRow, Mark, ReportError, Run, StepRow};

/// Marks of every run, tagged with the run's index (colour).
pub(super) fn all_marks(runs: &[Run]) -> Vec<(usize, Mark)> {
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

pub(super) fn smoothed(points: &[(f64, f64)], w: usize) -> Vec<(f64, f64)> {
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

/// Legend keys of a per-step curve: the moving average and the faint raw
/// line when smoothing (`w > 1`), the raw line alone otherwise.
fn smoothing_keys(w: usize) -> Vec<Key> {
    if w > 1 {
        vec![
            Key::Line(Stroke::Solid, "moving average"),
            Key::Line(Stroke::Faint, "per step"),
        ]
    } else {
        vec![Key::Line(Stroke::Solid, "per step")]
    }
}

pub(super) fn steps_window(w: usize) -> String {
    if w == 1 {
        "1 step (no smoothing)".into()
    } else {
        format!("{w} steps")
    }
}

pub(super) fn success_train(
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
    let keys = smoothing_keys(w);
    render(
        runs,
        Spec {
            file: "success_train.svg",
            title: "Train success",
            caption: format!(
                "Success of the trained rollouts at each training step (`success`), {}.{}",
                smoothing_note(w),
                mark_note(marks)
            ),
            layout: Layout::single(),
            panels: &[p],
            keys: &keys,
        },
        x,
    )
}

pub(super) fn success_test(
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
        Spec {
            file: "success_test.svg",
            title: "Test-panel success",
            caption: format!(
                "Success on the test panel at each evaluation (`eval.jsonl`, panel \"test\"), \
                 unsmoothed.{}",
                mark_note(marks)
            ),
            layout: Layout::single(),
            panels: &[p],
            keys: &[Key::Markers("evaluation")],
        },
        x,
    )
}

pub(super) fn success_regions(
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
            let pts = |f: fn(&EvalRow) -> Option<f64>| -> Vec<(f64, f64)> {
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
        Spec {
            file: "success_regions.svg",
            title: "Success in and out of the initial region",
            caption: format!(
                "Evaluation success on tasks the initial policy already solved at least once \
                 (in-region, solid, filled dots) and on the rest (out-region, dashed, hollow dots), \
                 per evaluation panel; a missing value means the run did not record it.{}",
                mark_note(marks)
            ),
            layout: Layout {
                cols: panels.len(),
                ..Layout::single()
            },
            panels: &panels,
            keys: &[
                Key::Line(Stroke::Solid, "in-region"),
                Key::Line(Stroke::Dashed, "out-region"),
            ],
        },
        x,
    )
}

pub(super) fn rollouts(runs: &[Run], x: (f64, f64)) -> Result<Figure, ReportError> {
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
        Spec {
            file: "rollouts.svg",
            title: "Rollouts spent",
            caption: "Rollouts generated per training step (left) and in total so far (right): all rollouts \
             including probes (`rollouts`, solid) and the probe rollouts alone \
             (`rounds.probe_rollouts`, dashed)."
                .into(),
            layout: Layout::pair(),
            panels: &[per, cum],
            keys: &[
                Key::Line(Stroke::Solid, "all (probes included)"),
                Key::Line(Stroke::Dashed, "probes"),
            ],
        },
        x,
    )
}

pub(super) fn wall_time(runs: &[Run], x: (f64, f64)) -> Result<Figure, ReportError> {
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
        Spec {
            file: "time.svg",
            title: "Wall time",
            caption: format!(
                "Cumulative wall time in {unit_name}: the sum of `time.step_s` up to each step, plus \
                 `time.eval_s` of the evaluations at or before it."
            ),
            layout: Layout::single(),
            panels: &[p],
            keys: &[],
        },
        x,
    )
}

pub(super) fn throughput(runs: &[Run], x: (f64, f64), w: usize) -> Result<Figure, ReportError> {
    let mut roll = Panel::new("rollout (generation)", "tokens / s", YRange::FromZero);
    let mut train = Panel::new("training", "tokens / s", YRange::FromZero);
    for (i, r) in runs.iter().enumerate() {
        for (p, f) in [
            (
                &mut roll,
                (|s: &StepRow| s.rollout_tokens_per_s) as fn(_) -> _,
            ),
            (&mut train, |s: &StepRow| s.train_tokens_per_s),
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
    let keys = smoothing_keys(w);
    render(
        runs,
        Spec {
            file: "throughput.svg",
            title: "Throughput",
            caption: format!(
                "Tokens per second of rollout generation (`time.rollout_tokens_per_s`, left) and \
                 of training (`time.train_tokens_per_s`, right), {}.",
                smoothing_note(w)
            ),
            layout: Layout::pair(),
            panels: &[roll, train],
            keys: &keys,
        },
        x,
    )
}
