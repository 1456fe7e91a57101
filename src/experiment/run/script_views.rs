//! What the scripts see of the run's tasks, episodes and results.

use super::Ctx;
use crate::env::Task;
use crate::guidance::rounds::Outcome;
use crate::guidance::runtime::EpisodeView;
use crate::guidance::{ResolvedSpec, TaskView};
use crate::rollout;

/// What a reward script sees of an episode.
pub(super) fn episode_view(e: &rollout::Episode, task: &Task) -> EpisodeView {
    EpisodeView {
        task_id: e.task_id.clone(),
        success: e.success,
        env_reward: e.reward,
        invalid: e.invalid as i64,
        policy_turns: e.policy_turns as i64,
        expert_len: task.expert.len() as i64,
        prefix: e.spec.prefix as i64,
        plan_k: e.spec.plan as i64,
        expert: e.spec.expert,
        expert_match: e.expert_match as i64,
        actions: e.actions.clone(),
        error: e.error.is_some(),
    }
}

impl Outcome for rollout::Episode {
    fn success(&self) -> bool {
        self.success
    }
    fn reward(&self) -> f64 {
        self.reward
    }
    fn resolved(&self) -> ResolvedSpec {
        self.spec
    }
}

pub(super) fn task_view(ctx: &Ctx, task: &Task, step: usize) -> TaskView {
    TaskView::new(
        task,
        ctx.clusters.of(task.expert.len()),
        &ctx.runtime.history(&task.id),
        step,
        ctx.exp.steps,
        ctx.exp.rollout.group_size,
    )
}
