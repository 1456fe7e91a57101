//! GGUF files (llama.cpp's single-file format): loading one into the
//! trainable [`Policy`] and writing a policy back as one.
//!
//! This module owns the GGUF side of the mapping: which metadata keys give
//! which [`ModelConfig`] / [`Arch`] field ([`gguf_config`]), the tensor
//! names (`blk.N.attn_q.weight` ↔ `model.layers.N.self_attn.q_proj.weight`,
//! ..., from the table in [`crate::model::names`]), dequantisation of every ggml type candle knows (F32, F16, BF16,
//! Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, K-quants) to f32, and llama.cpp's row
//! permutation of the Q/K projections. [`Policy`] still owns which tensors
//! an architecture needs and their shapes; the tokenizer stored in the same
//! file is built by [`crate::model::gguf_tokenizer`].
//!
//! **Q/K permutation.** llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.
//! modify_tensors`) rewrites the rows of `q_proj`/`k_proj` (weights and
//! biases) of llama-architecture models with
//! `permute(w, n_head) = w.reshape(n_head, 2, head_dim/2, ...).swapaxes(1, 2)`
//! (`n_head` = kv heads for K), because ggml's "normal" rope rotates
//! adjacent pairs `(2i, 2i+1)` while HF rotates halves `(i, i + head_dim/2)`.
//! We use HF's rotate-half layout, so [`Policy::from_gguf`] undoes it for
//! `general.architecture = llama` and [`Policy::write_gguf`] applies it.
//! Qwen2/Qwen3 are converted without the permutation (their ggml rope is
//! the "neox" rotate-half one; candle-transformers' `quantized_qwen2` uses
//! `rope` where `quantized_llama` uses `rope_i`), so their rows are used
//! as stored.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Tensor};

pub use candle_core::quantized::GgmlDType;

use super::config::{Arch, Family, ModelConfig, RopeScaling};
use super::error::{ModelError, Result};
use super::gguf_tokenizer::GgufVocab;
use super::llama::Policy;
use super::names::{LayerTensor, GGUF_BLOCKS, GGUF_EMBED, GGUF_LM_HEAD};

pub use super::gguf_file::GgufFile;
use super::gguf_file::Meta;

pub use super::names::{gguf_to_hf_name, hf_to_gguf_name};

// --- config ------------------------------------------------------------------

fn family_of(arch: &str, file: &str) -> Result<Family> {
    match arch {
        "llama" => Ok(Family::Llama),
        "qwen2" => Ok(Family::Qwen2),
        "qwen3" => Ok(Family::Qwen3),
        other => Err(ModelError::UnknownArchitecture {
            file: file.to_string(),
            field: "general.architecture".into(),
            value: other.to_string(),
            supported: "llama, qwen2, qwen3".into(),
        }),
    }
}

/// [`ModelConfig`] and [`Arch`] of a GGUF model, from its header only.
///
/// Keys (`A` = `general.architecture`, one of `llama`, `qwen2`, `qwen3`):
/// `A.embedding_length`, `A.block_count`, `A.feed_forward_length`,
/// `A.attention.head_count`, `A.attention.layer_norm_rms_epsilon`,
/// `A.context_length` are required; `A.attention.head_count_kv` defaults
/// to the head count, `A.attention.key_length` (head_dim) to
/// `embedding_length / head_count`, `A.rope.freq_base` to 10000. The
/// vocabulary size is `A.vocab_size`, else the length of
/// `tokenizer.ggml.tokens`, else the rows of `token_embd.weight`.
/// Embeddings are tied when there is no `output.weight`; attention biases
/// (Llama/Qwen3) are on when `blk.0.attn_q.bias` exists. bos/eos/pad come
/// from `tokenizer.ggml.*_token_id` (ids outside the vocabulary are
/// dropped, as llama.cpp does). Refused: `A.rope.dimension_count` ≠
/// head_dim (partial rotary), rope scaling other than `linear`, a
/// `rope_freqs.weight` tensor (Llama 3.1 style per-frequency factors),
/// `A.attention.value_length` ≠ `key_length`.
pub fn gguf_config(path: &Path) -> Result<(ModelConfig, Arch)> {
    config_of(&GgufFile::open(path)?)
}

fn config_of(g: &GgufFile) -> Result<(ModelConfig, Arch)> {
    let file = g.file();
    let m = Meta {
        md: g.metadata(),
        file: &file,
    };
    let a = m.str("general.architecture")?;
    let family = family_of(a, &file)?;
    let k = |s: &str| format!("{a}.{s}");

    let hidden_size = m.usize(&k("embedding_length"))?;
    let num_hidden_layers = m.usize(&k("block_count"))?;
    let intermediate_size = m.usize(&k("feed_forward_length"))?;
    let num_attention_heads = m.usize(&k("attention.head_count"))?;
    let num_key_value_heads = m
        .opt_usize(&k("attention.head_count_kv"))?
        .unwrap_or(num_attention_heads);
    let rms_norm_eps = m
        .opt_f64(&k("attention.layer_norm_rms_epsilon"))?
        .ok_or_else(|| m.missing(&k("attention.layer_norm_rms_epsilon")))?;
    let max_position_embeddings = m.usize(&k("context_length"))?;
    let rope_theta = m.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0);
    if num_attention_heads == 0 {
        return Err(m.bad(&k("attention.head_count"), "must be > 0"));
    }
    let head_dim = head_dim_of(&m, &k, hidden_size, num_attention_heads)?;

    let rope_scaling = rope_scaling_of(&m, &k)?;
    if g.tensor_info("rope_freqs.weight").is_some() {
        return Err(ModelError::TensorData {
            file: file.clone(),
            name: "rope_freqs.weight".into(),
            msg: "per-frequency rope factors (Llama 3.1+ rope scaling) are not supported".into(),
        });
    }

    let vocab_size = vocab_size_of(g, &m, &k)?;
    let id = |key: &str| -> Result<Option<u32>> {
        Ok(m.opt_u64(key)?
            .filter(|&v| (v as usize) < vocab_size)
            .map(|v| v as u32))
    };
    let cfg = ModelConfig {
        architectures: vec![family.class_name().to_string()],
        model_type: family.model_type().to_string(),
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rope_theta,
        rms_norm_eps,
        max_position_embeddings,
        tie_word_embeddings: g.tensor_info(GGUF_LM_HEAD).is_none(),
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: id("tokenizer.ggml.eos_token_id")?,
        pad_token_id: id("tokenizer.ggml.padding_token_id")?,
        initializer_range: 0.02,
    };
    let arch = Arch {
        family,
        attention_bias: family != Family::Qwen2
            && g.tensor_info(&LayerTensor::QBias.gguf_name(0)).is_some(),
        rope_scaling,
    };
    cfg.validate()
        .and_then(|()| arch.validate())
        .map_err(|e| ModelError::Checkpoint {
            path: g.path().to_path_buf(),
            msg: format!("GGUF metadata gives an invalid config: {e}"),
        })?;
    Ok((cfg, arch))
}

/// `head_dim` of a GGUF config: `A.attention.key_length`, else
/// `embedding_length / head_count`; `None` when it is that default (so the
/// config equals the HF one it came from). Refuses value/key lengths that
/// differ and partial rotary.
fn head_dim_of(
    m: &Meta<'_>,
    k: &dyn Fn(&str) -> String,
    hidden_size: usize,
    num_attention_heads: usize,
) -> Result<Option<usize>> {
    let default_hd = hidden_size / num_attention_heads;
    let key_length = m.opt_usize(&k("attention.key_length"))?;
    let head_dim_v = key_length.unwrap_or(default_hd);
    if let Some(vl) = m.opt_usize(&k("attention.value_length"))? {
        if vl != head_dim_v {
            return Err(m.bad(
                &k("attention.value_length"),
                format!("{vl} differs from the key length {head_dim_v} (not supported)"),
            ));
        }
    }
    if let Some(rd) = m.opt_usize(&k("rope.dimension_count"))? {
        if rd != head_dim_v {
            return Err(m.bad(
                &k("rope.dimension_count"),
                format!(
                    "{rd} differs from head_dim {head_dim_v} (partial rotary is not supported)"
                ),
            ));
        }
    }
    // Keep `head_dim` absent when it is the default, so the config equals
    // the HF one it came from.
    Ok(
        (head_dim_v != default_hd || !hidden_size.is_multiple_of(num_attention_heads))
            .then_some(head_dim_v),
    )
}

/// `rope_scaling` of a GGUF config (`A.rope.scaling.*`): none or linear.
fn rope_scaling_of(m: &Meta<'_>, k: &dyn Fn(&str) -> String) -> Result<Option<RopeScaling>> {
    Ok(match m.opt_str(&k("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") => {
            let key = k("rope.scaling.factor");
            let factor = m.opt_f64(&key)?.ok_or_else(|| m.missing(&key))?;
            // llama.cpp writes factor 1 for "no scaling" too.
            (factor != 1.0).then_some(RopeScaling::Linear { factor })
        }
        Some(other) => {
            return Err(m.bad(
                &k("rope.scaling.type"),
                format!("rope scaling `{other}` is not supported (supported: none, linear)"),
            ))
        }
    })
}

/// Vocabulary size of a GGUF model: `A.vocab_size`, else the length of
/// `tokenizer.ggml.tokens`, else the rows of `token_embd.weight`.
fn vocab_size_of(g: &GgufFile, m: &Meta<'_>, k: &dyn Fn(&str) -> String) -> Result<usize> {
    let n_tokens = match m.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) => Some(a.len()),
        _ => None,
    };
    Ok(match m.opt_usize(&k("vocab_size"))? {
        Some(v) => v,
        None => match n_tokens {
            Some(n) => n,
            None => g
                .tensor_info(GGUF_EMBED)
                .map(|(_, s)| s[0])
                .ok_or_else(|| m.missing(&k("vocab_size")))?,
        },
    })
}

// --- Q/K permutation ------------------------------------------------------------

/// llama.cpp's `permute` (HF → GGUF) on the rows of a `(n_head*hd, ...)`
/// weight or `(n_head*hd,)` bias: row `(h, half, i)` moves to `(h, i, half)`.
pub(super) fn permute_rows(t: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rest: usize = dims[1..].iter().product();
    let hd = dims[0] / n_head;
    Ok(t.reshape((n_head, 2, hd / 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// Inverse of [`permute_rows`] (GGUF → HF).
pub(super) fn unpermute_rows(t: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rest: usize = dims[1..].iter().product();
    let hd = dims[0] / n_head;
    Ok(t.reshape((n_head, hd / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// Heads whose rows llama.cpp permutes for a tensor (HF name), if any.
pub(super) fn permuted_heads(cfg: &ModelConfig, arch: &Arch, hf_name: &str) -> Option<usize> {
    if arch.family != Family::Llama {
        return None;
    }
    let is = |t: LayerTensor| hf_name.ends_with(t.hf());
    if is(LayerTensor::Q) || is(LayerTensor::QBias) {
        Some(cfg.num_attention_heads)
    } else if is(LayerTensor::K) || is(LayerTensor::KBias) {
        Some(cfg.num_key_value_heads)
    } else {
        None
    }
}

/// Renames the HF tensor name in an error from [`Policy`] to the GGUF
/// name the user can find in the file.
fn gguf_named(e: ModelError) -> ModelError {
    let rename = |n: String| match hf_to_gguf_name(&n) {
        Some(g) => format!("{g} ({n})"),
        None => n,
    };
    match e {
        ModelError::MissingTensor { file, name } => ModelError::MissingTensor {
            file,
            name: rename(name),
        },
        ModelError::Shape {
            file,
            name,
            expected,
            got,
        } => ModelError::Shape {
            file,
            name: rename(name),
            expected,
            got,
        },
        ModelError::UnexpectedTensor { file, name } => ModelError::UnexpectedTensor {
            file,
            name: rename(name),
        },
        other => other,
    }
}

impl Policy {
    /// Loads a GGUF model (`general.architecture` llama, qwen2 or qwen3;
    /// config from the metadata, see [`gguf_config`]) as a trainable f32
    /// policy on `device`. Quantised tensors are dequantised with candle's
    /// ggml kernels; llama.cpp's Q/K row permutation is undone for llama.
    ///
    /// Errors name the file and the GGUF tensor or key: not a GGUF file
    /// ([`ModelError::NotGguf`]), unknown architecture, missing metadata,
    /// missing tensor, wrong shape, a tensor no supported architecture has
    /// ([`ModelError::UnexpectedTensor`]), unreadable tensor data
    /// ([`ModelError::TensorData`]). The tokenizer stored in the file is
    /// loaded separately with [`crate::model::Tok::from_gguf`].
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Policy> {
        let g = GgufFile::open(path)?;
        let (cfg, arch) = config_of(&g)?;
        let file = g.file();
        let mut tensors = HashMap::new();
        for (name, t) in g.read_all_f32()? {
            let Some(hf) = gguf_to_hf_name(&name) else {
                // Not a tensor we map: `Policy` reports it as unexpected
                // under its GGUF name.
                tensors.insert(name, t);
                continue;
            };
            let t = match permuted_heads(&cfg, &arch, &hf) {
                // Only when the rows match; otherwise `Policy` reports the
                // wrong shape.
                Some(n) if t.dims().first() == Some(&(n * cfg.head_dim())) => {
                    unpermute_rows(&t, n)?
                }
                _ => t,
            };
            tensors.insert(hf, t);
        }
        Policy::assemble(&cfg, &arch, tensors, &|_| file.clone(), device, true).map_err(gguf_named)
    }

    /// Writes the policy as a GGUF file that [`Policy::from_gguf`] (and
    /// llama.cpp, given a `vocab`) loads: llama.cpp's metadata keys and
    /// tensor names, Q/K rows permuted for llama. 2-D weights are stored
    /// as `dtype` (`F32`, `F16`, `Q8_0`, `Q4_0`, ..., when their row length
    /// is a multiple of the type's block size, else F32); 1-D tensors
    /// (norms, biases) always as F32, like llama.cpp. With `vocab`, its
    /// `tokenizer.ggml.*` keys are written too. bos/eos/pad ids come from
    /// the config (a vocab's own ids must agree with it).
    ///
    /// Llama 3 rope scaling has no GGUF metadata form (llama.cpp stores a
    /// `rope_freqs` tensor) and is refused.
    pub fn write_gguf(
        &self,
        path: &Path,
        dtype: GgmlDType,
        vocab: Option<&GgufVocab>,
    ) -> Result<()> {
        let mut md = model_metadata(self.config(), self.arch())?;
        md.extend(token_metadata(self.config(), vocab)?);
        let qtensors = self.gguf_tensors(path, dtype)?;

        let io = |source: std::io::Error| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let f = File::create(path).map_err(io)?;
        let mut w = BufWriter::new(f);
        let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(n, q)| (n.as_str(), q)).collect();
        gguf_file::write(&mut w, &md_refs, &t_refs).map_err(|e| ModelError::Checkpoint {
            path: path.to_path_buf(),
            msg: format!("cannot write GGUF: {e}"),
        })?;
        use std::io::Write;
        w.flush().map_err(io)
    }

    /// Every weight under its GGUF name, Q/K rows permuted for llama,
    /// stored as `dtype` where the row length allows (see
    /// [`Policy::write_gguf`]), in llama.cpp's order: embeddings, blocks in
    /// order, head. `path` only names the file in errors.
    fn gguf_tensors(&self, path: &Path, dtype: GgmlDType) -> Result<Vec<(String, QTensor)>> {
        let (cfg, arch) = (self.config(), self.arch());
        let mut qtensors: Vec<(String, QTensor)> = Vec::new();
        for (name, t) in self.named_tensors() {
            let gname = hf_to_gguf_name(&name).ok_or_else(|| {
                ModelError::InvalidArgument(format!("write_gguf: no GGUF name for tensor `{name}`"))
            })?;
            // f32 for the quantiser whatever the policy's stored dtype.
            let t = t.detach().to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            let t = match permuted_heads(cfg, arch, &name) {
                Some(n) => permute_rows(&t, n)?,
                None => t,
            };
            let ty = if t.rank() == 2 && t.dims()[1] % dtype.block_size() == 0 {
                dtype
            } else {
                GgmlDType::F32
            };
            let q = QTensor::quantize(&t, ty).map_err(|e| ModelError::TensorData {
                file: path.display().to_string(),
                name: gname.clone(),
                msg: format!("cannot store as {ty:?}: {e}"),
            })?;
            qtensors.push((gname, q));
        }
        // llama.cpp's order: embeddings, blocks in order, head.
        let rank = |n: &str| -> (usize, usize, String) {
            if n == GGUF_EMBED {
                (0, 0, n.into())
            } else if let Some(rest) = n
                .strip_prefix(GGUF_BLOCKS)
                .and_then(|r| r.strip_prefix('.'))
            {
                let (l, s) = rest.split_once('.').unwrap_or((rest, ""));
                (1, l.parse().unwrap_or(0), s.into())
            } else {
                (2, 0, n.into())
            }
        };
        qtensors.sort_by_key(|(n, _)| rank(n));
        Ok(qtensors)
    }
}

/// The GGUF metadata of the model's dimensions and rope (llama.cpp's
/// keys under the family's `general.architecture`).
fn model_metadata(cfg: &ModelConfig, arch: &Arch) -> Result<Vec<(String, Value)>> {
    let a = arch.family.model_type();
    let k = |s: &str| format!("{a}.{s}");
    let u32v = |x: usize| -> Result<Value> {
        u32::try_from(x).map(Value::U32).map_err(|_| {
            ModelError::InvalidArgument(format!("write_gguf: {x} does not fit in u32"))
        })
    };
    let hd = cfg.head_dim();
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(a.into())),
        (
            "general.name".into(),
            Value::String("actguide policy".into()),
        ),
        (k("vocab_size"), u32v(cfg.vocab_size)?),
        (k("context_length"), u32v(cfg.max_position_embeddings)?),
        (k("embedding_length"), u32v(cfg.hidden_size)?),
        (k("block_count"), u32v(cfg.num_hidden_layers)?),
        (k("feed_forward_length"), u32v(cfg.intermediate_size)?),
        (k("attention.head_count"), u32v(cfg.num_attention_heads)?),
        (k("attention.head_count_kv"), u32v(cfg.num_key_value_heads)?),
        (k("attention.key_length"), u32v(hd)?),
        (k("attention.value_length"), u32v(hd)?),
        (k("rope.dimension_count"), u32v(hd)?),
        (k("rope.freq_base"), Value::F32(cfg.rope_theta as f32)),
        (
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps as f32),
        ),
    ];
    match &arch.rope_scaling {
        None => {}
        Some(RopeScaling::Linear { factor }) => {
            md.push((k("rope.scaling.type"), Value::String("linear".into())));
            md.push((k("rope.scaling.factor"), Value::F32(*factor as f32)));
        }
        Some(rs) => {
            return Err(ModelError::InvalidArgument(format!(
                "write_gguf: rope_scaling {} has no GGUF metadata form",
                rs.to_json()
            )))
        }
    }
    Ok(md)
}

/// The vocabulary's `tokenizer.ggml.*` keys (with `vocab`) followed by
/// the bos/eos/pad ids: the config's, else the vocabulary's; the two must
/// agree where both are set.
fn token_metadata(cfg: &ModelConfig, vocab: Option<&GgufVocab>) -> Result<Vec<(String, Value)>> {
    let mut md = Vec::new();
    let mut ids: Vec<(&str, Option<u32>)> = vec![
        ("tokenizer.ggml.bos_token_id", cfg.bos_token_id),
        ("tokenizer.ggml.eos_token_id", cfg.eos_token_id),
        ("tokenizer.ggml.padding_token_id", cfg.pad_token_id),
    ];
    if let Some(v) = vocab {
        if v.tokens.len() > cfg.vocab_size {
            return Err(ModelError::InvalidArgument(format!(
                "write_gguf: vocabulary has {} tokens, the model only {}",
                v.tokens.len(),
                cfg.vocab_size
            )));
        }
        for (key, own) in [
            ("tokenizer.ggml.bos_token_id", v.bos_token_id),
            ("tokenizer.ggml.eos_token_id", v.eos_token_id),
            ("tokenizer.ggml.padding_token_id", v.padding_token_id),
        ] {
            let slot = ids.iter_mut().find(|(k2, _)| *k2 == key).expect("listed");
            match (slot.1, own) {
                (Some(c), Some(o)) if c != o => {
                    return Err(ModelError::InvalidArgument(format!(
                        "write_gguf: {key}: config says {c}, vocabulary {o}"
                    )))
                }
                (None, Some(o)) => slot.1 = Some(o),
                _ => {}
            }
        }
        // The special-token ids are written once, below, as reconciled
        // here: llama.cpp refuses a file with a key twice.
        md.extend(
            v.to_metadata()
                .into_iter()
                .filter(|(k, _)| !ids.iter().any(|(k2, _)| k2 == k)),
        );
    }
    for (key, id) in ids {
        if let Some(id) = id {
            md.push((key.to_string(), Value::U32(id)));
        }
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for (g, h) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            (
                "blk.12.attn_q.weight",
                "model.layers.12.self_attn.q_proj.weight",
            ),
            (
                "blk.0.ffn_norm.weight",
                "model.layers.0.post_attention_layernorm.weight",
            ),
            (
                "blk.3.attn_k_norm.weight",
                "model.layers.3.self_attn.k_norm.weight",
            ),
            ("output.weight", "lm_head.weight"),
        ] {
            assert_eq!(gguf_to_hf_name(g).as_deref(), Some(h));
            assert_eq!(hf_to_gguf_name(h).as_deref(), Some(g));
        }
        assert_eq!(gguf_to_hf_name("rope_freqs.weight"), None);
        assert_eq!(gguf_to_hf_name("blk.x.attn_q.weight"), None);
    }

    #[test]
    fn permutation_matches_llama_cpp() {
        // 2 heads of head_dim 4, 1 input column: HF rows are
        // (h, half, i) = h*4 + half*2 + i; llama.cpp's permute puts
        // (h, i, half) there, i.e. per head [0, 2, 1, 3].
        let t = Tensor::arange(0f32, 8., &Device::Cpu)
            .unwrap()
            .reshape((8, 1))
            .unwrap();
        let p = permute_rows(&t, 2).unwrap();
        let v: Vec<f32> = p.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v, [0., 2., 1., 3., 4., 6., 5., 7.]);
        let back = unpermute_rows(&p, 2).unwrap();
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            (0..8).map(|x| x as f32).collect::<Vec<_>>()
        );
        // Biases (1-D) too.
        let b = Tensor::arange(0f32, 8., &Device::Cpu).unwrap();
        let pb = permute_rows(&b, 2).unwrap();
        assert_eq!(
            pb.to_vec1::<f32>().unwrap(),
            [0., 2., 1., 3., 4., 6., 5., 7.]
        );
    }
}
