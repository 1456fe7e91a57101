//! `actguide report`: compare run directories.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

// Flags of `actguide report`.
#[derive(Args)]
pub struct ReportArgs {
    /// Run directories (each with metrics.jsonl).
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Output folder (default: runs/_report).
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(a: ReportArgs) -> Result<()> {
    let out = a.out.unwrap_or_else(|| PathBuf::from("runs/_report"));
    let r = actguide::report::write_report(&a.runs, &out)?;
    for w in &r.warnings {
        eprintln!("warning: {w}");
    }
    print!("{}", r.table);
    for f in &r.files {
        println!("wrote {}", f.display());
    }
    Ok(())
}
