//! Comparisons: several runs that share panel, seed and step budget (an
//! experiment file with `compare: [...]`), run one after another into one
//! directory, then one report over all of them.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::experiment::config::Comparison;
use crate::experiment::run::{run, Event, RunError, RunOptions, RunSummary};
use crate::rundir::{fresh_dir, write_atomic};

/// The manifest of a comparison directory.
const COMPARISON_FILE: &str = "comparison.json";

/// What a finished comparison produced.
#[derive(Debug, Clone)]
pub struct ComparisonSummary {
    /// `<runs_dir>/<name>` (or `-2`, `-3`, … when taken).
    pub dir: PathBuf,
    pub runs: Vec<RunSummary>,
    /// The report directory, when the report was written.
    pub report: Option<PathBuf>,
}

/// Run every entry of `cmp` in order, each into `<dir>/<entry name>`, then
/// write the comparison report to `<dir>/report`. `opts.stop_after` (steps
/// per run) is for smoke tests; `opts.resume` is not used; an interrupt
/// stops the entry in progress (with a checkpoint) and skips the rest.
pub fn run_comparison(
    cmp: &Comparison,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<ComparisonSummary, RunError> {
    let dir = fresh_dir(&Path::new(&cmp.runs_dir).join(&cmp.name), COMPARISON_FILE);
    std::fs::create_dir_all(&dir).map_err(RunError::io(&dir))?;
    let names: Vec<&str> = cmp.runs.iter().map(|e| e.name.as_str()).collect();
    let manifest = json!({ "name": cmp.name, "runs": names });
    write_atomic(
        &dir.join(COMPARISON_FILE),
        serde_json::to_string_pretty(&manifest)
            .unwrap_or_default()
            .as_bytes(),
    )?;
    let mut runs = Vec::new();
    let mut dirs = Vec::new();
    for exp in &cmp.runs {
        let mut exp = exp.clone();
        exp.runs_dir = dir.display().to_string();
        runs.push(run(
            exp,
            &RunOptions {
                resume: None,
                ..opts.clone()
            },
            on_event,
        )?);
        dirs.extend(runs.last().map(|r| r.run_dir.clone()));
        if opts.interrupted() {
            break;
        }
    }
    let out = dir.join("report");
    crate::report::write_report(&dirs, &out).map_err(|source| RunError::Report {
        out: out.clone(),
        source,
    })?;
    Ok(ComparisonSummary {
        dir,
        runs,
        report: Some(out),
    })
}
