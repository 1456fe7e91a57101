//! Throughput benchmark (ignored by default).

use super::*;

/// Throughput on the benchmark config. Run with
/// `cargo test --release --lib model::llama::tests::bench::throughput -- --ignored --nocapture`.
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
                share_prefixes: false,
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
