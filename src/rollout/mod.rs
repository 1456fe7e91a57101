//! Episode runner: many episodes at once, turn by turn, with generation
//! batched across every live episode; guidance applied (executed expert
//! prefixes, plans in the prompt); per-turn token records out.
//!
//! - `episode`: the records ([`EpisodeRequest`], [`Episode`], [`Turn`])
//!   and a running episode's state, its start with the executed expert
//!   prefix and its end;
//! - `turn`: one policy turn (the intervention's view, the prompts,
//!   applying a generation);
//! - `driver`: [`run`], the batched loop over every live episode;
//! - `encode`: prompts to token ids and answers to actions under the
//!   rollout format;
//! - `expert`: [`expert_state_prompts`], prompts along the expert
//!   trajectory (diagnostics);
//! - [`prompt`] and [`chat`]: the prompt text in the plain and chat formats.

pub mod chat;
mod driver;
mod encode;
mod episode;
mod expert;
pub mod prompt;
mod turn;

use crate::model::ModelError;
use chat::{ChatError, PromptFormat};

pub use driver::{run, InterveneFn, RolloutStats};
pub use episode::{state_text, Episode, EpisodeRequest, Turn};
pub use expert::{expert_state_prompts, StatePrompts};

/// Rollout settings (from the experiment's `rollout` section).
#[derive(Debug, Clone)]
pub struct RolloutOptions {
    pub temperature: f64,
    pub top_p: f64,
    pub greedy: bool,
    pub constrained: bool,
    pub history: usize,
    /// Chat format: each episode is one growing conversation, so its turns
    /// share their prompts as prefixes (`rollout.conversation`).
    pub conversation: bool,
    pub invalid_penalty: f64,
    pub max_action_tokens: usize,
    pub show_actions: bool,
    /// Record prompt and action tokens of executed prefix turns (needed
    /// only for the auxiliary NLL on prefix actions).
    pub record_prefix: bool,
    /// Policy actions per episode (executed prefix actions come on top).
    pub max_steps: usize,
    /// If set, an episode's policy budget is at most the expert actions
    /// still to do plus this slack: success then needs near-expert play,
    /// so rewarded episodes carry few wandering actions.
    pub step_slack: Option<usize>,
    /// Prompt and answer format (`rollout.format`).
    pub format: PromptFormat,
    /// Episodes whose env calls (reset, expert prefix, each turn's step)
    /// run at once, on that many threads; 1 runs them in order. External
    /// envs wait on the network, so their calls overlap (`env.concurrency`).
    pub env_concurrency: usize,
    /// Generate the policy's turns on engine servers instead of `policy`
    /// (`rollout.engine`); the policy still encodes prompts and reads
    /// answers. A request the engine fails ends its episode (recorded as
    /// an engine failure).
    pub engine: Option<std::sync::Arc<crate::inference::Engine>>,
}

impl RolloutOptions {
    /// Env step limit for a task with `expert_len` actions of which
    /// `prefix` are executed for the policy.
    pub fn env_limit(&self, expert_len: usize, prefix: usize) -> usize {
        let remaining = expert_len.saturating_sub(prefix);
        let budget = match self.step_slack {
            Some(slack) => self.max_steps.min(remaining + slack),
            None => self.max_steps,
        };
        prefix + budget.max(1)
    }
}

/// Errors of the runner (model failures; env failures end one episode).
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Only where no episode can absorb it (diagnostics walking the expert
    /// trajectory); in `run`, an env failure ends one episode.
    #[error("env: {0}")]
    Env(String),
    /// The tokenizer does not fit the chat format.
    #[error("rollout.format: {0}")]
    Chat(#[from] ChatError),
    /// The plain format ends answers at the model's eos.
    #[error(
        "the model's config.json has no eos_token_id, which rollout.format \"plain\" \
         ends answers with; set it, or use rollout.format \"chat\""
    )]
    NoEos,
    /// Every engine server is down.
    #[error(transparent)]
    Engine(#[from] Box<crate::inference::EngineError>),
}

#[cfg(test)]
mod tests;
