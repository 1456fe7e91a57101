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
use crate::guidance::host::{GuidanceHost, TaskResult, TaskView};
use crate::guidance::rounds::{drive, DriveReport, Outcome, Request};
use crate::guidance::{Clusters, ResolvedSpec};
use crate::script::ScriptError;
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

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// Play `host`'s script over `panel` for `p.steps` steps.
pub fn simulate(
    host: &mut GuidanceHost,
    panel: &[Task],
    p: &SimParams,
) -> Result<SimReport, ScriptError> {
    let lens: Vec<usize> = panel.iter().map(|t| t.expert.len()).collect();
    let clusters = Clusters::from_lengths(&lens, p.clusters);
    host.init()?;
    let mut skill = p.horizon;
    let mut rows = Vec::new();
    let mut script_seconds = 0.0f64;
    for step in 0..p.steps {
        let idx = seed::tasks_for_step(p.seed, panel.len(), p.tasks_per_step, step);
        let views: Vec<TaskView> = idx
            .iter()
            .map(|&i| {
                let t = &panel[i];
                let h = host.history(&t.id);
                TaskView {
                    id: t.id.clone(),
                    task_type: t.task_type.clone(),
                    cluster: clusters.of(t.expert.len()) as i64,
                    expert_len: t.expert.len() as i64,
                    difficulty: t.difficulty as i64,
                    visits: h.visits,
                    last_success: h.last_success,
                    step: step as i64,
                    total_steps: p.steps as i64,
                    group_size: p.group_size as i64,
                }
            })
            .collect();
        let mut rng = seed::rng(p.seed, &[seed::label("simulate"), step as u64]);
        let sk = skill;
        let mut exec_s = 0.0f64;
        let t_drive = std::time::Instant::now();
        let mut exec =
            |_: &mut GuidanceHost, reqs: &[Request]| -> Result<Vec<SimEpisode>, ScriptError> {
                let t0 = std::time::Instant::now();
                let out = reqs
                    .iter()
                    .map(|r| {
                        let len = lens[idx[r.task]];
                        let spec = r.spec.resolve(len);
                        let success = rng.random::<f64>() < p.p_success(sk, len, &spec);
                        SimEpisode { spec, success }
                    })
                    .collect();
                exec_s += t0.elapsed().as_secs_f64();
                Ok(out)
            };
        let mut report = DriveReport::default();
        let groups = drive(host, step, &views, p.max_rounds, &mut exec, &mut report)?;
        // Host calls (plan, review) and the driver's bookkeeping; the
        // learner's own time is taken out.
        script_seconds += t_drive.elapsed().as_secs_f64() - exec_s;
        let mut results = Vec::new();
        let mut by_cluster: BTreeMap<String, ClusterAcc> = BTreeMap::new();
        let mut succ_all = Vec::new();
        let mut guided = Vec::new();
        let mut informative = 0usize;
        let mut signal = 0.0f64;
        for (v, g) in views.iter().zip(&groups) {
            let tr: Vec<&SimEpisode> = g.training().map(|r| &r.ep).collect();
            let s: Vec<f64> = tr.iter().map(|e| e.reward()).collect();
            if s.iter().any(|&x| x > 0.0) && s.contains(&0.0) {
                informative += 1;
                let len = v.expert_len.max(0) as usize;
                let m = mean(
                    &tr.iter()
                        .filter(|e| !e.spec.expert)
                        .map(|e| p.to_play(len, &e.spec))
                        .collect::<Vec<_>>(),
                );
                signal += (m / skill.max(1e-9)).min(1.0);
            }
            succ_all.extend(s.iter().copied());
            guided.extend(tr.iter().map(|e| f64::from(u8::from(e.spec.is_guided()))));
            let len = v.expert_len.max(1) as f64;
            let depths: Vec<f64> = tr.iter().map(|e| e.spec.prefix as f64).collect();
            let acc = by_cluster.entry(v.cluster.to_string()).or_default();
            for e in &tr {
                acc.ratios.push(e.spec.prefix as f64 / len);
                acc.plan_ks.push(e.spec.plan as f64);
                acc.rewards.push(e.reward());
            }
            acc.first_depths.extend(tr.first().map(|e| e.spec.prefix));
            results.push(TaskResult {
                id: v.id.clone(),
                task_type: v.task_type.clone(),
                cluster: v.cluster,
                expert_len: v.expert_len,
                depth: mean(&depths),
                depth_ratio: mean(&depths) / len,
                plan_k: mean(&tr.iter().map(|e| e.spec.plan as f64).collect::<Vec<_>>()),
                guided: tr.iter().any(|e| e.spec.is_guided()),
                rewards: s.clone(),
                successes: tr.iter().map(|e| e.success).collect(),
                success_rate: mean(&s),
                rollouts: g.spent() as i64,
                rounds: g.rounds as i64,
            });
        }
        let frac_zero_std = 1.0 - informative as f64 / views.len().max(1) as f64;
        let mut extra = BTreeMap::new();
        extra.insert("skill".to_string(), skill);
        let t_upd = std::time::Instant::now();
        let err = host.update(step, &results, &extra);
        script_seconds += t_upd.elapsed().as_secs_f64();
        report.errors.extend(err);
        host.end_step();
        let effects = host.take_effects();
        let p_unguided = mean(
            &lens
                .iter()
                .map(|&l| p.p_success(skill, l, &ResolvedSpec::default()))
                .collect::<Vec<_>>(),
        );
        let clusters_row = by_cluster
            .into_iter()
            .map(|(k, a)| {
                let mu = mean(&a.ratios);
                let var = mean(
                    &a.ratios
                        .iter()
                        .map(|x| (x - mu).powi(2))
                        .collect::<Vec<_>>(),
                );
                let row = ClusterRow {
                    tasks: a.first_depths.len(),
                    depth_mu: round4(mu),
                    depth_sigma: round4(var.sqrt()),
                    plan_k: round4(mean(&a.plan_ks)),
                    success: round4(mean(&a.rewards)),
                    depths: a.first_depths,
                };
                (k, row)
            })
            .collect();
        rows.push(SimRow {
            step,
            skill: round4(skill),
            p_unguided: round4(p_unguided),
            success: round4(mean(&succ_all)),
            guided_frac: round4(mean(&guided)),
            rollouts: groups.iter().map(|g| g.spent()).sum(),
            probes: groups.iter().map(|g| g.probes()).sum(),
            rounds: round4(mean(
                &groups.iter().map(|g| g.rounds as f64).collect::<Vec<_>>(),
            )),
            frac_zero_std: round4(frac_zero_std),
            clusters: clusters_row,
            metrics: effects
                .metrics
                .into_iter()
                .map(|(k, v)| (k, round4(v)))
                .collect(),
            errors: report.errors.iter().map(|e| e.to_string()).collect(),
        });
        skill += p.learn_rate * signal / views.len().max(1) as f64 + p.drift;
    }
    let final_p = mean(
        &lens
            .iter()
            .map(|&l| p.p_success(skill, l, &ResolvedSpec::default()))
            .collect::<Vec<_>>(),
    );
    Ok(SimReport {
        script: host.script().file(),
        params: p.clone(),
        mean_rollouts_per_step: round4(mean(
            &rows.iter().map(|r| r.rollouts as f64).collect::<Vec<_>>(),
        )),
        final_p_unguided: round4(final_p),
        rows,
        script_seconds,
    })
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
}

/// Load a guidance script and a task panel and simulate.
pub fn simulate_file(
    script: &std::path::Path,
    panel: &std::path::Path,
    p: &SimParams,
) -> Result<SimReport, SimError> {
    let tasks = crate::env::panel::read_jsonl(panel)?;
    let mut host = GuidanceHost::new(script, p.seed)?;
    Ok(simulate(&mut host, &tasks, p)?)
}
