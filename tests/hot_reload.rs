//! Hot reload: a guidance script edited during a real (tiny) training run
//! takes effect at the next step; a broken edit keeps the last good version
//! and the run goes on.

use std::path::PathBuf;
use std::time::Duration;

use actguide::experiment::{self, Event, Experiment, RunOptions};
use serde_json::Value;

const V1: &str = "const RATIO = 0.9;\nfn plan(task, state) { prefix_ratio(RATIO) }\n";
const V2: &str = "const RATIO = 0.0;\nfn plan(task, state) { prefix_ratio(RATIO) }\n";
const BROKEN: &str = "const RATIO = 0.5;\nfn plan(task, state) { prefix_ratio(RATIO }\n";

#[test]
fn edits_take_effect_at_the_next_step_and_broken_edits_are_rejected() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("guidance.rhai");
    std::fs::write(&script, V1).unwrap();
    let src = format!(
        r#"#{{ name: "hot", seed: 5, steps: 4, runs_dir: "{runs}",
             model: #{{ path: "{r}/models/tiny" }},
             env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 4 }},
             guidance: #{{ script: "{s}" }},
             rollout: #{{ tasks_per_step: 2, group_size: 2 }},
             evaluation: #{{ every: 0, max_tasks: 2 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.path().join("runs").display(),
        r = root.display(),
        s = script.display(),
    );
    let exp = Experiment::from_source("hot.rhai", &src).unwrap();
    let mut reloads = Vec::new();
    let summary = experiment::run(exp, &RunOptions::default(), &mut |ev| match ev {
        Event::Step { step: 0, .. } => {
            // Editor-style save: write a temp file and rename it over.
            let tmpf = script.with_extension("rhai.tmp");
            std::fs::write(&tmpf, V2).unwrap();
            std::fs::rename(&tmpf, &script).unwrap();
            std::thread::sleep(Duration::from_millis(400));
        }
        Event::Step { step: 1, .. } => {
            std::fs::write(&script, BROKEN).unwrap();
            std::thread::sleep(Duration::from_millis(400));
        }
        Event::Reload { step, result } => reloads.push((step, result)),
        _ => {}
    })
    .unwrap();
    let metrics: Vec<Value> = std::fs::read_to_string(summary.run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Step 0 ran V1 (deep prefixes), steps 1.. run V2 (none).
    assert!(metrics[0]["depth_mean"].as_f64().unwrap() > 0.0);
    for m in &metrics[1..] {
        assert_eq!(m["depth_mean"], 0.0, "{m}");
    }
    let h: Vec<&str> = metrics
        .iter()
        .map(|m| m["script_hash"].as_str().unwrap())
        .collect();
    assert_ne!(h[0], h[1]);
    assert_eq!(h[1], h[2], "the broken edit must not replace V2");
    assert_eq!(h[2], h[3]);
    // The reload log and events: one success at step 1, one error at step 2.
    assert_eq!(reloads.len(), 2, "{reloads:?}");
    assert_eq!(reloads[0].0, 1);
    assert_eq!(reloads[0].1.as_ref().unwrap(), h[1]);
    assert_eq!(reloads[1].0, 2);
    let err = reloads[1].1.as_ref().unwrap_err();
    assert!(err.contains(&format!("{}:2:", script.display())), "{err}");
    let log = std::fs::read_to_string(summary.run_dir.join("reloads.jsonl")).unwrap();
    assert_eq!(log.lines().count(), 2);
    // Every version that ran is kept in the run directory.
    let copies = std::fs::read_dir(summary.run_dir.join("scripts"))
        .unwrap()
        .count();
    assert_eq!(copies, 2);
}
