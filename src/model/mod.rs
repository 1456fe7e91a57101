//! Policy model: a Llama-style decoder in candle, its tokenizer, and the
//! pieces generation needs.
//!
//! - [`config`]: [`ModelConfig`] (dimensions) and [`Arch`] (family:
//!   Llama / Qwen2 / Qwen3, attention biases, `rope_scaling`), HF
//!   `config.json` compatible.
//! - [`device`]: devices by name (`cpu`, `cuda`, `cuda:N`).
//! - [`error`]: [`ModelError`], the error type of everything here.
//! - [`gguf`]: GGUF files (llama.cpp): [`Policy::from_gguf`] (metadata →
//!   config, dequantised tensors, Q/K un-permute) and
//!   [`Policy::write_gguf`].
//! - [`gguf_tokenizer`]: byte-level BPE tokenizers from GGUF metadata
//!   ([`Tok::from_gguf`], [`GgufVocab`]).
//! - [`hf`]: HF model folders and safetensors: [`Policy::from_hf_dir`] /
//!   [`Policy::save_hf_dir`] (`config.json` + single or sharded
//!   safetensors), [`Policy::load_safetensors`] /
//!   [`Policy::save_safetensors`].
//! - [`kernels`]: [`Kernels`], the CPU path chosen at start-up (bf16
//!   rollout weights and mixed-precision training where the CPU has AMX
//!   and MKL is loaded, f32 elsewhere) and the header line that names it.
//! - [`llama`]: [`Policy`], the model, one concept per file: its weights
//!   (random init, building from named tensors), the decoder block,
//!   differentiable scoring ([`Policy::score`]) for training, and batched,
//!   KV-cached, optionally constrained generation ([`Policy::generate`])
//!   for rollouts. Its tests live in `llama/tests/` (incl. an independent
//!   f64 reference forward and a cross-check against candle-transformers'
//!   Llama).
//! - [`lora`]: LoRA settings, adapted projections and PEFT file layout
//!   ([`LoraConfig`]); the adapters live in [`Policy`], and the methods
//!   that attach, apply, merge and save them are in `lora/adapters.rs`
//!   ([`Policy::with_lora`], [`Policy::merged`], [`Policy::save_adapter`]).
//! - [`memory`]: the peak-memory estimate of a training run of the policy
//!   (weights, optimiser state, KL reference, rollout, activations) and the
//!   refusal of a run that cannot fit, checked before loading and before
//!   the first step.
//! - [`precision`]: [`Precision`] (`model.dtype`: f32 or bf16 compute
//!   with f32 master weights and optimiser state).
//! - [`names`]: every weight's checkpoint name (HF, GGUF, PEFT), stated
//!   once.
//! - [`source`]: [`ModelSource`], what a `model.path` names (HF folder or
//!   GGUF file) with its tokenizer side files.
//! - `sampler` (private): token choice from a row of logits (temperature,
//!   top-p, greedy, constrained), kept apart from the model.
//! - `ops` (private): fused CPU kernels *with* backward passes (causal
//!   softmax, RMSNorm, rotary, SwiGLU, target log-prob + entropy) used by
//!   the model, with composite-candle fallbacks for non-CPU devices.
//! - [`trie`]: [`TokenTrie`], prefix tree of admissible actions for
//!   constrained decoding.
//! - [`tokenizer`]: [`Tok`], a thin wrapper over `tokenizers` (word-level
//!   vocabularies for tiny models, `tokenizer.json` for real ones).

pub mod config;
pub mod device;
pub mod error;
pub mod gguf;
pub mod gguf_file;
pub mod gguf_tokenizer;
pub mod hf;
pub mod kernels;
pub mod llama;
pub mod lora;
pub mod memory;
pub mod names;
mod ops;
pub mod precision;
mod sampler;
pub mod source;
pub mod tokenizer;
pub mod trie;

pub use config::{Arch, Family, ModelConfig, RopeScaling};
pub use error::ModelError;
pub use gguf::{gguf_config, GgmlDType, GgufFile};
pub use gguf_tokenizer::GgufVocab;
pub use kernels::{CpuInfo, Kernels};
pub(crate) use llama::lcp;
pub use llama::{
    note_weights_changed, GenerateOptions, Generated, Policy, ScoreBatch, ScoreOutput,
};
pub use lora::{LoraConfig, Proj};
pub use ops::{
    cpu_has_amx_bf16, decode_kernel, fused_attention_available, matmul_backend,
    mixed_precision_available, packed_f32_rollout_bytes, packed_rollout_bytes,
};
pub use precision::Precision;
pub use source::ModelSource;
pub use tokenizer::Tok;
pub use trie::TokenTrie;
