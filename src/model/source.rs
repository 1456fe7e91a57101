//! Model sources: what an experiment's `model.path` names, and the files a
//! checkpoint or an export carries beside the weights.
//!
//! A source is either
//! - an HF folder: `config.json`, `tokenizer.json`, optionally
//!   `tokenizer_config.json` (chat template, special tokens) and
//!   `generation_config.json`, and weights (`model.safetensors` or a
//!   sharded index) — without weights the model is initialised from the
//!   run seed (the built-in tiny models); or
//! - a GGUF file (llama.cpp): config, tokenizer and chat template all come
//!   from its metadata, and the HF side files are synthesised so exports
//!   load in `transformers`.

use std::path::{Path, PathBuf};

use candle_core::Device;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use super::config::{Arch, ModelConfig};
use super::error::{ModelError, Result};
use super::gguf::{gguf_config, GgufFile};
use super::gguf_tokenizer::GgufVocab;
use super::hf::{CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE};
use super::llama::Policy;
use super::tokenizer::Tok;

/// Tokenizer file name.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Tokenizer settings file name (chat template, special tokens).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// Generation defaults file name.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq)]
enum WeightsFrom {
    HfFolder,
    Gguf,
    /// No weights: initialised from the run seed.
    Random,
}

/// An opened model source (config and tokenizer read; weights not yet).
#[derive(Debug)]
pub struct ModelSource {
    pub path: PathBuf,
    pub cfg: ModelConfig,
    pub arch: Arch,
    pub tok: Tok,
    /// `config.json` text in HF form (for a GGUF, synthesised from its
    /// metadata).
    pub config_json: String,
    /// `tokenizer.json` text (for a GGUF: built from its vocabulary).
    pub tokenizer_json: String,
    /// `tokenizer_config.json`, when the folder has one (for a GGUF:
    /// synthesised from its special tokens and chat template).
    pub tokenizer_config: Option<Value>,
    /// `generation_config.json`, when the folder has one (for a GGUF:
    /// synthesised from its bos/eos ids).
    pub generation_config: Option<Value>,
    weights: WeightsFrom,
}

fn io(path: &Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            msg: format!("not valid JSON: {e}"),
        })
}

impl ModelSource {
    /// Opens `path`: a `.gguf` file or an HF folder. A missing file is
    /// [`ModelError::MissingFile`] naming it; bad contents are the loaders'
    /// errors (file and key or tensor named).
    pub fn open(path: &Path) -> Result<ModelSource> {
        let is_gguf = path.extension().is_some_and(|e| e == "gguf");
        if is_gguf || path.is_file() {
            return Self::open_gguf(path);
        }
        if !path.is_dir() {
            return Err(ModelError::MissingFile {
                path: path.to_path_buf(),
                what: "model folder or .gguf file".into(),
            });
        }
        let cfg_path = path.join(CONFIG_FILE);
        if !cfg_path.is_file() {
            return Err(ModelError::MissingFile {
                path: cfg_path,
                what: "model config".into(),
            });
        }
        let (cfg, arch) = ModelConfig::from_file_with_arch(&cfg_path)?;
        let config_json = std::fs::read_to_string(&cfg_path).map_err(|e| io(&cfg_path, e))?;
        let tok_path = path.join(TOKENIZER_FILE);
        if !tok_path.is_file() {
            return Err(ModelError::MissingFile {
                path: tok_path,
                what: "tokenizer".into(),
            });
        }
        let tok = Tok::from_file(&tok_path)?;
        let tokenizer_json = std::fs::read_to_string(&tok_path).map_err(|e| io(&tok_path, e))?;
        let weights = if path.join(WEIGHTS_FILE).exists() || path.join(INDEX_FILE).exists() {
            WeightsFrom::HfFolder
        } else {
            WeightsFrom::Random
        };
        Ok(ModelSource {
            path: path.to_path_buf(),
            cfg,
            arch,
            tok,
            config_json,
            tokenizer_json,
            tokenizer_config: read_json(&path.join(TOKENIZER_CONFIG_FILE))?,
            generation_config: read_json(&path.join(GENERATION_CONFIG_FILE))?,
            weights,
        })
    }

    fn open_gguf(path: &Path) -> Result<ModelSource> {
        let g = GgufFile::open(path)?;
        let file = path.display().to_string();
        let (cfg, arch) = gguf_config(path)?;
        let config_json = cfg.to_hf_json(&arch).map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let vocab = GgufVocab::from_metadata(g.metadata(), &file)?;
        let tok = Tok::from_gguf_vocab(&vocab, path)?;
        let tokenizer_json = vocab.to_tokenizer_json(&file)?.to_string();
        let name = |id: Option<u32>| id.and_then(|i| vocab.tokens.get(i as usize).cloned());
        let template = match g.metadata().get("tokenizer.chat_template") {
            Some(v) => Some(v.to_string().map_err(|e| ModelError::BadMetadata {
                file: file.clone(),
                key: "tokenizer.chat_template".into(),
                msg: e.to_string(),
            })?),
            None => None,
        };
        let tokenizer_config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": name(vocab.bos_token_id),
            "eos_token": name(vocab.eos_token_id),
            "unk_token": name(vocab.unknown_token_id),
            "pad_token": name(vocab.padding_token_id),
            "chat_template": template,
            "model_max_length": cfg.max_position_embeddings,
            "clean_up_tokenization_spaces": false,
        });
        let generation_config = json!({
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
        });
        Ok(ModelSource {
            path: path.to_path_buf(),
            cfg,
            arch,
            tok,
            config_json,
            tokenizer_json,
            tokenizer_config: Some(tokenizer_config),
            generation_config: Some(generation_config),
            weights: WeightsFrom::Gguf,
        })
    }

    /// True when the source holds weights (else [`ModelSource::load`]
    /// initialises them from the RNG).
    pub fn has_weights(&self) -> bool {
        self.weights != WeightsFrom::Random
    }

    /// The `chat_template` of `tokenizer_config.json` (or the GGUF's
    /// `tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.tokenizer_config.as_ref()?["chat_template"].as_str()
    }

    /// The file that declares the chat template, for error messages.
    pub fn chat_template_origin(&self) -> PathBuf {
        match self.weights {
            WeightsFrom::Gguf => self.path.clone(),
            _ => self.path.join(TOKENIZER_CONFIG_FILE),
        }
    }

    /// The trainable initial policy: the source's weights, or a random
    /// init from `rng()` when it has none.
    pub fn load(&self, rng: impl FnOnce() -> ChaCha8Rng, device: &Device) -> Result<Policy> {
        match self.weights {
            WeightsFrom::HfFolder => Policy::from_hf_dir(&self.path, device),
            WeightsFrom::Gguf => Policy::from_gguf(&self.path, device),
            WeightsFrom::Random => {
                Policy::new_random_with_arch(&self.cfg, &self.arch, &mut rng(), device)
            }
        }
    }

    /// Writes the tokenizer files (`tokenizer.json`, and
    /// `tokenizer_config.json` / `generation_config.json` when known) into
    /// `dir`, so that it loads in `transformers` with the right tokenizer,
    /// special tokens and chat template.
    pub fn write_side_files(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let write = |name: &str, text: String| -> Result<()> {
            let p = dir.join(name);
            std::fs::write(&p, text).map_err(|e| io(&p, e))
        };
        write(TOKENIZER_FILE, self.tokenizer_json.clone())?;
        for (name, v) in [
            (TOKENIZER_CONFIG_FILE, &self.tokenizer_config),
            (GENERATION_CONFIG_FILE, &self.generation_config),
        ] {
            if let Some(v) = v {
                let text = serde_json::to_string_pretty(v).expect("JSON values serialise");
                write(name, text + "\n")?;
            }
        }
        Ok(())
    }
}
