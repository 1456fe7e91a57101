//! Model configuration, field-compatible with Hugging Face `config.json`
//! files of the decoder families implemented here (`LlamaForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`).
//!
//! Two types split the config:
//! - [`ModelConfig`]: the dimensions every family shares (vocabulary,
//!   widths, heads, GQA, rope theta, tied head, special ids). The tiny
//!   random models used in tests and experiments are plain Llama
//!   `ModelConfig`s.
//! - [`Arch`]: what differs between families and checkpoints: the
//!   [`Family`] (from `model_type`/`architectures`), attention biases and
//!   `rope_scaling`. [`Arch::from_config`] gives a family's defaults;
//!   [`ModelConfig::from_file_with_arch`] reads both from a `config.json`.
//!
//! A config written by [`ModelConfig::save`] /
//! [`ModelConfig::save_with_arch`] loads in `transformers` and vice versa.
//! Unknown fields that do not change the math (`torch_dtype`,
//! `attention_dropout`, ...) are ignored on load; fields that would change
//! it in ways not implemented here are refused.

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

use super::error::{ConfigJsonError, ModelError, Result, RopeScalingError};

fn default_architectures() -> Vec<String> {
    vec!["LlamaForCausalLM".to_string()]
}
fn default_model_type() -> String {
    "llama".to_string()
}
fn default_initializer_range() -> f64 {
    0.02
}
fn default_rope_theta() -> f64 {
    10000.0
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_max_position_embeddings() -> usize {
    2048
}

/// HF configs store `eos_token_id` (and sometimes the others) either as an
/// integer or as a list of integers (Llama 3: `[128001, 128009]`). We keep
/// the first one; generation stops on a single eos id.
fn de_token_id<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<u32>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u32),
        Many(Vec<u32>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => None,
        Some(OneOrMany::One(x)) => Some(x),
        Some(OneOrMany::Many(v)) => v.first().copied(),
    })
}

/// Architecture hyper-parameters of a Llama-style decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    #[serde(default = "default_architectures")]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Grouped-query attention: query head `h` reads key/value head
    /// `h / (num_attention_heads / num_key_value_heads)` (HF `repeat_kv`).
    pub num_key_value_heads: usize,
    /// Per-head width; `hidden_size / num_attention_heads` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// When true the LM head reuses `model.embed_tokens.weight` and the
    /// checkpoint has no `lm_head.weight`.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default, deserialize_with = "de_token_id")]
    pub bos_token_id: Option<u32>,
    #[serde(default, deserialize_with = "de_token_id")]
    pub eos_token_id: Option<u32>,
    #[serde(default, deserialize_with = "de_token_id")]
    pub pad_token_id: Option<u32>,
    /// Standard deviation of the normal init used by [`crate::model::Policy::new_random`].
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
}

impl ModelConfig {
    /// Reads and validates a `config.json` of any supported family, for
    /// callers that keep only the [`ModelConfig`] (and so build the
    /// family's default [`Arch`]). Settings that [`Arch::from_config`]
    /// would not reproduce (`rope_scaling`, `attention_bias: true`) are
    /// refused rather than silently dropped; use
    /// [`ModelConfig::from_file_with_arch`] or
    /// [`crate::model::Policy::from_hf_dir`] for those.
    pub fn from_file(path: &Path) -> Result<Self> {
        let (cfg, arch) = Self::from_file_with_arch(path)?;
        let plain = Arch::from_config(&cfg)?;
        let cfg_err = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            msg,
        };
        if let Some(rs) = &arch.rope_scaling {
            return Err(cfg_err(format!(
                "rope_scaling = {} is not supported by ModelConfig::from_file (it would be \
                 dropped); load with ModelConfig::from_file_with_arch or Policy::from_hf_dir",
                rs.to_json()
            )));
        }
        if arch.attention_bias != plain.attention_bias {
            return Err(cfg_err(format!(
                "attention_bias = {} is not supported by ModelConfig::from_file (it would be \
                 dropped); load with ModelConfig::from_file_with_arch or Policy::from_hf_dir",
                arch.attention_bias
            )));
        }
        Ok(cfg)
    }

    /// Reads and validates a `config.json` with its architecture variant:
    /// the family (from `model_type` and `architectures`; an unknown value
    /// is [`ModelError::UnknownArchitecture`]), `attention_bias` and
    /// `rope_scaling`. Settings that change the math in ways not
    /// implemented here (`mlp_bias`, a `hidden_act` other than `silu`,
    /// `use_sliding_window`, unsupported rope scaling types) are refused.
    /// When `architectures` is absent it is set to the family's class name.
    pub fn from_file_with_arch(path: &Path) -> Result<(Self, Arch)> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let cfg_err = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            msg,
        };
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| cfg_err(e.to_string()))?;
        if !raw.is_object() {
            return Err(cfg_err("not a JSON object".into()));
        }
        // Fields that change the math but that this implementation lacks:
        // refuse rather than silently run a different model.
        let is_true = |k: &str| raw.get(k).and_then(serde_json::Value::as_bool) == Some(true);
        for key in ["mlp_bias", "use_sliding_window"] {
            if is_true(key) {
                return Err(cfg_err(format!("{key} = true is not supported")));
            }
        }
        match raw.get("hidden_act") {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(a)) if a == "silu" => {}
            Some(v) => {
                return Err(cfg_err(format!(
                    "hidden_act = {v} is not supported (only \"silu\")"
                )))
            }
        }
        let mut cfg: ModelConfig =
            serde_json::from_value(raw.clone()).map_err(|e| cfg_err(e.to_string()))?;
        let file = path.display().to_string();
        if raw.get("architectures").is_none() {
            // The serde default names Llama; use the family's own class.
            cfg.architectures.clear();
        }
        let family = Family::resolve(&cfg.model_type, &cfg.architectures, &file)?;
        if cfg.architectures.is_empty() {
            cfg.architectures = vec![family.class_name().to_string()];
        }
        let attention_bias = match raw.get("attention_bias") {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Bool(b)) => *b,
            Some(v) => return Err(cfg_err(format!("attention_bias = {v} is not a boolean"))),
        };
        let rope_scaling = RopeScaling::from_json(raw.get("rope_scaling"))
            .map_err(|m| cfg_err(format!("rope_scaling: {m}")))?;
        let arch = Arch {
            family,
            attention_bias,
            rope_scaling,
        };
        cfg.validate()
            .and_then(|()| arch.validate())
            .map_err(|e| ModelError::Config {
                path: path.to_path_buf(),
                msg: match e {
                    ModelError::InvalidConfig(m) => m,
                    other => other.to_string(),
                },
            })?;
        Ok((cfg, arch))
    }

    /// Writes the config with its architecture variant (`attention_bias`,
    /// `rope_scaling`, `hidden_act`) in HF form, so `transformers` builds
    /// the same model from it.
    pub fn save_with_arch(&self, arch: &Arch, path: &Path) -> Result<()> {
        let text = self.to_hf_json(arch).map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        std::fs::write(path, text).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The text [`ModelConfig::save_with_arch`] writes.
    pub fn to_hf_json(&self, arch: &Arch) -> std::result::Result<String, ConfigJsonError> {
        let mut v = serde_json::to_value(self)?;
        let obj = v.as_object_mut().ok_or(ConfigJsonError::NotAnObject)?;
        obj.insert("hidden_act".into(), "silu".into());
        if arch.family != Family::Qwen2 {
            // Qwen2 has no such field: its q/k/v biases are unconditional.
            obj.insert("attention_bias".into(), arch.attention_bias.into());
        }
        obj.insert(
            "rope_scaling".into(),
            arch.rope_scaling
                .as_ref()
                .map_or(serde_json::Value::Null, RopeScaling::to_json),
        );
        obj.insert("torch_dtype".into(), "float32".into());
        let text = serde_json::to_string_pretty(&v)?;
        Ok(text + "\n")
    }

    /// Writes the config as pretty JSON (HF field names).
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        std::fs::write(path, text + "\n").map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Checks the invariants the model code relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidConfig(m));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        if self.vocab_size > u32::MAX as usize {
            return bad(format!(
                "vocab_size {} does not fit u32 ids",
                self.vocab_size
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        match self.head_dim {
            Some(0) => return bad("head_dim must be > 0".into()),
            Some(_) => {}
            None => {
                if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
                    return bad(format!(
                        "hidden_size ({}) must be divisible by num_attention_heads ({}) when head_dim is not given",
                        self.hidden_size, self.num_attention_heads
                    ));
                }
            }
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim ({}) must be even for rotary embeddings",
                self.head_dim()
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return bad(format!("rope_theta must be > 0, got {}", self.rope_theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return bad(format!(
                "rms_norm_eps must be > 0, got {}",
                self.rms_norm_eps
            ));
        }
        if !(self.initializer_range.is_finite() && self.initializer_range >= 0.0) {
            return bad(format!(
                "initializer_range must be >= 0, got {}",
                self.initializer_range
            ));
        }
        for (name, id) in [
            ("bos_token_id", self.bos_token_id),
            ("eos_token_id", self.eos_token_id),
            ("pad_token_id", self.pad_token_id),
        ] {
            if let Some(id) = id {
                if id as usize >= self.vocab_size {
                    return bad(format!(
                        "{name} {id} is outside the vocabulary (vocab_size {})",
                        self.vocab_size
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The decoder families implemented by [`crate::model::Policy`]. All are
/// pre-norm decoders with RMSNorm, grouped-query attention, rotary
/// embeddings in the rotate-half layout and a SwiGLU MLP; they differ in
/// the attention projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `model_type` "llama", `LlamaForCausalLM` (Llama 2/3, SmolLM2, the
    /// tiny models): no biases unless `attention_bias`.
    Llama,
    /// `model_type` "qwen2", `Qwen2ForCausalLM` (Qwen2, Qwen2.5): q/k/v
    /// projections always have biases, o does not.
    Qwen2,
    /// `model_type` "qwen3", `Qwen3ForCausalLM`: per-head RMSNorm of q and
    /// k (`q_norm`, `k_norm`, width `head_dim`) after the projection and
    /// before rotary; biases only with `attention_bias`.
    Qwen3,
}

impl Family {
    const ALL: [Family; 3] = [Family::Llama, Family::Qwen2, Family::Qwen3];

    /// HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }

    /// HF model class (`architectures[0]`).
    pub fn class_name(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The family named by `model_type`; every entry of `architectures`
    /// must be that family's class. `file` names the config in errors.
    pub fn resolve(model_type: &str, architectures: &[String], file: &str) -> Result<Family> {
        let supported = Self::ALL
            .iter()
            .map(|f| format!("{} ({})", f.model_type(), f.class_name()))
            .collect::<Vec<_>>()
            .join(", ");
        let unknown = |field: &str, value: String| ModelError::UnknownArchitecture {
            file: file.to_string(),
            field: field.to_string(),
            value,
            supported: supported.clone(),
        };
        let family = Self::ALL
            .into_iter()
            .find(|f| f.model_type() == model_type)
            .ok_or_else(|| unknown("model_type", model_type.to_string()))?;
        for a in architectures {
            match Self::ALL.into_iter().find(|f| f.class_name() == a) {
                Some(f) if f == family => {}
                Some(_) => {
                    return Err(unknown(
                        "architectures",
                        format!("{a} (does not match model_type {model_type})"),
                    ))
                }
                None => return Err(unknown("architectures", a.clone())),
            }
        }
        Ok(family)
    }
}

/// HF `rope_scaling`: a rescaling of the rotary inverse frequencies,
/// computed once at load time exactly like `transformers`'
/// `ROPE_INIT_FUNCTIONS` (in f32). `rope_type` "default" (or a null
/// `rope_scaling`) means none.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `"linear"`: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// `"llama3"` (Llama 3.1/3.2): low frequencies (wavelength beyond
    /// `original_max_position_embeddings / low_freq_factor`) divided by
    /// `factor`, high ones (below `... / high_freq_factor`) kept, smooth
    /// interpolation between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
}

impl RopeScaling {
    /// Parses HF's `rope_scaling` value (type under `rope_type`, or the
    /// older `type`). Errors are messages; the caller adds the file.
    pub fn from_json(
        v: Option<&serde_json::Value>,
    ) -> std::result::Result<Option<Self>, RopeScalingError> {
        let obj = match v {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::Object(o)) => o,
            Some(other) => return Err(RopeScalingError::NotAnObject(other.to_string())),
        };
        let ty = obj
            .get("rope_type")
            .or_else(|| obj.get("type"))
            .and_then(serde_json::Value::as_str)
            .ok_or(RopeScalingError::MissingType)?;
        let num = |k: &str| -> std::result::Result<f64, RopeScalingError> {
            obj.get(k)
                .and_then(serde_json::Value::as_f64)
                .ok_or_else(|| RopeScalingError::MissingNumber {
                    kind: ty.to_string(),
                    key: k.to_string(),
                })
        };
        let scaling = match ty {
            "default" => return Ok(None),
            "linear" => RopeScaling::Linear {
                factor: num("factor")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: obj
                    .get("original_max_position_embeddings")
                    .and_then(serde_json::Value::as_u64)
                    .ok_or(RopeScalingError::MissingOriginalMax)?
                    as usize,
            },
            other => return Err(RopeScalingError::UnsupportedType(other.to_string())),
        };
        scaling.validate()?;
        Ok(Some(scaling))
    }

    /// HF form of the value (`rope_type` key).
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        }
    }

    fn validate(&self) -> std::result::Result<(), RopeScalingError> {
        let pos = |k: &str, x: f64| {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                Err(RopeScalingError::NotPositive {
                    key: k.to_string(),
                    value: x,
                })
            }
        };
        match *self {
            RopeScaling::Linear { factor } => pos("factor", factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                pos("factor", factor)?;
                pos("low_freq_factor", low_freq_factor)?;
                pos("high_freq_factor", high_freq_factor)?;
                if original_max_position_embeddings == 0 {
                    return Err(RopeScalingError::ZeroOriginalMax);
                }
                // The smooth interpolation divides by their difference.
                if high_freq_factor <= low_freq_factor {
                    return Err(RopeScalingError::FreqFactorOrder {
                        low: low_freq_factor,
                        high: high_freq_factor,
                    });
                }
                Ok(())
            }
        }
    }

    /// Rescales the default inverse frequencies in place (HF
    /// `_compute_linear_scaling_rope_parameters` /
    /// `_compute_llama3_parameters`, f32 arithmetic like torch).
    fn apply(&self, inv_freq: &mut [f32]) {
        match *self {
            RopeScaling::Linear { factor } => {
                for f in inv_freq.iter_mut() {
                    *f /= factor as f32;
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let (factor, low, high) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                );
                let old = original_max_position_embeddings as f32;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    *f = if wavelen < high_wavelen {
                        *f
                    } else if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * *f / factor + smooth * *f
                    };
                }
            }
        }
    }
}

/// The architecture variant of a model beyond its [`ModelConfig`]
/// dimensions: which tensors exist and how rotary frequencies are built.
#[derive(Debug, Clone, PartialEq)]
pub struct Arch {
    pub family: Family,
    /// HF `attention_bias` of Llama and Qwen3 configs: biases on the q, k,
    /// v and o projections. Ignored for Qwen2, whose q/k/v biases are
    /// unconditional (and whose o projection never has one).
    pub attention_bias: bool,
    pub rope_scaling: Option<RopeScaling>,
}

impl Arch {
    /// The family's defaults (no `attention_bias`, no rope scaling) for an
    /// in-memory config; an unknown `model_type`/`architectures` is
    /// [`ModelError::UnknownArchitecture`].
    pub fn from_config(cfg: &ModelConfig) -> Result<Arch> {
        Ok(Arch {
            family: Family::resolve(&cfg.model_type, &cfg.architectures, "<in-memory config>")?,
            attention_bias: false,
            rope_scaling: None,
        })
    }

    /// Whether q/k/v projections carry `*.bias` tensors.
    pub fn qkv_bias(&self) -> bool {
        self.family == Family::Qwen2 || self.attention_bias
    }

    /// Whether the o projection carries an `o_proj.bias`.
    pub fn o_bias(&self) -> bool {
        self.family != Family::Qwen2 && self.attention_bias
    }

    /// Whether attention has per-head `q_norm`/`k_norm` RMSNorms (Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.family == Family::Qwen3
    }

    /// Checks the rope scaling parameters.
    pub fn validate(&self) -> Result<()> {
        if let Some(rs) = &self.rope_scaling {
            rs.validate()
                .map_err(|m| ModelError::InvalidConfig(format!("rope_scaling: {m}")))?;
        }
        Ok(())
    }

    /// Rotary inverse frequencies (`head_dim / 2`), in f32 like HF:
    /// `1 / theta^(2i / head_dim)`, then `rope_scaling`.
    pub fn inv_freq(&self, cfg: &ModelConfig) -> Vec<f32> {
        let hd = cfg.head_dim();
        let mut inv: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0f32 / (cfg.rope_theta as f32).powf((2 * i) as f32 / hd as f32))
            .collect();
        if let Some(rs) = &self.rope_scaling {
            rs.apply(&mut inv);
        }
        inv
    }
}

#[cfg(test)]
pub(in crate::model) mod tests {
    use super::*;

    /// A 2-layer, 32-wide Llama config for tests (vocabulary 50).
    pub(in crate::model) fn tiny() -> ModelConfig {
        ModelConfig {
            architectures: default_architectures(),
            model_type: default_model_type(),
            vocab_size: 50,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: None,
            rope_theta: 10000.0,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 512,
            tie_word_embeddings: true,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            pad_token_id: Some(0),
            initializer_range: 0.02,
        }
    }

    #[test]
    fn roundtrip_and_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        let cfg = tiny();
        cfg.save(&p).unwrap();
        assert_eq!(ModelConfig::from_file(&p).unwrap(), cfg);
        assert_eq!(cfg.head_dim(), 8);

        // A minimal HF-style config with a list eos and unknown fields.
        let json = r#"{"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
            "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": [2, 3],
            "torch_dtype": "bfloat16", "rope_scaling": null}"#;
        let c: ModelConfig = serde_json::from_str(json).unwrap();
        assert_eq!(c.eos_token_id, Some(2));
        assert_eq!(c.pad_token_id, None);
        assert_eq!(c.architectures, vec!["LlamaForCausalLM".to_string()]);
        assert_eq!(c.model_type, "llama");
        assert_eq!(c.initializer_range, 0.02);
        c.validate().unwrap();
    }

    #[test]
    fn validate_rejects_bad_configs() {
        let mut c = tiny();
        c.num_key_value_heads = 3;
        assert!(c.validate().is_err());
        let mut c = tiny();
        c.eos_token_id = Some(50);
        assert!(c.validate().is_err());
        let mut c = tiny();
        c.head_dim = Some(7);
        assert!(c.validate().is_err());

        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        let mut v = serde_json::to_value(tiny()).unwrap();
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
        std::fs::write(&p, v.to_string()).unwrap();
        let e = ModelConfig::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("rope_scaling"), "{e}");

        let mut c = tiny();
        c.hidden_size = 30;
        c.save(&p).unwrap();
        let e = ModelConfig::from_file(&p).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("hidden_size"),
            "{e}"
        );
    }
}
