//! Thin wrapper over the `tokenizers` crate.
//!
//! The tiny experiments use a word-level vocabulary built from the
//! environment's words ([`Tok::build_word_level`]); real models load their
//! `tokenizer.json` with [`Tok::from_file`], or the vocabulary stored in a
//! GGUF file with [`Tok::from_gguf`] (built in `gguf_tokenizer`). All go
//! through the same `tokenizers::Tokenizer`, so the rest of the crate never
//! cares which one it has. The word-level tokenizer is written as a standard `tokenizer.json`
//! that Python `tokenizers`/`transformers` load unchanged.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;

use super::error::{ModelError, Result};

/// Name of the unknown-word token of word-level tokenizers.
pub const UNK_TOKEN: &str = "[UNK]";

/// A loaded tokenizer plus where it came from (for error messages).
#[derive(Clone)]
pub struct Tok {
    inner: Tokenizer,
    origin: PathBuf,
}

impl std::fmt::Debug for Tok {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tok")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl Tok {
    /// Loads a standard `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
            });
        }
        let inner = Tokenizer::from_file(path).map_err(|e| ModelError::Tokenizer {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        Ok(Tok {
            inner,
            origin: path.to_path_buf(),
        })
    }

    /// Wraps an already built tokenizer; `origin` names it in errors.
    pub(super) fn from_parts(inner: Tokenizer, origin: PathBuf) -> Self {
        Tok { inner, origin }
    }

    /// Builds a word-level tokenizer: ids `0..` are the `specials` in order
    /// (plus `[UNK]` right after them if it is not among them), then the
    /// `words` in the given order (lower-cased; duplicates skipped).
    ///
    /// Pipeline: `Lowercase` normalizer, `Whitespace` pre-tokenizer
    /// (`\w+|[^\w\s]+`, so "cabinet 1." is `cabinet`, `1`, `.`), `WordLevel`
    /// model with `[UNK]` for unknown words, no post-processor, and no
    /// decoder: `tokenizers` then joins decoded tokens with single spaces
    /// ("go to cabinet 1 ."), identically in Rust and Python. Specials are
    /// registered as special added tokens, so they are recognised verbatim in
    /// text and skipped by [`Tok::decode`].
    ///
    /// Every word must be a single pre-token (a run of word characters or a
    /// run of punctuation); anything else could never be produced by
    /// `encode` and is rejected.
    pub fn build_word_level(words: &[String], specials: &[&str]) -> Result<Self> {
        let origin = PathBuf::from("<word-level tokenizer>");
        let err = |msg: String| ModelError::Tokenizer {
            path: origin.clone(),
            msg,
        };
        let mut specials_v: Vec<String> = Vec::new();
        for s in specials {
            if s.is_empty() {
                return Err(err("empty special token".into()));
            }
            if !specials_v.iter().any(|x| x == s) {
                specials_v.push(s.to_string());
            }
        }
        if !specials_v.iter().any(|x| x == UNK_TOKEN) {
            specials_v.push(UNK_TOKEN.to_string());
        }
        let mut vocab = Map::new();
        let mut order: Vec<String> = Vec::new();
        for s in &specials_v {
            vocab.insert(s.clone(), json!(order.len()));
            order.push(s.clone());
        }
        let n_specials = order.len();
        for w in words {
            let w = w.to_lowercase();
            if w.is_empty() || w.chars().any(char::is_whitespace) {
                return Err(err(format!("word {w:?} is empty or contains whitespace")));
            }
            if !vocab.contains_key(&w) {
                vocab.insert(w.clone(), json!(order.len()));
                order.push(w);
            }
        }
        let added: Vec<Value> = specials_v
            .iter()
            .enumerate()
            .map(|(id, s)| {
                json!({"id": id, "content": s, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let doc = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "Lowercase"},
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": Value::Object(vocab), "unk_token": UNK_TOKEN},
        });
        let inner = Tokenizer::from_str(&doc.to_string()).map_err(|e| err(e.to_string()))?;
        let tok = Tok {
            inner,
            origin: origin.clone(),
        };
        for (id, w) in order.iter().enumerate().skip(n_specials) {
            let ids = tok.encode(w)?;
            if ids != [id as u32] {
                return Err(err(format!(
                    "word {w:?} is not a single pre-token (encodes to {ids:?}); split it first"
                )));
            }
        }
        Ok(tok)
    }

    /// Writes a standard (pretty-printed) `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.inner
            .save(path, true)
            .map_err(|e| ModelError::Tokenizer {
                path: path.to_path_buf(),
                msg: e.to_string(),
            })
    }

    /// Token ids of `text`, without special tokens added (no BOS/EOS); chat
    /// formatting is the caller's business.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer {
                path: self.origin.clone(),
                msg: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, skipping special tokens (eos, pad, ...).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| ModelError::Tokenizer {
                path: self.origin.clone(),
                msg: e.to_string(),
            })
    }

    /// Id of a token string (vocabulary entry or added token), if any.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens; the model's `vocab_size` must
    /// be at least this.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The underlying `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// The words of `texts` this tokenizer cannot encode: their tokens do
    /// not decode back to them (a word-level vocabulary without the word
    /// gives `[UNK]`, which decoding drops), so an action holding one
    /// reaches the env cut short. Compared ignoring case and whitespace;
    /// sorted, each once.
    pub fn unencodable_words<'a>(&self, texts: impl IntoIterator<Item = &'a str>) -> Vec<String> {
        // Word-level decoding puts spaces around punctuation
        // (`click [ red ]`): compare without whitespace.
        let norm = |s: &str| -> String {
            s.chars()
                .filter(|c| !c.is_whitespace())
                .flat_map(char::to_lowercase)
                .collect()
        };
        let round_trips = |t: &str| {
            self.encode(t)
                .and_then(|ids| self.decode(&ids))
                .is_ok_and(|d| norm(&d) == norm(t))
        };
        let mut seen = std::collections::BTreeSet::new();
        let mut bad = std::collections::BTreeSet::new();
        for t in texts {
            if !seen.insert(t) || round_trips(t) {
                continue;
            }
            for w in t.split_whitespace() {
                if !round_trips(w) {
                    bad.insert(w.to_string());
                }
            }
        }
        bad.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words() -> Vec<String> {
        [
            "go", "to", "cabinet", "1", "10", ".", "you", "arrive", "at", "take", "apple", "from",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    #[test]
    fn word_level_roundtrip() {
        let tok = Tok::build_word_level(&words(), &["<pad>", "<s>", "</s>"]).unwrap();
        assert_eq!(tok.token_id("<pad>"), Some(0));
        assert_eq!(tok.token_id("<s>"), Some(1));
        assert_eq!(tok.token_id("</s>"), Some(2));
        assert_eq!(tok.token_id(UNK_TOKEN), Some(3));
        assert_eq!(tok.token_id("go"), Some(4));
        assert_eq!(tok.vocab_size(), 4 + words().len());

        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer.json");
        tok.save(&p).unwrap();
        let tok2 = Tok::from_file(&p).unwrap();
        assert_eq!(tok2.vocab_size(), tok.vocab_size());

        for t in [&tok, &tok2] {
            let ids = t.encode("go to cabinet 1.").unwrap();
            assert_eq!(ids, vec![4, 5, 6, 7, 9]);
            let text = t.decode(&ids).unwrap();
            assert_eq!(text, "go to cabinet 1 .");
            assert_eq!(t.encode(&text).unwrap(), ids);
            // Lower-casing, "10" vs "1", specials skipped on decode.
            let ids = t.encode("Go to cabinet 10</s>").unwrap();
            assert_eq!(ids, vec![4, 5, 6, 8, 2]);
            assert_eq!(t.decode(&ids).unwrap(), "go to cabinet 10");
            // Unknown words map to [UNK].
            assert_eq!(t.encode("go to fridge 1").unwrap(), vec![4, 5, 3, 7]);
            assert_eq!(t.encode("").unwrap(), Vec::<u32>::new());
        }
    }

    #[test]
    fn word_level_rejects_multi_token_words() {
        let bad = vec!["cabinet 1".to_string()];
        assert!(Tok::build_word_level(&bad, &["<pad>"]).is_err());
        let bad = vec!["1.".to_string()];
        let e = Tok::build_word_level(&bad, &["<pad>"]).unwrap_err();
        assert!(e.to_string().contains("single pre-token"), "{e}");
        // Existing [UNK] among specials keeps its position.
        let tok = Tok::build_word_level(&words(), &["[UNK]", "<eos>"]).unwrap();
        assert_eq!(tok.token_id(UNK_TOKEN), Some(0));
        assert_eq!(tok.token_id("<eos>"), Some(1));
        assert!(Tok::from_file(Path::new("/nonexistent/tokenizer.json")).is_err());
    }

    #[test]
    fn words_outside_a_word_level_vocabulary_are_named() {
        let words: Vec<String> = ["go", "to", "the", "cabinet", "1"]
            .iter()
            .map(|w| w.to_string())
            .collect();
        let tok = Tok::build_word_level(&words, &["[PAD]", "[EOS]"]).unwrap();
        let bad = tok.unencodable_words(["go to cabinet 1", "go to the fridge 1", "open fridge 1"]);
        assert_eq!(bad, ["fridge", "open"]);
        assert!(tok.unencodable_words(["go to the cabinet 1"]).is_empty());
    }
}
