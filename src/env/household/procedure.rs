//! A scripted household agent that does not know the answer: the ceiling a
//! learned policy can reach on unseen tasks. It acts only on what the agent
//! knows — its memory of seen objects (the status line's "Seen:"), the doors
//! of the receptacles it has stood at, what it holds — by running the
//! expert planner on that belief world and taking the plan's first action,
//! then planning again. Where the belief has no plan (the goal object, the
//! lamp or the appliance not seen yet) it searches: open the receptacle it
//! stands at if it is closed, else go to the next receptacle it has not
//! visited, in the room's order. In a `reveal` world its memory holds
//! every object from the start, so it never searches.

use std::collections::BTreeSet;

use super::expert::expert_plan;
use super::sim::Sim;
use super::world::World;
use crate::env::{EnvError, Task};

/// The procedure's episode on `task` with at most `budget` actions:
/// whether it reached the goal, and the actions it took.
pub fn procedure_episode(task: &Task, budget: usize) -> Result<(bool, Vec<String>), EnvError> {
    let world = super::HouseholdEnv::parse_world(task)?;
    let mut sim = Sim::new(world).map_err(|e| EnvError::BadTask {
        task: task.id.clone(),
        msg: e.to_string(),
    })?;
    let mut visited: BTreeSet<usize> = sim.here().into_iter().collect();
    let mut actions = Vec::new();
    while actions.len() < budget && !sim.satisfied() {
        let action = next_action(&sim, &visited);
        let (_, valid) = sim.exec(&action);
        if !valid {
            // The belief was wrong in a way a re-plan cannot fix (it never
            // should be: the planner only acts where the agent has looked).
            return Err(EnvError::Other(format!(
                "household procedure: \"{action}\" was refused in task {}",
                task.id
            )));
        }
        visited.extend(sim.here());
        actions.push(action);
    }
    Ok((sim.satisfied(), actions))
}

/// The first action of the expert plan on the agent's belief, or a search
/// step.
fn next_action(sim: &Sim, visited: &BTreeSet<usize>) -> String {
    if let Some(a) = expert_plan(&belief(sim, visited)).into_iter().next() {
        return a;
    }
    let w = &sim.world;
    if let Some(r) = sim.here().filter(|&r| !sim.is_open(r)) {
        return format!("open {}", w.receptacles[r].name);
    }
    match (0..w.receptacles.len()).find(|r| !visited.contains(r)) {
        Some(r) => format!("go to {}", w.receptacles[r].name),
        // Everything searched and still no plan: nothing left to try.
        None => "look".to_string(),
    }
}

/// The world as the agent knows it: the objects it has seen (where it saw
/// them, which is where they are) and the one it holds; doors as it saw
/// them where it has stood, closed where it has not looked (so a plan goes
/// there and opens, and re-plans on arrival with the door it sees).
fn belief(sim: &Sim, visited: &BTreeSet<usize>) -> World {
    let w = &sim.world;
    let known: BTreeSet<usize> = sim.memory().iter().copied().chain(sim.holding()).collect();
    let mut b = w.clone();
    b.objects = (0..w.objects.len())
        .filter(|o| known.contains(o))
        .map(|o| w.objects[o].clone())
        .collect();
    for (i, r) in b.receptacles.iter_mut().enumerate() {
        if r.open.is_some() && !visited.contains(&i) {
            r.open = Some(false);
        }
    }
    b
}

/// The procedure's success on `tasks` by difficulty, `(difficulty, tasks,
/// success rate)` sorted by difficulty, under a run's step budget:
/// `max_steps`, or with `step_slack` the expert's length plus the slack,
/// capped at `max_steps` (as `env.step_slack` budgets an episode). It is
/// deterministic: one episode per task. A task it cannot run is an error.
pub fn procedure_success(
    tasks: &[Task],
    max_steps: usize,
    step_slack: Option<usize>,
) -> Result<Vec<(usize, usize, f64)>, EnvError> {
    let mut by: std::collections::BTreeMap<usize, (usize, usize)> = Default::default();
    for t in tasks {
        // As a run budgets it (rollout::episode).
        let len = t.budget_len().unwrap_or(max_steps);
        let budget = step_slack.map_or(max_steps, |s| (len + s).min(max_steps));
        let (ok, _) = procedure_episode(t, budget)?;
        let e = by.entry(t.difficulty).or_default();
        e.0 += 1;
        e.1 += usize::from(ok);
    }
    Ok(by
        .into_iter()
        .map(|(d, (n, s))| (d, n, s as f64 / n as f64))
        .collect())
}
