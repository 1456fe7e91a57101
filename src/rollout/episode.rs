//! The records a rollout produces ([`EpisodeRequest`] in, [`Episode`] of
//! [`Turn`]s out) and the state of one episode while it runs ([`Live`]):
//! its start with the executed expert prefix, its history, its prompts and
//! its end.

use crate::env::{Env, EnvError, Task};
use crate::guidance::ResolvedSpec;
use crate::model::ModelError;

use super::encode::Fmt;
use super::prompt::{PromptParts, Step};
use super::{RolloutError, RolloutOptions};

/// One episode to run.
#[derive(Debug, Clone)]
pub struct EpisodeRequest<'a> {
    pub task: &'a Task,
    pub spec: ResolvedSpec,
}

/// One turn of an episode, with everything the trainer needs.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Turn {
    /// Context the action was generated under (with the plan, if any).
    pub prompt_ids: Vec<u32>,
    /// The same turn's prompt without the plan (for internalised plan
    /// guidance: score the guided tokens under the unguided prompt).
    pub unguided_prompt_ids: Option<Vec<u32>>,
    /// Action tokens including the end-of-action token.
    pub action_ids: Vec<u32>,
    /// Behaviour log-probs of `action_ids` (empty for prefix turns).
    pub logprobs: Vec<f32>,
    /// An executed expert action: never a policy token.
    pub prefix: bool,
    /// A turn of an `expert()` episode: the expert's action, trained as an
    /// off-policy sample (LUFFY).
    pub off_policy: bool,
    /// The action matched an admissible action.
    pub valid: bool,
    pub action: String,
    /// The generated tokens hold the tokenizer's unknown token: the env got
    /// the action cut short, and no loss trains on the turn.
    pub unencodable: bool,
    /// The env state the action was taken in: the env's status line and
    /// observation, without goal, plan or history ([`state_text`]; GiGPO's
    /// anchor state).
    pub state: String,
    /// What this turn's env step added to [`Episode::reward`]: the env's
    /// reward plus the invalid-action penalty.
    pub reward: f64,
}

/// The anchor-state text of a turn: the env's status line and its current
/// observation. Two turns of a task's group with the same text acted in
/// the same state, whatever history led there.
pub fn state_text(status: &str, observation: &str) -> String {
    format!("{status}\n{observation}")
}

/// A finished episode (serialisable: data-parallel ranks send theirs to
/// rank 0).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Episode {
    pub task_id: String,
    pub spec: ResolvedSpec,
    pub turns: Vec<Turn>,
    pub success: bool,
    /// Env reward plus shaping (invalid-action penalties).
    pub reward: f64,
    pub invalid: usize,
    /// Policy turns (prefix turns excluded).
    pub policy_turns: usize,
    /// Set when the env (or the engine) failed; the episode counts as a
    /// failure and trains nothing.
    pub error: Option<String>,
    /// The failure was the engine's (a server died or timed out).
    #[serde(default)]
    pub engine_failed: bool,
    /// On an engine: the oldest policy version any of its turns was
    /// generated at (asynchronous rollouts train on it later; the run
    /// drops episodes older than `rollout.async.max_staleness`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<u64>,
    /// Turns an intervention script hinted, and whether it stopped the
    /// episode.
    pub hints: usize,
    pub stopped: bool,
    /// Expert actions of the executed prefix the env ran: `spec.prefix`
    /// unless the prefix stopped early (an inadmissible expert action, an
    /// env failure, the episode's end). An `expert()` episode's trajectory
    /// is off-policy turns, not a prefix: 0. A metric only; nothing trains
    /// on it.
    #[serde(default)]
    pub prefix_executed: usize,
    /// Every action taken, executed prefix included.
    pub actions: Vec<String>,
    /// How many reference actions the episode reproduced in order from the
    /// start (executed prefix included).
    pub expert_match: usize,
    /// The env's numeric extras from the episode's last observation.
    pub info: std::collections::BTreeMap<String, f64>,
    /// An expert action of the executed prefix that was not in the env's
    /// admissible list: it was not sent, and the prefix stopped before it
    /// (so no loss ever trains on it).
    pub expert_inadmissible: Option<String>,
    /// Actions with words the tokenizer cannot encode, with those words:
    /// executed expert actions (sent to the env as written, but recorded
    /// for no loss) and policy answers holding the unknown token (sent cut
    /// short, kept out of the loss).
    pub unencodable: Vec<(String, Vec<String>)>,
}

impl Episode {
    /// Replace the reward with an outcome reward `r` (a reward script's):
    /// the script scores the episode, not its steps, so `r` becomes the
    /// reward of the last policy turn and the other turns' rewards 0 (the
    /// turn rewards still sum to `reward`).
    pub fn replace_reward(&mut self, r: f64) {
        self.reward = r;
        for t in &mut self.turns {
            t.reward = 0.0;
        }
        if let Some(t) = self.turns.iter_mut().rev().find(|t| t.is_policy()) {
            t.reward = r;
        }
    }
}

impl Turn {
    /// A turn the policy generated (not an executed prefix action, not an
    /// expert() episode's off-policy turn).
    pub fn is_policy(&self) -> bool {
        !self.prefix && !self.off_policy
    }
}

/// An episode while it runs: its env, the history the prompt shows, and
/// the record being built.
pub(super) struct Live<'a> {
    pub(super) req: EpisodeRequest<'a>,
    pub(super) env: Box<dyn Env>,
    pub(super) history: Vec<Step>,
    pub(super) observation: String,
    /// The env's status line for `observation` (kept for the history).
    pub(super) status: String,
    pub(super) admissible: Vec<String>,
    pub(super) plan: Vec<String>,
    pub(super) ep: Episode,
    pub(super) done: bool,
}

impl<'a> Live<'a> {
    /// A fresh episode for `req` in `env` (not reset yet); the plan is the
    /// first `req.spec.plan` expert actions.
    pub(super) fn new(req: EpisodeRequest<'a>, env: Box<dyn Env>) -> Self {
        let expert = &req.task.expert;
        Live {
            plan: expert[..req.spec.plan.min(expert.len())].to_vec(),
            ep: Episode {
                task_id: req.task.id.clone(),
                spec: req.spec,
                ..Default::default()
            },
            req,
            env,
            history: Vec::new(),
            observation: String::new(),
            status: String::new(),
            admissible: Vec::new(),
            done: false,
        }
    }

    /// The episode for `req` in a fresh env from `make_env`, not reset yet
    /// ([`Live::begin`] starts it).
    pub(super) fn with_env(
        req: &EpisodeRequest<'a>,
        make_env: &dyn Fn(usize) -> Box<dyn Env>,
        opts: &RolloutOptions,
    ) -> Self {
        // An expert() episode replays the whole trajectory: its limit
        // counts every expert action as executed.
        let executed = if req.spec.expert {
            req.task.expert.len()
        } else {
            req.spec.prefix
        };
        let len = req.task.budget_len().unwrap_or(opts.max_steps);
        let env = make_env(opts.env_limit(len, executed));
        Live::new(req.clone(), env)
    }

    /// Start the episode: reset the env to the task, then the executed
    /// expert prefix (or, for an `expert()` episode, the whole expert
    /// trajectory). An env failure ends the episode, not the call.
    pub(super) fn begin(
        &mut self,
        fmt: &Fmt<'_>,
        opts: &RolloutOptions,
    ) -> Result<(), RolloutError> {
        let l = self;
        let req = l.req.clone();
        match l.env.reset(req.task) {
            Ok(obs) => {
                l.observation = obs.text;
                l.status = l.env.status();
                l.admissible = obs.admissible;
                l.done = obs.done;
            }
            Err(e) => {
                l.fail(e);
                return Ok(());
            }
        }
        l.execute_prefix(fmt, opts)?;
        Ok(())
    }

    /// Executed expert prefix: the env runs the actions, they enter the
    /// history, and each is recorded (for the auxiliary NLL only). An
    /// expert() episode is the whole trajectory, recorded as off-policy
    /// turns (LUFFY), and ends with it.
    fn execute_prefix(&mut self, fmt: &Fmt<'_>, opts: &RolloutOptions) -> Result<(), ModelError> {
        let task = self.req.task;
        let expert_ep = self.req.spec.expert;
        let n_exec = if expert_ep {
            task.expert.len()
        } else {
            self.req.spec.prefix
        };
        for a in task.expert.iter().take(n_exec) {
            // Panels can carry actions the env does not know (a stale or
            // foreign expert): never execute or train on them.
            if !self.admissible.is_empty() && !self.admissible.contains(a) {
                self.ep.expert_inadmissible = Some(a.clone());
                break;
            }
            // Its tokens would hold the unknown token: the env still gets
            // the action as written, but no loss may train on it.
            let unknown = fmt.unencodable(a);
            let trainable = unknown.is_empty();
            if !trainable {
                self.ep.unencodable.push((a.clone(), unknown));
            }
            let record = if trainable && (opts.record_prefix || expert_ep) {
                let prompt_ids = self.prompt(fmt, &self.plan, opts)?;
                let mut action_ids = fmt.action_ids(a)?;
                action_ids.push(fmt.stop);
                Some((prompt_ids, action_ids, self.state()))
            } else {
                None
            };
            match self.env.step(a) {
                Ok(obs) => {
                    if !expert_ep {
                        self.ep.prefix_executed += 1;
                    }
                    if let Some((prompt_ids, action_ids, state)) = record {
                        self.ep.turns.push(Turn {
                            prompt_ids,
                            unguided_prompt_ids: None,
                            action_ids,
                            logprobs: Vec::new(),
                            prefix: !expert_ep,
                            off_policy: expert_ep,
                            valid: obs.valid,
                            action: a.clone(),
                            unencodable: false,
                            state,
                            // Only the prefix step that ends the episode
                            // counts (below).
                            reward: if obs.done { f64::from(obs.reward) } else { 0.0 },
                        });
                    }
                    self.advance(a.clone(), obs.text, obs.admissible);
                    if obs.done {
                        self.ep.success = obs.success;
                        self.ep.reward += f64::from(obs.reward);
                        self.done = true;
                        break;
                    }
                }
                Err(e) => {
                    self.fail(e);
                    break;
                }
            }
        }
        if expert_ep {
            self.done = true;
        }
        Ok(())
    }

    /// `action` was taken and the env answered `text` with `admissible`:
    /// the old observation and the action enter the history.
    pub(super) fn advance(&mut self, action: String, text: String, admissible: Vec<String>) {
        let observation = std::mem::replace(&mut self.observation, text);
        let status = std::mem::replace(&mut self.status, self.env.status());
        let admissible = std::mem::replace(&mut self.admissible, admissible);
        self.history.push(Step {
            observation,
            action,
            status,
            admissible,
        });
    }

    /// The current state's anchor text ([`state_text`]).
    pub(super) fn state(&self) -> String {
        state_text(&self.env.status(), &self.observation)
    }

    /// Prompt token ids of the current state with `plan` shown, laid out
    /// as `opts` says (history window, action list, conversation).
    pub(super) fn prompt(
        &self,
        fmt: &Fmt<'_>,
        plan: &[String],
        opts: &RolloutOptions,
    ) -> Result<Vec<u32>, ModelError> {
        fmt.prompt(&PromptParts {
            goal: &self.req.task.goal,
            plan,
            history: &self.history,
            window: opts.history,
            status: &self.status,
            observation: &self.observation,
            admissible: &self.admissible,
            show_actions: opts.show_actions,
            conversation: opts.conversation,
        })
    }

    /// The reference's next action after the longest prefix of it this
    /// episode has followed.
    pub(super) fn expert_next(&self) -> (usize, String) {
        let expert = &self.req.task.expert;
        let m = expert
            .iter()
            .zip(&self.history)
            .take_while(|(e, h)| *e == &h.action)
            .count();
        (m, expert.get(m).cloned().unwrap_or_default())
    }

    pub(super) fn fail(&mut self, e: EnvError) {
        self.ep.error = Some(e.to_string());
        self.done = true;
    }

    /// This turn was generated at policy `version` (on an engine).
    pub(super) fn generated_at(&mut self, version: u64) {
        let v = &mut self.ep.policy_version;
        *v = Some(v.map_or(version, |o| o.min(version)));
    }

    /// The engine failed this turn's generation: the episode ends as a
    /// failure and, like an env failure, stays out of the learning signal.
    pub(super) fn fail_engine(&mut self, why: String) {
        self.ep.error = Some(why);
        self.ep.engine_failed = true;
        self.done = true;
    }

    /// The finished record: the reference match and every action taken.
    pub(super) fn finish(self) -> Episode {
        let (m, _) = self.expert_next();
        let mut ep = self.ep;
        ep.expert_match = m;
        ep.actions = self.history.into_iter().map(|h| h.action).collect();
        ep
    }
}
