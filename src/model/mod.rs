//! Policy model: a Llama-style decoder in candle, its tokenizer, and the
//! pieces generation needs.
//!
//! - [`config`]: [`ModelConfig`], HF `LlamaForCausalLM` `config.json`
//!   compatible.
//! - [`error`]: [`ModelError`], the error type of everything here.
//! - [`llama`]: [`Policy`], the model: random init / HF safetensors I/O,
//!   differentiable scoring ([`Policy::score`]) for training and batched,
//!   KV-cached, optionally constrained generation ([`Policy::generate`]) for
//!   rollouts.
//!   Its tests live in `llama_tests.rs` (incl. an independent f64 reference
//!   forward and a cross-check against candle-transformers' Llama).
//! - `ops` (private): fused CPU kernels *with* backward passes (causal
//!   softmax, RMSNorm, rotary, SwiGLU, target log-prob + entropy) used by
//!   the model, with composite-candle fallbacks for non-CPU devices.
//! - [`trie`]: [`TokenTrie`], prefix tree of admissible actions for
//!   constrained decoding.
//! - [`tokenizer`]: [`Tok`], a thin wrapper over `tokenizers` (word-level
//!   vocabularies for tiny models, `tokenizer.json` for real ones).

pub mod config;
pub mod error;
pub mod llama;
mod ops;
pub mod tokenizer;
pub mod trie;

pub use config::ModelConfig;
pub use error::ModelError;
pub use llama::{GenerateOptions, Generated, Policy, ScoreBatch, ScoreOutput};
pub use tokenizer::Tok;
pub use trie::TokenTrie;
