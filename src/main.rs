//! The `actguide` command line: parses arguments, calls the library, prints.
//!
//! This file lists the subcommands (their one-line help is the doc comment
//! of each variant of [`Cmd`]); each subcommand group lives in `cli/` with
//! its flags (an `Args` struct) and a `run()`, and `cli/print.rs` prints
//! what a training run reports while it runs. Developer tools are grouped
//! under `actguide dev`. One flag name means one thing in every command
//! (`--panel test|train|PATH`, `--device cpu|cuda|cuda:N`, `--tasks` a list
//! of task ids, counts named for what they count); the tests below hold
//! every command to that.

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
    Sft(cli::run::SftArgs),
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
    InitTiny(cli::tiny::InitTinyArgs),
    /// Developer tools: benchmarks, the device check, the reference
    /// engine server.
    Dev(cli::dev::DevArgs),
    /// A rank of a data-parallel run (`run --devices`); started by rank 0.
    #[command(hide = true)]
    DpWorker(cli::run::WorkerArgs),
}

/// A reader that closes stdout early (`actguide tasks select ... | head`)
/// makes `println!` panic with EPIPE. Exit quietly instead, as a Unix
/// tool does (status 141, SIGPIPE's). SIGPIPE itself stays ignored, so a
/// broken pipe to an env or worker process is an error the run handles,
/// not a signal that kills it.
fn quiet_broken_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

fn main() {
    quiet_broken_stdout();
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
        Cmd::Sft(a) => cli::run::sft(a),
        Cmd::Check(a) => cli::script::check(a),
        Cmd::Simulate(a) => cli::script::simulate(a),
        Cmd::Tasks(a) => cli::tasks::run(a),
        Cmd::Eval(a) => cli::checkpoint::eval(a),
        Cmd::Probe(a) => cli::checkpoint::probe(a),
        Cmd::Report(a) => cli::report::run(a),
        Cmd::Export(a) => cli::checkpoint::export(a),
        Cmd::ServeEnv(a) => cli::env::serve_env(a),
        Cmd::InitTiny(a) => cli::tiny::init_tiny(a),
        Cmd::Dev(a) => cli::dev::run(a),
        Cmd::DpWorker(a) => cli::run::dp_worker(a),
    }
}

#[cfg(test)]
mod tests {
    use super::{cli, Cli};
    use clap::{CommandFactory, Parser};
    use std::any::TypeId;

    /// Every numeric flag of every command, with a value outside its
    /// range (`None`: every value of its type means something).
    const NUMERIC_FLAGS: &[(&str, &str, Option<&str>)] = &[
        ("run", "stop-after", Some("0")),
        ("run", "memory-gb", Some("0")),
        ("run", "jobs", Some("0")),
        ("sft", "stop-after", Some("0")),
        ("simulate", "steps", Some("0")),
        ("simulate", "tasks-per-step", Some("0")),
        ("simulate", "group-size", Some("0")),
        ("simulate", "clusters", Some("0")),
        ("simulate", "max-rounds", None),
        ("simulate", "seed", None),
        ("simulate", "horizon", Some("inf")),
        ("simulate", "sharpness", Some("0")),
        ("simulate", "plan-gain", Some("1.5")),
        ("simulate", "learn-rate", Some("-1")),
        ("simulate", "drift", Some("NaN")),
        ("tasks select", "min-expert", None),
        ("tasks select", "max-expert", None),
        ("tasks select", "first", Some("0")),
        ("tasks select", "expert-share", Some("1.5")),
        ("tasks select", "expert-noise", Some("-0.1")),
        ("tasks select", "noise-max-len", Some("0")),
        ("tasks select", "seed", None),
        ("tasks generate", "seed", None),
        ("tasks generate", "train", Some("0")),
        ("tasks generate", "test", Some("0")),
        ("tasks stats", "rollouts", Some("0")),
        ("tasks stats", "max-steps", Some("0")),
        ("tasks stats", "seed", None),
        ("tasks stats", "step-slack", None),
        ("tasks from-server", "timeout-s", Some("0")),
        ("tasks from-server", "retries", Some("1000")),
        ("eval", "samples", Some("0")),
        ("eval", "max-tasks", None),
        ("eval", "seed", None),
        ("probe", "per-cluster", Some("0")),
        ("probe", "k", Some("0")),
        ("probe", "seed", None),
        ("export", "max-shard-mb", Some("0")),
        ("serve-env", "port", None),
        ("serve-env", "max-steps", Some("0")),
        ("serve-env", "die-after-steps", None),
        ("serve-env", "malformed-after-steps", None),
        ("serve-env", "fault-every", Some("0")),
        ("dev bench-grpo", "prompts", Some("0")),
        ("dev bench-grpo", "prompt-len", Some("0")),
        ("dev bench-grpo", "group-size", Some("1")),
        ("dev bench-grpo", "new-tokens", Some("0")),
        ("dev bench-grpo", "steps", Some("0")),
        ("dev bench-grpo", "micro-batch", Some("0")),
        ("dev bench-grpo", "lora-rank", None),
        ("dev bench-grpo", "lr", Some("0")),
        ("dev bench-grpo", "seed", None),
        ("dev bench-model", "batches", Some("0")),
        ("dev bench-model", "prompt-len", Some("0")),
        ("dev bench-model", "new-tokens", Some("0")),
        ("dev bench-model", "train-len", Some("1")),
        ("dev bench-model", "repeats", Some("0")),
        ("dev bench-model", "seed", None),
        ("dev bench-model", "lora-rank", Some("0")),
        ("dev bench", "tasks-per-step", Some("0")),
        ("dev bench", "group-size", Some("0")),
        ("dev bench", "steps", Some("0")),
        ("dev bench", "max-steps", Some("0")),
        ("dev bench", "seed", None),
        ("dev bench-rollouts", "rounds", Some("0")),
        ("dev bench-rollouts", "servers", Some("0")),
        ("dev bench-rollouts", "threads", Some("0")),
        ("dp-worker", "rank", None),
        ("dp-worker", "world", Some("1")),
        ("dp-worker", "node", None),
        ("dp-worker", "join-timeout", Some("0")),
        ("run", "nodes", Some("0")),
        ("run", "node-rank", None),
        ("run", "join-timeout", Some("0")),
    ];

    fn numeric(arg: &clap::Arg) -> bool {
        let t = arg.get_value_parser().type_id();
        [
            TypeId::of::<usize>(),
            TypeId::of::<u64>(),
            TypeId::of::<u32>(),
            TypeId::of::<u16>(),
            TypeId::of::<i64>(),
            TypeId::of::<f64>(),
        ]
        .iter()
        .any(|id| t == *id)
    }

    /// (command path, flag) of every numeric flag.
    fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<(String, String)>) {
        for arg in cmd.get_arguments() {
            if let Some(long) = arg.get_long() {
                if numeric(arg) {
                    out.push((path.to_string(), long.to_string()));
                }
            }
        }
        for sub in cmd.get_subcommands() {
            let p = if path.is_empty() {
                sub.get_name().to_string()
            } else {
                format!("{path} {}", sub.get_name())
            };
            walk(sub, &p, out);
        }
    }

    #[test]
    fn every_numeric_flag_has_a_range_that_clap_enforces() {
        let cmd = Cli::command();
        let mut found = Vec::new();
        walk(&cmd, "", &mut found);
        let listed: Vec<(String, String)> = NUMERIC_FLAGS
            .iter()
            .map(|(c, f, _)| (c.to_string(), f.to_string()))
            .collect();
        let missing: Vec<_> = found.iter().filter(|f| !listed.contains(f)).collect();
        assert!(
            missing.is_empty(),
            "numeric flags without a row: {missing:?}"
        );
        let stale: Vec<_> = listed.iter().filter(|f| !found.contains(f)).collect();
        assert!(stale.is_empty(), "rows of no flag: {stale:?}");
        for (path, flag, bad) in NUMERIC_FLAGS {
            let Some(bad) = bad else { continue };
            // Values are checked as they are parsed, before any missing
            // required argument is noticed.
            let mut argv = vec!["actguide".to_string()];
            argv.extend(path.split(' ').map(str::to_string));
            argv.push(format!("--{flag}={bad}"));
            let e = match Cli::try_parse_from(&argv) {
                Ok(_) => panic!("{argv:?} was accepted"),
                Err(e) => e,
            };
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{argv:?}: {e}"
            );
        }
    }

    /// Every flag of every command, with its command path.
    fn all_flags(cmd: &clap::Command, path: &str, out: &mut Vec<(String, clap::Arg)>) {
        for arg in cmd.get_arguments() {
            out.push((path.to_string(), arg.clone()));
        }
        for sub in cmd.get_subcommands() {
            let p = format!("{path} {}", sub.get_name());
            all_flags(sub, p.trim(), out);
        }
    }

    /// One meaning per flag name: every `--panel` is `test|train|PATH`,
    /// every `--device` the same optional device (the default rule lives in
    /// `DeviceArg`), every `--tasks` a list of task ids, counts are named
    /// for what they count, closed sets offer their values.
    #[test]
    fn a_flag_name_means_the_same_in_every_command() {
        use actguide::experiment::PanelRef;
        use actguide::model::device::DeviceSpec;
        let mut flags = Vec::new();
        all_flags(&Cli::command(), "", &mut flags);
        let mut seen = std::collections::BTreeMap::<&str, usize>::new();
        for (path, arg) in &flags {
            let Some(long) = arg.get_long() else {
                // A positional `panel` is a command's input file (`tasks
                // stats PANEL`); a device or task list is always a flag.
                assert!(
                    !["device", "tasks"].contains(&arg.get_id().as_str()),
                    "{path}: `{}` must be a flag, not a positional",
                    arg.get_id()
                );
                continue;
            };
            let t = arg.get_value_parser().type_id();
            let names: Vec<_> = arg.get_value_names().unwrap_or_default().to_vec();
            match long {
                "panel" => {
                    assert!(t == TypeId::of::<PanelRef>(), "{path} --panel");
                    assert_eq!(names, [cli::args::PANEL], "{path} --panel");
                }
                "device" => {
                    assert!(t == TypeId::of::<DeviceSpec>(), "{path} --device");
                    assert!(!arg.is_required_set(), "{path} --device");
                    assert!(arg.get_default_values().is_empty(), "{path} --device");
                    assert_eq!(names, ["cpu|cuda|cuda:N"], "{path} --device");
                }
                "devices" => assert!(t == TypeId::of::<DeviceSpec>(), "{path} --devices"),
                "tasks" => {
                    assert!(t == TypeId::of::<String>(), "{path} --tasks");
                    assert_eq!(arg.get_value_delimiter(), Some(','), "{path} --tasks");
                }
                "tasks-per-step" | "group-size" | "max-tasks" => {
                    assert!(t == TypeId::of::<usize>(), "{path} --{long}")
                }
                "protocol" | "id-field" => {
                    assert!(!arg.get_possible_values().is_empty(), "{path} --{long}")
                }
                "group" | "num-tasks" => panic!("{path}: --{long} is not a flag name"),
                _ => {}
            }
            *seen.entry(long).or_default() += 1;
        }
        // The rule is exercised: each shared name occurs more than once.
        for name in [
            "panel",
            "device",
            "tasks-per-step",
            "group-size",
            "id-field",
        ] {
            assert!(
                seen.get(name).copied().unwrap_or(0) >= 2,
                "--{name}: {seen:?}"
            );
        }
    }

    #[test]
    fn developer_tools_are_under_dev() {
        let cmd = Cli::command();
        let top: Vec<&str> = cmd.get_subcommands().map(|c| c.get_name()).collect();
        for tool in [
            "bench",
            "bench-model",
            "bench-grpo",
            "bench-rollouts",
            "check-device",
            "engine-reference",
        ] {
            assert!(!top.contains(&tool), "{tool} at the top level");
            let argv = ["actguide", "dev", tool, "--help"];
            let e = Cli::try_parse_from(argv).err().expect("help");
            assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{argv:?}");
        }
    }

    /// `--help` of each command a researcher uses (all but `dev` and the
    /// hidden ones, subcommands included) fits one screen.
    #[test]
    fn user_command_help_fits_a_screen() {
        fn visit(cmd: &clap::Command, path: &mut Vec<String>, long: &mut Vec<String>) {
            for sub in cmd.get_subcommands() {
                if sub.is_hide_set() || (path.is_empty() && sub.get_name() == "dev") {
                    continue;
                }
                path.push(sub.get_name().to_string());
                let mut argv = vec!["actguide".to_string()];
                argv.extend(path.iter().cloned());
                argv.push("--help".into());
                let help = match Cli::try_parse_from(&argv) {
                    Ok(_) => panic!("{argv:?} parsed"),
                    Err(e) => e.render().to_string(),
                };
                let lines = help.lines().count();
                if lines > 45 {
                    long.push(format!("{}: {lines} lines", argv[1..].join(" ")));
                }
                visit(sub, path, long);
                path.pop();
            }
        }
        let mut long = Vec::new();
        visit(&Cli::command(), &mut Vec::new(), &mut long);
        assert!(long.is_empty(), "{long:?}");
    }
}
