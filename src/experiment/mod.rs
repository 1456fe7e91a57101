//! Experiments: config files, the run loop, the model side (`models`:
//! sources, LoRA, prompt format), metrics, evaluation and export, and the
//! panel a command names (`panel_ref`). The files a run writes belong to
//! [`crate::rundir`].

pub mod compare;
pub mod config;
pub mod eval;
pub mod export;
pub mod metrics;
pub mod models;
pub mod panel_ref;
pub mod probe;
pub mod run;

pub use compare::{run_comparison, ComparisonSummary};
pub use config::{Comparison, ConfigError, Experiment, ExperimentFile, ENTRY_MODEL};
pub use panel_ref::PanelRef;
pub use run::{
    run, serve_node, serve_worker, sft, Event, RunError, RunOptions, RunSummary, WorkerPlace,
    JOIN_TIMEOUT, RANKS_FILE,
};
