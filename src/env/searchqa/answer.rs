//! Answer scoring as in SQuAD: normalised exact match and token F1.

/// SQuAD normalisation: lower-case, drop punctuation, drop the articles
/// "a", "an", "the", collapse whitespace.
pub fn normalize_answer(s: &str) -> String {
    let no_punct: String = s
        .to_lowercase()
        .chars()
        // SQuAD drops ASCII punctuation; dropping every non-word, non-space
        // character also covers dashes and quotes beyond ASCII.
        .filter(|c| c.is_alphanumeric() || c.is_whitespace() || *c == '_')
        .collect();
    no_punct
        .split_whitespace()
        .filter(|w| !matches!(*w, "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Token-level F1 of `pred` against `gold` after [`normalize_answer`]. When
/// either side normalises to nothing, 1.0 iff both do (as SQuAD does).
pub fn f1(pred: &str, gold: &str) -> f64 {
    let p = normalize_answer(pred);
    let g = normalize_answer(gold);
    let p: Vec<&str> = p.split_whitespace().collect();
    let g: Vec<&str> = g.split_whitespace().collect();
    if p.is_empty() || g.is_empty() {
        return if p == g { 1.0 } else { 0.0 };
    }
    // Multiset intersection size.
    let mut rest = g.clone();
    let mut common = 0usize;
    for w in &p {
        if let Some(i) = rest.iter().position(|x| x == w) {
            rest.swap_remove(i);
            common += 1;
        }
    }
    if common == 0 {
        return 0.0;
    }
    let precision = common as f64 / p.len() as f64;
    let recall = common as f64 / g.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// Normalised exact match.
pub fn exact_match(pred: &str, gold: &str) -> bool {
    normalize_answer(pred) == normalize_answer(gold)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_like_squad() {
        assert_eq!(normalize_answer("The Paris."), "paris");
        assert!(exact_match("The Paris.", "paris"));
        assert_eq!(normalize_answer("  An  Apex,  Labs!! "), "apex labs");
        // Only whole-word articles go ("Theo" stays).
        assert_eq!(normalize_answer("Theo the Great"), "theo great");
        assert_eq!(normalize_answer("a the an ."), "");
        assert!(!exact_match("Apex Labs", "Apex Works"));
    }

    #[test]
    fn token_f1_by_hand() {
        assert_eq!(f1("The Paris.", "paris"), 1.0);
        // 2 common tokens: precision 2/3, recall 1 → F1 0.8.
        assert!((f1("Ada Ashby Tarsk", "Ada Ashby") - 0.8).abs() < 1e-12);
        // 1 common of 2 and 2: P = R = 0.5.
        assert!((f1("Apex Works", "Apex Labs") - 0.5).abs() < 1e-12);
        // Repeated words count once each side (multiset intersection).
        assert!((f1("apex apex", "apex labs") - 0.5).abs() < 1e-12);
        assert_eq!(f1("Tarsk", "Velmora"), 0.0);
        assert_eq!(f1("the", "a"), 1.0);
        assert_eq!(f1("the", "Tarsk"), 0.0);
    }
}
