//! Model commands: `actguide init-tiny`, `actguide bench-model` and
//! `actguide bench`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use actguide::bench::BenchConfig;
use actguide::bench_model::ModelBenchConfig;
use actguide::model::device::DeviceSpec;
use actguide::model::{LoraConfig, Precision};

use super::print_report;
use actguide::env::BuiltinEnv;

// Flags of `actguide init-tiny`.
#[derive(Args)]
pub struct InitTinyArgs {
    /// The built-in env whose vocabulary the tokenizer covers.
    #[arg(long, default_value = "household")]
    env: BuiltinEnv,
    /// Build the vocabulary from task panels instead (any env, external
    /// ones too: goals, expert actions and world texts, and what the env
    /// showed while `tasks from-server` built the panel, from the
    /// `.seen.json` file beside it); needs --out.
    #[arg(long = "panel", required = false)]
    panels: Vec<PathBuf>,
    /// Output folder (default: models/tiny, or models/tiny-<env>).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn init_tiny(a: InitTinyArgs) -> Result<()> {
    let env = a.env;
    let (out, (cfg, n)) = if a.panels.is_empty() {
        let out = a.out.unwrap_or_else(|| match env {
            BuiltinEnv::Household => PathBuf::from("models/tiny"),
            e => PathBuf::from(format!("models/tiny-{e}")),
        });
        let written = actguide::tiny::write_tiny_model_for(env, &out)?;
        (out, written)
    } else {
        let Some(out) = a.out else {
            anyhow::bail!("--panel needs --out DIR (the built-in cards stay as they are)");
        };
        let mut tasks = Vec::new();
        let mut seen = Vec::new();
        for p in &a.panels {
            tasks.extend(actguide::env::panel::read_jsonl(p)?);
            if let Some(s) = actguide::env::harvest::Seen::read_for(p)? {
                println!(
                    "{}: with the {} action(s) and {} word(s) the env showed ({})",
                    p.display(),
                    s.actions.len(),
                    s.words.len(),
                    actguide::env::harvest::Seen::path_for(p).display()
                );
                seen.push(s);
            }
        }
        let written = actguide::tiny::write_tiny_model_from_panels(&tasks, &seen, &out)?;
        (out, written)
    };
    println!(
        "wrote {}/config.json and tokenizer.json ({} tokens, {} layers, hidden {})",
        out.display(),
        n,
        cfg.num_hidden_layers,
        cfg.hidden_size
    );
    Ok(())
}

// Flags of `actguide bench-model`.
#[derive(Args)]
pub struct BenchModelArgs {
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
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Compute precision, f32 or bf16 (default: bf16 on CUDA, f32 on CPU).
    #[arg(long)]
    dtype: Option<Precision>,
    /// Generate from bf16 copies of the weights (CPU, with MKL); the
    /// |Δlogp| column is then the behaviour mismatch against f32 scoring.
    #[arg(long)]
    rollout_bf16: bool,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn bench_model(a: BenchModelArgs) -> Result<()> {
    let report = actguide::bench_model::run(&ModelBenchConfig {
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
        device: a.device,
        dtype: a.dtype,
        rollout_bf16: a.rollout_bf16,
        ..Default::default()
    })?;
    print_report(&report, a.json)
}

// Flags of `actguide bench`.
#[derive(Args)]
pub struct BenchArgs {
    #[arg(long, default_value = "models/tiny")]
    model: PathBuf,
    #[arg(long, default_value = "envs/household/train.jsonl")]
    panel: PathBuf,
    /// Tasks per step.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 8)]
    tasks: usize,
    /// Rollouts per task.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 8)]
    group: usize,
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
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Compute precision, f32 or bf16 (default: bf16 on CUDA, f32 on CPU).
    #[arg(long)]
    dtype: Option<Precision>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    let report = actguide::bench::run(&BenchConfig {
        model: a.model,
        panel: a.panel,
        tasks: a.tasks,
        group: a.group,
        steps: a.steps,
        max_steps: a.max_steps,
        seed: a.seed,
        scripts: a.scripts,
        device: a.device,
        dtype: a.dtype,
    })?;
    print_report(&report, a.json)
}

// Flags of `actguide check-device`.
#[derive(Args)]
pub struct CheckDeviceArgs {
    /// Device: cuda, cuda:N (or cpu, where parity is trivial).
    #[arg(default_value = "cuda")]
    device: DeviceSpec,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn check_device(a: CheckDeviceArgs) -> Result<()> {
    let report = actguide::device_check::run(a.device)?;
    print_report(&report, a.json)?;
    if !report.passed() {
        anyhow::bail!("{}: some checks failed (rows marked NO)", report.device);
    }
    Ok(())
}
