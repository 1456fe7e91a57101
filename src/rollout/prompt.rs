//! Prompt rendering and action projection for the word-level agent format.
//!
//! A prompt is Markovian: the goal, an optional reference plan, a short
//! window of recent (action, observation) pairs, the env's status line
//! (location, hand, what was seen where), the current observation and the
//! admissible actions. The policy answers with one action and `[EOS]`.

/// Words the prompt scaffold adds on top of the env vocabulary.
pub const SCAFFOLD_WORDS: &[&str] = &[
    "task",
    ":",
    "plan",
    ".",
    "history",
    "none",
    ">",
    "status",
    "observation",
    "actions",
    "|",
    "action",
    "(",
    ")",
    "may",
    "be",
    "incomplete",
];

/// One past step as shown in the history window: the observation the
/// agent had, and the action it took. (The action's result is the next
/// step's observation, or the prompt's current observation.) The status
/// line and admissible actions of that state are kept for the chat
/// conversation layout, which shows every past state as it was prompted.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Step {
    pub observation: String,
    pub action: String,
    pub status: String,
    pub admissible: Vec<String>,
}

/// Everything a prompt shows.
#[derive(Debug, Clone, Copy)]
pub struct PromptParts<'a> {
    pub goal: &'a str,
    pub plan: &'a [String],
    pub history: &'a [Step],
    pub window: usize,
    pub status: &'a str,
    pub observation: &'a str,
    pub admissible: &'a [String],
    /// List the admissible actions in the prompt (constrained decoding
    /// enforces them either way; leaving them out halves prompt length).
    pub show_actions: bool,
    /// Chat format only: the episode as one growing conversation (every
    /// past state a user message, every answer the assistant's), so each
    /// prompt extends the one before; `window` is then ignored.
    pub conversation: bool,
}

/// Render a prompt. `plan` is shown only when non-empty (k ≥ 1); with
/// k = 0 the prompt is the unguided one.
pub fn render(p: &PromptParts) -> String {
    let mut s = String::with_capacity(512);
    s.push_str("task : ");
    s.push_str(p.goal);
    s.push('\n');
    if !p.plan.is_empty() {
        s.push_str("plan ( may be incomplete ) :");
        for (i, a) in p.plan.iter().enumerate() {
            s.push_str(&format!(" {} . {a}", i + 1));
        }
        s.push('\n');
    }
    s.push_str("history :");
    let start = p.history.len().saturating_sub(p.window);
    if start == p.history.len() {
        s.push_str(" none");
    }
    for (i, st) in p.history[start..].iter().enumerate() {
        if i > 0 {
            s.push_str(" |");
        }
        s.push(' ');
        s.push_str(&st.observation);
        s.push_str(" > ");
        s.push_str(&st.action);
    }
    s.push('\n');
    s.push_str("status : ");
    s.push_str(p.status);
    s.push_str("\nobservation : ");
    s.push_str(p.observation);
    if p.show_actions {
        s.push_str("\nactions : ");
        s.push_str(&p.admissible.join(" | "));
    }
    s.push_str("\naction :");
    s
}

/// Lower-case and re-space text into words and punctuation runs (the
/// tokenizer's own split), so "put apple 1 in/on desk 1" and the decoded
/// "put apple 1 in / on desk 1" compare equal.
pub fn normalize(text: &str) -> String {
    let lower = text.to_lowercase();
    let mut out: Vec<String> = Vec::new();
    let mut cur = String::new();
    let mut cur_word: Option<bool> = None;
    for ch in lower.chars() {
        if ch.is_whitespace() {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            cur_word = None;
            continue;
        }
        let is_word = ch.is_alphanumeric() || ch == '_';
        if cur_word.is_some_and(|w| w != is_word) && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(ch);
        cur_word = Some(is_word);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out.join(" ")
}

/// Project model text onto an admissible action (normalised exact match).
pub fn project<'a>(text: &str, admissible: &'a [String]) -> Option<&'a String> {
    let n = normalize(text);
    let n = n.trim_end_matches(" .").trim();
    admissible.iter().find(|a| normalize(a) == n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn projection_normalises() {
        let adm = vec![
            "go to cabinet 1".to_string(),
            "take apple 1 from desk 1".to_string(),
        ];
        assert_eq!(project("Go to  cabinet 1", &adm), Some(&adm[0]));
        assert_eq!(project("go to cabinet 1.", &adm), Some(&adm[0]));
        assert_eq!(project("go to cabinet 10", &adm), None);
        assert_eq!(project("", &adm), None);
        assert_eq!(normalize("put a in/on b"), "put a in / on b");
    }

    #[test]
    fn prompt_has_sections_and_window() {
        let hist: Vec<Step> = (0..4)
            .map(|i| Step {
                action: format!("a{i}"),
                observation: format!("o{i}"),
                ..Default::default()
            })
            .collect();
        let plan = vec!["go to desk 1".to_string()];
        let adm = vec!["look".to_string(), "inventory".to_string()];
        let p = PromptParts {
            goal: "put a apple in desk 1",
            plan: &plan,
            history: &hist,
            window: 2,
            status: "You are at desk 1.",
            observation: "Nothing happens.",
            admissible: &adm,
            show_actions: true,
            conversation: false,
        };
        let s = render(&p);
        assert!(s.contains("plan ( may be incomplete ) : 1 . go to desk 1"));
        assert!(s.contains("history : o2 > a2 | o3 > a3\n"), "{s}");
        assert!(!s.contains("a1"));
        assert!(s.ends_with("actions : look | inventory\naction :"));
        let unguided = render(&PromptParts { plan: &[], ..p });
        assert!(!unguided.contains("plan"));
        let short = render(&PromptParts {
            show_actions: false,
            ..p
        });
        assert!(short.ends_with("observation : Nothing happens.\naction :"));
    }
}
