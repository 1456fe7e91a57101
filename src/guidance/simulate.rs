//! `actguide simulate`: a guidance script played against a deterministic
//! synthetic learner instead of a model, so a strategy's schedule and cost
//! can be developed and snapshot-tested without training.
//!
//! The learner has a *horizon* h: how many actions it can chain on its
//! own. A rollout of a task with expert length L, executed prefix n and a
//! plan covering c of the remaining actions must play m = L − n −
//! plan_gain·c actions itself and succeeds with probability
//! σ(sharpness·(h − m)): deeper guidance helps, long tasks are hard. After
//! each step the horizon grows by `learn_rate` per task whose training
//! group had mixed outcomes (only those carry a GRPO signal), weighted by
//! min(1, m / h) — practice near the frontier teaches most, far easier
//! work little — plus `drift`. An `expert()` rollout always succeeds.
//! This is the reachability barrier in a few lines: unguided groups of
//! long tasks all fail and teach nothing.

use std::collections::BTreeMap;

use rand::Rng;
use serde::Serialize;

use crate::env::Task;
use crate::guidance::clusters::Clusters;
use crate::guidance::rounds::{drive, DriveReport, Outcome, Request, TaskRounds};
use crate::guidance::runtime::GuidanceRuntime;
use crate::guidance::script_inputs::{mean, TaskResult, TaskView};
use crate::guidance::spec::ResolvedSpec;
use crate::script::{Effects, ScriptError};
use crate::seed;

/// Parameters of the synthetic learner and of the simulated run.
#[derive(Debug, Clone, Serialize)]
pub struct SimParams {
    pub steps: usize,
    pub tasks_per_step: usize,
    pub group_size: usize,
    pub clusters: usize,
    pub max_rounds: usize,
    pub seed: u64,
    /// Initial horizon (actions the learner can chain on its own).
    pub horizon: f64,
    /// Slope of success in (horizon − actions to play).
    pub sharpness: f64,
    /// Fraction of an action a shown plan action takes off the learner.
    pub plan_gain: f64,
    /// Horizon gained per step at full GRPO signal.
    pub learn_rate: f64,
    /// Horizon gained per step regardless of signal.
    pub drift: f64,
    /// Model `rollout.async`: each step's plan, rounds and rollouts come
    /// before the previous step's update (the script sees results one
    /// step late) and sample the learner as it was before that update.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub lag: bool,
}

impl Default for SimParams {
    fn default() -> Self {
        SimParams {
            steps: 30,
            tasks_per_step: 8,
            group_size: 8,
            clusters: 3,
            max_rounds: 8,
            seed: 0,
            horizon: 1.5,
            sharpness: 1.5,
            plan_gain: 0.8,
            learn_rate: 0.3,
            drift: 0.0,
            lag: false,
        }
    }
}

impl SimParams {
    /// Actions the learner must play itself.
    pub fn to_play(&self, len: usize, spec: &ResolvedSpec) -> f64 {
        let n = spec.prefix.min(len) as f64;
        // Plan actions beyond the executed prefix ease the rest.
        let covered = (spec.plan.min(len) as f64 - n).max(0.0);
        (len as f64 - n - self.plan_gain * covered).max(0.0)
    }

    /// Success probability of one rollout.
    pub fn p_success(&self, horizon: f64, len: usize, spec: &ResolvedSpec) -> f64 {
        if spec.expert {
            return 1.0;
        }
        let z = self.sharpness * (horizon - self.to_play(len, spec));
        1.0 / (1.0 + (-z).exp())
    }
}

/// A simulated rollout.
#[derive(Debug, Clone)]
pub struct SimEpisode {
    pub spec: ResolvedSpec,
    pub success: bool,
}

impl Outcome for SimEpisode {
    fn success(&self) -> bool {
        self.success
    }
    fn reward(&self) -> f64 {
        f64::from(u8::from(self.success))
    }
    fn resolved(&self) -> ResolvedSpec {
        self.spec
    }
}

/// Depth statistics of one cluster in one step (training groups).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClusterRow {
    pub tasks: usize,
    /// Mean and std of the executed depth ratio n/L over rollouts.
    pub depth_mu: f64,
    pub depth_sigma: f64,
    pub plan_k: f64,
    pub success: f64,
    /// Executed depths n of the training rollouts, one per task (first
    /// rollout), in task order.
    pub depths: Vec<usize>,
}

/// One step's training rollouts of one cluster.
#[derive(Default)]
struct ClusterAcc {
    ratios: Vec<f64>,
    plan_ks: Vec<f64>,
    rewards: Vec<f64>,
    /// Executed depth of each task's first training rollout.
    first_depths: Vec<usize>,
}

/// One simulated step.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SimRow {
    pub step: usize,
    /// Learner horizon before the step, and its mean unguided success
    /// probability over the panel.
    pub skill: f64,
    pub p_unguided: f64,
    /// Success over training groups.
    pub success: f64,
    pub guided_frac: f64,
    /// Rollouts generated, probes included, and probe rollouts alone.
    pub rollouts: usize,
    pub probes: usize,
    pub rounds: f64,
    pub frac_zero_std: f64,
    pub clusters: BTreeMap<String, ClusterRow>,
    pub metrics: BTreeMap<String, f64>,
    pub errors: Vec<String>,
}

/// A whole simulation.
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    pub script: String,
    pub params: SimParams,
    pub rows: Vec<SimRow>,
    pub mean_rollouts_per_step: f64,
    pub final_p_unguided: f64,
    /// Wall time spent inside the script's entry points (plan, review,
    /// update), in total (not in the table: it varies run to run).
    pub script_seconds: f64,
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// Play `runtime`'s script over `panel` for `p.steps` steps.
pub fn simulate(
    runtime: &mut GuidanceRuntime,
    panel: &[Task],
    p: &SimParams,
) -> Result<SimReport, ScriptError> {
    let lens: Vec<usize> = panel.iter().map(|t| t.expert.len()).collect();
    let clusters = Clusters::from_lengths(&lens, p.clusters);
    runtime.init()?;
    let mut skill = p.horizon;
    // With `lag`: the learner before the last update, and that update's
    // step, results and extras, not yet handed to the script.
    let mut before = skill;
    let mut pending: Option<(usize, Vec<TaskResult>, BTreeMap<String, f64>)> = None;
    let mut rows = Vec::new();
    let mut script_seconds = 0.0f64;
    for step in 0..p.steps {
        let sampled = if p.lag { before } else { skill };
        let idx = seed::tasks_for_step(p.seed, panel.len(), p.tasks_per_step, step);
        let views: Vec<TaskView> = idx
            .iter()
            .map(|&i| {
                let t = &panel[i];
                let cluster = clusters.of(t.expert.len());
                TaskView::new(
                    t,
                    cluster,
                    &runtime.history(&t.id),
                    step,
                    p.steps,
                    p.group_size,
                )
            })
            .collect();
        let played = play_rounds(runtime, step, &views, &idx, &lens, sampled, p)?;
        // Runtime calls (plan, review) and the driver's bookkeeping.
        script_seconds += played.script_s;
        let (groups, mut report) = (played.groups, played.report);
        let batch = StepBatch::collect(&views, &groups, sampled, p);
        let mut extra = BTreeMap::new();
        extra.insert("skill".to_string(), skill);
        let t_upd = std::time::Instant::now();
        let due = if p.lag {
            pending.replace((step, batch.results.clone(), extra))
        } else {
            Some((step, batch.results.clone(), extra))
        };
        if let Some((s, results, extra)) = due {
            report.errors.extend(runtime.update(s, &results, &extra));
        }
        script_seconds += t_upd.elapsed().as_secs_f64();
        runtime.end_step();
        let effects = runtime.take_effects();
        let signal = batch.signal;
        rows.push(batch.row(
            step,
            skill,
            p_unguided(p, skill, &lens),
            &groups,
            effects,
            &report,
        ));
        before = skill;
        skill += p.learn_rate * signal / views.len().max(1) as f64 + p.drift;
    }
    if let Some((s, results, extra)) = pending {
        // The last step's results, as the run's last update.
        if let Some(e) = runtime.update(s, &results, &extra) {
            if let Some(r) = rows.last_mut() {
                r.errors.push(e.to_string());
            }
        }
    }
    Ok(SimReport {
        script: runtime.script().file(),
        params: p.clone(),
        mean_rollouts_per_step: round4(mean(
            &rows.iter().map(|r| r.rollouts as f64).collect::<Vec<_>>(),
        )),
        final_p_unguided: round4(p_unguided(p, skill, &lens)),
        rows,
        script_seconds,
    })
}

/// Mean unguided success probability over the panel at horizon `skill`.
fn p_unguided(p: &SimParams, skill: f64, lens: &[usize]) -> f64 {
    mean(
        &lens
            .iter()
            .map(|&l| p.p_success(skill, l, &ResolvedSpec::default()))
            .collect::<Vec<_>>(),
    )
}

/// One step's rounds, played by the learner.
struct Played {
    groups: Vec<TaskRounds<SimEpisode>>,
    report: DriveReport,
    /// Seconds of the drive spent outside the learner.
    script_s: f64,
}

/// Drive `plan` and the review rounds of one step, the learner (at
/// horizon `skill`) executing every batch of requests.
fn play_rounds(
    runtime: &mut GuidanceRuntime,
    step: usize,
    views: &[TaskView],
    idx: &[usize],
    lens: &[usize],
    skill: f64,
    p: &SimParams,
) -> Result<Played, ScriptError> {
    let mut rng = seed::rng(p.seed, &[seed::label("simulate"), step as u64]);
    let mut exec_s = 0.0f64;
    let t_drive = std::time::Instant::now();
    let mut exec =
        |_: &mut GuidanceRuntime, reqs: &[Request]| -> Result<Vec<SimEpisode>, ScriptError> {
            let t0 = std::time::Instant::now();
            let out = reqs
                .iter()
                .map(|r| {
                    let len = lens[idx[r.task]];
                    let spec = r.spec.resolve(len);
                    let success = rng.random::<f64>() < p.p_success(skill, len, &spec);
                    SimEpisode { spec, success }
                })
                .collect();
            exec_s += t0.elapsed().as_secs_f64();
            Ok(out)
        };
    let mut report = DriveReport::default();
    let groups = drive(runtime, step, views, p.max_rounds, &mut exec, &mut report)?;
    // The learner's own time is taken out.
    let script_s = t_drive.elapsed().as_secs_f64() - exec_s;
    Ok(Played {
        groups,
        report,
        script_s,
    })
}

/// One step's training groups: the batch for `update` and the statistics
/// of the step's row.
struct StepBatch {
    results: Vec<TaskResult>,
    by_cluster: BTreeMap<String, ClusterAcc>,
    /// Rewards and guided flags (1/0) of every training rollout.
    succ_all: Vec<f64>,
    guided: Vec<f64>,
    /// Tasks whose group had mixed outcomes (a GRPO signal), and their
    /// summed weight min(1, m / h) for the learner's progress.
    informative: usize,
    signal: f64,
}

impl StepBatch {
    fn collect(
        views: &[TaskView],
        groups: &[TaskRounds<SimEpisode>],
        skill: f64,
        p: &SimParams,
    ) -> Self {
        let mut b = StepBatch {
            results: Vec::new(),
            by_cluster: BTreeMap::new(),
            succ_all: Vec::new(),
            guided: Vec::new(),
            informative: 0,
            signal: 0.0,
        };
        for (v, g) in views.iter().zip(groups) {
            let tr: Vec<&SimEpisode> = g.training().map(|r| &r.ep).collect();
            let s: Vec<f64> = tr.iter().map(|e| e.reward()).collect();
            if s.iter().any(|&x| x > 0.0) && s.contains(&0.0) {
                b.informative += 1;
                let len = v.expert_len.max(0) as usize;
                let m = mean(
                    &tr.iter()
                        .filter(|e| !e.spec.expert)
                        .map(|e| p.to_play(len, &e.spec))
                        .collect::<Vec<_>>(),
                );
                b.signal += (m / skill.max(1e-9)).min(1.0);
            }
            b.succ_all.extend(s.iter().copied());
            b.guided
                .extend(tr.iter().map(|e| f64::from(u8::from(e.spec.is_guided()))));
            let len = v.expert_len.max(1) as f64;
            let acc = b.by_cluster.entry(v.cluster.to_string()).or_default();
            for e in &tr {
                acc.ratios.push(e.spec.prefix as f64 / len);
                acc.plan_ks.push(e.spec.plan as f64);
                acc.rewards.push(e.reward());
            }
            acc.first_depths.extend(tr.first().map(|e| e.spec.prefix));
            b.results
                .push(TaskResult::from_group(v, tr, g.spent(), g.rounds));
        }
        b
    }

    /// The step's row of the table.
    fn row(
        self,
        step: usize,
        skill: f64,
        p_unguided: f64,
        groups: &[TaskRounds<SimEpisode>],
        effects: Effects,
        report: &DriveReport,
    ) -> SimRow {
        let frac_zero_std = 1.0 - self.informative as f64 / groups.len().max(1) as f64;
        SimRow {
            step,
            skill: round4(skill),
            p_unguided: round4(p_unguided),
            success: round4(mean(&self.succ_all)),
            guided_frac: round4(mean(&self.guided)),
            rollouts: groups.iter().map(|g| g.spent()).sum(),
            probes: groups.iter().map(|g| g.probes()).sum(),
            rounds: round4(mean(
                &groups.iter().map(|g| g.rounds as f64).collect::<Vec<_>>(),
            )),
            frac_zero_std: round4(frac_zero_std),
            clusters: self
                .by_cluster
                .into_iter()
                .map(|(k, a)| (k, a.row()))
                .collect(),
            metrics: effects
                .metrics
                .into_iter()
                .map(|(k, v)| (k, round4(v)))
                .collect(),
            errors: report.errors.iter().map(|e| e.to_string()).collect(),
        }
    }
}

impl ClusterAcc {
    /// The cluster's depth statistics, rounded for the table.
    fn row(self) -> ClusterRow {
        let mu = mean(&self.ratios);
        let var = mean(
            &self
                .ratios
                .iter()
                .map(|x| (x - mu).powi(2))
                .collect::<Vec<_>>(),
        );
        ClusterRow {
            tasks: self.first_depths.len(),
            depth_mu: round4(mu),
            depth_sigma: round4(var.sqrt()),
            plan_k: round4(mean(&self.plan_ks)),
            success: round4(mean(&self.rewards)),
            depths: self.first_depths,
        }
    }
}

/// The readable per-step table.
pub fn table(r: &SimReport) -> String {
    let mut keys: Vec<String> = Vec::new();
    for row in &r.rows {
        for k in row.clusters.keys() {
            if !keys.contains(k) {
                keys.push(k.clone());
            }
        }
    }
    keys.sort();
    let mut s = String::new();
    s.push_str(&format!("script {}\n", r.script));
    s.push_str("step  horizon  p0     succ   guided  rollouts  probes  rounds  zero_std");
    for k in &keys {
        s.push_str(&format!("  | c{k}: r mu±sd   k    depths"));
    }
    s.push('\n');
    for row in &r.rows {
        s.push_str(&format!(
            "{:>4}  {:>7.2}  {:.3}  {:.3}  {:>6.3}  {:>8}  {:>6}  {:>6.2}  {:>8.3}",
            row.step,
            row.skill,
            row.p_unguided,
            row.success,
            row.guided_frac,
            row.rollouts,
            row.probes,
            row.rounds,
            row.frac_zero_std
        ));
        for k in &keys {
            match row.clusters.get(k) {
                Some(c) => s.push_str(&format!(
                    "  | {:.2}±{:.2} {:>4.1}  {:?}",
                    c.depth_mu, c.depth_sigma, c.plan_k, c.depths
                )),
                None => s.push_str("  | -"),
            }
        }
        s.push('\n');
        for e in &row.errors {
            s.push_str(&format!("      error: {e}\n"));
        }
    }
    s.push_str(&format!(
        "mean rollouts/step {:.1}; unguided success p0 {:.3} -> {:.3}\n",
        r.mean_rollouts_per_step,
        r.rows.first().map_or(0.0, |x| x.p_unguided),
        r.final_p_unguided
    ));
    s
}

/// Errors of `simulate_file`.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Script(#[from] ScriptError),
    #[error(transparent)]
    Panel(#[from] crate::env::panel::PanelError),
    /// A simulation that means nothing, or too large to finish.
    #[error("{0}")]
    Invalid(String),
}

/// The most episodes one simulation plays (steps × tasks per step × group
/// size, before review rounds): about a minute of a script's calls.
pub const MAX_EPISODES: u64 = 10_000_000;

impl SimParams {
    /// Refuse a simulation that means nothing (no step, task or rollout)
    /// or would not finish (past [`MAX_EPISODES`]).
    pub fn check(&self) -> Result<(), SimError> {
        for (name, v) in [
            ("steps", self.steps),
            ("tasks", self.tasks_per_step),
            ("group", self.group_size),
            ("clusters", self.clusters),
        ] {
            if v == 0 {
                return Err(SimError::Invalid(format!("--{name} must be ≥ 1")));
            }
        }
        let episodes = (self.steps as u64)
            .saturating_mul(self.tasks_per_step as u64)
            .saturating_mul(self.group_size as u64);
        if episodes > MAX_EPISODES {
            return Err(SimError::Invalid(format!(
                "{} steps × {} tasks × {} rollouts = {episodes} episodes, over the {MAX_EPISODES} \
                 one simulation plays: lower --steps, --tasks or --group",
                self.steps, self.tasks_per_step, self.group_size
            )));
        }
        Ok(())
    }
}

/// Load a guidance script and a task panel and simulate.
pub fn simulate_file(
    script: &std::path::Path,
    panel: &std::path::Path,
    p: &SimParams,
) -> Result<SimReport, SimError> {
    p.check()?;
    let tasks = crate::env::panel::read_jsonl(panel)?;
    let mut runtime = GuidanceRuntime::new(script, p.seed)?;
    Ok(simulate(&mut runtime, &tasks, p)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_huge_simulations_are_refused_before_any_work() {
        let ok = SimParams::default();
        ok.check().unwrap();
        let e = SimParams {
            tasks_per_step: 100_000_000,
            ..ok.clone()
        }
        .check()
        .unwrap_err()
        .to_string();
        assert!(e.contains("episodes, over the 10000000"), "{e}");
        let e = SimParams {
            steps: 0,
            ..ok.clone()
        }
        .check()
        .unwrap_err();
        assert_eq!(e.to_string(), "--steps must be ≥ 1");
        // Refused before the panel is read (a missing one is not reached).
        let e = simulate_file(
            std::path::Path::new("missing.rhai"),
            std::path::Path::new("missing.jsonl"),
            &SimParams {
                tasks_per_step: 0,
                ..ok
            },
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "--tasks must be ≥ 1");
    }

    /// Under `lag` (rollout.async), step t's plan runs before step t−1's
    /// update: the script has seen one update fewer at each plan.
    #[test]
    fn async_lag_hands_results_to_the_script_one_step_late() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("count.rhai");
        std::fs::write(
            &script,
            r#"
fn init(state) { state.updates = 0; }
fn plan(task, state) { metric("updates_seen", state.updates); none() }
fn review(task, group, state) {}
fn update(batch, state) { state.updates += 1; metric("updated", state.updates); }
"#,
        )
        .unwrap();
        let panel: Vec<Task> =
            crate::env::panel::read_jsonl(std::path::Path::new("envs/household/train.jsonl"))
                .unwrap();
        let run = |lag: bool| {
            let p = SimParams {
                steps: 4,
                tasks_per_step: 2,
                group_size: 2,
                lag,
                ..SimParams::default()
            };
            let mut rt = GuidanceRuntime::new(&script, 0).unwrap();
            simulate(&mut rt, &panel, &p).unwrap()
        };
        let seen = |r: &SimReport| -> Vec<f64> {
            r.rows
                .iter()
                .map(|row| row.metrics["updates_seen"])
                .collect()
        };
        let (sync, lagged) = (run(false), run(true));
        assert_eq!(seen(&sync), [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(seen(&lagged), [0.0, 0.0, 1.0, 2.0]);
        // By the last row the lagged script has had one update fewer (the
        // last step's comes after the loop).
        assert_eq!(sync.rows[3].metrics["updated"], 4.0);
        assert_eq!(lagged.rows[3].metrics["updated"], 3.0);
        assert!(lagged.rows.iter().all(|r| r.errors.is_empty()));
        // Without lag, nothing is serialised differently.
        let v = serde_json::to_value(&sync.params).unwrap();
        assert!(v.get("lag").is_none());
    }
}
