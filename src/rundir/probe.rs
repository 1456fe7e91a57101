//! The record of `actguide probe` (ActGuide-RL's reachability
//! diagnostics): what `--json` prints and the report's probe figure
//! reads. Computed by `experiment::probe`.

use serde::Serialize;

/// One state along the guided trajectory.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ProbePoint {
    /// Expert actions executed before this state.
    pub t: usize,
    /// The plan's action at this state.
    pub action: String,
    pub delta_logit: f64,
    /// Successes of the K unguided continuations from this state.
    pub successes: usize,
    pub k: usize,
    /// Pass@K: at least one continuation succeeded.
    pub pass: bool,
}

/// One task's probe.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TaskProbe {
    pub id: String,
    pub task_type: String,
    pub cluster: usize,
    pub expert_len: usize,
    pub points: Vec<ProbePoint>,
    /// The first t from which every state reaches reward (Pass@K > 0 at
    /// t and after; the goal state t = L counts as reached): 0 = no
    /// barrier (in-region); the barrier interval is [barrier − 1, barrier).
    pub barrier: usize,
    /// The state with the largest guidance influence.
    pub max_delta_t: Option<usize>,
}

/// The probe of a run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ProbeResult {
    pub checkpoint: String,
    pub step: usize,
    pub policy: &'static str,
    pub k: usize,
    pub seed: u64,
    pub tasks: Vec<TaskProbe>,
}
