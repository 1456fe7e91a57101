//! What stops a run, or a command that loads one (`eval`, `probe`,
//! `export`, comparisons).

use std::path::PathBuf;

use crate::env::{panel, EnvError};
use crate::experiment::config::ConfigError;
use crate::model::ModelError;
use crate::report::ReportError;
use crate::rollout::RolloutError;
use crate::rundir::checkpoint::CheckpointError;
use crate::rundir::tensorboard::TensorBoardError;
use crate::rundir::RunDirError;
use crate::script::ScriptError;
use crate::train::TrainError;

/// Errors that stop a run (before or while it runs).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Script(#[from] ScriptError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Panel(#[from] panel::PanelError),
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The run directory's files.
    #[error(transparent)]
    RunDir(#[from] RunDirError),
    #[error(transparent)]
    TensorBoard(#[from] TensorBoardError),
    /// The configuration cannot fit in the device's memory.
    #[error(transparent)]
    Memory(#[from] Box<crate::model::memory::MemoryError>),
    /// A data-parallel rank failed, left, or could not start.
    #[error("data-parallel run: {0}")]
    Ranks(String),
    #[error("data-parallel run: {0}")]
    Collective(#[from] crate::distributed::CollectiveError),
    /// The engine servers could not start, take weights, or all died.
    #[error(transparent)]
    Engine(#[from] Box<crate::inference::EngineError>),
    /// A subprocess env could not supply a panel's expert actions.
    #[error("{}: {source}", panel.display())]
    Experts {
        panel: PathBuf,
        #[source]
        source: EnvError,
    },
    /// A train panel none of whose tasks has expert actions (after the env
    /// was asked for them): nothing to guide with.
    #[error(
        "{}:1: no task has expert actions (`expert` is empty on every line): guidance, the \
         difficulty clusters and the memory estimate need them; add them, or use an env that \
         supplies them (env.kind \"subprocess\", or \"http\" with env.expert_endpoint)",
        panel.display()
    )]
    NoExperts { panel: PathBuf },
    /// Training diverged: the weights are no longer usable. Nothing of the
    /// step was logged or saved.
    #[error(
        "step {step}: {what} is {value}; training stopped (the last checkpoint \
         holds the last good weights; lower trainer.lr or raise trainer.grad_clip; at \
         the first step of a run or a resume, check the weights it started from)"
    )]
    NonFinite {
        step: usize,
        what: &'static str,
        value: f64,
    },
    /// The SFT phase cannot run (e.g. no expert trajectory in its panel).
    #[error("sft: {0}")]
    Sft(String),
    /// A checkpoint's optimiser or script state does not fit the run.
    #[error("{}: {msg}", checkpoint.display())]
    Resume { checkpoint: PathBuf, msg: String },
    /// An entry of a comparison cannot start (found before any entry
    /// runs).
    #[error("compare entry \"{entry}\": {source}")]
    Entry {
        entry: String,
        #[source]
        source: Box<RunError>,
    },
    /// A comparison's report.
    #[error("{}: {source}", out.display())]
    Report {
        out: PathBuf,
        #[source]
        source: ReportError,
    },
    #[error("{}: not a run directory (experiment.json) or a checkpoint directory (state.json)", path.display())]
    NotARun { path: PathBuf },
    #[error("{}: a checkpoint directory lies in <run>/checkpoints/", path.display())]
    CheckpointOutsideRun { path: PathBuf },
    #[error("{}: no task with id \"{id}\"", panel.display())]
    UnknownTask { panel: PathBuf, id: String },
    #[error(
        "{}: rollout.format \"chat\": this chat_template is neither ChatML nor Llama 3; \
         set rollout.format to \"chatml\" or \"llama3\" if the model follows one",
        origin.display()
    )]
    ChatTemplate { origin: PathBuf },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl RunError {
    /// An I/O failure on `path`.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> RunError {
        let path = path.into();
        move |source| RunError::Io { path, source }
    }
}
