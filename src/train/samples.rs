//! Episodes to token samples: which turns are trained, under which prompt
//! (plan losses), with which advantage and weight.

use super::Advantages;
use crate::guidance::PlanLoss;
use crate::rollout::Episode;

/// One scored sequence: a turn's prompt followed by its action tokens.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// Truncated importance weights min(π_old / π_engine, C) per target,
    /// when the tokens came from an engine (empty: weight 1; see
    /// [`crate::train::Trainer::behaviour_correction`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tis: Vec<f32>,
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

/// Build samples from episodes. Policy turns take their advantage from
/// `advantages` (per turn where it has per-turn values, GiGPO); executed
/// prefix turns (aux and forced) and off-policy expert turns take their
/// episode's.
pub fn build_samples(
    episodes: &[Episode],
    advantages: &Advantages,
    o: &SampleOptions,
) -> Vec<Sample> {
    let mut out = Vec::new();
    for (ei, ep) in episodes.iter().enumerate() {
        let adv = advantages.episode(ei);
        let n_prefix = ep.turns.iter().filter(|t| t.prefix).count();
        let base = |seq_prompt: &[u32], t: &crate::rollout::Turn, adv: f64| -> Sample {
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
                tis: Vec::new(),
            }
        };
        for (ti, t) in ep.turns.iter().enumerate() {
            // An answer holding the unknown token reached the env cut
            // short: it says nothing about the action the policy meant.
            if t.action_ids.is_empty() || t.unencodable {
                continue;
            }
            if t.prefix {
                if o.with_aux {
                    out.push(Sample {
                        aux: true,
                        aux_weight: 1.0 / n_prefix as f32,
                        ..base(&t.prompt_ids, t, adv)
                    });
                }
                if o.train_prefix {
                    let a = if o.protect_forced { adv.max(0.0) } else { adv };
                    out.push(Sample {
                        forced: true,
                        advantage: a as f32,
                        old_logp: Vec::new(),
                        ..base(&t.prompt_ids, t, adv)
                    });
                }
                continue;
            }
            if t.off_policy {
                out.push(Sample {
                    off_policy: true,
                    ..base(&t.prompt_ids, t, adv)
                });
                continue;
            }
            let adv = advantages.policy_turn(ei, ti);
            let Some(unguided) = &t.unguided_prompt_ids else {
                out.push(base(&t.prompt_ids, t, adv));
                continue;
            };
            let mode = match ep.spec.plan_loss {
                PlanLoss::Default => o.plan_loss,
                m => m,
            };
            match mode {
                PlanLoss::OnPolicy | PlanLoss::Default => out.push(base(&t.prompt_ids, t, adv)),
                // Same tokens, unguided context; behaviour log-probs stay
                // those of the guided context (ActGuide-RL §2).
                PlanLoss::Internalize => out.push(base(unguided, t, adv)),
                PlanLoss::Dual => {
                    out.push(base(&t.prompt_ids, t, adv));
                    out.push(Sample {
                        weight: o.dual_weight,
                        ..base(unguided, t, adv)
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::Turn;

    /// A valid `look` turn (tokens 7 3) after `prompt_ids`: an executed
    /// prefix turn (no log-probs) or a policy turn.
    fn look(prompt_ids: Vec<u32>, unguided: Option<Vec<u32>>, prefix: bool) -> Turn {
        Turn {
            prompt_ids,
            unguided_prompt_ids: unguided,
            action_ids: vec![7, 3],
            logprobs: if prefix { vec![] } else { vec![-1.0, -0.5] },
            prefix,
            off_policy: false,
            valid: true,
            action: "look".into(),
            unencodable: false,
            state: String::new(),
            reward: 0.0,
        }
    }

    /// One episode's advantage.
    fn adv(a: f64) -> Advantages {
        vec![a].into()
    }

    #[test]
    fn samples_skip_prefix_turns_unless_aux() {
        use crate::guidance::ResolvedSpec;
        use crate::rollout::Episode;
        let turn = |prefix: bool| look(vec![2, 5, 6], None, prefix);
        let ep = Episode {
            task_id: "t".into(),
            spec: ResolvedSpec {
                prefix: 2,
                ..Default::default()
            },
            turns: vec![turn(true), turn(true), turn(false)],
            success: true,
            reward: 1.0,
            policy_turns: 1,
            ..Default::default()
        };
        let s = build_samples(
            std::slice::from_ref(&ep),
            &adv(0.5),
            &SampleOptions::default(),
        );
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].targets, vec![3, 4]);
        assert_eq!(s[0].old_logp, vec![-1.0, -0.5]);
        assert_eq!(s[0].advantage, 0.5);
        let s = build_samples(
            &[ep],
            &adv(0.5),
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
                unencodable: false,
                state: String::new(),
                reward: 0.0,
            }],
            success: true,
            reward: 1.0,
            policy_turns: 1,
            ..Default::default()
        }
    }

    #[test]
    fn plan_losses_pick_the_context_of_the_guided_tokens() {
        let o = SampleOptions::default();
        // Internalised (the default): unguided prompt, guided behaviour log-probs.
        let s = build_samples(&[guided_episode(PlanLoss::Default)], &adv(1.0), &o);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].seq, vec![2, 5, 7, 3]);
        assert_eq!(s[0].targets, vec![2, 3]);
        assert_eq!(s[0].old_logp, vec![-0.7, -0.2]);
        // On-policy under the guided prompt, chosen per spec.
        let s = build_samples(&[guided_episode(PlanLoss::OnPolicy)], &adv(1.0), &o);
        assert_eq!(s[0].seq, vec![2, 9, 9, 5, 7, 3]);
        // Dual: both, the unguided one weighted.
        let s = build_samples(&[guided_episode(PlanLoss::Dual)], &adv(1.0), &o);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].seq.len(), s[0].weight), (6, 1.0));
        assert_eq!((s[1].seq.len(), s[1].weight), (4, 0.1));
        // The experiment default applies when the spec does not choose.
        let on = SampleOptions {
            plan_loss: PlanLoss::OnPolicy,
            ..o
        };
        let s = build_samples(&[guided_episode(PlanLoss::Default)], &adv(1.0), &on);
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
            unencodable: false,
            state: String::new(),
            reward: 0.0,
        }];
        let o = SampleOptions {
            train_prefix: true,
            ..Default::default()
        };
        let s = build_samples(std::slice::from_ref(&ep), &adv(-1.5), &o);
        assert_eq!(s.len(), 1);
        assert!(s[0].forced && !s[0].aux);
        assert_eq!(s[0].advantage, 0.0);
        let s = build_samples(std::slice::from_ref(&ep), &adv(0.5), &o);
        assert_eq!(s[0].advantage, 0.5);
        let unprotected = SampleOptions {
            protect_forced: false,
            ..o
        };
        let s = build_samples(&[ep], &adv(-1.5), &unprotected);
        assert_eq!(s[0].advantage, -1.5);
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
            unencodable: false,
            state: String::new(),
            reward: 0.0,
        }];
        let s = build_samples(&[ep], &adv(0.8), &SampleOptions::default());
        assert_eq!(s.len(), 1);
        assert!(s[0].off_policy && !s[0].aux && !s[0].forced);
        assert_eq!(s[0].advantage, 0.8);
    }

    #[test]
    fn per_turn_advantages_reach_policy_samples_only() {
        use crate::guidance::ResolvedSpec;
        use crate::rollout::Turn;
        let turn =
            |prefix: bool, guided: bool| look(vec![2, 9, 5], guided.then(|| vec![2, 5]), prefix);
        let mut ep = guided_episode(PlanLoss::Dual);
        ep.spec = ResolvedSpec {
            prefix: 1,
            plan: 2,
            plan_loss: PlanLoss::Dual,
            ..Default::default()
        };
        ep.turns = vec![turn(true, false), turn(false, true), turn(false, false)];
        let mut expert = guided_episode(PlanLoss::Default);
        expert.spec.expert = true;
        expert.turns = vec![Turn {
            off_policy: true,
            logprobs: vec![],
            ..turn(false, false)
        }];
        let advantages = Advantages {
            episodes: vec![-0.5, 0.75],
            // The prefix turn's and the expert turn's own values are never
            // used: those turns take their episode's.
            turns: vec![vec![9.0, 1.25, -2.0], vec![9.0]],
        };
        let o = SampleOptions {
            with_aux: true,
            train_prefix: true,
            protect_forced: false,
            ..Default::default()
        };
        let s = build_samples(&[ep, expert], &advantages, &o);
        let got: Vec<(bool, bool, bool, f32, f32)> = s
            .iter()
            .map(|x| (x.aux, x.forced, x.off_policy, x.weight, x.advantage))
            .collect();
        assert_eq!(
            got,
            vec![
                (true, false, false, 1.0, -0.5),  // aux NLL on the prefix
                (false, true, false, 1.0, -0.5),  // forced prefix tokens
                (false, false, false, 1.0, 1.25), // guided turn, dual: guided half
                (false, false, false, 0.1, 1.25), // and unguided half
                (false, false, false, 1.0, -2.0), // unguided turn
                (false, false, true, 1.0, 0.75),  // expert turn (LUFFY)
            ]
        );
        // Per-episode advantages only: every turn takes its episode's.
        let s = build_samples(
            &[guided_episode(PlanLoss::Dual)],
            &adv(0.5),
            &SampleOptions::default(),
        );
        assert_eq!(s.len(), 2);
        assert!(s.iter().all(|x| x.advantage == 0.5));
    }
}
