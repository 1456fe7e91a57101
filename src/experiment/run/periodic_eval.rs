//! Evaluations during a run: each configured panel, unguided, with the
//! in-region / out-region split fixed by the first evaluation; one
//! `eval.jsonl` line and one TensorBoard event per panel.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::{Ctx, Event, RunError};
use crate::env::{Env, Task};
use crate::experiment::config::EvalPanel;
use crate::experiment::eval::{evaluate, EvalSet};
use crate::experiment::metrics::round;
use crate::rundir::tensorboard::{scalars_from_json, wall_time_now};
use crate::rundir::{EnvErrorLine, EvalLine, EvalTimes};
use crate::seed;

pub(super) fn run_eval(
    ctx: &mut Ctx,
    step: usize,
    make: &dyn Fn(usize) -> Box<dyn Env>,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let e = ctx.exp.evaluation.clone();
    for (i, panel) in e.panels.iter().enumerate() {
        let tasks = match panel {
            EvalPanel::Train => &ctx.train,
            EvalPanel::Test => &ctx.test,
        };
        let n = if e.max_tasks == 0 {
            tasks.len()
        } else {
            e.max_tasks.min(tasks.len())
        };
        let tasks = &tasks[..n];
        let mut opts = ctx.ropts.clone();
        opts.greedy = e.greedy;
        // Evaluation runs on the built-in model (the trainer's weights),
        // engine or not.
        opts.engine = None;
        // The test panel keeps the stream it always had, so adding a
        // train panel changes no test number.
        let mut labels = vec![seed::label("eval"), step as u64];
        if *panel != EvalPanel::Test {
            labels.push(seed::label(panel.as_str()));
        }
        let mut rng = seed::rng(ctx.exp.seed, &labels);
        let samples = if e.greedy { 1 } else { e.samples.max(1) };
        let r = evaluate(
            &ctx.policy,
            &ctx.tok,
            make,
            &EvalSet {
                tasks,
                samples,
                clusters: &ctx.clusters,
            },
            &opts,
            &mut rng,
        )?;
        let success = r.breakdown.success.unwrap_or(0.0);
        for f in &r.env_failures {
            ctx.dir.append(&EnvErrorLine {
                step: Some(step),
                task: Some(f.task.clone()),
                error: Some(f.error.clone()),
                eval: Some(panel.to_string()),
            })?;
        }
        let split = region_split(
            &mut ctx.regions,
            panel.as_str(),
            tasks,
            &r.successes,
            &r.attempts,
        );
        let line = EvalLine {
            step: Some(step),
            panel: Some(panel.to_string()),
            greedy: Some(e.greedy),
            result: r.breakdown,
            env_errors: Some(r.env_failures.len()),
            time: EvalTimes {
                eval_s: Some(round(r.stats.seconds)),
            },
            ..split
        };
        let v = ctx.dir.append(&line)?;
        tb_write(ctx, step, &format!("eval_{panel}"), &v)?;
        if i == 0 {
            ctx.evals.retain(|(s, _)| *s != step);
            ctx.evals.push((step, success));
        }
        on_event(Event::Eval {
            step,
            result: Box::new(line),
        });
    }
    Ok(())
}

/// Success in and out of the panel's region (the tasks the initial policy
/// solves at least once, fixed at the panel's first evaluation, whose line
/// lists them), as the region fields of an eval line; over the episodes
/// the env completed (`attempts` per task).
fn region_split(
    regions: &mut BTreeMap<String, BTreeSet<String>>,
    panel: &str,
    tasks: &[Task],
    successes: &[usize],
    attempts: &[usize],
) -> EvalLine {
    let first = !regions.contains_key(panel);
    if first {
        let ids: BTreeSet<String> = tasks
            .iter()
            .zip(successes)
            .filter(|(_, &c)| c > 0)
            .map(|(t, _)| t.id.clone())
            .collect();
        regions.insert(panel.to_string(), ids);
    }
    let region = &regions[panel];
    // Successes, completed episodes and tasks, in and out of the region.
    let (mut sin, mut ain, mut nin, mut sout, mut aout, mut nout) = (0, 0, 0usize, 0, 0, 0usize);
    for ((t, &c), &a) in tasks.iter().zip(successes).zip(attempts) {
        if region.contains(&t.id) {
            (sin, ain, nin) = (sin + c, ain + a, nin + 1);
        } else {
            (sout, aout, nout) = (sout + c, aout + a, nout + 1);
        }
    }
    // `null` when the side has no completed episode.
    let rate = |s: usize, a: usize| (a > 0).then(|| round(s as f64 / a as f64));
    EvalLine {
        success_in_region: rate(sin, ain),
        success_out_region: rate(sout, aout),
        in_region_tasks: Some(nin),
        out_region_tasks: Some(nout),
        in_region_ids: first.then(|| region.clone()),
        ..EvalLine::default()
    }
}

/// Log a metrics or eval line's numbers to TensorBoard under `prefix/`.
pub(super) fn tb_write(
    ctx: &mut Ctx,
    step: usize,
    prefix: &str,
    line: &Value,
) -> Result<(), RunError> {
    if let Some(w) = &mut ctx.tb {
        // The step is the event's own step, not a scalar.
        let step_tag = format!("{prefix}/step");
        let mut scalars = scalars_from_json(prefix, line);
        scalars.retain(|(tag, _)| *tag != step_tag);
        w.write_scalars(step as i64, wall_time_now(), &scalars)?;
    }
    Ok(())
}
