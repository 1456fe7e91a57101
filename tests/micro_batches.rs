//! How the trainer fills micro-batches with `share_prefixes`: a large
//! model's micro-batch holds as many sequences as the memory of
//! `micro_batch` longest ones allows on the packed trie, so a group's shared
//! prompt runs through the trunk once per micro-batch, not once per
//! `micro_batch` sequences; the update is the one without sharing (up to
//! float rounding). Small models keep filling by count.

use actguide::model::{ModelConfig, Policy};
use actguide::seed;
use actguide::train::{Sample, TrainStats, Trainer, TrainerSection};
use candle_core::Device;
use rand::Rng;

fn config(large: bool) -> ModelConfig {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let tiny = ModelConfig::from_file(&root.join("models/tiny/config.json")).unwrap();
    if !large {
        return tiny;
    }
    // ≥ 16M product weights: a large model by the trainer's measure.
    ModelConfig {
        hidden_size: 512,
        intermediate_size: 2048,
        num_hidden_layers: 5,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        ..tiny
    }
}

/// 16 sequences of one group: a shared 40-token prompt, then a 6-token
/// answer each (no two opening alike), the last 3 tokens scored.
fn samples(vocab: u32) -> Vec<Sample> {
    let mut rng = seed::rng(4, &[1]);
    let prompt: Vec<u32> = (0..40).map(|_| rng.random_range(4..vocab)).collect();
    (0..16)
        .map(|i| {
            let mut seq = prompt.clone();
            seq.push(4 + i as u32);
            seq.extend((0..5).map(|_| rng.random_range(4..vocab)));
            let len = seq.len();
            Sample {
                seq,
                targets: (len - 3..len).collect(),
                old_logp: vec![-4.0; 3],
                advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
                episode: i,
                aux: false,
                aux_weight: 1.0,
                off_policy: false,
                forced: false,
                weight: 1.0,
                tis: Vec::new(),
            }
        })
        .collect()
}

fn step(large: bool, share: bool) -> TrainStats {
    let cfg = config(large);
    let p = Policy::new_random(&cfg, &mut seed::rng(3, &[1]), &Device::Cpu).unwrap();
    let settings = TrainerSection {
        micro_batch: 2,
        share_prefixes: share,
        ..TrainerSection::default()
    };
    let mut t = Trainer::new(&p, None, &settings, 4, 1.0).unwrap();
    let s = samples(cfg.vocab_size as u32);
    t.step(&p, &s, 0, &mut seed::rng(5, &[3])).unwrap()
}

#[test]
fn a_large_models_shared_micro_batches_run_the_groups_prompt_once_per_memory_budget() {
    let shared = step(true, true);
    let plain = step(true, false);
    // Each sequence runs up to its last target: 45 tokens, 16 of them.
    assert_eq!(plain.trunk_tokens, 16 * 45);
    // The budget is 2 × 45 tokens' memory (and 2 × 64 LM-head rows): the
    // first micro-batch holds the prompt-and-answer (45) and 9 answers of
    // 5, the next the other 6 with the prompt again. By count (2 per
    // micro-batch) it would be 8 × 50 = 400.
    assert_eq!(shared.trunk_tokens, 45 + 9 * 5 + 45 + 5 * 5);
    // The same update up to float rounding.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-4 * (1.0 + b.abs());
    assert!(
        close(shared.grad_norm, plain.grad_norm),
        "{shared:?} {plain:?}"
    );
    assert!(close(shared.pg_loss, plain.pg_loss), "{shared:?} {plain:?}");
}

#[test]
fn a_small_models_shared_micro_batches_are_filled_by_count() {
    let shared = step(false, true);
    // 8 micro-batches of 2 sequences: the prompt (40) and both answers'
    // 5 tokens each.
    assert_eq!(shared.trunk_tokens, 8 * (40 + 2 * 5));
}
