//! `actguide sft`: the supervised warm start. Behaviour cloning on expert
//! trajectories: a panel's expert actions are rolled through the env (so
//! every action comes with the observations and prompt the policy will see
//! in RL, in the same prompt format), and the token NLL of the actions is
//! minimised. A share of the trajectories shows the first k expert actions
//! as a plan in the prompt (k uniform in 1..=L), so the policy also learns
//! to read a plan — the prior ActGuide-RL's guidance relies on.
//!
//! An SFT experiment is an ordinary experiment file with an `sft` section:
//! `steps`, `trainer` (lr, schedule, micro-batches; the NLL is the only
//! loss), `model` (LoRA too), `env`, `rollout` (the prompt format) and
//! `checkpoint.every` mean what they mean for a run. The run directory
//! holds `sft.jsonl` (one line per step), checkpoints (resumed exactly),
//! `sft_eval.json` (greedy success on its own trajectories) and `model/`,
//! a full HF folder (LoRA merged) that RL starts from (`model.path`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::env::{make_env, panel, Env, Task};
use crate::experiment::config::Experiment;
use crate::experiment::metrics::round;
use crate::experiment::{policies, RunError};
use crate::guidance::{Clusters, ResolvedSpec};
use crate::rollout::{self, EpisodeRequest, RolloutOptions};
use crate::rundir::checkpoint::{self, Loaded, RunState};
use crate::rundir::{Record, RunDir};
use crate::seed;
use crate::train::{Sample, TrainStats, Trainer, TrainerSection};

pub use crate::experiment::config::SftSection;

/// One line of `sft.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SftLine {
    pub step: usize,
    /// Mean token NLL of the expert actions.
    pub nll: f64,
    pub trajectories: usize,
    /// Trajectories shown with a plan.
    pub with_plan: usize,
    pub action_tokens: usize,
    pub grad_norm: f64,
    pub lr: f64,
    /// Expert actions the tokenizer cannot encode (left out of the loss).
    pub unencodable_actions: usize,
    /// Trajectories the env failed (left out).
    pub env_errors: usize,
    pub seconds: f64,
    /// Tokens run through forward and backward per second.
    pub train_tok_s: f64,
}

impl Record for SftLine {
    const FILE: &'static str = "sft.jsonl";
}

/// What the CLI shows.
#[derive(Debug, Clone)]
pub enum SftEvent {
    Started {
        run_dir: PathBuf,
        start_step: usize,
        steps: usize,
        trajectories: usize,
    },
    Step(SftLine),
    Checkpoint(PathBuf),
    Log(String),
}

/// How an SFT run ended.
#[derive(Debug, Clone, Serialize)]
pub struct SftSummary {
    pub run_dir: PathBuf,
    pub steps_done: usize,
    /// Greedy success on `eval_tasks` of its own tasks (when run).
    pub own_success: Option<f64>,
    /// The HF folder RL starts from (written after the last step).
    pub model: Option<PathBuf>,
}

/// Options of [`run`].
#[derive(Debug, Clone, Default)]
pub struct SftOptions {
    pub resume: Option<PathBuf>,
    pub stop_after: Option<usize>,
}

/// The trainer settings of the SFT phase: the experiment's, with the NLL
/// as the only loss.
fn trainer_settings(t: &TrainerSection) -> TrainerSection {
    TrainerSection {
        kl_coef: 0.0,
        aux_nll_coef: 1.0,
        ..t.clone()
    }
}

/// The SFT panel: `sft.panel` (or `env.train`), without the tasks longer
/// than `sft.max_expert_len`.
fn sft_tasks(exp: &Experiment, s: &SftSection) -> Result<Vec<Task>, RunError> {
    let path = s.panel.clone().unwrap_or_else(|| exp.env.train.clone());
    let mut tasks = panel::read_jsonl(Path::new(&path))?;
    crate::env::fill_experts(&exp.env.spec(), &mut tasks).map_err(|source| RunError::Experts {
        panel: PathBuf::from(&path),
        source,
    })?;
    tasks.retain(|t| !t.expert.is_empty() && s.max_expert_len.is_none_or(|m| t.expert.len() <= m));
    if tasks.is_empty() {
        return Err(RunError::Sft(format!(
            "{path}: no task with expert actions{}",
            s.max_expert_len
                .map(|m| format!(" of at most {m} actions (sft.max_expert_len)"))
                .unwrap_or_default()
        )));
    }
    Ok(tasks)
}

/// The tasks of step `step`: consecutive slices of a seeded permutation
/// of the panel, a fresh one each epoch (a function of the seed and the
/// step alone, so a resumed run draws the same).
fn step_tasks(seed_: u64, n: usize, per_step: usize, step: usize) -> Vec<usize> {
    let per = per_step.min(n);
    let steps_per_epoch = n.div_ceil(per);
    let epoch = step / steps_per_epoch;
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut seed::rng(
        seed_,
        &[seed::label("sft-order"), epoch as u64],
    ));
    let at = (step % steps_per_epoch) * per;
    order[at..(at + per).min(n)].to_vec()
}

/// One SFT step's expert episodes (with plans for a share) as NLL samples.
struct StepData {
    samples: Vec<Sample>,
    trajectories: usize,
    with_plan: usize,
    unencodable: usize,
    env_errors: usize,
}

fn step_data(
    ctx: &SftCtx,
    step: usize,
    make: &dyn Fn(usize) -> Box<dyn Env>,
) -> Result<StepData, RunError> {
    let idx = step_tasks(ctx.exp.seed, ctx.tasks.len(), ctx.sft.tasks_per_step, step);
    let mut prng = seed::rng(ctx.exp.seed, &[seed::label("sft-plan"), step as u64]);
    let reqs: Vec<EpisodeRequest> = idx
        .iter()
        .map(|&i| {
            let t = &ctx.tasks[i];
            let plan = if prng.random::<f64>() < ctx.sft.plan_share {
                prng.random_range(1..=t.expert.len())
            } else {
                0
            };
            EpisodeRequest {
                task: t,
                spec: ResolvedSpec {
                    expert: true,
                    plan,
                    ..Default::default()
                },
            }
        })
        .collect();
    let mut rng = seed::rng(ctx.exp.seed, &[seed::label("sft-rollout"), step as u64]);
    let (eps, _) = rollout::run(
        &ctx.policy,
        &ctx.tok,
        make,
        &reqs,
        &ctx.ropts,
        &mut rng,
        None,
    )?;
    let mut d = StepData {
        samples: Vec::new(),
        trajectories: 0,
        with_plan: 0,
        unencodable: 0,
        env_errors: 0,
    };
    for (ei, ep) in eps.iter().enumerate() {
        d.unencodable += ep.unencodable.len();
        if ep.error.is_some() {
            d.env_errors += 1;
            continue;
        }
        d.trajectories += 1;
        d.with_plan += usize::from(ep.spec.plan > 0);
        for t in ep.turns.iter().filter(|t| !t.action_ids.is_empty()) {
            let mut seq = t.prompt_ids.clone();
            let start = seq.len();
            seq.extend(&t.action_ids);
            d.samples.push(Sample {
                targets: (start..seq.len()).collect(),
                seq,
                old_logp: Vec::new(),
                advantage: 0.0,
                episode: ei,
                aux: true,
                aux_weight: 1.0,
                off_policy: false,
                forced: false,
                weight: 1.0,
                tis: Vec::new(),
            });
        }
    }
    Ok(d)
}

/// Everything an SFT run holds.
struct SftCtx {
    exp: Experiment,
    sft: SftSection,
    dir: RunDir,
    _lock: crate::rundir::RunLock,
    tasks: Vec<Task>,
    src: crate::model::ModelSource,
    tok: crate::model::Tok,
    policy: crate::model::Policy,
    trainer: Trainer,
    ropts: RolloutOptions,
}

/// Open (or resume) the run directory and build the policy and trainer.
fn setup(exp: Experiment, o: &SftOptions) -> Result<(SftCtx, usize), RunError> {
    let sft = exp.sft.clone().unwrap_or_default();
    let device = policies::device(&exp)?;
    let (dir, lock, resumed): (RunDir, _, Option<Loaded>) = match &o.resume {
        Some(d) => {
            let dir = RunDir::at(d);
            let lock = dir.lock()?;
            let need = checkpoint::Sums::Required;
            (dir, lock, Some(checkpoint::load_latest(d, &device, need)?))
        }
        None => {
            let (dir, lock) = RunDir::claim(&exp.run_dir())?;
            (dir, lock, None)
        }
    };
    dir.create()?;
    if resumed.is_none() {
        dir.write_experiment(&exp)?;
    }
    let tasks = sft_tasks(&exp, &sft)?;
    let src = policies::open(&exp)?;
    let tok = src.tok.clone();
    let policy = policies::trained(&exp, &src, resumed.as_ref(), &device)?;
    let mut trainer = Trainer::new(
        &policy,
        None,
        &trainer_settings(&exp.trainer),
        exp.steps,
        exp.rollout.temperature,
    )?;
    let start = match &resumed {
        Some(l) => {
            policies::restore_optimizer(&mut trainer, l)?;
            let mut warnings = Vec::new();
            crate::rundir::jsonl::truncate_after(
                &dir.path().join(SftLine::FILE),
                l.state.step,
                &mut warnings,
            )?;
            l.state.step
        }
        None => 0,
    };
    let ropts = policies::rollout_options(&exp, &src, true)?;
    Ok((
        SftCtx {
            exp,
            sft,
            dir,
            _lock: lock,
            tasks,
            src,
            tok,
            policy,
            trainer,
            ropts,
        },
        start,
    ))
}

/// Run (or resume) an SFT experiment to its step budget.
pub fn run(
    exp: Experiment,
    o: &SftOptions,
    on_event: &mut dyn FnMut(SftEvent),
) -> Result<SftSummary, RunError> {
    let (mut ctx, start) = setup(exp, o)?;
    let steps = ctx.exp.steps;
    on_event(SftEvent::Started {
        run_dir: ctx.dir.path().to_path_buf(),
        start_step: start,
        steps,
        trajectories: ctx.tasks.len(),
    });
    let spec = ctx.exp.env.spec();
    let make = {
        let spec = spec.clone();
        move |limit: usize| -> Box<dyn Env> { make_env(&spec, limit) }
    };
    // The same peak-memory check as `run` (no KL reference, no
    // generation: expert trajectories only).
    let check = crate::experiment::memory::before_start(&crate::experiment::memory::StartCheck {
        exp: &ctx.exp,
        policy: &ctx.policy,
        tok: &ctx.tok,
        make: &make,
        tasks: &ctx.tasks,
        opts: &ctx.ropts,
        rollout_batch: 0,
        reference: false,
        limit: None,
    });
    match check {
        Ok(line) => on_event(SftEvent::Log(line)),
        Err(e) => {
            if o.resume.is_none() {
                let _ = std::fs::remove_dir_all(ctx.dir.path());
            }
            return Err(e);
        }
    }
    let mut step = start;
    let mut done_here = 0;
    while step < steps && o.stop_after.is_none_or(|n| done_here < n) {
        spec.begin_step();
        let t0 = Instant::now();
        let d = step_data(&ctx, step, &make)?;
        for line in crate::experiment::run::settle_envs_in(&ctx.dir, &spec, step, None)? {
            on_event(SftEvent::Log(line));
        }
        let mut trng = seed::rng(ctx.exp.seed, &[seed::label("sft-train"), step as u64]);
        let st: TrainStats = ctx.trainer.step(&ctx.policy, &d.samples, step, &mut trng)?;
        if !st.aux_loss.is_finite() || !st.grad_norm.is_finite() {
            return Err(RunError::NonFinite {
                step: step + 1,
                what: if st.aux_loss.is_finite() {
                    "grad_norm"
                } else {
                    "nll"
                },
                value: if st.aux_loss.is_finite() {
                    st.grad_norm
                } else {
                    st.aux_loss
                },
            });
        }
        let seconds = t0.elapsed().as_secs_f64();
        let line = SftLine {
            step,
            nll: round(st.aux_loss),
            trajectories: d.trajectories,
            with_plan: d.with_plan,
            action_tokens: st.aux_tokens,
            grad_norm: round(st.grad_norm),
            lr: st.lr,
            unencodable_actions: d.unencodable,
            env_errors: d.env_errors,
            seconds: round(seconds),
            train_tok_s: round(st.train_tokens as f64 / st.seconds.max(1e-9)),
        };
        ctx.dir.append(&line)?;
        on_event(SftEvent::Step(line));
        step += 1;
        done_here += 1;
        let every = ctx.exp.checkpoint.every;
        if step == steps || (every > 0 && step % every == 0) || o.stop_after == Some(done_here) {
            on_event(SftEvent::Checkpoint(save(&ctx, step)?));
        }
    }
    let mut summary = SftSummary {
        run_dir: ctx.dir.path().to_path_buf(),
        steps_done: step,
        own_success: None,
        model: None,
    };
    if step == steps {
        summary.own_success = own_success(&mut ctx, &make, on_event)?;
        let out = ctx.dir.path().join("model");
        crate::experiment::export::export(
            ctx.dir.path(),
            &out,
            &crate::experiment::export::ExportOptions::default(),
        )?;
        on_event(SftEvent::Log(format!(
            "wrote {} (start RL from it: model.path)",
            out.display()
        )));
        summary.model = Some(out);
    }
    Ok(summary)
}

/// Greedy unguided success on the first `sft.eval_tasks` of the SFT
/// panel, written to `sft_eval.json`.
fn own_success(
    ctx: &mut SftCtx,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    on_event: &mut dyn FnMut(SftEvent),
) -> Result<Option<f64>, RunError> {
    let n = ctx.sft.eval_tasks.min(ctx.tasks.len());
    if n == 0 {
        return Ok(None);
    }
    let tasks = &ctx.tasks[..n];
    let lens: Vec<usize> = tasks.iter().map(|t| t.expert.len()).collect();
    let clusters = Clusters::from_lengths(&lens, 1);
    let opts = RolloutOptions {
        greedy: true,
        ..ctx.ropts.clone()
    };
    let set = crate::experiment::eval::EvalSet {
        tasks,
        samples: 1,
        clusters: &clusters,
    };
    let mut rng = seed::rng(ctx.exp.seed, &[seed::label("sft-eval")]);
    let r = crate::experiment::eval::evaluate(&ctx.policy, &ctx.tok, make, &set, &opts, &mut rng)?;
    let success = r.breakdown.success.unwrap_or(0.0);
    let text = serde_json::json!({ "tasks": n, "greedy": true, "success": success });
    crate::rundir::write_atomic(
        &ctx.dir.path().join("sft_eval.json"),
        format!("{text}\n").as_bytes(),
    )?;
    on_event(SftEvent::Log(format!(
        "greedy success on {n} of its own tasks: {success:.3}"
    )));
    Ok(Some(success))
}

/// `<run>/checkpoints/step-NNNNNN` after `step` steps (no script state:
/// the SFT phase runs none).
fn save(ctx: &SftCtx, step: usize) -> Result<PathBuf, RunError> {
    let state = RunState {
        step,
        seed: ctx.exp.seed,
        optimizer_t: ctx.trainer.optimizer().t,
        host: crate::guidance::host::HostSnapshot {
            state: serde_json::Value::Null,
            history: Default::default(),
            states: Default::default(),
        },
        script_hash: String::new(),
        script_copy: String::new(),
        copies: Default::default(),
        evals: Vec::new(),
        rng: "derived: seed x (stream label, step)".into(),
        experiment: None,
    };
    policies::save_checkpoint(
        ctx.dir.path(),
        &state,
        &ctx.exp,
        &ctx.src,
        &ctx.policy,
        &ctx.trainer,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_once_per_epoch_in_a_seeded_order() {
        let a: Vec<Vec<usize>> = (0..6).map(|s| step_tasks(3, 10, 4, s)).collect();
        // 10 tasks, 4 per step: steps of 4, 4, 2 per epoch.
        assert_eq!(
            a.iter().map(Vec::len).collect::<Vec<_>>(),
            [4, 4, 2, 4, 4, 2]
        );
        for epoch in [&a[..3], &a[3..]] {
            let mut all: Vec<usize> = epoch.concat();
            all.sort();
            assert_eq!(all, (0..10).collect::<Vec<_>>());
        }
        assert_ne!(a[..3].concat(), a[3..].concat(), "a fresh order each epoch");
        assert_eq!(step_tasks(3, 10, 4, 4), a[4]);
        assert_ne!(step_tasks(4, 10, 4, 0), a[0]);
        // More per step than tasks: the whole panel each step.
        assert_eq!(step_tasks(3, 3, 8, 0).len(), 3);
    }

    #[test]
    fn sft_settings_are_checked() {
        let ok = SftSection::default();
        assert!(ok.check().is_ok());
        for (bad, msg) in [
            (
                SftSection {
                    tasks_per_step: 0,
                    ..ok.clone()
                },
                "tasks_per_step",
            ),
            (
                SftSection {
                    plan_share: 1.5,
                    ..ok.clone()
                },
                "plan_share",
            ),
            (
                SftSection {
                    plan_share: f64::NAN,
                    ..ok.clone()
                },
                "plan_share",
            ),
            (
                SftSection {
                    max_expert_len: Some(0),
                    ..ok.clone()
                },
                "max_expert_len",
            ),
        ] {
            assert!(bad.check().unwrap_err().contains(msg));
        }
    }
}
