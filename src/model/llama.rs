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
//! Everything runs in f32. The training path never uses candle's fused
//! kernels (`softmax_last_dim`, `rms_norm`, `rope*`, `sdpa`): they have no
//! backward pass and candle silently drops the gradient through them.
//! Instead it uses this module's own fused CPU kernels *with* backward
//! passes (`ops`: causal softmax, RMSNorm, rotary, SwiGLU, target
//! log-prob + entropy), which fall back to composite candle ops on other
//! devices. Generation runs on detached weights and may use candle's
//! forward-only kernels.
//!
//! Both paths run the trunk in chunks of sequences (longest first) so that
//! no activation grows past a few MB (see `CHUNK_BUDGET` in the source).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, Var};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::config::{Arch, ModelConfig};
use super::error::{ModelError, Result};
use super::lora::{LoraConfig, Proj, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use super::ops;
use super::trie::TokenTrie;

/// Sequences to score, right-padded internally.
#[derive(Debug, Clone, Default)]
pub struct ScoreBatch {
    /// Full token sequences (prompt + completion).
    pub seqs: Vec<Vec<u32>>,
    /// `targets[i]`: positions `p` (`1 <= p < seqs[i].len()`) whose token
    /// `seqs[i][p]` is scored given `seqs[i][..p]`, in the order they should
    /// appear in the output.
    pub targets: Vec<Vec<usize>>,
    /// Logits are divided by this before the softmax; use the sampling
    /// temperature so scores match the behaviour log-probs.
    pub temperature: f64,
}

impl ScoreBatch {
    /// Total number of scored tokens (`N` in [`ScoreOutput`]).
    pub fn num_targets(&self) -> usize {
        self.targets.iter().map(Vec::len).sum()
    }
}

/// Result of [`Policy::score`]; both tensors are part of the autograd graph
/// when the policy is trainable.
#[derive(Debug, Clone)]
pub struct ScoreOutput {
    /// `(N,)` f32: log-prob of each target token, targets flattened in order
    /// (sequence 0's targets, then sequence 1's, ...).
    pub logp: Tensor,
    /// `(N,)` f32: entropy of the full next-token distribution (at the same
    /// temperature) at each target.
    pub entropy: Tensor,
}

/// Sampling settings for [`Policy::generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// Softmax temperature for sampling and for the reported log-probs. Must
    /// be > 0 unless `greedy` (then a non-positive value reports log-probs at
    /// temperature 1).
    pub temperature: f64,
    /// Nucleus sampling mass; `>= 1` disables it, `-> 0` approaches greedy.
    pub top_p: f64,
    /// Arg-max decoding (of the constrained logits) instead of sampling.
    pub greedy: bool,
    pub eos_token_id: u32,
}

/// One generated completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// Generated ids, including the eos if one was emitted.
    pub tokens: Vec<u32>,
    /// One per token: `log softmax(logits / temperature)[token]` over the
    /// full, unconstrained vocabulary (see [`Policy::generate`]).
    pub logprobs: Vec<f32>,
    /// True when eos was emitted (false: stopped by `max_new_tokens`).
    pub finished: bool,
}

/// Weights of one decoder block (HF shapes: `(out, in)`).
#[derive(Clone)]
struct LayerW {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    ln1: Tensor,
    ln2: Tensor,
    /// q/k/v projection biases (`Arch::qkv_bias`), shapes `(out,)`.
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    /// o projection bias (`Arch::o_bias`), `(hidden,)`.
    bo: Option<Tensor>,
    /// Per-head RMSNorm weights of q and k (`Arch::qk_norm`), `(head_dim,)`.
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// `cat([gate, up])`, precomputed for generation (detached weights);
    /// `None` on the training path, where it is rebuilt from the `Var`s.
    gu: Option<Tensor>,
    /// LoRA adapters indexed by [`Proj::index`]; empty without LoRA.
    ad: Vec<Option<Adapter>>,
}

/// One LoRA adapter: `A (r, in)`, `B (out, r)`.
#[derive(Clone)]
struct Adapter {
    a: Tensor,
    b: Tensor,
}

#[derive(Clone)]
struct Weights {
    embed: Tensor,
    layers: Vec<LayerW>,
    norm: Tensor,
    /// `None` when tied to `embed`.
    lm_head: Option<Tensor>,
}

impl Weights {
    fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Weights> {
        Ok(Weights {
            embed: f(&self.embed)?,
            layers: self
                .layers
                .iter()
                .map(|l| {
                    Ok(LayerW {
                        q: f(&l.q)?,
                        k: f(&l.k)?,
                        v: f(&l.v)?,
                        o: f(&l.o)?,
                        gate: f(&l.gate)?,
                        up: f(&l.up)?,
                        down: f(&l.down)?,
                        ln1: f(&l.ln1)?,
                        ln2: f(&l.ln2)?,
                        bq: l.bq.as_ref().map(f).transpose()?,
                        bk: l.bk.as_ref().map(f).transpose()?,
                        bv: l.bv.as_ref().map(f).transpose()?,
                        bo: l.bo.as_ref().map(f).transpose()?,
                        q_norm: l.q_norm.as_ref().map(f).transpose()?,
                        k_norm: l.k_norm.as_ref().map(f).transpose()?,
                        gu: None,
                        ad: l
                            .ad
                            .iter()
                            .map(|a| {
                                a.as_ref()
                                    .map(|a| {
                                        Ok(Adapter {
                                            a: f(&a.a)?,
                                            b: f(&a.b)?,
                                        })
                                    })
                                    .transpose()
                            })
                            .collect::<Result<Vec<_>>>()?,
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            norm: f(&self.norm)?,
            lm_head: self.lm_head.as_ref().map(f).transpose()?,
        })
    }

    /// Same storage, no autograd tracking: generation on these builds no graph.
    fn detached(&self) -> Result<Weights> {
        let mut w = self.map(&|t| Ok(t.detach()))?;
        for l in &mut w.layers {
            l.gu = Some(Tensor::cat(&[&l.gate, &l.up], 0)?);
        }
        Ok(w)
    }

    fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    fn named(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![
            ("model.embed_tokens.weight".to_string(), self.embed.clone()),
            ("model.norm.weight".to_string(), self.norm.clone()),
        ];
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.extend([
                (format!("{p}.self_attn.q_proj.weight"), l.q.clone()),
                (format!("{p}.self_attn.k_proj.weight"), l.k.clone()),
                (format!("{p}.self_attn.v_proj.weight"), l.v.clone()),
                (format!("{p}.self_attn.o_proj.weight"), l.o.clone()),
                (format!("{p}.mlp.gate_proj.weight"), l.gate.clone()),
                (format!("{p}.mlp.up_proj.weight"), l.up.clone()),
                (format!("{p}.mlp.down_proj.weight"), l.down.clone()),
                (format!("{p}.input_layernorm.weight"), l.ln1.clone()),
                (
                    format!("{p}.post_attention_layernorm.weight"),
                    l.ln2.clone(),
                ),
            ]);
            for (n, t) in [
                ("self_attn.q_proj.bias", &l.bq),
                ("self_attn.k_proj.bias", &l.bk),
                ("self_attn.v_proj.bias", &l.bv),
                ("self_attn.o_proj.bias", &l.bo),
                ("self_attn.q_norm.weight", &l.q_norm),
                ("self_attn.k_norm.weight", &l.k_norm),
            ] {
                if let Some(t) = t {
                    out.push((format!("{p}.{n}"), t.clone()));
                }
            }
        }
        if let Some(h) = &self.lm_head {
            out.push(("lm_head.weight".to_string(), h.clone()));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// Names and HF shapes of every parameter the config and architecture
/// need, sorted by name.
fn param_specs(cfg: &ModelConfig, arch: &Arch) -> Vec<(String, Vec<usize>)> {
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let hd = cfg.head_dim();
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let mut out = vec![
        ("model.embed_tokens.weight".to_string(), vec![v, h]),
        ("model.norm.weight".to_string(), vec![h]),
    ];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.extend([
            (format!("{p}.self_attn.q_proj.weight"), vec![nh * hd, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![nkv * hd, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![nkv * hd, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, nh * hd]),
            (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
        ]);
        if arch.qkv_bias() {
            out.extend([
                (format!("{p}.self_attn.q_proj.bias"), vec![nh * hd]),
                (format!("{p}.self_attn.k_proj.bias"), vec![nkv * hd]),
                (format!("{p}.self_attn.v_proj.bias"), vec![nkv * hd]),
            ]);
        }
        if arch.o_bias() {
            out.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
        }
        if arch.qk_norm() {
            out.extend([
                (format!("{p}.self_attn.q_norm.weight"), vec![hd]),
                (format!("{p}.self_attn.k_norm.weight"), vec![hd]),
            ]);
        }
    }
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Additive mask value for hidden attention columns. `-inf` gives exactly
/// zero weight; every query row keeps at least its own column visible, so no
/// row is all `-inf` (which would give NaN).
const MASKED: f32 = f32::NEG_INFINITY;

/// Budget (in f32 elements) for the largest activation of one chunk of
/// sequences (attention scores or the fused gate/up projection). Scoring
/// and prefill run the trunk chunk by chunk: on CPU, tensors of a few MB
/// stay in the allocator's heap and in cache, while tens-of-MB tensors are
/// mmapped and page-faulted afresh on every op, which costs more than the
/// arithmetic. Results do not depend on it (up to float rounding).
const CHUNK_BUDGET: usize = 1 << 21;

thread_local! {
    /// Per-thread override of [`CHUNK_BUDGET`], for tests that force tiny chunks.
    static CHUNK_BUDGET_OVERRIDE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The policy model. Trainable instances hold candle [`Var`]s (updated in
/// place by the optimiser); [`Policy::frozen_copy`] instances hold plain,
/// detached tensors.
pub struct Policy {
    cfg: ModelConfig,
    arch: Arch,
    device: Device,
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
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy")
            .field("cfg", &self.cfg)
            .field("arch", &self.arch)
            .field("device", &self.device)
            .field("num_params", &self.num_params())
            .field("trainable", &!self.vars.is_empty())
            .field("lora", &self.lora)
            .finish()
    }
}

/// How attention hides columns.
#[derive(Clone, Copy)]
enum AttnMask<'a> {
    /// Plain causal mask (scoring: right-padded, positions from 0).
    Causal,
    /// Additive mask broadcastable to `(b, n_kv, n_rep, t, s)` (generation:
    /// left padding).
    Additive(&'a Tensor),
}

/// Per-layer KV cache of a generation batch: `(B, n_kv, capacity, head_dim)`
/// buffers written in place with `slice_set`.
struct LayerCache {
    k: Tensor,
    v: Tensor,
}

impl Policy {
    /// Random init from a seeded RNG (candle's own CPU RNG cannot be
    /// seeded): matrices ~ N(0, initializer_range), norm weights = 1,
    /// biases = 0 (HF init). Parameters are drawn in sorted-name order, so
    /// a seed fixes the model. The architecture is the family's default
    /// ([`Arch::from_config`]).
    pub fn new_random(cfg: &ModelConfig, rng: &mut ChaCha8Rng, device: &Device) -> Result<Self> {
        Self::new_random_with_arch(cfg, &Arch::from_config(cfg)?, rng, device)
    }

    /// [`Policy::new_random`] with an explicit architecture variant.
    pub fn new_random_with_arch(
        cfg: &ModelConfig,
        arch: &Arch,
        rng: &mut ChaCha8Rng,
        device: &Device,
    ) -> Result<Self> {
        cfg.validate()?;
        arch.validate()?;
        let normal = Normal::new(0.0f32, cfg.initializer_range as f32)
            .map_err(|e| ModelError::InvalidConfig(format!("initializer_range: {e}")))?;
        let mut tensors = HashMap::new();
        for (name, shape) in param_specs(cfg, arch) {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = if name.ends_with(".bias") {
                vec![0.0; n]
            } else if shape.len() == 1 {
                vec![1.0; n]
            } else {
                (0..n).map(|_| normal.sample(rng)).collect()
            };
            tensors.insert(name, Tensor::from_vec(data, shape, device)?);
        }
        Self::assemble(
            cfg,
            arch,
            tensors,
            &|_| "<random init>".into(),
            device,
            true,
        )
    }

    /// Builds a trainable policy from HF-named tensors (any float dtype; they
    /// are converted to f32 and copied into fresh `Var`s on the tensors'
    /// device), with the family's default architecture
    /// ([`Arch::from_config`]). A missing tensor, a wrong shape or an
    /// unexpected tensor (biases the architecture lacks, other
    /// architectures) is an error naming `file` and the tensor. Tolerated
    /// extras: a redundant `lm_head.weight` in a tied checkpoint and
    /// `*.rotary_emb.inv_freq` buffers.
    pub fn from_tensors(
        cfg: &ModelConfig,
        tensors: HashMap<String, Tensor>,
        file: &str,
    ) -> Result<Self> {
        Self::from_tensors_with_arch(cfg, &Arch::from_config(cfg)?, tensors, file)
    }

    /// [`Policy::from_tensors`] with an explicit architecture variant.
    pub fn from_tensors_with_arch(
        cfg: &ModelConfig,
        arch: &Arch,
        tensors: HashMap<String, Tensor>,
        file: &str,
    ) -> Result<Self> {
        let device = match tensors.get("model.embed_tokens.weight") {
            Some(t) => t.device().clone(),
            None => {
                return Err(ModelError::MissingTensor {
                    file: file.to_string(),
                    name: "model.embed_tokens.weight".to_string(),
                })
            }
        };
        Self::assemble(cfg, arch, tensors, &|_| file.to_string(), &device, true)
    }

    /// Checks `tensors` against the parameter list of `cfg` + `arch` and
    /// builds the policy on `device`. `file_of(name)` names the file a
    /// tensor comes (or should come) from, for error messages: sharded
    /// checkpoints name the shard.
    pub(super) fn assemble(
        cfg: &ModelConfig,
        arch: &Arch,
        mut tensors: HashMap<String, Tensor>,
        file_of: &dyn Fn(&str) -> String,
        device: &Device,
        trainable: bool,
    ) -> Result<Self> {
        cfg.validate()?;
        arch.validate()?;
        let mut vars = Vec::new();
        let mut got: HashMap<String, Tensor> = HashMap::new();
        for (name, shape) in param_specs(cfg, arch) {
            let t = tensors
                .remove(&name)
                .ok_or_else(|| ModelError::MissingTensor {
                    file: file_of(&name),
                    name: name.clone(),
                })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::Shape {
                    file: file_of(&name),
                    name,
                    expected: shape,
                    got: t.dims().to_vec(),
                });
            }
            if !t.dtype().is_float() {
                return Err(ModelError::Dtype {
                    file: file_of(&name),
                    name,
                    dtype: format!("{:?}", t.dtype()),
                });
            }
            let t = t.to_dtype(DType::F32)?.to_device(device)?;
            let t = if trainable {
                let var = Var::from_tensor(&t.detach())?;
                let t = var.as_tensor().clone();
                vars.push((name.clone(), var));
                t
            } else {
                t.detach().contiguous()?
            };
            got.insert(name, t);
        }
        for name in tensors.keys() {
            let harmless = name.ends_with("rotary_emb.inv_freq")
                || (cfg.tie_word_embeddings && name == "lm_head.weight");
            if !harmless {
                return Err(ModelError::UnexpectedTensor {
                    file: file_of(name),
                    name: name.clone(),
                });
            }
        }
        // Every spec'd tensor is in `got`; optional per-architecture ones
        // (biases, q/k norms) are there iff `param_specs` listed them.
        const SPEC: &str = "spec'd tensor present";
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| {
                let mut t = |n: &str| got.remove(&format!("model.layers.{l}.{n}"));
                LayerW {
                    q: t("self_attn.q_proj.weight").expect(SPEC),
                    k: t("self_attn.k_proj.weight").expect(SPEC),
                    v: t("self_attn.v_proj.weight").expect(SPEC),
                    o: t("self_attn.o_proj.weight").expect(SPEC),
                    gate: t("mlp.gate_proj.weight").expect(SPEC),
                    up: t("mlp.up_proj.weight").expect(SPEC),
                    down: t("mlp.down_proj.weight").expect(SPEC),
                    ln1: t("input_layernorm.weight").expect(SPEC),
                    ln2: t("post_attention_layernorm.weight").expect(SPEC),
                    bq: t("self_attn.q_proj.bias"),
                    bk: t("self_attn.k_proj.bias"),
                    bv: t("self_attn.v_proj.bias"),
                    bo: t("self_attn.o_proj.bias"),
                    q_norm: t("self_attn.q_norm.weight"),
                    k_norm: t("self_attn.k_norm.weight"),
                    gu: None,
                    ad: Vec::new(),
                }
            })
            .collect();
        let w = Weights {
            embed: got.remove("model.embed_tokens.weight").expect(SPEC),
            layers,
            norm: got.remove("model.norm.weight").expect(SPEC),
            lm_head: if cfg.tie_word_embeddings {
                None
            } else {
                Some(got.remove("lm_head.weight").expect(SPEC))
            },
        };
        Ok(Policy {
            cfg: cfg.clone(),
            arch: arch.clone(),
            inv_freq: arch.inv_freq(cfg),
            device: device.clone(),
            w,
            vars,
            lora: None,
            dropout_rng: Mutex::new(None),
        })
    }

    /// Loads HF weights for `cfg` with the family's default architecture
    /// ([`Arch::from_config`]): a `.safetensors` file, a sharded
    /// checkpoint's `model.safetensors.index.json`, or a directory holding
    /// either. [`Policy::from_hf_dir`] also reads the config (and its
    /// `rope_scaling`/`attention_bias`) from the folder.
    pub fn load_safetensors(cfg: &ModelConfig, path: &Path, device: &Device) -> Result<Self> {
        let arch = Arch::from_config(cfg)?;
        let path = if path.is_dir() {
            super::hf::weights_path(path)?
        } else {
            path.to_path_buf()
        };
        let (tensors, origins) = super::hf::read_weights(&path)?;
        Self::assemble(cfg, &arch, tensors, &|n| origins.file_of(n), device, true)
    }

    /// Writes all weights under their HF names (no `lm_head.weight` when
    /// tied), so `transformers` can load the file with the saved config.
    pub fn save_safetensors(&self, path: &Path) -> Result<()> {
        let map: HashMap<String, Tensor> = self
            .w
            .named()
            .into_iter()
            .map(|(n, t)| (n, t.detach()))
            .collect();
        candle_core::safetensors::save(&map, path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })
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
    /// frozen KL reference.
    pub fn frozen_copy(&self) -> Result<Policy> {
        let w = self.w.map(&|t| Ok(t.detach().copy()?))?;
        Ok(Policy {
            cfg: self.cfg.clone(),
            arch: self.arch.clone(),
            device: self.device.clone(),
            w,
            vars: Vec::new(),
            inv_freq: self.inv_freq.clone(),
            lora: self.lora.clone(),
            dropout_rng: Mutex::new(None),
        })
    }

    /// Number of scalar parameters (tied head counted once).
    pub fn num_params(&self) -> usize {
        self.w.named().iter().map(|(_, t)| t.elem_count()).sum()
    }

    // ------------------------------------------------------------------
    // LoRA
    // ------------------------------------------------------------------

    /// The LoRA settings, when adapters are attached.
    pub fn lora(&self) -> Option<&LoraConfig> {
        self.lora.as_ref()
    }

    /// Number of trainable scalars: every weight for full training, the
    /// adapters alone under LoRA, 0 for a frozen copy.
    pub fn num_trainable_params(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// HF `(out, in)` shape of projection `p`.
    fn proj_shape(&self, p: Proj) -> (usize, usize) {
        let c = &self.cfg;
        let (h, i, hd) = (c.hidden_size, c.intermediate_size, c.head_dim());
        match p {
            Proj::Q => (c.num_attention_heads * hd, h),
            Proj::K | Proj::V => (c.num_key_value_heads * hd, h),
            Proj::O => (h, c.num_attention_heads * hd),
            Proj::Gate | Proj::Up => (i, h),
            Proj::Down => (h, i),
        }
    }

    /// Attaches fresh LoRA adapters to the projections `cfg` names, in
    /// every layer, and freezes the base: the base weights become detached
    /// tensors and only the adapters are `Var`s (what the optimiser sees).
    /// `A` is drawn from `U(-1/√in, 1/√in)` (PEFT's Kaiming-uniform init)
    /// in layer, then module, order from `rng`; `B` is zero, so the adapted
    /// model computes exactly what the base does until the first update.
    pub fn with_lora(self, cfg: &LoraConfig, rng: &mut ChaCha8Rng) -> Result<Policy> {
        let projs = cfg.projections()?;
        let mut tensors = HashMap::new();
        for l in 0..self.cfg.num_hidden_layers {
            for &p in &projs {
                let (out, inp) = self.proj_shape(p);
                let bound = 1.0 / (inp as f32).sqrt();
                let a: Vec<f32> = (0..cfg.rank * inp)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                tensors.insert(
                    p.tensor_name(l, true),
                    Tensor::from_vec(a, (cfg.rank, inp), &self.device)?,
                );
                tensors.insert(
                    p.tensor_name(l, false),
                    Tensor::zeros((out, cfg.rank), DType::F32, &self.device)?,
                );
            }
        }
        self.with_lora_tensors(cfg, tensors, "<new adapters>")
    }

    /// [`Policy::with_lora`] with given adapter tensors under their PEFT
    /// names (`base_model.model.model.layers.<i>.<module>.lora_A.weight`,
    /// any float dtype). A missing, misshapen or unexpected tensor is an
    /// error naming `file` and the tensor.
    pub fn with_lora_tensors(
        self,
        cfg: &LoraConfig,
        mut tensors: HashMap<String, Tensor>,
        file: &str,
    ) -> Result<Policy> {
        if self.lora.is_some() {
            return Err(ModelError::InvalidArgument(
                "the policy already has LoRA adapters (merge them first)".into(),
            ));
        }
        let projs = cfg.projections()?;
        let mut w = self.w.map(&|t| Ok(t.detach()))?;
        let mut vars = Vec::new();
        for (l, lw) in w.layers.iter_mut().enumerate() {
            lw.gu = None;
            lw.ad = vec![None; Proj::ALL.len()];
            for &p in &projs {
                let (out, inp) = self.proj_shape(p);
                let mut take = |a: bool, shape: [usize; 2]| -> Result<Tensor> {
                    let name = p.tensor_name(l, a);
                    let t = tensors
                        .remove(&name)
                        .ok_or_else(|| ModelError::MissingTensor {
                            file: file.to_string(),
                            name: name.clone(),
                        })?;
                    if t.dims() != shape {
                        return Err(ModelError::Shape {
                            file: file.to_string(),
                            name,
                            expected: shape.to_vec(),
                            got: t.dims().to_vec(),
                        });
                    }
                    if !t.dtype().is_float() {
                        return Err(ModelError::Dtype {
                            file: file.to_string(),
                            name,
                            dtype: format!("{:?}", t.dtype()),
                        });
                    }
                    let t = t.to_dtype(DType::F32)?.to_device(&self.device)?;
                    let var = Var::from_tensor(&t.detach())?;
                    let t = var.as_tensor().clone();
                    vars.push((name, var));
                    Ok(t)
                };
                let a = take(true, [cfg.rank, inp])?;
                let b = take(false, [out, cfg.rank])?;
                lw.ad[p.index()] = Some(Adapter { a, b });
            }
        }
        if let Some(name) = tensors.keys().min() {
            return Err(ModelError::UnexpectedTensor {
                file: file.to_string(),
                name: name.clone(),
            });
        }
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Policy {
            cfg: self.cfg,
            arch: self.arch,
            device: self.device,
            w,
            vars,
            inv_freq: self.inv_freq,
            lora: Some(cfg.clone()),
            dropout_rng: Mutex::new(None),
        })
    }

    /// The adapter tensors under their PEFT names, sorted (empty without
    /// LoRA). They share storage with the model.
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (l, lw) in self.w.layers.iter().enumerate() {
            for (i, ad) in lw.ad.iter().enumerate() {
                if let Some(ad) = ad {
                    out.push((Proj::ALL[i].tensor_name(l, true), ad.a.clone()));
                    out.push((Proj::ALL[i].tensor_name(l, false), ad.b.clone()));
                }
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Writes the adapters alone in PEFT's layout: `adapter_config.json`
    /// (`base_model_name_or_path` = `base`) and `adapter_model.safetensors`.
    pub fn save_adapter(&self, dir: &Path, base: &str) -> Result<()> {
        let Some(cfg) = &self.lora else {
            return Err(ModelError::InvalidArgument(
                "save_adapter: the policy has no LoRA adapters".into(),
            ));
        };
        let io = |path: &Path, source: std::io::Error| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let cpath = dir.join(ADAPTER_CONFIG);
        let text = serde_json::to_string_pretty(&cfg.to_peft_json(base))
            .map_err(|e| io(&cpath, std::io::Error::other(e)))?;
        std::fs::write(&cpath, text + "\n").map_err(|e| io(&cpath, e))?;
        let wpath = dir.join(ADAPTER_WEIGHTS);
        let map: HashMap<String, Tensor> = self
            .adapter_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.detach()))
            .collect();
        candle_core::safetensors::save(&map, &wpath).map_err(|e| ModelError::Checkpoint {
            path: wpath.clone(),
            msg: format!("cannot write safetensors: {e}"),
        })
    }

    /// Attaches the adapters PEFT saved in `dir` (`adapter_config.json` +
    /// `adapter_model.safetensors`) to this base policy.
    pub fn load_adapter(self, dir: &Path) -> Result<Policy> {
        let (cfg, _) = LoraConfig::from_peft_file(&dir.join(ADAPTER_CONFIG))?;
        let wpath = dir.join(ADAPTER_WEIGHTS);
        if !wpath.is_file() {
            return Err(ModelError::MissingFile {
                path: dir.to_path_buf(),
                what: ADAPTER_WEIGHTS.to_string(),
            });
        }
        let tensors = candle_core::safetensors::load(&wpath, &self.device).map_err(|e| {
            ModelError::Checkpoint {
                path: wpath.clone(),
                msg: format!("cannot read safetensors: {e}"),
            }
        })?;
        self.with_lora_tensors(&cfg, tensors, &wpath.display().to_string())
    }

    /// A plain trainable policy whose weights are the base plus each
    /// adapter's update, `W + (alpha / r) B A` (for a full HF checkpoint).
    /// Without adapters: a trainable copy.
    pub fn merged(&self) -> Result<Policy> {
        let w = self.inference_weights()?;
        let tensors: HashMap<String, Tensor> = w.named().into_iter().collect();
        Self::assemble(
            &self.cfg,
            &self.arch,
            tensors,
            &|_| "<merged>".into(),
            &self.device,
            true,
        )
    }

    /// Weights for generation: detached, with any adapters merged in (one
    /// small `B A` product per adapter per call, instead of two extra
    /// matmuls per adapted projection per token).
    fn inference_weights(&self) -> Result<Weights> {
        let Some(cfg) = &self.lora else {
            return self.w.detached();
        };
        let scale = cfg.scale();
        let mut w = self.w.map(&|t| Ok(t.detach()))?;
        for lw in &mut w.layers {
            for (i, ad) in std::mem::take(&mut lw.ad).into_iter().enumerate() {
                let Some(ad) = ad else { continue };
                let delta = (ad.b.matmul(&ad.a)? * scale)?;
                let slot = match Proj::ALL[i] {
                    Proj::Q => &mut lw.q,
                    Proj::K => &mut lw.k,
                    Proj::V => &mut lw.v,
                    Proj::O => &mut lw.o,
                    Proj::Gate => &mut lw.gate,
                    Proj::Up => &mut lw.up,
                    Proj::Down => &mut lw.down,
                };
                *slot = (&*slot + delta)?;
            }
            lw.gu = Some(Tensor::cat(&[&lw.gate, &lw.up], 0)?);
        }
        Ok(w)
    }

    /// Seeds the LoRA dropout masks of the following [`Policy::score`]
    /// calls (`None`: no dropout, as in evaluation). Masks are drawn from
    /// this stream in call order, so a run that sets it from its own seed
    /// per step is reproducible. No effect without LoRA dropout.
    pub fn set_dropout_seed(&self, seed: Option<u64>) {
        use rand::SeedableRng;
        let mut g = self.dropout_rng.lock().unwrap_or_else(|e| e.into_inner());
        *g = seed.map(ChaCha8Rng::seed_from_u64);
    }

    // ------------------------------------------------------------------
    // Building blocks
    // ------------------------------------------------------------------

    /// Splits sequences, sorted by decreasing length `lens`, into
    /// consecutive chunks whose largest activation fits [`CHUNK_BUDGET`].
    fn plan_chunks(&self, lens: &[usize]) -> Vec<std::ops::Range<usize>> {
        let budget = CHUNK_BUDGET_OVERRIDE
            .with(|c| c.get())
            .unwrap_or(CHUNK_BUDGET);
        let widest = (2 * self.cfg.intermediate_size)
            .max(self.cfg.hidden_size)
            .max(self.cfg.num_attention_heads * self.cfg.head_dim());
        let mut out = Vec::new();
        let mut start = 0;
        while start < lens.len() {
            let t = lens[start].max(1);
            let per_seq = t * widest.max(self.cfg.num_attention_heads * t);
            let n = (budget / per_seq).max(1);
            let end = (start + n).min(lens.len());
            out.push(start..end);
            start = end;
        }
        out
    }

    /// Rotary tables for `rows * t` positions (`rows` = 1 when all
    /// sequences share positions `0..t`).
    fn rope_tables(&self, positions: &[usize], rows: usize, t: usize) -> ops::RopeTables {
        ops::RopeTables::new(&self.inv_freq, positions, rows, t)
    }

    fn embed(&self, w: &Weights, ids: &[u32]) -> Result<Tensor> {
        let v = self.cfg.vocab_size;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= v) {
            return Err(ModelError::InvalidArgument(format!(
                "token id {bad} outside the vocabulary (vocab_size {v})"
            )));
        }
        let ids = Tensor::from_slice(ids, ids.len(), &self.device)?;
        Ok(w.embed.index_select(&ids, 0)?)
    }

    /// One decoder block on `x` `(b * t, hidden)`. `cache = Some((c, off,
    /// from))` writes this step's keys/values at column `off` of the cache
    /// and attends over columns `from..off + t`.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        lw: &LayerW,
        x: &Tensor,
        b: usize,
        t: usize,
        rope: &ops::RopeTables,
        mask: AttnMask<'_>,
        cache: Option<(&mut LayerCache, usize, usize)>,
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps;
        let hd = self.cfg.head_dim();
        let (nh, nkv) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads);
        let rep = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();

        let h = ops::rms_norm(x, &lw.ln1, eps)?;
        // Qwen3: RMSNorm over each head's `head_dim` values of q and k,
        // after the projection and before rotary (HF order). Rows of
        // `(b * t, heads * hd)` split into `(b * t * heads, hd)`.
        let head_norm = |y: Tensor, w: &Option<Tensor>, heads: usize| -> Result<Tensor> {
            match w {
                Some(w) => ops::rms_norm(&y.reshape((b * t * heads, hd))?, w, eps),
                None => Ok(y),
            }
        };
        let q = head_norm(
            self.proj(lw, Proj::Q, &h, &lw.q, lw.bq.as_ref())?,
            &lw.q_norm,
            nh,
        )?;
        let k = head_norm(
            self.proj(lw, Proj::K, &h, &lw.k, lw.bk.as_ref())?,
            &lw.k_norm,
            nkv,
        )?;
        // (b, heads, t, hd), rotated.
        let q = ops::rope_heads_first(&q.reshape((b, t, nh, hd))?, rope)?;
        let k = ops::rope_heads_first(&k.reshape((b, t, nkv, hd))?, rope)?;
        let v = self
            .proj(lw, Proj::V, &h, &lw.v, lw.bv.as_ref())?
            .reshape((b, t, nkv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let (k, v) = match cache {
            None => (k, v),
            Some((c, off, from)) => {
                c.k.slice_set(&k, 2, off)?;
                c.v.slice_set(&v, 2, off)?;
                let s = off + t - from;
                (c.k.narrow(2, from, s)?, c.v.narrow(2, from, s)?)
            }
        };
        let s = k.dim(2)?;
        // GQA without materialising repeated K/V: query head h = g * rep + r
        // reads kv head g, so (b, nh, t, hd) regroups to (b, nkv, rep * t, hd);
        // score rows are then ordered (b, kv head, r, query).
        let q = q.reshape((b, nkv, rep * t, hd))?;
        let att = match mask {
            // Training path: fused scale + causal mask + softmax, with backward.
            AttnMask::Causal => ops::causal_softmax(&q.matmul(&k.t()?)?, scale, t)?,
            // Generation path (detached weights, no backward needed), so
            // candle's fused forward-only softmax is fine here.
            AttnMask::Additive(m) => {
                let att = q
                    .affine(scale, 0.0)?
                    .matmul(&k.t()?)?
                    .reshape((b, nkv, rep, t, s))?
                    .broadcast_add(m)?;
                candle_nn::ops::softmax_last_dim(&att)?.reshape((b, nkv, rep * t, s))?
            }
        };
        let y = att
            .matmul(&v)?
            .reshape((b, nh, t, hd))?
            .transpose(1, 2)?
            .reshape((b * t, nh * hd))?;
        let x = (x + self.proj(lw, Proj::O, &y, &lw.o, lw.bo.as_ref())?)?;

        let h = ops::rms_norm(&x, &lw.ln2, eps)?;
        let gu_w = match &lw.gu {
            Some(gu) => gu.clone(),
            None => Tensor::cat(&[&lw.gate, &lw.up], 0)?,
        };
        let mut gu = self.base_linear(&h, &gu_w)?;
        let (dg, du) = (
            self.lora_delta(lw, Proj::Gate, &h)?,
            self.lora_delta(lw, Proj::Up, &h)?,
        );
        if dg.is_some() || du.is_some() {
            let i = self.cfg.intermediate_size;
            let zeros = || Tensor::zeros((h.dim(0)?, i), DType::F32, &self.device);
            let dg = dg.map_or_else(zeros, Ok)?;
            let du = du.map_or_else(zeros, Ok)?;
            gu = (gu + Tensor::cat(&[&dg, &du], 1)?)?;
        }
        let m = self.proj(lw, Proj::Down, &ops::swiglu(&gu)?, &lw.down, None)?;
        Ok((x + m)?)
    }

    /// `x Wᵀ (+ bias)` plus the LoRA update of projection `p`, if adapted.
    fn proj(
        &self,
        lw: &LayerW,
        p: Proj,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let y = self.base_linear(x, w)?;
        let y = match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        Ok(match self.lora_delta(lw, p, x)? {
            Some(d) => (y + d)?,
            None => y,
        })
    }

    /// `x Wᵀ` for a base weight: under LoRA the base is frozen, and the
    /// product skips the weight gradient candle's matmul would compute.
    fn base_linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        // Only when a gradient flows through `x` (scoring the trained
        // policy); generation and the frozen reference build no graph.
        if self.lora.is_some() && x.track_op() {
            ops::frozen_linear(x, w)
        } else {
            linear(x, w)
        }
    }

    /// `(alpha / r) · dropout(x) Aᵀ Bᵀ` for projection `p`, or `None` when
    /// it has no adapter.
    fn lora_delta(&self, lw: &LayerW, p: Proj, x: &Tensor) -> Result<Option<Tensor>> {
        let (Some(Some(ad)), Some(cfg)) = (lw.ad.get(p.index()), &self.lora) else {
            return Ok(None);
        };
        let x = self.lora_dropout(x, cfg.dropout)?;
        let d = linear(&linear(&x, &ad.a)?, &ad.b)?;
        Ok(Some((d * cfg.scale())?))
    }

    /// Inverted dropout with masks from the seeded stream, when one is set.
    fn lora_dropout(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        // Only the trained policy drops (not a frozen KL reference).
        if p <= 0.0 || self.vars.is_empty() {
            return Ok(x.clone());
        }
        let mut guard = self.dropout_rng.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rng) = guard.as_mut() else {
            return Ok(x.clone());
        };
        let keep = 1.0 - p;
        let mask: Vec<f32> = (0..x.elem_count())
            .map(|_| {
                if rng.random::<f64>() < keep {
                    (1.0 / keep) as f32
                } else {
                    0.0
                }
            })
            .collect();
        Ok((x * Tensor::from_vec(mask, x.shape(), &self.device)?)?)
    }

    /// Logits `(rows, vocab)` from pre-norm hidden rows `(rows, hidden)`.
    fn head(&self, w: &Weights, hidden: &Tensor) -> Result<Tensor> {
        let h = ops::rms_norm(hidden, &w.norm, self.cfg.rms_norm_eps)?;
        self.base_linear(&h, w.head())
    }

    // ------------------------------------------------------------------
    // Scoring (training path)
    // ------------------------------------------------------------------

    /// Log-probs (and entropies) of the target tokens, differentiable with
    /// respect to every parameter.
    ///
    /// Sequences are right-padded (a causal mask suffices: real positions
    /// never see the padding after them) and truncated after their last
    /// target's context, the trunk runs once, and only the hidden rows that
    /// predict a target are gathered before the final norm and LM head, so
    /// the `(N, vocab)` logits are the only vocabulary-sized activations.
    pub fn score(&self, batch: &ScoreBatch) -> Result<ScoreOutput> {
        if batch.seqs.len() != batch.targets.len() {
            return Err(ModelError::InvalidArgument(format!(
                "score: {} sequences but {} target lists",
                batch.seqs.len(),
                batch.targets.len()
            )));
        }
        if !(batch.temperature.is_finite() && batch.temperature > 0.0) {
            return Err(ModelError::InvalidArgument(format!(
                "score: temperature must be > 0, got {}",
                batch.temperature
            )));
        }
        // Rows that have targets, and how much of each sequence they need.
        let mut rows: Vec<(usize, usize)> = Vec::new();
        for (i, (s, tg)) in batch.seqs.iter().zip(&batch.targets).enumerate() {
            for &p in tg {
                if p == 0 || p >= s.len() {
                    return Err(ModelError::InvalidArgument(format!(
                        "score: target position {p} out of range 1..{} in sequence {i}",
                        s.len()
                    )));
                }
                if s[p] as usize >= self.cfg.vocab_size {
                    return Err(ModelError::InvalidArgument(format!(
                        "token id {} outside the vocabulary (vocab_size {})",
                        s[p], self.cfg.vocab_size
                    )));
                }
            }
            if let Some(&maxp) = tg.iter().max() {
                rows.push((i, maxp));
            }
        }
        let n_targets = batch.num_targets();
        if n_targets == 0 {
            let empty = Tensor::zeros(0, DType::F32, &self.device)?;
            return Ok(ScoreOutput {
                logp: empty.clone(),
                entropy: empty,
            });
        }
        // Output offset of each row's first target.
        let mut first = Vec::with_capacity(rows.len());
        let mut acc = 0usize;
        for &(i, _) in &rows {
            first.push(acc);
            acc += batch.targets[i].len();
        }
        // Longest first, so each chunk is padded only to its own longest.
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&r| std::cmp::Reverse(rows[r].1));
        let lens: Vec<usize> = order.iter().map(|&r| rows[r].1).collect();
        let w = &self.w;
        let mut parts = Vec::new();
        // gathered[k] = output position of the k-th gathered hidden row.
        let mut gathered = Vec::with_capacity(n_targets);
        for chunk in self.plan_chunks(&lens) {
            let rs = &order[chunk];
            let (b, t) = (rs.len(), rows[rs[0]].1);
            let mut ids = vec![0u32; b * t];
            let mut sel = Vec::new();
            for (k, &r) in rs.iter().enumerate() {
                let (i, len) = rows[r];
                ids[k * t..k * t + len].copy_from_slice(&batch.seqs[i][..len]);
                for (j, &p) in batch.targets[i].iter().enumerate() {
                    sel.push((k * t + p - 1) as u32);
                    gathered.push(first[r] + j);
                }
            }
            let mut x = self.embed(w, &ids)?;
            let positions: Vec<usize> = (0..t).collect();
            let rope = self.rope_tables(&positions, 1, t);
            for lw in &w.layers {
                x = self.block(lw, &x, b, t, &rope, AttnMask::Causal, None)?;
            }
            let n_sel = sel.len();
            parts.push(x.index_select(&Tensor::from_vec(sel, n_sel, &self.device)?, 0)?);
        }
        let hidden = if parts.len() == 1 {
            parts.pop().expect("one part")
        } else {
            Tensor::cat(&parts, 0)?
        };
        // Back to output order (targets flattened sequence by sequence).
        let mut perm = vec![0u32; n_targets];
        for (k, &o) in gathered.iter().enumerate() {
            perm[o] = k as u32;
        }
        let is_identity = perm.iter().enumerate().all(|(k, &p)| p as usize == k);
        let hidden = if is_identity {
            hidden
        } else {
            hidden.index_select(&Tensor::from_vec(perm, n_targets, &self.device)?, 0)?
        };
        let tgt: Vec<u32> = batch
            .seqs
            .iter()
            .zip(&batch.targets)
            .flat_map(|(s, tg)| tg.iter().map(move |&p| s[p]))
            .collect();
        let logits = self.head(w, &hidden)?;
        let both = ops::logp_entropy(&logits, &tgt, 1.0 / batch.temperature)?;
        let logp = both.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?;
        let entropy = both.narrow(1, 1, 1)?.squeeze(1)?.contiguous()?;
        Ok(ScoreOutput { logp, entropy })
    }

    // ------------------------------------------------------------------
    // Generation
    // ------------------------------------------------------------------

    /// Samples completions for a batch of prompts.
    ///
    /// Runs on detached weights (candle has no no-grad mode, so this is what
    /// keeps generation from building an autograd graph). Prompts are
    /// left-padded to a common length; each sequence's rotary positions start
    /// at 0 on its first real token and an additive mask hides its pad
    /// columns, so a prompt's distribution does not depend on what it is
    /// batched with (greedy output is identical alone or batched). Prompts
    /// are prefilled once, longest first, in chunks of similar length, into
    /// a preallocated per-layer KV cache (written in place with
    /// `slice_set`); then all unfinished sequences advance one token per
    /// step; finished ones are dropped from the batch (the caches are
    /// compacted). Each step samples the active sequences in that
    /// longest-first order from `rng`, so results are reproducible for the
    /// same prompts, options and seed.
    ///
    /// With `constraints` (one trie per prompt) a sequence can only emit one
    /// of its trie's actions followed by eos. Sampling uses the masked
    /// distribution (with top-p), but the reported `logprobs` are the
    /// *unconstrained* `log softmax(logits / temperature)` over the full
    /// vocabulary: that is the quantity [`Policy::score`] computes for the
    /// same sequence (which knows nothing about constraints), so the PPO
    /// ratio is exactly 1 before the first update, and the learning signal
    /// moves the model's own distribution towards admissible actions rather
    /// than relying on the mask.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        opts: &GenerateOptions,
        constraints: Option<&[TokenTrie]>,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<Generated>> {
        let vocab = self.cfg.vocab_size;
        if let Some(c) = constraints {
            if c.len() != prompts.len() {
                return Err(ModelError::InvalidArgument(format!(
                    "generate: {} prompts but {} constraint tries",
                    prompts.len(),
                    c.len()
                )));
            }
        }
        if opts.eos_token_id as usize >= vocab {
            return Err(ModelError::InvalidArgument(format!(
                "generate: eos id {} outside the vocabulary",
                opts.eos_token_id
            )));
        }
        let temperature = if opts.temperature.is_finite() && opts.temperature > 0.0 {
            opts.temperature
        } else if opts.greedy {
            1.0
        } else {
            return Err(ModelError::InvalidArgument(format!(
                "generate: temperature must be > 0 when sampling, got {}",
                opts.temperature
            )));
        };
        if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
            return Err(ModelError::InvalidArgument(format!(
                "generate: prompt {i} is empty"
            )));
        }
        let mut out: Vec<Generated> = prompts
            .iter()
            .map(|_| Generated {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finished: false,
            })
            .collect();
        if prompts.is_empty() || opts.max_new_tokens == 0 {
            return Ok(out);
        }
        let w = self.inference_weights()?;
        let n = prompts.len();
        let p_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = p_len + opts.max_new_tokens;
        // Longest first; each chunk is prefilled at its own length and
        // written right-aligned into the cache, so columns line up.
        let mut active: Vec<usize> = (0..n).collect();
        active.sort_by_key(|&i| std::cmp::Reverse(prompts[i].len()));
        let mut pads: Vec<usize> = active.iter().map(|&i| p_len - prompts[i].len()).collect();
        let lens: Vec<usize> = active.iter().map(|&i| prompts[i].len()).collect();
        let mut caches: Vec<Vec<LayerCache>> = Vec::new();
        let mut logits_parts = Vec::new();
        for chunk in self.plan_chunks(&lens) {
            let chunk_prompts: Vec<&[u32]> = active[chunk]
                .iter()
                .map(|&i| prompts[i].as_slice())
                .collect();
            let (c, l) = self.prefill(&w, &chunk_prompts, p_len, capacity)?;
            caches.push(c);
            logits_parts.push(l);
        }
        let mut cache: Vec<LayerCache> = if caches.len() == 1 {
            caches.pop().unwrap_or_default()
        } else {
            (0..self.cfg.num_hidden_layers)
                .map(|l| {
                    let ks: Vec<&Tensor> = caches.iter().map(|c| &c[l].k).collect();
                    let vs: Vec<&Tensor> = caches.iter().map(|c| &c[l].v).collect();
                    Ok(LayerCache {
                        k: Tensor::cat(&ks, 0)?,
                        v: Tensor::cat(&vs, 0)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        drop(caches);
        let mut logits = Tensor::cat(&logits_parts, 0)?;

        let sampler = Sampler {
            temperature,
            top_p: opts.top_p,
            greedy: opts.greedy,
            eos: opts.eos_token_id,
        };
        for step in 0..opts.max_new_tokens {
            let rows: Vec<Vec<f32>> = logits.to_vec2()?;
            let mut keep = Vec::with_capacity(active.len());
            for (row, &i) in active.iter().enumerate() {
                let allowed_buf: Vec<u32>;
                let allowed: Option<&[u32]> = match constraints {
                    None => None,
                    Some(tries) => {
                        let mut a = tries[i].allowed(&out[i].tokens);
                        if a.is_empty() {
                            // Empty trie: nothing but eos is admissible.
                            a.push(opts.eos_token_id);
                        }
                        allowed_buf = a;
                        Some(&allowed_buf)
                    }
                };
                let (tok, lp) = sampler.pick(&rows[row], allowed, rng);
                out[i].tokens.push(tok);
                out[i].logprobs.push(lp);
                if tok == opts.eos_token_id {
                    out[i].finished = true;
                } else {
                    keep.push(row);
                }
            }
            if keep.is_empty() || step + 1 == opts.max_new_tokens {
                break;
            }
            if keep.len() < active.len() {
                let idx = Tensor::from_vec(
                    keep.iter().map(|&r| r as u32).collect::<Vec<_>>(),
                    keep.len(),
                    &self.device,
                )?;
                for c in cache.iter_mut() {
                    c.k = c.k.index_select(&idx, 0)?;
                    c.v = c.v.index_select(&idx, 0)?;
                }
                active = keep.iter().map(|&r| active[r]).collect();
                pads = keep.iter().map(|&r| pads[r]).collect();
            }
            // One decode step for every active sequence.
            let b = active.len();
            let last: Vec<u32> = active
                .iter()
                .map(|&i| *out[i].tokens.last().expect("token just pushed"))
                .collect();
            let off = p_len + step;
            let positions: Vec<usize> = active.iter().map(|&i| prompts[i].len() + step).collect();
            let rope = self.rope_tables(&positions, b, 1);
            // Columns before every active sequence's first real token are
            // skipped outright; the rest of the padding is masked.
            let from = pads.iter().copied().min().unwrap_or(0);
            let s = off + 1 - from;
            let mut mask = vec![0f32; b * s];
            for (r, &pad) in pads.iter().enumerate() {
                mask[r * s..r * s + pad - from].fill(MASKED);
            }
            let mask = Tensor::from_vec(mask, (b, 1, 1, 1, s), &self.device)?;
            let mut x = self.embed(&w, &last)?;
            for (lw, c) in w.layers.iter().zip(cache.iter_mut()) {
                x = self.block(
                    lw,
                    &x,
                    b,
                    1,
                    &rope,
                    AttnMask::Additive(&mask),
                    Some((c, off, from)),
                )?;
            }
            logits = self.head(&w, &x)?;
        }
        Ok(out)
    }

    /// Next-token logits (unscaled, full vocabulary) after each prompt, on
    /// detached weights: for diagnostics such as the guidance influence
    /// ‖logit(·|s, g) − logit(·|s)‖.
    pub fn next_logits(&self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
            return Err(ModelError::InvalidArgument(format!(
                "next_logits: prompt {i} is empty"
            )));
        }
        let w = self.inference_weights()?;
        // One prompt at a time: no padding, so the logits are exactly those
        // of the unpadded sequence.
        prompts
            .iter()
            .map(|p| {
                let (_, logits) = self.prefill(&w, &[p.as_slice()], p.len(), p.len())?;
                Ok(logits.squeeze(0)?.to_vec1::<f32>()?)
            })
            .collect()
    }

    /// Prefills `prompts`, left-padded to their own longest length `t`,
    /// into fresh caches of `capacity` columns, written right-aligned so the
    /// prompts end at column `p_len` (columns before `p_len - t` stay zero
    /// and count as padding); returns the caches and the last position's
    /// logits.
    fn prefill(
        &self,
        w: &Weights,
        prompts: &[&[u32]],
        p_len: usize,
        capacity: usize,
    ) -> Result<(Vec<LayerCache>, Tensor)> {
        let b = prompts.len();
        let t = prompts.iter().map(|p| p.len()).max().unwrap_or(1);
        let off = p_len - t;
        let pad_id = self.cfg.pad_token_id.unwrap_or(0);
        let mut ids = vec![pad_id; b * t];
        let mut positions = vec![0usize; b * t];
        // Row r, query i may see column j iff j <= i and j is a real token;
        // pad queries see themselves (keeps every row finite; their outputs
        // are never read).
        let mut mask = vec![MASKED; b * t * t];
        for (r, p) in prompts.iter().enumerate() {
            let pad = t - p.len();
            ids[r * t + pad..(r + 1) * t].copy_from_slice(p);
            for i in 0..t {
                positions[r * t + i] = i.saturating_sub(pad);
                let row = &mut mask[(r * t + i) * t..(r * t + i + 1) * t];
                if i < pad {
                    row[i] = 0.0;
                } else {
                    row[pad..=i].fill(0.0);
                }
            }
        }
        let rope = self.rope_tables(&positions, b, t);
        let mask = Tensor::from_vec(mask, (b, 1, 1, t, t), &self.device)?;
        let (nkv, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim());
        let mut cache = Vec::with_capacity(w.layers.len());
        let mut x = self.embed(w, &ids)?;
        for lw in &w.layers {
            let mut c = LayerCache {
                k: Tensor::zeros((b, nkv, capacity, hd), DType::F32, &self.device)?,
                v: Tensor::zeros((b, nkv, capacity, hd), DType::F32, &self.device)?,
            };
            x = self.block(
                lw,
                &x,
                b,
                t,
                &rope,
                AttnMask::Additive(&mask),
                Some((&mut c, off, off)),
            )?;
            cache.push(c);
        }
        let last = x
            .reshape((b, t, self.cfg.hidden_size))?
            .narrow(1, t - 1, 1)?
            .squeeze(1)?;
        let logits = self.head(w, &last)?;
        Ok((cache, logits))
    }
}

/// Host-side token choice for one sequence at one step.
struct Sampler {
    temperature: f64,
    top_p: f64,
    greedy: bool,
    eos: u32,
}

impl Sampler {
    /// Returns the chosen token and its unconstrained behaviour log-prob.
    fn pick(&self, logits: &[f32], allowed: Option<&[u32]>, rng: &mut ChaCha8Rng) -> (u32, f32) {
        let inv_t = 1.0 / self.temperature;
        let tok = match allowed {
            Some(a) => self.choose(logits, a.iter().copied(), inv_t, rng),
            None => self.choose(logits, 0..logits.len() as u32, inv_t, rng),
        };
        // Full-vocabulary log-softmax at the temperature, in f64.
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
        let lse: f64 = logits
            .iter()
            .map(|&x| ((x as f64 - max) * inv_t).exp())
            .sum::<f64>()
            .ln();
        let lp = (logits[tok as usize] as f64 - max) * inv_t - lse;
        (tok, lp as f32)
    }

    fn choose(
        &self,
        logits: &[f32],
        cands: impl Iterator<Item = u32> + Clone,
        inv_t: f64,
        rng: &mut ChaCha8Rng,
    ) -> u32 {
        // Arg-max, ties to the lowest id (also the top-p order below).
        let best = cands
            .clone()
            .fold(None::<u32>, |best, c| match best {
                None => Some(c),
                Some(b) => {
                    let (lc, lb) = (logits[c as usize], logits[b as usize]);
                    if lc > lb || (lc == lb && c < b) {
                        Some(c)
                    } else {
                        Some(b)
                    }
                }
            })
            .unwrap_or(self.eos);
        if self.greedy {
            return best;
        }
        let m = logits[best as usize] as f64;
        let mut probs: Vec<(u32, f64)> = cands
            .map(|c| (c, ((logits[c as usize] as f64 - m) * inv_t).exp()))
            .collect();
        let total: f64 = probs.iter().map(|p| p.1).sum();
        let mut kept = probs.len();
        if self.top_p < 1.0 {
            // Only tokens with p >= eps can be in the nucleus: the others
            // together weigh less than n * eps = (1 - top_p) * total, so the
            // sorted prefix reaches top_p * total before leaving the p >= eps
            // set. Pruning first keeps the sort small for large vocabularies.
            let eps = total * (1.0 - self.top_p.max(0.0)) / probs.len() as f64;
            probs.retain(|p| p.1 >= eps);
            probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let target = self.top_p.max(0.0) * total;
            let mut cum = 0.0;
            kept = probs.len();
            for (j, p) in probs.iter().enumerate() {
                cum += p.1;
                if cum >= target {
                    kept = j + 1;
                    break;
                }
            }
        }
        let probs = &probs[..kept.max(1)];
        let mass: f64 = probs.iter().map(|p| p.1).sum();
        let u = rng.random::<f64>() * mass;
        let mut cum = 0.0;
        for p in probs {
            cum += p.1;
            if u < cum {
                return p.0;
            }
        }
        probs[probs.len() - 1].0
    }
}

// ----------------------------------------------------------------------
// Differentiable primitives
// ----------------------------------------------------------------------

/// `x (rows, in) @ w.T` for an HF `(out, in)` weight.
fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    Ok(x.matmul(&w.t()?)?)
}

#[cfg(test)]
#[path = "llama_tests.rs"]
mod tests;
