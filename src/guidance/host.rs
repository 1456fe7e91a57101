//! The strategy host: owns the guidance script and the optional reward and
//! intervention scripts, their persistent `state`s, and the per-task history
//! scripts see; calls `init`, `plan`, `review`, `update`, `reward` and
//! `intervene`; reloads edited scripts at step boundaries.
//!
//! A failing script never stops a run: the call falls back to the host's
//! default (unguided, accept, env reward, no intervention) and the error is
//! returned for the run log. A freshly reloaded version is on probation
//! until it has been through one step: a runtime error in that step swaps
//! the last good version back in.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rhai::{Array, Dynamic, Map};
use serde::{Deserialize, Serialize};

use crate::guidance::spec::GuidanceSpec;
use crate::script::{to_dynamic, Effects, HostHandles, Script, ScriptError};
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
    /// Rollouts spent on this task this step (probes included) and rounds.
    #[serde(default)]
    pub rollouts: i64,
    #[serde(default)]
    pub rounds: i64,
}

/// Per-task history kept by the host across steps (and checkpoints).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TaskHistory {
    pub visits: i64,
    pub last_success: f64,
}

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

/// What `review(task, group, state)` asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Review {
    /// Train on the group as it is.
    Accept,
    /// Run another round for this task.
    Round(RoundRequest),
    /// Make the rollouts of round `i` (0 = the first) the training group.
    Select(usize),
}

/// How a further round's rollouts are used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoundUse {
    /// Seen by the script; joins the training group only if kept.
    Probe,
    /// Replaces the training group.
    Replace,
    /// Added to the training group.
    Append,
}

impl RoundUse {
    pub fn name(&self) -> &'static str {
        match self {
            RoundUse::Probe => "probe",
            RoundUse::Replace => "replace",
            RoundUse::Append => "append",
        }
    }
}

/// A request for another round: one spec per rollout.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundRequest {
    pub specs: Vec<GuidanceSpec>,
    pub use_: RoundUse,
    /// For probes: train on them too (they join the final group).
    pub keep: bool,
}

/// What an intervention script decided for one turn.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Intervention {
    #[default]
    Nothing,
    /// Text shown to the policy for this turn (in the plan slot).
    Hint(String),
    /// End the episode (counted as a failure).
    Stop,
}

/// What `intervene(turn, state)` sees.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TurnView {
    pub task_id: String,
    /// Policy turns taken so far in this episode.
    pub turn: i64,
    /// Invalid actions in a row just before this turn, and in total.
    pub invalid_streak: i64,
    pub invalid: i64,
    pub last_action: String,
    pub observation: String,
    /// The reference trajectory's next action after the longest prefix of
    /// it the episode has followed ("" when it is used up).
    pub expert_next: String,
    pub expert_len: i64,
    /// Executed prefix depth and plan length of this episode.
    pub prefix: i64,
    pub plan_k: i64,
}

/// What `reward(episode, state)` sees.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EpisodeView {
    pub task_id: String,
    pub success: bool,
    /// The env's reward plus the runner's invalid-action penalties.
    pub env_reward: f64,
    pub invalid: i64,
    pub policy_turns: i64,
    pub expert_len: i64,
    pub prefix: i64,
    pub plan_k: i64,
    pub expert: bool,
    /// How many of the reference actions the episode reproduced in order
    /// (executed prefix included).
    pub expert_match: i64,
    pub actions: Vec<String>,
    pub error: bool,
}

/// The outcome of a reload attempt of one script.
#[derive(Debug, Clone, PartialEq)]
pub struct ReloadOutcome {
    pub role: Role,
    pub file: String,
    /// The new version's hash, or the error (the previous version stays).
    pub result: Result<String, ScriptError>,
    /// A version that failed at run time on probation and was replaced by
    /// the last good one (whose hash is `result`).
    pub reverted: Option<ScriptError>,
}

/// One script with its state and reload bookkeeping.
struct Slot {
    /// The file edits are reloaded from (on resume the host starts from the
    /// run's saved copy but still follows this file).
    source: PathBuf,
    script: Script,
    /// The version before the active one, while the active one is on
    /// probation (its first step).
    last_good: Option<Script>,
    state: Dynamic,
}

impl Slot {
    fn new(handles: &HostHandles, path: &Path) -> Result<Self, ScriptError> {
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

/// Host of a run's scripts.
pub struct GuidanceHost {
    handles: HostHandles,
    guidance: Slot,
    reward: Option<Slot>,
    intervene: Option<Slot>,
    history: BTreeMap<String, TaskHistory>,
    seed: u64,
    /// Probation reverts since the last `take_reverts`.
    reverts: Vec<ReloadOutcome>,
}

/// Cap on hint length (a runaway script cannot flood prompts).
const MAX_HINT_CHARS: usize = 512;

impl GuidanceHost {
    /// Compile the guidance script at `path`. Nothing is called yet.
    pub fn new(path: &Path, seed: u64) -> Result<Self, ScriptError> {
        let handles = HostHandles::new();
        Ok(GuidanceHost {
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

    /// Follow `path` for reloads of `role` (the script may have been
    /// loaded from a saved copy).
    pub fn set_source(&mut self, role: Role, path: &Path) {
        if let Some(s) = self.slot_mut(role) {
            s.source = path.to_path_buf();
        }
    }

    pub fn source(&self) -> &Path {
        &self.guidance.source
    }

    /// Every file a reload should react to: each script's source file and
    /// the files its active version imports.
    pub fn watched_files(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for r in self.roles() {
            let s = self.slot(r).expect("role present");
            out.push(s.source.clone());
            out.extend(s.script.imports.iter().map(|(p, _)| p.clone()));
        }
        out.sort();
        out.dedup();
        out
    }

    /// Recompile every script from its source file. A version that compiles
    /// and passes a trial call (on a copy of the state) becomes active and
    /// starts its probation; `state` is kept. Unchanged scripts are skipped.
    /// On error the last good version stays in effect.
    pub fn reload(&mut self, sample: &TaskView) -> Vec<ReloadOutcome> {
        let mut out = Vec::new();
        for role in self.roles() {
            let slot = self.slot(role).expect("role present");
            let file = slot.source.display().to_string();
            let result = Script::load(&self.handles, &slot.source).and_then(|new| {
                if new.hash == slot.script.hash {
                    return Ok(None);
                }
                let copy = Dynamic::from(slot.state.flatten_clone());
                trial(role, &new, sample, copy)?;
                Ok(Some(new))
            });
            // The trial's draws, metrics and logs are not the run's.
            self.handles.take_effects();
            let result = match result {
                Ok(None) => continue,
                Ok(Some(new)) => {
                    let hash = new.hash.clone();
                    let slot = self.slot_mut(role).expect("role present");
                    let old = std::mem::replace(&mut slot.script, new);
                    // Keep the oldest good version if a probationary one
                    // is replaced before it finished a step.
                    if slot.last_good.is_none() {
                        slot.last_good = Some(old);
                    }
                    Ok(hash)
                }
                Err(e) => Err(e),
            };
            out.push(ReloadOutcome {
                role,
                file,
                result,
                reverted: None,
            });
        }
        out
    }

    /// A step finished: active versions leave probation.
    pub fn end_step(&mut self) {
        for role in self.roles() {
            self.slot_mut(role).expect("role present").last_good = None;
        }
    }

    /// Versions reverted for runtime errors since the last call.
    pub fn take_reverts(&mut self) -> Vec<ReloadOutcome> {
        std::mem::take(&mut self.reverts)
    }

    /// A runtime error in `role`: if its active version is on probation,
    /// the last good one comes back for the rest of the run.
    fn failed(&mut self, role: Role, e: ScriptError) -> ScriptError {
        let Some(slot) = self.slot_mut(role) else {
            return e;
        };
        if let Some(good) = slot.last_good.take() {
            let file = slot.source.display().to_string();
            let hash = good.hash.clone();
            slot.script = good;
            self.reverts.push(ReloadOutcome {
                role,
                file,
                result: Ok(hash),
                reverted: Some(e.clone()),
            });
        }
        e
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

    /// Guidance script state as JSON (checkpoints, metrics).
    pub fn state_json(&self) -> serde_json::Value {
        state_json(&self.guidance.state)
    }

    /// Numeric entries of the guidance script's state, flattened with dots
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
            states: self
                .roles()
                .into_iter()
                .filter(|r| *r != Role::Guidance)
                .map(|r| {
                    (
                        r.name().to_string(),
                        state_json(&self.slot(r).expect("role present").state),
                    )
                })
                .collect(),
        }
    }

    pub fn restore(&mut self, snap: &HostSnapshot) -> Result<(), String> {
        let to = |v: &serde_json::Value| -> Result<Dynamic, String> {
            let d: Dynamic = rhai::serde::to_dynamic(v).map_err(|e| e.to_string())?;
            Ok(d.into_shared())
        };
        self.guidance.state = to(&snap.state)?;
        for role in [Role::Reward, Role::Intervene] {
            if let (Some(v), Some(slot)) = (snap.states.get(role.name()), self.slot_mut(role)) {
                slot.state = to(v)?;
            }
        }
        self.history = snap.history.clone();
        Ok(())
    }
}

fn state_json(state: &Dynamic) -> serde_json::Value {
    serde_json::to_value(state.flatten_clone()).unwrap_or(serde_json::Value::Null)
}

/// Call a new version's entry point once on sample input (state copy), so
/// a version that fails at once never becomes active.
fn trial(role: Role, s: &Script, sample: &TaskView, state: Dynamic) -> Result<(), ScriptError> {
    let file = s.file();
    match role {
        Role::Guidance => {
            if s.has_fn("plan", 2) {
                let v = s.call("plan", (to_dynamic(sample), state))?;
                specs_from(&file, "plan()", v, sample.group_size.max(1) as usize)
                    .map_err(|e| at_fn(s, "plan", e))?;
            }
        }
        Role::Reward => {
            if s.has_fn("reward", 2) {
                let ep = EpisodeView {
                    task_id: sample.id.clone(),
                    success: true,
                    env_reward: 1.0,
                    invalid: 1,
                    policy_turns: sample.expert_len.max(1),
                    expert_len: sample.expert_len,
                    prefix: 0,
                    plan_k: 0,
                    expert: false,
                    expert_match: sample.expert_len,
                    actions: vec!["look".into()],
                    error: false,
                };
                number_from(&file, s.call("reward", (to_dynamic(&ep), state))?)
                    .map_err(|e| at_fn(s, "reward", e))?;
            }
        }
        Role::Intervene => {
            if s.has_fn("intervene", 2) {
                let t = TurnView {
                    task_id: sample.id.clone(),
                    turn: 3,
                    invalid_streak: 3,
                    invalid: 3,
                    last_action: "look".into(),
                    observation: "Nothing happens.".into(),
                    expert_next: "look".into(),
                    expert_len: sample.expert_len,
                    prefix: 0,
                    plan_k: 0,
                };
                intervention_from(&file, s.call("intervene", (to_dynamic(&t), state))?)
                    .map_err(|e| at_fn(s, "intervene", e))?;
            }
        }
    }
    Ok(())
}

/// A wrong return value of entry point `name`: positioned at its
/// definition.
fn at_fn(s: &Script, name: &str, e: ScriptError) -> ScriptError {
    if e.line > 0 {
        return e;
    }
    let mut at = s.fn_position(name);
    at.msg = e.msg;
    at
}

fn type_error(file: &str, msg: String) -> ScriptError {
    ScriptError {
        file: file.to_string(),
        line: 0,
        col: 0,
        msg,
    }
}

/// Check a spec result: one spec (repeated `r` times, the group size) or
/// an array of specs, one per rollout (any length up to
/// [`MAX_ROUND_ROLLOUTS`]: TraPO's micro-groups are smaller than a group).
fn specs_from(
    file: &str,
    what: &str,
    v: Dynamic,
    r: usize,
) -> Result<Vec<GuidanceSpec>, ScriptError> {
    let bad = |got: &str| {
        type_error(
            file,
            format!("{what} must return a spec or an array of 1..={MAX_ROUND_ROLLOUTS} specs, got {got}"),
        )
    };
    if v.is::<GuidanceSpec>() {
        return Ok(vec![v.cast::<GuidanceSpec>(); r]);
    }
    if v.is::<Array>() {
        let arr = v.cast::<Array>();
        if arr.is_empty() || arr.len() > MAX_ROUND_ROLLOUTS {
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

/// Most rollouts one review round may ask for per task.
pub const MAX_ROUND_ROLLOUTS: usize = 256;

/// Check a `review` result.
fn review_from(file: &str, v: Dynamic, group_size: usize) -> Result<Review, ScriptError> {
    const SHAPE: &str = "review() must return () to accept, #{ select: round } or #{ guidance: spec or [specs], rollouts: n, mode: \"probe\" | \"replace\" | \"append\", keep: bool }";
    if v.is_unit() {
        return Ok(Review::Accept);
    }
    let Some(m) = v.clone().try_cast::<Map>() else {
        return Err(type_error(file, format!("{SHAPE}; got {}", v.type_name())));
    };
    for k in m.keys() {
        if !["guidance", "rollouts", "mode", "use", "keep", "select"].contains(&k.as_str()) {
            return Err(type_error(file, format!("{SHAPE}; unknown key `{k}`")));
        }
    }
    if let Some(sel) = m.get("select") {
        let i = sel.as_int().ok().filter(|i| *i >= 0).ok_or_else(|| {
            type_error(file, format!("{SHAPE}; `select` must be a round index ≥ 0"))
        })?;
        return Ok(Review::Select(i as usize));
    }
    let Some(g) = m.get("guidance") else {
        return Err(type_error(file, format!("{SHAPE}; `guidance` is missing")));
    };
    let rollouts = match m.get("rollouts") {
        Some(n) => Some(
            n.as_int()
                .ok()
                .filter(|n| (1..=MAX_ROUND_ROLLOUTS as i64).contains(n))
                .ok_or_else(|| {
                    type_error(
                        file,
                        format!("{SHAPE}; `rollouts` must be 1..={MAX_ROUND_ROLLOUTS}"),
                    )
                })? as usize,
        ),
        None => None,
    };
    let specs = specs_from(
        file,
        "review()'s `guidance`",
        g.clone(),
        rollouts.unwrap_or(group_size),
    )?;
    if let Some(n) = rollouts.filter(|&n| n != specs.len()) {
        return Err(type_error(
            file,
            format!(
                "{SHAPE}; `rollouts` is {n} but `guidance` holds {} specs",
                specs.len()
            ),
        ));
    }
    // `mode` (`use` is a reserved word in Rhai; `"use"` quoted works too).
    let use_ = match m
        .get("mode")
        .or_else(|| m.get("use"))
        .map(|u| u.to_string())
    {
        None => RoundUse::Probe,
        Some(u) => match u.as_str() {
            "probe" => RoundUse::Probe,
            "replace" => RoundUse::Replace,
            "append" => RoundUse::Append,
            other => {
                return Err(type_error(
                    file,
                    format!("{SHAPE}; unknown mode \"{other}\""),
                ))
            }
        },
    };
    let keep = match m.get("keep") {
        None => false,
        Some(k) => k
            .as_bool()
            .map_err(|_| type_error(file, format!("{SHAPE}; `keep` must be a bool")))?,
    };
    Ok(Review::Round(RoundRequest { specs, use_, keep }))
}

fn number_from(file: &str, v: Dynamic) -> Result<f64, ScriptError> {
    let x = if let Ok(f) = v.as_float() {
        f
    } else if let Ok(i) = v.as_int() {
        i as f64
    } else {
        return Err(type_error(
            file,
            format!("reward() must return a number, got {}", v.type_name()),
        ));
    };
    if !x.is_finite() {
        return Err(type_error(file, format!("reward() returned {x}")));
    }
    Ok(x)
}

fn intervention_from(file: &str, v: Dynamic) -> Result<Intervention, ScriptError> {
    const SHAPE: &str = "intervene() must return (), #{ hint: text } or #{ stop: true }";
    if v.is_unit() {
        return Ok(Intervention::Nothing);
    }
    let Some(m) = v.clone().try_cast::<Map>() else {
        return Err(type_error(file, format!("{SHAPE}; got {}", v.type_name())));
    };
    if let Some(s) = m.get("stop") {
        if s.as_bool().unwrap_or(false) {
            return Ok(Intervention::Stop);
        }
    }
    match m.get("hint") {
        Some(h) if h.is_string() => {
            let h = h.to_string();
            let h: String = h.chars().take(MAX_HINT_CHARS).collect();
            Ok(if h.trim().is_empty() {
                Intervention::Nothing
            } else {
                Intervention::Hint(h)
            })
        }
        Some(h) => Err(type_error(
            file,
            format!("{SHAPE}; `hint` must be a string, got {}", h.type_name()),
        )),
        None if m.contains_key("stop") => Ok(Intervention::Nothing),
        None => Err(type_error(
            file,
            format!("{SHAPE}; got a map without `hint` or `stop`"),
        )),
    }
}

/// `actguide check`: compile a script (guidance, reward or intervention)
/// and call each entry point it defines on synthetic tasks, groups,
/// episodes and turns. Returns a readable trace, or the first error with
/// its position.
pub fn check_script(path: &Path) -> Result<Vec<String>, ScriptError> {
    use crate::guidance::rounds::{drive, DriveReport, Request};
    use crate::guidance::simulate::SimEpisode;
    use rand::{Rng, SeedableRng};

    let handles = HostHandles::new();
    let script = Script::load(&handles, path)?;
    let mut out = vec![format!(
        "compiled {} (version {})",
        path.display(),
        script.hash
    )];
    for (p, _) in &script.imports {
        out.push(format!("imports {}", p.display()));
    }
    let is_guidance = ["plan", "update"].iter().any(|f| script.has_fn(f, 2))
        || script.has_fn("review", 3)
        || script.has_fn("init", 1)
            && !script.has_fn("reward", 2)
            && !script.has_fn("intervene", 2);
    let is_reward = script.has_fn("reward", 2);
    let is_intervene = script.has_fn("intervene", 2);
    if !(is_guidance || is_reward || is_intervene) {
        return Err(type_error(
            &script.file(),
            "defines none of the entry points init(state), plan(task, state), review(task, group, state), update(batch, state), reward(episode, state), intervene(turn, state)".into(),
        ));
    }
    let types = ["pick_and_place", "pick_heat_then_place", "pick_two_obj"];
    let view = |i: usize, step: i64, h: TaskHistory| TaskView {
        id: format!("task-{i}"),
        task_type: types[i].into(),
        cluster: i as i64,
        expert_len: [1, 4, 9][i],
        difficulty: [1, 4, 9][i],
        visits: h.visits,
        last_success: h.last_success,
        step,
        total_steps: 10,
        group_size: 4,
    };
    if is_guidance {
        let mut host = GuidanceHost::new(path, 0)?;
        for f in ["init", "plan", "review", "update"] {
            let arity = match f {
                "init" => 1,
                "review" => 3,
                _ => 2,
            };
            if !host.guidance.script.has_fn(f, arity) {
                out.push(format!("{f}: not defined (the host's default applies)"));
            }
        }
        host.init()?;
        for step in 0..2usize {
            let views: Vec<TaskView> = (0..3)
                .map(|i| view(i, step as i64, host.history(&format!("task-{i}"))))
                .collect();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(step as u64);
            let mut lines = Vec::new();
            let mut exec = |_: &mut GuidanceHost,
                            reqs: &[Request]|
             -> Result<Vec<SimEpisode>, ScriptError> {
                let mut by_task: BTreeMap<usize, Vec<String>> = BTreeMap::new();
                let eps = reqs
                    .iter()
                    .map(|r| {
                        let len = [1usize, 4, 9][r.task];
                        let spec = r.spec.resolve(len);
                        by_task.entry(r.task).or_default().push(r.spec.to_string());
                        // Deeper guidance, shorter tasks: likelier success.
                        let p = (0.9 - 0.1 * (len - spec.prefix.max(spec.plan).min(len)) as f64)
                            .max(0.0);
                        SimEpisode {
                            spec,
                            success: spec.expert || rng.random::<f64>() < p,
                        }
                    })
                    .collect();
                for (t, specs) in by_task {
                    lines.push(format!(
                        "step {step} plan(cluster {t}, expert_len {}) -> [{}]",
                        [1, 4, 9][t],
                        specs.join(", ")
                    ));
                }
                Ok(eps)
            };
            let mut report = DriveReport::default();
            let groups = drive(&mut host, step, &views, 4, &mut exec, &mut report)?;
            if let Some(e) = report.errors.into_iter().next() {
                return Err(e);
            }
            out.append(&mut lines);
            let results: Vec<TaskResult> = views
                .iter()
                .zip(&groups)
                .map(|(v, g)| {
                    let s: Vec<bool> = g.training().map(|r| r.ep.success).collect();
                    let rate = s.iter().filter(|&&x| x).count() as f64 / s.len().max(1) as f64;
                    TaskResult {
                        id: v.id.clone(),
                        task_type: v.task_type.clone(),
                        cluster: v.cluster,
                        expert_len: v.expert_len,
                        depth: 0.0,
                        depth_ratio: 0.0,
                        plan_k: 0.0,
                        guided: false,
                        rewards: s.iter().map(|&x| f64::from(u8::from(x))).collect(),
                        successes: s,
                        success_rate: rate,
                        rollouts: g.spent() as i64,
                        rounds: g.rounds as i64,
                    }
                })
                .collect();
            for r in &results {
                out.push(format!(
                    "step {step} {}: {} rollouts in {} rounds, success {:.2}",
                    r.id, r.rollouts, r.rounds, r.success_rate
                ));
            }
            if let Some(e) = host.update(step, &results, &BTreeMap::new()) {
                return Err(e);
            }
            host.end_step();
            out.push(format!("step {step} update -> state {}", host.state_json()));
        }
        for l in host.take_effects().logs {
            out.push(format!("log: {l}"));
        }
    }
    if is_reward || is_intervene {
        let mut host = GuidanceHost::new(path, 0)?;
        if is_reward {
            host.set_reward_script(path)?;
        }
        if is_intervene {
            host.set_intervene_script(path)?;
        }
        host.init()?;
        for (i, (success, invalid, turns)) in [(true, 0, 4), (false, 3, 8), (true, 2, 9)]
            .into_iter()
            .enumerate()
        {
            if !is_reward {
                break;
            }
            let ep = EpisodeView {
                task_id: format!("task-{i}"),
                success,
                env_reward: f64::from(u8::from(success)),
                invalid,
                policy_turns: turns,
                expert_len: 4,
                prefix: 0,
                plan_k: 0,
                expert: false,
                expert_match: if success { 4 } else { 1 },
                actions: vec!["go to desk 1".into(); turns as usize],
                error: false,
            };
            let (r, e) = host.reward(0, i, &ep);
            if let Some(e) = e {
                return Err(e);
            }
            out.push(format!(
                "reward(success {success}, invalid {invalid}, turns {turns}) -> {}",
                r.unwrap_or(f64::NAN)
            ));
        }
        for streak in [0i64, 1, 2, 3, 5] {
            if !is_intervene {
                break;
            }
            let t = TurnView {
                task_id: "task-0".into(),
                turn: streak + 1,
                invalid_streak: streak,
                invalid: streak,
                last_action: "look".into(),
                observation: "Nothing happens.".into(),
                expert_next: "go to desk 1".into(),
                expert_len: 4,
                prefix: 0,
                plan_k: 0,
            };
            let (r, e) = host.intervene(0, &t);
            if let Some(e) = e {
                return Err(e);
            }
            out.push(format!("intervene(invalid_streak {streak}) -> {r:?}"));
        }
    }
    Ok(out)
}

/// Checkpointed host state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostSnapshot {
    pub state: serde_json::Value,
    pub history: BTreeMap<String, TaskHistory>,
    /// States of the reward and intervention scripts, by role name.
    #[serde(default)]
    pub states: BTreeMap<String, serde_json::Value>,
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
        assert_eq!(s[2].to_string(), "plan(2)");
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
            rollouts: 0,
            rounds: 0,
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
