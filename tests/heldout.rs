//! The held-out benchmark (examples/heldout_sft.rhai, examples/heldout.rhai):
//! its panels are reproducible selections of the committed household
//! panels, its calibration (the scripted procedure's ceiling) is pinned,
//! and every arm of its comparison runs on a tiny budget.

use std::path::{Path, PathBuf};

use actguide::env::household::{add_expert_noise, procedure_success};
use actguide::env::panel::{self, keep_expert_share, read_jsonl, Selection};
use actguide::experiment::{self, ExperimentFile, RunOptions, ENTRY_MODEL};
use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn household(name: &str) -> PathBuf {
    root().join("envs/household").join(name)
}

/// `actguide tasks select SRC [--min-expert 5] --world-set reveal=true`.
fn revealed(src: &str, min_expert: Option<usize>) -> Vec<actguide::env::Task> {
    let mut t = panel::select(
        &read_jsonl(&household(src)).unwrap(),
        &Selection {
            min_expert,
            ..Default::default()
        },
    );
    panel::set_world_key(&mut t, "reveal", &json!(true)).unwrap();
    t
}

fn bytes(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap()
}

#[test]
fn the_reveal_panels_are_reproducible_selections() {
    for (src, min, out, n) in [
        ("train.jsonl", None, "reveal/train.jsonl", 256),
        ("test.jsonl", None, "reveal/test.jsonl", 64),
        ("train.jsonl", Some(5), "reveal/long115.jsonl", 115),
        ("test.jsonl", Some(5), "reveal/long_test.jsonl", 32),
    ] {
        let t = revealed(src, min);
        assert_eq!(t.len(), n, "{out}");
        assert_eq!(panel::to_jsonl(&t), bytes(&household(out)), "{out}");
    }
    // Scarce data: 29 of the 115 keep their expert actions (seed 1).
    let mut t = revealed("train.jsonl", Some(5));
    assert_eq!(keep_expert_share(&mut t, 0.25, 1), 29);
    assert_eq!(
        panel::to_jsonl(&t),
        bytes(&household("reveal/long115_share25.jsonl"))
    );
    // Noisy demonstrations: ε 0.3, at most 10 actions, seed 1.
    let mut t = revealed("train.jsonl", Some(5));
    let st = add_expert_noise(&mut t, 0.3, 10, 1).unwrap();
    assert_eq!(
        (
            st.tasks,
            st.changed,
            st.kept_clean,
            st.clean_actions,
            st.noisy_actions
        ),
        (115, 85, 4, 738, 928)
    );
    assert_eq!(
        panel::to_jsonl(&t),
        bytes(&household("reveal/long115_noise30.jsonl"))
    );
    // The plan-reading prior's panel and its disjoint benchmark.
    let types = |ts: &[&str]| ts.iter().map(|t| t.to_string()).collect::<Vec<_>>();
    let sel = |src: &str, min, max, ts: &[&str]| {
        panel::select(
            &read_jsonl(&household(src)).unwrap(),
            &Selection {
                min_expert: min,
                max_expert: max,
                types: types(ts),
                ..Default::default()
            },
        )
    };
    let mut prior = sel("reveal/train.jsonl", None, Some(4), &[]);
    prior.extend(sel(
        "reveal/train.jsonl",
        Some(5),
        None,
        &[
            "pick_heat_then_place",
            "pick_and_place",
            "look_at_obj_in_light",
            "pick_two_obj",
        ],
    ));
    assert_eq!(prior.len(), 205);
    assert_eq!(
        panel::to_jsonl(&prior),
        bytes(&household("reveal/plan_prior.jsonl"))
    );
    let cc = ["pick_clean_then_place", "pick_cool_then_place"];
    for (src, out, n) in [
        ("reveal/long115.jsonl", "reveal/long_cc.jsonl", 51),
        ("reveal/long_test.jsonl", "reveal/long_cc_test.jsonl", 16),
    ] {
        let t = sel(src, None, None, &cc);
        assert_eq!(t.len(), n, "{out}");
        assert_eq!(panel::to_jsonl(&t), bytes(&household(out)), "{out}");
        // Disjoint: no benchmark task's type has a long task in the prior.
        assert!(t.iter().all(|x| !prior.iter().any(|p| p.id == x.id)));
    }
}

/// The other comparisons of the search load with the arms their docs name.
#[test]
fn the_search_comparisons_load() {
    for (file, names) in [
        (
            "examples/plan_prior.rhai",
            &[
                "actguide-s7",
                "actguide-s11",
                "actguide-s13",
                "grpo-s7",
                "grpo-s11",
                "grpo-s13",
                "bc",
                "g2",
            ][..],
        ),
        (
            "examples/heldout_180.rhai",
            &[
                "bc-s7",
                "bc-s11",
                "bc-s13",
                "g2-s7",
                "g2-s11",
                "g2-s13",
                "bc_noisy-s7",
                "bc_noisy-s11",
                "bc_noisy-s13",
                "g2_noisy-s7",
                "g2_noisy-s11",
                "g2_noisy-s13",
            ][..],
        ),
    ] {
        let ExperimentFile::Compare(c) = ExperimentFile::load(&root().join(file)).unwrap() else {
            panic!("{file} is a comparison")
        };
        let got: Vec<&str> = c.runs.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(got, names, "{file}");
        assert!(c.runs.iter().all(|e| e.steps >= 60), "{file}");
    }
    let ExperimentFile::Single(s) =
        ExperimentFile::load(&root().join("examples/plan_prior_sft.rhai")).unwrap()
    else {
        panic!("plan_prior_sft.rhai is one experiment")
    };
    let sft = s.sft.expect("an sft section");
    assert_eq!((sft.plan_share, sft.max_expert_len), (0.5, Some(10)));
}

/// The noisy-expert round (examples/heldout_noisy.rhai): its arms, and
/// Agent-G² executing noisy prefixes on a tiny budget without an
/// inadmissible expert action or an env error (every detour replays).
#[test]
fn the_noisy_expert_round_executes_its_demonstrations() {
    let ExperimentFile::Compare(c) =
        ExperimentFile::load(&root().join("examples/heldout_noisy.rhai")).unwrap()
    else {
        panic!("examples/heldout_noisy.rhai is a comparison")
    };
    let names: Vec<&str> = c.runs.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        ["bc-s7", "bc-s11", "bc-s13", "bc180", "g2-s7", "g2-s11", "g2-s13", "bc_grpo"]
    );
    assert_eq!(c.after[7], Some(0), "bc_grpo starts from bc-s7's model");
    let tmp = tempfile::tempdir().unwrap();
    let mut e = c.runs[4].clone();
    on_tiny_model(&mut e, tmp.path());
    e.steps = 3;
    e.rollout.tasks_per_step = 4;
    let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
    let m = lines(&s.run_dir.join("metrics.jsonl"));
    assert_eq!(m.len(), 3);
    let mut depth = 0.0;
    for l in &m {
        assert_eq!(l["env_errors"], 0, "{l}");
        // Written only when some expert action was refused.
        assert!(l.get("expert_inadmissible").is_none(), "{l}");
        depth += l["depth_mean"].as_f64().unwrap_or(0.0);
    }
    assert!(depth > 0.0, "G² executed no prefix: {m:?}");
}

#[test]
fn the_procedure_calibrates_the_regimes() {
    let all = |panel: &str, slack: Option<usize>| {
        let tasks = read_jsonl(&household(panel)).unwrap();
        let table = procedure_success(&tasks, 50, slack).unwrap();
        let solved: f64 = table.iter().map(|(_, n, s)| s * *n as f64).sum();
        solved.round() as usize
    };
    // Revealed: the agent's memory holds every object, so the procedure
    // plans straight away and solves every held-out task in the budget.
    assert_eq!(all("reveal/long_test.jsonl", Some(2)), 32);
    // Hidden (the barrier benchmark's panels): it has to search, and the
    // expert's length + 2 leaves room for that in 11 of the 32.
    assert_eq!(all("long_test.jsonl", Some(2)), 11);
    assert_eq!(all("long_test.jsonl", None), 32);
}

/// `e` on the tiny model, its files found from the repository root, its
/// run under `runs_dir`: groups of 2, no evaluation but the end's, 2 tasks.
fn on_tiny_model(e: &mut actguide::experiment::Experiment, runs_dir: &Path) {
    let abs = |p: &str| root().join(p).display().to_string();
    e.model.path = abs("models/tiny");
    e.env.train = abs(&e.env.train);
    e.env.test = abs(&e.env.test);
    e.guidance.script = abs(&e.guidance.script);
    e.runs_dir = runs_dir.display().to_string();
    e.rollout.group_size = 2;
    e.evaluation.every = 0;
    e.evaluation.max_tasks = 2;
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn every_arm_of_the_heldout_comparison_runs_on_a_tiny_budget() {
    let ExperimentFile::Compare(mut c) =
        ExperimentFile::load(&root().join("examples/heldout.rhai")).unwrap()
    else {
        panic!("examples/heldout.rhai is a comparison")
    };
    let names: Vec<&str> = c.runs.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["bc", "g2", "bc_grpo", "grpo", "luffy", "actguide"]);
    let tmp = tempfile::tempdir().unwrap();
    c.runs_dir = tmp.path().display().to_string();
    let abs = |p: &str| root().join(p).display().to_string();
    for e in &mut c.runs {
        // The warm start is not built here: the tiny model stands in.
        if !e.model.path.starts_with(ENTRY_MODEL) {
            e.model.path = abs("models/tiny");
        }
        e.env.train = abs(&e.env.train);
        e.env.test = abs(&e.env.test);
        e.guidance.script = abs(&e.guidance.script);
        e.steps = 2;
        e.rollout.tasks_per_step = 2;
        e.rollout.group_size = 3;
        e.evaluation.every = 2;
        e.evaluation.max_tasks = 3;
        if let Some(s) = &mut e.sft {
            s.tasks_per_step = 2;
        }
    }
    let out = experiment::run_comparison(&c, &RunOptions::default(), 1, &|_, _| {}).unwrap();
    for name in ["bc", "g2", "bc_grpo", "grpo", "luffy", "actguide"] {
        let d = out.dir.join(name);
        let ev = lines(&d.join("eval.jsonl"));
        assert_eq!(ev.len(), 4, "{name}: steps 0 and 2, test and train");
        let steps = if name == "bc" {
            "sft.jsonl"
        } else {
            "metrics.jsonl"
        };
        assert_eq!(lines(&d.join(steps)).len(), 2, "{name}");
    }
    // The guided arms were guided; GRPO was not.
    let guided = |name: &str| {
        lines(&out.dir.join(name).join("metrics.jsonl"))
            .iter()
            .map(|l| l["rollouts"].as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(guided("grpo"), 12);
    assert!(guided("actguide") >= 12);
    let md = std::fs::read_to_string(out.report.unwrap().join("report.md")).unwrap();
    for name in ["bc", "g2", "bc_grpo", "grpo", "luffy", "actguide"] {
        assert!(md.contains(&format!("| {name} |")), "{name}: {md}");
    }
}

#[test]
fn a_scarce_data_panel_trains_every_task_and_guides_only_those_with_experts() {
    let tasks = read_jsonl(&household("reveal/long115_share25.jsonl")).unwrap();
    let with: Vec<&str> = tasks
        .iter()
        .filter(|t| !t.expert.is_empty())
        .map(|t| t.id.as_str())
        .collect();
    assert_eq!(with.len(), 29);
    // A task without expert actions keeps the budget its difficulty gives.
    assert!(tasks
        .iter()
        .all(|t| t.budget_len() == Some(t.difficulty) && t.difficulty >= 5));
    let ExperimentFile::Compare(c) =
        ExperimentFile::load(&root().join("examples/heldout.rhai")).unwrap()
    else {
        panic!("examples/heldout.rhai is a comparison")
    };
    let tmp = tempfile::tempdir().unwrap();
    // LUFFY: each group's last member replays the expert where there is
    // one, and is an on-policy rollout where there is none.
    let mut e = c.runs.iter().find(|e| e.name == "luffy").unwrap().clone();
    e.env.train = "envs/household/reveal/long115_share25.jsonl".into();
    on_tiny_model(&mut e, tmp.path());
    e.steps = 4;
    let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
    let m = lines(&s.run_dir.join("metrics.jsonl"));
    let guided: Vec<f64> = m
        .iter()
        .map(|l| l["guided_frac"].as_f64().unwrap())
        .collect();
    for l in &m {
        assert_eq!(l["env_errors"], 0, "{l}");
    }
    // 32 tasks drawn, about a quarter of them with experts: guided_frac
    // is the share of expert members, below the 1/2 that a replay in
    // every group would give.
    let total: f64 = guided.iter().sum::<f64>() / guided.len() as f64;
    assert!(total > 0.0 && total < 0.5, "{guided:?}");
}

/// The headline (examples/headline.rhai): its warm start is an entry of
/// its own, every other arm starts from it (BC + GRPO from its seed's BC
/// model), and every arm runs on a tiny budget.
#[test]
fn every_arm_of_the_headline_runs_on_a_tiny_budget() {
    let ExperimentFile::Compare(mut c) =
        ExperimentFile::load(&root().join("examples/headline.rhai")).unwrap()
    else {
        panic!("examples/headline.rhai is a comparison")
    };
    let arms = ["bc", "g2", "actguide", "grpo", "luffy", "bc_grpo"];
    let mut want = vec!["warm".to_string()];
    for a in arms {
        want.extend([7, 11, 13].map(|s| format!("{a}-s{s}")));
    }
    let names: Vec<String> = c.runs.iter().map(|e| e.name.clone()).collect();
    assert_eq!(names, want);
    for (e, after) in c.runs.iter().zip(&c.after) {
        let from = after.map(|j| c.runs[j].name.clone());
        let expect = match e.name.split_once("-s") {
            None => None,
            Some(("bc_grpo", s)) => Some(format!("bc-s{s}")),
            Some(_) => Some("warm".to_string()),
        };
        assert_eq!(from, expect, "{}", e.name);
        assert!(e.trainer.skip_zero_grad, "{}", e.name);
    }
    let tmp = tempfile::tempdir().unwrap();
    c.runs_dir = tmp.path().display().to_string();
    let abs = |p: &str| root().join(p).display().to_string();
    for e in &mut c.runs {
        if !e.model.path.starts_with(ENTRY_MODEL) {
            e.model.path = abs(&e.model.path);
        }
        e.env.train = abs(&e.env.train);
        e.env.test = abs(&e.env.test);
        e.guidance.script = abs(&e.guidance.script);
        e.steps = 2;
        e.rollout.tasks_per_step = 2;
        e.rollout.group_size = 3;
        e.evaluation.every = 2;
        e.evaluation.max_tasks = 3;
        if let Some(s) = &mut e.sft {
            s.tasks_per_step = 2;
            s.eval_tasks = s.eval_tasks.min(3);
        }
    }
    let out = experiment::run_comparison(&c, &RunOptions::default(), 2, &|_, _| {}).unwrap();
    assert!(out.dir.join("warm/model").is_dir());
    let step0 = |name: &str| lines(&out.dir.join(name).join("eval.jsonl"))[0].clone();
    for name in &want[1..] {
        let d = out.dir.join(name);
        assert_eq!(lines(&d.join("eval.jsonl")).len(), 4, "{name}");
        let log = if name.starts_with("bc-") {
            "sft.jsonl"
        } else {
            "metrics.jsonl"
        };
        assert_eq!(lines(&d.join(log)).len(), 2, "{name}");
    }
    // Same seed, same warm start: the RL arms' step-0 evaluations agree.
    for a in ["g2", "actguide", "grpo", "luffy"] {
        for s in [7, 11, 13] {
            assert_eq!(
                step0(&format!("{a}-s{s}"))["success"],
                step0(&format!("g2-s{s}"))["success"]
            );
        }
    }
    let md = std::fs::read_to_string(out.report.unwrap().join("report.md")).unwrap();
    for a in arms {
        assert!(md.contains(&format!("| {a} |")), "{a}: {md}");
    }
}
