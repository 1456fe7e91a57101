//! `actguide sft`: the supervised warm start of an experiment file's `sft`
//! section (or resume one).

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use actguide::experiment::sft::{self, SftEvent, SftOptions};
use actguide::experiment::{Experiment, ExperimentFile};

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
    let o = SftOptions {
        resume: a.resume,
        stop_after: a.stop_after,
    };
    let bar = (!a.plain && console::Term::stderr().is_term()).then(|| {
        let b = ProgressBar::new(exp.steps as u64);
        b.set_style(
            ProgressStyle::with_template("sft {pos:>5}/{len} [{bar:30}] {msg} ({eta})")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        b
    });
    let say = |s: String| match &bar {
        Some(b) => b.println(s),
        None => eprintln!("{s}"),
    };
    let steps = exp.steps;
    let summary = sft::run(exp, &o, &mut |ev| match ev {
        SftEvent::Started {
            run_dir,
            start_step,
            steps,
            trajectories,
        } => {
            say(format!(
                "sft: {} ({trajectories} expert trajectories, steps {}..{steps})",
                run_dir.display(),
                start_step + 1
            ));
            if let Some(b) = &bar {
                b.set_position(start_step as u64);
            }
        }
        SftEvent::Step(l) => {
            let line = format!(
                "nll {:.4} | {} traj ({} with plan) | grad {:.3} | lr {:.2e} | {:.2}s/step | {:.0} train tok/s",
                l.nll, l.trajectories, l.with_plan, l.grad_norm, l.lr, l.seconds, l.train_tok_s
            );
            match &bar {
                Some(b) => {
                    b.set_position(l.step as u64 + 1);
                    b.set_message(line);
                }
                None => eprintln!("step {:>5}/{steps} | {line}", l.step + 1),
            }
            if l.env_errors > 0 || l.unencodable_actions > 0 {
                say(format!(
                    "step {}: {} trajectories failed in the env, {} actions the tokenizer cannot encode (left out)",
                    l.step + 1,
                    l.env_errors,
                    l.unencodable_actions
                ));
            }
        }
        SftEvent::Checkpoint(p) => {
            if bar.is_none() {
                eprintln!("checkpoint {}", p.display());
            }
        }
        SftEvent::Log(l) => say(format!("sft: {l}")),
    })?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    println!(
        "sft run {}: {} steps{}{}",
        summary.run_dir.display(),
        summary.steps_done,
        summary
            .own_success
            .map(|s| format!(", greedy success on its own tasks {s:.3}"))
            .unwrap_or_default(),
        summary
            .model
            .map(|m| format!(", model {}", m.display()))
            .unwrap_or_default()
    );
    Ok(())
}
