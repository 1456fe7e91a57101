//! The built-in ALFWorld-like household environment.
//!
//! This module owns everything household: the catalog of receptacle and
//! object kinds ([`catalog`]), the serialized world ([`World`]), the rules
//! engine (commands, feedback, admissible list, goal test, status), the
//! expert planner ([`expert_plan`]) and a noisy demonstrator built on it
//! ([`add_expert_noise`]), the seeded panel generator
//! ([`generate_panels`], with the default seed and sizes; `room` draws one
//! random room) and the env's word list ([`vocabulary`]). Writing the
//! default panels and the random-policy baseline are the same for every
//! built-in env: [`crate::env::kind`].
//!
//! Worlds are complete states, so the panel's short "in-region" tasks are
//! just worlds captured part-way along an expert trajectory (agent at the
//! object's receptacle, or holding it, ...), while "out-region" tasks start
//! from the middle of the room as in ALFWorld.

mod catalog;
mod expert;
mod generate;
mod noisy;
mod procedure;
mod room;
mod sim;
#[cfg(test)]
mod tests;
mod vocab;
mod world;

pub use catalog::{TaskType, MAX_INDEX};
pub use expert::expert_plan;
pub use generate::{generate_panels, DEFAULT_SEED, DEFAULT_TEST, DEFAULT_TRAIN};
pub use noisy::{add_expert_noise, noisy_demo, NoiseStats};
pub use procedure::{procedure_episode, procedure_success};
pub use vocab::{split_words, vocabulary};
pub use world::{Agent, Goal, Object, Receptacle, World, WorldError};

use super::{Env, EnvError, Observation, Task};
use sim::Sim;

/// Default episode limit (ALFWorld's 50 steps).
pub const DEFAULT_MAX_STEPS: usize = 50;

/// The household env: one episode at a time over a task's [`World`].
#[derive(Debug, Clone)]
pub struct HouseholdEnv {
    max_steps: usize,
    episode: Option<Episode>,
}

#[derive(Debug, Clone)]
struct Episode {
    sim: Sim,
    steps: usize,
    done: bool,
}

impl Default for HouseholdEnv {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_STEPS)
    }
}

impl HouseholdEnv {
    /// An env whose episodes end after `max_steps` steps (at least 1).
    pub fn new(max_steps: usize) -> Self {
        HouseholdEnv {
            max_steps: max_steps.max(1),
            episode: None,
        }
    }

    /// Parse a task's world (the same check `reset` does).
    pub fn parse_world(task: &Task) -> Result<World, EnvError> {
        let bad = |msg: String| EnvError::BadTask {
            task: task.id.clone(),
            msg,
        };
        let world: World = serde_json::from_value(task.world.clone())
            .map_err(|e| bad(format!("bad household world: {e}")))?;
        world.validate().map_err(|e| bad(e.to_string()))?;
        Ok(world)
    }
}

impl Env for HouseholdEnv {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        // A failed reset leaves no episode behind to step by mistake.
        self.episode = None;
        let world = Self::parse_world(task)?;
        let sim = Sim::new(world).map_err(|e| EnvError::BadTask {
            task: task.id.clone(),
            msg: e.to_string(),
        })?;
        let text = sim.intro(&task.goal);
        let admissible = sim.admissible();
        self.episode = Some(Episode {
            sim,
            steps: 0,
            done: false,
        });
        Ok(Observation {
            text,
            admissible,
            done: false,
            reward: 0.0,
            success: false,
            valid: true,
            info: Default::default(),
        })
    }

    fn step(&mut self, action: &str) -> Result<Observation, EnvError> {
        let ep = match &mut self.episode {
            Some(ep) if !ep.done => ep,
            Some(_) => {
                return Err(EnvError::Other(
                    "household: step after the episode ended; call reset".into(),
                ))
            }
            None => return Err(EnvError::Other("household: step before reset".into())),
        };
        let (text, valid) = ep.sim.exec(action);
        ep.steps += 1;
        let success = ep.sim.satisfied();
        ep.done = success || ep.steps >= self.max_steps;
        Ok(Observation {
            text,
            admissible: ep.sim.admissible(),
            done: ep.done,
            reward: if success { 1.0 } else { 0.0 },
            success,
            valid,
            info: Default::default(),
        })
    }

    fn status(&self) -> String {
        match &self.episode {
            Some(ep) => ep.sim.status(),
            None => "No task loaded.".to_string(),
        }
    }
}
