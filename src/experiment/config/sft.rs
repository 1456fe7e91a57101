//! The `sft` section of an experiment file (`actguide sft`, see
//! [`crate::experiment::sft`]).

use serde::{Deserialize, Serialize};

/// The experiment file's `sft` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SftSection {
    /// Panel of expert trajectories (default: `env.train`).
    pub panel: Option<String>,
    /// Keep only tasks with at most this many expert actions (for SFT data
    /// disjoint from a benchmark's long tasks).
    pub max_expert_len: Option<usize>,
    /// Trajectories per optimiser step (the panel is visited in a fresh
    /// seeded order each epoch).
    pub tasks_per_step: usize,
    /// Share of trajectories shown with a plan of their first k expert
    /// actions, k uniform in 1..=L.
    pub plan_share: f64,
    /// Greedy success on this many of its own tasks after the last step
    /// (0: none).
    pub eval_tasks: usize,
    /// Also evaluate the unguided policy on the `evaluation` panels at step
    /// 0, every `evaluation.every` steps and at the end, as an RL run does
    /// (`eval.jsonl`): a behaviour-cloning arm of a comparison, reported
    /// beside the RL arms.
    pub evaluate: bool,
}

impl Default for SftSection {
    fn default() -> Self {
        SftSection {
            panel: None,
            max_expert_len: None,
            tasks_per_step: 16,
            plan_share: 0.0,
            eval_tasks: 32,
            evaluate: false,
        }
    }
}

impl SftSection {
    /// A wrong value, as the message of a positioned config error.
    pub fn check(&self) -> Result<(), String> {
        if self.tasks_per_step == 0 {
            return Err("sft.tasks_per_step must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.plan_share) {
            return Err(format!(
                "sft.plan_share must be in [0, 1], got {}",
                self.plan_share
            ));
        }
        if self.max_expert_len == Some(0) {
            return Err("sft.max_expert_len must be at least 1".into());
        }
        Ok(())
    }
}
