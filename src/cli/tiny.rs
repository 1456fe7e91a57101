//! `actguide init-tiny`: write a tiny model card (config and word-level
//! tokenizer) for a built-in env or for task panels.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use actguide::env::BuiltinEnv;
use actguide::experiment::PanelRef;

use super::args::PANEL;

// Flags of `actguide init-tiny`.
#[derive(Args)]
pub struct InitTinyArgs {
    /// The built-in env whose vocabulary the tokenizer covers.
    #[arg(long, default_value = "household")]
    env: BuiltinEnv,
    /// Build the vocabulary from task panels instead (repeatable; any env,
    /// external ones too; with `.seen.json` files beside them); needs --out.
    #[arg(long = "panel", value_name = PANEL)]
    panels: Vec<PanelRef>,
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
        for file in a.panels.iter().map(|p| p.of_env(env)) {
            let p = file.as_path();
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
