//! The `actguide` command line: parses arguments, calls the library, prints.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use actguide::experiment::{self, Comparison, Event, ExperimentFile, RunOptions, RunSummary};

// candle allocates and frees large tensors on every op; glibc's malloc
// returns them to the OS each time (mmap/munmap + page faults), which
// doubled step time in measurements. mimalloc keeps them.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    Run {
        /// Experiment file (*.rhai); omit with --resume.
        experiment: Option<PathBuf>,
        /// Resume the run in this directory from its latest checkpoint.
        #[arg(long)]
        resume: Option<PathBuf>,
        /// Stop after this many steps (the run can be resumed later).
        #[arg(long)]
        stop_after: Option<usize>,
        /// Plain log lines even on a terminal.
        #[arg(long)]
        plain: bool,
    },
    /// Compile a script (guidance, reward or intervention) and call its
    /// entry points on synthetic inputs; exits non-zero on any error.
    Check { script: PathBuf },
    /// Play a guidance script against a synthetic learner (no model) and
    /// print its per-step schedule and cost.
    Simulate {
        script: PathBuf,
        #[arg(long, default_value = "envs/household/train.jsonl")]
        panel: PathBuf,
        #[arg(long, default_value_t = 30)]
        steps: usize,
        #[arg(long, default_value_t = 8)]
        tasks: usize,
        #[arg(long, default_value_t = 8)]
        group: usize,
        #[arg(long, default_value_t = 3)]
        clusters: usize,
        /// Bound on review rounds per task and step.
        #[arg(long, default_value_t = 8)]
        max_rounds: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Learner: initial horizon (actions it chains on its own).
        #[arg(long, default_value_t = 1.5)]
        horizon: f64,
        /// Learner: slope of success in (horizon - actions to play).
        #[arg(long, default_value_t = 1.5)]
        sharpness: f64,
        /// Learner: fraction of an action a shown plan action takes off.
        #[arg(long, default_value_t = 0.8)]
        plan_gain: f64,
        /// Learner: horizon gained per step at full GRPO signal.
        #[arg(long, default_value_t = 0.3)]
        learn_rate: f64,
        /// Learner: horizon gained per step regardless of signal.
        #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
        drift: f64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Task panels.
    Tasks {
        #[command(subcommand)]
        cmd: TasksCmd,
    },
    /// Evaluate a run's latest checkpoint (or a checkpoint directory) on a
    /// panel: greedy and sampled success, unbiased pass@k, by task type,
    /// cluster and in-/out-region (against the run's initial policy).
    Eval {
        /// A run directory or runs/<name>/checkpoints/step-NNNNNN.
        path: PathBuf,
        /// "test", "train" or a panel file.
        #[arg(long, default_value = "test")]
        panel: String,
        /// Sampled rollouts per task (pass@k up to this k).
        #[arg(long, default_value_t = 8)]
        samples: usize,
        /// Evaluate the first N tasks only (0 = all).
        #[arg(long, default_value_t = 0)]
        max_tasks: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Reachability diagnostics (ActGuide-RL Fig. 3): along guided
    /// rollouts of chosen tasks, per state the guidance influence
    /// ‖ΔLogit‖ and the Pass@K of unguided continuations.
    Probe {
        /// A run directory or runs/<name>/checkpoints/step-NNNNNN.
        path: PathBuf,
        /// "test", "train" or a panel file.
        #[arg(long, default_value = "test")]
        panel: String,
        /// Comma-separated task ids (default: the first --per-cluster
        /// tasks of each difficulty cluster).
        #[arg(long, value_delimiter = ',')]
        tasks: Vec<String>,
        #[arg(long, default_value_t = 2)]
        per_cluster: usize,
        /// Unguided continuations per state (K of Pass@K).
        #[arg(long, default_value_t = 32)]
        k: usize,
        /// Probe the run's initial policy instead of its checkpoint.
        #[arg(long)]
        initial: bool,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Also write the plot (SVG) here.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Compare run directories: SVG figures, report.md and a
    /// self-contained report.html.
    Report {
        /// Run directories (each with metrics.jsonl).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Output folder (default: runs/_report).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Export a checkpoint for other tools: a full HF folder (LoRA
    /// adapters merged) that `transformers` loads, or the adapters alone
    /// (PEFT layout).
    Export {
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
        #[arg(long)]
        max_shard_mb: Option<usize>,
    },
    /// Serve a built-in env over the subprocess protocol (stdin/stdout,
    /// envs/PROTOCOL.md) or AgentGym's HTTP API, for external use and the
    /// protocol tests.
    ServeEnv {
        #[arg(long, default_value = "household")]
        env: actguide::env::BuiltinEnv,
        /// "stdio" or "http".
        #[arg(long, default_value = "stdio")]
        protocol: String,
        /// HTTP port (0: any free port; the URL is printed first).
        #[arg(long, default_value_t = 0)]
        port: u16,
        #[arg(long, default_value_t = 50)]
        max_steps: usize,
        /// Fault injection: exit when asked for step N+1.
        #[arg(long)]
        die_after_steps: Option<usize>,
        /// Fault injection: reply with malformed JSON after step N.
        #[arg(long)]
        malformed_after_steps: Option<usize>,
        /// Faults only for tasks whose id number is divisible by this.
        #[arg(long, default_value_t = 1)]
        fault_every: usize,
    },
    /// Write the built-in tiny model card (config.json + tokenizer.json).
    InitTiny {
        /// The env whose vocabulary the tokenizer covers.
        #[arg(long, default_value = "household")]
        env: actguide::env::BuiltinEnv,
        /// Output folder (default: models/tiny, or models/tiny-<env>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Measure decode and train tokens/s of a model (GGUF file or HF
    /// folder) on random token sequences, per batch size.
    BenchModel {
        /// A .gguf file or a HF model folder.
        model: PathBuf,
        /// Comma-separated batch sizes.
        #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
        batches: Vec<usize>,
        /// Prompt tokens before decoding.
        #[arg(long, default_value_t = 64)]
        prompt_len: usize,
        /// New tokens per sequence (every sequence decodes exactly this many).
        #[arg(long, default_value_t = 32)]
        new_tokens: usize,
        /// Tokens per sequence of the train step.
        #[arg(long, default_value_t = 128)]
        train_len: usize,
        /// Timed runs per measurement, after one warm-up.
        #[arg(long, default_value_t = 2)]
        repeats: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Train LoRA adapters of this rank (alpha = 2 rank, every
        /// projection) instead of every weight.
        #[arg(long)]
        lora_rank: Option<usize>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Measure rollout and train tokens/s of a model on the household env.
    Bench {
        #[arg(long, default_value = "models/tiny")]
        model: PathBuf,
        #[arg(long, default_value = "envs/household/train.jsonl")]
        panel: PathBuf,
        /// Tasks per step.
        #[arg(long, default_value_t = 8)]
        tasks: usize,
        /// Rollouts per task.
        #[arg(long, default_value_t = 8)]
        group: usize,
        #[arg(long, default_value_t = 3)]
        steps: usize,
        /// Episode step limit.
        #[arg(long, default_value_t = 20)]
        max_steps: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Guidance scripts whose entry-point cost per step is measured.
        #[arg(long, num_args = 0.., default_values = ["scripts/guidance/gaussian.rhai", "scripts/guidance/actguide.rhai", "scripts/guidance/binary_search.rhai"])]
        scripts: Vec<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum TasksCmd {
    /// Generate train/test panels.
    Generate {
        #[arg(long, default_value = "household")]
        env: actguide::env::BuiltinEnv,
        #[arg(long, default_value_t = 2026)]
        seed: u64,
        #[arg(long, default_value_t = 256)]
        train: usize,
        #[arg(long, default_value_t = 64)]
        test: usize,
        /// Output folder (default: envs/<env>).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Success of a uniformly random valid-action policy by difficulty.
    Stats {
        panel: PathBuf,
        #[arg(long, default_value = "household")]
        env: actguide::env::BuiltinEnv,
        #[arg(long, default_value_t = 16)]
        rollouts: usize,
        #[arg(long, default_value_t = 20)]
        max_steps: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = dispatch(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Run {
            experiment,
            resume,
            stop_after,
            plain,
        } => run(experiment, resume, stop_after, plain),
        Cmd::Tasks { cmd } => tasks(cmd),
        Cmd::Check { script } => {
            for line in actguide::guidance::host::check_script(&script)? {
                println!("{line}");
            }
            println!("ok");
            Ok(())
        }
        Cmd::Simulate {
            script,
            panel,
            steps,
            tasks,
            group,
            clusters,
            max_rounds,
            seed,
            horizon,
            sharpness,
            plan_gain,
            learn_rate,
            drift,
            json,
        } => {
            use actguide::guidance::simulate::{simulate_file, table, SimParams};
            let p = SimParams {
                steps,
                tasks_per_step: tasks,
                group_size: group,
                clusters,
                max_rounds,
                seed,
                horizon,
                sharpness,
                plan_gain,
                learn_rate,
                drift,
            };
            let report = simulate_file(&script, &panel, &p)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", table(&report));
            }
            Ok(())
        }
        Cmd::Eval {
            path,
            panel,
            samples,
            max_tasks,
            seed,
            json,
        } => {
            use actguide::experiment::eval::{eval_checkpoint, eval_table, EvalOptions};
            let v = eval_checkpoint(
                &path,
                &EvalOptions {
                    panel,
                    samples,
                    max_tasks,
                    seed,
                },
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print!("{}", eval_table(&v));
            }
            Ok(())
        }
        Cmd::Probe {
            path,
            panel,
            tasks,
            per_cluster,
            k,
            initial,
            seed,
            plot,
            json,
        } => {
            use actguide::experiment::probe::{probe, probe_table, ProbeOptions};
            let r = probe(
                &path,
                &ProbeOptions {
                    panel,
                    tasks,
                    per_cluster,
                    k,
                    initial,
                    seed,
                },
            )?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", probe_table(&r));
            }
            if let Some(p) = plot {
                let svg = actguide::report::probe_plot::probe_svg(&r)
                    .map_err(|e| anyhow::anyhow!("probe plot: {e}"))?;
                std::fs::write(&p, svg).with_context(|| p.display().to_string())?;
                println!("plot written to {}", p.display());
            }
            Ok(())
        }
        Cmd::Report { runs, out } => {
            let out = out.unwrap_or_else(|| PathBuf::from("runs/_report"));
            let r = actguide::report::write_report(&runs, &out)?;
            for w in &r.warnings {
                eprintln!("warning: {w}");
            }
            print!("{}", r.table);
            for f in &r.files {
                println!("wrote {}", f.display());
            }
            Ok(())
        }
        Cmd::Export {
            path,
            out,
            adapter_only,
            max_shard_mb,
        } => {
            let s = actguide::experiment::export::export(
                &path,
                &out,
                &actguide::experiment::export::ExportOptions {
                    adapter_only,
                    max_shard_bytes: max_shard_mb.map(|mb| mb << 20),
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
        Cmd::ServeEnv {
            env,
            protocol,
            port,
            max_steps,
            die_after_steps,
            malformed_after_steps,
            fault_every,
        } => {
            use actguide::env::external::serve::{serve_stdio, Faults, HttpServer};
            let faults = Faults {
                die_after_steps,
                malformed_after_steps,
                every: fault_every,
            };
            match protocol.as_str() {
                "stdio" => serve_stdio(env, max_steps, faults)?,
                "http" => {
                    let server = HttpServer::bind(env, port, max_steps, faults)?;
                    println!("listening on {}", server.url());
                    use std::io::Write;
                    std::io::stdout().flush()?;
                    server.run()?;
                }
                other => bail!("unknown protocol `{other}` (stdio, http)"),
            }
            Ok(())
        }
        Cmd::InitTiny { env, out } => {
            let out = out.unwrap_or_else(|| match env {
                actguide::env::BuiltinEnv::Household => PathBuf::from("models/tiny"),
                e => PathBuf::from(format!("models/tiny-{e}")),
            });
            let (cfg, n) = actguide::tiny::write_tiny_model_for(env, &out)?;
            println!(
                "wrote {}/config.json and tokenizer.json ({} tokens, {} layers, hidden {})",
                out.display(),
                n,
                cfg.num_hidden_layers,
                cfg.hidden_size
            );
            Ok(())
        }
        Cmd::BenchModel {
            model,
            batches,
            prompt_len,
            new_tokens,
            train_len,
            repeats,
            seed,
            lora_rank,
            json,
        } => {
            use actguide::bench_model::{run, ModelBenchConfig};
            let report = run(&ModelBenchConfig {
                model,
                batches,
                prompt_len,
                new_tokens,
                train_len,
                repeats,
                seed,
                lora: lora_rank.map(|rank| actguide::model::LoraConfig {
                    rank,
                    alpha: 2.0 * rank as f64,
                    ..Default::default()
                }),
                ..Default::default()
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{report}");
            }
            Ok(())
        }
        Cmd::Bench {
            model,
            panel,
            tasks,
            group,
            steps,
            max_steps,
            seed,
            scripts,
            json,
        } => {
            let report = actguide::bench::run(&actguide::bench::BenchConfig {
                model,
                panel,
                tasks,
                group,
                steps,
                max_steps,
                seed,
                scripts,
            })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{report}");
            }
            Ok(())
        }
    }
}

fn tasks(cmd: TasksCmd) -> Result<()> {
    use actguide::env::panel;
    match cmd {
        TasksCmd::Generate {
            env,
            seed,
            train,
            test,
            out,
        } => {
            let (tr, te) = actguide::env::generate_panels(env, seed, train, test)?;
            let out = out.unwrap_or_else(|| PathBuf::from("envs").join(env.name()));
            std::fs::create_dir_all(&out).with_context(|| out.display().to_string())?;
            panel::write_panels(&out, &tr, &te)?;
            println!(
                "wrote {} train and {} test tasks to {}",
                tr.len(),
                te.len(),
                out.display()
            );
            Ok(())
        }
        TasksCmd::Stats {
            panel: path,
            env,
            rollouts,
            max_steps,
            seed,
        } => {
            let tasks = panel::read_jsonl(&path)?;
            let table =
                actguide::env::random_policy_success(env, &tasks, rollouts, max_steps, seed);
            println!(
                "random valid-action policy, {rollouts} rollouts/task, limit {max_steps} steps"
            );
            println!("{:>10} {:>6} {:>8}", "difficulty", "tasks", "success");
            for (d, n, s) in table {
                println!("{d:>10} {n:>6} {s:>8.3}");
            }
            Ok(())
        }
    }
}

fn run(
    experiment: Option<PathBuf>,
    resume: Option<PathBuf>,
    stop_after: Option<usize>,
    plain: bool,
) -> Result<()> {
    let exp = match (&experiment, &resume) {
        (Some(p), None) => match ExperimentFile::load(p)? {
            ExperimentFile::Single(e) => *e,
            ExperimentFile::Compare(c) => return compare(&c, stop_after, plain),
        },
        (None, Some(d)) => {
            let p = d.join("experiment.json");
            let text = std::fs::read_to_string(&p).with_context(|| {
                format!("{}: cannot read the run's resolved config", p.display())
            })?;
            serde_json::from_str(&text).with_context(|| p.display().to_string())?
        }
        (Some(_), Some(_)) => bail!("give either an experiment file or --resume RUN_DIR, not both"),
        (None, None) => {
            bail!("give an experiment file (e.g. examples/quickstart.rhai) or --resume RUN_DIR")
        }
    };
    let (bar, mut on_event) = event_printer(exp.steps, plain);
    let summary = experiment::run(exp, &RunOptions { resume, stop_after }, &mut on_event)?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    print_summary(&summary);
    Ok(())
}

/// Run a comparison, then print one line per run and where the report is.
fn compare(c: &Comparison, stop_after: Option<usize>, plain: bool) -> Result<()> {
    let steps = c.runs.first().map_or(0, |e| e.steps);
    let (bar, mut on_event) = event_printer(steps, plain);
    let out = experiment::run_comparison(c, stop_after, &mut on_event)?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    println!(
        "── comparison {} ──────────────────────────────",
        out.dir.display()
    );
    println!(
        "{:<22} {:>7} {:>9} {:>9} {:>9} {:>10}",
        "run", "steps", "test@0", "test@end", "s/step", "wall s"
    );
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.3}"));
    for s in &out.runs {
        let name = s
            .run_dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        println!(
            "{name:<22} {:>7} {:>9} {:>9} {:>9.2} {:>10.1}",
            s.steps_done,
            f(s.start_test_success),
            f(s.end_test_success),
            s.seconds_per_step,
            s.seconds
        );
    }
    if let Some(r) = &out.report {
        println!("report             {}", r.join("report.html").display());
    }
    Ok(())
}

fn print_summary(summary: &RunSummary) {
    println!("── summary ─────────────────────────────────────────────");
    println!("run dir            {}", summary.run_dir.display());
    println!("steps              {}", summary.steps_done);
    let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.3}"));
    println!(
        "test success       start {}  →  end {}",
        f(summary.start_test_success),
        f(summary.end_test_success)
    );
    println!(
        "wall time          {:.1} s ({:.2} s/step)",
        summary.seconds, summary.seconds_per_step
    );
    println!(
        "throughput         {:.0} rollout tok/s, {:.0} train tok/s",
        summary.rollout_tokens_per_s, summary.train_tokens_per_s
    );
}

/// The progress bar (on a terminal) and the handler that prints run
/// events.
fn event_printer(steps: usize, plain: bool) -> (Option<ProgressBar>, impl FnMut(Event)) {
    let tty = std::io::stderr().is_terminal() && !plain;
    let steps = steps as u64;
    let bar = if tty {
        let b = ProgressBar::new(steps);
        b.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps  ETA {eta}  {msg}",
            )
            .expect("static template"),
        );
        Some(b)
    } else {
        None
    };
    let say = |b: &Option<ProgressBar>, s: String| match b {
        Some(b) => b.println(s),
        None => eprintln!("{s}"),
    };
    let bar_out = bar.clone();
    let on_event = move |ev: Event| match ev {
        Event::Started {
            run_dir,
            start_step,
            steps,
            params,
            trainable,
            train_tasks,
            test_tasks,
        } => {
            if let Some(b) = &bar {
                b.set_length(steps as u64);
                b.set_position(start_step as u64);
            }
            say(
                &bar,
                format!(
                    "run {} | steps {start_step}..{steps} | {params} parameters{} | {train_tasks} train / {test_tasks} test tasks",
                    run_dir.display(),
                    if trainable == params {
                        String::new()
                    } else {
                        format!(" ({trainable} trainable)")
                    }
                ),
            );
        }
        Event::Step { step, metrics: m } => {
            let t = &m.time;
            let z = |x: Option<f64>| x.unwrap_or(0.0);
            match &bar {
                Some(b) => {
                    b.set_position(step as u64 + 1);
                    // Short enough for one terminal line.
                    b.set_message(format!(
                        "success {:.2} | depth {:.2} | {:.1}s/step",
                        z(m.batch.success),
                        z(m.depth_mean),
                        z(t.step_s),
                    ));
                }
                None => {
                    let msg = format!(
                        "train success {:.2} | guided {:.2} depth {:.2} | zero-std {:.2} | {:.1}s/step | {:.0} rollout tok/s {:.0} train tok/s",
                        z(m.batch.success),
                        z(m.guided_frac),
                        z(m.depth_mean),
                        z(m.frac_zero_std),
                        z(t.step_s),
                        z(t.rollout_tokens_per_s),
                        z(t.train_tokens_per_s),
                    );
                    eprintln!("step {:>4}/{steps} | {msg}", step + 1);
                }
            }
        }
        Event::Eval { step, result } => say(
            &bar,
            format!(
                "eval @ step {step}: {} success {:.3} (by cluster {})",
                result.panel.as_deref().unwrap_or("test"),
                result.result.success.unwrap_or(0.0),
                serde_json::json!(result.result.success_by_cluster)
            ),
        ),
        Event::ScriptError(e) => say(&bar, format!("script error (kept going): {e}")),
        Event::Log(l) => say(&bar, format!("script: {l}")),
        Event::Reload { step, role, result } => match result {
            Ok(h) => say(
                &bar,
                format!(
                    "{role} script reloaded: version {h} in effect from step {}",
                    step + 1
                ),
            ),
            Err(e) => say(
                &bar,
                format!(
                    "{role} script NOT reloaded at step {} (last good version kept): {e}",
                    step + 1
                ),
            ),
        },
        Event::Checkpoint(p) => {
            if bar.is_none() {
                eprintln!("checkpoint {}", p.display());
            }
        }
    };
    (bar_out, on_event)
}
