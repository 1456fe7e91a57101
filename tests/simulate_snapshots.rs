//! Every bundled guidance strategy's schedule, played by `simulate` against
//! the synthetic learner, is pinned by a snapshot; the probing baselines'
//! cost relative to Agent-G² is checked; and the error text of a set of
//! broken scripts is pinned.

use std::path::Path;

use actguide::guidance::check_script;
use actguide::guidance::simulate::{simulate_file, table, SimParams, SimReport};

const STRATEGIES: [&str; 15] = [
    "zero_rl",
    "fixed",
    "linear",
    "cosine",
    "step_decay",
    "target_acc",
    "binary_search",
    "enumeration",
    "actguide",
    "gaussian",
    "luffy",
    "bread",
    "adaback",
    "reverse_curriculum",
    "trapo",
];

fn sim(script: &str, steps: usize) -> SimReport {
    let p = SimParams {
        steps,
        ..SimParams::default()
    };
    simulate_file(
        Path::new(script),
        Path::new("envs/household/train.jsonl"),
        &p,
    )
    .unwrap_or_else(|e| panic!("{script}: {e}"))
}

#[test]
fn every_bundled_strategy_has_a_pinned_schedule() {
    // A new bundled strategy must be added here (and get a snapshot).
    let mut on_disk: Vec<String> = std::fs::read_dir("scripts/guidance")
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rhai"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    on_disk.sort();
    let mut listed: Vec<String> = STRATEGIES.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(on_disk, listed);
    for s in STRATEGIES {
        let report = sim(&format!("scripts/guidance/{s}.rhai"), 12);
        for row in &report.rows {
            assert!(row.errors.is_empty(), "{s}: {:?}", row.errors);
        }
        insta::assert_snapshot!(format!("simulate_{s}"), table(&report));
    }
    let report = sim("scripts/guidance.rhai", 12);
    insta::assert_snapshot!("simulate_guidance_rhai", table(&report));
}

#[test]
fn simulate_is_deterministic_and_json_carries_the_table() {
    let a = sim("scripts/guidance/gaussian.rhai", 5);
    let b = sim("scripts/guidance/gaussian.rhai", 5);
    assert_eq!(a.rows, b.rows);
    let j = serde_json::to_value(&a).unwrap();
    assert_eq!(j["rows"].as_array().unwrap().len(), 5);
    assert!(j["rows"][0]["clusters"]["0"]["depth_mu"].is_number());
}

/// Agent-G²'s cost argument: probing baselines spend ≥ 3x its rollouts.
#[test]
fn gaussian_spends_at_most_a_third_of_the_probing_baselines() {
    let g = sim("scripts/guidance/gaussian.rhai", 30).mean_rollouts_per_step;
    let bs = sim("scripts/guidance/binary_search.rhai", 30).mean_rollouts_per_step;
    let en = sim("scripts/guidance/enumeration.rhai", 30).mean_rollouts_per_step;
    assert!(g * 3.0 <= bs, "gaussian {g}, binary_search {bs}");
    assert!(g * 3.0 <= en, "gaussian {g}, enumeration {en}");
}

#[test]
fn broken_scripts_give_positioned_errors() {
    let mut names: Vec<_> = std::fs::read_dir("tests/scripts/broken")
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    let mut out = String::new();
    for p in names {
        let shown = p.display().to_string();
        match check_script(Path::new(&shown)) {
            Ok(trace) => panic!("{shown} passed check:\n{}", trace.join("\n")),
            Err(e) => out.push_str(&format!("{e}\n")),
        }
    }
    insta::assert_snapshot!("broken_scripts", out);
}
