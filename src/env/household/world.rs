//! The serialized household world (`Task::world`): the room's receptacles,
//! the objects and where they are, the agent's position and hand, and the
//! goal. A world is a complete state, so a start state part-way through a
//! task (agent at a counter, holding a clean mug) is just another world.

use serde::{Deserialize, Serialize};

use super::catalog::{
    kind_of, object_kind, receptacle_kind, split_name, Category, TaskType, Treatment,
};

/// What is wrong with a household world (the message a bad task shows).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorldError {
    #[error("no receptacles")]
    NoReceptacles,
    #[error("bad receptacle name {0:?}")]
    BadReceptacleName(String),
    #[error("receptacle {0:?}: `open` must be given exactly for openable kinds")]
    OpenMismatch(String),
    #[error("duplicate name {0:?}")]
    DuplicateName(String),
    #[error("bad object name {0:?}")]
    BadObjectName(String),
    #[error("object {object:?} at unknown {at:?}")]
    UnknownPlace { object: String, at: String },
    #[error("lamp {lamp:?} inside openable {at:?}")]
    LampInside { lamp: String, at: String },
    #[error("object {0:?}: only lamps can be on")]
    NotALamp(String),
    #[error("agent.holding must name the one object with no `at`")]
    Holding,
    #[error("lamp {0:?} cannot be held")]
    LampHeld(String),
    #[error("agent at unknown receptacle {0:?}")]
    AgentAt(String),
    #[error("goal object {0:?} is not a takeable kind")]
    GoalObject(String),
    #[error("goal lamp {0:?} not in the room")]
    GoalLamp(String),
    #[error("goal target {0:?} not in the room")]
    GoalTarget(String),
    #[error("{object} cannot be made {adjective}")]
    Untreatable {
        object: String,
        adjective: &'static str,
    },
    #[error("no {appliance} to {verb} with")]
    NoAppliance {
        appliance: &'static str,
        verb: &'static str,
    },
}

/// A complete household state plus the goal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct World {
    /// Receptacles in display order ("cabinet 1", "countertop 1", ...).
    pub receptacles: Vec<Receptacle>,
    /// Objects (lamps included); their order is the listing order.
    pub objects: Vec<Object>,
    pub agent: Agent,
    pub goal: Goal,
    /// The agent starts knowing where every object is (its memory, the
    /// status line's "Seen:", holds them all from the first step): a regime
    /// in which a learned procedure can solve an unseen task without the
    /// search the step budget may not allow. Absent (false) in the
    /// generated panels; `actguide tasks select --world-set reveal=true`
    /// writes such panels.
    #[serde(default, skip_serializing_if = "is_false")]
    pub reveal: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receptacle {
    pub name: String,
    /// Door state; present exactly for openable kinds (cabinet, fridge, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Object {
    pub name: String,
    /// The receptacle it is in / on; `None` while the agent holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub clean: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub hot: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub cool: bool,
    /// Lamps only: switched on.
    #[serde(default, skip_serializing_if = "is_false")]
    pub on: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Agent {
    /// Receptacle the agent stands at; `None` = the middle of the room.
    #[serde(default)]
    pub at: Option<String>,
    /// Object in hand (at most one).
    #[serde(default)]
    pub holding: Option<String>,
}

/// What success means: kinds, not instances, as in ALFWorld ("put a mug in
/// cabinet" is satisfied by any mug in any cabinet).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Goal {
    #[serde(rename = "type")]
    pub task_type: TaskType,
    /// Object kind ("apple").
    pub object: String,
    /// Receptacle kind ("fridge"), or the lamp kind for the light task.
    pub target: String,
}

impl Object {
    /// "apple 1 (clean, hot)": the name plus any state the agent caused.
    pub fn label(&self) -> String {
        let flags: Vec<&str> = [
            (self.clean, "clean"),
            (self.hot, "hot"),
            (self.cool, "cool"),
            (self.on, "on"),
        ]
        .iter()
        .filter(|(set, _)| *set)
        .map(|(_, word)| *word)
        .collect();
        if flags.is_empty() {
            self.name.clone()
        } else {
            format!("{} ({})", self.name, flags.join(", "))
        }
    }

    /// Whether the object has the state `t` produces.
    pub(crate) fn treated(&self, t: Treatment) -> bool {
        match t {
            Treatment::Clean => self.clean,
            Treatment::Heat => self.hot,
            Treatment::Cool => self.cool,
        }
    }

    pub fn is_lamp(&self) -> bool {
        object_kind(kind_of(&self.name)).is_some_and(|k| k.category == Category::Lamp)
    }
}

impl World {
    pub fn receptacle(&self, name: &str) -> Option<usize> {
        self.receptacles.iter().position(|r| r.name == name)
    }

    pub fn object(&self, name: &str) -> Option<usize> {
        self.objects.iter().position(|o| o.name == name)
    }

    /// Check that the world is well-formed and the goal is reachable in
    /// principle (needed kinds exist) and not already met.
    pub fn validate(&self) -> Result<(), WorldError> {
        let mut names = std::collections::BTreeSet::new();
        if self.receptacles.is_empty() {
            return Err(WorldError::NoReceptacles);
        }
        for r in &self.receptacles {
            let kind = split_name(&r.name)
                .and_then(|(k, _)| receptacle_kind(k))
                .ok_or_else(|| WorldError::BadReceptacleName(r.name.clone()))?;
            if kind.openable != r.open.is_some() {
                return Err(WorldError::OpenMismatch(r.name.clone()));
            }
            if !names.insert(r.name.as_str()) {
                return Err(WorldError::DuplicateName(r.name.clone()));
            }
        }
        let mut held = Vec::new();
        for o in &self.objects {
            split_name(&o.name)
                .and_then(|(k, _)| object_kind(k))
                .ok_or_else(|| WorldError::BadObjectName(o.name.clone()))?;
            if !names.insert(o.name.as_str()) {
                return Err(WorldError::DuplicateName(o.name.clone()));
            }
            match &o.at {
                None => held.push(o.name.as_str()),
                Some(r) => self.validate_place(o, r)?,
            }
            if o.on && !o.is_lamp() {
                return Err(WorldError::NotALamp(o.name.clone()));
            }
        }
        if held.len() > 1 || held.first().copied() != self.agent.holding.as_deref() {
            return Err(WorldError::Holding);
        }
        self.validate_agent()?;
        self.validate_goal()
    }

    /// Object `o` stands at receptacle `r`.
    fn validate_place(&self, o: &Object, r: &str) -> Result<(), WorldError> {
        let ri = self.receptacle(r).ok_or_else(|| WorldError::UnknownPlace {
            object: o.name.clone(),
            at: r.to_string(),
        })?;
        if o.is_lamp() && self.receptacles[ri].open.is_some() {
            return Err(WorldError::LampInside {
                lamp: o.name.clone(),
                at: r.to_string(),
            });
        }
        Ok(())
    }

    fn validate_agent(&self) -> Result<(), WorldError> {
        if let Some(h) = &self.agent.holding {
            if self.objects.iter().any(|o| &o.name == h && o.is_lamp()) {
                return Err(WorldError::LampHeld(h.clone()));
            }
        }
        if let Some(at) = &self.agent.at {
            if self.receptacle(at).is_none() {
                return Err(WorldError::AgentAt(at.clone()));
            }
        }
        Ok(())
    }

    fn validate_goal(&self) -> Result<(), WorldError> {
        let g = &self.goal;
        let obj = object_kind(&g.object)
            .filter(|k| k.category != Category::Lamp)
            .ok_or_else(|| WorldError::GoalObject(g.object.clone()))?;
        let kind_present = |kind: &str| self.receptacles.iter().any(|r| kind_of(&r.name) == kind);
        if g.task_type == TaskType::LookAtObjInLight {
            let lamp_ok = object_kind(&g.target).is_some_and(|k| k.category == Category::Lamp);
            if !lamp_ok || !self.objects.iter().any(|o| kind_of(&o.name) == g.target) {
                return Err(WorldError::GoalLamp(g.target.clone()));
            }
        } else if receptacle_kind(&g.target).is_none() || !kind_present(&g.target) {
            return Err(WorldError::GoalTarget(g.target.clone()));
        }
        if let Some(t) = g.task_type.treatment() {
            if !t.applies_to(obj) {
                return Err(WorldError::Untreatable {
                    object: g.object.clone(),
                    adjective: t.adjective(),
                });
            }
            if !kind_present(t.appliance()) {
                return Err(WorldError::NoAppliance {
                    appliance: t.appliance(),
                    verb: t.verb(),
                });
            }
        }
        Ok(())
    }
}
