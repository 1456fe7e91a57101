//! The trainer learns: on a panel of one-step household tasks, GRPO from a
//! random tiny policy raises greedy success well above its start.

use std::path::PathBuf;

use actguide::env::{panel, Task};
use actguide::experiment::{self, Experiment, RunOptions};

#[test]
fn grpo_learns_one_step_tasks() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let tasks: Vec<Task> = panel::read_jsonl(&root.join("envs/household/train.jsonl"))
        .unwrap()
        .into_iter()
        .filter(|t| t.difficulty == 1)
        .take(8)
        .collect();
    assert_eq!(tasks.len(), 8);
    let p = tmp.path().join("short.jsonl");
    panel::write_jsonl(&p, &tasks).unwrap();
    let src = format!(
        r#"#{{ name: "learn", seed: 3, steps: 14, runs_dir: "{runs}",
             model: #{{ path: "{r}/models/tiny" }},
             env: #{{ train: "{p}", test: "{p}", max_steps: 4 }},
             guidance: #{{ script: "{r}/scripts/guidance/zero_rl.rhai" }},
             rollout: #{{ tasks_per_step: 8, group_size: 8, history: 1, show_actions: false }},
             trainer: #{{ lr: 0.004, schedule: "constant" }},
             evaluation: #{{ every: 0 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.path().join("runs").display(),
        r = root.display(),
        p = p.display(),
    );
    let exp = Experiment::from_source("learn.rhai", &src).unwrap();
    let s = experiment::run(exp, &RunOptions::default(), &mut |_| {}).unwrap();
    let (start, end) = (s.start_test_success.unwrap(), s.end_test_success.unwrap());
    assert!(end >= start + 0.5, "greedy success {start} -> {end}");
}
