//! The run loop: sample tasks, ask the guidance script for specs, roll out,
//! train, update the script, log metrics, evaluate and checkpoint; resume
//! from the latest checkpoint continues exactly.

use std::collections::{BTreeMap, BTreeSet};

use crate::report::tensorboard::{scalars_from_json, wall_time_now, EventWriter};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{json, Value};

use crate::env::{fill_experts, make_env, panel, Env, Task};
use crate::experiment::config::{ConfigError, Experiment};
use crate::experiment::eval::{evaluate, EvalSet};
use crate::experiment::metrics::{mean, round, std, success_breakdown};
use crate::guidance::host::{EpisodeView, ReloadOutcome, Role, TurnView};
use crate::guidance::rounds::{drive, DriveReport, Outcome, Request};
use crate::guidance::{Clusters, GuidanceHost, PlanLoss, ResolvedSpec, TaskResult, TaskView};
use crate::model::{ModelError, ModelSource, Policy, Tok};
use crate::rollout::{self, EpisodeRequest, RolloutError, RolloutOptions, RolloutStats};
use crate::script::watch::FileWatcher;
use crate::script::ScriptError;
use crate::seed;
use crate::train::checkpoint::{self, CheckpointError, CheckpointFiles, RunState};
use crate::train::{
    build_samples, group_advantages, is_zero_std, AdvantageKind, SampleOptions, TrainError, Trainer,
};

/// How to run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Continue the run in this directory from its latest checkpoint.
    pub resume: Option<PathBuf>,
    /// Stop after this many steps of this invocation (tests simulate a
    /// killed run with it); the step budget of the experiment is unchanged.
    pub stop_after: Option<usize>,
}

/// What the loop reports while it runs (the binary prints these).
#[derive(Debug, Clone)]
pub enum Event {
    Started {
        run_dir: PathBuf,
        start_step: usize,
        steps: usize,
        params: usize,
        /// Parameters the optimiser updates (the adapters under LoRA).
        trainable: usize,
        train_tasks: usize,
        test_tasks: usize,
    },
    Step {
        step: usize,
        metrics: Value,
    },
    Eval {
        step: usize,
        result: Value,
    },
    ScriptError(String),
    /// The guidance script was edited: `Ok(hash)` is the new active
    /// version (from this step on), `Err(msg)` kept the last good one.
    Reload {
        step: usize,
        /// "guidance", "reward" or "intervene".
        role: String,
        result: Result<String, String>,
    },
    Log(String),
    Checkpoint(PathBuf),
}

/// Final figures of a run.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub run_dir: PathBuf,
    pub steps_done: usize,
    pub start_test_success: Option<f64>,
    pub end_test_success: Option<f64>,
    pub seconds: f64,
    pub rollout_tokens_per_s: f64,
    pub train_tokens_per_s: f64,
    pub seconds_per_step: f64,
}

/// Errors that stop a run (before or while it runs).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Script(#[from] ScriptError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Panel(#[from] panel::PanelError),
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("{path}: {msg}")]
    Io { path: String, msg: String },
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> RunError {
    RunError::Io {
        path: path.display().to_string(),
        msg: e.to_string(),
    }
}

/// Everything a run holds.
struct Ctx {
    exp: Experiment,
    run_dir: PathBuf,
    train: Vec<Task>,
    test: Vec<Task>,
    clusters: Clusters,
    tok: Tok,
    /// The opened `model.path` (tokenizer side files for checkpoints).
    src: ModelSource,
    policy: Policy,
    trainer: Trainer,
    host: GuidanceHost,
    script_copy: String,
    /// Saved copies of the reward and intervention scripts, by role.
    copies: BTreeMap<String, String>,
    evals: Vec<(usize, f64)>,
    /// In-region task ids per evaluation panel, fixed at the first
    /// evaluation.
    regions: BTreeMap<String, BTreeSet<String>>,
    /// TensorBoard event file under `<run>/tb/` (a new file per process,
    /// as TensorBoard expects).
    tb: Option<EventWriter>,
    ropts: RolloutOptions,
    /// Watches the guidance script for hot reload (None if watching is
    /// unavailable on this system).
    watcher: Option<FileWatcher>,
}

/// Run (or resume) an experiment to its step budget.
pub fn run(
    exp: Experiment,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<RunSummary, RunError> {
    let t_start = Instant::now();
    let (mut ctx, start_step) = setup(exp, opts)?;
    let steps = ctx.exp.steps;
    on_event(Event::Started {
        run_dir: ctx.run_dir.clone(),
        start_step,
        steps,
        params: ctx.policy.num_params(),
        trainable: ctx.policy.num_trainable_params(),
        train_tasks: ctx.train.len(),
        test_tasks: ctx.test.len(),
    });
    let make = {
        let spec = ctx.exp.env.spec();
        move |limit: usize| -> Box<dyn Env> { make_env(&spec, limit) }
    };
    if start_step == 0 && !ctx.evals.iter().any(|(s, _)| *s == 0) {
        run_eval(&mut ctx, 0, &make, on_event)?;
    }
    let metrics_path = ctx.run_dir.join("metrics.jsonl");
    let mut totals = (0usize, 0f64, 0usize, 0f64, 0usize);
    let mut step = start_step;
    let mut done_here = 0usize;
    while step < steps {
        if opts.stop_after.is_some_and(|n| done_here >= n) {
            break;
        }
        let line = train_step(&mut ctx, step, &make, on_event)?;
        let t = &line["time"];
        totals.0 += line["rollout_tokens"].as_u64().unwrap_or(0) as usize;
        totals.1 += t["rollout_s"].as_f64().unwrap_or(0.0);
        totals.2 += line["train_tokens"].as_u64().unwrap_or(0) as usize;
        totals.3 += t["train_s"].as_f64().unwrap_or(0.0);
        totals.4 += 1;
        append_line(&metrics_path, &line)?;
        tb_write(&mut ctx, step, "train", &line)?;
        on_event(Event::Step {
            step,
            metrics: line,
        });
        step += 1;
        done_here += 1;
        let every = ctx.exp.evaluation.every;
        if step == steps || (every > 0 && step % every == 0) {
            run_eval(&mut ctx, step, &make, on_event)?;
        }
        let ck = ctx.exp.checkpoint.every;
        if step == steps || (ck > 0 && step % ck == 0) {
            let dir = save_checkpoint(&ctx, step)?;
            on_event(Event::Checkpoint(dir));
        }
    }
    let secs = t_start.elapsed().as_secs_f64();
    Ok(RunSummary {
        run_dir: ctx.run_dir.clone(),
        steps_done: step,
        start_test_success: ctx.evals.first().map(|e| e.1),
        end_test_success: ctx.evals.last().map(|e| e.1),
        seconds: secs,
        rollout_tokens_per_s: totals.0 as f64 / totals.1.max(1e-9),
        train_tokens_per_s: totals.2 as f64 / totals.3.max(1e-9),
        seconds_per_step: if totals.4 > 0 {
            secs / totals.4 as f64
        } else {
            0.0
        },
    })
}

fn setup(exp: Experiment, opts: &RunOptions) -> Result<(Ctx, usize), RunError> {
    let device = super::policies::device(&exp)?;
    let run_dir = match &opts.resume {
        Some(d) => d.clone(),
        None => fresh_run_dir(&exp.run_dir()),
    };
    let resumed = match &opts.resume {
        Some(d) => Some(checkpoint::load_latest(d, &device)?),
        None => None,
    };
    std::fs::create_dir_all(run_dir.join("scripts")).map_err(|e| io_err(&run_dir, e))?;
    let mut train = panel::read_jsonl(Path::new(&exp.env.train))?;
    let mut test = panel::read_jsonl(Path::new(&exp.env.test))?;
    // A subprocess env can supply the expert actions a panel lacks.
    let spec = exp.env.spec();
    fill_experts(&spec, &mut train).map_err(|e| io_err(Path::new(&exp.env.train), e))?;
    fill_experts(&spec, &mut test).map_err(|e| io_err(Path::new(&exp.env.test), e))?;
    let lens: Vec<usize> = train.iter().map(|t| t.expert.len()).collect();
    let clusters = Clusters::from_lengths(&lens, exp.guidance.clusters);

    let src = super::policies::open(&exp)?;
    let tok = src.tok.clone();
    // The initial policy (from the model source, else the seed) is also
    // the frozen KL reference, after a resume too; with LoRA the adapters
    // start at zero, so it is exactly the adapted model's start.
    let policy = super::policies::trained(&exp, &src, resumed.as_ref(), &device)?;
    let reference = if exp.trainer.kl_coef > 0.0 {
        Some(super::policies::initial(&exp, &src, &device)?)
    } else {
        None
    };
    let mut trainer = Trainer::new(
        &policy,
        reference.as_ref(),
        &exp.trainer,
        exp.steps,
        exp.rollout.temperature,
    )?;
    // The script: on resume, the version that was active at the checkpoint.
    let script_path = match &resumed {
        Some(l) => PathBuf::from(&l.state.script_copy),
        None => PathBuf::from(&exp.guidance.script),
    };
    let mut host = GuidanceHost::new(&script_path, exp.seed)?;
    let hooks = [
        (Role::Reward, exp.guidance.reward.clone()),
        (Role::Intervene, exp.guidance.intervene.clone()),
    ];
    for (role, path) in &hooks {
        let Some(path) = path else { continue };
        let from = resumed
            .as_ref()
            .and_then(|l| l.state.copies.get(role.name()))
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(path));
        match role {
            Role::Reward => host.set_reward_script(&from)?,
            _ => host.set_intervene_script(&from)?,
        }
        host.set_source(*role, Path::new(path));
    }
    let mut copies = BTreeMap::new();
    let (start_step, evals, script_copy) = match &resumed {
        Some(l) => {
            trainer
                .opt
                .load_state(&l.optimizer, l.state.optimizer_t)
                .map_err(|m| io_err(&l.dir, m))?;
            host.restore(&l.state.host).map_err(|m| io_err(&l.dir, m))?;
            host.set_source(Role::Guidance, Path::new(&exp.guidance.script));
            copies = l.state.copies.clone();
            (
                l.state.step,
                l.state.evals.clone(),
                l.state.script_copy.clone(),
            )
        }
        None => {
            host.init()?;
            let copy = save_script_copy(&run_dir, Role::Guidance, Some(host.script()))?;
            for (role, _) in hooks.iter().filter(|h| h.1.is_some()) {
                let c = save_script_copy(&run_dir, *role, host.script_of(*role))?;
                copies.insert(role.name().to_string(), c);
            }
            // Resolved config, so a run directory says exactly what ran.
            let cfg_out = serde_json::to_string_pretty(&exp).map_err(|e| io_err(&run_dir, e))?;
            checkpoint::write_atomic(&run_dir.join("experiment.json"), cfg_out.as_bytes())?;
            (0, Vec::new(), copy)
        }
    };
    if resumed.is_some() {
        truncate_after(&run_dir.join("metrics.jsonl"), start_step)?;
        truncate_after(&run_dir.join("eval.jsonl"), start_step + 1)?;
        truncate_after(&run_dir.join("reloads.jsonl"), start_step)?;
        truncate_after(&run_dir.join("env_errors.jsonl"), start_step)?;
    }
    let regions = read_regions(&run_dir.join("eval.jsonl"))?;
    let tb = Some(EventWriter::create(&run_dir.join("tb")).map_err(|e| io_err(&run_dir, e))?);
    let ropts = super::policies::rollout_options(
        &exp,
        &src,
        exp.trainer.aux_nll_coef > 0.0 || exp.trainer.train_prefix,
    )?;
    let watcher = FileWatcher::new(&host.watched_files()).ok();
    Ok((
        Ctx {
            watcher,
            exp,
            run_dir,
            train,
            test,
            clusters,
            tok,
            src,
            policy,
            trainer,
            host,
            script_copy,
            copies,
            evals,
            regions,
            tb,
            ropts,
        },
        start_step,
    ))
}

/// `runs/<name>`, or `runs/<name>-2`, `-3`, … when earlier runs hold the
/// name: a new run never overwrites an old one.
fn fresh_run_dir(base: &Path) -> PathBuf {
    fresh_dir(base, "experiment.json")
}

/// `base`, or `base-2`, `base-3`, … : the first that holds neither `marker`
/// nor a `metrics.jsonl`.
pub fn fresh_dir(base: &Path, marker: &str) -> PathBuf {
    let taken = |p: &Path| p.join(marker).exists() || p.join("metrics.jsonl").exists();
    if !taken(base) {
        return base.to_path_buf();
    }
    let name = base.file_name().and_then(|s| s.to_str()).unwrap_or("run");
    (2..)
        .map(|i| base.with_file_name(format!("{name}-{i}")))
        .find(|p| !taken(p))
        .expect("an unused name exists")
}

/// Keep a copy of every script version used, with its imports in the same
/// relative layout (so a resumed run can load it):
/// `scripts/<role>-<hash>/<file>` plus imported files beside it.
fn save_script_copy(
    run_dir: &Path,
    role: Role,
    script: Option<&crate::script::Script>,
) -> Result<String, RunError> {
    let Some(script) = script else {
        return Ok(String::new());
    };
    let dir = run_dir
        .join("scripts")
        .join(format!("{}-{}", role.name(), script.hash));
    let name = script
        .path
        .file_name()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("script.rhai"));
    let main = dir.join(&name);
    if !main.exists() {
        checkpoint::write_atomic(&main, script.source.as_bytes())?;
        let root = script.path.parent().unwrap_or(Path::new("."));
        for (p, src) in &script.imports {
            let rel = p
                .strip_prefix(root)
                .map(Path::to_path_buf)
                .unwrap_or_else(|_| PathBuf::from(p.file_name().unwrap_or_default()));
            checkpoint::write_atomic(&dir.join(rel), src.as_bytes())?;
        }
    }
    Ok(main.display().to_string())
}

/// Drop lines whose `step` is ≥ `step` (they follow the checkpoint we
/// resume from and will be written again).
fn truncate_after(path: &Path, step: usize) -> Result<(), RunError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| (s as usize) < step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    checkpoint::write_atomic(path, kept.as_bytes())?;
    Ok(())
}

fn append_line(path: &Path, v: &Value) -> Result<(), RunError> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| io_err(path, e))?;
    writeln!(f, "{v}").map_err(|e| io_err(path, e))
}

fn train_step(
    ctx: &mut Ctx,
    step: usize,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    on_event: &mut dyn FnMut(Event),
) -> Result<Value, RunError> {
    let t_step = Instant::now();
    let task_idx = seed::tasks_for_step(
        ctx.exp.seed,
        ctx.train.len(),
        ctx.exp.rollout.tasks_per_step,
        step,
    );
    let changed = ctx
        .watcher
        .as_mut()
        .is_some_and(|w| w.changed(std::time::Duration::from_secs(2)));
    if changed {
        let sample = ctx.train[task_idx[0]].clone();
        hot_reload(ctx, step, &sample, on_event)?;
    }
    let views: Vec<TaskView> = task_idx
        .iter()
        .map(|&ti| task_view(ctx, &ctx.train[ti], step))
        .collect();

    // 1–2. Plan, rollouts and review rounds; every round of every task is
    // one batched rollout call.
    let t_drive = Instant::now();
    let mut rstats = RolloutStats::default();
    let mut exec_s = 0.0f64;
    let mut hook_s = 0.0f64;
    let mut hook_errors: Vec<ScriptError> = Vec::new();
    let mut rollout_error: Option<RolloutError> = None;
    let drive_errors: usize;
    let groups = {
        let Ctx {
            host,
            train,
            policy,
            tok,
            ropts,
            exp,
            ..
        } = ctx;
        let seed_ = exp.seed;
        let mut calls = 0u64;
        let mut exec = |host: &mut GuidanceHost,
                        reqs: &[Request]|
         -> Result<Vec<rollout::Episode>, RolloutError> {
            let t0 = Instant::now();
            let requests: Vec<EpisodeRequest> = reqs
                .iter()
                .map(|r| {
                    let task = &train[task_idx[r.task]];
                    EpisodeRequest {
                        task,
                        spec: r.spec.resolve(task.expert.len()),
                    }
                })
                .collect();
            let mut rng = seed::rng(seed_, &[seed::label("rollout"), step as u64, calls]);
            calls += 1;
            let mut hs = 0.0f64;
            let has_int = host.has_intervene();
            let mut int_errors = Vec::new();
            let mut intervene = |t: &TurnView| {
                let t0 = Instant::now();
                let (x, e) = host.intervene(step, t);
                int_errors.extend(e);
                hs += t0.elapsed().as_secs_f64();
                x
            };
            let (mut eps, st) = rollout::run(
                policy,
                tok,
                make,
                &requests,
                ropts,
                &mut rng,
                if has_int { Some(&mut intervene) } else { None },
            )?;
            hook_errors.extend(int_errors);
            // Reward shaping by the reward script (the env reward stands
            // on error).
            if host.has_reward() {
                let t0 = Instant::now();
                for (i, (e, q)) in eps.iter_mut().zip(&requests).enumerate() {
                    let view = episode_view(e, q.task);
                    let (r, err) = host.reward(step, i, &view);
                    hook_errors.extend(err);
                    if let Some(r) = r {
                        e.reward = r;
                    }
                }
                hs += t0.elapsed().as_secs_f64();
            }
            rstats.prompt_tokens += st.prompt_tokens;
            rstats.generated_tokens += st.generated_tokens;
            rstats.generate_calls += st.generate_calls;
            rstats.seconds += st.seconds;
            hook_s += hs;
            exec_s += t0.elapsed().as_secs_f64() - hs;
            Ok(eps)
        };
        let mut report = DriveReport::default();
        let mut exec_dyn = |h: &mut GuidanceHost, q: &[Request]| match exec(h, q) {
            Ok(v) => Ok(v),
            Err(e) => {
                rollout_error = Some(e);
                Err(())
            }
        };
        let groups = drive(
            host,
            step,
            &views,
            exp.guidance.max_rounds,
            &mut exec_dyn,
            &mut report,
        );
        drive_errors = report.errors.len();
        for e in report.errors {
            on_event(Event::ScriptError(e.to_string()));
        }
        if report.bound_hits > 0 {
            on_event(Event::Log(format!(
                "step {}: {} review requests hit the bound of {} rounds",
                step + 1,
                report.bound_hits,
                exp.guidance.max_rounds
            )));
        }
        match groups {
            Ok(g) => g,
            Err(()) => {
                return Err(rollout_error
                    .map(RunError::from)
                    .unwrap_or_else(|| io_err(&ctx.run_dir, "rollout failed")))
            }
        }
    };
    let mut script_errors = drive_errors + hook_errors.len();
    for e in hook_errors {
        on_event(Event::ScriptError(e.to_string()));
    }
    let mut script_s = (t_drive.elapsed().as_secs_f64() - exec_s).max(0.0);
    let _ = hook_s;

    // The training batch: each task's training group.
    let mut tasks: Vec<&Task> = Vec::new();
    let mut episodes: Vec<rollout::Episode> = Vec::new();
    let mut group_sizes = Vec::new();
    for (&ti, g) in task_idx.iter().zip(&groups) {
        group_sizes.push(g.group.len());
        for r in g.training() {
            tasks.push(&ctx.train[ti]);
            episodes.push(r.ep.clone());
        }
    }

    // 3. Advantages per task group.
    let kind = AdvantageKind::parse(&ctx.exp.trainer.advantage).unwrap_or(AdvantageKind::Grpo);
    let mut advantages = Vec::with_capacity(episodes.len());
    let mut zero_std = 0usize;
    let mut at = 0usize;
    for &n in &group_sizes {
        let rewards: Vec<f64> = episodes[at..at + n].iter().map(|e| e.reward).collect();
        if is_zero_std(&rewards) {
            zero_std += 1;
        }
        advantages.extend(group_advantages(&rewards, kind));
        at += n;
    }

    // 4. Train.
    let t = &ctx.exp.trainer;
    let sopts = SampleOptions {
        with_aux: t.aux_nll_coef > 0.0,
        plan_loss: PlanLoss::parse(&t.plan_loss).unwrap_or(PlanLoss::Internalize),
        dual_weight: t.dual_weight as f32,
        train_prefix: t.train_prefix,
        protect_forced: t.protect_forced,
    };
    let samples = build_samples(&episodes, &advantages, &sopts);
    let mut trng = seed::rng(ctx.exp.seed, &[seed::label("train"), step as u64]);
    let tstats = ctx.trainer.step(&ctx.policy, &samples, step, &mut trng)?;

    // 5. Script update with per-task results.
    let results: Vec<TaskResult> = task_idx
        .iter()
        .zip(&groups)
        .map(|(&ti, g)| {
            let task = &ctx.train[ti];
            let grp: Vec<&rollout::Episode> = g.training().map(|r| &r.ep).collect();
            let depths: Vec<f64> = grp.iter().map(|e| e.spec.prefix as f64).collect();
            let len = task.expert.len().max(1) as f64;
            TaskResult {
                id: task.id.clone(),
                task_type: task.task_type.clone(),
                cluster: ctx.clusters.of(task.expert.len()) as i64,
                expert_len: task.expert.len() as i64,
                depth: mean(&depths),
                depth_ratio: mean(&depths) / len,
                plan_k: mean(&grp.iter().map(|e| e.spec.plan as f64).collect::<Vec<_>>()),
                guided: grp.iter().any(|e| e.spec.is_guided()),
                rewards: grp.iter().map(|e| e.reward).collect(),
                successes: grp.iter().map(|e| e.success).collect(),
                success_rate: mean(
                    &grp.iter()
                        .map(|e| f64::from(u8::from(e.success)))
                        .collect::<Vec<_>>(),
                ),
                rollouts: g.spent() as i64,
                rounds: g.rounds as i64,
            }
        })
        .collect();
    let t_upd = Instant::now();
    let script_hash = ctx.host.hash().to_string();
    let script_hashes = ctx.host.hashes();
    let mut extra = BTreeMap::new();
    extra.insert("pg_loss".to_string(), tstats.pg_loss);
    extra.insert("entropy".to_string(), tstats.entropy);
    if let Some(e) = ctx.host.update(step, &results, &extra) {
        script_errors += 1;
        on_event(Event::ScriptError(e.to_string()));
    }
    script_s += t_upd.elapsed().as_secs_f64();
    // Versions that failed on probation were swapped back (logged below).
    let reverts = ctx.host.take_reverts();
    ctx.host.end_step();
    let effects = ctx.host.take_effects();
    for l in &effects.logs {
        on_event(Event::Log(l.clone()));
    }

    // 6. The metrics line.
    let pairs: Vec<(&Task, &rollout::Episode)> =
        tasks.iter().copied().zip(episodes.iter()).collect();
    let mut line = success_breakdown(&pairs, &ctx.clusters);
    let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
    let policy_turns: usize = episodes.iter().map(|e| e.policy_turns).sum();
    let invalid: usize = episodes.iter().map(|e| e.invalid).sum();
    let mut depth_by_cluster: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    // Guidance depth of every trained rollout (executed prefix, else plan
    // k), per cluster: the report draws its distribution over time.
    let mut depths_by_cluster: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (q, e) in tasks.iter().zip(&episodes) {
        let len = q.expert.len().max(1) as f64;
        let c = ctx.clusters.of(q.expert.len()).to_string();
        depth_by_cluster
            .entry(c.clone())
            .or_default()
            .push(e.spec.prefix as f64 / len);
        let d = if e.spec.prefix > 0 {
            e.spec.prefix
        } else {
            e.spec.plan
        };
        depths_by_cluster.entry(c).or_default().push(d);
    }
    let first_round: Vec<f64> = groups
        .iter()
        .flat_map(|g| g.all.iter().filter(|r| r.round == 0))
        .map(|r| f64::from(u8::from(r.ep.success)))
        .collect();
    let script_metrics: serde_json::Map<String, Value> = effects
        .metrics
        .iter()
        .map(|(k, v)| (k.clone(), json!(round(*v))))
        .collect();
    let state_nums: serde_json::Map<String, Value> = ctx
        .host
        .state_numbers()
        .into_iter()
        .map(|(k, v)| (k, json!(round(v))))
        .collect();
    let step_s = t_step.elapsed().as_secs_f64();
    let spent: usize = groups.iter().map(|g| g.spent()).sum();
    // Mean of each numeric env extra over the episodes that report it.
    let mut info: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for e in &episodes {
        for (k, v) in &e.info {
            info.entry(k.clone()).or_default().push(*v);
        }
    }
    let env_info: serde_json::Map<String, Value> = info
        .into_iter()
        .map(|(k, v)| (k, json!(round(mean(&v)))))
        .collect();
    let rounds_block = json!({
        "probe_rollouts": groups.iter().map(|g| g.probes()).sum::<usize>(),
        "trained_rollouts": episodes.len(),
        "rounds_mean": round(mean(&groups.iter().map(|g| g.rounds as f64).collect::<Vec<_>>())),
        "hints": episodes.iter().map(|e| e.hints).sum::<usize>(),
        "stopped": episodes.iter().filter(|e| e.stopped).count(),
    });
    let extra = json!({
        "step": step,
        "script_hash": script_hash,
        "script_hashes": script_hashes,
        "reward_mean": round(mean(&rewards)),
        "reward_std": round(std(&rewards)),
        "frac_zero_std": round(zero_std as f64 / task_idx.len().max(1) as f64),
        "success_round0": round(mean(&first_round)),
        "guided_frac": round(mean(&episodes.iter().map(|e| f64::from(u8::from(e.spec.is_guided()))).collect::<Vec<_>>())),
        "depth_mean": round(mean(&episodes.iter().map(|e| e.spec.prefix as f64).collect::<Vec<_>>())),
        "depth_ratio_by_cluster": depth_by_cluster.into_iter().map(|(k, v)| (k, json!(round(mean(&v))))).collect::<serde_json::Map<_, _>>(),
        "depths_by_cluster": depths_by_cluster,
        "plan_k_mean": round(mean(&episodes.iter().map(|e| e.spec.plan as f64).collect::<Vec<_>>())),
        "expert_frac": round(mean(&episodes.iter().map(|e| f64::from(u8::from(e.spec.expert))).collect::<Vec<_>>())),
        "rollouts": spent,
        "rounds": rounds_block,
        "valid_action_ratio": round(1.0 - invalid as f64 / policy_turns.max(1) as f64),
        "episode_len": round(policy_turns as f64 / episodes.len().max(1) as f64),
        "env_errors": episodes.iter().filter(|e| e.error.is_some()).count(),
        "env_info": env_info,
        "pg_loss": round(tstats.pg_loss),
        "aux_loss": round(tstats.aux_loss),
        "kl": round(tstats.kl),
        "entropy": round(tstats.entropy),
        "clip_frac": round(tstats.clip_frac),
        "grad_norm": round(tstats.grad_norm),
        "lr": tstats.lr,
        "policy_tokens": tstats.policy_tokens,
        "rollout_tokens": rstats.prompt_tokens + rstats.generated_tokens,
        "generated_tokens": rstats.generated_tokens,
        "train_tokens": tstats.train_tokens,
        "script_errors": script_errors,
        "script": script_metrics,
        "state": state_nums,
        "time": {
            "rollout_s": round(rstats.seconds),
            "train_s": round(tstats.seconds),
            "script_s": round(script_s),
            "step_s": round(step_s),
            "rollout_tokens_per_s": round((rstats.prompt_tokens + rstats.generated_tokens) as f64 / rstats.seconds.max(1e-9)),
            "train_tokens_per_s": round(tstats.train_tokens as f64 / tstats.seconds.max(1e-9)),
        },
    });
    if let (Value::Object(a), Value::Object(b)) = (&mut line, extra) {
        a.extend(b);
    }
    for r in reverts {
        log_reload(ctx, step, &r, on_event)?;
    }
    // Episodes the env failed (dead server, malformed reply, …): each goes
    // to env_errors.jsonl with its reason; the batch trained without them
    // losing anything else.
    let failed: Vec<(String, String)> = groups
        .iter()
        .flat_map(|g| g.all.iter())
        .filter_map(|r| {
            r.ep.error
                .as_ref()
                .map(|e| (r.ep.task_id.clone(), e.clone()))
        })
        .collect();
    if !failed.is_empty() {
        for (task, error) in &failed {
            append_line(
                &ctx.run_dir.join("env_errors.jsonl"),
                &json!({ "step": step, "task": task, "error": error }),
            )?;
        }
        on_event(Event::Log(format!(
            "step {}: {} episode(s) failed in the env (env_errors.jsonl), e.g. {}: {}",
            step + 1,
            failed.len(),
            failed[0].0,
            failed[0].1
        )));
    }
    Ok(line)
}

/// What a reward script sees of an episode.
fn episode_view(e: &rollout::Episode, task: &Task) -> EpisodeView {
    EpisodeView {
        task_id: e.task_id.clone(),
        success: e.success,
        env_reward: e.reward,
        invalid: e.invalid as i64,
        policy_turns: e.policy_turns as i64,
        expert_len: task.expert.len() as i64,
        prefix: e.spec.prefix as i64,
        plan_k: e.spec.plan as i64,
        expert: e.spec.expert,
        expert_match: e.expert_match as i64,
        actions: e.actions.clone(),
        error: e.error.is_some(),
    }
}

impl Outcome for rollout::Episode {
    fn success(&self) -> bool {
        self.success
    }
    fn reward(&self) -> f64 {
        self.reward
    }
    fn resolved(&self) -> ResolvedSpec {
        self.spec
    }
}

fn task_view(ctx: &Ctx, task: &Task, step: usize) -> TaskView {
    let h = ctx.host.history(&task.id);
    TaskView {
        id: task.id.clone(),
        task_type: task.task_type.clone(),
        cluster: ctx.clusters.of(task.expert.len()) as i64,
        expert_len: task.expert.len() as i64,
        difficulty: task.difficulty as i64,
        visits: h.visits,
        last_success: h.last_success,
        step: step as i64,
        total_steps: ctx.exp.steps as i64,
        group_size: ctx.exp.rollout.group_size as i64,
    }
}

/// Swap in edited scripts at a step boundary, or keep the last good
/// versions; either way each outcome goes to `reloads.jsonl`.
fn hot_reload(
    ctx: &mut Ctx,
    step: usize,
    sample: &Task,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let view = task_view(ctx, sample, step);
    let outcomes = ctx.host.reload(&view);
    for o in &outcomes {
        log_reload(ctx, step, o, on_event)?;
    }
    if outcomes.iter().any(|o| o.result.is_ok()) {
        // The set of imported files may have changed.
        ctx.watcher = FileWatcher::new(&ctx.host.watched_files()).ok();
    }
    Ok(())
}

/// One line of `reloads.jsonl` (and a copy of each new version).
fn log_reload(
    ctx: &mut Ctx,
    step: usize,
    o: &ReloadOutcome,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let role = o.role.name();
    let active = ctx
        .host
        .script_of(o.role)
        .map(|s| s.hash.clone())
        .unwrap_or_default();
    let (line, result) = match (&o.result, &o.reverted) {
        (Ok(hash), None) => {
            let copy = save_script_copy(&ctx.run_dir, o.role, ctx.host.script_of(o.role))?;
            ctx.copies.insert(role.to_string(), copy.clone());
            (
                json!({ "step": step, "role": role, "file": o.file, "ok": true, "hash": hash, "copy": copy }),
                Ok(hash.clone()),
            )
        }
        (_, Some(e)) => (
            json!({ "step": step, "role": role, "file": o.file, "ok": false, "reverted": true, "error": e.to_string(), "active": active }),
            Err(format!(
                "{e} (runtime error on probation: back to version {active})"
            )),
        ),
        (Err(e), None) => (
            json!({ "step": step, "role": role, "file": o.file, "ok": false, "error": e.to_string(), "active": active }),
            Err(e.to_string()),
        ),
    };
    if let Some(c) = ctx.copies.get(role) {
        if o.role == Role::Guidance {
            ctx.script_copy = c.clone();
        }
    }
    append_line(&ctx.run_dir.join("reloads.jsonl"), &line)?;
    on_event(Event::Reload {
        step,
        role: role.to_string(),
        result,
    });
    Ok(())
}

fn run_eval(
    ctx: &mut Ctx,
    step: usize,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let e = ctx.exp.evaluation.clone();
    for (i, panel) in e.panels.iter().enumerate() {
        let tasks = if panel == "train" {
            &ctx.train
        } else {
            &ctx.test
        };
        let n = if e.max_tasks == 0 {
            tasks.len()
        } else {
            e.max_tasks.min(tasks.len())
        };
        let tasks = &tasks[..n];
        let mut opts = ctx.ropts.clone();
        opts.greedy = e.greedy;
        // The test panel keeps the stream it always had, so adding a
        // train panel changes no test number.
        let mut labels = vec![seed::label("eval"), step as u64];
        if panel != "test" {
            labels.push(seed::label(panel));
        }
        let mut rng = seed::rng(ctx.exp.seed, &labels);
        let samples = if e.greedy { 1 } else { e.samples.max(1) };
        let r = evaluate(
            &ctx.policy,
            &ctx.tok,
            make,
            &EvalSet {
                tasks,
                samples,
                clusters: &ctx.clusters,
            },
            &opts,
            &mut rng,
        )?;
        let mut result = r.breakdown;
        let success = result["success"].as_f64().unwrap_or(0.0);
        // The first evaluation fixes the in-region tasks: those the initial
        // policy solves at least once.
        let first = !ctx.regions.contains_key(panel);
        if first {
            let ids: BTreeSet<String> = tasks
                .iter()
                .zip(&r.successes)
                .filter(|(_, &c)| c > 0)
                .map(|(t, _)| t.id.clone())
                .collect();
            ctx.regions.insert(panel.clone(), ids);
        }
        let region = &ctx.regions[panel];
        let (mut sin, mut nin, mut sout, mut nout) = (0usize, 0usize, 0usize, 0usize);
        for (t, &c) in tasks.iter().zip(&r.successes) {
            if region.contains(&t.id) {
                sin += c;
                nin += 1;
            } else {
                sout += c;
                nout += 1;
            }
        }
        let rate = |s: usize, k: usize| {
            if k == 0 {
                Value::Null
            } else {
                json!(round(s as f64 / (k * samples) as f64))
            }
        };
        if let Value::Object(m) = &mut result {
            m.insert("step".into(), json!(step));
            m.insert("panel".into(), json!(panel));
            m.insert("greedy".into(), json!(e.greedy));
            m.insert("success_in_region".into(), rate(sin, nin));
            m.insert("success_out_region".into(), rate(sout, nout));
            m.insert("in_region_tasks".into(), json!(nin));
            m.insert("out_region_tasks".into(), json!(nout));
            if first {
                m.insert("in_region_ids".into(), json!(region));
            }
            m.insert("time".into(), json!({ "eval_s": round(r.stats.seconds) }));
        }
        append_line(&ctx.run_dir.join("eval.jsonl"), &result)?;
        tb_write(ctx, step, &format!("eval_{panel}"), &result)?;
        if i == 0 {
            ctx.evals.retain(|(s, _)| *s != step);
            ctx.evals.push((step, success));
        }
        on_event(Event::Eval { step, result });
    }
    Ok(())
}

/// Log a metrics or eval line's numbers to TensorBoard under `prefix/`.
fn tb_write(ctx: &mut Ctx, step: usize, prefix: &str, line: &Value) -> Result<(), RunError> {
    if let Some(w) = &mut ctx.tb {
        // The step is the event's own step, not a scalar.
        let step_tag = format!("{prefix}/step");
        let mut scalars = scalars_from_json(prefix, line);
        scalars.retain(|(tag, _)| *tag != step_tag);
        w.write_scalars(step as i64, wall_time_now(), &scalars)
            .map_err(|e| io_err(w.path(), e))?;
    }
    Ok(())
}

/// The in-region task ids each panel's first evaluation recorded in
/// `eval.jsonl` (for a resumed run).
fn read_regions(path: &Path) -> Result<BTreeMap<String, BTreeSet<String>>, RunError> {
    let mut out = BTreeMap::new();
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(out);
    };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).map_err(|e| io_err(path, e))?;
        if let Some(ids) = v["in_region_ids"].as_array() {
            let panel = v["panel"].as_str().unwrap_or("test").to_string();
            out.entry(panel).or_insert_with(|| {
                ids.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            });
        }
    }
    Ok(out)
}

fn save_checkpoint(ctx: &Ctx, step: usize) -> Result<PathBuf, RunError> {
    // Under LoRA the Vars are the adapters alone: that is what a
    // checkpoint keeps (the base is `model.path`).
    let weights = ctx
        .policy
        .named_vars()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    let state = RunState {
        step,
        seed: ctx.exp.seed,
        optimizer_t: ctx.trainer.opt.t,
        host: ctx.host.snapshot(),
        script_hash: ctx.host.hash().to_string(),
        script_copy: ctx.script_copy.clone(),
        copies: ctx.copies.clone(),
        evals: ctx.evals.clone(),
        rng: "derived: seed x (stream label, step)".into(),
    };
    Ok(checkpoint::save(
        &ctx.run_dir,
        &state,
        CheckpointFiles {
            weights,
            optimizer: ctx.trainer.opt.state_tensors(),
            adapter: ctx.policy.lora(),
            base_model: &ctx.exp.model.path,
            model: &ctx.src,
        },
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_runs_never_reuse_a_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("q");
        assert_eq!(fresh_run_dir(&base), base);
        std::fs::create_dir_all(&base).unwrap();
        std::fs::write(base.join("experiment.json"), "{}").unwrap();
        assert_eq!(fresh_run_dir(&base), tmp.path().join("q-2"));
    }

    #[test]
    fn task_order_covers_each_epoch() {
        let mut seen: Vec<usize> = (0..5)
            .flat_map(|s| seed::tasks_for_step(3, 10, 2, s))
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        assert_eq!(
            seed::tasks_for_step(3, 10, 4, 7),
            seed::tasks_for_step(3, 10, 4, 7)
        );
    }
}
