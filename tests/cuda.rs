//! CUDA end to end (built with `--features cuda`, run on a machine with an
//! NVIDIA GPU: `cargo test --release --features cuda --test cuda --
//! --include-ignored`, as `scripts/gpu-check.sh` does). Without the
//! feature this file compiles to nothing; without a GPU its tests are
//! ignored, so CI (no GPU) passes while `cargo check --features cuda`
//! keeps them compiling.
#![cfg(feature = "cuda")]

use std::path::PathBuf;

use actguide::dev::device_check;
use actguide::experiment::{self, eval, Experiment, RunOptions};
use actguide::model::device::DeviceSpec;
use actguide::model::Precision;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_computes_what_the_cpu_does_and_trains() {
    let r = device_check::run(DeviceSpec::Cuda(0)).unwrap();
    println!("{r}");
    assert!(r.passed(), "{r}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_run_on_cuda_trains_in_bf16_and_loads_back_there() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root().display().to_string();
    let src = format!(
        r#"#{{
            name: "cuda", seed: 2, steps: 3, runs_dir: "{runs}",
            model: #{{ path: "{r}/models/tiny", device: "cuda" }},
            env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 6 }},
            guidance: #{{ script: "{r}/scripts/guidance/gaussian.rhai", clusters: 3 }},
            rollout: #{{ tasks_per_step: 4, group_size: 4 }},
            trainer: #{{ lr: 0.01, kl_coef: 0.01 }},
            evaluation: #{{ every: 3, max_tasks: 4 }},
            checkpoint: #{{ every: 3 }},
        }}"#,
        runs = tmp.path().display(),
    );
    let exp = Experiment::from_source("cuda.rhai", &src).unwrap();
    assert_eq!(
        exp.model.precision(),
        Precision::Bf16,
        "bf16 is CUDA's default"
    );
    let s = experiment::run(exp, &RunOptions::default(), &mut |_| {}).unwrap();
    assert_eq!(s.steps_done, 3);
    let m = eval::load_run(&s.run_dir, None).unwrap();
    assert!(m.trained.device().is_cuda());
    assert_eq!(m.trained.precision(), Precision::Bf16);
    // The same checkpoint on the CPU (eval --device cpu).
    let c = eval::load_run(&s.run_dir, Some(DeviceSpec::Cpu)).unwrap();
    assert!(c.trained.device().is_cpu());
}
