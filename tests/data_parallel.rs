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

/// `world` ranks on threads, `per_node` to a node (node 0 hosts rank
/// 0; the others join as ranks of later nodes): every rank's weights and
/// metrics after the step.
fn train_on_ranks(world: usize, per_node: usize) -> Vec<(Vec<Vec<f32>>, TrainStats)> {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = Duration::from_secs(60);
    let workers: Vec<_> = (1..world)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let g = TcpGroup::connect(&addr, r, world, r / per_node, t).unwrap();
                train(Some(Arc::new(g)))
            })
        })
        .collect();
    let nodes = (world > per_node).then_some(per_node);
    let g = TcpGroup::host_watching(l, world, nodes, t, &mut || None).unwrap();
    let mut out = vec![train(Some(Arc::new(g)))];
    out.extend(workers.into_iter().map(|w| w.join().unwrap()));
    out
}

#[test]
fn two_ranks_take_the_step_one_process_takes() {
    let ranks = train_on_ranks(2, 2);
    same_step_as_one_process(&ranks);
}

#[test]
fn two_nodes_of_two_ranks_take_the_step_one_process_takes() {
    let ranks = train_on_ranks(4, 2);
    same_step_as_one_process(&ranks);
}

fn same_step_as_one_process(ranks: &[(Vec<Vec<f32>>, TrainStats)]) {
    let (w0, s0) = &ranks[0];
    let (w, s) = train(None);
    let untimed = |s: &TrainStats| TrainStats {
        seconds: 0.0,
        ..s.clone()
    };
    for (r, (wr, sr)) in ranks.iter().enumerate().skip(1) {
        assert_eq!(w0, wr, "rank {r}'s weights are bit-identical to rank 0's");
        assert_eq!(
            untimed(s0),
            untimed(sr),
            "rank {r} reports the same metrics"
        );
    }
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
    let mut worst = 0f32;
    for ((a, b), i) in w0
        .iter()
        .flatten()
        .zip(w.iter().flatten())
        .zip(init.iter().flatten())
    {
        worst = worst.max((a - b).abs());
        moved += usize::from(b != i);
    }
    assert!(
        worst <= 1e-5,
        "a weight differs by {worst} from one process's"
    );
    assert!(moved > 1000, "the step changed the weights ({moved})");
}

// ---------------------------------------------------------------------------
// Whole runs: `--devices cpu,cpu`, rank 1 a separate `actguide dp-worker`
// process; and two nodes of two ranks, node 1 a separate `actguide run
// --node-rank 1` in its own process group.

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
        let mut needle = String::new();
        let mut killed = false;
        let e = experiment::run(experiment(tmp.path(), "k"), &two_cpus(), &mut |ev| {
            // The run names where its ranks joined; rank 1 was told that.
            if let experiment::Event::Log(l) = &ev {
                if let Some(at) = l.split("(rendezvous ").nth(1) {
                    needle = format!("--rendezvous {}", at.trim_end_matches(')'));
                }
            }
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

    /// A free loopback port (bound and released: another process could
    /// take it in between, which the tests would report as a failed join).
    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Node 1 of 2 with two CPU ranks, in its own process group, joining
    /// rank 0 at `port`; it reads nothing but its flags.
    fn node_one(port: u16) -> std::process::Child {
        use std::os::unix::process::CommandExt;
        std::process::Command::new(env!("CARGO_BIN_EXE_actguide"))
            .args([
                "run",
                "--nodes",
                "2",
                "--node-rank",
                "1",
                "--devices",
                "cpu,cpu",
            ])
            .args(["--rendezvous", &format!("127.0.0.1:{port}")])
            .args(["--join-timeout", "60"])
            .process_group(0)
            .spawn()
            .unwrap()
    }

    /// Node 0 of 2 with two CPU ranks, listening at `port`.
    fn node_zero(port: u16) -> RunOptions {
        RunOptions {
            launch: Some(actguide::distributed::launch::Launch {
                nodes: 2,
                node: 0,
                rendezvous: format!("127.0.0.1:{port}"),
                local_rank: None,
                source: actguide::distributed::launch::LaunchSource::Flags,
            }),
            join_timeout: Some(std::time::Duration::from_secs(60)),
            ..two_cpus()
        }
    }

    /// A run over two nodes, node 1 started beside it.
    fn two_nodes(exp: Experiment, opts: RunOptions) -> experiment::RunSummary {
        let port = free_port();
        let mut node = node_one(port);
        let opts = RunOptions {
            launch: node_zero(port).launch,
            join_timeout: node_zero(port).join_timeout,
            ..opts
        };
        let r = experiment::run(exp, &opts, &mut |_| {}).unwrap();
        let status = node.wait().unwrap();
        assert!(status.success(), "node 1 ended with {status}");
        r
    }

    /// Every checkpoint's `ranks.json`: the four ranks' weight digests.
    fn digests(run: &Path) -> Vec<Vec<(u64, String)>> {
        let mut dirs: Vec<_> = std::fs::read_dir(run.join("checkpoints"))
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        dirs.sort();
        dirs.iter()
            .map(|d| {
                let v: Value = serde_json::from_str(
                    &std::fs::read_to_string(d.join(experiment::RANKS_FILE)).unwrap(),
                )
                .unwrap();
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|r| {
                        (
                            r["node"].as_u64().unwrap(),
                            r["weights_sha256"].as_str().unwrap().to_string(),
                        )
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn two_nodes_train_in_step_resume_exactly_and_on_one_node() {
        let tmp = tempfile::tempdir().unwrap();
        let a = two_nodes(experiment(tmp.path(), "a"), two_cpus());
        let ma = metrics(&a.run_dir);
        assert_eq!(ma.len(), 3);
        assert!(ma.iter().all(|m| m["episodes"] == 12), "{ma:?}");
        let d = digests(&a.run_dir);
        assert_eq!(d.len(), 3, "a checkpoint per step");
        for ck in &d {
            let nodes: Vec<u64> = ck.iter().map(|(n, _)| *n).collect();
            assert_eq!(nodes, [0, 0, 1, 1], "two ranks on each node");
            assert!(
                ck.iter().all(|(_, h)| *h == ck[0].1),
                "ranks in step: {ck:?}"
            );
        }
        assert_ne!(d[0][0].1, d[2][0].1, "the weights moved");
        // Same seed, same layout, same numbers.
        let b = two_nodes(experiment(tmp.path(), "b"), two_cpus());
        assert_eq!(metrics(&b.run_dir), ma);
        // Stopped after a step, resumed on two nodes: node 1's ranks take
        // the checkpoint over the rendezvous, and the run continues exactly.
        let stop = RunOptions {
            stop_after: Some(1),
            ..two_cpus()
        };
        let c = two_nodes(experiment(tmp.path(), "c"), stop);
        let resume = RunOptions {
            resume: Some(c.run_dir.clone()),
            ..two_cpus()
        };
        two_nodes(experiment(tmp.path(), "c"), resume);
        assert_eq!(metrics(&c.run_dir), ma, "resume continues exactly");
        assert_eq!(digests(&c.run_dir), d);
        // Resumed on one node, one process: it goes on to the end.
        let e = two_nodes(
            experiment(tmp.path(), "e"),
            RunOptions {
                stop_after: Some(1),
                ..two_cpus()
            },
        );
        let one = RunOptions {
            resume: Some(e.run_dir.clone()),
            ..Default::default()
        };
        let done = experiment::run(experiment(tmp.path(), "e"), &one, &mut |_| {}).unwrap();
        assert_eq!(done.steps_done, 3);
        assert_eq!(metrics(&e.run_dir)[0], ma[0]);
    }

    #[test]
    fn a_node_that_dies_or_never_comes_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut node = node_one(port);
        let pid = node.id() as i32;
        let mut exp = experiment(tmp.path(), "k");
        exp.steps = 30;
        let mut killed = false;
        let e = experiment::run(exp, &node_zero(port), &mut |ev| {
            if let experiment::Event::Step { step: 1, .. } = ev {
                // The whole node: its first process and its dp-worker.
                std::process::Command::new("sh")
                    .args(["-c", &format!("kill -9 -{pid}")])
                    .status()
                    .unwrap();
                killed = true;
            }
        })
        .unwrap_err();
        let _ = node.wait();
        assert!(killed);
        let msg = e.to_string();
        assert!(msg.contains("on node 1 (did it stop?)"), "{msg}");
        assert!(tmp.path().join("k/checkpoints/step-000002").is_dir());
        // A node that never joins: its ranks and node are named.
        let lonely = RunOptions {
            join_timeout: Some(std::time::Duration::from_secs(2)),
            ..node_zero(free_port())
        };
        let e = experiment::run(experiment(tmp.path(), "w"), &lonely, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ranks [2, 3] (of nodes [1]) did not join within 2 s"),
            "{e}"
        );
        // A node whose rendezvous does not answer says so.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_actguide"))
            .args([
                "run",
                "--nodes",
                "2",
                "--node-rank",
                "1",
                "--join-timeout",
                "1",
            ])
            .args(["--rendezvous", &format!("127.0.0.1:{}", free_port())])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("node 1 cannot reach rank 0 at 127.0.0.1:") && err.contains("within 1 s"),
            "{err}"
        );
    }
}

/// A batch without signal (every advantage 0, no aux tokens) after one
/// with signal: AdamW moves the weights on its momentum alone, unless
/// `trainer.skip_zero_grad` skips the step.
#[test]
fn a_zero_gradient_moves_adamw_unless_skipped() {
    for skip in [false, true] {
        let p = policy();
        let cfg = TrainerSection {
            skip_zero_grad: skip,
            ..settings()
        };
        let mut t = Trainer::new(&p, None, &cfg, 4, 1.0).unwrap();
        let s = samples(p.config().vocab_size as u32);
        let mut rng = seed::rng(5, &[3]);
        t.step(&p, &s, 0, &mut rng).unwrap();
        let before = weights(&p);
        let silent: Vec<Sample> = s
            .iter()
            .filter(|x| !x.aux)
            .map(|x| Sample {
                advantage: 0.0,
                ..x.clone()
            })
            .collect();
        let st = t.step(&p, &silent, 1, &mut rng).unwrap();
        assert_eq!(st.grad_norm, 0.0);
        if skip {
            assert_eq!(st.skipped_updates, 2, "both minibatches");
            assert_eq!(weights(&p), before);
        } else {
            assert_eq!(st.skipped_updates, 0);
            assert_ne!(weights(&p), before, "momentum moves the weights");
        }
    }
}
