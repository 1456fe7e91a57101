//! LoRA and model sources in the run loop: a LoRA run trains and
//! checkpoints the adapters alone, resumes exactly and exports a merged HF
//! folder (and a PEFT adapter folder) that load back with the same logits;
//! a `.gguf` model path runs with its own tokenizer and chat template; and
//! bad LoRA settings are refused before anything starts.

mod common;

use std::path::{Path, PathBuf};

use actguide::experiment::export::{export, ExportOptions};
use actguide::experiment::{self, eval, Experiment, RunOptions};
use actguide::model::{ModelSource, Policy, ScoreBatch};
use candle_core::Device;
use serde_json::Value as Json;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn exp(src: &str) -> Experiment {
    Experiment::from_source("test.rhai", src).expect("valid experiment")
}

/// A short LoRA experiment on the tiny model (plain prompts).
fn tiny_lora(runs: &Path, name: &str) -> Experiment {
    let r = root().display().to_string();
    exp(&format!(
        r#"#{{
            name: "{name}", seed: 5, steps: 4, runs_dir: "{runs}",
            model: #{{ path: "{r}/models/tiny",
                       lora: #{{ rank: 4, alpha: 8.0, dropout: 0.1, targets: ["q_proj", "v_proj", "down_proj"] }} }},
            env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 6 }},
            guidance: #{{ script: "{r}/scripts/guidance/gaussian.rhai", clusters: 3 }},
            rollout: #{{ tasks_per_step: 3, group_size: 4 }},
            trainer: #{{ lr: 0.01, kl_coef: 0.01, aux_nll_coef: 0.5, micro_batch: 16 }},
            evaluation: #{{ every: 2, max_tasks: 4 }},
            checkpoint: #{{ every: 2 }},
        }}"#,
        runs = runs.display(),
    ))
}

fn metrics(run_dir: &Path) -> Vec<Json> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Json = serde_json::from_str(l).unwrap();
            v.as_object_mut().unwrap().remove("time");
            v
        })
        .collect()
}

fn logp(p: &Policy, seqs: &[Vec<u32>]) -> Vec<f32> {
    let batch = ScoreBatch {
        seqs: seqs.to_vec(),
        targets: seqs.iter().map(|s| (1..s.len()).collect()).collect(),
        temperature: 1.0,
        share_prefixes: false,
    };
    p.score(&batch).unwrap().logp.to_vec1().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn lora_run_checkpoints_adapters_resumes_exactly_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let full = experiment::run(
        tiny_lora(tmp.path(), "full"),
        &RunOptions::default(),
        &mut |_| {},
    )
    .unwrap();
    let part = tiny_lora(tmp.path(), "part");
    let dir = part.run_dir();
    let stop = RunOptions {
        stop_after: Some(3),
        ..Default::default()
    };
    experiment::run(part.clone(), &stop, &mut |_| {}).unwrap();
    let resume = RunOptions {
        resume: Some(dir.clone()),
        ..Default::default()
    };
    experiment::run(part, &resume, &mut |_| {}).unwrap();
    assert_eq!(metrics(&full.run_dir).len(), 4);
    assert_eq!(metrics(&full.run_dir), metrics(&dir));

    // Checkpoints hold the adapters alone, in PEFT's layout.
    let ck = full.run_dir.join("checkpoints/step-000004");
    assert!(!ck.join("model.safetensors").exists());
    let adapters = std::fs::read(ck.join("adapter_model.safetensors")).unwrap();
    assert_eq!(
        adapters,
        std::fs::read(dir.join("checkpoints/step-000004/adapter_model.safetensors")).unwrap()
    );
    let cfg: Json =
        serde_json::from_str(&std::fs::read_to_string(ck.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 4);
    assert!(cfg["base_model_name_or_path"]
        .as_str()
        .unwrap()
        .ends_with("models/tiny"));
    assert!(ck.join("tokenizer.json").exists() && ck.join("config.json").exists());

    // The trained policy: adapters moved away from zero, base untouched.
    let m = eval::load_run(&full.run_dir, None).unwrap();
    assert_eq!(m.trained.lora().unwrap().rank, 4);
    assert_eq!(m.trained.named_vars().len(), 2 * 3 * 2);
    let b_norm: f32 = m
        .trained
        .adapter_tensors()
        .iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .map(|(_, t)| {
            t.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .sum();
    assert!(b_norm > 0.0, "LoRA B stayed zero: nothing was learned");
    for ((n, a), (_, b)) in m
        .trained
        .named_tensors()
        .iter()
        .zip(m.initial.named_tensors())
    {
        let d: f32 = (a - &b)
            .unwrap()
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert_eq!(d, 0.0, "base weight {n} changed");
    }
    let seqs = vec![
        m.tok.encode("go to fridge 1").unwrap(),
        m.tok.encode("take apple 1 from countertop 1").unwrap(),
    ];
    let want = logp(&m.trained, &seqs);
    assert!(max_diff(&want, &logp(&m.initial, &seqs)) > 1e-4);

    // Export: merged full folder, and the adapters alone.
    let merged = tmp.path().join("merged");
    let s = export(&full.run_dir, &merged, &ExportOptions::default()).unwrap();
    assert_eq!((s.kind, s.merged_lora, s.step), ("full", true, 4));
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(
            s.files.contains(&f.to_string()),
            "{f} missing: {:?}",
            s.files
        );
    }
    let back = Policy::from_hf_dir(&merged, &Device::Cpu).unwrap();
    assert!(back.lora().is_none());
    let d = max_diff(&want, &logp(&back, &seqs));
    assert!(d < 1e-4, "merged export differs by {d}");
    let src = ModelSource::open(&merged).unwrap();
    assert_eq!(src.tok.encode("go to fridge 1").unwrap(), seqs[0]);

    let ad = tmp.path().join("adapter");
    let s = export(
        &ck,
        &ad,
        &ExportOptions {
            adapter_only: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(s.kind, "adapter");
    let back = m.initial.frozen_copy().unwrap().merged().unwrap();
    let back = back.load_adapter(&ad).unwrap();
    assert_eq!(logp(&back, &seqs), want);
}

#[test]
fn adapter_only_export_needs_a_lora_run_and_resume_checks_the_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let mut e = tiny_lora(tmp.path(), "plain");
    e.model.lora = None;
    e.steps = 1;
    let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
    let err = export(
        &s.run_dir,
        &tmp.path().join("x"),
        &ExportOptions {
            adapter_only: true,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("--adapter-only needs a LoRA run"), "{err}");
    // Resuming a full-weight checkpoint as a LoRA run is refused.
    let mut e = tiny_lora(tmp.path(), "plain");
    e.steps = 2;
    let err = experiment::run(
        e,
        &RunOptions {
            resume: Some(s.run_dir.clone()),
            ..Default::default()
        },
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("do not match model.lora"), "{err}");
}

#[test]
fn bad_lora_settings_are_refused_with_their_key() {
    let tmp = tempfile::tempdir().unwrap();
    let r = root().display().to_string();
    let src = |lora: &str| {
        format!(
            r#"#{{ name: "x", runs_dir: "{t}", steps: 1,
                model: #{{ path: "{r}/models/tiny", lora: {lora} }},
                env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl" }},
                guidance: #{{ script: "{r}/scripts/guidance/zero_rl.rhai" }} }}"#,
            t = tmp.path().display()
        )
    };
    let err = |lora: &str| {
        Experiment::from_source("bad.rhai", &src(lora))
            .unwrap_err()
            .to_string()
    };
    let e = err("#{ rank: 0 }");
    assert!(
        e.contains("bad.rhai") && e.contains("model.lora.rank"),
        "{e}"
    );
    let e = err(r#"#{ targets: ["qkv"] }"#);
    assert!(e.contains("unknown module `qkv`"), "{e}");
    let e = err("#{ rnak: 4 }");
    assert!(e.contains("bad.rhai") && e.contains("rnak"), "{e}");
    let e = err("#{ dropout: 1.5 }");
    assert!(e.contains("model.lora.dropout"), "{e}");
}

#[test]
fn a_gguf_model_path_runs_in_chat_format_with_lora() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("tiny-chat.gguf");
    common::tiny_chat_gguf(&gguf);
    let src = ModelSource::open(&gguf).unwrap();
    assert!(src.has_weights());
    assert!(src.chat_template().unwrap().contains("<|im_start|>"));
    let r = root().display().to_string();
    let e = exp(&format!(
        r#"#{{
            name: "gguf", seed: 2, steps: 1, runs_dir: "{runs}",
            model: #{{ path: "{g}", lora: #{{ rank: 2 }} }},
            env: #{{ train: "{r}/envs/household/train.jsonl", test: "{r}/envs/household/test.jsonl", max_steps: 2 }},
            guidance: #{{ script: "{r}/scripts/guidance/gaussian.rhai", clusters: 3 }},
            rollout: #{{ format: "chat", tasks_per_step: 1, group_size: 2, history: 0, show_actions: false }},
            trainer: #{{ lr: 0.01 }},
            evaluation: #{{ every: 0, max_tasks: 1, samples: 1 }},
            checkpoint: #{{ every: 1 }},
        }}"#,
        runs = tmp.path().display(),
        g = gguf.display(),
    ));
    let s = experiment::run(e, &RunOptions::default(), &mut |_| {}).unwrap();
    let m = metrics(&s.run_dir);
    assert_eq!(m.len(), 1);
    assert!(m[0]["rollout_tokens"].as_u64().unwrap() > 0, "{}", m[0]);
    // The checkpoint carries the tokenizer files synthesised from the GGUF.
    let ck = s.run_dir.join("checkpoints/step-000001");
    let tc: Json =
        serde_json::from_str(&std::fs::read_to_string(ck.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert!(tc["chat_template"].as_str().unwrap().contains("<|im_end|>"));
    let gc: Json =
        serde_json::from_str(&std::fs::read_to_string(ck.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(gc["eos_token_id"], 2);
    // Exported: an HF folder with the same tokenizer and (merged) model.
    let out = tmp.path().join("hf");
    export(&s.run_dir, &out, &ExportOptions::default()).unwrap();
    let back = ModelSource::open(&out).unwrap();
    let text = "<|im_start|>user\nhello 123<|im_end|>";
    assert_eq!(
        back.tok.encode(text).unwrap(),
        src.tok.encode(text).unwrap()
    );
    assert_eq!(back.chat_template(), src.chat_template());
    let seqs = vec![src.tok.encode(text).unwrap()];
    let m = eval::load_run(&s.run_dir, None).unwrap();
    let hf = Policy::from_hf_dir(&out, &Device::Cpu).unwrap();
    assert!(max_diff(&logp(&m.trained, &seqs), &logp(&hf, &seqs)) < 1e-4);
}
