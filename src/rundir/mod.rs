//! The run directory: the one place that knows its layout and file formats.
//!
//! ```text
//! runs/<name>/
//!   experiment.json          the resolved experiment, so the directory says what ran
//!   metrics.jsonl            one [`StepLine`] per training step
//!   eval.jsonl               one [`EvalLine`] per evaluation and panel
//!   reloads.jsonl            one [`ReloadLine`] per hot-reload outcome
//!   env_errors.jsonl         one [`EnvErrorLine`] per episode the env failed
//!   resumes.jsonl            one [`ResumeLine`] per resume
//!   sft.jsonl                one [`SftLine`] per step of an SFT run
//!   sft_eval.json            an SFT run's [`SftEval`] (its own tasks, greedy)
//!   model/                   an SFT run's final policy as an HF folder
//!   scripts/<role>-<hash>/   every script version used, with its imports
//!   tb/                      TensorBoard event files (a new one per process)
//!   checkpoints/step-NNNNNN/ weights, optimiser moments, run state
//!   checkpoints/latest       the name of the newest checkpoint
//!   lock                     held by the live run (its pid), see [`lock`]
//! ```
//!
//! The run loop writes these files through [`RunDir`]; `actguide report`,
//! `actguide eval` and a resumed run read them back through the same typed
//! records ([`records`]), so writer and readers cannot drift apart.
//!
//! Sub-modules: [`records`] (the JSONL lines), [`jsonl`] (appending,
//! reading, truncating them), [`checkpoint`], [`tensorboard`] (event
//! files), [`scripts`] (saved script versions), [`lock`] (one live run per
//! directory), [`probe`] (the record `actguide probe` prints and the
//! report's probe figure draws).

pub mod checkpoint;
pub mod jsonl;
pub mod lock;
pub mod probe;
pub mod records;
pub mod scripts;
pub mod tensorboard;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

pub use jsonl::Record;
pub use lock::RunLock;
pub use records::{
    ComparisonManifest, EnvErrorLine, EvalLine, EvalTimes, ReloadLine, ResumeLine, RunKind,
    SftEval, SftLine, StepAsync, StepBehaviour, StepEngine, StepGigpo, StepLine, StepRounds,
    StepTimes, SuccessBreakdown,
};

/// The resolved experiment of a run.
pub const EXPERIMENT_FILE: &str = "experiment.json";
/// Saved script versions.
pub const SCRIPTS_DIR: &str = "scripts";
/// TensorBoard event files.
pub const TB_DIR: &str = "tb";

/// Errors reading or writing the run directory's files.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A whole-file JSON document (e.g. `experiment.json`) that does not
    /// parse, or a value that does not serialise.
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}:{line}: bad JSON: {source}", path.display())]
    BadLine {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// Another live process holds the run directory.
    #[error("{}: in use by another actguide process (pid {holder}); wait for it to end", dir.display())]
    Busy { dir: PathBuf, holder: String },
    #[error("{}:{line}: expected a JSON object", path.display())]
    NotObject { path: PathBuf, line: usize },
    /// A JSON object whose keys have the wrong types for its record.
    #[error("{}:{line}: {source}", path.display())]
    BadRecord {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
}

impl RunDirError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunDirError + '_ {
        move |source| RunDirError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Write a file atomically (temp file in the same folder + rename), so a
/// killed run never leaves it half written.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RunDirError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(RunDirError::io(dir))?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(RunDirError::io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(RunDirError::io(path))
}

/// Whether a directory holds an earlier run or comparison (its `marker`
/// file or a `metrics.jsonl`).
fn taken(dir: &Path, marker: &str) -> bool {
    dir.join(marker).exists() || dir.join(StepLine::FILE).exists()
}

/// `base`, or `base-2`, `base-3`, … : the first that holds neither `marker`
/// nor a `metrics.jsonl`, so a new comparison never overwrites an old one.
pub fn fresh_dir(base: &Path, marker: &str) -> PathBuf {
    let taken = |p: &Path| taken(p, marker);
    if !taken(base) {
        return base.to_path_buf();
    }
    let name = base.file_name().and_then(|s| s.to_str()).unwrap_or("run");
    (2..)
        .map(|i| base.with_file_name(format!("{name}-{i}")))
        .find(|p| !taken(p))
        .expect("an unused name exists")
}

/// A run directory (which need not exist yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunDir {
    root: PathBuf,
}

impl RunDir {
    /// The run directory at `root`.
    pub fn at(root: impl Into<PathBuf>) -> Self {
        RunDir { root: root.into() }
    }

    /// Claim `runs/<name>`, or `runs/<name>-2`, `-3`, … when earlier or
    /// live runs hold the name: created and locked for this process.
    pub fn claim(base: &Path) -> Result<(Self, RunLock), RunDirError> {
        let lock = lock::claim(base, |p| taken(p, EXPERIMENT_FILE))?;
        Ok((RunDir::at(lock.dir()), lock))
    }

    /// Lock an existing run directory (to resume it).
    pub fn lock(&self) -> Result<RunLock, RunDirError> {
        RunLock::acquire(&self.root)
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Create the directory (and its `scripts/`).
    pub fn create(&self) -> Result<(), RunDirError> {
        std::fs::create_dir_all(self.root.join(SCRIPTS_DIR)).map_err(RunDirError::io(&self.root))
    }

    /// Write `experiment.json` (pretty-printed).
    pub fn write_experiment(&self, exp: &impl Serialize) -> Result<(), RunDirError> {
        let text = serde_json::to_string_pretty(exp).map_err(|source| RunDirError::Json {
            path: self.root.clone(),
            source,
        })?;
        write_atomic(&self.root.join(EXPERIMENT_FILE), text.as_bytes())
    }

    /// Read `experiment.json` as `T`.
    pub fn read_experiment<T: DeserializeOwned>(&self) -> Result<T, RunDirError> {
        let path = self.root.join(EXPERIMENT_FILE);
        let text = std::fs::read_to_string(&path).map_err(RunDirError::io(&path))?;
        serde_json::from_str(&text).map_err(|source| RunDirError::Json { path, source })
    }

    /// Write `sft_eval.json`.
    pub fn write_sft_eval(&self, eval: &SftEval) -> Result<(), RunDirError> {
        let path = self.root.join(SftEval::FILE);
        let text = serde_json::to_string(eval).map_err(|source| RunDirError::Json {
            path: path.clone(),
            source,
        })?;
        write_atomic(&path, format!("{text}\n").as_bytes())
    }

    /// Read `sft_eval.json` (`None` when the run wrote none).
    pub fn read_sft_eval(&self) -> Result<Option<SftEval>, RunDirError> {
        let path = self.root.join(SftEval::FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|source| RunDirError::Json { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(RunDirError::io(&path)(e)),
        }
    }

    /// Append one record to its file; returns the JSON written (the
    /// TensorBoard log takes its numbers from it).
    pub fn append<R: Record>(&self, record: &R) -> Result<Value, RunDirError> {
        jsonl::append(&self.root.join(R::FILE), record)
    }

    /// Every record of `R`'s file (`None` when there is none); see
    /// [`jsonl::read`] for what is skipped with a warning.
    pub fn read<R: Record>(
        &self,
        warnings: &mut Vec<String>,
    ) -> Result<Option<Vec<R>>, RunDirError> {
        jsonl::read(&self.root.join(R::FILE), warnings)
    }

    /// Before resuming at `step`: drop the log lines written after the
    /// checkpoint (they will be written again). Evaluations at `step` ran
    /// before that checkpoint was saved, so they stay. Damaged lines are
    /// set aside with a warning each (see [`jsonl::truncate_after`]).
    pub fn truncate_for_resume(
        &self,
        step: usize,
        warnings: &mut Vec<String>,
    ) -> Result<(), RunDirError> {
        jsonl::truncate_after(&self.root.join(StepLine::FILE), step, warnings)?;
        jsonl::truncate_after(&self.root.join(SftLine::FILE), step, warnings)?;
        jsonl::truncate_after(&self.root.join(EvalLine::FILE), step + 1, warnings)?;
        jsonl::truncate_after(&self.root.join(ReloadLine::FILE), step, warnings)?;
        jsonl::truncate_after(&self.root.join(EnvErrorLine::FILE), step, warnings)
    }

    /// The in-region task ids each panel's first evaluation recorded in
    /// `eval.jsonl` (for a resumed run).
    pub fn regions(&self) -> Result<BTreeMap<String, BTreeSet<String>>, RunDirError> {
        let mut out = BTreeMap::new();
        let lines: Vec<EvalLine> = jsonl::read_all(&self.root.join(EvalLine::FILE))?;
        for line in lines {
            if let Some(ids) = line.in_region_ids {
                out.entry(line.panel.unwrap_or_else(|| "test".into()))
                    .or_insert(ids);
            }
        }
        Ok(out)
    }

    /// Keep a copy of a script version (see [`scripts::save_copy`]);
    /// returns the copy's path.
    pub fn save_script_copy(
        &self,
        role: &str,
        script: &crate::script::Script,
    ) -> Result<String, RunDirError> {
        scripts::save_copy(&self.root.join(SCRIPTS_DIR), role, script)
    }

    /// A new TensorBoard event file under `tb/`.
    pub fn tensorboard(&self) -> Result<tensorboard::EventWriter, tensorboard::TensorBoardError> {
        tensorboard::EventWriter::create(&self.root.join(TB_DIR))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_runs_never_reuse_a_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("q");
        let (dir, lock) = RunDir::claim(&base).unwrap();
        assert_eq!(dir.path(), base);
        dir.write_experiment(&serde_json::json!({})).unwrap();
        drop(lock);
        let (dir, _lock) = RunDir::claim(&base).unwrap();
        assert_eq!(dir.path(), tmp.path().join("q-2"));
        // A live run's directory cannot be locked for a resume.
        assert!(matches!(dir.lock(), Err(RunDirError::Busy { .. })));
    }
}
