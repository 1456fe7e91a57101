//! `actguide check`: compile a script (guidance, reward or intervention)
//! and call each entry point it defines on synthetic tasks, groups,
//! episodes and turns, so a script's mistakes show up with their position
//! before a run starts. Guidance scripts play two steps against a small
//! synthetic learner through the same round driver training runs use.

use std::collections::BTreeMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::env::Task;
use crate::guidance::decode::type_error;
use crate::guidance::rounds::{drive, DriveReport, Request};
use crate::guidance::runtime::GuidanceRuntime;
use crate::guidance::script_inputs::{EpisodeView, TaskResult, TaskView, TurnView};
use crate::guidance::simulate::SimEpisode;
use crate::script::{Script, ScriptError};

/// Task types and expert lengths of the three synthetic tasks.
const TYPES: [&str; 3] = ["pick_and_place", "pick_heat_then_place", "pick_two_obj"];
const LENS: [usize; 3] = [1, 4, 9];

/// Steps a guidance script is played for.
const STEPS: usize = 2;

/// Which kinds of script a file is, by the entry points it defines.
struct Kinds {
    guidance: bool,
    reward: bool,
    intervene: bool,
}

impl Kinds {
    fn of(script: &Script) -> Self {
        let reward = script.has_fn("reward", 2);
        let intervene = script.has_fn("intervene", 2);
        // `init` alone makes a guidance script unless it is the `init` of
        // a reward or intervention script.
        let guidance = ["plan", "update"].iter().any(|f| script.has_fn(f, 2))
            || script.has_fn("review", 3)
            || script.has_fn("init", 1) && !reward && !intervene;
        Kinds {
            guidance,
            reward,
            intervene,
        }
    }
}

/// Compile the script at `path` and call each entry point it defines on
/// synthetic input. Returns a readable trace, or the first error with its
/// position.
pub fn check_script(path: &Path) -> Result<Vec<String>, ScriptError> {
    let handles = crate::guidance::script_handles();
    let script = Script::load(&handles, path)?;
    let mut out = vec![format!(
        "compiled {} (version {})",
        path.display(),
        script.hash
    )];
    for (p, _) in &script.imports {
        out.push(format!("imports {}", p.display()));
    }
    let kinds = Kinds::of(&script);
    if !(kinds.guidance || kinds.reward || kinds.intervene) {
        return Err(type_error(
            &script.file(),
            "defines none of the entry points init(state), plan(task, state), review(task, group, state), update(batch, state), reward(episode, state), intervene(turn, state)".into(),
        ));
    }
    if kinds.guidance {
        check_guidance(path, &mut out)?;
    }
    if kinds.reward || kinds.intervene {
        check_hooks(path, &kinds, &mut out)?;
    }
    Ok(out)
}

/// The three synthetic tasks guidance scripts are played on.
fn sample_tasks() -> Vec<Task> {
    (0..TYPES.len())
        .map(|i| Task {
            id: format!("task-{i}"),
            task_type: TYPES[i].into(),
            goal: String::new(),
            world: serde_json::Value::Null,
            expert: vec!["look".into(); LENS[i]],
            difficulty: LENS[i],
        })
        .collect()
}

/// Play a guidance script for [`STEPS`] steps: `init`, then per step
/// `plan`, review rounds and `update`, tracing what each call returned.
fn check_guidance(path: &Path, out: &mut Vec<String>) -> Result<(), ScriptError> {
    let mut runtime = GuidanceRuntime::new(path, 0)?;
    for (f, arity) in [("init", 1), ("plan", 2), ("review", 3), ("update", 2)] {
        if !runtime.script().has_fn(f, arity) {
            out.push(format!("{f}: not defined (the runtime's default applies)"));
        }
    }
    runtime.init()?;
    let tasks = sample_tasks();
    for step in 0..STEPS {
        check_step(&mut runtime, &tasks, step, out)?;
    }
    for l in runtime.take_effects().logs {
        out.push(format!("log: {l}"));
    }
    Ok(())
}

/// One synthetic step of a guidance script.
fn check_step(
    runtime: &mut GuidanceRuntime,
    tasks: &[Task],
    step: usize,
    out: &mut Vec<String>,
) -> Result<(), ScriptError> {
    let views: Vec<TaskView> = tasks
        .iter()
        .enumerate()
        .map(|(i, t)| TaskView::new(t, i, &runtime.history(&t.id), step, 10, 4))
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(step as u64);
    let mut lines = Vec::new();
    let mut exec =
        |_: &mut GuidanceRuntime, reqs: &[Request]| -> Result<Vec<SimEpisode>, ScriptError> {
            Ok(play(reqs, step, &mut rng, &mut lines))
        };
    let mut report = DriveReport::default();
    let groups = drive(runtime, step, &views, 4, &mut exec, &mut report)?;
    if let Some(e) = report.errors.into_iter().next() {
        return Err(e);
    }
    out.append(&mut lines);
    let results: Vec<TaskResult> = views
        .iter()
        .zip(&groups)
        .map(|(v, g)| TaskResult {
            // The synthetic batch has always carried no depths; kept so
            // the trace stays the same.
            depth: 0.0,
            depth_ratio: 0.0,
            plan_k: 0.0,
            guided: false,
            ..TaskResult::from_group(v, g.training().map(|r| &r.ep), g.spent(), g.rounds)
        })
        .collect();
    for r in &results {
        out.push(format!(
            "step {step} {}: {} rollouts in {} rounds, success {:.2}",
            r.id, r.rollouts, r.rounds, r.success_rate
        ));
    }
    if let Some(e) = runtime.update(step, &results, &BTreeMap::new()) {
        return Err(e);
    }
    runtime.end_step();
    out.push(format!(
        "step {step} update -> state {}",
        runtime.state_json()
    ));
    Ok(())
}

/// The synthetic learner of `check`: deeper guidance and shorter tasks
/// succeed more often, `expert()` always. Adds one line per task saying
/// which specs its requests carried.
fn play(
    reqs: &[Request],
    step: usize,
    rng: &mut ChaCha8Rng,
    lines: &mut Vec<String>,
) -> Vec<SimEpisode> {
    let mut by_task: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let eps = reqs
        .iter()
        .map(|r| {
            let len = LENS[r.task];
            let spec = r.spec.resolve(len);
            by_task.entry(r.task).or_default().push(r.spec.to_string());
            // Deeper guidance, shorter tasks: likelier success.
            let p = (0.9 - 0.1 * (len - spec.prefix.max(spec.plan).min(len)) as f64).max(0.0);
            SimEpisode {
                spec,
                success: spec.expert || rng.random::<f64>() < p,
            }
        })
        .collect();
    for (t, specs) in by_task {
        lines.push(format!(
            "step {step} plan(cluster {t}, expert_len {}) -> [{}]",
            LENS[t],
            specs.join(", ")
        ));
    }
    eps
}

/// Call a reward and/or intervention script on synthetic episodes and
/// turns.
fn check_hooks(path: &Path, kinds: &Kinds, out: &mut Vec<String>) -> Result<(), ScriptError> {
    let mut runtime = GuidanceRuntime::new(path, 0)?;
    if kinds.reward {
        runtime.set_reward_script(path)?;
    }
    if kinds.intervene {
        runtime.set_intervene_script(path)?;
    }
    runtime.init()?;
    if kinds.reward {
        check_reward(&mut runtime, out)?;
    }
    if kinds.intervene {
        check_intervene(&mut runtime, out)?;
    }
    Ok(())
}

/// `reward` on a success, a failure with invalid actions, and a late
/// success.
fn check_reward(runtime: &mut GuidanceRuntime, out: &mut Vec<String>) -> Result<(), ScriptError> {
    for (i, (success, invalid, turns)) in [(true, 0, 4), (false, 3, 8), (true, 2, 9)]
        .into_iter()
        .enumerate()
    {
        let ep = EpisodeView {
            task_id: format!("task-{i}"),
            success,
            env_reward: f64::from(u8::from(success)),
            invalid,
            policy_turns: turns,
            expert_len: 4,
            prefix: 0,
            plan_k: 0,
            expert: false,
            expert_match: if success { 4 } else { 1 },
            actions: vec!["go to desk 1".into(); turns as usize],
            error: false,
        };
        let (r, e) = runtime.reward(0, i, &ep);
        if let Some(e) = e {
            return Err(e);
        }
        out.push(format!(
            "reward(success {success}, invalid {invalid}, turns {turns}) -> {}",
            r.unwrap_or(f64::NAN)
        ));
    }
    Ok(())
}

/// `intervene` at growing streaks of invalid actions.
fn check_intervene(
    runtime: &mut GuidanceRuntime,
    out: &mut Vec<String>,
) -> Result<(), ScriptError> {
    for streak in [0i64, 1, 2, 3, 5] {
        let t = TurnView {
            task_id: "task-0".into(),
            turn: streak + 1,
            invalid_streak: streak,
            invalid: streak,
            last_action: "look".into(),
            observation: "Nothing happens.".into(),
            expert_next: "go to desk 1".into(),
            expert_len: 4,
            prefix: 0,
            plan_k: 0,
        };
        let (r, e) = runtime.intervene(0, &t);
        if let Some(e) = e {
            return Err(e);
        }
        out.push(format!("intervene(invalid_streak {streak}) -> {r:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn check_reports_positioned_errors_and_traces_good_scripts() {
        let mut f = tempfile::Builder::new().suffix(".rhai").tempfile().unwrap();
        f.write_all(b"fn plan(task, state) {\n  if task.step == 1 { 1 / 0 } else { none() }\n}")
            .unwrap();
        // It compiles; the error comes at run time, in step 1.
        GuidanceRuntime::new(f.path(), 7).unwrap();
        let e = check_script(f.path()).unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/guidance/gaussian.rhai");
        let trace = check_script(&path).unwrap();
        assert!(
            trace
                .iter()
                .any(|l| l.contains("plan(cluster 2, expert_len 9) -> [prefix_ratio(")),
            "{trace:?}"
        );
        assert!(trace.iter().any(|l| l.contains("mu_global")), "{trace:?}");
    }
}
