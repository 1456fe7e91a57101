//! Rollouts on engine servers (`rollout.engine`):
//! - the request and reply shapes of llama.cpp, vLLM and SGLang against
//!   recorded bodies from their documentation and sources
//!   (`tests/fixtures/engines/`);
//! - a LoRA run whose rollouts come from two launched servers (the
//!   reference server, `actguide dev engine-reference`, which samples from the
//!   same policy): the engine's behaviour log-probs match the trainer's own
//!   before and after each weight sync, and every step's weights reach the
//!   servers;
//! - one of two servers killed mid-run: the run completes, the dead
//!   server's episodes are reported, nothing else is lost;
//! - the same run on a real llama.cpp server when one is built
//!   (scripts/build-llama-server.sh), skipped with a message otherwise.

mod common;

use std::path::{Path, PathBuf};

use actguide::experiment::{self, Event, Experiment, RunOptions};
use actguide::inference::{Api, Request};
use serde_json::Value;

use common::children_of;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(name: &str) -> Value {
    let p = root().join("tests/fixtures/engines").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// Every key of our request body is a documented key of the engine's
/// (the recorded request), with a value of the same JSON type.
fn assert_documented(ours: &Value, doc: &Value, what: &str) {
    let (Some(o), Some(d)) = (ours.as_object(), doc.as_object()) else {
        panic!("{what}: not objects");
    };
    for (k, v) in o {
        let dv = d
            .get(k)
            .unwrap_or_else(|| panic!("{what}: `{k}` is not in the documented request"));
        let kind = |v: &Value| match v {
            Value::Number(_) => "number",
            Value::String(_) => "string",
            Value::Bool(_) => "bool",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
            Value::Null => "null",
        };
        assert_eq!(kind(v), kind(dv), "{what}: `{k}` has another type");
        if v.is_object() {
            assert_documented(v, dv, &format!("{what}.{k}"));
        }
    }
}

#[test]
fn request_and_reply_shapes_match_the_engines_documented_bodies() {
    let answers = vec!["Hello!".to_string(), "Goodbye.".to_string()];
    let prompt = [151644u32, 872, 198, 9707, 151645, 198, 151644, 77091, 198];
    let req = Request {
        prompt: &prompt,
        answers: Some(&answers),
        max_new_tokens: 16,
        temperature: 1.0,
        top_p: 1.0,
        stop: 151645,
        seed: 1234,
        model: "adapter_a",
    };
    let vllm = Api::Vllm.body(&req);
    assert_documented(&vllm, &fixture("vllm_completions_request.json"), "vLLM");
    assert_eq!(
        vllm["structured_outputs"]["choice"],
        serde_json::json!(answers)
    );
    let sgl = Api::Sglang.body(&req);
    assert_documented(&sgl, &fixture("sglang_generate_request.json"), "SGLang");
    assert_eq!(
        sgl["sampling_params"]["regex"],
        fixture("sglang_generate_request.json")["sampling_params"]["regex"]
    );
    let lcpp = Api::LlamaCpp.body(&req);
    let doc = fixture("llamacpp_completion_request.json");
    for k in lcpp.as_object().unwrap().keys() {
        // top_k/min_p/typical_p/repeat_penalty switch llama.cpp's default
        // samplers off; its README documents them with the others.
        let extra = ["top_k", "min_p", "typical_p", "repeat_penalty", "stream"];
        assert!(
            doc.get(k).is_some() || extra.contains(&k.as_str()),
            "llama.cpp: `{k}` is not in the documented request"
        );
    }

    // Replies: the three generated tokens and their log-probs; vLLM and
    // SGLang report the stop token too here, so nothing is appended.
    let r = Api::Vllm
        .parse(&fixture("vllm_completions_response.json"), 151645)
        .unwrap();
    assert_eq!(r.tokens, vec![9707, 0, 151645]);
    assert_eq!(r.logprobs, vec![-0.9163, 0.0, 0.0]);
    assert!(r.finished);
    let r = Api::Sglang
        .parse(&fixture("sglang_generate_response.json"), 151645)
        .unwrap();
    assert_eq!(r.tokens, vec![9707, 0, 151645]);
    assert_eq!(r.logprobs, vec![-0.9163, 0.0, 0.0]);
    assert!(r.finished);
    let r = Api::LlamaCpp
        .parse(&fixture("llamacpp_completion_response.json"), 151645)
        .unwrap();
    assert_eq!(r.tokens, vec![9707, 0, 151645]);
    assert_eq!(r.logprobs.len(), 3);
    assert!(r.finished);
    // A reply that ended without reporting the stop token gets it, with
    // no behaviour log-prob (NaN).
    let mut v = fixture("sglang_generate_response.json");
    v["meta_info"]["output_token_logprobs"] = serde_json::json!([[-0.5, 9707, null]]);
    let r = Api::Sglang.parse(&v, 151645).unwrap();
    assert_eq!(r.tokens, vec![9707, 151645]);
    assert!(r.logprobs[1].is_nan());
}

/// A wrapper that starts `program` in llama-server's place (the run passes
/// llama-server's flags to it).
fn server_program(dir: &Path, program: &str, pre: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("server.sh");
    std::fs::write(&p, format!("#!/bin/sh\nexec {program} {pre} \"$@\"\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// The tiny chat GGUF and a program that serves it with the reference
/// server, in `dir`.
fn tiny_with_reference(dir: &Path) -> (PathBuf, PathBuf) {
    let gguf = dir.join("tiny-chat.gguf");
    common::tiny_chat_gguf(&gguf);
    let prog = server_program(dir, env!("CARGO_BIN_EXE_actguide"), "dev engine-reference");
    (gguf, prog)
}

fn engine_exp(runs: &Path, gguf: &Path, program: &Path, count: usize, steps: usize) -> Experiment {
    Experiment::from_source(
        "engine.rhai",
        &engine_src(runs, gguf, program, count, steps),
    )
    .expect("valid experiment")
}

/// The experiment file of [`engine_exp`].
fn engine_src(runs: &Path, gguf: &Path, program: &Path, count: usize, steps: usize) -> String {
    let r = root().display().to_string();
    format!(
        r#"#{{
                name: "engine", seed: 3, steps: {steps}, runs_dir: "{runs}",
                model: #{{ path: "{g}", lora: #{{ rank: 4, alpha: 8.0 }} }},
                env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 3 }},
                guidance: #{{ script: "{r}/scripts/guidance/gaussian.rhai", clusters: 3 }},
                rollout: #{{
                    format: "chat", tasks_per_step: 3, group_size: 4, history: 0, show_actions: false,
                    engine: #{{ kind: "openai", api: "llama.cpp", timeout_s: 60.0, max_concurrency: 2,
                               launch: #{{ program: "{p}", count: {count} }} }},
                }},
                trainer: #{{ lr: 0.05, micro_batch: 16, aux_nll_coef: 1.0 }},
                evaluation: #{{ every: 0, max_tasks: 1, samples: 1 }},
                checkpoint: #{{ every: 0 }},
            }}"#,
        runs = runs.display(),
        g = gguf.display(),
        p = program.display(),
    )
}

fn metrics(run_dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn rollouts_on_launched_servers_match_the_trainers_log_probs_across_syncs() {
    // LoRA runs hand the servers the adapter (a llama.cpp LoRA GGUF beside
    // a base written once); `launch.adapter: false` the merged model.
    for adapter in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let (gguf, prog) = tiny_with_reference(tmp.path());
        let src = engine_src(tmp.path(), &gguf, &prog, 2, 3)
            .replace("count: 2 }", &format!("count: 2, adapter: {adapter} }}"));
        let e = Experiment::from_source("engine.rhai", &src).unwrap();
        let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
        let m = metrics(&s.run_dir);
        assert_eq!(m.len(), 3);
        for (i, line) in m.iter().enumerate() {
            let en = &line["engine"];
            // Rollouts of step i come from the weights after step i's sync.
            assert_eq!(en["version"], i as u64, "{en}");
            assert!(en["tokens"].as_u64().unwrap() > 0, "{en}");
            // The reference server samples from the same weights: only
            // float noise between batched and single-sequence scoring
            // remains. A server still on the previous step's weights, or
            // an adapter with its Q/K rows in the wrong order, would be
            // far off (lr 0.05).
            let mm = en["mismatch_max"].as_f64().unwrap();
            assert!(
                mm < 1e-3,
                "adapter {adapter}, step {i}: behaviour log-probs differ by {mm}: {en}"
            );
            assert_eq!(en["failed_episodes"], 0);
            assert_eq!(en["synced"], 2);
            let served: u64 = en["servers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["served"].as_u64().unwrap())
                .sum();
            assert!(served > 0);
            assert!(line["episodes"].as_u64().unwrap() == 12, "{line}");
        }
        // The weights changed every step (the auxiliary NLL on executed
        // expert actions trains even when no rollout succeeds).
        assert!(m.iter().all(|l| l["grad_norm"].as_f64().unwrap() > 0.0));
        let dir = s.run_dir.join("engine");
        let bytes = m[2]["engine"]["sync_bytes"].as_u64().unwrap();
        if adapter {
            let base = std::fs::metadata(dir.join("policy-base.gguf"))
                .unwrap()
                .len();
            let last = std::fs::metadata(dir.join("adapter-v000003.gguf"))
                .unwrap()
                .len();
            assert_eq!(bytes, last);
            assert!(bytes * 4 < base, "adapter {bytes} B against base {base} B");
            assert!(!dir.join("adapter-v000001.gguf").exists());
            assert!(!dir.join("policy-v000003.gguf").exists());
        } else {
            let last = std::fs::metadata(dir.join("policy-v000003.gguf"))
                .unwrap()
                .len();
            assert_eq!(bytes, last);
            assert!(!dir.join("policy-v000001.gguf").exists());
            assert!(!dir.join("policy-base.gguf").exists());
        }
    }
}

#[test]
fn a_run_killed_with_sigkill_takes_its_launched_servers_with_it() {
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let (gguf, prog) = tiny_with_reference(tmp.path());
    let runs = tmp.path().join("runs");
    let exp = tmp.path().join("engine.rhai");
    std::fs::write(&exp, engine_src(&runs, &gguf, &prog, 2, 50)).unwrap();
    let mut run = common::spawn_run(&exp);
    // Wait for the first step's line: the servers are up and in use.
    let run_dir = runs.join("engine");
    let t0 = Instant::now();
    while std::fs::read_to_string(run_dir.join("metrics.jsonl")).map_or(0, |t| t.lines().count())
        == 0
    {
        assert!(run.try_wait().unwrap().is_none(), "the run ended early");
        assert!(t0.elapsed() < Duration::from_secs(240), "no step in 4 min");
        std::thread::sleep(Duration::from_millis(100));
    }
    let servers = || -> Vec<u64> {
        let v: Value = serde_json::from_str(
            &std::fs::read_to_string(run_dir.join("engine/servers.json")).unwrap(),
        )
        .unwrap();
        v["pids"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_u64)
            .collect()
    };
    assert_eq!(servers().len(), 2);
    // The run's children just before the kill (servers restart after
    // every step, so servers.json alone may miss a pair being started),
    // and the pids servers.json names after it.
    let mut pids = children_of(run.id());
    assert!(pids.len() >= 2, "{pids:?}");
    run.kill().unwrap(); // SIGKILL: no destructor runs
    run.wait().unwrap();
    pids.extend(servers());
    let left = common::still_alive_after(&pids, Duration::from_secs(10));
    assert!(left.is_empty(), "servers left running: {left:?}");
}

#[test]
fn a_killed_server_fails_its_episodes_and_the_run_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let (gguf, prog) = tiny_with_reference(tmp.path());
    let e = engine_exp(tmp.path(), &gguf, &prog, 2, 4);
    let run_dir = e.run_dir();
    // Kill server 0 when step 1 has ended (its sync has restarted both
    // servers and rewritten servers.json), before step 2's rollouts.
    let mut dead = String::new();
    let mut on_event = |ev: Event| {
        if let Event::Step { step: 0, .. } = ev {
            let v: Value = serde_json::from_str(
                &std::fs::read_to_string(run_dir.join("engine/servers.json")).unwrap(),
            )
            .unwrap();
            let pid = v["pids"][0].as_u64().unwrap();
            dead = v["urls"][0].as_str().unwrap().to_string();
            let ok = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status()
                .unwrap()
                .success();
            assert!(ok);
        }
    };
    let s = experiment::run(e, &RunOptions::default(), &mut on_event).unwrap();
    assert_eq!(s.steps_done, 4, "the run completed");
    let m = metrics(&s.run_dir);
    let failed: u64 = m
        .iter()
        .map(|l| l["engine"]["failed_episodes"].as_u64().unwrap())
        .sum();
    assert!(failed >= 1, "the dead server's episodes are reported");
    // Nothing else is lost: every step trained on all episodes but the
    // failed ones.
    for l in &m {
        let eps = l["episodes"].as_u64().unwrap();
        let f = l["engine"]["failed_episodes"].as_u64().unwrap();
        assert_eq!(eps + f, 12, "{l}");
        assert_eq!(l["env_errors"].as_u64().unwrap(), f);
    }
    let errors = std::fs::read_to_string(s.run_dir.join("env_errors.jsonl")).unwrap();
    assert!(
        errors.contains(&format!("engine {dead}")),
        "the failures name the server: {errors}"
    );
    // The restart at the next sync brought the killed server back.
    let last = &m[3]["engine"];
    assert_eq!(last["synced"], 2, "{last}");
}

/// `ACTGUIDE_LLAMA_SERVER`, else the build script's output.
fn llama_server() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ACTGUIDE_LLAMA_SERVER") {
        return Some(PathBuf::from(p));
    }
    let p = root().join(".llama-server/bin/llama-server");
    p.is_file().then_some(p)
}

#[test]
fn rollouts_on_a_real_llama_cpp_server_match_the_trainers_log_probs() {
    let Some(server) = llama_server() else {
        eprintln!(
            "SKIPPED: no llama.cpp server (run scripts/build-llama-server.sh, or set ACTGUIDE_LLAMA_SERVER)"
        );
        return;
    };
    // Adapter sync (llama.cpp applies our LoRA GGUF on the base) and the
    // merged model, the same run otherwise.
    let mut bytes = Vec::new();
    for adapter in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let gguf = tmp.path().join("tiny-chat.gguf");
        common::tiny_chat_gguf(&gguf);
        let src = engine_src(tmp.path(), &gguf, &server, 1, 3)
            .replace("count: 1 }", &format!("count: 1, adapter: {adapter} }}"));
        let e = Experiment::from_source("engine.rhai", &src).unwrap();
        let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
        let m = metrics(&s.run_dir);
        assert_eq!(m.len(), 3);
        for (i, line) in m.iter().enumerate() {
            let en = &line["engine"];
            assert_eq!(en["version"], i as u64);
            assert_eq!(en["failed_episodes"], 0, "{en}");
            eprintln!("llama.cpp (adapter {adapter}) step {i}: engine {en}");
            // llama.cpp computes in its own kernels (f32 weights here):
            // the log-probs agree to a few 1e-3. Steps 1 and 2 run on
            // trained adapters (lr 0.05), so a wrong layout shows there.
            let mm = en["mismatch"].as_f64().unwrap();
            assert!(
                mm < 5e-3,
                "adapter {adapter}, step {i}: mean |Δ log p| {mm}: {en}"
            );
            assert!(en["tokens"].as_u64().unwrap() > 0);
        }
        bytes.push(m[2]["engine"]["sync_bytes"].as_u64().unwrap());
    }
    assert!(
        bytes[0] * 4 < bytes[1],
        "adapter {} B, merged {} B",
        bytes[0],
        bytes[1]
    );
}

/// A stand-in vLLM server: answers `/v1/completions` with the stop token
/// alone (log-prob −1) and accepts adapters on `/v1/load_lora_adapter`
/// with a plain-text reply, as vLLM does; records every request.
fn fake_vllm(log: std::sync::Arc<std::sync::Mutex<Vec<(String, Value)>>>) -> String {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let log = log.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(stream.try_clone().unwrap());
                let mut first = String::new();
                r.read_line(&mut first).unwrap();
                let path = first.split_whitespace().nth(1).unwrap_or("").to_string();
                let mut len = 0usize;
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
                        break;
                    }
                    let lower = h.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap();
                    }
                }
                let mut buf = vec![0u8; len];
                r.read_exact(&mut buf).unwrap();
                let body: Value = serde_json::from_slice(&buf).unwrap_or(Value::Null);
                log.lock().unwrap().push((path.clone(), body.clone()));
                let (ctype, reply) = match path.as_str() {
                    "/v1/completions" => (
                        "application/json",
                        serde_json::json!({
                            "choices": [{
                                "index": 0, "text": "",
                                "logprobs": {"tokens": ["token_id:2"], "token_logprobs": [-1.0],
                                             "top_logprobs": null, "text_offset": [0]},
                                "finish_reason": "stop", "token_ids": [2]
                            }]
                        })
                        .to_string(),
                    ),
                    _ => (
                        "text/plain",
                        "Success: LoRA adapter loaded successfully.".to_string(),
                    ),
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
                    reply.len()
                );
            });
        }
    });
    url
}

#[test]
fn vllm_adapters_are_loaded_after_each_step_and_requests_name_them() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny-chat.gguf");
    common::tiny_chat_gguf(&gguf);
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let url = fake_vllm(log.clone());
    let r = root().display().to_string();
    let e = Experiment::from_source(
        "vllm.rhai",
        &format!(
            r#"#{{
                name: "vllm", seed: 3, steps: 2, runs_dir: "{runs}",
                model: #{{ path: "{g}", lora: #{{ rank: 4, alpha: 8.0 }} }},
                env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 2 }},
                guidance: #{{ script: "{r}/scripts/guidance/zero_rl.rhai" }},
                rollout: #{{
                    format: "chat", tasks_per_step: 2, group_size: 2, history: 0, show_actions: false,
                    engine: #{{ kind: "openai", api: "vllm", servers: ["{url}"], model: "org/tiny", tis_cap: 2.0 }},
                }},
                trainer: #{{ lr: 0.01 }},
                evaluation: #{{ every: 0, max_tasks: 1, samples: 1 }},
                checkpoint: #{{ every: 0 }},
            }}"#,
            runs = tmp.path().display(),
            g = gguf.display(),
        ),
    )
    .unwrap();
    let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
    let log = log.lock().unwrap();
    let completions: Vec<&Value> = log
        .iter()
        .filter(|(p, _)| p == "/v1/completions")
        .map(|(_, b)| b)
        .collect();
    // Step 1 asks the base model, step 2 the adapter loaded after step 1.
    let models: std::collections::BTreeSet<&str> = completions
        .iter()
        .map(|b| b["model"].as_str().unwrap())
        .collect();
    assert_eq!(models, ["org/tiny", "tiny-v1"].into_iter().collect());
    assert!(completions.iter().all(|b| b["structured_outputs"]["choice"]
        .as_array()
        .is_some_and(|c| !c.is_empty())));
    let loads: Vec<&Value> = log
        .iter()
        .filter(|(p, _)| p == "/v1/load_lora_adapter")
        .map(|(_, b)| b)
        .collect();
    assert_eq!(loads.len(), 2, "one adapter per optimiser step");
    assert_eq!(loads[0]["lora_name"], "tiny-v1");
    assert_eq!(loads[1]["lora_name"], "tiny-v2");
    // The adapter of the last step is a PEFT folder on disk.
    let last = PathBuf::from(loads[1]["lora_path"].as_str().unwrap());
    assert!(last.join("adapter_config.json").is_file());
    assert!(log
        .iter()
        .any(|(p, b)| p == "/v1/unload_lora_adapter" && b["lora_name"] == "tiny-v1"));
    // The engine's log-probs (−1) are not the policy's: the mismatch and
    // the truncated weights are reported.
    let m = metrics(&s.run_dir);
    let en = &m[0]["engine"];
    assert!(en["mismatch"].as_f64().unwrap() > 0.0, "{en}");
    assert_eq!(en["synced"], 1);
}

#[test]
fn bench_rollouts_measures_builtin_and_one_and_two_servers() {
    let tmp = tempfile::tempdir().unwrap();
    let (gguf, prog) = tiny_with_reference(tmp.path());
    let e = engine_exp(tmp.path(), &gguf, &prog, 1, 1);
    let b = actguide::dev::bench_rollouts::run(&e, 1, &[1, 2], Some(1), &tmp.path().join("work"))
        .unwrap();
    let shape: Vec<(&str, usize)> = b
        .rows
        .iter()
        .map(|r| (r.generation.as_str(), r.servers))
        .collect();
    assert_eq!(shape, vec![("builtin", 0), ("engine", 1), ("engine", 2)]);
    for r in &b.rows {
        assert_eq!(r.episodes, 12);
        assert_eq!(r.failed, 0, "{r:?}");
        assert!(
            r.generated_tokens > 0 && r.generated_tokens_per_s > 0.0,
            "{r:?}"
        );
    }
    assert!(b.to_string().contains("| engine | 2 |"));
}

#[test]
fn an_engine_run_on_several_devices_is_refused_before_anything_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let (gguf, prog) = tiny_with_reference(tmp.path());
    let e = engine_exp(tmp.path(), &gguf, &prog, 1, 1);
    let run_dir = e.run_dir();
    let opts = RunOptions {
        devices: vec![
            actguide::model::device::DeviceSpec::Cpu,
            actguide::model::device::DeviceSpec::Cpu,
        ],
        ..RunOptions::default()
    };
    let err = experiment::run(e, &opts, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("run it on one device"), "{err}");
    assert!(!run_dir.exists(), "nothing was started");
}

/// A reference server started on `gguf` at a free port; its stderr lines
/// arrive on `log`. Killed when dropped.
struct Reference {
    child: std::process::Child,
    addr: std::net::SocketAddr,
    log: std::sync::mpsc::Receiver<String>,
}

impl Reference {
    fn start(gguf: &Path) -> Reference {
        use std::io::BufRead;
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_actguide"))
            .args(["dev", "engine-reference"])
            .args(["-m", &gguf.display().to_string()])
            .args(["--port", &addr.port().to_string()])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, log) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let _ = tx.send(line);
            }
        });
        let s = Reference { child, addr, log };
        let t0 = std::time::Instant::now();
        while s.try_request("GET", "/health", "").is_none() {
            assert!(t0.elapsed().as_secs() < 60, "the server did not start");
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        s
    }

    /// The status and JSON body of one request, None if nobody answered.
    fn try_request(&self, method: &str, path: &str, body: &str) -> Option<(u16, Value)> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(self.addr).ok()?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut reply = String::new();
        s.read_to_string(&mut reply).ok()?;
        let status = reply.split_whitespace().nth(1)?.parse().ok()?;
        let json = serde_json::from_str(reply.split_once("\r\n\r\n")?.1).ok()?;
        Some((status, json))
    }

    fn complete(&self, body: Value) -> (u16, Value) {
        self.try_request("POST", "/completion", &body.to_string())
            .expect("an answer")
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_reference_server_refuses_a_request_past_the_models_positions_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny-chat.gguf");
    common::tiny_chat_gguf(&gguf); // 8192 positions
    let server = Reference::start(&gguf);
    let prompt = |n: usize| vec![100u32; n];

    let t0 = std::time::Instant::now();
    let (status, v) =
        server.complete(serde_json::json!({ "prompt": prompt(9000), "n_predict": 16 }));
    assert!(t0.elapsed().as_secs() < 10, "refused before any compute");
    assert_eq!(status, 400, "{v}");
    let e = &v["error"];
    assert_eq!(e["code"], 400);
    assert_eq!(e["type"], "exceed_context_size_error");
    assert_eq!(e["n_prompt_tokens"], 9000);
    assert_eq!(e["n_ctx"], 8192);
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains("9000") && msg.contains("8192"), "{msg}");

    // A short prompt with an n_predict past the positions, or a huge one.
    for n in [9000.0, 1e15] {
        let (status, v) =
            server.complete(serde_json::json!({ "prompt": prompt(100), "n_predict": n }));
        assert_eq!(status, 400, "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("100 prompt tokens") && msg.contains("8192"),
            "{msg}"
        );
    }

    // What fits is served; n_predict -1 (llama.cpp's "until the context is
    // full") stops at the last position.
    let (status, v) = server.complete(serde_json::json!({ "prompt": prompt(10), "n_predict": 4 }));
    assert_eq!(status, 200, "{v}");
    assert!(
        (1..=4).contains(&v["tokens"].as_array().unwrap().len()),
        "{v}"
    );
    let (status, v) =
        server.complete(serde_json::json!({ "prompt": prompt(8190), "n_predict": -1 }));
    assert_eq!(status, 200, "{v}");
    assert!(
        (1..=2).contains(&v["tokens"].as_array().unwrap().len()),
        "{v}"
    );
}

#[test]
fn the_reference_server_stops_generating_when_its_client_leaves() {
    use std::io::Write;
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny-chat.gguf");
    common::tiny_chat_gguf(&gguf);
    let server = Reference::start(&gguf);
    // The grammar's one answer forces 3000 tokens (one per byte: the
    // vocabulary merges no "aa").
    let answer = "a".repeat(3000);
    let body = serde_json::json!({
        "prompt": [1, 100, 101],
        "n_predict": 4000,
        "grammar": format!("root ::= \"{answer}\""),
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(server.addr).unwrap();
    write!(
        s,
        "POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The client leaves without waiting for the answer.
    drop(s);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let line = loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let line = server
            .log
            .recv_timeout(left)
            .expect("the server says it stopped");
        if line.contains("client closed the connection") {
            break line;
        }
    };
    let generated: usize = line
        .split("after ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(generated < 3000, "{line}");
    // The server is free for the next client at once.
    let (status, v) = server.complete(serde_json::json!({ "prompt": [1, 100], "n_predict": 2 }));
    assert_eq!(status, 200, "{v}");
}

/// `rollout.async`: each step after the first was driven while the one
/// before it trained; every trained episode carries the version it was
/// sampled at, the lag is counted, and episodes past `max_staleness`
/// leave the batch. The reference server samples from exactly the
/// weights it was given, so the behaviour mismatch shows whether the
/// version tags are right: on-policy episodes agree to float noise, and
/// one-version-old ones (lr 0.05) visibly differ.
#[test]
fn asynchronous_rollouts_overlap_the_update_and_account_for_their_lag() {
    let tmp = tempfile::tempdir().unwrap();
    let (gguf, prog) = tiny_with_reference(tmp.path());
    for k in [1u64, 0] {
        let src = engine_src(tmp.path(), &gguf, &prog, 1, 4)
            .replace(r#"name: "engine""#, &format!(r#"name: "async{k}""#))
            .replace(
                "engine: #{ kind",
                &format!(r#""async": #{{ max_staleness: {k} }}, engine: #{{ kind"#),
            );
        let e = Experiment::from_source("async.rhai", &src).expect("valid experiment");
        assert!(e.rollout.async_rollouts.is_some());
        let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
        let m = metrics(&s.run_dir);
        assert_eq!(m.len(), 4);
        let mut old = 0u64;
        for (i, line) in m.iter().enumerate() {
            let a = &line["async"];
            assert_eq!(a["version"], i as u64, "{a}");
            assert_eq!(a["max_staleness"], k);
            // The first step has no step before it to overlap.
            assert_eq!(a["overlapped"], i > 0, "{a}");
            let lag: Vec<u64> = a["lag"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            assert!(
                lag.len() <= 2,
                "one step of overlap: at most 1 behind ({a})"
            );
            let behind = lag.get(1).copied().unwrap_or(0);
            old += behind;
            let dropped = a["dropped"].as_u64().unwrap();
            assert_eq!(dropped, if k == 0 { behind } else { 0 }, "{a}");
            assert_eq!(
                lag.iter().sum::<u64>(),
                line["episodes"].as_u64().unwrap() + dropped,
                "every training episode counted once ({line})"
            );
            let en = &line["engine"];
            assert_eq!(en["failed_episodes"], 0, "{en}");
            let mm = en["mismatch_max"].as_f64().unwrap();
            if behind > dropped {
                assert!(
                    mm > 1e-3,
                    "step {i}: old episodes trained, mismatch {mm}: {en}"
                );
            } else {
                assert!(
                    mm < 1e-3,
                    "step {i}: only on-policy episodes, mismatch {mm}: {en}"
                );
            }
        }
        eprintln!("max_staleness {k}: {old} episodes one version behind over 4 steps");
    }
}
