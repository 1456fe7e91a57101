//! Checkpoints under `<run>/checkpoints/`: weights (safetensors, HF
//! names), model config, tokenizer, optimiser moments and run state (step,
//! script state, task history, eval history), written to a temporary folder
//! and renamed into place so a killed run never leaves a half-written
//! checkpoint; `latest` names the newest.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::guidance::runtime::RuntimeSnapshot;
use crate::model::hf::WEIGHTS_FILE;
use crate::model::lora::{LoraConfig, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use crate::model::{ModelError, ModelSource};
use crate::rundir::{write_atomic, RunDirError};

/// The non-tensor part of a checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunState {
    /// Steps completed: the run continues at this step.
    pub step: usize,
    pub seed: u64,
    /// Optimiser update count (Adam bias correction).
    pub optimizer_t: u64,
    /// The guidance runtime's state (its key in `state.json` is `host`).
    #[serde(rename = "host")]
    pub runtime: RuntimeSnapshot,
    /// Hash of the guidance script active at this step, and its saved copy.
    pub script_hash: String,
    pub script_copy: String,
    /// Saved copies of the reward and intervention scripts active at this
    /// step, by role name.
    #[serde(default)]
    pub copies: std::collections::BTreeMap<String, String>,
    /// Test success by evaluated step.
    pub evals: Vec<(usize, f64)>,
    /// Every random stream is derived from (seed, label, step): this
    /// names the scheme so a resumed run knows how to continue.
    pub rng: String,
    /// The resolved experiment this checkpoint was trained under: a resume
    /// under other settings is refused unless accepted knowingly (the
    /// run's `experiment.json` can be edited; this copy is under
    /// `SHA256SUMS`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experiment: Option<serde_json::Value>,
    /// RL or SFT (written only for SFT, so RL checkpoints read as before).
    #[serde(default, skip_serializing_if = "super::RunKind::is_rl")]
    pub kind: super::RunKind,
}

/// Whether a checkpoint must carry `SHA256SUMS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sums {
    /// Refuse a checkpoint without one: its files cannot be vouched for.
    Required,
    /// Take a checkpoint without one as it is (`--accept-unverified`, or a
    /// data-parallel rank reading what rank 0 verified).
    MayLack,
}

/// The checkpoints folder of a run directory.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
/// The file in it naming the newest checkpoint.
pub const LATEST_FILE: &str = "latest";
/// A checkpoint's run state.
pub const STATE_FILE: &str = "state.json";
/// A checkpoint's optimiser moments.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// The SHA-256 of every other file of a checkpoint (`sha256sum` format, so
/// `sha256sum -c SHA256SUMS` checks it too), written last.
pub const SUMS_FILE: &str = "SHA256SUMS";

/// Errors reading or writing checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: no checkpoint to resume from ({source})", path.display())]
    NoLatest {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// safetensors files.
    #[error("{}: {source}", path.display())]
    Tensors {
        path: PathBuf,
        #[source]
        source: candle_core::Error,
    },
    /// `state.json` and `adapter_config.json`.
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// The model's side files and the adapters' settings.
    #[error("{}: {source}", path.display())]
    Model {
        path: PathBuf,
        #[source]
        source: Box<ModelError>,
    },
    /// A file whose bytes changed since the checkpoint was written.
    #[error(
        "{}: damaged (its SHA-256 differs from {SUMS_FILE}); resume from an earlier \
         checkpoint by pointing checkpoints/latest at it",
        path.display()
    )]
    Checksum { path: PathBuf },
    /// A file `SHA256SUMS` lists is missing or a line does not parse.
    #[error("{}: {msg}", path.display())]
    Sums { path: PathBuf, msg: String },
    /// No `SHA256SUMS`: nothing says the files are the ones written.
    #[error(
        "{}: no {SUMS_FILE}, so its files cannot be checked (edited or damaged weights would \
         load silently); `actguide run --resume … --accept-unverified` takes it as it is",
        dir.display()
    )]
    Unverified { dir: PathBuf },
    #[error(transparent)]
    File(#[from] RunDirError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn tensors(path: &Path) -> impl FnOnce(candle_core::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Tensors {
        path: path.to_path_buf(),
        source,
    }
}

fn json(path: &Path) -> impl FnOnce(serde_json::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Json {
        path: path.to_path_buf(),
        source,
    }
}

fn model(path: &Path) -> impl FnOnce(ModelError) -> CheckpointError + '_ {
    move |source| CheckpointError::Model {
        path: path.to_path_buf(),
        source: Box::new(source),
    }
}

/// What a checkpoint holds besides the run state.
pub struct CheckpointFiles<'a> {
    /// The trained tensors: every weight (HF names, written to
    /// `model.safetensors`), or with `adapter` the LoRA adapters alone
    /// (PEFT names, `adapter_model.safetensors` + `adapter_config.json`).
    pub weights: HashMap<String, Tensor>,
    pub adapter: Option<&'a LoraConfig>,
    /// Written into `adapter_config.json` as `base_model_name_or_path`.
    pub base_model: &'a str,
    pub optimizer: HashMap<String, Tensor>,
    /// The model's `config.json` and tokenizer files (`tokenizer.json` and, when known,
    /// `tokenizer_config.json` / `generation_config.json`).
    pub model: &'a ModelSource,
}

/// Write `<dir>/checkpoints/step-NNNNNN/` atomically and point
/// `<dir>/checkpoints/latest` at it.
pub fn save(
    run_dir: &Path,
    state: &RunState,
    files: CheckpointFiles<'_>,
) -> Result<PathBuf, CheckpointError> {
    let root = run_dir.join(CHECKPOINTS_DIR);
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    let name = format!("step-{:06}", state.step);
    let final_dir = root.join(&name);
    let tmp = root.join(format!(".{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let weights_file = match files.adapter {
        None => WEIGHTS_FILE,
        Some(l) => {
            let text = serde_json::to_string_pretty(&l.to_peft_json(files.base_model))
                .map_err(json(&tmp))?;
            std::fs::write(tmp.join(ADAPTER_CONFIG), text + "\n").map_err(io(&tmp))?;
            ADAPTER_WEIGHTS
        }
    };
    candle_core::safetensors::save(&files.weights, tmp.join(weights_file))
        .map_err(tensors(&tmp))?;
    candle_core::safetensors::save(&files.optimizer, tmp.join(OPTIMIZER_FILE))
        .map_err(tensors(&tmp))?;
    std::fs::write(tmp.join("config.json"), &files.model.config_json).map_err(io(&tmp))?;
    files.model.write_side_files(&tmp).map_err(model(&tmp))?;
    let st = serde_json::to_string_pretty(state).map_err(json(&tmp))?;
    std::fs::write(tmp.join(STATE_FILE), st).map_err(io(&tmp))?;
    write_sums(&tmp)?;
    if final_dir.exists() {
        std::fs::remove_dir_all(&final_dir).map_err(io(&final_dir))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(io(&final_dir))?;
    write_atomic(&root.join(LATEST_FILE), name.as_bytes())?;
    Ok(final_dir)
}

/// The hex SHA-256 of a file.
fn sha256_file(path: &Path) -> Result<String, CheckpointError> {
    use sha2::{Digest, Sha256};
    // Streamed: a real model's weights need not sit in memory twice.
    let mut file = std::fs::File::open(path).map_err(io(path))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(io(path))?;
    Ok(format!("{:x}", hasher.finalize()))
}

/// Write `SHA256SUMS` over every file of the checkpoint folder `dir`, in
/// name order.
fn write_sums(dir: &Path) -> Result<(), CheckpointError> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n != SUMS_FILE)
        .collect();
    names.sort();
    let mut text = String::new();
    for n in names {
        text.push_str(&format!("{}  {n}\n", sha256_file(&dir.join(&n))?));
    }
    std::fs::write(dir.join(SUMS_FILE), text).map_err(io(dir))
}

/// Check every file `SHA256SUMS` lists; a checkpoint without the file is
/// refused unless `need` is [`Sums::MayLack`].
pub fn verify(dir: &Path, need: Sums) -> Result<(), CheckpointError> {
    let sums = dir.join(SUMS_FILE);
    let text = match std::fs::read_to_string(&sums) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return match need {
                Sums::MayLack => Ok(()),
                Sums::Required => Err(CheckpointError::Unverified {
                    dir: dir.to_path_buf(),
                }),
            };
        }
        Err(e) => return Err(io(&sums)(e)),
    };
    for (i, line) in text.lines().enumerate() {
        let Some((hash, name)) = line.split_once("  ") else {
            return Err(CheckpointError::Sums {
                path: sums.clone(),
                msg: format!("line {}: expected `<sha256>  <file>`", i + 1),
            });
        };
        let path = dir.join(name);
        if !path.is_file() {
            return Err(CheckpointError::Sums {
                path: sums.clone(),
                msg: format!("lists {name}, which is missing"),
            });
        }
        if sha256_file(&path)? != hash {
            return Err(CheckpointError::Checksum { path });
        }
    }
    Ok(())
}

/// A loaded checkpoint.
pub struct Loaded {
    pub dir: PathBuf,
    pub state: RunState,
    /// Every weight, or the LoRA adapters when `adapter` is set.
    pub weights: HashMap<String, Tensor>,
    /// The adapters' settings, for a LoRA run's checkpoint.
    pub adapter: Option<LoraConfig>,
    pub optimizer: HashMap<String, Tensor>,
}

impl Loaded {
    /// The file `weights` came from.
    pub fn weights_path(&self) -> PathBuf {
        self.dir.join(match self.adapter {
            Some(_) => ADAPTER_WEIGHTS,
            None => WEIGHTS_FILE,
        })
    }
}

/// Load the checkpoint `latest` points at.
pub fn load_latest(run_dir: &Path, device: &Device, need: Sums) -> Result<Loaded, CheckpointError> {
    load_dir(&latest_dir(run_dir)?, device, need)
}

/// The checkpoint folder `<run_dir>/checkpoints/latest` names.
pub fn latest_dir(run_dir: &Path) -> Result<PathBuf, CheckpointError> {
    let root = run_dir.join(CHECKPOINTS_DIR);
    let latest = root.join(LATEST_FILE);
    let name = std::fs::read_to_string(&latest).map_err(|source| CheckpointError::NoLatest {
        path: latest.clone(),
        source,
    })?;
    Ok(root.join(name.trim()))
}

/// Load the checkpoint in `dir` (`<run>/checkpoints/step-NNNNNN`), after
/// checking its files against `SHA256SUMS`.
pub fn load_dir(dir: &Path, device: &Device, need: Sums) -> Result<Loaded, CheckpointError> {
    let dir = dir.to_path_buf();
    verify(&dir, need)?;
    let st_path = dir.join(STATE_FILE);
    let st = std::fs::read_to_string(&st_path).map_err(io(&st_path))?;
    let state: RunState = serde_json::from_str(&st).map_err(json(&st_path))?;
    let adapter = if dir.join(ADAPTER_CONFIG).is_file() {
        let (l, _) = LoraConfig::from_peft_file(&dir.join(ADAPTER_CONFIG)).map_err(model(&dir))?;
        Some(l)
    } else {
        None
    };
    let wp = dir.join(match adapter {
        Some(_) => ADAPTER_WEIGHTS,
        None => WEIGHTS_FILE,
    });
    let weights = candle_core::safetensors::load(&wp, device).map_err(tensors(&wp))?;
    let op = dir.join(OPTIMIZER_FILE);
    let optimizer = candle_core::safetensors::load(&op, device).map_err(tensors(&op))?;
    Ok(Loaded {
        dir,
        state,
        weights,
        adapter,
        optimizer,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_catch_damage_that_keeps_the_size() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        std::fs::write(d.join("model.safetensors"), vec![7u8; 4096]).unwrap();
        std::fs::write(d.join(STATE_FILE), "{}").unwrap();
        // No SHA256SUMS: refused, unless taken knowingly.
        let e = verify(d, Sums::Required).unwrap_err();
        assert!(matches!(e, CheckpointError::Unverified { .. }), "{e}");
        assert!(e.to_string().contains("--accept-unverified"), "{e}");
        verify(d, Sums::MayLack).unwrap();
        write_sums(d).unwrap();
        let sums = std::fs::read_to_string(d.join(SUMS_FILE)).unwrap();
        assert_eq!(sums.lines().count(), 2, "{sums}");
        assert!(sums.lines().all(|l| l.len() > 66), "{sums}");
        verify(d, Sums::Required).unwrap();
        let mut bytes = std::fs::read(d.join("model.safetensors")).unwrap();
        bytes[100..164].fill(0xFF);
        std::fs::write(d.join("model.safetensors"), &bytes).unwrap();
        let e = verify(d, Sums::MayLack).unwrap_err();
        assert!(matches!(e, CheckpointError::Checksum { .. }), "{e}");
        assert!(e.to_string().contains("model.safetensors: damaged"), "{e}");
        std::fs::remove_file(d.join("model.safetensors")).unwrap();
        let e = verify(d, Sums::Required).unwrap_err();
        assert!(
            e.to_string()
                .contains("lists model.safetensors, which is missing"),
            "{e}"
        );
    }
}
