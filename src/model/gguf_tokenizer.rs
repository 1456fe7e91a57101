//! Tokenizers stored in GGUF metadata (`tokenizer.ggml.*`), rebuilt as a
//! standard `tokenizers::Tokenizer` and wrapped as our [`Tok`].
//!
//! This module owns the vocabulary keys ([`GgufVocab`]) and the choice of
//! pre-tokenizer from `tokenizer.ggml.pre`. Only byte-level BPE
//! (`tokenizer.ggml.model = "gpt2"`, used by SmolLM2, Qwen2/2.5/3 and
//! Llama 3) is supported; SentencePiece (`"llama"`) vocabularies are
//! refused.
//!
//! Pre-tokenizers follow llama.cpp's `llm_tokenizer_bpe` (llama-vocab.cpp),
//! which applies its regexes one after the other, each to the pieces of
//! the previous one; they are written in the form the models' own HF
//! `tokenizer.json` files use:
//! - `gpt2` / `gpt-2` / `phi-2` / `olmo` / `mpt` (and an absent key):
//!   GPT-2's regex
//!   `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
//!   i.e. `ByteLevel { use_regex: true }`.
//! - `smollm` (and `starcoder`, `refact`, `command-r`, `codeshell`):
//!   llama.cpp's `["\p{N}", <GPT-2 regex>]`: every number character on its
//!   own, then GPT-2; SmolLM2's `tokenizer.json` says the same with
//!   `Digits { individual_digits: true }` + `ByteLevel`.
//! - `qwen2` (and `deepseek-r1-qwen`, `megrez`, `stablelm2`):
//!   `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//!   (single digits), as an isolated `Split` then byte-level mapping.
//! - `llama-bpe` / `llama3` / `llama-v3` / `dbrx` / `smaug-bpe` (Llama 3):
//!   the same with `\p{N}{1,3}`, and `ignore_merges` (a piece that is a
//!   whole vocabulary entry is emitted as is, like llama.cpp's
//!   `tokenizer_ignore_merges` and Llama 3's `tokenizer.json`).
//!
//! Any other value is refused rather than tokenised differently from
//! llama.cpp. Tokens typed CONTROL (3) become special added tokens and
//! USER_DEFINED (4) plain added tokens: both match verbatim in text and
//! encode as their single id; [`Tok::decode`] skips the special ones.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use candle_core::quantized::gguf_file::Value;
use serde_json::{json, Map, Value as Json};
use tokenizers::Tokenizer;

use super::error::{ModelError, Result};
use super::gguf_file::{GgufFile, Meta};
use super::tokenizer::Tok;

/// llama.cpp token types (`tokenizer.ggml.token_type`).
pub const TOKEN_TYPE_NORMAL: i32 = 1;
/// Unknown-token type.
pub const TOKEN_TYPE_UNKNOWN: i32 = 2;
/// Control tokens (`<|im_start|>`, `<|endoftext|>`): special added tokens.
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// User-defined tokens: matched verbatim, not special.
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// GPT-2's pre-tokenizer regex (what `ByteLevel { use_regex: true }` runs).
pub const GPT2_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Qwen2's pre-tokenizer regex (its `tokenizer.json`; llama.cpp `QWEN2`).
pub const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pre-tokenizer regex (its `tokenizer.json`; llama.cpp `LLAMA3`).
pub const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer families llama.cpp's `tokenizer.ggml.pre` selects
/// (see the module docs for the names mapped to each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    Gpt2,
    SmolLm,
    Qwen2,
    Llama3,
}

impl PreTokenizer {
    /// The family of a `tokenizer.ggml.pre` value (`None`: key absent).
    pub fn from_gguf_name(name: Option<&str>) -> Option<Self> {
        Some(match name {
            None | Some("gpt2" | "gpt-2" | "phi-2" | "olmo" | "mpt") => PreTokenizer::Gpt2,
            Some("smollm" | "starcoder" | "refact" | "command-r" | "codeshell") => {
                PreTokenizer::SmolLm
            }
            Some("qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2") => PreTokenizer::Qwen2,
            Some("llama-bpe" | "llama3" | "llama-v3" | "dbrx" | "smaug-bpe") => {
                PreTokenizer::Llama3
            }
            Some(_) => return None,
        })
    }

    const SUPPORTED: &'static str = "gpt2, gpt-2, phi-2, olmo, mpt, smollm, starcoder, refact, \
        command-r, codeshell, qwen2, deepseek-r1-qwen, megrez, stablelm2, llama-bpe, llama3, \
        llama-v3, dbrx, smaug-bpe";

    /// `tokenizer.json` form.
    fn to_json(self) -> Json {
        let byte_level = |use_regex: bool| {
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                   "use_regex": use_regex})
        };
        let split = |re: &str| {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ]})
        };
        match self {
            PreTokenizer::Gpt2 => byte_level(true),
            PreTokenizer::SmolLm => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            PreTokenizer::Qwen2 => split(QWEN2_REGEX),
            PreTokenizer::Llama3 => split(LLAMA3_REGEX),
        }
    }
}

/// The `tokenizer.ggml.*` metadata of a byte-level BPE vocabulary.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`; only `"gpt2"` (byte-level BPE) is supported.
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, in the byte-level alphabet (`Ġ` = space).
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, one per token; empty means all normal.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`, `"left right"`, by priority.
    pub merges: Vec<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
}

impl GgufVocab {
    /// Reads the vocabulary keys; `file` names the source in errors.
    pub fn from_metadata(md: &HashMap<String, Value>, file: &str) -> Result<Self> {
        let m = Meta { md, file };
        let model = m.str("tokenizer.ggml.model")?.to_string();
        let pre = m.opt_str("tokenizer.ggml.pre")?.map(str::to_string);
        let tokens = m
            .opt_str_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| m.missing("tokenizer.ggml.tokens"))?;
        let token_types = m
            .opt_i64_array("tokenizer.ggml.token_type")?
            .unwrap_or_default()
            .into_iter()
            .map(|t| i32::try_from(t).unwrap_or(0))
            .collect();
        let merges = m
            .opt_str_array("tokenizer.ggml.merges")?
            .unwrap_or_default();
        let id = |k: &str| -> Result<Option<u32>> {
            Ok(m.opt_u64(k)?.and_then(|v| u32::try_from(v).ok()))
        };
        Ok(GgufVocab {
            model,
            pre,
            tokens,
            token_types,
            merges,
            bos_token_id: id("tokenizer.ggml.bos_token_id")?,
            eos_token_id: id("tokenizer.ggml.eos_token_id")?,
            unknown_token_id: id("tokenizer.ggml.unknown_token_id")?,
            padding_token_id: id("tokenizer.ggml.padding_token_id")?,
        })
    }

    /// The metadata entries that describe this vocabulary (special ids
    /// included when set), for writing a GGUF file.
    pub fn to_metadata(&self) -> Vec<(String, Value)> {
        let strs = |v: &[String]| Value::Array(v.iter().cloned().map(Value::String).collect());
        let mut md = vec![
            (
                "tokenizer.ggml.model".to_string(),
                Value::String(self.model.clone()),
            ),
            ("tokenizer.ggml.tokens".to_string(), strs(&self.tokens)),
        ];
        if let Some(p) = &self.pre {
            md.push(("tokenizer.ggml.pre".into(), Value::String(p.clone())));
        }
        if !self.token_types.is_empty() {
            md.push((
                "tokenizer.ggml.token_type".into(),
                Value::Array(self.token_types.iter().map(|&t| Value::I32(t)).collect()),
            ));
        }
        if !self.merges.is_empty() {
            md.push(("tokenizer.ggml.merges".into(), strs(&self.merges)));
        }
        for (k, v) in [
            ("tokenizer.ggml.bos_token_id", self.bos_token_id),
            ("tokenizer.ggml.eos_token_id", self.eos_token_id),
            ("tokenizer.ggml.unknown_token_id", self.unknown_token_id),
            ("tokenizer.ggml.padding_token_id", self.padding_token_id),
        ] {
            if let Some(v) = v {
                md.push((k.to_string(), Value::U32(v)));
            }
        }
        md
    }

    /// The `tokenizer.json` document of this vocabulary. `file` names the
    /// source in errors.
    pub fn to_tokenizer_json(&self, file: &str) -> Result<Json> {
        let bad = |key: &str, msg: String| ModelError::BadMetadata {
            file: file.to_string(),
            key: key.to_string(),
            msg,
        };
        if self.model != "gpt2" {
            return Err(bad(
                "tokenizer.ggml.model",
                format!(
                    "tokenizer model `{}` is not supported (only \"gpt2\", byte-level BPE)",
                    self.model
                ),
            ));
        }
        let pre = PreTokenizer::from_gguf_name(self.pre.as_deref()).ok_or_else(|| {
            bad(
                "tokenizer.ggml.pre",
                format!(
                    "pre-tokenizer `{}` is not supported (supported: {})",
                    self.pre.as_deref().unwrap_or(""),
                    PreTokenizer::SUPPORTED
                ),
            )
        })?;
        if !self.token_types.is_empty() && self.token_types.len() != self.tokens.len() {
            return Err(bad(
                "tokenizer.ggml.token_type",
                format!(
                    "{} entries for {} tokens",
                    self.token_types.len(),
                    self.tokens.len()
                ),
            ));
        }
        let mut vocab = Map::new();
        let mut added = Vec::new();
        for (id, tok) in self.tokens.iter().enumerate() {
            if tok.is_empty() {
                return Err(bad("tokenizer.ggml.tokens", format!("token {id} is empty")));
            }
            // llama.cpp keeps the last id of a duplicated string; so do we.
            vocab.insert(tok.clone(), json!(id));
            let ty = self
                .token_types
                .get(id)
                .copied()
                .unwrap_or(TOKEN_TYPE_NORMAL);
            if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                added.push(json!({"id": id, "content": tok, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false,
                    "special": ty == TOKEN_TYPE_CONTROL}));
            }
        }
        let merges = self
            .merges
            .iter()
            .enumerate()
            .map(|(i, m)| {
                // llama.cpp splits at the first space after the first
                // character (`find(' ', 1)`).
                let split = m.char_indices().skip(1).find(|&(_, c)| c == ' ');
                match split.map(|(p, _)| p) {
                    Some(p) if p + 1 < m.len() => Ok(json!([&m[..p], &m[p + 1..]])),
                    _ => Err(bad(
                        "tokenizer.ggml.merges",
                        format!("merge {i} ({m:?}) is not \"left right\""),
                    )),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre.to_json(),
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                        "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": pre == PreTokenizer::Llama3,
                "vocab": Json::Object(vocab), "merges": merges,
            },
        }))
    }
}

impl Tok {
    /// The tokenizer stored in a GGUF file's metadata (the header only is
    /// read). Errors: [`ModelError::NotGguf`], missing or unsupported
    /// `tokenizer.ggml.*` keys ([`ModelError::MissingMetadata`],
    /// [`ModelError::BadMetadata`]).
    pub fn from_gguf(path: &Path) -> Result<Tok> {
        let g = GgufFile::open(path)?;
        let file = path.display().to_string();
        let vocab = GgufVocab::from_metadata(g.metadata(), &file)?;
        Tok::from_gguf_vocab(&vocab, path)
    }

    /// Builds the tokenizer of a [`GgufVocab`]; `origin` names it in errors.
    pub fn from_gguf_vocab(vocab: &GgufVocab, origin: &Path) -> Result<Tok> {
        let file = origin.display().to_string();
        let doc = vocab.to_tokenizer_json(&file)?;
        let inner = Tokenizer::from_str(&doc.to_string()).map_err(|e| ModelError::Tokenizer {
            path: PathBuf::from(origin),
            msg: format!("cannot build the GGUF tokenizer: {e}"),
        })?;
        Ok(Tok::from_parts(inner, origin.to_path_buf()))
    }
}
