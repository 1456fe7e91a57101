//! Rollout generation on inference-engine servers (llama.cpp's server,
//! vLLM, SGLang) instead of the built-in candle generation
//! (`rollout.engine`; docs/ENGINES.md). The controller stays here: envs,
//! guidance scripts, hot reload and the trainer; only the policy's turns
//! are generated remotely, from token-id prompts, with the sampled tokens'
//! log-probs (the behaviour policy) coming back.
//!
//! - [`config`]: the `rollout.engine` section;
//! - [`api`]: request bodies, replies and constrained decoding per server
//!   API;
//! - [`pool`]: many servers: least in-flight first, failures, back-off,
//!   the policy version each server holds;
//! - [`launch`]: llama.cpp servers the run starts itself, restarted with
//!   the new weights after each optimiser step;
//! - [`reference`]: a server speaking llama.cpp's `/completion` API over an
//!   actguide policy (tests: exact log-probs, a server to kill).
//!
//! Weight sync after each optimiser step ([`Engine::sync`]): launched
//! llama.cpp servers restart on a GGUF of the policy, or, for a LoRA
//! policy, on the base GGUF written once with the step's adapter as a
//! llama.cpp LoRA GGUF (`launch.adapter`, the default); vLLM and
//! SGLang load the step's LoRA adapter (PEFT folder) under a new name
//! through their runtime adapter API, or reload a full-weight HF folder
//! from disk. Every request names the version it wants, and only servers
//! holding it get requests.

pub mod api;
pub mod config;
pub mod launch;
pub mod pool;
pub mod reference;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::model::{GgmlDType, GgufVocab, Policy};

pub use api::{Api, Request};
pub use config::{EngineKind, EngineSection, LaunchSection};
pub use launch::{Launched, Served};
pub use pool::{Pool, ServerCounts};

/// One generated answer from an engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineReply {
    /// Generated ids, the stop token included when the answer ended.
    pub tokens: Vec<u32>,
    /// The engine's log-prob of each token (NaN where it reported none).
    pub logprobs: Vec<f32>,
    /// The answer ended with the stop token (not cut by the token limit).
    pub finished: bool,
    /// The policy version the server held (set by [`Pool`]).
    pub version: u64,
}

/// Engine failures that stop a run (one request's failure only ends its
/// episode).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("every engine server is down ({servers} servers); last failure: {last}")]
    AllDown { servers: usize, last: String },
    #[error("engine: {0}")]
    Setup(String),
    #[error("engine: writing the weights for the servers: {0}")]
    Weights(#[from] crate::model::ModelError),
    #[error("engine: {0}")]
    Io(#[from] std::io::Error),
    #[error("engine weight sync to version {version}: no server took it ({why})")]
    Sync { version: u64, why: String },
}

/// What one weight sync did.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncReport {
    pub version: u64,
    /// Servers now holding `version`.
    pub synced: usize,
    pub seconds: f64,
    /// Bytes of weights written for the servers (0 for a full-weight
    /// reload that vLLM / SGLang read from a folder they share).
    pub bytes: u64,
    /// Servers that failed to take it, with why (they get no requests
    /// until a later sync succeeds).
    pub failed: Vec<(String, String)>,
}

/// The servers of a run and how they get new weights.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineSection,
    pool: Pool,
    launched: Option<Mutex<Launched>>,
    /// `<run>/engine`: weights written for the servers, server logs.
    dir: PathBuf,
    /// The tokenizer written into GGUF files (launched llama.cpp).
    vocab: Option<GgufVocab>,
    /// The model is trained with LoRA adapters (synced as adapters on
    /// vLLM / SGLang).
    lora: bool,
    /// Launched llama.cpp with adapter sync: the base GGUF the servers
    /// keep (written once at start).
    base_gguf: Option<PathBuf>,
}

impl Engine {
    /// Start (or reach) the servers of `cfg` serving `policy` as version 0.
    /// `vocab`: the model's GGUF vocabulary (needed to launch llama.cpp).
    pub fn start(
        cfg: &EngineSection,
        dir: &Path,
        policy: &Policy,
        vocab: Option<GgufVocab>,
    ) -> Result<Self, EngineError> {
        cfg.check().map_err(EngineError::Setup)?;
        if cfg.api == Api::Vllm && policy.lora().is_none() {
            // vLLM reloads full weights only from the path it was started
            // with (dev-mode `/collective_rpc reload_weights`).
            return Err(EngineError::Setup(
                "vLLM takes new weights at run time as LoRA adapters only: set model.lora (or use SGLang, which reloads full weights from disk)"
                    .into(),
            ));
        }
        std::fs::create_dir_all(dir)?;
        let mut base_gguf = None;
        let (urls, launched) = match &cfg.launch {
            Some(l) => {
                let Some(v) = &vocab else {
                    return Err(EngineError::Setup(
                        "launching llama.cpp servers needs the model's GGUF vocabulary: use a GGUF model.path"
                            .into(),
                    ));
                };
                if l.adapter && policy.lora().is_some() {
                    let base = dir.join(BASE_GGUF);
                    write_then_rename(&base, |tmp| {
                        policy.write_gguf(tmp, GgmlDType::F32, Some(v))
                    })?;
                    base_gguf = Some(base);
                }
                let (served, _) = write_served(policy, v, dir, 0, base_gguf.as_deref())?;
                let ctx = policy.config().max_position_embeddings;
                let mut la = Launched::start(l, cfg.max_concurrency, ctx, &served, dir)?;
                la.wait_ready(Duration::from_secs_f64(cfg.timeout_s))?;
                (la.urls(), Some(Mutex::new(la)))
            }
            None => (cfg.servers.clone(), None),
        };
        let pool = Pool::new(
            cfg.api,
            urls,
            Duration::from_secs_f64(cfg.timeout_s),
            cfg.max_concurrency,
            Duration::from_secs_f64(cfg.retry_s),
        );
        // Version 0 is what every server was started with or already
        // serves (the run's initial policy): the pool starts there.
        Ok(Engine {
            cfg: cfg.clone(),
            pool,
            launched,
            dir: dir.to_path_buf(),
            vocab,
            lora: policy.lora().is_some(),
            base_gguf,
        })
    }

    pub fn settings(&self) -> &EngineSection {
        &self.cfg
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The model name requests carry at the current version (vLLM's
    /// `model`, SGLang's `lora_path`): the base model at version 0 and for
    /// full-weight reloads, `<model>-v<N>` for adapters.
    pub fn model_name(&self) -> String {
        let v = self.pool.version();
        if self.lora && v > 0 && self.cfg.api != Api::LlamaCpp {
            adapter_name(&self.cfg.model, v)
        } else {
            self.cfg.model.clone()
        }
    }

    /// Hand `policy` (after optimiser step `version`) to the servers. A
    /// server that fails to take it gets no requests until a later sync
    /// succeeds; the sync fails only when no server took it.
    pub fn sync(&self, policy: &Policy, version: u64) -> Result<SyncReport, EngineError> {
        let t0 = Instant::now();
        // Requests in flight (asynchronous rollouts) finish on the old
        // weights; new ones wait for the new.
        self.pool
            .begin_sync(Duration::from_secs_f64(self.cfg.timeout_s));
        let _end = EndSync(&self.pool);
        self.pool.set_version(version);
        let n = self.pool.urls().len();
        let mut failed = Vec::new();
        let bytes;
        match (&self.launched, self.cfg.api) {
            (Some(la), _) => {
                let vocab = self.vocab.as_ref().ok_or_else(|| {
                    EngineError::Setup("no GGUF vocabulary to write".into())
                })?;
                let (served, written) =
                    write_served(policy, vocab, &self.dir, version, self.base_gguf.as_deref())?;
                bytes = written;
                let mut la = la.lock().unwrap_or_else(|e| e.into_inner());
                let ready = la.restart(&served, Duration::from_secs_f64(self.cfg.timeout_s));
                for (i, r) in ready.into_iter().enumerate() {
                    match r {
                        Ok(()) => self.pool.mark_synced(i, version),
                        Err(why) => {
                            self.pool.mark_failed(i);
                            failed.push((self.pool.urls()[i].clone(), why));
                        }
                    }
                }
                // The previous version's file is no longer served.
                if version > 0 {
                    let _ = std::fs::remove_file(gguf_path(&self.dir, version - 1));
                    let _ = std::fs::remove_file(adapter_path(&self.dir, version - 1));
                }
            }
            (None, Api::LlamaCpp) => {
                return Err(EngineError::Setup(
                    "llama.cpp servers cannot load new weights at run time: let the run start them (rollout.engine.launch)"
                        .into(),
                ))
            }
            (None, api) => {
                let (route, body) = self.sync_request(policy, version, api)?;
                bytes = dir_bytes(&self.dir.join(format!("v{version:06}")));
                for i in 0..n {
                    match self.pool.post_to(i, &route, &body) {
                        Ok(v) if v.get("success") == Some(&json!(false)) => {
                            self.pool.mark_failed(i);
                            failed.push((self.pool.urls()[i].clone(), v.to_string()));
                        }
                        Ok(_) => self.pool.mark_synced(i, version),
                        Err(why) => {
                            self.pool.mark_failed(i);
                            failed.push((self.pool.urls()[i].clone(), why));
                        }
                    }
                }
                if self.lora && version > 1 {
                    // The previous adapter: unloading it frees the slot.
                    let old = adapter_name(&self.cfg.model, version - 1);
                    let route = match api {
                        Api::Vllm => "/v1/unload_lora_adapter",
                        _ => "/unload_lora_adapter",
                    };
                    for i in 0..n {
                        let _ = self.pool.post_to(i, route, &json!({ "lora_name": old }));
                    }
                }
                // The servers hold `version` now: the previous folder
                // (a full HF model without LoRA) is no longer read.
                if version > 0 && failed.len() < n {
                    let _ = std::fs::remove_dir_all(self.dir.join(format!("v{:06}", version - 1)));
                }
            }
        }
        let synced = n - failed.len();
        if synced == 0 {
            return Err(EngineError::Sync {
                version,
                why: failed
                    .iter()
                    .map(|(u, w)| format!("{u}: {w}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        Ok(SyncReport {
            version,
            synced,
            seconds: t0.elapsed().as_secs_f64(),
            bytes,
            failed,
        })
    }

    /// vLLM / SGLang: write the step's weights and the request that loads
    /// them (route, body).
    fn sync_request(
        &self,
        policy: &Policy,
        version: u64,
        api: Api,
    ) -> Result<(String, serde_json::Value), EngineError> {
        let dir = self.dir.join(format!("v{version:06}"));
        if self.lora {
            policy.save_adapter(&dir, &self.cfg.model)?;
            let name = adapter_name(&self.cfg.model, version);
            let path = dir.display().to_string();
            Ok(match api {
                Api::Vllm => (
                    "/v1/load_lora_adapter".into(),
                    json!({ "lora_name": name, "lora_path": path }),
                ),
                _ => (
                    "/load_lora_adapter".into(),
                    json!({ "lora_name": name, "lora_path": path }),
                ),
            })
        } else {
            policy.save_hf_dir(&dir, None)?;
            let path = dir.display().to_string();
            // SGLang (vLLM is refused at start).
            Ok((
                "/update_weights_from_disk".into(),
                json!({ "model_path": path }),
            ))
        }
    }
}

/// The GGUF vocabulary of a `.gguf` model path (what launched llama.cpp
/// servers get written into their GGUF files), else none.
pub fn gguf_vocab(path: &Path) -> Result<Option<GgufVocab>, crate::model::ModelError> {
    if path.extension().is_none_or(|e| e != "gguf") {
        return Ok(None);
    }
    let g = crate::model::GgufFile::open(path)?;
    Ok(Some(GgufVocab::from_metadata(
        g.metadata(),
        &path.display().to_string(),
    )?))
}

/// Ends the pool's weight sync however [`Engine::sync`] returns.
struct EndSync<'a>(&'a Pool);

impl Drop for EndSync<'_> {
    fn drop(&mut self) {
        self.0.end_sync();
    }
}

/// The served adapter name of `version`.
pub fn adapter_name(model: &str, version: u64) -> String {
    let base = model.rsplit('/').next().unwrap_or(model);
    format!("{base}-v{version}")
}

fn gguf_path(dir: &Path, version: u64) -> PathBuf {
    dir.join(format!("policy-v{version:06}.gguf"))
}

/// The base model of adapter sync, written once at start.
const BASE_GGUF: &str = "policy-base.gguf";

fn adapter_path(dir: &Path, version: u64) -> PathBuf {
    dir.join(format!("adapter-v{version:06}.gguf"))
}

/// Bytes of the files directly in `dir` (0 when it cannot be read).
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Writes through `write` to a temporary name beside `path`, then renames
/// it into place, so a server never reads half a file.
fn write_then_rename<T>(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<T, crate::model::ModelError>,
) -> Result<T, EngineError> {
    let tmp = path.with_extension("gguf.tmp");
    let out = write(&tmp)?;
    std::fs::rename(&tmp, path)?;
    Ok(out)
}

/// Writes what the servers start on at `version`, and its size: with
/// `base` (adapter sync), the policy's adapters as a llama.cpp LoRA GGUF
/// beside that base; otherwise the policy (LoRA adapters merged) as an f32
/// GGUF.
fn write_served(
    policy: &Policy,
    vocab: &GgufVocab,
    dir: &Path,
    version: u64,
    base: Option<&Path>,
) -> Result<(Served, u64), EngineError> {
    if let Some(base) = base {
        let path = adapter_path(dir, version);
        let bytes = write_then_rename(&path, |tmp| policy.write_lora_gguf(tmp))?;
        let served = Served {
            model: base.to_path_buf(),
            lora: Some(path),
        };
        return Ok((served, bytes));
    }
    let path = gguf_path(dir, version);
    let merged;
    let p = if policy.lora().is_some() {
        merged = policy.merged()?;
        &merged
    } else {
        policy
    };
    write_then_rename(&path, |tmp| p.write_gguf(tmp, GgmlDType::F32, Some(vocab)))?;
    let bytes = std::fs::metadata(&path)?.len();
    Ok((
        Served {
            model: path,
            lora: None,
        },
        bytes,
    ))
}
