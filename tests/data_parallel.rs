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
                tis: Vec::new(),
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
    (weights(&p), stats)
}

fn weights(p: &Policy) -> Vec<Vec<f32>> {
    p.named_vars()
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
    let init = weights(&policy());
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

// ---------------------------------------------------------------------------
// Whole runs: `--devices cpu,cpu`, rank 1 a separate `actguide dp-worker`
// process.

mod runs {
    use std::path::{Path, PathBuf};

    use actguide::experiment::{self, Experiment, RunError, RunOptions};
    use actguide::model::device::DeviceSpec;
    use serde_json::Value;

    fn experiment(runs: &Path, name: &str) -> Experiment {
        let r = Path::new(env!("CARGO_MANIFEST_DIR"));
        let src = format!(
            r#"#{{
                name: "{name}", seed: 3, steps: 3, runs_dir: "{runs}",
                model: #{{ path: "{r}/models/tiny" }},
                env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 6 }},
                guidance: #{{ script: "{r}/scripts/guidance/gaussian.rhai", clusters: 3 }},
                rollout: #{{ tasks_per_step: 4, group_size: 3 }},
                trainer: #{{ micro_batch: 8, aux_nll_coef: 0.5 }},
                evaluation: #{{ every: 3, max_tasks: 6, samples: 2 }},
                checkpoint: #{{ every: 1 }},
            }}"#,
            runs = runs.display(),
            r = r.display()
        );
        Experiment::from_source("dp.rhai", &src).unwrap()
    }

    fn two_cpus() -> RunOptions {
        RunOptions {
            devices: vec![DeviceSpec::Cpu, DeviceSpec::Cpu],
            worker_program: Some(PathBuf::from(env!("CARGO_BIN_EXE_actguide"))),
            ..Default::default()
        }
    }

    /// The metrics lines without their clocks.
    fn metrics(dir: &Path) -> Vec<Value> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let mut v: Value = serde_json::from_str(l).unwrap();
                let m = v.as_object_mut().unwrap();
                m.remove("time");
                m.retain(|k, _| !k.ends_with("tokens_per_s"));
                v
            })
            .collect()
    }

    #[test]
    fn a_two_process_run_is_deterministic_and_resumes_exactly() {
        let tmp = tempfile::tempdir().unwrap();
        let a = experiment::run(experiment(tmp.path(), "a"), &two_cpus(), &mut |_| {}).unwrap();
        let b = experiment::run(experiment(tmp.path(), "b"), &two_cpus(), &mut |_| {}).unwrap();
        let (ma, mb) = (metrics(&a.run_dir), metrics(&b.run_dir));
        assert_eq!(ma.len(), 3);
        assert_eq!(ma, mb, "same seed, same devices, same numbers");
        // Both ranks rolled out: the step's 4 task groups × 3 episodes.
        assert!(ma.iter().all(|m| m["episodes"] == 12), "{ma:?}");
        // Stopped after 1 step, then resumed on two ranks again.
        let stop = RunOptions {
            stop_after: Some(1),
            ..two_cpus()
        };
        let c = experiment::run(experiment(tmp.path(), "c"), &stop, &mut |_| {}).unwrap();
        let resume = RunOptions {
            resume: Some(c.run_dir.clone()),
            ..two_cpus()
        };
        experiment::run(experiment(tmp.path(), "c"), &resume, &mut |_| {}).unwrap();
        assert_eq!(metrics(&c.run_dir), ma, "resume continues exactly");
        // One process: other random streams, the same kind of run.
        let one = experiment::run(
            experiment(tmp.path(), "one"),
            &RunOptions::default(),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(metrics(&one.run_dir).len(), 3);
    }

    /// The pid of the process whose command line mentions `needle`.
    fn pid_of(needle: &str) -> Option<String> {
        std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (cmd.contains("dp-worker") && cmd.contains(needle))
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
    }

    #[test]
    fn a_rank_that_dies_fails_the_run_with_its_rank_named() {
        let tmp = tempfile::tempdir().unwrap();
        let needle = tmp.path().display().to_string();
        let mut killed = false;
        let e = experiment::run(experiment(tmp.path(), "k"), &two_cpus(), &mut |ev| {
            if let experiment::Event::Step { step: 0, .. } = ev {
                let pid = pid_of(&needle).expect("rank 1 runs");
                std::process::Command::new("sh")
                    .args(["-c", &format!("kill -9 {pid}")])
                    .status()
                    .unwrap();
                killed = true;
            }
        })
        .unwrap_err();
        assert!(killed);
        let msg = e.to_string();
        assert!(matches!(e, RunError::Collective(_)), "{msg}");
        assert!(msg.contains("rank 1 (did it stop?)"), "{msg}");
        // The last checkpoint (step 1) stays, to resume from.
        assert!(tmp.path().join("k/checkpoints/step-000001").is_dir());
        // A worker program that cannot serve is noticed before any step.
        let bad = RunOptions {
            worker_program: Some(PathBuf::from("/bin/false")),
            ..two_cpus()
        };
        let e = experiment::run(experiment(tmp.path(), "f"), &bad, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1 exited before joining"), "{e}");
    }
}
