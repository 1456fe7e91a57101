//! Experiments: config files, the run loop, the run directory, metrics and
//! evaluation.

pub mod config;
pub mod eval;
pub mod metrics;
pub mod run;

pub use config::{ConfigError, Experiment};
pub use run::{run, Event, RunError, RunOptions, RunSummary};
