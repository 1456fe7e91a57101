//! Model configuration, field-compatible with Hugging Face
//! `LlamaForCausalLM` `config.json` files.
//!
//! The same struct describes the tiny random models used in tests and
//! experiments and real checkpoints (SmolLM2, Llama, Qwen2-style configs
//! without biases), so a config written by [`ModelConfig::save`] loads in
//! `transformers` and vice versa. Unknown fields (`rope_scaling`,
//! `torch_dtype`, ...) are ignored on load.

use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize};

use super::error::{ModelError, Result};

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
    /// Reads and validates a `config.json`. Configs asking for features this
    /// implementation lacks (`rope_scaling`, `attention_bias`, `mlp_bias`)
    /// are rejected.
    pub fn from_file(path: &Path) -> Result<Self> {
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
        // Fields that change the math but that this implementation lacks:
        // refuse rather than silently run a different model.
        for key in ["rope_scaling", "attention_bias", "mlp_bias"] {
            match raw.get(key) {
                None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {}
                Some(v) => return Err(cfg_err(format!("{key} = {v} is not supported"))),
            }
        }
        let cfg: ModelConfig = serde_json::from_value(raw).map_err(|e| cfg_err(e.to_string()))?;
        cfg.validate().map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            msg: match e {
                ModelError::InvalidConfig(m) => m,
                other => other.to_string(),
            },
        })?;
        Ok(cfg)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> ModelConfig {
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
