//! `actguide engine-reference`: the reference engine server.

use anyhow::{anyhow, Result};
use clap::Args;

use actguide::engine::reference::{ReferenceServer, ServerArgs};

#[derive(Args)]
pub struct EngineReferenceArgs {
    /// llama-server's flags: `-m MODEL.gguf --host H --port P -t N`
    /// (`-np`, `-c` accepted and ignored).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

pub fn engine_reference(a: EngineReferenceArgs) -> Result<()> {
    let args = ServerArgs::parse(&a.args).map_err(|e| anyhow!("engine-reference: {e}"))?;
    let server = ReferenceServer::open(&args).map_err(|e| anyhow!("engine-reference: {e}"))?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()?;
    pool.install(|| server.run());
    Ok(())
}

#[derive(Args)]
pub struct BenchRolloutsArgs {
    /// An experiment file; its model, panel, rollout settings and
    /// `rollout.engine` are measured.
    experiment: std::path::PathBuf,
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
    work: std::path::PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn bench_rollouts(a: BenchRolloutsArgs) -> Result<()> {
    let exp = actguide::experiment::Experiment::load(&a.experiment)?;
    let report = actguide::bench_rollouts::run(&exp, a.rounds, &a.servers, a.threads, &a.work)?;
    super::print_report(&report, a.json)
}
