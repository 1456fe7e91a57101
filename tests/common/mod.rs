//! Fixtures shared by integration tests (each test file that needs them
//! declares `mod common;`).

#![allow(dead_code)]

use actguide::model::gguf_tokenizer::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL};
use std::path::Path;

use actguide::model::{Arch, Family, GgmlDType, GgufVocab, ModelConfig, Policy};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// GPT-2's byte → printable-char map (the byte-level BPE alphabet).
pub fn bytes_to_unicode() -> Vec<char> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut n = 0;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap()
            }
        })
        .collect()
}

/// A small byte-level vocabulary: 3 control tokens, the 256 byte symbols,
/// then a few merged tokens (incl. digit merges, which SmolLM's per-digit
/// pre-tokenizer must never reach).
pub fn synthetic_vocab(pre: Option<&str>) -> GgufVocab {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    tokens.extend(bytes_to_unicode().into_iter().map(String::from));
    let merges = [
        "h e", "l l", "ll o", "he llo", "Ġ hello", "1 2", "12 3", "4 5",
    ];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut token_types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
    token_types[..3].fill(TOKEN_TYPE_CONTROL);
    GgufVocab {
        model: "gpt2".into(),
        pre: pre.map(String::from),
        tokens,
        token_types,
        merges: merges.iter().map(|s| s.to_string()).collect(),
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        unknown_token_id: None,
        padding_token_id: Some(0),
    }
}

/// A tiny random-init Llama config (hidden 32, 2 layers, 4 heads, 2 kv
/// heads, tied embeddings; bos 1, eos 2, pad 0).
pub fn tiny_llama_config(vocab_size: usize, max_positions: usize) -> ModelConfig {
    ModelConfig {
        architectures: vec![Family::Llama.class_name().into()],
        model_type: Family::Llama.model_type().into(),
        vocab_size,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: None,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        max_position_embeddings: max_positions,
        tie_word_embeddings: true,
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        pad_token_id: Some(0),
        initializer_range: 0.02,
    }
}

/// Vocabulary size of [`family_config`].
pub const FAMILY_VOCAB: usize = 100;

/// A tiny random-init config of `family` (hidden 64, 2 layers, 4 heads, 2
/// kv heads, vocab [`FAMILY_VOCAB`]). Qwen3 gets the explicit `qwen3_head_dim` (its
/// checkpoints give head_dim, and it need not be hidden / heads = 16).
pub fn family_config(family: Family, tied: bool, qwen3_head_dim: usize) -> ModelConfig {
    let qwen = family != Family::Llama;
    ModelConfig {
        architectures: vec![family.class_name().into()],
        model_type: family.model_type().into(),
        vocab_size: FAMILY_VOCAB,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: (family == Family::Qwen3).then_some(qwen3_head_dim),
        rope_theta: if qwen { 1_000_000.0 } else { 10_000.0 },
        rms_norm_eps: 1e-6,
        max_position_embeddings: 256,
        tie_word_embeddings: tied,
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        pad_token_id: Some(0),
        // Peaked enough that greedy choices are not near-ties.
        initializer_range: 0.2,
    }
}

/// A tiny random llama with a byte-level BPE vocabulary and a ChatML
/// template in its GGUF metadata.
pub fn tiny_chat_gguf(path: &Path) {
    let vocab = synthetic_vocab(Some("smollm"));
    let cfg = tiny_llama_config(vocab.tokens.len(), 8192);
    let arch = Arch::from_config(&cfg).unwrap();
    let p =
        Policy::new_random_with_arch(&cfg, &arch, &mut ChaCha8Rng::seed_from_u64(9), &Device::Cpu)
            .unwrap();
    let plain = path.with_extension("plain.gguf");
    p.write_gguf(&plain, GgmlDType::F32, Some(&vocab)).unwrap();
    // Add the chat template (write_gguf does not know one).
    let mut f = std::fs::File::open(&plain).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let template = Value::String(
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
         message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
            .into(),
    );
    let mut md: Vec<(&str, &Value)> = c.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    md.push(("tokenizer.chat_template", &template));
    let tensors: Vec<(String, _)> = c
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), c.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let t_refs: Vec<(&str, _)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut std::fs::File::create(path).unwrap(), &md, &t_refs).unwrap();
}

/// Whether process `pid` exists and is not a zombie (a dead child not yet
/// reaped), from /proc.
pub fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            != Some("Z")
    })
}

/// The processes whose parent is `pid`, from /proc.
pub fn children_of(pid: u32) -> Vec<u64> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().nth(1))
                    == Some(&pid.to_string())
            })
        })
        .collect()
}

/// The processes of `pids` still alive after waiting up to `wait` for them
/// all to end.
pub fn still_alive_after(pids: &[u64], wait: std::time::Duration) -> Vec<u64> {
    let t0 = std::time::Instant::now();
    while pids.iter().any(|&p| alive(p)) && t0.elapsed() < wait {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    pids.iter().copied().filter(|&p| alive(p)).collect()
}

/// `actguide run <experiment>` as a separate process, its output dropped
/// (tests that kill it).
pub fn spawn_run(experiment: &Path) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_actguide"))
        .arg("run")
        .arg(experiment)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}
