//! Experiment files: a Rhai file that evaluates to a map describing the run
//! (seed, model, env and panels, guidance script, rollout and trainer
//! settings, eval schedule, step budget).
//!
//! This module holds the settings themselves (one struct per section, with
//! their defaults; the trainer's live in [`crate::train::settings`]) and the
//! checks serde cannot express (bounds, settings that need each other); the
//! `env` section, one variant per env kind with that kind's own keys, is
//! its `env` module. Its `load` module reads a file into them, `ranges` holds every numeric
//! setting's range and `position` finds a key's line:col in the source. Unknown keys, wrong types and
//! unknown values of the typed settings (`env.kind`, `model.device`,
//! `rollout.format`, the trainer's choices, `evaluation.panels`) are
//! rejected with the key's path, its line:col in the file and, for
//! choices, the allowed values.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

use crate::model::device::DeviceSpec;
use crate::rollout::chat::PromptFormat;
use crate::script::ScriptError;
pub use crate::train::TrainerSection;

mod env;
mod load;
mod position;
mod ranges;
mod sft;

pub use env::{
    EnvKeyError, EnvKindSection, EnvSection, HttpEnvSection, IdField, SubprocessEnvSection,
};
pub use load::{Comparison, ExperimentFile, ENTRY_MODEL};
pub use sft::SftSection;

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
    /// The supervised warm start (`actguide sft`); absent for RL runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sft: Option<SftSection>,
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
    #[serde(default)]
    pub device: DeviceSpec,
    /// Compute precision, `"f32"` or `"bf16"` (f32 master weights and
    /// optimiser state either way; see [`crate::model::Precision`]).
    /// Absent: bf16 on CUDA, f32 on CPU ([`ModelSection::precision`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<crate::model::Precision>,
    /// LoRA adapters on a frozen base; absent: every weight trains.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<crate::model::LoraConfig>,
    /// Generate rollouts from bf16 copies of the weights (CPU, f32, with
    /// MKL; see [`crate::model::Policy::set_rollout_bf16`]). The trainer
    /// then rescores π_old in f32 and weights each token by the truncated
    /// importance ratio min(π_old / π_bf16, 2), as for an inference engine;
    /// each step's `rollout_bf16` record in metrics.jsonl gives the mismatch.
    /// Absent: chosen at start-up ([`crate::model::Kernels`]): on where the
    /// CPU has AMX-BF16 and MKL is loaded, for models larger than the tiny
    /// ones; off elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_bf16: Option<bool>,
    /// Mixed-precision training: the trained pass's products in bf16 with
    /// f32 accumulation, f32 master weights and AdamW state
    /// ([`crate::model::Policy::set_mixed_precision`]). Absent: chosen at
    /// start-up like `rollout_bf16`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<bool>,
}

impl ModelSection {
    /// The precision this section resolves to on its device.
    pub fn precision(&self) -> crate::model::Precision {
        crate::model::Precision::resolve(self.dtype, self.device)
    }
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
    /// Wall-clock budget of one script call, seconds: a call over it is a
    /// script error (a new version on probation is swapped back).
    #[serde(default = "d_call_budget_s")]
    pub call_budget_s: f64,
}

fn d_call_budget_s() -> f64 {
    crate::script::DEFAULT_CALL_BUDGET_S
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
    /// Chat format only: each episode is one growing conversation (every
    /// past state a user message, every answer the assistant's), so turn
    /// t + 1's prompt extends turn t's and the trainer scores an episode's
    /// turns in one pass; `history` is ignored.
    pub conversation: bool,
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
    pub format: PromptFormat,
    /// Where the policy's turns are generated: `"builtin"` (this process,
    /// the default) or an engine map (`crate::inference`, docs/ENGINES.md).
    #[serde(
        deserialize_with = "crate::inference::config::engine_field",
        skip_serializing_if = "Option::is_none"
    )]
    pub engine: Option<crate::inference::EngineSection>,
    /// Asynchronous rollouts on the engine: step t+1's rollouts are
    /// generated while step t trains (docs/DISTRIBUTED.md).
    #[serde(rename = "async", skip_serializing_if = "Option::is_none")]
    pub async_rollouts: Option<AsyncSection>,
}

/// `rollout.async`: overlap generation with training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AsyncSection {
    /// Episodes sampled more than this many policy versions before the
    /// update that trains on them are dropped (and counted). With one step
    /// of overlap an episode is at most 1 version old; 0 keeps only the
    /// turns generated after the weight sync.
    pub max_staleness: u64,
}

impl Default for AsyncSection {
    fn default() -> Self {
        AsyncSection { max_staleness: 1 }
    }
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
            conversation: false,
            invalid_penalty: 0.0,
            max_action_tokens: 16,
            show_actions: true,
            format: PromptFormat::Plain,
            engine: None,
            async_rollouts: None,
        }
    }
}

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
    #[serde(deserialize_with = "eval_panels")]
    pub panels: Vec<EvalPanel>,
}

/// A task panel evaluations run on (`evaluation.panels`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EvalPanel {
    /// The env's test panel (`env.test`).
    Test,
    /// The env's train panel (`env.train`).
    Train,
}

impl EvalPanel {
    /// The name in experiment files, `eval.jsonl` and seed labels.
    pub fn as_str(self) -> &'static str {
        match self {
            EvalPanel::Test => "test",
            EvalPanel::Train => "train",
        }
    }
}

impl std::fmt::Display for EvalPanel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `evaluation.panels`: "test" and/or "train", each at most once, in the
/// order given (the first is the headline).
fn eval_panels<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<EvalPanel>, D::Error> {
    let names = Vec::<String>::deserialize(d)?;
    let panels: Vec<EvalPanel> = names
        .iter()
        .filter_map(|n| match n.as_str() {
            "test" => Some(EvalPanel::Test),
            "train" => Some(EvalPanel::Train),
            _ => None,
        })
        .collect();
    let once_each = !panels.is_empty()
        && panels.len() == names.len()
        && panels.len() <= 2
        && !(panels.len() == 2 && panels[0] == panels[1]);
    if !once_each {
        return Err(serde::de::Error::custom(format!(
            "must list \"test\" and/or \"train\" once each, got {names:?}"
        )));
    }
    Ok(panels)
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            every: 10,
            samples: 1,
            greedy: true,
            max_tasks: 0,
            panels: vec![EvalPanel::Test],
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

impl Experiment {
    /// The checks serde cannot express (bounds, settings that need each
    /// other), one section at a time.
    fn validate(&self, file: &str) -> Result<(), ConfigError> {
        check_name(file, &self.name)?;
        check_rollout(file, &self.rollout)?;
        if let Some(s) = &self.sft {
            s.check().map_err(|m| invalid(file, &m))?;
        }
        check_model(file, &self.model)
    }

    /// The run directory.
    pub fn run_dir(&self) -> PathBuf {
        Path::new(&self.runs_dir).join(&self.name)
    }
}

/// A check of [`Experiment::validate`] failed.
fn invalid(file: &str, msg: &str) -> ConfigError {
    ConfigError::Invalid {
        file: file.into(),
        msg: msg.into(),
    }
}

/// The run directory is `<runs_dir>/<name>`: a name must stay inside the
/// runs folder and not be the folder itself.
fn check_name(file: &str, name: &str) -> Result<(), ConfigError> {
    let plain =
        !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\', '\0']);
    if !plain {
        return Err(invalid(
            file,
            &format!(
                "name must be a plain directory name (no `/`, `\\`, `.` or `..`), got {name:?}"
            ),
        ));
    }
    Ok(())
}

/// Bounds are in [`ranges::RANGES`]; these are the rollout settings that
/// need each other.
fn check_rollout(file: &str, r: &RolloutSection) -> Result<(), ConfigError> {
    if r.async_rollouts.is_some() && r.engine.is_none() {
        return Err(invalid(
            file,
            "rollout.async overlaps engine generation with training: it needs rollout.engine \
             (built-in generation shares the trainer's weights and cores)",
        ));
    }
    if r.conversation && r.format == PromptFormat::Plain {
        return Err(invalid(
            file,
            "rollout.conversation lays an episode out as chat messages: set rollout.format to \"chat\"",
        ));
    }
    if let Some(e) = &r.engine {
        e.check().map_err(|m| invalid(file, &m))?;
        // Engines report log-probs of the raw distribution (temperature
        // 1): sampling at another temperature would make every token look
        // off-policy.
        if r.temperature != 1.0 {
            return Err(invalid(
                file,
                "rollout.engine: engines report log-probs at temperature 1, so rollout.temperature must be 1.0",
            ));
        }
        if r.format == PromptFormat::Plain {
            return Err(invalid(
                file,
                "rollout.engine serves real models: set rollout.format to \"chat\" (the plain format is the tiny model's)",
            ));
        }
    }
    Ok(())
}

fn check_model(file: &str, m: &ModelSection) -> Result<(), ConfigError> {
    if let Some(l) = &m.lora {
        l.projections().map_err(|e| {
            invalid(
                file,
                &format!(
                    "model.{}",
                    e.to_string().trim_start_matches("invalid model config: ")
                ),
            )
        })?;
    }
    if !m.device.compiled() {
        return Err(invalid(
            file,
            &format!(
                "model.device \"{}\" is not available in this build (build with `--features cuda`)",
                m.device
            ),
        ));
    }
    Ok(())
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
        let msg = refused(&src);
        assert!(msg.starts_with("x.rhai:5:5:"), "{msg}");
        assert!(msg.contains("`seed`"), "{msg}");
    }

    #[test]
    fn missing_key_and_syntax_error() {
        let src = GOOD.replace("steps: steps,", "");
        let msg = refused(&src);
        assert!(msg.contains("missing field `steps`"), "{msg}");
        let msg = Experiment::from_source("x.rhai", "#{ name: }")
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("x.rhai:1:"), "{msg}");
    }

    #[test]
    fn non_finite_numbers_and_missing_keys_are_positioned() {
        let src = GOOD.replace("lr: 0.001", "lr: 0.0 / 0.0");
        let msg = refused(&src);
        assert_eq!(
            msg,
            format!(
                "{}`trainer.lr` is NaN: a setting must be a finite number",
                at(&src, "lr:")
            )
        );
        let src = GOOD.replace("seed: 1", "seed: 1, x: [1.0 / 0.0]");
        let msg = refused(&src);
        assert!(msg.contains("`x.0` is inf"), "{msg}");
        // A missing top-level key points at the map, not at 0:0.
        let src = GOOD.replace("steps: steps,", "");
        let msg = refused(&src);
        assert!(msg.starts_with(&at(&src, "#{")), "{msg}");
        assert!(msg.contains("missing field `steps`"), "{msg}");
    }

    #[test]
    fn the_http_id_field_is_a_choice() {
        let with = |v: &str| {
            GOOD.replace(
                "test: \"b.jsonl\" }",
                &format!(
                    "test: \"b.jsonl\", kind: \"http\", url: \"http://h:1\", id_field: \"{v}\" }}"
                ),
            )
        };
        let e = Experiment::from_source("x.rhai", &with("env_idx")).unwrap();
        let EnvKindSection::Http(http) = &e.env.kind else {
            panic!("{:?}", e.env.kind)
        };
        assert_eq!(http.id_field, IdField::EnvIdx);
        assert_eq!(http.id_field.as_str(), "env_idx");
        let src = with("idx");
        let msg = refused(&src);
        assert_eq!(
            msg,
            format!(
                "{}`env.id_field`: unknown variant `idx`, expected `id` or `env_idx`",
                at(&src, "id_field:")
            )
        );
    }

    #[test]
    fn run_names_stay_inside_the_runs_folder() {
        for bad in ["", ".", "..", "../../../tmp/x", "a/b", "a\\\\b"] {
            let src = GOOD.replace("name: \"t\"", &format!("name: \"{bad}\""));
            let msg = refused(&src);
            assert!(
                msg.contains("name must be a plain directory name"),
                "{bad}: {msg}"
            );
        }
        for ok in ["run", "run-2", "a.b", "quick start"] {
            let src = GOOD.replace("name: \"t\"", &format!("name: \"{ok}\""));
            assert_eq!(Experiment::from_source("x.rhai", &src).unwrap().name, ok);
        }
    }

    #[test]
    fn rollout_format_defaults_to_plain_and_is_validated() {
        let e = Experiment::from_source("x.rhai", GOOD).unwrap();
        assert_eq!(e.rollout.format, PromptFormat::Plain);
        for ok in ["chat", "chatml", "llama3", "plain"] {
            let src = GOOD.replace(
                "steps: steps,",
                &format!("steps: steps, rollout: #{{ format: \"{ok}\" }},"),
            );
            let e = Experiment::from_source("x.rhai", &src).unwrap();
            assert_eq!(e.rollout.format.as_str(), ok);
        }
        let src = GOOD.replace(
            "steps: steps,",
            "steps: steps, rollout: #{ format: \"jinja\" },",
        );
        let msg = refused(&src);
        assert!(msg.contains("rollout.format must be"), "{msg}");
        assert!(msg.contains("\"jinja\""), "{msg}");
    }

    /// The line:col of `needle` in `src`, as the error prefix shows it.
    fn at(src: &str, needle: &str) -> String {
        let i = src.find(needle).unwrap();
        let line = src[..i].matches('\n').count() + 1;
        let col = i - src[..i].rfind('\n').map_or(0, |p| p + 1) + 1;
        format!("x.rhai:{line}:{col}: ")
    }

    /// The message `Experiment::from_source` refuses `src` with.
    fn refused(src: &str) -> String {
        Experiment::from_source("x.rhai", src)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn unknown_setting_values_are_positioned_and_name_the_allowed_ones() {
        // (what the good file says, what the bad one says instead, the key
        // the error points at, the message after the position)
        let mut cases: Vec<(&str, String, &str, String)> = vec![
            (
                "steps: steps,",
                "steps: steps, rollout: #{ format: \"jinja\" },".into(),
                "format:",
                "rollout.format must be \"plain\", \"chat\", \"chatml\" or \"llama3\", got \"jinja\"".into(),
            ),
            (
                "path: \"models/tiny\"",
                "path: \"m\", device: \"gpu\"".into(),
                "device:",
                "model.device must be \"cpu\", \"cuda\" or \"cuda:N\", got \"gpu\"".into(),
            ),
        ];
        for bad in [
            r#"["test", "bogus"]"#,
            r#"["test", "test"]"#,
            r#"["test", "train", "test"]"#,
            "[]",
        ] {
            let got: Vec<String> = serde_json::from_str(bad).unwrap();
            cases.push((
                "every: 5",
                format!("every: 5, panels: {bad}"),
                "panels:",
                format!(
                    "evaluation.panels must list \"test\" and/or \"train\" once each, got {got:?}"
                ),
            ));
        }
        cases.push((
            "lr: 0.001",
            "lr: 0.001, schedule: \"linear\"".into(),
            "schedule:",
            "`trainer.schedule`: unknown variant `linear`, expected `cosine` or `constant`".into(),
        ));
        cases.push((
            "lr: 0.001",
            "lr: 0.001, plan_loss: \"default\"".into(),
            "plan_loss:",
            "trainer.plan_loss must be \"internalize\", \"on_policy\" or \"dual\", got \"default\""
                .into(),
        ));
        for (good, bad, key, msg) in cases {
            let src = GOOD.replace(good, &bad);
            assert_eq!(refused(&src), format!("{}{msg}", at(&src, key)));
        }
        for (set, key, msg) in [
            (
                "gigpo_gamma: 1.5",
                "gigpo_gamma:",
                "trainer.gigpo_gamma must be in [0, 1], got 1.5",
            ),
            (
                "gigpo_step_weight: -0.5",
                "gigpo_step_weight:",
                "trainer.gigpo_step_weight must be a finite number ≥ 0, got -0.5",
            ),
            (
                "gigpo_gamma: 0.0 / 0.0",
                "gigpo_gamma:",
                "`trainer.gigpo_gamma` is NaN: a setting must be a finite number",
            ),
            (
                "gigpo_step_weight: 1.0 / 0.0",
                "gigpo_step_weight:",
                "`trainer.gigpo_step_weight` is inf: a setting must be a finite number",
            ),
            (
                "gigpo_norm: \"max\"",
                "gigpo_norm:",
                "`trainer.gigpo_norm`: unknown variant `max`, expected `std` or `mean`",
            ),
        ] {
            let src = GOOD.replace(
                "lr: 0.001",
                &format!("lr: 0.001, advantage: \"gigpo\", {set}"),
            );
            assert_eq!(refused(&src), format!("{}{msg}", at(&src, key)));
        }
        // A wrong type keeps serde's wording.
        let src = GOOD.replace("every: 5", "every: 5, panels: \"test\"");
        let msg = refused(&src);
        assert!(msg.starts_with(&at(&src, "panels:")), "{msg}");
        assert!(msg.contains("`evaluation.panels`: invalid type"), "{msg}");
    }

    #[test]
    fn typed_settings_read_and_write_back_their_names() {
        let src = GOOD
            .replace("path: \"models/tiny\"", "path: \"m\", device: \"cpu\"")
            .replace("every: 5", "every: 5, panels: [\"train\", \"test\"]")
            .replace(
                "steps: steps,",
                "steps: steps, rollout: #{ format: \"chatml\" },",
            );
        let e = Experiment::from_source("x.rhai", &src).unwrap();
        assert_eq!(e.model.device, DeviceSpec::Cpu);
        assert_eq!(e.evaluation.panels, [EvalPanel::Train, EvalPanel::Test]);
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["model"]["device"], "cpu");
        assert_eq!(json["rollout"]["format"], "chatml");
        assert_eq!(
            json["evaluation"]["panels"],
            serde_json::json!(["train", "test"])
        );
        let back: Experiment = serde_json::from_value(json).unwrap();
        assert_eq!(back, e);
        let d = Experiment::from_source("x.rhai", GOOD).unwrap();
        assert_eq!(d.model.device, DeviceSpec::Cpu);
        assert_eq!(d.evaluation.panels, [EvalPanel::Test]);
    }

    #[test]
    fn the_conversation_layout_needs_the_chat_format() {
        let with = |fmt: &str| {
            GOOD.replace(
                "steps: steps,",
                &format!("steps: steps, rollout: #{{ format: \"{fmt}\", conversation: true }},"),
            )
        };
        let msg = refused(&with("plain"));
        assert!(msg.contains("rollout.conversation"), "{msg}");
        assert!(msg.contains("\"chat\""), "{msg}");
        let e = Experiment::from_source("x.rhai", &with("chatml")).unwrap();
        assert!(e.rollout.conversation);
    }
}
