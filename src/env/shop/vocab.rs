//! The shop's closed vocabulary: every word the env can emit (instructions,
//! pages, status) or accept (admissible actions), split with
//! [`split_words`]. A tiny from-scratch policy can use it as its whole token
//! set; the tests check it against real rollouts.

use super::catalog::{BRANDS, TYPES};
use crate::env::household::split_words;

/// Every template sentence of the env with its slots filled by placeholder
/// words ("x") or sample numbers; the punctuation runs must be exactly the
/// ones the env emits, so templates copy its formats verbatim.
const TEMPLATES: &[&str] = &[
    // Search page and instruction.
    "WebShop [SEP] Instruction: [SEP] x [SEP] Search",
    "i need a x with y and z, and color is w, and price lower than 30 dollars",
    // Results page.
    "Back to Search [SEP] Page 1 (Total results: 50) [SEP] < Prev [SEP] Next > [SEP] x [SEP] $24",
    // Item page and its sub-pages.
    "x [SEP] Price: $24 [SEP] Rating: 4.5 [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now",
    "a x y by z that is u, v and w. [SEP] category: x > y > z",
    "4 color choices, 1 size choice",
    "4.5 stars [SEP] love this x, really y. [SEP] good, y as described. okay not great",
    // Purchase.
    "Thank you for shopping with us! [SEP] Purchased [SEP] x [SEP] Your score (min 0.0, max 1.0) [SEP] 0.67",
    // Actions.
    "search[x y] click[x y] click[next >] click[< prev] click[back to search] click[buy now]",
    "click[description] click[features] click[reviews]",
    // Status.
    "Page: search. Page: results 1 of 5 for x y. Page: item x. Selected: none.",
    "Page: description of x. Selected: color x, size y. Bought x.",
    "Need: x; y, z; no options; price under 30 dollars. No task loaded.",
];

/// Sorted, deduplicated list of every word the env can emit or accept.
pub fn vocabulary() -> Vec<String> {
    let mut words: Vec<String> = Vec::new();
    let mut add = |text: &str| words.extend(split_words(text).into_iter().map(String::from));
    for t in TEMPLATES {
        add(t);
    }
    for t in TYPES {
        add(t.name);
        add(t.top);
        add(t.parent);
        t.attributes.iter().for_each(|a| add(a));
        t.styles.iter().for_each(|s| add(s));
        for k in t.options {
            add(k.name);
            k.values.iter().for_each(|v| add(v));
        }
    }
    BRANDS.iter().for_each(|b| add(b));
    // Prices, caps, counts, pages, sizes, ratings and scores ("0.05").
    for n in 0..=100 {
        add(&n.to_string());
        add(&format!("{n:02}"));
    }
    words.sort();
    words.dedup();
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocabulary_is_sorted_unique_and_modest() {
        let v = vocabulary();
        assert!(v.windows(2).all(|w| w[0] < w[1]));
        for w in [
            "shirt", "navy", "[", "SEP", "]", ">]", "[<", "$", "click", "search", "00",
        ] {
            assert!(v.iter().any(|x| x == w), "missing {w}");
        }
        assert!(v.len() < 600, "{} words", v.len());
    }
}
