//! `actguide sft`: the supervised warm start learns its trajectories,
//! resumes exactly, and writes a model folder RL starts from.

use std::path::{Path, PathBuf};

use actguide::env::panel::{read_jsonl, write_jsonl};
use actguide::experiment::sft::{self, SftOptions};
use actguide::experiment::{self, Experiment, RunOptions};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The first 8 household train tasks with at most 4 expert actions.
fn small_panel(dir: &Path) -> PathBuf {
    let tasks: Vec<_> = read_jsonl(&root().join("envs/household/train.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|t| t.expert.len() <= 4)
        .take(8)
        .collect();
    assert_eq!(tasks.len(), 8);
    let p = dir.join("small.jsonl");
    write_jsonl(&p, &tasks).unwrap();
    p
}

fn experiment(dir: &Path, name: &str, steps: usize, extra: &str) -> Experiment {
    let r = root();
    let p = small_panel(dir);
    let src = format!(
        r#"#{{ name: "{name}", seed: 4, steps: {steps}, runs_dir: "{runs}",
             model: #{{ path: "{r}/models/tiny" }},
             env: #{{ train: "{p}", test: "{p}", max_steps: 6, step_slack: 2 }},
             guidance: #{{ script: "{r}/scripts/guidance/zero_rl.rhai" }},
             rollout: #{{ history: 1, show_actions: false }},
             trainer: #{{ lr: 0.01, schedule: "cosine", grad_clip: 1.0 }},
             sft: #{{ tasks_per_step: 8, plan_share: 0.5 {extra} }},
             checkpoint: #{{ every: 0 }} }}"#,
        runs = dir.join("runs").display(),
        r = r.display(),
        p = p.display(),
    );
    Experiment::from_source("sft.rhai", &src).unwrap()
}

fn lines(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("sft.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            let o = v.as_object_mut().unwrap();
            o.remove("seconds");
            o.remove("train_tok_s");
            v
        })
        .collect()
}

#[test]
fn sft_learns_its_trajectories_and_writes_a_model_rl_starts_from() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = experiment(tmp.path(), "sft", 100, ", eval_tasks: 8");
    let s = sft::run(exp, &SftOptions::default(), &mut |_| {}).unwrap();
    let m = lines(&s.run_dir);
    assert_eq!(m.len(), 100);
    let nll = |i: usize| m[i]["nll"].as_f64().unwrap();
    let first = nll(0);
    let last: f64 = (95..100).map(nll).sum::<f64>() / 5.0;
    assert!(last < first / 4.0, "nll {first} -> {last}");
    assert!(m.iter().any(|l| l["with_plan"].as_u64().unwrap() > 0));
    // Greedy, unguided, it solves the tasks it was trained on.
    let own = s.own_success.unwrap();
    assert!(own >= 0.9, "greedy success on its own tasks {own}");
    let eval: Value =
        serde_json::from_str(&std::fs::read_to_string(s.run_dir.join("sft_eval.json")).unwrap())
            .unwrap();
    assert_eq!(eval["success"].as_f64(), Some(own));
    // RL starts from the written model folder.
    let model = s.model.unwrap();
    let r = root();
    let src = format!(
        r#"#{{ name: "rl", seed: 4, steps: 1, runs_dir: "{runs}",
             model: #{{ path: "{model}" }},
             env: #{{ train: "{p}", test: "{p}", max_steps: 6, step_slack: 2 }},
             guidance: #{{ script: "{r}/scripts/guidance/zero_rl.rhai" }},
             rollout: #{{ tasks_per_step: 8, group_size: 2, history: 1, show_actions: false }},
             evaluation: #{{ every: 0, greedy: true, samples: 1 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.path().join("runs").display(),
        model = model.display(),
        r = r.display(),
        p = tmp.path().join("small.jsonl").display(),
    );
    let rl = experiment::run(
        Experiment::from_source("rl.rhai", &src).unwrap(),
        &RunOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    let evals: Vec<Value> = std::fs::read_to_string(rl.run_dir.join("eval.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The step-0 greedy evaluation of the RL run is the SFT policy's.
    let at0 = evals[0]["success"].as_f64().unwrap();
    assert!(at0 >= 0.9, "RL's initial policy is not the SFT one: {at0}");
}

#[test]
fn sft_resume_is_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = sft::run(
        experiment(tmp.path(), "whole", 6, ", eval_tasks: 0"),
        &SftOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    let part = sft::run(
        experiment(tmp.path(), "part", 6, ", eval_tasks: 0"),
        &SftOptions {
            stop_after: Some(3),
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(part.steps_done, 3);
    assert!(part.model.is_none());
    let resumed = sft::run(
        experiment(tmp.path(), "part", 6, ", eval_tasks: 0"),
        &SftOptions {
            resume: Some(part.run_dir.clone()),
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(resumed.steps_done, 6);
    assert_eq!(lines(&whole.run_dir), lines(&part.run_dir));
    let w = |d: &Path| std::fs::read(d.join("model/model.safetensors")).unwrap();
    assert_eq!(w(&whole.run_dir), w(&part.run_dir));
}

#[test]
fn sft_settings_and_an_empty_sft_panel_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root();
    let bad = format!(
        r#"#{{ name: "x", steps: 1, model: #{{ path: "m" }}, env: #{{ train: "a", test: "b" }},
             guidance: #{{ script: "{r}/scripts/guidance/zero_rl.rhai" }},
             sft: #{{ plan_share: 2.0 }} }}"#,
        r = r.display()
    );
    let e = Experiment::from_source("bad.rhai", &bad)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.rhai") && e.contains("sft.plan_share must be in [0, 1]"),
        "{e}"
    );
    let long: Vec<_> = read_jsonl(&root().join("envs/household/train.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|t| t.expert.len() >= 3)
        .take(4)
        .collect();
    let p = tmp.path().join("long.jsonl");
    write_jsonl(&p, &long).unwrap();
    let extra = format!(", panel: \"{}\", max_expert_len: 2", p.display());
    let exp = experiment(tmp.path(), "none", 2, &extra);
    let e = sft::run(exp, &SftOptions::default(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("long.jsonl: no task with expert actions of at most 2 actions"),
        "{e}"
    );
}
