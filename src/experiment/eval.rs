//! Evaluation on a task panel: unguided rollouts (greedy or sampled), with
//! success overall, by task type and by difficulty cluster.

use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use crate::env::{Env, Task};
use crate::experiment::metrics::success_breakdown;
use crate::guidance::{Clusters, ResolvedSpec};
use crate::model::{Policy, Tok};
use crate::rollout::{self, EpisodeRequest, RolloutError, RolloutOptions, RolloutStats};

/// What to evaluate on.
#[derive(Debug, Clone, Copy)]
pub struct EvalSet<'a> {
    pub tasks: &'a [Task],
    /// Unguided rollouts per task.
    pub samples: usize,
    /// Clusters for the per-cluster breakdown.
    pub clusters: &'a Clusters,
}

/// Evaluate `policy` on a set of tasks with unguided rollouts.
pub fn evaluate(
    policy: &Policy,
    tok: &Tok,
    make_env: &dyn Fn(usize) -> Box<dyn Env>,
    set: &EvalSet<'_>,
    opts: &RolloutOptions,
    rng: &mut ChaCha8Rng,
) -> Result<(Value, RolloutStats), RolloutError> {
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
    let pairs: Vec<(&Task, &rollout::Episode)> =
        reqs.iter().map(|r| r.task).zip(eps.iter()).collect();
    Ok((success_breakdown(&pairs, set.clusters), stats))
}
