//! A third-party env as a new user meets one: a text game written for
//! Python's standard library alone (`tests/fixtures/textgame/game.py`:
//! `ThreadingHTTPServer` with its default listen backlog, or stdin/stdout),
//! which knows the gold path only per env instance. Using only the
//! project's commands — `tasks from-server`, `init-tiny --panel`, `run` —
//! 16 concurrent episodes lose none to the connection, the harvested
//! vocabulary encodes every action, no env is left alive on the server,
//! and a run killed with SIGKILL leaves no env process behind.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use actguide::experiment::{self, Event, Experiment, RunOptions};
use serde_json::Value;

use common::children_of;

const BIN: &str = env!("CARGO_BIN_EXE_actguide");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn game() -> String {
    root()
        .join("tests/fixtures/textgame/game.py")
        .display()
        .to_string()
}

/// Whether python3 runs; in CI (CI=true) its absence is a failure.
fn python() -> bool {
    let ok = Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var("CI").is_err(),
            "python3 is needed for the third-party env tests"
        );
        eprintln!("SKIPPED: no python3");
    }
    ok
}

/// The game's HTTP server on a free port; killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Server {
    fn start() -> Server {
        let mut child = Command::new("python3")
            .args([&game(), "--http", "0"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap()
            .to_string();
        Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }

    /// Envs created and not closed, and envs created in all.
    fn live(&self) -> (u64, u64) {
        let v: Value = ureq::get(&format!("{}/live", self.url))
            .call()
            .unwrap()
            .body_mut()
            .read_json()
            .unwrap();
        (v["live"].as_u64().unwrap(), v["created"].as_u64().unwrap())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `actguide <args>`; panics with its output unless it succeeds.
fn actguide(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "actguide {args:?}:\n{text}");
    text
}

/// Train and test panels in `t` built over stdio (experts per instance),
/// and a tiny card in `t/card` from them and what the env showed.
fn stdio_panels_and_card(t: &Path, train: &str, test: &str) -> PathBuf {
    let g = game();
    for (range, name) in [(train, "train.jsonl"), (test, "test.jsonl")] {
        let out = actguide(&[
            "tasks",
            "from-server",
            "--range",
            range,
            "--expert",
            "instance",
            "--out",
            t.join(name).to_str().unwrap(),
            "--",
            "python3",
            &g,
            "--stdio",
        ]);
        assert!(out.contains("task(s)"), "{out}");
    }
    card_from(t, &t.join("card"))
}

/// `init-tiny` on the panels in `dir`, written to `out`.
fn card_from(dir: &Path, out: &Path) -> PathBuf {
    actguide(&[
        "init-tiny",
        "--panel",
        dir.join("train.jsonl").to_str().unwrap(),
        "--panel",
        dir.join("test.jsonl").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    out.to_path_buf()
}

/// The experiment file's text: `steps` steps of 8 tasks × 2 rollouts (16
/// episodes at once) on the card at `card`, `env` the env map's kind keys.
fn experiment(
    dir: &Path,
    name: &str,
    card: &Path,
    env: &str,
    panels: &Path,
    steps: usize,
) -> String {
    format!(
        r#"#{{ name: "{name}", seed: 4, steps: {steps}, runs_dir: "{runs}",
             model: #{{ path: "{card}" }},
             env: #{{ {env}, train: "{p}/train.jsonl", test: "{p}/test.jsonl",
                      max_steps: 6, step_slack: 2, concurrency: 16, timeout_s: 20.0 }},
             guidance: #{{ script: "{r}/scripts/guidance/gaussian.rhai", clusters: 2 }},
             rollout: #{{ tasks_per_step: 8, group_size: 2, history: 1, show_actions: false }},
             evaluation: #{{ every: 0, max_tasks: 4, samples: 2 }},
             checkpoint: #{{ every: 0 }} }}"#,
        runs = dir.join("runs").display(),
        card = card.display(),
        p = panels.display(),
        r = root().display(),
    )
}

/// Run an experiment in-process: its metrics lines, its env_errors.jsonl
/// lines, and its log.
fn run(src: &str) -> (Vec<Value>, Vec<Value>, Vec<String>) {
    let exp = Experiment::from_source("x.rhai", src).unwrap();
    let mut logs = Vec::new();
    let s = experiment::run(exp, &RunOptions::default(), &mut |ev| {
        if let Event::Log(l) = ev {
            logs.push(l)
        }
    })
    .unwrap();
    let read = |f: &str| -> Vec<Value> {
        std::fs::read_to_string(s.run_dir.join(f))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    (read("metrics.jsonl"), read("env_errors.jsonl"), logs)
}

/// No episode failed, no action was unencodable, every step ran its 16.
fn assert_clean(metrics: &[Value], errors: &[Value], steps: usize) {
    assert_eq!(metrics.len(), steps);
    for m in metrics {
        assert_eq!(m["episodes"], 16, "{m}");
        assert_eq!(m["env_errors"], 0, "{m}");
        assert!(m.get("unencodable_actions").is_none(), "{m}");
    }
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn an_ordinary_python_http_server_at_concurrency_16_loses_nothing() {
    if !python() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let server = Server::start();
    // Experts from the reset reply for train, from `GET /expert?env_idx=`
    // after a reset for test: the server has no per-task route.
    let url = server.url.as_str();
    let out = actguide(&[
        "tasks",
        "from-server",
        "--url",
        url,
        "--id-field",
        "env_idx",
        "--range",
        "0..24",
        "--expert",
        "reset:info.extra.expert_plan",
        "--out",
        t.join("train.jsonl").to_str().unwrap(),
    ]);
    assert!(out.contains("wrote 24 task(s)"), "{out}");
    assert!(out.contains("train.seen.json"), "{out}");
    actguide(&[
        "tasks",
        "from-server",
        "--url",
        url,
        "--id-field",
        "env_idx",
        "--range",
        "100..108",
        "--expert",
        "instance",
        "--out",
        t.join("test.jsonl").to_str().unwrap(),
    ]);
    // Asked per task, the server has nothing to say.
    let refused = Command::new(BIN)
        .args([
            "tasks",
            "from-server",
            "--url",
            url,
            "--id-field",
            "env_idx",
        ])
        .args(["--range", "0..2", "--out"])
        .arg(t.join("none.jsonl"))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let seen: Value =
        serde_json::from_str(&std::fs::read_to_string(t.join("train.seen.json")).unwrap()).unwrap();
    assert!(seen["actions"].as_array().unwrap().len() > 50, "{seen}");

    // A card from the panels alone, and one with what the env showed.
    let bare_dir = t.join("bare");
    std::fs::create_dir(&bare_dir).unwrap();
    for f in ["train.jsonl", "test.jsonl"] {
        std::fs::copy(t.join(f), bare_dir.join(f)).unwrap();
    }
    let bare = card_from(&bare_dir, &t.join("card-bare"));
    let card = card_from(t, &t.join("card"));
    let env = format!(r#"kind: "http", url: "{url}", id_field: "env_idx""#);
    // The bare card on the harvested panels: warned before step 1, with
    // the count.
    let (_, _, logs) = run(&experiment(t, "bare", &bare, &env, t, 1));
    let warning = logs
        .iter()
        .find(|l| l.contains("admissible action(s) the env showed"))
        .unwrap_or_else(|| panic!("no warning: {logs:#?}"));
    assert!(warning.contains("the tokenizer cannot encode"), "{warning}");

    let (metrics, errors, logs) = run(&experiment(t, "seen", &card, &env, t, 2));
    assert_clean(&metrics, &errors, 2);
    assert!(
        !logs.iter().any(|l| l.contains("cannot encode")),
        "{logs:#?}"
    );
    let (live, created) = server.live();
    assert_eq!(live, 0, "envs left alive on the server ({created} created)");
    assert!(created > 40);
}

#[test]
fn a_stdio_env_that_knows_experts_per_instance_builds_and_trains() {
    if !python() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let g = game();
    let card = stdio_panels_and_card(t, "0..24", "100..108");
    // The test panel without its experts: the run asks each env instance.
    let tasks = actguide::env::panel::read_jsonl(&t.join("test.jsonl")).unwrap();
    let bare: Vec<_> = tasks
        .iter()
        .cloned()
        .map(|mut t| {
            t.expert.clear();
            t.difficulty = 0;
            t
        })
        .collect();
    actguide::env::panel::write_jsonl(&t.join("test.jsonl"), &bare).unwrap();
    let env = format!(
        r#"kind: "subprocess", command: ["python3", "{g}", "--stdio"], expert: "instance""#
    );
    let (metrics, errors, _) = run(&experiment(t, "stdio", &card, &env, t, 2));
    assert_clean(&metrics, &errors, 2);
}

#[test]
fn a_run_killed_with_sigkill_leaves_no_env_process() {
    if !python() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let g = game();
    let card = stdio_panels_and_card(t, "0..16", "100..104");
    let env = format!(r#"kind: "subprocess", command: ["python3", "{g}", "--stdio"]"#);
    let exp = t.join("kill.rhai");
    std::fs::write(&exp, experiment(t, "kill", &card, &env, t, 1000)).unwrap();
    let mut run = common::spawn_run(&exp);
    // Wait until the run has env processes (16 episodes at once).
    let t0 = Instant::now();
    let mut envs = Vec::new();
    while envs.len() < 8 {
        assert!(run.try_wait().unwrap().is_none(), "the run ended early");
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no env processes: {envs:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
        envs = children_of(run.id());
    }
    run.kill().unwrap(); // SIGKILL: no destructor runs
    run.wait().unwrap();
    let left = common::still_alive_after(&envs, Duration::from_secs(10));
    assert!(left.is_empty(), "env processes left running: {left:?}");
}
