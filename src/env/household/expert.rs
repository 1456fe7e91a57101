//! The expert planner: a short successful command sequence from any world
//! state. It knows where every object is (the expert is the action data, not
//! an agent), and it plans by running candidate plans through the rules
//! engine, so every step it emits is valid by construction.

use super::catalog::{kind_of, TaskType};
use super::sim::Sim;
use super::world::World;

/// A shortest-ish plan that reaches `world`'s goal, or an empty plan if the
/// world is invalid or already solved. For pick-two it delivers one object,
/// then plans the second from the resulting state.
pub fn expert_plan(world: &World) -> Vec<String> {
    let Ok(mut sim) = Sim::new(world.clone()) else {
        return Vec::new();
    };
    let mut plan = Vec::new();
    // Each round delivers one object; two rounds suffice for every type.
    for _ in 0..2 {
        if sim.satisfied() {
            break;
        }
        let best = candidates(&sim)
            .into_iter()
            .filter_map(|o| deliver(&sim, o))
            .min_by_key(|p| p.plan.len());
        match best {
            Some(p) => {
                plan.extend(p.plan);
                sim = p.sim;
            }
            None => break,
        }
    }
    plan
}

/// Objects of the goal kind that still need handling (not already counted
/// towards the goal), in world order so ties break deterministically.
fn candidates(sim: &Sim) -> Vec<usize> {
    let w = &sim.world;
    let g = &w.goal;
    let treatment = g.task_type.treatment();
    (0..w.objects.len())
        .filter(|&o| {
            let obj = &w.objects[o];
            if kind_of(&obj.name) != g.object || obj.is_lamp() {
                return false;
            }
            if g.task_type == TaskType::LookAtObjInLight {
                return true;
            }
            let in_target = obj.at.as_deref().is_some_and(|r| kind_of(r) == g.target);
            !(in_target && treatment.is_none_or(|t| obj.treated(t)))
        })
        .collect()
}

/// A plan under construction, with the state it leads to.
struct Planner {
    sim: Sim,
    plan: Vec<String>,
}

impl Planner {
    /// Execute and record `cmd`; `None` if the engine refuses it.
    fn act(&mut self, cmd: String) -> Option<()> {
        let (_, valid) = self.sim.exec(&cmd);
        valid.then(|| self.plan.push(cmd))
    }

    fn here_name(&self) -> Option<String> {
        self.sim.world.agent.at.clone()
    }

    fn go(&mut self, r: &str) -> Option<()> {
        if self.here_name().as_deref() == Some(r) {
            return Some(());
        }
        self.act(format!("go to {r}"))
    }

    /// Go to `r` and open it if it is closed.
    fn reach(&mut self, r: &str) -> Option<()> {
        self.go(r)?;
        let ri = self.sim.world.receptacle(r)?;
        if !self.sim.is_open(ri) {
            self.act(format!("open {r}"))?;
        }
        Some(())
    }

    /// Cost of reaching receptacle `r` from here (travel + door).
    fn reach_cost(&self, r: usize) -> usize {
        usize::from(self.sim.here() != Some(r)) + usize::from(!self.sim.is_open(r))
    }
}

/// Plan the delivery of object `o` towards the goal from `sim`'s state.
fn deliver(sim: &Sim, o: usize) -> Option<Planner> {
    let mut p = Planner {
        sim: sim.clone(),
        plan: Vec::new(),
    };
    let name = p.sim.world.objects[o].name.clone();
    let goal = p.sim.world.goal.clone();

    // Free the hand if it holds something else: put it down right here if
    // possible, else on the first receptacle without a door.
    if let Some(h) = p.sim.holding().filter(|&h| h != o) {
        let held = p.sim.world.objects[h].name.clone();
        let spot = match p.sim.here().filter(|&r| p.sim.is_open(r)) {
            Some(r) => r,
            None => p
                .sim
                .world
                .receptacles
                .iter()
                .position(|r| r.open.is_none())?,
        };
        let spot = p.sim.world.receptacles[spot].name.clone();
        p.go(&spot)?;
        p.act(format!("move {held} to {spot}"))?;
    }
    if p.sim.holding() != Some(o) {
        let from = p.sim.world.objects[o].at.clone()?;
        p.reach(&from)?;
        p.act(format!("take {name} from {from}"))?;
    }
    if let Some(t) = goal.task_type.treatment() {
        if !p.sim.world.objects[o].treated(t) {
            let appliance = best(&p, |r| kind_of(r) == t.appliance())?;
            p.go(&appliance)?;
            p.act(format!("{} {name} with {appliance}", t.verb()))?;
        }
    }
    if goal.task_type == TaskType::LookAtObjInLight {
        // Prefer a lamp where the agent already is, else the first one.
        let here = p.here_name();
        let lamps: Vec<(String, String)> = p
            .sim
            .world
            .objects
            .iter()
            .filter(|l| kind_of(&l.name) == goal.target)
            .filter_map(|l| Some((l.name.clone(), l.at.clone()?)))
            .collect();
        let (lamp, at) = lamps
            .iter()
            .find(|(_, at)| Some(at) == here.as_ref())
            .or_else(|| lamps.first())?
            .clone();
        p.go(&at)?;
        p.act(format!("use {lamp}"))?;
    } else {
        let target = best(&p, |r| kind_of(r) == goal.target)?;
        p.reach(&target)?;
        p.act(format!("move {name} to {target}"))?;
    }
    Some(p)
}

/// The cheapest-to-reach receptacle matching `pred` (first on ties).
fn best(p: &Planner, pred: impl Fn(&str) -> bool) -> Option<String> {
    let rs = &p.sim.world.receptacles;
    (0..rs.len())
        .filter(|&r| pred(&rs[r].name))
        .min_by_key(|&r| p.reach_cost(r))
        .map(|r| rs[r].name.clone())
}
