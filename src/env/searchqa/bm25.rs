//! Okapi BM25 retrieval over the corpus documents (k1 = 1.2, b = 0.75), with
//! a deterministic tokenisation: lower-cased alphanumeric runs, minus a small
//! stop-word list (so "the founder of Apex Labs" matches on its content
//! words). Ties are broken by document index, i.e. by doc id.

use std::collections::HashMap;

const K1: f64 = 1.2;
const B: f64 = 0.75;

/// Function words of the documents and questions, dropped from both sides.
const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "at", "by", "did", "for", "in", "is", "of", "on", "the", "to", "was", "what",
    "where", "which", "who", "whose",
];

pub(crate) fn is_stop_word(w: &str) -> bool {
    STOP_WORDS.contains(&w)
}

/// Search terms of `text`: lower-cased alphanumeric runs, stop words out.
pub fn tokenize(text: &str) -> Vec<String> {
    text.to_lowercase()
        .split(|c: char| !c.is_alphanumeric())
        .filter(|t| !t.is_empty() && !is_stop_word(t))
        .map(String::from)
        .collect()
}

/// An inverted view of the documents sufficient for BM25 scoring.
#[derive(Debug, Default)]
pub struct Bm25 {
    /// Term frequencies per document.
    tf: Vec<HashMap<String, u32>>,
    /// Document frequency per term.
    df: HashMap<String, usize>,
    len: Vec<usize>,
    avg_len: f64,
}

impl Bm25 {
    /// Index `docs` (document `i` is `docs[i]`).
    pub fn new(docs: &[String]) -> Bm25 {
        let mut tf = Vec::with_capacity(docs.len());
        let mut df: HashMap<String, usize> = HashMap::new();
        let mut len = Vec::with_capacity(docs.len());
        for text in docs {
            let terms = tokenize(text);
            let mut counts: HashMap<String, u32> = HashMap::new();
            for t in &terms {
                *counts.entry(t.clone()).or_default() += 1;
            }
            for t in counts.keys() {
                *df.entry(t.clone()).or_default() += 1;
            }
            len.push(terms.len());
            tf.push(counts);
        }
        let avg_len = len.iter().sum::<usize>() as f64 / len.len().max(1) as f64;
        Bm25 {
            tf,
            df,
            len,
            avg_len,
        }
    }

    /// Score of every document for `query` (each distinct term once).
    pub fn scores(&self, query: &str) -> Vec<f64> {
        let mut terms = tokenize(query);
        // Repeating a word in the query should not change the ranking.
        let mut seen = std::collections::BTreeSet::new();
        terms.retain(|t| seen.insert(t.clone()));
        let n = self.tf.len() as f64;
        let mut scores = vec![0.0; self.tf.len()];
        for t in &terms {
            let Some(&df) = self.df.get(t) else { continue };
            // Lucene's idf: always positive, so a term never lowers a score.
            let idf = (1.0 + (n - df as f64 + 0.5) / (df as f64 + 0.5)).ln();
            for (d, score) in scores.iter_mut().enumerate() {
                let Some(&f) = self.tf[d].get(t) else {
                    continue;
                };
                let f = f as f64;
                let norm = K1 * (1.0 - B + B * self.len[d] as f64 / self.avg_len);
                *score += idf * f * (K1 + 1.0) / (f + norm);
            }
        }
        scores
    }

    /// The `k` best documents with a positive score, best first; equal
    /// scores in document order.
    pub fn search(&self, query: &str, k: usize) -> Vec<(usize, f64)> {
        let mut hits: Vec<(usize, f64)> = self
            .scores(query)
            .into_iter()
            .enumerate()
            .filter(|&(_, s)| s > 0.0)
            .collect();
        hits.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        hits.truncate(k);
        hits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizes_deterministically() {
        assert_eq!(
            tokenize("Where was the founder of Apex-Labs born?"),
            vec!["founder", "apex", "labs", "born"]
        );
        assert!(tokenize("  the of ").is_empty());
    }

    /// Hand-checked toy index: tf, idf and length normalisation.
    #[test]
    fn ranks_by_bm25() {
        let docs: Vec<String> = [
            "Apex Labs. Apex Labs was founded by Ada Ashby.",
            "Ada Ashby was born in Tarsk.",
            "Cobalt Labs is based in Tarsk.",
            "Tarsk is a city.",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let idx = Bm25::new(&docs);
        // "apex" occurs only in doc 0.
        let hits = idx.search("apex", 3);
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].0, 0);
        // Check one score by hand: tf 2, df 1, N 4, |d0| 7, avgdl 17/4.
        let idf = (1.0f64 + (4.0 - 1.0 + 0.5) / 1.5).ln();
        let norm = 1.2 * (1.0 - 0.75 + 0.75 * 7.0 / 4.25);
        let want = idf * 2.0 * 2.2 / (2.0 + norm);
        assert!((hits[0].1 - want).abs() < 1e-12, "{} vs {want}", hits[0].1);
        // "tarsk": the short doc 3 beats docs 1 and 2 (same tf, longer).
        let order: Vec<usize> = idx.search("Tarsk", 3).iter().map(|h| h.0).collect();
        assert_eq!(order[0], 3);
        // Docs 1 and 2 both have 4 terms: an exact tie, broken by index.
        assert_eq!(&order[1..], &[1, 2]);
        assert!(idx.search("nothing here", 3).is_empty());
        assert!(idx.search("the", 3).is_empty());
    }
}
