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
