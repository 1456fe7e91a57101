//! What the scripts see of the run's tasks, episodes and results.

use super::Ctx;
use crate::env::Task;
use crate::experiment::metrics::mean;
use crate::guidance::host::EpisodeView;
use crate::guidance::rounds::{Outcome, TaskRounds};
use crate::guidance::{ResolvedSpec, TaskResult, TaskView};
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
    let h = ctx.host.history(&task.id);
    TaskView {
        id: task.id.clone(),
        task_type: task.task_type.clone(),
        cluster: ctx.clusters.of(task.expert.len()) as i64,
        expert_len: task.expert.len() as i64,
        difficulty: task.difficulty as i64,
        visits: h.visits,
        last_success: h.last_success,
        step: step as i64,
        total_steps: ctx.exp.steps as i64,
        group_size: ctx.exp.rollout.group_size as i64,
    }
}

/// What the guidance script's `update` learns of a task's step: its
/// training group's guidance and outcomes.
pub(super) fn task_result(ctx: &Ctx, task: &Task, g: &TaskRounds<rollout::Episode>) -> TaskResult {
    let grp: Vec<&rollout::Episode> = g.training().map(|r| &r.ep).collect();
    let depths: Vec<f64> = grp.iter().map(|e| e.spec.prefix as f64).collect();
    let len = task.expert.len().max(1) as f64;
    TaskResult {
        id: task.id.clone(),
        task_type: task.task_type.clone(),
        cluster: ctx.clusters.of(task.expert.len()) as i64,
        expert_len: task.expert.len() as i64,
        depth: mean(&depths),
        depth_ratio: mean(&depths) / len,
        plan_k: mean(&grp.iter().map(|e| e.spec.plan as f64).collect::<Vec<_>>()),
        guided: grp.iter().any(|e| e.spec.is_guided()),
        rewards: grp.iter().map(|e| e.reward).collect(),
        successes: grp.iter().map(|e| e.success).collect(),
        success_rate: mean(
            &grp.iter()
                .map(|e| f64::from(u8::from(e.success)))
                .collect::<Vec<_>>(),
        ),
        rollouts: g.spent() as i64,
        rounds: g.rounds as i64,
    }
}
