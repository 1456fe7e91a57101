//! The searchqa vocabulary: every word the env can emit (questions, search
//! results, documents, feedback, status, admissible actions), split the way
//! [`split_words`] splits text and lower-cased, since the tiny word-level
//! model lower-cases its input and uses this list as its whole token set.
//!
//! It also holds the numbers 1–9 with which the prompt numbers the steps of
//! a shown expert plan.
//!
//! It is built by rendering the env's own text functions over the whole
//! corpus (every document and search line) and with a placeholder slot for
//! the free parts (question, query), so a new template cannot be forgotten;
//! the tests still check it against real rollouts.

use super::corpus::{corpus, name_words, Kind, Relation};
use super::generate::MAX_HOPS;
use super::{intro_text, no_doc_text, results_text, status_text, CORRECT, NOTHING_HAPPENS, WRONG};
use crate::env::household::split_words;

/// Sorted, deduplicated, lower-cased list of every word the env can emit or
/// accept.
pub fn vocabulary() -> Vec<String> {
    let c = corpus();
    let x = "x";
    let mut texts: Vec<String> = vec![
        intro_text(x),
        NOTHING_HAPPENS.to_string(),
        CORRECT.to_string(),
        WRONG.to_string(),
        no_doc_text(x),
        results_text(x, &[]),
        results_text(x, &[x.to_string()]),
        status_text(x, &[], None),
        status_text(x, &[(x.into(), x.into())], Some((x, vec![]))),
        status_text(x, &[(x.into(), x.into())], Some((x, vec![x, x]))),
        "No task loaded.".to_string(),
    ];
    // Tools as the admissible list writes them.
    for tool in ["search", "open", "answer"] {
        texts.push(format!("{tool}[{x}]"));
    }
    // Questions: every relation as the last hop and as an inner hop.
    for r in Relation::ALL {
        texts.push(r.question(x));
        texts.push(r.noun_phrase(x));
        texts.push(r.sentence(x, x));
    }
    for k in Kind::ALL {
        texts.push(k.name().to_string());
    }
    // Every document and search line (names, ids, fact sentences).
    for d in 0..c.docs.len() {
        texts.push(c.render_doc(d).0);
        texts.push(c.render_hit(d).0);
    }
    texts.extend(name_words().map(String::from));
    // The prompt numbers the steps of a shown expert plan ("1 . search[..]
    // 2 . open[..]"), and the plan of a MAX_HOPS question has 2·hops + 1
    // actions; the env has no other numbers, so they must come from here.
    texts.extend((1..=2 * MAX_HOPS + 1).map(|n| n.to_string()));

    let mut words: Vec<String> = texts
        .iter()
        .flat_map(|t| split_words(t))
        .map(|w| w.to_lowercase())
        .collect();
    words.sort();
    words.dedup();
    words
}
