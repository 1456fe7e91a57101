//! The policy's parameter tensors and where they come from: the weight
//! structs, the parameter list (HF name and shape) a config and
//! architecture need, random init, and building a policy from named
//! tensors with every name, shape and dtype checked.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use super::{Policy, PolicyParts};
use crate::model::config::{Arch, ModelConfig};
use crate::model::error::{ModelError, Result};
use crate::model::names::{LayerTensor, EMBED, LM_HEAD, NORM};

/// Weights of one decoder block (HF shapes: `(out, in)`).
#[derive(Clone)]
pub(crate) struct LayerW {
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) o: Tensor,
    pub(crate) gate: Tensor,
    pub(crate) up: Tensor,
    pub(crate) down: Tensor,
    pub(crate) ln1: Tensor,
    pub(crate) ln2: Tensor,
    /// q/k/v projection biases (`Arch::qkv_bias`), shapes `(out,)`.
    pub(crate) bq: Option<Tensor>,
    pub(crate) bk: Option<Tensor>,
    pub(crate) bv: Option<Tensor>,
    /// o projection bias (`Arch::o_bias`), `(hidden,)`.
    pub(crate) bo: Option<Tensor>,
    /// Per-head RMSNorm weights of q and k (`Arch::qk_norm`), `(head_dim,)`.
    pub(crate) q_norm: Option<Tensor>,
    pub(crate) k_norm: Option<Tensor>,
    /// `cat([gate, up])`, precomputed for generation (detached weights);
    /// `None` on the training path, where it is rebuilt from the `Var`s.
    pub(crate) gu: Option<Tensor>,
    /// LoRA adapters indexed by [`crate::model::lora::Proj::index`]; empty without LoRA.
    pub(crate) ad: Vec<Option<Adapter>>,
}

/// One LoRA adapter: `A (r, in)`, `B (out, r)`.
#[derive(Clone)]
pub(crate) struct Adapter {
    pub(crate) a: Tensor,
    pub(crate) b: Tensor,
}

/// Bumped whenever any `Var` changes in place (the optimiser's step), so
/// copies derived from weights (bf16 rollout weights) know they are stale.
static WEIGHTS_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Marks every policy's weights as changed (called after each optimiser step).
pub fn note_weights_changed() {
    WEIGHTS_EPOCH.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// The current weights epoch (see [`note_weights_changed`]).
pub(crate) fn weights_epoch() -> u64 {
    WEIGHTS_EPOCH.load(std::sync::atomic::Ordering::SeqCst)
}

/// Every weight of the policy.
#[derive(Clone)]
pub(crate) struct Weights {
    pub(crate) embed: Tensor,
    pub(crate) layers: Vec<LayerW>,
    pub(crate) norm: Tensor,
    /// `None` when tied to `embed`.
    pub(crate) lm_head: Option<Tensor>,
}

impl LayerW {
    /// Builds a layer from its tensors: `take(t)` gives tensor `t` or
    /// `None` when the architecture lacks it (every architecture has the
    /// projections and the two norms).
    fn from_fn(mut take: impl FnMut(LayerTensor) -> Option<Tensor>) -> LayerW {
        const SPEC: &str = "spec'd tensor present";
        LayerW {
            q: take(LayerTensor::Q).expect(SPEC),
            k: take(LayerTensor::K).expect(SPEC),
            v: take(LayerTensor::V).expect(SPEC),
            o: take(LayerTensor::O).expect(SPEC),
            gate: take(LayerTensor::Gate).expect(SPEC),
            up: take(LayerTensor::Up).expect(SPEC),
            down: take(LayerTensor::Down).expect(SPEC),
            ln1: take(LayerTensor::Ln1).expect(SPEC),
            ln2: take(LayerTensor::Ln2).expect(SPEC),
            bq: take(LayerTensor::QBias),
            bk: take(LayerTensor::KBias),
            bv: take(LayerTensor::VBias),
            bo: take(LayerTensor::OBias),
            q_norm: take(LayerTensor::QNorm),
            k_norm: take(LayerTensor::KNorm),
            gu: None,
            ad: Vec::new(),
        }
    }

    /// Tensor `t` of this layer, if the architecture has it.
    fn get(&self, t: LayerTensor) -> Option<&Tensor> {
        match t {
            LayerTensor::Q => Some(&self.q),
            LayerTensor::K => Some(&self.k),
            LayerTensor::V => Some(&self.v),
            LayerTensor::O => Some(&self.o),
            LayerTensor::Gate => Some(&self.gate),
            LayerTensor::Up => Some(&self.up),
            LayerTensor::Down => Some(&self.down),
            LayerTensor::Ln1 => Some(&self.ln1),
            LayerTensor::Ln2 => Some(&self.ln2),
            LayerTensor::QBias => self.bq.as_ref(),
            LayerTensor::KBias => self.bk.as_ref(),
            LayerTensor::VBias => self.bv.as_ref(),
            LayerTensor::OBias => self.bo.as_ref(),
            LayerTensor::QNorm => self.q_norm.as_ref(),
            LayerTensor::KNorm => self.k_norm.as_ref(),
        }
    }
}

impl Weights {
    /// Applies `f` to every tensor (the precomputed `gu` is dropped).
    pub(crate) fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Weights> {
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

    /// No autograd tracking (same storage where `t` is already in `dtype`):
    /// generation on these builds no graph.
    pub(crate) fn detached(&self, dtype: DType) -> Result<Weights> {
        let mut w = self.map(&|t| Ok(t.detach().to_dtype(dtype)?))?;
        for l in &mut w.layers {
            l.gu = Some(Tensor::cat(&[&l.gate, &l.up], 0)?);
        }
        Ok(w)
    }

    /// bf16 copies of the weights generation multiplies by (projections,
    /// the precomputed `gu`, the LM head, untied from the embedding, which
    /// stays f32 for the lookup); norms and biases stay f32.
    pub(crate) fn rollout_bf16(mut self) -> Result<Weights> {
        use rayon::prelude::*;
        let mut head = self.head().clone();
        let mut slots: Vec<&mut Tensor> = Vec::new();
        for l in &mut self.layers {
            if l.gu.is_none() {
                l.gu = Some(Tensor::cat(&[&l.gate, &l.up], 0)?);
            }
            slots.extend([&mut l.q, &mut l.k, &mut l.v, &mut l.o, &mut l.down]);
            slots.extend(l.gu.as_mut());
        }
        // One tensor per task over the pool: the conversion reads 4 and
        // writes 2 bytes per weight, once per weights version.
        slots.push(&mut head);
        slots.par_iter_mut().try_for_each(|t| -> Result<()> {
            **t = t.to_dtype(DType::BF16)?;
            Ok(())
        })?;
        self.lm_head = Some(head);
        Ok(self)
    }

    /// The weights generation multiplies by, which rollout copies convert
    /// or pack: every projection, the fused gate/up and the LM head (the
    /// embedding when tied).
    pub(crate) fn rollout_products(&self) -> Vec<&Tensor> {
        let mut out = Vec::new();
        for l in &self.layers {
            out.extend([&l.q, &l.k, &l.v, &l.o, &l.down]);
            out.extend(l.gu.as_ref());
        }
        out.push(self.head());
        out
    }

    /// The ids of every tensor, in a fixed order: with
    /// [`weights_epoch`], what a cache of derived weights is keyed by
    /// (a replaced tensor has a new id; an updated `Var` keeps its id but
    /// bumps the epoch).
    pub(crate) fn ids(&self) -> Vec<candle_core::TensorId> {
        let mut out = vec![self.embed.id(), self.norm.id()];
        out.extend(self.lm_head.as_ref().map(Tensor::id));
        for l in &self.layers {
            for t in LayerTensor::ALL {
                out.extend(l.get(t).map(Tensor::id));
            }
            for a in l.ad.iter().flatten() {
                out.extend([a.a.id(), a.b.id()]);
            }
        }
        out
    }

    /// The LM head: its own weight, or the embedding when tied.
    pub(crate) fn head(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Every base weight under its HF name, sorted by name.
    pub(crate) fn named(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![
            (EMBED.to_string(), self.embed.clone()),
            (NORM.to_string(), self.norm.clone()),
        ];
        for (i, l) in self.layers.iter().enumerate() {
            for t in LayerTensor::ALL {
                if let Some(x) = l.get(t) {
                    out.push((t.name(i), x.clone()));
                }
            }
        }
        if let Some(h) = &self.lm_head {
            out.push((LM_HEAD.to_string(), h.clone()));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// HF shape of layer tensor `t` under `cfg`, or `None` when `arch` lacks it.
fn layer_shape(t: LayerTensor, cfg: &ModelConfig, arch: &Arch) -> Option<Vec<usize>> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let hd = cfg.head_dim();
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    Some(match t {
        LayerTensor::Q => vec![nh * hd, h],
        LayerTensor::K | LayerTensor::V => vec![nkv * hd, h],
        LayerTensor::O => vec![h, nh * hd],
        LayerTensor::Gate | LayerTensor::Up => vec![i, h],
        LayerTensor::Down => vec![h, i],
        LayerTensor::Ln1 | LayerTensor::Ln2 => vec![h],
        LayerTensor::QBias if arch.qkv_bias() => vec![nh * hd],
        LayerTensor::KBias | LayerTensor::VBias if arch.qkv_bias() => vec![nkv * hd],
        LayerTensor::OBias if arch.o_bias() => vec![h],
        LayerTensor::QNorm | LayerTensor::KNorm if arch.qk_norm() => vec![hd],
        LayerTensor::QBias
        | LayerTensor::KBias
        | LayerTensor::VBias
        | LayerTensor::OBias
        | LayerTensor::QNorm
        | LayerTensor::KNorm => return None,
    })
}

/// Names and HF shapes of every parameter the config and architecture
/// need, sorted by name.
fn param_specs(cfg: &ModelConfig, arch: &Arch) -> Vec<(String, Vec<usize>)> {
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut out = vec![(EMBED.to_string(), vec![v, h]), (NORM.to_string(), vec![h])];
    for l in 0..cfg.num_hidden_layers {
        for t in LayerTensor::ALL {
            if let Some(shape) = layer_shape(t, cfg, arch) {
                out.push((t.name(l), shape));
            }
        }
    }
    if !cfg.tie_word_embeddings {
        out.push((LM_HEAD.to_string(), vec![v, h]));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
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
        let device = match tensors.get(EMBED) {
            Some(t) => t.device().clone(),
            None => {
                return Err(ModelError::MissingTensor {
                    file: file.to_string(),
                    name: EMBED.to_string(),
                })
            }
        };
        Self::assemble(cfg, arch, tensors, &|_| file.to_string(), &device, true)
    }

    /// Checks `tensors` against the parameter list of `cfg` + `arch` and
    /// builds the policy on `device`. `file_of(name)` names the file a
    /// tensor comes (or should come) from, for error messages: sharded
    /// checkpoints name the shard.
    pub(in crate::model) fn assemble(
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
                || (cfg.tie_word_embeddings && name == LM_HEAD);
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
            .map(|l| LayerW::from_fn(|t| got.remove(&t.name(l))))
            .collect();
        let w = Weights {
            embed: got.remove(EMBED).expect(SPEC),
            layers,
            norm: got.remove(NORM).expect(SPEC),
            lm_head: if cfg.tie_word_embeddings {
                None
            } else {
                Some(got.remove(LM_HEAD).expect(SPEC))
            },
        };
        Ok(Policy::new(PolicyParts {
            cfg: cfg.clone(),
            arch: arch.clone(),
            device: device.clone(),
            dtype: DType::F32,
            w,
            vars,
            lora: None,
        }))
    }
}
