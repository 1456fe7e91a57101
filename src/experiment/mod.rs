//! Experiments: config files, the run loop, the run directory, the model
//! side (`model`: sources, LoRA, prompt format), metrics, evaluation and
//! export.

pub mod compare;
pub mod config;
pub mod eval;
pub mod export;
pub mod metrics;
pub mod policies;
pub mod probe;
pub mod run;

pub use compare::{run_comparison, ComparisonSummary};
pub use config::{Comparison, ConfigError, Experiment, ExperimentFile};
pub use run::{run, Event, RunError, RunOptions, RunSummary};
