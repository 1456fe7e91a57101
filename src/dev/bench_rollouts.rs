//! `actguide dev bench-rollouts`: rollout throughput of an experiment's model
//! on the built-in generation and on its engine (`rollout.engine`) with 1,
//! 2, … launched servers: the same episodes (the first
//! `tasks_per_step` train tasks × `group_size`, unguided), timed round by
//! round.

use std::path::Path;
use std::sync::Arc;

use crate::env::{make_env, panel, Env};
use crate::experiment::{models, Experiment, RunError};
use crate::guidance::ResolvedSpec;
use crate::inference::{Engine, EngineSection};
use crate::rollout::{self, EpisodeRequest};
use crate::seed;

/// One measured setting.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RolloutBenchRow {
    /// "builtin" or "engine".
    pub generation: String,
    /// Engine servers (0: built in).
    pub servers: usize,
    /// Threads per server (the process's threads when built in).
    pub threads: usize,
    pub episodes: usize,
    pub generated_tokens: usize,
    pub generated_tokens_per_s: f64,
    /// Prompt + generated tokens per second.
    pub rollout_tokens_per_s: f64,
    pub seconds_per_round: f64,
    /// Episodes the engine failed.
    pub failed: usize,
}

/// The table.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RolloutBench {
    pub model: String,
    pub rounds: usize,
    pub rows: Vec<RolloutBenchRow>,
}

impl std::fmt::Display for RolloutBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "model {}, {} round(s) per setting",
            self.model, self.rounds
        )?;
        writeln!(
            f,
            "| generation | servers | threads each | episodes | generated tokens | generated tok/s | rollout tok/s | s/round | failed |"
        )?;
        write!(f, "|---|---:|---:|---:|---:|---:|---:|---:|---:|")?;
        for r in &self.rows {
            write!(
                f,
                "\n| {} | {} | {} | {} | {} | {:.1} | {:.0} | {:.2} | {} |",
                r.generation,
                r.servers,
                r.threads,
                r.episodes,
                r.generated_tokens,
                r.generated_tokens_per_s,
                r.rollout_tokens_per_s,
                r.seconds_per_round,
                r.failed
            )?;
        }
        Ok(())
    }
}

/// Measure `rounds` rollout rounds built in, then on the experiment's
/// engine with each server count of `servers` (launched llama.cpp
/// servers, `threads` each when given; running servers are measured as
/// listed). Server logs and weights go to `work`.
pub fn run(
    exp: &Experiment,
    rounds: usize,
    servers: &[usize],
    threads: Option<usize>,
    work: &Path,
) -> Result<RolloutBench, RunError> {
    let device = models::device(exp)?;
    let src = models::open(exp)?;
    let policy = models::initial(exp, &src, &device)?;
    let tasks = panel::read_jsonl(Path::new(&exp.env.train))?;
    let n_tasks = exp.rollout.tasks_per_step.min(tasks.len());
    let reqs: Vec<EpisodeRequest> = tasks[..n_tasks]
        .iter()
        .flat_map(|t| {
            (0..exp.rollout.group_size).map(move |_| EpisodeRequest {
                task: t,
                spec: ResolvedSpec::default(),
            })
        })
        .collect();
    let spec = exp.env.spec();
    let make = |limit: usize| -> Box<dyn Env> { make_env(&spec, limit) };
    let mut ropts = models::rollout_options(exp, &src, false)?;
    let measure = |ropts: &rollout::RolloutOptions,
                   generation: &str,
                   n_servers: usize,
                   threads: usize|
     -> Result<RolloutBenchRow, RunError> {
        let (mut secs, mut gen, mut all, mut failed) = (0.0, 0usize, 0usize, 0usize);
        for round in 0..rounds.max(1) {
            let mut rng = seed::rng(exp.seed, &[seed::label("bench-rollouts"), round as u64]);
            let (eps, st) = rollout::run(&policy, &src.tok, &make, &reqs, ropts, &mut rng, None)?;
            secs += st.seconds;
            gen += st.generated_tokens;
            all += st.prompt_tokens + st.generated_tokens;
            failed += eps.iter().filter(|e| e.engine_failed).count();
        }
        let r = rounds.max(1) as f64;
        Ok(RolloutBenchRow {
            generation: generation.into(),
            servers: n_servers,
            threads,
            episodes: reqs.len(),
            generated_tokens: gen,
            generated_tokens_per_s: gen as f64 / secs.max(1e-9),
            rollout_tokens_per_s: all as f64 / secs.max(1e-9),
            seconds_per_round: secs / r,
            failed,
        })
    };
    let mut rows = vec![measure(&ropts, "builtin", 0, rayon::current_num_threads())?];
    if let Some(cfg) = &exp.rollout.engine {
        let vocab = crate::inference::gguf_vocab(&src.path)?;
        let counts: Vec<usize> = match &cfg.launch {
            Some(_) if !servers.is_empty() => servers.to_vec(),
            Some(l) => vec![l.count],
            None => vec![cfg.servers.len()],
        };
        for n in counts {
            let mut c: EngineSection = cfg.clone();
            let threads = match c.launch.as_mut() {
                Some(l) => {
                    l.count = n;
                    l.threads = threads.unwrap_or(l.threads).max(1);
                    l.threads
                }
                None => 0,
            };
            let dir = work.join(format!("servers-{n}"));
            let e = Engine::start(&c, &dir, &policy, vocab.clone()).map_err(Box::new)?;
            ropts.engine = Some(Arc::new(e));
            rows.push(measure(&ropts, "engine", n, threads)?);
            // Dropping the engine stops launched servers.
            ropts.engine = None;
        }
    }
    Ok(RolloutBench {
        model: exp.model.path.clone(),
        rounds: rounds.max(1),
        rows,
    })
}
