//! `actguide dev bench-model`: raw model throughput, independent of any env.
//!
//! For each batch size `B`, on random token prompts:
//! - **decode**: [`Policy::generate`] (greedy, KV cache) of `N` new tokens
//!   after a prompt of `P` tokens; `decode_tok_s = B·N / seconds` of the
//!   whole call (prefill included). Prefill is timed on its own as a
//!   `max_new_tokens = 1` call (`prefill_s`), and `decode_only_tok_s =
//!   B·(N−1) / (generate_s − prefill_s)` estimates the incremental steps.
//! - **train**: one optimiser step on `B` sequences of `L` tokens: score
//!   every position `1..L` ([`Policy::score`]), loss = −mean log-prob,
//!   backward, the crate's AdamW over all parameters;
//!   `train_tok_s = B·L / seconds` (forward + backward + optimiser).
//!
//! Every sequence decodes exactly `N` tokens: the eos id handed to
//! `generate` is not the model's eos but the last vocabulary id (a rare BPE
//! merge in real tokenizers), and the number of generated tokens is counted
//! and reported so a row where that assumption failed is visible
//! (`generated_tokens < B·N`). `scripts/bench_transformers.py` measures the
//! same workload with HF transformers (`min_new_tokens = max_new_tokens`).
//!
//! Each measurement runs once untimed (warm-up), then `repeats` times; the
//! row holds the fastest run (other processes only ever add time, so the
//! fastest is the best estimate of the quiet machine's figure; both sides
//! of `scripts/compare-hf.sh` use this rule), the per-run times are kept in
//! the JSON.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};
use rand::Rng;

use crate::model::{GenerateOptions, ModelError, Policy, ScoreBatch};
use crate::seed;
use crate::train::{AdamW, AdamWParams};

/// Errors of the model benchmark.
#[derive(Debug, thiserror::Error)]
pub enum ModelBenchError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("{}: neither a .gguf file nor a HF model folder", .0.display())]
    NotAModel(PathBuf),
    #[error("invalid benchmark settings: {0}")]
    InvalidArgument(String),
}

/// What to measure.
#[derive(Debug, Clone)]
pub struct ModelBenchConfig {
    /// A `.gguf` file or a HF model folder (`config.json` + safetensors).
    pub model: PathBuf,
    pub batches: Vec<usize>,
    /// Prompt length `P` of the decode measurement.
    pub prompt_len: usize,
    /// New tokens `N` per sequence.
    pub new_tokens: usize,
    /// Sequence length `L` of the train measurement.
    pub train_len: usize,
    /// Timed runs per measurement (after one warm-up).
    pub repeats: usize,
    pub seed: u64,
    /// AdamW learning rate of the train step (small: the weights barely
    /// move, so later decode runs see essentially the same model).
    pub lr: f64,
    /// Train LoRA adapters on the frozen base instead of every weight.
    pub lora: Option<crate::model::LoraConfig>,
    /// Where the model runs.
    pub device: crate::model::device::DeviceSpec,
    /// Compute precision; `None`: the device's default (bf16 on CUDA).
    pub dtype: Option<crate::model::Precision>,
    /// Generate from bf16 weight copies ([`Policy::set_rollout_bf16`]);
    /// `None`: this CPU's default ([`crate::model::Kernels`]).
    pub rollout_bf16: Option<bool>,
    /// Train with bf16 products ([`Policy::set_mixed_precision`]); `None`
    /// as for `rollout_bf16`.
    pub mixed_precision: Option<bool>,
}

impl Default for ModelBenchConfig {
    fn default() -> Self {
        ModelBenchConfig {
            model: PathBuf::new(),
            batches: vec![1, 8, 32],
            prompt_len: 64,
            new_tokens: 32,
            train_len: 128,
            lora: None,
            repeats: 3,
            seed: 0,
            lr: 1e-6,
            device: Default::default(),
            dtype: None,
            rollout_bf16: None,
            mixed_precision: None,
        }
    }
}

/// Figures for one batch size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelBenchRow {
    pub batch: usize,
    pub prompt_len: usize,
    pub new_tokens: usize,
    /// `batch · new_tokens / generate_s`.
    pub decode_tok_s: f64,
    /// Fastest seconds of a `max_new_tokens = 1` call (prefill + one token).
    pub prefill_s: f64,
    /// Fastest seconds of the full generate call.
    pub generate_s: f64,
    /// `batch · (new_tokens − 1) / (generate_s − prefill_s)`.
    pub decode_only_tok_s: f64,
    /// Tokens generated in the last timed run (should be `batch · new_tokens`).
    pub generated_tokens: usize,
    pub train_len: usize,
    /// `batch · train_len / train_s`.
    pub train_tok_s: f64,
    /// Fastest seconds of forward + backward + AdamW.
    pub train_s: f64,
    /// Mean seconds of the AdamW update alone (part of `train_s`; the
    /// rest is forward + backward).
    pub optimizer_s: f64,
    /// Per-run seconds of the timed runs.
    pub prefill_s_runs: Vec<f64>,
    pub generate_s_runs: Vec<f64>,
    pub train_s_runs: Vec<f64>,
    /// Mean loss (−mean log-prob) of the timed train steps.
    pub train_loss: f64,
    /// Mean and max |log-prob at generation − log-prob the trainer's f32
    /// scoring gives| over the last decode's tokens: 0 up to rounding for
    /// f32 generation, the behaviour mismatch for bf16 rollout weights.
    pub decode_logp_mismatch: f64,
    pub decode_logp_mismatch_max: f64,
}

/// Measured figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelBenchReport {
    pub implementation: String,
    /// The kernel line of run headers: the CPU (model, flags, class) and
    /// the bf16 choices.
    pub kernels: String,
    pub model: String,
    pub params: usize,
    pub vocab_size: usize,
    pub threads: usize,
    pub repeats: usize,
    pub load_s: f64,
    pub rows: Vec<ModelBenchRow>,
    /// Memory held by the packed rollout weights: MKL's bf16 packs
    /// (`--rollout-bf16`) or the f32 packs of the decode kernel.
    pub rollout_packed_bytes: Option<usize>,
}

impl std::fmt::Display for ModelBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "implementation {}", self.implementation)?;
        writeln!(f, "kernels        {}", self.kernels)?;
        writeln!(f, "model          {}", self.model)?;
        writeln!(
            f,
            "parameters     {} (vocab {})",
            self.params, self.vocab_size
        )?;
        writeln!(f, "threads        {}", self.threads)?;
        writeln!(f, "repeats        {} (after one warm-up)", self.repeats)?;
        write!(f, "{}", table_header())?;
        for r in &self.rows {
            write!(
                f,
                "\n{:>5} {:>6} {:>4} {:>10.1} {:>10.1} {:>9.3} {:>9.3} {:>6} {:>10.1} {:>9.3} {:>9.3} {:>9.5}",
                r.batch,
                r.prompt_len,
                r.new_tokens,
                r.decode_tok_s,
                r.decode_only_tok_s,
                r.prefill_s,
                r.generate_s,
                r.train_len,
                r.train_tok_s,
                r.train_s,
                r.optimizer_s,
                r.decode_logp_mismatch
            )?;
        }
        if let Some(b) = self.rollout_packed_bytes {
            write!(
                f,
                "\npacked weights for decode: {:.0} MB",
                b as f64 / 1048576.0
            )?;
        }
        Ok(())
    }
}

fn table_header() -> String {
    format!(
        "{:>5} {:>6} {:>4} {:>10} {:>10} {:>9} {:>9} {:>6} {:>10} {:>9} {:>9} {:>9}",
        "batch",
        "prompt",
        "new",
        "decode/s",
        "dec-only/s",
        "prefill_s",
        "gen_s",
        "train",
        "train/s",
        "train_s",
        "optim_s",
        "|Δlogp|"
    )
}

/// The smallest of timed runs (0 for none).
fn fastest(xs: &[f64]) -> f64 {
    xs.iter().copied().reduce(f64::min).unwrap_or(0.0)
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Loads a `.gguf` file or a HF model folder (`config.json` + weights; no
/// tokenizer needed) as a trainable f32 policy on `device`.
pub fn load_model(path: &Path, device: &Device) -> Result<Policy, ModelBenchError> {
    if path.is_dir() {
        Ok(Policy::from_hf_dir(path, device)?)
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        Ok(Policy::from_gguf(path, device)?)
    } else {
        Err(ModelBenchError::NotAModel(path.to_path_buf()))
    }
}

/// Range `lo..vocab - 1` of the random ids: `lo` skips the config's
/// special ids when they sit at the start of the vocabulary (as in
/// SmolLM2's), and the last id is left out because it is the benchmark's
/// eos.
fn token_range(policy: &Policy) -> (u32, u32) {
    let c = policy.config();
    let vocab = c.vocab_size as u32;
    let top = [c.bos_token_id, c.eos_token_id, c.pad_token_id]
        .into_iter()
        .flatten()
        .max()
        .map_or(0, |m| m + 1);
    let lo = if top < vocab / 2 { top } else { 0 };
    (lo, vocab.saturating_sub(1).max(lo + 1))
}

fn random_seqs(rng: &mut impl Rng, range: (u32, u32), b: usize, len: usize) -> Vec<Vec<u32>> {
    (0..b)
        .map(|_| {
            (0..len)
                .map(|_| rng.random_range(range.0..range.1))
                .collect()
        })
        .collect()
}

/// Mean and max |generation log-prob − f32 score log-prob| of the
/// generated tokens.
fn logp_mismatch(
    policy: &Policy,
    prompts: &[Vec<u32>],
    out: &[crate::model::Generated],
) -> Result<(f64, f64), ModelBenchError> {
    let batch = ScoreBatch {
        seqs: prompts
            .iter()
            .zip(out)
            .map(|(p, g)| p.iter().chain(&g.tokens).copied().collect())
            .collect(),
        targets: prompts
            .iter()
            .zip(out)
            .map(|(p, g)| (p.len()..p.len() + g.tokens.len()).collect())
            .collect(),
        temperature: 1.0,
        share_prefixes: false,
    };
    let scored = policy.score_detached(&batch)?.logp.to_vec1::<f32>()?;
    let gen: Vec<f32> = out
        .iter()
        .flat_map(|g| g.logprobs.iter().copied())
        .collect();
    let d: Vec<f64> = scored
        .iter()
        .zip(&gen)
        .map(|(a, b)| f64::from((a - b).abs()))
        .collect();
    Ok((mean(&d), d.iter().copied().fold(0.0, f64::max)))
}

/// One train step; returns the loss and the seconds of the optimiser
/// update alone.
fn train_step(
    policy: &Policy,
    opt: &mut AdamW,
    seqs: &[Vec<u32>],
    lr: f64,
) -> Result<(f64, f64), ModelBenchError> {
    let batch = ScoreBatch {
        seqs: seqs.to_vec(),
        targets: seqs.iter().map(|s| (1..s.len()).collect()).collect(),
        temperature: 1.0,
        share_prefixes: false,
    };
    let out = policy.score(&batch)?;
    let loss = out.logp.mean_all()?.neg()?;
    let grads = loss.backward()?;
    let g: Vec<Option<Tensor>> = opt.grads_from(&grads);
    let loss = f64::from(loss.to_scalar::<f32>()?);
    let t = Instant::now();
    opt.step(&g, lr)?;
    // Asynchronous devices (CUDA) finish the step before the clock stops.
    policy.device().synchronize()?;
    Ok((loss, t.elapsed().as_secs_f64()))
}

/// Run the benchmark.
pub fn run(cfg: &ModelBenchConfig) -> Result<ModelBenchReport, ModelBenchError> {
    let t0 = Instant::now();
    let device = cfg.device.open()?;
    let precision = crate::model::Precision::resolve(cfg.dtype, cfg.device);
    let mut policy = load_model(&cfg.model, &device)?.with_precision(precision)?;
    if let Some(l) = &cfg.lora {
        policy = policy.with_lora(l, &mut seed::rng(cfg.seed, &[seed::label("lora")]))?;
    }
    crate::model::Kernels::detect(&policy, cfg.rollout_bf16, cfg.mixed_precision)
        .apply(&mut policy)?;
    let load_s = t0.elapsed().as_secs_f64();
    run_with(&policy, &cfg.model.display().to_string(), load_s, cfg)
}

/// Run the benchmark on an already loaded policy.
pub fn run_with(
    policy: &Policy,
    model_name: &str,
    load_s: f64,
    cfg: &ModelBenchConfig,
) -> Result<ModelBenchReport, ModelBenchError> {
    if cfg.batches.is_empty() || cfg.batches.contains(&0) {
        return Err(ModelBenchError::InvalidArgument(
            "batch sizes must be >= 1 (and at least one given)".into(),
        ));
    }
    if cfg.prompt_len == 0 || cfg.new_tokens == 0 || cfg.train_len < 2 || cfg.repeats == 0 {
        return Err(ModelBenchError::InvalidArgument(format!(
            "need prompt_len >= 1, new_tokens >= 1, train_len >= 2, repeats >= 1 \
             (got {}, {}, {}, {})",
            cfg.prompt_len, cfg.new_tokens, cfg.train_len, cfg.repeats
        )));
    }
    let vocab = policy.config().vocab_size;
    let range = token_range(policy);
    let gen_opts = |n: usize| GenerateOptions {
        max_new_tokens: n,
        temperature: 1.0,
        top_p: 1.0,
        greedy: true,
        // Not the model's eos: see the module docs.
        eos_token_id: (vocab - 1) as u32,
    };
    let mut opt = AdamW::new(policy.named_vars(), AdamWParams::without_decay())?;
    let mut rows = Vec::new();
    for (bi, &b) in cfg.batches.iter().enumerate() {
        let mut rng = seed::rng(cfg.seed, &[seed::label("bench-model"), bi as u64]);
        let prompts = random_seqs(&mut rng, range, b, cfg.prompt_len);
        let train_seqs = random_seqs(&mut rng, range, b, cfg.train_len);

        // Decode.
        policy.generate(&prompts, &gen_opts(cfg.new_tokens), None, &mut rng)?;
        let (mut prefill, mut gen) = (Vec::new(), Vec::new());
        let mut last = Vec::new();
        for _ in 0..cfg.repeats {
            let t = Instant::now();
            policy.generate(&prompts, &gen_opts(1), None, &mut rng)?;
            prefill.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            last = policy.generate(&prompts, &gen_opts(cfg.new_tokens), None, &mut rng)?;
            gen.push(t.elapsed().as_secs_f64());
        }
        let generated_tokens: usize = last.iter().map(|g| g.tokens.len()).sum();
        let (mismatch, mismatch_max) = logp_mismatch(policy, &prompts, &last)?;

        // Train.
        train_step(policy, &mut opt, &train_seqs, cfg.lr)?;
        let mut train = Vec::new();
        let mut losses = Vec::new();
        let mut optim = Vec::new();
        for _ in 0..cfg.repeats {
            let t = Instant::now();
            let (loss, o) = train_step(policy, &mut opt, &train_seqs, cfg.lr)?;
            train.push(t.elapsed().as_secs_f64());
            losses.push(loss);
            optim.push(o);
        }

        let (prefill_s, generate_s, train_s) = (fastest(&prefill), fastest(&gen), fastest(&train));
        let decode_only_s = generate_s - prefill_s;
        rows.push(ModelBenchRow {
            batch: b,
            prompt_len: cfg.prompt_len,
            new_tokens: cfg.new_tokens,
            decode_tok_s: generated_tokens as f64 / generate_s.max(1e-12),
            prefill_s,
            generate_s,
            decode_only_tok_s: if cfg.new_tokens > 1 && decode_only_s > 0.0 {
                generated_tokens.saturating_sub(b) as f64 / decode_only_s
            } else {
                0.0
            },
            generated_tokens,
            train_len: cfg.train_len,
            train_tok_s: (b * cfg.train_len) as f64 / train_s.max(1e-12),
            train_s,
            optimizer_s: mean(&optim),
            prefill_s_runs: prefill,
            generate_s_runs: gen,
            train_s_runs: train,
            train_loss: mean(&losses),
            decode_logp_mismatch: mismatch,
            decode_logp_mismatch_max: mismatch_max,
        });
    }
    Ok(ModelBenchReport {
        rollout_packed_bytes: policy.rollout_packed_bytes(),
        implementation: format!(
            "actguide (candle, {}{}, {})",
            policy.precision(),
            match (policy.rollout_bf16(), policy.mixed_precision()) {
                (true, true) => ", bf16 rollout weights, mixed-precision training",
                (true, false) => ", bf16 rollout weights",
                (false, true) => ", mixed-precision training",
                (false, false) => "",
            },
            match policy.device() {
                Device::Cpu => format!("CPU, matmul: {}", crate::model::matmul_backend()),
                d => format!("{d:?}"),
            }
        ),
        kernels: crate::model::Kernels::of(policy).line(),
        model: model_name.to_string(),
        params: policy.num_params(),
        vocab_size: vocab,
        threads: candle_core::utils::get_num_threads(),
        repeats: cfg.repeats,
        load_s,
        rows,
    })
}
