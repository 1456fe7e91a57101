//! Wall-clock seconds of a training step, by phase (the model is verl's
//! `marked_timer`): `let _t = timings.mark(Phase::Update);` adds the time
//! until the end of the scope to that phase. The phases are what the
//! `time` block of the step's metrics line reports ([`Timings::step_times`]).
//! Timings use interior mutability so a phase can be marked while another
//! one runs (rollout execution inside the drive).

use std::cell::Cell;
use std::time::Instant;

use crate::experiment::metrics::round;
use crate::rundir::StepTimes;

/// A timed part of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Planning, rollouts and review rounds, all of it.
    Drive,
    /// Executing rollout batches inside [`Phase::Drive`], the reward and
    /// intervention scripts excluded.
    Execute,
    /// Generation, by the rollout runner's own clock.
    Generate,
    /// The policy update, by the trainer's own clock.
    Train,
    /// The guidance script's update with the step's results.
    Update,
}

impl Phase {
    const COUNT: usize = 5;

    fn index(self) -> usize {
        self as usize
    }
}

/// Seconds per phase of one training step, and the step's start.
#[derive(Debug)]
pub struct Timings {
    start: Instant,
    secs: [Cell<f64>; Phase::COUNT],
}

/// Adds the time from its creation to its drop to a phase.
#[must_use = "the phase is timed until this guard drops"]
pub struct Mark<'a> {
    timings: &'a Timings,
    phase: Phase,
    start: Instant,
}

impl Drop for Mark<'_> {
    fn drop(&mut self) {
        self.timings
            .add(self.phase, self.start.elapsed().as_secs_f64());
    }
}

impl Timings {
    /// The step starts now.
    pub fn start() -> Self {
        Timings {
            start: Instant::now(),
            secs: Default::default(),
        }
    }

    /// Time `phase` until the returned guard drops.
    pub fn mark(&self, phase: Phase) -> Mark<'_> {
        Mark {
            timings: self,
            phase,
            start: Instant::now(),
        }
    }

    /// Add seconds measured elsewhere (a sub-system's own clock).
    pub fn add(&self, phase: Phase, secs: f64) {
        let c = &self.secs[phase.index()];
        c.set(c.get() + secs);
    }

    pub fn secs(&self, phase: Phase) -> f64 {
        self.secs[phase.index()].get()
    }

    /// Scripts' share: the drive outside rollout execution (planning,
    /// reviews, reward and intervention hooks), plus the update.
    pub fn script_s(&self) -> f64 {
        (self.secs(Phase::Drive) - self.secs(Phase::Execute)).max(0.0) + self.secs(Phase::Update)
    }

    /// The `time` block of the metrics line, with the step's token counts
    /// for the throughputs; the step's own time is taken now.
    pub fn step_times(&self, rollout_tokens: usize, train_tokens: usize) -> StepTimes {
        let (generate, train) = (self.secs(Phase::Generate), self.secs(Phase::Train));
        StepTimes {
            rollout_s: Some(round(generate)),
            train_s: Some(round(train)),
            script_s: Some(round(self.script_s())),
            step_s: Some(round(self.start.elapsed().as_secs_f64())),
            rollout_tokens_per_s: Some(round(rollout_tokens as f64 / generate.max(1e-9))),
            train_tokens_per_s: Some(round(train_tokens as f64 / train.max(1e-9))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up() {
        let t = Timings::start();
        t.add(Phase::Drive, 2.0);
        t.add(Phase::Execute, 1.5);
        {
            let _m = t.mark(Phase::Update);
        }
        t.add(Phase::Update, 0.25);
        assert!(t.secs(Phase::Update) >= 0.25);
        assert!((t.script_s() - 0.5 - t.secs(Phase::Update)).abs() < 1e-12);
        // Execution longer than the drive (clock jitter) never goes
        // negative.
        t.add(Phase::Execute, 5.0);
        assert_eq!(t.script_s(), t.secs(Phase::Update));
        let times = t.step_times(100, 0);
        assert_eq!(times.train_s, Some(0.0));
        assert_eq!(times.train_tokens_per_s, Some(0.0));
    }
}
