//! Run comparison reports (`actguide report RUN... --out DIR`).
//!
//! Ownership, in data-flow order:
//! - this module: reducing run directories (their typed records, read
//!   through [`crate::rundir`]) to [`Run`]s, the derived numbers
//!   ([`SummaryRow`], script-version [`Mark`]s, moving averages,
//!   quantiles), the markdown summary and [`write_report`], which writes
//!   everything into the output folder;
//! - [`plot`]: the SVG figures (plotters), one file per figure;
//! - [`html`]: the single self-contained `report.html` (SVGs inlined);
//! - [`probe_plot`]: the figure of `actguide probe` (separate from the
//!   comparison report; shares only the plotting dependency).
//!
//! [`tensorboard`] is re-exported from [`crate::rundir::tensorboard`], which
//! owns the event files.
//!
//! Every key of the run files is optional: older runs lack some, and a
//! missing key drops that series or table cell, never the report. Output is
//! deterministic (no dates, sorted maps), so the same run directories give
//! byte-identical files.

pub mod groups;
pub mod html;
pub mod plot;
pub mod probe_plot;
pub use crate::rundir::tensorboard;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::rundir::{EvalLine, Record, ReloadLine, RunDir, RunDirError, SftLine, StepLine};

/// Why a report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("no run directories given")]
    NoRuns,
    #[error("{}: not a run directory (no metrics.jsonl or sft.jsonl)", dir.display())]
    NoMetrics { dir: PathBuf },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A run file that does not read.
    #[error(transparent)]
    RunDir(#[from] RunDirError),
    #[error("figure {figure}: {msg}")]
    Plot { figure: String, msg: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ReportError + '_ {
    move |source| ReportError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One training step (a `metrics.jsonl` line), reduced to what the report
/// uses. `None` / empty: the key was absent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepRow {
    pub step: u64,
    pub success: Option<f64>,
    pub success_round0: Option<f64>,
    /// All rollouts generated this step, probes included.
    pub rollouts: Option<f64>,
    pub probe_rollouts: Option<f64>,
    pub trained_rollouts: Option<f64>,
    /// Guidance depth of every trained rollout, per cluster.
    pub depths_by_cluster: BTreeMap<String, Vec<f64>>,
    /// Mean depth ratio per cluster (older runs' only depth record).
    pub depth_ratio_by_cluster: BTreeMap<String, f64>,
    pub step_s: Option<f64>,
    pub rollout_tokens_per_s: Option<f64>,
    pub train_tokens_per_s: Option<f64>,
    pub script_hash: Option<String>,
    pub script_hashes: BTreeMap<String, String>,
}

/// One evaluation (an `eval.jsonl` line).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalRow {
    pub step: u64,
    /// "test" or "train" ("test" when the line has none).
    pub panel: String,
    pub success: Option<f64>,
    pub success_in_region: Option<f64>,
    pub success_out_region: Option<f64>,
    pub in_region_tasks: Option<u64>,
    pub out_region_tasks: Option<u64>,
    pub eval_s: Option<f64>,
}

/// One hot-reload outcome (a `reloads.jsonl` line).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reload {
    /// The step at whose start an edit was loaded (accepted or rejected:
    /// the outcome applies from this step), or at whose end a version on
    /// probation was reverted (the kept version applies from `step + 1`).
    pub step: u64,
    pub role: String,
    pub ok: bool,
    /// A new version that failed on probation and was swapped back out.
    pub reverted: bool,
    pub hash: Option<String>,
    /// The version kept after a rejected or reverted reload.
    pub active: Option<String>,
    pub error: Option<String>,
}

/// A loaded run directory.
#[derive(Debug, Clone, Default)]
pub struct Run {
    /// The directory's file name.
    pub name: String,
    pub dir: PathBuf,
    /// `experiment.json`'s `guidance.script`.
    pub guidance_script: Option<String>,
    /// `experiment.json`'s `seed`.
    pub seed: Option<u64>,
    /// The whole `experiment.json` (seed replicas are grouped by it).
    pub config: Option<Value>,
    /// Sorted by step, one row per step.
    pub steps: Vec<StepRow>,
    /// Sorted by (step, panel), one row per pair.
    pub evals: Vec<EvalRow>,
    /// In file order.
    pub reloads: Vec<Reload>,
    /// Things skipped while reading (e.g. a partly written last line).
    pub warnings: Vec<String>,
}

impl Run {
    /// Evaluations of one panel, by step.
    pub fn evals_of<'a>(&'a self, panel: &'a str) -> impl Iterator<Item = &'a EvalRow> + 'a {
        self.evals.iter().filter(move |e| e.panel == panel)
    }
}

// ---------------------------------------------------------------------------
// Reading

fn step_row(line: &StepLine, fallback_step: u64) -> StepRow {
    let t = &line.time;
    StepRow {
        step: line.step.map_or(fallback_step, |s| s as u64),
        success: line.batch.success,
        success_round0: line.success_round0,
        rollouts: line.rollouts.map(|x| x as f64),
        probe_rollouts: line.rounds.probe_rollouts.map(|x| x as f64),
        trained_rollouts: line.rounds.trained_rollouts.map(|x| x as f64),
        depths_by_cluster: line
            .depths_by_cluster
            .iter()
            .map(|(k, d)| (k.clone(), d.iter().map(|&x| x as f64).collect()))
            .collect(),
        depth_ratio_by_cluster: line.depth_ratio_by_cluster.clone(),
        step_s: t.step_s,
        rollout_tokens_per_s: t.rollout_tokens_per_s,
        train_tokens_per_s: t.train_tokens_per_s,
        script_hash: line.script_hash.clone(),
        script_hashes: line.script_hashes.clone(),
    }
}

/// One SFT step: its expert trajectories (replayed in the env) count as
/// its rollouts, all of them trained on.
fn sft_row(line: &SftLine) -> StepRow {
    StepRow {
        step: line.step as u64,
        rollouts: Some(line.trajectories as f64),
        probe_rollouts: Some(0.0),
        trained_rollouts: Some(line.trajectories as f64),
        step_s: Some(line.seconds),
        train_tokens_per_s: Some(line.train_tok_s),
        ..StepRow::default()
    }
}

fn eval_row(line: &EvalLine) -> Option<EvalRow> {
    Some(EvalRow {
        step: line.step? as u64,
        panel: line.panel.clone().unwrap_or_else(|| "test".into()),
        success: line.result.success,
        success_in_region: line.success_in_region,
        success_out_region: line.success_out_region,
        in_region_tasks: line.in_region_tasks.map(|x| x as u64),
        out_region_tasks: line.out_region_tasks.map(|x| x as u64),
        eval_s: line.time.eval_s,
    })
}

fn reload_row(line: &ReloadLine) -> Option<Reload> {
    Some(Reload {
        step: line.step? as u64,
        role: line.role.clone().unwrap_or_else(|| "guidance".into()),
        ok: line.ok.unwrap_or(false),
        reverted: line.reverted.unwrap_or(false),
        hash: line.hash.clone(),
        active: line.active.clone(),
        error: line.error.clone(),
    })
}

/// `experiment.json`; an unreadable file costs the cells that need it
/// (and a warning), not the report.
fn experiment_json(dir: &RunDir, warnings: &mut Vec<String>) -> Option<Value> {
    match dir.read_experiment::<Value>() {
        Ok(v) => Some(v),
        Err(RunDirError::Json { path, source }) => {
            warnings.push(format!("{}: unreadable ({source})", path.display()));
            None
        }
        Err(_) => None,
    }
}

/// Read one run directory. Only `metrics.jsonl` is required.
pub fn read_run(dir: &Path) -> Result<Run, ReportError> {
    let mut warnings = Vec::new();
    let rd = RunDir::at(dir);
    // An SFT run (a behaviour-cloning arm) logs its steps to sft.jsonl.
    let rows: Vec<StepRow> = match rd.read::<StepLine>(&mut warnings)? {
        Some(metrics) => metrics
            .iter()
            .enumerate()
            .map(|(i, line)| step_row(line, i as u64))
            .collect(),
        None => match rd.read::<SftLine>(&mut warnings)? {
            Some(sft) => sft.iter().map(sft_row).collect(),
            None => {
                return Err(ReportError::NoMetrics {
                    dir: dir.to_path_buf(),
                })
            }
        },
    };
    let name = dir
        .canonicalize()
        .ok()
        .as_deref()
        .and_then(Path::file_name)
        .or_else(|| dir.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string());
    let config = experiment_json(&rd, &mut warnings);
    let guidance_script = config
        .as_ref()
        .and_then(|c| c["guidance"]["script"].as_str())
        .map(str::to_string);
    let seed = config.as_ref().and_then(|c| c["seed"].as_u64());

    // A later line for the same step supersedes an earlier one: a run that
    // died between writing a step and its checkpoint logs that step again.
    let mut by_step: BTreeMap<u64, StepRow> = BTreeMap::new();
    for row in rows {
        by_step.insert(row.step, row);
    }

    let eval_path = dir.join(EvalLine::FILE);
    let mut by_eval: BTreeMap<(u64, String), EvalRow> = BTreeMap::new();
    for line in rd.read::<EvalLine>(&mut warnings)?.unwrap_or_default() {
        match eval_row(&line) {
            Some(r) => {
                by_eval.insert((r.step, r.panel.clone()), r);
            }
            None => warnings.push(format!(
                "{}: a line without step skipped",
                eval_path.display()
            )),
        }
    }

    let reload_path = dir.join(ReloadLine::FILE);
    let mut reloads = Vec::new();
    for line in rd.read::<ReloadLine>(&mut warnings)?.unwrap_or_default() {
        match reload_row(&line) {
            Some(r) => reloads.push(r),
            None => warnings.push(format!(
                "{}: a line without step skipped",
                reload_path.display()
            )),
        }
    }

    Ok(Run {
        name,
        dir: dir.to_path_buf(),
        guidance_script,
        seed,
        config,
        steps: by_step.into_values().collect(),
        evals: by_eval.into_values().collect(),
        reloads,
        warnings,
    })
}

// ---------------------------------------------------------------------------
// Derived numbers

/// Trailing moving average: element i is the mean of the last `window`
/// values up to i (fewer at the start), so the curve starts at step 0 and
/// never looks ahead.
pub fn moving_average(values: &[f64], window: usize) -> Vec<f64> {
    let w = window.max(1);
    let mut out = Vec::with_capacity(values.len());
    let mut sum = 0.0;
    for (i, x) in values.iter().enumerate() {
        sum += x;
        if i >= w {
            sum -= values[i - w];
        }
        out.push(sum / (i + 1).min(w) as f64);
    }
    out
}

/// The `q`-quantile (0..=1) of sorted values, linearly interpolated between
/// order statistics (numpy's default); `None` for no values.
pub fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() || !q.is_finite() {
        return None;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64))
}

/// Smoothing window (in steps) for a figure whose longest run has
/// `max_len` steps: about a twentieth of the run, between 1 and 10, so a
/// 150-step run is smoothed over 8 steps and a 6-step one not at all.
pub fn smoothing_window(max_len: usize) -> usize {
    (max_len / 20).clamp(1, 10)
}

/// What a step-axis marker stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum MarkKind {
    /// A successful hot reload (drawn at its effective step).
    Reload,
    /// A reload whose new version failed to compile or check.
    Rejected,
    /// A new version that failed on probation and was swapped back.
    Reverted,
    /// `script_hash(es)` changed between consecutive metrics lines with no
    /// logged reload explaining it (e.g. a run without `reloads.jsonl`).
    ScriptChange,
}

/// A script-version event on the step axis.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Mark {
    /// The first step the outcome applies to (the reload's step; a
    /// revert's step + 1).
    pub step: u64,
    pub kind: MarkKind,
    /// Short hash (new version, or the one kept), or what happened.
    pub label: String,
}

/// Hashes are 12+ hex digits; 8 tell versions apart on a plot.
fn short_hash(h: &str) -> String {
    h.chars().take(8).collect()
}

/// The script version of a metrics line: per-role hashes when logged,
/// else the single `script_hash`.
fn version_key(r: &StepRow) -> Option<BTreeMap<String, String>> {
    if !r.script_hashes.is_empty() {
        Some(r.script_hashes.clone())
    } else {
        r.script_hash
            .as_ref()
            .map(|h| BTreeMap::from([("guidance".to_string(), h.clone())]))
    }
}

/// Reload outcomes and unexplained script-hash changes of a run, by step.
/// A successful reload at step s shows up as a hash change at s as well;
/// that change is not marked twice.
pub fn script_marks(run: &Run) -> Vec<Mark> {
    let mut marks = BTreeSet::new();
    let mut reload_steps = BTreeSet::new();
    for r in &run.reloads {
        // Reloads happen before their step runs, reverts after it.
        let step = if r.reverted { r.step + 1 } else { r.step };
        let role = if r.role == "guidance" {
            String::new()
        } else {
            format!("{}:", r.role)
        };
        let (kind, label) = if r.ok {
            reload_steps.insert(step);
            (
                MarkKind::Reload,
                format!("{role}{}", short_hash(r.hash.as_deref().unwrap_or("?"))),
            )
        } else if r.reverted {
            (MarkKind::Reverted, format!("{role}reverted"))
        } else {
            (MarkKind::Rejected, format!("{role}rejected"))
        };
        marks.insert(Mark { step, kind, label });
    }
    let mut prev: Option<BTreeMap<String, String>> = None;
    for r in &run.steps {
        let Some(cur) = version_key(r) else { continue };
        if let Some(p) = &prev {
            if *p != cur && !reload_steps.contains(&r.step) {
                let changed: Vec<String> = cur
                    .iter()
                    .filter(|(role, h)| p.get(*role) != Some(*h))
                    .map(|(role, h)| {
                        if role == "guidance" {
                            short_hash(h)
                        } else {
                            format!("{role}:{}", short_hash(h))
                        }
                    })
                    .collect();
                marks.insert(Mark {
                    step: r.step,
                    kind: MarkKind::ScriptChange,
                    label: changed.join(" "),
                });
            }
        }
        prev = Some(cur);
    }
    marks.into_iter().collect()
}

/// A run's row of the summary table. `None`: not in the run's files.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SummaryRow {
    pub name: String,
    pub guidance_script: Option<String>,
    /// Metrics lines (distinct steps).
    pub steps: usize,
    /// (step, success) of the last test-panel evaluation.
    pub final_test: Option<(u64, f64)>,
    /// (step, success) of the best test-panel evaluation (earliest on ties).
    pub best_test: Option<(u64, f64)>,
    pub final_test_in_region: Option<f64>,
    pub final_test_out_region: Option<f64>,
    /// (step, success) of the last train-panel evaluation.
    pub final_train_panel: Option<(u64, f64)>,
    pub final_train_out_region: Option<f64>,
    pub total_rollouts: Option<f64>,
    pub probe_rollouts: Option<f64>,
    pub rollouts_per_step: Option<f64>,
    /// Sum of `time.step_s` and `time.eval_s`.
    pub wall_s: Option<f64>,
    /// Mean over steps of the per-step rates.
    pub rollout_tokens_per_s: Option<f64>,
    pub train_tokens_per_s: Option<f64>,
    /// Distinct script versions seen in the metrics lines.
    pub script_versions: usize,
    pub reloads_ok: usize,
    /// Rejected plus reverted.
    pub reloads_failed: usize,
}

fn sum_opt(xs: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    xs.flatten()
        .fold(None, |acc, x| Some(acc.unwrap_or(0.0) + x))
}

fn mean_opt(xs: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let v: Vec<f64> = xs.flatten().collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The summary-table numbers of a run.
pub fn summarize(run: &Run) -> SummaryRow {
    let test: Vec<&EvalRow> = run.evals_of("test").collect();
    let last_test = test.iter().rev().find(|e| e.success.is_some());
    let best_test = test.iter().filter_map(|e| Some((e.step, e.success?))).fold(
        None,
        |best: Option<(u64, f64)>, (s, x)| match best {
            Some((_, b)) if b >= x => best,
            _ => Some((s, x)),
        },
    );
    let last_any_test = test.last();
    let final_train_panel = run
        .evals_of("train")
        .filter_map(|e| Some((e.step, e.success?)))
        .last();
    let final_train_out_region = run
        .evals_of("train")
        .last()
        .and_then(|e| e.success_out_region);
    let total_rollouts = sum_opt(run.steps.iter().map(|r| r.rollouts));
    let with_rollouts = run.steps.iter().filter(|r| r.rollouts.is_some()).count();
    let step_s = sum_opt(run.steps.iter().map(|r| r.step_s));
    let eval_s = sum_opt(run.evals.iter().map(|e| e.eval_s));
    let versions: BTreeSet<BTreeMap<String, String>> =
        run.steps.iter().filter_map(version_key).collect();
    SummaryRow {
        name: run.name.clone(),
        guidance_script: run.guidance_script.clone(),
        steps: run.steps.len(),
        final_test: last_test.and_then(|e| Some((e.step, e.success?))),
        best_test,
        final_test_in_region: last_any_test.and_then(|e| e.success_in_region),
        final_test_out_region: last_any_test.and_then(|e| e.success_out_region),
        final_train_panel,
        final_train_out_region,
        total_rollouts,
        probe_rollouts: sum_opt(run.steps.iter().map(|r| r.probe_rollouts)),
        rollouts_per_step: total_rollouts
            .filter(|_| with_rollouts > 0)
            .map(|t| t / with_rollouts as f64),
        wall_s: match (step_s, eval_s) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        },
        rollout_tokens_per_s: mean_opt(run.steps.iter().map(|r| r.rollout_tokens_per_s)),
        train_tokens_per_s: mean_opt(run.steps.iter().map(|r| r.train_tokens_per_s)),
        script_versions: versions.len(),
        reloads_ok: run.reloads.iter().filter(|r| r.ok).count(),
        reloads_failed: run.reloads.iter().filter(|r| !r.ok).count(),
    }
}

// ---------------------------------------------------------------------------
// The summary table

/// Column headers of the summary table (markdown and HTML).
pub const TABLE_HEADERS: [&str; 17] = [
    "run",
    "guidance script",
    "steps",
    "final test",
    "best test",
    "final test in-region",
    "final test out-region",
    "final train panel",
    "final train out-region",
    "rollouts",
    "probe rollouts",
    "rollouts / step",
    "wall time (s)",
    "rollout tok/s",
    "train tok/s",
    "script versions",
    "reloads ok / failed",
];

const NA: &str = "–";

fn fmt_rate(x: Option<f64>) -> String {
    x.map_or(NA.into(), |x| format!("{x:.3}"))
}

fn fmt_at(x: Option<(u64, f64)>) -> String {
    x.map_or(NA.into(), |(s, x)| format!("{x:.3} @{s}"))
}

/// Counts print as integers; a fractional sum keeps one decimal.
fn fmt_count(x: Option<f64>) -> String {
    x.map_or(NA.into(), |x| {
        if x.fract() == 0.0 {
            format!("{x:.0}")
        } else {
            format!("{x:.1}")
        }
    })
}

fn fmt_fixed(x: Option<f64>, decimals: usize) -> String {
    x.map_or(NA.into(), |x| format!("{x:.decimals$}"))
}

/// The cells of a summary row, as text (escaped by the caller).
pub fn table_cells(s: &SummaryRow) -> [String; 17] {
    [
        s.name.clone(),
        s.guidance_script.clone().unwrap_or_else(|| NA.into()),
        s.steps.to_string(),
        fmt_at(s.final_test),
        fmt_at(s.best_test),
        fmt_rate(s.final_test_in_region),
        fmt_rate(s.final_test_out_region),
        fmt_at(s.final_train_panel),
        fmt_rate(s.final_train_out_region),
        fmt_count(s.total_rollouts),
        fmt_count(s.probe_rollouts),
        fmt_fixed(s.rollouts_per_step, 1),
        fmt_fixed(s.wall_s, 1),
        fmt_fixed(s.rollout_tokens_per_s, 0),
        fmt_fixed(s.train_tokens_per_s, 0),
        s.script_versions.to_string(),
        format!("{} / {}", s.reloads_ok, s.reloads_failed),
    ]
}

/// Markdown cells must not break the table.
fn md_cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// The summary table in markdown, one row per run.
pub fn markdown_table(rows: &[SummaryRow]) -> String {
    markdown_rows(
        &TABLE_HEADERS,
        2,
        rows.iter().map(|r| table_cells(r).to_vec()),
    )
}

/// A markdown table; the first `left` columns are left-aligned.
fn markdown_rows(headers: &[&str], left: usize, rows: impl Iterator<Item = Vec<String>>) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "| {} |", headers.join(" | "));
    let _ = writeln!(
        out,
        "|{}",
        (0..headers.len())
            .map(|i| if i < left { "---|" } else { "---:|" })
            .collect::<String>()
    );
    for cells in rows {
        let cells: Vec<String> = cells.iter().map(|c| md_cell(c)).collect();
        let _ = writeln!(out, "| {} |", cells.join(" | "));
    }
    out
}

// ---------------------------------------------------------------------------
// Writing

/// What [`write_report`] wrote.
#[derive(Debug, Clone)]
pub struct ReportSummary {
    /// Every file written, in writing order (figures, report.md,
    /// report.html).
    pub files: Vec<PathBuf>,
    pub markdown: PathBuf,
    pub html: PathBuf,
    /// The summary table (markdown), for printing.
    pub table: String,
    pub runs: Vec<SummaryRow>,
    /// Skipped lines and unreadable optional files.
    pub warnings: Vec<String>,
}

/// Shown at the top of report.md and report.html; shared so both agree.
pub(crate) const TABLE_NOTE: &str = "Success values are rates in [0, 1]; `x @s` is the value \
    at evaluation step s. Best test: the highest test-panel success (earliest on ties). \
    Rollouts count every generated rollout, probes included. Wall time sums `time.step_s` \
    and `time.eval_s`; tokens/s are means of the per-step rates.";

fn render_markdown(title: &str, table: &str, grouped: bool, figures: &[plot::Figure]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "# {title}\n");
    if grouped {
        let _ = writeln!(md, "{}\n", groups::GROUP_NOTE);
    }
    let _ = writeln!(md, "{TABLE_NOTE}\n");
    md.push_str(table);
    md.push_str("\n## Figures\n\n");
    for f in figures {
        let _ = writeln!(md, "### {}\n", f.title);
        let _ = writeln!(md, "![{}]({})\n", f.title, f.file);
        let _ = writeln!(md, "{}\n", f.caption);
    }
    md
}

/// Load the run directories and write the figures (`*.svg`), `report.md`
/// and `report.html` into `out` (created if needed).
pub fn write_report(runs: &[PathBuf], out: &Path) -> Result<ReportSummary, ReportError> {
    if runs.is_empty() {
        return Err(ReportError::NoRuns);
    }
    let loaded: Vec<Run> = runs.iter().map(|d| read_run(d)).collect::<Result<_, _>>()?;
    let rows: Vec<SummaryRow> = loaded.iter().map(summarize).collect();
    let groups = groups::seed_groups(&loaded);
    let figures = plot::figures(&loaded)?;
    let mut table = String::new();
    if let Some(g) = &groups {
        table.push_str(&markdown_rows(
            &groups::GROUP_HEADERS,
            1,
            g.iter().map(|r| groups::group_cells(r).to_vec()),
        ));
        table.push('\n');
    }
    table.push_str(&markdown_table(&rows));
    let names: Vec<&str> = loaded.iter().map(|r| r.name.as_str()).collect();
    let title = format!("actguide report: {}", names.join(", "));

    std::fs::create_dir_all(out).map_err(io_err(out))?;
    let mut files = Vec::new();
    for f in &figures {
        let p = out.join(&f.file);
        std::fs::write(&p, &f.svg).map_err(io_err(&p))?;
        files.push(p);
    }
    let markdown = out.join("report.md");
    std::fs::write(
        &markdown,
        render_markdown(&title, &table, groups.is_some(), &figures),
    )
    .map_err(io_err(&markdown))?;
    files.push(markdown.clone());
    let html_path = out.join("report.html");
    std::fs::write(
        &html_path,
        html::render(&title, &rows, groups.as_deref(), &figures),
    )
    .map_err(io_err(&html_path))?;
    files.push(html_path.clone());

    Ok(ReportSummary {
        files,
        markdown,
        html: html_path,
        table,
        runs: rows,
        warnings: loaded.into_iter().flat_map(|r| r.warnings).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A run-file line from its JSON.
    fn line<T: serde::de::DeserializeOwned>(v: Value) -> T {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn moving_average_is_trailing_with_short_start() {
        let ma = moving_average(&[1.0, 0.0, 1.0, 1.0], 2);
        assert_eq!(ma, vec![1.0, 0.5, 0.5, 1.0]);
        assert_eq!(moving_average(&[3.0, 5.0], 0), vec![3.0, 5.0]);
        assert!(moving_average(&[], 3).is_empty());
    }

    #[test]
    fn quantiles_interpolate() {
        let v = [0.0, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.5), Some(2.0));
        assert_eq!(quantile(&v, 0.1), Some(0.4));
        assert_eq!(quantile(&v, 0.9), Some(3.6));
        assert_eq!(quantile(&[7.0], 0.9), Some(7.0));
        assert_eq!(quantile(&[], 0.5), None);
    }

    fn row(step: u64, hash: &str) -> StepRow {
        StepRow {
            step,
            script_hash: Some(hash.into()),
            script_hashes: BTreeMap::from([("guidance".into(), hash.into())]),
            ..Default::default()
        }
    }

    #[test]
    fn marks_from_reloads_and_hash_changes() {
        let run = Run {
            steps: vec![
                row(0, "aaaaaaaaaaaa"),
                row(1, "bbbbbbbbbbbb"),
                row(2, "bbbbbbbbbbbb"),
                row(3, "bbbbbbbbbbbb"),
                row(4, "cccccccccccc"),
            ],
            reloads: vec![
                reload_row(&line(
                    json!({"step":1,"role":"guidance","ok":true,"hash":"bbbbbbbbbbbb"}),
                ))
                .unwrap(),
                reload_row(&line(
                    json!({"step":2,"role":"guidance","ok":false,"error":"x","active":"bbbb"}),
                ))
                .unwrap(),
                reload_row(&line(
                    json!({"step":3,"role":"reward","ok":false,"reverted":true,"error":"y"}),
                ))
                .unwrap(),
            ],
            ..Default::default()
        };
        let marks = script_marks(&run);
        assert_eq!(
            marks,
            vec![
                // The reload at step 1 explains the change at step 1
                // (edits load before their step runs).
                Mark {
                    step: 1,
                    kind: MarkKind::Reload,
                    label: "bbbbbbbb".into()
                },
                Mark {
                    step: 2,
                    kind: MarkKind::Rejected,
                    label: "rejected".into()
                },
                // A revert at the end of step 3 applies from step 4.
                Mark {
                    step: 4,
                    kind: MarkKind::Reverted,
                    label: "reward:reverted".into()
                },
                // No reload logged for this one.
                Mark {
                    step: 4,
                    kind: MarkKind::ScriptChange,
                    label: "cccccccc".into()
                },
            ]
        );
        let s = summarize(&run);
        assert_eq!(
            (s.script_versions, s.reloads_ok, s.reloads_failed),
            (3, 1, 2)
        );
    }

    #[test]
    fn summary_handles_missing_keys() {
        let run = Run {
            name: "r".into(),
            steps: vec![
                step_row(&line(json!({"step": 0})), 0),
                step_row(&line(json!({"rollouts": 5})), 1),
            ],
            ..Default::default()
        };
        let s = summarize(&run);
        assert_eq!(s.steps, 2);
        assert_eq!(s.total_rollouts, Some(5.0));
        assert_eq!(s.rollouts_per_step, Some(5.0));
        assert_eq!(s.final_test, None);
        assert_eq!(s.wall_s, None);
        let table = markdown_table(&[s]);
        assert!(
            table
                .lines()
                .nth(2)
                .unwrap()
                .starts_with("| r | – | 2 | – |"),
            "{table}"
        );
    }

    #[test]
    fn bad_json_names_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "{\"step\":0}\n{oops\n").unwrap();
        let e = read_run(dir.path()).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl:2: bad JSON"), "{e}");
        // A partly written last line (no newline) is a live run: skipped.
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":0}\n{\"step\":1,\"succ",
        )
        .unwrap();
        let run = read_run(dir.path()).unwrap();
        assert_eq!(run.steps.len(), 1);
        assert_eq!(run.warnings.len(), 1);
        let e = read_run(&dir.path().join("nope")).unwrap_err().to_string();
        assert!(e.contains("no metrics.jsonl"), "{e}");
    }
}
