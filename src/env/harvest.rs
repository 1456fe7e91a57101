//! Building a task panel from an external env: each task's goal is read
//! from the first observation the env shows for its world, its expert
//! actions come from the env (where `env.expert` says: per task, or from
//! an env instance reset to it), its difficulty is their length, and the
//! expert is replayed to check that it really solves the task.
//!
//! What the env showed on the way (every observation, status and
//! admissible action) is kept as [`Seen`], written beside the panel: a
//! word-level vocabulary built from the panel alone misses the objects an
//! env names only in its observations and action lists.
//!
//! Nothing is dropped silently: every task that could not be built (the
//! env failed, no goal in the observation, an expert that does not
//! succeed) is returned with the reason.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::panel::PanelError;
use super::{make_env, EnvError, EnvKind, EnvSpec, ExpertSource, Observation, Task};

/// One task to build: how to reset the env to it. A line of a worlds
/// file: `{"id": "…", "world": {…}, "type": "…", "goal": "…"}` (`type`
/// and `goal` optional).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskSeed {
    pub id: String,
    pub world: serde_json::Value,
    #[serde(rename = "type", default)]
    pub task_type: String,
    /// A goal known beforehand: sent with the reset (envs that render the
    /// task's goal show it), and kept when the first observation names
    /// none.
    #[serde(default)]
    pub goal: String,
}

/// Read a worlds file: one [`TaskSeed`] per line, blank lines skipped,
/// errors with the file and 1-based line, ids unique, at least one seed.
pub fn read_seeds(path: &std::path::Path) -> Result<Vec<TaskSeed>, PanelError> {
    let text = std::fs::read_to_string(path).map_err(|source| PanelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut seeds = Vec::new();
    let mut first: std::collections::BTreeMap<String, usize> = Default::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let seed: TaskSeed = serde_json::from_str(line).map_err(|e| PanelError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            msg: e.to_string(),
        })?;
        if let Some(&f) = first.get(&seed.id) {
            return Err(PanelError::DuplicateId {
                path: path.to_path_buf(),
                line: i + 1,
                id: seed.id,
                first: f,
            });
        }
        first.insert(seed.id.clone(), i + 1);
        seeds.push(seed);
    }
    if seeds.is_empty() {
        return Err(PanelError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(seeds)
}

/// How the panel is built.
#[derive(Debug, Clone, PartialEq)]
pub struct HarvestOptions {
    /// The goal is the text after the last occurrence of this marker in
    /// the first observation, up to the end of its line, without a final
    /// full stop (ALFWorld and AgentGym: "Your task is to:").
    pub goal_after: String,
    /// Replay each expert and keep only tasks it solves.
    pub verify: bool,
    /// Step limit of a replay, on top of the expert's length.
    pub slack: usize,
}

impl Default for HarvestOptions {
    fn default() -> Self {
        HarvestOptions {
            goal_after: "Your task is to:".into(),
            verify: true,
            slack: 1,
        }
    }
}

/// A task that could not be built, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    pub id: String,
    pub reason: String,
}

/// The built panel, the tasks left out, and what the env showed.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Harvest {
    pub tasks: Vec<Task>,
    pub rejected: Vec<Rejected>,
    pub seen: Seen,
}

/// What an env showed while a panel was built from it: every admissible
/// action it listed, and the words (whitespace-separated, as shown) of
/// every observation and status. Kept beside the panel
/// ([`Seen::path_for`]) for `init-tiny --panel` and the run's encoding
/// check.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Seen {
    pub actions: BTreeSet<String>,
    pub words: BTreeSet<String>,
}

impl Seen {
    /// The file beside `panel`: `train.jsonl` → `train.seen.json`.
    pub fn path_for(panel: &Path) -> PathBuf {
        panel.with_extension("seen.json")
    }

    /// Record one observation (its text and actions) and a status line.
    pub fn record(&mut self, obs: &Observation, status: &str) {
        self.actions.extend(obs.admissible.iter().cloned());
        for text in [obs.text.as_str(), status] {
            self.words.extend(text.split_whitespace().map(String::from));
        }
    }

    /// The file beside `panel`, if there is one.
    pub fn read_for(panel: &Path) -> Result<Option<Seen>, PanelError> {
        let path = Self::path_for(panel);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(PanelError::Io { path, source }),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| PanelError::Parse {
                path,
                line: e.line(),
                msg: e.to_string(),
            })
    }

    /// Write it beside `panel`; returns the path.
    pub fn write_for(&self, panel: &Path) -> Result<PathBuf, PanelError> {
        let path = Self::path_for(panel);
        let text = serde_json::to_string_pretty(self).expect("strings serialise");
        std::fs::write(&path, text + "\n").map_err(|source| PanelError::Io {
            path: path.clone(),
            source,
        })?;
        Ok(path)
    }
}

/// Build a panel from the env `spec` reaches, one task per seed, in order.
/// Errors only when the env cannot supply expert actions at all (a
/// built-in env, or an external one whose expert source is the panel);
/// each task's own failures are in [`Harvest::rejected`].
pub fn harvest(
    spec: &EnvSpec,
    seeds: &[TaskSeed],
    o: &HarvestOptions,
) -> Result<Harvest, EnvError> {
    match &spec.kind {
        EnvKind::Builtin(k) => {
            return Err(EnvError::Other(format!(
                "the built-in env {} has generated panels (`actguide tasks generate`)",
                k.name()
            )))
        }
        EnvKind::Http {
            expert: ExpertSource::Panel,
            ..
        }
        | EnvKind::Subprocess {
            expert: ExpertSource::Panel,
            ..
        } => {
            return Err(EnvError::Other(
                "the env must supply the expert actions: say where it has them \
                 (--expert task, instance or reset:<field>)"
                    .into(),
            ))
        }
        _ => {}
    }
    let mut out = Harvest::default();
    for seed in seeds {
        match build_one(spec, seed, o, &mut out.seen) {
            Ok(t) => out.tasks.push(t),
            Err(reason) => out.rejected.push(Rejected {
                id: seed.id.clone(),
                reason,
            }),
        }
    }
    Ok(out)
}

/// One task: goal from the first observation, expert from the env,
/// checked by replay.
fn build_one(
    spec: &EnvSpec,
    seed: &TaskSeed,
    o: &HarvestOptions,
    seen: &mut Seen,
) -> Result<Task, String> {
    let mut task = Task {
        id: seed.id.clone(),
        task_type: seed.task_type.clone(),
        goal: seed.goal.clone(),
        world: seed.world.clone(),
        expert: Vec::new(),
        difficulty: 0,
    };
    let first = {
        let mut env = make_env(spec, 1);
        let first = env.reset(&task).map_err(|e| format!("reset: {e}"))?;
        seen.record(&first, &env.status());
        first
    };
    task.goal = goal_of(&first.text, &o.goal_after)
        .or_else(|| (!seed.goal.is_empty()).then(|| seed.goal.clone()))
        .ok_or_else(|| {
            let cut: String = first.text.chars().take(160).collect();
            format!(
                "no goal after {:?} in the first observation: {cut:?}",
                o.goal_after
            )
        })?;
    super::fill_experts(spec, std::slice::from_mut(&mut task))
        .map_err(|e| format!("expert: {e}"))?;
    if task.expert.is_empty() {
        return Err("the env gave no expert actions".into());
    }
    task.difficulty = task.expert.len();
    if o.verify {
        replay(spec, &task, o.slack, seen)?;
    }
    Ok(task)
}

/// The goal in an observation: the rest of the line after the last
/// `marker`, trimmed, without a final full stop.
pub fn goal_of(observation: &str, marker: &str) -> Option<String> {
    let at = observation.rfind(marker)? + marker.len();
    let line = observation[at..].lines().next().unwrap_or("").trim();
    let goal = line.strip_suffix('.').unwrap_or(line).trim();
    (!goal.is_empty()).then(|| goal.to_string())
}

/// Replay the expert: every action must be admissible (when the env
/// lists actions) and the last must end the episode with success.
fn replay(spec: &EnvSpec, task: &Task, slack: usize, seen: &mut Seen) -> Result<(), String> {
    let mut env = make_env(spec, task.expert.len() + slack);
    let mut obs = env.reset(task).map_err(|e| format!("replay reset: {e}"))?;
    seen.record(&obs, &env.status());
    for (i, a) in task.expert.iter().enumerate() {
        if !obs.admissible.is_empty() && !obs.admissible.contains(a) {
            return Err(format!("expert action {} ({a:?}) is not admissible", i + 1));
        }
        if obs.done {
            return Err(format!("the episode ended before expert action {}", i + 1));
        }
        obs = env
            .step(a)
            .map_err(|e| format!("replay step {}: {e}", i + 1))?;
        seen.record(&obs, &env.status());
    }
    if obs.done && obs.success {
        Ok(())
    } else {
        Err(format!(
            "the expert's {} actions do not solve the task (done {}, success {})",
            task.expert.len(),
            obs.done,
            obs.success
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_goal_is_the_line_after_the_last_marker() {
        let obs = "You are in a room.\n\nYour task is to: put a clean mug in cabinet.";
        assert_eq!(
            goal_of(obs, "Your task is to:").as_deref(),
            Some("put a clean mug in cabinet")
        );
        assert_eq!(
            goal_of("Goal: a\nGoal: buy socks\nmore", "Goal:").as_deref(),
            Some("buy socks")
        );
        assert_eq!(goal_of("Your task is to: .", "Your task is to:"), None);
        assert_eq!(goal_of("no marker here", "Your task is to:"), None);
    }

    #[test]
    fn built_in_envs_and_external_ones_without_experts_are_refused() {
        let e = harvest(
            &EnvSpec::builtin(crate::env::BuiltinEnv::Household),
            &[],
            &HarvestOptions::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("tasks generate"), "{e}");
        let spec = EnvSpec {
            kind: EnvKind::Http {
                url: "http://127.0.0.1:9".into(),
                id_field: "id".into(),
                expert: ExpertSource::Panel,
            },
            ..EnvSpec::builtin(crate::env::BuiltinEnv::Household)
        };
        let e = harvest(&spec, &[], &HarvestOptions::default()).unwrap_err();
        assert!(e.to_string().contains("--expert task"), "{e}");
    }
}
