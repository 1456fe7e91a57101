//! The household's closed vocabulary: every word the env can emit (goals,
//! feedback, admissible commands, status) and every command word, split the
//! way a regex `\w+|[^\w\s]+` splits text. A tiny from-scratch policy can use
//! it as its whole token set.

use super::catalog::{TaskType, MAX_INDEX, OBJECTS, RECEPTACLES};

/// Split like the regex `\w+|[^\w\s]+`: runs of word characters
/// (alphanumeric or `_`) and runs of other non-space characters.
pub fn split_words(text: &str) -> Vec<&str> {
    #[derive(PartialEq, Clone, Copy)]
    enum Class {
        Word,
        Space,
        Punct,
    }
    let class = |c: char| {
        if c.is_alphanumeric() || c == '_' {
            Class::Word
        } else if c.is_whitespace() {
            Class::Space
        } else {
            Class::Punct
        }
    };
    let mut out = Vec::new();
    let mut start: Option<(usize, Class)> = None;
    for (i, c) in text.char_indices() {
        let k = class(c);
        match start {
            Some((_, cur)) if cur == k => {}
            _ => {
                if let Some((s, cur)) = start.take() {
                    if cur != Class::Space {
                        out.push(&text[s..i]);
                    }
                }
                start = Some((i, k));
            }
        }
    }
    if let Some((s, cur)) = start {
        if cur != Class::Space {
            out.push(&text[s..]);
        }
    }
    out
}

/// Every template sentence of the env with its slots left out. The tests
/// check this against real rollouts, so a new template must be added here.
const TEMPLATES: &[&str] = &[
    // Start text, look, status.
    "You are in the middle of a room. Looking quickly around you, you see a x, and a y.",
    "You are in the middle of the room. You are at x. Seen: x at y, z. No task loaded.",
    "Your task is to: x.",
    // Receptacle descriptions and listings with state labels.
    "On the x, you see nothing. The x is closed. The x is open. In it, you see a x.",
    "a x (clean, hot, cool, on), and a y (on). x (hot) at y.",
    // Feedback.
    "You arrive at x. You open the x. You close the x.",
    "You pick up the x from the y. You move the x to the y.",
    "You clean the x using the y. You heat the x using the y. You cool the x using the y.",
    "You turn on the x. This is a x. You are carrying: nothing. Nothing happens.",
    // Commands (including the accepted aliases).
    "go to open close take from move to put in on in/on use heat clean cool with",
    "examine inventory look",
];

/// Sorted, deduplicated list of every word the env can emit or accept.
pub fn vocabulary() -> Vec<String> {
    let mut words: Vec<String> = Vec::new();
    let mut add = |text: &str| words.extend(split_words(text).into_iter().map(String::from));
    for t in TEMPLATES {
        add(t);
    }
    for tt in TaskType::ALL {
        for p in tt.phrasings() {
            add(&p.replace("{o}", " ").replace("{r}", " "));
        }
    }
    for k in RECEPTACLES {
        add(k.name);
    }
    for k in OBJECTS {
        add(k.name);
    }
    for n in 1..=MAX_INDEX {
        add(&n.to_string());
    }
    words.sort();
    words.dedup();
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_like_the_regex() {
        assert_eq!(
            split_words("You see a apple 1 (clean, hot).\n\nYour task_x: in/on"),
            vec![
                "You", "see", "a", "apple", "1", "(", "clean", ",", "hot", ").", "Your", "task_x",
                ":", "in", "/", "on"
            ]
        );
        assert!(split_words("   ").is_empty());
    }

    #[test]
    fn vocabulary_is_sorted_unique_and_has_the_basics() {
        let v = vocabulary();
        assert!(v.windows(2).all(|w| w[0] < w[1]));
        for w in [
            "cabinet", "apple", "desklamp", "1", "5", ".", ",", ":", ").", "),", "Nothing",
        ] {
            assert!(v.iter().any(|x| x == w), "missing {w}");
        }
    }
}
