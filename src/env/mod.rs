//! Environments: the [`Env`] trait every environment implements, the [`Task`]
//! record that task panels are made of (with its expert actions), panel I/O
//! ([`panel`]), the built-in environments ([`household`], [`shop`],
//! [`searchqa`]) and their names ([`kind`]), external environments
//! ([`external`]), how a run builds an env from its settings ([`spec`]),
//! and how a panel is built from an external env ([`harvest`]).

pub mod external;
pub mod harvest;
pub mod household;
pub mod kind;
pub mod panel;
pub mod searchqa;
pub mod shop;
pub mod spec;

pub use kind::{
    generate_panels, random_policy_success, write_default_panels, BuiltinEnv, CannotGenerate,
    EnvKindName, GenerateError, UnknownEnv,
};
pub use spec::{fill_experts, make_env, EnvKind, EnvSpec, ExpertSource};

use serde::{Deserialize, Serialize};

/// One task of a panel: everything needed to reset an environment to it,
/// plus the expert action data used as guidance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// Stable id, unique within the env (e.g. `household-train-0042`).
    pub id: String,
    /// Task type (household: one of the six ALFWorld types).
    #[serde(rename = "type")]
    pub task_type: String,
    /// Goal text as shown to the agent.
    pub goal: String,
    /// Env-specific world description (household: rooms, objects, start state).
    pub world: serde_json::Value,
    /// A successful action sequence from the start state.
    pub expert: Vec<String>,
    /// Difficulty; for the built-in envs the expert length.
    pub difficulty: usize,
}

impl Task {
    /// The length `env.step_slack` budgets the task by: its expert's, or,
    /// where a scarce-data panel withheld the expert actions, its
    /// difficulty (so the step limit does not tell the arms apart); `None`
    /// with neither.
    pub fn budget_len(&self) -> Option<usize> {
        match (self.expert.len(), self.difficulty) {
            (0, 0) => None,
            (0, d) => Some(d),
            (l, _) => Some(l),
        }
    }
}

/// What the env shows after a reset or a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// Feedback text ("You arrive at cabinet 1. ..." / "Nothing happens.").
    pub text: String,
    /// Actions the env accepts now (the admissible list).
    pub admissible: Vec<String>,
    /// Episode over (success or step limit).
    pub done: bool,
    /// Reward of this transition (household: 1.0 on success, else 0.0).
    pub reward: f32,
    /// Goal reached.
    pub success: bool,
    /// The action was a valid command (false for "Nothing happens.").
    pub valid: bool,
    /// Numeric extras of the env (searchqa's answer F1, an external env's
    /// numeric `info` fields); the run logs the mean of each over the
    /// step's episodes, from their last observation.
    pub info: std::collections::BTreeMap<String, f64>,
}

/// Errors an environment can raise (bad task data, protocol trouble).
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("task {task}: {msg}")]
    BadTask { task: String, msg: String },
    #[error("{0}")]
    Other(String),
}

/// A multi-turn text environment.
pub trait Env: Send {
    /// Reset to `task`'s start state and return the first observation.
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError>;
    /// Execute one action (any text; invalid text is a no-op with feedback).
    fn step(&mut self, action: &str) -> Result<Observation, EnvError>;
    /// A short Markovian summary of what the agent knows now (location,
    /// hand, what it has seen where), rendered into every prompt.
    fn status(&self) -> String;
}
