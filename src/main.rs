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
