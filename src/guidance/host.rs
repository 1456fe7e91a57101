//! The strategy host: owns the guidance script, its persistent `state`, and
//! the per-task history the script sees; calls `init`, `plan` and `update`.
//!
//! A failing script never stops a run: `plan` falls back to unguided
//! rollouts for that task and the error is returned for the run log.

use std::collections::BTreeMap;
use std::path::Path;

use rhai::{Array, Dynamic, Engine, Map};
use serde::{Deserialize, Serialize};

use crate::guidance::spec::GuidanceSpec;
use crate::script::{new_engine, to_dynamic, Effects, HostHandles, Script, ScriptError};
use crate::seed;

/// What a script sees of a task in `plan(task, state)`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TaskView {
    pub id: String,
    #[serde(rename = "type")]
    pub task_type: String,
    pub cluster: i64,
    pub expert_len: i64,
    pub difficulty: i64,
    /// Steps in which this task was trained on so far.
    pub visits: i64,
    /// Success rate of its last group (-1.0 if never seen).
    pub last_success: f64,
    /// Current training step and total steps.
    pub step: i64,
    pub total_steps: i64,
    pub group_size: i64,
}

/// One task's results in the batch given to `update(batch, state)`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TaskResult {
    pub id: String,
    #[serde(rename = "type")]
    pub task_type: String,
    pub cluster: i64,
    pub expert_len: i64,
    /// Mean executed prefix depth (actions) and ratio of expert length.
    pub depth: f64,
    pub depth_ratio: f64,
    pub plan_k: f64,
    pub guided: bool,
    pub rewards: Vec<f64>,
    pub successes: Vec<bool>,
    pub success_rate: f64,
}

/// Per-task history kept by the host across steps (and checkpoints).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TaskHistory {
    pub visits: i64,
    pub last_success: f64,
}

/// Host of one guidance script.
pub struct GuidanceHost {
    /// The file edits are reloaded from (on resume the host starts from
    /// the run's saved copy but still follows this file).
    source: std::path::PathBuf,
    engine: Engine,
    handles: HostHandles,
    script: Script,
    state: Dynamic,
    history: BTreeMap<String, TaskHistory>,
    seed: u64,
}

impl GuidanceHost {
    /// Compile the script at `path`. Nothing is called yet.
    pub fn new(path: &Path, seed: u64) -> Result<Self, ScriptError> {
        let (engine, handles) = new_engine();
        let script = Script::load(&engine, path)?;
        Ok(GuidanceHost {
            source: path.to_path_buf(),
            engine,
            handles,
            script,
            state: Dynamic::from_map(Map::new()).into_shared(),
            history: BTreeMap::new(),
            seed,
        })
    }

    pub fn script(&self) -> &Script {
        &self.script
    }

    /// Follow `path` for reloads (the script may have been loaded from a
    /// saved copy).
    pub fn set_source(&mut self, path: &Path) {
        self.source = path.to_path_buf();
    }

    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Recompile the script from its source file and, if it compiles and
    /// a trial `plan` call on a sample task (with a copy of the state)
    /// returns valid specs, make it the active version; `state` is kept.
    /// Returns the new hash, or `None` when the content is unchanged. On
    /// error the last good version stays in effect.
    pub fn reload(&mut self, sample: &TaskView) -> Result<Option<String>, ScriptError> {
        let mut new = Script::load(&self.engine, &self.source)?;
        if new.hash == self.script.hash {
            return Ok(None);
        }
        if new.has_fn("plan", 2) {
            let copy = Dynamic::from(self.state.flatten_clone());
            let out = new.call(&self.engine, "plan", (to_dynamic(sample), copy));
            // The trial's draws, metrics and logs are not the run's.
            self.handles.take_effects();
            let r = sample.group_size.max(1) as usize;
            out.and_then(|v| specs_from(&new.file(), v, r))?;
        }
        let hash = new.hash.clone();
        self.script = new;
        Ok(Some(hash))
    }

    pub fn hash(&self) -> &str {
        &self.script.hash
    }

    /// Call `init(state)` if the script defines it (once per run).
    pub fn init(&mut self) -> Result<(), ScriptError> {
        if self.script.has_fn("init", 1) {
            self.handles
                .reseed(seed::derive(self.seed, &[seed::label("init")]));
            self.script
                .call(&self.engine, "init", (self.state.clone(),))
                .map(drop)?;
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
        if !self.script.has_fn("plan", 2) {
            return (vec![GuidanceSpec::None; r], None);
        }
        self.handles.reseed(seed::derive(
            self.seed,
            &[seed::label("plan"), step as u64, seed::label(&task.id)],
        ));
        let out = self
            .script
            .call(&self.engine, "plan", (to_dynamic(task), self.state.clone()));
        match out.and_then(|v| self.specs_from(v, r)) {
            Ok(specs) => (specs, None),
            Err(e) => (vec![GuidanceSpec::None; r], Some(e)),
        }
    }

    fn specs_from(&self, v: Dynamic, r: usize) -> Result<Vec<GuidanceSpec>, ScriptError> {
        specs_from(&self.script.file(), v, r)
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
        if !self.script.has_fn("update", 2) {
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
        self.script
            .call(
                &self.engine,
                "update",
                (Dynamic::from_map(batch), self.state.clone()),
            )
            .err()
    }

    /// Metrics and log lines produced by helper calls since the last take.
    pub fn take_effects(&self) -> Effects {
        self.handles.take_effects()
    }

    /// Script state as JSON (checkpoints, metrics).
    pub fn state_json(&self) -> serde_json::Value {
        serde_json::to_value(self.state.flatten_clone()).unwrap_or(serde_json::Value::Null)
    }

    /// Numeric entries of the script state, flattened with dots
    /// (`state.clusters.0.mu` → `clusters.0.mu`) for metrics.
    pub fn state_numbers(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        flatten_numbers("", &self.state_json(), &mut out);
        out
    }

    /// Everything a checkpoint needs to restore this host.
    pub fn snapshot(&self) -> HostSnapshot {
        HostSnapshot {
            state: self.state_json(),
            history: self.history.clone(),
        }
    }

    pub fn restore(&mut self, snap: &HostSnapshot) -> Result<(), String> {
        let state: Dynamic = rhai::serde::to_dynamic(&snap.state).map_err(|e| e.to_string())?;
        self.state = state.into_shared();
        self.history = snap.history.clone();
        Ok(())
    }
}

/// Check a script's `plan` result: one spec, or an array of `r` specs.
fn specs_from(file: &str, v: Dynamic, r: usize) -> Result<Vec<GuidanceSpec>, ScriptError> {
    let bad = |what: &str| ScriptError {
        file: file.to_string(),
        line: 0,
        col: 0,
        msg: format!("plan() must return a spec or an array of {r} specs, got {what}"),
    };
    if v.is::<GuidanceSpec>() {
        return Ok(vec![v.cast::<GuidanceSpec>(); r]);
    }
    if v.is::<Array>() {
        let arr = v.cast::<Array>();
        if arr.len() != r {
            return Err(bad(&format!("an array of {}", arr.len())));
        }
        return arr
            .into_iter()
            .map(|x| {
                let tn = x.type_name().to_string();
                x.try_cast::<GuidanceSpec>()
                    .ok_or_else(|| bad(&format!("an array holding {tn}")))
            })
            .collect();
    }
    Err(bad(v.type_name()))
}

/// `actguide check`: compile a guidance script and call each entry point it
/// defines on synthetic tasks and batches. Returns a readable trace, or the
/// first error with its position.
pub fn check_script(path: &Path) -> Result<Vec<String>, ScriptError> {
    let mut host = GuidanceHost::new(path, 0)?;
    let mut out = vec![format!(
        "compiled {} (version {})",
        path.display(),
        host.hash()
    )];
    for f in ["init", "plan", "update"] {
        let arity = if f == "init" { 1 } else { 2 };
        if !host.script.has_fn(f, arity) {
            out.push(format!("{f}: not defined (the host's default applies)"));
        }
    }
    host.init()?;
    let types = ["pick_and_place", "pick_heat_then_place", "pick_two_obj"];
    let mut results = Vec::new();
    for step in 0..2 {
        for (i, len) in [1usize, 4, 9].into_iter().enumerate() {
            let h = host.history(&format!("task-{i}"));
            let view = TaskView {
                id: format!("task-{i}"),
                task_type: types[i].into(),
                cluster: i as i64,
                expert_len: len as i64,
                difficulty: len as i64,
                visits: h.visits,
                last_success: h.last_success,
                step,
                total_steps: 10,
                group_size: 4,
            };
            let (specs, err) = host.plan(step as usize, &view);
            if let Some(e) = err {
                return Err(e);
            }
            let shown: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
            out.push(format!(
                "step {step} plan(cluster {i}, expert_len {len}) -> [{}]",
                shown.join(", ")
            ));
            let rate = [1.0, 0.5, 0.0][i];
            results.push(TaskResult {
                id: view.id.clone(),
                task_type: view.task_type.clone(),
                cluster: i as i64,
                expert_len: len as i64,
                depth: 0.0,
                depth_ratio: 0.0,
                plan_k: 0.0,
                guided: false,
                rewards: vec![rate; 4],
                successes: vec![rate > 0.5; 4],
                success_rate: rate,
            });
        }
        if let Some(e) = host.update(step as usize, &results, &BTreeMap::new()) {
            return Err(e);
        }
        results.clear();
        out.push(format!("step {step} update -> state {}", host.state_json()));
    }
    for l in host.take_effects().logs {
        out.push(format!("log: {l}"));
    }
    Ok(out)
}

/// Checkpointed host state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostSnapshot {
    pub state: serde_json::Value,
    pub history: BTreeMap<String, TaskHistory>,
}

fn flatten_numbers(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, f64>) {
    match v {
        serde_json::Value::Number(n) => {
            if let Some(f) = n.as_f64() {
                out.insert(prefix.to_string(), f);
            }
        }
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten_numbers(&key, v, out);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                flatten_numbers(&format!("{prefix}.{i}"), v, out);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn host(src: &str) -> (GuidanceHost, tempfile::NamedTempFile) {
        let mut f = tempfile::Builder::new().suffix(".rhai").tempfile().unwrap();
        f.write_all(src.as_bytes()).unwrap();
        (GuidanceHost::new(f.path(), 7).unwrap(), f)
    }

    fn view(id: &str) -> TaskView {
        TaskView {
            id: id.into(),
            task_type: "pick_and_place".into(),
            cluster: 1,
            expert_len: 6,
            difficulty: 6,
            visits: 0,
            last_success: -1.0,
            step: 0,
            total_steps: 10,
            group_size: 4,
        }
    }

    #[test]
    fn state_persists_across_calls_and_constants_are_visible() {
        let (mut h, _f) = host(
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
        let (mut h1, _f1) = host(src);
        let (mut h2, _f2) = host(src);
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
        let (mut h, _f) = host("fn plan(task, state) { [none(), prefix(1), plan(2), prefix(3)] }");
        let (s, e) = h.plan(0, &view("a"));
        assert!(e.is_none());
        assert_eq!(s[2], GuidanceSpec::Plan { k: 2 });
        let (mut h, _f) = host("fn plan(task, state) { 42 }");
        let (s, e) = h.plan(0, &view("a"));
        assert_eq!(s, vec![GuidanceSpec::None; 4]);
        assert!(e.unwrap().msg.contains("must return a spec"));
    }

    #[test]
    fn runtime_errors_are_positioned_and_loops_are_cut() {
        let (mut h, _f) = host("fn plan(task, state) {\n  let x = task.nope + 1;\n  none()\n}");
        let e = h.plan(0, &view("a")).1.unwrap();
        assert_eq!(e.line, 2, "{e}");
        let (mut h, _f) = host("fn plan(task, state) { loop { } }");
        let e = h.plan(0, &view("a")).1.unwrap();
        assert!(e.msg.contains("operation limit"), "{e}");
    }

    #[test]
    fn check_reports_positioned_errors_and_traces_good_scripts() {
        let (_, f) =
            host("fn plan(task, state) {\n  if task.step == 1 { 1 / 0 } else { none() }\n}");
        let e = check_script(f.path()).unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/guidance/gaussian.rhai");
        let trace = check_script(&path).unwrap();
        assert!(
            trace
                .iter()
                .any(|l| l.contains("plan(cluster 2, expert_len 9) -> [prefix_ratio(")),
            "{trace:?}"
        );
        assert!(trace.iter().any(|l| l.contains("mu_global")), "{trace:?}");
    }

    #[test]
    fn snapshot_roundtrip() {
        let (mut h, _f) = host("fn init(state) { state.mu = #{ a: 0.8, b: [1, 2] }; }");
        h.init().unwrap();
        let snap = h.snapshot();
        let (mut h2, _f2) = host("fn init(state) {}");
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
        }
    }

    #[test]
    fn gaussian_script_follows_agent_g2_equations() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/guidance/gaussian.rhai");
        let mut h = GuidanceHost::new(&path, 1).unwrap();
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
