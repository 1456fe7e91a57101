//! The guidance-depth figure: per difficulty cluster, the depth of the
//! trained rollouts (median and 10–90 % band over a trailing window of
//! steps) and the mean depth ratio.

use super::curves::{smoothed, steps_window};
use super::draw::{render, Spec};
use super::panel::{Band, Key, Layout, Panel, YRange};
use super::style::Stroke;
use super::Figure;
use crate::report::{quantile, ReportError, Run};

/// Difficulty clusters in numeric order ("10" after "9").
fn sorted_clusters<'a>(keys: impl Iterator<Item = &'a String>) -> Vec<String> {
    let mut v: Vec<String> = keys.cloned().collect();
    v.sort_by(|a, b| match (a.parse::<i64>(), b.parse::<i64>()) {
        (Ok(x), Ok(y)) => x.cmp(&y),
        (Ok(_), Err(_)) => std::cmp::Ordering::Less,
        (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
        _ => a.cmp(b),
    });
    v.dedup();
    v
}

/// Median and 10–90 % band of a run's depths in one cluster, each step
/// pooling the rollouts of the last `w` steps (a step has only a handful of
/// rollouts per cluster, too few for stable quantiles on their own).
fn depth_quantiles(run: &Run, cluster: &str, w: usize) -> (Vec<(f64, f64)>, Vec<Band>, usize) {
    let per_step: Vec<(f64, Option<&Vec<f64>>)> = run
        .steps
        .iter()
        .map(|s| (s.step as f64, s.depths_by_cluster.get(cluster)))
        .collect();
    let mut median = Vec::new();
    let mut bands = Vec::new();
    let mut cur = Band {
        run: 0,
        lower: Vec::new(),
        upper: Vec::new(),
    };
    for i in 0..per_step.len() {
        let here = per_step[i].1.is_some_and(|v| !v.is_empty());
        let mut pool: Vec<f64> = if here {
            per_step[i + 1 - w.min(i + 1)..=i]
                .iter()
                .filter_map(|(_, v)| *v)
                .flatten()
                .copied()
                .collect()
        } else {
            Vec::new()
        };
        pool.sort_by(f64::total_cmp);
        match (
            quantile(&pool, 0.1),
            quantile(&pool, 0.5),
            quantile(&pool, 0.9),
        ) {
            (Some(lo), Some(mid), Some(hi)) => {
                let xs = per_step[i].0;
                median.push((xs, mid));
                cur.lower.push((xs, lo));
                cur.upper.push((xs, hi));
            }
            // A step without rollouts of this cluster breaks the band.
            _ if !cur.lower.is_empty() => bands.push(std::mem::replace(
                &mut cur,
                Band {
                    run: 0,
                    lower: Vec::new(),
                    upper: Vec::new(),
                },
            )),
            _ => {}
        }
    }
    if !cur.lower.is_empty() {
        bands.push(cur);
    }
    let n = median.len();
    (median, bands, n)
}

pub(super) fn depth(runs: &[Run], x: (f64, f64), w: usize) -> Result<Figure, ReportError> {
    let list_clusters = sorted_clusters(
        runs.iter()
            .flat_map(|r| r.steps.iter().flat_map(|s| s.depths_by_cluster.keys())),
    );
    let ratio_clusters = sorted_clusters(
        runs.iter()
            .flat_map(|r| r.steps.iter().flat_map(|s| s.depth_ratio_by_cluster.keys())),
    );
    let clusters = sorted_clusters(list_clusters.iter().chain(&ratio_clusters));
    // One row per cluster; a column per kind of record present (the
    // per-rollout depths, the per-step mean ratio), so the figure keeps the
    // page width however many clusters there are.
    let kinds = [!list_clusters.is_empty(), !ratio_clusters.is_empty()];
    let cols = kinds.iter().filter(|k| **k).count();
    let mut panels: Vec<Panel> = Vec::new();
    for c in &clusters {
        if kinds[0] {
            let mut p = Panel::new(
                format!("cluster {c}: guidance depth"),
                "depth (actions or plan k)",
                YRange::FromZero,
            );
            for (i, r) in runs.iter().enumerate() {
                let (median, bands, _) = depth_quantiles(r, c, w);
                p.bands
                    .extend(bands.into_iter().map(|b| Band { run: i, ..b }));
                p.line(i, median, Stroke::Solid, false);
            }
            panels.push(p);
        }
        if kinds[1] {
            let mut p = Panel::new(
                format!("cluster {c}: mean depth ratio"),
                "prefix / expert length",
                YRange::Unit,
            );
            for (i, r) in runs.iter().enumerate() {
                let raw: Vec<(f64, f64)> = r
                    .steps
                    .iter()
                    .filter_map(|s| Some((s.step as f64, *s.depth_ratio_by_cluster.get(c)?)))
                    .collect();
                p.line(i, smoothed(&raw, w), Stroke::Solid, false);
            }
            panels.push(p);
        }
    }
    let layout = if panels.is_empty() {
        panels.push(Panel::new("guidance depth", "depth", YRange::FromZero));
        Layout::single()
    } else {
        Layout {
            rows: clusters.len(),
            cols,
            panel_h: 300,
        }
    };
    let mut keys = Vec::new();
    if kinds[0] {
        keys.push(Key::Band("median, 10–90 %"));
    }
    if kinds[1] {
        keys.push(Key::Line(Stroke::Solid, "mean ratio (smoothed)"));
    }
    render(
        runs,
        Spec {
            file: "depth.svg",
            title: "Guidance depth by difficulty cluster",
            caption: format!(
                "One row per difficulty cluster. Guidance depth panels (in runs that log \
                 `depths_by_cluster`): the depth of every trained rollout (executed expert-prefix \
                 actions, or plan k for plan guidance), as median (line) and 10–90 % band, each \
                 step pooling the rollouts of the last {}. Mean depth ratio panels \
                 (`depth_ratio_by_cluster`, the only depth record of older runs): executed prefix \
                 over expert length, averaged per step, trailing moving average over {}.",
                steps_window(w),
                steps_window(w)
            ),
            layout,
            panels: &panels,
            keys: &keys,
        },
        x,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::StepRow;
    use std::collections::BTreeMap;

    fn run_with_depths(depths: &[Option<Vec<f64>>]) -> Run {
        Run {
            steps: depths
                .iter()
                .enumerate()
                .map(|(i, d)| StepRow {
                    step: i as u64,
                    depths_by_cluster: d
                        .clone()
                        .map(|v| BTreeMap::from([("0".to_string(), v)]))
                        .unwrap_or_default(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn depth_band_pools_window_and_breaks_on_gaps() {
        let r = run_with_depths(&[
            Some(vec![0.0, 10.0]),
            Some(vec![5.0]),
            None,
            Some(vec![2.0]),
        ]);
        let (median, bands, n) = depth_quantiles(&r, "0", 2);
        assert_eq!(n, 3);
        // Step 1 pools steps 0 and 1: {0, 5, 10}.
        assert_eq!(median, vec![(0.0, 5.0), (1.0, 5.0), (3.0, 2.0)]);
        assert_eq!(bands.len(), 2);
        assert_eq!(bands[0].lower, vec![(0.0, 1.0), (1.0, 1.0)]);
        assert_eq!(bands[0].upper, vec![(0.0, 9.0), (1.0, 9.0)]);
    }

    #[test]
    fn clusters_sort_numerically() {
        let keys = ["10".to_string(), "2".into(), "x".into(), "2".into()];
        assert_eq!(sorted_clusters(keys.iter()), vec!["2", "10", "x"]);
    }
}
