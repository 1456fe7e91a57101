//! One policy turn of a live episode: the view an intervention script
//! sees, the prompts the turn is generated and trained under, and applying
//! the generated answer (decode, env step, record).

use crate::guidance::runtime::{Intervention, TurnView};
use crate::model::{Generated, ModelError, Tok, TokenTrie};

use super::encode::Fmt;
use super::episode::{Live, Turn};
use super::RolloutOptions;

impl Live<'_> {
    /// What an intervention script sees before this episode's next policy
    /// turn.
    pub(super) fn turn_view(&self) -> TurnView {
        let streak = self
            .ep
            .turns
            .iter()
            .rev()
            .take_while(|t| !t.prefix && !t.valid)
            .count();
        let (_, next) = self.expert_next();
        TurnView {
            task_id: self.req.task.id.clone(),
            turn: self.ep.policy_turns as i64,
            invalid_streak: streak as i64,
            invalid: self.ep.invalid as i64,
            last_action: self
                .history
                .last()
                .map(|h| h.action.clone())
                .unwrap_or_default(),
            observation: self.observation.clone(),
            expert_next: next,
            expert_len: self.req.task.expert.len() as i64,
            prefix: self.req.spec.prefix as i64,
            plan_k: self.req.spec.plan as i64,
        }
    }

    /// Ask the intervention for this turn: the hint to show, if any (a
    /// stop ends the episode).
    pub(super) fn intervene(
        &mut self,
        f: &mut dyn FnMut(&TurnView) -> Intervention,
    ) -> Option<String> {
        match f(&self.turn_view()) {
            Intervention::Nothing => None,
            Intervention::Hint(h) => {
                self.ep.hints += 1;
                Some(h)
            }
            Intervention::Stop => {
                self.ep.stopped = true;
                self.done = true;
                None
            }
        }
    }

    /// The turn's prompts: the one generated under (plan or hint shown)
    /// and, when guided, the same state without the guidance. A hint takes
    /// the plan's place for this turn.
    pub(super) fn turn_prompts(
        &self,
        hint: Option<&String>,
        fmt: &Fmt<'_>,
        opts: &RolloutOptions,
    ) -> Result<(Vec<u32>, Option<Vec<u32>>), ModelError> {
        let hint: Vec<String> = hint.into_iter().cloned().collect();
        let shown: &[String] = if hint.is_empty() { &self.plan } else { &hint };
        let guided = !shown.is_empty();
        let prompt = self.prompt(fmt, shown, opts)?;
        let unguided = if guided {
            Some(self.prompt(fmt, &[], opts)?)
        } else {
            None
        };
        Ok((prompt, unguided))
    }

    /// The token trie of the admissible actions (constrained decoding).
    pub(super) fn action_trie(&self, fmt: &Fmt<'_>) -> Result<TokenTrie, ModelError> {
        let acts = self
            .admissible
            .iter()
            .map(|a| fmt.action_ids(a))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(TokenTrie::new(&acts, fmt.stop))
    }

    /// Apply the generated answer `g` to the turn prompted by `prompt`
    /// (`unguided`: the same without guidance): read the action, record the
    /// turn (with the invalid-action penalty), and step the env.
    pub(super) fn apply(
        &mut self,
        g: Generated,
        prompt: Vec<u32>,
        unguided: Option<Vec<u32>>,
        fmt: &Fmt<'_>,
        tok: &Tok,
        opts: &RolloutOptions,
    ) -> Result<(), ModelError> {
        let body: Vec<u32> = g
            .tokens
            .iter()
            .copied()
            .filter(|&t| t != fmt.stop)
            .collect();
        let text = tok.decode(&body)?;
        let (valid, action) = fmt.read(&text, &self.admissible);
        let unk = fmt.holds_unk(&body);
        if let Some(t) = unk {
            self.ep
                .unencodable
                .push((action.clone(), vec![t.to_string()]));
        }
        self.ep.turns.push(Turn {
            prompt_ids: prompt,
            unguided_prompt_ids: unguided,
            // A truncated output (no EOS) is still trained on as is.
            action_ids: g.tokens,
            logprobs: g.logprobs,
            prefix: false,
            off_policy: false,
            valid,
            action: action.clone(),
            unencodable: unk.is_some(),
            state: self.state(),
            reward: 0.0,
        });
        self.ep.policy_turns += 1;
        if !valid {
            self.ep.invalid += 1;
            self.ep.reward += opts.invalid_penalty;
            self.turn_reward(opts.invalid_penalty);
        }
        match self.env.step(&action) {
            Ok(obs) => {
                self.ep.reward += f64::from(obs.reward);
                self.turn_reward(f64::from(obs.reward));
                if !obs.info.is_empty() {
                    self.ep.info = obs.info;
                }
                self.advance(action, obs.text, obs.admissible);
                if obs.done {
                    self.ep.success = obs.success;
                    self.done = true;
                }
            }
            Err(e) => self.fail(e),
        }
        Ok(())
    }

    /// Book `r`, just added to the episode's reward, to its last turn.
    fn turn_reward(&mut self, r: f64) {
        if let Some(t) = self.ep.turns.last_mut() {
            t.reward += r;
        }
    }
}
