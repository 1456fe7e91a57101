//! LoRA: fresh adapters compute the base, gradients reach adapters only,
//! merging, PEFT files, seeded dropout, training.

use super::*;

pub(super) fn lora_cfg(targets: &[&str], dropout: f64) -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout,
        targets: targets.iter().map(|s| s.to_string()).collect(),
    }
}

pub(super) const ALL: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// A LoRA policy whose `B`s are random too (fresh ones are zero, which
/// would hide every adapter bug behind `0 · x`).
pub(super) fn lora_policy(tied: bool, targets: &[&str], dropout: f64) -> Policy {
    let p = policy(tied, 31)
        .with_lora(
            &lora_cfg(targets, dropout),
            &mut ChaCha8Rng::seed_from_u64(32),
        )
        .unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(33);
    for (n, v) in p.named_vars() {
        if n.contains("lora_B") {
            let data: Vec<f32> = (0..v.elem_count())
                .map(|_| rng.random_range(-0.2..0.2))
                .collect();
            v.set(&Tensor::from_vec(data, v.dims(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    p
}

pub(super) fn lora_batch() -> ScoreBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(34);
    ScoreBatch {
        seqs: vec![rand_seq(&mut rng, 9, 50), rand_seq(&mut rng, 6, 50)],
        targets: vec![vec![2, 5, 8], vec![1, 5]],
        temperature: 1.0,
        share_prefixes: false,
    }
}

#[test]
fn fresh_lora_computes_exactly_the_base() {
    let base = policy(false, 31);
    let batch = lora_batch();
    let want = score_vec(&base, &batch);
    let p = policy(false, 31)
        .with_lora(&lora_cfg(ALL, 0.0), &mut ChaCha8Rng::seed_from_u64(1))
        .unwrap();
    assert_eq!(score_vec(&p, &batch), want);
    let prompts = prompts_of(&[4, 7], 3);
    let g = |p: &Policy| {
        p.generate(
            &prompts,
            &opts(6, 1.0, 1.0, false),
            None,
            &mut ChaCha8Rng::seed_from_u64(4),
        )
        .unwrap()
    };
    assert_eq!(g(&p), g(&base));
    // Only adapters train: 2 layers x 7 modules x (A, B).
    assert_eq!(p.named_vars().len(), 2 * 7 * 2);
    assert!(p.named_vars().iter().all(|(n, _)| n.contains(".lora_")));
    let (h, i, kv) = (32, 64, 2 * 8);
    let per_layer = 4 * ((h + 32) + (h + kv) * 2 + (32 + h) + (h + i) * 2 + (i + h));
    assert_eq!(p.num_trainable_params(), 2 * per_layer);
    assert_eq!(p.num_params(), base.num_params());
    assert!(p
        .with_lora(&lora_cfg(ALL, 0.0), &mut ChaCha8Rng::seed_from_u64(1))
        .is_err());
}

#[test]
fn lora_gradients_reach_every_adapter_and_no_base_weight() {
    for (tied, targets) in [(true, ALL), (false, &["q_proj", "v_proj", "up_proj"][..])] {
        let p = lora_policy(tied, targets, 0.0);
        let out = p.score(&lora_batch()).unwrap();
        let loss = (out.logp.sum_all().unwrap() + out.entropy.sum_all().unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        assert_eq!(p.named_vars().len(), 2 * 2 * targets.len());
        for (name, var) in p.named_vars() {
            let g = grads.get(var.as_tensor()).expect(&name);
            let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(norm > 0.0 && norm.is_finite(), "{name}: {norm}");
        }
        // (Custom ops may still hand a gradient to a frozen input; what
        // matters is that no base weight is a Var the optimiser could see.)
        for (name, t) in p.named_tensors() {
            assert!(!t.is_variable(), "{name} is still a Var");
        }
    }
}

/// The fused LoRA product (base and update in one BLAS op, gate and up
/// together) gives the scores and adapter gradients of the update composed
/// from candle ops; a projection whose stacked partner has no adapter (up
/// without gate) keeps the composed update.
#[test]
fn fused_lora_products_match_the_composed_update() {
    let batch = lora_batch();
    let mut counts = Vec::new();
    for targets in [ALL, &["q_proj", "v_proj", "up_proj"][..]] {
        let p = lora_policy(false, targets, 0.0);
        ops::LORA_PRODUCTS.with(|c| c.set(0));
        let fused = super::score::scored(&p, &batch, false, None).1;
        counts.push(ops::LORA_PRODUCTS.with(|c| c.get()));
        let composed: Vec<f64> = super::score::scored(&p, &batch, true, None)
            .1
            .into_iter()
            .map(f64::from)
            .collect();
        assert_close(&fused, &composed, 2e-4, &format!("{targets:?}"));
    }
    if !ops::blas_loaded() {
        println!("SKIPPED (fused products): no BLAS found (scripts/install-mkl.sh)");
        return;
    }
    // Every layer: q, k, v, o, gate+up, down; then q and v only.
    assert!(counts[0] > 0 && counts[0] % 6 == 0, "{counts:?}");
    assert_eq!(counts[1] * 3, counts[0], "{counts:?}");
}

#[test]
fn merged_weights_compute_what_the_adapters_do() {
    for tied in [true, false] {
        let p = lora_policy(tied, ALL, 0.0);
        let m = p.merged().unwrap();
        assert!(m.lora().is_none() && m.is_trainable());
        let batch = lora_batch();
        let (a, b) = (score_vec(&p, &batch), score_vec(&m, &batch));
        let a64: Vec<f64> = a.0.iter().map(|&x| x as f64).collect();
        assert_close(&b.0, &a64, 1e-5, "merged vs adapters");
        // Adapters change the model (B is random here).
        let base = score_vec(&policy(tied, 31), &batch).0;
        assert!(base.iter().zip(&a.0).any(|(x, y)| (x - y).abs() > 1e-3));
        // Generation merges on the fly: behaviour log-probs match scoring.
        let prompts = prompts_of(&[5, 2, 8], 6);
        let gens = p
            .generate(
                &prompts,
                &opts(5, 1.0, 1.0, false),
                None,
                &mut ChaCha8Rng::seed_from_u64(7),
            )
            .unwrap();
        let got: Vec<f32> = gens.iter().flat_map(|g| g.logprobs.clone()).collect();
        let want: Vec<f64> = rescore(&p, &prompts, &gens, 1.0)
            .into_iter()
            .map(f64::from)
            .collect();
        assert_close(&got, &want, 1e-4, "lora behaviour vs score");
    }
}

#[test]
fn adapters_save_load_and_refuse_bad_files() {
    let p = lora_policy(false, &["q_proj", "down_proj"], 0.0);
    let dir = tempfile::tempdir().unwrap();
    p.save_adapter(dir.path(), "models/base").unwrap();
    let back = policy(false, 31).load_adapter(dir.path()).unwrap();
    assert_eq!(back.lora(), p.lora());
    let batch = lora_batch();
    assert_eq!(score_vec(&back, &batch), score_vec(&p, &batch));
    let cfg_text = std::fs::read_to_string(dir.path().join(ADAPTER_CONFIG)).unwrap();
    assert!(cfg_text.contains("\"peft_type\": \"LORA\"") && cfg_text.contains("models/base"));

    let wpath = dir.path().join(ADAPTER_WEIGHTS);
    let mut tensors: HashMap<String, Tensor> = p.adapter_tensors().into_iter().collect();
    let err = |t: HashMap<String, Tensor>| {
        policy(false, 31)
            .with_lora_tensors(p.lora().unwrap(), t, "ad.safetensors")
            .unwrap_err()
            .to_string()
    };
    let name = Proj::Down.tensor_name(1, false);
    let kept = tensors.remove(&name).unwrap();
    let e = err(tensors.clone());
    assert!(
        e.contains("ad.safetensors") && e.contains(&name) && e.contains("missing"),
        "{e}"
    );
    tensors.insert(name.clone(), kept.t().unwrap());
    let e = err(tensors.clone());
    assert!(e.contains(&name) && e.contains("shape"), "{e}");
    tensors.insert(name, kept);
    tensors.insert(
        Proj::K.tensor_name(0, true),
        Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    let e = err(tensors);
    assert!(
        e.contains("unexpected") && e.contains("k_proj.lora_A"),
        "{e}"
    );
    std::fs::remove_file(&wpath).unwrap();
    let e = policy(false, 31)
        .load_adapter(dir.path())
        .unwrap_err()
        .to_string();
    assert!(e.contains(ADAPTER_WEIGHTS), "{e}");
    assert!(policy(false, 31).save_adapter(dir.path(), "b").is_err());
}

#[test]
fn lora_dropout_is_seeded_and_off_without_a_seed() {
    let p = lora_policy(false, ALL, 0.3);
    let batch = lora_batch();
    let plain = score_vec(&p, &batch).0;
    p.set_dropout_seed(Some(5));
    let a = score_vec(&p, &batch).0;
    let a2 = score_vec(&p, &batch).0;
    p.set_dropout_seed(Some(5));
    let b = score_vec(&p, &batch).0;
    p.set_dropout_seed(None);
    assert_eq!(score_vec(&p, &batch).0, plain);
    assert_eq!(a, b, "same seed, same masks");
    assert_ne!(a, plain, "dropout changes the scores");
    assert_ne!(a, a2, "the stream advances between calls");
    // A frozen copy (the KL reference) never drops.
    let f = p.frozen_copy().unwrap();
    f.set_dropout_seed(Some(5));
    assert_eq!(score_vec(&f, &batch).0, plain);
}

#[test]
fn lora_training_moves_the_target_log_prob() {
    use crate::train::optim::{AdamW, AdamWParams};
    let p = policy(false, 31)
        .with_lora(&lora_cfg(ALL, 0.0), &mut ChaCha8Rng::seed_from_u64(2))
        .unwrap();
    let batch = lora_batch();
    let before: f32 = p
        .score(&batch)
        .unwrap()
        .logp
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    let mut opt = AdamW::new(p.named_vars(), AdamWParams::without_decay()).unwrap();
    let base_before: Vec<(String, Tensor)> = p
        .named_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.copy().unwrap()))
        .collect();
    for _ in 0..5 {
        let loss = p
            .score(&batch)
            .unwrap()
            .logp
            .sum_all()
            .unwrap()
            .neg()
            .unwrap();
        let g = loss.backward().unwrap();
        let grads: Vec<Option<Tensor>> = opt.grads_from(&g);
        opt.step(&grads, 1e-2).unwrap();
    }
    let after: f32 = p
        .score(&batch)
        .unwrap()
        .logp
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    assert!(after > before + 0.5, "logp {before} -> {after}");
    for ((n, a), (_, b)) in base_before.iter().zip(p.named_tensors()) {
        let d: f32 = (a - &b)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert_eq!(d, 0.0, "base {n} moved");
    }
}

#[test]
fn adapters_written_as_llama_cpp_lora_gguf_load_back_exactly() {
    use crate::model::GgmlDType;
    let p = lora_policy(false, ALL, 0.0);
    let dir = tempfile::tempdir().unwrap();
    let (base, lora) = (dir.path().join("base.gguf"), dir.path().join("lora.gguf"));
    p.write_gguf(&base, GgmlDType::F32, None).unwrap();
    let bytes = p.write_lora_gguf(&lora).unwrap();
    assert_eq!(bytes, std::fs::metadata(&lora).unwrap().len());
    assert!(bytes < std::fs::metadata(&base).unwrap().len());
    // The base file holds no adapter; the adapter file no base weight.
    let g = crate::model::GgufFile::open(&lora).unwrap();
    assert!(g
        .tensor_names()
        .iter()
        .all(|n| n.ends_with(".lora_a") || n.ends_with(".lora_b")));
    assert_eq!(
        g.tensor_names().len(),
        2 * ALL.len() * p.config().num_hidden_layers
    );
    // Q's B is stored with llama.cpp's row permutation, A as it is.
    let (_, qb) = g.tensor_info("blk.0.attn_q.weight.lora_b").unwrap();
    let (_, qa) = g.tensor_info("blk.0.attn_q.weight.lora_a").unwrap();
    assert_eq!((qa[0], qb[1]), (4, 4));
    let back = Policy::from_gguf(&base, &Device::Cpu)
        .unwrap()
        .load_lora_gguf(&lora)
        .unwrap();
    assert_eq!(back.lora(), p.lora());
    for ((na, a), (nb, b)) in p.adapter_tensors().iter().zip(back.adapter_tensors()) {
        assert_eq!(na, &nb);
        assert_eq!(max_abs_diff(a, &b), 0.0, "{na}");
    }
    let batch = lora_batch();
    assert_eq!(score_vec(&back, &batch), score_vec(&p, &batch));
    // A B written without the permutation would not load back equal.
    let raw = p.adapter_tensors();
    let qb_raw = &raw
        .iter()
        .find(|(n, _)| n == &Proj::Q.tensor_name(0, false))
        .unwrap()
        .1;
    let stored = g.read_all_f32().unwrap();
    let qb_file = &stored
        .iter()
        .find(|(n, _)| n == "blk.0.attn_q.weight.lora_b")
        .unwrap()
        .1;
    assert!(
        max_abs_diff(qb_raw, qb_file) > 0.0,
        "Q's B must be row-permuted in the file"
    );
}

/// Largest elementwise |a − b|.
fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

#[test]
fn a_file_that_is_not_a_lora_adapter_is_refused_with_file_and_key() {
    use crate::model::GgmlDType;
    let p = lora_policy(false, &["q_proj"], 0.0);
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.gguf");
    p.write_gguf(&model, GgmlDType::F32, None).unwrap();
    let base = || Policy::from_gguf(&model, &Device::Cpu).unwrap();
    let e = base().load_lora_gguf(&model).unwrap_err().to_string();
    assert!(
        e.contains("model.gguf") && e.contains("general.type"),
        "{e}"
    );
    let e = base()
        .load_lora_gguf(&dir.path().join("none.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("none.gguf"), "{e}");
    let e = policy(false, 31)
        .write_lora_gguf(&dir.path().join("x.gguf"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no LoRA adapters"), "{e}");
}
