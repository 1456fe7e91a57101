//! Per-step metrics (docs/ALGORITHMS.md#per-step-metrics): aggregation of episode results into
//! the numbers of the `metrics.jsonl` and `eval.jsonl` lines.

use std::collections::BTreeMap;

use crate::env::Task;
use crate::guidance::Clusters;
use crate::rollout::Episode;
use crate::rundir::SuccessBreakdown;

/// Mean of a slice (0 for empty).
pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Population standard deviation.
pub fn std(v: &[f64]) -> f64 {
    let m = mean(v);
    mean(&v.iter().map(|x| (x - m).powi(2)).collect::<Vec<_>>()).sqrt()
}

/// Success rate overall, by task type and by cluster for episodes paired
/// with their tasks.
pub fn success_breakdown(pairs: &[(&Task, &Episode)], clusters: &Clusters) -> SuccessBreakdown {
    let mut by_type: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut by_cluster: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut all = Vec::with_capacity(pairs.len());
    for (t, e) in pairs {
        let s = if e.success { 1.0 } else { 0.0 };
        all.push(s);
        by_type.entry(t.task_type.clone()).or_default().push(s);
        by_cluster
            .entry(clusters.of(t.expert.len()).to_string())
            .or_default()
            .push(s);
    }
    SuccessBreakdown {
        // No episode (the env failed them all): no rate, rather than 0.
        success: (!all.is_empty()).then(|| round(mean(&all))),
        success_by_type: means(by_type),
        success_by_cluster: means(by_cluster),
        episodes: Some(all.len()),
    }
}

/// The rounded mean of each list.
pub fn means(lists: BTreeMap<String, Vec<f64>>) -> BTreeMap<String, f64> {
    lists
        .into_iter()
        .map(|(k, v)| (k, round(mean(&v))))
        .collect()
}

/// Round to 6 decimals so metrics files are readable and stable.
pub fn round(x: f64) -> f64 {
    if x.is_finite() {
        (x * 1e6).round() / 1e6
    } else {
        x
    }
}
