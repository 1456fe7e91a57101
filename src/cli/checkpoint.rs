//! Commands on a trained checkpoint: `actguide eval`, `actguide probe` and
//! `actguide export`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use actguide::experiment::eval::{eval_checkpoint, eval_table, EvalOptions};
use actguide::experiment::export::ExportOptions;
use actguide::experiment::probe::{probe_table, ProbeOptions};
use actguide::experiment::PanelRef;

use super::args::{DeviceArg, PANEL};
use super::print_json;

// Flags of `actguide eval`.
#[derive(Args)]
pub struct EvalArgs {
    /// A run directory or runs/<name>/checkpoints/step-NNNNNN.
    path: PathBuf,
    /// The run's test or train panel, or a panel file.
    #[arg(long, value_name = PANEL, default_value = "test")]
    panel: PanelRef,
    /// Sampled rollouts per task (pass@k up to this k).
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 8)]
    samples: usize,
    /// Evaluate the first N tasks only (0 = all).
    #[arg(long, default_value_t = 0)]
    max_tasks: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    device: DeviceArg,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn eval(a: EvalArgs) -> Result<()> {
    let v = eval_checkpoint(
        &a.path,
        &EvalOptions {
            panel: a.panel,
            samples: a.samples,
            max_tasks: a.max_tasks,
            seed: a.seed,
            device: a.device.device,
        },
    )?;
    if a.json {
        print_json(&v)?;
    } else {
        print!("{}", eval_table(&v));
    }
    // A broken env must not read as a bad policy: the numbers leave the
    // lost episodes out, and the exit code says the panel was not fully
    // evaluated.
    let lost = v["env_errors"].as_u64().unwrap_or(0);
    if lost > 0 {
        anyhow::bail!(
            "{lost} evaluation episode(s) were lost to env failures and left out of the rates \
             above (e.g. {}); the panel was not fully evaluated",
            v["env_error_examples"][0]
        );
    }
    Ok(())
}

// Flags of `actguide probe`.
#[derive(Args)]
pub struct ProbeArgs {
    /// A run directory or runs/<name>/checkpoints/step-NNNNNN.
    path: PathBuf,
    /// The run's test or train panel, or a panel file.
    #[arg(long, value_name = PANEL, default_value = "test")]
    panel: PanelRef,
    /// Comma-separated task ids (default: the first --per-cluster
    /// tasks of each difficulty cluster).
    #[arg(long, value_delimiter = ',')]
    tasks: Vec<String>,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 2)]
    per_cluster: usize,
    /// Unguided continuations per state (K of Pass@K).
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 32)]
    k: usize,
    /// Probe the run's initial policy instead of its checkpoint.
    #[arg(long)]
    initial: bool,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    device: DeviceArg,
    /// Also write the plot (SVG) here.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn probe(a: ProbeArgs) -> Result<()> {
    let r = actguide::experiment::probe::probe(
        &a.path,
        &ProbeOptions {
            panel: a.panel,
            tasks: a.tasks,
            per_cluster: a.per_cluster,
            k: a.k,
            initial: a.initial,
            seed: a.seed,
            device: a.device.device,
        },
    )?;
    if a.json {
        print_json(&r)?;
    } else {
        print!("{}", probe_table(&r));
    }
    if let Some(p) = a.plot {
        let svg = actguide::report::probe_plot::probe_svg(&r)
            .map_err(|e| anyhow::anyhow!("probe plot: {e}"))?;
        std::fs::write(&p, svg).with_context(|| p.display().to_string())?;
        println!("plot written to {}", p.display());
    }
    Ok(())
}

// Flags of `actguide export`.
#[derive(Args)]
pub struct ExportArgs {
    /// A run directory or runs/<name>/checkpoints/step-NNNNNN.
    path: PathBuf,
    /// Output folder.
    #[arg(long)]
    out: PathBuf,
    /// LoRA runs: write adapter_config.json + adapter_model.safetensors
    /// instead of merged weights.
    #[arg(long)]
    adapter_only: bool,
    /// Shard weights into files of at most this many MB.
    #[arg(value_parser = super::ranges::at_least(1), long)]
    max_shard_mb: Option<usize>,
    #[command(flatten)]
    device: DeviceArg,
}

pub fn export(a: ExportArgs) -> Result<()> {
    let s = actguide::experiment::export::export(
        &a.path,
        &a.out,
        &ExportOptions {
            adapter_only: a.adapter_only,
            max_shard_bytes: a.max_shard_mb.map(|mb| mb << 20),
            device: a.device.device,
        },
    )?;
    println!(
        "exported {} (step {}) as {}{} to {}: {}",
        s.checkpoint.display(),
        s.step,
        s.kind,
        if s.merged_lora { ", LoRA merged" } else { "" },
        s.out.display(),
        s.files.join(", ")
    );
    Ok(())
}
