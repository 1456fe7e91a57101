//! The advantage estimators, one registry by name: the trainer's
//! `advantage` setting (`"grpo"`, `"dr_grpo"`, `"gigpo"`) picks one, and
//! [`batch_advantages`] runs it over a training batch's task groups. The
//! run loop only hands over episodes and group sizes; which estimator
//! needs turns, anchor states or a normalisation is this module's business.

use crate::rollout::Episode;

use super::advantage::{group_advantages, is_zero_std, AdvantageKind, Advantages};
use super::gigpo::{gigpo_advantages, AnchorStats, Gigpo};
use super::settings::TrainerSection;

/// One task group's advantages (its episodes share a task and a prompt).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GroupAdvantages {
    /// One per episode.
    pub episodes: Vec<f64>,
    /// One list per episode with one value per turn, for estimators that
    /// credit turns apart (GiGPO); `None`: every turn takes its episode's.
    pub turns: Option<Vec<Vec<f64>>>,
    /// What the group's anchor states looked like (GiGPO).
    pub anchors: Option<AnchorStats>,
}

/// An advantage estimator.
pub trait Estimator: Send + Sync {
    /// The name the experiment file gives it.
    fn name(&self) -> &'static str;
    /// Whether it reports anchor-state statistics (then a batch's
    /// [`BatchAdvantages::anchors`] is `Some` even with no groups).
    fn has_anchors(&self) -> bool {
        false
    }
    /// The advantages of one group.
    fn group(&self, episodes: &[Episode]) -> GroupAdvantages;
}

/// GRPO and Dr.GRPO: group-normalised episode rewards.
struct GroupRelative(AdvantageKind);

impl Estimator for GroupRelative {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn group(&self, episodes: &[Episode]) -> GroupAdvantages {
        let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
        GroupAdvantages {
            episodes: group_advantages(&rewards, self.0),
            ..GroupAdvantages::default()
        }
    }
}

/// GiGPO: episode level plus a step level over anchor states.
struct GiGpo(Gigpo);

impl Estimator for GiGpo {
    fn name(&self) -> &'static str {
        AdvantageKind::Gigpo.name()
    }
    fn has_anchors(&self) -> bool {
        true
    }
    fn group(&self, episodes: &[Episode]) -> GroupAdvantages {
        let g = gigpo_advantages(episodes, &self.0);
        GroupAdvantages {
            episodes: g.episodes,
            turns: Some(g.turns),
            anchors: Some(g.stats),
        }
    }
}

/// The registry: the estimator the trainer settings name.
pub fn estimator(t: &TrainerSection) -> Box<dyn Estimator> {
    match t.advantage {
        k @ (AdvantageKind::Grpo | AdvantageKind::DrGrpo) => Box::new(GroupRelative(k)),
        AdvantageKind::Gigpo => Box::new(GiGpo(t.gigpo())),
    }
}

/// A training batch's advantages and what they say about the batch.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchAdvantages {
    pub advantages: Advantages,
    /// Groups whose rewards all tie (all-zero advantages: no signal).
    pub zero_std: usize,
    /// Anchor-state statistics summed over groups, for estimators that
    /// keep them.
    pub anchors: Option<AnchorStats>,
}

/// Advantages per task group (`group_sizes` consecutive episodes each)
/// under the estimator the trainer settings name.
pub fn batch_advantages(
    t: &TrainerSection,
    episodes: &[Episode],
    group_sizes: &[usize],
) -> BatchAdvantages {
    let est = estimator(t);
    let mut out = BatchAdvantages {
        advantages: Advantages {
            episodes: Vec::with_capacity(episodes.len()),
            turns: Vec::new(),
        },
        zero_std: 0,
        anchors: est.has_anchors().then(AnchorStats::default),
    };
    let mut at = 0usize;
    for &n in group_sizes {
        let group = &episodes[at..at + n];
        let rewards: Vec<f64> = group.iter().map(|e| e.reward).collect();
        if is_zero_std(&rewards) {
            out.zero_std += 1;
        }
        let g = est.group(group);
        out.advantages.episodes.extend(g.episodes);
        if let Some(turns) = g.turns {
            out.advantages.turns.extend(turns);
        }
        if let (Some(sum), Some(s)) = (out.anchors.as_mut(), g.anchors.as_ref()) {
            sum.add(s);
        }
        at += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::gigpo::tests::{episode, turn};
    use super::*;

    fn trainer(advantage: AdvantageKind) -> TrainerSection {
        TrainerSection {
            advantage,
            ..TrainerSection::default()
        }
    }

    /// Two groups: one that ties (no signal) and one that does not.
    fn batch() -> (Vec<Episode>, Vec<usize>) {
        let eps = vec![
            episode(vec![turn("a", 0.0), turn("b", 0.0)]),
            episode(vec![turn("a", 0.0)]),
            episode(vec![turn("a", 0.0), turn("b", 1.0)]),
            episode(vec![turn("a", 0.0), turn("c", 0.0)]),
            episode(vec![turn("a", 0.0), turn("b", 1.0)]),
        ];
        (eps, vec![2, 3])
    }

    #[test]
    fn the_registry_finds_each_estimator_by_its_experiment_file_name() {
        for (k, name) in [
            (AdvantageKind::Grpo, "grpo"),
            (AdvantageKind::DrGrpo, "dr_grpo"),
            (AdvantageKind::Gigpo, "gigpo"),
        ] {
            assert_eq!(estimator(&trainer(k)).name(), name);
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{name}\""), "name() must be the serde name");
        }
    }

    #[test]
    fn group_relative_estimators_give_the_group_advantages_of_each_group() {
        let (eps, sizes) = batch();
        for k in [AdvantageKind::Grpo, AdvantageKind::DrGrpo] {
            let b = batch_advantages(&trainer(k), &eps, &sizes);
            let mut want = group_advantages(&[0.0, 0.0], k);
            want.extend(group_advantages(&[1.0, 0.0, 1.0], k));
            assert_eq!(b.advantages.episodes, want);
            assert!(b.advantages.turns.is_empty());
            assert_eq!(b.zero_std, 1);
            assert_eq!(b.anchors, None);
        }
    }

    #[test]
    fn gigpo_gives_turn_advantages_and_sums_anchor_stats_over_groups() {
        let (eps, sizes) = batch();
        let t = trainer(AdvantageKind::Gigpo);
        let b = batch_advantages(&t, &eps, &sizes);
        let g1 = gigpo_advantages(&eps[..2], &t.gigpo());
        let g2 = gigpo_advantages(&eps[2..], &t.gigpo());
        let mut want = g1.episodes.clone();
        want.extend(g2.episodes.clone());
        assert_eq!(b.advantages.episodes, want);
        // One list per episode, one value per turn.
        let lens: Vec<usize> = b.advantages.turns.iter().map(Vec::len).collect();
        assert_eq!(lens, vec![2, 1, 2, 2, 2]);
        let mut stats = g1.stats;
        stats.add(&g2.stats);
        assert_eq!(b.anchors, Some(stats));
        assert_ne!(
            stats,
            AnchorStats::default(),
            "state a repeats in both groups"
        );
        assert_eq!(b.zero_std, 1);
    }

    #[test]
    fn gigpo_reports_anchor_stats_even_for_an_empty_batch() {
        let b = batch_advantages(&trainer(AdvantageKind::Gigpo), &[], &[]);
        assert_eq!(b.anchors, Some(AnchorStats::default()));
        let b = batch_advantages(&trainer(AdvantageKind::Grpo), &[], &[]);
        assert_eq!(b.anchors, None);
        assert_eq!(b.zero_std, 0);
    }
}
