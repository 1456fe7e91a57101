//! The strategy runtime: owns the guidance script and the optional reward and
//! intervention scripts, their persistent `state`s, and the per-task history
//! scripts see; calls `init`, `plan`, `review`, `update`, `reward` and
//! `intervene`.
//!
//! A failing script never stops a run: the call falls back to the runtime's
//! default (unguided, accept, env reward, no intervention) and the error is
//! returned for the run log. Reloading edited scripts at step boundaries and
//! their probation live in [`reload`](self::reload); checkpoint snapshots in
//! [`snapshot`](self::snapshot). The records scripts see are in
//! [`script_inputs`](crate::guidance::script_inputs), the decoding of what they return in
//! [`decode`](crate::guidance::decode).

mod reload;
mod snapshot;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rhai::{Array, Dynamic, Map};
use serde::{Deserialize, Serialize};

use crate::guidance::decode::{at_fn, intervention_from, number_from, review_from, specs_from};
use crate::guidance::spec::GuidanceSpec;
use crate::script::{to_dynamic, Effects, Script, ScriptError, ScriptHandles};
use crate::seed;

// The records and decoded values this runtime's API speaks in, at their old
// paths (`guidance::runtime::TurnView`, ...) for callers elsewhere.
pub use crate::guidance::decode::{
    Intervention, Review, RoundRequest, RoundUse, MAX_ROUND_ROLLOUTS,
};
pub use crate::guidance::script_inputs::{
    EpisodeView, TaskHistory, TaskResult, TaskView, TurnView,
};
pub use reload::ReloadOutcome;
pub use snapshot::{RestoreError, RuntimeSnapshot};

/// The three kinds of script a run can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Guidance,
    Reward,
    Intervene,
}

impl Role {
    pub fn name(&self) -> &'static str {
        match self {
            Role::Guidance => "guidance",
            Role::Reward => "reward",
            Role::Intervene => "intervene",
        }
    }
}

/// One script with its state and reload bookkeeping.
struct Slot {
    /// The file edits are reloaded from (on resume the runtime starts from the
    /// run's saved copy but still follows this file).
    source: PathBuf,
    script: Script,
    /// The version before the active one, while the active one is on
    /// probation (its first step).
    last_good: Option<Script>,
    state: Dynamic,
}

impl Slot {
    fn new(handles: &ScriptHandles, path: &Path) -> Result<Self, ScriptError> {
        Ok(Slot {
            source: path.to_path_buf(),
            script: Script::load(handles, path)?,
            last_good: None,
            state: Dynamic::from_map(Map::new()).into_shared(),
        })
    }

    fn call(&self, name: &str, args: impl rhai::FuncArgs) -> Result<Dynamic, ScriptError> {
        self.script.call(name, args)
    }
}

/// Runtime of a run's scripts.
pub struct GuidanceRuntime {
    handles: ScriptHandles,
    guidance: Slot,
    reward: Option<Slot>,
    intervene: Option<Slot>,
    history: BTreeMap<String, TaskHistory>,
    seed: u64,
    /// Probation reverts since the last `take_reverts`.
    reverts: Vec<ReloadOutcome>,
}

impl GuidanceRuntime {
    /// Compile the guidance script at `path`. Nothing is called yet.
    /// Set the wall-clock budget of every script call (all roles).
    pub fn set_call_budget(&self, limit: std::time::Duration) {
        self.handles.set_call_budget(limit);
    }

    pub fn new(path: &Path, seed: u64) -> Result<Self, ScriptError> {
        let handles = crate::guidance::script_handles();
        Ok(GuidanceRuntime {
            guidance: Slot::new(&handles, path)?,
            handles,
            reward: None,
            intervene: None,
            history: BTreeMap::new(),
            seed,
            reverts: Vec::new(),
        })
    }

    /// Add a reward-shaping script.
    pub fn set_reward_script(&mut self, path: &Path) -> Result<(), ScriptError> {
        self.reward = Some(Slot::new(&self.handles, path)?);
        Ok(())
    }

    /// Add an intervention script.
    pub fn set_intervene_script(&mut self, path: &Path) -> Result<(), ScriptError> {
        self.intervene = Some(Slot::new(&self.handles, path)?);
        Ok(())
    }

    pub fn script(&self) -> &Script {
        &self.guidance.script
    }

    /// The active script of `role`, if the run has one.
    pub fn script_of(&self, role: Role) -> Option<&Script> {
        self.slot(role).map(|s| &s.script)
    }

    fn slot(&self, role: Role) -> Option<&Slot> {
        match role {
            Role::Guidance => Some(&self.guidance),
            Role::Reward => self.reward.as_ref(),
            Role::Intervene => self.intervene.as_ref(),
        }
    }

    fn slot_mut(&mut self, role: Role) -> Option<&mut Slot> {
        match role {
            Role::Guidance => Some(&mut self.guidance),
            Role::Reward => self.reward.as_mut(),
            Role::Intervene => self.intervene.as_mut(),
        }
    }

    fn roles(&self) -> Vec<Role> {
        [Role::Guidance, Role::Reward, Role::Intervene]
            .into_iter()
            .filter(|r| self.slot(*r).is_some())
            .collect()
    }

    pub fn hash(&self) -> &str {
        &self.guidance.script.hash
    }

    /// Hash of each script's active version, by role name.
    pub fn hashes(&self) -> BTreeMap<String, String> {
        self.roles()
            .into_iter()
            .map(|r| {
                (
                    r.name().to_string(),
                    self.slot(r).expect("role present").script.hash.clone(),
                )
            })
            .collect()
    }

    /// Call `init(state)` of each script that defines it (once per run).
    pub fn init(&mut self) -> Result<(), ScriptError> {
        for role in self.roles() {
            let slot = self.slot(role).expect("role present");
            if slot.script.has_fn("init", 1) {
                self.handles.reseed(seed::derive(
                    self.seed,
                    &[seed::label("init"), seed::label(role.name())],
                ));
                slot.call("init", (slot.state.clone(),)).map(drop)?;
            }
        }
        Ok(())
    }

    /// The view of `task` a script gets.
    pub fn history(&self, id: &str) -> TaskHistory {
        self.history.get(id).cloned().unwrap_or(TaskHistory {
            visits: 0,
            last_success: -1.0,
        })
    }

    /// Ask the script for one spec per rollout of `task`. A missing `plan`
    /// means unguided. On a script error all rollouts are unguided and the
    /// error is returned alongside.
    pub fn plan(
        &mut self,
        step: usize,
        task: &TaskView,
    ) -> (Vec<GuidanceSpec>, Option<ScriptError>) {
        let r = task.group_size.max(1) as usize;
        if !self.guidance.script.has_fn("plan", 2) {
            return (vec![GuidanceSpec::None; r], None);
        }
        self.handles.reseed(seed::derive(
            self.seed,
            &[seed::label("plan"), step as u64, seed::label(&task.id)],
        ));
        let g = &self.guidance;
        let out = g.call("plan", (to_dynamic(task), g.state.clone()));
        match out.and_then(|v| {
            specs_from(&g.script.file(), "plan()", v, r).map_err(|e| at_fn(&g.script, "plan", e))
        }) {
            Ok(specs) => (specs, None),
            Err(e) => (
                vec![GuidanceSpec::None; r],
                Some(self.failed(Role::Guidance, e)),
            ),
        }
    }

    /// Does the guidance script review groups (and so may ask for rounds)?
    pub fn has_review(&self) -> bool {
        self.guidance.script.has_fn("review", 3)
    }

    /// Call `review(task, group, state)` after round `round` of `task`.
    pub fn review(
        &mut self,
        step: usize,
        round: usize,
        task: &TaskView,
        group: &Dynamic,
    ) -> (Review, Option<ScriptError>) {
        if !self.has_review() {
            return (Review::Accept, None);
        }
        self.handles.reseed(seed::derive(
            self.seed,
            &[
                seed::label("review"),
                step as u64,
                seed::label(&task.id),
                round as u64,
            ],
        ));
        let g = &self.guidance;
        let file = g.script.file();
        let out = g.call("review", (to_dynamic(task), group.clone(), g.state.clone()));
        match out.and_then(|v| {
            review_from(&file, v, task.group_size.max(1) as usize)
                .map_err(|e| at_fn(&g.script, "review", e))
        }) {
            Ok(r) => (r, None),
            Err(e) => (Review::Accept, Some(self.failed(Role::Guidance, e))),
        }
    }

    /// Record results and call `update(batch, state)`.
    pub fn update(
        &mut self,
        step: usize,
        results: &[TaskResult],
        extra: &BTreeMap<String, f64>,
    ) -> Option<ScriptError> {
        for r in results {
            let h = self.history.entry(r.id.clone()).or_default();
            h.visits += 1;
            h.last_success = r.success_rate;
        }
        if !self.guidance.script.has_fn("update", 2) {
            return None;
        }
        let acc = if results.is_empty() {
            0.0
        } else {
            results.iter().map(|r| r.success_rate).sum::<f64>() / results.len() as f64
        };
        let mut batch = Map::new();
        batch.insert("step".into(), Dynamic::from(step as i64));
        batch.insert("acc".into(), Dynamic::from(acc));
        let tasks: Array = results.iter().map(to_dynamic).collect();
        batch.insert("tasks".into(), Dynamic::from_array(tasks));
        let mut metrics = Map::new();
        for (k, v) in extra {
            metrics.insert(k.as_str().into(), Dynamic::from(*v));
        }
        batch.insert("metrics".into(), Dynamic::from_map(metrics));
        self.handles.reseed(seed::derive(
            self.seed,
            &[seed::label("update"), step as u64],
        ));
        let g = &self.guidance;
        g.call("update", (Dynamic::from_map(batch), g.state.clone()))
            .err()
            .map(|e| self.failed(Role::Guidance, e))
    }

    pub fn has_reward(&self) -> bool {
        self.reward
            .as_ref()
            .is_some_and(|s| s.script.has_fn("reward", 2))
    }

    /// Shaped reward of an episode, or `None` without a reward script (or
    /// on error: the env reward then stands).
    pub fn reward(
        &mut self,
        step: usize,
        index: usize,
        ep: &EpisodeView,
    ) -> (Option<f64>, Option<ScriptError>) {
        if !self.has_reward() {
            return (None, None);
        }
        self.handles.reseed(seed::derive(
            self.seed,
            &[
                seed::label("reward"),
                step as u64,
                seed::label(&ep.task_id),
                index as u64,
            ],
        ));
        let s = self.reward.as_ref().expect("checked");
        let file = s.script.file();
        let out = s.call("reward", (to_dynamic(ep), s.state.clone()));
        match out.and_then(|v| number_from(&file, v).map_err(|e| at_fn(&s.script, "reward", e))) {
            Ok(x) => (Some(x), None),
            Err(e) => (None, Some(self.failed(Role::Reward, e))),
        }
    }

    pub fn has_intervene(&self) -> bool {
        self.intervene
            .as_ref()
            .is_some_and(|s| s.script.has_fn("intervene", 2))
    }

    /// Ask the intervention script about one turn.
    pub fn intervene(
        &mut self,
        step: usize,
        turn: &TurnView,
    ) -> (Intervention, Option<ScriptError>) {
        if !self.has_intervene() {
            return (Intervention::Nothing, None);
        }
        self.handles.reseed(seed::derive(
            self.seed,
            &[
                seed::label("intervene"),
                step as u64,
                seed::label(&turn.task_id),
                turn.turn as u64,
            ],
        ));
        let s = self.intervene.as_ref().expect("checked");
        let file = s.script.file();
        let out = s.call("intervene", (to_dynamic(turn), s.state.clone()));
        match out
            .and_then(|v| intervention_from(&file, v).map_err(|e| at_fn(&s.script, "intervene", e)))
        {
            Ok(x) => (x, None),
            Err(e) => (Intervention::Nothing, Some(self.failed(Role::Intervene, e))),
        }
    }

    /// Metrics and log lines produced by helper calls since the last take.
    pub fn take_effects(&self) -> Effects {
        self.handles.take_effects()
    }
}

#[cfg(test)]
pub(in crate::guidance) mod tests {
    use super::*;
    use std::io::Write;

    /// A runtime over the script `src` (kept in a temp file), seeded `seed`.
    pub(in crate::guidance) fn host_seeded(
        src: &str,
        seed: u64,
    ) -> (GuidanceRuntime, tempfile::NamedTempFile) {
        let mut f = tempfile::Builder::new().suffix(".rhai").tempfile().unwrap();
        f.write_all(src.as_bytes()).unwrap();
        (GuidanceRuntime::new(f.path(), seed).unwrap(), f)
    }

    fn runtime(src: &str) -> (GuidanceRuntime, tempfile::NamedTempFile) {
        host_seeded(src, 7)
    }

    /// A fresh 6-action pick-and-place task of cluster `cluster`.
    pub(in crate::guidance) fn view_in(id: &str, cluster: i64) -> TaskView {
        TaskView {
            id: id.into(),
            task_type: "pick_and_place".into(),
            cluster,
            expert_len: 6,
            difficulty: 6,
            visits: 0,
            last_success: -1.0,
            step: 0,
            total_steps: 10,
            group_size: 4,
        }
    }

    fn view(id: &str) -> TaskView {
        view_in(id, 1)
    }

    #[test]
    fn state_persists_across_calls_and_constants_are_visible() {
        let (mut h, _f) = runtime(
            r#"
            const DEPTH = 0.5;
            fn init(state) { state.calls = 0; }
            fn plan(task, state) { state.calls += 1; prefix_ratio(DEPTH) }
            fn update(batch, state) { state.acc = batch.acc; }
            "#,
        );
        h.init().unwrap();
        let (specs, err) = h.plan(0, &view("a"));
        assert!(err.is_none(), "{err:?}");
        assert_eq!(specs, vec![GuidanceSpec::PrefixRatio { r: 0.5 }; 4]);
        h.plan(0, &view("b"));
        assert!(h.update(0, &[], &BTreeMap::new()).is_none());
        let s = h.state_json();
        assert_eq!(s["calls"], 2);
        assert_eq!(s["acc"], 0.0);
    }

    #[test]
    fn script_rng_is_reproducible_per_call_site() {
        let src = "fn plan(task, state) { prefix_ratio(uniform(0.0, 1.0)) }";
        let (mut h1, _f1) = runtime(src);
        let (mut h2, _f2) = runtime(src);
        let a = h1.plan(3, &view("a")).0;
        // h2 makes extra draws first; the draw for (step 3, task a) is unchanged.
        h2.plan(1, &view("z"));
        h2.plan(2, &view("y"));
        let b = h2.plan(3, &view("a")).0;
        assert_eq!(a, b);
        assert_ne!(h1.plan(4, &view("a")).0, a);
    }

    #[test]
    fn per_rollout_arrays_and_wrong_types() {
        let (mut h, _f) =
            runtime("fn plan(task, state) { [none(), prefix(1), plan(2), prefix(3)] }");
        let (s, e) = h.plan(0, &view("a"));
        assert!(e.is_none());
        assert_eq!(s[2].to_string(), "plan(2)");
        let (mut h, _f) = runtime("fn plan(task, state) { 42 }");
        let (s, e) = h.plan(0, &view("a"));
        assert_eq!(s, vec![GuidanceSpec::None; 4]);
        assert!(e.unwrap().msg.contains("must return a spec"));
    }

    #[test]
    fn runtime_errors_are_positioned_and_loops_are_cut() {
        let (mut h, _f) = runtime("fn plan(task, state) {\n  let x = task.nope + 1;\n  none()\n}");
        let e = h.plan(0, &view("a")).1.unwrap();
        assert_eq!(e.line, 2, "{e}");
        let (mut h, _f) = runtime("fn plan(task, state) { loop { } }");
        let e = h.plan(0, &view("a")).1.unwrap();
        assert!(e.msg.contains("operation limit"), "{e}");
    }

    #[test]
    fn snapshot_roundtrip() {
        let (mut h, _f) = runtime("fn init(state) { state.mu = #{ a: 0.8, b: [1, 2] }; }");
        h.init().unwrap();
        let snap = h.snapshot();
        let (mut h2, _f2) = runtime("fn init(state) {}");
        h2.restore(&snap).unwrap();
        assert_eq!(h2.state_json(), h.state_json());
        assert_eq!(h.state_numbers()["mu.a"], 0.8);
    }

    fn result(id: &str, cluster: i64, rate: f64) -> TaskResult {
        TaskResult {
            id: id.into(),
            task_type: "pick_and_place".into(),
            cluster,
            expert_len: 6,
            depth: 0.0,
            depth_ratio: 0.0,
            plan_k: 0.0,
            guided: true,
            rewards: vec![],
            successes: vec![],
            success_rate: rate,
            rollouts: 0,
            rounds: 0,
            env_failed: 0,
        }
    }

    #[test]
    fn gaussian_script_follows_agent_g2_equations() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/guidance/gaussian.rhai");
        let mut h = GuidanceRuntime::new(&path, 1).unwrap();
        h.init().unwrap();
        assert_eq!(h.state_json()["mu_global"], 0.8);
        // acc = (1 + 0.5 + 0) / 3 = 0.5: no move of mu_global (sign(0) = 0).
        let rs = [
            result("a", 0, 1.0),
            result("b", 0, 0.5),
            result("c", 2, 0.0),
        ];
        assert!(h.update(0, &rs, &BTreeMap::new()).is_none());
        let s = h.state_numbers();
        assert!((s["mu_global"] - 0.8).abs() < 1e-12);
        // cluster 0: p = 0.75, v = 0.0625; A = 0.2 * 0.75, V = 0.2 * 0.0625
        assert!((s["A.0"] - 0.15).abs() < 1e-12, "{s:?}");
        assert!((s["V.0"] - 0.0125).abs() < 1e-12, "{s:?}");
        assert!((s["A.2"] - 0.0).abs() < 1e-12);
        // acc = 1 > P_TARGET: mu_global steps down by DELTA.
        assert!(h
            .update(1, &[result("a", 0, 1.0)], &BTreeMap::new())
            .is_none());
        assert!((h.state_numbers()["mu_global"] - 0.7).abs() < 1e-12);
        let m = h.take_effects().metrics;
        assert!(m.iter().any(|(k, _)| k == "g2.mu_global"));
        // mu_i for cluster 2: clip(0.7 + 1.0 (0.5 - 0)) = 1.0, sigma = 0.1:
        // the sampled ratio is clipped to [0, 1] and mostly deep.
        let mut deep = 0;
        for step in 0..200 {
            let (specs, e) = h.plan(
                step,
                &TaskView {
                    cluster: 2,
                    ..view("c")
                },
            );
            assert!(e.is_none());
            match specs[0] {
                GuidanceSpec::PrefixRatio { r } => {
                    assert!((0.0..=1.0).contains(&r));
                    if r > 0.8 {
                        deep += 1;
                    }
                }
                other => panic!("{other:?}"),
            }
            assert!(specs.iter().all(|s| *s == specs[0]), "one draw per task");
        }
        assert!(deep > 150, "{deep}");
    }
}
