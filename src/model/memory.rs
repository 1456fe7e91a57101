//! The peak memory of a training run of the policy, estimated before it
//! starts, and the refusal of a configuration that cannot fit (with a
//! `trainer.micro_batch` that can). The model owns the estimate because it
//! models the policy's own tensors; the run supplies the shape (micro-batch,
//! rollout batch, probed sequence length, KL reference) and calls
//! [`before_loading`] and [`before_start`].
//!
//! What a step holds at its peak: the stored weights (trained `Var`s in
//! f32, frozen ones in the compute dtype), the gradients and AdamW's two
//! moments of the trained parameters (f32), the frozen KL reference when
//! `kl_coef > 0`, and the larger of two transients: the rollout (a merged
//! copy of the weights for generation plus the KV cache of the whole
//! rollout batch) and the training micro-batch, whose autograd graph keeps
//! every layer's activations of `micro_batch` sequences until the backward
//! pass (see [`train_bytes_per_token`]).
//!
//! The activation model counts the tensors the training path saves per
//! token and layer, calibrated against the peak resident memory of real
//! training steps (see [`train_bytes_per_token`]); it errs a little high.

use crate::model::{ModelConfig, Policy, Precision, Proj};

/// Share of the available memory a run may plan to use (the rest covers
/// the allocator's slack, the tokenizer, envs, scripts and the estimate's
/// error).
pub const USABLE_SHARE: f64 = 0.85;

/// LM head rows (scored targets) the estimate allows per sequence of a
/// micro-batch.
pub const HEAD_ROWS: usize = 64;

/// The estimate's parts, in bytes.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryEstimate {
    /// Stored weights (trained f32 masters and frozen weights, and any
    /// cached bf16 rollout copies).
    pub weights: u64,
    /// Gradients and AdamW moments of the trained parameters.
    pub optimizer: u64,
    /// The frozen KL reference (0 without `kl_coef`).
    pub reference: u64,
    /// Generation: merged weights and the KV cache of the rollout batch.
    pub rollout: u64,
    /// Autograd graph of one training micro-batch.
    pub train: u64,
    /// Tokens per training sequence the estimate assumed.
    pub seq_len: usize,
    pub micro_batch: usize,
    /// What one more sequence in the micro-batch adds.
    pub per_sequence: u64,
}

impl MemoryEstimate {
    /// What the run holds at all times.
    pub fn resident(&self) -> u64 {
        self.weights + self.optimizer + self.reference
    }

    /// The estimated peak.
    pub fn peak(&self) -> u64 {
        self.resident() + self.rollout.max(self.train)
    }

    /// The largest micro-batch whose peak fits in `budget` bytes, if any.
    pub fn fitting_micro_batch(&self, budget: u64) -> Option<usize> {
        let fixed = self.resident();
        if fixed + self.rollout > budget || fixed + self.per_sequence > budget {
            return None;
        }
        Some(((budget - fixed) / self.per_sequence.max(1)) as usize)
    }
}

/// Bytes the training path keeps per token of a sequence of `t` tokens, all
/// layers together: per layer the saved inputs and outputs of the norms,
/// the q/k/v projections and rotary, the attention scores and weights
/// (`heads × t` per token, in f32 whatever the dtype; none when attention
/// is fused), the attention output and its projection, the fused gate/up
/// projection, SwiGLU, the down projection and both residual sums, times
/// 1.6 for what that count misses (reshape copies, the backward pass's
/// transient gradients, the allocator). Measured on SmolLM2-135M (f32, CPU,
/// the growth of bench-model's peak from 4 to 8 sequences of 256 tokens):
/// 2.78 MB per token with the composite attention (no BLAS), 2.09 MB fused
/// (MKL); this gives 3.13 and 2.25 MB.
pub fn train_bytes_per_token(
    cfg: &ModelConfig,
    precision: Precision,
    t: usize,
    fused_attention: bool,
) -> u64 {
    let h = cfg.hidden_size as u64;
    let a = (cfg.num_attention_heads * cfg.head_dim()) as u64;
    let kv = (cfg.num_key_value_heads * cfg.head_dim()) as u64;
    let i = cfg.intermediate_size as u64;
    let elems = 7 * h + 4 * a + 4 * kv + 3 * i;
    let scores = if fused_attention {
        0
    } else {
        2 * cfg.num_attention_heads as u64 * t as u64 * 4
    };
    let per_layer = elems * precision.bytes() as u64 + scores;
    per_layer * cfg.num_hidden_layers as u64 * 8 / 5
}

/// Bytes per token, all layers together, that LoRA updates composed from
/// candle ops keep on top of [`train_bytes_per_token`] (none where they
/// run fused, see `Policy::lora_updates_fused`): per adapted projection
/// and layer, 4.5 times its output (the update, its scaled copy, the sum,
/// the gate/up concatenation and the backward's transients). Measured on
/// SmolLM2-135M (f32, CPU, LoRA r 8 on every projection, bench-model's
/// 8 × 256 tokens): peak 10.6 GiB composed against 5.3 fused, 2.78 MB per
/// token; this gives 2.80.
pub fn lora_composed_bytes_per_token(
    cfg: &ModelConfig,
    precision: Precision,
    adapted: &[Proj],
) -> u64 {
    let outputs: usize = adapted
        .iter()
        .map(|p| match p {
            Proj::Q => cfg.num_attention_heads * cfg.head_dim(),
            Proj::K | Proj::V => cfg.num_key_value_heads * cfg.head_dim(),
            Proj::O | Proj::Down => cfg.hidden_size,
            Proj::Gate | Proj::Up => cfg.intermediate_size,
        })
        .sum();
    (outputs * cfg.num_hidden_layers * precision.bytes()) as u64 * 9 / 2
}

/// [`lora_composed_bytes_per_token`] of `policy` (0 without LoRA or where
/// its updates run fused).
fn lora_extra(policy: &Policy) -> u64 {
    match policy.lora() {
        Some(l) if !policy.lora_updates_fused() => lora_composed_bytes_per_token(
            policy.config(),
            policy.precision(),
            &l.projections().unwrap_or_default(),
        ),
        _ => 0,
    }
}

/// Whether `policy` trains with the fused attention (no scores kept).
fn fused_attention(policy: &Policy) -> bool {
    policy.device().is_cpu()
        && policy.precision() == Precision::F32
        && crate::model::fused_attention_available()
}

/// What a training micro-batch of `policy` keeps until its backward, in
/// bytes: per token through the trunk (sequences of up to `t` tokens, see
/// [`train_bytes_per_token`]) and per scored target (its logits row and
/// their gradient). The estimate's model, for the trainer to fill
/// micro-batches by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MicroCost {
    pub token: u64,
    pub target: u64,
}

impl MicroCost {
    pub fn of(policy: &Policy, t: usize) -> MicroCost {
        let cfg = policy.config();
        MicroCost {
            token: train_bytes_per_token(cfg, policy.precision(), t, fused_attention(policy))
                + lora_extra(policy),
            target: head_row_bytes(cfg),
        }
    }
}

/// The logits row of one scored target and its gradient, in f32.
fn head_row_bytes(cfg: &ModelConfig) -> u64 {
    2 * cfg.vocab_size as u64 * 4
}

/// What an estimate needs besides the policy.
#[derive(Debug, Clone, Copy)]
pub struct RunShape {
    /// Sequences per training forward/backward (`trainer.micro_batch`).
    pub micro_batch: usize,
    /// Episodes generated together (tasks per step × group size).
    pub rollout_batch: usize,
    /// Longest training sequence (prompt + answer), in tokens.
    pub seq_len: usize,
    /// Whether a frozen KL reference is kept (`kl_coef > 0`).
    pub reference: bool,
}

/// What the estimate needs to know of a model.
#[derive(Debug, Clone)]
pub struct Footprint {
    pub cfg: ModelConfig,
    pub precision: Precision,
    /// Scalar parameters of the model (base weights).
    pub params: u64,
    /// Trained scalars (every weight, or the LoRA adapters).
    pub trained: u64,
    pub lora: bool,
    /// Attention runs fused (f32 on the CPU with a BLAS): no `(t, t)`
    /// scores or probabilities are kept for the backward.
    pub fused_attention: bool,
    /// Bytes of the cached rollout weights and their packed copies
    /// (`model.rollout_bf16`, or f32 where the decode kernel runs; 0
    /// otherwise), held all run long.
    pub rollout_copies: u64,
    /// Bytes of the bf16 copies of the product weights that mixed-precision
    /// training holds (`model.mixed_precision`): under LoRA the frozen
    /// base's, made once; in full training each pass's, kept for its
    /// backward. 0 without mixed precision.
    pub mixed_copies: u64,
    /// Bytes per token that composed LoRA updates add to the training
    /// pass ([`lora_composed_bytes_per_token`]; 0 where they run fused).
    pub lora_per_token: u64,
}

impl Footprint {
    pub fn of(policy: &Policy) -> Footprint {
        Footprint {
            cfg: policy.config().clone(),
            precision: policy.precision(),
            params: policy.num_params() as u64,
            trained: policy.num_trainable_params() as u64,
            lora: policy.lora().is_some(),
            fused_attention: fused_attention(policy),
            rollout_copies: rollout_copy_bytes(policy),
            mixed_copies: if policy.mixed_precision() {
                2 * policy.product_elems() as u64
            } else {
                0
            },
            lora_per_token: lora_extra(policy),
        }
    }
}

impl Footprint {
    /// What a model's config alone says of its footprint, before any
    /// weight exists: the projections, embeddings and norms it declares
    /// (biases and rollout copies left out, LoRA adapters counted as
    /// nothing), so the estimate from it is a lower bound. Capped at 10¹⁵
    /// parameters so the byte counts stay in range.
    pub fn lower_bound(cfg: &ModelConfig, precision: Precision, lora: bool) -> Footprint {
        let (h, i) = (cfg.hidden_size as f64, cfg.intermediate_size as f64);
        let a = (cfg.num_attention_heads * cfg.head_dim()) as f64;
        let kv = (cfg.num_key_value_heads * cfg.head_dim()) as f64;
        let per_layer = 2.0 * a * h + 2.0 * kv * h + 3.0 * i * h + 2.0 * h;
        let heads = if cfg.tie_word_embeddings { 1.0 } else { 2.0 };
        let params =
            cfg.num_hidden_layers as f64 * per_layer + heads * cfg.vocab_size as f64 * h + h;
        let params = params.min(1e15) as u64;
        Footprint {
            cfg: cfg.clone(),
            precision,
            params,
            trained: if lora { 0 } else { params },
            lora,
            fused_attention: true,
            rollout_copies: 0,
            mixed_copies: 0,
            lora_per_token: 0,
        }
    }
}

/// Refuses, before any weight is allocated, a model whose weights,
/// optimizer state and KL reference (`reference`) alone, one token of one
/// sequence on top, cannot fit in the memory `limit` (else what `device`
/// has free; `name` names the device in the refusal). `fp` is the config's
/// [`Footprint::lower_bound`]; the full estimate ([`before_start`]) follows
/// once the policy is built.
pub fn before_loading(
    fp: &Footprint,
    reference: bool,
    limit: Option<u64>,
    device: &candle_core::Device,
    name: &str,
) -> Result<(), Box<MemoryError>> {
    let est = estimate_for(
        fp,
        &RunShape {
            micro_batch: 1,
            rollout_batch: 0,
            seq_len: 1,
            reference,
        },
    );
    let Some(total) = limit.or_else(|| available(device)) else {
        return Ok(());
    };
    check(&est, total, name)
}

/// The cached rollout weights of `policy`: under `model.rollout_bf16` the
/// bf16 copies of every product weight (projections, gate/up, LM head)
/// plus MKL's packs of them; in f32 on a CPU where the decode kernel runs,
/// its packs (one f32 copy of the same weights) and the gate/up
/// concatenation they are cached with; else nothing.
fn rollout_copy_bytes(policy: &Policy) -> u64 {
    let cfg = policy.config();
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let a = cfg.num_attention_heads * cfg.head_dim();
    let kv = cfg.num_key_value_heads * cfg.head_dim();
    let mut shapes = Vec::new();
    for _ in 0..cfg.num_hidden_layers {
        shapes.extend([(a, h), (kv, h), (kv, h), (h, a), (2 * i, h), (h, i)]);
    }
    shapes.push((cfg.vocab_size, h));
    if policy.rollout_bf16() {
        let elems: u64 = shapes.iter().map(|&(n, k)| (n * k) as u64).sum();
        return elems * 2 + crate::model::packed_rollout_bytes(&shapes);
    }
    if policy.device().is_cpu() && policy.precision() == Precision::F32 {
        let packs = crate::model::packed_f32_rollout_bytes(&shapes);
        if packs > 0 {
            let gu = cfg.num_hidden_layers as u64 * 2 * i as u64 * h as u64 * 4;
            return packs + gu;
        }
    }
    0
}

/// Estimates the peak of a run of `policy` with `shape`.
pub fn estimate(policy: &Policy, shape: &RunShape) -> MemoryEstimate {
    estimate_for(&Footprint::of(policy), shape)
}

/// [`estimate`] from a model's footprint.
pub fn estimate_for(m: &Footprint, shape: &RunShape) -> MemoryEstimate {
    let cfg = &m.cfg;
    let p = m.precision;
    let total = m.params;
    let trained = m.trained;
    let lora = m.lora;
    // Full training: every weight is an f32 master; under LoRA the base
    // is frozen in the compute dtype and only the adapters are f32.
    let frozen = if lora { total } else { 0 };
    let weights = frozen * p.bytes() as u64 + trained * 4 + m.rollout_copies + m.mixed_copies;
    let optimizer = trained * 3 * 4;
    let reference = if shape.reference {
        total * p.bytes() as u64
    } else {
        0
    };
    // Generation weights: a cast (bf16) or merged (LoRA) copy of the
    // weights, else the gate/up concatenation alone.
    let h = cfg.hidden_size as u64;
    let layers = cfg.num_hidden_layers as u64;
    let gu = layers * 2 * cfg.intermediate_size as u64 * h * p.bytes() as u64;
    let copy = if lora || p != Precision::F32 {
        total * p.bytes() as u64
    } else {
        gu
    };
    let kv_per_token = layers * 2 * (cfg.num_key_value_heads * cfg.head_dim()) as u64;
    let kv = shape.rollout_batch as u64 * shape.seq_len as u64 * kv_per_token * p.bytes() as u64;
    // The prefill's largest activation is chunked (a few MB), so the cache
    // dominates generation's transient memory.
    let rollout = copy + kv;
    let per_sequence = (train_bytes_per_token(cfg, p, shape.seq_len, m.fused_attention)
        + m.lora_per_token)
        * shape.seq_len as u64
            // LM head rows of the answer's targets: logits and their gradient.
            + HEAD_ROWS as u64 * head_row_bytes(cfg);
    MemoryEstimate {
        weights,
        optimizer,
        reference,
        rollout,
        train: per_sequence * shape.micro_batch as u64,
        seq_len: shape.seq_len,
        micro_batch: shape.micro_batch,
        per_sequence,
    }
}

/// Memory the run may use on the CPU: what the system reports available
/// plus what this process already holds (the estimate counts the weights
/// already loaded). `None` where `/proc` cannot tell.
pub fn available_cpu() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let avail_kb: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let rss_pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // Pages are 4 KiB on the platforms this reads /proc on.
    Some(avail_kb * 1024 + rss_pages * 4096)
}

/// Memory of the device `policy` lives on that the run may use: for CUDA
/// the device's total memory (a run owns its GPU), for the CPU
/// [`available_cpu`].
pub fn available(device: &candle_core::Device) -> Option<u64> {
    match device {
        candle_core::Device::Cpu => available_cpu(),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => d
            .cuda_stream()
            .context()
            .mem_get_info()
            .ok()
            .map(|(_free, total)| total as u64),
        #[allow(unreachable_patterns)]
        _ => None,
    }
}

/// Gibibytes, for messages.
pub fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The share of `total` bytes a run may plan for.
pub fn budget(total: u64) -> u64 {
    (total as f64 * USABLE_SHARE) as u64
}

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "this run would need about {} at its peak but {} is usable on {device} \
     ({:.0}% of {}): weights {}, optimizer state {}, KL reference {}, rollout {}, \
     training micro-batch of {} sequences × {} tokens {}. {hint}",
    gib(.est.peak()), gib(budget(*.total)), USABLE_SHARE * 100.0, gib(*.total),
    gib(.est.weights), gib(.est.optimizer), gib(.est.reference), gib(.est.rollout),
    .est.micro_batch, .est.seq_len, gib(.est.train)
)]
pub struct MemoryError {
    pub est: MemoryEstimate,
    /// Bytes the device has (or the user's limit).
    pub total: u64,
    pub device: String,
    /// What to change.
    pub hint: String,
}

/// Refuses `est` when its peak exceeds [`USABLE_SHARE`] of `total` bytes
/// on `device` (a name for the message); the hint names the largest
/// `trainer.micro_batch` that fits, or what else to change.
pub fn check(est: &MemoryEstimate, total: u64, device: &str) -> Result<(), Box<MemoryError>> {
    let budget = budget(total);
    if est.peak() <= budget {
        return Ok(());
    }
    let hint = match est.fitting_micro_batch(budget) {
        Some(m) if m >= 1 => format!(
            "Set trainer.micro_batch to {m} or less (gradients accumulate over micro-batches, \
             so the update is the same)."
        ),
        _ => "Even one sequence per micro-batch does not fit: train LoRA adapters \
              (model.lora), compute in bf16 (model.dtype: \"bf16\"), shorten prompts \
              (rollout.history, rollout.show_actions: false), drop the KL reference \
              (trainer.kl_coef: 0) or use a device with more memory."
            .to_string(),
    };
    Err(Box::new(MemoryError {
        est: est.clone(),
        total,
        device: device.to_string(),
        hint,
    }))
}

/// Estimates the peak of a run of `policy` with `shape` and refuses it
/// when it cannot fit in the memory `limit` (else what the policy's device
/// reports; `name` names the device). Returns the line to log: the
/// estimate against the usable memory, or the estimate alone when the
/// device's memory is unknown.
pub fn before_start(
    policy: &Policy,
    shape: &RunShape,
    limit: Option<u64>,
    name: &str,
) -> Result<String, Box<MemoryError>> {
    let est = estimate(policy, shape);
    let Some(total) = limit.or_else(|| available(policy.device())) else {
        return Ok(format!(
            "memory estimate: peak about {} (the free memory of {name} is unknown)",
            gib(est.peak())
        ));
    };
    check(&est, total, name)?;
    Ok(format!(
        "memory estimate: peak about {} of {} usable on {name} (micro-batch {} × {} tokens)",
        gib(est.peak()),
        gib(budget(total)),
        est.micro_batch,
        est.seq_len
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M's dimensions.
    fn smollm2() -> ModelConfig {
        let mut c: ModelConfig = serde_json::from_value(serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
            "tie_word_embeddings": true
        }))
        .unwrap();
        c.bos_token_id = Some(1);
        c
    }

    fn footprint(lora: bool, precision: Precision) -> Footprint {
        Footprint {
            cfg: smollm2(),
            precision,
            params: 134_515_008,
            trained: if lora { 2_442_240 } else { 134_515_008 },
            lora,
            fused_attention: false,
            rollout_copies: 0,
            mixed_copies: 0,
            lora_per_token: 0,
        }
    }

    #[test]
    fn the_activation_model_matches_the_measured_smollm2_step() {
        // Measured: 2.78 MB per token (f32, 256-token sequences), 2.09
        // with the fused attention.
        let b = train_bytes_per_token(&smollm2(), Precision::F32, 256, false) as f64 / 1e6;
        assert!((2.78..3.3).contains(&b), "{b} MB per token");
        let f = train_bytes_per_token(&smollm2(), Precision::F32, 256, true) as f64 / 1e6;
        assert!((2.09..2.5).contains(&f), "{f} MB per token fused");
        // bf16 halves the saved activations except the f32 attention scores.
        let h = train_bytes_per_token(&smollm2(), Precision::Bf16, 256, false) as f64 / 1e6;
        assert!(h < 0.7 * b, "{h} vs {b}");
    }

    #[test]
    fn composed_lora_updates_match_the_measured_smollm2_step() {
        // Measured: 2.78 MB per token more than fused (r 8, every projection).
        let all = crate::model::Proj::ALL;
        let b = lora_composed_bytes_per_token(&smollm2(), Precision::F32, &all) as f64 / 1e6;
        assert!((2.78..3.1).contains(&b), "{b} MB per token");
        // Fewer adapted projections keep less; bf16 half.
        let qv = lora_composed_bytes_per_token(&smollm2(), Precision::F32, &[Proj::Q, Proj::V]);
        assert!((qv as f64) < 0.2 * b * 1e6);
        let h = lora_composed_bytes_per_token(&smollm2(), Precision::Bf16, &all) as f64 / 1e6;
        assert!((h - b / 2.0).abs() < 1e-3);
        // The estimate adds it per token of every sequence.
        let shape = RunShape {
            micro_batch: 2,
            rollout_batch: 8,
            seq_len: 100,
            reference: false,
        };
        let fused = estimate_for(&footprint(true, Precision::F32), &shape);
        let composed = estimate_for(
            &Footprint {
                lora_per_token: 1000,
                ..footprint(true, Precision::F32)
            },
            &shape,
        );
        assert_eq!(composed.train - fused.train, 2 * 100 * 1000);
    }

    #[test]
    fn the_oom_killed_smollm2_configuration_is_refused_with_a_micro_batch_that_fits() {
        // examples/smollm2_household.rhai at the default micro-batch (64)
        // was killed at 23 GB; its probed sequence length is 421 tokens
        // (the longest chat prompt with the whole plan, plus 32 answer
        // tokens).
        let shape = RunShape {
            micro_batch: 64,
            rollout_batch: 8,
            seq_len: 421,
            reference: true,
        };
        let est = estimate_for(&footprint(true, Precision::F32), &shape);
        let total = 23u64 << 30;
        let err = check(&est, total, "cpu").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("Set trainer.micro_batch to"), "{msg}");
        let m: usize = msg
            .split("Set trainer.micro_batch to ")
            .nth(1)
            .and_then(|s| s.split(' ').next())
            .and_then(|s| s.parse().ok())
            .unwrap();
        // The figure `actguide run` printed for this configuration.
        assert_eq!(m, 12);
        let fits = |mb: usize| {
            let e = estimate_for(
                &footprint(true, Precision::F32),
                &RunShape {
                    micro_batch: mb,
                    ..shape
                },
            );
            check(&e, total, "cpu").is_ok()
        };
        assert!(fits(m) && !fits(m + 1), "{m} is the largest that fits");
        // The example's own setting (4) fits.
        assert!(fits(4));
    }

    #[test]
    fn when_nothing_fits_the_hint_names_the_other_levers() {
        let shape = RunShape {
            micro_batch: 1,
            rollout_batch: 8,
            seq_len: 421,
            reference: true,
        };
        let full = estimate_for(&footprint(false, Precision::F32), &shape);
        let err = check(&full, 2u64 << 30, "cuda:0").unwrap_err().to_string();
        assert!(err.contains("model.lora") && err.contains("bf16"), "{err}");
        assert!(err.contains("on cuda:0"), "{err}");
        // Full training holds weights, gradients and two moments in f32.
        assert_eq!(full.weights + full.optimizer, 134_515_008 * 16);
        // LoRA in bf16 stores the base in bf16 and trains f32 adapters.
        let lora = estimate_for(&footprint(true, Precision::Bf16), &shape);
        assert_eq!(lora.weights, 134_515_008 * 2 + 2_442_240 * 4);
        assert!(lora.peak() < full.peak() / 2);
    }

    #[test]
    fn before_loading_refuses_a_config_whose_weights_alone_do_not_fit() {
        let cpu = candle_core::Device::Cpu;
        let fp = Footprint::lower_bound(&smollm2(), Precision::F32, false);
        // Full training in f32: 16 bytes per parameter, about 2 GiB, more
        // than 85% of 2 GiB.
        let err = before_loading(&fp, false, Some(2 << 30), &cpu, "cpu").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("usable on cpu") && msg.contains("model.lora"),
            "{msg}"
        );
        assert!(before_loading(&fp, false, Some(8 << 30), &cpu, "cpu").is_ok());
        // The KL reference adds a copy of the weights in the compute dtype.
        let with_ref = 8u64 << 30;
        let est = |reference| {
            estimate_for(
                &fp,
                &RunShape {
                    micro_batch: 1,
                    rollout_batch: 0,
                    seq_len: 1,
                    reference,
                },
            )
        };
        assert_eq!(est(true).reference, fp.params * 4);
        assert!(before_loading(&fp, true, Some(with_ref), &cpu, "cpu").is_ok());
        // LoRA trains no base weight: the same model fits in 2 GiB.
        let lora = Footprint::lower_bound(&smollm2(), Precision::F32, true);
        assert!(before_loading(&lora, false, Some(2 << 30), &cpu, "cpu").is_ok());
        assert!(est(false).peak() < est(true).peak());
    }
}
