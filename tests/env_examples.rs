//! The shop and searchqa examples train on CPU and write metrics (2 steps
//! of each example file, in a temp run directory).

use std::path::PathBuf;

use actguide::experiment::{self, Experiment, RunOptions};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn shop_and_searchqa_examples_train_and_write_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["shop_actguide", "searchqa_actguide"] {
        let mut exp = Experiment::load(&root().join(format!("examples/{name}.rhai"))).unwrap();
        // Paths in examples are relative to the repository root.
        let abs = |p: &str| root().join(p).display().to_string();
        exp.model.path = abs(&exp.model.path);
        exp.env.train = abs(&exp.env.train);
        exp.env.test = abs(&exp.env.test);
        exp.guidance.script = abs(&exp.guidance.script);
        exp.steps = 2;
        exp.runs_dir = tmp.path().display().to_string();
        exp.evaluation.max_tasks = 4;
        let s = experiment::run(exp, &RunOptions::default(), &mut |_| {}).unwrap();
        let m: Vec<Value> = std::fs::read_to_string(s.run_dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(m.len(), 2, "{name}");
        for l in &m {
            assert_eq!(l["env_errors"], 0, "{name}: {l}");
            assert!(l["policy_tokens"].as_u64().unwrap() > 0, "{name}: {l}");
            // ActGuide-RL: every all-fail task was probed with plans.
            assert!(l["rollouts"].as_u64().unwrap() >= 32, "{name}: {l}");
        }
        assert!(
            m.iter().any(|l| l["plan_k_mean"].as_f64().unwrap() > 0.0),
            "{name}: no plan fallback in {m:?}"
        );
        if name == "searchqa_actguide" {
            // The answers' token F1 is logged.
            assert!(m.iter().any(|l| l["env_info"]["f1"].is_number()), "{m:?}");
        }
        let eval = std::fs::read_to_string(s.run_dir.join("eval.jsonl")).unwrap();
        assert_eq!(eval.lines().count(), 2, "{name}");
    }
}
