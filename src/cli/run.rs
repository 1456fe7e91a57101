//! `actguide run` and `actguide sft`: run an experiment file (RL or SFT
//! steps), a comparison, or resume a run; and `dp-worker`, a rank of a
//! data-parallel run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use actguide::distributed::launch::{self, LaunchFlags};
use actguide::experiment::{self, Comparison, Experiment, ExperimentFile, RunOptions, WorkerPlace};
use actguide::model::device::DeviceSpec;
use actguide::rundir::{RunDir, RunKind};

use super::args::DeviceArg;
use super::print::{print_comparison, print_summary, EventPrinter};

// Flags `actguide run` and `actguide sft` share: what to run and how to
// show it.
#[derive(Args)]
pub struct LoopArgs {
    /// Experiment file (*.rhai); omit with --resume.
    experiment: Option<PathBuf>,
    /// Resume the run in this directory from its latest checkpoint.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after this many steps (the run can be resumed later).
    #[arg(value_parser = super::ranges::at_least(1), long)]
    stop_after: Option<usize>,
    /// Plain log lines even on a terminal.
    #[arg(long)]
    plain: bool,
}

// Flags of `actguide run`.
#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    common: LoopArgs,
    /// Memory (GiB) the run may plan for, instead of what the machine
    /// reports free; a configuration whose estimated peak exceeds 85 % of
    /// it is refused before it starts.
    #[arg(value_parser = super::ranges::positive, long)]
    memory_gb: Option<f64>,
    /// Comparisons: run this many entries at once, the cores shared
    /// equally between them (same numbers as one at a time).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    jobs: u16,
    /// Data-parallel training: one process per device, e.g. `cuda:0,cuda:1`
    /// or `cpu,cpu` (docs/DISTRIBUTED.md).
    #[arg(long, value_delimiter = ',', value_name = "cpu|cuda|cuda:N,...")]
    devices: Vec<DeviceSpec>,
    /// Several nodes: how many (each one `actguide run` with its own
    /// --devices); also read from torchrun's or Slurm's variables.
    #[arg(long, value_parser = super::ranges::at_least(1), help_heading = "Nodes")]
    nodes: Option<usize>,
    /// This node, 0..nodes; node 0 owns the run directory.
    #[arg(long, help_heading = "Nodes")]
    node_rank: Option<usize>,
    /// HOST:PORT where node 0 listens and the others connect.
    #[arg(long, value_name = "HOST:PORT", help_heading = "Nodes")]
    rendezvous: Option<String>,
    /// Seconds ranks wait for each other to join (default 300).
    #[arg(long, value_parser = super::ranges::at_least(1), help_heading = "Nodes")]
    join_timeout: Option<usize>,
    /// With --resume: take a checkpoint that has no SHA256SUMS as it is.
    #[arg(long, requires = "resume")]
    accept_unverified: bool,
    /// With --resume: continue although the run's experiment.json differs
    /// from the settings the checkpoint was trained under.
    #[arg(long, requires = "resume")]
    accept_changed_config: bool,
}

// Flags of `actguide sft`.
#[derive(Args)]
pub struct SftArgs {
    #[command(flatten)]
    common: LoopArgs,
}

// Flags of `actguide dp-worker` (started by a node's first process, not
// by hand).
#[derive(Args)]
pub struct WorkerArgs {
    #[arg(long)]
    rank: usize,
    #[arg(value_parser = super::ranges::at_least(2), long)]
    world: usize,
    /// This rank's node.
    #[arg(long, default_value_t = 0)]
    node: usize,
    /// Rank 0's address.
    #[arg(long)]
    rendezvous: String,
    #[command(flatten)]
    device: DeviceArg,
    /// Seconds to wait for the rendezvous.
    #[arg(long, value_parser = super::ranges::at_least(1), default_value_t = 300)]
    join_timeout: usize,
}

/// Serve rank 0 of a data-parallel run.
pub fn dp_worker(a: WorkerArgs) -> Result<()> {
    ignore_signals()?;
    let place = WorkerPlace {
        rank: a.rank,
        world: a.world,
        node: a.node,
        rendezvous: a.rendezvous,
        device: Some(a.device.or_cpu()),
        local_rank: None,
        join_timeout: Duration::from_secs(a.join_timeout as u64),
    };
    experiment::serve_worker(&place)
        .with_context(|| format!("rank {} of {} (node {})", a.rank, a.world, a.node))
}

/// Ctrl-C reaches the whole process group: rank 0 finishes its step,
/// checkpoints and then tells the other ranks to stop, so they must not
/// die first (a lost rank would fail that step).
fn ignore_signals() -> Result<()> {
    ctrlc::set_handler(|| {}).context("cannot install the SIGINT/SIGTERM handler")
}

pub fn run(args: RunArgs) -> Result<()> {
    let RunArgs {
        common,
        memory_gb,
        jobs,
        devices,
        nodes,
        node_rank,
        rendezvous,
        join_timeout,
        accept_unverified,
        accept_changed_config,
    } = args;
    let launch = launch::from_env(&LaunchFlags {
        nodes,
        node_rank,
        rendezvous,
    })?;
    let join_timeout = join_timeout.map(|s| Duration::from_secs(s as u64));
    if let Some(l) = launch.as_ref().filter(|l| l.node > 0) {
        // Not node 0: the experiment, the run directory and the scripts
        // are rank 0's; this node only lends its devices.
        ignore_signals()?;
        eprintln!(
            "node {} of {} (from {}): joining rank 0 at {}",
            l.node, l.nodes, l.source, l.rendezvous
        );
        let opts = RunOptions {
            devices,
            launch: Some(l.clone()),
            join_timeout,
            ..Default::default()
        };
        return experiment::serve_node(&opts)
            .with_context(|| format!("node {} of {}", l.node, l.nodes));
    }
    let opts = RunOptions {
        memory_limit: memory_gb.map(|g| (g * (1u64 << 30) as f64) as u64),
        devices,
        launch,
        join_timeout,
        accept_unverified,
        accept_changed_config,
        ..options(RunKind::Rl, &common)?
    };
    let exp = match load(&common, "examples/quickstart.rhai")? {
        ExperimentFile::Single(e) => *e,
        ExperimentFile::Compare(c) => {
            // Entries start and end at different times (several at once
            // with --jobs): an interrupt always lets the steps in progress
            // finish with their checkpoints.
            if let Some(s) = &opts.stepping {
                s.store(true, Ordering::SeqCst);
            }
            let opts = RunOptions {
                stepping: None,
                ..opts.clone()
            };
            return compare(&c, &opts, jobs.into(), common.plain);
        }
    };
    run_one(exp, &opts, common.plain)
}

/// `actguide sft`: the run loop with SFT steps, on one experiment.
pub fn sft(args: SftArgs) -> Result<()> {
    let common = args.common;
    let opts = options(RunKind::Sft, &common)?;
    let exp = match load(&common, "examples/sft.rhai")? {
        ExperimentFile::Single(e) => *e,
        ExperimentFile::Compare(_) => bail!(
            "{}: sft takes one experiment, not a comparison",
            common
                .experiment
                .as_deref()
                .unwrap_or(Path::new("?"))
                .display()
        ),
    };
    run_one(exp, &opts, common.plain)
}

/// The options of a run of `kind`: resume, stop and signal handling.
fn options(kind: RunKind, a: &LoopArgs) -> Result<RunOptions> {
    let stepping = Arc::new(AtomicBool::new(false));
    Ok(RunOptions {
        kind,
        resume: a.resume.clone(),
        stop_after: a.stop_after,
        interrupt: Some(interrupt_on_signals(stepping.clone())?),
        stepping: Some(stepping),
        ..Default::default()
    })
}

/// The experiment file, or with `--resume` the run's resolved config;
/// `example` names a file to suggest when neither is given.
fn load(a: &LoopArgs, example: &str) -> Result<ExperimentFile> {
    match (&a.experiment, &a.resume) {
        (Some(p), None) => Ok(ExperimentFile::load(p)?),
        (None, Some(d)) => Ok(ExperimentFile::Single(Box::new(resolved_config(d)?))),
        (Some(_), Some(_)) => bail!("give either an experiment file or --resume RUN_DIR, not both"),
        (None, None) => bail!("give an experiment file (e.g. {example}) or --resume RUN_DIR"),
    }
}

/// Run one experiment with a progress printer, print its summary; an
/// interrupted run exits with [`INTERRUPTED`].
fn run_one(exp: Experiment, opts: &RunOptions, plain: bool) -> Result<()> {
    let printer = EventPrinter::new(exp.steps, plain);
    let summary = experiment::run(exp, opts, &mut |ev| printer.print(ev))?;
    printer.finish();
    print_summary(&summary);
    if summary.interrupted {
        // Stopped early with a checkpoint: not a finished run.
        std::process::exit(INTERRUPTED);
    }
    Ok(())
}

/// The exit code of a run stopped by SIGINT / SIGTERM (128 + SIGINT, as
/// shells report it).
const INTERRUPTED: i32 = 130;

/// A flag SIGINT / SIGTERM raise: the run ends its step, writes a
/// checkpoint and stops. Before the first step (`stepping` not yet
/// raised: loading, set-up) there is nothing to checkpoint, so the process
/// stops at once; so does a second signal.
fn interrupt_on_signals(stepping: Arc<AtomicBool>) -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    let seen = flag.clone();
    ctrlc::set_handler(move || {
        if !stepping.load(Ordering::SeqCst) {
            eprintln!(
                "interrupt: stopping now (the run had not started a step: nothing to checkpoint)"
            );
            std::process::exit(INTERRUPTED);
        }
        if seen.swap(true, Ordering::SeqCst) {
            eprintln!("second interrupt: stopping now, without a checkpoint");
            std::process::exit(INTERRUPTED);
        }
        eprintln!(
            "interrupt: finishing the current step, then writing a checkpoint (again to stop now)"
        );
    })
    .context("cannot install the SIGINT/SIGTERM handler")?;
    Ok(flag)
}

/// The resolved config a run wrote into its directory (`--resume`).
fn resolved_config(run_dir: &std::path::Path) -> Result<Experiment> {
    RunDir::at(run_dir)
        .read_experiment()
        .context("cannot read the run's resolved config")
}

/// Run a comparison, then print one line per run and where the report is.
fn compare(c: &Comparison, opts: &RunOptions, jobs: usize, plain: bool) -> Result<()> {
    let steps = c.runs.first().map_or(0, |e| e.steps);
    let started = std::time::Instant::now();
    let out = if jobs > 1 {
        // One bar cannot follow several runs: plain lines, tagged.
        let printer = EventPrinter::new(steps, true);
        experiment::run_comparison(c, opts, jobs, &|name, ev| printer.print_as(Some(name), ev))?
    } else {
        let printer = EventPrinter::new(steps, plain);
        let out = experiment::run_comparison(c, opts, 1, &|_, ev| printer.print(ev))?;
        printer.finish();
        out
    };
    eprintln!(
        "comparison: {} runs in {:.0} s ({} at a time)",
        out.runs.len(),
        started.elapsed().as_secs_f64(),
        jobs
    );
    print_comparison(&out);
    if out.runs.iter().any(|r| r.interrupted) {
        std::process::exit(INTERRUPTED);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(experiment: Option<&str>, resume: Option<&str>) -> LoopArgs {
        LoopArgs {
            experiment: experiment.map(PathBuf::from),
            resume: resume.map(PathBuf::from),
            stop_after: None,
            plain: true,
        }
    }

    #[test]
    fn run_and_sft_take_a_file_or_a_run_directory_not_both() {
        let e = load(&args(None, None), "examples/sft.rhai").err().unwrap();
        assert_eq!(
            e.to_string(),
            "give an experiment file (e.g. examples/sft.rhai) or --resume RUN_DIR"
        );
        let e = load(&args(Some("a.rhai"), Some("runs/a")), "x")
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "give either an experiment file or --resume RUN_DIR, not both"
        );
        let e = load(&args(None, Some("/nonexistent/run")), "x")
            .err()
            .unwrap();
        assert!(e.to_string().contains("resolved config"), "{e:#}");
    }
}
