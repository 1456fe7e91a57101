//! actguide: guided agentic reinforcement learning of LLM agents.
//!
//! A compiled core — a candle transformer policy, built-in text
//! environments with expert planners, a batched episode runner and a GRPO
//! trainer — driven by Rhai scripts that decide, per task and step, how much
//! expert guidance a rollout gets (executed expert prefixes, plans in the
//! prompt).
//!
//! Modules, lowest layer first (docs/ARCHITECTURE.md has the map and the
//! data flow of one training step):
//! - [`seed`]: the seeded RNG streams everything draws from;
//! - [`env`]: the `Env` trait, task panels, the built-in household, shop
//!   and searchqa environments with their expert planners, external envs
//!   (AgentGym HTTP, subprocess NDJSON);
//! - [`model`]: config, tokenizers, the trainable Llama-style policy (HF
//!   folders and GGUF, LoRA), batched generation with constrained decoding,
//!   log-prob scoring, the custom differentiable ops;
//! - [`tiny`]: the built-in tiny policy and its word-level tokenizer;
//! - [`script`]: the sandboxed Rhai engine, its helper API, the file watcher;
//! - [`guidance`]: guidance specs, clusters, review rounds, the strategy
//!   runtime (reload, probation), `actguide check` and `simulate`;
//! - [`rollout`]: prompts (plain and chat), action projection, the episode
//!   runner;
//! - [`train`]: advantages, PPO/GRPO losses, AdamW, lr schedules;
//! - [`inference`]: rollout generation on inference-engine servers
//!   (llama.cpp, vLLM, SGLang): requests, server pool, weight sync;
//! - [`distributed`]: collective operations for data-parallel training;
//! - [`rundir`]: the run directory's layout and files (metrics and eval
//!   logs as typed records, checkpoints, TensorBoard events, script copies);
//! - [`report`]: figures, markdown and HTML reports of runs (it reads run
//!   directories only);
//! - [`experiment`]: experiment files, the run loop and its phases,
//!   evaluation, probe, export, comparisons;
//! - [`dev`]: developer tools (`actguide dev …`): benchmarks of the loop,
//!   a model and rollouts, the device check.

pub mod children;
pub mod dev;
pub mod distributed;
pub mod env;
pub mod experiment;
pub mod guidance;
pub mod inference;
pub mod model;
pub mod report;
pub mod rollout;
pub mod rundir;
pub mod script;
pub mod seed;
pub mod tiny;
pub mod train;
