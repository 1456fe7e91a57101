//! The one run loop: set-up, memory check, events, the steps, evaluation,
//! checkpoints, resume and the summary, for every kind of step. A kind
//! contributes only its step: RL ([`step`]: sample tasks, ask the guidance
//! script for specs, roll out, train, update the script) or SFT ([`sft`]:
//! behaviour cloning on expert trajectories). Resume from the latest
//! checkpoint continues exactly.
//!
//! Files: [`setup`] (opening or resuming a run), [`step`] (one RL step as
//! named phases) with [`step_line`] (its metrics line) and [`timings`] (its
//! clocks), [`sft`] (the SFT step), [`periodic_eval`] (evaluations during the
//! run), [`reload`] (hot reload), [`script_views`] (what the scripts see),
//! [`error`]. Every file the run writes goes through [`crate::rundir`].

mod error;
mod overlap;
mod periodic_eval;
mod phases;
mod rank_worker;
mod ranks;
mod reload;
mod script_views;
mod setup;
pub mod sft;
mod step;
mod step_line;
mod timings;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::env::{make_env, Env, EnvSpec, Task};
use crate::experiment::config::Experiment;
use crate::guidance::runtime::Role;
use crate::guidance::{Clusters, GuidanceRuntime};
use crate::model::{ModelSource, Policy, Tok};
use crate::rollout::RolloutOptions;
use crate::rundir::checkpoint::RunState;
use crate::rundir::tensorboard::EventWriter;
use crate::rundir::{EvalLine, RunDir, RunKind, SftLine, StepLine};
use crate::script::watch::FileWatcher;
use crate::script::Script;
use crate::train::Trainer;

pub use error::RunError;
use periodic_eval::{run_eval, tb_write};
pub use rank_worker::{serve_node, serve_worker, WorkerPlace};
pub use ranks::{JOIN_TIMEOUT, RANKS_FILE};
pub use reload::ReloadFailure;
use reload::{log_reload, reload_if_edited};
use script_views::task_view;
pub(crate) use setup::open_scripts;

/// How to run.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// What the steps do: RL (the default) or SFT.
    pub kind: RunKind,
    /// Continue the run in this directory from its latest checkpoint.
    pub resume: Option<PathBuf>,
    /// Stop after this many steps of this invocation (tests simulate a
    /// killed run with it); the step budget of the experiment is unchanged.
    pub stop_after: Option<usize>,
    /// Raised from outside (the binary's SIGINT/SIGTERM handler): the run
    /// finishes the step in progress, writes a checkpoint and stops.
    pub interrupt: Option<Arc<AtomicBool>>,
    /// Raised by the run while it is in its step loop (where an interrupt
    /// is worth a checkpoint), lowered when it leaves it.
    pub stepping: Option<Arc<AtomicBool>>,
    /// Memory the run may plan for, in bytes, instead of what the device
    /// reports (for a machine shared with other jobs).
    pub memory_limit: Option<u64>,
    /// Data-parallel: one rank per device (`--devices`); empty or one
    /// entry: this process alone on `model.device`.
    pub devices: Vec<crate::model::device::DeviceSpec>,
    /// A run over several nodes (`--nodes`, or a cluster launcher's
    /// variables): this process is node `launch.node`; node 0 runs rank 0.
    pub launch: Option<crate::distributed::launch::Launch>,
    /// How long ranks wait for each other to join (default
    /// [`JOIN_TIMEOUT`]).
    pub join_timeout: Option<std::time::Duration>,
    /// The program that serves `dp-worker` for ranks 1.. (default: this
    /// executable; tests name the built binary).
    pub worker_program: Option<PathBuf>,
    /// Resume from a checkpoint without `SHA256SUMS` (its files taken as
    /// they are).
    pub accept_unverified: bool,
    /// Resume although the experiment differs from the one the checkpoint
    /// was trained under (the differing keys are logged and recorded in
    /// `resumes.jsonl`).
    pub accept_changed_config: bool,
}

impl RunOptions {
    /// Whether the run has other ranks (several devices or nodes).
    pub fn data_parallel(&self) -> bool {
        self.devices.len() > 1 || self.launch.is_some()
    }

    /// Whether [`RunOptions::interrupt`] has been raised.
    pub fn interrupted(&self) -> bool {
        self.interrupt
            .as_ref()
            .is_some_and(|f| f.load(Ordering::SeqCst))
    }
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
    /// An RL step ended; its `metrics.jsonl` line.
    Step {
        step: usize,
        metrics: Box<StepLine>,
    },
    /// An SFT step ended; its `sft.jsonl` line.
    SftStep(Box<SftLine>),
    /// One panel's evaluation; its `eval.jsonl` line.
    Eval {
        step: usize,
        result: Box<EvalLine>,
    },
    ScriptError(String),
    /// The guidance script was edited: `Ok(hash)` is the new active
    /// version (from this step on), `Err(why)` kept the last good one.
    Reload {
        step: usize,
        /// "guidance", "reward" or "intervene".
        role: String,
        result: Result<String, ReloadFailure>,
    },
    /// A notice of the runner itself (review requests that hit the round
    /// bound, episodes that failed in the env).
    Log(String),
    /// A line a script printed (`print`, `debug`, `log`).
    ScriptLog(String),
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
    /// Stopped early by [`RunOptions::interrupt`] (after a checkpoint).
    pub interrupted: bool,
    /// SFT: greedy success on its own tasks after the last step (when
    /// `sft.eval_tasks` > 0).
    pub own_success: Option<f64>,
    /// SFT: the HF folder RL starts from (written after the last step).
    pub model: Option<PathBuf>,
    /// Problems the whole run shows (every episode failed in the env, a
    /// script failed at every step).
    pub warnings: Vec<String>,
}

/// Everything a run holds.
struct Ctx {
    /// Held for the whole run: no other process writes this directory.
    _lock: crate::rundir::RunLock,
    exp: Experiment,
    dir: RunDir,
    train: Vec<Task>,
    test: Vec<Task>,
    clusters: Clusters,
    tok: Tok,
    /// The opened `model.path` (tokenizer side files for checkpoints).
    src: ModelSource,
    policy: Policy,
    trainer: Trainer,
    runtime: GuidanceRuntime,
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
    /// The other ranks of a data-parallel run (None: this process alone).
    ranks: Option<ranks::Ranks>,
    /// Compare every script with its file at the next step boundary, edit
    /// or not (set on resume).
    reload_pending: bool,
    /// Asynchronous rollouts: the next step's, driven while this one
    /// trained.
    prefetched: Option<overlap::Prefetched>,
}

/// Tokens and clock of the steps this invocation ran (the summary's
/// throughputs), summed from their metrics lines.
#[derive(Default)]
struct Totals {
    rollout_tokens: usize,
    rollout_s: f64,
    train_tokens: usize,
    train_s: f64,
    steps: usize,
    /// Episodes trained on, and episodes the env failed.
    episodes: usize,
    env_errors: usize,
    script_errors: usize,
    /// Steps with at least one script error.
    steps_with_script_errors: usize,
}

impl Totals {
    fn add(&mut self, line: &StepLine) {
        self.rollout_tokens += line.rollout_tokens.unwrap_or(0);
        self.rollout_s += line.time.rollout_s.unwrap_or(0.0);
        self.train_tokens += line.train_tokens.unwrap_or(0);
        self.train_s += line.time.train_s.unwrap_or(0.0);
        self.steps += 1;
        self.episodes += line.batch.episodes.unwrap_or(0);
        self.env_errors += line.env_errors.unwrap_or(0);
        let errs = line.script_errors.unwrap_or(0);
        self.script_errors += errs;
        self.steps_with_script_errors += usize::from(errs > 0);
    }

    fn add_sft(&mut self, line: &SftLine, train_tokens: usize, train_s: f64) {
        self.train_tokens += train_tokens;
        self.train_s += train_s;
        self.steps += 1;
        self.episodes += line.trajectories;
        self.env_errors += line.env_errors;
    }

    /// What the end-of-run summary must not let pass silently.
    fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.steps > 0 && self.episodes == 0 && self.env_errors > 0 {
            out.push(format!(
                "every episode of this invocation was lost to env failures ({}, see \
                 env_errors.jsonl): nothing was learned",
                self.env_errors
            ));
        }
        if self.steps > 0 && self.steps_with_script_errors == self.steps {
            out.push(format!(
                "a script failed at every step ({} errors): guidance ran on its last good \
                 version or not at all",
                self.script_errors
            ));
        }
        out
    }
}

/// The kind of a run's steps, with what the kind holds.
enum Kind {
    Rl,
    Sft(Box<sft::SftKind>),
}

impl Kind {
    fn of(&self) -> RunKind {
        match self {
            Kind::Rl => RunKind::Rl,
            Kind::Sft(_) => RunKind::Sft,
        }
    }

    /// The tasks its steps draw from.
    fn tasks<'a>(&'a self, ctx: &'a Ctx) -> &'a [Task] {
        match self {
            Kind::Rl => &ctx.train,
            Kind::Sft(k) => &k.tasks,
        }
    }
}

/// Estimates the run's peak memory before it starts (see
/// [`crate::model::memory`]) and refuses it when it cannot fit, with the
/// `trainer.micro_batch` that can. SFT generates nothing and keeps no KL
/// reference. External envs are not probed (the probe's episodes would
/// reach the server), so their runs log that the estimate was skipped.
fn check_memory(
    ctx: &Ctx,
    kind: &Kind,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    limit: Option<u64>,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let line = if !ctx.exp.env.is_builtin() {
        "memory estimate skipped: an external env's prompt lengths are not probed".to_string()
    } else {
        let rl = kind.of().is_rl();
        let shape = crate::model::memory::RunShape {
            micro_batch: ctx.exp.trainer.micro_batch,
            rollout_batch: match rl {
                true => ctx.exp.rollout.tasks_per_step * ctx.exp.rollout.group_size,
                false => 0,
            },
            seq_len: probe_seq_len(ctx, make, kind.tasks(ctx))?,
            reference: rl && ctx.exp.trainer.kl_coef > 0.0,
        };
        let device = ctx.exp.model.device.to_string();
        crate::model::memory::before_start(&ctx.policy, &shape, limit, &device)?
    };
    on_event(Event::Log(line));
    Ok(())
}

/// The longest training sequence of a run on `tasks`, measured: the
/// expert trajectories of the (up to) 8 tasks with the longest experts are
/// rolled through the env with the whole plan shown (the longest prompts
/// guidance can make), and the longest prompt gets an answer of
/// `max_action_tokens`. Draws from its own seed stream, so the run's
/// random draws do not change.
fn probe_seq_len(
    ctx: &Ctx,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    tasks: &[Task],
) -> Result<usize, crate::rollout::RolloutError> {
    use crate::guidance::ResolvedSpec;
    use crate::rollout::EpisodeRequest;
    let mut order: Vec<&Task> = tasks.iter().collect();
    order.sort_by_key(|t| std::cmp::Reverse(t.expert.len()));
    let reqs: Vec<EpisodeRequest> = order
        .into_iter()
        .take(8)
        .map(|t| EpisodeRequest {
            task: t,
            spec: ResolvedSpec {
                expert: true,
                plan: t.expert.len(),
                ..Default::default()
            },
        })
        .collect();
    let mut rng = crate::seed::rng(ctx.exp.seed, &[crate::seed::label("memory-probe")]);
    let opts = &ctx.ropts;
    let (eps, _) = crate::rollout::run(&ctx.policy, &ctx.tok, make, &reqs, opts, &mut rng, None)?;
    let longest = eps
        .iter()
        .flat_map(|e| &e.turns)
        .map(|t| {
            t.prompt_ids
                .len()
                .max(t.unguided_prompt_ids.as_ref().map_or(0, Vec::len))
        })
        .max()
        .unwrap_or(0);
    Ok(longest + opts.max_action_tokens)
}

/// Start (or reach) the engine servers with the policy of `start_step`:
/// launched servers start on it; running servers get it by a sync unless
/// the run starts from its initial policy (which they already serve).
fn start_engine(
    ctx: &Ctx,
    cfg: &crate::inference::EngineSection,
    start_step: usize,
) -> Result<crate::inference::Engine, RunError> {
    let vocab = crate::inference::gguf_vocab(&ctx.src.path)?;
    let e =
        crate::inference::Engine::start(cfg, &ctx.dir.path().join("engine"), &ctx.policy, vocab)
            .map_err(Box::new)?;
    if start_step > 0 && cfg.launch.is_none() {
        e.sync(&ctx.policy, start_step as u64).map_err(Box::new)?;
    }
    Ok(e)
}

/// With `rollout.engine`: start (or reach) its servers and hand them to the
/// training rollouts. (`ranks::check` refused `--devices` with an engine.)
fn attach_engine(
    ctx: &mut Ctx,
    start_step: usize,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let Some(cfg) = ctx.exp.rollout.engine.clone() else {
        return Ok(());
    };
    let e = start_engine(ctx, &cfg, start_step)?;
    on_event(Event::Log(format!(
        "engine: {} {} server(s) ({}), serving step {start_step}'s policy",
        e.pool().urls().len(),
        serde_json::to_value(e.pool().api())
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
        e.pool().urls().join(", ")
    )));
    ctx.ropts.engine = Some(Arc::new(e));
    Ok(())
}

/// The run log's line on the CPU products: the matmul path, and whether
/// generation packs its f32 weights (which depends on the model's size).
fn cpu_matmul_line(policy: &crate::model::Policy) -> String {
    let mut line = format!("CPU matmul: {}", crate::model::matmul_backend());
    let copies = crate::model::memory::Footprint::of(policy).rollout_copies;
    if copies > 0 && !policy.rollout_bf16() {
        line += &format!(
            "; generation on packed f32 weights ({} decode kernel; rollout copies {:.0} MB)",
            crate::model::decode_kernel().unwrap_or("portable"),
            copies as f64 / 1048576.0
        );
    }
    line
}

/// Run (or resume) an experiment to its step budget, with the steps of
/// [`RunOptions::kind`].
pub fn run(
    exp: Experiment,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<RunSummary, RunError> {
    let t_start = Instant::now();
    let exp = place_rank0(exp, opts)?;
    let (mut ctx, kind, start_step, warnings) = setup::setup(exp, opts)?;
    let steps = ctx.exp.steps;
    announce(&ctx, &kind, start_step, warnings, on_event);
    let spec = ctx.exp.env.spec();
    let make = {
        let spec = spec.clone();
        move |limit: usize| -> Box<dyn Env> { make_env(&spec, limit) }
    };
    if let Err(e) = check_memory(&ctx, &kind, &make, opts.memory_limit, on_event) {
        // A fresh run refused before its first step leaves nothing behind
        // (so the corrected rerun gets the same name).
        if opts.resume.is_none() {
            let _ = std::fs::remove_dir_all(ctx.dir.path());
        }
        return Err(e);
    }
    if opts.data_parallel() {
        start_ranks(&mut ctx, opts, on_event)?;
    }
    // RL evaluates its unguided policy as it goes (from step 0); SFT on its
    // own tasks once, at the end, and, with `sft.evaluate` (an imitation
    // arm of a comparison), on the evaluation panels as RL does.
    let evaluates = kind.of().is_rl() || ctx.exp.sft.as_ref().is_some_and(|s| s.evaluate);
    if kind.of().is_rl() {
        attach_engine(&mut ctx, start_step, on_event)?;
    }
    if evaluates && start_step == 0 && !ctx.evals.iter().any(|(s, _)| *s == 0) {
        spec.begin_step();
        run_eval(&mut ctx, 0, &make, on_event)?;
        settle_envs(&ctx, &spec, 0, Some("test"), on_event)?;
    }
    let _stepping = Stepping::raise(opts.stepping.clone());
    let mut totals = Totals::default();
    let mut step = start_step;
    let mut done_here = 0usize;
    let mut interrupted = false;
    while step < steps {
        if opts.stop_after.is_some_and(|n| done_here >= n) {
            break;
        }
        spec.begin_step();
        // Asynchronous rollouts drive the next step during this one,
        // except before a checkpoint (which must not hold rollouts in
        // flight; the last step has one).
        let drive_ahead = ctx.exp.rollout.async_rollouts.is_some()
            && !checkpoint_due(&ctx, opts, step + 1, done_here + 1);
        one_step(
            &mut ctx,
            &kind,
            step,
            drive_ahead,
            &make,
            &spec,
            &mut totals,
            on_event,
        )?;
        step += 1;
        done_here += 1;
        let every = ctx.exp.evaluation.every;
        if evaluates && (step == steps || (every > 0 && step % every == 0)) {
            spec.begin_step();
            run_eval(&mut ctx, step, &make, on_event)?;
            settle_envs(&ctx, &spec, step, Some("test"), on_event)?;
        }
        let interrupt = opts.interrupted() && step < steps;
        if checkpoint_due(&ctx, opts, step, done_here) {
            let dir = save_checkpoint(&ctx, kind.of(), step)?;
            on_event(Event::Checkpoint(dir));
        }
        if interrupt {
            on_event(Event::Log(format!(
                "interrupted: stopped after step {step} of {steps} with a checkpoint; \
                 continue with `{} --resume {}`",
                kind.of().command(),
                ctx.dir.path().display()
            )));
            interrupted = true;
            break;
        }
    }
    if let Some(r) = &ctx.ranks {
        r.stop()?;
    }
    let (own_success, model) = match &kind {
        Kind::Sft(k) if step == steps => {
            let (own, model) = k.finish(&mut ctx, &make, on_event)?;
            (own, Some(model))
        }
        _ => (None, None),
    };
    let secs = t_start.elapsed().as_secs_f64();
    Ok(RunSummary {
        run_dir: ctx.dir.path().to_path_buf(),
        steps_done: step,
        start_test_success: ctx.evals.first().map(|e| e.1),
        end_test_success: ctx.evals.last().map(|e| e.1),
        seconds: secs,
        rollout_tokens_per_s: totals.rollout_tokens as f64 / totals.rollout_s.max(1e-9),
        train_tokens_per_s: totals.train_tokens as f64 / totals.train_s.max(1e-9),
        seconds_per_step: if totals.steps > 0 {
            secs / totals.steps as f64
        } else {
            0.0
        },
        interrupted,
        warnings: totals.warnings(),
        own_success,
        model,
    })
}

/// Whether a checkpoint follows step boundary `step` (steps done), with
/// `done_here` of them run by this invocation: on the schedule, at the
/// end, and, off the schedule, at an interrupt or at --stop-after (the
/// run is meant to be resumed).
fn checkpoint_due(ctx: &Ctx, opts: &RunOptions, step: usize, done_here: usize) -> bool {
    let (ck, steps) = (ctx.exp.checkpoint.every, ctx.exp.steps);
    let interrupt = opts.interrupted() && step < steps;
    interrupt
        || opts.stop_after == Some(done_here)
        || step >= steps
        || (ck > 0 && step.is_multiple_of(ck))
}

/// A data-parallel run's checks, and rank 0's device on `exp`.
fn place_rank0(mut exp: Experiment, opts: &RunOptions) -> Result<Experiment, RunError> {
    if opts.data_parallel() {
        if !opts.kind.is_rl() {
            return Err(RunError::Sft(
                "data-parallel devices are for RL runs; an SFT run trains on one device".into(),
            ));
        }
        ranks::check(&exp, &opts.devices)?;
        exp.model.device = ranks::rank0_device(&exp, opts);
    }
    Ok(exp)
}

/// Start the run's other ranks (and nodes), and say so.
fn start_ranks(
    ctx: &mut Ctx,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    if let Some(l) = &opts.launch {
        // The join can take long (other nodes start later): say why.
        on_event(Event::Log(format!(
            "node 0 of {} (from {}): waiting up to {} s for the other nodes at {}",
            l.nodes,
            l.source,
            opts.join_timeout.unwrap_or(JOIN_TIMEOUT).as_secs(),
            l.rendezvous
        )));
    }
    let r = ranks::Ranks::start(ctx, opts)?;
    on_event(Event::Log(r.describe()));
    ctx.ranks = Some(r);
    Ok(())
}

/// The run's opening events: what it is, the CPU matmul path, the
/// set-up's warnings.
fn announce(
    ctx: &Ctx,
    kind: &Kind,
    start_step: usize,
    warnings: Vec<String>,
    on_event: &mut dyn FnMut(Event),
) {
    on_event(Event::Started {
        run_dir: ctx.dir.path().to_path_buf(),
        start_step,
        steps: ctx.exp.steps,
        params: ctx.policy.num_params(),
        trainable: ctx.policy.num_trainable_params(),
        train_tasks: kind.tasks(ctx).len(),
        test_tasks: ctx.test.len(),
    });
    if ctx.policy.device().is_cpu() {
        on_event(Event::Log(crate::model::Kernels::of(&ctx.policy).line()));
        on_event(Event::Log(cpu_matmul_line(&ctx.policy)));
    }
    for w in warnings {
        on_event(Event::Log(w));
    }
}

/// One step of the run's kind: its line logged (metrics.jsonl or
/// sft.jsonl, TensorBoard), the envs settled, the event sent.
#[allow(clippy::too_many_arguments)]
fn one_step(
    ctx: &mut Ctx,
    kind: &Kind,
    step: usize,
    drive_ahead: bool,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    spec: &EnvSpec,
    totals: &mut Totals,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    match kind {
        Kind::Rl => {
            let line = step::train_step(ctx, step, make, spec, drive_ahead, on_event)?;
            settle_envs(ctx, spec, step, None, on_event)?;
            totals.add(&line);
            let v = ctx.dir.append(&line)?;
            tb_write(ctx, step, "train", &v)?;
            on_event(Event::Step {
                step,
                metrics: Box::new(line),
            });
        }
        Kind::Sft(k) => {
            let (line, tokens, secs) = k.step(ctx, step, make)?;
            settle_envs(ctx, spec, step, None, on_event)?;
            totals.add_sft(&line, tokens, secs);
            let v = ctx.dir.append(&line)?;
            tb_write(ctx, step, "sft", &v)?;
            on_event(Event::SftStep(Box::new(line)));
        }
    }
    Ok(())
}

/// Holds [`RunOptions::stepping`] raised while the step loop runs (and
/// lowers it however the loop is left).
struct Stepping(Option<Arc<AtomicBool>>);

impl Stepping {
    fn raise(flag: Option<Arc<AtomicBool>>) -> Self {
        if let Some(f) = &flag {
            f.store(true, Ordering::SeqCst);
        }
        Stepping(flag)
    }
}

impl Drop for Stepping {
    fn drop(&mut self) {
        if let Some(f) = &self.0 {
            f.store(false, Ordering::SeqCst);
        }
    }
}

/// Save a copy of a script version under the run's `scripts/` (an empty
/// path for a role without a script).
fn save_copy(dir: &RunDir, role: Role, script: Option<&Script>) -> Result<String, RunError> {
    match script {
        Some(s) => Ok(dir.save_script_copy(role.name(), s)?),
        None => Ok(String::new()),
    }
}

/// Save `<run>/checkpoints/step-NNNNNN` after `step` steps.
fn save_checkpoint(ctx: &Ctx, kind: RunKind, step: usize) -> Result<PathBuf, RunError> {
    let state = RunState {
        step,
        seed: ctx.exp.seed,
        optimizer_t: ctx.trainer.optimizer().t,
        runtime: ctx.runtime.snapshot(),
        script_hash: ctx.runtime.hash().to_string(),
        script_copy: ctx.script_copy.clone(),
        copies: ctx.copies.clone(),
        evals: ctx.evals.clone(),
        rng: "derived: seed x (stream label, step)".into(),
        experiment: serde_json::to_value(&ctx.exp).ok(),
        kind,
    };
    let dir = super::models::save_checkpoint(
        ctx.dir.path(),
        &state,
        &ctx.exp,
        &ctx.src,
        &ctx.policy,
        &ctx.trainer,
    )?;
    // The ranks never send weights: their digests show they agree.
    if let Some(r) = &ctx.ranks {
        r.agree(&ctx.policy, &dir)?;
    }
    Ok(dir)
}

/// After a step or an evaluation (`eval`: its panel): the notice of a
/// lowered cap on env requests in flight, once; and the envs whose `close`
/// was skipped this step (after a timeout) closed now, or, where that
/// fails too, listed in `env_errors.jsonl` so none stays alive unnoticed.
fn settle_envs(
    ctx: &Ctx,
    spec: &EnvSpec,
    step: usize,
    eval: Option<&str>,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    for line in settle_envs_in(&ctx.dir, spec, step, eval)? {
        on_event(Event::Log(line));
    }
    Ok(())
}

/// [`settle_envs`] for any loop with a run directory: the log lines.
pub(crate) fn settle_envs_in(
    dir: &RunDir,
    spec: &EnvSpec,
    step: usize,
    eval: Option<&str>,
) -> Result<Vec<String>, RunError> {
    let mut log = Vec::new();
    if let Some(note) = spec.conns.take_notice() {
        log.push(format!("run: {note}"));
    }
    let wait = spec.limits.timeout.min(std::time::Duration::from_secs(5));
    let open = spec.conns.close_left_open(wait);
    if let Some((first, why)) = open.first() {
        log.push(format!(
            "run: {} env(s) whose close was skipped after a timeout could not be closed \
             (env_errors.jsonl), e.g. {} of task {}: {why}",
            open.len(),
            first.id,
            first.task
        ));
    }
    for (env, why) in open {
        dir.append(&crate::rundir::EnvErrorLine {
            step: Some(step),
            task: Some(env.task),
            error: Some(format!(
                "env {} ({}={}) left open: {why}",
                env.base, env.id_field, env.id
            )),
            eval: eval.map(String::from),
        })?;
    }
    Ok(log)
}

#[cfg(test)]
mod tests {
    use crate::seed;

    #[test]
    fn the_summary_warns_when_nothing_could_be_learned() {
        use super::Totals;
        use crate::rundir::{StepLine, SuccessBreakdown};
        let line = |episodes: usize, env_errors: usize, script_errors: usize| StepLine {
            batch: SuccessBreakdown {
                episodes: Some(episodes),
                ..Default::default()
            },
            env_errors: Some(env_errors),
            script_errors: Some(script_errors),
            ..Default::default()
        };
        let mut ok = Totals::default();
        ok.add(&line(8, 1, 1));
        ok.add(&line(8, 0, 0));
        assert!(ok.warnings().is_empty());
        let mut lost = Totals::default();
        lost.add(&line(0, 8, 1));
        lost.add(&line(0, 8, 2));
        let w = lost.warnings();
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("lost to env failures (16"), "{w:?}");
        assert!(
            w[1].contains("a script failed at every step (3 errors)"),
            "{w:?}"
        );
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
