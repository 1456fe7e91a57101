//! actguide: guided agentic reinforcement learning of LLM agents.
//!
//! A compiled core — a candle transformer policy, built-in text
//! environments with expert planners, a batched episode runner and a GRPO
//! trainer — driven by Rhai scripts that decide, per task and step, how much
//! expert guidance a rollout gets (executed expert prefixes, plans in the
//! prompt).
//!
//! Modules, in data-flow order:
//! - [`env`]: the `Env` trait, task panels, the household environment and
//!   its expert planner;
//! - [`model`]: config, tokenizer, the trainable Llama-style policy,
//!   batched generation with constrained decoding, log-prob scoring;
//! - [`script`]: the sandboxed Rhai engine and its helper API;
//! - [`guidance`]: guidance specs, clusters, the strategy host;
//! - [`rollout`]: prompts, action projection, the episode runner;
//! - [`train`]: advantages, PPO/GRPO losses, AdamW, schedules, checkpoints;
//! - [`experiment`]: experiment files, the run loop, metrics, evaluation;
//! - [`rundir`]: the run directory's layout and files (metrics and eval
//!   logs as typed records, checkpoints, TensorBoard events);
//! - [`bench`]: throughput measurement;
//! - [`bench_model`]: raw decode / train throughput of a model.

pub mod bench;
pub mod bench_model;
pub mod env;
pub mod experiment;
pub mod guidance;
pub mod model;
pub mod report;
pub mod rollout;
pub mod rundir;
pub mod script;
pub mod seed;
pub mod tiny;
pub mod train;
