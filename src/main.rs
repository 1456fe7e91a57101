//! The `actguide` command line: parses arguments, calls the library, prints.
//!
//! This file lists the subcommands (their one-line help is the doc comment
//! of each variant of [`Cmd`]); each subcommand group lives in `cli/` with
//! its flags (an `Args` struct) and a `run()`, and `cli/print.rs` prints
//! what a training run reports while it runs.

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};

// candle allocates and frees large tensors on every op; glibc's malloc
// returns them to the OS each time (mmap/munmap + page faults), which
// doubled step time in measurements. mimalloc keeps them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (index in mimalloc 3's `mi_option_e`).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Never hand freed memory back to the OS. mimalloc still purges idle pages
/// after a delay, and a training step frees and re-allocates the same large
/// buffers every op: the kernel then zeroes fresh (huge) pages again
/// (`clear_page_erms`, ~9 % of a tiny-model step in `perf`). Without purging
/// a quickstart step is ~13 % faster; the resident set stays at its peak,
/// which a step reaches anyway. `MIMALLOC_PURGE_DELAY` still overrides.
fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: called first in main, before any other thread exists
        // (mimalloc's option setters are not thread-safe).
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

/// candle's barrier-pool thread (elementwise ops) spins 25 000 times
/// after each op before it parks; on a small CPU that spinning takes turns
/// from the BLAS and rayon threads (8 % of a SmolLM2 train step on 2
/// cores in `perf`; train tok/s +3 % with 200). `CANDLE_BARRIER_POOL_SPIN_LIMIT`
/// still overrides.
fn short_spins() {
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        // SAFETY: called first in main, before any other thread exists.
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "200");
    }
}

#[derive(Parser)]
#[command(
    name = "actguide",
    version,
    about = "Guided agentic RL of LLM agents with hot-reloaded Rhai guidance scripts"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run an experiment file (or resume a run directory).
    Run(cli::run::RunArgs),
    /// Supervised warm start: behaviour cloning on expert trajectories
    /// (an experiment file's `sft` section); writes the model RL starts from.
    Sft(cli::sft::SftArgs),
    /// Compile a script (guidance, reward or intervention) and call its
    /// entry points on synthetic inputs; exits non-zero on any error.
    Check(cli::script::CheckArgs),
    /// Play a guidance script against a synthetic learner (no model) and
    /// print its per-step schedule and cost.
    Simulate(cli::script::SimulateArgs),
    /// Task panels.
    Tasks(cli::tasks::TasksArgs),
    /// Evaluate a run's latest checkpoint (or a checkpoint directory) on a
    /// panel: greedy and sampled success, unbiased pass@k, by task type,
    /// cluster and in-/out-region (against the run's initial policy).
    Eval(cli::checkpoint::EvalArgs),
    /// Reachability diagnostics (ActGuide-RL Fig. 3): along guided
    /// rollouts of chosen tasks, per state the guidance influence
    /// ‖ΔLogit‖ and the Pass@K of unguided continuations.
    Probe(cli::checkpoint::ProbeArgs),
    /// Compare run directories: SVG figures, report.md and a
    /// self-contained report.html.
    Report(cli::report::ReportArgs),
    /// Export a checkpoint for other tools: a full HF folder (LoRA
    /// adapters merged) that `transformers` loads, or the adapters alone
    /// (PEFT layout).
    Export(cli::checkpoint::ExportArgs),
    /// Serve a built-in env over the subprocess protocol (stdin/stdout,
    /// envs/PROTOCOL.md) or AgentGym's HTTP API, for external use and the
    /// protocol tests.
    ServeEnv(cli::env::ServeEnvArgs),
    /// Write the built-in tiny model card (config.json + tokenizer.json).
    InitTiny(cli::model::InitTinyArgs),
    /// Measure decode and train tokens/s of a model (GGUF file or HF
    /// folder) on random token sequences, per batch size.
    BenchModel(cli::model::BenchModelArgs),
    /// Measure rollout and train tokens/s of a model on the household env.
    Bench(cli::model::BenchArgs),
    /// Check that a device (cuda:N, or cpu) computes what the CPU does in
    /// f32 and bf16 and trains (gradients, generation, a LoRA step).
    CheckDevice(cli::model::CheckDeviceArgs),
    /// Serve a GGUF policy over llama.cpp's `/completion` API (takes
    /// llama-server's flags): a stand-in rollout engine with the policy's
    /// exact log-probs, for tests of `rollout.engine`.
    EngineReference(cli::engine::EngineReferenceArgs),
    /// Rollout throughput of an experiment's model: built-in generation
    /// against its `rollout.engine` with 1, 2, … servers.
    BenchRollouts(cli::engine::BenchRolloutsArgs),
    /// A rank of a data-parallel run (`run --devices`); started by rank 0.
    #[command(hide = true)]
    DpWorker(cli::run::WorkerArgs),
}

fn main() {
    keep_freed_memory();
    short_spins();
    let cli = Cli::parse();
    if let Err(e) = dispatch(cli.cmd) {
        eprintln!("error: {}", cli::print::error_chain(&e));
        std::process::exit(1);
    }
}

fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Run(a) => cli::run::run(a),
        Cmd::Sft(a) => cli::sft::run(a),
        Cmd::Check(a) => cli::script::check(a),
        Cmd::Simulate(a) => cli::script::simulate(a),
        Cmd::Tasks(a) => cli::tasks::run(a),
        Cmd::Eval(a) => cli::checkpoint::eval(a),
        Cmd::Probe(a) => cli::checkpoint::probe(a),
        Cmd::Report(a) => cli::report::run(a),
        Cmd::Export(a) => cli::checkpoint::export(a),
        Cmd::ServeEnv(a) => cli::env::serve_env(a),
        Cmd::InitTiny(a) => cli::model::init_tiny(a),
        Cmd::BenchModel(a) => cli::model::bench_model(a),
        Cmd::Bench(a) => cli::model::bench(a),
        Cmd::CheckDevice(a) => cli::model::check_device(a),
        Cmd::DpWorker(a) => cli::run::dp_worker(a),
        Cmd::EngineReference(a) => cli::engine::engine_reference(a),
        Cmd::BenchRollouts(a) => cli::engine::bench_rollouts(a),
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::{CommandFactory, Parser};
    use std::any::TypeId;

    /// Every numeric flag of every command, with a value outside its
    /// range (`None`: every value of its type means something).
    const NUMERIC_FLAGS: &[(&str, &str, Option<&str>)] = &[
        ("run", "stop-after", Some("0")),
        ("run", "memory-gb", Some("0")),
        ("run", "jobs", Some("0")),
        ("sft", "stop-after", Some("0")),
        ("simulate", "steps", Some("0")),
        ("simulate", "tasks", Some("0")),
        ("simulate", "group", Some("0")),
        ("simulate", "clusters", Some("0")),
        ("simulate", "max-rounds", None),
        ("simulate", "seed", None),
        ("simulate", "horizon", Some("inf")),
        ("simulate", "sharpness", Some("0")),
        ("simulate", "plan-gain", Some("1.5")),
        ("simulate", "learn-rate", Some("-1")),
        ("simulate", "drift", Some("NaN")),
        ("tasks select", "min-expert", None),
        ("tasks select", "max-expert", None),
        ("tasks select", "first", Some("0")),
        ("tasks generate", "seed", None),
        ("tasks generate", "train", Some("0")),
        ("tasks generate", "test", Some("0")),
        ("tasks stats", "rollouts", Some("0")),
        ("tasks stats", "max-steps", Some("0")),
        ("tasks stats", "seed", None),
        ("tasks from-server", "timeout-s", Some("0")),
        ("tasks from-server", "retries", Some("1000")),
        ("eval", "samples", Some("0")),
        ("eval", "max-tasks", None),
        ("eval", "seed", None),
        ("probe", "per-cluster", Some("0")),
        ("probe", "k", Some("0")),
        ("probe", "seed", None),
        ("export", "max-shard-mb", Some("0")),
        ("serve-env", "port", None),
        ("serve-env", "max-steps", Some("0")),
        ("serve-env", "die-after-steps", None),
        ("serve-env", "malformed-after-steps", None),
        ("serve-env", "fault-every", Some("0")),
        ("bench-model", "batches", Some("0")),
        ("bench-model", "prompt-len", Some("0")),
        ("bench-model", "new-tokens", Some("0")),
        ("bench-model", "train-len", Some("1")),
        ("bench-model", "repeats", Some("0")),
        ("bench-model", "seed", None),
        ("bench-model", "lora-rank", Some("0")),
        ("bench", "tasks", Some("0")),
        ("bench", "group", Some("0")),
        ("bench", "steps", Some("0")),
        ("bench", "max-steps", Some("0")),
        ("bench", "seed", None),
        ("bench-rollouts", "rounds", Some("0")),
        ("bench-rollouts", "servers", Some("0")),
        ("bench-rollouts", "threads", Some("0")),
        ("dp-worker", "rank", None),
        ("dp-worker", "world", Some("1")),
    ];

    fn numeric(arg: &clap::Arg) -> bool {
        let t = arg.get_value_parser().type_id();
        [
            TypeId::of::<usize>(),
            TypeId::of::<u64>(),
            TypeId::of::<u32>(),
            TypeId::of::<u16>(),
            TypeId::of::<i64>(),
            TypeId::of::<f64>(),
        ]
        .iter()
        .any(|id| t == *id)
    }

    /// (command path, flag) of every numeric flag.
    fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<(String, String)>) {
        for arg in cmd.get_arguments() {
            if let Some(long) = arg.get_long() {
                if numeric(arg) {
                    out.push((path.to_string(), long.to_string()));
                }
            }
        }
        for sub in cmd.get_subcommands() {
            let p = if path.is_empty() {
                sub.get_name().to_string()
            } else {
                format!("{path} {}", sub.get_name())
            };
            walk(sub, &p, out);
        }
    }

    #[test]
    fn every_numeric_flag_has_a_range_that_clap_enforces() {
        let cmd = Cli::command();
        let mut found = Vec::new();
        walk(&cmd, "", &mut found);
        let listed: Vec<(String, String)> = NUMERIC_FLAGS
            .iter()
            .map(|(c, f, _)| (c.to_string(), f.to_string()))
            .collect();
        let missing: Vec<_> = found.iter().filter(|f| !listed.contains(f)).collect();
        assert!(
            missing.is_empty(),
            "numeric flags without a row: {missing:?}"
        );
        let stale: Vec<_> = listed.iter().filter(|f| !found.contains(f)).collect();
        assert!(stale.is_empty(), "rows of no flag: {stale:?}");
        for (path, flag, bad) in NUMERIC_FLAGS {
            let Some(bad) = bad else { continue };
            // Values are checked as they are parsed, before any missing
            // required argument is noticed.
            let mut argv = vec!["actguide".to_string()];
            argv.extend(path.split(' ').map(str::to_string));
            argv.push(format!("--{flag}={bad}"));
            let e = match Cli::try_parse_from(&argv) {
                Ok(_) => panic!("{argv:?} was accepted"),
                Err(e) => e,
            };
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{argv:?}: {e}"
            );
        }
    }
}
