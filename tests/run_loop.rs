//! Integration tests of the run loop on the built-in tiny model and the
//! household panel: determinism, exact resume, and experiment-file errors.

use std::path::{Path, PathBuf};
use std::process::Command;

use actguide::experiment::{self, Experiment, RunOptions};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A small, fast experiment in `runs_dir`.
fn experiment(runs_dir: &Path, name: &str, steps: usize, script: &str) -> Experiment {
    let r = root();
    let src = format!(
        r#"#{{
            name: "{name}",
            seed: 11,
            steps: {steps},
            runs_dir: "{runs}",
            model: #{{ path: "{r}/models/tiny" }},
            env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 6 }},
            guidance: #{{ script: "{r}/scripts/guidance/{script}", clusters: 3 }},
            rollout: #{{ tasks_per_step: 3, group_size: 4 }},
            trainer: #{{ lr: 0.003, kl_coef: 0.01, aux_nll_coef: 0.5, minibatches: 2, micro_batch: 16 }},
            evaluation: #{{ every: 2, max_tasks: 4, panels: ["test", "train"] }},
            checkpoint: #{{ every: 2 }},
        }}"#,
        runs = runs_dir.display(),
        r = r.display(),
    );
    Experiment::from_source("test.rhai", &src).expect("valid experiment")
}

fn metrics(run_dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("time");
            v
        })
        .collect()
}

fn weights(run_dir: &Path, step: usize) -> Vec<u8> {
    std::fs::read(run_dir.join(format!("checkpoints/step-{step:06}/model.safetensors"))).unwrap()
}

#[test]
fn review_rounds_are_deterministic() {
    // ActGuide-RL: probe rounds, plan fallbacks, internalised loss.
    let tmp = tempfile::tempdir().unwrap();
    let a = experiment(tmp.path(), "a", 2, "actguide.rhai");
    let b = experiment(tmp.path(), "b", 2, "actguide.rhai");
    let sa = experiment::run(a, &RunOptions::default(), &mut |_| {}).unwrap();
    let sb = experiment::run(b, &RunOptions::default(), &mut |_| {}).unwrap();
    let (ma, mb) = (metrics(&sa.run_dir), metrics(&sb.run_dir));
    assert_eq!(ma, mb);
    assert!(ma
        .iter()
        .any(|m| m["rounds"]["probe_rollouts"].as_u64().unwrap() > 0));
    assert_eq!(weights(&sa.run_dir, 2), weights(&sb.run_dir, 2));
}

#[test]
fn same_seed_gives_identical_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let a = experiment(tmp.path(), "a", 3, "gaussian.rhai");
    let b = experiment(tmp.path(), "b", 3, "gaussian.rhai");
    let sa = experiment::run(a, &RunOptions::default(), &mut |_| {}).unwrap();
    let sb = experiment::run(b, &RunOptions::default(), &mut |_| {}).unwrap();
    let (ma, mb) = (metrics(&sa.run_dir), metrics(&sb.run_dir));
    assert_eq!(ma.len(), 3);
    assert_eq!(ma, mb);
    // The run did real work: guided rollouts, tokens trained, non-zero grads.
    assert!(ma.iter().any(|m| m["guided_frac"].as_f64().unwrap() > 0.0));
    assert!(ma.iter().all(|m| m["policy_tokens"].as_u64().unwrap() > 0));
    assert!(ma.iter().any(|m| m["grad_norm"].as_f64().unwrap() > 0.0));
    assert_eq!(weights(&sa.run_dir, 3), weights(&sb.run_dir, 3));
    // `actguide eval` of the run: reproducible, pass@k consistent.
    use actguide::experiment::eval::{eval_checkpoint, EvalOptions};
    let o = EvalOptions {
        panel: "test".into(),
        samples: 4,
        max_tasks: 6,
        seed: 1,
        device: None,
    };
    let e1 = eval_checkpoint(&sa.run_dir, &o).unwrap();
    // `--device` reaches the model: a CUDA device in a CPU build is refused
    // by name before anything loads.
    #[cfg(not(feature = "cuda"))]
    {
        let cuda = EvalOptions {
            device: Some(actguide::model::device::DeviceSpec::Cuda(0)),
            ..o.clone()
        };
        let err = eval_checkpoint(&sa.run_dir, &cuda).unwrap_err().to_string();
        assert!(
            err.contains("cuda:0") && err.contains("--features cuda"),
            "{err}"
        );
    }
    let e2 = eval_checkpoint(&sa.run_dir.join("checkpoints/step-000003"), &o).unwrap();
    assert_eq!(e1, e2);
    assert_eq!(e1["step"], 3);
    let all = &e1["all"];
    assert_eq!(all["tasks"], 6);
    assert_eq!(all["pass_at_k"]["1"], all["sampled_success"]);
    let p: Vec<f64> = ["1", "2", "4"]
        .iter()
        .map(|k| all["pass_at_k"][*k].as_f64().unwrap())
        .collect();
    assert!(p[0] <= p[1] && p[1] <= p[2], "{p:?}");
    let regions: u64 = e1["by_region"]
        .as_object()
        .unwrap()
        .values()
        .map(|r| r["tasks"].as_u64().unwrap())
        .sum();
    assert_eq!(regions, 6);
    // A different seed gives a different run.
    let mut c = experiment(tmp.path(), "c", 3, "gaussian.rhai");
    c.seed = 12;
    let sc = experiment::run(c, &RunOptions::default(), &mut |_| {}).unwrap();
    assert_ne!(metrics(&sc.run_dir), ma);
}

#[test]
fn resume_after_a_stop_equals_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    // The working script (imports gaussian.rhai) and a reward script: the
    // resumed run loads both from the run directory's copies.
    let with_scripts = |name: &str| {
        let mut e = experiment(tmp.path(), name, 4, "../guidance.rhai");
        e.guidance.reward = Some(
            root()
                .join("scripts/reward/step_penalty.rhai")
                .display()
                .to_string(),
        );
        e
    };
    let full = with_scripts("full");
    let sf = experiment::run(full, &RunOptions::default(), &mut |_| {}).unwrap();

    let part = with_scripts("part");
    let dir = part.run_dir();
    // Stop after 3 steps: a stop writes a checkpoint at step 3, so the
    // resume continues from step 4.
    let s1 = experiment::run(
        part,
        &RunOptions {
            stop_after: Some(3),
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(s1.steps_done, 3);
    let exp: Experiment =
        serde_json::from_str(&std::fs::read_to_string(dir.join("experiment.json")).unwrap())
            .unwrap();
    let s2 = experiment::run(
        exp,
        &RunOptions {
            resume: Some(dir.clone()),
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(s2.steps_done, 4);
    let mf = metrics(&sf.run_dir);
    let mp = metrics(&dir);
    assert_eq!(mf.len(), 4);
    assert_eq!(mf, mp);
    assert_eq!(weights(&sf.run_dir, 4), weights(&dir, 4));
    let ef = std::fs::read_to_string(sf.run_dir.join("eval.jsonl")).unwrap();
    let ep = std::fs::read_to_string(dir.join("eval.jsonl")).unwrap();
    let strip = |s: &str| -> Vec<Value> {
        s.lines()
            .map(|l| {
                let mut v: Value = serde_json::from_str(l).unwrap();
                v.as_object_mut().unwrap().remove("time");
                v
            })
            .collect()
    };
    assert_eq!(strip(&ef), strip(&ep));
    // The resumed run recovered the step-0 regions of both panels: its
    // later lines carry the same in-/out-region split.
    let last = strip(&ep);
    assert!(last
        .iter()
        .any(|v| v["panel"] == "train" && v["step"] == 4 && v["in_region_tasks"].is_u64()));
}

#[test]
fn an_interrupt_ends_the_step_writes_a_checkpoint_and_resumes_exactly() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let tmp = tempfile::tempdir().unwrap();
    let full = experiment(tmp.path(), "full", 4, "gaussian.rhai");
    let sf = experiment::run(full, &RunOptions::default(), &mut |_| {}).unwrap();
    assert!(!sf.interrupted);

    let part = experiment(tmp.path(), "part", 4, "gaussian.rhai");
    let dir = part.run_dir();
    let flag = Arc::new(AtomicBool::new(false));
    let opts = RunOptions {
        interrupt: Some(flag.clone()),
        ..Default::default()
    };
    let mut logs = Vec::new();
    // Raised while step 0 is reported (as a signal would, mid-run): the
    // run stops after it, off the checkpoint schedule (every 2).
    let s1 = experiment::run(part, &opts, &mut |ev| match ev {
        experiment::Event::Step { step: 0, .. } => flag.store(true, Ordering::SeqCst),
        experiment::Event::Log(l) => logs.push(l),
        _ => {}
    })
    .unwrap();
    assert!(s1.interrupted);
    assert_eq!(s1.steps_done, 1);
    assert!(dir.join("checkpoints/step-000001").is_dir());
    assert!(
        logs.iter()
            .any(|l| l.contains("interrupted: stopped after step 1 of 4")),
        "{logs:?}"
    );
    let exp: Experiment =
        serde_json::from_str(&std::fs::read_to_string(dir.join("experiment.json")).unwrap())
            .unwrap();
    let s2 = experiment::run(
        exp,
        &RunOptions {
            resume: Some(dir.clone()),
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(s2.steps_done, 4);
    assert_eq!(metrics(&sf.run_dir), metrics(&dir));
    assert_eq!(weights(&sf.run_dir, 4), weights(&dir, 4));
}

#[test]
fn a_diverging_run_stops_with_a_clear_error_and_saves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut exp = experiment(tmp.path(), "nan", 3, "gaussian.rhai");
    exp.trainer.lr = 1e30;
    exp.trainer.grad_clip = 0.0;
    let dir = exp.run_dir();
    let e = experiment::run(exp, &RunOptions::default(), &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("training stopped"), "{e}");
    assert!(e.contains("is NaN") || e.contains("is inf"), "{e}");
    // The diverged step left no metrics line and no checkpoint.
    let lines = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap_or_default();
    assert!(lines.lines().count() < 3, "{lines}");
    for l in lines.lines() {
        let v: Value = serde_json::from_str(l).unwrap();
        assert!(v["grad_norm"].as_f64().is_some_and(f64::is_finite), "{l}");
    }
    assert!(!dir.join("checkpoints/step-000003").exists());
}

#[test]
fn bad_experiment_file_gives_a_positioned_error_and_starts_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bad.rhai");
    std::fs::write(
        &path,
        "#{\n  name: \"bad\",\n  steps: 2,\n  runs_dir: \"RUNS\",\n  model: #{ path: \"models/tiny\" },\n  env: #{ train: \"a\", test: \"b\" },\n  guidance: #{ script: \"g.rhai\" },\n  trainer: #{ learning_rate: 0.1 },\n}\n"
            .replace("RUNS", &tmp.path().join("runs").display().to_string()),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_actguide"))
        .args(["run", path.to_str().unwrap()])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let want = format!(
        "{}:8:15: `trainer.learning_rate`: unknown field",
        path.display()
    );
    assert!(err.contains(&want), "{err}");
    assert!(!tmp.path().join("runs").exists(), "nothing may start");

    // A syntax error is positioned too.
    std::fs::write(&path, "#{\n  name: \"x\",\n  steps: ,\n}\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_actguide"))
        .args(["run", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{}:3:", path.display())), "{err}");
}

#[test]
fn a_script_error_during_the_run_does_not_stop_it() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("flaky.rhai");
    std::fs::write(
        &script,
        "fn plan(task, state) {\n    if task.step == 1 { throw \"boom\"; }\n    prefix_ratio(0.5)\n}\nfn update(batch, state) {\n    if batch.step == 2 { let x = batch.nope + 1; }\n}\n",
    )
    .unwrap();
    let mut exp = experiment(tmp.path(), "flaky", 3, "zero_rl.rhai");
    exp.guidance.script = script.display().to_string();
    exp.evaluation.every = 0;
    let mut errors = Vec::new();
    let s = experiment::run(exp, &RunOptions::default(), &mut |ev| {
        if let experiment::Event::ScriptError(e) = ev {
            errors.push(e);
        }
    })
    .unwrap();
    assert_eq!(s.steps_done, 3);
    let m = metrics(&s.run_dir);
    assert_eq!(m[0]["script_errors"], 0);
    assert!(m[0]["guided_frac"].as_f64().unwrap() > 0.0);
    // Step 1: every plan() call failed → all rollouts unguided.
    assert_eq!(m[1]["script_errors"], 3);
    assert_eq!(m[1]["guided_frac"], 0.0);
    assert_eq!(m[2]["script_errors"], 1);
    assert!(errors[0].contains("flaky.rhai:2:"), "{}", errors[0]);
    assert!(errors[0].contains("boom"), "{}", errors[0]);
    assert!(errors[3].contains("flaky.rhai:6:"), "{}", errors[3]);
}

#[test]
fn a_tokenizer_missing_panel_words_is_named_and_its_actions_are_counted() {
    use actguide::env::panel::read_jsonl;
    let tmp = tempfile::tempdir().unwrap();
    let r = root();
    // A card built from the panel with "fridge" renamed: the real panel's
    // fridge actions hold a word it cannot encode.
    let mut tasks = read_jsonl(&r.join("envs/household/train.jsonl")).unwrap();
    for t in &mut tasks {
        t.goal = t.goal.replace("fridge", "icebox");
        for a in &mut t.expert {
            *a = a.replace("fridge", "icebox");
        }
        t.world = serde_json::from_str(&t.world.to_string().replace("fridge", "icebox")).unwrap();
    }
    let card = tmp.path().join("card");
    actguide::tiny::write_tiny_model_from_panels(&tasks, &[], &card).unwrap();
    let src = format!(
        r#"#{{ name: "unk", seed: 5, steps: 2, runs_dir: "{runs}",
             model: #{{ path: "{card}" }},
             env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 6 }},
             guidance: #{{ script: "{r}/scripts/guidance/fixed.rhai" }},
             rollout: #{{ tasks_per_step: 6, group_size: 2 }},
             trainer: #{{ aux_nll_coef: 0.5 }},
             evaluation: #{{ every: 0, max_tasks: 2 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.path().join("runs").display(),
        card = card.display(),
        r = r.display(),
    );
    let exp = Experiment::from_source("x.rhai", &src).unwrap();
    let mut logs = Vec::new();
    let s = experiment::run(exp, &RunOptions::default(), &mut |e| {
        if let experiment::Event::Log(l) = e {
            logs.push(l)
        }
    })
    .unwrap();
    // Named before training.
    assert!(
        logs.iter().any(|l| l.starts_with(
            "the tokenizer cannot encode 1 word(s) of the panels' expert actions: fridge"
        )),
        "{logs:?}"
    );
    // Counted per step, each in env_errors.jsonl with its task.
    let m = metrics(&s.run_dir);
    let counted: u64 = m
        .iter()
        .filter_map(|l| l["unencodable_actions"].as_u64())
        .sum();
    let errs: Vec<Value> = std::fs::read_to_string(s.run_dir.join("env_errors.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let unk: Vec<&Value> = errs
        .iter()
        .filter(|e| e["error"].as_str().unwrap().contains("cannot encode"))
        .collect();
    assert!(counted > 0, "{m:?}");
    assert_eq!(unk.len() as u64, counted);
    for e in &unk {
        assert!(e["task"].as_str().is_some_and(|t| !t.is_empty()));
        let msg = e["error"].as_str().unwrap();
        assert!(msg.contains("fridge") || msg.contains("[UNK]"), "{msg}");
    }
    assert!(logs
        .iter()
        .any(|l| l.contains("action(s) had words the tokenizer cannot encode")));
}

#[test]
fn depth_metrics_count_the_executed_prefix_not_the_planned_one() {
    use actguide::env::panel::read_jsonl;
    let tmp = tempfile::tempdir().unwrap();
    let r = root();
    // Every task's first expert action is one the env does not know: a
    // planned prefix of 3 executes nothing.
    let mut tasks = read_jsonl(&r.join("envs/household/train.jsonl")).unwrap();
    tasks.retain(|t| t.expert.len() >= 4);
    for t in &mut tasks {
        t.expert[0] = "teleport to the moon".into();
    }
    let panel = tmp.path().join("train.jsonl");
    let text: Vec<String> = tasks
        .iter()
        .map(|t| serde_json::to_string(t).unwrap())
        .collect();
    std::fs::write(&panel, text.join("\n") + "\n").unwrap();
    let script = tmp.path().join("prefix3.rhai");
    std::fs::write(
        &script,
        "fn init(state) {}\nfn plan(task, state) { prefix(3) }\n\
         fn review(task, group, state) {}\nfn update(batch, state) {}\n",
    )
    .unwrap();
    let src = format!(
        r#"#{{ name: "depth", seed: 5, steps: 1, runs_dir: "{runs}",
             model: #{{ path: "{r}/models/tiny" }},
             env: #{{ train: "{panel}", test: "{r}/envs/household/test.jsonl", max_steps: 4 }},
             guidance: #{{ script: "{script}", clusters: 2 }},
             rollout: #{{ tasks_per_step: 2, group_size: 2 }},
             evaluation: #{{ every: 0, max_tasks: 1 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.path().join("runs").display(),
        panel = panel.display(),
        script = script.display(),
        r = r.display(),
    );
    let exp = Experiment::from_source("x.rhai", &src).unwrap();
    let s = experiment::run(exp, &RunOptions::default(), &mut |_| {}).unwrap();
    let m = metrics(&s.run_dir);
    let l = &m[0];
    assert_eq!(l["planned_depth_mean"], 3.0, "{l}");
    assert_eq!(l["depth_mean"], 0.0, "{l}");
    for (_, ratio) in l["depth_ratio_by_cluster"].as_object().unwrap() {
        assert_eq!(ratio.as_f64(), Some(0.0), "{l}");
    }
    let depths: Vec<u64> = l["depths_by_cluster"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|d| d.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()))
        .collect();
    assert_eq!(depths, vec![0; 4], "{l}");
    // Each stopped prefix is counted and logged with its task.
    assert_eq!(l["expert_inadmissible"], 4, "{l}");
    let errs = std::fs::read_to_string(s.run_dir.join("env_errors.jsonl")).unwrap();
    let inadmissible: Vec<Value> = errs
        .lines()
        .map(|x| serde_json::from_str::<Value>(x).unwrap())
        .filter(|e| {
            e["error"]
                .as_str()
                .unwrap()
                .contains("teleport to the moon")
        })
        .collect();
    assert_eq!(inadmissible.len(), 4, "{errs}");
    assert!(inadmissible.iter().all(|e| e["task"]
        .as_str()
        .is_some_and(|t| t.starts_with("household-train-"))));
}
