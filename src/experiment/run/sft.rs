//! The SFT step kind (`actguide sft`): behaviour cloning on expert
//! trajectories, one step of the run loop ([`super::run`]) like RL's. A
//! panel's expert actions are rolled through the env (so every action
//! comes with the observations and prompt the policy will see in RL, in the
//! same prompt format), and the token NLL of the actions is minimised. A
//! share of the trajectories shows the first k expert actions as a plan in
//! the prompt (k uniform in 1..=L), so the policy also learns to read a
//! plan — the prior ActGuide-RL's guidance relies on.
//!
//! An SFT experiment is an ordinary experiment file with an `sft` section:
//! set-up, memory check, events, checkpoints, resume and the summary are
//! the run loop's. What this kind adds: its panel (`sft.panel`, else
//! `env.train`, cut to `sft.max_expert_len`), the trainer with the NLL as
//! its only loss, its step (`sft.jsonl`), and at the end `sft_eval.json`
//! (greedy success on its own trajectories) and `model/`, a full HF folder
//! (LoRA merged) that RL starts from (`model.path`).

use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::Rng;

use super::{Ctx, Event, RunOptions, RunSummary};
use crate::env::{panel, Env, Task};
use crate::experiment::config::Experiment;
use crate::experiment::metrics::round;
use crate::experiment::RunError;
use crate::guidance::{Clusters, ResolvedSpec};
use crate::rollout::{self, EpisodeRequest, RolloutOptions};
use crate::rundir::{RunKind, SftEval, SftLine};
use crate::seed;
use crate::train::{Sample, TrainStats, TrainerSection};

pub use crate::experiment::config::SftSection;

/// Options of [`run`].
#[derive(Debug, Clone, Default)]
pub struct SftOptions {
    pub resume: Option<PathBuf>,
    pub stop_after: Option<usize>,
}

/// Run (or resume) an SFT experiment to its step budget: the run loop with
/// SFT steps.
pub fn run(
    exp: Experiment,
    o: &SftOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<RunSummary, RunError> {
    let opts = RunOptions {
        kind: RunKind::Sft,
        resume: o.resume.clone(),
        stop_after: o.stop_after,
        ..Default::default()
    };
    super::run(exp, &opts, on_event)
}

/// What the SFT kind holds beside the run's context: its section and its
/// panel of expert trajectories.
pub(super) struct SftKind {
    sft: SftSection,
    pub(super) tasks: Vec<Task>,
}

impl SftKind {
    pub(super) fn new(exp: &Experiment) -> Result<Self, RunError> {
        let sft = exp.sft.clone().unwrap_or_default();
        let tasks = sft_tasks(exp, &sft)?;
        Ok(SftKind { sft, tasks })
    }

    /// One step: the expert episodes of its tasks (a share with plans),
    /// then an NLL update; its `sft.jsonl` line, and the tokens trained
    /// and the update's seconds (for the run's throughput).
    pub(super) fn step(
        &self,
        ctx: &mut Ctx,
        step: usize,
        make: &dyn Fn(usize) -> Box<dyn Env>,
    ) -> Result<(SftLine, usize, f64), RunError> {
        let t0 = std::time::Instant::now();
        let d = step_data(ctx, self, step, make)?;
        let mut trng = seed::rng(ctx.exp.seed, &[seed::label("sft-train"), step as u64]);
        let st: TrainStats = ctx.trainer.step(&ctx.policy, &d.samples, step, &mut trng)?;
        if !st.aux_loss.is_finite() || !st.grad_norm.is_finite() {
            let nll_bad = !st.aux_loss.is_finite();
            return Err(RunError::NonFinite {
                step: step + 1,
                what: if nll_bad { "nll" } else { "grad_norm" },
                value: if nll_bad { st.aux_loss } else { st.grad_norm },
            });
        }
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
            seconds: round(t0.elapsed().as_secs_f64()),
            train_tok_s: round(st.train_tokens as f64 / st.seconds.max(1e-9)),
        };
        Ok((line, st.train_tokens, st.seconds))
    }

    /// After the last step: `sft_eval.json` and the `model/` folder RL
    /// starts from; returns both for the summary.
    pub(super) fn finish(
        &self,
        ctx: &mut Ctx,
        make: &dyn Fn(usize) -> Box<dyn Env>,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<(Option<f64>, PathBuf), RunError> {
        let own = self.own_success(ctx, make, on_event)?;
        let out = ctx.dir.path().join("model");
        crate::experiment::export::export(
            ctx.dir.path(),
            &out,
            &crate::experiment::export::ExportOptions::default(),
        )?;
        on_event(Event::Log(format!(
            "wrote {} (start RL from it: model.path)",
            out.display()
        )));
        Ok((own, out))
    }

    /// Greedy unguided success on the first `sft.eval_tasks` of the SFT
    /// panel, written to `sft_eval.json`.
    fn own_success(
        &self,
        ctx: &mut Ctx,
        make: &dyn Fn(usize) -> Box<dyn Env>,
        on_event: &mut dyn FnMut(Event),
    ) -> Result<Option<f64>, RunError> {
        let n = self.sft.eval_tasks.min(self.tasks.len());
        if n == 0 {
            return Ok(None);
        }
        let tasks = &self.tasks[..n];
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
        let r =
            crate::experiment::eval::evaluate(&ctx.policy, &ctx.tok, make, &set, &opts, &mut rng)?;
        let success = r.breakdown.success.unwrap_or(0.0);
        ctx.dir.write_sft_eval(&SftEval {
            tasks: n,
            greedy: true,
            success,
        })?;
        on_event(Event::Log(format!(
            "greedy success on {n} of its own tasks: {success:.3}"
        )));
        Ok(Some(success))
    }
}

/// The trainer settings of the SFT kind: the experiment's, with the NLL
/// as the only loss.
pub(super) fn trainer_settings(t: &TrainerSection) -> TrainerSection {
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
    ctx: &Ctx,
    kind: &SftKind,
    step: usize,
    make: &dyn Fn(usize) -> Box<dyn Env>,
) -> Result<StepData, RunError> {
    let idx = step_tasks(
        ctx.exp.seed,
        kind.tasks.len(),
        kind.sft.tasks_per_step,
        step,
    );
    let mut prng = seed::rng(ctx.exp.seed, &[seed::label("sft-plan"), step as u64]);
    let reqs: Vec<EpisodeRequest> = idx
        .iter()
        .map(|&i| {
            let t = &kind.tasks[i];
            let plan = if prng.random::<f64>() < kind.sft.plan_share {
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
