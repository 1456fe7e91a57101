//! The model side of an experiment, shared by `run`, `eval` and `probe`:
//! opening `model.path`, building the initial and the trained policy (full
//! weights or LoRA adapters on the frozen base, fresh or from a
//! checkpoint), and the rollout options with the prompt format resolved
//! against the model's chat template.

use std::path::Path;

use candle_core::Device;

use crate::experiment::config::Experiment;
use crate::experiment::RunError;
use crate::model::{ModelError, ModelSource, Policy};
use crate::rollout::chat::{ChatTemplate, PromptFormat};
use crate::rollout::RolloutOptions;
use crate::rundir::checkpoint::{self, CheckpointFiles, Loaded, RunState};
use crate::seed;
use crate::train::Trainer;

/// The device an experiment asks for (`model.device`).
pub fn device(exp: &Experiment) -> Result<Device, RunError> {
    exp.model.device.open().map_err(RunError::Model)
}

/// Opens the experiment's `model.path`.
pub fn open(exp: &Experiment) -> Result<ModelSource, RunError> {
    Ok(ModelSource::open(Path::new(&exp.model.path))?)
}

/// The run's initial policy without adapters: the source's weights, or a
/// random init from the run seed, in the experiment's precision
/// (`model.dtype`). It is also the frozen KL reference.
pub fn initial(exp: &Experiment, src: &ModelSource, device: &Device) -> Result<Policy, ModelError> {
    src.load(|| seed::rng(exp.seed, &[seed::label("init")]), device)?
        .with_precision(exp.model.precision())
}

/// The policy a run trains: from the checkpoint `resumed` when given, else
/// the initial one; with `model.lora`, adapters (fresh from the run seed,
/// or the checkpoint's) on the frozen base.
pub fn trained(
    exp: &Experiment,
    src: &ModelSource,
    resumed: Option<&Loaded>,
    device: &Device,
) -> Result<Policy, ModelError> {
    let mut p = trained_weights(exp, src, resumed, device)?;
    kernels(exp, &p).apply(&mut p)?;
    Ok(p)
}

/// The bf16 choices for the trained policy `p`: the experiment's explicit
/// settings, else the defaults for this CPU ([`crate::model::Kernels`]).
pub fn kernels(exp: &Experiment, p: &Policy) -> crate::model::Kernels {
    crate::model::Kernels::detect(p, exp.model.rollout_bf16, exp.model.mixed_precision)
}

fn trained_weights(
    exp: &Experiment,
    src: &ModelSource,
    resumed: Option<&Loaded>,
    device: &Device,
) -> Result<Policy, ModelError> {
    let file = |l: &Loaded| l.weights_path().display().to_string();
    match (&exp.model.lora, resumed) {
        (None, None) => initial(exp, src, device),
        (None, Some(l)) => {
            if l.adapter.is_some() {
                return Err(ModelError::InvalidArgument(format!(
                    "{}: the checkpoint holds LoRA adapters but the experiment has no model.lora",
                    l.dir.display()
                )));
            }
            Policy::from_tensors_with_arch(&src.cfg, &src.arch, l.weights.clone(), &file(l))?
                .with_precision(exp.model.precision())
        }
        (Some(lora), None) => initial(exp, src, device)?
            .with_lora(lora, &mut seed::rng(exp.seed, &[seed::label("lora")])),
        (Some(lora), Some(l)) => {
            if l.adapter.as_ref() != Some(lora) {
                return Err(ModelError::InvalidArgument(format!(
                    "{}: the checkpoint's adapters ({:?}) do not match model.lora ({lora:?})",
                    l.dir.display(),
                    l.adapter
                )));
            }
            initial(exp, src, device)?.with_lora_tensors(lora, l.weights.clone(), &file(l))
        }
    }
}

/// Restore the trainer's optimiser from a loaded checkpoint.
pub fn restore_optimizer(trainer: &mut Trainer, l: &Loaded) -> Result<(), RunError> {
    trainer
        .restore_optimizer(&l.optimizer, l.state.optimizer_t)
        .map_err(|e| RunError::Resume {
            checkpoint: l.dir.clone(),
            msg: e.to_string(),
        })
}

/// The experiment's rollout options. `rollout.format = "chat"` takes the
/// template the model declares (`chat_template` in `tokenizer_config.json`
/// or the GGUF) and falls back to the tokenizer's special tokens when it
/// declares none.
pub fn rollout_options(
    exp: &Experiment,
    src: &ModelSource,
    record_prefix: bool,
) -> Result<RolloutOptions, RunError> {
    let mut format = exp.rollout.format;
    if let (PromptFormat::Chat(None), Some(t)) = (format, src.chat_template()) {
        let template = ChatTemplate::from_jinja(t).ok_or_else(|| RunError::ChatTemplate {
            origin: src.chat_template_origin(),
        })?;
        format = PromptFormat::Chat(Some(template));
    }
    Ok(RolloutOptions {
        temperature: exp.rollout.temperature,
        top_p: exp.rollout.top_p,
        greedy: false,
        constrained: exp.rollout.constrained,
        history: exp.rollout.history,
        conversation: exp.rollout.conversation,
        invalid_penalty: exp.rollout.invalid_penalty,
        max_action_tokens: exp.rollout.max_action_tokens,
        show_actions: exp.rollout.show_actions,
        record_prefix,
        max_steps: exp.env.max_steps,
        step_slack: exp.env.step_slack,
        format,
        env_concurrency: if exp.env.is_builtin() {
            1
        } else {
            exp.env.concurrency.max(1)
        },
        // The run loop attaches the started engine to the training
        // rollouts' options; evaluation stays on the built-in model.
        engine: None,
    })
}

/// Save `<run_dir>/checkpoints/step-NNNNNN` with `state`: the trained
/// weights (under LoRA the Vars are the adapters alone, the base being
/// `model.path`), the optimiser state and the model's side files. Shared by
/// training runs and the SFT phase.
pub fn save_checkpoint(
    run_dir: &Path,
    state: &RunState,
    exp: &Experiment,
    src: &ModelSource,
    policy: &Policy,
    trainer: &Trainer,
) -> Result<std::path::PathBuf, RunError> {
    let weights = policy
        .named_vars()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect();
    Ok(checkpoint::save(
        run_dir,
        state,
        CheckpointFiles {
            weights,
            optimizer: trainer.optimizer().state_tensors(),
            adapter: policy.lora(),
            base_model: &exp.model.path,
            model: src,
        },
    )?)
}
