//! Script tooling without a model: `actguide check` and `actguide simulate`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use actguide::env::BuiltinEnv;
use actguide::experiment::PanelRef;
use actguide::guidance::simulate::{simulate_file, table, SimParams};

use super::args::PANEL;
use super::print_json;

// Flags of `actguide check`.
#[derive(Args)]
pub struct CheckArgs {
    script: PathBuf,
}

pub fn check(args: CheckArgs) -> Result<()> {
    for line in actguide::guidance::check_script(&args.script)? {
        println!("{line}");
    }
    println!("ok");
    Ok(())
}

// Flags of `actguide simulate`.
#[derive(Args)]
pub struct SimulateArgs {
    script: PathBuf,
    /// The household env's train or test panel, or a panel file.
    #[arg(long, value_name = PANEL, default_value = "train")]
    panel: PanelRef,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 30)]
    steps: usize,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 8)]
    tasks_per_step: usize,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 8)]
    group_size: usize,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 3)]
    clusters: usize,
    /// Bound on review rounds per task and step.
    #[arg(long, default_value_t = 8)]
    max_rounds: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Learner: initial horizon (actions it chains on its own).
    #[arg(value_parser = super::ranges::finite, long, default_value_t = 1.5)]
    horizon: f64,
    /// Learner: slope of success in (horizon - actions to play).
    #[arg(value_parser = super::ranges::positive, long, default_value_t = 1.5)]
    sharpness: f64,
    /// Learner: fraction of an action a shown plan action takes off.
    #[arg(value_parser = super::ranges::fraction, long, default_value_t = 0.8)]
    plan_gain: f64,
    /// Learner: horizon gained per step at full GRPO signal.
    #[arg(value_parser = super::ranges::non_negative, long, default_value_t = 0.3)]
    learn_rate: f64,
    /// Learner: horizon gained per step regardless of signal.
    #[arg(value_parser = super::ranges::finite, long, default_value_t = 0.0, allow_negative_numbers = true)]
    drift: f64,
    /// Model `rollout.async`: each step plans and samples before the
    /// previous step's update reaches the script and the learner.
    #[arg(long = "async")]
    lag: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn simulate(a: SimulateArgs) -> Result<()> {
    let p = SimParams {
        steps: a.steps,
        tasks_per_step: a.tasks_per_step,
        group_size: a.group_size,
        clusters: a.clusters,
        max_rounds: a.max_rounds,
        seed: a.seed,
        horizon: a.horizon,
        sharpness: a.sharpness,
        plan_gain: a.plan_gain,
        learn_rate: a.learn_rate,
        drift: a.drift,
        lag: a.lag,
    };
    let panel = a.panel.of_env(BuiltinEnv::Household);
    let report = simulate_file(&a.script, &panel, &p)?;
    if a.json {
        print_json(&report)?;
    } else {
        print!("{}", table(&report));
    }
    Ok(())
}
