//! Integration tests of comparisons (`compare: [...]` experiment files),
//! per-panel in-/out-region evaluation, TensorBoard logging, and
//! `actguide probe`, on the built-in tiny model and household panel.

use std::path::{Path, PathBuf};

use actguide::experiment::probe::{probe, ProbeOptions};
use actguide::experiment::{self, ExperimentFile, RunOptions};
use actguide::report::tensorboard::read_events;
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A small comparison source: `entries` is the body of the compare list.
fn source(runs_dir: &Path, steps: usize, entries: &str) -> String {
    let r = root();
    format!(
        r#"#{{
            name: "cmp",
            seed: 5,
            steps: {steps},
            runs_dir: "{runs}",
            model: #{{ path: "{r}/models/tiny" }},
            env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 6 }},
            guidance: #{{ script: "{r}/scripts/guidance/zero_rl.rhai", clusters: 3 }},
            rollout: #{{ tasks_per_step: 2, group_size: 3 }},
            evaluation: #{{ every: 2, max_tasks: 6, samples: 3, greedy: false, panels: ["test", "train"] }},
            checkpoint: #{{ every: 0 }},
            compare: [{entries}],
        }}"#,
        runs = runs_dir.display(),
        r = r.display(),
    )
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_comparison_runs_each_entry_on_the_same_setup_and_writes_one_report() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root();
    let src = source(
        tmp.path(),
        2,
        &format!(
            r#"#{{ name: "zero" }}, #{{ name: "g2", guidance: #{{ script: "{}/scripts/guidance/gaussian.rhai" }} }}"#,
            r.display()
        ),
    );
    let ExperimentFile::Compare(c) = ExperimentFile::from_source("cmp.rhai", &src).unwrap() else {
        panic!("a compare file is a comparison")
    };
    assert_eq!(c.runs.len(), 2);
    // Everything but the overridden key is shared.
    assert_eq!(c.runs[0].seed, c.runs[1].seed);
    assert_eq!(c.runs[0].rollout, c.runs[1].rollout);
    assert!(c.runs[0].guidance.script.ends_with("zero_rl.rhai"));
    assert!(c.runs[1].guidance.script.ends_with("gaussian.rhai"));
    assert_eq!(
        c.runs[1].guidance.clusters, 3,
        "deep merge keeps sibling keys"
    );

    let out = experiment::run_comparison(&c, &RunOptions::default(), 1, &|_, _| {}).unwrap();
    assert_eq!(out.dir, tmp.path().join("cmp"));
    for name in ["zero", "g2"] {
        let d = out.dir.join(name);
        assert_eq!(lines(&d.join("metrics.jsonl")).len(), 2, "{name}");
        // Both panels at steps 0 and 2, with the region split.
        let ev = lines(&d.join("eval.jsonl"));
        let panels: Vec<(u64, &str)> = ev
            .iter()
            .map(|e| (e["step"].as_u64().unwrap(), e["panel"].as_str().unwrap()))
            .collect();
        assert_eq!(
            panels,
            [(0, "test"), (0, "train"), (2, "test"), (2, "train")]
        );
        for e in &ev {
            let (nin, nout) = (
                e["in_region_tasks"].as_u64().unwrap(),
                e["out_region_tasks"].as_u64().unwrap(),
            );
            assert_eq!(nin + nout, 6);
            if nin > 0 {
                assert!(e["success_in_region"].as_f64().is_some());
            }
        }
        // Step 0 fixes the regions: in-region success there is > 0 by
        // definition and out-region success is 0.
        for e in ev.iter().filter(|e| e["step"] == 0) {
            assert!(e["in_region_ids"].is_array());
            assert_eq!(e["success_out_region"].as_f64(), Some(0.0));
            if e["in_region_tasks"].as_u64().unwrap() > 0 {
                assert!(e["success_in_region"].as_f64().unwrap() > 0.0);
            }
        }
        // TensorBoard: one event per step and per evaluated panel.
        let tb: Vec<PathBuf> = std::fs::read_dir(d.join("tb"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(tb.len(), 1);
        let events = read_events(&tb[0]).unwrap();
        let train_steps: Vec<i64> = events
            .iter()
            .filter(|e| {
                matches!(&e.what, Some(actguide::report::tensorboard::event::What::Summary(s))
                    if s.value.iter().any(|v| v.tag == "train/success"))
            })
            .map(|e| e.step)
            .collect();
        assert_eq!(train_steps, [0, 1]);
    }
    // Same seed, same panel: the two runs' step-0 evaluations agree.
    let e0 = |n: &str| {
        let mut v = lines(&out.dir.join(n).join("eval.jsonl"))[0].clone();
        v.as_object_mut().unwrap().remove("time");
        v
    };
    assert_eq!(e0("zero"), e0("g2"));
    let report = out.report.expect("a report");
    let md = std::fs::read_to_string(report.join("report.md")).unwrap();
    assert!(md.contains("zero") && md.contains("g2"));
    assert!(report.join("report.html").exists());
}

/// A metrics or eval line without its timings (which differ run to run).
fn untimed(mut v: Value) -> Value {
    let m = v.as_object_mut().unwrap();
    m.remove("time");
    m.retain(|k, _| !k.ends_with("tokens_per_s"));
    v
}

#[test]
fn seed_replicas_run_in_parallel_with_the_same_numbers_as_one_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root();
    let src = source(
        tmp.path(),
        2,
        &format!(
            r#"#{{ name: "zero", seeds: [5, 6] }}, #{{ name: "g2", guidance: #{{ script: "{}/scripts/guidance/gaussian.rhai" }} }}"#,
            r.display()
        ),
    );
    let ExperimentFile::Compare(c) = ExperimentFile::from_source("cmp.rhai", &src).unwrap() else {
        panic!("a compare file is a comparison")
    };
    let names: Vec<(&str, u64)> = c.runs.iter().map(|e| (e.name.as_str(), e.seed)).collect();
    assert_eq!(names, [("zero-s5", 5), ("zero-s6", 6), ("g2", 5)]);
    let seen = std::sync::Mutex::new(std::collections::BTreeSet::new());
    let one = experiment::run_comparison(&c, &RunOptions::default(), 1, &|_, _| {}).unwrap();
    let two = experiment::run_comparison(&c, &RunOptions::default(), 2, &|n, _| {
        seen.lock().unwrap().insert(n.to_string());
    })
    .unwrap();
    assert_eq!(two.dir, tmp.path().join("cmp-2"));
    assert_eq!(
        seen.into_inner().unwrap().into_iter().collect::<Vec<_>>(),
        ["g2", "zero-s5", "zero-s6"],
        "every event carries its entry"
    );
    for name in ["zero-s5", "zero-s6", "g2"] {
        for file in ["metrics.jsonl", "eval.jsonl"] {
            let a: Vec<Value> = lines(&one.dir.join(name).join(file))
                .into_iter()
                .map(untimed)
                .collect();
            let b: Vec<Value> = lines(&two.dir.join(name).join(file))
                .into_iter()
                .map(untimed)
                .collect();
            assert_eq!(a, b, "{name}/{file}: jobs 2 gives what jobs 1 gave");
        }
    }
    // The seeds differ, so the replicas' rollouts differ.
    let m = |n: &str| {
        lines(&one.dir.join(n).join("metrics.jsonl"))
            .into_iter()
            .map(untimed)
            .collect::<Vec<_>>()
    };
    assert_ne!(m("zero-s5"), m("zero-s6"));
    // The report aggregates the replicas.
    let md = std::fs::read_to_string(one.report.unwrap().join("report.md")).unwrap();
    assert!(md.contains("| zero | 2 | 5, 6 |"), "{md}");
    assert!(md.contains("| g2 | 1 | 5 |"), "{md}");
}

#[test]
fn imitation_arms_run_in_a_comparison_and_grpo_starts_from_the_bc_model() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root();
    // BC (an `sft` entry evaluated as RL is), GRPO from BC's model (seed
    // replicas pair up), LUFFY, and zero-RL, on a tiny budget.
    let src = source(
        tmp.path(),
        2,
        &format!(
            r#"#{{ name: "bc", seeds: [5, 6], sft: #{{ tasks_per_step: 2, evaluate: true, eval_tasks: 2 }} }},
               #{{ name: "bc_grpo", seeds: [5, 6], model: #{{ path: "@bc" }} }},
               #{{ name: "luffy", guidance: #{{ script: "{r}/scripts/guidance/luffy.rhai" }} }},
               #{{ name: "zero" }}"#,
            r = r.display()
        ),
    );
    let ExperimentFile::Compare(c) = ExperimentFile::from_source("cmp.rhai", &src).unwrap() else {
        panic!("a compare file is a comparison")
    };
    assert_eq!(c.after, [None, None, Some(0), Some(1), None, None]);
    // Two at a time: bc_grpo-s5 waits for bc-s5 while the other job runs.
    let out = experiment::run_comparison(&c, &RunOptions::default(), 2, &|_, _| {}).unwrap();
    for s in [5, 6] {
        let bc = out.dir.join(format!("bc-s{s}"));
        assert_eq!(lines(&bc.join("sft.jsonl")).len(), 2);
        assert!(bc.join("model").join("config.json").exists());
        let ev = lines(&bc.join("eval.jsonl"));
        let at: Vec<(u64, &str)> = ev
            .iter()
            .map(|e| (e["step"].as_u64().unwrap(), e["panel"].as_str().unwrap()))
            .collect();
        assert_eq!(
            at,
            [(0, "test"), (0, "train"), (2, "test"), (2, "train")],
            "BC is evaluated unguided as RL is"
        );
        let grpo = out.dir.join(format!("bc_grpo-s{s}"));
        let exp: Value =
            serde_json::from_str(&std::fs::read_to_string(grpo.join("experiment.json")).unwrap())
                .unwrap();
        assert_eq!(
            exp["model"]["path"].as_str().unwrap(),
            bc.join("model").display().to_string(),
            "GRPO starts from its own seed's BC model"
        );
        assert_eq!(lines(&grpo.join("metrics.jsonl")).len(), 2);
    }
    // BC from the same start and seed: its step-0 evaluation is zero-RL's.
    let e0 = |n: &str| untimed(lines(&out.dir.join(n).join("eval.jsonl"))[0].clone());
    assert_eq!(e0("bc-s5"), e0("zero"));
    let md = std::fs::read_to_string(out.report.unwrap().join("report.md")).unwrap();
    for row in [
        "| bc | 2 | 5, 6 |",
        "| bc_grpo | 2 | 5, 6 |",
        "| luffy | 1 | 5 |",
    ] {
        assert!(md.contains(row), "{row}: {md}");
    }
}

#[test]
fn an_entry_model_names_an_earlier_imitation_arm() {
    let tmp = tempfile::tempdir().unwrap();
    for (entries, want) in [
        (
            r#"#{ name: "g", model: #{ path: "@bc" } }, #{ name: "bc", sft: #{} }"#,
            "names no earlier entry \"bc\"",
        ),
        (
            r#"#{ name: "zero" }, #{ name: "g", model: #{ path: "@zero" } }"#,
            "entry \"zero\" writes no model",
        ),
    ] {
        let e = ExperimentFile::from_source("cmp.rhai", &source(tmp.path(), 1, entries))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(want) && e.starts_with("cmp.rhai:"),
            "{entries}: {e}"
        );
    }
}

#[test]
fn comparison_entries_are_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let dup = source(tmp.path(), 1, r#"#{ name: "a" }, #{ name: "a" }"#);
    let e = ExperimentFile::from_source("cmp.rhai", &dup)
        .unwrap_err()
        .to_string();
    assert!(e.contains("used twice"), "{e}");
    assert!(e.starts_with("cmp.rhai:"), "{e}");
    let unnamed = source(tmp.path(), 1, r#"#{ seed: 3 }"#);
    let e = ExperimentFile::from_source("cmp.rhai", &unnamed)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`compare[0]` needs a `name`"), "{e}");
    let bad_key = source(
        tmp.path(),
        1,
        r#"#{ name: "x", rollout: #{ group_sise: 2 } }"#,
    );
    let e = ExperimentFile::from_source("cmp.rhai", &bad_key)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("compare entry \"x\"") && e.contains("group_sise"),
        "{e}"
    );
    for (entries, want) in [
        (
            r#"#{ name: "a", seeds: [] }"#,
            "`seeds` must be a non-empty array",
        ),
        (
            r#"#{ name: "a", seeds: [1, -2] }"#,
            "`seeds` must be a non-empty array",
        ),
        (
            r#"#{ name: "a", seeds: [1], seed: 2 }"#,
            "`seed` or `seeds`",
        ),
        (
            r#"#{ name: "a-s1" }, #{ name: "a", seeds: [1] }"#,
            "used twice",
        ),
    ] {
        let e = ExperimentFile::from_source("cmp.rhai", &source(tmp.path(), 1, entries))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(want) && e.starts_with("cmp.rhai:"),
            "{entries}: {e}"
        );
    }
    // A single experiment loader refuses a comparison instead of ignoring it.
    let ok = source(tmp.path(), 1, r#"#{ name: "a" }"#);
    assert!(experiment::Experiment::from_source("cmp.rhai", &ok).is_err());
}

#[test]
fn a_comparison_checks_every_entry_before_the_first_one_trains() {
    let r = root().display().to_string();
    let missing = format!("{r}/scripts/guidance/no_such_script.rhai");
    for (bad, cause) in [
        (
            format!(r#"guidance: #{{ script: "{missing}" }}"#),
            missing.clone(),
        ),
        (
            format!(r#"guidance: #{{ script: "{r}/tests/scripts/broken/syntax.rhai" }}"#),
            "syntax.rhai".to_string(),
        ),
        (
            format!(r#"guidance: #{{ reward: "{missing}" }}"#),
            missing.clone(),
        ),
        (
            format!(r#"env: #{{ test: "{r}/envs/household/no_such_panel.jsonl" }}"#),
            "no_such_panel.jsonl".to_string(),
        ),
        (
            format!(r#"model: #{{ path: "{r}/models/no_such_model" }}"#),
            "no_such_model".to_string(),
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let src = source(
            tmp.path(),
            1,
            &format!(r#"#{{ name: "fine" }}, #{{ name: "bad", {bad} }}"#),
        );
        let ExperimentFile::Compare(c) = ExperimentFile::from_source("cmp.rhai", &src).unwrap()
        else {
            panic!("a compare file is a comparison")
        };
        let e = experiment::run_comparison(&c, &RunOptions::default(), 1, &|_, _| {})
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("compare entry \"bad\": ") && e.contains(&cause),
            "{bad}: {e}"
        );
        // Found before anything ran: not even the comparison's directory
        // (so no run directory of the first entry) exists.
        assert!(!tmp.path().join("cmp").exists(), "{bad}");
    }
}

#[test]
fn probe_walks_the_expert_trajectory_and_is_deterministic() {
    let tmp = tempfile::tempdir().unwrap();
    let ExperimentFile::Compare(c) =
        ExperimentFile::from_source("cmp.rhai", &source(tmp.path(), 1, r#"#{ name: "p" }"#))
            .unwrap()
    else {
        panic!()
    };
    let mut exp = c.runs[0].clone();
    exp.runs_dir = tmp.path().display().to_string();
    let s = experiment::run(exp, &RunOptions::default(), &mut |_| {}).unwrap();
    let o = ProbeOptions {
        panel: "test".into(),
        tasks: vec![],
        per_cluster: 1,
        k: 4,
        initial: false,
        seed: 3,
        device: None,
    };
    let a = probe(&s.run_dir, &o).unwrap();
    let b = probe(&s.run_dir, &o).unwrap();
    assert_eq!(a, b, "same seed, same probe");
    // One task per cluster, one point per expert state.
    assert_eq!(a.tasks.len(), 3);
    let clusters: Vec<usize> = a.tasks.iter().map(|t| t.cluster).collect();
    assert_eq!(clusters, [0, 1, 2]);
    for t in &a.tasks {
        assert_eq!(t.points.len(), t.expert_len, "{}", t.id);
        assert!(t.barrier <= t.expert_len);
        // From the barrier on, every state reaches reward; just before it
        // none of the K continuations did.
        assert!(t.points[t.barrier..].iter().all(|p| p.pass));
        if t.barrier > 0 {
            assert!(!t.points[t.barrier - 1].pass);
        }
        // The plan changes the prompt, so the logits move.
        assert!(t.points.iter().all(|p| p.delta_logit > 0.0), "{}", t.id);
        assert!(t.points.iter().all(|p| p.successes <= p.k));
    }
    // Named tasks, and an unknown id is a clear error.
    let one = probe(
        &s.run_dir,
        &ProbeOptions {
            tasks: vec![a.tasks[1].id.clone()],
            ..o.clone()
        },
    )
    .unwrap();
    assert_eq!(one.tasks.len(), 1);
    assert_eq!(one.tasks[0].id, a.tasks[1].id);
    let e = probe(
        &s.run_dir,
        &ProbeOptions {
            tasks: vec!["no-such-task".into()],
            ..o.clone()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("no-such-task"), "{e}");
    // The figure draws every task.
    let svg = actguide::report::probe_plot::probe_svg(&a).unwrap();
    assert!(svg.starts_with("<svg"));
    for t in &a.tasks {
        assert!(svg.contains(&t.id));
    }
}

#[test]
fn every_example_experiment_loads() {
    // Example files are documentation: each must evaluate, as one run or
    // a comparison (paths inside stay relative to the repository root).
    let mut n = 0;
    for e in std::fs::read_dir(root().join("examples")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "rhai") {
            let loaded = ExperimentFile::load(&p);
            assert!(loaded.is_ok(), "{}: {:?}", p.display(), loaded.err());
            n += 1;
        }
    }
    assert!(n >= 10, "{n} example files");
    let ExperimentFile::Compare(c) =
        ExperimentFile::load(&root().join("examples/compare.rhai")).unwrap()
    else {
        panic!("examples/compare.rhai is a comparison")
    };
    // The headline: 3 seeds of GRPO, ActGuide-RL and G², one of the rest.
    let names: Vec<&str> = c.runs.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names.len(), 14, "{names:?}");
    for s in [
        "grpo-s13",
        "actguide-s11",
        "g2-s7",
        "gigpo",
        "binary_search",
        "g2_no_noise",
        "g2_no_aux",
        "g2_one_cluster",
    ] {
        assert!(names.contains(&s), "{s} in {names:?}");
    }
}
