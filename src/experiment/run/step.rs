//! One training step, as named phases: drive the rollouts (plan, rollout
//! batches and review rounds, with the reward and intervention scripts),
//! build the batch and its advantages, train, hand the task results to the
//! guidance script, build the metrics line, log env failures.
//!
//! The order of the phases is the order of the random draws and of the
//! events; changing it changes the run.

use std::collections::BTreeMap;
use std::time::Instant;

use rand_chacha::ChaCha8Rng;

use super::overlap;
use super::phases::{Batch, Driven, Update};
use super::ranks::{Local, Ranks};
use super::script_views::{episode_view, task_view};
use super::step_line::step_line;
use super::timings::{Phase, Timings};
use super::{log_reload, reload_if_edited, Ctx, Event, RunError};
use crate::env::{make_env, Env, EnvSpec, Task};
use crate::experiment::config::Experiment;
use crate::experiment::metrics::round;
use crate::guidance::rounds::{drive, DriveReport, Request, TaskRounds};
use crate::guidance::runtime::TurnView;
use crate::guidance::{GuidanceRuntime, TaskResult, TaskView};
use crate::inference::Engine;
use crate::model::{Policy, Tok};
use crate::rollout::{self, Episode, EpisodeRequest, RolloutError, RolloutOptions};
use crate::rundir::{EnvErrorLine, StepAsync, StepBehaviour, StepEngine, StepLine};
use crate::script::ScriptError;
use crate::seed;
use crate::train::{
    self, build_samples, BatchAdvantages, BehaviourStats, SampleOptions, TrainStats, Trainer,
};

/// Run one training step; returns its metrics line.
/// With `prefetch_next` (asynchronous rollouts), the next step's rollouts
/// are driven while this step trains.
pub(super) fn train_step(
    ctx: &mut Ctx,
    step: usize,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    spec: &EnvSpec,
    prefetch_next: bool,
    on_event: &mut dyn FnMut(Event),
) -> Result<StepLine, RunError> {
    let timings = Timings::start();
    // Under `rollout.async`, the previous step may have driven this one's
    // rollouts while it trained.
    let (task_idx, views, driven, overlapped) = match ctx.prefetched.take() {
        Some(p) if p.step == step => p.take(&timings, on_event),
        _ => {
            let (task_idx, views) = step_tasks(ctx, step, on_event)?;
            let parts = DriveParts::of(ctx);
            let driven = drive_rollouts(parts, step, &task_idx, &views, make, &timings, on_event)?;
            (task_idx, views, driven, false)
        }
    };
    let lag = overlap::lag_limit(ctx);
    // The next step's boundary (its hot-reload check) comes before its
    // plan, which runs beside this step's update.
    let next = match prefetch_next {
        true => Some(step_tasks(ctx, step + 1, on_event)?),
        false => None,
    };
    let batch = build_batch(&ctx.train, &ctx.exp, &task_idx, &driven.groups, lag);
    let (tstats, engine, bf16) = if let Some((next_idx, next_views)) = next {
        let parts = DriveParts {
            runtime: &mut ctx.runtime,
            train: &ctx.train,
            policy: &ctx.policy,
            tok: &ctx.tok,
            ropts: &ctx.ropts,
            exp: &ctx.exp,
            ranks: ctx.ranks.as_ref(),
        };
        let (policy, exp, ranks) = (&ctx.policy, &ctx.exp, ctx.ranks.as_ref());
        let engine = ctx.ropts.engine.clone();
        let trainer = &mut ctx.trainer;
        let (idx, views) = (&next_idx, &next_views);
        let (trained, driven, events, secs) = overlap::beside(
            move |clock, on_ev| {
                let make = |limit: usize| -> Box<dyn Env> { make_env(spec, limit) };
                drive_rollouts(parts, step + 1, idx, views, &make, clock, on_ev)
            },
            || {
                let e = engine.as_deref();
                train(trainer, policy, exp, step, &batch, &timings, ranks, e)
            },
        );
        let trained = trained?;
        let next = (next_idx, next_views);
        ctx.prefetched = Some(overlap::Prefetched::new(
            step + 1,
            next,
            driven?,
            events,
            secs,
        ));
        trained
    } else {
        train(
            &mut ctx.trainer,
            &ctx.policy,
            &ctx.exp,
            step,
            &batch,
            &timings,
            ctx.ranks.as_ref(),
            ctx.ropts.engine.as_deref(),
        )?
    };
    let results = task_results(&views, &driven.groups);
    let update = update_script(
        &mut ctx.runtime,
        step,
        &results,
        &tstats,
        &timings,
        on_event,
    );
    let mut line = step_line(ctx, step, &driven, &batch, &tstats, &update, &timings);
    line.engine = engine;
    line.rollout_bf16 = bf16;
    line.async_rollouts = lag.map(|(version, max_staleness)| StepAsync {
        version,
        max_staleness,
        lag: batch.lag.clone(),
        dropped: batch.stale,
        overlapped,
    });
    for r in &update.reverts {
        log_reload(ctx, step, r, on_event)?;
    }
    log_env_errors(ctx, step, &driven.groups, on_event)?;
    log_oversized_plans(ctx.exp.rollout.group_size, step, &driven.groups, on_event);
    Ok(line)
}

/// What driving a step's rollouts reads and writes of the run (apart, so
/// that the next step's drive can run beside this step's update).
struct DriveParts<'a> {
    runtime: &'a mut GuidanceRuntime,
    train: &'a [Task],
    policy: &'a Policy,
    tok: &'a Tok,
    ropts: &'a RolloutOptions,
    exp: &'a Experiment,
    ranks: Option<&'a Ranks>,
}

impl<'a> DriveParts<'a> {
    fn of(ctx: &'a mut Ctx) -> Self {
        DriveParts {
            runtime: &mut ctx.runtime,
            train: &ctx.train,
            policy: &ctx.policy,
            tok: &ctx.tok,
            ropts: &ctx.ropts,
            exp: &ctx.exp,
            ranks: ctx.ranks.as_ref(),
        }
    }
}

/// The step's tasks (train-panel indices) and their views, after the
/// scripts' hot-reload check at the step boundary.
fn step_tasks(
    ctx: &mut Ctx,
    step: usize,
    on_event: &mut dyn FnMut(Event),
) -> Result<(Vec<usize>, Vec<TaskView>), RunError> {
    let task_idx = seed::tasks_for_step(
        ctx.exp.seed,
        ctx.train.len(),
        ctx.exp.rollout.tasks_per_step,
        step,
    );
    reload_if_edited(ctx, step, &task_idx, on_event)?;
    let views: Vec<TaskView> = task_idx
        .iter()
        .map(|&ti| task_view(ctx, &ctx.train[ti], step))
        .collect();
    Ok((task_idx, views))
}

/// Plan, rollouts and review rounds; every round of every task is one
/// batched rollout call.
fn drive_rollouts(
    parts: DriveParts<'_>,
    step: usize,
    task_idx: &[usize],
    views: &[TaskView],
    make: &dyn Fn(usize) -> Box<dyn Env>,
    timings: &Timings,
    on_event: &mut dyn FnMut(Event),
) -> Result<Driven, RunError> {
    let _drive = timings.mark(Phase::Drive);
    let DriveParts {
        runtime,
        train,
        policy,
        tok,
        ropts,
        exp,
        ranks,
    } = parts;
    let mut ex = Executor {
        policy,
        tok,
        make,
        ropts,
        tasks: task_idx.iter().map(|&ti| &train[ti]).collect(),
        train,
        task_idx,
        ranks,
        seed: exp.seed,
        step,
        calls: 0,
        timings,
        prompt_tokens: 0,
        generated_tokens: 0,
        hook_errors: Vec::new(),
    };
    let mut report = DriveReport::default();
    let groups = drive(
        runtime,
        step,
        views,
        exp.guidance.max_rounds,
        &mut |h: &mut GuidanceRuntime, q: &[Request]| ex.run(h, q),
        &mut report,
    );
    let mut script_errors = report.errors.len();
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
    let groups = groups?;
    script_errors += ex.hook_errors.len();
    for e in ex.hook_errors {
        on_event(Event::ScriptError(e.to_string()));
    }
    Ok(Driven {
        groups,
        prompt_tokens: ex.prompt_tokens,
        generated_tokens: ex.generated_tokens,
        script_errors,
    })
}

/// Runs the rollout batches the drive asks for, with the intervention and
/// reward scripts, and keeps count of tokens, time and script errors.
struct Executor<'a> {
    policy: &'a Policy,
    tok: &'a Tok,
    make: &'a dyn Fn(usize) -> Box<dyn Env>,
    ropts: &'a RolloutOptions,
    /// The step's tasks (requests index into them).
    tasks: Vec<&'a Task>,
    /// The train panel, and the step's tasks' indices into it.
    train: &'a [Task],
    task_idx: &'a [usize],
    /// The other ranks of a data-parallel run.
    ranks: Option<&'a Ranks>,
    seed: u64,
    step: usize,
    /// Batches run so far this step (each gets its own random stream).
    calls: u64,
    timings: &'a Timings,
    prompt_tokens: usize,
    generated_tokens: usize,
    hook_errors: Vec<ScriptError>,
}

impl Executor<'_> {
    fn run(
        &mut self,
        runtime: &mut GuidanceRuntime,
        reqs: &[Request],
    ) -> Result<Vec<Episode>, RunError> {
        let t0 = Instant::now();
        let requests: Vec<EpisodeRequest> = reqs
            .iter()
            .map(|r| {
                let task = self.tasks[r.task];
                EpisodeRequest {
                    task,
                    spec: r.spec.resolve(task.expert.len()),
                }
            })
            .collect();
        let call = self.calls;
        self.calls += 1;
        let (mut eps, st, mut hooks_s) = match self.ranks {
            Some(r) => {
                let pos: Vec<usize> = reqs.iter().map(|q| q.task).collect();
                let local = Local {
                    policy: self.policy,
                    tok: self.tok,
                    make: self.make,
                    ropts: self.ropts,
                    train: self.train,
                    seed: self.seed,
                };
                let (eps, st) =
                    r.rollout(self.step, call, &requests, self.task_idx, &pos, &local)?;
                (eps, st, 0.0)
            }
            None => {
                let mut rng =
                    seed::rng(self.seed, &[seed::label("rollout"), self.step as u64, call]);
                self.generate(runtime, &requests, &mut rng)?
            }
        };
        // Reward shaping by the reward script (the env reward stands on
        // error).
        if runtime.has_reward() {
            let t0 = Instant::now();
            for (i, (e, q)) in eps.iter_mut().zip(&requests).enumerate() {
                let view = episode_view(e, q.task);
                let (r, err) = runtime.reward(self.step, i, &view);
                self.hook_errors.extend(err);
                if let Some(r) = r {
                    e.replace_reward(r);
                }
            }
            hooks_s += t0.elapsed().as_secs_f64();
        }
        self.prompt_tokens += st.prompt_tokens;
        self.generated_tokens += st.generated_tokens;
        self.timings.add(Phase::Generate, st.seconds);
        // Script time counts as script time, not rollout time.
        self.timings
            .add(Phase::Execute, t0.elapsed().as_secs_f64() - hooks_s);
        Ok(eps)
    }

    /// The rollouts, with the intervention script asked before each policy
    /// turn; also returns the seconds spent in that script.
    fn generate(
        &mut self,
        runtime: &mut GuidanceRuntime,
        requests: &[EpisodeRequest],
        rng: &mut ChaCha8Rng,
    ) -> Result<(Vec<Episode>, rollout::RolloutStats, f64), RolloutError> {
        let step = self.step;
        let mut hooks_s = 0.0f64;
        let has_int = runtime.has_intervene();
        let mut int_errors = Vec::new();
        let mut intervene = |t: &TurnView| {
            let t0 = Instant::now();
            let (x, e) = runtime.intervene(step, t);
            int_errors.extend(e);
            hooks_s += t0.elapsed().as_secs_f64();
            x
        };
        let (eps, st) = rollout::run(
            self.policy,
            self.tok,
            self.make,
            requests,
            self.ropts,
            rng,
            if has_int { Some(&mut intervene) } else { None },
        )?;
        self.hook_errors.extend(int_errors);
        Ok((eps, st, hooks_s))
    }
}

/// The training batch. `lag`: (the policy version being trained, the
/// largest lag kept) under asynchronous rollouts; older episodes leave
/// the batch like failed ones, counted in `stale`.
fn build_batch<'a>(
    train: &'a [Task],
    exp: &Experiment,
    task_idx: &[usize],
    groups: &[TaskRounds<Episode>],
    lag: Option<(u64, u64)>,
) -> Batch<'a> {
    let mut tasks: Vec<&Task> = Vec::new();
    let mut episodes: Vec<Episode> = Vec::new();
    let mut group_sizes = Vec::new();
    let mut env_failed = 0usize;
    let mut engine_failed = 0usize;
    let mut stale = 0usize;
    let mut lags: Vec<usize> = Vec::new();
    for (&ti, g) in task_idx.iter().zip(groups) {
        // Episodes the env failed say nothing about the policy: they leave
        // the group before advantages (and success) are computed.
        let (ok, failed): (Vec<_>, Vec<_>) = g.training().partition(|r| r.ep.error.is_none());
        env_failed += failed.len();
        engine_failed += failed.iter().filter(|r| r.ep.engine_failed).count();
        let ok: Vec<_> = match lag {
            None => ok,
            Some((version, max)) => ok
                .into_iter()
                .filter(|r| {
                    let l = version.saturating_sub(r.ep.policy_version.unwrap_or(version)) as usize;
                    if lags.len() <= l {
                        lags.resize(l + 1, 0);
                    }
                    lags[l] += 1;
                    let keep = l as u64 <= max;
                    stale += usize::from(!keep);
                    keep
                })
                .collect(),
        };
        group_sizes.push(ok.len());
        for r in ok {
            tasks.push(&train[ti]);
            episodes.push(r.ep.clone());
        }
    }
    let BatchAdvantages {
        advantages,
        zero_std,
        anchors,
    } = train::batch_advantages(&exp.trainer, &episodes, &group_sizes);
    Batch {
        tasks,
        episodes,
        advantages,
        zero_std,
        anchors,
        task_count: task_idx.len(),
        env_failed,
        engine_failed,
        stale,
        lag: lags,
    }
}

/// What the guidance script's `update` learns of each task: its training
/// group without the episodes the env failed (their count is
/// `env_failed`). A task whose every episode failed is left out, so an
/// outage never reads as the policy getting worse.
fn task_results(views: &[TaskView], groups: &[TaskRounds<Episode>]) -> Vec<TaskResult> {
    views
        .iter()
        .zip(groups)
        .filter_map(|(v, g)| {
            let ok = g.training().filter(|r| r.ep.error.is_none()).map(|r| &r.ep);
            let mut r = TaskResult::from_group(v, ok, g.spent(), g.rounds);
            r.env_failed = g.training().filter(|r| r.ep.error.is_some()).count() as i64;
            (!r.successes.is_empty() || r.env_failed == 0).then_some(r)
        })
        .collect()
}

/// Truncation cap of the importance weights for bf16 rollouts (the
/// engines' default `tis_cap`).
const BF16_TIS_CAP: f64 = 2.0;

/// One policy update on the batch; with an engine or bf16 rollout weights,
/// the behaviour correction before it (and with an engine the weight sync
/// after it).
#[allow(clippy::too_many_arguments)]
fn train(
    trainer: &mut Trainer,
    policy: &Policy,
    exp: &Experiment,
    step: usize,
    batch: &Batch,
    timings: &Timings,
    ranks: Option<&Ranks>,
    engine: Option<&Engine>,
) -> Result<(TrainStats, Option<StepEngine>, Option<StepBehaviour>), RunError> {
    let t = &exp.trainer;
    let sopts = SampleOptions {
        with_aux: t.aux_nll_coef > 0.0,
        plan_loss: t.plan_loss,
        dual_weight: t.dual_weight as f32,
        train_prefix: t.train_prefix,
        protect_forced: t.protect_forced,
    };
    let mut samples = build_samples(&batch.episodes, &batch.advantages, &sopts);
    let cap = match engine {
        Some(e) => Some(e.settings().tis_cap),
        None => policy.rollout_bf16().then_some(BF16_TIS_CAP),
    };
    let mut trng = seed::rng(exp.seed, &[seed::label("train"), step as u64]);
    let (tstats, behaviour) = match (cap, ranks) {
        // One rank: the trainer corrects inside its own pass where it can.
        (Some(cap), None) => {
            let (st, b) = trainer.step_corrected(policy, &mut samples, step, &mut trng, cap)?;
            (st, Some(b))
        }
        (cap, ranks) => {
            let behaviour = match cap {
                Some(cap) => {
                    let t0 = Instant::now();
                    let b = trainer.behaviour_correction(policy, &mut samples, cap)?;
                    timings.add(Phase::Train, t0.elapsed().as_secs_f64());
                    Some(b)
                }
                None => None,
            };
            // After the behaviour correction: the other ranks train on the
            // same corrected samples (their share of the micro-batches).
            if let Some(r) = ranks {
                r.train(step, &samples)?;
            }
            (trainer.step(policy, &samples, step, &mut trng)?, behaviour)
        }
    };
    timings.add(Phase::Train, tstats.seconds);
    // A NaN or inf loss or gradient has already reached the weights: stop
    // before anything of this step is logged or checkpointed, so the last
    // checkpoint stays the last good state.
    let figures = [
        ("pg_loss", tstats.pg_loss),
        ("aux_loss", tstats.aux_loss),
        ("kl", tstats.kl),
        ("entropy", tstats.entropy),
        ("grad_norm", tstats.grad_norm),
    ];
    if let Some((what, value)) = figures.into_iter().find(|(_, v)| !v.is_finite()) {
        return Err(RunError::NonFinite {
            step: step + 1,
            what,
            value,
        });
    }
    let bf16 = match (engine, &behaviour) {
        (None, Some(b)) => Some(behaviour_record(b)),
        _ => None,
    };
    let engine = match (engine, behaviour) {
        (Some(e), Some(b)) => Some(engine_step(e, policy, step, batch, &b)?),
        _ => None,
    };
    Ok((tstats, engine, bf16))
}

/// The mismatch figures of a behaviour correction, as `metrics.jsonl`
/// records them.
fn behaviour_record(b: &BehaviourStats) -> StepBehaviour {
    StepBehaviour {
        mismatch: round(b.mean_abs_diff()),
        mismatch_max: round(b.max_abs_diff),
        ratio_mean: round(b.mean_ratio()),
        truncated_frac: round(b.truncated as f64 / b.tokens.max(1) as f64),
        tokens: b.tokens,
    }
}

/// After the update: hand the weights to the servers (version `step + 1`)
/// and report the step's engine figures.
fn engine_step(
    e: &Engine,
    policy: &Policy,
    step: usize,
    batch: &Batch,
    b: &BehaviourStats,
) -> Result<StepEngine, RunError> {
    let version = e.pool().version();
    let servers = e.pool().take_counts();
    let sync = e.sync(policy, step as u64 + 1).map_err(Box::new)?;
    Ok(StepEngine {
        version,
        behaviour: behaviour_record(b),
        missing: b.missing,
        failed_episodes: batch.engine_failed,
        sync_s: round(sync.seconds),
        sync_bytes: sync.bytes,
        synced: sync.synced,
        servers,
    })
}

/// The script update with per-task results (and the step's losses).
fn update_script(
    runtime: &mut GuidanceRuntime,
    step: usize,
    results: &[TaskResult],
    tstats: &TrainStats,
    timings: &Timings,
    on_event: &mut dyn FnMut(Event),
) -> Update {
    let timed = timings.mark(Phase::Update);
    let script_hash = runtime.hash().to_string();
    let script_hashes = runtime.hashes();
    let mut extra = BTreeMap::new();
    extra.insert("pg_loss".to_string(), tstats.pg_loss);
    extra.insert("entropy".to_string(), tstats.entropy);
    let mut script_errors = 0;
    // Every episode of the step failed in the env: nothing to learn from,
    // so the script's state stays as it was.
    let update = (!results.is_empty()).then(|| runtime.update(step, results, &extra));
    if let Some(Some(e)) = update {
        script_errors += 1;
        on_event(Event::ScriptError(e.to_string()));
    }
    drop(timed);
    let reverts = runtime.take_reverts();
    runtime.end_step();
    let effects = runtime.take_effects();
    for l in &effects.logs {
        on_event(Event::ScriptLog(l.clone()));
    }
    if effects.dropped_metrics + effects.dropped_logs > 0 {
        on_event(Event::Log(format!(
            "step {}: the scripts' metric() calls and log lines are capped per step \
             ({} and {}): {} metric(s) and {} line(s) dropped",
            step + 1,
            crate::script::MAX_METRICS_PER_STEP,
            crate::script::MAX_LOGS_PER_STEP,
            effects.dropped_metrics,
            effects.dropped_logs
        )));
    }
    Update {
        script_hash,
        script_hashes,
        script_errors,
        reverts,
        effects,
    }
}

/// Episodes the env failed (dead server, malformed reply, …), expert
/// actions it did not admit and actions the tokenizer cannot encode: each
/// goes to `env_errors.jsonl` with its task, and the run says so once per
/// step and kind. (The batch trained
/// without the failed episodes.)
fn log_env_errors(
    ctx: &Ctx,
    step: usize,
    groups: &[TaskRounds<Episode>],
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let episodes = || groups.iter().flat_map(|g| g.all.iter()).map(|r| &r.ep);
    let failed: Vec<(&str, String)> = episodes()
        .filter_map(|e| Some((e.task_id.as_str(), e.error.clone()?)))
        .collect();
    let inadmissible: Vec<(&str, String)> = episodes()
        .filter_map(|e| {
            let action = e.expert_inadmissible.as_ref()?;
            Some((
                e.task_id.as_str(),
                format!(
                    "expert action {action:?} is not admissible here: the executed prefix \
                     stopped before it"
                ),
            ))
        })
        .collect();
    let unencodable: Vec<(&str, String)> = episodes()
        .flat_map(|e| {
            e.unencodable.iter().map(|(action, words)| {
                (
                    e.task_id.as_str(),
                    format!(
                        "action {action:?} has words the tokenizer cannot encode ({}): \
                         kept out of the loss",
                        words.join(", ")
                    ),
                )
            })
        })
        .collect();
    for (what, list) in [
        ("episode(s) failed in the env", &failed),
        (
            "episode(s) met an inadmissible expert action",
            &inadmissible,
        ),
        (
            "action(s) had words the tokenizer cannot encode",
            &unencodable,
        ),
    ] {
        let Some((first_task, first_error)) = list.first() else {
            continue;
        };
        for (task, error) in list {
            ctx.dir.append(&EnvErrorLine {
                step: Some(step),
                task: Some(task.to_string()),
                error: Some(error.clone()),
                eval: None,
            })?;
        }
        on_event(Event::Log(format!(
            "step {}: {} {what} (env_errors.jsonl, \"step\": {step}), e.g. {first_task}: {first_error}",
            step + 1,
            list.len(),
        )));
    }
    Ok(())
}

/// Plans that asked for more first-round rollouts than the group size
/// (allowed, up to 256 per task, but each one costs a rollout): said once
/// per step, so a script cannot multiply the step time unnoticed.
fn log_oversized_plans(
    group_size: usize,
    step: usize,
    groups: &[TaskRounds<Episode>],
    on_event: &mut dyn FnMut(Event),
) {
    let big: Vec<(&str, usize)> = groups
        .iter()
        .filter_map(|g| {
            let round0: Vec<_> = g.all.iter().filter(|r| r.round == 0).collect();
            Some((round0.first()?.ep.task_id.as_str(), round0.len()))
        })
        .filter(|&(_, n)| n > group_size)
        .collect();
    if let Some(&(task, n)) = big.iter().max_by_key(|(_, n)| *n) {
        on_event(Event::Log(format!(
            "step {}: plan() asked for more rollouts than rollout.group_size ({group_size}) \
             for {} task(s), up to {n} for {task}",
            step + 1,
            big.len()
        )));
    }
}
