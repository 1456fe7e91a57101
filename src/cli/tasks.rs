//! `actguide tasks`: generate task panels and measure a random policy on
//! them.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use actguide::env::panel;

use super::args::IdField;

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
    /// Build a panel from an external env: goals from its first
    /// observations, expert actions from the env, replayed to check them.
    FromServer(FromServerArgs),
    /// Keep the tasks of a panel that match (expert length, type), in file
    /// order, optionally only the first N.
    Select(SelectArgs),
}

pub fn run(a: TasksArgs) -> Result<()> {
    match a.cmd {
        TasksCmd::Generate(a) => generate(a),
        TasksCmd::Stats(a) => stats(a),
        TasksCmd::FromServer(a) => from_server(a),
        TasksCmd::Select(a) => select(a),
    }
}

// Flags of `actguide tasks select`.
#[derive(Args)]
struct SelectArgs {
    /// The panel to select from.
    panel: PathBuf,
    /// Output panel file.
    #[arg(long)]
    out: PathBuf,
    /// Tasks with at least this many expert actions.
    #[arg(long)]
    min_expert: Option<usize>,
    /// Tasks with at most this many expert actions.
    #[arg(long)]
    max_expert: Option<usize>,
    /// Comma-separated task types (default: all).
    #[arg(long, value_delimiter = ',')]
    types: Vec<String>,
    /// Then only the first N (file order).
    #[arg(value_parser = super::ranges::at_least(1), long)]
    first: Option<usize>,
    /// Set KEY in every kept task's world to a JSON value (e.g.
    /// `reveal=true` for household; the env checks the world when a run
    /// starts). Repeatable.
    #[arg(long, value_name = "KEY=JSON")]
    world_set: Vec<String>,
    /// Keep the expert actions of only this share of the kept tasks (drawn
    /// by --seed), clearing the rest: scarce expert data.
    #[arg(long, value_parser = super::ranges::fraction)]
    expert_share: Option<f64>,
    /// Replace each kept household task's expert actions by a noisy
    /// demonstration: at each step, with this probability, a random
    /// admissible action other than the expert's, then the expert's plan
    /// from where that led (drawn by --seed and the task id).
    #[arg(long, value_parser = super::ranges::fraction)]
    expert_noise: Option<f64>,
    /// Longest noisy demonstration; a task none of whose draws reaches the
    /// goal within it keeps its clean expert actions.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 12)]
    noise_max_len: usize,
    /// Seed of the --expert-share and --expert-noise draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn select(a: SelectArgs) -> Result<()> {
    let tasks = panel::read_jsonl(&a.panel)?;
    let kept = panel::select(
        &tasks,
        &panel::Selection {
            min_expert: a.min_expert,
            max_expert: a.max_expert,
            types: a.types,
            first: a.first,
        },
    );
    if kept.is_empty() {
        anyhow::bail!("{}: no task matches the selection", a.panel.display());
    }
    let mut kept = kept;
    for kv in &a.world_set {
        let (key, value) = kv
            .split_once('=')
            .with_context(|| format!("--world-set {kv:?}: expected KEY=JSON"))?;
        let value: serde_json::Value = serde_json::from_str(value)
            .with_context(|| format!("--world-set {kv:?}: the value is not JSON"))?;
        panel::set_world_key(&mut kept, key, &value)?;
    }
    if let Some(share) = a.expert_share {
        let n = panel::keep_expert_share(&mut kept, share, a.seed);
        println!("kept the expert actions of {n} of {} tasks", kept.len());
    }
    if let Some(eps) = a.expert_noise {
        let st =
            actguide::env::household::add_expert_noise(&mut kept, eps, a.noise_max_len, a.seed)
                .with_context(|| format!("--expert-noise on {}", a.panel.display()))?;
        println!(
            "noisy demonstrations: {} of {} tasks changed ({} kept clean: no draw within {} actions), {} expert actions -> {}",
            st.changed, st.tasks, st.kept_clean, a.noise_max_len, st.clean_actions, st.noisy_actions
        );
    }
    panel::write_jsonl(&a.out, &kept)?;
    println!(
        "wrote {} of {} tasks to {}",
        kept.len(),
        tasks.len(),
        a.out.display()
    );
    Ok(())
}

// Flags of `actguide tasks generate`.
#[derive(Args)]
struct GenerateArgs {
    #[arg(long, default_value = "household")]
    env: actguide::env::BuiltinEnv,
    #[arg(long, default_value_t = 2026)]
    seed: u64,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 256)]
    train: usize,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 64)]
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
    /// A built-in env (unless --url or a command after `--` names an
    /// external one).
    #[arg(long, default_value = "household")]
    env: actguide::env::BuiltinEnv,
    /// An AgentGym-style HTTP env server.
    #[arg(long, conflicts_with = "command")]
    url: Option<String>,
    /// http: the key the server names its envs by (id: ALFWorld, env_idx:
    /// WebShop).
    #[arg(long, value_enum, default_value_t = IdField::Id)]
    id_field: IdField,
    /// A subprocess env (envs/PROTOCOL.md): the program and its arguments,
    /// after `--`.
    #[arg(last = true)]
    command: Vec<String>,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 16)]
    rollouts: usize,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 20)]
    max_steps: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// household: also the scripted procedure that does not know the
    /// answer (it acts on the agent's memory and searches): the ceiling a
    /// learned policy can reach.
    #[arg(long)]
    procedure: bool,
    /// With --procedure: a task's budget is its expert length plus this,
    /// capped at --max-steps (as `env.step_slack`).
    #[arg(long, requires = "procedure")]
    step_slack: Option<usize>,
}

fn stats(a: StatsArgs) -> Result<()> {
    use actguide::env::{make_env, EnvKind, EnvSpec};
    let (rollouts, max_steps) = (a.rollouts, a.max_steps);
    let tasks = panel::read_jsonl(&a.panel)?;
    if a.procedure {
        if a.url.is_some() || !a.command.is_empty() || a.env != actguide::env::BuiltinEnv::Household
        {
            anyhow::bail!("--procedure is the household env's scripted agent");
        }
        let table = actguide::env::household::procedure_success(&tasks, max_steps, a.step_slack)?;
        let budget = match a.step_slack {
            Some(s) => format!("expert length + {s}, at most {max_steps} steps"),
            None => format!("{max_steps} steps"),
        };
        println!("scripted procedure (the agent's memory only, searches), budget {budget}");
        println!("{:>10} {:>6} {:>8}", "difficulty", "tasks", "success");
        let mut solved = 0.0;
        for (d, n, s) in &table {
            println!("{d:>10} {n:>6} {s:>8.3}");
            solved += s * *n as f64;
        }
        println!(
            "{:>10} {:>6} {:>8.3}",
            "all",
            tasks.len(),
            solved / tasks.len() as f64
        );
    }
    let spec = match (a.url, a.command.is_empty()) {
        (Some(url), _) => EnvSpec {
            kind: EnvKind::Http {
                url,
                id_field: a.id_field.key(),
                expert: Default::default(),
            },
            ..EnvSpec::builtin(a.env)
        },
        (None, false) => EnvSpec {
            kind: EnvKind::Subprocess {
                command: a.command,
                expert: Default::default(),
            },
            ..EnvSpec::builtin(a.env)
        },
        (None, true) => EnvSpec::builtin(a.env),
    };
    let mut env = make_env(&spec, max_steps);
    let st = panel::random_policy_stats(env.as_mut(), &tasks, rollouts, a.seed);
    println!("random valid-action policy, {rollouts} rollouts/task, limit {max_steps} steps");
    println!("{:>10} {:>6} {:>8}", "difficulty", "tasks", "success");
    for (d, n, s) in st.table {
        println!("{d:>10} {n:>6} {s:>8.3}");
    }
    if let Some((task, e)) = st.env_errors.first() {
        eprintln!(
            "{} rollout(s) failed in the env and count as failures, e.g. {task}: {e}",
            st.env_errors.len()
        );
    }
    Ok(())
}

// Flags of `actguide tasks from-server`.
#[derive(Args)]
struct FromServerArgs {
    /// An AgentGym-style HTTP env server.
    #[arg(long, conflicts_with = "command", required_unless_present = "command")]
    url: Option<String>,
    /// Where the env has each task's expert actions: asked per task, per
    /// instance after a reset, or a field of the reset reply
    /// (docs/USAGE.md).
    #[arg(long, value_name = "task|instance|reset:PATH", default_value = "task")]
    expert: actguide::env::ExpertSource,
    /// http: the key the server names its envs by (id: ALFWorld, env_idx:
    /// WebShop).
    #[arg(long, value_enum, default_value_t = IdField::Id)]
    id_field: IdField,
    /// A subprocess env (envs/PROTOCOL.md): the program and its arguments,
    /// after `--`.
    #[arg(last = true)]
    command: Vec<String>,
    /// The tasks: a JSONL file of `{"id", "world", "type", "goal"}` lines
    /// (type and goal optional).
    #[arg(long, conflicts_with = "range", required_unless_present = "range")]
    worlds: Option<PathBuf>,
    /// The tasks: world `{"<world-key>": i}` for i in A..B (AgentGym's
    /// ALFWorld adapter resets by `game` number).
    #[arg(long, value_name = "A..B")]
    range: Option<String>,
    #[arg(long, default_value = "game")]
    world_key: String,
    /// Task ids of `--range`: this prefix and the number.
    #[arg(long, default_value = "game-")]
    id_prefix: String,
    /// The goal is the rest of the first observation's line after this.
    #[arg(long, default_value = "Your task is to:")]
    goal_after: String,
    /// Keep tasks whose expert was not replayed to success.
    #[arg(long)]
    no_verify: bool,
    #[arg(value_parser = super::ranges::positive, long, default_value_t = 30.0)]
    timeout_s: f64,
    #[arg(value_parser = super::ranges::retries, long, default_value_t = 2)]
    retries: usize,
    /// The panel to write (JSONL).
    #[arg(long)]
    out: PathBuf,
}

fn from_server(a: FromServerArgs) -> Result<()> {
    use actguide::env::external::Limits;
    use actguide::env::harvest::{harvest, read_seeds, HarvestOptions, TaskSeed};
    use actguide::env::{EnvKind, EnvSpec};
    let kind = match a.url {
        Some(url) => EnvKind::Http {
            url,
            id_field: a.id_field.key(),
            expert: a.expert.clone(),
        },
        None => EnvKind::Subprocess {
            command: a.command,
            expert: a.expert.clone(),
        },
    };
    anyhow::ensure!(
        a.timeout_s.is_finite() && a.timeout_s > 0.0,
        "--timeout-s must be a positive number of seconds"
    );
    let spec = EnvSpec {
        kind,
        limits: Limits {
            timeout: std::time::Duration::from_secs_f64(a.timeout_s),
            retries: a.retries,
        },
        ..EnvSpec::builtin(actguide::env::BuiltinEnv::Household)
    };
    let seeds: Vec<TaskSeed> = match (&a.worlds, &a.range) {
        (Some(p), _) => read_seeds(p)?,
        (None, Some(r)) => {
            let (lo, hi) = r
                .split_once("..")
                .and_then(|(l, h)| {
                    Some((l.trim().parse::<u64>().ok()?, h.trim().parse::<u64>().ok()?))
                })
                .with_context(|| format!("--range {r:?}: expected A..B, e.g. 0..100"))?;
            (lo..hi)
                .map(|i| TaskSeed {
                    id: format!("{}{i}", a.id_prefix),
                    world: serde_json::json!({ a.world_key.as_str(): i }),
                    task_type: String::new(),
                    goal: String::new(),
                })
                .collect()
        }
        (None, None) => unreachable!("clap requires --worlds or --range"),
    };
    let o = HarvestOptions {
        goal_after: a.goal_after,
        verify: !a.no_verify,
        ..Default::default()
    };
    let h = harvest(&spec, &seeds, &o)?;
    for r in &h.rejected {
        eprintln!("left out {}: {}", r.id, r.reason);
    }
    anyhow::ensure!(
        !h.tasks.is_empty(),
        "no task could be built from {} world(s)",
        seeds.len()
    );
    panel::write_jsonl(&a.out, &h.tasks)?;
    let seen = h.seen.write_for(&a.out)?;
    println!(
        "wrote {} task(s) to {} ({} left out{})",
        h.tasks.len(),
        a.out.display(),
        h.rejected.len(),
        if o.verify {
            ", experts replayed to success"
        } else {
            ", experts not replayed"
        }
    );
    println!(
        "wrote the {} action(s) and {} word(s) the env showed to {} (init-tiny --panel reads it)",
        h.seen.actions.len(),
        h.seen.words.len(),
        seen.display()
    );
    Ok(())
}
