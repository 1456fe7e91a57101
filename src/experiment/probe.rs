//! `actguide probe`: ActGuide-RL's reachability diagnostics (paper Fig. 3)
//! along guided rollouts of chosen tasks. At every state s_t of a rollout
//! that follows the expert plan: the guidance influence
//! ‖ΔLogit‖ = ‖logit(·|s_t, g) − logit(·|s_t)‖ (next-token logits with and
//! without the plan in the prompt), and the prefix-level Pass@K of K
//! unguided continuations started from s_t. The reachability barrier is
//! where Pass@K collapses to 0.

use std::path::Path;

use crate::env::{panel, Task};
use crate::experiment::eval::load_run;
use crate::experiment::RunError;
use crate::guidance::ResolvedSpec;
use crate::rollout::{self, EpisodeRequest};
pub use crate::rundir::probe::{ProbePoint, ProbeResult, TaskProbe};
use crate::seed;

/// What to probe.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// The panel: the run's test or train panel, or a file.
    pub panel: crate::experiment::PanelRef,
    /// Task ids; empty = the first `per_cluster` tasks of each cluster.
    pub tasks: Vec<String>,
    pub per_cluster: usize,
    /// Unguided continuations per state (the K of Pass@K).
    pub k: usize,
    /// Probe the run's initial policy instead of its checkpoint.
    pub initial: bool,
    pub seed: u64,
    /// Device to probe on; `None`: the run's `model.device`.
    pub device: Option<crate::model::device::DeviceSpec>,
}

/// First t such that every point from t on passes (L when none does).
pub fn barrier(points: &[ProbePoint], expert_len: usize) -> usize {
    let mut b = expert_len.max(points.len());
    for p in points.iter().rev() {
        if p.pass {
            b = p.t;
        } else {
            break;
        }
    }
    b
}

/// L2 norm of the difference of two logit vectors.
pub fn l2_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from(x - y).powi(2))
        .sum::<f64>()
        .sqrt()
}

/// Probe the run or checkpoint at `path`. Deterministic in `seed`.
pub fn probe(path: &Path, o: &ProbeOptions) -> Result<ProbeResult, RunError> {
    let run = load_run(path, o.device)?;
    let policy = if o.initial {
        &run.initial
    } else {
        &run.trained
    };
    let panel_path = o.panel.in_run(&run.exp);
    let all = panel::read_jsonl(&panel_path)?;
    let tasks: Vec<Task> = if o.tasks.is_empty() {
        let mut taken = std::collections::BTreeMap::<usize, usize>::new();
        all.iter()
            .filter(|t| {
                let n = taken.entry(run.clusters.of(t.expert.len())).or_default();
                *n += 1;
                *n <= o.per_cluster
            })
            .cloned()
            .collect()
    } else {
        o.tasks
            .iter()
            .map(|id| {
                all.iter()
                    .find(|t| &t.id == id)
                    .cloned()
                    .ok_or_else(|| RunError::UnknownTask {
                        panel: panel_path.clone(),
                        id: id.clone(),
                    })
            })
            .collect::<Result<_, _>>()?
    };
    let spec = run.exp.env.spec();
    spec.begin_step();
    let make = move |limit: usize| crate::env::make_env(&spec, limit);
    let k = o.k.max(1);
    // Guidance influence at each state: the full expert plan vs none.
    let mut probes = Vec::with_capacity(tasks.len());
    let mut reqs = Vec::new();
    for task in &tasks {
        let states = rollout::expert_state_prompts(
            policy,
            &run.tok,
            &make,
            task,
            task.expert.len(),
            &run.ropts,
        )?;
        let mut points = Vec::with_capacity(states.len());
        for s in states {
            let logits = policy.next_logits(&[s.guided, s.unguided])?;
            points.push(ProbePoint {
                t: s.depth,
                action: s.next_action,
                delta_logit: crate::experiment::metrics::round(l2_diff(&logits[0], &logits[1])),
                successes: 0,
                k,
                pass: false,
            });
            for _ in 0..k {
                reqs.push(EpisodeRequest {
                    task,
                    spec: ResolvedSpec {
                        prefix: s.depth,
                        ..ResolvedSpec::default()
                    },
                });
            }
        }
        probes.push(TaskProbe {
            id: task.id.clone(),
            task_type: task.task_type.clone(),
            cluster: run.clusters.of(task.expert.len()),
            expert_len: task.expert.len(),
            points,
            barrier: 0,
            max_delta_t: None,
        });
    }
    // Every continuation of every state of every task in one batched call.
    let mut rng = seed::rng(o.seed, &[seed::label("probe")]);
    let (eps, _) = rollout::run(policy, &run.tok, &make, &reqs, &run.ropts, &mut rng, None)?;
    let mut chunks = eps.chunks(k);
    for p in &mut probes {
        for pt in &mut p.points {
            let c = chunks
                .next()
                .map_or(0, |g| g.iter().filter(|e| e.success).count());
            pt.successes = c;
            pt.pass = c > 0;
        }
        p.barrier = barrier(&p.points, p.expert_len);
        p.max_delta_t = p
            .points
            .iter()
            .max_by(|a, b| a.delta_logit.total_cmp(&b.delta_logit))
            .map(|pt| pt.t);
    }
    Ok(ProbeResult {
        checkpoint: run.ckpt_dir.display().to_string(),
        step: run.step,
        policy: if o.initial { "initial" } else { "trained" },
        k,
        seed: o.seed,
        tasks: probes,
    })
}

/// The probe as a readable table: one block per task.
pub fn probe_table(r: &ProbeResult) -> String {
    let mut s = format!(
        "probe of {} (step {}, {} policy), Pass@{} of unguided continuations\n",
        r.checkpoint, r.step, r.policy, r.k
    );
    for t in &r.tasks {
        s.push_str(&format!(
            "\ntask {} ({}, cluster {}, {} expert actions): barrier at t = {}{}\n",
            t.id,
            t.task_type,
            t.cluster,
            t.expert_len,
            t.barrier,
            if t.barrier == 0 { " (in-region)" } else { "" }
        ));
        s.push_str(&format!(
            "{:>4} {:>10} {:>9} {:>7}  next expert action\n",
            "t", "‖ΔLogit‖", "succ/K", "Pass@K"
        ));
        for p in &t.points {
            s.push_str(&format!(
                "{:>4} {:>10.3} {:>9} {:>7}  {}{}\n",
                p.t,
                p.delta_logit,
                format!("{}/{}", p.successes, p.k),
                if p.pass { "1" } else { "0" },
                p.action,
                if t.barrier > 0 && p.t + 1 == t.barrier {
                    "   ← barrier"
                } else {
                    ""
                }
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(t: usize, pass: bool) -> ProbePoint {
        ProbePoint {
            t,
            action: String::new(),
            delta_logit: 0.0,
            successes: usize::from(pass),
            k: 1,
            pass,
        }
    }

    #[test]
    fn barrier_is_where_reachability_stays_on() {
        // Reachable from the start: no barrier.
        assert_eq!(barrier(&[pt(0, true), pt(1, true)], 2), 0);
        // Unreachable until two expert actions are done.
        assert_eq!(barrier(&[pt(0, false), pt(1, false), pt(2, true)], 3), 2);
        // A lucky early success does not hide a later collapse.
        assert_eq!(barrier(&[pt(0, true), pt(1, false), pt(2, true)], 3), 2);
        // Never reachable: only the goal state itself.
        assert_eq!(barrier(&[pt(0, false), pt(1, false)], 2), 2);
    }

    #[test]
    fn l2_diff_is_the_euclidean_distance() {
        assert!((l2_diff(&[0.0, 3.0], &[4.0, 0.0]) - 5.0).abs() < 1e-12);
        assert_eq!(l2_diff(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
    }
}
