//! Opening a run: a fresh run directory, or the latest checkpoint of one to
//! resume; panels and clusters; the policy, its frozen reference and the
//! trainer; the scripts (on resume, the versions active at the
//! checkpoint). The order of these steps is the order of the random draws.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Device;

use super::{save_copy, sft, Ctx, Kind, RunError, RunOptions};
use crate::env::{fill_experts, panel, Task};
use crate::experiment::config::Experiment;
use crate::experiment::models;
use crate::guidance::runtime::Role;
use crate::guidance::{Clusters, GuidanceRuntime};
use crate::model::{ModelSource, Policy};
use crate::rundir::checkpoint::{self, Loaded};
use crate::rundir::RunDir;
use crate::script::watch::FileWatcher;
use crate::train::Trainer;

/// What [`setup`] builds: the run's context, its kind of step, the step to
/// start at and the warnings to show (damaged log lines set aside on
/// resume).
type Opened = (Ctx, Kind, usize, Vec<String>);

/// Build everything a run holds, for the steps of `opts.kind`.
pub(super) fn setup(exp: Experiment, opts: &RunOptions) -> Result<Opened, RunError> {
    let mut claimed = None;
    let r = open(exp, opts, &mut claimed);
    if let (Err(_), Some(dir)) = (&r, claimed) {
        // A fresh run refused while it was being set up leaves nothing
        // behind (so the corrected rerun gets the same name).
        let _ = std::fs::remove_dir_all(dir);
    }
    r
}

/// [`setup`]; `claimed` is set to a fresh run's new directory.
fn open(
    exp: Experiment,
    opts: &RunOptions,
    claimed: &mut Option<PathBuf>,
) -> Result<Opened, RunError> {
    let mut warnings = Vec::new();
    let device = models::device(&exp)?;
    let (dir, lock, resumed) = open_dir(&exp, opts, &device, claimed)?;
    dir.create()?;
    if exp.model.rollout_bf16 == Some(true) && crate::model::cpu_has_amx_bf16() == Some(false) {
        warnings.push(
            "model.rollout_bf16: this CPU has no AMX bf16 units, so MKL's bf16 products run \
             slower than its f32 ones here (SmolLM2 decode: 11.5 against 31.3 tok/s on an AMD \
             EPYC); rollouts will be slower, not faster"
                .into(),
        );
    }
    let (train, test, clusters) = panels(&exp)?;
    let kind = match opts.kind {
        crate::rundir::RunKind::Rl => Kind::Rl,
        crate::rundir::RunKind::Sft => Kind::Sft(Box::new(sft::SftKind::new(&exp)?)),
    };
    let src = models::open(&exp)?;
    crate::model::memory::before_loading(
        &crate::model::memory::Footprint::lower_bound(
            &src.cfg,
            exp.model.precision(),
            exp.model.lora.is_some(),
        ),
        exp.trainer.kl_coef > 0.0,
        opts.memory_limit,
        &device,
        &exp.model.device.to_string(),
    )?;
    let tok = src.tok.clone();
    warnings.extend(unencodable_expert_words(&tok, &train, &test));
    warnings.extend(unencodable_shown_actions(&exp, &tok)?);
    // SFT trains on the NLL of expert actions alone.
    let settings = match &kind {
        Kind::Rl => exp.trainer.clone(),
        Kind::Sft(_) => sft::trainer_settings(&exp.trainer),
    };
    let (policy, mut trainer) =
        policy_and_trainer(&exp, &settings, &src, resumed.as_ref(), &device)?;
    let mut runtime = open_scripts(&exp, resumed.as_ref())?;
    let scripts = match &resumed {
        Some(l) => resume_state(&exp, l, &mut trainer, &mut runtime)?,
        None => fresh_state(&exp, &dir, &mut runtime)?,
    };
    if let Some(l) = &resumed {
        vouch_for_resume(&exp, l, &dir, opts, &mut warnings)?;
        dir.truncate_for_resume(scripts.start_step, &mut warnings)?;
    }
    let regions = dir.regions()?;
    let tb = Some(dir.tensorboard()?);
    let ropts = models::rollout_options(
        &exp,
        &src,
        settings.aux_nll_coef > 0.0 || settings.train_prefix,
    )?;
    let watcher = FileWatcher::new(&runtime.watched_files()).ok();
    Ok((
        Ctx {
            _lock: lock,
            watcher,
            ranks: None,
            prefetched: None,
            exp,
            dir,
            train,
            test,
            clusters,
            tok,
            src,
            policy,
            trainer,
            runtime,
            script_copy: scripts.script_copy,
            copies: scripts.copies,
            evals: scripts.evals,
            regions,
            tb,
            ropts,
            // Edits made while the run was stopped reached no watcher:
            // the first step compares every script with its file.
            reload_pending: resumed.is_some(),
        },
        kind,
        scripts.start_step,
        warnings,
    ))
}

/// The run directory of [`open`], locked: the resumed one with its latest
/// checkpoint (refused when it is of the other run kind), or a fresh one
/// (`claimed` is set to it).
fn open_dir(
    exp: &Experiment,
    opts: &RunOptions,
    device: &Device,
    claimed: &mut Option<PathBuf>,
) -> Result<(RunDir, crate::rundir::RunLock, Option<checkpoint::Loaded>), RunError> {
    Ok(match &opts.resume {
        Some(d) => {
            let dir = RunDir::at(d);
            // A live run's directory is refused before anything is read
            // (a missing one gets the checkpoint loader's message).
            let lock = if d.is_dir() { Some(dir.lock()?) } else { None };
            let need = match opts.accept_unverified {
                true => checkpoint::Sums::MayLack,
                false => checkpoint::Sums::Required,
            };
            let loaded = checkpoint::load_latest(d, device, need)?;
            if loaded.state.kind != opts.kind {
                return Err(RunError::Resume {
                    checkpoint: loaded.dir.clone(),
                    msg: format!(
                        "this checkpoint is of an {} run; resume it with `{} --resume {}`",
                        serde_json::to_value(loaded.state.kind)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_uppercase))
                            .unwrap_or_default(),
                        loaded.state.kind.command(),
                        d.display()
                    ),
                });
            }
            let lock = match lock {
                Some(l) => l,
                None => dir.lock()?,
            };
            (dir, lock, Some(loaded))
        }
        None => {
            let (dir, lock) = RunDir::claim(&exp.run_dir())?;
            *claimed = Some(dir.path().to_path_buf());
            (dir, lock, None)
        }
    })
}

/// A warning when the tokenizer cannot encode words of the panels' expert
/// actions (those actions reach the env cut short).
fn unencodable_expert_words(
    tok: &crate::model::Tok,
    train: &[Task],
    test: &[Task],
) -> Option<String> {
    let unencodable = tok.unencodable_words(
        train
            .iter()
            .chain(test)
            .flat_map(|t| t.expert.iter().map(String::as_str)),
    );
    if unencodable.is_empty() {
        return None;
    }
    let shown: Vec<&str> = unencodable.iter().take(20).map(String::as_str).collect();
    Some(format!(
        "the tokenizer cannot encode {} word(s) of the panels' expert actions: {}{} — \
             actions with them reach the env cut short; build a vocabulary that has them \
             (actguide init-tiny) or use another tokenizer",
        unencodable.len(),
        shown.join(", "),
        if unencodable.len() > shown.len() {
            ", …"
        } else {
            ""
        }
    ))
}

/// A warning per panel whose env showed admissible actions the tokenizer
/// cannot encode (the `.seen.json` file `tasks from-server` writes beside
/// a panel): the policy could not name what those actions name.
pub(super) fn unencodable_shown_actions(
    exp: &Experiment,
    tok: &crate::model::Tok,
) -> Result<Vec<String>, RunError> {
    use crate::env::harvest::Seen;
    let mut out = Vec::new();
    let mut panels = vec![&exp.env.train];
    if exp.env.test != exp.env.train {
        panels.push(&exp.env.test);
    }
    for panel in panels {
        let path = Path::new(panel);
        let Some(seen) = Seen::read_for(path)? else {
            continue;
        };
        let bad: Vec<&String> = seen
            .actions
            .iter()
            .filter(|a| !tok.unencodable_words([a.as_str()]).is_empty())
            .collect();
        if let Some(first) = bad.first() {
            out.push(format!(
                "the tokenizer cannot encode {} of the {} admissible action(s) the env showed \
                 while {panel} was built ({}), e.g. {first:?}: the policy cannot choose them; \
                 build the card with them (actguide init-tiny --panel {panel} --out DIR)",
                bad.len(),
                seen.actions.len(),
                Seen::path_for(path).display(),
            ));
        }
    }
    Ok(out)
}

/// The train and test panels (with expert actions a subprocess env
/// supplies where a panel lacks them) and the difficulty clusters of the
/// train panel.
pub(super) fn panels(exp: &Experiment) -> Result<(Vec<Task>, Vec<Task>, Clusters), RunError> {
    let mut train = panel::read_jsonl(Path::new(&exp.env.train))?;
    let mut test = panel::read_jsonl(Path::new(&exp.env.test))?;
    let spec = exp.env.spec();
    for (tasks, path) in [(&mut train, &exp.env.train), (&mut test, &exp.env.test)] {
        fill_experts(&spec, tasks).map_err(|source| RunError::Experts {
            panel: PathBuf::from(path),
            source,
        })?;
    }
    if train.iter().all(|t| t.expert.is_empty()) {
        return Err(RunError::NoExperts {
            panel: PathBuf::from(&exp.env.train),
        });
    }
    let clusters =
        Clusters::from_expert_lengths(train.iter().map(|t| t.expert.len()), exp.guidance.clusters);
    Ok((train, test, clusters))
}

/// The policy (the model source's weights, else the seed's, or the
/// checkpoint's) and its trainer.
pub(super) fn policy_and_trainer(
    exp: &Experiment,
    settings: &crate::train::TrainerSection,
    src: &ModelSource,
    resumed: Option<&Loaded>,
    device: &Device,
) -> Result<(Policy, Trainer), RunError> {
    // The initial policy (from the model source, else the seed) is also
    // the frozen KL reference, after a resume too; with LoRA the adapters
    // start at zero, so it is exactly the adapted model's start.
    let policy = models::trained(exp, src, resumed, device)?;
    let reference = if settings.kl_coef > 0.0 {
        Some(models::initial(exp, src, device)?)
    } else {
        None
    };
    let trainer = Trainer::new(
        &policy,
        reference.as_ref(),
        settings,
        exp.steps,
        exp.rollout.temperature,
    )?;
    Ok((policy, trainer))
}

/// The reward and intervention scripts the experiment names.
fn hooks(exp: &Experiment) -> [(Role, Option<String>); 2] {
    [
        (Role::Reward, exp.guidance.reward.clone()),
        (Role::Intervene, exp.guidance.intervene.clone()),
    ]
}

/// The guidance runtime with its scripts: on resume, the versions that were
/// active at the checkpoint (their saved copies), still following the
/// experiment's files for hot reload.
pub(crate) fn open_scripts(
    exp: &Experiment,
    resumed: Option<&Loaded>,
) -> Result<GuidanceRuntime, RunError> {
    let script_path = match resumed {
        Some(l) => PathBuf::from(&l.state.script_copy),
        None => PathBuf::from(&exp.guidance.script),
    };
    let mut runtime = GuidanceRuntime::new(&script_path, exp.seed)?;
    runtime.set_call_budget(std::time::Duration::from_secs_f64(
        exp.guidance.call_budget_s,
    ));
    for (role, path) in &hooks(exp) {
        let Some(path) = path else { continue };
        let from = resumed
            .and_then(|l| l.state.copies.get(role.name()))
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(path));
        match role {
            Role::Reward => runtime.set_reward_script(&from)?,
            _ => runtime.set_intervene_script(&from)?,
        }
        runtime.set_source(*role, Path::new(path));
    }
    Ok(runtime)
}

/// A resume continues only what it can vouch for: the experiment the
/// checkpoint was trained under (its copy in `state.json`, under
/// `SHA256SUMS`), unless `--accept-changed-config` takes the new settings
/// knowingly. Each resume is recorded in `resumes.jsonl`.
fn vouch_for_resume(
    exp: &Experiment,
    l: &Loaded,
    dir: &RunDir,
    opts: &RunOptions,
    warnings: &mut Vec<String>,
) -> Result<(), RunError> {
    let mut changed = Vec::new();
    if let (Some(then), Ok(now)) = (&l.state.experiment, serde_json::to_value(exp)) {
        diff_settings("", then, &now, &mut changed);
    }
    if !changed.is_empty() && !opts.accept_changed_config {
        return Err(RunError::Resume {
            checkpoint: l.dir.clone(),
            msg: format!(
                "the experiment differs from the one this checkpoint was trained under ({}); \
                 restore the run's experiment.json, or resume with --accept-changed-config to \
                 continue under the new settings (recorded in resumes.jsonl)",
                changed.join("; ")
            ),
        });
    }
    let unverified = !l.dir.join(checkpoint::SUMS_FILE).is_file();
    if !changed.is_empty() {
        warnings.push(format!(
            "resumed under changed settings (--accept-changed-config): {}",
            changed.join("; ")
        ));
    }
    if unverified {
        warnings.push(format!(
            "resumed from {} without {} (--accept-unverified): its files were not checked",
            l.dir.display(),
            checkpoint::SUMS_FILE
        ));
    }
    dir.append(&crate::rundir::ResumeLine {
        step: Some(l.state.step),
        checkpoint: Some(l.dir.display().to_string()),
        changed,
        unverified,
    })?;
    Ok(())
}

/// Every leaf setting that differs between two resolved experiments, as
/// `key: old → new`.
fn diff_settings(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    let key = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let none = Value::Null;
                diff_settings(
                    &key(k),
                    x.get(k).unwrap_or(&none),
                    y.get(k).unwrap_or(&none),
                    out,
                );
            }
        }
        (x, y) if x != y => out.push(format!("{path}: {x} → {y}")),
        _ => {}
    }
}

/// Where the run starts, and its script bookkeeping.
struct ScriptState {
    start_step: usize,
    /// Test success by evaluated step.
    evals: Vec<(usize, f64)>,
    /// The saved copy of the active guidance script.
    script_copy: String,
    /// Saved copies of the active reward and intervention scripts, by role.
    copies: BTreeMap<String, String>,
}

/// Restore the optimiser and the scripts' state from the checkpoint.
fn resume_state(
    exp: &Experiment,
    l: &Loaded,
    trainer: &mut Trainer,
    runtime: &mut GuidanceRuntime,
) -> Result<ScriptState, RunError> {
    let resume = |msg: String| RunError::Resume {
        checkpoint: l.dir.clone(),
        msg,
    };
    models::restore_optimizer(trainer, l)?;
    runtime
        .restore(&l.state.runtime)
        .map_err(|e| resume(e.to_string()))?;
    runtime.set_source(Role::Guidance, Path::new(&exp.guidance.script));
    Ok(ScriptState {
        start_step: l.state.step,
        evals: l.state.evals.clone(),
        script_copy: l.state.script_copy.clone(),
        copies: l.state.copies.clone(),
    })
}

/// Start the scripts, save their first versions and the resolved
/// experiment (so a run directory says exactly what ran).
fn fresh_state(
    exp: &Experiment,
    dir: &RunDir,
    runtime: &mut GuidanceRuntime,
) -> Result<ScriptState, RunError> {
    runtime.init()?;
    let script_copy = save_copy(dir, Role::Guidance, Some(runtime.script()))?;
    let mut copies = BTreeMap::new();
    for (role, _) in hooks(exp).iter().filter(|h| h.1.is_some()) {
        let c = save_copy(dir, *role, runtime.script_of(*role))?;
        copies.insert(role.name().to_string(), c);
    }
    dir.write_experiment(exp)?;
    Ok(ScriptState {
        start_step: 0,
        evals: Vec::new(),
        script_copy,
        copies,
    })
}
