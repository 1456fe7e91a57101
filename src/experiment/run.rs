//! The run loop: sample tasks, ask the guidance script for specs, roll out,
//! train, update the script, log metrics, evaluate and checkpoint; resume
//! from the latest checkpoint continues exactly.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Device;
use rand::seq::SliceRandom;
use serde_json::{json, Value};

use crate::env::{make_env, panel, Env, Task};
use crate::experiment::config::{ConfigError, Experiment};
use crate::experiment::eval::{evaluate, EvalSet};
use crate::experiment::metrics::{mean, round, std, success_breakdown};
use crate::guidance::{Clusters, GuidanceHost, GuidanceSpec, TaskResult, TaskView};
use crate::model::{ModelConfig, ModelError, Policy, Tok};
use crate::rollout::{self, EpisodeRequest, RolloutError, RolloutOptions};
use crate::script::watch::FileWatcher;
use crate::script::ScriptError;
use crate::seed;
use crate::train::checkpoint::{self, CheckpointError, CheckpointFiles, RunState};
use crate::train::{
    build_samples, group_advantages, is_zero_std, AdvantageKind, TrainError, Trainer,
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
    tokenizer_json: String,
    config_json: String,
    policy: Policy,
    trainer: Trainer,
    host: GuidanceHost,
    script_copy: String,
    evals: Vec<(usize, f64)>,
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
        train_tasks: ctx.train.len(),
        test_tasks: ctx.test.len(),
    });
    let make = {
        let kind = ctx.exp.env.kind.clone();
        move |limit: usize| -> Box<dyn Env> { make_env(&kind, limit) }
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
    let device = Device::Cpu;
    let run_dir = match &opts.resume {
        Some(d) => d.clone(),
        None => fresh_run_dir(&exp.run_dir()),
    };
    let resumed = match &opts.resume {
        Some(d) => Some(checkpoint::load_latest(d, &device)?),
        None => None,
    };
    std::fs::create_dir_all(run_dir.join("scripts")).map_err(|e| io_err(&run_dir, e))?;
    let train = panel::read_jsonl(Path::new(&exp.env.train))?;
    let test = panel::read_jsonl(Path::new(&exp.env.test))?;
    let lens: Vec<usize> = train.iter().map(|t| t.expert.len()).collect();
    let clusters = Clusters::from_lengths(&lens, exp.guidance.clusters);

    let mdir = Path::new(&exp.model.path);
    let cfg_path = mdir.join("config.json");
    let cfg = ModelConfig::from_file(&cfg_path)?;
    let tok_path = mdir.join("tokenizer.json");
    let tok = Tok::from_file(&tok_path)?;
    let tokenizer_json = std::fs::read_to_string(&tok_path).map_err(|e| io_err(&tok_path, e))?;
    let config_json = std::fs::read_to_string(&cfg_path).map_err(|e| io_err(&cfg_path, e))?;
    // The initial policy: weights from the model folder, else from the
    // seed. It is also the frozen KL reference, after a resume too.
    let w = mdir.join("model.safetensors");
    let load_initial = || -> Result<Policy, ModelError> {
        if w.exists() {
            Policy::load_safetensors(&cfg, &w, &device)
        } else {
            Policy::new_random(
                &cfg,
                &mut seed::rng(exp.seed, &[seed::label("init")]),
                &device,
            )
        }
    };
    let policy = match &resumed {
        Some(l) => Policy::from_tensors(
            &cfg,
            l.weights.clone(),
            &l.dir.join("model.safetensors").display().to_string(),
        )?,
        None => load_initial()?,
    };
    let reference = if exp.trainer.kl_coef > 0.0 {
        Some(load_initial()?)
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
    let (start_step, evals, script_copy) = match &resumed {
        Some(l) => {
            trainer
                .opt
                .load_state(&l.optimizer, l.state.optimizer_t)
                .map_err(|m| io_err(&l.dir, m))?;
            host.restore(&l.state.host).map_err(|m| io_err(&l.dir, m))?;
            host.set_source(Path::new(&exp.guidance.script));
            (
                l.state.step,
                l.state.evals.clone(),
                l.state.script_copy.clone(),
            )
        }
        None => {
            host.init()?;
            let copy = save_script_copy(
                &run_dir,
                host.script().path.as_path(),
                &host.script().source,
                host.hash(),
            )?;
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
    }
    let ropts = RolloutOptions {
        temperature: exp.rollout.temperature,
        top_p: exp.rollout.top_p,
        greedy: false,
        constrained: exp.rollout.constrained,
        history: exp.rollout.history,
        invalid_penalty: exp.rollout.invalid_penalty,
        max_action_tokens: exp.rollout.max_action_tokens,
        show_actions: exp.rollout.show_actions,
        record_prefix: exp.trainer.aux_nll_coef > 0.0,
        max_steps: exp.env.max_steps,
        step_slack: exp.env.step_slack,
    };
    let watcher = FileWatcher::new(&[PathBuf::from(&exp.guidance.script)]).ok();
    Ok((
        Ctx {
            watcher,
            exp,
            run_dir,
            train,
            test,
            clusters,
            tok,
            tokenizer_json,
            config_json,
            policy,
            trainer,
            host,
            script_copy,
            evals,
            ropts,
        },
        start_step,
    ))
}

/// `runs/<name>`, or `runs/<name>-2`, `-3`, … when earlier runs hold the
/// name: a new run never overwrites an old one.
fn fresh_run_dir(base: &Path) -> PathBuf {
    let taken = |p: &Path| p.join("experiment.json").exists() || p.join("metrics.jsonl").exists();
    if !taken(base) {
        return base.to_path_buf();
    }
    let name = base.file_name().and_then(|s| s.to_str()).unwrap_or("run");
    (2..)
        .map(|i| base.with_file_name(format!("{name}-{i}")))
        .find(|p| !taken(p))
        .expect("an unused name exists")
}

/// Keep a copy of every script version used: `scripts/<stem>-<hash>.rhai`.
fn save_script_copy(
    run_dir: &Path,
    path: &Path,
    source: &str,
    hash: &str,
) -> Result<String, RunError> {
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("script");
    let p = run_dir.join("scripts").join(format!("{stem}-{hash}.rhai"));
    if !p.exists() {
        checkpoint::write_atomic(&p, source.as_bytes())?;
    }
    Ok(p.display().to_string())
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

/// Task indices for a step: epochs over a seeded permutation of the panel.
fn tasks_for_step(seed_: u64, n: usize, per_step: usize, step: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(per_step);
    let mut cached: Option<(usize, Vec<usize>)> = None;
    for j in 0..per_step {
        let g = step * per_step + j;
        let (epoch, pos) = (g / n, g % n);
        if cached.as_ref().is_none_or(|c| c.0 != epoch) {
            let mut perm: Vec<usize> = (0..n).collect();
            perm.shuffle(&mut seed::rng(seed_, &[seed::label("order"), epoch as u64]));
            cached = Some((epoch, perm));
        }
        out.push(cached.as_ref().expect("set above").1[pos]);
    }
    out
}

fn train_step(
    ctx: &mut Ctx,
    step: usize,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    on_event: &mut dyn FnMut(Event),
) -> Result<Value, RunError> {
    let t_step = Instant::now();
    let task_idx = tasks_for_step(
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
    let r = &ctx.exp.rollout;

    // 1. Guidance specs from the script.
    let t_script = Instant::now();
    let mut script_errors = 0usize;
    let mut requests = Vec::with_capacity(task_idx.len() * r.group_size);
    for &ti in &task_idx {
        let task = &ctx.train[ti];
        let view = task_view(ctx, task, step);
        let (specs, err) = ctx.host.plan(step, &view);
        if let Some(e) = err {
            script_errors += 1;
            on_event(Event::ScriptError(e.to_string()));
        }
        if specs.contains(&GuidanceSpec::Expert) {
            on_event(Event::Log(format!(
                "{}: expert() needs LUFFY's off-policy loss, which this build does not have yet; those rollouts run unguided",
                task.id
            )));
        }
        for s in specs {
            let mut resolved = s.resolve(task.expert.len());
            resolved.expert = false;
            requests.push(EpisodeRequest {
                task,
                spec: resolved,
            });
        }
    }
    let mut script_s = t_script.elapsed().as_secs_f64();

    // 2. Rollouts, batched over every episode of the step.
    let mut rng = seed::rng(ctx.exp.seed, &[seed::label("rollout"), step as u64]);
    let (episodes, rstats) =
        rollout::run(&ctx.policy, &ctx.tok, make, &requests, &ctx.ropts, &mut rng)?;

    // 3. Advantages per task group.
    let kind = AdvantageKind::parse(&ctx.exp.trainer.advantage).unwrap_or(AdvantageKind::Grpo);
    let g = r.group_size;
    let mut advantages = Vec::with_capacity(episodes.len());
    let mut zero_std = 0usize;
    for grp in episodes.chunks(g) {
        let rewards: Vec<f64> = grp.iter().map(|e| e.reward).collect();
        if is_zero_std(&rewards) {
            zero_std += 1;
        }
        advantages.extend(group_advantages(&rewards, kind));
    }

    // 4. Train.
    let samples = build_samples(&episodes, &advantages, ctx.exp.trainer.aux_nll_coef > 0.0);
    let mut trng = seed::rng(ctx.exp.seed, &[seed::label("train"), step as u64]);
    let tstats = ctx.trainer.step(&ctx.policy, &samples, step, &mut trng)?;

    // 5. Script update with per-task results.
    let results: Vec<TaskResult> = task_idx
        .iter()
        .zip(episodes.chunks(g))
        .map(|(&ti, grp)| {
            let task = &ctx.train[ti];
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
            }
        })
        .collect();
    let t_upd = Instant::now();
    let script_hash = ctx.host.hash().to_string();
    let mut extra = BTreeMap::new();
    extra.insert("pg_loss".to_string(), tstats.pg_loss);
    extra.insert("entropy".to_string(), tstats.entropy);
    if let Some(e) = ctx.host.update(step, &results, &extra) {
        script_errors += 1;
        on_event(Event::ScriptError(e.to_string()));
    }
    script_s += t_upd.elapsed().as_secs_f64();
    let effects = ctx.host.take_effects();
    for l in &effects.logs {
        on_event(Event::Log(l.clone()));
    }

    // 6. The metrics line.
    let pairs: Vec<(&Task, &rollout::Episode)> = requests
        .iter()
        .map(|q| q.task)
        .zip(episodes.iter())
        .collect();
    let mut line = success_breakdown(&pairs, &ctx.clusters);
    let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
    let policy_turns: usize = episodes.iter().map(|e| e.policy_turns).sum();
    let invalid: usize = episodes.iter().map(|e| e.invalid).sum();
    let mut depth_by_cluster: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (q, e) in requests.iter().zip(&episodes) {
        let len = q.task.expert.len().max(1) as f64;
        depth_by_cluster
            .entry(ctx.clusters.of(q.task.expert.len()).to_string())
            .or_default()
            .push(e.spec.prefix as f64 / len);
    }
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
    let extra = json!({
        "step": step,
        "script_hash": script_hash,
        "reward_mean": round(mean(&rewards)),
        "reward_std": round(std(&rewards)),
        "frac_zero_std": round(zero_std as f64 / task_idx.len().max(1) as f64),
        "guided_frac": round(mean(&episodes.iter().map(|e| f64::from(u8::from(e.spec.is_guided()))).collect::<Vec<_>>())),
        "depth_mean": round(mean(&episodes.iter().map(|e| e.spec.prefix as f64).collect::<Vec<_>>())),
        "depth_ratio_by_cluster": depth_by_cluster.into_iter().map(|(k, v)| (k, json!(round(mean(&v))))).collect::<serde_json::Map<_, _>>(),
        "plan_k_mean": round(mean(&episodes.iter().map(|e| e.spec.plan as f64).collect::<Vec<_>>())),
        "rollouts": episodes.len(),
        "valid_action_ratio": round(1.0 - invalid as f64 / policy_turns.max(1) as f64),
        "episode_len": round(policy_turns as f64 / episodes.len().max(1) as f64),
        "env_errors": episodes.iter().filter(|e| e.error.is_some()).count(),
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
    Ok(line)
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

/// Swap in an edited guidance script at a step boundary, or keep the last
/// good version; either way the outcome goes to `reloads.jsonl`.
fn hot_reload(
    ctx: &mut Ctx,
    step: usize,
    sample: &Task,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let view = task_view(ctx, sample, step);
    let file = ctx.host.source().display().to_string();
    let (line, result) = match ctx.host.reload(&view) {
        Ok(None) => return Ok(()),
        Ok(Some(hash)) => {
            let src = ctx.host.script().source.clone();
            ctx.script_copy = save_script_copy(&ctx.run_dir, ctx.host.source(), &src, &hash)?;
            (
                json!({ "step": step, "file": file, "ok": true, "hash": hash, "copy": ctx.script_copy }),
                Ok(hash),
            )
        }
        Err(e) => (
            json!({ "step": step, "file": file, "ok": false, "error": e.to_string(), "active": ctx.host.hash() }),
            Err(e.to_string()),
        ),
    };
    append_line(&ctx.run_dir.join("reloads.jsonl"), &line)?;
    on_event(Event::Reload { step, result });
    Ok(())
}

fn run_eval(
    ctx: &mut Ctx,
    step: usize,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let e = &ctx.exp.evaluation;
    let n = if e.max_tasks == 0 {
        ctx.test.len()
    } else {
        e.max_tasks.min(ctx.test.len())
    };
    let mut opts = ctx.ropts.clone();
    opts.greedy = e.greedy;
    let mut rng = seed::rng(ctx.exp.seed, &[seed::label("eval"), step as u64]);
    let (mut result, stats) = evaluate(
        &ctx.policy,
        &ctx.tok,
        make,
        &EvalSet {
            tasks: &ctx.test[..n],
            samples: if e.greedy { 1 } else { e.samples },
            clusters: &ctx.clusters,
        },
        &opts,
        &mut rng,
    )?;
    let success = result["success"].as_f64().unwrap_or(0.0);
    if let Value::Object(m) = &mut result {
        m.insert("step".into(), json!(step));
        m.insert("greedy".into(), json!(e.greedy));
        m.insert("time".into(), json!({ "eval_s": round(stats.seconds) }));
    }
    append_line(&ctx.run_dir.join("eval.jsonl"), &result)?;
    ctx.evals.retain(|(s, _)| *s != step);
    ctx.evals.push((step, success));
    on_event(Event::Eval { step, result });
    Ok(())
}

fn save_checkpoint(ctx: &Ctx, step: usize) -> Result<PathBuf, RunError> {
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
        evals: ctx.evals.clone(),
        rng: "derived: seed x (stream label, step)".into(),
    };
    Ok(checkpoint::save(
        &ctx.run_dir,
        &state,
        CheckpointFiles {
            weights,
            optimizer: ctx.trainer.opt.state_tensors(),
            config_json: &ctx.config_json,
            tokenizer_json: &ctx.tokenizer_json,
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
        let mut seen: Vec<usize> = (0..5).flat_map(|s| tasks_for_step(3, 10, 2, s)).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        assert_eq!(tasks_for_step(3, 10, 4, 7), tasks_for_step(3, 10, 4, 7));
    }
}
