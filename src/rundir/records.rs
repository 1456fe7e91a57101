//! The typed lines of the run directory's logs: [`StepLine`]
//! (`metrics.jsonl`), [`EvalLine`] (`eval.jsonl`), [`ReloadLine`]
//! (`reloads.jsonl`) and [`EnvErrorLine`] (`env_errors.jsonl`).
//!
//! The run writes every key; scalars are still `Option`s because readers
//! meet lines that lack keys (files of older versions, hand-made ones) and
//! because serde_json writes a NaN or infinite float as `null`. `None`
//! means "absent or null"; readers decide what that shows. Maps of numbers
//! skip entries that are not numbers, so one NaN never costs the line.
//! Keys are written in alphabetical order ([`super::jsonl`]).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use super::jsonl::Record;

/// The numeric entries of a JSON object (others, nulls included, are
/// skipped; a non-object gives an empty map).
fn number_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, f64>, D::Error> {
    let v = Value::deserialize(d)?;
    Ok(v.as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, x)| Some((k.clone(), x.as_f64()?)))
                .collect()
        })
        .unwrap_or_default())
}

/// Success overall, by task type and by difficulty cluster of a set of
/// episodes (a training batch or an evaluation panel).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SuccessBreakdown {
    pub success: Option<f64>,
    #[serde(default, deserialize_with = "number_map")]
    pub success_by_type: BTreeMap<String, f64>,
    /// By cluster index (as a string: JSON keys).
    #[serde(default, deserialize_with = "number_map")]
    pub success_by_cluster: BTreeMap<String, f64>,
    pub episodes: Option<usize>,
}

/// The review rounds of a training step (`rounds` of a [`StepLine`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRounds {
    /// Rollouts that only informed a review (not trained on).
    pub probe_rollouts: Option<usize>,
    pub trained_rollouts: Option<usize>,
    /// Mean rounds per task.
    pub rounds_mean: Option<f64>,
    /// Hints an intervention script gave.
    pub hints: Option<usize>,
    /// Episodes an intervention script stopped.
    pub stopped: Option<usize>,
}

/// Wall-clock seconds and throughput of a training step (`time` of a
/// [`StepLine`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimes {
    /// Generation, by the rollout runner's clock.
    pub rollout_s: Option<f64>,
    /// The update, by the trainer's clock.
    pub train_s: Option<f64>,
    /// Guidance, reward and intervention scripts.
    pub script_s: Option<f64>,
    /// The whole step, logging aside.
    pub step_s: Option<f64>,
    /// Prompt plus generated tokens per rollout second.
    pub rollout_tokens_per_s: Option<f64>,
    pub train_tokens_per_s: Option<f64>,
}

/// GiGPO's anchor states in a training step (`gigpo` of a [`StepLine`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepGigpo {
    /// Anchor groups (a state shared by policy turns of one task's group)
    /// with more than one policy turn.
    pub anchor_groups: Option<usize>,
    /// Policy turns in those groups.
    pub anchor_turns: Option<usize>,
    /// Mean |A^S| over every policy turn of the batch.
    pub step_adv_abs_mean: Option<f64>,
}

/// One training step: a line of `metrics.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepLine {
    pub step: Option<usize>,
    /// Success of the trained rollouts.
    #[serde(flatten)]
    pub batch: SuccessBreakdown,
    /// The guidance script version of this step, and every role's.
    pub script_hash: Option<String>,
    #[serde(default)]
    pub script_hashes: BTreeMap<String, String>,
    pub reward_mean: Option<f64>,
    pub reward_std: Option<f64>,
    /// Tasks whose group rewards all tie (no GRPO signal).
    pub frac_zero_std: Option<f64>,
    /// Success of the first review round's rollouts.
    pub success_round0: Option<f64>,
    pub guided_frac: Option<f64>,
    /// Mean executed expert prefix: the expert actions the env ran, fewer
    /// than planned when a prefix stopped early.
    pub depth_mean: Option<f64>,
    /// Mean planned expert prefix (the guidance's resolved `prefix`).
    pub planned_depth_mean: Option<f64>,
    #[serde(default, deserialize_with = "number_map")]
    pub depth_ratio_by_cluster: BTreeMap<String, f64>,
    /// Guidance depth of every trained rollout (executed prefix, else
    /// plan k), per cluster.
    #[serde(default)]
    pub depths_by_cluster: BTreeMap<String, Vec<usize>>,
    pub plan_k_mean: Option<f64>,
    pub expert_frac: Option<f64>,
    /// Every rollout generated, probes included.
    pub rollouts: Option<usize>,
    #[serde(default)]
    pub rounds: StepRounds,
    pub valid_action_ratio: Option<f64>,
    pub episode_len: Option<f64>,
    /// Trained episodes the env failed.
    pub env_errors: Option<usize>,
    /// Episodes whose executed expert prefix met an action the env did not
    /// admit (written only when there are any; each is in
    /// `env_errors.jsonl` with its task).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_inadmissible: Option<usize>,
    /// Actions with words the tokenizer cannot encode: executed expert
    /// actions (recorded for no loss) and answers holding the unknown
    /// token (kept out of the loss). Written only when there are any;
    /// each is in `env_errors.jsonl` with its task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unencodable_actions: Option<usize>,
    /// Mean of each numeric env extra over the episodes that report it.
    #[serde(default, deserialize_with = "number_map")]
    pub env_info: BTreeMap<String, f64>,
    /// GiGPO's anchor states (written only when `trainer.advantage` is
    /// "gigpo").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gigpo: Option<StepGigpo>,
    /// Asynchronous rollouts (written only with `rollout.async`).
    #[serde(rename = "async", default, skip_serializing_if = "Option::is_none")]
    pub async_rollouts: Option<StepAsync>,
    /// Generation on engine servers (written only with `rollout.engine`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<StepEngine>,
    /// Rollouts from bf16 weights (written only with `model.rollout_bf16`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_bf16: Option<StepBehaviour>,
    pub pg_loss: Option<f64>,
    pub aux_loss: Option<f64>,
    pub kl: Option<f64>,
    pub entropy: Option<f64>,
    pub clip_frac: Option<f64>,
    pub grad_norm: Option<f64>,
    /// Minibatches whose zero gradient skipped the optimiser step
    /// (written only with `trainer.skip_zero_grad` and when there are any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_updates: Option<usize>,
    pub lr: Option<f64>,
    pub policy_tokens: Option<usize>,
    pub rollout_tokens: Option<usize>,
    pub generated_tokens: Option<usize>,
    pub train_tokens: Option<usize>,
    /// Tokens the model ran for `train_tokens` (shared prefixes once).
    pub trunk_tokens: Option<usize>,
    pub script_errors: Option<usize>,
    /// The scripts' `metric()` calls of this step.
    #[serde(default, deserialize_with = "number_map")]
    pub script: BTreeMap<String, f64>,
    /// The guidance script's numeric state, flattened (`a.b` keys).
    #[serde(default, deserialize_with = "number_map")]
    pub state: BTreeMap<String, f64>,
    #[serde(default)]
    pub time: StepTimes,
}

/// `async` of a [`StepLine`]: how old the trained episodes were.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepAsync {
    /// The policy version this step trains (its weights before the update).
    pub version: u64,
    pub max_staleness: u64,
    /// Training-group episodes by lag (versions behind `version`): index
    /// 0 is on-policy, 1 one update behind, …
    pub lag: Vec<usize>,
    /// Episodes older than `max_staleness`: out of the update.
    pub dropped: usize,
    /// This step's rollouts were generated while the previous step
    /// trained (false: after it, as in a synchronous run — the first step,
    /// and each step after a checkpoint).
    pub overlapped: bool,
}

/// `engine` of a [`StepLine`]: the behaviour mismatch, the weight sync
/// and the servers of one step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepEngine {
    /// The policy version the step's rollouts were generated at.
    pub version: u64,
    /// The mismatch against the engine's log-probs, over the trained
    /// tokens it reported one for (written inline: `mismatch`, …).
    #[serde(flatten)]
    pub behaviour: StepBehaviour,
    /// Trained tokens without an engine log-prob (weight 1).
    pub missing: usize,
    /// Episodes the engine failed (also in `env_errors.jsonl`).
    pub failed_episodes: usize,
    /// Seconds to hand the updated weights to the servers.
    pub sync_s: f64,
    /// Bytes written for that hand-over (a LoRA adapter, or a whole model).
    #[serde(default)]
    pub sync_bytes: u64,
    /// Servers holding the new version after the sync.
    pub synced: usize,
    /// Per server: requests served and failed this step, down now.
    pub servers: Vec<crate::inference::ServerCounts>,
}

/// The behaviour mismatch of a step's rollouts (an engine's, or bf16
/// rollout weights'): |log π_old − log π_behaviour| over the trained
/// tokens, and the truncated importance weights it gave.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepBehaviour {
    /// Mean and largest |log π_old − log π_behaviour|.
    pub mismatch: f64,
    pub mismatch_max: f64,
    /// Mean π_old / π_behaviour, and the share of tokens above the cap.
    pub ratio_mean: f64,
    pub truncated_frac: f64,
    pub tokens: usize,
}

impl Record for StepLine {
    const FILE: &'static str = "metrics.jsonl";
}

/// `time` of an [`EvalLine`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalTimes {
    pub eval_s: Option<f64>,
}

/// One evaluation of one panel: a line of `eval.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EvalLine {
    pub step: Option<usize>,
    /// "test" or "train" ("test" when absent).
    pub panel: Option<String>,
    pub greedy: Option<bool>,
    #[serde(flatten)]
    pub result: SuccessBreakdown,
    /// Success on the tasks the initial policy solved (`null`: no such
    /// task), and on the others.
    pub success_in_region: Option<f64>,
    pub success_out_region: Option<f64>,
    pub in_region_tasks: Option<usize>,
    pub out_region_tasks: Option<usize>,
    /// The in-region task ids, on each panel's first evaluation only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_region_ids: Option<BTreeSet<String>>,
    /// Episodes the env failed (each in `env_errors.jsonl`), left out of
    /// every rate of this line.
    pub env_errors: Option<usize>,
    #[serde(default)]
    pub time: EvalTimes,
}

impl Record for EvalLine {
    const FILE: &'static str = "eval.jsonl";
}

/// One hot-reload outcome: a line of `reloads.jsonl`. `step` is the step
/// at whose start an edit was loaded (accepted or rejected; the outcome
/// applies from that step), or at whose end a version on probation was
/// reverted (the kept version applies from `step + 1`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReloadLine {
    pub step: Option<usize>,
    /// "guidance", "reward" or "intervene" ("guidance" when absent).
    pub role: Option<String>,
    /// The edited file.
    pub file: Option<String>,
    pub ok: Option<bool>,
    /// The new version (accepted reloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// Where the new version was saved (accepted reloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy: Option<String>,
    /// `Some(true)`: a new version that failed on probation and was
    /// swapped back out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverted: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The version kept (rejected or reverted reloads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active: Option<String>,
}

impl ReloadLine {
    /// A new version in effect, saved at `copy`.
    pub fn accepted(step: usize, role: &str, file: &str, hash: &str, copy: &str) -> Self {
        ReloadLine {
            step: Some(step),
            role: Some(role.into()),
            file: Some(file.into()),
            ok: Some(true),
            hash: Some(hash.into()),
            copy: Some(copy.into()),
            ..Default::default()
        }
    }

    /// A new version refused (it did not compile or check); `active`
    /// stays.
    pub fn rejected(step: usize, role: &str, file: &str, error: String, active: &str) -> Self {
        ReloadLine {
            step: Some(step),
            role: Some(role.into()),
            file: Some(file.into()),
            ok: Some(false),
            error: Some(error),
            active: Some(active.into()),
            ..Default::default()
        }
    }

    /// A new version that failed on probation; `active` is back.
    pub fn reverted(step: usize, role: &str, file: &str, error: String, active: &str) -> Self {
        ReloadLine {
            reverted: Some(true),
            ..ReloadLine::rejected(step, role, file, error, active)
        }
    }
}

impl Record for ReloadLine {
    const FILE: &'static str = "reloads.jsonl";
}

/// An episode the env failed (dead server, malformed reply, …): a line of
/// `env_errors.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EnvErrorLine {
    pub step: Option<usize>,
    /// The task id.
    pub task: Option<String>,
    pub error: Option<String>,
    /// The evaluated panel, for an evaluation episode (absent: a training
    /// episode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<String>,
}

impl Record for EnvErrorLine {
    const FILE: &'static str = "env_errors.jsonl";
}

/// One resume of the run: a line of `resumes.jsonl`, so the directory says
/// what a resumed run accepted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ResumeLine {
    /// The step the run continued at.
    pub step: Option<usize>,
    /// The checkpoint it continued from.
    pub checkpoint: Option<String>,
    /// Settings that differ from the ones the checkpoint was trained under
    /// (`key: old → new`), accepted with `--accept-changed-config`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
    /// The checkpoint had no `SHA256SUMS` (`--accept-unverified`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unverified: bool,
}

impl Record for ResumeLine {
    const FILE: &'static str = "resumes.jsonl";
}

/// What a run's steps do: guided RL (the default), or supervised
/// behaviour cloning on expert trajectories (`actguide sft`). A checkpoint
/// records it, so a run resumes as the kind it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunKind {
    #[default]
    Rl,
    Sft,
}

impl RunKind {
    pub fn is_rl(&self) -> bool {
        *self == RunKind::Rl
    }

    /// The command that runs (and resumes) this kind.
    pub fn command(&self) -> &'static str {
        match self {
            RunKind::Rl => "actguide run",
            RunKind::Sft => "actguide sft",
        }
    }
}

/// One supervised (SFT) step: a line of `sft.jsonl`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SftLine {
    pub step: usize,
    /// Mean token NLL of the expert actions.
    pub nll: f64,
    pub trajectories: usize,
    /// Trajectories shown with a plan.
    pub with_plan: usize,
    pub action_tokens: usize,
    pub grad_norm: f64,
    pub lr: f64,
    /// Expert actions the tokenizer cannot encode (left out of the loss).
    pub unencodable_actions: usize,
    /// Trajectories the env failed (left out).
    pub env_errors: usize,
    pub seconds: f64,
    /// Tokens run through forward and backward per second.
    pub train_tok_s: f64,
}

impl Record for SftLine {
    const FILE: &'static str = "sft.jsonl";
}

/// `sft_eval.json`: greedy, unguided success of an SFT run's final policy
/// on the first `tasks` of its own panel.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SftEval {
    pub greedy: bool,
    pub success: f64,
    pub tasks: usize,
}

impl SftEval {
    /// Its file in the run directory.
    pub const FILE: &'static str = "sft_eval.json";
}

/// `comparison.json`: the manifest of a comparison directory (the
/// directory of a `compare: [...]` experiment's runs): its name and its
/// runs' names, in list order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ComparisonManifest {
    pub name: String,
    pub runs: Vec<String>,
}

impl ComparisonManifest {
    /// Its file in the comparison directory.
    pub const FILE: &'static str = "comparison.json";

    /// Write it into the comparison directory `dir`.
    pub fn write(&self, dir: &std::path::Path) -> Result<(), super::RunDirError> {
        let json = serde_json::to_string_pretty(self).unwrap_or_default();
        super::write_atomic(&dir.join(Self::FILE), json.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Older lines lack keys, NaNs were written as null, maps may hold
    /// non-numbers: none of that costs the line.
    #[test]
    fn partial_lines_read() {
        let l: StepLine = serde_json::from_value(json!({
            "step": 2, "success": null, "rounds": {"probe_rollouts": 3},
            "env_info": {"a": 1.5, "b": null, "c": "x"}, "unknown": [1]
        }))
        .unwrap();
        assert_eq!(l.step, Some(2));
        assert_eq!(l.batch.success, None);
        assert_eq!(l.rounds.probe_rollouts, Some(3));
        assert_eq!(l.rounds.trained_rollouts, None);
        assert_eq!(l.env_info, BTreeMap::from([("a".to_string(), 1.5)]));
        assert_eq!(l.time, StepTimes::default());
    }

    /// Keys come out sorted, optional ones only when set, NaN as null.
    #[test]
    fn lines_keep_their_shape() {
        let r = ReloadLine::reverted(3, "reward", "r.rhai", "boom".into(), "abc");
        assert_eq!(
            serde_json::to_value(&r).unwrap().to_string(),
            r#"{"active":"abc","error":"boom","file":"r.rhai","ok":false,"reverted":true,"role":"reward","step":3}"#
        );
        let e = EvalLine {
            step: Some(0),
            result: SuccessBreakdown {
                success: Some(f64::NAN),
                episodes: Some(4),
                ..Default::default()
            },
            ..Default::default()
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["success"], Value::Null);
        assert_eq!(v["episodes"], 4);
        assert!(v.get("in_region_ids").is_none());
        assert_eq!(v["time"], json!({"eval_s": null}));
    }
}
