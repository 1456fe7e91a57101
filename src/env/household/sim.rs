//! The household rules: parsing commands, applying them to a [`World`],
//! the feedback text, the admissible list, the goal test and the agent's
//! memory of what it has seen. [`HouseholdEnv`](super::HouseholdEnv), the
//! expert planner and the generator all drive this one engine, so they can
//! never disagree about what a command does.

use super::catalog::{kind_of, object_kind, TaskType, Treatment};
use super::world::{World, WorldError};

/// A parsed command; names are still unresolved text.
#[derive(Debug, PartialEq)]
enum Cmd<'a> {
    Go(&'a str),
    Open(&'a str),
    Close(&'a str),
    Take(&'a str, &'a str),
    Move(&'a str, &'a str),
    Use(&'a str),
    Treat(Treatment, &'a str, &'a str),
    Examine(&'a str),
    Inventory,
    Look,
}

/// Trim, lowercase, collapse whitespace: the only input normalization.
pub(crate) fn normalize(input: &str) -> String {
    input
        .split_whitespace()
        .map(str::to_lowercase)
        .collect::<Vec<_>>()
        .join(" ")
}

fn parse(s: &str) -> Option<Cmd<'_>> {
    match s {
        "inventory" => return Some(Cmd::Inventory),
        "look" => return Some(Cmd::Look),
        _ => {}
    }
    let (verb, rest) = s.split_once(' ')?;
    Some(match verb {
        "go" => Cmd::Go(rest.strip_prefix("to ")?),
        "open" => Cmd::Open(rest),
        "close" => Cmd::Close(rest),
        "use" => Cmd::Use(rest),
        "examine" => Cmd::Examine(rest),
        "take" => {
            let (o, r) = rest.split_once(" from ")?;
            Cmd::Take(o, r)
        }
        "move" => {
            let (o, r) = rest.split_once(" to ")?;
            Cmd::Move(o, r)
        }
        // ALFWorld's own spelling of the move command, and its two readings.
        "put" => {
            let (o, r) = [" in/on ", " in ", " on "]
                .iter()
                .find_map(|sep| rest.split_once(sep))?;
            Cmd::Move(o, r)
        }
        _ => {
            let t = Treatment::ALL.into_iter().find(|t| t.verb() == verb)?;
            let (o, r) = rest.split_once(" with ")?;
            Cmd::Treat(t, o, r)
        }
    })
}

/// "nothing" / "a x" / "a x, and a y" / "a x, a y, and a z" (ALFWorld's lists).
pub(crate) fn a_list<S: AsRef<str>>(items: &[S]) -> String {
    match items {
        [] => "nothing".to_string(),
        [one] => format!("a {}", one.as_ref()),
        [init @ .., last] => {
            let mut s: String = init.iter().map(|x| format!("a {}, ", x.as_ref())).collect();
            s.push_str(&format!("and a {}", last.as_ref()));
            s
        }
    }
}

pub(crate) const NOTHING_HAPPENS: &str = "Nothing happens.";

/// Why a world cannot start an episode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SimError {
    #[error(transparent)]
    World(#[from] WorldError),
    #[error("goal already satisfied in the start state")]
    AlreadySatisfied,
}

/// World state plus the agent's memory: objects in order of first sighting.
/// Objects only move when the agent moves them, so where an object was last
/// seen is always where it is now.
#[derive(Debug, Clone)]
pub(crate) struct Sim {
    pub world: World,
    seen: Vec<usize>,
}

impl Sim {
    /// Validate `world` and put the agent in it (it knows what it can see).
    pub fn new(world: World) -> Result<Sim, SimError> {
        world.validate()?;
        let mut sim = Sim {
            world,
            seen: Vec::new(),
        };
        if sim.satisfied() {
            return Err(SimError::AlreadySatisfied);
        }
        if let Some(h) = sim.holding() {
            sim.seen.push(h);
        }
        if sim.world.reveal {
            // World order: the same for every task built the same way.
            let held = sim.holding();
            let all = (0..sim.world.objects.len()).filter(|&o| Some(o) != held);
            sim.seen.extend(all);
        }
        sim.observe_here();
        Ok(sim)
    }

    /// The objects the agent has seen, in order of first sighting.
    pub fn memory(&self) -> &[usize] {
        &self.seen
    }

    pub fn here(&self) -> Option<usize> {
        self.world
            .agent
            .at
            .as_deref()
            .and_then(|r| self.world.receptacle(r))
    }

    pub fn holding(&self) -> Option<usize> {
        self.world
            .agent
            .holding
            .as_deref()
            .and_then(|o| self.world.object(o))
    }

    fn rname(&self, r: usize) -> &str {
        &self.world.receptacles[r].name
    }

    /// Closed doors hide contents and block take / move.
    pub fn is_open(&self, r: usize) -> bool {
        self.world.receptacles[r].open != Some(false)
    }

    /// Object `o` is in / on receptacle `r`.
    fn lies_at(&self, o: usize, r: usize) -> bool {
        self.world.objects[o].at.as_deref() == Some(self.rname(r))
    }

    fn contents(&self, r: usize) -> Vec<usize> {
        (0..self.world.objects.len())
            .filter(|&o| self.lies_at(o, r))
            .collect()
    }

    /// Remember what is visible where the agent stands. Called after every
    /// command, so whatever a feedback text showed is in memory.
    fn observe_here(&mut self) {
        if let Some(r) = self.here().filter(|&r| self.is_open(r)) {
            for o in self.contents(r) {
                if !self.seen.contains(&o) {
                    self.seen.push(o);
                }
            }
        }
    }

    /// What the agent sees at `r`.
    fn describe(&self, r: usize) -> String {
        let name = self.rname(r);
        let labels: Vec<String> = self
            .contents(r)
            .iter()
            .map(|&o| self.world.objects[o].label())
            .collect();
        match self.world.receptacles[r].open {
            Some(false) => format!("The {name} is closed."),
            Some(true) => format!("The {name} is open. In it, you see {}.", a_list(&labels)),
            None => format!("On the {name}, you see {}.", a_list(&labels)),
        }
    }

    fn carrying(&self) -> String {
        match self.holding() {
            Some(o) => format!("You are carrying: a {}.", self.world.objects[o].label()),
            None => "You are carrying: nothing.".to_string(),
        }
    }

    fn room(&self) -> String {
        let names: Vec<&str> = self
            .world
            .receptacles
            .iter()
            .map(|r| r.name.as_str())
            .collect();
        format!("Looking quickly around you, you see {}.", a_list(&names))
    }

    /// The first observation. From the middle of the room with empty hands it
    /// is ALFWorld's text verbatim; other start states also say where the agent
    /// is, what is there and what it carries, in the commands' own words.
    pub fn intro(&self, goal: &str) -> String {
        let body = match (self.here(), self.holding()) {
            (None, None) => format!("You are in the middle of a room. {}", self.room()),
            (None, Some(_)) => format!(
                "You are in the middle of a room. {} {}",
                self.room(),
                self.carrying()
            ),
            (Some(r), _) => format!(
                "You are at {}. {} {} {}",
                self.rname(r),
                self.room(),
                self.describe(r),
                self.carrying()
            ),
        };
        format!("{body}\n\nYour task is to: {goal}.")
    }

    /// Apply one command; returns the feedback and whether it was valid.
    pub fn exec(&mut self, input: &str) -> (String, bool) {
        let s = normalize(input);
        match parse(&s).and_then(|cmd| self.apply(cmd)) {
            Some(text) => {
                self.observe_here();
                (text, true)
            }
            None => (NOTHING_HAPPENS.to_string(), false),
        }
    }

    /// `None` means the command is not possible now ("Nothing happens.").
    fn apply(&mut self, cmd: Cmd<'_>) -> Option<String> {
        let w = &self.world;
        let here = self.here();
        // Resolves `r` only if it is the receptacle the agent stands at.
        let at = |r: &str| here.filter(|&h| w.receptacles[h].name == r);
        // Resolves `o` only if it is the held object.
        let held = |o: &str| self.holding().filter(|&h| w.objects[h].name == o);
        match cmd {
            Cmd::Go(r) => {
                let r = w.receptacle(r).filter(|&r| Some(r) != here)?;
                self.world.agent.at = Some(self.rname(r).to_string());
                Some(format!(
                    "You arrive at {}. {}",
                    self.rname(r),
                    self.describe(r)
                ))
            }
            Cmd::Open(r) => {
                let r = at(r).filter(|&r| w.receptacles[r].open == Some(false))?;
                self.world.receptacles[r].open = Some(true);
                Some(format!(
                    "You open the {}. {}",
                    self.rname(r),
                    self.describe(r)
                ))
            }
            Cmd::Close(r) => {
                let r = at(r).filter(|&r| w.receptacles[r].open == Some(true))?;
                self.world.receptacles[r].open = Some(false);
                Some(format!("You close the {}.", self.rname(r)))
            }
            Cmd::Take(o, r) => {
                let r = at(r).filter(|&r| self.is_open(r) && self.holding().is_none())?;
                let oi = w
                    .object(o)
                    .filter(|&oi| self.lies_at(oi, r) && !w.objects[oi].is_lamp())?;
                self.world.objects[oi].at = None;
                self.world.agent.holding = Some(o.to_string());
                Some(format!("You pick up the {o} from the {}.", self.rname(r)))
            }
            Cmd::Move(o, r) => {
                let oi = held(o)?;
                let r = at(r).filter(|&r| self.is_open(r))?;
                self.world.objects[oi].at = Some(self.rname(r).to_string());
                self.world.agent.holding = None;
                Some(format!("You move the {o} to the {}.", self.rname(r)))
            }
            Cmd::Use(o) => {
                // A lamp works when the agent stands where the lamp is.
                let oi = w.object(o).filter(|&oi| {
                    let lamp = &w.objects[oi];
                    lamp.is_lamp() && w.agent.at.is_some() && lamp.at == w.agent.at
                })?;
                self.world.objects[oi].on = true;
                Some(format!("You turn on the {o}."))
            }
            Cmd::Treat(t, o, r) => {
                let oi = held(o)?;
                let r = at(r).filter(|&r| kind_of(&w.receptacles[r].name) == t.appliance())?;
                let kind = object_kind(kind_of(o))?;
                if !t.applies_to(kind) {
                    return None;
                }
                let obj = &mut self.world.objects[oi];
                match t {
                    Treatment::Clean => obj.clean = true,
                    // Heating and cooling undo each other.
                    Treatment::Heat => (obj.hot, obj.cool) = (true, false),
                    Treatment::Cool => (obj.cool, obj.hot) = (true, false),
                }
                Some(format!(
                    "You {} the {o} using the {}.",
                    t.verb(),
                    self.rname(r)
                ))
            }
            Cmd::Examine(x) => {
                if let Some(r) = at(x) {
                    return Some(self.describe(r));
                }
                // The held object, or anything visible where the agent stands.
                let oi = w.object(x).filter(|&oi| {
                    held(x).is_some()
                        || here.is_some_and(|h| self.is_open(h) && self.lies_at(oi, h))
                })?;
                Some(format!("This is a {}.", w.objects[oi].label()))
            }
            Cmd::Inventory => Some(self.carrying()),
            Cmd::Look => Some(match here {
                Some(r) => format!("You are at {}. {}", self.rname(r), self.describe(r)),
                None => format!("You are in the middle of a room. {}", self.room()),
            }),
        }
    }

    /// The admissible commands now, in a fixed order: moves first, then what
    /// can be done here, then the always-available ones.
    pub fn admissible(&self) -> Vec<String> {
        let w = &self.world;
        let here = self.here();
        let held = self.holding().map(|o| w.objects[o].name.as_str());
        let mut out: Vec<String> = (0..w.receptacles.len())
            .filter(|&r| Some(r) != here)
            .map(|r| format!("go to {}", self.rname(r)))
            .collect();
        if let Some(h) = here {
            let hn = self.rname(h);
            match w.receptacles[h].open {
                Some(false) => out.push(format!("open {hn}")),
                Some(true) => out.push(format!("close {hn}")),
                None => {}
            }
            let contents = self.contents(h);
            if self.is_open(h) {
                match held {
                    None => out.extend(
                        contents
                            .iter()
                            .filter(|&&o| !w.objects[o].is_lamp())
                            .map(|&o| format!("take {} from {hn}", w.objects[o].name)),
                    ),
                    Some(o) => out.push(format!("move {o} to {hn}")),
                }
            }
            if let Some(o) = held {
                let kind = object_kind(kind_of(o));
                for t in Treatment::ALL {
                    if kind_of(hn) == t.appliance() && kind.is_some_and(|k| t.applies_to(k)) {
                        out.push(format!("{} {o} with {hn}", t.verb()));
                    }
                }
            }
            out.extend(
                contents
                    .iter()
                    .filter(|&&o| w.objects[o].is_lamp())
                    .map(|&o| format!("use {}", w.objects[o].name)),
            );
            out.push(format!("examine {hn}"));
        }
        if let Some(o) = held {
            out.push(format!("examine {o}"));
        }
        out.push("inventory".into());
        out.push("look".into());
        out
    }

    /// The goal test, on the state alone (checked after every step).
    pub fn satisfied(&self) -> bool {
        let w = &self.world;
        let g = &w.goal;
        let of_kind = |o: &&super::world::Object| kind_of(&o.name) == g.object;
        if g.task_type == TaskType::LookAtObjInLight {
            // Holding the object next to a lit lamp of the goal's kind.
            let holds = self.holding().is_some_and(|o| of_kind(&&w.objects[o]));
            let lit = w.objects.iter().any(|o| {
                kind_of(&o.name) == g.target && o.on && o.at.is_some() && o.at == w.agent.at
            });
            return holds && lit;
        }
        let needed = if g.task_type == TaskType::PickTwoObj {
            2
        } else {
            1
        };
        let placed = w
            .objects
            .iter()
            .filter(of_kind)
            .filter(|o| o.at.as_deref().is_some_and(|r| kind_of(r) == g.target))
            .filter(|o| g.task_type.treatment().is_none_or(|t| o.treated(t)))
            .count();
        placed >= needed
    }

    /// One-paragraph Markovian summary: place, hand, and everything seen
    /// (with where it is and its state), in order of first sighting.
    pub fn status(&self) -> String {
        let w = &self.world;
        let place = match self.here() {
            Some(r) => format!("You are at {}.", self.rname(r)),
            None => "You are in the middle of the room.".to_string(),
        };
        let seen: Vec<String> = self
            .seen
            .iter()
            .filter_map(|&o| {
                let obj = &w.objects[o];
                obj.at.as_ref().map(|r| format!("{} at {r}", obj.label()))
            })
            .collect();
        let seen = if seen.is_empty() {
            "nothing".to_string()
        } else {
            seen.join(", ")
        };
        format!("{place} {} Seen: {seen}.", self.carrying())
    }
}
