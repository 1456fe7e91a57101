//! The policy: a Llama-style decoder (HF `LlamaForCausalLM`,
//! `Qwen2ForCausalLM` and `Qwen3ForCausalLM` layouts and weight names) with
//! a differentiable scoring path for training and a batched, KV-cached
//! generation path for rollouts.
//!
//! Architecture: token embedding, `num_hidden_layers` blocks of
//! (RMSNorm → grouped-query attention with rotary embeddings in the HF
//! rotate-half layout → residual, RMSNorm → SwiGLU MLP → residual), final
//! RMSNorm, LM head (tied to the embedding or its own `lm_head.weight`).
//! The [`Arch`] adds, per family: q/k/v(/o) projection biases (Qwen2, or
//! `attention_bias`), per-head RMSNorm of q and k before rotary (Qwen3),
//! and rescaled rotary frequencies (`rope_scaling`). Both paths (scoring
//! and generation) run the same block code, so they cannot diverge by
//! architecture.
//!
//! The compute dtype is f32 or bf16 ([`Precision`]; f32 master weights
//! and optimiser state either way). The training path never uses candle's fused
//! kernels (`softmax_last_dim`, `rms_norm`, `rope*`, `sdpa`): they have no
//! backward pass and candle silently drops the gradient through them.
//! Instead it uses this module's own fused CPU kernels *with* backward
//! passes (`ops`: causal softmax, RMSNorm, rotary, SwiGLU, target
//! log-prob + entropy), which fall back to composite candle ops on other
//! devices. Generation runs on detached weights and may use candle's
//! forward-only kernels.
//!
//! Both paths run the trunk in chunks of sequences (longest first) so that
//! no activation grows past a few MB (see `CHUNK_BUDGET` in the source);
//! scoring with `share_prefixes` runs chunks of packed prefix trees
//! instead (`pack`), by the same budget.
//!
//! Files, one concept each:
//! - `weights`: the parameter tensors (`Weights`, `LayerW`), their HF
//!   names and shapes (names from [`crate::model::names`]) and the
//!   constructors that check a checkpoint against them;
//! - `block`: the trunk shared by both paths (embedding, decoder block =
//!   attention + MLP, final norm and head, chunk planning);
//! - `score`: the differentiable scoring path ([`Policy::score`]);
//! - `pack`: prefix-tree packing of sequences that share prefixes, for
//!   scoring them once;
//! - `cache`: the per-layer KV cache of a generation batch;
//! - `generate`: batched, KV-cached generation ([`Policy::generate`]):
//!   prefill, decode steps, cache compaction; token choice is
//!   `crate::model::sampler`'s.
//!
//! LoRA adapters on the policy live in [`crate::model::lora`], HF
//! safetensors I/O in [`crate::model::hf`], GGUF I/O in
//! [`crate::model::gguf`].

use std::sync::{Arc, Mutex};

use std::collections::{HashMap, HashSet};

use candle_core::{DType, Device, Tensor, Var};
use rand_chacha::ChaCha8Rng;

use super::config::{Arch, ModelConfig};
use super::error::Result;
use super::lora::LoraConfig;
use super::precision::Precision;

mod block;
mod cache;
mod generate;
pub(in crate::model) mod pack;
mod score;
mod weights;

pub(in crate::model) use block::linear;
pub use generate::{GenerateOptions, Generated};
pub(crate) use pack::lcp;
pub use score::{ScoreBatch, ScoreOutput};
pub use weights::note_weights_changed;
pub(crate) use weights::{weights_epoch, Adapter, LayerW, Weights};

/// The policy model. Trainable instances hold candle [`Var`]s (updated in
/// place by the optimiser); [`Policy::frozen_copy`] instances hold plain,
/// detached tensors.
///
/// Every policy is built by [`Policy::new`] from [`PolicyParts`]: the
/// loaders (HF folders, GGUF files, random init, merged adapters) through
/// `Policy::assemble`, which checks named tensors first, and LoRA and
/// frozen copies directly. The fields are private to `llama`; the LoRA,
/// HF and GGUF code (`lora`, `hf`, `gguf`) reach them through accessors.
pub struct Policy {
    cfg: ModelConfig,
    arch: Arch,
    device: Device,
    /// Compute dtype (F32 or BF16, see [`Precision`]): frozen tensors in
    /// `w` are stored in it, trained `Var`s stay f32 master copies.
    dtype: DType,
    w: Weights,
    /// Sorted by name; empty for frozen copies.
    vars: Vec<(String, Var)>,
    /// Rotary inverse frequencies, `head_dim / 2` of them, computed in f32
    /// like HF does.
    inv_freq: Vec<f32>,
    /// LoRA settings when adapters are attached (then `vars` holds only
    /// the adapters and the base weights are detached).
    lora: Option<LoraConfig>,
    /// Source of LoRA dropout masks for the next [`Policy::score`] calls
    /// (see [`Policy::set_dropout_seed`]); `None`: no dropout.
    dropout_rng: Mutex<Option<ChaCha8Rng>>,
    /// Generate from bf16 copies of the projection and head weights (see
    /// [`Policy::set_rollout_bf16`]).
    rollout_bf16: bool,
    /// Train with bf16 products (see [`Policy::set_mixed_precision`]).
    mixed_precision: bool,
    /// Under LoRA with mixed precision: the frozen base's product weights
    /// in bf16, rounded once, keyed by the ids of the tensors each was
    /// made from (two for the fused gate/up).
    frozen_bf16: Mutex<HashMap<Vec<candle_core::TensorId>, Arc<crate::model::ops::FrozenBf16>>>,
    /// The last bf16 rollout weights, keyed by the source tensors' ids and
    /// the weights epoch (so an optimiser step or a replaced tensor
    /// rebuilds them).
    rollout_cache: Mutex<Option<RolloutCache>>,
}

/// What a [`Policy`] is made of; the rest of its state (rotary
/// frequencies, dropout stream, rollout weights) starts from these.
pub(in crate::model) struct PolicyParts {
    pub cfg: ModelConfig,
    pub arch: Arch,
    pub device: Device,
    /// The compute dtype `w`'s frozen tensors are stored in.
    pub dtype: DType,
    pub w: Weights,
    /// The trained tensors of `w` (or of its adapters), sorted by name;
    /// empty for a frozen policy.
    pub vars: Vec<(String, Var)>,
    pub lora: Option<LoraConfig>,
}

/// Cached generation weights and what they were derived from.
struct RolloutCache {
    key: (u64, Vec<candle_core::TensorId>),
    w: Weights,
    /// MKL-packed copies of `w`'s bf16 products, for decode-sized batches
    /// (freed with the cache entry).
    packed: Option<crate::model::ops::PackedWeights>,
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("cfg", &self.cfg)
            .field("arch", &self.arch)
            .field("device", &self.device)
            .field("dtype", &self.dtype)
            .field("num_params", &self.num_params())
            .field("trainable", &!self.vars.is_empty())
            .field("lora", &self.lora)
            .finish()
    }
}

impl Policy {
    /// The one constructor: a policy of `parts`, without dropout and
    /// generating from its own weights (no bf16 rollout copies).
    pub(in crate::model) fn new(parts: PolicyParts) -> Policy {
        let PolicyParts {
            cfg,
            arch,
            device,
            dtype,
            w,
            vars,
            lora,
        } = parts;
        Policy {
            inv_freq: arch.inv_freq(&cfg),
            cfg,
            arch,
            device,
            dtype,
            w,
            vars,
            lora,
            dropout_rng: Mutex::new(None),
            rollout_bf16: false,
            mixed_precision: false,
            frozen_bf16: Mutex::new(HashMap::new()),
            rollout_cache: Mutex::new(None),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The architecture variant (family, biases, rope scaling).
    pub fn arch(&self) -> &Arch {
        &self.arch
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The LoRA settings, when adapters are attached.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// The compute dtype (see [`Policy::precision`]).
    pub(in crate::model) fn dtype(&self) -> DType {
        self.dtype
    }

    /// The stored weights (trained `Var`s as f32 masters, frozen tensors in
    /// the compute dtype).
    pub(in crate::model) fn weights(&self) -> &Weights {
        &self.w
    }

    /// The LoRA dropout stream (see [`Policy::set_dropout_seed`]).
    pub(in crate::model) fn dropout_rng(&self) -> std::sync::MutexGuard<'_, Option<ChaCha8Rng>> {
        self.dropout_rng.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Generate from bf16 copies of the projection and LM-head weights
    /// (cached until an optimiser step or a replaced tensor makes them
    /// stale, see [`note_weights_changed`]), multiplied on the BLAS's bf16 kernels (AMX on
    /// CPUs that have it) with f32 accumulation; everything else (norms,
    /// attention, embeddings, sampling) stays f32, and scoring and training
    /// are untouched. Decode reads half the bytes per token. The sampled
    /// tokens' log-probs then come from the bf16 model: a run corrects for
    /// the mismatch as it does for an inference engine (π_old rescored,
    /// truncated importance weights). Only on the CPU, in f32, with a BLAS
    /// that has bf16 products (MKL).
    pub fn set_rollout_bf16(&mut self, on: bool) -> Result<()> {
        if on
            && !(self.device.is_cpu()
                && self.dtype == DType::F32
                && crate::model::ops::bf16_rollouts_available())
        {
            return Err(crate::model::ModelError::InvalidArgument(format!(
                "bf16 rollout weights need the CPU, f32 compute and a BLAS with bf16 products (MKL: scripts/install-mkl.sh); here: {:?}, {:?}, matmul {}",
                self.device,
                self.dtype,
                crate::model::matmul_backend()
            )));
        }
        if self.rollout_bf16 != on {
            // The cached rollout weights are of the other kind.
            *self.rollout_cache.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        self.rollout_bf16 = on;
        Ok(())
    }

    /// Whether generation uses bf16 weight copies.
    pub fn rollout_bf16(&self) -> bool {
        self.rollout_bf16
    }

    /// Mixed-precision training on the CPU: the projections and LM head of
    /// every pass that builds a graph (the trained policy's scoring) take
    /// their products in bf16 with f32 accumulation, forward and backward,
    /// as PyTorch's CPU autocast does; weights, activations, gradients and
    /// AdamW state stay f32, and so do norms, attention, the log-softmax
    /// and every pass without a graph (generation, π_old and reference
    /// scoring). Only on the CPU, in f32, with a BLAS that has bf16
    /// products (MKL); it pays where the CPU multiplies bf16 in hardware
    /// (AMX), see [`crate::model::Kernels`].
    pub fn set_mixed_precision(&mut self, on: bool) -> Result<()> {
        if on
            && !(self.device.is_cpu()
                && self.dtype == DType::F32
                && crate::model::ops::mixed_precision_available())
        {
            return Err(crate::model::ModelError::InvalidArgument(format!(
                "mixed-precision training needs the CPU, f32 compute and a BLAS with bf16 products (MKL: scripts/install-mkl.sh); here: {:?}, {:?}, matmul {}",
                self.device,
                self.dtype,
                crate::model::matmul_backend()
            )));
        }
        self.mixed_precision = on;
        if !on {
            self.frozen_bf16
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clear();
        }
        Ok(())
    }

    /// The bf16 copy of the frozen weights `ws` stacked by rows, made on
    /// first use (see `frozen_bf16`).
    pub(in crate::model) fn frozen_bf16(
        &self,
        ws: &[&Tensor],
    ) -> Result<Arc<crate::model::ops::FrozenBf16>> {
        let key: Vec<candle_core::TensorId> = ws.iter().map(|w| w.id()).collect();
        let mut map = self.frozen_bf16.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = map.get(&key) {
            return Ok(w.clone());
        }
        let w = Arc::new(crate::model::ops::FrozenBf16::of(ws)?);
        map.insert(key, w.clone());
        Ok(w)
    }

    /// Bytes of the frozen base's bf16 copies made so far.
    pub fn frozen_bf16_bytes(&self) -> usize {
        self.frozen_bf16
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|w| w.bytes())
            .sum()
    }

    /// Whether training takes bf16 products.
    pub fn mixed_precision(&self) -> bool {
        self.mixed_precision
    }

    /// Weights for generation: detached, with any adapters merged in (one
    /// small `B A` product per adapter per call, instead of two extra
    /// matmuls per adapted projection per token), in the compute dtype;
    /// the products' weights in bf16 under [`Policy::set_rollout_bf16`],
    /// also packed for MKL's decode-sized products. Cached (with f32 packs
    /// for the decode kernel where it runs) until the weights change.
    pub(in crate::model) fn inference_weights(&self) -> Result<Weights> {
        use crate::model::ops::{f32_rollout_packs, PackedWeights};
        let f32_packs = self.device.is_cpu() && self.dtype == DType::F32 && f32_rollout_packs();
        if !self.rollout_bf16 && !f32_packs {
            return self.merged_weights();
        }
        let key = (weights_epoch(), self.w.ids());
        let mut cache = self.rollout_cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cache.as_ref().filter(|c| c.key == key) {
            return Ok(c.w.clone());
        }
        // Free the stale copies first; their packed buffers are reused.
        let old = cache.take().and_then(|c| c.packed);
        let (w, packed) = if self.rollout_bf16 {
            let w = self.merged_weights()?.rollout_bf16()?;
            let packed = PackedWeights::pack(&w.rollout_products(), old)?;
            (w, packed)
        } else {
            let w = self.merged_weights()?;
            let packed = PackedWeights::pack_f32(&w.rollout_products(), old)?;
            (w, packed)
        };
        *cache = Some(RolloutCache {
            key,
            w: w.clone(),
            packed,
        });
        Ok(w)
    }

    /// Bytes held by the packed copies of the rollout weights (MKL's for
    /// bf16, the decode kernel's for f32; decode-sized products), once
    /// generation has built them.
    pub fn rollout_packed_bytes(&self) -> Option<usize> {
        let cache = self.rollout_cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.as_ref()?.packed.as_ref().map(|p| p.bytes)
    }

    /// The compute precision (see [`Precision`]).
    pub fn precision(&self) -> Precision {
        match self.dtype {
            DType::BF16 => Precision::Bf16,
            _ => Precision::F32,
        }
    }

    /// This policy computing in `p`. Frozen tensors (everything but the
    /// trained `Var`s: a LoRA run's base, all of a frozen copy) are stored
    /// in `p`'s dtype; trained `Var`s stay f32 master copies, cast at each
    /// forward ([`Policy::compute_weights`]) so that their gradients and
    /// the optimiser state stay f32.
    pub fn with_precision(mut self, p: Precision) -> Result<Policy> {
        let dt = p.dtype();
        let trained: HashSet<_> = self.vars.iter().map(|(_, v)| v.as_tensor().id()).collect();
        self.w = self.w.map(&|t| {
            Ok(if trained.contains(&t.id()) {
                t.clone()
            } else {
                t.to_dtype(dt)?
            })
        })?;
        self.dtype = dt;
        Ok(self)
    }

    /// The weights the forward pass uses: the stored ones, cast to the
    /// compute dtype (a no-op in f32 and for frozen tensors, which are
    /// stored in it). The cast of a trained `Var` is differentiable, so its
    /// gradient comes back in f32.
    pub(in crate::model) fn compute_weights(&self) -> Result<Weights> {
        if self.dtype == DType::F32 {
            return Ok(self.w.clone());
        }
        let dt = self.dtype;
        self.w.map(&|t| Ok(t.to_dtype(dt)?))
    }

    /// Trainable parameters, sorted by HF name (what the optimiser updates;
    /// empty for a frozen copy). With tied embeddings the head is
    /// `model.embed_tokens.weight` and appears once.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        self.vars.clone()
    }

    /// All base weights (trainable or not), sorted by HF name; LoRA
    /// adapters are in [`Policy::adapter_tensors`]. The tensors share
    /// storage with the model.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        self.w.named()
    }

    /// True for policies holding `Var`s (not a frozen copy).
    pub fn is_trainable(&self) -> bool {
        !self.vars.is_empty()
    }

    /// Deep copy with detached weights: later optimiser steps on `self` do
    /// not affect it, and scoring it builds no autograd graph. Used as the
    /// frozen KL reference. Its weights are stored in the compute dtype.
    pub fn frozen_copy(&self) -> Result<Policy> {
        let dt = self.dtype;
        let w = self.w.map(&|t| {
            let t = t.detach();
            Ok(if t.dtype() == dt {
                t.copy()?
            } else {
                t.to_dtype(dt)?
            })
        })?;
        Ok(Policy::new(PolicyParts {
            cfg: self.cfg.clone(),
            arch: self.arch.clone(),
            device: self.device.clone(),
            dtype: dt,
            w,
            vars: Vec::new(),
            lora: self.lora.clone(),
        }))
    }

    /// Number of scalar parameters (tied head counted once).
    pub fn num_params(&self) -> usize {
        self.w.named().iter().map(|(_, t)| t.elem_count()).sum()
    }

    /// Elements of the products' weights: the projections and the LM head
    /// (the token embedding when tied). What decides whether the model stays
    /// in the CPU's caches, and what bf16 copies of the weights hold.
    pub fn product_elems(&self) -> usize {
        self.w.head().elem_count()
            + self
                .w
                .layers
                .iter()
                .flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down])
                .map(|t| t.elem_count())
                .sum::<usize>()
    }

    /// Whether the model counts as large (`kernels::LARGE_MODEL_ELEMS`
    /// product weights or more). Only large models take the paths whose
    /// float sums depend on batch layout (packed f32 weights, shared
    /// prefill, wide packed rows, shared LM-head rows, micro-batches filled
    /// by memory, bf16 by default), so small ones such as the built-in tiny
    /// model stay bit-identical.
    pub fn is_large(&self) -> bool {
        self.product_elems() >= crate::model::kernels::LARGE_MODEL_ELEMS
    }

    /// Number of trainable scalars: every weight for full training, the
    /// adapters alone under LoRA, 0 for a frozen copy.
    pub fn num_trainable_params(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }
}

#[cfg(test)]
mod tests;
