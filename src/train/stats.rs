//! The metrics of one optimiser step: host-side sums over every trained
//! token, and the [`TrainStats`] they become.

use candle_core::{DType, Tensor};

use super::samples::Sample;

/// Metrics of one optimiser step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainStats {
    pub pg_loss: f64,
    pub aux_loss: f64,
    pub kl: f64,
    pub entropy: f64,
    pub clip_frac: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub policy_tokens: usize,
    pub aux_tokens: usize,
    /// Tokens of the scored sequences (prompts included).
    pub train_tokens: usize,
    /// Tokens the model ran forward+backward for them: fewer than
    /// `train_tokens` when shared prefixes are scored once.
    pub trunk_tokens: usize,
    /// Minibatches whose zero gradient skipped the optimiser step
    /// (`trainer.skip_zero_grad`).
    pub skipped_updates: usize,
    pub seconds: f64,
}

/// The engine's behaviour log-probs against the trainer's own
/// ([`crate::train::Trainer::behaviour_correction`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BehaviourStats {
    /// Tokens with an engine log-prob.
    pub tokens: usize,
    /// Tokens without one (weight 1).
    pub missing: usize,
    /// Σ |log π_old − log π_engine|.
    pub abs_diff_sum: f64,
    pub max_abs_diff: f64,
    /// Σ π_old / π_engine.
    pub ratio_sum: f64,
    /// Tokens whose ratio exceeded the cap.
    pub truncated: usize,
}

impl BehaviourStats {
    /// Mean |Δ log p| per token.
    pub fn mean_abs_diff(&self) -> f64 {
        self.abs_diff_sum / self.tokens.max(1) as f64
    }

    pub fn mean_ratio(&self) -> f64 {
        if self.tokens == 0 {
            1.0
        } else {
            self.ratio_sum / self.tokens as f64
        }
    }
}

/// Running sums over the micro-batches of one step.
#[derive(Default)]
pub(super) struct Sums {
    pub(super) pg: f64,
    pub(super) aux_nll: f64,
    pub(super) kl: f64,
    pub(super) entropy: f64,
    pub(super) clipped: usize,
    pub(super) policy_tokens: usize,
    pub(super) aux_tokens: usize,
    pub(super) train_tokens: usize,
    pub(super) trunk_tokens: usize,
}

/// Host copies of one micro-batch's per-token values, in the order of its
/// target tokens.
pub(super) struct MicroTokens<'a> {
    /// Current log-probs of the targets.
    pub(super) logp: &'a [f32],
    pub(super) entropy: &'a [f32],
    /// π_θ / π_old.
    pub(super) ratio: &'a [f32],
    /// k3 KL to the reference, when there is one.
    pub(super) kl: Option<&'a [f32]>,
    pub(super) adv: &'a [f32],
    /// 1 for off-policy (LUFFY) tokens, never clipped.
    pub(super) off: &'a [f32],
}

impl Sums {
    /// Add one micro-batch: its summed policy loss `pg_loss` and, token by
    /// token over the samples `chunk` of `mb`, the aux NLL, entropy, KL and
    /// whether the PPO clip was active.
    pub(super) fn add_micro(
        &mut self,
        pg_loss: &Tensor,
        chunk: &[usize],
        mb: &[&Sample],
        t: &MicroTokens<'_>,
        clip_low: f64,
        clip_high: f64,
    ) -> Result<(), candle_core::Error> {
        self.pg += pg_loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let mut k = 0;
        for &i in chunk {
            let s = mb[i];
            for _ in 0..s.targets.len() {
                if s.aux {
                    self.aux_nll -= t.logp[k] as f64;
                    self.aux_tokens += 1;
                } else {
                    self.policy_tokens += 1;
                    self.entropy += t.entropy[k] as f64;
                    if let Some(kv) = t.kl {
                        self.kl += kv[k] as f64;
                    }
                    let a = t.adv[k];
                    let r = t.ratio[k] as f64;
                    if t.off[k] == 0.0
                        && ((a > 0.0 && r > 1.0 + clip_high) || (a < 0.0 && r < 1.0 - clip_low))
                    {
                        self.clipped += 1;
                    }
                }
                k += 1;
            }
        }
        Ok(())
    }

    /// Add the other ranks' sums (data-parallel training).
    pub(super) fn reduce(
        &mut self,
        coll: &dyn crate::distributed::Collective,
    ) -> Result<(), crate::distributed::CollectiveError> {
        let v = coll.all_reduce_f64(&[
            self.pg,
            self.aux_nll,
            self.kl,
            self.entropy,
            self.clipped as f64,
            self.policy_tokens as f64,
            self.aux_tokens as f64,
            self.train_tokens as f64,
            self.trunk_tokens as f64,
        ])?;
        self.pg = v[0];
        self.aux_nll = v[1];
        self.kl = v[2];
        self.entropy = v[3];
        self.clipped = v[4] as usize;
        self.policy_tokens = v[5] as usize;
        self.aux_tokens = v[6] as usize;
        self.train_tokens = v[7] as usize;
        self.trunk_tokens = v[8] as usize;
        Ok(())
    }

    /// The step's metrics after `updates` optimiser updates over
    /// `ppo_epochs` passes; `stats.grad_norm` holds the summed norms.
    pub(super) fn finish(
        &self,
        mut stats: TrainStats,
        updates: usize,
        ppo_epochs: usize,
    ) -> TrainStats {
        let pt = self.policy_tokens.max(1) as f64;
        stats.pg_loss = self.pg / updates.max(1) as f64;
        stats.aux_loss = if self.aux_tokens > 0 {
            self.aux_nll / self.aux_tokens as f64
        } else {
            0.0
        };
        stats.kl = self.kl / pt;
        stats.entropy = self.entropy / pt;
        stats.clip_frac = self.clipped as f64 / pt;
        stats.grad_norm /= updates.max(1) as f64;
        stats.policy_tokens = self.policy_tokens / ppo_epochs;
        stats.aux_tokens = self.aux_tokens / ppo_epochs;
        stats.train_tokens = self.train_tokens;
        stats.trunk_tokens = self.trunk_tokens;
        stats
    }
}
