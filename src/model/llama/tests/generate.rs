//! Generation: log-probs vs scoring, batching/chunking independence,
//! determinism, top-p, constrained decoding, argument checks.

use super::*;

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
fn generation_ends_where_the_stop_check_says_so() {
    let p = policy(false, 21);
    let prompts = prompts_of(&[5, 9], 4);
    let o = opts(12, 1.0, 1.0, true);
    let full = p
        .generate(&prompts, &o, None, &mut ChaCha8Rng::seed_from_u64(0))
        .unwrap();
    // Asked before the prefill and after each sampled token: the fourth
    // check stops after three tokens, the ones the full run starts with.
    let mut checks = 0;
    let cut = p
        .generate_until(
            &prompts,
            &o,
            None,
            &mut ChaCha8Rng::seed_from_u64(0),
            &mut || {
                checks += 1;
                checks == 4
            },
        )
        .unwrap();
    assert_eq!(checks, 4);
    for (c, f) in cut.iter().zip(&full) {
        let n = f.tokens.len().min(3);
        assert_eq!(c.tokens, f.tokens[..n]);
        assert_eq!(c.finished, f.finished && f.tokens.len() <= 3);
    }
    // A stop before the prefill computes nothing.
    let none = p
        .generate_until(
            &prompts,
            &o,
            None,
            &mut ChaCha8Rng::seed_from_u64(0),
            &mut || true,
        )
        .unwrap();
    assert!(none.iter().all(|g| g.tokens.is_empty() && !g.finished));
}

#[test]
fn prompts_sharing_prefixes_are_prefilled_once_and_decode_as_if_alone() {
    let cfg = large_cfg(true);
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let p = Policy::new_random(&cfg, &mut rng, &Device::Cpu).unwrap();
    assert!(p.is_large());
    let base = prompts_of(&[7, 4, 9, 5], 21);
    let with = |a: &[u32], b: &[u32]| [a, b].concat();
    // Equal prompts, prompts sharing a prefix of several lengths, one
    // prompt the prefix of another, and one sharing nothing.
    let prompts = vec![
        base[0].clone(),
        with(&base[0], &base[1]),
        base[0].clone(),
        base[2].clone(),
        with(&base[0], &base[3]),
        with(&with(&base[0], &base[1]), &base[3]),
        base[1].clone(),
    ];
    let o = opts(5, 1.0, 1.0, true);
    let batched = p.generate(&prompts, &o, None, &mut rng).unwrap();
    // Against the training path (no cache, no packing): the log-probs of
    // the generated tokens, so a wrong cache cannot pass as consistent.
    let flat: Vec<f64> = batched
        .iter()
        .flat_map(|g| g.logprobs.iter().map(|&x| x as f64))
        .collect();
    let scored = rescore(&p, &prompts, &batched, 1.0);
    assert_close(&scored, &flat, 1e-4, "shared prefill vs scoring");
    for (pr, g) in prompts.iter().zip(&batched) {
        let alone = p
            .generate(std::slice::from_ref(pr), &o, None, &mut rng)
            .unwrap();
        assert_eq!(alone[0].tokens, g.tokens);
        assert_eq!(g.tokens.len(), 5);
        let a: Vec<f64> = alone[0].logprobs.iter().map(|&x| x as f64).collect();
        assert_close(&g.logprobs, &a, 1e-4, "alone vs shared prefill");
    }
    // Chunked: packed rows of at most 12 tokens (the budget over the
    // widest activation, the fused gate/up) split the trie.
    CHUNK_BUDGET_OVERRIDE.with(|c| c.set(Some(12 * 2 * cfg.intermediate_size)));
    let small = p.generate(&prompts, &o, None, &mut ChaCha8Rng::seed_from_u64(9));
    CHUNK_BUDGET_OVERRIDE.with(|c| c.set(None));
    let small = small.unwrap();
    let whole = p
        .generate(&prompts, &o, None, &mut ChaCha8Rng::seed_from_u64(9))
        .unwrap();
    for (a, b) in small.iter().zip(&whole) {
        assert_eq!(a.tokens, b.tokens);
        let b: Vec<f64> = b.logprobs.iter().map(|&x| x as f64).collect();
        assert_close(&a.logprobs, &b, 1e-4, "chunked vs whole shared prefill");
    }
}
