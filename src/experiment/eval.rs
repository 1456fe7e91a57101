//! Evaluation on a task panel: unguided rollouts (greedy or sampled), with
//! success overall, by task type and by difficulty cluster.

use rand_chacha::ChaCha8Rng;
use serde_json::Value;

use crate::env::{Env, Task};
use crate::experiment::metrics::success_breakdown;
use crate::guidance::{Clusters, ResolvedSpec};
use crate::model::{Policy, Tok};
use crate::rollout::{self, EpisodeRequest, RolloutError, RolloutOptions, RolloutStats};

/// Evaluate `policy` on `tasks` with `samples` unguided rollouts each.
pub fn evaluate(
    policy: &Policy,
    tok: &Tok,
    make_env: &dyn Fn() -> Box<dyn Env>,
    tasks: &[Task],
    samples: usize,
    opts: &RolloutOptions,
    clusters: &Clusters,
    rng: &mut ChaCha8Rng,
) -> Result<(Value, RolloutStats), RolloutError> {
    let reqs: Vec<EpisodeRequest> = tasks
        .iter()
        .flat_map(|t| {
            (0..samples.max(1)).map(move |_| EpisodeRequest {
                task: t,
                spec: ResolvedSpec::default(),
            })
        })
        .collect();
    let (eps, stats) = rollout::run(policy, tok, make_env, &reqs, opts, rng)?;
    let pairs: Vec<(&Task, &rollout::Episode)> =
        reqs.iter().map(|r| r.task).zip(eps.iter()).collect();
    Ok((success_breakdown(&pairs, clusters), stats))
}
