//! HF model folders and the Llama / Qwen2 / Qwen3 architectures of
//! [`Policy`]: round trips through `save_hf_dir` / `from_hf_dir` (single
//! file and sharded), dtype conversion, one error per kind of bad folder,
//! cross-checks of our logits against candle-transformers' independent
//! `qwen2`, `qwen3` and `llama` (llama3 rope scaling) implementations,
//! KV-cached generation against full-sequence logits, and gradients
//! reaching every parameter (biases and q/k norms included).
//!
//! Everything runs on tiny random models (hidden 64, 2 layers, 4 heads,
//! 2 kv heads, vocab 100) in temp dirs: no downloads, fast in debug.

mod common;

use std::collections::HashMap;
use std::path::Path;

use actguide::model::{
    Arch, Family, GenerateOptions, ModelConfig, ModelError, Policy, RopeScaling, ScoreBatch,
};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const VOCAB: usize = common::FAMILY_VOCAB;

fn config(family: Family, tied: bool) -> ModelConfig {
    common::family_config(family, tied, 24)
}

fn arch(family: Family) -> Arch {
    Arch {
        family,
        attention_bias: false,
        rope_scaling: None,
    }
}

fn llama3_scaling() -> RopeScaling {
    // head_dim 16, theta 1e4: wavelengths 2π .. ~2e4, so with an original
    // context of 64 the high (< 16), smoothed (16..64) and low (> 64)
    // frequency regimes all occur.
    RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    }
}

/// A random policy whose 1-D tensors are not at their init values (biases
/// 0, norms 1), so the cross-checks would notice a bias or norm applied in
/// the wrong place.
fn random_policy(cfg: &ModelConfig, arch: &Arch, seed: u64) -> Policy {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let p = Policy::new_random_with_arch(cfg, arch, &mut rng, &Device::Cpu).unwrap();
    let tensors: HashMap<String, Tensor> = p
        .named_tensors()
        .into_iter()
        .map(|(n, t)| {
            if t.rank() != 1 {
                return (n, t);
            }
            let k = t.elem_count();
            let v: Vec<f32> = if n.ends_with(".bias") {
                (0..k).map(|_| rng.random_range(-0.5..0.5)).collect()
            } else {
                (0..k).map(|_| rng.random_range(0.7..1.3)).collect()
            };
            (n, Tensor::from_vec(v, k, &Device::Cpu).unwrap())
        })
        .collect();
    Policy::from_tensors_with_arch(cfg, arch, tensors, "<test>").unwrap()
}

fn seqs(seed: u64, lens: &[usize]) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    lens.iter()
        .map(|&l| (0..l).map(|_| rng.random_range(3..VOCAB as u32)).collect())
        .collect()
}

/// Every variant under test: (label, config, arch).
fn variants() -> Vec<(&'static str, ModelConfig, Arch)> {
    let mut llama3 = arch(Family::Llama);
    llama3.rope_scaling = Some(llama3_scaling());
    let mut qwen3_bias = arch(Family::Qwen3);
    qwen3_bias.attention_bias = true;
    vec![
        ("llama", config(Family::Llama, false), arch(Family::Llama)),
        ("llama3-scaled", config(Family::Llama, true), llama3),
        ("qwen2", config(Family::Qwen2, true), arch(Family::Qwen2)),
        (
            "qwen2-untied",
            config(Family::Qwen2, false),
            arch(Family::Qwen2),
        ),
        ("qwen3", config(Family::Qwen3, true), arch(Family::Qwen3)),
        (
            "qwen3-bias-untied",
            config(Family::Qwen3, false),
            qwen3_bias,
        ),
    ]
}

fn flat(p: &Policy) -> Vec<(String, Vec<f32>)> {
    p.named_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect()
}

fn score_all(p: &Policy, seqs: &[Vec<u32>]) -> Vec<f32> {
    let batch = ScoreBatch {
        seqs: seqs.to_vec(),
        targets: seqs.iter().map(|s| (1..s.len()).collect()).collect(),
        temperature: 1.0,
        share_prefixes: false,
    };
    p.score(&batch).unwrap().logp.to_vec1().unwrap()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn log_softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let z = l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    l.iter().map(|&x| (x as f64 - m - z) as f32).collect()
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

// ----------------------------------------------------------------------
// Round trips
// ----------------------------------------------------------------------

#[test]
fn hf_dir_roundtrip_is_bit_identical() {
    let prompts = seqs(1, &[7, 12, 3]);
    for (label, cfg, arch) in variants() {
        let p = random_policy(&cfg, &arch, 2);
        let dir = tempfile::tempdir().unwrap();
        p.save_hf_dir(dir.path(), None).unwrap();
        assert_eq!(
            files_in(dir.path()),
            ["config.json", "model.safetensors"],
            "{label}"
        );
        let q = Policy::from_hf_dir(dir.path(), &Device::Cpu).unwrap();
        assert_eq!(q.config(), p.config(), "{label}");
        assert_eq!(q.arch(), p.arch(), "{label}");
        assert!(q.is_trainable());
        assert_eq!(flat(&q), flat(&p), "{label}: weights");
        assert_eq!(
            q.next_logits(&prompts).unwrap(),
            p.next_logits(&prompts).unwrap(),
            "{label}: logits"
        );
        assert_eq!(score_all(&q, &prompts), score_all(&p, &prompts), "{label}");
    }
}

#[test]
fn sharded_checkpoint_matches_single_file() {
    let prompts = seqs(3, &[9, 4]);
    for (label, cfg, arch) in variants() {
        let p = random_policy(&cfg, &arch, 4);
        let single = tempfile::tempdir().unwrap();
        p.save_hf_dir(single.path(), None).unwrap();
        let total: usize = p
            .named_tensors()
            .iter()
            .map(|(_, t)| 4 * t.elem_count())
            .sum();
        // The smallest limit (in steps of total/40) that packs into 3 shards.
        let sharded = tempfile::tempdir().unwrap();
        let limit = (4..40)
            .rev()
            .map(|k| total * k / 40)
            .find(|&limit| {
                p.save_hf_dir(sharded.path(), Some(limit)).unwrap();
                files_in(sharded.path())
                    .iter()
                    .any(|f| f.ends_with("-of-00003.safetensors"))
            })
            .unwrap_or_else(|| panic!("{label}: no limit gives 3 shards"));
        let files = files_in(sharded.path());
        assert_eq!(
            files,
            [
                "config.json",
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors",
                "model.safetensors.index.json",
            ],
            "{label} (limit {limit})"
        );
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(sharded.path().join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(index["metadata"]["total_size"], total);
        let map = index["weight_map"].as_object().unwrap();
        assert_eq!(map.len(), p.named_tensors().len());
        for f in &files[1..4] {
            let size = std::fs::metadata(sharded.path().join(f)).unwrap().len() as usize;
            // Tensor bytes plus a small JSON header.
            assert!(
                size <= limit + 4096,
                "{label}: {f} has {size} bytes > {limit}"
            );
        }
        let a = Policy::from_hf_dir(single.path(), &Device::Cpu).unwrap();
        let b = Policy::from_hf_dir(sharded.path(), &Device::Cpu).unwrap();
        assert_eq!(flat(&a), flat(&b), "{label}");
        assert_eq!(
            a.next_logits(&prompts).unwrap(),
            b.next_logits(&prompts).unwrap(),
            "{label}"
        );
        assert_eq!(score_all(&a, &prompts), score_all(&b, &prompts), "{label}");
        // Saving single-file again into the sharded folder removes the
        // shards, so the folder is never ambiguous.
        p.save_hf_dir(sharded.path(), None).unwrap();
        assert_eq!(
            files_in(sharded.path()),
            ["config.json", "model.safetensors"]
        );
    }
    // The index also loads through load_safetensors (default arch).
    let cfg = config(Family::Qwen2, true);
    let p = random_policy(&cfg, &arch(Family::Qwen2), 5);
    let dir = tempfile::tempdir().unwrap();
    p.save_hf_dir(dir.path(), Some(20_000)).unwrap();
    let idx = dir.path().join("model.safetensors.index.json");
    let q = Policy::load_safetensors(&cfg, &idx, &Device::Cpu).unwrap();
    assert_eq!(flat(&q), flat(&p));
}

#[test]
fn half_precision_weights_are_converted_to_f32() {
    let cfg = config(Family::Qwen3, true);
    let p = random_policy(&cfg, &arch(Family::Qwen3), 6);
    for dtype in [DType::BF16, DType::F16] {
        let dir = tempfile::tempdir().unwrap();
        p.save_hf_dir(dir.path(), None).unwrap();
        let half: HashMap<String, Tensor> = p
            .named_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.to_dtype(dtype).unwrap()))
            .collect();
        candle_core::safetensors::save(&half, dir.path().join("model.safetensors")).unwrap();
        let q = Policy::from_hf_dir(dir.path(), &Device::Cpu).unwrap();
        for (n, t) in q.named_tensors() {
            assert_eq!(t.dtype(), DType::F32, "{n}");
            // Half -> f32 is exact: the loaded weights are the rounded ones.
            let want: Vec<f32> = half[&n]
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want,
                "{n}"
            );
        }
        let prompts = seqs(7, &[6]);
        let d = max_abs_diff(
            &q.next_logits(&prompts).unwrap()[0],
            &p.next_logits(&prompts).unwrap()[0],
        );
        assert!(d < 0.1, "{dtype:?}: logits moved by {d}");
    }
}

// ----------------------------------------------------------------------
// Bad folders
// ----------------------------------------------------------------------

fn saved(family: Family, shards: Option<usize>) -> (tempfile::TempDir, Policy) {
    let cfg = config(family, true);
    let p = random_policy(&cfg, &arch(family), 8);
    let dir = tempfile::tempdir().unwrap();
    p.save_hf_dir(dir.path(), shards).unwrap();
    (dir, p)
}

fn load_err(dir: &Path) -> (ModelError, String) {
    let e = Policy::from_hf_dir(dir, &Device::Cpu).unwrap_err();
    let msg = e.to_string();
    (e, msg)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

fn rewrite_weights(file: &Path, f: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let mut map = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
    f(&mut map);
    candle_core::safetensors::save(&map, file).unwrap();
}

#[test]
fn missing_files_are_named() {
    let (dir, _) = saved(Family::Qwen2, None);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, ModelError::MissingFile { .. }), "{msg}");
    assert!(msg.contains("config.json"), "{msg}");

    let (dir, _) = saved(Family::Qwen2, None);
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, ModelError::MissingFile { .. }), "{msg}");
    assert!(
        msg.contains("model.safetensors") && msg.contains("model.safetensors.index.json"),
        "{msg}"
    );

    let (dir, _) = saved(Family::Qwen2, Some(20_000));
    let shard = files_in(dir.path())
        .into_iter()
        .find(|f| f.starts_with("model-00002-of-"))
        .unwrap();
    std::fs::remove_file(dir.path().join(&shard)).unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, ModelError::MissingFile { .. }), "{msg}");
    assert!(msg.contains(&shard) && msg.contains("index.json"), "{msg}");
}

#[test]
fn bad_tensors_are_named() {
    // Missing tensor, single file: names the file and the tensor.
    let (dir, _) = saved(Family::Qwen3, None);
    let file = dir.path().join("model.safetensors");
    rewrite_weights(&file, |m| {
        m.remove("model.layers.1.self_attn.k_norm.weight");
    });
    let (e, msg) = load_err(dir.path());
    assert!(
        matches!(&e, ModelError::MissingTensor { name, .. } if name == "model.layers.1.self_attn.k_norm.weight"),
        "{msg}"
    );
    assert!(
        msg.contains("model.safetensors") && msg.contains("k_norm"),
        "{msg}"
    );

    // Missing tensor, sharded: names the shard the index puts it in.
    let (dir, _) = saved(Family::Qwen2, Some(20_000));
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let name = "model.layers.0.self_attn.v_proj.bias";
    let shard = index["weight_map"][name].as_str().unwrap().to_string();
    rewrite_weights(&dir.path().join(&shard), |m| {
        m.remove(name);
    });
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, ModelError::MissingTensor { .. }), "{msg}");
    assert!(msg.contains(&shard) && msg.contains(name), "{msg}");

    // Wrong shape: tensor, expected and found shapes.
    let (dir, _) = saved(Family::Qwen2, None);
    let file = dir.path().join("model.safetensors");
    rewrite_weights(&file, |m| {
        m.insert(
            "model.layers.1.self_attn.k_proj.bias".into(),
            Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap(),
        );
    });
    let (e, msg) = load_err(dir.path());
    assert!(
        matches!(&e, ModelError::Shape { name, expected, got, .. }
            if name == "model.layers.1.self_attn.k_proj.bias" && expected == &[32] && got == &[64]),
        "{msg}"
    );
    assert!(
        msg.contains("model.safetensors") && msg.contains("[32]") && msg.contains("[64]"),
        "{msg}"
    );

    // Non-float weights (e.g. a quantized checkpoint).
    let (dir, _) = saved(Family::Llama, None);
    let file = dir.path().join("model.safetensors");
    rewrite_weights(&file, |m| {
        m.insert(
            "model.norm.weight".into(),
            Tensor::zeros(64, DType::U32, &Device::Cpu).unwrap(),
        );
    });
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, ModelError::Dtype { .. }), "{msg}");
    assert!(
        msg.contains("model.norm.weight") && msg.contains("U32"),
        "{msg}"
    );

    // A Qwen2 checkpoint under a Llama config: the biases are refused, not
    // silently dropped.
    let (dir, _) = saved(Family::Qwen2, None);
    edit_config(dir.path(), |v| {
        v["model_type"] = "llama".into();
        v["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    });
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, ModelError::UnexpectedTensor { .. }), "{msg}");
    assert!(
        msg.contains("model.safetensors") && msg.contains("_proj.bias"),
        "{msg}"
    );

    // Unreadable files.
    let (dir, _) = saved(Family::Llama, None);
    std::fs::write(dir.path().join("model.safetensors"), b"not safetensors").unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, ModelError::Checkpoint { .. }), "{msg}");
    assert!(msg.contains("model.safetensors"), "{msg}");
    let (dir, _) = saved(Family::Llama, Some(20_000));
    std::fs::write(dir.path().join("model.safetensors.index.json"), "{}").unwrap();
    let (e, msg) = load_err(dir.path());
    assert!(matches!(e, ModelError::Checkpoint { .. }), "{msg}");
    assert!(
        msg.contains("index.json") && msg.contains("weight_map"),
        "{msg}"
    );
}

/// An in-place edit of a `config.json` value.
type ConfigEdit = Box<dyn Fn(&mut serde_json::Value)>;

#[test]
fn bad_configs_are_named() {
    let cases: Vec<(&str, ConfigEdit, &[&str])> = vec![
        (
            "unknown model_type",
            Box::new(|v| {
                v["model_type"] = "mistral".into();
                v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
            }),
            &["config.json", "model_type", "mistral"],
        ),
        (
            "unknown architecture",
            Box::new(|v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"])),
            &["config.json", "architectures", "GPT2LMHeadModel"],
        ),
        (
            "family mismatch",
            Box::new(|v| v["architectures"] = serde_json::json!(["Qwen2ForCausalLM"])),
            &["config.json", "Qwen2ForCausalLM", "qwen3"],
        ),
        (
            "unsupported rope scaling",
            Box::new(|v| {
                v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})
            }),
            &["config.json", "rope_scaling", "yarn"],
        ),
        (
            "sliding window",
            Box::new(|v| v["use_sliding_window"] = true.into()),
            &["config.json", "use_sliding_window"],
        ),
        (
            "activation",
            Box::new(|v| v["hidden_act"] = "gelu".into()),
            &["config.json", "hidden_act"],
        ),
    ];
    for (what, edit, needles) in cases {
        let (dir, _) = saved(Family::Qwen3, None);
        edit_config(dir.path(), edit);
        let (e, msg) = load_err(dir.path());
        if what.starts_with("unknown") || what == "family mismatch" {
            assert!(
                matches!(e, ModelError::UnknownArchitecture { .. }),
                "{what}: {msg}"
            );
        }
        for n in needles {
            assert!(msg.contains(n), "{what}: `{n}` not in: {msg}");
        }
    }
}

#[test]
fn real_hf_configs_parse() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    let parse = |text: &str| {
        std::fs::write(&path, text).unwrap();
        ModelConfig::from_file_with_arch(&path)
    };
    // Qwen2.5-0.5B-Instruct (abridged only by dropping nothing that matters).
    let (c, a) = parse(
        r#"{"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
        "use_cache": true, "use_sliding_window": false, "vocab_size": 151936}"#,
    )
    .unwrap();
    assert_eq!(a, arch(Family::Qwen2));
    assert!(a.qkv_bias() && !a.o_bias() && !a.qk_norm());
    assert_eq!((c.head_dim(), c.tie_word_embeddings), (64, true));
    // Qwen3-0.6B: explicit head_dim 128 != 1024 / 16.
    let (c, a) = parse(
        r#"{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
        "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
        "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
        "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false,
        "vocab_size": 151936}"#,
    )
    .unwrap();
    assert_eq!(a, arch(Family::Qwen3));
    assert!(a.qk_norm() && !a.qkv_bias());
    assert_eq!(c.head_dim(), 128);
    // Llama-3.2-1B: llama3 rope scaling, list eos.
    let llama32 = r#"{"architectures": ["LlamaForCausalLM"], "attention_bias": false,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "use_cache": true, "vocab_size": 128256}"#;
    let (c, a) = parse(llama32).unwrap();
    assert_eq!(c.eos_token_id, Some(128001));
    assert_eq!(
        a.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        })
    );
    // The plain loader refuses what it would drop.
    let e = ModelConfig::from_file(&path).unwrap_err().to_string();
    assert!(
        e.contains("rope_scaling") && e.contains("from_hf_dir"),
        "{e}"
    );
    // SmolLM2 is a plain llama (no architectures given: inferred class).
    let (c, a) = parse(
        r#"{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
        "rope_theta": 100000, "rms_norm_eps": 1e-05, "max_position_embeddings": 8192,
        "tie_word_embeddings": true, "vocab_size": 49152, "rope_scaling": null}"#,
    )
    .unwrap();
    assert_eq!(a, arch(Family::Llama));
    assert_eq!(c.architectures, ["LlamaForCausalLM"]);
    assert_eq!(ModelConfig::from_file(&path).unwrap(), c);
    // The built-in tiny model cards are unchanged plain Llama configs.
    for card in ["tiny", "tiny-shop", "tiny-searchqa"] {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models")
            .join(card)
            .join("config.json");
        let c = ModelConfig::from_file(&p).unwrap();
        let (c2, a) = ModelConfig::from_file_with_arch(&p).unwrap();
        assert_eq!((c2, a), (c.clone(), arch(Family::Llama)), "{card}");
        assert_eq!(Arch::from_config(&c).unwrap(), arch(Family::Llama));
    }
}

// ----------------------------------------------------------------------
// Independent references: candle-transformers
// ----------------------------------------------------------------------

/// Our logits (generation path via `next_logits`, and the training path's
/// log-probs) for every prefix of `seq`, against `reference(prefix)`;
/// returns (max |logit diff|, max |logp diff|).
fn compare(p: &Policy, seq: &[u32], mut reference: impl FnMut(&[u32]) -> Vec<f32>) -> (f32, f32) {
    let prefixes: Vec<Vec<u32>> = (1..=seq.len()).map(|k| seq[..k].to_vec()).collect();
    let ours = p.next_logits(&prefixes).unwrap();
    let lp = score_all(p, &[seq.to_vec()]);
    let (mut dl, mut dp) = (0f32, 0f32);
    for (k, prefix) in prefixes.iter().enumerate() {
        let want = reference(prefix);
        dl = dl.max(max_abs_diff(&ours[k], &want));
        if k + 1 < seq.len() {
            let want_lp = log_softmax(&want)[seq[k + 1] as usize];
            dp = dp.max((lp[k] - want_lp).abs());
        }
    }
    (dl, dp)
}

fn var_builder(p: &Policy) -> candle_nn::VarBuilder<'static> {
    let map: HashMap<String, Tensor> = p.named_tensors().into_iter().collect();
    candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu)
}

/// The saved config.json plus the fields candle-transformers' structs
/// require without defaults.
fn ct_config_json(p: &Policy) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    p.save_hf_dir(dir.path(), None).unwrap();
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
            .unwrap();
    // No sliding window in effect (larger than any sequence here).
    v["sliding_window"] = 4096.into();
    v["max_window_layers"] = 2.into();
    v["use_sliding_window"] = false.into();
    v["head_dim"] = p.config().head_dim().into();
    v
}

const TOL: f32 = 1e-4;

#[test]
fn qwen2_matches_candle_transformers() {
    use candle_transformers::models::qwen2 as ct;
    let seq = &seqs(10, &[13])[0];
    for tied in [true, false] {
        let cfg = config(Family::Qwen2, tied);
        let p = random_policy(&cfg, &arch(Family::Qwen2), 11);
        let c: ct::Config = serde_json::from_value(ct_config_json(&p)).unwrap();
        let mut m = ct::ModelForCausalLM::new(&c, var_builder(&p)).unwrap();
        let (dl, dp) = compare(&p, seq, |prefix| {
            m.clear_kv_cache();
            let x = Tensor::new(prefix, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            m.forward(&x, 0)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        });
        eprintln!("qwen2 tied={tied}: max |logit diff| {dl:.2e}, max |logp diff| {dp:.2e}");
        assert!(dl < TOL && dp < TOL, "qwen2 tied={tied}: {dl} {dp}");
    }
}

#[test]
fn qwen3_matches_candle_transformers() {
    use candle_transformers::models::qwen3 as ct;
    let seq = &seqs(12, &[13])[0];
    for (tied, bias) in [(true, false), (false, true)] {
        let cfg = config(Family::Qwen3, tied);
        let mut a = arch(Family::Qwen3);
        a.attention_bias = bias;
        let p = random_policy(&cfg, &a, 13);
        let c: ct::Config = serde_json::from_value(ct_config_json(&p)).unwrap();
        assert_eq!(c.head_dim, 24);
        let mut m = ct::ModelForCausalLM::new(&c, var_builder(&p)).unwrap();
        let (dl, dp) = compare(&p, seq, |prefix| {
            m.clear_kv_cache();
            let x = Tensor::new(prefix, &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            m.forward(&x, 0)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        });
        eprintln!(
            "qwen3 tied={tied} attention_bias={bias}: max |logit diff| {dl:.2e}, max |logp diff| {dp:.2e}"
        );
        assert!(
            dl < TOL && dp < TOL,
            "qwen3 tied={tied} bias={bias}: {dl} {dp}"
        );
    }
}

#[test]
fn llama3_rope_scaling_matches_candle_transformers() {
    use candle_transformers::models::llama as ct;
    // Long enough that the scaled low frequencies matter.
    let seq = &seqs(14, &[40])[0];
    let cfg = config(Family::Llama, false);
    let mut a = arch(Family::Llama);
    a.rope_scaling = Some(llama3_scaling());
    let p = random_policy(&cfg, &a, 15);
    let lc: ct::LlamaConfig = serde_json::from_value(ct_config_json(&p)).unwrap();
    assert!(lc.rope_scaling.is_some());
    let cc = lc.into_config(false);
    let m = ct::Llama::load(var_builder(&p), &cc).unwrap();
    let reference = |prefix: &[u32]| -> Vec<f32> {
        let mut cache = ct::Cache::new(false, DType::F32, &cc, &Device::Cpu).unwrap();
        let x = Tensor::new(prefix, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        m.forward(&x, 0, &mut cache)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (dl, dp) = compare(&p, seq, reference);
    eprintln!("llama3 rope scaling: max |logit diff| {dl:.2e}, max |logp diff| {dp:.2e}");
    assert!(dl < TOL && dp < TOL, "llama3: {dl} {dp}");
    // The scaling is in effect: the unscaled model differs from the reference.
    let plain = Policy::from_tensors_with_arch(
        &cfg,
        &arch(Family::Llama),
        p.named_tensors().into_iter().collect(),
        "<test>",
    )
    .unwrap();
    let (dl_plain, _) = compare(&plain, seq, reference);
    assert!(dl_plain > 1e-2, "scaling had no effect ({dl_plain})");
}

// ----------------------------------------------------------------------
// Generation and gradients
// ----------------------------------------------------------------------

#[test]
fn kv_cached_generation_agrees_with_full_sequence_logits() {
    let prompts = seqs(16, &[5, 11, 1, 8]);
    for (label, cfg, arch) in variants() {
        let p = random_policy(&cfg, &arch, 17);
        let o = GenerateOptions {
            max_new_tokens: 6,
            temperature: 1.0,
            top_p: 1.0,
            greedy: true,
            eos_token_id: 2,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let gens = p.generate(&prompts, &o, None, &mut rng).unwrap();
        for (pr, g) in prompts.iter().zip(&gens) {
            let full: Vec<u32> = pr.iter().chain(&g.tokens).copied().collect();
            // Greedy token i = argmax of the uncached forward over the
            // whole prefix.
            let prefixes: Vec<Vec<u32>> = (0..g.tokens.len())
                .map(|i| full[..pr.len() + i].to_vec())
                .collect();
            for (i, l) in p.next_logits(&prefixes).unwrap().iter().enumerate() {
                let argmax = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap();
                assert_eq!(g.tokens[i] as usize, argmax, "{label}: token {i}");
            }
            // Reported log-probs = the training path's log-probs.
            let batch = ScoreBatch {
                seqs: vec![full.clone()],
                targets: vec![(pr.len()..full.len()).collect()],
                temperature: 1.0,
                share_prefixes: false,
            };
            let lp: Vec<f32> = p.score(&batch).unwrap().logp.to_vec1().unwrap();
            let d = max_abs_diff(&lp, &g.logprobs);
            assert!(d < 1e-4, "{label}: generate vs score logp {d}");
        }
    }
}

#[test]
fn every_parameter_gets_a_gradient() {
    let s = seqs(18, &[9, 5]);
    for (label, cfg, arch) in variants() {
        let p = random_policy(&cfg, &arch, 19);
        let per_layer = 9
            + if arch.qkv_bias() { 3 } else { 0 }
            + usize::from(arch.o_bias())
            + if arch.qk_norm() { 2 } else { 0 };
        let vars = p.named_vars();
        assert_eq!(
            vars.len(),
            2 + usize::from(!cfg.tie_word_embeddings) + 2 * per_layer,
            "{label}"
        );
        let out = p
            .score(&ScoreBatch {
                seqs: s.clone(),
                targets: vec![vec![3, 8, 1], vec![4]],
                temperature: 1.0,
                share_prefixes: false,
            })
            .unwrap();
        let loss = (out.logp.sum_all().unwrap() + out.entropy.sum_all().unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in &vars {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{label}: no grad for {name}"));
            assert_eq!(g.dims(), var.as_tensor().dims());
            let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{label}: {name}: grad norm {norm}"
            );
        }
    }
}

/// Writes every variant (and SmolLM2 converted from its GGUF, when
/// `models/smollm2` has it) as a HF folder under `target/hf-export/<name>/`
/// with `actguide_logits.json` (token ids and our last-position logits),
/// for `scripts/check-hf-transformers.py` to load with HF transformers and
/// compare. Run: `cargo test --test hf_models -- --ignored export`.
#[test]
#[ignore = "writes files for the HF transformers check (needs torch, outside CI)"]
fn export_for_transformers_check() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/hf-export");
    let mut models: Vec<(String, Policy)> = variants()
        .into_iter()
        .enumerate()
        .map(|(i, (name, cfg, arch))| (name.to_string(), random_policy(&cfg, &arch, 40 + i as u64)))
        .collect();
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    if gguf.exists() {
        models.push((
            "smollm2".into(),
            Policy::from_gguf(&gguf, &Device::Cpu).unwrap(),
        ));
    }
    for (name, p) in &models {
        let dir = root.join(name);
        p.save_hf_dir(&dir, None).unwrap();
        let ids: Vec<u32> = seqs(7, &[12])[0].clone();
        let logits = p.next_logits(std::slice::from_ref(&ids)).unwrap().remove(0);
        let out = serde_json::json!({ "ids": ids, "logits": logits });
        std::fs::write(dir.join("actguide_logits.json"), out.to_string()).unwrap();
        println!("wrote {}", dir.display());
    }
}
