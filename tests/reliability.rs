//! What a hostile user finds, answered: a model too large for the machine
//! is refused before any weight exists; evaluation tells env failures
//! apart from the policy's; a resume refuses a checkpoint it cannot vouch
//! for (no SHA256SUMS, settings edited while stopped) unless accepted
//! knowingly, and picks up a script edited while the run was stopped.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_actguide");

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn actguide(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

/// `actguide run --resume DIR --stop-after 1 --plain` with `extra` flags.
fn resume(dir: &str, extra: &[&str]) -> Output {
    let mut args = vec!["run", "--resume", dir, "--stop-after", "1", "--plain"];
    args.extend(extra);
    actguide(&args)
}

fn read_lines(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// An experiment file on the tiny household setup; `model`, `env` and
/// `script` fill their keys.
fn experiment(dir: &Path, name: &str, model: &Path, env: &str, script: &Path) -> PathBuf {
    let r = root();
    let src = format!(
        r#"#{{
            name: "{name}", seed: 5, steps: 6, runs_dir: "{runs}",
            model: #{{ path: "{model}" }},
            env: #{{ {env} train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 4 }},
            guidance: #{{ script: "{script}" }},
            rollout: #{{ tasks_per_step: 2, group_size: 2 }},
            evaluation: #{{ every: 0, max_tasks: 2 }},
            checkpoint: #{{ every: 1 }},
        }}"#,
        runs = dir.join("runs").display(),
        r = r.display(),
        model = model.display(),
        script = script.display(),
    );
    let p = dir.join(format!("{name}.rhai"));
    std::fs::write(&p, src).unwrap();
    p
}

#[test]
fn a_model_too_large_for_the_machine_is_refused_before_its_weights_exist() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("huge");
    std::fs::create_dir(&model).unwrap();
    std::fs::copy(
        root().join("models/tiny/tokenizer.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    let cfg = std::fs::read_to_string(root().join("models/tiny/config.json"))
        .unwrap()
        .replace("\"hidden_size\": 128", "\"hidden_size\": 65536")
        .replace(
            "\"intermediate_size\": 384",
            "\"intermediate_size\": 262144",
        )
        .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 200");
    std::fs::write(model.join("config.json"), cfg).unwrap();
    let script = root().join("scripts/guidance/fixed.rhai");
    let exp = experiment(tmp.path(), "huge", &model, "", &script);
    let t0 = Instant::now();
    // 64 GiB would hold every weight of a 537M-parameter model; this one
    // has 10¹³ parameters.
    let out = actguide(&["run", exp.to_str().unwrap(), "--memory-gb", "64", "--plain"]);
    // A bound on a hang, not a speed measurement: allocating the weights
    // alone would take minutes and be killed.
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("this run would need about"), "{err}");
    assert!(err.contains("weights"), "{err}");
    // Nothing is left behind: the corrected rerun gets the same name.
    assert!(!tmp.path().join("runs/huge").exists());
}

#[test]
fn evaluation_counts_env_failures_apart_and_eval_exits_non_zero() {
    let tmp = tempfile::tempdir().unwrap();
    // Every episode's first step kills the env process.
    let env = format!(
        r#"kind: "subprocess", command: ["{BIN}", "serve-env", "--protocol", "stdio", "--die-after-steps", "0"], timeout_s: 10.0, retries: 0,"#
    );
    let script = root().join("scripts/guidance/fixed.rhai");
    let exp = experiment(
        tmp.path(),
        "dead",
        &root().join("models/tiny"),
        &env,
        &script,
    );
    let out = actguide(&["run", exp.to_str().unwrap(), "--stop-after", "1", "--plain"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let run = tmp.path().join("runs/dead");
    let evals = read_lines(&run.join("eval.jsonl"));
    // The step-0 evaluation lost both its episodes: no rate, not 0.
    assert_eq!(evals[0]["env_errors"], 2, "{evals:?}");
    assert_eq!(evals[0]["success"], Value::Null, "{evals:?}");
    assert_eq!(evals[0]["episodes"], 0, "{evals:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stderr.contains("2 episode(s) lost to env failures")
            || stdout.contains("2 episode(s) lost to env failures"),
        "{stdout}\n{stderr}"
    );
    let errs = read_lines(&run.join("env_errors.jsonl"));
    let eval_errs: Vec<&Value> = errs.iter().filter(|e| e["eval"] == "test").collect();
    assert_eq!(eval_errs.len(), 2, "{errs:?}");
    assert!(eval_errs
        .iter()
        .all(|e| e["step"] == 0 && e["task"].is_string()));
    // `actguide eval` on the run says the panel was not evaluated.
    let out = actguide(&[
        "eval",
        run.to_str().unwrap(),
        "--samples",
        "1",
        "--max-tasks",
        "2",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lost to env failures"), "{err}");
    assert!(err.contains("not fully evaluated"), "{err}");
}

#[test]
fn a_resume_refuses_what_it_cannot_vouch_for_unless_accepted_knowingly() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("fixed.rhai");
    std::fs::copy(root().join("scripts/guidance/fixed.rhai"), &script).unwrap();
    let exp = experiment(tmp.path(), "r", &root().join("models/tiny"), "", &script);
    let run = tmp.path().join("runs/r");
    let dir = run.to_str().unwrap();
    let out = actguide(&["run", exp.to_str().unwrap(), "--stop-after", "1", "--plain"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Settings edited while the run was stopped: refused, keys named.
    let path = run.join("experiment.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut e: Value = serde_json::from_str(&text).unwrap();
    e["seed"] = 99.into();
    e["rollout"]["group_size"] = 3.into();
    std::fs::write(&path, serde_json::to_string_pretty(&e).unwrap()).unwrap();
    let out = resume(dir, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rollout.group_size: 2 → 3"), "{err}");
    assert!(err.contains("seed: 5 → 99"), "{err}");
    assert!(err.contains("--accept-changed-config"), "{err}");
    assert_eq!(read_lines(&run.join("metrics.jsonl")).len(), 1);
    // Accepted knowingly: logged and recorded.
    let out = resume(dir, &["--accept-changed-config"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resumed under changed settings"), "{err}");
    let resumes = read_lines(&run.join("resumes.jsonl"));
    assert_eq!(resumes.len(), 1);
    assert_eq!(resumes[0]["step"], 1);
    assert_eq!(
        resumes[0]["changed"],
        serde_json::json!(["rollout.group_size: 2 → 3", "seed: 5 → 99"])
    );
    let m = read_lines(&run.join("metrics.jsonl"));
    assert_eq!(m[1]["episodes"], 6, "{m:?}");

    // No SHA256SUMS: refused; accepted knowingly.
    std::fs::remove_file(run.join("checkpoints/step-000002/SHA256SUMS")).unwrap();
    let out = resume(dir, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no SHA256SUMS"), "{err}");
    assert!(err.contains("--accept-unverified"), "{err}");
    // The script, edited while the run was stopped, is reloaded at the
    // resume step.
    let edited = std::fs::read_to_string(&script).unwrap() + "\n// edited while stopped\n";
    std::fs::write(&script, edited).unwrap();
    let out = resume(dir, &["--accept-unverified"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let resumes = read_lines(&run.join("resumes.jsonl"));
    assert_eq!(resumes.len(), 2);
    assert_eq!(resumes[1]["unverified"], true);
    let reloads = read_lines(&run.join("reloads.jsonl"));
    assert_eq!(reloads.len(), 1, "{reloads:?}");
    assert_eq!(reloads[0]["step"], 2);
    assert_eq!(reloads[0]["ok"], true);
}

#[test]
fn a_train_panel_without_any_expert_action_is_refused_with_its_file() {
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("envs/household/train.jsonl")).unwrap();
    let empty: String = text
        .lines()
        .map(|l| {
            let mut t: Value = serde_json::from_str(l).unwrap();
            t["expert"] = serde_json::json!([]);
            t.to_string() + "\n"
        })
        .collect();
    let panel = tmp.path().join("noexpert.jsonl");
    std::fs::write(&panel, empty).unwrap();
    let script = root().join("scripts/guidance/fixed.rhai");
    let exp = experiment(tmp.path(), "ne", &root().join("models/tiny"), "", &script);
    let src = std::fs::read_to_string(&exp).unwrap().replace(
        &format!("train: \"{}/envs/household/train.jsonl\"", root().display()),
        &format!("train: \"{}\"", panel.display()),
    );
    std::fs::write(&exp, src).unwrap();
    let out = actguide(&["run", exp.to_str().unwrap(), "--plain"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("noexpert.jsonl:1: no task has expert actions"),
        "{err}"
    );
    assert!(!tmp.path().join("runs/ne").exists());
}

#[test]
fn sigint_before_the_first_step_stops_at_once_with_130() {
    let tmp = tempfile::tempdir().unwrap();
    let script = root().join("scripts/guidance/fixed.rhai");
    let exp = experiment(
        tmp.path(),
        "early",
        &root().join("models/tiny"),
        "",
        &script,
    );
    // A long first evaluation (every test task, 50 actions each): the
    // interrupt lands before the first step.
    let src = std::fs::read_to_string(&exp)
        .unwrap()
        .replace(
            "evaluation: #{ every: 0, max_tasks: 2 }",
            "evaluation: #{ every: 0, samples: 8, greedy: false }",
        )
        .replace("max_steps: 4", "max_steps: 50");
    std::fs::write(&exp, src).unwrap();
    let run = tmp.path().join("runs/early");
    let child = Command::new(BIN)
        .args(["run", exp.to_str().unwrap(), "--plain"])
        .current_dir(root())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !run.join("experiment.json").exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no set-up in 120 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let sent = Instant::now();
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    // A bound on a hang: the first evaluation alone takes far longer.
    assert!(
        sent.elapsed() < Duration::from_secs(20),
        "{:?}",
        sent.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("had not started a step"), "{err}");
    assert!(!run.join("metrics.jsonl").exists());
}

/// `actguide tasks select ... | head -1`: a reader that closes stdout early
/// ends the command with SIGPIPE's status and no panic message; the output
/// file is written all the same.
#[test]
fn a_closed_stdout_ends_a_command_quietly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("sel.jsonl");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = Command::new(BIN)
        .args([
            "tasks",
            "select",
            "envs/household/reveal/long_test.jsonl",
            "--first",
            "3",
        ])
        .arg("--out")
        .arg(&out)
        .current_dir(root())
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(141), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(read_lines(&out).len(), 3);
}
