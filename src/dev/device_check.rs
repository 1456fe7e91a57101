//! `actguide dev check-device`: does the model compute the same thing on a
//! device as on the CPU, and does it train there? On a small random policy
//! (Llama layout, untied head, grouped-query attention):
//! - **parity f32**: target log-probs and next-token logits on the device
//!   against the CPU's, in f32 (max |Δ|);
//! - **parity bf16**: the device in bf16 against the CPU in f32 (max
//!   relative error, as in the CPU bf16 tests);
//! - **gradients f32 / bf16**: every parameter gets a finite, non-zero
//!   gradient on the device (the fused CPU kernels are not used there, so
//!   this checks the composite ops' backward);
//! - **generation**: the log-probs generation reports on the device match
//!   scoring the same tokens (the PPO ratio starts at 1);
//! - **LoRA step**: AdamW steps on the device's bf16 LoRA adapters raise
//!   the target log-prob.
//!
//! It runs on any device, the CPU included (then parity is trivially 0),
//! so the command and its thresholds are tested where CI runs; on a GPU it
//! is the first thing `scripts/gpu-check.sh` runs.

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::model::device::DeviceSpec;
use crate::model::{
    GenerateOptions, LoraConfig, ModelConfig, ModelError, Policy, Precision, ScoreBatch,
};
use crate::train::{AdamW, AdamWParams};

/// Largest |Δ| of f32 log-probs and logits between a device and the CPU
/// (different kernels, same math).
pub const F32_TOL: f64 = 1e-3;
/// Largest relative error of bf16 on the device against f32 on the CPU
/// (log-probs relative to max(1, |value|), logits to their row's largest
/// |logit|; bf16 keeps 8 mantissa bits).
pub const BF16_TOL: f64 = 0.05;
/// Largest |Δ| between generation's reported log-probs and scoring.
pub const GENERATE_TOL: f64 = 0.08;

/// One check's outcome.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckRow {
    pub check: String,
    /// What was measured, in the check's unit.
    pub value: f64,
    /// The bound it must stay within (or exceed, for the LoRA step's gain).
    pub bound: f64,
    pub pass: bool,
    pub note: String,
}

/// All checks on one device.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceCheckReport {
    pub device: String,
    pub rows: Vec<CheckRow>,
}

impl DeviceCheckReport {
    pub fn passed(&self) -> bool {
        self.rows.iter().all(|r| r.pass)
    }
}

impl std::fmt::Display for DeviceCheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "device {}", self.device)?;
        writeln!(
            f,
            "{:<28} {:>12} {:>10}  {:<4}  note",
            "check", "value", "bound", "ok"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<28} {:>12.3e} {:>10.2e}  {:<4}  {}",
                r.check,
                r.value,
                r.bound,
                if r.pass { "yes" } else { "NO" },
                r.note
            )?;
        }
        Ok(())
    }
}

/// The check model: small, but with every feature the trunk has that
/// matters for kernels (GQA, untied head, several layers).
fn check_config() -> ModelConfig {
    serde_json::from_value(serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
        "tie_word_embeddings": false, "eos_token_id": 2, "initializer_range": 0.1
    }))
    .expect("valid check config")
}

fn batch(seed: u64) -> ScoreBatch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut seq = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(3..256)).collect() };
    ScoreBatch {
        seqs: vec![seq(40), seq(23), seq(7)],
        targets: vec![(20..40).collect(), (1..23).collect(), vec![3, 6]],
        temperature: 1.0,
        share_prefixes: false,
    }
}

/// The same weights on `device` (trainable, f32, then `precision`).
fn moved(p: &Policy, device: &Device, precision: Precision) -> Result<Policy, ModelError> {
    let tensors = p
        .named_tensors()
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(device)?)))
        .collect::<Result<_, candle_core::Error>>()?;
    Policy::from_tensors(p.config(), tensors, "<check>")?.with_precision(precision)
}

fn vec1(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    Ok(t.to_device(&Device::Cpu)?.to_vec1()?)
}

fn max_abs(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max)
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / (*y as f64).abs().max(1.0))
        .fold(0.0, f64::max)
}

/// Max |Δ| of logit rows (`width` each) relative to each row's largest
/// |logit|: a small logit carries the rounding of the large ones.
fn max_rel_rows(a: &[f32], b: &[f32], width: usize) -> f64 {
    a.chunks(width)
        .zip(b.chunks(width))
        .map(|(ra, rb)| {
            let top = rb.iter().fold(1f64, |m, &v| m.max((v as f64).abs()));
            max_abs(ra, rb) / top
        })
        .fold(0.0, f64::max)
}

fn row(check: &str, value: f64, bound: f64, pass: bool, note: String) -> CheckRow {
    CheckRow {
        check: check.into(),
        value,
        bound,
        pass,
        note,
    }
}

/// Scores and next-token logits of `p` on the check batch, on the CPU.
fn outputs(p: &Policy) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
    let b = batch(1);
    let logp = vec1(&p.score(&b)?.logp)?;
    let prompts: Vec<Vec<u32>> = b
        .seqs
        .iter()
        .map(|s| s[..s.len().min(12)].to_vec())
        .collect();
    let logits = p.next_logits(&prompts)?.concat();
    Ok((logp, logits))
}

/// Parity of `dev` (in `precision`) against the CPU reference in f32.
fn parity(cpu: &Policy, dev: &Policy, precision: Precision) -> Result<CheckRow, ModelError> {
    let (lc, gc) = outputs(cpu)?;
    let (ld, gd) = outputs(dev)?;
    Ok(match precision {
        Precision::F32 => {
            let v = max_abs(&ld, &lc).max(max_abs(&gd, &gc));
            row(
                "parity f32 (max |Δ|)",
                v,
                F32_TOL,
                v <= F32_TOL,
                "log-probs and logits vs CPU f32".into(),
            )
        }
        Precision::Bf16 => {
            let v = max_rel(&ld, &lc).max(max_rel_rows(&gd, &gc, cpu.config().vocab_size));
            row(
                "parity bf16 (max rel)",
                v,
                BF16_TOL,
                v <= BF16_TOL,
                "bf16 on the device vs CPU f32".into(),
            )
        }
    })
}

/// Every parameter of `p` gets a finite, non-zero gradient.
fn gradients(p: &Policy, name: &str) -> Result<CheckRow, ModelError> {
    let out = p.score(&batch(2))?;
    let loss = (out.logp.sum_all()? + out.entropy.sum_all()?)?;
    let grads = loss.backward()?;
    let vars = p.named_vars();
    let mut missing = Vec::new();
    for (n, v) in &vars {
        let ok = match grads.get(v.as_tensor()) {
            Some(g) => {
                let norm: f32 = g.sqr()?.sum_all()?.to_device(&Device::Cpu)?.to_scalar()?;
                norm > 0.0 && norm.is_finite()
            }
            None => false,
        };
        if !ok {
            missing.push(n.clone());
        }
    }
    let got = (vars.len() - missing.len()) as f64;
    Ok(row(
        name,
        got,
        vars.len() as f64,
        missing.is_empty() && !vars.is_empty(),
        if missing.is_empty() {
            format!("{} of {} parameters", got, vars.len())
        } else {
            format!("no gradient: {}", missing.join(", "))
        },
    ))
}

/// Generation's reported log-probs against scoring the same tokens.
fn generation(p: &Policy) -> Result<CheckRow, ModelError> {
    let b = batch(3);
    let prompts: Vec<Vec<u32>> = b
        .seqs
        .iter()
        .map(|s| s[..s.len().min(9)].to_vec())
        .collect();
    let opts = GenerateOptions {
        max_new_tokens: 8,
        temperature: 1.0,
        top_p: 1.0,
        greedy: false,
        eos_token_id: 2,
    };
    let gens = p.generate(&prompts, &opts, None, &mut ChaCha8Rng::seed_from_u64(4))?;
    let seqs: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&gens)
        .map(|(pr, g)| pr.iter().chain(&g.tokens).copied().collect())
        .collect();
    let targets = prompts
        .iter()
        .zip(&gens)
        .map(|(pr, g)| (pr.len()..pr.len() + g.tokens.len()).collect())
        .collect();
    let scored = vec1(
        &p.score(&ScoreBatch {
            seqs,
            targets,
            temperature: 1.0,
            share_prefixes: false,
        })?
        .logp,
    )?;
    let reported: Vec<f32> = gens.iter().flat_map(|g| g.logprobs.clone()).collect();
    let v = max_abs(&scored, &reported);
    Ok(row(
        &format!("generate vs score ({})", p.precision()),
        v,
        GENERATE_TOL,
        v <= GENERATE_TOL,
        format!("{} sampled tokens", reported.len()),
    ))
}

/// Five AdamW steps on bf16 LoRA adapters raise the target log-prob.
fn lora_step(base: &Policy, device: &Device) -> Result<CheckRow, ModelError> {
    let cfg = LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..Default::default()
    };
    let p =
        moved(base, device, Precision::Bf16)?.with_lora(&cfg, &mut ChaCha8Rng::seed_from_u64(5))?;
    let b = batch(6);
    let total = |p: &Policy| -> Result<f64, ModelError> {
        Ok(vec1(&p.score(&b)?.logp)?.iter().map(|&v| v as f64).sum())
    };
    let before = total(&p)?;
    let mut opt = AdamW::new(p.named_vars(), AdamWParams::without_decay())?;
    for _ in 0..5 {
        let loss = p.score(&b)?.logp.sum_all()?.neg()?;
        let g = loss.backward()?;
        let grads: Vec<Option<Tensor>> = opt.grads_from(&g);
        opt.step(&grads, 1e-2)?;
    }
    let gain = total(&p)? - before;
    Ok(row(
        "LoRA bf16 step (Δ logp)",
        gain,
        0.0,
        gain > 0.0 && gain.is_finite(),
        format!("sum of {} target log-probs, 5 AdamW steps", b.num_targets()),
    ))
}

/// Runs every check on `spec`'s device.
pub fn run(spec: DeviceSpec) -> Result<DeviceCheckReport, ModelError> {
    let device = spec.open()?;
    let cpu = Policy::new_random(
        &check_config(),
        &mut ChaCha8Rng::seed_from_u64(0),
        &Device::Cpu,
    )?;
    let f32_dev = moved(&cpu, &device, Precision::F32)?;
    let bf16_dev = moved(&cpu, &device, Precision::Bf16)?;
    let rows = vec![
        parity(&cpu, &f32_dev, Precision::F32)?,
        parity(&cpu, &bf16_dev, Precision::Bf16)?,
        gradients(&f32_dev, "gradients f32 (params)")?,
        gradients(&bf16_dev, "gradients bf16 (params)")?,
        generation(&f32_dev)?,
        generation(&bf16_dev)?,
        lora_step(&cpu, &device)?,
    ];
    Ok(DeviceCheckReport {
        device: spec.to_string(),
        rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_check_passes_on_the_cpu() {
        let r = run(DeviceSpec::Cpu).unwrap();
        assert_eq!(r.rows.len(), 7);
        assert!(r.passed(), "{r}");
        // CPU against CPU: f32 parity is exact, bf16 really rounds.
        assert_eq!(r.rows[0].value, 0.0);
        assert!(r.rows[1].value > 0.0);
        let text = r.to_string();
        assert!(
            text.contains("parity bf16") && text.contains("LoRA bf16 step"),
            "{text}"
        );
    }
}
