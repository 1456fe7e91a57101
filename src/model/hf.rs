//! Hugging Face model folders: reading and writing the layout
//! `transformers` uses (`config.json` plus `model.safetensors`, or
//! `model.safetensors.index.json` plus `model-0000K-of-0000N.safetensors`
//! shards), for every family [`Policy`] implements.
//!
//! This module owns the file layout (which files, shard naming, the index's
//! `weight_map`, dtype conversion, error attribution to files) and every
//! safetensors read or write of the base weights
//! ([`Policy::load_safetensors`], [`Policy::save_safetensors`]);
//! [`Policy`] owns which tensors an architecture needs and their shapes.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use super::config::{Arch, ModelConfig};
use super::error::{ModelError, Result};
use super::llama::Policy;

/// Single-file weights name.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Sharded checkpoint index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Config name.
pub const CONFIG_FILE: &str = "config.json";

/// Which file each tensor of a checkpoint came from (or, per the index,
/// should have come from), for error messages.
pub(super) struct Origins {
    by_name: HashMap<String, String>,
    /// The file named for tensors no file claims: the weights file itself,
    /// or the index of a sharded checkpoint.
    default: String,
}

impl Origins {
    pub(super) fn file_of(&self, name: &str) -> String {
        self.by_name
            .get(name)
            .cloned()
            .unwrap_or_else(|| self.default.clone())
    }
}

/// The weights of the HF folder `dir`: `model.safetensors` if present,
/// else `model.safetensors.index.json`.
pub(super) fn weights_path(dir: &Path) -> Result<PathBuf> {
    let single = dir.join(WEIGHTS_FILE);
    let index = dir.join(INDEX_FILE);
    if single.is_file() {
        Ok(single)
    } else if index.is_file() {
        Ok(index)
    } else {
        Err(ModelError::MissingFile {
            path: dir.to_path_buf(),
            what: format!("weights ({WEIGHTS_FILE} or {INDEX_FILE})"),
        })
    }
}

/// Reads a `.safetensors` file, or every shard of an `*.index.json`
/// (shards resolved relative to the index). Float tensors are converted to
/// f32 on the CPU shard by shard, so a bf16 checkpoint never has all of its
/// bf16 copies and their f32 copies in memory at once; other dtypes are
/// left for [`Policy`] to refuse with the tensor's name.
pub(super) fn read_weights(path: &Path) -> Result<(HashMap<String, Tensor>, Origins)> {
    let path_s = path.display().to_string();
    if !path.is_file() {
        return Err(ModelError::MissingFile {
            path: path.to_path_buf(),
            what: "weights file".into(),
        });
    }
    let mut by_name = HashMap::new();
    let files: Vec<PathBuf> = if path_s.ends_with(".index.json") {
        let map = read_index(path)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut shards: Vec<&String> = map.values().collect();
        shards.sort();
        shards.dedup();
        let mut files = Vec::with_capacity(shards.len());
        for s in shards {
            let f = dir.join(s);
            if !f.is_file() {
                return Err(ModelError::MissingFile {
                    path: f,
                    what: format!("shard `{s}` named in {path_s}"),
                });
            }
            files.push(f);
        }
        for (name, shard) in &map {
            by_name.insert(name.clone(), dir.join(shard).display().to_string());
        }
        files
    } else {
        vec![path.to_path_buf()]
    };
    let mut tensors = HashMap::new();
    for f in &files {
        let shard = candle_core::safetensors::load(f, &Device::Cpu).map_err(|e| {
            ModelError::Checkpoint {
                path: f.clone(),
                msg: format!("cannot read safetensors: {e}"),
            }
        })?;
        let f_s = f.display().to_string();
        for (name, t) in shard {
            let t = if t.dtype().is_float() && t.dtype() != DType::F32 {
                t.to_dtype(DType::F32)?
            } else {
                t
            };
            // Tensors the index does not list are still attributed to the
            // shard that holds them.
            by_name.entry(name.clone()).or_insert_with(|| f_s.clone());
            tensors.insert(name, t);
        }
    }
    Ok((
        tensors,
        Origins {
            by_name,
            default: path_s,
        },
    ))
}

/// The `weight_map` (tensor name → shard file name) of an index.
fn read_index(path: &Path) -> Result<BTreeMap<String, String>> {
    let bad = |msg: String| ModelError::Checkpoint {
        path: path.to_path_buf(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object in the index".into()))?;
    map.iter()
        .map(|(k, s)| match s.as_str() {
            // A shard name must stay inside the folder.
            Some(s) if !s.is_empty() && !s.contains('/') && !s.contains('\\') => {
                Ok((k.clone(), s.to_string()))
            }
            _ => Err(bad(format!(
                "weight_map entry `{k}` = {s} is not a shard file name"
            ))),
        })
        .collect()
}

impl Policy {
    /// Loads HF weights for `cfg` with the family's default architecture
    /// ([`Arch::from_config`]): a `.safetensors` file, a sharded
    /// checkpoint's `model.safetensors.index.json`, or a directory holding
    /// either. [`Policy::from_hf_dir`] also reads the config (and its
    /// `rope_scaling`/`attention_bias`) from the folder.
    pub fn load_safetensors(cfg: &ModelConfig, path: &Path, device: &Device) -> Result<Self> {
        let arch = Arch::from_config(cfg)?;
        let path = if path.is_dir() {
            weights_path(path)?
        } else {
            path.to_path_buf()
        };
        let (tensors, origins) = read_weights(&path)?;
        Self::assemble(cfg, &arch, tensors, &|n| origins.file_of(n), device, true)
    }

    /// Writes all weights under their HF names (no `lm_head.weight` when
    /// tied), so `transformers` can load the file with the saved config.
    pub fn save_safetensors(&self, path: &Path) -> Result<()> {
        let map: HashMap<String, Tensor> = self
            .named_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.detach()))
            .collect();
        candle_core::safetensors::save(&map, path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })
    }

    /// Loads a HF model folder: `config.json` (family, dimensions,
    /// `rope_scaling`, `attention_bias`; see
    /// [`ModelConfig::from_file_with_arch`]) and the weights
    /// (`model.safetensors`, or a sharded checkpoint through
    /// `model.safetensors.index.json`). bf16/f16 weights are converted to
    /// f32; the policy is trainable and lives on `device`.
    ///
    /// Errors name the file involved: a missing `config.json`, weights or
    /// shard ([`ModelError::MissingFile`]), an unknown architecture
    /// ([`ModelError::UnknownArchitecture`]), a missing tensor (named with
    /// the shard the index puts it in), a wrong shape, an unexpected tensor.
    /// The tokenizer is not read here (see [`crate::model::Tok`]).
    pub fn from_hf_dir(dir: &Path, device: &Device) -> Result<Policy> {
        let cfg_path = dir.join(CONFIG_FILE);
        if !cfg_path.is_file() {
            return Err(ModelError::MissingFile {
                path: cfg_path,
                what: "model config".into(),
            });
        }
        let (cfg, arch) = ModelConfig::from_file_with_arch(&cfg_path)?;
        let (tensors, origins) = read_weights(&weights_path(dir)?)?;
        Policy::assemble(&cfg, &arch, tensors, &|n| origins.file_of(n), device, true)
    }

    /// Writes the policy as a HF model folder that `transformers` (and
    /// [`Policy::from_hf_dir`]) loads: `config.json` with the architecture
    /// variant, and f32 weights under their HF names (no `lm_head.weight`
    /// when tied). With `max_shard_bytes`, weights are split, in name
    /// order, into `model-0000K-of-0000N.safetensors` shards of at most
    /// that size (a single tensor larger than the limit gets a shard of its
    /// own) plus `model.safetensors.index.json`; a single shard is written
    /// as plain `model.safetensors`, like `transformers` does. Weight files
    /// of the other layout left in `dir` by an earlier save are removed so
    /// the folder is unambiguous.
    pub fn save_hf_dir(&self, dir: &Path, max_shard_bytes: Option<usize>) -> Result<()> {
        let io = |path: &Path, source: std::io::Error| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
            let p = entry.map_err(|e| io(dir, e))?.path();
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            let stale = name == WEIGHTS_FILE
                || name == INDEX_FILE
                || (name.starts_with("model-")
                    && name.contains("-of-")
                    && name.ends_with(".safetensors"));
            if stale {
                std::fs::remove_file(&p).map_err(|e| io(&p, e))?;
            }
        }
        self.config()
            .save_with_arch(self.arch(), &dir.join(CONFIG_FILE))?;
        let named: Vec<(String, Tensor)> = self
            .named_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.detach()))
            .collect();
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let mut shards: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
        let mut size = 0usize;
        for (n, t) in named {
            let b = bytes(&t);
            let last = shards.last_mut().expect("one shard");
            if let Some(limit) = max_shard_bytes {
                if !last.is_empty() && size + b > limit {
                    shards.push(Vec::new());
                    size = 0;
                }
            }
            size += b;
            shards.last_mut().expect("one shard").push((n, t));
        }
        let write = |path: &Path, part: &[(String, Tensor)]| -> Result<()> {
            let map: HashMap<String, Tensor> = part.iter().cloned().collect();
            candle_core::safetensors::save(&map, path).map_err(|e| ModelError::Checkpoint {
                path: path.to_path_buf(),
                msg: format!("cannot write safetensors: {e}"),
            })
        };
        if shards.len() == 1 {
            return write(&dir.join(WEIGHTS_FILE), &shards[0]);
        }
        let n = shards.len();
        let mut weight_map = BTreeMap::new();
        let mut total = 0usize;
        for (k, part) in shards.iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
            write(&dir.join(&file), part)?;
            for (name, t) in part {
                total += bytes(t);
                weight_map.insert(name.clone(), file.clone());
            }
        }
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": weight_map,
        });
        let path = dir.join(INDEX_FILE);
        let text = serde_json::to_string_pretty(&index).map_err(|e| ModelError::Checkpoint {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        std::fs::write(&path, text + "\n").map_err(|e| io(&path, e))
    }
}
