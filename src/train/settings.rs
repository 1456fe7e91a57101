//! The trainer's settings (`trainer` in an experiment file): optimiser,
//! learning-rate schedule, advantage, loss and batching options. The
//! choices are enums, so an unknown value fails while the file is read,
//! with the allowed values named.

use serde::{Deserialize, Deserializer, Serialize};

use super::{AdvantageKind, Gigpo, GigpoNorm};
use crate::guidance::PlanLoss;

/// GRPO / PPO trainer settings (docs/ALGORITHMS.md#trainer-defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerSection {
    pub lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub warmup_steps: usize,
    /// The learning rate after warm-up.
    pub schedule: Schedule,
    /// Final lr as a fraction of `lr` for the cosine schedule.
    pub min_lr_ratio: f64,
    /// Global gradient-norm clip (0 = off).
    pub grad_clip: f64,
    /// How group rewards become advantages.
    pub advantage: AdvantageKind,
    /// GiGPO's discount γ of step returns, in [0, 1] (used only with
    /// `advantage: "gigpo"`, like the next two).
    #[serde(deserialize_with = "unit_interval")]
    pub gigpo_gamma: f64,
    /// GiGPO's weight ω of the step-level advantage, ≥ 0.
    #[serde(deserialize_with = "non_negative")]
    pub gigpo_step_weight: f64,
    /// GiGPO's normalisation at both levels: "std" or "mean".
    pub gigpo_norm: GigpoNorm,
    pub clip_low: f64,
    pub clip_high: f64,
    /// Dual-clip constant c for negative advantages (0 = off).
    pub dual_clip: f64,
    /// How token losses are averaged over a batch.
    pub aggregation: Aggregation,
    /// KL coefficient β to the frozen initial policy (k3); 0 = off.
    pub kl_coef: f64,
    /// Auxiliary NLL weight η on executed expert prefix actions.
    pub aux_nll_coef: f64,
    /// How turns under a plan or hint are trained: "internalize"
    /// (ActGuide-RL), "on_policy" or "dual"; `plan(k).with_loss(..)`
    /// overrides. Never [`PlanLoss::Default`], which means "this setting".
    #[serde(deserialize_with = "trainer_plan_loss")]
    pub plan_loss: PlanLoss,
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
    /// Sequences scored per forward/backward (memory bound only). With
    /// `share_prefixes` in a large model, the memory of this many of the
    /// longest sequences: a micro-batch then holds as many sequences as
    /// their packed trie fits.
    pub micro_batch: usize,
    /// Score sequences that share a prefix (a group's first prompt, an
    /// episode's system message and history) in one packed row that holds
    /// the prefix once; micro-batches then gather such sequences. The same
    /// loss up to float rounding, fewer tokens through the model.
    pub share_prefixes: bool,
    /// Skip the optimiser step of a minibatch whose gradient is exactly
    /// zero (every advantage 0, no auxiliary tokens): AdamW would
    /// otherwise keep moving the weights on its momentum and weight decay
    /// with no learning signal at all.
    pub skip_zero_grad: bool,
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
            schedule: Schedule::Cosine,
            min_lr_ratio: 0.1,
            grad_clip: 1.0,
            advantage: AdvantageKind::Grpo,
            gigpo_gamma: 0.95,
            gigpo_step_weight: 1.0,
            gigpo_norm: GigpoNorm::Std,
            clip_low: 0.2,
            clip_high: 0.28,
            dual_clip: 3.0,
            aggregation: Aggregation::TokenMean,
            kl_coef: 0.0,
            aux_nll_coef: 0.0,
            plan_loss: PlanLoss::Internalize,
            dual_weight: 0.1,
            luffy_gamma: 0.1,
            train_prefix: false,
            protect_forced: true,
            entropy_coef: 0.0,
            ppo_epochs: 1,
            minibatches: 1,
            micro_batch: 64,
            share_prefixes: true,
            skip_zero_grad: false,
        }
    }
}

impl TrainerSection {
    /// GiGPO's settings.
    pub fn gigpo(&self) -> Gigpo {
        Gigpo {
            gamma: self.gigpo_gamma,
            step_weight: self.gigpo_step_weight,
            norm: self.gigpo_norm,
        }
    }
}

/// The learning rate after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// Cosine decay to `min_lr_ratio · lr` at the last step.
    Cosine,
    /// `lr` throughout.
    Constant,
}

/// How the policy loss is averaged over a batch's tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregation {
    /// Every token of the batch weighs the same (DAPO).
    TokenMean,
    /// The mean over tokens of each sequence, then over sequences (GRPO).
    SeqMeanTokenMean,
}

/// `trainer.plan_loss`: a [`PlanLoss`] other than `Default`.
fn trainer_plan_loss<'de, D: Deserializer<'de>>(d: D) -> Result<PlanLoss, D::Error> {
    let name = String::deserialize(d)?;
    match PlanLoss::parse(&name) {
        Some(PlanLoss::Default) | None => Err(serde::de::Error::custom(format!(
            "must be \"internalize\", \"on_policy\" or \"dual\", got \"{name}\""
        ))),
        Some(p) => Ok(p),
    }
}

/// A number in [0, 1] (refused with the key's position otherwise).
fn unit_interval<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let x = f64::deserialize(d)?;
    if !(0.0..=1.0).contains(&x) {
        return Err(serde::de::Error::custom(format!(
            "must be in [0, 1], got {x}"
        )));
    }
    Ok(x)
}

/// A finite number ≥ 0 (refused with the key's position otherwise).
fn non_negative<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let x = f64::deserialize(d)?;
    if !(x >= 0.0 && x.is_finite()) {
        return Err(serde::de::Error::custom(format!(
            "must be a finite number ≥ 0, got {x}"
        )));
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_read_and_write_back_their_names() {
        let t: TrainerSection = serde_json::from_value(serde_json::json!({
            "schedule": "constant",
            "advantage": "dr_grpo",
            "aggregation": "seq_mean_token_mean",
            "plan_loss": "dual",
        }))
        .unwrap();
        assert_eq!(t.schedule, Schedule::Constant);
        assert_eq!(t.advantage, AdvantageKind::DrGrpo);
        assert_eq!(t.aggregation, Aggregation::SeqMeanTokenMean);
        assert_eq!(t.plan_loss, PlanLoss::Dual);
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["schedule"], "constant");
        assert_eq!(json["advantage"], "dr_grpo");
        assert_eq!(json["aggregation"], "seq_mean_token_mean");
        assert_eq!(json["plan_loss"], "dual");
        let back: TrainerSection = serde_json::from_value(json).unwrap();
        assert_eq!(back, t);
        let d = TrainerSection::default();
        assert_eq!(
            (d.schedule, d.advantage, d.aggregation, d.plan_loss),
            (
                Schedule::Cosine,
                AdvantageKind::Grpo,
                Aggregation::TokenMean,
                PlanLoss::Internalize
            )
        );
    }

    #[test]
    fn unknown_choices_name_the_allowed_ones() {
        let err = |k: &str, v: &str| {
            serde_json::from_value::<TrainerSection>(serde_json::json!({ k: v }))
                .unwrap_err()
                .to_string()
        };
        assert!(err("schedule", "linear").contains("expected `cosine` or `constant`"));
        assert!(err("advantage", "ppo").contains("expected one of `grpo`, `dr_grpo`, `gigpo`"));
        assert!(err("gigpo_norm", "max").contains("expected `std` or `mean`"));
        assert!(
            err("aggregation", "sum").contains("expected `token_mean` or `seq_mean_token_mean`")
        );
        for bad in ["default", "sft"] {
            assert!(err("plan_loss", bad).starts_with(&format!(
                "must be \"internalize\", \"on_policy\" or \"dual\", got \"{bad}\""
            )));
        }
    }

    #[test]
    fn gigpo_settings_default_read_and_refuse_out_of_range() {
        let d = TrainerSection::default();
        assert_eq!(
            d.gigpo(),
            Gigpo {
                gamma: 0.95,
                step_weight: 1.0,
                norm: GigpoNorm::Std
            }
        );
        let t: TrainerSection = serde_json::from_value(serde_json::json!({
            "advantage": "gigpo", "gigpo_gamma": 0.0, "gigpo_step_weight": 0.5,
            "gigpo_norm": "mean",
        }))
        .unwrap();
        assert_eq!(t.advantage, AdvantageKind::Gigpo);
        assert_eq!(
            t.gigpo(),
            Gigpo {
                gamma: 0.0,
                step_weight: 0.5,
                norm: GigpoNorm::Mean
            }
        );
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["advantage"], "gigpo");
        assert_eq!(json["gigpo_norm"], "mean");
        assert_eq!(serde_json::from_value::<TrainerSection>(json).unwrap(), t);
        let err = |k: &str, v: f64| {
            serde_json::from_value::<TrainerSection>(serde_json::json!({ k: v }))
                .unwrap_err()
                .to_string()
        };
        assert!(err("gigpo_gamma", 1.5).starts_with("must be in [0, 1], got 1.5"));
        assert!(err("gigpo_gamma", -0.1).starts_with("must be in [0, 1], got -0.1"));
        assert!(err("gigpo_step_weight", -1.0).starts_with("must be a finite number ≥ 0, got -1"));
        assert!(serde_json::from_value::<TrainerSection>(
            serde_json::json!({ "gigpo_gamma": 1.0, "gigpo_step_weight": 0.0 })
        )
        .is_ok());
    }
}
