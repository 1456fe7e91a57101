//! The serialized household world (`Task::world`): the room's receptacles,
//! the objects and where they are, the agent's position and hand, and the
//! goal. A world is a complete state, so a start state part-way through a
//! task (agent at a counter, holding a clean mug) is just another world.

use serde::{Deserialize, Serialize};

use super::catalog::{
    kind_of, object_kind, receptacle_kind, split_name, Category, TaskType, Treatment,
};

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
    pub fn validate(&self) -> Result<(), String> {
        let mut names = std::collections::BTreeSet::new();
        if self.receptacles.is_empty() {
            return Err("no receptacles".into());
        }
        for r in &self.receptacles {
            let kind = split_name(&r.name)
                .and_then(|(k, _)| receptacle_kind(k))
                .ok_or_else(|| format!("bad receptacle name {:?}", r.name))?;
            if kind.openable != r.open.is_some() {
                return Err(format!(
                    "receptacle {:?}: `open` must be given exactly for openable kinds",
                    r.name
                ));
            }
            if !names.insert(r.name.as_str()) {
                return Err(format!("duplicate name {:?}", r.name));
            }
        }
        let mut held = Vec::new();
        for o in &self.objects {
            split_name(&o.name)
                .and_then(|(k, _)| object_kind(k))
                .ok_or_else(|| format!("bad object name {:?}", o.name))?;
            if !names.insert(o.name.as_str()) {
                return Err(format!("duplicate name {:?}", o.name));
            }
            match &o.at {
                None => held.push(o.name.as_str()),
                Some(r) => {
                    let ri = self
                        .receptacle(r)
                        .ok_or_else(|| format!("object {:?} at unknown {:?}", o.name, r))?;
                    if o.is_lamp() && self.receptacles[ri].open.is_some() {
                        return Err(format!("lamp {:?} inside openable {:?}", o.name, r));
                    }
                }
            }
            if o.on && !o.is_lamp() {
                return Err(format!("object {:?}: only lamps can be on", o.name));
            }
        }
        if held.len() > 1 || held.first().copied() != self.agent.holding.as_deref() {
            return Err("agent.holding must name the one object with no `at`".into());
        }
        if let Some(h) = &self.agent.holding {
            if self.objects.iter().any(|o| &o.name == h && o.is_lamp()) {
                return Err(format!("lamp {h:?} cannot be held"));
            }
        }
        if let Some(at) = &self.agent.at {
            if self.receptacle(at).is_none() {
                return Err(format!("agent at unknown receptacle {at:?}"));
            }
        }
        self.validate_goal()
    }

    fn validate_goal(&self) -> Result<(), String> {
        let g = &self.goal;
        let obj = object_kind(&g.object)
            .filter(|k| k.category != Category::Lamp)
            .ok_or_else(|| format!("goal object {:?} is not a takeable kind", g.object))?;
        let kind_present = |kind: &str| self.receptacles.iter().any(|r| kind_of(&r.name) == kind);
        if g.task_type == TaskType::LookAtObjInLight {
            let lamp_ok = object_kind(&g.target).is_some_and(|k| k.category == Category::Lamp);
            if !lamp_ok || !self.objects.iter().any(|o| kind_of(&o.name) == g.target) {
                return Err(format!("goal lamp {:?} not in the room", g.target));
            }
        } else if receptacle_kind(&g.target).is_none() || !kind_present(&g.target) {
            return Err(format!("goal target {:?} not in the room", g.target));
        }
        if let Some(t) = g.task_type.treatment() {
            if !t.applies_to(obj) {
                return Err(format!("{} cannot be made {}", g.object, t.adjective()));
            }
            if !kind_present(t.appliance()) {
                return Err(format!("no {} to {} with", t.appliance(), t.verb()));
            }
        }
        Ok(())
    }
}
