//! The metrics line of a training step (docs/ALGORITHMS.md#per-step-metrics lists what
//! each number means).

use std::collections::BTreeMap;

use super::phases::{Batch, Driven, Update};
use super::timings::Timings;
use super::Ctx;
use crate::env::Task;
use crate::experiment::metrics::{mean, means, round, std, success_breakdown};
use crate::guidance::Clusters;
use crate::rollout::Episode;
use crate::rundir::{StepGigpo, StepLine, StepRounds};
use crate::train::TrainStats;

/// Mean of a per-episode number.
fn mean_of(episodes: &[Episode], f: impl Fn(&Episode) -> f64) -> f64 {
    mean(&episodes.iter().map(f).collect::<Vec<_>>())
}

pub(super) fn step_line(
    ctx: &Ctx,
    step: usize,
    driven: &Driven,
    batch: &Batch,
    tstats: &TrainStats,
    update: &Update,
    timings: &Timings,
) -> StepLine {
    let episodes = &batch.episodes;
    let pairs: Vec<(&Task, &Episode)> = batch.tasks.iter().copied().zip(episodes.iter()).collect();
    let rewards: Vec<f64> = episodes.iter().map(|e| e.reward).collect();
    let policy_turns: usize = episodes.iter().map(|e| e.policy_turns).sum();
    let invalid: usize = episodes.iter().map(|e| e.invalid).sum();
    let (depth_ratio, depths) = depths_by_cluster(&batch.tasks, episodes, &ctx.clusters);
    let first_round: Vec<f64> = driven
        .groups
        .iter()
        .flat_map(|g| g.all.iter().filter(|r| r.round == 0))
        .map(|r| f64::from(u8::from(r.ep.success)))
        .collect();
    let rollout_tokens = driven.prompt_tokens + driven.generated_tokens;
    StepLine {
        step: Some(step),
        batch: success_breakdown(&pairs, &ctx.clusters),
        script_hash: Some(update.script_hash.clone()),
        script_hashes: update.script_hashes.clone(),
        reward_mean: Some(round(mean(&rewards))),
        reward_std: Some(round(std(&rewards))),
        frac_zero_std: Some(round(
            batch.zero_std as f64 / batch.task_count.max(1) as f64,
        )),
        success_round0: Some(round(mean(&first_round))),
        guided_frac: Some(round(mean_of(episodes, |e| {
            f64::from(u8::from(e.spec.is_guided()))
        }))),
        depth_mean: Some(round(mean_of(episodes, |e| e.prefix_executed as f64))),
        planned_depth_mean: Some(round(mean_of(episodes, |e| e.spec.prefix as f64))),
        depth_ratio_by_cluster: means(depth_ratio),
        depths_by_cluster: depths,
        plan_k_mean: Some(round(mean_of(episodes, |e| e.spec.plan as f64))),
        expert_frac: Some(round(mean_of(episodes, |e| {
            f64::from(u8::from(e.spec.expert))
        }))),
        rollouts: Some(driven.groups.iter().map(|g| g.spent()).sum()),
        rounds: StepRounds {
            probe_rollouts: Some(driven.groups.iter().map(|g| g.probes()).sum()),
            trained_rollouts: Some(episodes.len()),
            rounds_mean: Some(round(mean(
                &driven
                    .groups
                    .iter()
                    .map(|g| g.rounds as f64)
                    .collect::<Vec<_>>(),
            ))),
            hints: Some(episodes.iter().map(|e| e.hints).sum()),
            stopped: Some(episodes.iter().filter(|e| e.stopped).count()),
        },
        valid_action_ratio: Some(round(1.0 - invalid as f64 / policy_turns.max(1) as f64)),
        episode_len: Some(round(policy_turns as f64 / episodes.len().max(1) as f64)),
        env_errors: Some(batch.env_failed),
        expert_inadmissible: Some(
            driven
                .groups
                .iter()
                .flat_map(|g| g.all.iter())
                .filter(|r| r.ep.expert_inadmissible.is_some())
                .count(),
        )
        .filter(|&n| n > 0),
        unencodable_actions: Some(
            driven
                .groups
                .iter()
                .flat_map(|g| g.all.iter())
                .map(|r| r.ep.unencodable.len())
                .sum(),
        )
        .filter(|&n| n > 0),
        env_info: env_info(episodes),
        // Filled in by the step after the weight sync.
        engine: None,
        async_rollouts: None,
        rollout_bf16: None,
        gigpo: batch.anchors.map(|a| StepGigpo {
            anchor_groups: Some(a.shared_groups),
            anchor_turns: Some(a.shared_turns),
            step_adv_abs_mean: Some(round(a.step_adv_abs_mean())),
        }),
        pg_loss: Some(round(tstats.pg_loss)),
        aux_loss: Some(round(tstats.aux_loss)),
        kl: Some(round(tstats.kl)),
        entropy: Some(round(tstats.entropy)),
        clip_frac: Some(round(tstats.clip_frac)),
        grad_norm: Some(round(tstats.grad_norm)),
        skipped_updates: (tstats.skipped_updates > 0).then_some(tstats.skipped_updates),
        lr: Some(tstats.lr),
        policy_tokens: Some(tstats.policy_tokens),
        rollout_tokens: Some(rollout_tokens),
        generated_tokens: Some(driven.generated_tokens),
        train_tokens: Some(tstats.train_tokens),
        trunk_tokens: Some(tstats.trunk_tokens),
        script_errors: Some(driven.script_errors + update.script_errors),
        script: update
            .effects
            .metrics
            .iter()
            .map(|(k, v)| (k.clone(), round(*v)))
            .collect(),
        state: ctx
            .runtime
            .state_numbers()
            .into_iter()
            .map(|(k, v)| (k, round(v)))
            .collect(),
        time: timings.step_times(rollout_tokens, tstats.train_tokens),
    }
}

/// Per cluster: the executed prefix over the expert length of every trained
/// rollout, and its guidance depth (executed prefix, else plan k) — the
/// report draws that distribution over time. Executed, not planned: a
/// prefix that stopped early (an inadmissible expert action) guided the
/// rollout only as far as it ran.
fn depths_by_cluster(
    tasks: &[&Task],
    episodes: &[Episode],
    clusters: &Clusters,
) -> (BTreeMap<String, Vec<f64>>, BTreeMap<String, Vec<usize>>) {
    let mut ratio: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut depths: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (q, e) in tasks.iter().zip(episodes) {
        let len = q.expert.len().max(1) as f64;
        let c = clusters.of(q.expert.len()).to_string();
        ratio
            .entry(c.clone())
            .or_default()
            .push(e.prefix_executed as f64 / len);
        let d = if e.spec.prefix > 0 {
            e.prefix_executed
        } else {
            e.spec.plan
        };
        depths.entry(c).or_default().push(d);
    }
    (ratio, depths)
}

/// Mean of each numeric env extra over the episodes that report it.
fn env_info(episodes: &[Episode]) -> BTreeMap<String, f64> {
    let mut info: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for e in episodes {
        for (k, v) in &e.info {
            info.entry(k.clone()).or_default().push(*v);
        }
    }
    means(info)
}
