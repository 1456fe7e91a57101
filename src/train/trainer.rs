//! The GRPO/PPO update: one optimiser step per minibatch, gradients
//! accumulated over micro-batches of length-sorted samples, global
//! grad-norm clipping, AdamW and the learning-rate schedule.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::distributed::{shard, Collective, Single};
use crate::model::memory::{MicroCost, HEAD_ROWS};
use crate::model::{lcp, Policy, ScoreBatch, ScoreOutput};

use super::loss::{luffy_token_loss, ppo_token_loss};
use super::optim::{AdamW, AdamWParams};
use super::samples::Sample;
use super::schedule;
use super::settings::{Aggregation, Schedule, TrainerSection};
use super::stats::{BehaviourStats, MicroTokens, Sums, TrainStats};
use super::TrainError;

/// GRPO trainer: optimiser, schedule, frozen reference.
pub struct Trainer {
    cfg: TrainerSection,
    opt: AdamW,
    reference: Option<Policy>,
    total_steps: usize,
    temperature: f64,
    /// The ranks training together ([`Single`]: this process alone).
    coll: Arc<dyn Collective>,
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
            coll: Arc::new(Single),
        })
    }

    /// Train data-parallel with the ranks of `coll`: every rank passes the
    /// same samples to [`Trainer::step`], scores its share of the
    /// micro-batches, and the gradients and metric sums are added over
    /// ranks before clipping, so every rank takes the same AdamW step.
    pub fn with_collective(mut self, coll: Arc<dyn Collective>) -> Self {
        self.set_collective(coll);
        self
    }

    /// See [`Trainer::with_collective`].
    pub fn set_collective(&mut self, coll: Arc<dyn Collective>) {
        self.coll = coll;
    }

    /// The trainer's settings.
    pub fn settings(&self) -> &TrainerSection {
        &self.cfg
    }

    /// The optimiser (its update count and moments go into checkpoints).
    pub fn optimizer(&self) -> &AdamW {
        &self.opt
    }

    /// Restore the optimiser's moments and update count from a checkpoint
    /// (see [`AdamW::load_state`]).
    pub fn restore_optimizer(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        t: u64,
    ) -> Result<(), super::OptimStateError> {
        self.opt.load_state(tensors, t)
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
        self.step_with(policy, samples, step, rng, None)
    }

    /// Whether [`Trainer::step_corrected`] can take π_old from the
    /// training pass itself: one optimiser step over the whole batch on
    /// one rank, so every micro-batch is scored by the weights that
    /// sampled π_old would have been scored with.
    pub fn fuses_behaviour(&self) -> bool {
        self.cfg.ppo_epochs == 1 && self.cfg.minibatches == 1 && self.coll.world() == 1
    }

    /// One update on samples whose policy tokens came from another
    /// behaviour policy (an inference engine, bf16 rollout weights),
    /// truncating the importance weights at `cap`. Where the update is a
    /// single optimiser step ([`Trainer::fuses_behaviour`]) π_old is the
    /// training pass's own detached log-prob (the PPO ratio is then 1, as
    /// in any one-step GRPO update) and the weights min(π_old / π_behaviour,
    /// `cap`) are taken from that pass: no separate scoring pass. Elsewhere
    /// [`Trainer::behaviour_correction`] scores π_old first. The returned
    /// seconds include the correction.
    pub fn step_corrected(
        &mut self,
        policy: &Policy,
        samples: &mut [Sample],
        step: usize,
        rng: &mut ChaCha8Rng,
        cap: f64,
    ) -> Result<(TrainStats, BehaviourStats), TrainError> {
        if self.fuses_behaviour() {
            let mut fuse = Fuse {
                cap,
                stats: BehaviourStats::default(),
            };
            let stats = self.step_with(policy, samples, step, rng, Some(&mut fuse))?;
            return Ok((stats, fuse.stats));
        }
        let t0 = Instant::now();
        let b = self.behaviour_correction(policy, samples, cap)?;
        let mut stats = self.step(policy, samples, step, rng)?;
        stats.seconds = t0.elapsed().as_secs_f64();
        Ok((stats, b))
    }

    fn step_with(
        &mut self,
        policy: &Policy,
        samples: &[Sample],
        step: usize,
        rng: &mut ChaCha8Rng,
        mut fuse: Option<&mut Fuse>,
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
                let grads = self.accumulate(policy, &mb, &mut sums, fuse.as_deref_mut())?;
                let grads = self.reduce(grads)?;
                let norm = global_norm(&grads)?;
                stats.grad_norm += norm;
                updates += 1;
                // The norm is the global one (after the ranks' reduce), so
                // every rank skips the same minibatches.
                if self.cfg.skip_zero_grad && norm == 0.0 {
                    stats.skipped_updates += 1;
                    continue;
                }
                let grads = self.clip(grads, norm)?;
                self.opt.step(&grads, lr)?;
            }
        }
        if self.coll.world() > 1 {
            sums.reduce(self.coll.as_ref())?;
        }
        let mut stats = sums.finish(stats, updates, self.cfg.ppo_epochs);
        stats.seconds = t0.elapsed().as_secs_f64();
        if dropout {
            policy.set_dropout_seed(None);
        }
        Ok(stats)
    }

    /// Tokens generated by an engine: its log-probs are the behaviour
    /// policy, which differs from this model's by kernels and precision.
    /// Score every policy sample with the current (pre-update) weights,
    /// make that π_old, and weight each token's loss by the truncated
    /// importance ratio min(π_old / π_engine, `cap`) (truncated importance
    /// sampling, as in current RL-with-inference-engine practice). A token
    /// without an engine log-prob (NaN) keeps weight 1. Returns the
    /// mismatch.
    pub fn behaviour_correction(
        &self,
        policy: &Policy,
        samples: &mut [Sample],
        cap: f64,
    ) -> Result<BehaviourStats, TrainError> {
        let mut idx: Vec<usize> = (0..samples.len())
            .filter(|&i| corrected(&samples[i]))
            .collect();
        if self.cfg.share_prefixes {
            idx.sort_by(|&a, &b| samples[a].seq.cmp(&samples[b].seq));
        }
        let mut st = BehaviourStats::default();
        let seqs: Vec<_> = idx.iter().map(|&i| scored(&samples[i])).collect();
        let ranges = micro_chunks(&seqs, self.cfg.micro_batch, self.micro_fill(policy, &seqs));
        for chunk in ranges.into_iter().map(|r| &idx[r]) {
            let batch = ScoreBatch {
                seqs: chunk.iter().map(|&i| samples[i].seq.clone()).collect(),
                targets: chunk.iter().map(|&i| samples[i].targets.clone()).collect(),
                temperature: self.temperature,
                share_prefixes: self.cfg.share_prefixes,
            };
            let lp = policy.score_detached(&batch)?.logp.to_vec1::<f32>()?;
            let mut at = 0usize;
            for &i in chunk {
                let s = &mut samples[i];
                let n = s.targets.len();
                let local = &lp[at..at + n];
                at += n;
                s.tis = local
                    .iter()
                    .enumerate()
                    .map(|(j, &l)| truncated_weight(&mut st, l, s.old_logp.get(j).copied(), cap))
                    .collect();
                s.old_logp = local.to_vec();
            }
        }
        Ok(st)
    }

    /// Sum the gradients over ranks (identity alone). A variable keeps no
    /// gradient only when no rank has one, as in one process.
    fn reduce(&self, grads: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>, TrainError> {
        if self.coll.world() == 1 {
            return Ok(grads);
        }
        let present: Vec<f64> = grads
            .iter()
            .map(|g| f64::from(u8::from(g.is_some())))
            .collect();
        let present = self.coll.all_reduce_f64(&present)?;
        let dense: Vec<Tensor> = grads
            .iter()
            .zip(self.opt.vars())
            .map(|(g, (_, v))| match g {
                Some(g) => Ok(g.clone()),
                None => v.as_tensor().zeros_like(),
            })
            .collect::<Result<_, candle_core::Error>>()?;
        let sums = self.coll.all_reduce_sum(&dense)?;
        Ok(sums
            .into_iter()
            .zip(present)
            .map(|(s, p)| (p > 0.0).then_some(s))
            .collect())
    }

    /// Scale `grads` (of global norm `norm`) down to the clip norm.
    fn clip(
        &self,
        grads: Vec<Option<Tensor>>,
        norm: f64,
    ) -> Result<Vec<Option<Tensor>>, candle_core::Error> {
        if self.cfg.grad_clip > 0.0 && norm > self.cfg.grad_clip {
            let s = self.cfg.grad_clip / (norm + 1e-6);
            grads
                .into_iter()
                .map(|g| g.map(|g| g * s).transpose())
                .collect()
        } else {
            Ok(grads)
        }
    }

    /// Forward/backward over micro-batches of one minibatch; returns the
    /// summed gradients aligned with the optimiser's variables.
    fn accumulate(
        &self,
        policy: &Policy,
        mb: &[&Sample],
        sums: &mut Sums,
        mut fuse: Option<&mut Fuse>,
    ) -> Result<Vec<Option<Tensor>>, TrainError> {
        let c = &self.cfg;
        let norms = Norms::of(mb, c.aux_nll_coef);
        // Sort by length so micro-batches pad little, or by content so
        // sequences sharing a prefix score together; stable for determinism.
        let mut idx: Vec<usize> = (0..mb.len())
            .filter(|&i| !mb[i].aux || norms.use_aux)
            .collect();
        if c.share_prefixes {
            idx.sort_by(|&a, &b| mb[a].seq.cmp(&mb[b].seq));
        } else {
            idx.sort_by_key(|&i| mb[i].seq.len());
        }
        let vars = self.opt.vars();
        let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
        let dev = policy.device().clone();
        let seqs: Vec<_> = idx.iter().map(|&i| scored(mb[i])).collect();
        let chunks: Vec<&[usize]> =
            micro_chunks(&seqs, c.micro_batch, self.micro_fill(policy, &seqs))
                .into_iter()
                .map(|r| &idx[r])
                .collect();
        // Data-parallel: this rank's share of the micro-batches (all of
        // them alone); the token weights above are the whole minibatch's.
        for k in shard(chunks.len(), self.coll.rank(), self.coll.world()) {
            let chunk = chunks[k];
            let batch = ScoreBatch {
                seqs: chunk.iter().map(|&i| mb[i].seq.clone()).collect(),
                targets: chunk.iter().map(|&i| mb[i].targets.clone()).collect(),
                temperature: self.temperature,
                share_prefixes: c.share_prefixes,
            };
            sums.train_tokens += batch.seqs.iter().map(Vec::len).sum::<usize>();
            let out = policy.score(&batch)?;
            sums.trunk_tokens += out.trunk_tokens;
            // Host copy of the log-probs: forced tokens' ratio base, and
            // the aux NLL metric below.
            let lp = out.logp.detach().to_vec1::<f32>()?;
            let consts = TokenConsts::of(
                chunk,
                mb,
                &lp,
                &norms,
                c.aggregation == Aggregation::TokenMean,
                fuse.as_deref_mut(),
            );
            let terms = self.micro_loss(&batch, &out, &consts, norms.use_aux, &dev)?;
            let grads = terms.loss.backward()?;
            for (k, (_, v)) in vars.iter().enumerate() {
                if let Some(g) = grads.get(v.as_tensor()) {
                    acc[k] = Some(match acc[k].take() {
                        Some(a) => (a + g)?,
                        None => g.clone(),
                    });
                }
            }
            // Metrics on the host side.
            let ent = out.entropy.detach().to_vec1::<f32>()?;
            let rt = terms.ratio.detach().to_vec1::<f32>()?;
            let tokens = MicroTokens {
                logp: &lp,
                entropy: &ent,
                ratio: &rt,
                kl: terms.kl.as_deref(),
                adv: &consts.adv,
                off: &consts.off,
            };
            sums.add_micro(&terms.pg_loss, chunk, mb, &tokens, c.clip_low, c.clip_high)?;
        }
        Ok(acc)
    }

    /// How the micro-batches of `seqs` are filled ([`micro_chunks`]): with
    /// prefix sharing in a large model, by the policy's memory per token
    /// and target; else by count. Small models keep the count: their step
    /// is overhead more than products, and the built-in tiny model's runs
    /// stay bit-identical.
    fn micro_fill(&self, policy: &Policy, seqs: &[(&[u32], usize)]) -> Fill {
        let share = self.cfg.share_prefixes;
        if !share || !policy.is_large() {
            return Fill::Count { share };
        }
        let longest = seqs.iter().map(|s| s.0.len()).max().unwrap_or(0);
        Fill::Memory(MicroCost::of(policy, longest))
    }

    /// The loss of one scored micro-batch: the policy loss (PPO, LUFFY's
    /// shaped loss on off-policy tokens), the aux NLL, the k3 KL to the
    /// reference and the entropy bonus, each weighted per token.
    fn micro_loss(
        &self,
        batch: &ScoreBatch,
        out: &ScoreOutput,
        k: &TokenConsts,
        use_aux: bool,
        dev: &Device,
    ) -> Result<MicroLoss, TrainError> {
        let c = &self.cfg;
        let n = k.w_pg.len();
        let any_off = k.off.iter().any(|&x| x > 0.0);
        let t = |v: &[f32]| Tensor::from_slice(v, n, dev);
        let (w_pg_t, w_aux_t, adv_t, old_t) = (t(&k.w_pg)?, t(&k.w_aux)?, t(&k.adv)?, t(&k.old)?);
        let logp = &out.logp;
        let (mut pg, ratio) =
            ppo_token_loss(logp, &old_t, &adv_t, c.clip_low, c.clip_high, c.dual_clip)?;
        if any_off {
            let m = t(&k.off)?;
            let shaped = luffy_token_loss(logp, &adv_t, c.luffy_gamma)?;
            pg = ((&pg * (1.0 - &m)?)? + (shaped * &m)?)?;
        }
        // Engine tokens: the PPO loss against the trainer's own π_old,
        // weighted by the truncated ratio π_old / π_engine (a constant).
        if k.tis.iter().any(|&w| w != 1.0) {
            pg = (&pg * t(&k.tis)?)?;
        }
        let pg_loss = (&pg * &w_pg_t)?.sum_all()?;
        let mut loss = pg_loss.clone();
        if use_aux {
            let aux = (logp.neg()? * &w_aux_t)?.sum_all()?;
            loss = (loss + (aux * c.aux_nll_coef)?)?;
        }
        let mut kl_vals = None;
        if let Some(r) = &self.reference {
            let ref_logp = r.score(batch)?.logp.detach();
            let d = (&ref_logp - logp)?;
            let kl = ((d.exp()? - &d)? - 1.0)?;
            loss = (loss + ((&kl * &w_pg_t)?.sum_all()? * c.kl_coef)?)?;
            kl_vals = Some(kl.detach().to_vec1::<f32>()?);
        }
        if c.entropy_coef > 0.0 {
            loss = (loss - ((&out.entropy * &w_pg_t)?.sum_all()? * c.entropy_coef)?)?;
        }
        Ok(MicroLoss {
            loss,
            pg_loss,
            ratio,
            kl: kl_vals,
        })
    }
}

/// Token-weight normalisers of one minibatch, so that its loss is the
/// chosen aggregate.
struct Norms {
    /// Weighted policy tokens (token mean).
    policy_tokens: f64,
    /// Weighted policy tokens per episode (seq-mean-token-mean).
    ep_tokens: BTreeMap<usize, f64>,
    n_eps: usize,
    /// Σ aux_weight × tokens over the aux samples.
    aux_weight_total: f64,
    /// The aux NLL is on and has tokens.
    use_aux: bool,
}

impl Norms {
    fn of(mb: &[&Sample], aux_nll_coef: f64) -> Self {
        let policy_tokens: f64 = mb
            .iter()
            .filter(|s| !s.aux)
            .map(|s| s.weight as f64 * s.targets.len() as f64)
            .sum();
        let mut ep_tokens = BTreeMap::<usize, f64>::new();
        for s in mb.iter().filter(|s| !s.aux) {
            *ep_tokens.entry(s.episode).or_default() += s.weight as f64 * s.targets.len() as f64;
        }
        let n_eps = ep_tokens.len().max(1);
        let aux_weight_total: f64 = mb
            .iter()
            .filter(|s| s.aux)
            .map(|s| s.aux_weight as f64 * s.targets.len() as f64)
            .sum();
        Norms {
            policy_tokens,
            ep_tokens,
            n_eps,
            aux_weight_total,
            use_aux: aux_nll_coef > 0.0 && aux_weight_total > 0.0,
        }
    }
}

/// Per-token constants of one micro-batch, in the order of its target
/// tokens.
struct TokenConsts {
    /// Policy-loss weight (0 for aux tokens).
    w_pg: Vec<f32>,
    /// Aux NLL weight (0 for policy tokens).
    w_aux: Vec<f32>,
    adv: Vec<f32>,
    /// The ratio's base log-prob.
    old: Vec<f32>,
    /// 1 for off-policy (LUFFY) tokens.
    off: Vec<f32>,
    /// Truncated importance weights of engine tokens (1 elsewhere).
    tis: Vec<f32>,
}

impl TokenConsts {
    /// The constants of the samples `chunk` of `mb`, whose current
    /// log-probs are `lp`; `token_mean` picks the aggregation.
    /// With `fuse`, π_old of the corrected samples is `lp` itself and
    /// their importance weights are taken against it.
    fn of(
        chunk: &[usize],
        mb: &[&Sample],
        lp: &[f32],
        norms: &Norms,
        token_mean: bool,
        mut fuse: Option<&mut Fuse>,
    ) -> Self {
        let mut k = TokenConsts {
            w_pg: Vec::new(),
            w_aux: Vec::new(),
            adv: Vec::new(),
            old: Vec::new(),
            off: Vec::new(),
            tis: Vec::new(),
        };
        let mut k_all = 0usize;
        for &i in chunk {
            let s = mb[i];
            for j in 0..s.targets.len() {
                if s.aux {
                    k.w_pg.push(0.0f32);
                    k.w_aux
                        .push((s.aux_weight as f64 / norms.aux_weight_total) as f32);
                    k.adv.push(0.0);
                    k.old.push(0.0);
                    k.off.push(0.0);
                    k.tis.push(1.0);
                } else {
                    let w = if token_mean {
                        1.0 / norms.policy_tokens.max(1e-9)
                    } else {
                        1.0 / (norms.ep_tokens[&s.episode].max(1e-9) * norms.n_eps as f64)
                    };
                    k.w_pg.push((w * s.weight as f64) as f32);
                    k.w_aux.push(0.0);
                    k.adv.push(s.advantage);
                    k.off.push(if s.off_policy { 1.0 } else { 0.0 });
                    match fuse.as_deref_mut().filter(|_| corrected(s)) {
                        Some(f) => {
                            let l = lp[k_all];
                            k.old.push(l);
                            let w = truncated_weight(
                                &mut f.stats,
                                l,
                                s.old_logp.get(j).copied(),
                                f.cap,
                            );
                            k.tis.push(w);
                        }
                        None => {
                            // Forced tokens have no behaviour log-prob:
                            // their ratio is taken against the current
                            // policy.
                            k.old.push(if s.forced {
                                lp[k_all]
                            } else {
                                s.old_logp.get(j).copied().unwrap_or(0.0)
                            });
                            k.tis.push(s.tis.get(j).copied().unwrap_or(1.0));
                        }
                    }
                }
                k_all += 1;
            }
        }
        k
    }
}

/// The behaviour correction taken inside the training pass
/// ([`Trainer::step_corrected`]).
struct Fuse {
    cap: f64,
    stats: BehaviourStats,
}

/// A policy sample whose tokens carry a behaviour log-prob to correct
/// for (not aux, forced or off-policy expert tokens).
fn corrected(s: &Sample) -> bool {
    !s.aux && !s.forced && !s.off_policy && !s.old_logp.is_empty()
}

/// The truncated importance weight min(π_old / π_behaviour, `cap`) of one
/// token whose π_old log-prob is `old`, counted in `st`; 1 where the
/// behaviour log-prob is missing (NaN or absent).
fn truncated_weight(st: &mut BehaviourStats, old: f32, behaviour: Option<f32>, cap: f64) -> f32 {
    match behaviour.filter(|b| b.is_finite()) {
        Some(b) => {
            let d = f64::from(old - b);
            let w = d.exp();
            st.tokens += 1;
            st.abs_diff_sum += d.abs();
            st.max_abs_diff = st.max_abs_diff.max(d.abs());
            st.ratio_sum += w;
            if w > cap {
                st.truncated += 1;
            }
            w.min(cap) as f32
        }
        None => {
            st.missing += 1;
            1.0
        }
    }
}

/// The loss of one micro-batch and what its metrics need.
struct MicroLoss {
    /// Everything, to backpropagate.
    loss: Tensor,
    /// The weighted policy loss alone.
    pg_loss: Tensor,
    /// π_θ / π_old per token.
    ratio: Tensor,
    /// k3 KL per token, when there is a reference.
    kl: Option<Vec<f32>>,
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

/// What one sample costs a micro-batch: the tokens the trunk runs (up to
/// its last target) and its target count.
fn scored(s: &Sample) -> (&[u32], usize) {
    let end = s.targets.iter().max().copied().unwrap_or(0);
    (&s.seq[..end.min(s.seq.len())], s.targets.len())
}

/// How [`micro_chunks`] fills micro-batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// `micro_batch` sequences each; with `share`, a sequence that the
    /// next one strictly extends (a conversation turn whose prompt and
    /// answer open the next turn's prompt) does not count, so an episode's
    /// turns stay together.
    Count { share: bool },
    /// Prefix sharing by memory: `micro_batch` longest sequences' worth of
    /// packed-trie tokens and LM-head targets, at these costs.
    Memory(MicroCost),
}

/// Splits sequences (in scoring order; each the tokens it runs through the
/// trunk and its target count) into micro-batches.
///
/// With [`Fill::Memory`] a micro-batch holds as many sequences as fit the
/// memory of `micro_batch` of the longest ones: each longest sequence's
/// tokens and [`HEAD_ROWS`] targets (or the most of one sequence, if
/// more), against the tokens of the packed trie (a sequence adds its
/// suffix after the one before it) and the targets. That is the bound the
/// memory estimate and a sequence count give, but a group whose rollouts
/// share their prompts (a task's first turn, each turn's system message
/// and task) runs those prompts once per micro-batch rather than once per
/// `micro_batch` sequences: on SmolLM2's 8 × 8 household step, 2× fewer
/// tokens through the trunk.
fn micro_chunks(seqs: &[(&[u32], usize)], micro_batch: usize, fill: Fill) -> Vec<Range<usize>> {
    let per = micro_batch.max(1);
    let cost = match fill {
        Fill::Memory(cost) => cost,
        Fill::Count { share } => return count_chunks(seqs, per, share),
    };
    let longest = seqs.iter().map(|s| s.0.len()).max().unwrap_or(0) as u64;
    let most = seqs.iter().map(|s| s.1).max().unwrap_or(0).max(HEAD_ROWS) as u64;
    let budget = per as u64 * (longest * cost.token + most * cost.target);
    let mut out = Vec::new();
    let (mut start, mut used) = (0usize, 0u64);
    for k in 0..seqs.len() {
        let (s, n) = seqs[k];
        let shared = if k == start { 0 } else { lcp(seqs[k - 1].0, s) };
        let mut add = (s.len() - shared) as u64 * cost.token + n as u64 * cost.target;
        if k > start && used + add > budget {
            out.push(start..k);
            start = k;
            add = s.len() as u64 * cost.token + n as u64 * cost.target;
            used = 0;
        }
        used += add;
    }
    if start < seqs.len() {
        out.push(start..seqs.len());
    }
    out
}

/// [`Fill::Count`].
fn count_chunks(seqs: &[(&[u32], usize)], per: usize, share: bool) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut count) = (0usize, 0usize);
    for k in 0..seqs.len() {
        let extended = share
            && seqs.get(k + 1).is_some_and(|next| {
                next.0.len() > seqs[k].0.len() && next.0.starts_with(seqs[k].0)
            });
        if !extended {
            count += 1;
        }
        if count == per {
            out.push(start..k + 1);
            start = k + 1;
            count = 0;
        }
    }
    if start < seqs.len() {
        out.push(start..seqs.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{micro_chunks, Fill};
    use crate::model::memory::MicroCost;

    const TOKENS: Fill = Fill::Memory(MicroCost {
        token: 1,
        target: 0,
    });
    const TARGETS: Fill = Fill::Memory(MicroCost {
        token: 0,
        target: 1,
    });
    const COUNT: Fill = Fill::Count { share: false };
    const COUNT_SHARED: Fill = Fill::Count { share: true };

    #[test]
    fn counted_micro_batches_keep_a_conversation_together() {
        let t = |s: &'static [u32]| (s, 1usize);
        let (a, b, c, d, e) = (
            t(&[1, 2]),
            t(&[1, 2, 3, 4]),
            t(&[1, 2, 3, 4, 5]),
            t(&[1, 7]),
            t(&[1, 7]),
        );
        let seqs = [a, b, c, d, e];
        // The plain count, with sharing off, or with no sequence extended.
        assert_eq!(micro_chunks(&seqs, 2, COUNT), vec![0..2, 2..4, 4..5]);
        assert_eq!(micro_chunks(&[d, e, d], 2, COUNT_SHARED), vec![0..2, 2..3]);
        // a and b open c: the conversation a-b-c is one, equal sequences
        // are not an extension.
        assert_eq!(micro_chunks(&seqs, 2, COUNT_SHARED), vec![0..4, 4..5]);
        assert_eq!(micro_chunks(&seqs, 1, COUNT_SHARED), vec![0..3, 3..4, 4..5]);
    }

    #[test]
    fn shared_micro_batches_fill_the_memory_of_micro_batch_longest_sequences() {
        let seq = |last: u32| vec![1, 2, 3, last];
        let seqs: Vec<Vec<u32>> = vec![seq(4), seq(5), seq(6), seq(7), seq(8), vec![9; 4]];
        let with = |targets: &[usize]| -> Vec<(&[u32], usize)> {
            seqs.iter()
                .map(Vec::as_slice)
                .zip(targets.iter().copied())
                .collect()
        };
        // Without sharing: the plain count.
        let one = with(&[4, 1, 1, 1, 1, 1]);
        assert_eq!(micro_chunks(&one, 2, COUNT), vec![0..2, 2..4, 4..6]);
        // Sharing, 2 × 4 tokens: the first five hold 4 + 1 + 1 + 1 + 1
        // packed tokens; the sixth shares nothing and opens the next.
        assert_eq!(micro_chunks(&one, 2, TOKENS), vec![0..5, 5..6]);
        // 2 × 100 targets (the most of one sequence) bound the LM head too.
        let two = with(&[100, 60, 60, 1, 1, 1]);
        assert_eq!(micro_chunks(&two, 2, TARGETS), vec![0..2, 2..6]);
        // micro_batch 1: each sequence alone (a second one's suffix would
        // exceed the longest sequence's tokens).
        assert_eq!(micro_chunks(&one, 1, TOKENS).len(), 6);
        // A conversation's turns extend each other: the extension alone counts.
        let (a, b, c): (&[u32], &[u32], &[u32]) = (&[1, 2], &[1, 2, 3, 4], &[5, 6, 7, 8]);
        assert_eq!(
            micro_chunks(&[(a, 1), (b, 1), (c, 1)], 1, TOKENS),
            vec![0..2, 2..3]
        );
        assert_eq!(
            micro_chunks(&[], 4, TOKENS),
            Vec::<std::ops::Range<usize>>::new()
        );
    }
}
