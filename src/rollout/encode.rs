//! How prompts become token ids and answers become actions under the
//! rollout's prompt format (plain word-level prompts or a chat template).

use crate::model::{ModelError, Policy, Tok};

use super::chat::{self, ChatTemplate, PromptFormat};
use super::prompt::{project, render, PromptParts};
use super::{RolloutError, RolloutOptions};

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
pub(super) struct Fmt<'t> {
    tok: &'t Tok,
    bos: Option<u32>,
    max_prompt: usize,
    /// `Some` in the chat format.
    chat: Option<ChatTemplate>,
    /// Ends an answer: the model's eos (plain) or the template's
    /// end-of-turn token (chat).
    pub(super) stop: u32,
    /// The tokenizer's unknown token (`[UNK]`, `<unk>`), if it has one:
    /// decoding drops it, so an answer holding it reaches the env cut
    /// short.
    unk: Option<(u32, &'static str)>,
}

impl<'t> Fmt<'t> {
    pub(super) fn new(
        policy: &Policy,
        tok: &'t Tok,
        opts: &RolloutOptions,
    ) -> Result<Self, RolloutError> {
        let cfg = policy.config();
        let max_prompt = cfg
            .max_position_embeddings
            .saturating_sub(opts.max_action_tokens + 1)
            .max(8);
        let (chat, stop) = match opts.format {
            // Answers end at the model's eos: without one, none would end.
            PromptFormat::Plain => (None, cfg.eos_token_id.ok_or(RolloutError::NoEos)?),
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
            unk: ["[UNK]", "<unk>"]
                .into_iter()
                .find_map(|t| Some((tok.token_id(t)?, t))),
        })
    }

    /// Words of the action `a` the tokenizer cannot encode (empty when it
    /// round-trips).
    pub(super) fn unencodable(&self, a: &str) -> Vec<String> {
        self.tok.unencodable_words([a])
    }

    /// The unknown token's name, when generated tokens hold it.
    pub(super) fn holds_unk(&self, ids: &[u32]) -> Option<&'static str> {
        self.unk.filter(|(u, _)| ids.contains(u)).map(|(_, t)| t)
    }

    /// Prompt token ids. Plain: BOS + the word-level prompt. Chat: the
    /// rendered template (its special tokens encode as single ids; it
    /// carries its own BOS where the template has one).
    pub(super) fn prompt(&self, parts: &PromptParts) -> Result<Vec<u32>, ModelError> {
        match self.chat {
            None => encode_prompt(self.tok, self.bos, &render(parts), self.max_prompt),
            Some(t) => {
                let mut ids = self.tok.encode(&chat::render_agent(t, parts))?;
                truncate_left(&mut ids, t.keep_prefix_tokens(), self.max_prompt);
                Ok(ids)
            }
        }
    }

    /// The text of a well-formed answer `a`, without the stop token (what
    /// an engine's constraint allows).
    pub(super) fn answer_text(&self, a: &str) -> String {
        match self.chat {
            None => a.to_string(),
            Some(_) => chat::wrap_action(a),
        }
    }

    /// Tokens of a well-formed answer `a`, without the stop token.
    pub(super) fn action_ids(&self, a: &str) -> Result<Vec<u32>, ModelError> {
        match self.chat {
            None => self.tok.encode(a),
            Some(_) => self.tok.encode(&chat::wrap_action(a)),
        }
    }

    /// Read the decoded answer: whether it is a valid action, and the
    /// action to send to the env. A chat-format violation is invalid and
    /// never executed: the env gets the raw text, marked if it happens to
    /// name an admissible action.
    pub(super) fn read(&self, text: &str, admissible: &[String]) -> (bool, String) {
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
