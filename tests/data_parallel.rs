//! Data-parallel training on the CPU: ranks on threads of this process,
//! joined over loopback TCP, each scoring its share of the micro-batches.
//! The ranks must end bit-identical to each other and equal (up to the
//! order of float sums) to one process training on the whole batch.

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use actguide::distributed::{Collective, TcpGroup};
use actguide::model::{ModelConfig, Policy};
use actguide::seed;
use actguide::train::{Sample, TrainStats, Trainer, TrainerSection};
use candle_core::Device;
use rand::Rng;

fn policy() -> Policy {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let cfg = ModelConfig::from_file(&root.join("models/tiny/config.json")).unwrap();
    Policy::new_random(&cfg, &mut seed::rng(3, &[1]), &Device::Cpu).unwrap()
}

/// Seven policy samples of different lengths and advantages, one aux.
fn samples(vocab: u32) -> Vec<Sample> {
    let mut rng = seed::rng(9, &[2]);
    (0..7)
        .map(|i| {
            let len = 6 + i * 3;
            let seq: Vec<u32> = (0..len).map(|_| rng.random_range(4..vocab)).collect();
            let targets: Vec<usize> = (len - 3..len).collect();
            Sample {
                seq,
                old_logp: if i == 6 { vec![] } else { vec![-3.0; 3] },
                targets,
                advantage: if i % 2 == 0 { 1.0 } else { -0.5 },
                episode: i / 2,
                aux: i == 6,
                aux_weight: 1.0,
                off_policy: false,
                forced: false,
                weight: 1.0,
            }
        })
        .collect()
}

fn settings() -> TrainerSection {
    TrainerSection {
        micro_batch: 2,
        minibatches: 2,
        aux_nll_coef: 0.5,
        ..TrainerSection::default()
    }
}

/// Two optimiser steps (two minibatches) on `coll`'s share; the weights.
fn train(coll: Option<Arc<dyn Collective>>) -> (Vec<Vec<f32>>, TrainStats) {
    let p = policy();
    let mut t = Trainer::new(&p, None, &settings(), 4, 1.0).unwrap();
    if let Some(c) = coll {
        t = t.with_collective(c);
    }
    let s = samples(p.config().vocab_size as u32);
    let mut rng = seed::rng(5, &[3]);
    let stats = t.step(&p, &s, 0, &mut rng).unwrap();
    let w = p
        .named_vars()
        .iter()
        .map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect();
    (w, stats)
}

#[test]
fn two_ranks_take_the_step_one_process_takes() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = Duration::from_secs(60);
    let worker = std::thread::spawn(move || {
        let g: Arc<dyn Collective> = Arc::new(TcpGroup::connect(&addr, 1, 2, t).unwrap());
        train(Some(g))
    });
    let g: Arc<dyn Collective> = Arc::new(TcpGroup::host(l, 2, t).unwrap());
    let (w0, s0) = train(Some(g));
    let (w1, s1) = worker.join().unwrap();
    let (w, s) = train(None);
    assert_eq!(w0, w1, "the ranks' weights are bit-identical");
    let untimed = |s: &TrainStats| TrainStats {
        seconds: 0.0,
        ..s.clone()
    };
    assert_eq!(
        untimed(&s0),
        untimed(&s1),
        "the ranks report the same metrics"
    );
    assert_eq!(
        (s0.policy_tokens, s0.aux_tokens, s0.train_tokens),
        (s.policy_tokens, s.aux_tokens, s.train_tokens),
        "every token trained once, over both ranks"
    );
    for (name, a, b) in [
        ("pg_loss", s0.pg_loss, s.pg_loss),
        ("aux_loss", s0.aux_loss, s.aux_loss),
        ("entropy", s0.entropy, s.entropy),
        ("grad_norm", s0.grad_norm, s.grad_norm),
    ] {
        assert!(
            (a - b).abs() <= 1e-4 * b.abs().max(1.0),
            "{name}: {a} vs {b}"
        );
    }
    let init = train_free_weights();
    let mut moved = 0usize;
    for ((a, b), i) in w0
        .iter()
        .flatten()
        .zip(w.iter().flatten())
        .zip(init.iter().flatten())
    {
        assert!((a - b).abs() <= 1e-5 + 1e-4 * b.abs(), "{a} vs {b}");
        moved += usize::from(b != i);
    }
    assert!(moved > 1000, "the step changed the weights ({moved})");
}

fn train_free_weights() -> Vec<Vec<f32>> {
    policy()
        .named_vars()
        .iter()
        .map(|(_, v)| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        })
        .collect()
}
