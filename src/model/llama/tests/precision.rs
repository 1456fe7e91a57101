//! bf16 compute (`model.dtype: "bf16"`) on the CPU: close to f32, every
//! parameter still gets an f32 gradient, optimiser steps work on the f32
//! master weights, frozen weights are stored in bf16, checkpoints
//! round-trip exactly.

use super::lora::{lora_batch, lora_cfg, lora_policy, ALL};
use super::*;
use crate::model::Precision;
use crate::train::optim::{AdamW, AdamWParams};

/// Largest relative error `|bf16 - f32| / max(1, |f32|)` allowed in
/// log-probs, entropies and logits of the test model. bf16 keeps 8 bits of
/// mantissa (0.4 % per rounding); the test model's weights are large
/// (init range 0.3), so its activations are large and round coarsely:
/// measured worst 1.4 % (scores) and 3 % (logits, relative to the row's
/// largest).
const BF16_REL_TOL: f64 = 0.05;

/// Asserts `a` (bf16) within [`BF16_REL_TOL`] of `b` (f32), relative to
/// each value (at least 1), or with `row_scale` to the largest |value| of
/// `b` (logits: a small logit carries the rounding of the large ones);
/// returns the largest relative error.
fn assert_rel(a: &[f32], b: &[f32], row_scale: bool, what: &str) -> f64 {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let top = b.iter().fold(1f64, |m, &v| m.max((v as f64).abs()));
    let mut worst = 0f64;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let scale = if row_scale {
            top
        } else {
            (y as f64).abs().max(1.0)
        };
        let rel = (x as f64 - y as f64).abs() / scale;
        assert!(
            rel <= BF16_REL_TOL,
            "{what}[{i}]: {x} vs {y} (rel {rel:.4})"
        );
        worst = worst.max(rel);
    }
    worst
}

fn batch() -> ScoreBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    ScoreBatch {
        seqs: vec![rand_seq(&mut rng, 12, 50), rand_seq(&mut rng, 7, 50)],
        targets: vec![vec![3, 8, 11, 1], vec![4, 6]],
        temperature: 1.0,
        share_prefixes: false,
    }
}

fn bf16(p: Policy) -> Policy {
    p.with_precision(Precision::Bf16).unwrap()
}

fn target_logp(p: &Policy, b: &ScoreBatch) -> f32 {
    p.score(b)
        .unwrap()
        .logp
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// `n` AdamW steps raising the batch's target log-prob.
fn train(p: &Policy, b: &ScoreBatch, n: usize, lr: f64) {
    let mut opt = AdamW::new(p.named_vars(), AdamWParams::without_decay()).unwrap();
    for _ in 0..n {
        let loss = p.score(b).unwrap().logp.sum_all().unwrap().neg().unwrap();
        let g = loss.backward().unwrap();
        let grads: Vec<Option<Tensor>> = opt.grads_from(&g);
        opt.step(&grads, lr).unwrap();
    }
}

#[test]
fn bf16_scores_and_generation_are_close_to_f32() {
    for tied in [true, false] {
        let f = policy(tied, 1);
        let h = bf16(policy(tied, 1));
        assert_eq!(h.precision(), Precision::Bf16);
        let b = batch();
        let (lf, ef) = score_vec(&f, &b);
        let (lh, eh) = score_vec(&h, &b);
        let worst = assert_rel(&lh, &lf, false, "bf16 logp").max(assert_rel(
            &eh,
            &ef,
            false,
            "bf16 entropy",
        ));
        eprintln!("tied={tied}: worst relative error of bf16 scores {worst:.4}");
        assert_ne!(lh, lf, "the bf16 path really rounds");
        // Next-token logits (generation path) too.
        let prompts = prompts_of(&[5, 9], 3);
        let nf = f.next_logits(&prompts).unwrap();
        let nh = h.next_logits(&prompts).unwrap();
        for (a, b) in nh.iter().zip(&nf) {
            let w = assert_rel(a, b, true, "bf16 next logits");
            eprintln!("tied={tied}: worst error of bf16 logits, relative to the largest {w:.4}");
        }
        // Generation's reported log-probs are close to those scoring gives
        // (both bf16; the paths round differently: cached keys, scale
        // before the product), so the PPO ratio starts near 1 (measured
        // worst |Δ| 0.032 here; exactly equal in f32).
        let gens = h
            .generate(
                &prompts,
                &opts(6, 1.0, 1.0, false),
                None,
                &mut ChaCha8Rng::seed_from_u64(4),
            )
            .unwrap();
        let re = rescore(&h, &prompts, &gens, 1.0);
        let reported: Vec<f64> = gens
            .iter()
            .flat_map(|g| g.logprobs.iter().map(|&v| v as f64))
            .collect();
        assert_close(&re, &reported, 0.08, "bf16 generate vs score");
    }
}

#[test]
fn bf16_every_parameter_gets_an_f32_gradient() {
    for tied in [true, false] {
        let p = bf16(policy(tied, 1));
        // The trained Vars stay f32 master copies.
        for (name, t) in p.named_tensors() {
            assert_eq!(t.dtype(), DType::F32, "{name}");
        }
        let out = p.score(&batch()).unwrap();
        assert_eq!(out.logp.dtype(), DType::F32);
        let loss = (out.logp.sum_all().unwrap() + out.entropy.sum_all().unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in p.named_vars() {
            let g = grads.get(var.as_tensor()).expect(&name);
            assert_eq!(g.dtype(), DType::F32, "{name}");
            let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(norm > 0.0 && norm.is_finite(), "{name}: {norm}");
        }
    }
    // LoRA: the adapters train in f32, the frozen base is stored in bf16.
    let p = bf16(lora_policy(false, ALL, 0.0));
    for (name, t) in p.named_tensors() {
        assert_eq!(t.dtype(), DType::BF16, "{name}");
    }
    let out = p.score(&lora_batch()).unwrap();
    let grads = out.logp.sum_all().unwrap().backward().unwrap();
    assert_eq!(p.named_vars().len(), 2 * 7 * 2);
    for (name, var) in p.named_vars() {
        assert_eq!(var.dtype(), DType::F32, "{name}");
        let g = grads.get(var.as_tensor()).expect(&name);
        let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(norm > 0.0 && norm.is_finite(), "{name}: {norm}");
    }
}

#[test]
fn bf16_optimiser_steps_raise_the_target_log_prob() {
    let b = batch();
    let p = bf16(policy(false, 1));
    let reference = p.frozen_copy().unwrap();
    for (name, t) in reference.named_tensors() {
        assert_eq!(t.dtype(), DType::BF16, "frozen copy stores {name} in bf16");
    }
    let before = target_logp(&p, &b);
    train(&p, &b, 5, 1e-2);
    let after = target_logp(&p, &b);
    assert!(after > before + 1.0, "full: {before} -> {after}");
    // The frozen copy did not move.
    assert_eq!(target_logp(&reference, &b), before);

    let lb = lora_batch();
    let p = bf16(policy(false, 31))
        .with_lora(&lora_cfg(ALL, 0.0), &mut ChaCha8Rng::seed_from_u64(2))
        .unwrap();
    assert_eq!(
        p.precision(),
        Precision::Bf16,
        "adapters keep the precision"
    );
    let before = target_logp(&p, &lb);
    train(&p, &lb, 5, 1e-2);
    let after = target_logp(&p, &lb);
    assert!(after > before + 0.5, "lora: {before} -> {after}");
}

#[test]
fn bf16_checkpoints_round_trip_exactly() {
    let b = batch();
    let dir = tempfile::tempdir().unwrap();
    // Full weights: the checkpoint holds the f32 masters.
    let p = bf16(policy(true, 1));
    train(&p, &b, 2, 1e-2);
    let path = dir.path().join("w.safetensors");
    p.save_safetensors(&path).unwrap();
    let back = bf16(Policy::load_safetensors(p.config(), &path, &Device::Cpu).unwrap());
    assert_eq!(score_vec(&back, &b), score_vec(&p, &b));
    // LoRA: the adapters (f32) on the bf16 base.
    let lb = lora_batch();
    let p = bf16(lora_policy(true, ALL, 0.0));
    train(&p, &lb, 2, 1e-2);
    p.save_adapter(dir.path(), "base").unwrap();
    let back = bf16(policy(true, 31)).load_adapter(dir.path()).unwrap();
    assert_eq!(score_vec(&back, &lb), score_vec(&p, &lb));
}

/// bf16 rollout weights (`Policy::set_rollout_bf16`): the sampled tokens'
/// behaviour log-probs stay close to the f32 scores of the same tokens,
/// an optimiser step rebuilds the cached bf16 copies (the behaviour after
/// the step matches the updated weights, not the old ones), and the
/// setting is refused where it cannot run.
#[test]
fn bf16_rollout_weights_track_the_f32_policy() {
    let mut p = policy(true, 21);
    if !crate::model::ops::bf16_rollouts_available() {
        assert!(p.set_rollout_bf16(true).is_err());
        println!("SKIPPED: no BLAS with bf16 products (scripts/install-mkl.sh)");
        return;
    }
    p.set_rollout_bf16(true).unwrap();
    let prompts = prompts_of(&[3, 9, 1, 14], 8);
    let behaviour_gap = |p: &Policy, seed: u64| generation_gap(p, &prompts, seed);
    let before = behaviour_gap(&p, 1);
    assert!(
        before > 0.0,
        "bf16 weights gave exactly the f32 log-probs: not used?"
    );
    assert!(before < 0.1, "bf16 behaviour log-probs off by {before}");
    // The memory estimate covers the packed copies generation built.
    let packed = p.rollout_packed_bytes().expect("MKL packs bf16 weights") as u64;
    let counted = crate::model::memory::Footprint::of(&p).rollout_copies;
    assert!(
        counted >= packed && counted <= packed + 4 * p.num_params() as u64,
        "estimate {counted} against {packed} packed bytes"
    );
    // A large step: stale bf16 copies would now be far off.
    large_step(&p);
    let after = behaviour_gap(&p, 2);
    assert!(
        after < 0.1,
        "after a step the bf16 weights are stale: off by {after}"
    );
    // The f32 policy still generates exactly what it scores.
    p.set_rollout_bf16(false).unwrap();
    assert!(behaviour_gap(&p, 3) < 1e-4);
}

/// f32 generation on a CPU where the decode kernel runs multiplies by
/// packed copies of the weights: the sampled tokens' log-probs still match
/// scoring, the copies are counted by the memory estimate, and an optimiser
/// step repacks them (stale packs would generate from the old weights).
#[test]
fn f32_rollout_packs_track_the_policy() {
    let p = policy(true, 22);
    // Below the size generation packs: no packs.
    let small = policy(true, 23);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let prompt = prompts_of(&[3], 1);
    small
        .generate(&prompt, &opts(2, 1.0, 1.0, false), None, &mut rng)
        .unwrap();
    assert!(small.rollout_packed_bytes().is_none());
    let counted = crate::model::memory::Footprint::of(&small).rollout_copies;
    assert_eq!(counted, 0);
    // Pack this tiny model's weights (on this thread).
    crate::model::ops::PACK_MIN_ELEMS_OVERRIDE.with(|c| c.set(Some(0)));
    let prompts = prompts_of(&[3, 9, 1, 14], 8);
    let gap = |p: &Policy, seed: u64| generation_gap(p, &prompts, seed);
    assert!(gap(&p, 1) < 1e-4);
    if !crate::model::ops::f32_rollout_packs() {
        assert!(p.rollout_packed_bytes().is_none());
        println!("SKIPPED: no decode kernel on this CPU (AVX-512 or AVX2 with FMA)");
        return;
    }
    // Every matrix (projections, gate and up, the tied head) is packed
    // once, padded to the kernel's blocks.
    let matrices: usize = p
        .named_tensors()
        .iter()
        .filter(|(_, t)| t.rank() == 2)
        .map(|(_, t)| t.elem_count())
        .sum();
    let packed = p.rollout_packed_bytes().expect("f32 packs built");
    assert!(
        packed >= 4 * matrices && packed < 8 * matrices,
        "{packed} packed bytes for {matrices} weights"
    );
    let packed = packed as u64;
    let counted = crate::model::memory::Footprint::of(&p).rollout_copies;
    assert!(
        counted >= packed && counted <= 2 * packed,
        "estimate {counted} against {packed} packed bytes"
    );
    large_step(&p);
    assert!(gap(&p, 2) < 1e-4, "after a step the packs are stale");
}

/// The largest |log-prob at generation − log-prob scoring gives| over the
/// tokens `p` samples from `prompts` (6 each, temperature 1).
fn generation_gap(p: &Policy, prompts: &[Vec<u32>], seed: u64) -> f64 {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let gens = p
        .generate(prompts, &opts(6, 1.0, 1.0, false), None, &mut rng)
        .unwrap();
    let got: Vec<f32> = gens.iter().flat_map(|g| g.logprobs.clone()).collect();
    let want = rescore(p, prompts, &gens, 1.0);
    got.iter()
        .zip(&want)
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, f64::max)
}

/// One AdamW step of lr 0.05 on `p`: derived weight copies made before it
/// are far off after it.
fn large_step(p: &Policy) {
    let mut opt = AdamW::new(p.named_vars(), AdamWParams::without_decay()).unwrap();
    let out = p.score(&lora_batch()).unwrap();
    let grads = out
        .logp
        .mean_all()
        .unwrap()
        .neg()
        .unwrap()
        .backward()
        .unwrap();
    opt.step(&opt.grads_from(&grads), 0.05).unwrap();
}

/// Gradients of `p`'s trained tensors for the batch's summed target
/// log-prob, by name.
fn grads_of(p: &Policy, b: &ScoreBatch) -> Vec<(String, Vec<f32>)> {
    let loss = p.score(b).unwrap().logp.sum_all().unwrap().neg().unwrap();
    let g = loss.backward().unwrap();
    p.named_vars()
        .into_iter()
        .map(|(n, v)| {
            let t = g
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("{n}: no gradient"));
            (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect()
}

/// Mixed-precision training (`Policy::set_mixed_precision`): bf16 products
/// with f32 accumulation give every trained tensor a non-zero gradient
/// within a stated tolerance of f32's (relative L2 error per tensor ≤ 5 %,
/// cosine ≥ 0.998; measured ≤ 2.9 %), scores within [`BF16_REL_TOL`], for full training and
/// for LoRA (whose frozen base multiplies from bf16 copies made once);
/// generation and
/// scoring without a graph stay exactly f32; and the setting is refused
/// where it cannot run.
#[test]
fn mixed_precision_gradients_match_f32() {
    let mut probe = policy(true, 41);
    if !crate::model::ops::mixed_precision_available() {
        assert!(probe.set_mixed_precision(true).is_err());
        println!("SKIPPED: no BLAS with bf16 products (scripts/install-mkl.sh)");
        return;
    }
    type Case = (&'static str, Box<dyn Fn() -> Policy>, ScoreBatch);
    let cases: Vec<Case> = vec![
        ("full, tied", Box::new(|| policy(true, 41)), batch()),
        ("full, untied", Box::new(|| policy(false, 42)), batch()),
        (
            "lora",
            Box::new(|| lora_policy(true, ALL, 0.0)),
            lora_batch(),
        ),
    ];
    for (what, make, b) in cases {
        let f = make();
        let mut m = make();
        m.set_mixed_precision(true).unwrap();
        assert!(m.mixed_precision());
        // Without a graph (π_old, reference) the scores are f32's exactly.
        let detached = |p: &Policy| {
            let s = p.score_detached(&b).unwrap();
            s.logp.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        let gf = grads_of(&f, &b);
        let pairs = crate::model::ops::PAIR_PRODUCTS.with(|c| c.get());
        let gm = grads_of(&m, &b);
        // Full training multiplies by the stacked gate/up straight from the
        // two weights, once per layer (no f32 `cat`); LoRA keeps its own.
        let pairs = crate::model::ops::PAIR_PRODUCTS.with(|c| c.get()) - pairs;
        let layers = m.config().num_hidden_layers;
        assert_eq!(pairs, if m.lora().is_some() { 0 } else { layers }, "{what}");
        assert_eq!(gf.len(), gm.len());
        let mut worst = 0f64;
        for ((n, a), (_, c)) in gf.iter().zip(&gm) {
            let dot: f64 = a.iter().zip(c).map(|(&x, &y)| x as f64 * y as f64).sum();
            let na: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
            let nc: f64 = c.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
            let diff: f64 = a
                .iter()
                .zip(c)
                .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(
                nc > 0.0,
                "{what}: {n} got a zero gradient under mixed precision"
            );
            let rel = diff / na.max(1e-12);
            let cos = dot / (na * nc).max(1e-30);
            assert!(
                rel <= 0.05 && cos >= 0.998,
                "{what}: {n}: relative L2 error {rel:.4}, cosine {cos:.5}"
            );
            worst = worst.max(rel);
        }
        assert!(
            worst > 0.0,
            "{what}: mixed gradients equal f32's exactly: not bf16?"
        );
        // A LoRA base is rounded once and kept (every product weight, the
        // fused gate/up as one) except the first layer's q, k and v: their
        // input, the frozen embedding, carries no graph, so they take the
        // f32 path. Full training keeps no copies.
        let kept = m.frozen_bf16_bytes();
        if m.lora().is_some() {
            let c = m.config();
            let first_qkv =
                c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim();
            assert_eq!(
                kept,
                2 * (m.product_elems() - first_qkv),
                "{what}: frozen bf16 copies"
            );
        } else {
            assert_eq!(kept, 0, "{what}");
        }
        eprintln!("{what}: worst relative L2 gradient error {worst:.4}");
        // The tracked pass rounds, within the bf16 tolerance.
        let (lf, _) = score_vec(&f, &b);
        let tracked = m
            .score(&b)
            .unwrap()
            .logp
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_rel(&tracked, &lf, false, "mixed-precision logp");
        assert_eq!(
            detached(&m),
            detached(&f),
            "{what}: detached scoring must stay f32"
        );
    }
    assert!(probe.set_mixed_precision(true).is_ok());
}
