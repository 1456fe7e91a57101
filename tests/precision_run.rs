//! `model.dtype: "bf16"` through the run loop on the CPU: a full-weight
//! bf16 run trains, resumes exactly (f32 master weights and optimiser
//! state in the checkpoint), and `eval`'s loader rebuilds it in bf16; a
//! LoRA bf16 run keeps its base in bf16; a bad dtype is refused with its
//! key. And the memory estimate: a micro-batch that cannot fit is refused
//! before the run starts, and the micro-batch its message suggests runs.

use std::path::{Path, PathBuf};

use actguide::experiment::{self, eval, Experiment, RunOptions};
use actguide::model::Precision;
use candle_core::DType;
use serde_json::Value as Json;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tiny(runs: &Path, name: &str, model_extra: &str) -> Experiment {
    let r = root().display().to_string();
    let src = format!(
        r#"#{{
            name: "{name}", seed: 9, steps: 3, runs_dir: "{runs}",
            model: #{{ path: "{r}/models/tiny", dtype: "bf16" {model_extra} }},
            env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 4 }},
            guidance: #{{ script: "{r}/scripts/guidance/gaussian.rhai", clusters: 3 }},
            rollout: #{{ tasks_per_step: 2, group_size: 4 }},
            trainer: #{{ lr: 0.01, kl_coef: 0.01, aux_nll_coef: 0.5 }},
            evaluation: #{{ every: 2, max_tasks: 2 }},
            checkpoint: #{{ every: 2 }},
        }}"#,
        runs = runs.display(),
    );
    Experiment::from_source("test.rhai", &src).expect("valid experiment")
}

fn metrics(run_dir: &Path) -> Vec<Json> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Json = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("time");
            v
        })
        .collect()
}

#[test]
fn a_bf16_run_trains_resumes_exactly_and_loads_back_in_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    let full = experiment::run(
        tiny(tmp.path(), "full", ""),
        &RunOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    let m = metrics(&full.run_dir);
    assert_eq!(m.len(), 3);
    for row in &m {
        let loss = row["pg_loss"].as_f64().expect("a loss every step");
        let grad = row["grad_norm"].as_f64().expect("a gradient every step");
        assert!(loss.is_finite() && grad.is_finite() && grad > 0.0, "{row}");
    }
    // The resolved setting is recorded with the run.
    let written: Json = serde_json::from_str(
        &std::fs::read_to_string(full.run_dir.join("experiment.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(written["model"]["dtype"], "bf16");

    // Stop after 2 steps and resume: the same metrics as the unbroken run.
    let part = tiny(tmp.path(), "part", "");
    let dir = part.run_dir();
    let stop = RunOptions {
        stop_after: Some(2),
        ..Default::default()
    };
    experiment::run(part.clone(), &stop, &mut |_| {}).unwrap();
    let resume = RunOptions {
        resume: Some(dir.clone()),
        ..Default::default()
    };
    experiment::run(part, &resume, &mut |_| {}).unwrap();
    assert_eq!(metrics(&dir), m);

    // The checkpoint holds the f32 masters; the loader computes in bf16.
    let loaded = eval::load_run(&full.run_dir, None).unwrap();
    assert_eq!(loaded.trained.precision(), Precision::Bf16);
    assert_eq!(loaded.initial.precision(), Precision::Bf16);
    for (name, t) in loaded.trained.named_tensors() {
        assert_eq!(t.dtype(), DType::F32, "{name}");
    }
}

#[test]
fn a_bf16_lora_run_keeps_its_base_in_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = r#", lora: #{ rank: 4, alpha: 8.0, targets: ["q_proj", "v_proj"] }"#;
    let mut e = tiny(tmp.path(), "lora", lora);
    e.steps = 2;
    let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(metrics(&s.run_dir).len(), 2);
    let loaded = eval::load_run(&s.run_dir, None).unwrap();
    assert_eq!(loaded.trained.precision(), Precision::Bf16);
    for (name, t) in loaded.trained.named_tensors() {
        assert_eq!(t.dtype(), DType::BF16, "base {name}");
    }
    for (name, v) in loaded.trained.named_vars() {
        assert_eq!(v.dtype(), DType::F32, "adapter {name}");
    }
}

#[test]
fn an_unknown_dtype_is_refused_with_its_key() {
    let src = r#"#{ name: "x", model: #{ path: "m", dtype: "fp8" },
        env: #{ train: "a", test: "b" }, guidance: #{ script: "s" } }"#;
    let e = Experiment::from_source("bad.rhai", src)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.dtype must be \"f32\" or \"bf16\", got \"fp8\""),
        "{e}"
    );
    assert!(e.contains("bad.rhai:1:"), "{e}");
}

#[test]
fn a_micro_batch_that_cannot_fit_is_refused_and_the_suggested_one_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = tiny(tmp.path(), "huge", "");
    e.model.dtype = None;
    e.steps = 1;
    e.evaluation.every = 0;
    // Plan for a fixed 2 GiB (`--memory-gb 2`), so the outcome does not
    // depend on what else runs on the machine; ten million sequences per
    // micro-batch do not fit that.
    let opts = RunOptions {
        memory_limit: Some(2 << 30),
        ..Default::default()
    };
    e.trainer.micro_batch = 10_000_000;
    let err = experiment::run(e.clone(), &opts, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("training micro-batch of 10000000 sequences"),
        "{err}"
    );
    let m: usize = err
        .split("Set trainer.micro_batch to ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no suggestion in: {err}"));
    assert!((1..10_000_000).contains(&m), "{m}");
    // Refused before anything ran: the fresh run directory is gone, so
    // the corrected run gets the same name.
    assert!(!e.run_dir().exists());
    e.trainer.micro_batch = m;
    let mut logs = Vec::new();
    experiment::run(e.clone(), &opts, &mut |ev| {
        if let experiment::Event::Log(l) = ev {
            logs.push(l)
        }
    })
    .unwrap();
    assert!(e.run_dir().join("metrics.jsonl").exists());
    assert!(
        logs.iter().any(
            |l| l.starts_with("memory estimate: peak about") && l.contains("of 1.7 GiB usable")
        ),
        "{logs:?}"
    );
    // Without a limit the check plans for what the machine has free.
    assert!(actguide::model::memory::available_cpu().is_some_and(|b| b > 0));
    // A limit too small for one sequence.
    let mut small = e.clone();
    small.name = "small".into();
    let opts = RunOptions {
        memory_limit: Some(1 << 20),
        ..Default::default()
    };
    let err = experiment::run(small, &opts, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Even one sequence per micro-batch does not fit"),
        "{err}"
    );
}
