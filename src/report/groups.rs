//! Seed replicas: runs whose resolved experiments differ only in `seed`
//! (and name) form one group, reported as mean and range over seeds — a
//! single seed says little about an RL run.

use serde_json::Value;

use super::{EvalRow, Run};

/// Mean, smallest and largest value over a group's runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    /// Runs that had the value.
    pub n: usize,
}

impl Spread {
    fn of(xs: impl Iterator<Item = Option<f64>>) -> Option<Spread> {
        let v: Vec<f64> = xs.flatten().collect();
        (!v.is_empty()).then(|| Spread {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            n: v.len(),
        })
    }

    /// `0.524 [0.365, 0.630]`, or the value alone for one run.
    fn show(s: Option<Spread>, decimals: usize) -> String {
        match s {
            None => super::NA.into(),
            Some(s) if s.n == 1 || s.min == s.max => format!("{:.decimals$}", s.mean),
            Some(s) => format!(
                "{:.decimals$} [{:.decimals$}, {:.decimals$}]",
                s.mean, s.min, s.max
            ),
        }
    }
}

/// One group of seed replicas (or a single run).
#[derive(Debug, Clone, PartialEq)]
pub struct GroupRow {
    /// The runs' name without its `-s<seed>` suffix.
    pub name: String,
    pub seeds: Vec<u64>,
    /// At the last evaluation of each run.
    pub train_out_region: Option<Spread>,
    pub test_out_region: Option<Spread>,
    pub train: Option<Spread>,
    pub test: Option<Spread>,
    /// Rollouts per step that were trained on (all minus probes).
    pub trained_per_step: Option<Spread>,
    pub probes_per_step: Option<Spread>,
    pub wall_s: Option<Spread>,
}

/// Column headers of the groups table.
pub const GROUP_HEADERS: [&str; 10] = [
    "strategy",
    "runs",
    "seeds",
    "train out-region",
    "test out-region",
    "train all",
    "test all",
    "trained rollouts / step",
    "probe rollouts / step",
    "wall time (s)",
];

/// Shown above the groups table.
pub(crate) const GROUP_NOTE: &str = "Runs whose experiments differ only in `seed` are one \
    group: mean [min, max] over seeds at each run's last evaluation. Out-region tasks are \
    those the initial policy never solved at step 0. The first row is the initial policy \
    (the step-0 evaluations, mean over runs); its out-region success is 0 by definition.";

/// The experiment without what tells replicas apart: the seed, the name,
/// and in a model path the seed's replica of the entry it came from (GRPO
/// after BC seed 7 starts from `…/bc-s7/model`).
fn replica_key(config: &Value) -> Value {
    let mut c = config.clone();
    let seed = c["seed"].as_u64();
    if let (Some(seed), Some(path)) = (seed, c["model"]["path"].as_str()) {
        let own = format!("-s{seed}/model");
        if let Some(stem) = path.strip_suffix(&own) {
            c["model"]["path"] = Value::String(format!("{stem}/model"));
        }
    }
    if let Some(m) = c.as_object_mut() {
        m.remove("seed");
        m.remove("name");
    }
    c
}

fn last_eval<'a>(run: &'a Run, panel: &'a str) -> Option<&'a EvalRow> {
    run.evals_of(panel).last()
}

/// Group `runs` (in order of first appearance); `None` when no group has
/// two runs (then the summary table says it all).
pub fn seed_groups(runs: &[Run]) -> Option<Vec<GroupRow>> {
    let mut groups: Vec<(Option<Value>, Vec<&Run>)> = Vec::new();
    for r in runs {
        let key = r.config.as_ref().map(replica_key);
        match groups.iter_mut().find(|(k, _)| k.is_some() && *k == key) {
            Some((_, members)) => members.push(r),
            None => groups.push((key, vec![r])),
        }
    }
    if groups.iter().all(|(_, m)| m.len() < 2) {
        return None;
    }
    let mut rows = vec![initial_row(runs)];
    rows.extend(groups.iter().map(|(_, m)| group_row(m)));
    Some(rows)
}

fn group_row(members: &[&Run]) -> GroupRow {
    let first = members[0];
    let name = match first.seed {
        Some(s) => first
            .name
            .strip_suffix(&format!("-s{s}"))
            .unwrap_or(&first.name)
            .to_string(),
        None => first.name.clone(),
    };
    let at_end = |panel: &'static str, f: fn(&EvalRow) -> Option<f64>| {
        Spread::of(members.iter().map(|r| last_eval(r, panel).and_then(f)))
    };
    let per_step = |probes: bool| {
        Spread::of(members.iter().map(|r| {
            let steps = r.steps.iter().filter(|s| s.rollouts.is_some()).count();
            let total: f64 = r.steps.iter().filter_map(|s| s.rollouts).sum();
            let probe: f64 = r.steps.iter().filter_map(|s| s.probe_rollouts).sum();
            let x = if probes { probe } else { total - probe };
            (steps > 0).then(|| x / steps as f64)
        }))
    };
    GroupRow {
        name,
        seeds: members.iter().filter_map(|r| r.seed).collect(),
        train_out_region: at_end("train", |e| e.success_out_region),
        test_out_region: at_end("test", |e| e.success_out_region),
        train: at_end("train", |e| e.success),
        test: at_end("test", |e| e.success),
        trained_per_step: per_step(false),
        probes_per_step: per_step(true),
        // The summary table's figure, so the two tables agree.
        wall_s: Spread::of(members.iter().map(|r| super::summarize(r).wall_s)),
    }
}

/// The step-0 evaluations: the policy every run starts from.
fn initial_row(runs: &[Run]) -> GroupRow {
    let at0 = |panel: &'static str, f: fn(&EvalRow) -> Option<f64>| {
        Spread::of(
            runs.iter()
                .map(|r| r.evals_of(panel).find(|e| e.step == 0).and_then(f)),
        )
    };
    GroupRow {
        name: "initial policy (step 0)".into(),
        seeds: Vec::new(),
        train_out_region: at0("train", |e| e.success_out_region),
        test_out_region: at0("test", |e| e.success_out_region),
        train: at0("train", |e| e.success),
        test: at0("test", |e| e.success),
        trained_per_step: None,
        probes_per_step: None,
        wall_s: None,
    }
}

/// The cells of a group row, as text.
pub fn group_cells(g: &GroupRow) -> [String; 10] {
    let seeds: Vec<String> = g.seeds.iter().map(u64::to_string).collect();
    [
        g.name.clone(),
        if g.seeds.is_empty() {
            super::NA.into()
        } else {
            g.seeds.len().to_string()
        },
        if seeds.is_empty() {
            super::NA.into()
        } else {
            seeds.join(", ")
        },
        Spread::show(g.train_out_region, 3),
        Spread::show(g.test_out_region, 3),
        Spread::show(g.train, 3),
        Spread::show(g.test, 3),
        Spread::show(g.trained_per_step, 1),
        Spread::show(g.probes_per_step, 1),
        Spread::show(g.wall_s, 0),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::StepRow;
    use serde_json::json;

    fn run(name: &str, seed: u64, script: &str, out: f64, rollouts: f64) -> Run {
        Run {
            name: name.into(),
            seed: Some(seed),
            config: Some(json!({ "name": name, "seed": seed, "guidance": { "script": script } })),
            steps: (0..4)
                .map(|s| StepRow {
                    step: s,
                    rollouts: Some(rollouts),
                    probe_rollouts: Some(if script == "bs" { 10.0 } else { 0.0 }),
                    step_s: Some(2.0),
                    ..Default::default()
                })
                .collect(),
            evals: [0, 4]
                .into_iter()
                .map(|step| EvalRow {
                    step,
                    panel: "train".into(),
                    success: Some(if step == 0 { 0.25 } else { 0.5 }),
                    success_out_region: Some(if step == 0 { 0.0 } else { out }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn replicas_group_by_everything_but_seed() {
        let runs = [
            run("g2-s7", 7, "g2", 0.6, 64.0),
            run("bs", 7, "bs", 0.2, 74.0),
            run("g2-s11", 11, "g2", 0.3, 64.0),
            run("g2-s13", 13, "g2", 0.45, 64.0),
        ];
        let rows = seed_groups(&runs).expect("a group of three");
        let names: Vec<&str> = rows.iter().map(|g| g.name.as_str()).collect();
        assert_eq!(names, ["initial policy (step 0)", "g2", "bs"]);
        let g2 = &rows[1];
        assert_eq!(g2.seeds, [7, 11, 13]);
        let out = g2.train_out_region.unwrap();
        assert!((out.mean - 0.45).abs() < 1e-12 && out.min == 0.3 && out.max == 0.6);
        assert_eq!(
            group_cells(g2)[3..].to_vec(),
            [
                "0.450 [0.300, 0.600]",
                "–",
                "0.500",
                "–",
                "64.0",
                "0.0",
                "8"
            ]
        );
        let bs = group_cells(&rows[2]);
        assert_eq!((bs[7].as_str(), bs[8].as_str()), ("64.0", "10.0"));
        let init = group_cells(&rows[0]);
        assert_eq!((init[3].as_str(), init[5].as_str()), ("0.000", "0.250"));
        // No replicas: no groups table.
        assert_eq!(seed_groups(&runs[..2]), None);
    }
}
