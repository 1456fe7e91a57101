//! Tests of [`super::Policy`]: gradients, scoring against an independent
//! host-side reference forward, generation/score consistency, sampling,
//! constrained decoding and checkpoint I/O.

use super::*;
use rand::SeedableRng;

fn tiny_cfg(tied: bool) -> ModelConfig {
    ModelConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        vocab_size: 50,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: None,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 512,
        tie_word_embeddings: tied,
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        pad_token_id: Some(0),
        // Larger than the HF default so distributions are peaked enough for
        // sampling tests to mean something.
        initializer_range: 0.3,
    }
}

fn policy(tied: bool, seed: u64) -> Policy {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Policy::new_random(&tiny_cfg(tied), &mut rng, &Device::Cpu).unwrap()
}

fn rand_seq(rng: &mut ChaCha8Rng, len: usize, vocab: u32) -> Vec<u32> {
    (0..len).map(|_| rng.random_range(3..vocab)).collect()
}

// ----------------------------------------------------------------------
// Independent reference: a plain f64 host implementation of the HF Llama
// forward, one sequence at a time, written without candle.
// ----------------------------------------------------------------------

struct HostModel {
    cfg: ModelConfig,
    w: HashMap<String, Vec<f64>>,
}

impl HostModel {
    fn new(p: &Policy) -> Self {
        let w = p
            .named_tensors()
            .into_iter()
            .map(|(n, t)| {
                let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                (n, v.into_iter().map(f64::from).collect())
            })
            .collect();
        HostModel {
            cfg: p.config().clone(),
            w,
        }
    }

    fn get(&self, n: &str) -> &[f64] {
        &self.w[n]
    }

    /// `W (out, in) @ x`.
    fn mv(w: &[f64], x: &[f64]) -> Vec<f64> {
        let inn = x.len();
        w.chunks(inn)
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(a, b)| a * r * b).collect()
    }

    fn rope(v: &mut [f64], pos: usize, theta: f64) {
        let hd = v.len();
        let half = hd / 2;
        for i in 0..half {
            let f = 1.0 / theta.powf((2 * i) as f64 / hd as f64);
            let (s, c) = (pos as f64 * f).sin_cos();
            let (a, b) = (v[i], v[i + half]);
            v[i] = a * c - b * s;
            v[i + half] = b * c + a * s;
        }
    }

    /// Logits at every position of `seq`.
    fn logits(&self, seq: &[u32]) -> Vec<Vec<f64>> {
        let c = &self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim());
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let rep = nh / nkv;
        let emb = self.get("model.embed_tokens.weight");
        let mut xs: Vec<Vec<f64>> = seq
            .iter()
            .map(|&t| emb[t as usize * h..(t as usize + 1) * h].to_vec())
            .collect();
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let g = |n: &str| self.get(&format!("{p}.{n}"));
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (t, x) in xs.iter().enumerate() {
                let hn = Self::rms(x, g("input_layernorm.weight"), c.rms_norm_eps);
                let mut q = Self::mv(g("self_attn.q_proj.weight"), &hn);
                let mut k = Self::mv(g("self_attn.k_proj.weight"), &hn);
                for hh in 0..nh {
                    Self::rope(&mut q[hh * hd..(hh + 1) * hd], t, c.rope_theta);
                }
                for hh in 0..nkv {
                    Self::rope(&mut k[hh * hd..(hh + 1) * hd], t, c.rope_theta);
                }
                qs.push(q);
                ks.push(k);
                vs.push(Self::mv(g("self_attn.v_proj.weight"), &hn));
            }
            for t in 0..xs.len() {
                let mut y = vec![0.0; nh * hd];
                for hh in 0..nh {
                    let kvh = hh / rep;
                    let q = &qs[t][hh * hd..(hh + 1) * hd];
                    let sc: Vec<f64> = (0..=t)
                        .map(|j| {
                            let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (j, ej) in e.iter().enumerate() {
                        let v = &vs[j][kvh * hd..(kvh + 1) * hd];
                        for d in 0..hd {
                            y[hh * hd + d] += ej / z * v[d];
                        }
                    }
                }
                let o = Self::mv(g("self_attn.o_proj.weight"), &y);
                for (a, b) in xs[t].iter_mut().zip(o) {
                    *a += b;
                }
                let hn = Self::rms(&xs[t], g("post_attention_layernorm.weight"), c.rms_norm_eps);
                let gt = Self::mv(g("mlp.gate_proj.weight"), &hn);
                let up = Self::mv(g("mlp.up_proj.weight"), &hn);
                let act: Vec<f64> = gt
                    .iter()
                    .zip(&up)
                    .map(|(a, u)| a / (1.0 + (-a).exp()) * u)
                    .collect();
                let d = Self::mv(g("mlp.down_proj.weight"), &act);
                for (a, b) in xs[t].iter_mut().zip(d) {
                    *a += b;
                }
            }
        }
        let head = if c.tie_word_embeddings {
            self.get("model.embed_tokens.weight")
        } else {
            self.get("lm_head.weight")
        };
        xs.iter()
            .map(|x| {
                Self::mv(
                    head,
                    &Self::rms(x, self.get("model.norm.weight"), c.rms_norm_eps),
                )
            })
            .collect()
    }

    fn log_softmax(l: &[f64], temp: f64) -> Vec<f64> {
        let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = l.iter().map(|x| ((x - m) / temp).exp()).sum::<f64>().ln();
        l.iter().map(|x| (x - m) / temp - z).collect()
    }
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

// ----------------------------------------------------------------------

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
    };
    let run = |composite: bool, chunk: Option<usize>| {
        super::ops::FORCE_COMPOSITE.with(|c| c.set(composite));
        CHUNK_BUDGET_OVERRIDE.with(|c| c.set(chunk));
        let out = p.score(&batch).unwrap();
        let loss = (out.logp.sum_all().unwrap() + (out.entropy.sum_all().unwrap() * 0.3).unwrap())
            .unwrap();
        let grads = loss.backward().unwrap();
        super::ops::FORCE_COMPOSITE.with(|c| c.set(false));
        CHUNK_BUDGET_OVERRIDE.with(|c| c.set(None));
        let mut flat: Vec<f32> = out.logp.to_vec1().unwrap();
        flat.extend(out.entropy.to_vec1::<f32>().unwrap());
        for (name, v) in p.named_vars() {
            let g = grads
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("no grad for {name}"));
            flat.extend(g.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
        flat
    };
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
        })
        .unwrap();
    assert_eq!(out.logp.dims(), &[0]);
    for bad in [
        ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![vec![2]],
            temperature: 1.0,
        },
        ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![vec![0]],
            temperature: 1.0,
        },
        ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![vec![1]],
            temperature: 0.0,
        },
        ScoreBatch {
            seqs: vec![vec![3, 99]],
            targets: vec![vec![1]],
            temperature: 1.0,
        },
        ScoreBatch {
            seqs: vec![vec![3, 4]],
            targets: vec![],
            temperature: 1.0,
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
        },
    )
    .0
}

fn prompts_of(lens: &[usize], seed: u64) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    lens.iter().map(|&l| rand_seq(&mut rng, l, 50)).collect()
}

#[test]
fn generation_logprobs_match_score() {
    let prompts = prompts_of(&[3, 9, 1, 14, 6], 8);
    for tied in [true, false] {
        let p = policy(tied, 9);
        for (temp, top_p) in [(1.0, 1.0), (0.8, 0.9), (1.5, 1.0)] {
            let mut rng = ChaCha8Rng::seed_from_u64(10);
            let gens = p
                .generate(&prompts, &opts(7, temp, top_p, false), None, &mut rng)
                .unwrap();
            for g in &gens {
                assert_eq!(g.tokens.len(), g.logprobs.len());
                assert!(!g.tokens.is_empty() && g.tokens.len() <= 7);
                assert_eq!(g.finished, g.tokens.last() == Some(&2));
                if g.finished {
                    assert!(!g.tokens[..g.tokens.len() - 1].contains(&2));
                } else {
                    assert_eq!(g.tokens.len(), 7);
                }
            }
            let got: Vec<f32> = gens.iter().flat_map(|g| g.logprobs.clone()).collect();
            let want: Vec<f64> = rescore(&p, &prompts, &gens, temp)
                .into_iter()
                .map(f64::from)
                .collect();
            assert_close(
                &got,
                &want,
                1e-4,
                &format!("behaviour vs score tied={tied} T={temp}"),
            );
        }
    }
}

#[test]
fn generation_independent_of_batch_and_chunking() {
    let p = policy(false, 11);
    let prompts = prompts_of(&[4, 12, 2, 8, 8, 5], 12);
    let o = opts(6, 1.0, 1.0, true);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let batched = p.generate(&prompts, &o, None, &mut rng).unwrap();
    for (pr, g) in prompts.iter().zip(&batched) {
        let alone = p
            .generate(std::slice::from_ref(pr), &o, None, &mut rng)
            .unwrap();
        assert_eq!(alone[0].tokens, g.tokens);
        let a: Vec<f64> = alone[0].logprobs.iter().map(|&x| x as f64).collect();
        assert_close(&g.logprobs, &a, 1e-5, "alone vs batched logprobs");
    }
    // Force one prefill chunk per sequence: same result.
    CHUNK_BUDGET_OVERRIDE.with(|c| c.set(Some(1)));
    let chunked = p.generate(&prompts, &o, None, &mut rng);
    CHUNK_BUDGET_OVERRIDE.with(|c| c.set(None));
    let chunked = chunked.unwrap();
    for (a, b) in chunked.iter().zip(&batched) {
        assert_eq!(a.tokens, b.tokens);
        let bb: Vec<f64> = b.logprobs.iter().map(|&x| x as f64).collect();
        assert_close(&a.logprobs, &bb, 1e-5, "chunked prefill");
    }
}

#[test]
fn generation_is_deterministic_given_seed() {
    let p = policy(true, 13);
    let prompts = prompts_of(&[5, 3, 10], 14);
    let o = opts(8, 1.0, 0.95, false);
    let run = |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        p.generate(&prompts, &o, None, &mut rng).unwrap()
    };
    assert_eq!(run(1), run(1));
    // Different seeds give different samples somewhere (overwhelmingly likely).
    assert!((2..6).any(|s| run(s) != run(1)));
    let g = opts(8, 1.0, 1.0, true);
    let a = p
        .generate(&prompts, &g, None, &mut ChaCha8Rng::seed_from_u64(1))
        .unwrap();
    let b = p
        .generate(&prompts, &g, None, &mut ChaCha8Rng::seed_from_u64(99))
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn top_p_to_zero_equals_greedy() {
    let p = policy(false, 15);
    let prompts = prompts_of(&[6, 2, 9, 4], 16);
    let greedy = p
        .generate(
            &prompts,
            &opts(8, 1.0, 1.0, true),
            None,
            &mut ChaCha8Rng::seed_from_u64(0),
        )
        .unwrap();
    for seed in 0..5 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let tiny_p = p
            .generate(&prompts, &opts(8, 1.0, 1e-9, false), None, &mut rng)
            .unwrap();
        assert_eq!(tiny_p, greedy);
    }
}

#[test]
fn top_p_samples_exactly_the_nucleus() {
    let mut rng = ChaCha8Rng::seed_from_u64(28);
    for trial in 0..20 {
        let v = 60;
        let logits: Vec<f32> = (0..v).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let top_p = [0.3, 0.6, 0.9, 0.99][trial % 4];
        let temp = [0.7, 1.0, 1.6][trial % 3];
        // Brute-force nucleus.
        let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut pr: Vec<(u32, f64)> = (0..v as u32)
            .map(|i| (i, ((logits[i as usize] as f64 - m) / temp).exp()))
            .collect();
        let total: f64 = pr.iter().map(|p| p.1).sum();
        pr.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut cum = 0.0;
        let mut nucleus = std::collections::HashSet::new();
        for (i, p) in &pr {
            nucleus.insert(*i);
            cum += p;
            if cum >= top_p * total {
                break;
            }
        }
        let sampler = Sampler {
            temperature: temp,
            top_p,
            greedy: false,
            eos: 2,
        };
        let mut seen = std::collections::HashSet::new();
        for _ in 0..400 {
            let (tok, lp) = sampler.pick(&logits, None, &mut rng);
            assert!(nucleus.contains(&tok), "token {tok} outside the nucleus");
            let want = (logits[tok as usize] as f64 - m) / temp - total.ln();
            assert!((lp as f64 - want).abs() < 1e-5);
            seen.insert(tok);
        }
        if nucleus.len() <= 5 {
            assert_eq!(seen, nucleus);
        }
    }
}

#[test]
fn constrained_decoding_only_emits_admissible_actions() {
    let eos = 2u32;
    // "cabinet 1" = [5, 7] is a prefix of "cabinet 10" = [5, 7, 9].
    let action_sets: Vec<Vec<Vec<u32>>> = vec![
        vec![vec![5, 7], vec![5, 7, 9], vec![11]],
        vec![vec![20, 21, 22, 23], vec![20, 21], vec![30, 31, 32]],
        vec![vec![40]],
        vec![vec![5, 7, 9], vec![5, 7], vec![5, 8], vec![6]],
    ];
    let tries: Vec<TokenTrie> = action_sets.iter().map(|a| TokenTrie::new(a, eos)).collect();
    let prompts = prompts_of(&[4, 9, 2, 6], 17);
    let mut seen: Vec<std::collections::HashSet<Vec<u32>>> = vec![Default::default(); 4];
    for seed in 0..3 {
        // Random weights per seed so the unconstrained preferences vary.
        let p = policy(seed % 2 == 0, 100 + seed);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for trial in 0..40 {
            let temp = [1.0, 2.0, 0.5][trial % 3];
            let top_p = [1.0, 0.8][trial % 2];
            let o = opts(6, temp, top_p, trial % 10 == 0);
            let gens = p.generate(&prompts, &o, Some(&tries), &mut rng).unwrap();
            for (i, g) in gens.iter().enumerate() {
                assert!(g.finished, "{g:?}");
                assert_eq!(g.tokens.last(), Some(&eos));
                let action = &g.tokens[..g.tokens.len() - 1];
                assert!(
                    action_sets[i].iter().any(|a| a == action),
                    "prompt {i}: emitted {action:?}"
                );
                seen[i].insert(action.to_vec());
            }
            // Behaviour log-probs stay the unconstrained ones.
            let want: Vec<f64> = rescore(&p, &prompts, &gens, temp)
                .into_iter()
                .map(f64::from)
                .collect();
            let got: Vec<f32> = gens.iter().flat_map(|g| g.logprobs.clone()).collect();
            assert_close(&got, &want, 1e-4, "constrained behaviour logprobs");
        }
    }
    // Sampling at temperature 2 reaches both the short and the long action.
    assert!(
        seen[0].contains(&vec![5, 7]) && seen[0].contains(&vec![5, 7, 9]),
        "{:?}",
        seen[0]
    );
    assert!(seen[1].len() >= 2, "{:?}", seen[1]);

    // The longest prompt finishes first: the remaining batch skips its pad
    // columns; log-probs must still match scoring.
    let p = policy(false, 26);
    let prompts = prompts_of(&[12, 3, 7], 27);
    let tries = [
        TokenTrie::new(&[vec![40]], eos),
        TokenTrie::new(&[vec![5, 6, 7, 8, 9]], eos),
        TokenTrie::new(&[vec![10, 11, 12, 13]], eos),
    ];
    let gens = p
        .generate(
            &prompts,
            &opts(8, 1.0, 1.0, false),
            Some(&tries),
            &mut ChaCha8Rng::seed_from_u64(3),
        )
        .unwrap();
    assert_eq!(gens[0].tokens, vec![40, eos]);
    assert_eq!(gens[1].tokens, vec![5, 6, 7, 8, 9, eos]);
    let want: Vec<f64> = rescore(&p, &prompts, &gens, 1.0)
        .into_iter()
        .map(f64::from)
        .collect();
    let got: Vec<f32> = gens.iter().flat_map(|g| g.logprobs.clone()).collect();
    assert_close(&got, &want, 1e-4, "after the longest prompt finished");

    // Too few new tokens: truncated, not finished; empty trie: eos at once.
    let p = policy(true, 1);
    let short = p
        .generate(
            &prompts[..2],
            &opts(2, 1.0, 1.0, false),
            Some(&[
                TokenTrie::new(&[vec![20, 21, 22, 23]], eos),
                TokenTrie::new(&[], eos),
            ]),
            &mut ChaCha8Rng::seed_from_u64(0),
        )
        .unwrap();
    assert_eq!(short[0].tokens, vec![20, 21]);
    assert!(!short[0].finished);
    assert_eq!(short[1].tokens, vec![eos]);
    assert!(short[1].finished);
}

#[test]
fn generate_argument_checks() {
    let p = policy(true, 1);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    assert!(p
        .generate(&[vec![]], &opts(3, 1.0, 1.0, false), None, &mut rng)
        .is_err());
    assert!(p
        .generate(&[vec![3]], &opts(3, 0.0, 1.0, false), None, &mut rng)
        .is_err());
    assert!(p
        .generate(&[vec![3]], &opts(3, 0.0, 1.0, true), None, &mut rng)
        .is_ok());
    assert!(p
        .generate(&[vec![3]], &opts(3, 1.0, 1.0, false), Some(&[]), &mut rng)
        .is_err());
    assert!(p
        .generate(&[vec![3, 77]], &opts(3, 1.0, 1.0, false), None, &mut rng)
        .is_err());
    let z = p
        .generate(&[vec![3]], &opts(0, 1.0, 1.0, false), None, &mut rng)
        .unwrap();
    assert!(z[0].tokens.is_empty() && !z[0].finished);
    assert!(p
        .generate(&[], &opts(3, 1.0, 1.0, false), None, &mut rng)
        .unwrap()
        .is_empty());
}

#[test]
fn safetensors_roundtrip_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(18);
    let seqs = vec![rand_seq(&mut rng, 8, 50), rand_seq(&mut rng, 4, 50)];
    let batch = ScoreBatch {
        seqs,
        targets: vec![vec![1, 4, 7], vec![2, 3]],
        temperature: 1.0,
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

/// Throughput on the benchmark config. Run with
/// `cargo test --release --lib model::llama::tests::throughput -- --ignored --nocapture`.
/// Set `ACTGUIDE_BENCH_BUDGETS=1,2,4` (units of 2^20 elements) to compare
/// chunk budgets. Prints the best of a few repetitions.
#[test]
#[ignore]
fn throughput() {
    let cfg = ModelConfig {
        vocab_size: 400,
        hidden_size: 128,
        intermediate_size: 384,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        initializer_range: 0.02,
        ..tiny_cfg(true)
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let p = Policy::new_random(&cfg, &mut rng, &Device::Cpu).unwrap();
    let prompts: Vec<Vec<u32>> = (0..64).map(|_| rand_seq(&mut rng, 200, 400)).collect();
    let o = GenerateOptions {
        max_new_tokens: 6,
        temperature: 1.0,
        top_p: 1.0,
        greedy: false,
        // Not emitted by a near-uniform random model often: ~6 tokens each.
        eos_token_id: 399,
    };
    let seqs: Vec<Vec<u32>> = (0..64).map(|_| rand_seq(&mut rng, 200, 400)).collect();
    let budgets: Vec<Option<usize>> = match std::env::var("ACTGUIDE_BENCH_BUDGETS") {
        Ok(v) => v
            .split(',')
            .map(|x| Some(x.trim().parse::<usize>().unwrap() << 20))
            .collect(),
        Err(_) => vec![None],
    };
    let best = |f: &mut dyn FnMut() -> f64| (0..3).map(|_| f()).fold(f64::INFINITY, f64::min);
    // CPU time of this thread (Linux), a load-independent measure of work
    // when run with RAYON_NUM_THREADS=1.
    let cpu = || -> f64 {
        std::fs::read_to_string("/proc/thread-self/schedstat")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
            .map_or(0.0, |ns| ns * 1e-9)
    };
    for budget in budgets {
        CHUNK_BUDGET_OVERRIDE.with(|c| c.set(budget));
        let label = budget.map_or("default".to_string(), |b| format!("{}Mi", b >> 20));
        let mut gcpu = f64::INFINITY;
        let g = best(&mut || {
            let (t0, c0) = (std::time::Instant::now(), cpu());
            let g = p.generate(&prompts, &o, None, &mut rng).unwrap();
            assert!(g.iter().all(|g| !g.tokens.is_empty()));
            gcpu = gcpu.min(cpu() - c0);
            t0.elapsed().as_secs_f64()
        });
        println!(
            "[budget {label}] generate 64 prompts x 200 tokens, 6 new tokens: {g:.3}s (main-thread cpu {gcpu:.3}s)"
        );
        let o30 = GenerateOptions {
            max_new_tokens: 30,
            ..o.clone()
        };
        let g30 = best(&mut || {
            let t0 = std::time::Instant::now();
            p.generate(&prompts, &o30, None, &mut rng).unwrap();
            t0.elapsed().as_secs_f64()
        });
        println!("[budget {label}] generate 64 prompts x 200 tokens, 30 new tokens: {g30:.3}s");
        for (what, targets) in [
            ("all 199 positions", (1..200).collect::<Vec<usize>>()),
            ("last 6 positions", (194..200).collect()),
        ] {
            let batch = ScoreBatch {
                seqs: seqs.clone(),
                targets: vec![targets; 64],
                temperature: 1.0,
            };
            let mut fwd = f64::INFINITY;
            let mut tcpu = f64::INFINITY;
            let total = best(&mut || {
                let (t0, c0) = (std::time::Instant::now(), cpu());
                let out = p.score(&batch).unwrap();
                fwd = fwd.min(t0.elapsed().as_secs_f64());
                let loss = (out.logp.sum_all().unwrap() + out.entropy.sum_all().unwrap()).unwrap();
                let grads = loss.backward().unwrap();
                assert!(grads.get(p.named_vars()[0].1.as_tensor()).is_some());
                tcpu = tcpu.min(cpu() - c0);
                t0.elapsed().as_secs_f64()
            });
            println!(
                "[budget {label}] score 64 x 200 tokens ({what}): forward {fwd:.3}s, forward+backward {total:.3}s (main-thread cpu {tcpu:.3}s)"
            );
        }
    }
    CHUNK_BUDGET_OVERRIDE.with(|c| c.set(None));
}

// ----------------------------------------------------------------------
// LoRA
// ----------------------------------------------------------------------

fn lora_cfg(targets: &[&str], dropout: f64) -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout,
        targets: targets.iter().map(|s| s.to_string()).collect(),
    }
}

const ALL: &[&str] = &[
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
fn lora_policy(tied: bool, targets: &[&str], dropout: f64) -> Policy {
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

fn lora_batch() -> ScoreBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(34);
    ScoreBatch {
        seqs: vec![rand_seq(&mut rng, 9, 50), rand_seq(&mut rng, 6, 50)],
        targets: vec![vec![2, 5, 8], vec![1, 5]],
        temperature: 1.0,
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
    let mut opt = AdamW::new(
        p.named_vars(),
        AdamWParams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    )
    .unwrap();
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
        let grads: Vec<Option<Tensor>> = opt
            .vars()
            .iter()
            .map(|(_, v)| g.get(v.as_tensor()).cloned())
            .collect();
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
