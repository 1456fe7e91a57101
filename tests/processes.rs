//! The binary under real process conditions: two starts of one experiment
//! at the same moment, a live run's directory, and SIGINT mid-run.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_actguide");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A small experiment file in `dir` named `name`, `steps` steps long.
fn write_experiment(dir: &Path, name: &str, steps: usize) -> PathBuf {
    let r = root();
    let src = format!(
        r#"#{{
            name: "{name}", seed: 5, steps: {steps}, runs_dir: "{runs}",
            model: #{{ path: "{r}/models/tiny" }},
            env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 4 }},
            guidance: #{{ script: "{r}/scripts/guidance/gaussian.rhai" }},
            rollout: #{{ tasks_per_step: 2, group_size: 2 }},
            evaluation: #{{ every: 0, max_tasks: 2 }},
            checkpoint: #{{ every: 0 }},
        }}"#,
        runs = dir.join("runs").display(),
        r = r.display(),
    );
    let p = dir.join(format!("{name}.rhai"));
    std::fs::write(&p, src).unwrap();
    p
}

fn lines(p: &Path) -> usize {
    std::fs::read_to_string(p).map_or(0, |t| t.lines().count())
}

#[test]
fn two_starts_at_once_get_their_own_directories() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = write_experiment(tmp.path(), "twin", 2);
    let spawn = || {
        Command::new(BIN)
            .args(["run", exp.to_str().unwrap(), "--plain"])
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    for child in [a, b] {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let runs = tmp.path().join("runs");
    for d in ["twin", "twin-2"] {
        // Each run wrote its own two steps, in order.
        let m = std::fs::read_to_string(runs.join(d).join("metrics.jsonl")).unwrap();
        let steps: Vec<u64> = m
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(steps, [0, 1], "{d}");
    }
    assert!(!runs.join("twin-3").exists());
}

#[test]
fn a_name_that_leaves_the_runs_folder_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = write_experiment(tmp.path(), "esc", 1);
    let src = std::fs::read_to_string(&exp)
        .unwrap()
        .replace("name: \"esc\"", "name: \"../../outside\"");
    std::fs::write(&exp, src).unwrap();
    let out = Command::new(BIN)
        .args(["run", exp.to_str().unwrap()])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("name must be a plain directory name"), "{err}");
    assert!(!tmp.path().join("outside").exists());
}

#[test]
fn sigint_ends_the_step_and_writes_a_checkpoint_and_a_live_run_refuses_a_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let exp = write_experiment(tmp.path(), "sig", 200);
    let run_dir = tmp.path().join("runs").join("sig");
    let child = Command::new(BIN)
        .args(["run", exp.to_str().unwrap(), "--plain"])
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first step line, then interrupt.
    let t0 = Instant::now();
    while lines(&run_dir.join("metrics.jsonl")) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(300), "no step in 300 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    // A resume of the live run is refused.
    let busy = Command::new(BIN)
        .args(["run", "--resume", run_dir.to_str().unwrap()])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(!busy.status.success());
    let err = String::from_utf8_lossy(&busy.stderr);
    assert!(err.contains("in use by another actguide process"), "{err}");
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Stopped early with its checkpoint: 130, as for any interrupted
    // command, not the 0 of a finished run.
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("interrupted: stopped after step"),
        "{stderr}"
    );
    assert!(
        stdout.contains("(interrupted; resume with --resume)"),
        "{stdout}"
    );
    let done = lines(&run_dir.join("metrics.jsonl"));
    assert!((1..200).contains(&done), "{done}");
    let latest = std::fs::read_to_string(run_dir.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), format!("step-{done:06}"));
}

/// The metrics lines of a run, `time` blocks removed.
fn metrics_without_time(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("time");
            v
        })
        .collect()
}

#[test]
fn sigkill_at_any_moment_then_resume_equals_an_uninterrupted_run() {
    let tmp = tempfile::tempdir().unwrap();
    let steps = 10;
    let with_checkpoints = |name: &str| {
        let p = write_experiment(tmp.path(), name, steps);
        let src = std::fs::read_to_string(&p)
            .unwrap()
            .replace("checkpoint: #{ every: 0 }", "checkpoint: #{ every: 1 }");
        std::fs::write(&p, src).unwrap();
        p
    };
    let full = with_checkpoints("whole");
    let out = Command::new(BIN)
        .args(["run", full.to_str().unwrap(), "--plain"])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let want = metrics_without_time(&tmp.path().join("runs/whole"));
    assert_eq!(want.len(), steps);

    let exp = with_checkpoints("killed");
    let dir = tmp.path().join("runs/killed");
    // Kill delays from a fixed list: early (setup, first checkpoint) to
    // mid-step; the last attempt runs to the end.
    let delays_ms = [120u64, 450, 250, 700, 350, 900, 200, 600, 300, 800];
    let mut kills = 0;
    for attempt in 0..=delays_ms.len() {
        let resumable = dir.join("checkpoints/latest").is_file();
        if !resumable && dir.exists() {
            // Killed before its first checkpoint: start over.
            std::fs::remove_dir_all(&dir).unwrap();
        }
        let mut cmd = Command::new(BIN);
        if resumable {
            cmd.args(["run", "--resume", dir.to_str().unwrap(), "--plain"]);
        } else {
            cmd.args(["run", exp.to_str().unwrap(), "--plain"]);
        }
        let mut child = cmd
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        match delays_ms.get(attempt) {
            Some(&ms) => {
                std::thread::sleep(Duration::from_millis(ms));
                if child.try_wait().unwrap().is_none() {
                    child.kill().unwrap(); // SIGKILL
                    kills += 1;
                }
                child.wait().unwrap();
            }
            None => {
                let out = child.wait_with_output().unwrap();
                assert!(
                    out.status.success(),
                    "{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        if metrics_without_time(&dir).len() == steps
            && dir.join(format!("checkpoints/step-{steps:06}")).is_dir()
        {
            break;
        }
    }
    eprintln!("sigkill campaign: {kills} kills landed, then a clean finish");
    assert!(kills >= 2, "only {kills} kills landed");
    // Whole, unique, consecutive lines, equal to the uninterrupted run's.
    let got = metrics_without_time(&dir);
    let idx: Vec<u64> = got.iter().map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(idx, (0..steps as u64).collect::<Vec<_>>());
    assert_eq!(got, want);
}
