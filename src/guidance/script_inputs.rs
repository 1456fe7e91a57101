//! The records scripts see: a task in `plan` and `review` ([`TaskView`]),
//! its results in `update` ([`TaskResult`]), an episode in `reward`
//! ([`EpisodeView`]) and a turn in `intervene` ([`TurnView`]), plus the
//! per-task history the runtime keeps across steps ([`TaskHistory`]).
//!
//! Every view is built here by one constructor, so a training run,
//! `simulate` and `actguide check` show scripts the same fields computed
//! the same way. This module depends on nothing else of `guidance` but
//! the spec types.

use serde::{Deserialize, Serialize};

use crate::env::Task;
use crate::guidance::spec::ResolvedSpec;

/// What the guidance layer needs to know about an executed rollout: a
/// training run's episode or a `simulate` learner's rollout.
pub trait Outcome {
    fn success(&self) -> bool;
    fn reward(&self) -> f64;
    fn resolved(&self) -> ResolvedSpec;
}

/// What a script sees of a task in `plan(task, state)`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TaskView {
    pub id: String,
    #[serde(rename = "type")]
    pub task_type: String,
    pub cluster: i64,
    pub expert_len: i64,
    pub difficulty: i64,
    /// Steps in which this task was trained on so far.
    pub visits: i64,
    /// Success rate of its last group (-1.0 if never seen).
    pub last_success: f64,
    /// Current training step and total steps.
    pub step: i64,
    pub total_steps: i64,
    pub group_size: i64,
}

impl TaskView {
    /// The view of `task` (in length cluster `cluster`, with the runtime's
    /// `history` of it) at `step` of a run of `total_steps` steps whose
    /// groups have `group_size` rollouts.
    pub fn new(
        task: &Task,
        cluster: usize,
        history: &TaskHistory,
        step: usize,
        total_steps: usize,
        group_size: usize,
    ) -> Self {
        TaskView {
            id: task.id.clone(),
            task_type: task.task_type.clone(),
            cluster: cluster as i64,
            expert_len: task.expert.len() as i64,
            difficulty: task.difficulty as i64,
            visits: history.visits,
            last_success: history.last_success,
            step: step as i64,
            total_steps: total_steps as i64,
            group_size: group_size as i64,
        }
    }
}

/// One task's results in the batch given to `update(batch, state)`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TaskResult {
    pub id: String,
    #[serde(rename = "type")]
    pub task_type: String,
    pub cluster: i64,
    pub expert_len: i64,
    /// Mean executed prefix depth (actions) and ratio of expert length.
    pub depth: f64,
    pub depth_ratio: f64,
    pub plan_k: f64,
    pub guided: bool,
    pub rewards: Vec<f64>,
    pub successes: Vec<bool>,
    pub success_rate: f64,
    /// Rollouts spent on this task this step (probes included) and rounds.
    #[serde(default)]
    pub rollouts: i64,
    #[serde(default)]
    pub rounds: i64,
    /// Episodes of the training group the env failed (dead server,
    /// malformed reply): not in `rewards` / `successes`.
    #[serde(default)]
    pub env_failed: i64,
}

impl TaskResult {
    /// The results of the task `view` shows: `group` is its training
    /// group, `rollouts` every rollout spent on it this step (probes
    /// included) and `rounds` the rounds run.
    pub fn from_group<'a, E: Outcome + 'a>(
        view: &TaskView,
        group: impl IntoIterator<Item = &'a E>,
        rollouts: usize,
        rounds: usize,
    ) -> Self {
        let group: Vec<&E> = group.into_iter().collect();
        let depths: Vec<f64> = group.iter().map(|e| e.resolved().prefix as f64).collect();
        let len = view.expert_len.max(1) as f64;
        let plan_ks: Vec<f64> = group.iter().map(|e| e.resolved().plan as f64).collect();
        let successes: Vec<bool> = group.iter().map(|e| e.success()).collect();
        let rates: Vec<f64> = successes.iter().map(|&s| f64::from(u8::from(s))).collect();
        TaskResult {
            id: view.id.clone(),
            task_type: view.task_type.clone(),
            cluster: view.cluster,
            expert_len: view.expert_len,
            depth: mean(&depths),
            depth_ratio: mean(&depths) / len,
            plan_k: mean(&plan_ks),
            guided: group.iter().any(|e| e.resolved().is_guided()),
            rewards: group.iter().map(|e| e.reward()).collect(),
            successes,
            success_rate: mean(&rates),
            rollouts: rollouts as i64,
            rounds: rounds as i64,
            env_failed: 0,
        }
    }
}

/// Mean of `v`, 0 when empty (the statistics of [`TaskResult`] and of
/// `simulate`'s table).
pub(crate) fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Per-task history kept by the runtime across steps (and checkpoints).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TaskHistory {
    pub visits: i64,
    pub last_success: f64,
}

/// What `intervene(turn, state)` sees.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TurnView {
    pub task_id: String,
    /// Policy turns taken so far in this episode.
    pub turn: i64,
    /// Invalid actions in a row just before this turn, and in total.
    pub invalid_streak: i64,
    pub invalid: i64,
    pub last_action: String,
    pub observation: String,
    /// The reference trajectory's next action after the longest prefix of
    /// it the episode has followed ("" when it is used up).
    pub expert_next: String,
    pub expert_len: i64,
    /// Executed prefix depth and plan length of this episode.
    pub prefix: i64,
    pub plan_k: i64,
}

/// What `reward(episode, state)` sees.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpisodeView {
    pub task_id: String,
    pub success: bool,
    /// The env's reward plus the runner's invalid-action penalties.
    pub env_reward: f64,
    pub invalid: i64,
    pub policy_turns: i64,
    pub expert_len: i64,
    pub prefix: i64,
    pub plan_k: i64,
    pub expert: bool,
    /// How many of the reference actions the episode reproduced in order
    /// (executed prefix included).
    pub expert_match: i64,
    pub actions: Vec<String>,
    pub error: bool,
}
