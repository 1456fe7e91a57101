//! Asynchronous rollouts (`rollout.async`, docs/DISTRIBUTED.md): while
//! step t trains, step t+1's rollouts are driven on the engine servers.
//!
//! One step of overlap: step t+1's plan, rollout batches and review rounds
//! run on a second thread beside step t's behaviour correction, update
//! and weight sync. The engine finishes the requests in flight on the old
//! weights, then serves the new ones (`Pool::begin_sync`), so each turn
//! is generated at one version and an episode carries the oldest of its
//! turns' (`Episode::policy_version`). When step t+1 trains version t+1,
//! its episodes are 0 or 1 versions old; those older than
//! `max_staleness` leave the batch and are counted, and the trainer's
//! behaviour correction (`tis_cap`) covers the lag of the rest.
//!
//! The scripts keep their contract but see results one step later: step
//! t+1's `plan` runs before step t's `update`, so it knows results up to
//! step t−1. A step followed by a checkpoint (and the last step) does not
//! drive ahead, so a checkpoint never holds rollouts in flight and resume
//! continues as the uninterrupted run would. Which turns land before the
//! weight sync depends on timing: asynchronous runs are not reproducible
//! to the bit, unlike synchronous ones.

use super::phases::Driven;
use super::timings::{Phase, Timings};
use super::{Ctx, Event};
use crate::guidance::TaskView;

/// A step's rollouts, driven while the previous step trained.
pub(super) struct Prefetched {
    pub(super) step: usize,
    task_idx: Vec<usize>,
    views: Vec<TaskView>,
    driven: Driven,
    /// The drive's events (script errors, logs), told when the step runs.
    events: Vec<Event>,
    /// Seconds of the drive's phases (drive, execute, generate).
    secs: [f64; 3],
}

const DRIVE_PHASES: [Phase; 3] = [Phase::Drive, Phase::Execute, Phase::Generate];

impl Prefetched {
    pub(super) fn new(
        step: usize,
        (task_idx, views): (Vec<usize>, Vec<TaskView>),
        driven: Driven,
        events: Vec<Event>,
        secs: [f64; 3],
    ) -> Self {
        Prefetched {
            step,
            task_idx,
            views,
            driven,
            events,
            secs,
        }
    }

    /// The step's tasks, views and rollouts; its drive's events are told
    /// and its clock added to the step's.
    pub(super) fn take(
        self,
        timings: &Timings,
        on_event: &mut dyn FnMut(Event),
    ) -> (Vec<usize>, Vec<TaskView>, Driven, bool) {
        for e in self.events {
            on_event(e);
        }
        for (p, s) in DRIVE_PHASES.iter().zip(self.secs) {
            timings.add(*p, s);
        }
        (self.task_idx, self.views, self.driven, true)
    }
}

/// Under `rollout.async`: (the policy version this step trains, the
/// largest lag kept).
pub(super) fn lag_limit(ctx: &Ctx) -> Option<(u64, u64)> {
    let a = ctx.exp.rollout.async_rollouts.as_ref()?;
    let e = ctx.ropts.engine.as_ref()?;
    Some((e.pool().version(), a.max_staleness))
}

/// Run `update` on this thread and `drive` on a second one at the same
/// time. The drive gets its own clock and collects its events (told when
/// its step runs); returns the update's result, the drive's, its events
/// and its phase seconds.
pub(super) fn beside<D: Send, U>(
    drive: impl FnOnce(&Timings, &mut dyn FnMut(Event)) -> D + Send,
    update: impl FnOnce() -> U,
) -> (U, D, Vec<Event>, [f64; 3]) {
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            let clock = Timings::start();
            let mut events = Vec::new();
            let d = drive(&clock, &mut |e| events.push(e));
            (d, events, DRIVE_PHASES.map(|p| clock.secs(p)))
        });
        let u = update();
        // A panic there is a panic here, as in a synchronous step.
        let (d, events, secs) = h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        (u, d, events, secs)
    })
}
