//! Review rounds: `plan` gives each task its first round; after each round
//! the script's `review` may ask for another (probe, replace or append) or
//! select an earlier round as the training group. Every task's pending
//! round is executed in one batch, so generation stays batched across
//! tasks. The same driver serves training runs and `simulate`.

use rhai::{Array, Dynamic, Map};

use crate::guidance::decode::{Review, RoundUse};
use crate::guidance::runtime::GuidanceRuntime;
use crate::guidance::script_inputs::TaskView;
use crate::guidance::spec::GuidanceSpec;
use crate::script::ScriptError;

/// What the driver needs to know about an executed rollout (defined with
/// the views, which build a task's results from it).
pub use crate::guidance::script_inputs::Outcome;

/// One rollout to execute: task index (into the step's tasks) and spec.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    pub task: usize,
    pub spec: GuidanceSpec,
}

/// An executed rollout and the round it belongs to.
#[derive(Debug, Clone)]
pub struct Rollout<E> {
    pub ep: E,
    pub spec: GuidanceSpec,
    pub round: usize,
    pub use_: RoundUse,
    pub keep: bool,
}

/// All rounds of one task in one step.
#[derive(Debug, Clone)]
pub struct TaskRounds<E> {
    pub all: Vec<Rollout<E>>,
    /// Indices into `all` of the training group (kept probes included).
    pub group: Vec<usize>,
    /// Rounds run (1 = only the planned one).
    pub rounds: usize,
    /// The review asked for more rounds than the bound allows.
    pub bounded: bool,
}

impl<E> TaskRounds<E> {
    pub fn spent(&self) -> usize {
        self.all.len()
    }

    pub fn probes(&self) -> usize {
        self.all
            .iter()
            .filter(|r| r.use_ == RoundUse::Probe)
            .count()
    }

    pub fn training(&self) -> impl Iterator<Item = &Rollout<E>> {
        self.group.iter().map(|&i| &self.all[i])
    }
}

/// Runs one batch of requests (with the runtime, for reward and intervention
/// scripts) and returns one outcome per request, in order.
pub type Exec<'a, E, X> = dyn FnMut(&mut GuidanceRuntime, &[Request]) -> Result<Vec<E>, X> + 'a;

/// Errors and counters of one drive.
#[derive(Debug, Default)]
pub struct DriveReport {
    pub errors: Vec<ScriptError>,
    pub bound_hits: usize,
}

/// Run `plan`, then rounds until every task's review accepts (or the bound
/// of `max_rounds` extra rounds per task is reached). `exec` runs one batch
/// of requests (with the runtime, for reward and intervention scripts) and
/// returns one outcome per request, in order.
pub fn drive<E: Outcome + Clone, X>(
    runtime: &mut GuidanceRuntime,
    step: usize,
    views: &[TaskView],
    max_rounds: usize,
    exec: &mut Exec<'_, E, X>,
    report: &mut DriveReport,
) -> Result<Vec<TaskRounds<E>>, X> {
    let mut tasks: Vec<TaskRounds<E>> = views
        .iter()
        .map(|_| TaskRounds {
            all: Vec::new(),
            group: Vec::new(),
            rounds: 0,
            bounded: false,
        })
        .collect();
    // (specs, use, keep) per task for the next round.
    let mut pending: Vec<Option<(Vec<GuidanceSpec>, RoundUse, bool)>> = Vec::new();
    for v in views {
        let (specs, err) = runtime.plan(step, v);
        report.errors.extend(err);
        pending.push(Some((specs, RoundUse::Replace, false)));
    }
    let review = runtime.has_review();
    // Probes kept for training, per task.
    let mut kept: Vec<Vec<usize>> = vec![Vec::new(); views.len()];
    loop {
        let mut reqs = Vec::new();
        for (t, p) in pending.iter().enumerate() {
            if let Some((specs, _, _)) = p {
                reqs.extend(specs.iter().map(|&spec| Request { task: t, spec }));
            }
        }
        if reqs.is_empty() {
            break;
        }
        let outs = exec(runtime, &reqs)?;
        let mut outs = outs.into_iter();
        let mut ran = Vec::new();
        for (t, p) in pending.iter_mut().enumerate() {
            let Some((specs, use_, keep)) = p.take() else {
                continue;
            };
            let tr = &mut tasks[t];
            let round = tr.rounds;
            let start = tr.all.len();
            for spec in specs {
                let ep = outs.next().expect("one outcome per request");
                tr.all.push(Rollout {
                    ep,
                    spec,
                    round,
                    use_,
                    keep,
                });
            }
            let idx: Vec<usize> = (start..tr.all.len()).collect();
            match use_ {
                RoundUse::Replace => tr.group = idx,
                RoundUse::Append => tr.group.extend(idx),
                RoundUse::Probe if keep => kept[t].extend(idx),
                RoundUse::Probe => {}
            }
            tr.rounds += 1;
            ran.push(t);
        }
        if !review {
            break;
        }
        for t in ran {
            let view = group_view(&tasks[t]);
            let (r, err) = runtime.review(step, tasks[t].rounds - 1, &views[t], &view);
            report.errors.extend(err);
            match r {
                Review::Accept => {}
                Review::Select(i) => {
                    let tr = &mut tasks[t];
                    let sel: Vec<usize> = (0..tr.all.len())
                        .filter(|&k| tr.all[k].round == i)
                        .collect();
                    if sel.is_empty() {
                        report.errors.push(ScriptError {
                            file: runtime.script().file(),
                            line: 0,
                            col: 0,
                            msg: format!(
                                "review() selected round {i} of task {}, which ran {} rounds",
                                views[t].id, tr.rounds
                            ),
                        });
                    } else {
                        tr.group = sel;
                    }
                }
                Review::Round(req) => {
                    if tasks[t].rounds > max_rounds {
                        tasks[t].bounded = true;
                        report.bound_hits += 1;
                    } else {
                        pending[t] = Some((req.specs, req.use_, req.keep));
                    }
                }
            }
        }
    }
    for (t, k) in kept.into_iter().enumerate() {
        for i in k {
            if !tasks[t].group.contains(&i) {
                tasks[t].group.push(i);
            }
        }
    }
    Ok(tasks)
}

/// What `review(task, group, state)` sees: every round so far (with its
/// mode, spec, size and successes), every rollout, and the current training
/// group's summary.
pub fn group_view<E: Outcome>(tr: &TaskRounds<E>) -> Dynamic {
    let mut rounds = Array::new();
    for r in 0..tr.rounds {
        let rs: Vec<&Rollout<E>> = tr.all.iter().filter(|x| x.round == r).collect();
        let succ = rs.iter().filter(|x| x.ep.success()).count();
        let mut m = Map::new();
        m.insert("round".into(), Dynamic::from(r as i64));
        m.insert("mode".into(), Dynamic::from(rs[0].use_.name().to_string()));
        m.insert("spec".into(), Dynamic::from(rs[0].spec));
        m.insert("n".into(), Dynamic::from(rs.len() as i64));
        m.insert("successes".into(), Dynamic::from(succ as i64));
        m.insert(
            "rate".into(),
            Dynamic::from(succ as f64 / rs.len().max(1) as f64),
        );
        let depth = rs
            .iter()
            .map(|x| x.ep.resolved().prefix as f64)
            .sum::<f64>()
            / rs.len().max(1) as f64;
        m.insert("depth".into(), Dynamic::from(depth));
        let k =
            rs.iter().map(|x| x.ep.resolved().plan as f64).sum::<f64>() / rs.len().max(1) as f64;
        m.insert("plan_k".into(), Dynamic::from(k));
        rounds.push(Dynamic::from_map(m));
    }
    let mut rollouts = Array::new();
    for x in &tr.all {
        let mut m = Map::new();
        m.insert("round".into(), Dynamic::from(x.round as i64));
        m.insert("mode".into(), Dynamic::from(x.use_.name().to_string()));
        m.insert("spec".into(), Dynamic::from(x.spec));
        m.insert("success".into(), Dynamic::from(x.ep.success()));
        m.insert("reward".into(), Dynamic::from(x.ep.reward()));
        m.insert("depth".into(), Dynamic::from(x.ep.resolved().prefix as i64));
        m.insert("plan_k".into(), Dynamic::from(x.ep.resolved().plan as i64));
        rollouts.push(Dynamic::from_map(m));
    }
    let g: Vec<&Rollout<E>> = tr.training().collect();
    let succ = g.iter().filter(|x| x.ep.success()).count();
    let rewards: Array = g.iter().map(|x| Dynamic::from(x.ep.reward())).collect();
    let max_reward = g
        .iter()
        .map(|x| x.ep.reward())
        .fold(f64::NEG_INFINITY, f64::max);
    let mut m = Map::new();
    m.insert("round".into(), Dynamic::from(tr.rounds as i64 - 1));
    m.insert("rounds".into(), Dynamic::from_array(rounds));
    m.insert("rollouts".into(), Dynamic::from_array(rollouts));
    m.insert("n".into(), Dynamic::from(g.len() as i64));
    m.insert("successes".into(), Dynamic::from(succ as i64));
    m.insert(
        "success_rate".into(),
        Dynamic::from(succ as f64 / g.len().max(1) as f64),
    );
    m.insert("rewards".into(), Dynamic::from_array(rewards));
    m.insert(
        "max_reward".into(),
        Dynamic::from(if max_reward.is_finite() {
            max_reward
        } else {
            0.0
        }),
    );
    m.insert("spent".into(), Dynamic::from(tr.all.len() as i64));
    Dynamic::from_map(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guidance::runtime::tests::{host_seeded, view_in};
    use crate::guidance::simulate::SimEpisode;

    fn runtime(src: &str) -> (GuidanceRuntime, tempfile::NamedTempFile) {
        host_seeded(src, 1)
    }

    fn view(id: &str) -> TaskView {
        view_in(id, 0)
    }

    /// Succeeds iff the executed prefix is at least 3 (or the spec is
    /// expert()); records every batch it was asked to run.
    fn run(
        h: &mut GuidanceRuntime,
        views: &[TaskView],
        max_rounds: usize,
    ) -> (Vec<TaskRounds<SimEpisode>>, Vec<usize>, DriveReport) {
        let mut batches = Vec::new();
        let mut exec = |_: &mut GuidanceRuntime, reqs: &[Request]| -> Result<Vec<SimEpisode>, ()> {
            batches.push(reqs.len());
            Ok(reqs
                .iter()
                .map(|r| {
                    let spec = r.spec.resolve(6);
                    SimEpisode {
                        spec,
                        success: spec.expert || spec.prefix >= 3,
                    }
                })
                .collect())
        };
        let mut report = DriveReport::default();
        let g = drive(h, 0, views, max_rounds, &mut exec, &mut report).unwrap();
        (g, batches, report)
    }

    #[test]
    fn probes_are_seen_replace_swaps_the_group_and_rounds_are_batched() {
        // Hard task: probe prefix(3) with 2 rollouts, then replace with 4.
        let (mut h, _f) = runtime(
            r#"
            fn plan(task, state) { none() }
            fn review(task, group, state) {
                if group.round == 0 && group.successes == 0 {
                    return #{ guidance: prefix(3), rollouts: 2, mode: "probe" };
                }
                if group.round == 1 {
                    state.probe_rate = group.rounds[1].rate;
                    return #{ guidance: prefix(4), mode: "replace" };
                }
            }
            "#,
        );
        let (g, batches, report) = run(&mut h, &[view("a"), view("b")], 8);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        // Both tasks' rounds run in the same batches: 8, then 2 + 2, then 4 + 4.
        assert_eq!(batches, vec![8, 4, 8]);
        for t in &g {
            assert_eq!((t.rounds, t.spent(), t.probes()), (3, 10, 2));
            let group: Vec<_> = t.training().collect();
            assert_eq!(group.len(), 4);
            assert!(group.iter().all(|r| r.round == 2 && r.ep.success));
        }
        assert_eq!(h.state_json()["probe_rate"], 1.0);
    }

    #[test]
    fn append_keep_and_select() {
        let (mut h, _f) = runtime(
            r#"
            fn plan(task, state) { [none(), none()] }
            fn review(task, group, state) {
                switch group.round {
                    0 => #{ guidance: [prefix(3), prefix(5)], mode: "append" },
                    1 => #{ guidance: prefix(1), rollouts: 1, mode: "probe", keep: true },
                    _ => ()
                }
            }
            "#,
        );
        let (g, _, report) = run(&mut h, &[view("a")], 8);
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        let t = &g[0];
        // Round 0 (2) + appended round 1 (2) + kept probe (1).
        assert_eq!(t.training().count(), 5);
        assert_eq!(t.probes(), 1);
        let (mut h, _f) = runtime(
            r#"
            fn plan(task, state) { prefix(4) }
            fn review(task, group, state) {
                if group.round == 0 { #{ guidance: none(), mode: "probe" } } else { #{ select: 0 } }
            }
            "#,
        );
        let (g, _, _) = run(&mut h, &[view("a")], 8);
        assert!(g[0]
            .training()
            .all(|r| r.round == 0 && r.ep.spec.prefix == 4));
        assert_eq!(g[0].spent(), 8);
    }

    #[test]
    fn rounds_are_bounded_and_bad_requests_are_errors() {
        let (mut h, _f) = runtime(
            "fn review(task, group, state) { #{ guidance: none(), rollouts: 1, mode: \"probe\" } }",
        );
        let (g, _, report) = run(&mut h, &[view("a")], 3);
        assert_eq!(g[0].rounds, 4);
        assert!(g[0].bounded);
        assert_eq!(report.bound_hits, 1);
        let (mut h, _f) =
            runtime("fn review(task, group, state) { #{ guidance: none(), mode: \"twice\" } }");
        let (g, _, report) = run(&mut h, &[view("a")], 3);
        assert_eq!(g[0].rounds, 1);
        assert!(
            report.errors[0].msg.contains("unknown mode \"twice\""),
            "{:?}",
            report.errors
        );
    }
}
