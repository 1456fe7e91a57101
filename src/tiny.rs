//! The built-in tiny model cards (`models/tiny/` for the household env,
//! `models/tiny-shop/`, `models/tiny-searchqa/`): a word-level tokenizer
//! over one built-in env's vocabulary plus the prompt scaffold, saved as a
//! standard `tokenizer.json`, and a small Llama-style `config.json`. No
//! weights: a run initialises them from its seed.

use std::path::Path;

use crate::env::BuiltinEnv;
use crate::model::{ModelConfig, ModelError, Tok};
use crate::rollout::prompt::SCAFFOLD_WORDS;

/// Special tokens, in id order.
pub const SPECIALS: [&str; 4] = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"];

/// The tiny policy's architecture for a vocabulary of `vocab_size`.
pub fn tiny_config(vocab_size: usize) -> ModelConfig {
    ModelConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        vocab_size,
        hidden_size: 128,
        intermediate_size: 384,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: None,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 1024,
        tie_word_embeddings: true,
        bos_token_id: Some(2),
        eos_token_id: Some(3),
        pad_token_id: Some(0),
        initializer_range: 0.02,
    }
}

/// The household tiny tokenizer.
pub fn tiny_tokenizer() -> Result<Tok, ModelError> {
    tiny_tokenizer_for(BuiltinEnv::Household)
}

/// The tiny tokenizer of a built-in env: specials, then every env and
/// scaffold word.
pub fn tiny_tokenizer_for(env: BuiltinEnv) -> Result<Tok, ModelError> {
    let vocab = env.vocabulary();
    // The tokenizer lower-cases its input, so the vocabulary is lower-cased too.
    let mut words: Vec<String> = vocab.iter().map(|w| w.to_lowercase()).collect();
    words.extend(SCAFFOLD_WORDS.iter().map(|s| s.to_string()));
    words.sort();
    words.dedup();
    Tok::build_word_level(&words, &SPECIALS)
}

/// The pre-tokens of `text` as the tiny tokenizer splits it (lower-cased,
/// then the `Whitespace` pre-tokenizer: runs of word characters, runs of
/// punctuation).
fn pre_tokens(text: &str) -> Result<Vec<String>, ModelError> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let lower = text.to_lowercase();
    let mut pts = PreTokenizedString::from(lower.as_str());
    tokenizers::pre_tokenizers::whitespace::Whitespace {}
        .pre_tokenize(&mut pts)
        .map_err(|e| ModelError::Tokenizer {
            path: "<word-level tokenizer>".into(),
            msg: e.to_string(),
        })?;
    Ok(pts
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(s, _, _)| s.to_string())
        .collect())
}

/// Every string inside a JSON value (a task's `world`).
fn strings_in(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|x| strings_in(x, out)),
        serde_json::Value::Object(m) => m.values().for_each(|x| strings_in(x, out)),
        _ => {}
    }
}

/// A tiny tokenizer for any env, external ones included, from its task
/// panels: the words of every goal, expert action and `world` string, of
/// what the env showed while the panels were built (`seen`: observations
/// and admissible actions, see [`crate::env::harvest::Seen`]), plus the
/// prompt scaffold. (Words an env shows only off the expert's path are in
/// neither; the run counts actions it cannot encode.)
pub fn tiny_tokenizer_from_panels(
    tasks: &[crate::env::Task],
    seen: &[crate::env::harvest::Seen],
) -> Result<Tok, ModelError> {
    let mut texts: Vec<String> = Vec::new();
    for t in tasks {
        texts.push(t.goal.clone());
        texts.extend(t.expert.iter().cloned());
        strings_in(&t.world, &mut texts);
    }
    for s in seen {
        texts.extend(s.actions.iter().cloned());
        texts.extend(s.words.iter().cloned());
    }
    let mut words: Vec<String> = SCAFFOLD_WORDS.iter().map(|s| s.to_string()).collect();
    for t in &texts {
        words.extend(pre_tokens(t)?);
    }
    words.sort();
    words.dedup();
    Tok::build_word_level(&words, &SPECIALS)
}

/// Write a tiny card whose vocabulary comes from task panels into `out`.
pub fn write_tiny_model_from_panels(
    tasks: &[crate::env::Task],
    seen: &[crate::env::harvest::Seen],
    out: &Path,
) -> Result<(ModelConfig, usize), ModelError> {
    write_card(&tiny_tokenizer_from_panels(tasks, seen)?, out)
}

/// Write `tok` and the tiny config for its vocabulary into `out`.
fn write_card(tok: &Tok, out: &Path) -> Result<(ModelConfig, usize), ModelError> {
    std::fs::create_dir_all(out).map_err(|e| ModelError::Io {
        path: out.to_path_buf(),
        source: e,
    })?;
    let cfg = tiny_config(tok.vocab_size());
    tok.save(&out.join("tokenizer.json"))?;
    cfg.save(&out.join("config.json"))?;
    Ok((cfg, tok.vocab_size()))
}

/// Write a built-in env's tiny card (`config.json` and `tokenizer.json`)
/// into `out`.
pub fn write_tiny_model_for(
    env: BuiltinEnv,
    out: &Path,
) -> Result<(ModelConfig, usize), ModelError> {
    write_card(&tiny_tokenizer_for(env)?, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{panel, Env};

    fn root() -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    #[test]
    fn committed_tiny_card_matches_the_generator() {
        let tok = Tok::from_file(&root().join("models/tiny/tokenizer.json")).unwrap();
        let fresh = tiny_tokenizer().unwrap();
        assert_eq!(tok.vocab_size(), fresh.vocab_size());
        for w in ["go", "to", "cabinet", "1", "[EOS]", "action", ":"] {
            assert_eq!(tok.token_id(w), fresh.token_id(w), "{w}");
        }
        let cfg = ModelConfig::from_file(&root().join("models/tiny/config.json")).unwrap();
        assert_eq!(cfg, tiny_config(fresh.vocab_size()));
        assert_eq!(tok.token_id("[EOS]"), cfg.eos_token_id);
        assert_eq!(tok.token_id("[BOS]"), cfg.bos_token_id);
    }

    #[test]
    fn a_vocabulary_from_panels_encodes_every_panel_text() {
        // A panel of shop tasks, as an external env's would be: the
        // household vocabulary lacks its words, the panel's own has them.
        let tasks = panel::read_jsonl(&root().join("envs/shop/test.jsonl")).unwrap();
        let texts: Vec<&str> = tasks
            .iter()
            .flat_map(|t| {
                std::iter::once(t.goal.as_str()).chain(t.expert.iter().map(String::as_str))
            })
            .collect();
        assert!(!tiny_tokenizer()
            .unwrap()
            .unencodable_words(texts.clone())
            .is_empty());
        let tok = tiny_tokenizer_from_panels(&tasks, &[]).unwrap();
        assert_eq!(tok.unencodable_words(texts), Vec::<String>::new());
        for w in SCAFFOLD_WORDS {
            assert!(tok.token_id(w).is_some(), "{w}");
        }
        let tmp = tempfile::tempdir().unwrap();
        let (cfg, n) = write_tiny_model_from_panels(&tasks, &[], tmp.path()).unwrap();
        assert_eq!(cfg.vocab_size, n);
        let back = Tok::from_file(&tmp.path().join("tokenizer.json")).unwrap();
        assert_eq!(back.vocab_size(), n);
    }

    #[test]
    fn what_the_env_showed_joins_the_panels_vocabulary() {
        let tasks = panel::read_jsonl(&root().join("envs/shop/test.jsonl")).unwrap();
        let mut seen = crate::env::harvest::Seen::default();
        seen.record(
            &crate::env::Observation {
                text: "You stand in the Boudoir. On the vanity 2 you see a lip-liner.".into(),
                admissible: vec!["take lip liner from vanity 2".into()],
                done: false,
                reward: 0.0,
                success: false,
                valid: true,
                info: Default::default(),
            },
            "You carry a thimble.",
        );
        let shown = [
            "take lip liner from vanity 2",
            "you stand in the boudoir",
            "lip-liner.",
            "you carry a thimble",
        ];
        let bare = tiny_tokenizer_from_panels(&tasks, &[]).unwrap();
        assert!(!bare.unencodable_words(shown).is_empty());
        let tok = tiny_tokenizer_from_panels(&tasks, &[seen]).unwrap();
        assert_eq!(tok.unencodable_words(shown), Vec::<String>::new());
    }

    #[test]
    fn every_committed_panel_expert_word_is_in_its_tiny_vocabulary() {
        for (card, env) in [
            ("tiny", "household"),
            ("tiny-shop", "shop"),
            ("tiny-searchqa", "searchqa"),
        ] {
            let tok =
                Tok::from_file(&root().join(format!("models/{card}/tokenizer.json"))).unwrap();
            for split in ["train", "test"] {
                let tasks =
                    panel::read_jsonl(&root().join(format!("envs/{env}/{split}.jsonl"))).unwrap();
                let bad = tok.unencodable_words(
                    tasks
                        .iter()
                        .flat_map(|t| t.expert.iter().map(String::as_str)),
                );
                assert!(bad.is_empty(), "{env}/{split}: {bad:?}");
            }
        }
    }

    #[test]
    fn committed_shop_and_searchqa_cards_match_the_generator() {
        for env in [BuiltinEnv::Shop, BuiltinEnv::SearchQa] {
            let dir = root().join(format!("models/tiny-{env}"));
            let tok = Tok::from_file(&dir.join("tokenizer.json")).unwrap();
            let fresh = tiny_tokenizer_for(env).unwrap();
            assert_eq!(tok.vocab_size(), fresh.vocab_size(), "{env}");
            let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
            assert_eq!(cfg, tiny_config(fresh.vocab_size()), "{env}");
        }
    }

    #[test]
    fn shop_and_searchqa_expert_episodes_encode_without_unknown_tokens() {
        use crate::rollout::prompt::{render, PromptParts};
        for env_kind in [BuiltinEnv::Shop, BuiltinEnv::SearchQa] {
            let tok = tiny_tokenizer_for(env_kind).unwrap();
            let unk = tok.token_id("[UNK]").unwrap();
            let tasks =
                panel::read_jsonl(&root().join(format!("envs/{env_kind}/train.jsonl"))).unwrap();
            for t in tasks.iter().take(40) {
                let mut env = env_kind.env(50);
                let obs = env.reset(t).unwrap();
                let mut texts = vec![t.goal.clone(), obs.text, env.status()];
                texts.extend(obs.admissible);
                for a in &t.expert {
                    let o = env.step(a).unwrap();
                    texts.push(a.clone());
                    texts.push(o.text);
                    texts.push(env.status());
                    texts.extend(o.admissible);
                }
                texts.push(render(&PromptParts {
                    goal: &t.goal,
                    plan: &t.expert,
                    history: &[],
                    window: 1,
                    status: "",
                    observation: "",
                    admissible: &[],
                    show_actions: true,
                    conversation: false,
                }));
                for s in texts {
                    let ids = tok.encode(&s).unwrap();
                    assert!(!ids.contains(&unk), "{env_kind}: unknown word in {s:?}");
                }
            }
        }
    }

    #[test]
    fn panels_and_env_text_encode_without_unknown_tokens() {
        let tok = tiny_tokenizer().unwrap();
        let unk = tok.token_id("[UNK]").unwrap();
        for f in ["train", "test"] {
            let tasks =
                panel::read_jsonl(&root().join(format!("envs/household/{f}.jsonl"))).unwrap();
            for t in tasks.iter().take(40) {
                let mut env = crate::env::household::HouseholdEnv::new(50);
                let obs = env.reset(t).unwrap();
                let mut texts = vec![t.goal.clone(), obs.text, env.status()];
                texts.extend(obs.admissible);
                for a in &t.expert {
                    let o = env.step(a).unwrap();
                    texts.push(a.clone());
                    texts.push(o.text);
                    texts.push(env.status());
                }
                for s in texts {
                    let ids = tok.encode(&s).unwrap();
                    assert!(!ids.contains(&unk), "unknown word in {s:?}");
                }
            }
        }
    }
}
