//! Group-relative advantages (GRPO and Dr.GRPO).

/// How group rewards become advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageKind {
    /// (r − mean) / (std + 1e-6), std unbiased as in torch.std.
    Grpo,
    /// r − mean (Dr.GRPO: no std division).
    DrGrpo,
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
                    AdvantageKind::Grpo => d / (std + 1e-6),
                    AdvantageKind::DrGrpo => d,
                }
            }
        })
        .collect()
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
