//! `actguide dev bench`: rollout and train throughput of a model on the
//! household env, measured over a few real GRPO steps (rollouts with the
//! step's batch of episodes, then one optimiser step on their tokens).

use std::path::PathBuf;

use crate::env::{make_env, panel, Env};
use crate::experiment::RunError;
use crate::guidance::ResolvedSpec;
use crate::model::{ModelConfig, Policy, Tok};
use crate::rollout::chat::PromptFormat;
use crate::rollout::{self, EpisodeRequest, RolloutOptions};
use crate::seed;
use crate::train::TrainerSection;
use crate::train::{build_samples, group_advantages, AdvantageKind, Trainer};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub model: PathBuf,
    pub panel: PathBuf,
    pub tasks: usize,
    pub group: usize,
    pub steps: usize,
    pub max_steps: usize,
    pub seed: u64,
    /// Guidance scripts whose entry-point cost is measured against the
    /// training step.
    pub scripts: Vec<PathBuf>,
    /// Where the model runs.
    pub device: crate::model::device::DeviceSpec,
    /// Compute precision; `None`: the device's default (bf16 on CUDA).
    pub dtype: Option<crate::model::Precision>,
}

/// Cost of one script's entry points per training step.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScriptCost {
    pub script: String,
    /// Mean wall time of plan + review + update per step, over
    /// `script_steps` simulated steps of the same batch shape.
    pub seconds_per_step: f64,
    pub rollouts_per_step: f64,
    /// As a percentage of the measured training step (rollout + train).
    pub percent_of_step: f64,
}

/// Measured figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    pub threads: usize,
    pub params: usize,
    pub episodes_per_step: usize,
    pub rollout_tokens_per_s: f64,
    pub generated_tokens_per_s: f64,
    pub train_tokens_per_s: f64,
    pub rollout_s_per_step: f64,
    pub train_s_per_step: f64,
    pub script_steps: usize,
    pub scripts: Vec<ScriptCost>,
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "threads              {}", self.threads)?;
        writeln!(f, "parameters           {}", self.params)?;
        writeln!(f, "episodes per step    {}", self.episodes_per_step)?;
        writeln!(
            f,
            "rollout tokens/s     {:.0} (prompt + generated)",
            self.rollout_tokens_per_s
        )?;
        writeln!(f, "generated tokens/s   {:.0}", self.generated_tokens_per_s)?;
        writeln!(
            f,
            "train tokens/s       {:.0} (forward + backward + AdamW)",
            self.train_tokens_per_s
        )?;
        write!(
            f,
            "seconds per step     {:.2} rollout + {:.2} train",
            self.rollout_s_per_step, self.train_s_per_step
        )?;
        for c in &self.scripts {
            write!(
                f,
                "\nscript {:<40} {:>8.3} ms/step ({:>5.1} rollouts/step) = {:.4}% of a step",
                c.script,
                c.seconds_per_step * 1e3,
                c.rollouts_per_step,
                c.percent_of_step
            )?;
        }
        Ok(())
    }
}

/// Run the benchmark.
pub fn run(cfg: &BenchConfig) -> Result<BenchReport, RunError> {
    let mcfg = ModelConfig::from_file(&cfg.model.join("config.json"))?;
    let tok = Tok::from_file(&cfg.model.join("tokenizer.json"))?;
    let device = cfg.device.open()?;
    let policy = Policy::new_random(&mcfg, &mut seed::rng(cfg.seed, &[1]), &device)?
        .with_precision(crate::model::Precision::resolve(cfg.dtype, cfg.device))?;
    let tasks = panel::read_jsonl(&cfg.panel)?;
    let mut trainer = Trainer::new(&policy, None, &TrainerSection::default(), cfg.steps, 1.0)?;
    let opts = RolloutOptions {
        temperature: 1.0,
        top_p: 1.0,
        greedy: false,
        constrained: true,
        history: 2,
        conversation: false,
        invalid_penalty: 0.0,
        max_action_tokens: 16,
        show_actions: true,
        record_prefix: false,
        max_steps: cfg.max_steps,
        step_slack: None,
        format: PromptFormat::Plain,
        env_concurrency: 1,
        engine: None,
    };
    let make = |limit: usize| -> Box<dyn Env> {
        make_env(
            &crate::env::EnvSpec::builtin(crate::env::BuiltinEnv::Household),
            limit,
        )
    };
    let (mut rt, mut rtok, mut gtok, mut tt, mut ttok) = (0.0, 0usize, 0usize, 0.0, 0usize);
    let mut episodes_per_step = 0;
    for step in 0..cfg.steps {
        let reqs: Vec<EpisodeRequest> = (0..cfg.tasks)
            .flat_map(|i| {
                let t = &tasks[(step * cfg.tasks + i) % tasks.len()];
                (0..cfg.group).map(move |_| EpisodeRequest {
                    task: t,
                    spec: ResolvedSpec::default(),
                })
            })
            .collect();
        episodes_per_step = reqs.len();
        let mut rng = seed::rng(cfg.seed, &[2, step as u64]);
        let (eps, st) = rollout::run(&policy, &tok, &make, &reqs, &opts, &mut rng, None)?;
        rt += st.seconds;
        rtok += st.prompt_tokens + st.generated_tokens;
        gtok += st.generated_tokens;
        // Non-zero advantages so the update does real work.
        let rewards: Vec<f64> = (0..eps.len()).map(|i| (i % 2) as f64).collect();
        let adv = group_advantages(&rewards, AdvantageKind::Grpo);
        let samples = build_samples(&eps, &adv.into(), &crate::train::SampleOptions::default());
        let ts = trainer.step(
            &policy,
            &samples,
            step,
            &mut seed::rng(cfg.seed, &[3, step as u64]),
        )?;
        tt += ts.seconds;
        ttok += ts.train_tokens;
    }
    let n = cfg.steps.max(1) as f64;
    // Script entry points on the same batch shape, against the synthetic
    // learner (the runtime calls are what is timed, not the learner).
    let step_s = (rt + tt) / n;
    let script_steps = 30;
    let mut scripts = Vec::new();
    for path in &cfg.scripts {
        let p = crate::guidance::simulate::SimParams {
            steps: script_steps,
            tasks_per_step: cfg.tasks,
            group_size: cfg.group,
            seed: cfg.seed,
            ..Default::default()
        };
        let mut runtime = crate::guidance::GuidanceRuntime::new(path, cfg.seed)?;
        let r = crate::guidance::simulate::simulate(&mut runtime, &tasks, &p)?;
        let per = r.script_seconds / script_steps as f64;
        scripts.push(ScriptCost {
            script: path.display().to_string(),
            seconds_per_step: per,
            rollouts_per_step: r.mean_rollouts_per_step,
            percent_of_step: 100.0 * per / step_s.max(1e-12),
        });
    }
    Ok(BenchReport {
        threads: candle_core::utils::get_num_threads(),
        params: policy.num_params(),
        episodes_per_step,
        rollout_tokens_per_s: rtok as f64 / rt.max(1e-9),
        generated_tokens_per_s: gtok as f64 / rt.max(1e-9),
        train_tokens_per_s: ttok as f64 / tt.max(1e-9),
        rollout_s_per_step: rt / n,
        train_s_per_step: tt / n,
        script_steps,
        scripts,
    })
}
