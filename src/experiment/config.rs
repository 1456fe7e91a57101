//! Experiment files: a Rhai file that evaluates to a map describing the run
//! (seed, model, env and panels, guidance script, rollout and trainer
//! settings, eval schedule, step budget). Unknown keys and wrong types are
//! rejected with the key's path and its line:col in the file.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::script::ScriptError;

/// A whole experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Experiment {
    /// Run name: the run directory is `<runs_dir>/<name>`.
    pub name: String,
    #[serde(default)]
    pub seed: u64,
    /// Optimiser steps in the run.
    pub steps: usize,
    #[serde(default = "d_runs_dir")]
    pub runs_dir: String,
    pub model: ModelSection,
    pub env: EnvSection,
    pub guidance: GuidanceSection,
    #[serde(default)]
    pub rollout: RolloutSection,
    #[serde(default)]
    pub trainer: TrainerSection,
    #[serde(default)]
    /// (`eval` is a reserved word in Rhai, hence the long name.)
    pub evaluation: EvalSection,
    #[serde(default)]
    pub checkpoint: CheckpointSection,
}

fn d_runs_dir() -> String {
    "runs".into()
}

/// Which model to train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// An HF folder (`config.json`, `tokenizer.json`, optionally
    /// `tokenizer_config.json`, `generation_config.json` and weights —
    /// without weights the model is initialised from the run seed) or a
    /// `.gguf` file (see [`crate::model::ModelSource`]).
    pub path: String,
    #[serde(default = "d_device")]
    pub device: String,
    /// LoRA adapters on a frozen base; absent: every weight trains.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<crate::model::LoraConfig>,
}

fn d_device() -> String {
    "cpu".into()
}

/// Environment and task panels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvSection {
    /// "household", "shop", "searchqa" (built-in), "http" (AgentGym env
    /// server at `url`) or "subprocess" (`command` speaking
    /// envs/PROTOCOL.md).
    #[serde(default)]
    pub kind: crate::env::EnvKindName,
    pub train: String,
    pub test: String,
    /// Episode step limit in policy actions (executed expert prefix
    /// actions come on top).
    #[serde(default = "d_max_steps")]
    pub max_steps: usize,
    /// If set, a task's policy budget is min(max_steps, expert actions
    /// left + step_slack): rewarded episodes then hold little wandering.
    #[serde(default)]
    pub step_slack: Option<usize>,
    /// http: the env server's base URL.
    #[serde(default)]
    pub url: Option<String>,
    /// http: the id field of the server's dialect ("id" for AgentGym's
    /// ALFWorld adapter, "env_idx" for its WebShop adapter).
    #[serde(default = "d_id_field")]
    pub id_field: String,
    /// subprocess: the program and its arguments.
    #[serde(default)]
    pub command: Vec<String>,
    /// External envs: seconds to wait for one reply, and extra attempts of
    /// requests that are safe to repeat (create, reset, expert).
    #[serde(default = "d_timeout_s")]
    pub timeout_s: f64,
    #[serde(default = "d_retries")]
    pub retries: usize,
    /// External envs: a done step with at least this reward is a success
    /// (unless the reply says `success`).
    #[serde(default = "d_success_reward")]
    pub success_reward: f64,
}

fn d_id_field() -> String {
    "id".into()
}
fn d_timeout_s() -> f64 {
    30.0
}
fn d_retries() -> usize {
    2
}
fn d_success_reward() -> f64 {
    1.0
}

impl EnvSection {
    /// The env spec the runner builds envs from.
    pub fn spec(&self) -> crate::env::EnvSpec {
        use crate::env::{external::Limits, EnvKind, EnvKindName, EnvSpec};
        let kind = match self.kind {
            EnvKindName::Http => EnvKind::Http {
                url: self.url.clone().unwrap_or_default(),
                id_field: self.id_field.clone(),
            },
            EnvKindName::Subprocess => EnvKind::Subprocess {
                command: self.command.clone(),
            },
            EnvKindName::Builtin(k) => EnvKind::Builtin(k),
        };
        EnvSpec {
            kind,
            limits: Limits {
                timeout: std::time::Duration::from_secs_f64(self.timeout_s.clamp(0.001, 86_400.0)),
                retries: self.retries,
            },
            success_reward: self.success_reward,
        }
    }
}

fn d_max_steps() -> usize {
    50
}

/// Guidance script and clustering.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuidanceSection {
    pub script: String,
    /// Number of difficulty clusters (quantiles of expert length).
    #[serde(default = "d_clusters")]
    pub clusters: usize,
    /// Most review rounds per task and step after the planned one.
    #[serde(default = "d_max_rounds")]
    pub max_rounds: usize,
    /// Reward-shaping script (`reward(episode, state)`), if any.
    #[serde(default)]
    pub reward: Option<String>,
    /// Intervention script (`intervene(turn, state)`), if any.
    #[serde(default)]
    pub intervene: Option<String>,
}

fn d_max_rounds() -> usize {
    8
}

fn d_clusters() -> usize {
    3
}

/// How rollouts are generated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutSection {
    /// Tasks per step (each gets a group of `group_size` rollouts).
    pub tasks_per_step: usize,
    pub group_size: usize,
    pub temperature: f64,
    pub top_p: f64,
    /// Restrict generation to the admissible actions (token trie).
    pub constrained: bool,
    /// Number of recent (observation, action) pairs in the prompt.
    pub history: usize,
    /// Reward added per invalid action (usually ≤ 0).
    pub invalid_penalty: f64,
    /// Most tokens generated for one action.
    pub max_action_tokens: usize,
    /// List the admissible actions in the prompt.
    pub show_actions: bool,
    /// Prompt and answer format: "plain" (the word-level format, bare
    /// action + eos) or "chat" (the model's chat template, auto-detected
    /// from the tokenizer, and `<action>…</action>` answers ending with the
    /// end-of-turn token); "chatml" / "llama3" force a template.
    pub format: String,
}

impl Default for RolloutSection {
    fn default() -> Self {
        RolloutSection {
            tasks_per_step: 8,
            group_size: 8,
            temperature: 1.0,
            top_p: 1.0,
            constrained: true,
            history: 2,
            invalid_penalty: 0.0,
            max_action_tokens: 16,
            show_actions: true,
            format: "plain".into(),
        }
    }
}

/// GRPO / PPO trainer settings (ALGORITHMS.md §1, §3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerSection {
    pub lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub warmup_steps: usize,
    /// "cosine" or "constant" after warm-up.
    pub schedule: String,
    /// Final lr as a fraction of `lr` for the cosine schedule.
    pub min_lr_ratio: f64,
    /// Global gradient-norm clip (0 = off).
    pub grad_clip: f64,
    /// "grpo" (divide by group std) or "dr_grpo" (no std division).
    pub advantage: String,
    pub clip_low: f64,
    pub clip_high: f64,
    /// Dual-clip constant c for negative advantages (0 = off).
    pub dual_clip: f64,
    /// "token_mean" or "seq_mean_token_mean".
    pub aggregation: String,
    /// KL coefficient β to the frozen initial policy (k3); 0 = off.
    pub kl_coef: f64,
    /// Auxiliary NLL weight η on executed expert prefix actions.
    pub aux_nll_coef: f64,
    /// How turns under a plan or hint are trained: "internalize"
    /// (ActGuide-RL), "on_policy" or "dual"; `plan(k).with_loss(..)` overrides.
    pub plan_loss: String,
    /// Weight of the unguided off-policy term in the `dual` mode.
    pub dual_weight: f64,
    /// γ of LUFFY's shaped off-policy ratio x / (x + γ) for expert() data.
    pub luffy_gamma: f64,
    /// Train executed prefix actions as forced tokens in the policy loss
    /// (StepHint), besides the aux NLL.
    pub train_prefix: bool,
    /// Forced tokens get no negative advantage (StepHint's protection).
    pub protect_forced: bool,
    pub entropy_coef: f64,
    /// Passes over each batch and minibatches per pass.
    pub ppo_epochs: usize,
    pub minibatches: usize,
    /// Sequences scored per forward/backward (memory bound only).
    pub micro_batch: usize,
}

impl Default for TrainerSection {
    fn default() -> Self {
        TrainerSection {
            lr: 1e-3,
            weight_decay: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            warmup_steps: 0,
            schedule: "cosine".into(),
            min_lr_ratio: 0.1,
            grad_clip: 1.0,
            advantage: "grpo".into(),
            clip_low: 0.2,
            clip_high: 0.28,
            dual_clip: 3.0,
            aggregation: "token_mean".into(),
            kl_coef: 0.0,
            aux_nll_coef: 0.0,
            plan_loss: "internalize".into(),
            dual_weight: 0.1,
            luffy_gamma: 0.1,
            train_prefix: false,
            protect_forced: true,
            entropy_coef: 0.0,
            ppo_epochs: 1,
            minibatches: 1,
            micro_batch: 64,
        }
    }
}

/// Periodic evaluation on the test panel (unguided).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Evaluate every N steps (and at the start and end); 0 = only start/end.
    pub every: usize,
    /// Rollouts per test task.
    pub samples: usize,
    /// Greedy decoding (else sampled at the rollout temperature).
    pub greedy: bool,
    /// Evaluate on at most this many tasks of each panel (0 = all).
    pub max_tasks: usize,
    /// Panels to evaluate on: "test" and/or "train". The first one is the
    /// run's headline success. The first evaluation (step 0) also fixes
    /// each panel's in-region tasks (solved at least once in `samples`),
    /// and every later one reports success in- and out-region.
    pub panels: Vec<String>,
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            every: 10,
            samples: 1,
            greedy: true,
            max_tasks: 0,
            panels: vec!["test".into()],
        }
    }
}

/// Checkpoint schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Write a checkpoint every N steps (and at the end); 0 = end only.
    pub every: usize,
}

impl Default for CheckpointSection {
    fn default() -> Self {
        CheckpointSection { every: 10 }
    }
}

/// Errors loading an experiment file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Script(#[from] ScriptError),
    #[error("{file}:{line}:{col}: {msg}")]
    Field {
        file: String,
        line: usize,
        col: usize,
        msg: String,
    },
    #[error("{file}: {msg}")]
    Invalid { file: String, msg: String },
}

/// Evaluate an experiment file's source to its JSON map.
fn source_to_json(file: &str, source: &str) -> Result<serde_json::Value, ConfigError> {
    let (engine, _) = crate::script::new_engine();
    let value: rhai::Dynamic = engine
        .eval::<rhai::Dynamic>(source)
        .map_err(|e| ScriptError::from_eval(file, &e))?;
    if !value.is_map() {
        return Err(ConfigError::Invalid {
            file: file.into(),
            msg: format!(
                "an experiment file must evaluate to a map #{{ ... }}, got {}",
                value.type_name()
            ),
        });
    }
    serde_json::to_value(&value).map_err(|e| ConfigError::Invalid {
        file: file.into(),
        msg: e.to_string(),
    })
}

/// What an experiment file describes: one run, or a comparison of several
/// runs that share everything but the keys each one overrides.
#[derive(Debug, Clone, PartialEq)]
pub enum ExperimentFile {
    Single(Box<Experiment>),
    Compare(Comparison),
}

/// A comparison: `compare: [#{ name: "...", <overrides> }, …]` in an
/// experiment map. Each entry is deep-merged into the rest of the map;
/// the runs go to `<runs_dir>/<name>/<entry name>`.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub name: String,
    pub runs_dir: String,
    pub runs: Vec<Experiment>,
}

/// Merge `over` into `base`: maps key by key, anything else replaced.
fn deep_merge(base: &mut serde_json::Value, over: &serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(slot) => deep_merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

impl ExperimentFile {
    /// Evaluate an experiment file: one experiment, or a comparison.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let source = std::fs::read_to_string(path).map_err(|e| ConfigError::Invalid {
            file: file.clone(),
            msg: format!("cannot read experiment file: {e}"),
        })?;
        Self::from_source(&file, &source)
    }

    pub fn from_source(file: &str, source: &str) -> Result<Self, ConfigError> {
        let mut json = source_to_json(file, source)?;
        let Some(list) = json.as_object_mut().and_then(|m| m.remove("compare")) else {
            return Experiment::from_json(file, source, json)
                .map(|e| ExperimentFile::Single(Box::new(e)));
        };
        let (line, col) = locate_key(source, &["compare".to_string()]);
        let at = |msg: String| ConfigError::Field {
            file: file.into(),
            line,
            col,
            msg,
        };
        let entries = list.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
            at("`compare` must be a non-empty array of maps #{ name: \"...\", … }".into())
        })?;
        let name = json["name"].as_str().unwrap_or("compare").to_string();
        let runs_dir = json["runs_dir"].as_str().unwrap_or("runs").to_string();
        let mut runs = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for (i, entry) in entries.iter().enumerate() {
            let rname = entry
                .get("name")
                .and_then(|n| n.as_str())
                .filter(|n| {
                    !n.is_empty()
                        && n.chars()
                            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
                })
                .ok_or_else(|| {
                    at(format!(
                        "`compare[{i}]` needs a `name` of letters, digits, `_`, `-` or `.`"
                    ))
                })?
                .to_string();
            if !seen.insert(rname.clone()) {
                return Err(at(format!(
                    "`compare[{i}]`: the name \"{rname}\" is used twice"
                )));
            }
            let mut merged = json.clone();
            deep_merge(&mut merged, entry);
            merged["name"] = serde_json::json!(rname);
            let exp = Experiment::from_json(file, source, merged).map_err(|e| match e {
                ConfigError::Field {
                    file,
                    line,
                    col,
                    msg,
                } => ConfigError::Field {
                    file,
                    line,
                    col,
                    msg: format!("in compare entry \"{rname}\": {msg}"),
                },
                ConfigError::Invalid { file, msg } => ConfigError::Invalid {
                    file,
                    msg: format!("in compare entry \"{rname}\": {msg}"),
                },
                other => other,
            })?;
            runs.push(exp);
        }
        Ok(ExperimentFile::Compare(Comparison {
            name,
            runs_dir,
            runs,
        }))
    }
}

impl Experiment {
    /// Evaluate an experiment file. Relative paths inside it stay relative
    /// to the working directory (experiments are run from the repo root).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let source = std::fs::read_to_string(path).map_err(|e| ConfigError::Invalid {
            file: file.clone(),
            msg: format!("cannot read experiment file: {e}"),
        })?;
        Self::from_source(&file, &source)
    }

    pub fn from_source(file: &str, source: &str) -> Result<Self, ConfigError> {
        let json = source_to_json(file, source)?;
        if json.get("compare").is_some() {
            return Err(ConfigError::Invalid {
                file: file.into(),
                msg: "this file is a comparison (it has `compare`): run it with `actguide run`"
                    .into(),
            });
        }
        Self::from_json(file, source, json)
    }

    /// Deserialize and validate an experiment map; errors point at the key
    /// in `source`.
    fn from_json(file: &str, source: &str, json: serde_json::Value) -> Result<Self, ConfigError> {
        let exp: Experiment = serde_path_to_error::deserialize(json).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner().to_string();
            // For unknown fields serde names the field in the message; point
            // at it rather than at its parent.
            let mut keys: Vec<String> = if path == "." {
                vec![]
            } else {
                path.split('.').map(str::to_string).collect()
            };
            if let Some(unknown) = inner
                .strip_prefix("unknown field `")
                .and_then(|s| s.split('`').next())
            {
                // serde_path_to_error usually names it already.
                if keys.last().map(String::as_str) != Some(unknown) {
                    keys.push(unknown.to_string());
                }
            }
            let (line, col) = locate_key(source, &keys);
            let shown = if keys.is_empty() {
                "experiment".to_string()
            } else {
                keys.join(".")
            };
            ConfigError::Field {
                file: file.into(),
                line,
                col,
                msg: format!("`{shown}`: {inner}"),
            }
        })?;
        exp.validate(file)?;
        Ok(exp)
    }

    fn validate(&self, file: &str) -> Result<(), ConfigError> {
        let bad = |msg: String| ConfigError::Invalid {
            file: file.into(),
            msg,
        };
        let r = &self.rollout;
        let t = &self.trainer;
        if r.tasks_per_step == 0 || r.group_size == 0 {
            return Err(bad(
                "rollout.tasks_per_step and rollout.group_size must be ≥ 1".into(),
            ));
        }
        let temperature_ok = r.temperature > 0.0; // false for NaN too
        let top_p_ok = r.top_p > 0.0 && r.top_p <= 1.0;
        if !temperature_ok || !top_p_ok {
            return Err(bad(
                "rollout.temperature must be > 0 and rollout.top_p in (0, 1]".into(),
            ));
        }
        if crate::rollout::chat::PromptFormat::parse(&r.format).is_none() {
            return Err(bad(format!(
                "rollout.format must be \"plain\", \"chat\", \"chatml\" or \"llama3\", got \"{}\"",
                r.format
            )));
        }
        if !["grpo", "dr_grpo"].contains(&t.advantage.as_str()) {
            return Err(bad(format!(
                "trainer.advantage must be \"grpo\" or \"dr_grpo\", got \"{}\"",
                t.advantage
            )));
        }
        if !["token_mean", "seq_mean_token_mean"].contains(&t.aggregation.as_str()) {
            return Err(bad(format!(
                "trainer.aggregation must be \"token_mean\" or \"seq_mean_token_mean\", got \"{}\"",
                t.aggregation
            )));
        }
        if !["cosine", "constant"].contains(&t.schedule.as_str()) {
            return Err(bad(format!(
                "trainer.schedule must be \"cosine\" or \"constant\", got \"{}\"",
                t.schedule
            )));
        }
        if !["internalize", "on_policy", "dual"].contains(&t.plan_loss.as_str()) {
            return Err(bad(format!(
                "trainer.plan_loss must be \"internalize\", \"on_policy\" or \"dual\", got \"{}\"",
                t.plan_loss
            )));
        }
        let gamma_ok = t.luffy_gamma > 0.0;
        if !gamma_ok {
            return Err(bad("trainer.luffy_gamma must be > 0".into()));
        }
        if t.ppo_epochs == 0 || t.minibatches == 0 || t.micro_batch == 0 {
            return Err(bad(
                "trainer.ppo_epochs, minibatches and micro_batch must be ≥ 1".into(),
            ));
        }
        let panels = &self.evaluation.panels;
        if panels.is_empty()
            || panels.iter().any(|p| p != "test" && p != "train")
            || (panels.len() == 2 && panels[0] == panels[1])
            || panels.len() > 2
        {
            return Err(bad(format!(
                "evaluation.panels must list \"test\" and/or \"train\" once each, got {panels:?}"
            )));
        }
        let e = &self.env;
        match e.kind {
            crate::env::EnvKindName::Builtin(_) => {}
            crate::env::EnvKindName::Http => {
                if e.url.as_deref().is_none_or(|u| !u.starts_with("http://")) {
                    return Err(bad(
                        "env.kind \"http\" needs env.url = \"http://host:port\"".into(),
                    ));
                }
                if !["id", "env_idx"].contains(&e.id_field.as_str()) {
                    return Err(bad(format!(
                        "env.id_field must be \"id\" or \"env_idx\", got \"{}\"",
                        e.id_field
                    )));
                }
            }
            crate::env::EnvKindName::Subprocess => {
                if e.command.is_empty() {
                    return Err(bad(
                        "env.kind \"subprocess\" needs env.command = [\"program\", \"arg\", …]"
                            .into(),
                    ));
                }
            }
        }
        let timeout_ok = e.timeout_s > 0.0;
        if !timeout_ok {
            return Err(bad("env.timeout_s must be > 0".into()));
        }
        if let Some(l) = &self.model.lora {
            l.projections().map_err(|e| {
                bad(format!(
                    "model.{}",
                    e.to_string().trim_start_matches("invalid model config: ")
                ))
            })?;
        }
        let dev = crate::model::device::DeviceSpec::parse(&self.model.device).map_err(|_| {
            bad(format!(
                "model.device must be \"cpu\", \"cuda\" or \"cuda:N\", got \"{}\"",
                self.model.device
            ))
        })?;
        if !dev.compiled() {
            return Err(bad(format!(
                "model.device \"{}\" is not available in this build (build with `--features cuda`)",
                self.model.device
            )));
        }
        Ok(())
    }

    /// The run directory.
    pub fn run_dir(&self) -> PathBuf {
        Path::new(&self.runs_dir).join(&self.name)
    }
}

/// Find `a: … b: … c:` (the path of keys) in the source: the 1-based line
/// and column of the last key. Best effort: (0, 0) when not found.
fn locate_key(source: &str, keys: &[String]) -> (usize, usize) {
    let mut from = 0usize;
    let mut found = None;
    for key in keys {
        if key.parse::<usize>().is_ok() {
            continue; // array index: no key in the source
        }
        match find_key_from(source, key, from) {
            Some(i) => {
                found = Some(i);
                from = i + key.len();
            }
            None => break,
        }
    }
    match found {
        Some(i) => {
            let before = &source[..i];
            let line = before.matches('\n').count() + 1;
            let col = i - before.rfind('\n').map(|p| p + 1).unwrap_or(0) + 1;
            (line, col)
        }
        None => (0, 0),
    }
}

fn find_key_from(source: &str, key: &str, from: usize) -> Option<usize> {
    let bytes = source.as_bytes();
    let mut start = from;
    while let Some(off) = source[start..].find(key) {
        let i = start + off;
        let before_ok = i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        let rest = source[i + key.len()..].trim_start();
        let quoted = i > 0 && bytes[i - 1] == b'"' && rest.starts_with('"');
        let rest = if quoted { rest[1..].trim_start() } else { rest };
        if (before_ok || quoted) && rest.starts_with(':') && !rest.starts_with("::") {
            return Some(if quoted { i - 1 } else { i });
        }
        start = i + key.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
let steps = 3;
#{
    name: "t",
    seed: 1,
    steps: steps,
    model: #{ path: "models/tiny" },
    env: #{ train: "a.jsonl", test: "b.jsonl" },
    guidance: #{ script: "g.rhai" },
    trainer: #{ lr: 0.001 },
    evaluation: #{ every: 5 },
}
"#;

    #[test]
    fn good_file_parses_with_defaults() {
        let e = Experiment::from_source("x.rhai", GOOD).unwrap();
        assert_eq!(e.steps, 3);
        assert_eq!(e.rollout.group_size, 8);
        assert_eq!(e.trainer.lr, 0.001);
        assert_eq!(e.env.max_steps, 50);
    }

    #[test]
    fn unknown_nested_key_is_positioned() {
        let src = GOOD.replace("lr: 0.001", "lr: 0.001, lrr: 2");
        let e = Experiment::from_source("x.rhai", &src).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with("x.rhai:10:"), "{msg}");
        assert!(msg.contains("`trainer.lrr`"), "{msg}");
        assert!(msg.contains("unknown field"), "{msg}");
    }

    #[test]
    fn wrong_type_is_positioned() {
        let src = GOOD.replace("seed: 1", "seed: \"one\"");
        let msg = Experiment::from_source("x.rhai", &src)
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("x.rhai:5:5:"), "{msg}");
        assert!(msg.contains("`seed`"), "{msg}");
    }

    #[test]
    fn missing_key_and_syntax_error() {
        let src = GOOD.replace("steps: steps,", "");
        let msg = Experiment::from_source("x.rhai", &src)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("missing field `steps`"), "{msg}");
        let msg = Experiment::from_source("x.rhai", "#{ name: }")
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("x.rhai:1:"), "{msg}");
    }

    #[test]
    fn rollout_format_defaults_to_plain_and_is_validated() {
        let e = Experiment::from_source("x.rhai", GOOD).unwrap();
        assert_eq!(e.rollout.format, "plain");
        for ok in ["chat", "chatml", "llama3", "plain"] {
            let src = GOOD.replace(
                "steps: steps,",
                &format!("steps: steps, rollout: #{{ format: \"{ok}\" }},"),
            );
            let e = Experiment::from_source("x.rhai", &src).unwrap();
            assert_eq!(e.rollout.format, ok);
        }
        let src = GOOD.replace(
            "steps: steps,",
            "steps: steps, rollout: #{ format: \"jinja\" },",
        );
        let msg = Experiment::from_source("x.rhai", &src)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("rollout.format must be"), "{msg}");
        assert!(msg.contains("\"jinja\""), "{msg}");
    }
}
