//! Hot reload: at a step boundary every edited script is recompiled and
//! tried once on sample input (on a copy of its state); a version that
//! passes becomes active and is on probation until it has been through one
//! step. A runtime error during probation swaps the last good version back
//! in. A version that fails to compile or fails its trial never becomes
//! active.

use std::path::{Path, PathBuf};

use rhai::Dynamic;

use super::{GuidanceRuntime, Role};
use crate::guidance::decode::{at_fn, intervention_from, number_from, specs_from};
use crate::guidance::script_inputs::{EpisodeView, TaskView, TurnView};
use crate::script::{to_dynamic, Script, ScriptError};

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

impl GuidanceRuntime {
    /// Follow `path` for reloads of `role` (the script may have been
    /// loaded from a saved copy).
    pub fn set_source(&mut self, role: Role, path: &Path) {
        if let Some(s) = self.slot_mut(role) {
            s.source = path.to_path_buf();
        }
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
    pub(super) fn failed(&mut self, role: Role, e: ScriptError) -> ScriptError {
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
