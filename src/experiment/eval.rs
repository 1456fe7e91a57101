//! Evaluation on a task panel: unguided rollouts (greedy or sampled), with
//! success overall, by task type and by difficulty cluster — during runs
//! ([`evaluate`]) and for a saved checkpoint (`actguide eval`,
//! [`eval_checkpoint`]), where it adds unbiased pass@k and the in-region /
//! out-region split against the run's initial policy.

use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use crate::env::{Env, Task};
use crate::experiment::metrics::success_breakdown;
use crate::guidance::{Clusters, ResolvedSpec};
use crate::model::{Policy, Tok};
use crate::rollout::{self, EpisodeRequest, RolloutError, RolloutOptions, RolloutStats};
use crate::rundir::SuccessBreakdown;

/// What to evaluate on.
#[derive(Debug, Clone, Copy)]
pub struct EvalSet<'a> {
    pub tasks: &'a [Task],
    /// Unguided rollouts per task.
    pub samples: usize,
    /// Clusters for the per-cluster breakdown.
    pub clusters: &'a Clusters,
}

/// What one evaluation found: the breakdown (success overall, by type and
/// cluster, over the episodes the env completed), the rollout statistics,
/// each task's success and completed-episode counts (in the order of
/// [`EvalSet::tasks`]), and the episodes the env failed.
#[derive(Debug, Clone)]
pub struct EvalResult {
    pub breakdown: SuccessBreakdown,
    pub stats: RolloutStats,
    pub successes: Vec<usize>,
    pub attempts: Vec<usize>,
    pub env_failures: Vec<EnvFailure>,
}

/// An evaluation episode the env failed (dead server, malformed reply,
/// deadline): it says nothing of the policy, so it is left out of success
/// and reported instead.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvFailure {
    pub task: String,
    pub error: String,
}

/// Per task (`samples` consecutive episodes each): successes and episodes
/// the env completed; and the episodes it failed.
fn tally(
    tasks: &[Task],
    eps: &[rollout::Episode],
    samples: usize,
) -> (Vec<usize>, Vec<usize>, Vec<EnvFailure>) {
    let mut failures = Vec::new();
    let mut successes = Vec::with_capacity(tasks.len());
    let mut attempts = Vec::with_capacity(tasks.len());
    for (t, group) in tasks.iter().zip(eps.chunks(samples.max(1))) {
        let (mut s, mut a) = (0, 0);
        for e in group {
            match &e.error {
                Some(err) => failures.push(EnvFailure {
                    task: t.id.clone(),
                    error: err.clone(),
                }),
                None => {
                    a += 1;
                    s += usize::from(e.success);
                }
            }
        }
        successes.push(s);
        attempts.push(a);
    }
    (successes, attempts, failures)
}

/// Evaluate `policy` on a set of tasks with unguided rollouts.
pub fn evaluate(
    policy: &Policy,
    tok: &Tok,
    make_env: &dyn Fn(usize) -> Box<dyn Env>,
    set: &EvalSet<'_>,
    opts: &RolloutOptions,
    rng: &mut ChaCha8Rng,
) -> Result<EvalResult, RolloutError> {
    let samples = set.samples;
    let reqs: Vec<EpisodeRequest> = set
        .tasks
        .iter()
        .flat_map(|t| {
            (0..samples.max(1)).map(move |_| EpisodeRequest {
                task: t,
                spec: ResolvedSpec::default(),
            })
        })
        .collect();
    let (eps, stats) = rollout::run(policy, tok, make_env, &reqs, opts, rng, None)?;
    let pairs: Vec<(&Task, &rollout::Episode)> = reqs
        .iter()
        .map(|r| r.task)
        .zip(eps.iter())
        .filter(|(_, e)| e.error.is_none())
        .collect();
    let (successes, attempts, env_failures) = tally(set.tasks, &eps, samples);
    Ok(EvalResult {
        breakdown: success_breakdown(&pairs, set.clusters),
        stats,
        successes,
        attempts,
        env_failures,
    })
}

/// Unbiased pass@k from `c` successes in `n` samples (Chen et al. 2021):
/// 1 − C(n−c, k) / C(n, k), computed as a stable product.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if k == 0 || n == 0 {
        return 0.0;
    }
    let k = k.min(n);
    if n - c < k {
        return 1.0;
    }
    let mut miss = 1.0f64;
    for i in (n - c + 1)..=n {
        miss *= 1.0 - k as f64 / i as f64;
    }
    1.0 - miss
}

/// What `actguide eval` measures.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// The panel: the run's test or train panel, or a file.
    pub panel: crate::experiment::PanelRef,
    /// Sampled rollouts per task (pass@k for k up to this).
    pub samples: usize,
    /// 0 = every task of the panel.
    pub max_tasks: usize,
    pub seed: u64,
    /// Device to evaluate on; `None`: the run's `model.device`.
    pub device: Option<crate::model::device::DeviceSpec>,
}

/// Per-task outcome counts of one policy.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct TaskCounts {
    pub id: String,
    pub greedy: bool,
    pub successes: usize,
    pub samples: usize,
}

/// The powers of two up to `n`, and `n`.
fn ks(n: usize) -> Vec<usize> {
    let mut out: Vec<usize> = (0..).map(|i| 1usize << i).take_while(|&k| k <= n).collect();
    if out.last() != Some(&n) && n > 0 {
        out.push(n);
    }
    out
}

/// Success (greedy and sampled) and pass@k of a group of tasks.
fn summary(counts: &[&TaskCounts], n: usize) -> Value {
    let t = counts.len().max(1) as f64;
    let pass: serde_json::Map<String, Value> = ks(n)
        .into_iter()
        .map(|k| {
            let p = counts
                .iter()
                .map(|c| pass_at_k(c.samples, c.successes, k))
                .sum::<f64>()
                / t;
            (
                k.to_string(),
                serde_json::json!(crate::experiment::metrics::round(p)),
            )
        })
        .collect();
    serde_json::json!({
        "tasks": counts.len(),
        "greedy_success": crate::experiment::metrics::round(counts.iter().filter(|c| c.greedy).count() as f64 / t),
        "sampled_success": crate::experiment::metrics::round(counts.iter().map(|c| c.successes as f64 / c.samples.max(1) as f64).sum::<f64>() / t),
        "pass_at_k": pass,
    })
}

/// A run's experiment, its trained policy (latest or given checkpoint) and
/// its initial policy, rebuilt as the run built it.
pub struct RunModels {
    pub exp: crate::experiment::config::Experiment,
    pub run_dir: std::path::PathBuf,
    pub ckpt_dir: std::path::PathBuf,
    /// The checkpoint's step.
    pub step: usize,
    pub tok: Tok,
    /// The run's `model.path`, opened (tokenizer side files, chat template).
    pub src: crate::model::ModelSource,
    pub trained: Policy,
    pub initial: Policy,
    /// Difficulty clusters of the run's train panel.
    pub clusters: Clusters,
    /// The run's rollout settings (sampled decoding).
    pub ropts: RolloutOptions,
}

/// Load `path`: a run directory (its latest checkpoint) or a checkpoint
/// directory `<run>/checkpoints/step-NNNNNN`, on `device` (`None`: the
/// run's `model.device`) in the run's precision (`model.dtype`, resolved
/// on that device).
pub fn load_run(
    path: &std::path::Path,
    device: Option<crate::model::device::DeviceSpec>,
) -> Result<RunModels, crate::experiment::RunError> {
    use crate::env::panel;
    use crate::experiment::config::Experiment;
    use crate::experiment::RunError;
    use crate::rundir::checkpoint::{self, STATE_FILE};
    use crate::rundir::{RunDir, EXPERIMENT_FILE};
    use std::path::Path;

    let (run_dir, ckpt) = if path.join(EXPERIMENT_FILE).exists() {
        (path.to_path_buf(), None)
    } else if path.join(STATE_FILE).exists() {
        let run =
            path.parent()
                .and_then(Path::parent)
                .ok_or_else(|| RunError::CheckpointOutsideRun {
                    path: path.to_path_buf(),
                })?;
        (run.to_path_buf(), Some(path))
    } else {
        return Err(RunError::NotARun {
            path: path.to_path_buf(),
        });
    };
    let mut exp: Experiment = RunDir::at(&run_dir).read_experiment()?;
    if let Some(d) = device {
        exp.model.device = d;
    }
    let device = super::models::device(&exp)?;
    let loaded = match ckpt {
        None => checkpoint::load_latest(&run_dir, &device, checkpoint::Sums::Required)?,
        Some(dir) => checkpoint::load_dir(dir, &device, checkpoint::Sums::Required)?,
    };
    let train = panel::read_jsonl(Path::new(&exp.env.train))?;
    // As the run computed them (setup::panels).
    let clusters =
        Clusters::from_expert_lengths(train.iter().map(|t| t.expert.len()), exp.guidance.clusters);
    // The model as the run built it: its source, the checkpoint's weights
    // (or adapters on the source's base), and its prompt format.
    let src = super::models::open(&exp)?;
    let tok = src.tok.clone();
    let trained = super::models::trained(&exp, &src, Some(&loaded), &device)?;
    let initial = super::models::initial(&exp, &src, &device)?;
    let ropts = super::models::rollout_options(&exp, &src, false)?;
    Ok(RunModels {
        src,
        ckpt_dir: loaded.dir.clone(),
        step: loaded.state.step,
        exp,
        run_dir,
        tok,
        trained,
        initial,
        clusters,
        ropts,
    })
}

/// Evaluate the checkpoint at `path` (a run directory: its latest
/// checkpoint; or a checkpoint directory) on a panel: greedy and sampled
/// success, unbiased pass@k, broken down by task type, difficulty cluster
/// and in-region / out-region (in-region: tasks the run's initial policy
/// solves at least once in `samples` samples). Deterministic in `seed`.
pub fn eval_checkpoint(
    path: &std::path::Path,
    o: &EvalOptions,
) -> Result<Value, crate::experiment::RunError> {
    use crate::env::panel;
    use crate::experiment::RunError;
    use crate::seed;

    let RunModels {
        exp,
        ckpt_dir,
        step,
        tok,
        trained,
        initial,
        clusters,
        ropts,
        ..
    } = load_run(path, o.device)?;
    let mut opts = ropts;
    let panel_path = o.panel.in_run(&exp);
    let mut tasks = panel::read_jsonl(&panel_path)?;
    if o.max_tasks > 0 {
        tasks.truncate(o.max_tasks);
    }
    let spec = exp.env.spec();
    spec.begin_step();
    let make = move |limit: usize| crate::env::make_env(&spec, limit);
    let n = o.samples.max(1);
    // Successes and completed episodes per task, and the env's failures.
    type Tally = (Vec<usize>, Vec<usize>, Vec<EnvFailure>);
    let counts = |policy: &Policy,
                  opts: &RolloutOptions,
                  samples: usize,
                  label: &str|
     -> Result<Tally, RunError> {
        let reqs: Vec<EpisodeRequest> = tasks
            .iter()
            .flat_map(|t| {
                (0..samples).map(move |_| EpisodeRequest {
                    task: t,
                    spec: ResolvedSpec::default(),
                })
            })
            .collect();
        let mut rng = seed::rng(o.seed, &[seed::label(label)]);
        let (eps, _) = rollout::run(policy, &tok, &make, &reqs, opts, &mut rng, None)?;
        Ok(tally(&tasks, &eps, samples))
    };
    let (sampled, attempts, mut failures) = counts(&trained, &opts, n, "eval-sampled")?;
    let (before, before_attempts, f) = counts(&initial, &opts, n, "eval-initial")?;
    failures.extend(f);
    opts.greedy = true;
    let (greedy, _, f) = counts(&trained, &opts, 1, "eval-greedy")?;
    failures.extend(f);
    let (initial_greedy, _, f) = counts(&initial, &opts, 1, "eval-initial-greedy")?;
    failures.extend(f);
    let per: Vec<TaskCounts> = tasks
        .iter()
        .enumerate()
        .map(|(i, t)| TaskCounts {
            id: t.id.clone(),
            greedy: greedy[i] > 0,
            successes: sampled[i],
            samples: attempts[i],
        })
        .collect();
    let init: Vec<TaskCounts> = tasks
        .iter()
        .enumerate()
        .map(|(i, t)| TaskCounts {
            id: t.id.clone(),
            greedy: initial_greedy[i] > 0,
            successes: before[i],
            samples: before_attempts[i],
        })
        .collect();
    let group = |f: &dyn Fn(usize) -> String| -> serde_json::Map<String, Value> {
        let mut by: std::collections::BTreeMap<String, Vec<&TaskCounts>> = Default::default();
        for (i, c) in per.iter().enumerate() {
            by.entry(f(i)).or_default().push(c);
        }
        by.into_iter().map(|(k, v)| (k, summary(&v, n))).collect()
    };
    let region = |i: usize| {
        if before[i] > 0 {
            "in".to_string()
        } else {
            "out".to_string()
        }
    };
    Ok(serde_json::json!({
        "checkpoint": ckpt_dir.display().to_string(),
        "step": step,
        "panel": panel_path.display().to_string(),
        "samples": n,
        "seed": o.seed,
        "all": summary(&per.iter().collect::<Vec<_>>(), n),
        "initial": summary(&init.iter().collect::<Vec<_>>(), n),
        "by_type": group(&|i| tasks[i].task_type.clone()),
        "by_cluster": group(&|i| clusters.of(tasks[i].expert.len()).to_string()),
        "by_region": group(&region),
        "tasks": per,
        // Episodes the env failed, left out of every rate above.
        "env_errors": failures.len(),
        "env_error_examples": failures
            .iter()
            .take(5)
            .map(|f| serde_json::json!({ "task": f.task, "error": f.error }))
            .collect::<Vec<_>>(),
    }))
}

/// The readable table of an `eval_checkpoint` result.
pub fn eval_table(v: &Value) -> String {
    let mut s = format!(
        "checkpoint {} (step {}), panel {}, {} samples/task, seed {}\n",
        v["checkpoint"].as_str().unwrap_or("?"),
        v["step"],
        v["panel"].as_str().unwrap_or("?"),
        v["samples"],
        v["seed"]
    );
    let ks: Vec<String> = v["all"]["pass_at_k"]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    let mut ks = ks;
    ks.sort_by_key(|k| k.parse::<usize>().unwrap_or(0));
    s.push_str(&format!(
        "{:<28} {:>6} {:>7} {:>8}",
        "group", "tasks", "greedy", "sampled"
    ));
    for k in &ks {
        s.push_str(&format!(" {:>8}", format!("pass@{k}")));
    }
    s.push('\n');
    let mut row = |name: &str, r: &Value| {
        s.push_str(&format!(
            "{:<28} {:>6} {:>7.3} {:>8.3}",
            name,
            r["tasks"].as_u64().unwrap_or(0),
            r["greedy_success"].as_f64().unwrap_or(0.0),
            r["sampled_success"].as_f64().unwrap_or(0.0)
        ));
        for k in &ks {
            s.push_str(&format!(
                " {:>8.3}",
                r["pass_at_k"][k].as_f64().unwrap_or(0.0)
            ));
        }
        s.push('\n');
    };
    row("all", &v["all"]);
    row("initial policy (all)", &v["initial"]);
    for (section, label) in [
        ("by_region", "region"),
        ("by_cluster", "cluster"),
        ("by_type", ""),
    ] {
        if let Some(m) = v[section].as_object() {
            for (k, r) in m {
                let name = if label.is_empty() {
                    k.clone()
                } else {
                    format!("{label} {k}")
                };
                row(&name, r);
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The closed form, with exact binomials.
    fn closed(n: usize, c: usize, k: usize) -> f64 {
        fn binom(n: usize, k: usize) -> f64 {
            if k > n {
                return 0.0;
            }
            (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
        }
        1.0 - binom(n - c, k) / binom(n, k)
    }

    #[test]
    fn pass_at_k_matches_the_closed_form() {
        for n in 1..=16 {
            for c in 0..=n {
                for k in 1..=n {
                    let a = pass_at_k(n, c, k);
                    let b = closed(n, c, k);
                    assert!((a - b).abs() < 1e-12, "n {n} c {c} k {k}: {a} vs {b}");
                }
            }
        }
        // pass@1 is the success rate; no success, no pass.
        assert!((pass_at_k(8, 3, 1) - 3.0 / 8.0).abs() < 1e-12);
        assert_eq!(pass_at_k(8, 0, 8), 0.0);
        assert_eq!(pass_at_k(8, 1, 8), 1.0);
        assert_eq!(ks(6), vec![1, 2, 4, 6]);
        assert_eq!(ks(8), vec![1, 2, 4, 8]);
    }
}
