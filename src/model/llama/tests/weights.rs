//! Weights: safetensors round trip and errors, frozen copies, seeded init.

use super::*;

#[test]
fn safetensors_roundtrip_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(18);
    let seqs = vec![rand_seq(&mut rng, 8, 50), rand_seq(&mut rng, 4, 50)];
    let batch = ScoreBatch {
        seqs,
        targets: vec![vec![1, 4, 7], vec![2, 3]],
        temperature: 1.0,
        share_prefixes: false,
    };
    for tied in [true, false] {
        let p = policy(tied, 19);
        let path = dir.path().join(format!("model-{tied}.safetensors"));
        p.save_safetensors(&path).unwrap();
        let q = Policy::load_safetensors(p.config(), &path, &Device::Cpu).unwrap();
        assert!(q.is_trainable());
        assert_eq!(q.num_params(), p.num_params());
        assert_eq!(score_vec(&p, &batch), score_vec(&q, &batch));
        let names: Vec<String> = q.named_vars().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names.contains(&"lm_head.weight".to_string()), !tied);

        // Missing tensor.
        let mut map: HashMap<String, Tensor> = p.named_tensors().into_iter().collect();
        map.remove("model.layers.1.mlp.up_proj.weight");
        let e = Policy::from_tensors(p.config(), map, "ckpt.safetensors").unwrap_err();
        assert!(matches!(&e, ModelError::MissingTensor { name, file }
            if name == "model.layers.1.mlp.up_proj.weight" && file == "ckpt.safetensors"));
        let msg = e.to_string();
        assert!(
            msg.contains("ckpt.safetensors") && msg.contains("up_proj"),
            "{msg}"
        );

        // Wrong shape (through a file, so the file name is the path).
        let mut map: HashMap<String, Tensor> = p.named_tensors().into_iter().collect();
        map.insert(
            "model.layers.0.self_attn.k_proj.weight".into(),
            Tensor::zeros((32, 32), DType::F32, &Device::Cpu).unwrap(),
        );
        let bad = dir.path().join("bad.safetensors");
        candle_core::safetensors::save(&map, &bad).unwrap();
        let e = Policy::load_safetensors(p.config(), &bad, &Device::Cpu).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(&e, ModelError::Shape { name, expected, got, .. }
                if name == "model.layers.0.self_attn.k_proj.weight"
                    && expected == &vec![16, 32] && got == &vec![32, 32]),
            "{msg}"
        );
        assert!(
            msg.contains("bad.safetensors") && msg.contains("k_proj"),
            "{msg}"
        );
    }
    // Biases (e.g. a Qwen2 checkpoint) are refused, not silently dropped.
    let p = policy(true, 19);
    let mut map: HashMap<String, Tensor> = p.named_tensors().into_iter().collect();
    map.insert(
        "model.layers.0.self_attn.q_proj.bias".into(),
        Tensor::zeros(32, DType::F32, &Device::Cpu).unwrap(),
    );
    let e = Policy::from_tensors(p.config(), map, "qwen.safetensors").unwrap_err();
    assert!(
        matches!(&e, ModelError::UnexpectedTensor { name, .. } if name.ends_with("q_proj.bias")),
        "{e}"
    );

    // Tied checkpoints may carry a redundant lm_head.weight; f16 is upcast.
    let p = policy(true, 19);
    let mut map: HashMap<String, Tensor> = p
        .named_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.to_dtype(DType::F16).unwrap()))
        .collect();
    map.insert(
        "lm_head.weight".into(),
        map["model.embed_tokens.weight"].clone(),
    );
    map.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap(),
    );
    let q = Policy::from_tensors(p.config(), map, "f16").unwrap();
    let (a, _) = score_vec(&p, &batch);
    let (b, _) = score_vec(&q, &batch);
    let a: Vec<f64> = a.into_iter().map(f64::from).collect();
    assert_close(&b, &a, 0.05, "f16 upcast");
    assert!(Policy::load_safetensors(p.config(), &dir.path().join("nope"), &Device::Cpu).is_err());
}

#[test]
fn frozen_copy_is_detached_and_independent() {
    let p = policy(false, 20);
    let f = p.frozen_copy().unwrap();
    assert!(!f.is_trainable() && f.named_vars().is_empty());
    assert_eq!(f.num_params(), p.num_params());
    let batch = ScoreBatch {
        seqs: vec![vec![3, 4, 5, 6, 7]],
        targets: vec![vec![2, 4]],
        temperature: 1.0,
        share_prefixes: false,
    };
    let before = score_vec(&p, &batch);
    assert_eq!(score_vec(&f, &batch), before);
    // The frozen copy's score is not connected to the policy's vars.
    let grads = f
        .score(&batch)
        .unwrap()
        .logp
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (_, v) in p.named_vars() {
        assert!(grads.get(v.as_tensor()).is_none());
    }
    // Updating the policy in place leaves the copy alone.
    for (_, v) in p.named_vars() {
        let t = v.as_tensor().affine(1.1, 0.01).unwrap();
        v.set(&t).unwrap();
    }
    assert_ne!(score_vec(&p, &batch), before);
    assert_eq!(score_vec(&f, &batch), before);
}

#[test]
fn new_random_is_seeded() {
    let a = policy(true, 21);
    let b = policy(true, 21);
    let c = policy(true, 22);
    let flat = |p: &Policy| -> Vec<f32> {
        p.named_tensors()
            .iter()
            .flat_map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };
    assert_eq!(flat(&a), flat(&b));
    assert_ne!(flat(&a), flat(&c));
    let cfg = tiny_cfg(true);
    let h = cfg.hidden_size;
    let expect = cfg.vocab_size * h
        + h
        + 2 * (h * h + 2 * (h / 2) * h + h * h + 3 * h * cfg.intermediate_size + 2 * h);
    assert_eq!(a.num_params(), expect);
    // Norm weights start at one.
    let norm = &a
        .named_tensors()
        .into_iter()
        .find(|(n, _)| n == "model.norm.weight")
        .unwrap()
        .1;
    assert!(norm.to_vec1::<f32>().unwrap().iter().all(|&x| x == 1.0));
}

#[test]
fn policy_new_derives_the_rest_of_the_state_from_its_parts() {
    let p = policy(false, 23);
    p.set_dropout_seed(Some(5));
    let q = Policy::new(PolicyParts {
        cfg: p.config().clone(),
        arch: p.arch().clone(),
        device: p.device().clone(),
        dtype: p.dtype(),
        w: p.weights().clone(),
        vars: p.named_vars(),
        lora: None,
    });
    // The rotary frequencies are the architecture's; dropout and bf16
    // rollout copies start off, whatever the source policy had.
    assert_eq!(q.inv_freq, p.arch().inv_freq(p.config()));
    assert_eq!(q.inv_freq, p.inv_freq);
    assert!(q.dropout_rng().is_none() && !q.rollout_bf16());
    assert!(q.is_trainable() && q.lora().is_none());
    let batch = ScoreBatch {
        seqs: vec![vec![3, 4, 5, 6, 7]],
        targets: vec![vec![2, 4]],
        temperature: 1.0,
        share_prefixes: false,
    };
    assert_eq!(score_vec(&q, &batch), score_vec(&p, &batch));
    // The copies built through it start the same way.
    let f = p.frozen_copy().unwrap();
    assert_eq!(f.inv_freq, p.inv_freq);
    assert!(f.dropout_rng().is_none());
}
