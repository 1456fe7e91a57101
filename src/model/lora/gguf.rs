//! LoRA adapters as llama.cpp LoRA GGUF files: what `llama-server --lora
//! FILE` loads beside a base model, so a run on llama.cpp hands the servers
//! a few MB of adapter after each optimiser step instead of the whole
//! merged model.
//!
//! The layout is the one llama.cpp's `convert_lora_to_gguf.py` writes and
//! `llama-adapter.cpp` reads: metadata `general.type = "adapter"`,
//! `adapter.type = "lora"`, `adapter.lora.alpha`, and the model's
//! `general.architecture`; per adapted projection the tensors
//! `<base GGUF name>.lora_a` (`A`, `(r, in)`) and `.lora_b` (`B`,
//! `(out, r)`), row-major as PyTorch stores them. llama.cpp scales the
//! update by `alpha / r` (r from `lora_a`), as PEFT does. For llama the
//! base Q/K rows are permuted in GGUF (see [`crate::model::gguf`]), so
//! `B`'s rows of those projections are permuted the same way; `A` acts on
//! the input and is stored as it is.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};

use super::{LoraConfig, Proj};
use crate::model::error::{ModelError, Result};
use crate::model::gguf::{permute_rows, permuted_heads, unpermute_rows};
use crate::model::gguf_file::Meta;
use crate::model::{GgufFile, Policy};

/// Suffix of an adapter's `A` under the base tensor's GGUF name.
pub const LORA_A: &str = ".lora_a";
/// Suffix of an adapter's `B`.
pub const LORA_B: &str = ".lora_b";

impl Policy {
    /// Writes the adapters alone as a llama.cpp LoRA GGUF (f32 tensors;
    /// the base model is written apart with [`Policy::write_gguf`], which
    /// leaves adapters out). Returns the bytes written.
    pub fn write_lora_gguf(&self, path: &Path) -> Result<u64> {
        let Some(cfg) = self.lora() else {
            return Err(ModelError::InvalidArgument(
                "write_lora_gguf: the policy has no LoRA adapters".into(),
            ));
        };
        let md: Vec<(&str, Value)> = vec![
            (
                "general.architecture",
                Value::String(self.arch().family.model_type().into()),
            ),
            ("general.type", Value::String("adapter".into())),
            ("general.name", Value::String("actguide adapter".into())),
            ("adapter.type", Value::String("lora".into())),
            ("adapter.lora.alpha", Value::F32(cfg.alpha as f32)),
        ];
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        for (l, lw) in self.weights().layers.iter().enumerate() {
            for (i, ad) in lw.ad.iter().enumerate() {
                let Some(ad) = ad else { continue };
                let p = Proj::ALL[i];
                let base = p.weight().gguf_name(l);
                let cpu = |t: &candle_core::Tensor| {
                    t.detach().to_device(&Device::Cpu)?.to_dtype(DType::F32)
                };
                let a = cpu(&ad.a)?;
                let mut b = cpu(&ad.b)?;
                if let Some(n) = permuted_heads(self.config(), self.arch(), &p.weight().name(l)) {
                    b = permute_rows(&b, n)?;
                }
                for (suffix, t) in [(LORA_A, a), (LORA_B, b)] {
                    let q = QTensor::quantize(&t, GgmlDType::F32)?;
                    tensors.push((format!("{base}{suffix}"), q));
                }
            }
        }
        let io = |source: std::io::Error| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let f = File::create(path).map_err(io)?;
        let mut w = BufWriter::new(f);
        let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
        gguf_file::write(&mut w, &md_refs, &t_refs).map_err(|e| ModelError::Checkpoint {
            path: path.to_path_buf(),
            msg: format!("cannot write GGUF: {e}"),
        })?;
        use std::io::Write;
        w.flush().map_err(io)?;
        Ok(std::fs::metadata(path).map_err(io)?.len())
    }

    /// Attaches the adapters of a llama.cpp LoRA GGUF to this base policy
    /// (what `llama-server -m BASE --lora FILE` computes). Its targets and
    /// rank come from the tensors, alpha from `adapter.lora.alpha` (absent:
    /// alpha = r, llama.cpp's scale 1). Errors name the file and the key
    /// or tensor: not an adapter, another architecture, a tensor that
    /// adapts nothing this policy has, a half of a pair missing.
    pub fn load_lora_gguf(self, path: &Path) -> Result<Policy> {
        let g = GgufFile::open(path)?;
        let file = g.file();
        let m = Meta {
            md: g.metadata(),
            file: &file,
        };
        for (key, want) in [("general.type", "adapter"), ("adapter.type", "lora")] {
            let got = m.str(key)?;
            if got != want {
                return Err(m.bad(key, format!("\"{got}\", expected \"{want}\"")));
            }
        }
        let arch = self.arch().family.model_type();
        let got = m.str("general.architecture")?;
        if got != arch {
            return Err(m.bad(
                "general.architecture",
                format!("an adapter for {got}, the model is {arch}"),
            ));
        }
        let mut by_name: HashMap<String, candle_core::Tensor> =
            g.read_all_f32()?.into_iter().collect();
        // Which projections carry adapters: those of any layer (with_lora
        // then requires them in every layer).
        let layers = self.config().num_hidden_layers;
        let mut targets = Vec::new();
        let mut rank = None;
        for p in Proj::ALL {
            let a = (0..layers)
                .find_map(|l| by_name.get(&format!("{}{LORA_A}", p.weight().gguf_name(l))));
            if let Some(a) = a {
                targets.push(p.name().to_string());
                rank.get_or_insert(a.dims()[0]);
            }
        }
        let Some(rank) = rank else {
            return Err(ModelError::MissingTensor {
                file,
                name: format!("blk.0.attn_q.weight{LORA_A} (or any other adapter)"),
            });
        };
        let alpha = m.opt_f64("adapter.lora.alpha")?.unwrap_or(rank as f64);
        let cfg = LoraConfig {
            rank,
            alpha,
            dropout: 0.0,
            targets,
        };
        let mut peft = HashMap::new();
        for l in 0..layers {
            for p in cfg.projections()? {
                let base = p.weight().gguf_name(l);
                for (suffix, is_a) in [(LORA_A, true), (LORA_B, false)] {
                    let name = format!("{base}{suffix}");
                    let t = by_name
                        .remove(&name)
                        .ok_or_else(|| ModelError::MissingTensor {
                            file: file.clone(),
                            name: name.clone(),
                        })?;
                    let t = match permuted_heads(self.config(), self.arch(), &p.weight().name(l)) {
                        Some(n)
                            if !is_a
                                && t.dims().first() == Some(&(n * self.config().head_dim())) =>
                        {
                            unpermute_rows(&t, n)?
                        }
                        _ => t,
                    };
                    peft.insert(p.tensor_name(l, is_a), t);
                }
            }
        }
        if let Some(name) = by_name.keys().min() {
            return Err(ModelError::UnexpectedTensor {
                file,
                name: name.clone(),
            });
        }
        self.with_lora_tensors(&cfg, peft, &file)
    }
}
