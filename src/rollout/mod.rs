//! Episode runner: many episodes at once, turn by turn, with generation
//! batched across every live episode; guidance applied (executed expert
//! prefixes, plans in the prompt); per-turn token records out.

pub mod prompt;

use std::time::Instant;

use rand_chacha::ChaCha8Rng;

use crate::env::{Env, EnvError, Task};
use crate::guidance::ResolvedSpec;
use crate::model::{GenerateOptions, ModelError, Policy, Tok, TokenTrie};
use prompt::{project, render, PromptParts, Step};

/// Rollout settings (from the experiment's `rollout` section).
#[derive(Debug, Clone)]
pub struct RolloutOptions {
    pub temperature: f64,
    pub top_p: f64,
    pub greedy: bool,
    pub constrained: bool,
    pub history: usize,
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

/// One episode to run.
#[derive(Debug, Clone)]
pub struct EpisodeRequest<'a> {
    pub task: &'a Task,
    pub spec: ResolvedSpec,
}

/// One turn of an episode, with everything the trainer needs.
#[derive(Debug, Clone, PartialEq)]
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
    /// The action matched an admissible action.
    pub valid: bool,
    pub action: String,
}

/// A finished episode.
#[derive(Debug, Clone, PartialEq)]
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
    /// Set when the env failed; the episode counts as a failure.
    pub error: Option<String>,
}

/// Throughput counters of one `run` call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RolloutStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub generate_calls: usize,
    pub seconds: f64,
}

/// Errors of the runner (model failures; env failures end one episode).
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error(transparent)]
    Model(#[from] ModelError),
}

struct Live<'a> {
    req: EpisodeRequest<'a>,
    env: Box<dyn Env>,
    history: Vec<Step>,
    observation: String,
    admissible: Vec<String>,
    plan: Vec<String>,
    ep: Episode,
    done: bool,
}

impl Live<'_> {
    fn render(&self, with_plan: bool, window: usize, show_actions: bool) -> String {
        render(&PromptParts {
            goal: &self.req.task.goal,
            plan: if with_plan { &self.plan } else { &[] },
            history: &self.history,
            window,
            status: &self.env.status(),
            observation: &self.observation,
            admissible: &self.admissible,
            show_actions,
        })
    }

    fn fail(&mut self, e: EnvError) {
        self.ep.error = Some(e.to_string());
        self.done = true;
    }
}

/// Token ids of a prompt: BOS + text, left-truncated to `max_len`.
fn encode_prompt(
    tok: &Tok,
    bos: Option<u32>,
    text: &str,
    max_len: usize,
) -> Result<Vec<u32>, ModelError> {
    let mut ids = Vec::with_capacity(256);
    ids.extend(bos);
    ids.extend(tok.encode(text)?);
    if ids.len() > max_len {
        // Keep the end: status, observation and actions matter most.
        let cut = ids.len() - max_len;
        ids.drain(bos.map_or(0, |_| 1)..bos.map_or(0, |_| 1) + cut);
    }
    Ok(ids)
}

/// Run all `requests` to completion. `make_env(limit)` builds a fresh env
/// per episode with that step limit (see [`RolloutOptions::env_limit`]).
/// Generation is one batch over every live episode per turn.
pub fn run(
    policy: &Policy,
    tok: &Tok,
    make_env: &dyn Fn(usize) -> Box<dyn Env>,
    requests: &[EpisodeRequest<'_>],
    opts: &RolloutOptions,
    rng: &mut ChaCha8Rng,
) -> Result<(Vec<Episode>, RolloutStats), RolloutError> {
    let t0 = Instant::now();
    let cfg = policy.config();
    let eos = cfg.eos_token_id.unwrap_or(0);
    let bos = cfg.bos_token_id;
    let max_prompt = cfg
        .max_position_embeddings
        .saturating_sub(opts.max_action_tokens + 1)
        .max(8);
    let mut stats = RolloutStats::default();
    let mut live: Vec<Live> = Vec::with_capacity(requests.len());
    for req in requests {
        let env = make_env(opts.env_limit(req.task.expert.len(), req.spec.prefix));
        let ep = Episode {
            task_id: req.task.id.clone(),
            spec: req.spec,
            turns: Vec::new(),
            success: false,
            reward: 0.0,
            invalid: 0,
            policy_turns: 0,
            error: None,
        };
        let mut l = Live {
            req: req.clone(),
            env,
            history: Vec::new(),
            observation: String::new(),
            admissible: Vec::new(),
            plan: req.task.expert[..req.spec.plan.min(req.task.expert.len())].to_vec(),
            ep,
            done: false,
        };
        match l.env.reset(req.task) {
            Ok(obs) => {
                l.observation = obs.text;
                l.admissible = obs.admissible;
                l.done = obs.done;
            }
            Err(e) => {
                l.fail(e);
                live.push(l);
                continue;
            }
        }
        // Executed expert prefix: the env runs the actions, they enter the
        // history, and each is recorded (for the auxiliary NLL only).
        for a in req.task.expert.iter().take(req.spec.prefix) {
            // Token records of prefix turns serve only the auxiliary NLL.
            let record = if opts.record_prefix {
                let text = l.render(!l.plan.is_empty(), opts.history, opts.show_actions);
                let mut action_ids = tok.encode(a)?;
                action_ids.push(eos);
                Some((encode_prompt(tok, bos, &text, max_prompt)?, action_ids))
            } else {
                None
            };
            match l.env.step(a) {
                Ok(obs) => {
                    if let Some((prompt_ids, action_ids)) = record {
                        l.ep.turns.push(Turn {
                            prompt_ids,
                            unguided_prompt_ids: None,
                            action_ids,
                            logprobs: Vec::new(),
                            prefix: true,
                            valid: obs.valid,
                            action: a.clone(),
                        });
                    }
                    let before = std::mem::replace(&mut l.observation, obs.text);
                    l.history.push(Step {
                        observation: before,
                        action: a.clone(),
                    });
                    l.admissible = obs.admissible;
                    if obs.done {
                        l.ep.success = obs.success;
                        l.ep.reward += f64::from(obs.reward);
                        l.done = true;
                        break;
                    }
                }
                Err(e) => {
                    l.fail(e);
                    break;
                }
            }
        }
        live.push(l);
    }

    let gen_opts = GenerateOptions {
        max_new_tokens: opts.max_action_tokens,
        temperature: opts.temperature,
        top_p: opts.top_p,
        greedy: opts.greedy,
        eos_token_id: eos,
    };
    loop {
        let idx: Vec<usize> = (0..live.len()).filter(|&i| !live[i].done).collect();
        if idx.is_empty() {
            break;
        }
        let mut prompts = Vec::with_capacity(idx.len());
        let mut unguided = Vec::with_capacity(idx.len());
        let mut tries = Vec::with_capacity(idx.len());
        for &i in &idx {
            let l = &live[i];
            let guided = !l.plan.is_empty();
            prompts.push(encode_prompt(
                tok,
                bos,
                &l.render(guided, opts.history, opts.show_actions),
                max_prompt,
            )?);
            unguided.push(if guided {
                Some(encode_prompt(
                    tok,
                    bos,
                    &l.render(false, opts.history, opts.show_actions),
                    max_prompt,
                )?)
            } else {
                None
            });
            if opts.constrained {
                let acts = l
                    .admissible
                    .iter()
                    .map(|a| tok.encode(a))
                    .collect::<Result<Vec<_>, _>>()?;
                tries.push(TokenTrie::new(&acts, eos));
            }
        }
        stats.prompt_tokens += prompts.iter().map(Vec::len).sum::<usize>();
        let gens = policy.generate(
            &prompts,
            &gen_opts,
            if opts.constrained { Some(&tries) } else { None },
            rng,
        )?;
        stats.generate_calls += 1;
        for ((&i, g), (p, u)) in idx.iter().zip(gens).zip(prompts.into_iter().zip(unguided)) {
            stats.generated_tokens += g.tokens.len();
            let l = &mut live[i];
            let body: Vec<u32> = g.tokens.iter().copied().filter(|&t| t != eos).collect();
            let text = tok.decode(&body)?;
            let matched = project(&text, &l.admissible).cloned();
            let valid = matched.is_some();
            let action = matched.unwrap_or_else(|| text.clone());
            l.ep.turns.push(Turn {
                prompt_ids: p,
                unguided_prompt_ids: u,
                // A truncated output (no EOS) is still trained on as is.
                action_ids: g.tokens,
                logprobs: g.logprobs,
                prefix: false,
                valid,
                action: action.clone(),
            });
            l.ep.policy_turns += 1;
            if !valid {
                l.ep.invalid += 1;
                l.ep.reward += opts.invalid_penalty;
            }
            match l.env.step(&action) {
                Ok(obs) => {
                    l.ep.reward += f64::from(obs.reward);
                    let before = std::mem::replace(&mut l.observation, obs.text);
                    l.history.push(Step {
                        observation: before,
                        action,
                    });
                    l.admissible = obs.admissible;
                    if obs.done {
                        l.ep.success = obs.success;
                        l.done = true;
                    }
                }
                Err(e) => l.fail(e),
            }
        }
    }
    stats.seconds = t0.elapsed().as_secs_f64();
    Ok((live.into_iter().map(|l| l.ep).collect(), stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(max_steps: usize, step_slack: Option<usize>) -> RolloutOptions {
        RolloutOptions {
            temperature: 1.0,
            top_p: 1.0,
            greedy: false,
            constrained: true,
            history: 1,
            invalid_penalty: 0.0,
            max_action_tokens: 8,
            show_actions: true,
            record_prefix: false,
            max_steps,
            step_slack,
        }
    }

    #[test]
    fn env_limit_counts_policy_actions_on_top_of_the_prefix() {
        assert_eq!(opts(8, None).env_limit(6, 0), 8);
        assert_eq!(opts(8, None).env_limit(6, 4), 12);
        // With slack: expert actions left + slack, capped by max_steps.
        assert_eq!(opts(8, Some(2)).env_limit(6, 4), 4 + 4);
        assert_eq!(opts(8, Some(2)).env_limit(10, 0), 8);
        assert_eq!(opts(8, Some(0)).env_limit(3, 3), 3 + 1);
    }
}
