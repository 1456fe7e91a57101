//! Group-relative advantages (GRPO, Dr.GRPO and GiGPO's episode level)
//! and the [`Advantages`] of a training batch.

/// How group rewards become advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageKind {
    /// (r − mean) / (std + 1e-6), std unbiased as in torch.std.
    Grpo,
    /// r − mean (Dr.GRPO: no std division).
    DrGrpo,
    /// GiGPO: the episode-level advantage plus a step-level one over anchor
    /// states ([`super::gigpo`]). It needs the episodes' turns, so
    /// [`group_advantages`] gives only its episode level in the default
    /// `"std"` normalisation (the same numbers as `Grpo`).
    Gigpo,
}

impl AdvantageKind {
    /// The name an experiment file gives it (its serde name).
    pub fn name(self) -> &'static str {
        match self {
            AdvantageKind::Grpo => "grpo",
            AdvantageKind::DrGrpo => "dr_grpo",
            AdvantageKind::Gigpo => "gigpo",
        }
    }
}

/// Advantages of one group's rewards. A group whose rewards are all equal
/// gets all-zero advantages (the reachability barrier's signature).
pub fn group_advantages(rewards: &[f64], kind: AdvantageKind) -> Vec<f64> {
    let n = rewards.len();
    if n == 0 {
        return vec![];
    }
    let mean = rewards.iter().sum::<f64>() / n as f64;
    let std = if n > 1 {
        (rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt()
    } else {
        0.0
    };
    rewards
        .iter()
        .map(|r| {
            let d = r - mean;
            if std == 0.0 {
                0.0
            } else {
                match kind {
                    AdvantageKind::Grpo | AdvantageKind::Gigpo => d / (std + 1e-6),
                    AdvantageKind::DrGrpo => d,
                }
            }
        })
        .collect()
}

/// The advantages of a batch of episodes: one per episode, and optionally
/// one per turn (GiGPO), which then replaces the episode's for its policy
/// turns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Advantages {
    /// One per episode.
    pub episodes: Vec<f64>,
    /// Empty, or one list per episode with one value per turn of
    /// `Episode::turns` (only policy turns' values are used).
    pub turns: Vec<Vec<f64>>,
}

impl Advantages {
    /// The advantage of episode `e`.
    pub fn episode(&self, e: usize) -> f64 {
        self.episodes[e]
    }

    /// The advantage of policy turn `t` of episode `e`: its own where the
    /// batch has per-turn values, else its episode's.
    pub fn policy_turn(&self, e: usize, t: usize) -> f64 {
        match self.turns.get(e) {
            Some(turns) => turns[t],
            None => self.episodes[e],
        }
    }
}

/// One advantage per episode (every turn takes its episode's).
impl From<Vec<f64>> for Advantages {
    fn from(episodes: Vec<f64>) -> Self {
        Advantages {
            episodes,
            turns: Vec::new(),
        }
    }
}

/// Whether a group has zero reward spread.
pub fn is_zero_std(rewards: &[f64]) -> bool {
    rewards.windows(2).all(|w| w[0] == w[1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpo_normalises_by_unbiased_std() {
        let a = group_advantages(&[1.0, 0.0, 0.0, 0.0], AdvantageKind::Grpo);
        // mean .25, unbiased std = sqrt(.75/3*... ) = 0.5
        assert!((a[0] - 0.75 / (0.5 + 1e-6)).abs() < 1e-9);
        assert!((a[1] + 0.25 / (0.5 + 1e-6)).abs() < 1e-9);
        assert!((a.iter().sum::<f64>()).abs() < 1e-9);
    }

    #[test]
    fn dr_grpo_and_zero_std() {
        let a = group_advantages(&[1.0, 0.0], AdvantageKind::DrGrpo);
        assert_eq!(a, vec![0.5, -0.5]);
        assert_eq!(
            group_advantages(&[0.0; 4], AdvantageKind::Grpo),
            vec![0.0; 4]
        );
        assert!(is_zero_std(&[1.0, 1.0]));
        assert!(!is_zero_std(&[1.0, 0.0]));
    }
}
