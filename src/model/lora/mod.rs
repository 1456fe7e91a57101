//! LoRA adapters (Hu et al. 2021) in the PEFT layout: the settings
//! ([`LoraConfig`]), which projections they attach to ([`Proj`]), and the
//! files PEFT reads and writes (`adapter_config.json`,
//! `adapter_model.safetensors` with `base_model.model.<module>.lora_A/B`
//! names).
//!
//! The adapted forward is `y = x Wᵀ + (alpha / r) · dropout(x) Aᵀ Bᵀ` with
//! `A: (r, in)`, `B: (out, r)`; `B` starts at zero so an adapted model
//! starts exactly at its base. The adapters live in [`super::Policy`];
//! the methods that attach, apply, merge, save and load them are in
//! `adapters.rs` ([`super::Policy::with_lora`], [`super::Policy::merged`],
//! [`super::Policy::save_adapter`], [`super::Policy::load_adapter`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::error::{ModelError, Result};
use super::names::{layer_prefix, LayerTensor};

mod adapters;
mod gguf;

pub use gguf::{LORA_A, LORA_B};

/// Adapter weights file name (PEFT).
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// Adapter config file name (PEFT).
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// A projection matrix LoRA can adapt, by its HF module name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Proj {
    pub const ALL: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::O,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];

    /// The projection's weight in a decoder layer.
    pub fn weight(self) -> LayerTensor {
        match self {
            Proj::Q => LayerTensor::Q,
            Proj::K => LayerTensor::K,
            Proj::V => LayerTensor::V,
            Proj::O => LayerTensor::O,
            Proj::Gate => LayerTensor::Gate,
            Proj::Up => LayerTensor::Up,
            Proj::Down => LayerTensor::Down,
        }
    }

    /// Short module name, as in PEFT's `target_modules`.
    pub fn name(self) -> &'static str {
        let path = self.path();
        path.rsplit_once('.').map_or(path, |(_, n)| n)
    }

    /// Path below `model.layers.<i>.` (the weight's name without
    /// `.weight`).
    pub fn path(self) -> &'static str {
        let w = self.weight().hf();
        w.strip_suffix(".weight").unwrap_or(w)
    }

    pub fn parse(s: &str) -> Option<Proj> {
        Proj::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Position in [`Proj::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// PEFT tensor name of this projection's `lora_A` (`a = true`) or
    /// `lora_B` in layer `layer`.
    pub fn tensor_name(self, layer: usize, a: bool) -> String {
        format!(
            "base_model.model.{}.{}.lora_{}.weight",
            layer_prefix(layer),
            self.path(),
            if a { "A" } else { "B" }
        )
    }
}

/// LoRA settings (the experiment file's `model.lora`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank r of the update `B A`.
    #[serde(default = "d_rank")]
    pub rank: usize,
    /// Scale numerator: the update is multiplied by `alpha / rank`.
    #[serde(default = "d_alpha")]
    pub alpha: f64,
    /// Dropout on the adapter's input during training (0 = none).
    #[serde(default)]
    pub dropout: f64,
    /// Adapted modules: any of q_proj, k_proj, v_proj, o_proj, gate_proj,
    /// up_proj, down_proj.
    #[serde(default = "d_targets")]
    pub targets: Vec<String>,
}

fn d_rank() -> usize {
    8
}
fn d_alpha() -> f64 {
    16.0
}
fn d_targets() -> Vec<String> {
    Proj::ALL.iter().map(|p| p.name().to_string()).collect()
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            rank: d_rank(),
            alpha: d_alpha(),
            dropout: 0.0,
            targets: d_targets(),
        }
    }
}

impl LoraConfig {
    /// Checks the values and returns the adapted projections, in
    /// [`Proj::ALL`] order.
    pub fn projections(&self) -> Result<Vec<Proj>> {
        if self.rank == 0 {
            return Err(ModelError::InvalidConfig(
                "lora.rank must be at least 1".into(),
            ));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(ModelError::InvalidConfig(format!(
                "lora.alpha must be > 0, got {}",
                self.alpha
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(ModelError::InvalidConfig(format!(
                "lora.dropout must be in [0, 1), got {}",
                self.dropout
            )));
        }
        if self.targets.is_empty() {
            return Err(ModelError::InvalidConfig(
                "lora.targets is empty: name at least one module".into(),
            ));
        }
        let mut out = Vec::new();
        for t in &self.targets {
            let p = Proj::parse(t).ok_or_else(|| {
                ModelError::InvalidConfig(format!(
                    "lora.targets: unknown module `{t}` (known: {})",
                    d_targets().join(", ")
                ))
            })?;
            if out.contains(&p) {
                return Err(ModelError::InvalidConfig(format!(
                    "lora.targets: `{t}` named twice"
                )));
            }
            out.push(p);
        }
        out.sort();
        Ok(out)
    }

    /// The update's scale, `alpha / rank`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// PEFT's `adapter_config.json` for these settings.
    pub fn to_peft_json(&self, base_model: &str) -> serde_json::Value {
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": self.targets,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "use_rslora": false,
            "use_dora": false,
            "init_lora_weights": true,
            "modules_to_save": null,
        })
    }

    /// Reads a PEFT `adapter_config.json`; refuses adapter kinds and
    /// options this implementation does not compute (rsLoRA, DoRA,
    /// trained biases, per-module ranks).
    pub fn from_peft_file(path: &Path) -> Result<(LoraConfig, String)> {
        let err = |msg: String| ModelError::Config {
            path: path.to_path_buf(),
            msg,
        };
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        if v["peft_type"].as_str() != Some("LORA") {
            return Err(err(format!(
                "peft_type is {}, only LORA adapters are supported",
                v["peft_type"]
            )));
        }
        for (key, ok) in [
            ("use_rslora", v["use_rslora"].as_bool() != Some(true)),
            ("use_dora", v["use_dora"].as_bool() != Some(true)),
            (
                "fan_in_fan_out",
                v["fan_in_fan_out"].as_bool() != Some(true),
            ),
            (
                "bias",
                v["bias"].is_null() || v["bias"].as_str() == Some("none"),
            ),
            (
                "rank_pattern",
                v["rank_pattern"].as_object().is_none_or(|m| m.is_empty()),
            ),
            (
                "alpha_pattern",
                v["alpha_pattern"].as_object().is_none_or(|m| m.is_empty()),
            ),
            ("modules_to_save", v["modules_to_save"].is_null()),
        ] {
            if !ok {
                return Err(err(format!("unsupported setting `{key}`: {}", v[key])));
            }
        }
        let rank = v["r"]
            .as_u64()
            .ok_or_else(|| err("missing integer `r`".into()))? as usize;
        let alpha = v["lora_alpha"]
            .as_f64()
            .ok_or_else(|| err("missing number `lora_alpha`".into()))?;
        let targets = match &v["target_modules"] {
            serde_json::Value::Array(a) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| err(format!("target_modules entry {x} is not a string")))
                })
                .collect::<Result<Vec<_>>>()?,
            serde_json::Value::String(s) if s == "all-linear" => d_targets(),
            other => {
                return Err(err(format!(
                    "target_modules {other} is not a list of module names"
                )))
            }
        };
        let cfg = LoraConfig {
            rank,
            alpha,
            dropout: v["lora_dropout"].as_f64().unwrap_or(0.0),
            targets,
        };
        cfg.projections().map_err(|e| err(e.to_string()))?;
        let base = v["base_model_name_or_path"]
            .as_str()
            .unwrap_or("")
            .to_string();
        Ok((cfg, base))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_target_every_projection() {
        let c = LoraConfig::default();
        assert_eq!(c.projections().unwrap(), Proj::ALL.to_vec());
        assert_eq!(c.scale(), 2.0);
    }

    #[test]
    fn bad_settings_are_refused_with_the_key() {
        let bad = |f: &dyn Fn(&mut LoraConfig)| {
            let mut c = LoraConfig::default();
            f(&mut c);
            c.projections().unwrap_err().to_string()
        };
        assert!(bad(&|c| c.rank = 0).contains("lora.rank"));
        assert!(bad(&|c| c.alpha = -1.0).contains("lora.alpha"));
        assert!(bad(&|c| c.dropout = 1.0).contains("lora.dropout"));
        assert!(bad(&|c| c.targets = vec!["qproj".into()]).contains("unknown module `qproj`"));
        assert!(bad(&|c| c.targets = vec!["q_proj".into(), "q_proj".into()]).contains("twice"));
        assert!(bad(&|c| c.targets.clear()).contains("empty"));
    }

    #[test]
    fn peft_config_round_trips_and_refuses_what_we_do_not_compute() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(ADAPTER_CONFIG);
        let c = LoraConfig {
            rank: 4,
            alpha: 8.0,
            dropout: 0.05,
            targets: vec!["q_proj".into(), "down_proj".into()],
        };
        std::fs::write(&p, c.to_peft_json("base").to_string()).unwrap();
        let (back, base) = LoraConfig::from_peft_file(&p).unwrap();
        assert_eq!((back, base.as_str()), (c.clone(), "base"));
        let mut v = c.to_peft_json("base");
        v["use_dora"] = true.into();
        std::fs::write(&p, v.to_string()).unwrap();
        let e = LoraConfig::from_peft_file(&p).unwrap_err().to_string();
        assert!(e.contains("use_dora") && e.contains(ADAPTER_CONFIG), "{e}");
        std::fs::write(&p, "{").unwrap();
        assert!(LoraConfig::from_peft_file(&p)
            .unwrap_err()
            .to_string()
            .contains("not valid JSON"));
    }

    #[test]
    fn tensor_names_follow_peft() {
        assert_eq!(
            Proj::Gate.tensor_name(3, true),
            "base_model.model.model.layers.3.mlp.gate_proj.lora_A.weight"
        );
    }
}
