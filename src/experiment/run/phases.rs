//! What the phases of a training step hand on: the rollouts driven
//! ([`Driven`]), the training batch ([`Batch`]) and the script update
//! ([`Update`]). `step` produces them; `step_line` reads them into the
//! step's metrics line.

use std::collections::BTreeMap;

use crate::env::Task;
use crate::guidance::rounds::TaskRounds;
use crate::guidance::runtime::ReloadOutcome;
use crate::rollout::Episode;
use crate::script::Effects;
use crate::train::{Advantages, AnchorStats};

/// What driving the rollouts produced.
pub(super) struct Driven {
    /// Every task's rounds, in the order of the step's tasks.
    pub groups: Vec<TaskRounds<Episode>>,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Errors of the guidance, reward and intervention scripts (already
    /// reported as events).
    pub script_errors: usize,
}

/// The training batch: each task's training group, flattened, with the
/// group-relative advantages.
pub(super) struct Batch<'a> {
    /// The task of each episode.
    pub tasks: Vec<&'a Task>,
    pub episodes: Vec<Episode>,
    pub advantages: Advantages,
    /// Tasks whose group rewards all tie (no signal).
    pub zero_std: usize,
    /// GiGPO's anchor states (only when `trainer.advantage` is "gigpo").
    pub anchors: Option<AnchorStats>,
    /// Tasks of the step.
    pub task_count: usize,
    /// Training-group episodes the env failed (not in `episodes`).
    pub env_failed: usize,
    /// Of those, the episodes the engine failed.
    pub engine_failed: usize,
    /// Training-group episodes older than `rollout.async.max_staleness`
    /// (not in `episodes`).
    pub stale: usize,
    /// Asynchronous rollouts: training-group episodes by lag (policy
    /// versions behind the one trained), dropped ones included.
    pub lag: Vec<usize>,
}

/// What the guidance script's update left.
pub(super) struct Update {
    /// The versions this step ran with.
    pub script_hash: String,
    pub script_hashes: BTreeMap<String, String>,
    pub script_errors: usize,
    /// Versions that failed on probation and were swapped back.
    pub reverts: Vec<ReloadOutcome>,
    /// The scripts' `metric()` and `log()` calls of the step.
    pub effects: Effects,
}
