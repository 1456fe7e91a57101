//! LoRA adapters on the policy: attaching fresh or saved adapters
//! (freezing the base), the adapted forward's update and dropout, merging
//! adapters into the base, and PEFT adapter files.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Tensor, Var};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::{LoraConfig, Proj, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use crate::model::error::{ModelError, Result};
use crate::model::llama::{linear, Adapter, LayerW, Policy, PolicyParts, Weights};
use crate::model::ops;

impl Policy {
    /// HF `(out, in)` shape of projection `p`.
    fn proj_shape(&self, p: Proj) -> (usize, usize) {
        let c = self.config();
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
        for l in 0..self.config().num_hidden_layers {
            for &p in &projs {
                let (out, inp) = self.proj_shape(p);
                let bound = 1.0 / (inp as f32).sqrt();
                let a: Vec<f32> = (0..cfg.rank * inp)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect();
                tensors.insert(
                    p.tensor_name(l, true),
                    Tensor::from_vec(a, (cfg.rank, inp), self.device())?,
                );
                tensors.insert(
                    p.tensor_name(l, false),
                    Tensor::zeros((out, cfg.rank), DType::F32, self.device())?,
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
        if self.lora().is_some() {
            return Err(ModelError::InvalidArgument(
                "the policy already has LoRA adapters (merge them first)".into(),
            ));
        }
        let projs = cfg.projections()?;
        let mut w = self.weights().map(&|t| Ok(t.detach()))?;
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
                    let t = t.to_dtype(DType::F32)?.to_device(self.device())?;
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
        let precision = self.precision();
        Policy::new(PolicyParts {
            cfg: self.config().clone(),
            arch: self.arch().clone(),
            device: self.device().clone(),
            dtype: DType::F32,
            w,
            vars,
            lora: Some(cfg.clone()),
        })
        .with_precision(precision)
    }

    /// The adapter tensors under their PEFT names, sorted (empty without
    /// LoRA). They share storage with the model.
    pub fn adapter_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (l, lw) in self.weights().layers.iter().enumerate() {
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
        let Some(cfg) = self.lora() else {
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
        let tensors = candle_core::safetensors::load(&wpath, self.device()).map_err(|e| {
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
            self.config(),
            self.arch(),
            tensors,
            &|_| "<merged>".into(),
            self.device(),
            true,
        )
    }

    /// The weights with each adapter's update merged into its base
    /// projection, detached, in the compute dtype (the base's own weights
    /// without adapters). Generation caches them (`inference_weights`).
    pub(in crate::model) fn merged_weights(&self) -> Result<Weights> {
        let Some(cfg) = self.lora() else {
            return self.weights().detached(self.dtype());
        };
        let scale = cfg.scale();
        let mut w = self.weights().map(&|t| Ok(t.detach()))?;
        for lw in &mut w.layers {
            for (i, ad) in std::mem::take(&mut lw.ad).into_iter().enumerate() {
                let Some(ad) = ad else { continue };
                // In f32 from the f32 adapters, rounded once to the base's dtype.
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
                *slot = (&*slot + delta.to_dtype(slot.dtype())?)?;
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
        *self.dropout_rng() = seed.map(ChaCha8Rng::seed_from_u64);
    }

    /// `(alpha / r) · dropout(x) Aᵀ Bᵀ` for projection `p`, or `None` when
    /// it has no adapter.
    pub(in crate::model) fn lora_delta(
        &self,
        lw: &LayerW,
        p: Proj,
        x: &Tensor,
    ) -> Result<Option<Tensor>> {
        let (Some(Some(ad)), Some(cfg)) = (lw.ad.get(p.index()), self.lora()) else {
            return Ok(None);
        };
        let x = self.lora_dropout(x, cfg.dropout)?;
        let d = linear(&linear(&x, &ad.a)?, &ad.b)?;
        Ok(Some((d * cfg.scale())?))
    }

    /// `x Wᵀ` plus the updates of the adapters of `ps`, for the frozen base
    /// weights `ws` of the same projections (one, or gate and up, whose
    /// outputs are then side by side), as one fused product
    /// ([`ops::lora_linear`]); `None` where a projection has no adapter or
    /// the fused product does not apply ([`Policy::lora_updates_fused`]).
    pub(in crate::model) fn lora_product(
        &self,
        lw: &LayerW,
        ps: &[Proj],
        x: &Tensor,
        ws: &[&Tensor],
    ) -> Result<Option<Tensor>> {
        let Some(cfg) = self.lora().filter(|_| self.lora_updates_fused()) else {
            return Ok(None);
        };
        let mut ads = Vec::with_capacity(ps.len());
        for p in ps {
            match lw.ad.get(p.index()) {
                Some(Some(ad)) => ads.push(ad),
                _ => return Ok(None),
            }
        }
        let stack = |part: fn(&Adapter) -> &Tensor| -> Result<Tensor> {
            Ok(match ads.as_slice() {
                [one] => part(one).clone(),
                _ => Tensor::cat(&ads.iter().map(|a| part(a)).collect::<Vec<_>>(), 0)?,
            })
        };
        let (a, b) = (stack(|ad| &ad.a)?, stack(|ad| &ad.b)?);
        let ws: Vec<Tensor> = ws.iter().map(|w| w.detach()).collect();
        ops::lora_linear(x, &ws, &a, &b, cfg.scale())
    }

    /// Inverted dropout with masks from the seeded stream, when one is set.
    fn lora_dropout(&self, x: &Tensor, p: f64) -> Result<Tensor> {
        // Only the trained policy drops (not a frozen KL reference).
        if p <= 0.0 || !self.is_trainable() {
            return Ok(x.clone());
        }
        let mut guard = self.dropout_rng();
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
        let mask = Tensor::from_vec(mask, x.shape(), self.device())?.to_dtype(x.dtype())?;
        Ok((x * mask)?)
    }
}
