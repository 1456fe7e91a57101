//! Chat-template prompts and the `<action>…</action>` answer format for real
//! (instruction-tuned) models.
//!
//! The templates are rendered in Rust, reproducing what the models' Jinja
//! `chat_template`s produce (the Jinja itself is never run):
//!
//! * ChatML (Qwen2.5, SmolLM2): `<|im_start|>{role}\n{content}<|im_end|>\n`
//!   per message, then `<|im_start|>assistant\n` as the generation prompt.
//!   Both templates insert a default system message when the first message
//!   is not a system one; the agent prompt always starts with its own, so
//!   that branch never applies and is not reproduced.
//! * Llama 3 (Meta-Llama-3-*-Instruct): `<|begin_of_text|>` once, then
//!   `<|start_header_id|>{role}<|end_header_id|>\n\n{content | trim}<|eot_id|>`
//!   per message, then `<|start_header_id|>assistant<|end_header_id|>\n\n`.
//!   (Llama 3.1/3.2 templates add a "Cutting Knowledge Date" preamble to the
//!   system message; that variant is not reproduced.)
//!
//! The policy answers `<action>ONE admissible action</action>`, optionally
//! after `<think>…</think>`, then the end-of-turn token (`<|im_end|>` /
//! `<|eot_id|>`), which is the stop token of generation.

use super::prompt::PromptParts;
use crate::model::Tok;

/// A chat template family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatTemplate {
    ChatMl,
    Llama3,
}

/// How the runner formats prompts and reads answers. As a setting
/// (`rollout.format`) it (de)serializes as one of [`PromptFormat::VALUES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "&'static str")]
pub enum PromptFormat {
    /// The word-level format of [`super::prompt`]: the answer is the bare
    /// action and the model's eos.
    #[default]
    Plain,
    /// Chat template (auto-detected from the tokenizer when `None`) and the
    /// `<action>` answer format.
    Chat(Option<ChatTemplate>),
}

impl PromptFormat {
    /// The config values of `rollout.format`.
    pub const VALUES: &'static [&'static str] = &["plain", "chat", "chatml", "llama3"];

    /// Parse a `rollout.format` value.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "plain" => PromptFormat::Plain,
            "chat" => PromptFormat::Chat(None),
            "chatml" => PromptFormat::Chat(Some(ChatTemplate::ChatMl)),
            "llama3" => PromptFormat::Chat(Some(ChatTemplate::Llama3)),
            _ => return None,
        })
    }

    /// The `rollout.format` value that parses to this format.
    pub fn as_str(self) -> &'static str {
        match self {
            PromptFormat::Plain => "plain",
            PromptFormat::Chat(None) => "chat",
            PromptFormat::Chat(Some(ChatTemplate::ChatMl)) => "chatml",
            PromptFormat::Chat(Some(ChatTemplate::Llama3)) => "llama3",
        }
    }
}

/// A `rollout.format` value that is none of [`PromptFormat::VALUES`]. The
/// message completes the setting's key ("rollout.format must be …") in
/// config errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be \"plain\", \"chat\", \"chatml\" or \"llama3\", got \"{0}\"")]
pub struct UnknownFormat(pub String);

impl TryFrom<String> for PromptFormat {
    type Error = UnknownFormat;

    fn try_from(s: String) -> Result<Self, UnknownFormat> {
        PromptFormat::parse(&s).ok_or(UnknownFormat(s))
    }
}

impl From<PromptFormat> for &'static str {
    fn from(f: PromptFormat) -> &'static str {
        f.as_str()
    }
}

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
        }
    }
}

/// The tokenizer lacks what a chat template needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ChatError(pub String);

impl ChatTemplate {
    /// The template whose special tokens the tokenizer has (`<|im_start|>`
    /// → ChatML, `<|start_header_id|>` → Llama 3).
    pub fn detect(tok: &Tok) -> Result<Self, ChatError> {
        for t in [ChatTemplate::ChatMl, ChatTemplate::Llama3] {
            if t.check(tok).is_ok() {
                return Ok(t);
            }
        }
        Err(ChatError(
            "rollout.format \"chat\" needs a tokenizer with chat special tokens \
             (<|im_start|>/<|im_end|> for ChatML, <|start_header_id|>/<|end_header_id|>/<|eot_id|> \
             for Llama 3); this one has neither — use rollout.format = \"plain\""
                .into(),
        ))
    }

    /// The template a model's Jinja `chat_template` implements, told by
    /// the role markers it emits (`None`: neither ChatML nor Llama 3).
    pub fn from_jinja(template: &str) -> Option<Self> {
        if template.contains("<|im_start|>") && template.contains("<|im_end|>") {
            Some(ChatTemplate::ChatMl)
        } else if template.contains("<|start_header_id|>") && template.contains("<|eot_id|>") {
            Some(ChatTemplate::Llama3)
        } else {
            None
        }
    }

    /// The template's special tokens.
    pub fn special_tokens(self) -> &'static [&'static str] {
        match self {
            ChatTemplate::ChatMl => &["<|im_start|>", "<|im_end|>"],
            ChatTemplate::Llama3 => &[
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ],
        }
    }

    /// Ok when the tokenizer has every special token of the template.
    pub fn check(self, tok: &Tok) -> Result<(), ChatError> {
        let missing: Vec<&str> = self
            .special_tokens()
            .iter()
            .copied()
            .filter(|t| tok.token_id(t).is_none())
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(ChatError(format!(
                "the {self:?} chat template needs the special tokens {missing:?}, \
                 which the tokenizer lacks"
            )))
        }
    }

    /// The end-of-turn token (`<|im_end|>` / `<|eot_id|>`).
    pub fn end_of_turn(self) -> &'static str {
        match self {
            ChatTemplate::ChatMl => "<|im_end|>",
            ChatTemplate::Llama3 => "<|eot_id|>",
        }
    }

    /// Id of the end-of-turn token: the stop token of generation.
    pub fn stop_id(self, tok: &Tok) -> Result<u32, ChatError> {
        tok.token_id(self.end_of_turn()).ok_or_else(|| {
            ChatError(format!(
                "the tokenizer has no end-of-turn token {}",
                self.end_of_turn()
            ))
        })
    }

    /// Tokens at the start of every rendered prompt that left-truncation
    /// must keep (Llama 3's `<|begin_of_text|>`).
    pub fn keep_prefix_tokens(self) -> usize {
        match self {
            ChatTemplate::ChatMl => 0,
            ChatTemplate::Llama3 => 1,
        }
    }

    /// Render `messages` exactly as the model's `chat_template` does, with
    /// the assistant header appended when `add_generation_prompt`.
    pub fn render(self, messages: &[Message], add_generation_prompt: bool) -> String {
        let mut s = String::with_capacity(
            64 + messages.iter().map(|m| m.content.len() + 32).sum::<usize>(),
        );
        match self {
            ChatTemplate::ChatMl => {
                for m in messages {
                    s.push_str("<|im_start|>");
                    s.push_str(m.role.as_str());
                    s.push('\n');
                    s.push_str(&m.content);
                    s.push_str("<|im_end|>\n");
                }
                if add_generation_prompt {
                    s.push_str("<|im_start|>assistant\n");
                }
            }
            ChatTemplate::Llama3 => {
                // `bos_token` is prepended to the first message only.
                if !messages.is_empty() {
                    s.push_str("<|begin_of_text|>");
                }
                for m in messages {
                    s.push_str("<|start_header_id|>");
                    s.push_str(m.role.as_str());
                    s.push_str("<|end_header_id|>\n\n");
                    // Jinja's `trim` strips Python whitespace.
                    s.push_str(m.content.trim());
                    s.push_str("<|eot_id|>");
                }
                if add_generation_prompt {
                    s.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
                }
            }
        }
        s
    }
}

/// The system message of the agent prompt.
pub const SYSTEM_PROMPT: &str = "You are an agent acting in a text environment. \
Each turn you see the task, where you are, what you observe and which actions are admissible. \
Answer with exactly one admissible action, written as <action>ACTION</action>. \
You may think first inside <think>...</think>; write nothing else.";

/// The answer a well-formed turn ends with: `<action>{a}</action>`.
pub fn wrap_action(action: &str) -> String {
    format!("<action>{action}</action>")
}

/// The agent prompt as chat messages: the system instructions, the history
/// window as (observation, `<action>a</action>`) turns, then a user message
/// with the goal, the plan (if any), the status, the observation and (if
/// shown) the admissible actions. The same information as the plain
/// format's [`super::prompt::render`].
///
/// In the conversation layout (`p.conversation`) the whole episode is one
/// exchange: the first user message carries the goal and plan, every later
/// state is a user message with its status, observation and actions, every
/// answer the assistant's. Turn t + 1's prompt then starts with turn t's
/// prompt and answer, so the trainer's prefix packing scores an episode's
/// turns in one pass.
pub fn agent_messages(p: &PromptParts) -> Vec<Message> {
    let mut msgs = vec![Message::new(Role::System, SYSTEM_PROMPT)];
    if p.conversation {
        for (i, st) in p.history.iter().enumerate() {
            let state = State {
                status: &st.status,
                observation: &st.observation,
                admissible: &st.admissible,
            };
            msgs.push(Message::new(Role::User, state_message(p, i == 0, state)));
            msgs.push(Message::new(Role::Assistant, wrap_action(&st.action)));
        }
    } else {
        let start = p.history.len().saturating_sub(p.window);
        for st in &p.history[start..] {
            msgs.push(Message::new(
                Role::User,
                format!("Observation: {}", st.observation),
            ));
            msgs.push(Message::new(Role::Assistant, wrap_action(&st.action)));
        }
    }
    let first = !p.conversation || p.history.is_empty();
    let now = State {
        status: p.status,
        observation: p.observation,
        admissible: p.admissible,
    };
    msgs.push(Message::new(Role::User, state_message(p, first, now)));
    msgs
}

/// One state as the prompt shows it.
#[derive(Clone, Copy)]
struct State<'a> {
    status: &'a str,
    observation: &'a str,
    admissible: &'a [String],
}

/// A user message for `state`: the goal and plan first when `head`, then
/// the status, the observation and (if shown) the admissible actions.
fn state_message(p: &PromptParts, head: bool, state: State) -> String {
    let mut u = String::with_capacity(512);
    if head {
        u.push_str("Task: ");
        u.push_str(p.goal);
        if !p.plan.is_empty() {
            u.push_str("\nReference plan (may be incomplete):");
            for (i, a) in p.plan.iter().enumerate() {
                u.push_str(&format!("\n{}. {a}", i + 1));
            }
        }
        u.push('\n');
    }
    u.push_str("Status: ");
    u.push_str(state.status);
    u.push_str("\nObservation: ");
    u.push_str(state.observation);
    if p.show_actions {
        u.push_str("\nAdmissible actions:");
        for a in state.admissible {
            u.push_str("\n- ");
            u.push_str(a);
        }
    }
    u
}

/// The rendered agent prompt, ending with the assistant header.
pub fn render_agent(template: ChatTemplate, p: &PromptParts) -> String {
    template.render(&agent_messages(p), true)
}

/// Why an answer is not in the `<action>` format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("no <action>…</action> in the answer")]
    MissingAction,
    #[error("more than one <action>…</action> in the answer")]
    MultipleActions,
    #[error("unclosed <{0}> tag")]
    Unclosed(&'static str),
    #[error("text outside <think>…</think> and <action>…</action>")]
    TextOutside,
}

/// Find an opening or closing tag at the start of `s` (after whitespace),
/// tolerating whitespace inside the brackets (`< action >`, `</ action >`,
/// as a word-level tokenizer decodes them). Returns the rest after the tag.
fn strip_tag<'a>(s: &'a str, name: &str, closing: bool) -> Option<&'a str> {
    let mut r = s.trim_start().strip_prefix('<')?.trim_start();
    if closing {
        r = r.strip_prefix('/')?.trim_start();
    }
    r = r.strip_prefix(name)?.trim_start();
    r.strip_prefix('>')
}

/// Position of the first tag `name` (opening or closing) in `s`: (start,
/// end) byte offsets of the tag.
fn find_tag(s: &str, name: &str, closing: bool) -> Option<(usize, usize)> {
    let mut from = 0;
    while let Some(i) = s[from..].find('<') {
        let at = from + i;
        if let Some(rest) = strip_tag(&s[at..], name, closing) {
            return Some((at, s.len() - rest.len()));
        }
        from = at + 1;
    }
    None
}

/// Read a chat-format answer: optional leading `<think>…</think>`, then
/// exactly one `<action>…</action>`, with nothing but whitespace around.
/// Returns the trimmed action text (to be projected onto the admissible
/// actions).
pub fn parse_action(text: &str) -> Result<String, FormatError> {
    let mut rest = text;
    if let Some(after) = strip_tag(rest, "think", false) {
        let (_, end) = find_tag(after, "think", true).ok_or(FormatError::Unclosed("think"))?;
        rest = &after[end..];
    }
    let Some(after) = strip_tag(rest, "action", false) else {
        return Err(if find_tag(rest, "action", false).is_some() {
            FormatError::TextOutside
        } else {
            FormatError::MissingAction
        });
    };
    let (start, end) = find_tag(after, "action", true).ok_or(FormatError::Unclosed("action"))?;
    let inner = &after[..start];
    if find_tag(inner, "action", false).is_some() {
        return Err(FormatError::MultipleActions);
    }
    let tail = &after[end..];
    if find_tag(tail, "action", false).is_some() {
        return Err(FormatError::MultipleActions);
    }
    if !tail.trim().is_empty() {
        return Err(FormatError::TextOutside);
    }
    Ok(inner.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::prompt::Step;

    fn msgs() -> Vec<Message> {
        vec![
            Message::new(Role::System, "You are a helpful assistant."),
            Message::new(Role::User, "Hi"),
            Message::new(Role::Assistant, "Hello!"),
            Message::new(Role::User, " How are you? \n"),
        ]
    }

    #[test]
    fn chatml_matches_hf_template() {
        assert_eq!(
            ChatTemplate::ChatMl.render(&msgs(), true),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n\
             <|im_start|>user\n How are you? \n<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(
            ChatTemplate::ChatMl.render(&msgs()[..2], false),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn llama3_matches_hf_template() {
        assert_eq!(
            ChatTemplate::Llama3.render(&msgs(), true),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
             You are a helpful assistant.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(
            ChatTemplate::Llama3.render(&msgs()[1..2], false),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        );
    }

    #[test]
    fn format_values_parse() {
        assert_eq!(PromptFormat::parse("plain"), Some(PromptFormat::Plain));
        assert_eq!(PromptFormat::parse("chat"), Some(PromptFormat::Chat(None)));
        // SmolLM2's and Llama 3.1's templates (abridged), and a foreign one.
        let smol = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}";
        let llama = "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}";
        assert_eq!(ChatTemplate::from_jinja(smol), Some(ChatTemplate::ChatMl));
        assert_eq!(ChatTemplate::from_jinja(llama), Some(ChatTemplate::Llama3));
        assert_eq!(ChatTemplate::from_jinja("[INST] {{ m }} [/INST]"), None);
        assert_eq!(
            PromptFormat::parse("llama3"),
            Some(PromptFormat::Chat(Some(ChatTemplate::Llama3)))
        );
        assert_eq!(PromptFormat::parse("jinja"), None);
        assert!(PromptFormat::VALUES
            .iter()
            .all(|v| PromptFormat::parse(v).is_some()));
        for v in PromptFormat::VALUES {
            let f: PromptFormat = serde_json::from_value(serde_json::json!(v)).unwrap();
            assert_eq!(f.as_str(), *v);
            assert_eq!(serde_json::to_value(f).unwrap(), serde_json::json!(v));
        }
        let e = serde_json::from_value::<PromptFormat>(serde_json::json!("jinja"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "must be \"plain\", \"chat\", \"chatml\" or \"llama3\", got \"jinja\""
        );
    }

    #[test]
    fn detection_from_special_tokens() {
        let w: Vec<String> = vec!["go".into()];
        let chatml = Tok::build_word_level(&w, &["<|im_start|>", "<|im_end|>"]).unwrap();
        assert_eq!(ChatTemplate::detect(&chatml), Ok(ChatTemplate::ChatMl));
        assert_eq!(ChatTemplate::ChatMl.stop_id(&chatml), Ok(1));
        let llama = Tok::build_word_level(
            &w,
            &[
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ],
        )
        .unwrap();
        assert_eq!(ChatTemplate::detect(&llama), Ok(ChatTemplate::Llama3));
        assert_eq!(ChatTemplate::Llama3.stop_id(&llama), Ok(3));
        assert!(ChatTemplate::ChatMl.check(&llama).is_err());
        let plain = Tok::build_word_level(&w, &["[EOS]"]).unwrap();
        let e = ChatTemplate::detect(&plain).unwrap_err();
        assert!(e.to_string().contains("chat special tokens"), "{e}");
        // Special tokens in rendered text encode as single ids.
        let ids = chatml.encode("<|im_start|>go<|im_end|>").unwrap();
        assert_eq!(ids, vec![0, chatml.token_id("go").unwrap(), 1]);
    }

    #[test]
    fn agent_messages_carry_plan_history_and_actions() {
        let hist = vec![
            Step {
                observation: "o0".into(),
                action: "a0".into(),
                ..Default::default()
            },
            Step {
                observation: "o1".into(),
                action: "a1".into(),
                ..Default::default()
            },
        ];
        let plan = vec!["go to desk 1".to_string(), "look".to_string()];
        let adm = vec!["look".to_string(), "inventory".to_string()];
        let p = PromptParts {
            goal: "put a apple in desk 1",
            plan: &plan,
            history: &hist,
            window: 1,
            status: "You are at desk 1.",
            observation: "Nothing happens.",
            admissible: &adm,
            show_actions: true,
            conversation: false,
        };
        let m = agent_messages(&p);
        assert_eq!(m.len(), 4);
        assert_eq!(m[0].role, Role::System);
        assert_eq!(m[1], Message::new(Role::User, "Observation: o1"));
        assert_eq!(m[2], Message::new(Role::Assistant, "<action>a1</action>"));
        assert_eq!(
            m[3].content,
            "Task: put a apple in desk 1\nReference plan (may be incomplete):\n\
             1. go to desk 1\n2. look\nStatus: You are at desk 1.\n\
             Observation: Nothing happens.\nAdmissible actions:\n- look\n- inventory"
        );
        let bare = agent_messages(&PromptParts {
            plan: &[],
            window: 0,
            show_actions: false,
            ..p
        });
        assert_eq!(bare.len(), 2);
        assert!(!bare[1].content.contains("plan"));
        assert!(!bare[1].content.contains("Admissible"));
        assert!(render_agent(ChatTemplate::ChatMl, &p).ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn parse_action_accepts_the_format() {
        let ok = |t: &str| parse_action(t).unwrap();
        assert_eq!(ok("<action>go to desk 1</action>"), "go to desk 1");
        assert_eq!(ok("  <action> go to desk 1 </action>\n"), "go to desk 1");
        assert_eq!(
            ok("<think>the apple is on the desk</think>\n<action>go to desk 1</action>"),
            "go to desk 1"
        );
        assert_eq!(ok("<think></think><action>look</action>"), "look");
        // As a word-level tokenizer decodes the tags.
        assert_eq!(ok("< action > go to desk 1 </ action >"), "go to desk 1");
        assert_eq!(
            ok("< think > hmm </ think > < action > look </ action >"),
            "look"
        );
    }

    #[test]
    fn parse_action_rejects_violations() {
        use FormatError::*;
        let err = |t: &str| parse_action(t).unwrap_err();
        assert_eq!(err("go to desk 1"), MissingAction);
        assert_eq!(err(""), MissingAction);
        assert_eq!(err("<think>go to desk 1</think>"), MissingAction);
        assert_eq!(
            err("<action>look</action><action>look</action>"),
            MultipleActions
        );
        assert_eq!(err("<action>look<action>look</action>"), MultipleActions);
        assert_eq!(err("I will look. <action>look</action>"), TextOutside);
        assert_eq!(err("<action>look</action> because"), TextOutside);
        assert_eq!(err("<action>look"), Unclosed("action"));
        assert_eq!(err("<think>hmm <action>look</action>"), Unclosed("think"));
        // Thinking must come first, and only once.
        assert_eq!(err("<action>look</action><think>x</think>"), TextOutside);
        assert_eq!(
            err("<think>a</think><think>b</think><action>look</action>"),
            TextOutside
        );
    }
}
