//! Property tests over every reader of user input: experiment files, task
//! panels and worlds files, the chat action parser, the subprocess protocol
//! (both ends), HF config files, GGUF and safetensors headers. Each gets
//! arbitrary bytes and mutations of a valid input; each must answer with a
//! value or a typed error — never a panic, never an abort.
//!
//! `PROPTEST_CASES` raises the number of cases (the defaults below keep CI
//! short); a failure prints the minimal input that triggered it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use actguide::env::panel::read_jsonl;
use actguide::experiment::Experiment;
use actguide::model::{ModelConfig, Policy};
use candle_core::Device;
use proptest::prelude::*;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

const BIN: &str = env!("CARGO_BIN_EXE_actguide");

/// `n` cases unless `PROPTEST_CASES` says otherwise.
fn cases(n: u32) -> ProptestConfig {
    let n = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n);
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Byte edits of a valid input: `(position, kind, byte)` — overwrite,
/// insert or delete — biased towards the first `hot` bytes (headers).
fn edits(hot: usize) -> impl Strategy<Value = Vec<(usize, u8, u8)>> {
    prop::collection::vec(
        (
            prop_oneof![3 => 0..hot.max(1), 1 => 0..usize::MAX],
            0u8..3,
            any::<u8>(),
        ),
        1..8,
    )
}

fn mutate(valid: &[u8], edits: &[(usize, u8, u8)]) -> Vec<u8> {
    let mut b = valid.to_vec();
    for &(pos, kind, byte) in edits {
        if b.is_empty() {
            b.push(byte);
            continue;
        }
        let at = pos % b.len();
        match kind {
            0 => b[at] = byte,
            1 => b.insert(at, byte),
            _ => {
                b.remove(at);
            }
        }
    }
    b
}

/// Arbitrary text, with a bias towards the syntax the readers care about.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[ #{}\\[\\]:,\"a-z0-9.\\-_ \n]{0,200}",
        "[{}\\[\\]:,\"a-z0-9.eE+\\- \n]{0,200}",
    ]
}

fn quickstart() -> String {
    std::fs::read_to_string(root().join("examples/quickstart.rhai")).unwrap()
}

/// A valid experiment file with every path absolute (so edits, not paths,
/// decide the outcome).
fn valid_experiment() -> String {
    let r = root().display().to_string();
    quickstart()
        .replace("\"models/", &format!("\"{r}/models/"))
        .replace("\"envs/", &format!("\"{r}/envs/"))
        .replace("\"scripts/", &format!("\"{r}/scripts/"))
}

proptest! {
    #![proptest_config(cases(256))]

    #[test]
    fn experiment_files_never_panic(s in text()) {
        let _ = Experiment::from_source("fuzz.rhai", &s);
    }

    #[test]
    fn edited_experiment_files_never_panic(e in edits(4096)) {
        let src = valid_experiment();
        let s = String::from_utf8_lossy(&mutate(src.as_bytes(), &e)).into_owned();
        if let Err(err) = Experiment::from_source("fuzz.rhai", &s) {
            // Every refusal names the file.
            prop_assert!(err.to_string().contains("fuzz.rhai"), "{}", err);
        }
    }

    #[test]
    fn chat_action_parser_never_panics(s in text()) {
        let _ = actguide::rollout::chat::parse_action(&s);
    }
}

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn panels_and_worlds_files_never_panic(s in text(), e in edits(2048)) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.jsonl");
        let valid = std::fs::read(root().join("envs/household/test.jsonl")).unwrap();
        for bytes in [s.into_bytes(), mutate(&valid[..valid.len().min(8192)], &e)] {
            std::fs::write(&p, &bytes).unwrap();
            if let Err(err) = read_jsonl(&p) {
                prop_assert!(err.to_string().contains("p.jsonl"), "{}", err);
            }
            let _ = actguide::env::harvest::read_seeds(&p);
        }
    }

    #[test]
    fn hf_config_files_never_panic(s in text(), e in edits(1024)) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        let valid = std::fs::read(root().join("models/tiny/config.json")).unwrap();
        for bytes in [s.into_bytes(), mutate(&valid, &e)] {
            std::fs::write(&p, &bytes).unwrap();
            let _ = ModelConfig::from_file_with_arch(&p);
        }
    }
}

/// A tiny policy's weights as GGUF and safetensors files in `dir`.
fn tiny_weights(dir: &Path) -> (ModelConfig, PathBuf, PathBuf) {
    let (cfg, _) =
        ModelConfig::from_file_with_arch(&root().join("models/tiny/config.json")).unwrap();
    let p = Policy::new_random(&cfg, &mut actguide::seed::rng(1, &[2]), &Device::Cpu).unwrap();
    let gguf = dir.join("w.gguf");
    p.write_gguf(&gguf, actguide::model::GgmlDType::F32, None)
        .unwrap();
    let st = dir.join("w.safetensors");
    p.save_safetensors(&st).unwrap();
    (cfg, gguf, st)
}

proptest! {
    #![proptest_config(cases(128))]

    #[test]
    fn gguf_and_safetensors_headers_never_panic(e in edits(2048), junk in prop::collection::vec(any::<u8>(), 0..256)) {
        let dir = tempfile::tempdir().unwrap();
        let (cfg, gguf, st) = tiny_weights(dir.path());
        let bad = dir.path().join("bad.gguf");
        for bytes in [mutate(&std::fs::read(&gguf).unwrap(), &e), junk.clone()] {
            std::fs::write(&bad, &bytes).unwrap();
            let _ = actguide::model::gguf_config(&bad);
            let _ = Policy::from_gguf(&bad, &Device::Cpu);
            let _ = actguide::model::ModelSource::open(&bad);
        }
        let bad = dir.path().join("bad.safetensors");
        for bytes in [mutate(&std::fs::read(&st).unwrap(), &e), junk] {
            std::fs::write(&bad, &bytes).unwrap();
            let _ = Policy::load_safetensors(&cfg, &bad, &Device::Cpu);
        }
    }
}

/// A JSON value of the shapes protocol replies have, with wrong types
/// and missing fields mixed in.
fn reply_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{json, Value};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,20}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(
                prop_oneof![
                    Just("observation".to_string()),
                    Just("available_actions".to_string()),
                    Just("done".to_string()),
                    Just("reward".to_string()),
                    Just("success".to_string()),
                    Just("valid".to_string()),
                    Just("info".to_string()),
                    Just("status".to_string()),
                    Just("error".to_string()),
                    Just("actions".to_string()),
                    "[a-z]{1,8}",
                ],
                inner,
                0..8,
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(cases(48))]

    /// The client end: a child that says hello properly, then answers
    /// reset and step with arbitrary replies (or arbitrary lines).
    #[test]
    fn subprocess_replies_never_panic_the_client(
        replies in prop::collection::vec(reply_value(), 1..4),
        raw in prop::option::of(text()),
    ) {
        use actguide::env::{make_env, EnvKind, EnvSpec};
        let dir = tempfile::tempdir().unwrap();
        let mut lines = vec![r#"{"id":1,"version":1}"#.to_string()];
        for (i, mut r) in replies.into_iter().enumerate() {
            if let serde_json::Value::Object(m) = &mut r {
                m.insert("id".into(), (i as u64 + 2).into());
            }
            lines.push(r.to_string());
        }
        if let Some(raw) = raw {
            lines.push(raw);
        }
        let script = dir.path().join("replies");
        std::fs::write(&script, lines.join("\n") + "\n").unwrap();
        // Reads one request per reply, so replies answer requests.
        let sh = format!(
            "while IFS= read -r line; do IFS= read -r reply <&3 || exit 0; printf '%s\\n' \"$reply\"; done 3<{}",
            script.display()
        );
        let spec = EnvSpec {
            kind: EnvKind::Subprocess {
                command: vec!["sh".into(), "-c".into(), sh],
                expert: actguide::env::ExpertSource::Task,
            },
            limits: actguide::env::external::Limits {
                timeout: std::time::Duration::from_secs(5),
                retries: 0,
            },
            ..EnvSpec::builtin(actguide::env::BuiltinEnv::Household)
        };
        let task = read_jsonl(&root().join("envs/household/test.jsonl")).unwrap()[0].clone();
        let mut env = make_env(&spec, 3);
        if env.reset(&task).is_ok() {
            for a in ["look", "go to cabinet 1", "inventory"] {
                if env.step(a).is_err() {
                    break;
                }
            }
        }
    }

    /// The server end: `serve-env --protocol stdio` fed arbitrary lines
    /// answers each (or ends) without panicking.
    #[test]
    fn serve_env_stdio_never_panics_on_requests(
        reqs in prop::collection::vec(prop_oneof![
            text(),
            reply_value().prop_map(|v| v.to_string()),
            (prop_oneof![Just("hello"), Just("reset"), Just("step"), Just("expert"), Just("close"), Just("x")],
             reply_value())
                .prop_map(|(op, v)| serde_json::json!({"op": op, "id": 1, "version": 1, "task": v, "action": v}).to_string()),
        ], 1..6),
    ) {
        let mut child = Command::new(BIN)
            .args(["serve-env", "--protocol", "stdio"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        {
            let mut stdin = child.stdin.take().unwrap();
            for r in &reqs {
                // A line is one request: newlines inside would split it.
                let _ = writeln!(stdin, "{}", r.replace('\n', " "));
            }
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        prop_assert!(!stderr.contains("panicked"), "{}", stderr);
        prop_assert!(out.status.code() != Some(101), "{}", stderr);
    }
}
