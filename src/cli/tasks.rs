//! `actguide tasks`: generate task panels and measure a random policy on
//! them.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use actguide::env::panel;

// Flags of `actguide tasks`: only its subcommand.
#[derive(Args)]
pub struct TasksArgs {
    #[command(subcommand)]
    cmd: TasksCmd,
}

#[derive(Subcommand)]
enum TasksCmd {
    /// Generate train/test panels.
    Generate(GenerateArgs),
    /// Success of a uniformly random valid-action policy by difficulty.
    Stats(StatsArgs),
}

pub fn run(a: TasksArgs) -> Result<()> {
    match a.cmd {
        TasksCmd::Generate(a) => generate(a),
        TasksCmd::Stats(a) => stats(a),
    }
}

// Flags of `actguide tasks generate`.
#[derive(Args)]
struct GenerateArgs {
    #[arg(long, default_value = "household")]
    env: actguide::env::BuiltinEnv,
    #[arg(long, default_value_t = 2026)]
    seed: u64,
    #[arg(long, default_value_t = 256)]
    train: usize,
    #[arg(long, default_value_t = 64)]
    test: usize,
    /// Output folder (default: envs/<env>).
    #[arg(long)]
    out: Option<PathBuf>,
}

fn generate(a: GenerateArgs) -> Result<()> {
    let (tr, te) = actguide::env::generate_panels(a.env, a.seed, a.train, a.test)?;
    let out = a
        .out
        .unwrap_or_else(|| PathBuf::from("envs").join(a.env.name()));
    std::fs::create_dir_all(&out).with_context(|| out.display().to_string())?;
    panel::write_panels(&out, &tr, &te)?;
    println!(
        "wrote {} train and {} test tasks to {}",
        tr.len(),
        te.len(),
        out.display()
    );
    Ok(())
}

// Flags of `actguide tasks stats`.
#[derive(Args)]
struct StatsArgs {
    panel: PathBuf,
    #[arg(long, default_value = "household")]
    env: actguide::env::BuiltinEnv,
    #[arg(long, default_value_t = 16)]
    rollouts: usize,
    #[arg(long, default_value_t = 20)]
    max_steps: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn stats(a: StatsArgs) -> Result<()> {
    let (rollouts, max_steps) = (a.rollouts, a.max_steps);
    let tasks = panel::read_jsonl(&a.panel)?;
    let table = actguide::env::random_policy_success(a.env, &tasks, rollouts, max_steps, a.seed);
    println!("random valid-action policy, {rollouts} rollouts/task, limit {max_steps} steps");
    println!("{:>10} {:>6} {:>8}", "difficulty", "tasks", "success");
    for (d, n, s) in table {
        println!("{d:>10} {n:>6} {s:>8.3}");
    }
    Ok(())
}
