//! What `actguide run` prints: the progress bar (on a terminal) or plain
//! lines while the run goes, and the summary table when it ends.
//!
//! Progress goes to stderr (through the bar when there is one), the summary
//! to stdout. Script output is prefixed `script:`, the runner's own notices
//! (review-round bounds hit, env failures) `run:`.

use std::io::IsTerminal;

use actguide::rundir::{EvalLine, StepLine};
use indicatif::{ProgressBar, ProgressStyle};

use actguide::experiment::{ComparisonSummary, Event, RunSummary};

/// Prints run events: through the progress bar on a terminal, else as
/// plain lines on stderr.
pub struct EventPrinter {
    bar: Option<ProgressBar>,
    /// The experiment's step budget, for the plain `step N/M` lines.
    steps: u64,
    /// Each run's own budget by tag ("" untagged), from its `Started`
    /// event: a comparison entry may set its own `steps`.
    tag_steps: std::sync::Mutex<std::collections::BTreeMap<String, u64>>,
}

impl EventPrinter {
    /// A bar over `steps` steps on a terminal, unless `plain`.
    pub fn new(steps: usize, plain: bool) -> Self {
        let tty = std::io::stderr().is_terminal() && !plain;
        let steps = steps as u64;
        let bar = tty.then(|| {
            let b = ProgressBar::new(steps);
            b.set_style(
                ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} steps  ETA {eta}  {msg}",
                )
                .expect("static template"),
            );
            b
        });
        EventPrinter {
            bar,
            steps,
            tag_steps: Default::default(),
        }
    }

    /// Clear the bar once the run is over (before the summary is printed).
    pub fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }

    /// A line above the bar, or on stderr without one.
    fn say(&self, s: String) {
        match &self.bar {
            Some(b) => b.println(s),
            None => eprintln!("{s}"),
        }
    }

    /// The step budget of the run `tag` names, as of `ev` (a `Started`
    /// event sets it).
    fn budget_of(&self, tag: Option<&str>, ev: &Event) -> u64 {
        let key = tag.unwrap_or_default().to_string();
        let mut m = self.tag_steps.lock().unwrap_or_else(|e| e.into_inner());
        if let Event::Started { steps, .. } = ev {
            m.insert(key.clone(), *steps as u64);
        }
        m.get(&key).copied().unwrap_or(self.steps)
    }

    pub fn print(&self, ev: Event) {
        self.print_as(None, ev)
    }

    /// Print an event; a `tag` (a comparison entry running beside others)
    /// prefixes each line.
    pub fn print_as(&self, tag: Option<&str>, ev: Event) {
        let say = |s: String| match tag {
            Some(t) => self.say(format!("[{t}] {s}")),
            None => self.say(s),
        };
        let total = self.budget_of(tag, &ev);
        match ev {
            Event::Started {
                run_dir,
                start_step,
                steps,
                params,
                trainable,
                train_tasks,
                test_tasks,
            } => {
                if let Some(b) = &self.bar {
                    b.set_length(steps as u64);
                    b.set_position(start_step as u64);
                }
                say(format!(
                    "run {} | steps {start_step}..{steps} | {params} parameters{} | {train_tasks} train / {test_tasks} test tasks",
                    run_dir.display(),
                    if trainable == params {
                        String::new()
                    } else {
                        format!(" ({trainable} trainable)")
                    }
                ));
            }
            Event::Step { step, metrics } => {
                let f = step_figures(&metrics);
                match &self.bar {
                    Some(b) => {
                        b.set_position(step as u64 + 1);
                        b.set_message(f.bar_message());
                    }
                    None => say(format!("step {:>4}/{total} | {}", step + 1, f.line())),
                }
            }
            Event::SftStep(l) => {
                let line = format!(
                    "nll {:.4} | {} traj ({} with plan) | grad {:.3} | lr {:.2e} | {:.2}s/step | {:.0} train tok/s",
                    l.nll, l.trajectories, l.with_plan, l.grad_norm, l.lr, l.seconds, l.train_tok_s
                );
                match &self.bar {
                    Some(b) => {
                        b.set_position(l.step as u64 + 1);
                        b.set_message(line);
                    }
                    None => say(format!("step {:>4}/{total} | {line}", l.step + 1)),
                }
                if l.env_errors > 0 || l.unencodable_actions > 0 {
                    say(format!(
                        "step {}: {} trajectories failed in the env, {} actions the tokenizer \
                         cannot encode (left out)",
                        l.step + 1,
                        l.env_errors,
                        l.unencodable_actions
                    ));
                }
            }
            Event::Eval { step, result } => say(eval_line(step, &result)),
            Event::ScriptError(e) => say(format!("script error (kept going): {e}")),
            Event::ScriptLog(l) => say(format!("script: {l}")),
            Event::Log(l) => say(format!("run: {l}")),
            Event::Reload { step, role, result } => say(match result {
                // Printed steps count from 1, JSONL files from 0: the
                // line names the reloads.jsonl entry too.
                Ok(h) => format!(
                    "{role} script reloaded: version {h} in effect from step {} \
                     (reloads.jsonl \"step\": {step})",
                    step + 1
                ),
                Err(e) => format!(
                    "{role} script NOT reloaded at step {} (last good version kept; \
                     reloads.jsonl \"step\": {step}): {e}",
                    step + 1
                ),
            }),
            Event::Checkpoint(p) => {
                if self.bar.is_none() {
                    say(format!("checkpoint {}", p.display()));
                }
            }
        }
    }
}

/// The figures of a step's metrics line that the progress shows.
struct StepFigures {
    success: f64,
    guided_frac: f64,
    depth_mean: f64,
    frac_zero_std: f64,
    step_s: f64,
    rollout_tokens_per_s: f64,
    train_tokens_per_s: f64,
    /// With `rollout.engine`: (mean |Δ log p| against the engine, episodes
    /// it failed, seconds and bytes of the weight sync).
    engine: Option<(f64, usize, f64, u64)>,
    /// With `model.rollout_bf16`: mean |Δ log p| of the bf16 rollouts.
    bf16_mismatch: Option<f64>,
}

/// The one place that reads fields of a step's metrics line (absent
/// fields show as 0).
fn step_figures(m: &StepLine) -> StepFigures {
    let z = |x: Option<f64>| x.unwrap_or(0.0);
    let t = &m.time;
    StepFigures {
        success: z(m.batch.success),
        guided_frac: z(m.guided_frac),
        depth_mean: z(m.depth_mean),
        frac_zero_std: z(m.frac_zero_std),
        step_s: z(t.step_s),
        rollout_tokens_per_s: z(t.rollout_tokens_per_s),
        train_tokens_per_s: z(t.train_tokens_per_s),
        engine: m.engine.as_ref().map(|e| {
            (
                e.behaviour.mismatch,
                e.failed_episodes,
                e.sync_s,
                e.sync_bytes,
            )
        }),
        bf16_mismatch: m.rollout_bf16.as_ref().map(|b| b.mismatch),
    }
}

impl StepFigures {
    /// Next to the bar: short enough for one terminal line.
    fn bar_message(&self) -> String {
        format!(
            "success {:.2} | depth {:.2} | {:.1}s/step",
            self.success, self.depth_mean, self.step_s,
        )
    }

    /// A plain step line (after `step N/M | `).
    fn line(&self) -> String {
        let mut l = format!(
            "train success {:.2} | guided {:.2} depth {:.2} | zero-std {:.2} | {:.1}s/step | {:.0} rollout tok/s {:.0} train tok/s",
            self.success,
            self.guided_frac,
            self.depth_mean,
            self.frac_zero_std,
            self.step_s,
            self.rollout_tokens_per_s,
            self.train_tokens_per_s,
        );
        if let Some((mismatch, failed, sync_s, bytes)) = self.engine {
            let mb = bytes as f64 / 1e6;
            l.push_str(&format!(
                " | engine |Δlogp| {mismatch:.4}, {failed} failed, sync {sync_s:.1}s ({mb:.1} MB)"
            ));
        }
        if let Some(mismatch) = self.bf16_mismatch {
            l.push_str(&format!(" | bf16 |Δlogp| {mismatch:.4}"));
        }
        l
    }
}

/// The line of an evaluation during the run (reads its result's fields).
fn eval_line(step: usize, result: &EvalLine) -> String {
    let panel = result.panel.as_deref().unwrap_or("test");
    let mut line = format!(
        "eval @ step {step}: {panel} success {} (by cluster {})",
        rate(result.result.success),
        serde_json::json!(result.result.success_by_cluster)
    );
    // Episodes the env failed are not the policy's failures: say so loudly.
    if let Some(n) = result.env_errors.filter(|&n| n > 0) {
        line += &format!(
            "; WARNING: {n} episode(s) lost to env failures, left out of the rate              (env_errors.jsonl, \"eval\": \"{panel}\")"
        );
    }
    line
}

/// A success rate with 3 decimals, `-` when not measured.
fn rate(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |v| format!("{v:.3}"))
}

/// The end-of-run table.
pub fn print_summary(summary: &RunSummary) {
    println!("── summary ─────────────────────────────────────────────");
    println!("run dir            {}", summary.run_dir.display());
    if summary.interrupted {
        println!(
            "steps              {} (interrupted; resume with --resume)",
            summary.steps_done
        );
    } else {
        println!("steps              {}", summary.steps_done);
    }
    if summary.start_test_success.is_some() {
        println!(
            "test success       start {}  →  end {}",
            rate(summary.start_test_success),
            rate(summary.end_test_success)
        );
    }
    if let Some(s) = summary.own_success {
        println!("own tasks          greedy success {s:.3}");
    }
    if let Some(m) = &summary.model {
        println!(
            "model              {} (start RL from it: model.path)",
            m.display()
        );
    }
    println!(
        "wall time          {:.1} s ({:.2} s/step)",
        summary.seconds, summary.seconds_per_step
    );
    if summary.model.is_some() {
        // SFT generates nothing: its rollouts replay expert actions.
        println!(
            "throughput         {:.0} train tok/s",
            summary.train_tokens_per_s
        );
    } else if summary.start_test_success.is_some() {
        println!(
            "throughput         {:.0} rollout tok/s, {:.0} train tok/s",
            summary.rollout_tokens_per_s, summary.train_tokens_per_s
        );
    }
    for w in &summary.warnings {
        println!("WARNING            {w}");
    }
}

/// The end-of-comparison table: one line per run and where the report is.
pub fn print_comparison(out: &ComparisonSummary) {
    println!(
        "── comparison {} ──────────────────────────────",
        out.dir.display()
    );
    println!(
        "{:<22} {:>7} {:>9} {:>9} {:>9} {:>10}",
        "run", "steps", "test@0", "test@end", "s/step", "wall s"
    );
    for s in &out.runs {
        let name = s
            .run_dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        println!(
            "{name:<22} {:>7} {:>9} {:>9} {:>9.2} {:>10.1}",
            s.steps_done,
            rate(s.start_test_success),
            rate(s.end_test_success),
            s.seconds_per_step,
            s.seconds
        );
    }
    if let Some(r) = &out.report {
        println!("report             {}", r.join("report.html").display());
    }
}

/// An error and its causes on one line, each cause once: the library's
/// errors often show their cause in their own message already.
pub fn error_chain(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg = format!("{msg}: {c}");
        }
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn started(steps: usize) -> Event {
        Event::Started {
            run_dir: "runs/x".into(),
            start_step: 0,
            steps,
            params: 1,
            trainable: 1,
            train_tasks: 1,
            test_tasks: 1,
        }
    }

    #[test]
    fn each_run_counts_its_steps_against_its_own_budget() {
        let p = EventPrinter::new(60, true);
        let ev = Event::ScriptLog("x".into());
        assert_eq!(p.budget_of(Some("bc180"), &ev), 60);
        assert_eq!(p.budget_of(Some("bc180"), &started(180)), 180);
        assert_eq!(p.budget_of(Some("bc"), &started(60)), 60);
        assert_eq!(p.budget_of(Some("bc180"), &ev), 180);
        // One run after another, untagged (a comparison with --jobs 1).
        assert_eq!(p.budget_of(None, &started(30)), 30);
        assert_eq!(p.budget_of(None, &ev), 30);
    }
}
