//! Protocol tests: the built-in household env served over the subprocess
//! protocol and over AgentGym's HTTP API (by `actguide serve-env`, on
//! loopback), healthy and with injected faults — a server that dies
//! mid-episode, one that sends malformed JSON. Training runs complete and
//! report the failed episodes; the rest of each batch trains.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use actguide::env::panel::{read_jsonl, write_jsonl};
use actguide::experiment::{self, Event, Experiment, RunOptions};
use serde_json::{json, Value};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

const BIN: &str = env!("CARGO_BIN_EXE_actguide");

/// Run 2 steps against an external env; `env` is the env map's extra keys.
fn run(
    tmp: &Path,
    name: &str,
    env: &str,
    train: &Path,
    test: &Path,
) -> (Vec<Value>, Vec<Value>, Vec<String>) {
    let r = root();
    let src = format!(
        r#"#{{ name: "{name}", seed: 3, steps: 2, runs_dir: "{runs}",
             model: #{{ path: "{r}/models/tiny" }},
             env: #{{ {env}, train: "{train}", test: "{test}", max_steps: 4, step_slack: 1, timeout_s: 10.0, retries: 1 }},
             guidance: #{{ script: "{r}/scripts/guidance/fixed.rhai" }},
             rollout: #{{ tasks_per_step: 4, group_size: 2, show_actions: false, history: 1 }},
             evaluation: #{{ every: 0, max_tasks: 2 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.join("runs").display(),
        r = r.display(),
        train = train.display(),
        test = test.display(),
    );
    let exp = Experiment::from_source("x.rhai", &src).unwrap();
    let mut logs = Vec::new();
    let s = experiment::run(exp, &RunOptions::default(), &mut |ev| {
        if let Event::Log(l) = ev {
            logs.push(l)
        }
    })
    .unwrap();
    assert_eq!(s.steps_done, 2);
    logs.extend(s.warnings.iter().map(|w| format!("summary: {w}")));
    let read = |f: &str| -> Vec<Value> {
        std::fs::read_to_string(s.run_dir.join(f))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    // The training episodes' failures (evaluations' carry an `eval` key).
    let train_errors = read("env_errors.jsonl")
        .into_iter()
        .filter(|e| e.get("eval").is_none())
        .collect();
    (read("metrics.jsonl"), train_errors, logs)
}

/// The first 16 household tasks; `wrap` turns each into the panel's task.
fn panel(tmp: &Path, name: &str, wrap: impl Fn(Value) -> Value) -> PathBuf {
    let tasks = read_jsonl(&root().join("envs/household/train.jsonl")).unwrap();
    let out: Vec<_> = tasks
        .into_iter()
        .take(16)
        .map(|t| serde_json::from_value(wrap(serde_json::to_value(&t).unwrap())).unwrap())
        .collect();
    let p = tmp.join(format!("{name}.jsonl"));
    write_jsonl(&p, &out).unwrap();
    p
}

fn errors(m: &[Value]) -> u64 {
    m.iter().map(|l| l["env_errors"].as_u64().unwrap()).sum()
}

fn episodes(m: &[Value]) -> u64 {
    m.iter().map(|l| l["episodes"].as_u64().unwrap()).sum()
}

fn stdio(extra: &[&str]) -> String {
    let mut cmd = vec![BIN, "serve-env", "--protocol", "stdio"];
    cmd.extend(extra);
    let quoted: Vec<String> = cmd.iter().map(|c| format!("\"{c}\"")).collect();
    format!("kind: \"subprocess\", command: [{}]", quoted.join(", "))
}

#[test]
fn subprocess_env_trains_and_supplies_expert_actions() {
    let tmp = tempfile::tempdir().unwrap();
    // No expert actions in the panel: the env supplies them.
    let p = panel(tmp.path(), "noexpert", |mut t| {
        t["expert"] = json!([]);
        t
    });
    let (m, errs, _) = run(tmp.path(), "ok", &stdio(&[]), &p, &p);
    assert_eq!(errors(&m), 0, "{errs:?}");
    assert!(
        m.iter().any(|l| l["depth_mean"].as_f64().unwrap() > 0.0),
        "{m:?}"
    );
    assert!(m.iter().all(|l| l["policy_tokens"].as_u64().unwrap() > 0));
}

#[test]
fn subprocess_env_dying_or_sending_malformed_json_fails_only_those_episodes() {
    let tmp = tempfile::tempdir().unwrap();
    let p = panel(tmp.path(), "tasks", |t| t);
    for (name, fault, needle) in [
        ("dies", "--die-after-steps", "the env process"),
        ("garbles", "--malformed-after-steps", "malformed JSON"),
    ] {
        // Tasks with an even id number fault at their second step.
        let env = stdio(&[fault, "1", "--fault-every", "2"]);
        let (m, errs, logs) = run(tmp.path(), name, &env, &p, &p);
        // Failed episodes are counted apart: `episodes` (what success is
        // over) holds only the ones the env completed.
        let n = errors(&m);
        assert!(
            n > 0 && episodes(&m) > 0,
            "{name}: {n} failed, {} ok",
            episodes(&m)
        );
        assert_eq!(errs.len() as u64, n);
        for e in &errs {
            let id = e["task"].as_str().unwrap();
            let num: u64 = id.rsplit('-').next().unwrap().parse().unwrap();
            assert_eq!(num % 2, 0, "{e}");
            assert!(e["error"].as_str().unwrap().contains(needle), "{e}");
        }
        assert!(
            logs.iter().any(|l| l.contains("failed in the env")),
            "{logs:?}"
        );
    }
}

/// `actguide serve-env --protocol http` on a free port; kill on drop.
struct Server(Child, String);

impl Server {
    fn start(extra: &[&str]) -> Server {
        let mut child = Command::new(BIN)
            .args(["serve-env", "--protocol", "http", "--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap()
            .to_string();
        Server(child, url)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn http_env_server_healthy_dying_and_malformed() {
    let tmp = tempfile::tempdir().unwrap();
    // The server's reset body carries the task; expert actions stay in the
    // panel (AgentGym's API has no expert request).
    let p = panel(tmp.path(), "http", |t| {
        let mut w = t.clone();
        w["world"] = json!({ "task": t });
        w
    });
    let ok = Server::start(&[]);
    let env = format!("kind: \"http\", url: \"{}\"", ok.1);
    let (m, errs, logs) = run(tmp.path(), "http-ok", &env, &p, &p);
    assert_eq!(errors(&m), 0, "{errs:?}");
    assert!(m.iter().all(|l| l["script"]["fixed.ratio"] == 0.5), "{m:?}");
    assert!(!logs.iter().any(|l| l.starts_with("summary:")), "{logs:?}");
    assert!(m.iter().any(|l| l["depth_mean"].as_f64().unwrap() > 0.0));
    // Every episode's server-side env was closed when the episode ended.
    let live: Value = ureq::get(&format!("{}/live", ok.1))
        .call()
        .unwrap()
        .body_mut()
        .read_json()
        .unwrap();
    assert_eq!(live["live"], 0, "{live}");

    // Expert actions from the server's `GET /expert?id=`: the client's
    // panel has none, the server's panel has them.
    let noexpert = panel(tmp.path(), "http-noexpert", |t| {
        let mut w = t.clone();
        w["world"] = json!({ "task": t });
        w["expert"] = json!([]);
        w
    });
    let gold = Server::start(&["--panel", p.to_str().unwrap()]);
    let env = format!("kind: \"http\", url: \"{}\", expert_endpoint: true", gold.1);
    let (m, errs, _) = run(tmp.path(), "http-expert", &env, &noexpert, &noexpert);
    assert_eq!(errors(&m), 0, "{errs:?}");
    assert!(
        m.iter().any(|l| l["depth_mean"].as_f64().unwrap() > 0.0),
        "{m:?}"
    );

    // Malformed replies for even-numbered tasks after the first step.
    let bad = Server::start(&["--malformed-after-steps", "1", "--fault-every", "2"]);
    let env = format!("kind: \"http\", url: \"{}\"", bad.1);
    let (m, errs, _) = run(tmp.path(), "http-bad", &env, &p, &p);
    let n = errors(&m);
    assert!(
        n > 0 && episodes(&m) > 0,
        "{n} failed, {} ok: {errs:?}",
        episodes(&m)
    );
    assert!(errs
        .iter()
        .all(|e| e["error"].as_str().unwrap().contains("malformed JSON")));

    // The server dies at its 7th step, in the middle of the first
    // training step's episodes (one server holds every episode, so all
    // episodes in flight and after fail): the run still completes, and
    // each failed episode is reported with the connection error.
    let dead = Server::start(&["--die-after-steps", "6"]);
    let env = format!("kind: \"http\", url: \"{}\"", dead.1);
    let (m, errs, logs) = run(tmp.path(), "http-dead", &env, &p, &p);
    // Every episode failed: none is trained on or counted in success, and
    // the script's update is not called (its state stays).
    assert_eq!(episodes(&m), 0, "{m:?}");
    assert!(
        logs.iter()
            .any(|l| l.starts_with("summary: every episode of this invocation was lost")),
        "{logs:?}"
    );
    assert!(errors(&m) > 0);
    assert_eq!(errs.len() as u64, errors(&m));
    for l in &m {
        assert_eq!(l["grad_norm"].as_f64(), Some(0.0), "{l}");
        assert_eq!(l["policy_tokens"].as_u64(), Some(0), "{l}");
        // update() never ran: it would have logged its metric.
        assert!(l["script"].get("fixed.ratio").is_none(), "{l}");
    }
    assert!(
        errs.iter()
            .all(|e| e["error"].as_str().unwrap().contains(&dead.1)),
        "{errs:?}"
    );
    assert_eq!(
        logs.iter()
            .filter(|l| l.contains("failed in the env"))
            .count(),
        2
    );
}

#[test]
fn silent_and_unreachable_envs_time_out_with_a_clear_error() {
    use actguide::env::external::Limits;
    use actguide::env::{make_env, EnvKind, EnvSpec};
    use std::time::{Duration, Instant};
    let task = read_jsonl(&root().join("envs/household/train.jsonl")).unwrap()[0].clone();
    let limits = Limits {
        timeout: Duration::from_millis(300),
        retries: 1,
    };
    // A process that never answers.
    let spec = EnvSpec {
        kind: EnvKind::Subprocess {
            command: vec!["sleep".into(), "30".into()],
            expert: actguide::env::ExpertSource::Task,
        },
        limits,
        success_reward: 1.0,
        step_deadline: None,
        guard: Default::default(),
        conns: Default::default(),
    };
    let t0 = Instant::now();
    let e = make_env(&spec, 5).reset(&task).err().unwrap().to_string();
    assert!(e.contains("hello: no reply within 0.3 s"), "{e}");
    // Two attempts (1 retry), each cut at the timeout.
    assert!(t0.elapsed() < Duration::from_secs(5));
    // Nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let spec = EnvSpec {
        kind: EnvKind::Http {
            url: format!("http://127.0.0.1:{port}"),
            id_field: "id".into(),
            expert: actguide::env::ExpertSource::Panel,
        },
        limits,
        success_reward: 1.0,
        step_deadline: None,
        guard: Default::default(),
        conns: Default::default(),
    };
    let e = make_env(&spec, 5).reset(&task).err().unwrap().to_string();
    assert!(
        e.contains(&format!("http env http://127.0.0.1:{port}: create:")),
        "{e}"
    );
}

#[test]
fn a_silent_env_costs_one_timeout_per_turn_not_one_per_episode() {
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let p = panel(tmp.path(), "tasks", |t| t);
    let r = root();
    // 8 training episodes and 2 + 2 evaluation episodes, each waiting 1 s
    // for a hello that never comes: 12 s one after the other.
    let src = format!(
        r#"#{{ name: "silent", seed: 3, steps: 1, runs_dir: "{runs}",
             model: #{{ path: "{r}/models/tiny" }},
             env: #{{ kind: "subprocess", command: ["sleep", "30"], train: "{p}", test: "{p}",
                      max_steps: 4, timeout_s: 1.0, retries: 0, concurrency: 16 }},
             guidance: #{{ script: "{r}/scripts/guidance/fixed.rhai" }},
             rollout: #{{ tasks_per_step: 4, group_size: 2 }},
             evaluation: #{{ every: 0, max_tasks: 2 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.path().join("runs").display(),
        r = r.display(),
        p = p.display(),
    );
    let exp = Experiment::from_source("x.rhai", &src).unwrap();
    let t0 = Instant::now();
    let s = experiment::run(exp, &RunOptions::default(), &mut |_| {}).unwrap();
    let took = t0.elapsed();
    let m: Vec<Value> = std::fs::read_to_string(s.run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(errors(&m), 8, "{m:?}");
    assert_eq!(episodes(&m), 0);
    // Three rounds of overlapping hellos (eval, train, eval): about 3 s.
    assert!(took < Duration::from_secs(9), "{took:?}");
}

#[test]
fn one_timeout_trips_the_step_and_the_deadline_cuts_every_wait() {
    use actguide::env::external::{Limits, StepGuard};
    use actguide::env::{make_env, EnvKind, EnvSpec};
    use std::time::{Duration, Instant};
    let task = read_jsonl(&root().join("envs/household/train.jsonl")).unwrap()[0].clone();
    let spec = EnvSpec {
        kind: EnvKind::Subprocess {
            command: vec!["sleep".into(), "30".into()],
            expert: actguide::env::ExpertSource::Task,
        },
        limits: Limits {
            timeout: Duration::from_secs(20),
            retries: 2,
        },
        success_reward: 1.0,
        step_deadline: Some(Duration::from_millis(400)),
        guard: StepGuard::default(),
        conns: Default::default(),
    };
    spec.begin_step();
    // The deadline cuts the first wait (20 s) to what is left of 0.4 s,
    // and the timeout stops the retries.
    let t0 = Instant::now();
    let e = make_env(&spec, 5).reset(&task).err().unwrap().to_string();
    let took = t0.elapsed();
    assert!(e.contains("hello: no reply within 0.4 s"), "{e}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    // Every other env of the step fails at once, saying why.
    let t0 = Instant::now();
    for _ in 0..5 {
        let e = make_env(&spec, 5).reset(&task).err().unwrap().to_string();
        assert!(
            e.contains("skipped: an earlier request timed out this step (hello: no reply"),
            "{e}"
        );
    }
    assert!(t0.elapsed() < Duration::from_secs(2));
    // The next step waits again, and its deadline holds without a timeout
    // having tripped anything.
    spec.begin_step();
    std::thread::sleep(Duration::from_millis(450));
    let e = make_env(&spec, 5).reset(&task).err().unwrap().to_string();
    assert!(
        e.contains("the step deadline (0.4 s, env.step_deadline_s) has passed"),
        "{e}"
    );
    // A server that accepts connections and never replies trips it too.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let spec = EnvSpec {
        kind: EnvKind::Http {
            url: format!("http://{}", silent.local_addr().unwrap()),
            id_field: "id".into(),
            expert: actguide::env::ExpertSource::Panel,
        },
        ..spec
    };
    spec.begin_step();
    let t0 = Instant::now();
    let e = make_env(&spec, 5).reset(&task).err().unwrap().to_string();
    assert!(e.contains("create: no reply in time"), "{e}");
    let e = make_env(&spec, 5).reset(&task).err().unwrap().to_string();
    assert!(
        e.contains("skipped: an earlier request timed out this step (create: no reply in time"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
fn a_silent_env_costs_one_timeout_per_step_even_one_episode_at_a_time() {
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let p = panel(tmp.path(), "tasks", |t| t);
    let r = root();
    // 8 training and 2 + 2 evaluation episodes, one at a time, each
    // allowed 1 s and two retries: 36 s without the step guard.
    let src = format!(
        r#"#{{ name: "silent1", seed: 3, steps: 1, runs_dir: "{runs}",
             model: #{{ path: "{r}/models/tiny" }},
             env: #{{ kind: "subprocess", command: ["sleep", "30"], train: "{p}", test: "{p}",
                      max_steps: 4, timeout_s: 1.0, retries: 2, concurrency: 1 }},
             guidance: #{{ script: "{r}/scripts/guidance/fixed.rhai" }},
             rollout: #{{ tasks_per_step: 4, group_size: 2 }},
             evaluation: #{{ every: 0, max_tasks: 2 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.path().join("runs").display(),
        r = r.display(),
        p = p.display(),
    );
    let exp = Experiment::from_source("x.rhai", &src).unwrap();
    let t0 = Instant::now();
    let s = experiment::run(exp, &RunOptions::default(), &mut |_| {}).unwrap();
    let took = t0.elapsed();
    let m: Vec<Value> = std::fs::read_to_string(s.run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(errors(&m), 8, "{m:?}");
    let all: Vec<Value> = std::fs::read_to_string(s.run_dir.join("env_errors.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The two evaluations' episodes are there too, marked as theirs.
    let (evals, errs): (Vec<Value>, Vec<Value>) =
        all.into_iter().partition(|e| e.get("eval").is_some());
    assert_eq!(evals.len(), 4, "{evals:?}");
    assert_eq!(errs.len(), 8);
    let first = errs[0]["error"].as_str().unwrap();
    assert!(first.contains("hello: no reply within 1.0 s"), "{first}");
    assert!(
        errs[1..].iter().all(|e| e["error"]
            .as_str()
            .unwrap()
            .contains("skipped: an earlier request timed out this step")),
        "{errs:?}"
    );
    // One timeout per phase (eval, train, eval): about 3 s.
    assert!(took < Duration::from_secs(9), "{took:?}");
}

#[test]
fn tasks_from_server_rebuild_a_panel_over_http_and_stdio() {
    let tmp = tempfile::tempdir().unwrap();
    let orig = read_jsonl(&root().join("envs/household/train.jsonl")).unwrap();
    let orig = &orig[..6];
    // The gold server knows the panel (its `GET /expert?id=`); the client
    // only has ids and reset bodies, plus one world the server cannot
    // supply an expert for.
    let p = panel(tmp.path(), "gold", |t| {
        let mut w = t.clone();
        w["world"] = json!({ "task": t });
        w
    });
    let gold = Server::start(&["--panel", p.to_str().unwrap()]);
    let mut worlds: Vec<String> = orig
        .iter()
        .map(|t| json!({ "id": t.id, "type": t.task_type, "world": { "task": t } }).to_string())
        .collect();
    let mut stranger = orig[0].clone();
    stranger.id = "not-on-the-server".into();
    worlds.push(json!({ "id": stranger.id, "world": { "task": stranger } }).to_string());
    let wpath = tmp.path().join("worlds.jsonl");
    std::fs::write(&wpath, worlds.join("\n") + "\n").unwrap();
    let out = tmp.path().join("built.jsonl");
    let o = Command::new(BIN)
        .args(["tasks", "from-server", "--url", &gold.1, "--worlds"])
        .arg(&wpath)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{stdout}{stderr}");
    assert!(
        stdout.contains("wrote 6 task(s)") && stdout.contains("1 left out"),
        "{stdout}"
    );
    assert!(
        stderr.contains("left out not-on-the-server: expert:"),
        "{stderr}"
    );
    let built = read_jsonl(&out).unwrap();
    assert_eq!(built.len(), 6);
    for (b, t) in built.iter().zip(orig) {
        assert_eq!(
            (&b.id, &b.task_type, &b.goal),
            (&t.id, &t.task_type, &t.goal)
        );
        assert_eq!(b.expert, t.expert);
        assert_eq!(b.difficulty, t.expert.len());
    }

    // Over stdio the env plans the experts itself; each is replayed to
    // success. A world the env cannot reset to is left out with the reason.
    use actguide::env::harvest::{harvest, HarvestOptions, TaskSeed};
    use actguide::env::{EnvKind, EnvSpec};
    let spec = EnvSpec {
        kind: EnvKind::Subprocess {
            command: vec![
                BIN.into(),
                "serve-env".into(),
                "--protocol".into(),
                "stdio".into(),
            ],
            expert: actguide::env::ExpertSource::Task,
        },
        ..EnvSpec::builtin(actguide::env::BuiltinEnv::Household)
    };
    let mut seeds: Vec<TaskSeed> = orig
        .iter()
        .map(|t| TaskSeed {
            id: t.id.clone(),
            world: t.world.clone(),
            task_type: t.task_type.clone(),
            // The household env shows the goal it is given.
            goal: t.goal.clone(),
        })
        .collect();
    seeds.push(TaskSeed {
        id: "garbled".into(),
        world: json!({ "rooms": 3 }),
        task_type: String::new(),
        goal: String::new(),
    });
    let h = harvest(&spec, &seeds, &HarvestOptions::default()).unwrap();
    assert_eq!(h.tasks.len(), 6, "{:?}", h.rejected);
    for (b, t) in h.tasks.iter().zip(orig) {
        assert_eq!(b.goal, t.goal);
        assert!(!b.expert.is_empty() && b.difficulty == b.expert.len());
    }
    assert_eq!(h.rejected.len(), 1);
    assert_eq!(h.rejected[0].id, "garbled");
    assert!(
        h.rejected[0].reason.starts_with("reset:"),
        "{:?}",
        h.rejected
    );

    // `--range` worlds this server does not understand: nothing is built,
    // and the command says so with a non-zero exit.
    let o = Command::new(BIN)
        .args([
            "tasks",
            "from-server",
            "--url",
            &gold.1,
            "--range",
            "0..2",
            "--out",
        ])
        .arg(tmp.path().join("none.jsonl"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("left out game-0: reset:"), "{stderr}");
    assert!(
        stderr.contains("no task could be built from 2 world(s)"),
        "{stderr}"
    );
}

#[test]
fn tasks_stats_runs_on_external_envs_and_names_their_failures() {
    let p = root().join("envs/household/test.jsonl");
    let stats = |extra: &[&str]| {
        let o = Command::new(BIN)
            .args(["tasks", "stats"])
            .arg(&p)
            .args(["--rollouts", "2", "--max-steps", "6"])
            .args(extra)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // The same env over stdio gives the built-in env's table.
    let (builtin, _) = stats(&[]);
    let (stdio, err) = stats(&["--", BIN, "serve-env", "--protocol", "stdio"]);
    assert_eq!(stdio, builtin);
    assert!(err.is_empty(), "{err}");
    // A dead server: every rollout failed, and the command says so.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (_, err) = stats(&["--url", &format!("http://127.0.0.1:{port}")]);
    assert!(
        err.starts_with("64 rollout(s) failed in the env and count as failures, e.g. household-test-0000: reset:"),
        "{err}"
    );
}

/// An AgentGym-style server on loopback whose env 3's steps hang for
/// `hang` (env 0 is the step-0 evaluation's, 1–8 the first step's):
/// returns its URL and the set of envs created and not closed.
fn hanging_server(
    hang: std::time::Duration,
) -> (
    String,
    std::sync::Arc<std::sync::Mutex<std::collections::BTreeSet<u64>>>,
) {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let live = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
    let next = Arc::new(Mutex::new(0u64));
    let shared = live.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let (live, next) = (shared.clone(), next.clone());
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let (head, body) = loop {
                    let n = s.read(&mut chunk).unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some((h, b)) = text.split_once("\r\n\r\n") {
                        let len = h
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap())
                            })
                            .unwrap_or(0);
                        if b.len() >= len {
                            break (h.to_string(), b.to_string());
                        }
                    }
                };
                let path = head.split(' ').nth(1).unwrap_or("").to_string();
                let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                let id = v["id"].as_u64().unwrap_or(u64::MAX);
                let reply = match path.as_str() {
                    "/create" => {
                        let mut n = next.lock().unwrap();
                        live.lock().unwrap().insert(*n);
                        *n += 1;
                        json!({ "id": *n - 1 })
                    }
                    "/reset" => {
                        json!({ "observation": "A room. Your task is to: wait.", "available_actions": ["wait", "look"] })
                    }
                    "/step" => {
                        if id == 3 {
                            std::thread::sleep(hang);
                        }
                        json!({ "observation": "Time passes.", "reward": 0.0, "done": false, "available_actions": ["wait", "look"] })
                    }
                    "/close" => {
                        live.lock().unwrap().remove(&id);
                        json!({ "closed": id })
                    }
                    _ => json!({ "error": "no route" }),
                };
                let text = reply.to_string();
                let _ = write!(
                    s,
                    "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{text}",
                    text.len()
                );
            });
        }
    });
    (url, live)
}

#[test]
fn envs_whose_close_a_timeout_skipped_are_closed_at_the_end_of_the_step() {
    use std::time::Duration;
    let tmp = tempfile::tempdir().unwrap();
    let p = panel(tmp.path(), "tasks", |mut t| {
        t["world"] = json!({});
        t
    });
    let (url, live) = hanging_server(Duration::from_secs(3));
    let r = root();
    let src = format!(
        r#"#{{ name: "left-open", seed: 3, steps: 1, runs_dir: "{runs}",
             model: #{{ path: "{r}/models/tiny" }},
             env: #{{ kind: "http", url: "{url}", train: "{p}", test: "{p}",
                      max_steps: 3, timeout_s: 1.0, retries: 0, concurrency: 8 }},
             guidance: #{{ script: "{r}/scripts/guidance/fixed.rhai" }},
             rollout: #{{ tasks_per_step: 4, group_size: 2, constrained: false }},
             evaluation: #{{ every: 0, max_tasks: 1, samples: 1 }}, checkpoint: #{{ every: 0 }} }}"#,
        runs = tmp.path().join("runs").display(),
        r = r.display(),
        p = p.display(),
    );
    let exp = Experiment::from_source("x.rhai", &src).unwrap();
    let s = experiment::run(exp, &RunOptions::default(), &mut |_| {}).unwrap();
    let m: Vec<Value> = std::fs::read_to_string(s.run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The timeout failed episodes, and their envs' closes were skipped.
    assert!(errors(&m) > 0, "{m:?}");
    let errs = std::fs::read_to_string(s.run_dir.join("env_errors.jsonl")).unwrap();
    assert!(
        errs.contains("skipped: an earlier request timed out"),
        "{errs}"
    );
    assert!(!errs.contains("left open"), "{errs}");
    // The hung step's own env is closed when its reply comes; wait for it.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(*live.lock().unwrap(), Default::default(), "envs left alive");
}
