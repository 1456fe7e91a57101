//! `actguide serve-env`: a built-in env behind the subprocess or HTTP
//! protocol.

use std::io::Write;

use anyhow::Result;
use clap::Args;

use actguide::env::external::serve::{serve_stdio, Faults, HttpServer};

use actguide::env::BuiltinEnv;
use actguide::experiment::PanelRef;

use super::args::{Protocol, PANEL};

// Flags of `actguide serve-env`.
#[derive(Args)]
pub struct ServeEnvArgs {
    #[arg(long, default_value = "household")]
    env: BuiltinEnv,
    /// NDJSON on stdin/stdout (envs/PROTOCOL.md) or AgentGym's HTTP API.
    #[arg(long, value_enum, default_value_t = Protocol::Stdio)]
    protocol: Protocol,
    /// HTTP port (0: any free port; the URL is printed first).
    #[arg(long, default_value_t = 0)]
    port: u16,
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 50)]
    max_steps: usize,
    /// Fault injection: exit when asked for step N+1.
    #[arg(long)]
    die_after_steps: Option<usize>,
    /// Fault injection: reply with malformed JSON after step N.
    #[arg(long)]
    malformed_after_steps: Option<usize>,
    /// Faults only for tasks whose id number is divisible by this.
    #[arg(value_parser = super::ranges::at_least(1), long, default_value_t = 1)]
    fault_every: usize,
    /// http: answer `GET /expert?id=` for this panel's tasks (test and
    /// train: the env's own panels).
    #[arg(long, value_name = PANEL)]
    panel: Option<PanelRef>,
}

pub fn serve_env(a: ServeEnvArgs) -> Result<()> {
    let faults = Faults {
        die_after_steps: a.die_after_steps,
        malformed_after_steps: a.malformed_after_steps,
        every: a.fault_every,
    };
    match a.protocol {
        Protocol::Stdio => serve_stdio(a.env, a.max_steps, faults)?,
        Protocol::Http => {
            let mut server = HttpServer::bind(a.env, a.port, a.max_steps, faults)?;
            if let Some(p) = &a.panel {
                let p = p.of_env(a.env);
                server = server.with_panel(actguide::env::panel::read_jsonl(&p)?);
            }
            // The URL goes first, and now: clients read it to connect.
            println!("listening on {}", server.url());
            std::io::stdout().flush()?;
            server.run()?;
        }
    }
    Ok(())
}
