//! Hot reload at step boundaries: swap in edited scripts (or keep the last
//! good versions), save each new version, log every outcome to
//! `reloads.jsonl`.

use super::{task_view, Ctx, Event, RunError};
use crate::env::Task;
use crate::guidance::runtime::{ReloadOutcome, Role};
use crate::rundir::ReloadLine;
use crate::script::watch::FileWatcher;
use crate::script::ScriptError;

/// Why an edited script is not in effect ([`Event::Reload`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ReloadFailure {
    /// The new version failed to load or its checks; the last good
    /// version stays.
    #[error("{0}")]
    Rejected(ScriptError),
    /// The new version failed at run time on probation and was replaced by
    /// the last good one, `active`.
    #[error("{error} (runtime error on probation: back to version {active})")]
    Reverted { error: ScriptError, active: String },
}

/// Reload the scripts when a watched file changed since the last check.
pub(super) fn reload_if_edited(
    ctx: &mut Ctx,
    step: usize,
    task_idx: &[usize],
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let changed = std::mem::take(&mut ctx.reload_pending)
        || ctx
            .watcher
            .as_mut()
            .is_some_and(|w| w.changed(std::time::Duration::from_secs(2)));
    if changed {
        // The view reload checks a new version against: the step's first
        // task.
        let sample = ctx.train[task_idx[0]].clone();
        hot_reload(ctx, step, &sample, on_event)?;
    }
    Ok(())
}

/// Swap in edited scripts at a step boundary, or keep the last good
/// versions; either way each outcome goes to `reloads.jsonl`.
fn hot_reload(
    ctx: &mut Ctx,
    step: usize,
    sample: &Task,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let view = task_view(ctx, sample, step);
    let outcomes = ctx.runtime.reload(&view);
    for o in &outcomes {
        log_reload(ctx, step, o, on_event)?;
    }
    if outcomes.iter().any(|o| o.result.is_ok()) {
        // The set of imported files may have changed.
        ctx.watcher = FileWatcher::new(&ctx.runtime.watched_files()).ok();
    }
    Ok(())
}

/// One line of `reloads.jsonl` (and a copy of each new version).
pub(super) fn log_reload(
    ctx: &mut Ctx,
    step: usize,
    o: &ReloadOutcome,
    on_event: &mut dyn FnMut(Event),
) -> Result<(), RunError> {
    let role = o.role.name();
    let active = ctx
        .runtime
        .script_of(o.role)
        .map(|s| s.hash.clone())
        .unwrap_or_default();
    let (line, result) = match (&o.result, &o.reverted) {
        (Ok(hash), None) => {
            let copy = super::save_copy(&ctx.dir, o.role, ctx.runtime.script_of(o.role))?;
            ctx.copies.insert(role.to_string(), copy.clone());
            (
                ReloadLine::accepted(step, role, &o.file, hash, &copy),
                Ok(hash.clone()),
            )
        }
        (_, Some(e)) => (
            ReloadLine::reverted(step, role, &o.file, e.to_string(), &active),
            Err(ReloadFailure::Reverted {
                error: e.clone(),
                active: active.clone(),
            }),
        ),
        (Err(e), None) => (
            ReloadLine::rejected(step, role, &o.file, e.to_string(), &active),
            Err(ReloadFailure::Rejected(e.clone())),
        ),
    };
    if let Some(c) = ctx.copies.get(role) {
        if o.role == Role::Guidance {
            ctx.script_copy = c.clone();
        }
    }
    ctx.dir.append(&line)?;
    on_event(Event::Reload {
        step,
        role: role.to_string(),
        result,
    });
    Ok(())
}
