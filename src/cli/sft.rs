//! `actguide sft`: the supervised warm start of an experiment file's `sft`
//! section (or resume one): the run loop with SFT steps.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Result};
use clap::Args;

use actguide::experiment::{self, Experiment, ExperimentFile, RunOptions};
use actguide::rundir::RunKind;

use super::print::{print_summary, EventPrinter};

// Flags of `actguide sft`.
#[derive(Args)]
pub struct SftArgs {
    /// Experiment file (*.rhai) with an `sft` section; omit with --resume.
    experiment: Option<PathBuf>,
    /// Resume the SFT run in this directory from its latest checkpoint.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after this many steps (the run can be resumed later).
    #[arg(value_parser = super::ranges::at_least(1), long)]
    stop_after: Option<usize>,
    /// Plain log lines even on a terminal.
    #[arg(long)]
    plain: bool,
}

pub fn run(a: SftArgs) -> Result<()> {
    let exp: Experiment = match (&a.experiment, &a.resume) {
        (Some(p), None) => match ExperimentFile::load(p)? {
            ExperimentFile::Single(e) => *e,
            ExperimentFile::Compare(_) => bail!(
                "{}: sft takes one experiment, not a comparison",
                p.display()
            ),
        },
        (None, Some(d)) => super::run::resolved_config(d)?,
        (Some(_), Some(_)) => bail!("give either an experiment file or --resume RUN_DIR, not both"),
        (None, None) => {
            bail!("give an experiment file (e.g. examples/sft.rhai) or --resume RUN_DIR")
        }
    };
    let stepping = Arc::new(AtomicBool::new(false));
    let opts = RunOptions {
        kind: RunKind::Sft,
        resume: a.resume,
        stop_after: a.stop_after,
        interrupt: Some(super::run::interrupt_on_signals(stepping.clone())?),
        stepping: Some(stepping),
        ..Default::default()
    };
    let printer = EventPrinter::new(exp.steps, a.plain);
    let summary = experiment::run(exp, &opts, &mut |ev| printer.print(ev))?;
    printer.finish();
    print_summary(&summary);
    if summary.interrupted {
        std::process::exit(super::run::INTERRUPTED);
    }
    Ok(())
}
