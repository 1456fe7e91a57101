//! Difficulty clusters: quantiles of the expert length over the training
//! panel, fixed once per run (Agent-G²: K clusters by expert length).

use serde::{Deserialize, Serialize};

/// Upper bounds (inclusive) of each cluster's expert length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Clusters {
    pub bounds: Vec<usize>,
}

impl Clusters {
    /// K quantile clusters over the given expert lengths. Ties can make
    /// fewer than K distinct clusters; empty bounds are dropped.
    /// Clusters of a training panel's expert lengths: tasks without expert
    /// actions (a scarce-data panel) fall in cluster 0 and do not move
    /// the bounds.
    pub fn from_expert_lengths(lengths: impl Iterator<Item = usize>, k: usize) -> Self {
        let lens: Vec<usize> = lengths.filter(|&l| l > 0).collect();
        Self::from_lengths(&lens, k)
    }

    pub fn from_lengths(lengths: &[usize], k: usize) -> Self {
        let mut v: Vec<usize> = lengths.to_vec();
        v.sort_unstable();
        if v.is_empty() || k == 0 {
            return Clusters {
                bounds: vec![usize::MAX],
            };
        }
        let mut bounds = Vec::new();
        for i in 1..=k {
            let idx = ((i * v.len()).div_ceil(k)).clamp(1, v.len()) - 1;
            let b = if i == k { usize::MAX } else { v[idx] };
            if bounds.last() != Some(&b) {
                bounds.push(b);
            }
        }
        Clusters { bounds }
    }

    pub fn len(&self) -> usize {
        self.bounds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bounds.is_empty()
    }

    /// Cluster index of a task with expert length `len`.
    pub fn of(&self, len: usize) -> usize {
        self.bounds
            .iter()
            .position(|&b| len <= b)
            .unwrap_or(self.bounds.len() - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_clusters() {
        let lens: Vec<usize> = (1..=12).collect();
        let c = Clusters::from_lengths(&lens, 3);
        assert_eq!(c.len(), 3);
        assert_eq!(c.of(1), 0);
        assert_eq!(c.of(4), 0);
        assert_eq!(c.of(5), 1);
        assert_eq!(c.of(8), 1);
        assert_eq!(c.of(9), 2);
        assert_eq!(c.of(100), 2);
    }

    #[test]
    fn ties_merge_clusters() {
        let c = Clusters::from_lengths(&[2, 2, 2, 2], 3);
        assert_eq!(c.len(), 2);
        assert_eq!(c.of(2), 0);
    }
}
