//! The built-in WebShop-like shop environment.
//!
//! This module owns everything shop: the generated product catalog and its
//! search engine ([`catalog`]), the serialized task world with the goal and
//! the WebShop reward ([`World`], [`Goal`], [`reward`]), the page rules
//! (search → results → item → description / features / reviews → buy), the
//! expert planner ([`expert_plan`]), the seeded panel generator
//! ([`generate_panels`], with the default seed and sizes) and the env's word
//! list ([`vocabulary`]). Writing the default panels and the random-policy
//! baseline are the same for every built-in env: [`crate::env::kind`].
//!
//! Free-text search cannot be enumerated, so the search page's admissible
//! list is the task's candidate queries (the goal's own and distractors);
//! every other page's admissible list is its clickables. Anything else is a
//! no-op: the page is shown unchanged with `valid = false`.

mod catalog;
mod generate;
mod sim;
#[cfg(test)]
mod tests;
mod vocab;
mod world;

pub use catalog::{
    catalog, product_type, Catalog, OptionKind, Product, ProductType, CATALOG_ID, MAX_RESULTS,
    PAGE_SIZE, TYPES,
};
pub use generate::{expert_plan, generate_panels, DEFAULT_SEED, DEFAULT_TEST, DEFAULT_TRAIN};
pub use vocab::vocabulary;
pub use world::{r_type, reward, Goal, World, WorldError};

use super::{Env, EnvError, Observation, Task};
use sim::Sim;

/// Default episode limit (WebShop's 15 steps).
pub const DEFAULT_MAX_STEPS: usize = 15;

/// The shop env: one episode at a time over a task's [`World`].
#[derive(Debug, Clone)]
pub struct ShopEnv {
    max_steps: usize,
    episode: Option<Episode>,
}

#[derive(Debug, Clone)]
struct Episode {
    sim: Sim,
    steps: usize,
    done: bool,
}

impl Default for ShopEnv {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_STEPS)
    }
}

impl ShopEnv {
    /// An env whose episodes end after `max_steps` steps (at least 1).
    pub fn new(max_steps: usize) -> Self {
        ShopEnv {
            max_steps: max_steps.max(1),
            episode: None,
        }
    }

    /// Parse and validate a task's world (the same check `reset` does).
    pub fn parse_world(task: &Task) -> Result<World, EnvError> {
        let bad = |msg: String| EnvError::BadTask {
            task: task.id.clone(),
            msg,
        };
        let world: World = serde_json::from_value(task.world.clone())
            .map_err(|e| bad(format!("bad shop world: {e}")))?;
        world
            .validate()
            .map_err(|e| bad(format!("bad shop world: {e}")))?;
        Ok(world)
    }
}

impl Env for ShopEnv {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        // A failed reset leaves no episode behind to step by mistake.
        self.episode = None;
        let world = Self::parse_world(task)?;
        let sim = Sim::new(world, &task.goal);
        let obs = Observation {
            text: sim.render(),
            admissible: sim.admissible(),
            done: false,
            reward: 0.0,
            success: false,
            valid: true,
            info: Default::default(),
        };
        self.episode = Some(Episode {
            sim,
            steps: 0,
            done: false,
        });
        Ok(obs)
    }

    fn step(&mut self, action: &str) -> Result<Observation, EnvError> {
        let ep = match &mut self.episode {
            Some(ep) if !ep.done => ep,
            Some(_) => {
                return Err(EnvError::Other(
                    "shop: step after the episode ended; call reset".into(),
                ))
            }
            None => return Err(EnvError::Other("shop: step before reset".into())),
        };
        let (text, valid) = ep.sim.exec(action);
        ep.steps += 1;
        let reward = ep.sim.bought.unwrap_or(0.0);
        ep.done = ep.sim.bought.is_some() || ep.steps >= self.max_steps;
        Ok(Observation {
            text,
            admissible: if ep.done {
                Vec::new()
            } else {
                ep.sim.admissible()
            },
            done: ep.done,
            reward: reward as f32,
            success: reward == 1.0,
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
