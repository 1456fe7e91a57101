//! Episode runner: many episodes at once, turn by turn, with generation
//! batched across every live episode; guidance applied (executed expert
//! prefixes, plans in the prompt); per-turn token records out.

pub mod chat;
pub mod prompt;

use std::time::Instant;

use rand_chacha::ChaCha8Rng;

use crate::env::{Env, EnvError, Task};
use crate::guidance::host::{Intervention, TurnView};
use crate::guidance::ResolvedSpec;
use crate::model::{GenerateOptions, ModelError, Policy, Tok, TokenTrie};
use chat::{ChatError, ChatTemplate, PromptFormat};
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
    /// Prompt and answer format (`rollout.format`).
    pub format: PromptFormat,
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
    /// A turn of an `expert()` episode: the expert's action, trained as an
    /// off-policy sample (LUFFY).
    pub off_policy: bool,
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
    /// Turns an intervention script hinted, and whether it stopped the
    /// episode.
    pub hints: usize,
    pub stopped: bool,
    /// Every action taken, executed prefix included.
    pub actions: Vec<String>,
    /// How many reference actions the episode reproduced in order from the
    /// start (executed prefix included).
    pub expert_match: usize,
    /// The env's numeric extras from the episode's last observation.
    pub info: std::collections::BTreeMap<String, f64>,
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
    /// Only where no episode can absorb it (diagnostics walking the expert
    /// trajectory); in `run`, an env failure ends one episode.
    #[error("env: {0}")]
    Env(String),
    /// The tokenizer does not fit the chat format.
    #[error("rollout.format: {0}")]
    Chat(#[from] ChatError),
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

impl<'a> Live<'a> {
    /// A fresh episode for `req` in `env` (not reset yet); the plan is the
    /// first `req.spec.plan` expert actions.
    fn new(req: EpisodeRequest<'a>, env: Box<dyn Env>) -> Self {
        let expert = &req.task.expert;
        Live {
            plan: expert[..req.spec.plan.min(expert.len())].to_vec(),
            ep: Episode {
                task_id: req.task.id.clone(),
                spec: req.spec,
                turns: Vec::new(),
                success: false,
                reward: 0.0,
                invalid: 0,
                policy_turns: 0,
                error: None,
                hints: 0,
                stopped: false,
                actions: Vec::new(),
                expert_match: 0,
                info: Default::default(),
            },
            req,
            env,
            history: Vec::new(),
            observation: String::new(),
            admissible: Vec::new(),
            done: false,
        }
    }

    /// `action` was taken and the env answered `text` with `admissible`:
    /// the old observation and the action enter the history.
    fn advance(&mut self, action: String, text: String, admissible: Vec<String>) {
        let before = std::mem::replace(&mut self.observation, text);
        self.history.push(Step {
            observation: before,
            action,
        });
        self.admissible = admissible;
    }

    /// Prompt token ids of the current state with `plan` shown.
    fn prompt(
        &self,
        fmt: &Fmt<'_>,
        plan: &[String],
        window: usize,
        show_actions: bool,
    ) -> Result<Vec<u32>, ModelError> {
        fmt.prompt(&PromptParts {
            goal: &self.req.task.goal,
            plan,
            history: &self.history,
            window,
            status: &self.env.status(),
            observation: &self.observation,
            admissible: &self.admissible,
            show_actions,
        })
    }

    /// The reference's next action after the longest prefix of it this
    /// episode has followed.
    fn expert_next(&self) -> (usize, String) {
        let expert = &self.req.task.expert;
        let m = expert
            .iter()
            .zip(&self.history)
            .take_while(|(e, h)| *e == &h.action)
            .count();
        (m, expert.get(m).cloned().unwrap_or_default())
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

/// Drop tokens after the first `keep` until `ids` fits in `max_len`
/// (keeping the end: status, observation and actions matter most).
fn truncate_left(ids: &mut Vec<u32>, keep: usize, max_len: usize) {
    if ids.len() > max_len {
        let cut = ids.len() - max_len;
        let keep = keep.min(ids.len() - cut);
        ids.drain(keep..keep + cut);
    }
}

/// How prompts are encoded and answers read under the rollout format.
struct Fmt<'t> {
    tok: &'t Tok,
    bos: Option<u32>,
    max_prompt: usize,
    /// `Some` in the chat format.
    chat: Option<ChatTemplate>,
    /// Ends an answer: the model's eos (plain) or the template's
    /// end-of-turn token (chat).
    stop: u32,
}

impl<'t> Fmt<'t> {
    fn new(policy: &Policy, tok: &'t Tok, opts: &RolloutOptions) -> Result<Self, RolloutError> {
        let cfg = policy.config();
        let max_prompt = cfg
            .max_position_embeddings
            .saturating_sub(opts.max_action_tokens + 1)
            .max(8);
        let eos = cfg.eos_token_id.unwrap_or(0);
        let (chat, stop) = match opts.format {
            PromptFormat::Plain => (None, eos),
            PromptFormat::Chat(explicit) => {
                let t = match explicit {
                    Some(t) => {
                        t.check(tok)?;
                        t
                    }
                    None => ChatTemplate::detect(tok)?,
                };
                (Some(t), t.stop_id(tok)?)
            }
        };
        Ok(Fmt {
            tok,
            bos: cfg.bos_token_id,
            max_prompt,
            chat,
            stop,
        })
    }

    /// Prompt token ids. Plain: BOS + the word-level prompt. Chat: the
    /// rendered template (its special tokens encode as single ids; it
    /// carries its own BOS where the template has one).
    fn prompt(&self, parts: &PromptParts) -> Result<Vec<u32>, ModelError> {
        match self.chat {
            None => encode_prompt(self.tok, self.bos, &render(parts), self.max_prompt),
            Some(t) => {
                let mut ids = self.tok.encode(&chat::render_agent(t, parts))?;
                truncate_left(&mut ids, t.keep_prefix_tokens(), self.max_prompt);
                Ok(ids)
            }
        }
    }

    /// Tokens of a well-formed answer `a`, without the stop token.
    fn action_ids(&self, a: &str) -> Result<Vec<u32>, ModelError> {
        match self.chat {
            None => self.tok.encode(a),
            Some(_) => self.tok.encode(&chat::wrap_action(a)),
        }
    }

    /// Read the decoded answer: whether it is a valid action, and the
    /// action to send to the env. A chat-format violation is invalid and
    /// never executed: the env gets the raw text, marked if it happens to
    /// name an admissible action.
    fn read(&self, text: &str, admissible: &[String]) -> (bool, String) {
        let inner = match self.chat {
            None => text.to_string(),
            Some(_) => match chat::parse_action(text) {
                Ok(a) => a,
                Err(e) => {
                    let action = if project(text, admissible).is_some() {
                        format!("[{e}] {text}")
                    } else {
                        text.to_string()
                    };
                    return (false, action);
                }
            },
        };
        match project(&inner, admissible) {
            Some(a) => (true, a.clone()),
            None => (false, inner),
        }
    }
}

/// Called before each policy turn of each live episode.
pub type InterveneFn<'f> = &'f mut dyn FnMut(&TurnView) -> Intervention;

/// Run all `requests` to completion. `make_env(limit)` builds a fresh env
/// per episode with that step limit (see [`RolloutOptions::env_limit`]).
/// Generation is one batch over every live episode per turn. `expert()`
/// requests replay the expert trajectory and record it as off-policy turns.
pub fn run(
    policy: &Policy,
    tok: &Tok,
    make_env: &dyn Fn(usize) -> Box<dyn Env>,
    requests: &[EpisodeRequest<'_>],
    opts: &RolloutOptions,
    rng: &mut ChaCha8Rng,
    mut intervene: Option<InterveneFn<'_>>,
) -> Result<(Vec<Episode>, RolloutStats), RolloutError> {
    let t0 = Instant::now();
    let fmt = Fmt::new(policy, tok, opts)?;
    let eos = fmt.stop;
    let mut stats = RolloutStats::default();
    let mut live: Vec<Live> = Vec::with_capacity(requests.len());
    for req in requests {
        // An expert() episode replays the whole trajectory: its limit
        // counts every expert action as executed.
        let executed = if req.spec.expert {
            req.task.expert.len()
        } else {
            req.spec.prefix
        };
        let env = make_env(opts.env_limit(req.task.expert.len(), executed));
        let mut l = Live::new(req.clone(), env);
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
        // history, and each is recorded (for the auxiliary NLL only). An
        // expert() episode is the whole trajectory, recorded as off-policy
        // turns (LUFFY).
        let expert_ep = req.spec.expert;
        let n_exec = if expert_ep {
            req.task.expert.len()
        } else {
            req.spec.prefix
        };
        for a in req.task.expert.iter().take(n_exec) {
            let record = if opts.record_prefix || expert_ep {
                let prompt_ids = l.prompt(&fmt, &l.plan, opts.history, opts.show_actions)?;
                let mut action_ids = fmt.action_ids(a)?;
                action_ids.push(eos);
                Some((prompt_ids, action_ids))
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
                            prefix: !expert_ep,
                            off_policy: expert_ep,
                            valid: obs.valid,
                            action: a.clone(),
                        });
                    }
                    l.advance(a.clone(), obs.text, obs.admissible);
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
        if expert_ep {
            l.done = true;
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
        // Interventions: a hint for this turn, or the end of the episode.
        let mut hints: Vec<Option<String>> = vec![None; live.len()];
        if let Some(f) = intervene.as_mut() {
            for (i, l) in live.iter_mut().enumerate() {
                if l.done {
                    continue;
                }
                let streak =
                    l.ep.turns
                        .iter()
                        .rev()
                        .take_while(|t| !t.prefix && !t.valid)
                        .count();
                let (_, next) = l.expert_next();
                let view = TurnView {
                    task_id: l.req.task.id.clone(),
                    turn: l.ep.policy_turns as i64,
                    invalid_streak: streak as i64,
                    invalid: l.ep.invalid as i64,
                    last_action: l
                        .history
                        .last()
                        .map(|h| h.action.clone())
                        .unwrap_or_default(),
                    observation: l.observation.clone(),
                    expert_next: next,
                    expert_len: l.req.task.expert.len() as i64,
                    prefix: l.req.spec.prefix as i64,
                    plan_k: l.req.spec.plan as i64,
                };
                match f(&view) {
                    Intervention::Nothing => {}
                    Intervention::Hint(h) => {
                        hints[i] = Some(h);
                        l.ep.hints += 1;
                    }
                    Intervention::Stop => {
                        l.ep.stopped = true;
                        l.done = true;
                    }
                }
            }
        }
        let idx: Vec<usize> = (0..live.len()).filter(|&i| !live[i].done).collect();
        if idx.is_empty() {
            break;
        }
        let mut prompts = Vec::with_capacity(idx.len());
        let mut unguided = Vec::with_capacity(idx.len());
        let mut tries = Vec::with_capacity(idx.len());
        for &i in &idx {
            let l = &live[i];
            // A hint takes the plan's place for this turn.
            let hint: Vec<String> = hints[i].iter().cloned().collect();
            let shown: &[String] = if hint.is_empty() { &l.plan } else { &hint };
            let guided = !shown.is_empty();
            prompts.push(l.prompt(&fmt, shown, opts.history, opts.show_actions)?);
            unguided.push(if guided {
                Some(l.prompt(&fmt, &[], opts.history, opts.show_actions)?)
            } else {
                None
            });
            if opts.constrained {
                let acts = l
                    .admissible
                    .iter()
                    .map(|a| fmt.action_ids(a))
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
            let (valid, action) = fmt.read(&text, &l.admissible);
            l.ep.turns.push(Turn {
                prompt_ids: p,
                unguided_prompt_ids: u,
                // A truncated output (no EOS) is still trained on as is.
                action_ids: g.tokens,
                logprobs: g.logprobs,
                prefix: false,
                off_policy: false,
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
                    if !obs.info.is_empty() {
                        l.ep.info = obs.info;
                    }
                    l.advance(action, obs.text, obs.admissible);
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
    let eps = live
        .into_iter()
        .map(|l| {
            let (m, _) = l.expert_next();
            let mut ep = l.ep;
            ep.expert_match = m;
            ep.actions = l.history.into_iter().map(|h| h.action).collect();
            ep
        })
        .collect();
    Ok((eps, stats))
}

/// The guided and unguided prompts of one state along the expert
/// trajectory.
#[derive(Debug, Clone, PartialEq)]
pub struct StatePrompts {
    /// Expert actions executed before this state.
    pub depth: usize,
    /// The expert action taken from this state.
    pub next_action: String,
    /// With the first `plan_k` expert actions shown as the plan.
    pub guided: Vec<u32>,
    /// The same state without the plan.
    pub unguided: Vec<u32>,
}

/// Walk the task's expert trajectory in a fresh env and return, for each
/// state s_t (t = 0 .. L−1, after t expert actions), the prompt the policy
/// would see there with the first `plan_k` expert actions as a plan, and
/// without: the states of a guided rollout that follows its plan
/// (ActGuide-RL's diagnostics, Fig. 3). Stops early if the env ends the
/// episode before the last expert action.
pub fn expert_state_prompts(
    policy: &Policy,
    tok: &Tok,
    make_env: &dyn Fn(usize) -> Box<dyn Env>,
    task: &Task,
    plan_k: usize,
    opts: &RolloutOptions,
) -> Result<Vec<StatePrompts>, RolloutError> {
    let fmt = Fmt::new(policy, tok, opts)?;
    let l_exp = task.expert.len();
    let env = make_env(opts.env_limit(l_exp, l_exp));
    let req = EpisodeRequest {
        task,
        spec: ResolvedSpec {
            plan: plan_k,
            ..ResolvedSpec::default()
        },
    };
    let mut l = Live::new(req, env);
    let mut out = Vec::with_capacity(l_exp);
    let obs = l
        .env
        .reset(task)
        .map_err(|e| RolloutError::Env(e.to_string()))?;
    l.observation = obs.text;
    l.admissible = obs.admissible;
    let mut done = obs.done;
    for (t, a) in task.expert.iter().enumerate() {
        if done {
            break;
        }
        out.push(StatePrompts {
            depth: t,
            next_action: a.clone(),
            guided: l.prompt(&fmt, &l.plan, opts.history, opts.show_actions)?,
            unguided: l.prompt(&fmt, &[], opts.history, opts.show_actions)?,
        });
        let obs = l
            .env
            .step(a)
            .map_err(|e| RolloutError::Env(e.to_string()))?;
        done = obs.done;
        l.advance(a.clone(), obs.text, obs.admissible);
    }
    Ok(out)
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
            format: PromptFormat::Plain,
        }
    }

    /// A tiny random policy whose word-level tokenizer has the ChatML
    /// specials (and the tag pieces `<`, `</`, `>`, `action`, `think`).
    fn chat_setup() -> (Policy, Tok, Vec<Task>) {
        let mut words: Vec<String> = crate::env::household::vocabulary()
            .iter()
            .map(|w| w.to_lowercase())
            .collect();
        words.extend(["<", "</", ">", "action", "think"].map(String::from));
        words.sort();
        words.dedup();
        let tok = Tok::build_word_level(&words, &["[PAD]", "<|im_start|>", "<|im_end|>", "[EOS]"])
            .unwrap();
        let cfg = crate::tiny::tiny_config(tok.vocab_size());
        let policy = Policy::new_random(
            &cfg,
            &mut crate::seed::rng(7, &[1]),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let tasks = crate::env::panel::read_jsonl(&root.join("envs/household/test.jsonl")).unwrap();
        (policy, tok, tasks[..2].to_vec())
    }

    fn household(limit: usize) -> Box<dyn Env> {
        crate::env::make_env(
            &crate::env::EnvSpec::builtin(crate::env::BuiltinEnv::Household),
            limit,
        )
    }

    #[test]
    fn chat_format_violations_are_invalid_with_the_penalty() {
        let (policy, tok, tasks) = chat_setup();
        let stop = tok.token_id("<|im_end|>").unwrap();
        let o = RolloutOptions {
            constrained: false,
            // Too short for `< action > … </ action >`: every answer is a
            // format violation.
            max_action_tokens: 4,
            invalid_penalty: -0.25,
            format: PromptFormat::Chat(None),
            ..opts(3, None)
        };
        let reqs: Vec<EpisodeRequest> = tasks
            .iter()
            .map(|t| EpisodeRequest {
                task: t,
                spec: ResolvedSpec {
                    plan: 2,
                    ..Default::default()
                },
            })
            .collect();
        let mut rng = crate::seed::rng(7, &[2]);
        let (eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
        for ep in &eps {
            assert!(ep.error.is_none(), "{:?}", ep.error);
            assert_eq!(ep.policy_turns, 3);
            assert_eq!(ep.invalid, 3);
            assert!(!ep.success);
            assert!((ep.reward - 3.0 * -0.25).abs() < 1e-12, "{}", ep.reward);
            for t in &ep.turns {
                assert!(!t.valid);
                // The prompt is the rendered template: it starts with
                // `<|im_start|>` and ends with the assistant header.
                assert_eq!(t.prompt_ids[0], tok.token_id("<|im_start|>").unwrap());
                assert!(t.unguided_prompt_ids.is_some());
                assert!(t.action_ids.len() <= 4);
                assert!(t.action_ids[..t.action_ids.len() - 1]
                    .iter()
                    .all(|&x| x != stop));
            }
        }
        // A bare admissible action without tags is a violation too, and is
        // not executed.
        let fmt = Fmt::new(&policy, &tok, &o).unwrap();
        assert_eq!(fmt.stop, stop);
        let adm = vec!["look".to_string()];
        let (valid, action) = fmt.read("look", &adm);
        assert!(!valid);
        assert!(project(&action, &adm).is_none(), "{action}");
        assert_eq!(
            fmt.read("< action > look </ action >", &adm),
            (true, "look".to_string())
        );
        assert_eq!(
            fmt.read("<action>jump</action>", &adm),
            (false, "jump".to_string())
        );
    }

    #[test]
    fn chat_format_constrained_actions_are_executed() {
        let (policy, tok, tasks) = chat_setup();
        let stop = tok.token_id("<|im_end|>").unwrap();
        let o = RolloutOptions {
            max_action_tokens: 40,
            invalid_penalty: -0.25,
            record_prefix: true,
            format: PromptFormat::Chat(None),
            ..opts(3, None)
        };
        let reqs: Vec<EpisodeRequest> = tasks
            .iter()
            .map(|t| EpisodeRequest {
                task: t,
                spec: ResolvedSpec {
                    prefix: 1,
                    ..Default::default()
                },
            })
            .collect();
        let mut rng = crate::seed::rng(7, &[3]);
        let (eps, _) = run(&policy, &tok, &household, &reqs, &o, &mut rng, None).unwrap();
        for (ep, task) in eps.iter().zip(&tasks) {
            assert!(ep.error.is_none(), "{:?}", ep.error);
            assert_eq!(ep.invalid, 0);
            assert!(ep.policy_turns >= 1);
            // The executed prefix turn is recorded in the chat format.
            let first = &ep.turns[0];
            assert!(first.prefix);
            let mut want = tok
                .encode(&format!("<action>{}</action>", task.expert[0]))
                .unwrap();
            want.push(stop);
            assert_eq!(first.action_ids, want);
            for (t, a) in ep.turns.iter().zip(&ep.actions) {
                assert!(t.valid);
                assert_eq!(&t.action, a);
                assert_eq!(t.action_ids.last(), Some(&stop));
                let text = tok.decode(&t.action_ids).unwrap();
                assert_eq!(normalize_action(&text), prompt::normalize(a), "{text}");
            }
        }
        // No chat specials: a clear error.
        let plain = crate::tiny::tiny_tokenizer().unwrap();
        let e = run(&policy, &plain, &household, &reqs, &o, &mut rng, None).unwrap_err();
        assert!(e.to_string().contains("chat special tokens"), "{e}");
    }

    fn normalize_action(text: &str) -> String {
        prompt::normalize(&chat::parse_action(text).unwrap())
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
