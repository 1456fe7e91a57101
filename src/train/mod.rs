//! The trainer: turns episodes into token samples with advantages, and runs
//! the GRPO/PPO update (clip-higher, dual clip, token-mean or
//! seq-mean-token-mean aggregation, k3 KL to a frozen reference, Agent-G²'s
//! auxiliary NLL on executed expert prefixes), with gradient accumulation
//! over micro-batches, global grad-norm clipping, AdamW and a warm-up +
//! cosine learning rate.
//!
//! - `samples`: episodes to token samples ([`build_samples`]);
//! - [`advantage`]: group-relative advantages and a batch's
//!   [`Advantages`];
//! - [`gigpo`]: GiGPO's episode- and step-level (anchor-state) advantages;
//! - `estimator`: the advantage estimators behind one registry by name
//!   ([`estimator`], [`batch_advantages`]);
//! - `loss`: the per-token policy losses (PPO, LUFFY);
//! - `trainer`: the [`Trainer`] and its update step;
//! - `stats`: the step's metrics ([`TrainStats`]);
//! - [`optim`] and [`schedule`]: AdamW and the learning-rate schedule;
//! - [`settings`]: the `trainer` section of an experiment file.

pub mod advantage;
mod estimator;
pub mod gigpo;
mod loss;
pub mod optim;
mod samples;
pub mod schedule;
pub mod settings;
mod stats;
mod trainer;

use crate::model::ModelError;
pub use advantage::{group_advantages, is_zero_std, AdvantageKind, Advantages};
pub use estimator::{batch_advantages, estimator, BatchAdvantages, Estimator, GroupAdvantages};
pub use gigpo::{gigpo_advantages, AnchorStats, Gigpo, GigpoNorm};
pub use loss::{luffy_token_loss, ppo_token_loss};
pub use optim::{AdamW, AdamWParams, OptimStateError};
pub use samples::{build_samples, Sample, SampleOptions};
pub use settings::{Aggregation, Schedule, TrainerSection};
pub use stats::{BehaviourStats, TrainStats};
pub use trainer::{global_norm, Trainer};

/// Errors of the trainer.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Collective(#[from] crate::distributed::CollectiveError),
}
