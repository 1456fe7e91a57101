//! The behaviour correction for tokens sampled by another policy (an
//! inference engine, bf16 rollout weights): taken inside the training
//! pass when the update is one optimiser step, it must give the update and
//! the mismatch figures that a separate π_old scoring pass gives.

use actguide::model::{ModelConfig, Policy};
use actguide::seed;
use actguide::train::{BehaviourStats, Sample, TrainStats, Trainer, TrainerSection};
use candle_core::Device;
use rand::Rng;

fn policy() -> Policy {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let cfg = ModelConfig::from_file(&root.join("models/tiny/config.json")).unwrap();
    Policy::new_random(&cfg, &mut seed::rng(3, &[1]), &Device::Cpu).unwrap()
}

/// Policy samples whose behaviour log-probs are the current ones shifted:
/// some far below (ratio over the cap), one missing (NaN), one aux sample
/// and one forced, which are not corrected.
fn samples(p: &Policy) -> Vec<Sample> {
    let vocab = p.config().vocab_size as u32;
    let mut rng = seed::rng(9, &[2]);
    (0..8)
        .map(|i| {
            let len = 6 + i * 3;
            let seq: Vec<u32> = (0..len).map(|_| rng.random_range(4..vocab)).collect();
            let targets: Vec<usize> = (len - 3..len).collect();
            let shift = [0.3f32, -0.2, 1.5, 0.05, -1.0, 0.0, 0.0, 0.0][i];
            let old_logp = match i {
                6 => vec![],
                5 => vec![-4.0, f32::NAN, -4.0],
                _ => vec![-4.0 - shift; 3],
            };
            Sample {
                seq,
                old_logp,
                targets,
                advantage: if i % 2 == 0 { 1.0 } else { -0.5 },
                episode: i / 2,
                aux: i == 6,
                aux_weight: 1.0,
                off_policy: false,
                forced: i == 7,
                weight: 1.0,
                tis: Vec::new(),
            }
        })
        .collect()
}

fn weights(p: &Policy) -> Vec<f32> {
    p.named_vars()
        .iter()
        .flat_map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
}

fn settings(minibatches: usize) -> TrainerSection {
    TrainerSection {
        micro_batch: 2,
        minibatches,
        aux_nll_coef: 0.5,
        lr: 1e-2,
        ..TrainerSection::default()
    }
}

/// A separate scoring pass, then the step.
fn two_passes(minibatches: usize) -> (Vec<f32>, TrainStats, BehaviourStats) {
    let p = policy();
    let mut t = Trainer::new(&p, None, &settings(minibatches), 4, 1.0).unwrap();
    let mut s = samples(&p);
    let b = t.behaviour_correction(&p, &mut s, 2.0).unwrap();
    let st = t.step(&p, &s, 0, &mut seed::rng(5, &[3])).unwrap();
    (weights(&p), st, b)
}

fn corrected(minibatches: usize) -> (Vec<f32>, TrainStats, BehaviourStats, bool) {
    let p = policy();
    let mut t = Trainer::new(&p, None, &settings(minibatches), 4, 1.0).unwrap();
    let mut s = samples(&p);
    let fused = t.fuses_behaviour();
    let (st, b) = t
        .step_corrected(&p, &mut s, 0, &mut seed::rng(5, &[3]), 2.0)
        .unwrap();
    (weights(&p), st, b, fused)
}

#[test]
fn the_correction_inside_the_training_pass_takes_the_separate_passs_step() {
    let before = weights(&policy());
    let (w2, s2, b2) = two_passes(1);
    let (w1, s1, b1, fused) = corrected(1);
    assert!(fused, "one minibatch, one epoch, one rank: fused");
    // The figures count the same tokens: 6 corrected samples × 3 tokens,
    // one of them without a behaviour log-prob (NaN); the aux and forced
    // samples are not corrected.
    assert_eq!((b1.tokens, b1.missing), (17, 1));
    assert_eq!((b2.tokens, b2.missing), (17, 1));
    assert!(b1.truncated > 0, "some ratios exceed the cap");
    assert_eq!(b1.truncated, b2.truncated);
    assert!((b1.abs_diff_sum - b2.abs_diff_sum).abs() < 1e-4 * b2.abs_diff_sum);
    assert!((b1.ratio_sum - b2.ratio_sum).abs() < 1e-4 * b2.ratio_sum);
    // The step moved the weights, and both ways to the same place.
    let moved = before
        .iter()
        .zip(&w1)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(moved > 1e-4, "the step moved the weights by {moved}");
    let diff = w1
        .iter()
        .zip(&w2)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        diff < 1e-3 * moved,
        "fused and two-pass steps differ by {diff}"
    );
    assert!((s1.grad_norm - s2.grad_norm).abs() < 1e-4 * s2.grad_norm);
    assert!((s1.pg_loss - s2.pg_loss).abs() < 1e-5);
}

#[test]
fn several_minibatches_score_pi_old_before_the_first_update() {
    let (w2, s2, b2) = two_passes(2);
    let (w1, s1, b1, fused) = corrected(2);
    assert!(
        !fused,
        "two optimiser steps need π_old from before the first"
    );
    assert_eq!(w1, w2);
    assert_eq!(s1.grad_norm, s2.grad_norm);
    assert_eq!(
        (b1.tokens, b1.missing, b1.truncated),
        (b2.tokens, b2.missing, b2.truncated)
    );
    assert_eq!(b1.abs_diff_sum, b2.abs_diff_sum);
}
