//! `actguide dev bench-grpo`: seconds per single-turn GRPO step of a real
//! model, generation and update apart, the workload `scripts/compare-trl.sh`
//! runs on TRL's `GRPOTrainer` too.
//!
//! Per step: `prompts` prompts × `group` sampled completions of exactly
//! `new_tokens` tokens each (temperature 1; the eos handed to `generate` is
//! the last vocabulary id, a rare BPE token, as TRL's side sets
//! `min_new_tokens`), a
//! reward per completion (the share of its tokens with an even id: cheap,
//! and it varies within a group, so every group has a gradient), group-
//! normalised advantages, and one trainer step (PPO-clipped token loss,
//! token mean, AdamW, grad clip 1, no KL) over all of them, with the
//! crate's [`Trainer`] exactly as a run calls it. LoRA by default (rank 8,
//! alpha 16, every projection), on the kernels this CPU picks unless told
//! otherwise. The first step is a warm-up; the report gives the fastest and
//! the mean of the timed ones.

use std::path::PathBuf;
use std::time::Instant;

use rand::Rng;

use crate::dev::bench_model::{load_model, ModelBenchError};
use crate::model::{GenerateOptions, LoraConfig, Policy};
use crate::seed;
use crate::train::{AdvantageKind, Sample, TrainError, Trainer, TrainerSection};

/// Errors of the GRPO benchmark.
#[derive(Debug, thiserror::Error)]
pub enum GrpoBenchError {
    #[error(transparent)]
    Model(#[from] ModelBenchError),
    #[error(transparent)]
    ModelLoad(#[from] crate::model::ModelError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("{}: {msg}", .path.display())]
    Prompts { path: PathBuf, msg: String },
    #[error("invalid benchmark settings: {0}")]
    InvalidArgument(String),
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct GrpoBenchConfig {
    /// A `.gguf` file or a HF model folder.
    pub model: PathBuf,
    /// A JSON list of prompts as token-id lists (the TRL side writes the
    /// ids its tokenizer gave, so both sides see the same prompts); `None`:
    /// random ids of `prompt_len`.
    pub prompt_file: Option<PathBuf>,
    pub prompts: usize,
    pub prompt_len: usize,
    pub group: usize,
    pub new_tokens: usize,
    /// Timed steps (after one warm-up).
    pub steps: usize,
    pub lr: f64,
    /// Sequences per forward/backward.
    pub micro_batch: usize,
    /// `None`: full fine-tuning.
    pub lora: Option<LoraConfig>,
    pub rollout_bf16: Option<bool>,
    pub mixed_precision: Option<bool>,
    pub seed: u64,
}

impl Default for GrpoBenchConfig {
    fn default() -> Self {
        GrpoBenchConfig {
            model: PathBuf::new(),
            prompt_file: None,
            prompts: 8,
            prompt_len: 64,
            group: 8,
            new_tokens: 32,
            steps: 3,
            lr: 1e-5,
            micro_batch: 64,
            lora: Some(LoraConfig {
                rank: 8,
                alpha: 16.0,
                ..Default::default()
            }),
            rollout_bf16: None,
            mixed_precision: None,
            seed: 0,
        }
    }
}

/// One timed step.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GrpoStep {
    pub generate_s: f64,
    pub update_s: f64,
    pub step_s: f64,
    pub mean_reward: f64,
    pub generated_tokens: usize,
}

/// The measurement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GrpoBenchReport {
    pub implementation: String,
    /// The kernel line of run headers.
    pub kernels: String,
    pub model: String,
    pub threads: usize,
    pub prompts: usize,
    pub group: usize,
    pub new_tokens: usize,
    pub prompt_tokens: Vec<usize>,
    pub trainable_params: usize,
    pub steps: Vec<GrpoStep>,
    /// Fastest timed step (its generation and update figures).
    pub fastest: GrpoStep,
    pub mean_step_s: f64,
}

impl std::fmt::Display for GrpoBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "implementation {}", self.implementation)?;
        writeln!(f, "kernels        {}", self.kernels)?;
        writeln!(f, "model          {}", self.model)?;
        writeln!(
            f,
            "workload       {} prompts × {} completions × {} new tokens; {} trainable parameters; {} threads",
            self.prompts, self.group, self.new_tokens, self.trainable_params, self.threads
        )?;
        writeln!(f, " step  generate_s  update_s   step_s  reward")?;
        for (i, s) in self.steps.iter().enumerate() {
            writeln!(
                f,
                "{:>5} {:>11.3} {:>9.3} {:>8.3} {:>7.3}",
                i + 1,
                s.generate_s,
                s.update_s,
                s.step_s,
                s.mean_reward
            )?;
        }
        write!(
            f,
            "fastest step {:.3} s (generate {:.3} s, update {:.3} s); mean {:.3} s",
            self.fastest.step_s, self.fastest.generate_s, self.fastest.update_s, self.mean_step_s
        )
    }
}

/// Run the benchmark.
pub fn run(cfg: &GrpoBenchConfig) -> Result<GrpoBenchReport, GrpoBenchError> {
    if cfg.prompts == 0 || cfg.group < 2 || cfg.new_tokens == 0 || cfg.steps == 0 {
        return Err(GrpoBenchError::InvalidArgument(
            "need prompts ≥ 1, group ≥ 2, new tokens ≥ 1, steps ≥ 1".into(),
        ));
    }
    let device = candle_core::Device::Cpu;
    let mut policy = load_model(&cfg.model, &device)?;
    if let Some(l) = &cfg.lora {
        policy = policy.with_lora(l, &mut seed::rng(cfg.seed, &[seed::label("lora")]))?;
    }
    crate::model::Kernels::detect(&policy, cfg.rollout_bf16, cfg.mixed_precision)
        .apply(&mut policy)?;
    let prompts = prompts(cfg, &policy)?;
    let settings = TrainerSection {
        lr: cfg.lr,
        weight_decay: 0.0,
        schedule: crate::train::Schedule::Constant,
        micro_batch: cfg.micro_batch,
        ..Default::default()
    };
    let mut trainer = Trainer::new(&policy, None, &settings, cfg.steps + 1, 1.0)?;
    let mut rng = seed::rng(cfg.seed, &[seed::label("bench-grpo")]);
    let mut steps = Vec::new();
    for step in 0..=cfg.steps {
        let s = one_step(&policy, &mut trainer, &prompts, cfg, step, &mut rng)?;
        if step > 0 {
            steps.push(s);
        }
    }
    let fastest = steps
        .iter()
        .min_by(|a, b| a.step_s.total_cmp(&b.step_s))
        .cloned()
        .expect("steps ≥ 1");
    let mean_step_s = steps.iter().map(|s| s.step_s).sum::<f64>() / steps.len() as f64;
    Ok(GrpoBenchReport {
        implementation: format!(
            "actguide (candle, CPU, matmul: {})",
            crate::model::matmul_backend()
        ),
        kernels: crate::model::Kernels::of(&policy).line(),
        model: cfg.model.display().to_string(),
        threads: candle_core::utils::get_num_threads(),
        prompts: cfg.prompts,
        group: cfg.group,
        new_tokens: cfg.new_tokens,
        prompt_tokens: prompts.iter().map(Vec::len).collect(),
        trainable_params: policy.num_trainable_params(),
        steps,
        fastest,
        mean_step_s,
    })
}

/// The prompts: the file's, else random ids.
fn prompts(cfg: &GrpoBenchConfig, policy: &Policy) -> Result<Vec<Vec<u32>>, GrpoBenchError> {
    let vocab = policy.config().vocab_size as u32;
    let Some(path) = &cfg.prompt_file else {
        let mut rng = seed::rng(cfg.seed, &[seed::label("bench-grpo-prompts")]);
        return Ok((0..cfg.prompts)
            .map(|_| {
                (0..cfg.prompt_len)
                    .map(|_| rng.random_range(0..vocab))
                    .collect()
            })
            .collect());
    };
    let err = |msg: String| GrpoBenchError::Prompts {
        path: path.clone(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let all: Vec<Vec<u32>> = serde_json::from_str(&text)
        .map_err(|e| err(format!("not a JSON list of token-id lists: {e}")))?;
    if all.len() < cfg.prompts {
        return Err(err(format!(
            "{} prompts, the benchmark needs {}",
            all.len(),
            cfg.prompts
        )));
    }
    if let Some(bad) = all.iter().flatten().find(|&&t| t >= vocab) {
        return Err(err(format!(
            "token id {bad} outside the vocabulary ({vocab})"
        )));
    }
    if all.iter().any(Vec::is_empty) {
        return Err(err("an empty prompt".into()));
    }
    Ok(all.into_iter().take(cfg.prompts).collect())
}

/// Generation, rewards, advantages and one trainer step.
fn one_step(
    policy: &Policy,
    trainer: &mut Trainer,
    prompts: &[Vec<u32>],
    cfg: &GrpoBenchConfig,
    step: usize,
    rng: &mut rand_chacha::ChaCha8Rng,
) -> Result<GrpoStep, GrpoBenchError> {
    let t0 = Instant::now();
    let batch: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), cfg.group))
        .collect();
    let opts = GenerateOptions {
        max_new_tokens: cfg.new_tokens,
        temperature: 1.0,
        top_p: 1.0,
        greedy: false,
        // Not the model's eos but the last vocabulary id, a rare BPE
        // token (as in bench-model): completions run to `new_tokens`
        // (the report counts the tokens generated).
        eos_token_id: policy.config().vocab_size as u32 - 1,
    };
    let gens = policy.generate(&batch, &opts, None, rng)?;
    let generate_s = t0.elapsed().as_secs_f64();
    let rewards: Vec<f64> = gens
        .iter()
        .map(|g| {
            let even = g.tokens.iter().filter(|&&t| t % 2 == 0).count();
            even as f64 / g.tokens.len().max(1) as f64
        })
        .collect();
    let mut samples = Vec::with_capacity(gens.len());
    for (i, chunk) in gens.chunks(cfg.group).enumerate() {
        let r = &rewards[i * cfg.group..(i + 1) * cfg.group];
        let adv = crate::train::group_advantages(r, AdvantageKind::Grpo);
        for (j, g) in chunk.iter().enumerate() {
            let p = &prompts[i];
            let mut seq = p.clone();
            seq.extend(&g.tokens);
            samples.push(Sample {
                targets: (p.len()..seq.len()).collect(),
                seq,
                old_logp: g.logprobs.clone(),
                advantage: adv[j] as f32,
                episode: i * cfg.group + j,
                aux: false,
                aux_weight: 0.0,
                off_policy: false,
                forced: false,
                weight: 1.0,
                tis: Vec::new(),
            });
        }
    }
    let t1 = Instant::now();
    // As a run does: bf16 rollout weights are a behaviour policy of their
    // own, corrected for inside the update (the runs' cap).
    if policy.rollout_bf16() {
        trainer.step_corrected(policy, &mut samples, step, rng, 2.0)?;
    } else {
        trainer.step(policy, &samples, step, rng)?;
    }
    let update_s = t1.elapsed().as_secs_f64();
    Ok(GrpoStep {
        generate_s,
        update_s,
        step_s: t0.elapsed().as_secs_f64(),
        mean_reward: rewards.iter().sum::<f64>() / rewards.len() as f64,
        generated_tokens: gens.iter().map(|g| g.tokens.len()).sum(),
    })
}
