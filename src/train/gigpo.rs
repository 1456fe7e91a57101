//! GiGPO, Group-in-Group Policy Optimization (Feng et al., 2025; the
//! verl-agent code): the episode-level group advantage plus a step-level
//! advantage over *anchor states*, the policy turns of one task's group
//! that acted in the same env state (docs/ALGORITHMS.md#gigpo).
//!
//! A turn's anchor state is its [`Turn::state`] (the env's status line and
//! observation, [`crate::rollout::state_text`]); its step return is the
//! discounted sum of the episode's turn rewards from that turn on
//! ([`step_rewards`], [`discounted_returns`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::advantage::{group_advantages, is_zero_std, AdvantageKind};
use crate::rollout::{Episode, Turn};

/// How GiGPO normalises a group's differences from its mean
/// (`trainer.gigpo_norm`), at both levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GigpoNorm {
    /// (x − mean) / (std + 1e-6), std unbiased (verl-agent's
    /// `mean_std_norm`).
    Std,
    /// x − mean (verl-agent's `mean_norm`).
    Mean,
}

impl GigpoNorm {
    /// The group advantage that normalises the same way.
    fn kind(self) -> AdvantageKind {
        match self {
            GigpoNorm::Std => AdvantageKind::Grpo,
            GigpoNorm::Mean => AdvantageKind::DrGrpo,
        }
    }
}

/// GiGPO's settings (from the experiment's `trainer` section).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gigpo {
    /// Discount γ of the step returns, in [0, 1].
    pub gamma: f64,
    /// Weight ω of the step-level advantage, ≥ 0.
    pub step_weight: f64,
    pub norm: GigpoNorm,
}

/// What the anchor states of a batch looked like (the step's `gigpo`
/// metrics); adds up over task groups.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AnchorStats {
    /// Anchor groups with more than one policy turn.
    pub shared_groups: usize,
    /// Policy turns in those groups.
    pub shared_turns: usize,
    /// Policy turns in all.
    pub policy_turns: usize,
    /// Σ |A^S| over every policy turn.
    pub step_adv_abs_sum: f64,
}

impl AnchorStats {
    pub fn add(&mut self, o: &AnchorStats) {
        self.shared_groups += o.shared_groups;
        self.shared_turns += o.shared_turns;
        self.policy_turns += o.policy_turns;
        self.step_adv_abs_sum += o.step_adv_abs_sum;
    }

    /// Mean |A^S| over every policy turn (0 without policy turns).
    pub fn step_adv_abs_mean(&self) -> f64 {
        if self.policy_turns == 0 {
            0.0
        } else {
            self.step_adv_abs_sum / self.policy_turns as f64
        }
    }
}

/// GiGPO's advantages of one task's training group.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GigpoGroup {
    /// A^E, one per episode.
    pub episodes: Vec<f64>,
    /// Per episode, one per turn of `Episode::turns`: A^E + ω·A^S for a
    /// policy turn, A^E for the others.
    pub turns: Vec<Vec<f64>>,
    /// A^S, laid out like `turns` (0 for turns that are not policy turns).
    pub step: Vec<Vec<f64>>,
    pub stats: AnchorStats,
}

/// The reward of each policy turn of `ep`, in order: what its env step
/// added to the episode's reward. Whatever else `Episode::reward` holds
/// goes to the last policy turn, so that the rewards sum to it (a reward
/// script's outcome reward is already there, see
/// [`Episode::replace_reward`]; what is left is float rounding, or the
/// reward of a prefix that ended the episode, which has no policy turn).
pub fn step_rewards(ep: &Episode) -> Vec<f64> {
    let mut r: Vec<f64> = policy_turns(ep).map(|(_, t)| t.reward).collect();
    let rest = ep.reward - r.iter().sum::<f64>();
    if let Some(last) = r.last_mut() {
        *last += rest;
    }
    r
}

/// R_t = Σ_{k ≥ t} γ^{k−t} r_k, for each t.
pub fn discounted_returns(rewards: &[f64], gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; rewards.len()];
    let mut running = 0.0;
    for (o, r) in out.iter_mut().zip(rewards).rev() {
        running = r + gamma * running;
        *o = running;
    }
    out
}

/// The policy turns of `ep` with their index in `Episode::turns`.
fn policy_turns(ep: &Episode) -> impl Iterator<Item = (usize, &Turn)> {
    ep.turns.iter().enumerate().filter(|(_, t)| t.is_policy())
}

/// Normalised differences from the mean of one anchor group: 0 for a
/// group of one or with equal returns.
fn anchor_advantages(returns: &[f64], norm: GigpoNorm) -> Vec<f64> {
    if returns.len() < 2 || is_zero_std(returns) {
        return vec![0.0; returns.len()];
    }
    group_advantages(returns, norm.kind())
}

/// GiGPO's advantages of one task's training group `episodes`:
/// A^E = (R_i − mean R) / F over the episodes' rewards, and for each
/// policy turn A^S = (R_t − mean) / F over the turns of the group that
/// share its anchor state, combined as A^E + ω·A^S (F = std + 1e-6 or 1,
/// after `g.norm`). A^E is exactly what `group_advantages` gives GRPO
/// (`"std"`) or Dr.GRPO (`"mean"`).
pub fn gigpo_advantages(episodes: &[Episode], g: &Gigpo) -> GigpoGroup {
    let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
    let episode_adv = group_advantages(&rewards, g.norm.kind());
    // Every policy turn of the group by anchor state, in episode and turn
    // order (so each group's sums run in a fixed order).
    let mut anchors: BTreeMap<&str, Vec<(usize, usize, f64)>> = BTreeMap::new();
    for (ei, ep) in episodes.iter().enumerate() {
        let returns = discounted_returns(&step_rewards(ep), g.gamma);
        for ((ti, t), ret) in policy_turns(ep).zip(returns) {
            anchors.entry(&t.state).or_default().push((ei, ti, ret));
        }
    }
    let mut step: Vec<Vec<f64>> = episodes.iter().map(|e| vec![0.0; e.turns.len()]).collect();
    let mut stats = AnchorStats::default();
    for members in anchors.values() {
        let returns: Vec<f64> = members.iter().map(|m| m.2).collect();
        let adv = anchor_advantages(&returns, g.norm);
        if members.len() > 1 {
            stats.shared_groups += 1;
            stats.shared_turns += members.len();
        }
        for (&(ei, ti, _), a) in members.iter().zip(adv) {
            step[ei][ti] = a;
        }
    }
    let turns = episodes
        .iter()
        .zip(&episode_adv)
        .zip(&step)
        .map(|((ep, &ae), st)| {
            ep.turns
                .iter()
                .zip(st)
                .map(|(t, &a)| {
                    if t.is_policy() {
                        ae + g.step_weight * a
                    } else {
                        ae
                    }
                })
                .collect()
        })
        .collect();
    for (ep, st) in episodes.iter().zip(&step) {
        for (ti, _) in policy_turns(ep) {
            stats.policy_turns += 1;
            stats.step_adv_abs_sum += st[ti].abs();
        }
    }
    GigpoGroup {
        episodes: episode_adv,
        turns,
        step,
        stats,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::guidance::ResolvedSpec;

    /// A policy turn in state `state` whose step gave `reward`.
    pub(in crate::train) fn turn(state: &str, reward: f64) -> Turn {
        Turn {
            prompt_ids: vec![2, 5],
            unguided_prompt_ids: None,
            action_ids: vec![7, 3],
            logprobs: vec![-0.5, -0.5],
            prefix: false,
            off_policy: false,
            valid: true,
            action: "look".into(),
            unencodable: false,
            state: state.into(),
            reward,
        }
    }

    /// An episode of `turns`; its reward is their sum.
    pub(in crate::train) fn episode(turns: Vec<Turn>) -> Episode {
        Episode {
            task_id: "t".into(),
            spec: ResolvedSpec::default(),
            reward: turns.iter().map(|t| t.reward).sum(),
            success: turns.iter().any(|t| t.reward > 0.0),
            policy_turns: turns.iter().filter(|t| t.is_policy()).count(),
            turns,
            ..Default::default()
        }
    }

    /// Three episodes from one start state s0, sparse final reward:
    ///
    /// | episode | states         | rewards | R | returns (γ = 0.5) |
    /// | 0       | s0, s1         | 0, 1    | 1 | 0.5, 1            |
    /// | 1       | s0, s2, s1     | 0, 0, 1 | 1 | 0.25, 0.5, 1      |
    /// | 2       | s0, s2, s3     | 0, 0, 0 | 0 | 0, 0, 0           |
    ///
    /// Anchor groups: s0 {0.5, 0.25, 0} (mean 0.25, unbiased std 0.25),
    /// s2 {0.5, 0} (mean 0.25, std √0.125), s1 {1, 1} (no spread → 0),
    /// s3 {0} (alone → 0). Episode level: R = {1, 1, 0}, mean 2/3,
    /// unbiased std √(1/3).
    fn three_episodes() -> Vec<Episode> {
        vec![
            episode(vec![turn("s0", 0.0), turn("s1", 1.0)]),
            episode(vec![turn("s0", 0.0), turn("s2", 0.0), turn("s1", 1.0)]),
            episode(vec![turn("s0", 0.0), turn("s2", 0.0), turn("s3", 0.0)]),
        ]
    }

    fn close(got: &[f64], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn discounted_returns_by_hand() {
        close(
            &discounted_returns(&[0.0, 0.0, 1.0], 0.5),
            &[0.25, 0.5, 1.0],
        );
        close(&discounted_returns(&[0.0, 0.0, 1.0], 0.0), &[0.0, 0.0, 1.0]);
        close(
            &discounted_returns(&[-0.1, 0.0, 1.0], 1.0),
            &[0.9, 1.0, 1.0],
        );
        assert!(discounted_returns(&[], 0.9).is_empty());
    }

    #[test]
    fn std_mode_by_hand() {
        let g = Gigpo {
            gamma: 0.5,
            step_weight: 1.0,
            norm: GigpoNorm::Std,
        };
        let out = gigpo_advantages(&three_episodes(), &g);
        let s = (1.0f64 / 3.0).sqrt() + 1e-6;
        let (win, lose) = ((1.0 / 3.0) / s, (-2.0 / 3.0) / s);
        close(&out.episodes, &[win, win, lose]);
        let s0 = 0.25 / (0.25 + 1e-6);
        let s2 = 0.25 / (0.125f64.sqrt() + 1e-6);
        close(&out.step[0], &[s0, 0.0]);
        close(&out.step[1], &[0.0, s2, 0.0]);
        close(&out.step[2], &[-s0, -s2, 0.0]);
        close(&out.turns[0], &[win + s0, win]);
        close(&out.turns[1], &[win, win + s2, win]);
        close(&out.turns[2], &[lose - s0, lose - s2, lose]);
        assert_eq!(
            (
                out.stats.shared_groups,
                out.stats.shared_turns,
                out.stats.policy_turns
            ),
            (3, 7, 8)
        );
        assert!((out.stats.step_adv_abs_mean() - (2.0 * s0 + 2.0 * s2) / 8.0).abs() < 1e-12);
    }

    #[test]
    fn mean_mode_by_hand() {
        let g = Gigpo {
            gamma: 0.5,
            step_weight: 0.5,
            norm: GigpoNorm::Mean,
        };
        let out = gigpo_advantages(&three_episodes(), &g);
        let (win, lose) = (1.0 / 3.0, -2.0 / 3.0);
        close(&out.episodes, &[win, win, lose]);
        close(&out.step[0], &[0.25, 0.0]);
        close(&out.step[1], &[0.0, 0.25, 0.0]);
        close(&out.step[2], &[-0.25, -0.25, 0.0]);
        // A = A^E + 0.5 · A^S.
        close(&out.turns[0], &[win + 0.125, win]);
        close(&out.turns[1], &[win, win + 0.125, win]);
        close(&out.turns[2], &[lose - 0.125, lose - 0.125, lose]);
        assert!((out.stats.step_adv_abs_mean() - 1.0 / 8.0).abs() < 1e-12);
    }

    #[test]
    fn without_step_weight_it_is_grpo_exactly() {
        let eps = vec![
            episode(vec![turn("a", 0.0), turn("b", 0.3)]),
            episode(vec![turn("a", -0.1), turn("c", 0.0), turn("b", 1.0)]),
            episode(vec![turn("a", 0.0)]),
            episode(vec![turn("a", 0.7), turn("c", 0.0)]),
        ];
        let rewards: Vec<f64> = eps.iter().map(|e| e.reward).collect();
        for (norm, kind) in [
            (GigpoNorm::Std, AdvantageKind::Grpo),
            (GigpoNorm::Mean, AdvantageKind::DrGrpo),
        ] {
            let g = Gigpo {
                gamma: 0.9,
                step_weight: 0.0,
                norm,
            };
            let out = gigpo_advantages(&eps, &g);
            let want = group_advantages(&rewards, kind);
            assert_eq!(out.episodes, want);
            for (turns, w) in out.turns.iter().zip(&want) {
                assert!(turns.iter().all(|a| a == w), "{turns:?} vs {w}");
            }
            // The step level itself is there (only its weight is 0).
            assert!(out.stats.step_adv_abs_sum > 0.0);
        }
    }

    #[test]
    fn anchor_groups_of_one_give_no_step_advantage() {
        let eps = vec![
            episode(vec![turn("a", 0.0), turn("b", 1.0)]),
            episode(vec![turn("c", 0.0), turn("d", 0.0)]),
        ];
        let g = Gigpo {
            gamma: 0.95,
            step_weight: 1.0,
            norm: GigpoNorm::Std,
        };
        let out = gigpo_advantages(&eps, &g);
        assert!(out.step.iter().flatten().all(|&a| a == 0.0));
        for (turns, e) in out.turns.iter().zip(&out.episodes) {
            assert!(turns.iter().all(|a| a == e));
        }
        assert_eq!((out.stats.shared_groups, out.stats.shared_turns), (0, 0));
        assert_eq!(out.stats.step_adv_abs_mean(), 0.0);
        // One episode alone: nothing at either level.
        let out = gigpo_advantages(&eps[..1], &g);
        assert_eq!(out.episodes, vec![0.0]);
        assert_eq!(out.turns, vec![vec![0.0, 0.0]]);
    }

    #[test]
    fn prefix_and_expert_turns_keep_the_episode_advantage() {
        let prefix = Turn {
            prefix: true,
            logprobs: vec![],
            ..turn("s0", 0.0)
        };
        let expert = Turn {
            off_policy: true,
            ..turn("s0", 0.0)
        };
        let mut eps = three_episodes();
        // Same state text as the policy turns of s0: still not an anchor
        // member, and no step return of its own.
        eps[0].turns.insert(0, prefix);
        eps.push(episode(vec![
            expert.clone(),
            Turn {
                reward: 1.0,
                ..expert
            },
        ]));
        let g = Gigpo {
            gamma: 0.5,
            step_weight: 1.0,
            norm: GigpoNorm::Mean,
        };
        let out = gigpo_advantages(&eps, &g);
        // R = {1, 1, 0, 1}: mean 3/4.
        close(&out.episodes, &[0.25, 0.25, -0.75, 0.25]);
        assert_eq!(out.turns[0][0], 0.25);
        assert_eq!(out.step[0][0], 0.0);
        close(&out.turns[0][1..], &[0.25 + 0.25, 0.25]);
        assert_eq!(out.turns[3], vec![0.25, 0.25]);
        assert_eq!(out.stats.policy_turns, 8);
    }

    #[test]
    fn step_rewards_sum_to_the_episode_reward() {
        let mut ep = episode(vec![turn("a", -0.1), turn("b", 0.0), turn("c", 1.0)]);
        close(&step_rewards(&ep), &[-0.1, 0.0, 1.0]);
        // What the turns do not account for goes to the last policy turn.
        ep.reward = 2.0;
        close(&step_rewards(&ep), &[-0.1, 0.0, 2.1]);
        // A reward script's outcome reward replaces the step rewards.
        ep.replace_reward(0.25);
        close(&step_rewards(&ep), &[0.0, 0.0, 0.25]);
        assert_eq!(ep.reward, 0.25);
        // No policy turn: no step rewards.
        let mut ep = episode(vec![Turn {
            prefix: true,
            ..turn("a", 1.0)
        }]);
        ep.replace_reward(0.5);
        assert!(step_rewards(&ep).is_empty());
        assert_eq!(ep.turns[0].reward, 0.0);
    }
}
