//! `actguide dev <tool>`: the developer tools of [`actguide::dev`]
//! (benchmarks, the device check) and the reference engine server.

use std::path::PathBuf;

use anyhow::{anyhow, Result};
use clap::{Args, Subcommand};

use actguide::dev::bench::BenchConfig;
use actguide::dev::bench_model::ModelBenchConfig;
use actguide::env::BuiltinEnv;
use actguide::experiment::PanelRef;
use actguide::inference::reference::{ReferenceServer, ServerArgs};
use actguide::model::{LoraConfig, Precision};

use super::args::{DeviceArg, PANEL};
use super::print_report;

// Flags of `actguide dev`: only its subcommand.
#[derive(Args)]
pub struct DevArgs {
    #[command(subcommand)]
    cmd: DevCmd,
}

#[derive(Subcommand)]
enum DevCmd {
    /// Measure rollout and train tokens/s of a model on the household env.
    Bench(BenchArgs),
    /// Measure decode and train tokens/s of a model (GGUF file or HF
    /// folder) on random token sequences, per batch size.
    BenchModel(BenchModelArgs),
    /// Seconds per single-turn GRPO step of a model (generation and update
    /// apart): the workload scripts/compare-trl.sh also runs on TRL.
    BenchGrpo(BenchGrpoArgs),
    /// Rollout throughput of an experiment's model: built-in generation
    /// against its `rollout.engine` with 1, 2, … servers.
    BenchRollouts(BenchRolloutsArgs),
    /// Check that a device computes what the CPU does in f32 and bf16 and
    /// trains (gradients, generation, a LoRA step).
    CheckDevice(CheckDeviceArgs),
    /// Serve a GGUF policy over llama.cpp's `/completion` API (takes
    /// llama-server's flags): a stand-in rollout engine with the policy's
    /// exact log-probs, for tests of `rollout.engine`.
    EngineReference(EngineReferenceArgs),
}

pub fn run(a: DevArgs) -> Result<()> {
    match a.cmd {
        DevCmd::Bench(a) => bench(a),
        DevCmd::BenchModel(a) => bench_model(a),
        DevCmd::BenchGrpo(a) => bench_grpo(a),
        DevCmd::BenchRollouts(a) => bench_rollouts(a),
        DevCmd::CheckDevice(a) => check_device(a),
        DevCmd::EngineReference(a) => engine_reference(a),
    }
}

// Flags of `actguide dev bench-model`.
#[derive(Args)]
struct BenchModelArgs {
    /// A .gguf file or a HF model folder.
    model: PathBuf,
    /// Comma-separated batch sizes.
    #[arg(value_parser = super::ranges::at_least(1), long, value_delimiter = ',', default_value = "1,8,32")]
    batches: Vec<usize>,
    /// Prompt tokens before decoding.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 64)]
    prompt_len: usize,
    /// New tokens per sequence (every sequence decodes exactly this many).
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 32)]
    new_tokens: usize,
    /// Tokens per sequence of the train step.
    #[arg(value_parser = super::ranges::at_least(2), long, default_value_t = 128)]
    train_len: usize,
    /// Timed runs per measurement, after one warm-up (the fastest is
    /// reported).
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 3)]
    repeats: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train LoRA adapters of this rank (alpha = 2 rank, every
    /// projection) instead of every weight.
    #[arg(value_parser = super::ranges::at_least(1), long)]
    lora_rank: Option<usize>,
    #[command(flatten)]
    device: DeviceArg,
    /// Compute precision, f32 or bf16 (default: bf16 on CUDA, f32 on CPU).
    #[arg(long)]
    dtype: Option<Precision>,
    /// Generate from bf16 copies of the weights (CPU, with MKL); the
    /// |Δlogp| column is then the behaviour mismatch against f32 scoring.
    /// Bare or `on`: on; `off`: f32; absent: this CPU's default (on with
    /// AMX-BF16 and MKL, see the run header's kernel line).
    #[arg(long, value_name = "on|off", num_args = 0..=1, default_missing_value = "on", value_parser = on_off)]
    rollout_bf16: Option<bool>,
    /// Train with bf16 products and f32 accumulation (CPU, with MKL); as
    /// `--rollout-bf16`.
    #[arg(long, value_name = "on|off", num_args = 0..=1, default_missing_value = "on", value_parser = on_off)]
    mixed_precision: Option<bool>,
    /// f32 everywhere: `--rollout-bf16 off --mixed-precision off`.
    #[arg(long, conflicts_with_all = ["rollout_bf16", "mixed_precision"])]
    f32: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

// Flags of `actguide dev bench-grpo`.
#[derive(Args)]
struct BenchGrpoArgs {
    /// A .gguf file or a HF model folder.
    model: PathBuf,
    /// A JSON list of prompts as token-id lists (default: random ids).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Prompts per step.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 8)]
    prompts: usize,
    /// Tokens of each random prompt (without --prompt-file).
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 64)]
    prompt_len: usize,
    /// Completions per prompt.
    #[arg(value_parser = super::ranges::at_least(2), long, default_value_t = 8)]
    group_size: usize,
    /// Tokens per completion (exactly).
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 32)]
    new_tokens: usize,
    /// Timed steps, after one warm-up step.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 3)]
    steps: usize,
    /// Sequences per forward/backward.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 64)]
    micro_batch: usize,
    /// LoRA rank (alpha = 2 rank, every projection); 0: full fine-tuning.
    #[arg(long, default_value_t = 8)]
    lora_rank: usize,
    /// AdamW learning rate.
    #[arg(value_parser = super::ranges::positive, long, default_value_t = 1e-5)]
    lr: f64,
    /// As for bench-model.
    #[arg(long, value_name = "on|off", num_args = 0..=1, default_missing_value = "on", value_parser = on_off)]
    rollout_bf16: Option<bool>,
    /// As for bench-model.
    #[arg(long, value_name = "on|off", num_args = 0..=1, default_missing_value = "on", value_parser = on_off)]
    mixed_precision: Option<bool>,
    /// f32 everywhere.
    #[arg(long, conflicts_with_all = ["rollout_bf16", "mixed_precision"])]
    f32: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn bench_grpo(a: BenchGrpoArgs) -> Result<()> {
    let report = actguide::dev::bench_grpo::run(&actguide::dev::bench_grpo::GrpoBenchConfig {
        model: a.model,
        prompt_file: a.prompt_file,
        prompts: a.prompts,
        prompt_len: a.prompt_len,
        group: a.group_size,
        new_tokens: a.new_tokens,
        steps: a.steps,
        lr: a.lr,
        micro_batch: a.micro_batch,
        lora: (a.lora_rank > 0).then(|| LoraConfig {
            rank: a.lora_rank,
            alpha: 2.0 * a.lora_rank as f64,
            ..Default::default()
        }),
        rollout_bf16: if a.f32 { Some(false) } else { a.rollout_bf16 },
        mixed_precision: if a.f32 {
            Some(false)
        } else {
            a.mixed_precision
        },
        seed: a.seed,
    })?;
    print_report(&report, a.json)
}

/// `on` / `off` (also `true` / `false`) for a setting whose absence means
/// "this machine's default".
fn on_off(s: &str) -> std::result::Result<bool, String> {
    match s {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        _ => Err(format!("expected on or off, got {s:?}")),
    }
}

fn bench_model(a: BenchModelArgs) -> Result<()> {
    let report = actguide::dev::bench_model::run(&ModelBenchConfig {
        model: a.model,
        batches: a.batches,
        prompt_len: a.prompt_len,
        new_tokens: a.new_tokens,
        train_len: a.train_len,
        repeats: a.repeats,
        seed: a.seed,
        lora: a.lora_rank.map(|rank| LoraConfig {
            rank,
            alpha: 2.0 * rank as f64,
            ..Default::default()
        }),
        device: a.device.or_cpu(),
        dtype: a.dtype,
        rollout_bf16: if a.f32 { Some(false) } else { a.rollout_bf16 },
        mixed_precision: if a.f32 {
            Some(false)
        } else {
            a.mixed_precision
        },
        ..Default::default()
    })?;
    print_report(&report, a.json)
}

// Flags of `actguide dev bench`.
#[derive(Args)]
struct BenchArgs {
    #[arg(long, default_value = "models/tiny")]
    model: PathBuf,
    /// The household env's train or test panel, or a panel file.
    #[arg(long, value_name = PANEL, default_value = "train")]
    panel: PanelRef,
    /// Tasks per step.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 8)]
    tasks_per_step: usize,
    /// Rollouts per task.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 8)]
    group_size: usize,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 3)]
    steps: usize,
    /// Episode step limit.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 20)]
    max_steps: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Guidance scripts whose entry-point cost per step is measured.
    #[arg(long, num_args = 0.., default_values = ["scripts/guidance/gaussian.rhai", "scripts/guidance/actguide.rhai", "scripts/guidance/binary_search.rhai"])]
    scripts: Vec<PathBuf>,
    #[command(flatten)]
    device: DeviceArg,
    /// Compute precision, f32 or bf16 (default: bf16 on CUDA, f32 on CPU).
    #[arg(long)]
    dtype: Option<Precision>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn bench(a: BenchArgs) -> Result<()> {
    let report = actguide::dev::bench::run(&BenchConfig {
        model: a.model,
        panel: a.panel.of_env(BuiltinEnv::Household),
        tasks: a.tasks_per_step,
        group: a.group_size,
        steps: a.steps,
        max_steps: a.max_steps,
        seed: a.seed,
        scripts: a.scripts,
        device: a.device.or_cpu(),
        dtype: a.dtype,
    })?;
    print_report(&report, a.json)
}

// Flags of `actguide dev check-device`.
#[derive(Args)]
struct CheckDeviceArgs {
    #[command(flatten)]
    device: DeviceArg,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn check_device(a: CheckDeviceArgs) -> Result<()> {
    let report = actguide::dev::device_check::run(a.device.or_cpu())?;
    print_report(&report, a.json)?;
    if !report.passed() {
        anyhow::bail!("{}: some checks failed (rows marked NO)", report.device);
    }
    Ok(())
}

// Flags of `actguide dev engine-reference`.
#[derive(Args)]
struct EngineReferenceArgs {
    /// llama-server's flags: `-m MODEL.gguf [--lora ADAPTER.gguf] --host H --port P -t N`
    /// (`-np`, `-c` accepted and ignored).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

fn engine_reference(a: EngineReferenceArgs) -> Result<()> {
    let args = ServerArgs::parse(&a.args).map_err(|e| anyhow!("engine-reference: {e}"))?;
    let server = ReferenceServer::open(&args).map_err(|e| anyhow!("engine-reference: {e}"))?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()?;
    pool.install(|| server.run());
    Ok(())
}

// Flags of `actguide dev bench-rollouts`.
#[derive(Args)]
struct BenchRolloutsArgs {
    /// An experiment file; its model, panel, rollout settings and
    /// `rollout.engine` are measured.
    experiment: PathBuf,
    /// Rollout rounds per setting.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 2)]
    rounds: usize,
    /// Server counts to measure launched engines with (default: the
    /// experiment's).
    #[arg(value_parser = super::ranges::at_least(1), long, value_delimiter = ',')]
    servers: Vec<usize>,
    /// Threads per launched server (default: the experiment's).
    #[arg(value_parser = super::ranges::at_least(1), long)]
    threads: Option<usize>,
    /// Where server logs and weight files go.
    #[arg(long, default_value = "runs/bench-rollouts")]
    work: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn bench_rollouts(a: BenchRolloutsArgs) -> Result<()> {
    let exp = actguide::experiment::Experiment::load(&a.experiment)?;
    let report =
        actguide::dev::bench_rollouts::run(&exp, a.rounds, &a.servers, a.threads, &a.work)?;
    print_report(&report, a.json)
}
