//! The trainer: turns episodes into token samples with advantages, and runs
//! the GRPO/PPO update (clip-higher, dual clip, token-mean or
//! seq-mean-token-mean aggregation, k3 KL to a frozen reference, Agent-G²'s
//! auxiliary NLL on executed expert prefixes), with gradient accumulation
//! over micro-batches, global grad-norm clipping, AdamW and a warm-up +
//! cosine learning rate.

pub mod advantage;
pub mod optim;
pub mod schedule;
pub mod settings;

use std::time::Instant;

use candle_core::{DType, Tensor};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::guidance::PlanLoss;
use crate::model::{ModelError, Policy, ScoreBatch};
use crate::rollout::Episode;
pub use advantage::{group_advantages, is_zero_std, AdvantageKind};
pub use optim::{AdamW, AdamWParams};
pub use settings::{Aggregation, Schedule, TrainerSection};

/// One scored sequence: a turn's prompt followed by its action tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub seq: Vec<u32>,
    /// Positions of the action tokens in `seq`.
    pub targets: Vec<usize>,
    /// Behaviour log-probs (policy samples) — empty for aux samples.
    pub old_logp: Vec<f32>,
    pub advantage: f32,
    /// Index of the episode this turn belongs to (for seq-mean).
    pub episode: usize,
    /// An executed expert prefix action (aux NLL), not a policy turn.
    pub aux: bool,
    /// Trajectory weight for the aux NLL: 1 / n_prefix.
    pub aux_weight: f32,
    /// An expert token trained off-policy with LUFFY's shaped ratio
    /// x / (x + γ), unclipped.
    pub off_policy: bool,
    /// A forced (executed expert) token in the policy loss (StepHint);
    /// its ratio is taken against the current policy.
    pub forced: bool,
    /// Weight of this sample's policy-loss tokens (the `dual` mode's
    /// off-policy term uses `dual_weight`).
    pub weight: f32,
}

/// How episodes become samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleOptions {
    /// Executed prefix actions as auxiliary NLL samples.
    pub with_aux: bool,
    /// Loss for turns generated under a plan or hint, unless a spec says
    /// otherwise (never `PlanLoss::Default`).
    pub plan_loss: PlanLoss,
    pub dual_weight: f32,
    /// Executed prefix actions as forced tokens in the policy loss.
    pub train_prefix: bool,
    /// Forced tokens never get a negative advantage (StepHint).
    pub protect_forced: bool,
}

impl Default for SampleOptions {
    fn default() -> Self {
        SampleOptions {
            with_aux: false,
            plan_loss: PlanLoss::Internalize,
            dual_weight: 0.1,
            train_prefix: false,
            protect_forced: true,
        }
    }
}

/// Build samples from episodes with one advantage per episode.
pub fn build_samples(episodes: &[Episode], advantages: &[f64], o: &SampleOptions) -> Vec<Sample> {
    let mut out = Vec::new();
    for (ei, (ep, &adv)) in episodes.iter().zip(advantages).enumerate() {
        let n_prefix = ep.turns.iter().filter(|t| t.prefix).count();
        let base = |seq_prompt: &[u32], t: &crate::rollout::Turn| -> Sample {
            let mut seq = seq_prompt.to_vec();
            let start = seq.len();
            seq.extend(&t.action_ids);
            Sample {
                targets: (start..seq.len()).collect(),
                seq,
                old_logp: t.logprobs.clone(),
                advantage: adv as f32,
                episode: ei,
                aux: false,
                aux_weight: 0.0,
                off_policy: false,
                forced: false,
                weight: 1.0,
            }
        };
        for t in &ep.turns {
            if t.action_ids.is_empty() {
                continue;
            }
            if t.prefix {
                if o.with_aux {
                    out.push(Sample {
                        aux: true,
                        aux_weight: 1.0 / n_prefix as f32,
                        ..base(&t.prompt_ids, t)
                    });
                }
                if o.train_prefix {
                    let a = if o.protect_forced { adv.max(0.0) } else { adv };
                    out.push(Sample {
                        forced: true,
                        advantage: a as f32,
                        old_logp: Vec::new(),
                        ..base(&t.prompt_ids, t)
                    });
                }
                continue;
            }
            if t.off_policy {
                out.push(Sample {
                    off_policy: true,
                    ..base(&t.prompt_ids, t)
                });
                continue;
            }
            let Some(unguided) = &t.unguided_prompt_ids else {
                out.push(base(&t.prompt_ids, t));
                continue;
            };
            let mode = match ep.spec.plan_loss {
                PlanLoss::Default => o.plan_loss,
                m => m,
            };
            match mode {
                PlanLoss::OnPolicy | PlanLoss::Default => out.push(base(&t.prompt_ids, t)),
                // Same tokens, unguided context; behaviour log-probs stay
                // those of the guided context (ActGuide-RL §2).
                PlanLoss::Internalize => out.push(base(unguided, t)),
                PlanLoss::Dual => {
                    out.push(base(&t.prompt_ids, t));
                    out.push(Sample {
                        weight: o.dual_weight,
                        ..base(unguided, t)
                    });
                }
            }
        }
    }
    out
}

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
    /// Tokens run through forward+backward (prompts included).
    pub train_tokens: usize,
    pub seconds: f64,
}

/// Errors of the trainer.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("{0}")]
    State(String),
}

/// GRPO trainer: optimiser, schedule, frozen reference.
pub struct Trainer {
    pub cfg: TrainerSection,
    pub opt: AdamW,
    pub reference: Option<Policy>,
    pub total_steps: usize,
    pub temperature: f64,
}

impl Trainer {
    /// `reference` is the frozen KL reference (the initial policy); it is
    /// only kept when `kl_coef > 0`.
    pub fn new(
        policy: &Policy,
        reference: Option<&Policy>,
        cfg: &TrainerSection,
        total_steps: usize,
        temperature: f64,
    ) -> Result<Self, TrainError> {
        let opt = AdamW::new(
            policy.named_vars(),
            AdamWParams {
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
            },
        )?;
        let reference = match reference {
            Some(r) if cfg.kl_coef > 0.0 => Some(r.frozen_copy()?),
            _ => None,
        };
        Ok(Trainer {
            cfg: cfg.clone(),
            opt,
            reference,
            total_steps,
            temperature,
        })
    }

    pub fn lr(&self, step: usize) -> f64 {
        schedule::lr_at(
            self.cfg.lr,
            step,
            self.total_steps,
            self.cfg.warmup_steps,
            self.cfg.schedule == Schedule::Cosine,
            self.cfg.min_lr_ratio,
        )
    }

    /// One optimiser step per minibatch, `ppo_epochs` passes over `samples`.
    pub fn step(
        &mut self,
        policy: &Policy,
        samples: &[Sample],
        step: usize,
        rng: &mut ChaCha8Rng,
    ) -> Result<TrainStats, TrainError> {
        let t0 = Instant::now();
        let lr = self.lr(step);
        // LoRA dropout masks come from this step's stream (drawn only when
        // dropout is on, so other runs keep their streams).
        let dropout = policy.lora().is_some_and(|l| l.dropout > 0.0);
        if dropout {
            policy.set_dropout_seed(Some(rng.random()));
        }
        let mut stats = TrainStats {
            lr,
            ..Default::default()
        };
        let mut sums = Sums::default();
        let mut updates = 0usize;
        for _ in 0..self.cfg.ppo_epochs {
            let mut order: Vec<usize> = (0..samples.len()).collect();
            if self.cfg.minibatches > 1 {
                order.shuffle(rng);
            }
            let per = samples.len().div_ceil(self.cfg.minibatches).max(1);
            for mb in order.chunks(per) {
                let mb: Vec<&Sample> = mb.iter().map(|&i| &samples[i]).collect();
                let grads = self.accumulate(policy, &mb, &mut sums)?;
                let norm = global_norm(&grads)?;
                stats.grad_norm += norm;
                let grads = if self.cfg.grad_clip > 0.0 && norm > self.cfg.grad_clip {
                    let s = self.cfg.grad_clip / (norm + 1e-6);
                    grads
                        .into_iter()
                        .map(|g| g.map(|g| g * s).transpose())
                        .collect::<Result<Vec<_>, _>>()?
                } else {
                    grads
                };
                self.opt.step(&grads, lr)?;
                updates += 1;
            }
        }
        let pt = sums.policy_tokens.max(1) as f64;
        stats.pg_loss = sums.pg / updates.max(1) as f64;
        stats.aux_loss = if sums.aux_tokens > 0 {
            sums.aux_nll / sums.aux_tokens as f64
        } else {
            0.0
        };
        stats.kl = sums.kl / pt;
        stats.entropy = sums.entropy / pt;
        stats.clip_frac = sums.clipped as f64 / pt;
        stats.grad_norm /= updates.max(1) as f64;
        stats.policy_tokens = sums.policy_tokens / self.cfg.ppo_epochs;
        stats.aux_tokens = sums.aux_tokens / self.cfg.ppo_epochs;
        stats.train_tokens = sums.train_tokens;
        stats.seconds = t0.elapsed().as_secs_f64();
        if dropout {
            policy.set_dropout_seed(None);
        }
        Ok(stats)
    }

    /// Forward/backward over micro-batches of one minibatch; returns the
    /// summed gradients aligned with the optimiser's variables.
    fn accumulate(
        &self,
        policy: &Policy,
        mb: &[&Sample],
        sums: &mut Sums,
    ) -> Result<Vec<Option<Tensor>>, TrainError> {
        let c = &self.cfg;
        // Token weights so that the minibatch loss is the chosen aggregate.
        let policy_tokens: f64 = mb
            .iter()
            .filter(|s| !s.aux)
            .map(|s| s.weight as f64 * s.targets.len() as f64)
            .sum();
        let mut ep_tokens = std::collections::BTreeMap::<usize, f64>::new();
        for s in mb.iter().filter(|s| !s.aux) {
            *ep_tokens.entry(s.episode).or_default() += s.weight as f64 * s.targets.len() as f64;
        }
        let n_eps = ep_tokens.len().max(1);
        let aux_weight_total: f64 = mb
            .iter()
            .filter(|s| s.aux)
            .map(|s| s.aux_weight as f64 * s.targets.len() as f64)
            .sum();
        let use_aux = c.aux_nll_coef > 0.0 && aux_weight_total > 0.0;

        // Sort by length so micro-batches pad little; stable for determinism.
        let mut idx: Vec<usize> = (0..mb.len()).filter(|&i| !mb[i].aux || use_aux).collect();
        idx.sort_by_key(|&i| mb[i].seq.len());
        let vars = self.opt.vars();
        let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
        let dev = policy.device().clone();
        for chunk in idx.chunks(c.micro_batch) {
            let batch = ScoreBatch {
                seqs: chunk.iter().map(|&i| mb[i].seq.clone()).collect(),
                targets: chunk.iter().map(|&i| mb[i].targets.clone()).collect(),
                temperature: self.temperature,
            };
            sums.train_tokens += batch.seqs.iter().map(Vec::len).sum::<usize>();
            let out = policy.score(&batch)?;
            // Host copy of the log-probs: forced tokens' ratio base, and
            // the aux NLL metric below.
            let lp = out.logp.detach().to_vec1::<f32>()?;
            // Per-token constants.
            let mut w_pg = Vec::new();
            let mut w_aux = Vec::new();
            let mut adv = Vec::new();
            let mut old = Vec::new();
            let mut off = Vec::new();
            let mut k_all = 0usize;
            for &i in chunk {
                let s = mb[i];
                for k in 0..s.targets.len() {
                    if s.aux {
                        w_pg.push(0.0f32);
                        w_aux.push((s.aux_weight as f64 / aux_weight_total) as f32);
                        adv.push(0.0);
                        old.push(0.0);
                        off.push(0.0);
                    } else {
                        let w = if c.aggregation == Aggregation::TokenMean {
                            1.0 / policy_tokens.max(1e-9)
                        } else {
                            1.0 / (ep_tokens[&s.episode].max(1e-9) * n_eps as f64)
                        };
                        w_pg.push((w * s.weight as f64) as f32);
                        w_aux.push(0.0);
                        adv.push(s.advantage);
                        // Forced tokens have no behaviour log-prob: their
                        // ratio is taken against the current policy.
                        old.push(if s.forced {
                            lp[k_all]
                        } else {
                            s.old_logp.get(k).copied().unwrap_or(0.0)
                        });
                        off.push(if s.off_policy { 1.0 } else { 0.0 });
                    }
                    k_all += 1;
                }
            }
            let n = w_pg.len();
            let any_off = off.iter().any(|&x| x > 0.0);
            let t = |v: Vec<f32>| Tensor::from_vec(v, n, &dev);
            let (w_pg_t, w_aux_t, adv_t, old_t) =
                (t(w_pg.clone())?, t(w_aux)?, t(adv.clone())?, t(old)?);
            let logp = &out.logp;
            let (mut pg, ratio) =
                ppo_token_loss(logp, &old_t, &adv_t, c.clip_low, c.clip_high, c.dual_clip)?;
            if any_off {
                let m = t(off.clone())?;
                let shaped = luffy_token_loss(logp, &adv_t, c.luffy_gamma)?;
                pg = ((&pg * (1.0 - &m)?)? + (shaped * &m)?)?;
            }
            let pg_loss = (&pg * &w_pg_t)?.sum_all()?;
            let mut loss = pg_loss.clone();
            if use_aux {
                let aux = (logp.neg()? * &w_aux_t)?.sum_all()?;
                loss = (loss + (aux * c.aux_nll_coef)?)?;
            }
            let mut kl_vals = None;
            if let Some(r) = &self.reference {
                let ref_logp = r.score(&batch)?.logp.detach();
                let d = (&ref_logp - logp)?;
                let kl = ((d.exp()? - &d)? - 1.0)?;
                loss = (loss + ((&kl * &w_pg_t)?.sum_all()? * c.kl_coef)?)?;
                kl_vals = Some(kl.detach().to_vec1::<f32>()?);
            }
            if c.entropy_coef > 0.0 {
                loss = (loss - ((&out.entropy * &w_pg_t)?.sum_all()? * c.entropy_coef)?)?;
            }
            let grads = loss.backward()?;
            for (k, (_, v)) in vars.iter().enumerate() {
                if let Some(g) = grads.get(v.as_tensor()) {
                    acc[k] = Some(match acc[k].take() {
                        Some(a) => (a + g)?,
                        None => g.clone(),
                    });
                }
            }
            // Metrics on the host side.
            sums.pg += pg_loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let ent = out.entropy.detach().to_vec1::<f32>()?;
            let rt = ratio.detach().to_vec1::<f32>()?;
            let mut k = 0;
            for &i in chunk {
                let s = mb[i];
                for _ in 0..s.targets.len() {
                    if s.aux {
                        sums.aux_nll -= lp[k] as f64;
                        sums.aux_tokens += 1;
                    } else {
                        sums.policy_tokens += 1;
                        sums.entropy += ent[k] as f64;
                        if let Some(kv) = &kl_vals {
                            sums.kl += kv[k] as f64;
                        }
                        let a = adv[k];
                        let r = rt[k] as f64;
                        if off[k] == 0.0
                            && ((a > 0.0 && r > 1.0 + c.clip_high)
                                || (a < 0.0 && r < 1.0 - c.clip_low))
                        {
                            sums.clipped += 1;
                        }
                    }
                    k += 1;
                }
            }
        }
        Ok(acc)
    }
}

#[derive(Default)]
struct Sums {
    pg: f64,
    aux_nll: f64,
    kl: f64,
    entropy: f64,
    clipped: usize,
    policy_tokens: usize,
    aux_tokens: usize,
    train_tokens: usize,
}

/// Per-token PPO loss (to be minimised) and the ratio π_θ/π_old:
/// max(−Â ρ, −Â clip(ρ, 1−ε_low, 1+ε_high)), and for Â < 0 with dual clip c
/// also capped at −c Â (ALGORITHMS.md §1).
pub fn ppo_token_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    adv: &Tensor,
    clip_low: f64,
    clip_high: f64,
    dual_clip: f64,
) -> Result<(Tensor, Tensor), candle_core::Error> {
    let ratio = (logp - old_logp)?.exp()?;
    let neg_adv = adv.neg()?;
    let l1 = (&neg_adv * &ratio)?;
    let l2 = (&neg_adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)?)?;
    let mut pg = l1.maximum(&l2)?;
    if dual_clip > 0.0 {
        let cap = (&neg_adv * dual_clip)?;
        pg = adv.lt(0.0f32)?.where_cond(&pg.minimum(&cap)?, &pg)?;
    }
    Ok((pg, ratio))
}

/// LUFFY's off-policy token loss: −Â · f(π_θ), f(x) = x / (x + γ), with
/// the behaviour probability of expert data taken as 1 and no clipping.
/// The shaping keeps gradients of low-probability expert tokens large
/// (f'(x) = γ / (x + γ)²) instead of vanishing with x.
pub fn luffy_token_loss(
    logp: &Tensor,
    adv: &Tensor,
    gamma: f64,
) -> Result<Tensor, candle_core::Error> {
    let x = logp.exp()?;
    let f = (&x / (&x + gamma)?)?;
    adv.neg()? * f
}

/// Global L2 norm over all gradients.
pub fn global_norm(grads: &[Option<Tensor>]) -> Result<f64, candle_core::Error> {
    let mut total = 0f64;
    for g in grads.iter().flatten() {
        total += g
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
    }
    Ok(total.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Loss and d loss / d logp for one token.
    fn one(logp: f32, old: f32, adv: f32) -> (f32, f32) {
        let dev = Device::Cpu;
        let lp = Var::new(&[logp], &dev).unwrap();
        let old = Tensor::new(&[old], &dev).unwrap();
        let adv = Tensor::new(&[adv], &dev).unwrap();
        let (pg, _) = ppo_token_loss(lp.as_tensor(), &old, &adv, 0.2, 0.28, 3.0).unwrap();
        let g = pg.sum_all().unwrap().backward().unwrap();
        let grad = g
            .get(lp.as_tensor())
            .map(|t| t.to_vec1::<f32>().unwrap()[0])
            .unwrap_or(0.0);
        (pg.to_vec1::<f32>().unwrap()[0], grad)
    }

    #[test]
    fn ppo_loss_clips_and_dual_clips() {
        // ratio 1: loss −A, gradient −A (push up good tokens).
        let (l, g) = one(-1.0, -1.0, 2.0);
        assert!((l + 2.0).abs() < 1e-6 && (g + 2.0).abs() < 1e-5, "{l} {g}");
        // A > 0, ratio 1.5 > 1 + 0.28: clipped, loss −1.28 A, no gradient.
        let (l, g) = one(1.5f32.ln(), 0.0, 1.0);
        assert!((l + 1.28).abs() < 1e-5 && g == 0.0, "{l} {g}");
        // A < 0, ratio 0.5 < 1 − 0.2: clipped at 0.8, no gradient.
        let (l, g) = one(0.5f32.ln(), 0.0, -1.0);
        assert!((l - 0.8).abs() < 1e-5 && g == 0.0, "{l} {g}");
        // A < 0, ratio 5: unclipped would be 5|A|, dual clip caps at 3|A|.
        let (l, g) = one(5f32.ln(), 0.0, -1.0);
        assert!((l - 3.0).abs() < 1e-5 && g == 0.0, "{l} {g}");
        // A < 0, ratio 2 (inside the dual-clip cap): loss 2|A|, gradient flows.
        let (l, g) = one(2f32.ln(), 0.0, -1.0);
        assert!((l - 2.0).abs() < 1e-5 && (g - 2.0).abs() < 1e-4, "{l} {g}");
    }

    #[test]
    fn samples_skip_prefix_turns_unless_aux() {
        use crate::guidance::ResolvedSpec;
        use crate::rollout::{Episode, Turn};
        let turn = |prefix: bool| Turn {
            prompt_ids: vec![2, 5, 6],
            unguided_prompt_ids: None,
            action_ids: vec![7, 3],
            logprobs: if prefix { vec![] } else { vec![-1.0, -0.5] },
            prefix,
            off_policy: false,
            valid: true,
            action: "look".into(),
        };
        let ep = Episode {
            task_id: "t".into(),
            spec: ResolvedSpec {
                prefix: 2,
                ..Default::default()
            },
            turns: vec![turn(true), turn(true), turn(false)],
            success: true,
            reward: 1.0,
            invalid: 0,
            policy_turns: 1,
            error: None,
            hints: 0,
            stopped: false,
            actions: vec![],
            expert_match: 0,
            info: Default::default(),
        };
        let s = build_samples(std::slice::from_ref(&ep), &[0.5], &SampleOptions::default());
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].targets, vec![3, 4]);
        assert_eq!(s[0].old_logp, vec![-1.0, -0.5]);
        assert_eq!(s[0].advantage, 0.5);
        let s = build_samples(
            &[ep],
            &[0.5],
            &SampleOptions {
                with_aux: true,
                ..Default::default()
            },
        );
        assert_eq!(s.iter().filter(|x| x.aux).count(), 2);
        assert!(s.iter().filter(|x| x.aux).all(|x| x.aux_weight == 0.5));
    }

    fn guided_episode(loss: PlanLoss) -> Episode {
        use crate::guidance::ResolvedSpec;
        use crate::rollout::Turn;
        Episode {
            task_id: "t".into(),
            spec: ResolvedSpec {
                plan: 2,
                plan_loss: loss,
                ..Default::default()
            },
            turns: vec![Turn {
                prompt_ids: vec![2, 9, 9, 5],
                unguided_prompt_ids: Some(vec![2, 5]),
                action_ids: vec![7, 3],
                logprobs: vec![-0.7, -0.2],
                prefix: false,
                off_policy: false,
                valid: true,
                action: "look".into(),
            }],
            success: true,
            reward: 1.0,
            invalid: 0,
            policy_turns: 1,
            error: None,
            hints: 0,
            stopped: false,
            actions: vec![],
            expert_match: 0,
            info: Default::default(),
        }
    }

    #[test]
    fn plan_losses_pick_the_context_of_the_guided_tokens() {
        let o = SampleOptions::default();
        // Internalised (the default): unguided prompt, guided behaviour log-probs.
        let s = build_samples(&[guided_episode(PlanLoss::Default)], &[1.0], &o);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].seq, vec![2, 5, 7, 3]);
        assert_eq!(s[0].targets, vec![2, 3]);
        assert_eq!(s[0].old_logp, vec![-0.7, -0.2]);
        // On-policy under the guided prompt, chosen per spec.
        let s = build_samples(&[guided_episode(PlanLoss::OnPolicy)], &[1.0], &o);
        assert_eq!(s[0].seq, vec![2, 9, 9, 5, 7, 3]);
        // Dual: both, the unguided one weighted.
        let s = build_samples(&[guided_episode(PlanLoss::Dual)], &[1.0], &o);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].seq.len(), s[0].weight), (6, 1.0));
        assert_eq!((s[1].seq.len(), s[1].weight), (4, 0.1));
        // The experiment default applies when the spec does not choose.
        let on = SampleOptions {
            plan_loss: PlanLoss::OnPolicy,
            ..o
        };
        let s = build_samples(&[guided_episode(PlanLoss::Default)], &[1.0], &on);
        assert_eq!(s[0].seq.len(), 6);
    }

    #[test]
    fn forced_prefix_tokens_are_protected_from_negative_advantage() {
        use crate::guidance::ResolvedSpec;
        use crate::rollout::Turn;
        let mut ep = guided_episode(PlanLoss::Default);
        ep.spec = ResolvedSpec {
            prefix: 1,
            ..Default::default()
        };
        ep.turns = vec![Turn {
            prompt_ids: vec![2, 5],
            unguided_prompt_ids: None,
            action_ids: vec![7, 3],
            logprobs: vec![],
            prefix: true,
            off_policy: false,
            valid: true,
            action: "look".into(),
        }];
        let o = SampleOptions {
            train_prefix: true,
            ..Default::default()
        };
        let s = build_samples(std::slice::from_ref(&ep), &[-1.5], &o);
        assert_eq!(s.len(), 1);
        assert!(s[0].forced && !s[0].aux);
        assert_eq!(s[0].advantage, 0.0);
        let s = build_samples(std::slice::from_ref(&ep), &[0.5], &o);
        assert_eq!(s[0].advantage, 0.5);
        let unprotected = SampleOptions {
            protect_forced: false,
            ..o
        };
        let s = build_samples(&[ep], &[-1.5], &unprotected);
        assert_eq!(s[0].advantage, -1.5);
    }

    #[test]
    fn luffy_loss_is_shaped_and_unclipped() {
        let dev = Device::Cpu;
        let gamma = 0.1;
        for (p, a) in [(0.05f32, 1.0f32), (0.9, 1.0), (0.3, -2.0)] {
            let lp = Var::new(&[p.ln()], &dev).unwrap();
            let adv = Tensor::new(&[a], &dev).unwrap();
            let l = luffy_token_loss(lp.as_tensor(), &adv, gamma).unwrap();
            let g = l.sum_all().unwrap().backward().unwrap();
            let grad = g.get(lp.as_tensor()).unwrap().to_vec1::<f32>().unwrap()[0];
            let x = p as f64;
            let want_l = -(a as f64) * x / (x + gamma);
            // d/dlogp of -A x/(x+g) = -A g x / (x+g)^2
            let want_g = -(a as f64) * gamma * x / (x + gamma).powi(2);
            let got_l = l.to_vec1::<f32>().unwrap()[0] as f64;
            assert!((got_l - want_l).abs() < 1e-5, "{got_l} {want_l}");
            assert!((grad as f64 - want_g).abs() < 1e-5, "{grad} {want_g}");
        }
        // A low-probability expert token keeps a large gradient relative to
        // its probability (plain x would give d/dlogp = x).
        let x = 0.01f64;
        assert!(gamma * x / (x + gamma).powi(2) > 0.8 * x);
    }

    #[test]
    fn off_policy_expert_turns_become_luffy_samples() {
        use crate::rollout::Turn;
        let mut ep = guided_episode(PlanLoss::Default);
        ep.spec.expert = true;
        ep.spec.plan = 0;
        ep.turns = vec![Turn {
            prompt_ids: vec![2, 5],
            unguided_prompt_ids: None,
            action_ids: vec![7, 3],
            logprobs: vec![],
            prefix: false,
            off_policy: true,
            valid: true,
            action: "look".into(),
        }];
        let s = build_samples(&[ep], &[0.8], &SampleOptions::default());
        assert_eq!(s.len(), 1);
        assert!(s[0].off_policy && !s[0].aux && !s[0].forced);
        assert_eq!(s[0].advantage, 0.8);
    }
}
