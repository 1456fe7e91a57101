//! Developer tools: measurements and checks of the machinery rather than
//! experiments, run as `actguide dev <tool>`. This module owns the
//! benchmarks ([`bench`]: throughput of the whole loop, [`bench_model`]:
//! raw decode / train throughput of a model, [`bench_grpo`]: seconds per
//! single-turn GRPO step against TRL, [`bench_rollouts`]: rollout
//! throughput, built in vs on an engine) and the device check
//! ([`device_check`]: a device computes and trains like the CPU). The
//! reference engine server that `actguide dev engine-reference` starts is
//! an engine and lives in [`crate::inference::reference`].
//!
//! These sit above every layer (they drive `experiment`, `train` and the
//! model directly); nothing in the library depends on them.

pub mod bench;
pub mod bench_grpo;
pub mod bench_model;
pub mod bench_rollouts;
pub mod device_check;
