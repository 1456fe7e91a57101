//! Tests of [`super::Policy`], by concept: scoring and gradients against
//! an independent host-side reference forward (`reference`, `score`),
//! generation/score consistency and constrained decoding (`generate`),
//! checkpoint I/O and init (`weights`), LoRA (`lora`) and an ignored
//! throughput benchmark (`bench`). Shared fixtures live here.

use super::block::CHUNK_BUDGET_OVERRIDE;
use super::*;
use crate::model::error::ModelError;
use crate::model::lora::{Proj, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use crate::model::ops;
use crate::model::trie::TokenTrie;
use candle_core::DType;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

mod bench;
mod generate;
mod lora;
mod precision;
mod reference;
mod score;
mod weights;

/// [`tiny_cfg`] widened past `kernels::LARGE_MODEL_ELEMS` (≥ 16M product
/// weights), for the paths only large models take (shared prefill, wide
/// packed rows, shared LM-head rows).
fn large_cfg(tied: bool) -> ModelConfig {
    ModelConfig {
        hidden_size: 512,
        intermediate_size: 2048,
        num_hidden_layers: 5,
        num_attention_heads: 8,
        num_key_value_heads: 4,
        initializer_range: 0.05,
        ..tiny_cfg(tied)
    }
}

fn tiny_cfg(tied: bool) -> ModelConfig {
    ModelConfig {
        tie_word_embeddings: tied,
        // Larger than the HF default so distributions are peaked enough for
        // sampling tests to mean something.
        initializer_range: 0.3,
        ..crate::model::config::tests::tiny()
    }
}

fn policy(tied: bool, seed: u64) -> Policy {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Policy::new_random(&tiny_cfg(tied), &mut rng, &Device::Cpu).unwrap()
}

fn rand_seq(rng: &mut ChaCha8Rng, len: usize, vocab: u32) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(3..vocab)).collect()
}

fn assert_close(a: &[f32], b: &[f64], tol: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (*x as f64 - y).abs() <= tol,
            "{what}[{i}]: {x} vs {y} (tol {tol})"
        );
    }
}

fn score_vec(p: &Policy, batch: &ScoreBatch) -> (Vec<f32>, Vec<f32>) {
    let out = p.score(batch).unwrap();
    (out.logp.to_vec1().unwrap(), out.entropy.to_vec1().unwrap())
}

fn opts(max_new: usize, temperature: f64, top_p: f64, greedy: bool) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: max_new,
        temperature,
        top_p,
        greedy,
        eos_token_id: 2,
    }
}

/// Scores `prompt + generated` at the generated positions.
fn rescore(p: &Policy, prompts: &[Vec<u32>], gens: &[Generated], temp: f64) -> Vec<f32> {
    let seqs: Vec<Vec<u32>> = prompts
        .iter()
        .zip(gens)
        .map(|(pr, g)| pr.iter().chain(&g.tokens).copied().collect())
        .collect();
    let targets = prompts
        .iter()
        .zip(gens)
        .map(|(pr, g)| (pr.len()..pr.len() + g.tokens.len()).collect())
        .collect();
    score_vec(
        p,
        &ScoreBatch {
            seqs,
            targets,
            temperature: temp,
            share_prefixes: false,
        },
    )
    .0
}

fn prompts_of(lens: &[usize], seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    lens.iter().map(|&l| rand_seq(&mut rng, l, 50)).collect()
}
