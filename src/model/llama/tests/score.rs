//! Scoring: gradients, fused vs composite kernels, the reference forward,
//! edge cases, and candle-transformers' Llama.

use super::reference::*;
use super::*;

#[test]
fn every_parameter_gets_a_gradient() {
    for tied in [true, false] {
        let p = policy(tied, 1);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let seqs = vec![rand_seq(&mut rng, 9, 50), rand_seq(&mut rng, 5, 50)];
        let batch = ScoreBatch {
            seqs,
            targets: vec![vec![3, 8, 1], vec![4]],
            temperature: 1.0,
            share_prefixes: false,
        };
        let out = p.score(&batch).unwrap();
        let loss = (out.logp.sum_all().unwrap() + out.entropy.sum_all().unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        let vars = p.named_vars();
        let expected = if tied {
            1 + 1 + 2 * 9
        } else {
            1 + 1 + 1 + 2 * 9
        };
        assert_eq!(vars.len(), expected);
        assert!(vars.windows(2).all(|w| w[0].0 < w[1].0), "sorted names");
        assert_eq!(vars.iter().any(|(n, _)| n == "lm_head.weight"), !tied);
        for (name, var) in &vars {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("no grad for {name} (tied={tied})"));
            assert_eq!(g.dims(), var.as_tensor().dims());
            let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(norm > 0.0 && norm.is_finite(), "{name}: grad norm {norm}");
        }
        // The logp part alone also reaches everything.
        let grads = out.logp.sum_all().unwrap().backward().unwrap();
        for (name, var) in &vars {
            assert!(grads.get(var.as_tensor()).is_some(), "{name}");
        }
    }
}

/// Scores `batch` on the composite or fused kernels with the chunk budget
/// `chunk`; returns the log-probs, and them with the entropies and every
/// parameter's gradient of `Σ logp + 0.3 Σ entropy`, flattened.
pub(super) fn scored(
    p: &Policy,
    batch: &ScoreBatch,
    composite: bool,
    chunk: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    super::ops::FORCE_COMPOSITE.with(|c| c.set(composite));
    CHUNK_BUDGET_OVERRIDE.with(|c| c.set(chunk));
    let out = p.score(batch).unwrap();
    let loss =
        (out.logp.sum_all().unwrap() + (out.entropy.sum_all().unwrap() * 0.3).unwrap()).unwrap();
    let grads = loss.backward().unwrap();
    super::ops::FORCE_COMPOSITE.with(|c| c.set(false));
    CHUNK_BUDGET_OVERRIDE.with(|c| c.set(None));
    let logp: Vec<f32> = out.logp.to_vec1().unwrap();
    let mut flat = logp.clone();
    flat.extend(out.entropy.to_vec1::<f32>().unwrap());
    for (name, v) in p.named_vars() {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no grad for {name}"));
        flat.extend(g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    (logp, flat)
}

/// The composite (non-CPU) fallbacks of the fused kernels give the same
/// scores and gradients as the fused CPU kernels, through the whole model,
/// also when the trunk runs in several chunks.
#[test]
fn fused_and_composite_paths_agree() {
    let p = policy(false, 23);
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    let batch = ScoreBatch {
        seqs: vec![
            rand_seq(&mut rng, 9, 50),
            rand_seq(&mut rng, 13, 50),
            rand_seq(&mut rng, 4, 50),
        ],
        targets: vec![vec![3, 8], vec![12, 1, 6], vec![2, 3]],
        temperature: 0.9,
        share_prefixes: false,
    };
    let run = |composite: bool, chunk: Option<usize>| scored(&p, &batch, composite, chunk).1;
    let fused = run(false, None);
    for (composite, chunk) in [(true, None), (false, Some(1)), (true, Some(1))] {
        let other: Vec<f64> = run(composite, chunk).into_iter().map(f64::from).collect();
        assert_close(
            &fused,
            &other,
            2e-4,
            &format!("composite={composite} chunk={chunk:?}"),
        );
    }
    // Generation through the composite path gives the same greedy tokens.
    let prompts = prompts_of(&[5, 9, 2], 25);
    let o = opts(5, 1.0, 1.0, true);
    let a = p.generate(&prompts, &o, None, &mut rng).unwrap();
    super::ops::FORCE_COMPOSITE.with(|c| c.set(true));
    let b = p.generate(&prompts, &o, None, &mut rng);
    super::ops::FORCE_COMPOSITE.with(|c| c.set(false));
    let b = b.unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.tokens, y.tokens);
        let yl: Vec<f64> = y.logprobs.iter().map(|&v| v as f64).collect();
        assert_close(&x.logprobs, &yl, 1e-5, "composite generation");
    }
}

/// Scoring with `share_prefixes` (packed prefix trees) gives the per-
/// sequence scores and gradients, on the fused and composite paths, in one
/// packed row and in several; and matches the host reference forward.
#[test]
fn packed_prefix_scoring_matches_per_sequence_scoring() {
    let p = policy(false, 31);
    let host = HostModel::new(&p);
    let mut rng = ChaCha8Rng::seed_from_u64(32);
    let trunk = rand_seq(&mut rng, 12, 50);
    let with = |n: usize, tail: Vec<u32>| [&trunk[..n], &tail[..]].concat();
    let seqs = vec![
        with(12, rand_seq(&mut rng, 5, 50)),
        rand_seq(&mut rng, 9, 50),
        with(12, rand_seq(&mut rng, 7, 50)),
        with(6, rand_seq(&mut rng, 4, 50)),
        with(12, vec![]),
        with(12, rand_seq(&mut rng, 5, 50)),
    ];
    let mut seqs = seqs;
    // A duplicate of the first sequence, scored at other targets.
    seqs.push(seqs[0].clone());
    let targets = vec![
        vec![16, 13, 3],
        vec![8, 1],
        vec![18, 12, 5, 5],
        vec![9, 7],
        vec![11, 2],
        vec![],
        vec![14, 1],
    ];
    let batch = |share: bool| ScoreBatch {
        seqs: seqs.clone(),
        targets: targets.clone(),
        temperature: 0.8,
        share_prefixes: share,
    };
    let run = |share: bool, composite: bool, chunk: Option<usize>| {
        scored(&p, &batch(share), composite, chunk)
    };
    let mut want_lp = Vec::new();
    for (s, tg) in seqs.iter().zip(&targets) {
        let logits = host.logits(s);
        for &pos in tg {
            want_lp.push(HostModel::log_softmax(&logits[pos - 1], 0.8)[s[pos] as usize]);
        }
    }
    let (_, plain) = run(false, false, None);
    // 128-wide activations: 2560 allows 20 tokens per packed row.
    for (composite, chunk) in [
        (false, None),
        (true, None),
        (false, Some(2560)),
        (true, Some(2560)),
    ] {
        let what = format!("composite={composite} chunk={chunk:?}");
        let (logp, flat) = run(true, composite, chunk);
        assert_close(
            &logp,
            &want_lp,
            1e-5,
            &format!("packed logp vs host, {what}"),
        );
        let plain: Vec<f64> = plain.iter().map(|&v| f64::from(v)).collect();
        assert_close(&flat, &plain, 2e-4, &format!("packed vs plain, {what}"));
    }
}

/// In a large model, packed scoring sends a target that another one in
/// its packed row repeats (the same token after the same prefix) through
/// the LM head once: the log-probs, entropies and gradients of a weighted
/// loss are those of one head row per target.
#[test]
fn repeated_targets_share_a_head_row_with_the_same_scores_and_gradients() {
    let cfg = large_cfg(false);
    let mut rng = ChaCha8Rng::seed_from_u64(41);
    let p = Policy::new_random(&cfg, &mut rng, &Device::Cpu).unwrap();
    assert!(p.is_large());
    let prompt = rand_seq(&mut rng, 10, 50);
    let with = |tail: &[u32]| [&prompt[..], tail].concat();
    let (a, b) = (rand_seq(&mut rng, 4, 50), rand_seq(&mut rng, 5, 50));
    // Copies of one sequence (a group replaying the same expert turn), a
    // sequence branching from it after 12 tokens, one sharing the prompt
    // alone, and one sharing nothing.
    let mut branch = with(&a);
    branch[12] = if branch[12] == 7 { 8 } else { 7 };
    let seqs = vec![
        with(&a),
        with(&a),
        branch,
        with(&b),
        with(&a),
        rand_seq(&mut rng, 8, 50),
    ];
    // Positions 11..14 repeat across the copies; position 12 of the branch
    // shares its predicting row but not its token; 10 is shared by all
    // sequences on the prompt; the copies also repeat a position within
    // one target list.
    let targets = vec![
        vec![10, 11, 12, 13],
        vec![13, 12, 11, 10, 12],
        vec![10, 11, 12, 13],
        vec![10, 11, 14],
        vec![11],
        vec![3, 7],
    ];
    let unique: std::collections::HashSet<Vec<u32>> = seqs
        .iter()
        .zip(&targets)
        .flat_map(|(s, tg)| tg.iter().map(|&t| s[..=t].to_vec()))
        .collect();
    let n: usize = targets.iter().map(Vec::len).sum();
    let wl: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let we: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    let run = |share: bool| {
        let batch = ScoreBatch {
            seqs: seqs.clone(),
            targets: targets.clone(),
            temperature: 0.9,
            share_prefixes: share,
        };
        crate::model::llama::score::HEAD_ROWS_SCORED.with(|c| c.set(0));
        let out = p.score(&batch).unwrap();
        let rows = crate::model::llama::score::HEAD_ROWS_SCORED.with(|c| c.get());
        let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
        let loss = ((&out.logp * t(&wl)).unwrap().sum_all().unwrap()
            + (&out.entropy * t(&we)).unwrap().sum_all().unwrap())
        .unwrap();
        let grads = loss.backward().unwrap();
        let mut flat: Vec<f32> = out.logp.to_vec1().unwrap();
        flat.extend(out.entropy.to_vec1::<f32>().unwrap());
        let mut grad = Vec::new();
        for (name, v) in p.named_vars() {
            let g = grads.get(v.as_tensor());
            let g = g.unwrap_or_else(|| panic!("no grad for {name}"));
            grad.extend(g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        (rows, flat, grad)
    };
    let (plain_rows, plain, plain_grad) = run(false);
    let (shared_rows, shared, shared_grad) = run(true);
    assert_eq!(plain_rows, n);
    assert_eq!(shared_rows, unique.len());
    assert!(shared_rows < n);
    let f64s = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    assert_close(&shared, &f64s(&plain), 1e-4, "shared head rows: scores");
    let scale = plain_grad.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(scale > 0.0);
    assert_close(
        &shared_grad,
        &f64s(&plain_grad),
        1e-3 * f64::from(scale),
        "shared head rows: gradients",
    );
}

#[test]
fn score_matches_reference_forward() {
    for tied in [true, false] {
        let p = policy(tied, 3);
        let host = HostModel::new(&p);
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let seqs: Vec<Vec<u32>> = [7usize, 13, 2, 10]
            .iter()
            .map(|&l| rand_seq(&mut rng, l, 50))
            .collect();
        // Arbitrary order, repeats, a sequence without targets.
        let targets = vec![vec![6, 1, 3], vec![12, 5, 5, 1, 9], vec![1], vec![]];
        for temp in [1.0, 0.7] {
            let batch = ScoreBatch {
                seqs: seqs.clone(),
                targets: targets.clone(),
                temperature: temp,
                share_prefixes: false,
            };
            let (logp, ent) = score_vec(&p, &batch);
            let mut want_lp = Vec::new();
            let mut want_ent = Vec::new();
            for (s, tg) in seqs.iter().zip(&targets) {
                let logits = host.logits(s);
                for &pos in tg {
                    let ls = HostModel::log_softmax(&logits[pos - 1], temp);
                    want_lp.push(ls[s[pos] as usize]);
                    want_ent.push(-ls.iter().map(|l| l.exp() * l).sum::<f64>());
                }
            }
            assert_close(&logp, &want_lp, 1e-5, &format!("logp tied={tied} T={temp}"));
            // One chunk per sequence (sorted by length, output re-ordered).
            CHUNK_BUDGET_OVERRIDE.with(|c| c.set(Some(1)));
            let (logp_c, ent_c) = score_vec(&p, &batch);
            CHUNK_BUDGET_OVERRIDE.with(|c| c.set(None));
            assert_close(&logp_c, &want_lp, 1e-5, "chunked logp");
            assert_close(&ent_c, &want_ent, 1e-5, "chunked entropy");
            assert_close(
                &ent,
                &want_ent,
                1e-5,
                &format!("entropy tied={tied} T={temp}"),
            );
            // Batch composition does not matter: each sequence alone.
            let mut k = 0;
            for (s, tg) in seqs.iter().zip(&targets) {
                let single = ScoreBatch {
                    seqs: vec![s.clone()],
                    targets: vec![tg.clone()],
                    temperature: temp,
                    share_prefixes: false,
                };
                let (lp1, _) = score_vec(&p, &single);
                let want: Vec<f64> = logp[k..k + tg.len()].iter().map(|&x| x as f64).collect();
                assert_close(&lp1, &want, 1e-5, "alone vs batched");
                k += tg.len();
            }
        }
    }
}

#[test]
fn score_edge_cases() {
    let p = policy(true, 5);
    let out = p
        .score(&ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![vec![]],
            temperature: 1.0,
            share_prefixes: false,
        })
        .unwrap();
    assert_eq!(out.logp.dims(), &[0]);
    for bad in [
        ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![vec![2]],
            temperature: 1.0,
            share_prefixes: false,
        },
        ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![vec![0]],
            temperature: 1.0,
            share_prefixes: false,
        },
        ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![vec![1]],
            temperature: 0.0,
            share_prefixes: false,
        },
        ScoreBatch {
            seqs: vec![vec![3, 99]],
            targets: vec![vec![1]],
            temperature: 1.0,
            share_prefixes: false,
        },
        ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![],
            temperature: 1.0,
            share_prefixes: false,
        },
    ] {
        assert!(matches!(p.score(&bad), Err(ModelError::InvalidArgument(_))));
    }
}

/// Cross-check against candle-transformers' Llama (HF conventions for
/// rotary layout, GQA head mapping, tied head).
#[test]
fn matches_candle_transformers_llama() {
    use candle_transformers::models::llama as ct;
    for tied in [true, false] {
        let p = policy(tied, 6);
        let cfg_json = serde_json::to_string(p.config()).unwrap();
        let lc: ct::LlamaConfig = serde_json::from_str(&cfg_json).unwrap();
        let cc = lc.into_config(false);
        let map: HashMap<String, Tensor> = p.named_tensors().into_iter().collect();
        let vb = candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
        let model = ct::Llama::load(vb, &cc).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let seq = rand_seq(&mut rng, 11, 50);
        let targets: Vec<usize> = (1..seq.len()).collect();
        let (logp, _) = score_vec(
            &p,
            &ScoreBatch {
                seqs: vec![seq.clone()],
                targets: vec![targets.clone()],
                temperature: 1.0,
                share_prefixes: false,
            },
        );
        let mut want = Vec::new();
        for &pos in &targets {
            let mut cache = ct::Cache::new(false, DType::F32, &cc, &Device::Cpu).unwrap();
            let x = Tensor::new(&seq[..pos], &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let l: Vec<f32> = model
                .forward(&x, 0, &mut cache)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1()
                .unwrap();
            let l: Vec<f64> = l.into_iter().map(f64::from).collect();
            want.push(HostModel::log_softmax(&l, 1.0)[seq[pos] as usize]);
        }
        assert_close(
            &logp,
            &want,
            1e-4,
            &format!("vs candle-transformers tied={tied}"),
        );
    }
}
