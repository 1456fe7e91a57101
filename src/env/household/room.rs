//! One random household room for a task type: what the goal needs (object
//! kind, target, lamp), which receptacles the room has, and where the
//! objects start. The generator ([`super::generate`]) turns rooms into tasks.
//!
//! The steps below draw from one stream in a fixed order (goal needs,
//! receptacle counts, door states, lamp, goal objects, clutter, listing
//! shuffle): the committed panels depend on that order, so keep it.

use std::collections::BTreeMap;

use rand::seq::{IndexedRandom, SliceRandom};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use super::catalog::{
    kind_of, Category, ObjectKind, ReceptacleKind, TaskType, MAX_INDEX, OBJECTS, RECEPTACLES,
};
use super::world::{Agent, Goal, Object, Receptacle, World};

/// Chance that a door starts closed.
const P_CLOSED: f64 = 0.6;
/// Chance that a non-light task's room still has a lamp (so "use" is not a
/// give-away of the task type).
const P_EXTRA_LAMP: f64 = 0.3;
const LAMPS: [&str; 2] = ["desklamp", "floorlamp"];

fn lamp_hosts(lamp: &str) -> &'static [&'static str] {
    if lamp == "desklamp" {
        &["desk", "dresser", "shelf", "sidetable"]
    } else {
        &["armchair", "dresser", "sidetable", "sofa"]
    }
}

fn holds(r: &ReceptacleKind, c: Category) -> bool {
    r.holds.contains(&c)
}

/// A random room for a task of type `tt`, agent in the middle, hands empty.
/// `None` when a draw hits a dead end (the caller retries with a new stream).
pub(super) fn gen_world(rng: &mut ChaCha8Rng, tt: TaskType) -> Option<World> {
    let needs = Needs::draw(rng, tt)?;
    let count = receptacle_counts(rng, &needs)?;
    let receptacles = name_receptacles(rng, &count);
    let objects = place_objects(rng, &needs, &receptacles)?;
    checked(World {
        receptacles,
        objects,
        agent: Agent::default(),
        goal: Goal {
            task_type: tt,
            object: needs.obj.name.to_string(),
            target: needs.target.to_string(),
        },
        reveal: false,
    })
}

/// What the task's room must hold.
struct Needs {
    tt: TaskType,
    /// The light task: the target is a lamp, not a receptacle.
    look: bool,
    /// The goal object's kind.
    obj: &'static ObjectKind,
    /// Target receptacle kind (light task: the lamp kind).
    target: &'static str,
    /// The lamp the room has, if any (light task: the target).
    lamp: Option<&'static str>,
    /// The appliance the treatment needs (clean, heat, cool tasks).
    appliance: Option<&'static str>,
}

impl Needs {
    /// Draw the goal object's kind, then the target and the lamp.
    fn draw(rng: &mut ChaCha8Rng, tt: TaskType) -> Option<Needs> {
        let look = tt == TaskType::LookAtObjInLight;
        let treatment = tt.treatment();
        let appliance = treatment.map(|t| t.appliance());
        let kinds: Vec<&ObjectKind> = OBJECTS
            .iter()
            .filter(|k| match k.category {
                Category::Lamp => false,
                Category::Small | Category::Soft => treatment.is_none(),
                _ => !look && treatment.is_none_or(|t| t.applies_to(k)),
            })
            .collect();
        let obj = *kinds.choose(rng)?;

        let (target, lamp) = if look {
            let lamp = *LAMPS.choose(rng)?;
            (lamp, Some(lamp))
        } else {
            let targets: Vec<&str> = RECEPTACLES
                .iter()
                .filter(|r| holds(r, obj.category) && Some(r.name) != appliance)
                .map(|r| r.name)
                .collect();
            let extra_lamp = rng.random_bool(P_EXTRA_LAMP);
            (
                *targets.choose(rng)?,
                extra_lamp.then(|| LAMPS[rng.random_range(0..2)]),
            )
        };
        Some(Needs {
            tt,
            look,
            obj,
            target,
            lamp,
            appliance,
        })
    }

    /// Where the goal object may start: objects never start in the target
    /// kind, so the task is never half done.
    fn is_source(&self, r: &ReceptacleKind) -> bool {
        holds(r, self.obj.category) && (self.look || r.name != self.target)
    }
}

/// How many receptacles of each kind (indexed like [`RECEPTACLES`]): the
/// kinds the task needs, then random others, drawn uniformly over the free
/// "slots" (so cabinets and drawers come up often).
fn receptacle_counts(rng: &mut ChaCha8Rng, needs: &Needs) -> Option<Vec<usize>> {
    let sources: Vec<&str> = RECEPTACLES
        .iter()
        .filter(|r| needs.is_source(r))
        .map(|r| r.name)
        .collect();
    let mut required = vec![*sources.choose(rng)?];
    if !needs.look {
        required.push(needs.target);
    }
    required.extend(needs.appliance);
    if let Some(l) = needs.lamp {
        required.push(*lamp_hosts(l).choose(rng)?);
    }
    let mut count = vec![0usize; RECEPTACLES.len()];
    for k in required {
        let i = RECEPTACLES.iter().position(|r| r.name == k)?;
        count[i] = 1;
    }
    let size = rng.random_range(6..=12);
    while count.iter().sum::<usize>() < size {
        let slots: Vec<usize> = (0..RECEPTACLES.len())
            .flat_map(|i| std::iter::repeat_n(i, RECEPTACLES[i].max - count[i]))
            .collect();
        count[*slots.choose(rng)?] += 1;
    }
    Some(count)
}

/// The receptacles "<kind> 1", "<kind> 2", … in catalog order, each door
/// drawn open or closed.
fn name_receptacles(rng: &mut ChaCha8Rng, count: &[usize]) -> Vec<Receptacle> {
    let mut receptacles = Vec::new();
    for (kind, &n) in RECEPTACLES.iter().zip(count) {
        for i in 1..=n {
            receptacles.push(Receptacle {
                name: format!("{} {i}", kind.name),
                open: kind.openable.then(|| !rng.random_bool(P_CLOSED)),
            });
        }
    }
    receptacles
}

/// The lamp, the goal's objects and clutter, in listing order (shuffled).
fn place_objects(
    rng: &mut ChaCha8Rng,
    needs: &Needs,
    receptacles: &[Receptacle],
) -> Option<Vec<Object>> {
    let mut p = Placer {
        receptacles,
        objects: Vec::new(),
        numbered: BTreeMap::new(),
    };
    // A lamp first, so the light task's object can avoid the lamp's place
    // (otherwise "go, take, use" makes most light tasks trivially short).
    let mut lamp_at = None;
    if let Some(l) = needs.lamp {
        let hosts = p.spots(&|k| lamp_hosts(l).contains(&k.name));
        p.place(l, &hosts, rng)?;
        lamp_at = p.objects.last().and_then(|o| o.at.clone());
    }
    p.place_goal_objects(rng, needs, lamp_at)?;
    p.place_clutter(rng, needs.obj.name)?;
    // Shuffle so the goal object is not always listed first.
    p.objects.shuffle(rng);
    Some(p.objects)
}

/// Objects placed so far, and how many of each kind (for their numbers).
struct Placer<'a> {
    receptacles: &'a [Receptacle],
    objects: Vec<Object>,
    numbered: BTreeMap<&'static str, usize>,
}

impl Placer<'_> {
    /// The room's receptacles whose kind satisfies `pred`, in room order.
    fn spots(&self, pred: &dyn Fn(&ReceptacleKind) -> bool) -> Vec<String> {
        self.receptacles
            .iter()
            .filter(|r| {
                RECEPTACLES
                    .iter()
                    .any(|k| k.name == kind_of(&r.name) && pred(k))
            })
            .map(|r| r.name.clone())
            .collect()
    }

    /// Add the next "<kind> <n>" at a random one of `spots`.
    fn place(&mut self, kind: &'static str, spots: &[String], rng: &mut ChaCha8Rng) -> Option<()> {
        let n = self.numbered.entry(kind).or_insert(0);
        *n += 1;
        self.objects.push(Object {
            name: format!("{kind} {n}"),
            at: Some(spots.choose(rng)?.clone()),
            ..Object::default()
        });
        Some(())
    }

    /// The goal's objects: one plus 0–2 more of the kind; pick-two gets two
    /// plus 0–1 more (spare copies make its expert shorter). The light
    /// task's object avoids the lamp's place.
    fn place_goal_objects(
        &mut self,
        rng: &mut ChaCha8Rng,
        needs: &Needs,
        lamp_at: Option<String>,
    ) -> Option<()> {
        let copies = match needs.tt {
            TaskType::PickTwoObj => 2 + rng.random_range(0..=1),
            _ => 1 + rng.random_range(0..=2),
        };
        let mut source_spots = self.spots(&|r| needs.is_source(r));
        if needs.look {
            source_spots.retain(|s| Some(s) != lamp_at.as_ref());
        }
        for _ in 0..copies {
            self.place(needs.obj.name, &source_spots, rng)?;
        }
        Some(())
    }

    /// Clutter: 2–6 objects of other kinds wherever their class fits (at
    /// most three of a kind).
    fn place_clutter(&mut self, rng: &mut ChaCha8Rng, goal_kind: &str) -> Option<()> {
        for _ in 0..rng.random_range(2..=6) {
            let kind = OBJECTS
                .iter()
                .filter(|k| k.category != Category::Lamp && k.name != goal_kind)
                .collect::<Vec<_>>()
                .choose(rng)
                .map(|k| (k.name, k.category))?;
            let s = self.spots(&|r| holds(r, kind.1));
            if !s.is_empty() && self.numbered.get(kind.0).copied().unwrap_or(0) < 3 {
                self.place(kind.0, &s, rng)?;
            }
        }
        Some(())
    }
}

/// `world` if it validates and every number fits the vocabulary.
fn checked(world: World) -> Option<World> {
    let max_index = world
        .receptacles
        .iter()
        .map(|r| &r.name)
        .chain(world.objects.iter().map(|o| &o.name))
        .filter_map(|n| n.rsplit(' ').next()?.parse::<usize>().ok())
        .max()
        .unwrap_or(0);
    (world.validate().is_ok() && max_index <= MAX_INDEX).then_some(world)
}
