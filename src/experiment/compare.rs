//! Comparisons: several runs that share panel, seed and step budget (an
//! experiment file with `compare: [...]`), run one after another into one
//! directory (one after another, or `jobs` at a time), then one report
//! over all of them.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::env::panel;
use crate::experiment::config::{Comparison, ENTRY_MODEL};
use crate::experiment::models;
use crate::experiment::run::{open_scripts, run, Event, RunError, RunOptions, RunSummary};
use crate::rundir::{fresh_dir, ComparisonManifest, RunKind};

/// What a finished comparison produced.
#[derive(Debug, Clone)]
pub struct ComparisonSummary {
    /// `<runs_dir>/<name>` (or `-2`, `-3`, … when taken).
    pub dir: PathBuf,
    pub runs: Vec<RunSummary>,
    /// The report directory, when the report was written.
    pub report: Option<PathBuf>,
}

/// Run every entry of `cmp`, each into `<dir>/<entry name>`, then write
/// the comparison report to `<dir>/report`. Every entry is checked first
/// ([`check_entries`]): nothing is created when one cannot start. `jobs`
/// entries run at once
/// (each on its own thread pool with an equal share of the cores; a run's
/// numbers do not depend on its thread count); `on_event` gets each event
/// with its entry's name. `opts.stop_after` (steps per run) is for smoke
/// tests; `opts.resume` is not used; an interrupt stops the entries in
/// progress (with a checkpoint) and starts no more. The first failed entry
/// (in list order) is the error, once the running ones have ended.
pub fn run_comparison(
    cmp: &Comparison,
    opts: &RunOptions,
    jobs: usize,
    on_event: &(dyn Fn(&str, Event) + Sync),
) -> Result<ComparisonSummary, RunError> {
    check_entries(cmp)?;
    let dir = fresh_dir(
        &Path::new(&cmp.runs_dir).join(&cmp.name),
        ComparisonManifest::FILE,
    );
    std::fs::create_dir_all(&dir).map_err(RunError::io(&dir))?;
    ComparisonManifest {
        name: cmp.name.clone(),
        runs: cmp.runs.iter().map(|e| e.name.clone()).collect(),
    }
    .write(&dir)?;
    let opts = RunOptions {
        resume: None,
        ..opts.clone()
    };
    let results = run_entries(cmp, &dir, &opts, jobs, on_event);
    let mut runs = Vec::new();
    for r in results.into_iter().flatten() {
        runs.push(r?);
    }
    let dirs: Vec<PathBuf> = runs.iter().map(|r| r.run_dir.clone()).collect();
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

/// Open what every entry names, with the loaders its run uses, creating
/// nothing: its panels, its model's config and tokenizer
/// ([`models::open`]), its scripts (compiled). A comparison trains its
/// entries one after another for hours; a missing or broken file in a
/// late entry would otherwise surface only when that entry starts. The
/// error names the first entry (in list order) that cannot start.
pub fn check_entries(cmp: &Comparison) -> Result<(), RunError> {
    for exp in &cmp.runs {
        let check = || -> Result<(), RunError> {
            // Read only: a panel without expert actions is filled by its
            // env when the run starts, which may launch the env's server.
            panel::read_jsonl(Path::new(&exp.env.train))?;
            panel::read_jsonl(Path::new(&exp.env.test))?;
            // A model another entry trains is opened when that entry ends.
            if !exp.model.path.starts_with(ENTRY_MODEL) {
                models::open(exp)?;
            }
            open_scripts(exp, None)?;
            Ok(())
        };
        check().map_err(|e| RunError::Entry {
            entry: exp.name.clone(),
            source: Box::new(e),
        })?;
    }
    Ok(())
}

/// The model folder entry `dep` wrote, for entry `name` that starts from
/// it: waits while `dep` is still running (entries start in list order,
/// so it has started); an error if it failed or stopped early.
fn entry_model(
    slot: &Mutex<Option<Result<RunSummary, RunError>>>,
    dep: &str,
    name: &str,
) -> Result<String, RunError> {
    loop {
        if let Some(r) = slot.lock().expect("comparison slot").as_ref() {
            return match r {
                Ok(s) => s.model.as_ref().map(|m| m.display().to_string()).ok_or_else(|| {
                    RunError::Sft(format!(
                        "entry \"{name}\" starts from entry \"{dep}\"'s model, which it did not write (stopped before its last step)"
                    ))
                }),
                Err(_) => Err(RunError::Sft(format!(
                    "entry \"{name}\" starts from entry \"{dep}\"'s model, and \"{dep}\" failed"
                ))),
            };
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Run the entries, `jobs` at a time; entry i's result lands in slot i
/// (`None`: not started, after an interrupt or a failure).
fn run_entries(
    cmp: &Comparison,
    dir: &Path,
    opts: &RunOptions,
    jobs: usize,
    on_event: &(dyn Fn(&str, Event) + Sync),
) -> Vec<Option<Result<RunSummary, RunError>>> {
    let n = cmp.runs.len();
    let jobs = jobs.clamp(1, n.max(1));
    let slots: Vec<Mutex<Option<Result<RunSummary, RunError>>>> =
        (0..n).map(|_| Mutex::new(None)).collect();
    let one = |i: usize| {
        let mut exp = cmp.runs[i].clone();
        exp.runs_dir = dir.display().to_string();
        let name = exp.name.clone();
        if let Some(j) = cmp.after.get(i).copied().flatten() {
            exp.model.path = entry_model(&slots[j], &cmp.runs[j].name, &name)?;
        }
        // An entry with an `sft` section is a behaviour-cloning arm.
        let opts = RunOptions {
            kind: if exp.sft.is_some() {
                RunKind::Sft
            } else {
                opts.kind
            },
            ..opts.clone()
        };
        run(exp, &opts, &mut |ev| on_event(&name, ev))
    };
    if jobs == 1 {
        for (i, slot) in slots.iter().enumerate() {
            if i > 0 && opts.interrupted() {
                break;
            }
            let r = one(i);
            let failed = r.is_err();
            *slot.lock().expect("comparison slot") = Some(r);
            if failed {
                break;
            }
        }
        return slots
            .into_iter()
            .map(|m| m.into_inner().expect("comparison slot"))
            .collect();
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let per_job = (cores / jobs).max(1);
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| {
                // Without its own pool every entry would queue on the global
                // one; a pool that cannot be built leaves the global one.
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(per_job)
                    .build()
                    .ok();
                loop {
                    if failed.load(Ordering::SeqCst) || opts.interrupted() {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let r = match &pool {
                        Some(p) => p.install(|| one(i)),
                        None => one(i),
                    };
                    if r.is_err() {
                        failed.store(true, Ordering::SeqCst);
                    }
                    *slots[i].lock().expect("comparison slot") = Some(r);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|m| m.into_inner().expect("comparison slot"))
        .collect()
}
