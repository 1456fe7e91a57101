//! The subcommands of the `actguide` binary, one file per group: each
//! subcommand has its flags (a clap `Args` struct; the subcommand's own
//! help line is its variant's doc comment in `main.rs`) and a function that
//! calls the library and prints the result; `args.rs` has the flags
//! several subcommands share, `dev.rs` the developer tools under
//! `actguide dev`. Nothing here computes: the work is in the `actguide`
//! library.

pub mod args;
pub mod checkpoint;
pub mod dev;
pub mod env;
pub mod print;
pub mod ranges;
pub mod report;
pub mod run;
pub mod script;
pub mod tasks;
pub mod tiny;

use anyhow::Result;

/// Print a report as pretty JSON (`--json`) or as its table.
fn print_report<T: serde::Serialize + std::fmt::Display>(report: &T, json: bool) -> Result<()> {
    if json {
        print_json(report)
    } else {
        println!("{report}");
        Ok(())
    }
}

/// Print `value` as pretty JSON (the `--json` flag of several commands).
fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
