//! The household's fixed vocabulary of things: receptacle kinds, object
//! kinds, what each can do, and the six ALFWorld task types with their goal
//! phrasings. Everything else (worlds, rules, generation) reads these tables,
//! so adding a kind here is enough to make it appear everywhere.

use serde::{Deserialize, Serialize};

/// Broad object classes; receptacles say which classes they can hold, which
/// keeps generated rooms plausible (no pillow in the microwave).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Category {
    Food,
    Dish,
    Utensil,
    Small,
    Soft,
    Lamp,
}

/// One kind of receptacle ("cabinet"), instantiated as "cabinet 1", ...
pub(crate) struct ReceptacleKind {
    pub name: &'static str,
    /// Has a door: starts open or closed, hides its contents when closed.
    pub openable: bool,
    /// Object classes that may stand in / on it (lamps included).
    pub holds: &'static [Category],
    /// Most instances a generated room has.
    pub max: usize,
}

use Category::*;

pub(crate) const RECEPTACLES: &[ReceptacleKind] = &[
    rk("armchair", false, &[Small, Soft, Lamp], 1),
    rk("bed", false, &[Small, Soft], 1),
    rk("cabinet", true, &[Dish, Utensil, Small, Food], 4),
    rk("coffeemachine", false, &[], 1),
    rk("coffeetable", false, &[Small, Dish], 1),
    rk("countertop", false, &[Food, Dish, Utensil, Small], 2),
    rk("desk", false, &[Small, Dish, Lamp], 1),
    rk("diningtable", false, &[Food, Dish, Utensil, Small], 1),
    rk("drawer", true, &[Utensil, Small], 3),
    rk("dresser", false, &[Small, Lamp], 1),
    rk("fridge", true, &[Food, Dish], 1),
    rk("garbagecan", false, &[Food, Small], 1),
    rk("microwave", true, &[Food, Dish], 1),
    rk("safe", true, &[Small], 1),
    rk("shelf", false, &[Small, Dish, Lamp], 3),
    rk("sidetable", false, &[Small, Dish, Lamp], 2),
    rk("sinkbasin", false, &[Dish, Utensil, Food], 1),
    rk("sofa", false, &[Small, Soft, Lamp], 1),
    rk("stoveburner", false, &[Dish], 2),
    rk("toaster", false, &[], 1),
];

const fn rk(
    name: &'static str,
    openable: bool,
    holds: &'static [Category],
    max: usize,
) -> ReceptacleKind {
    ReceptacleKind {
        name,
        openable,
        holds,
        max,
    }
}

/// One kind of object ("apple"), instantiated as "apple 1", ...
pub(crate) struct ObjectKind {
    pub name: &'static str,
    pub category: Category,
    pub cleanable: bool,
    pub heatable: bool,
    pub coolable: bool,
}

pub(crate) const OBJECTS: &[ObjectKind] = &[
    ok("alarmclock", Small, ""),
    ok("apple", Food, "chk"),
    ok("book", Small, ""),
    ok("bowl", Dish, "ck"),
    ok("bread", Food, "hk"),
    ok("cd", Small, ""),
    ok("cellphone", Small, ""),
    ok("creditcard", Small, ""),
    ok("cup", Dish, "chk"),
    ok("desklamp", Lamp, ""),
    ok("egg", Food, "chk"),
    ok("floorlamp", Lamp, ""),
    ok("fork", Utensil, "c"),
    ok("keychain", Small, ""),
    ok("knife", Utensil, "c"),
    ok("ladle", Utensil, "c"),
    ok("lettuce", Food, "ck"),
    ok("mug", Dish, "chk"),
    ok("newspaper", Small, ""),
    ok("pan", Dish, "ck"),
    ok("pen", Small, ""),
    ok("pencil", Small, ""),
    ok("pillow", Soft, ""),
    ok("plate", Dish, "chk"),
    ok("pot", Dish, "ck"),
    ok("potato", Food, "chk"),
    ok("remotecontrol", Small, ""),
    ok("spatula", Utensil, "c"),
    ok("spoon", Utensil, "c"),
    ok("statue", Small, ""),
    ok("tomato", Food, "chk"),
    ok("vase", Small, ""),
    ok("watch", Small, ""),
];

/// `caps`: c = cleanable, h = heatable, k = coolable.
const fn ok(name: &'static str, category: Category, caps: &'static str) -> ObjectKind {
    let b = caps.as_bytes();
    let mut i = 0;
    let (mut c, mut h, mut k) = (false, false, false);
    while i < b.len() {
        match b[i] {
            b'c' => c = true,
            b'h' => h = true,
            _ => k = true,
        }
        i += 1;
    }
    ObjectKind {
        name,
        category,
        cleanable: c,
        heatable: h,
        coolable: k,
    }
}

/// Highest instance number generated worlds use ("cabinet 4", "apple 4");
/// the vocabulary lists the numbers up to it.
pub const MAX_INDEX: usize = 5;

pub(crate) fn receptacle_kind(name: &str) -> Option<&'static ReceptacleKind> {
    RECEPTACLES.iter().find(|k| k.name == name)
}

pub(crate) fn object_kind(name: &str) -> Option<&'static ObjectKind> {
    OBJECTS.iter().find(|k| k.name == name)
}

/// "cabinet 3" → ("cabinet", 3); None unless "<word> <positive number>".
pub(crate) fn split_name(name: &str) -> Option<(&str, usize)> {
    let (kind, n) = name.split_once(' ')?;
    let n: usize = n.parse().ok()?;
    (n >= 1 && !kind.is_empty()).then_some((kind, n))
}

/// The kind part of an entity name ("apple 2" → "apple").
pub(crate) fn kind_of(name: &str) -> &str {
    name.split(' ').next().unwrap_or(name)
}

/// The three appliance treatments and the receptacle kind each needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Treatment {
    Clean,
    Heat,
    Cool,
}

impl Treatment {
    pub fn verb(self) -> &'static str {
        match self {
            Treatment::Clean => "clean",
            Treatment::Heat => "heat",
            Treatment::Cool => "cool",
        }
    }
    pub fn appliance(self) -> &'static str {
        match self {
            Treatment::Clean => "sinkbasin",
            Treatment::Heat => "microwave",
            Treatment::Cool => "fridge",
        }
    }
    /// The state adjective the object gets ("clean", "hot", "cool").
    pub fn adjective(self) -> &'static str {
        match self {
            Treatment::Clean => "clean",
            Treatment::Heat => "hot",
            Treatment::Cool => "cool",
        }
    }
    pub fn applies_to(self, kind: &ObjectKind) -> bool {
        match self {
            Treatment::Clean => kind.cleanable,
            Treatment::Heat => kind.heatable,
            Treatment::Cool => kind.coolable,
        }
    }
    pub const ALL: [Treatment; 3] = [Treatment::Clean, Treatment::Heat, Treatment::Cool];
}

/// The six ALFWorld task types (serialized with the names docs/ENVIRONMENTS.md#household uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskType {
    PickAndPlace,
    LookAtObjInLight,
    PickCleanThenPlace,
    PickHeatThenPlace,
    PickCoolThenPlace,
    PickTwoObj,
}

impl TaskType {
    pub const ALL: [TaskType; 6] = [
        TaskType::PickAndPlace,
        TaskType::LookAtObjInLight,
        TaskType::PickCleanThenPlace,
        TaskType::PickHeatThenPlace,
        TaskType::PickCoolThenPlace,
        TaskType::PickTwoObj,
    ];

    /// The name used in `Task::task_type`.
    pub fn name(self) -> &'static str {
        match self {
            TaskType::PickAndPlace => "pick_and_place",
            TaskType::LookAtObjInLight => "look_at_obj_in_light",
            TaskType::PickCleanThenPlace => "pick_clean_then_place",
            TaskType::PickHeatThenPlace => "pick_heat_then_place",
            TaskType::PickCoolThenPlace => "pick_cool_then_place",
            TaskType::PickTwoObj => "pick_two_obj",
        }
    }

    pub(crate) fn treatment(self) -> Option<Treatment> {
        match self {
            TaskType::PickCleanThenPlace => Some(Treatment::Clean),
            TaskType::PickHeatThenPlace => Some(Treatment::Heat),
            TaskType::PickCoolThenPlace => Some(Treatment::Cool),
            _ => None,
        }
    }

    /// ALFWorld's two goal phrasings; `{o}` is the object kind, `{r}` the
    /// target receptacle kind (or the lamp kind for the light task).
    pub(crate) fn phrasings(self) -> [&'static str; 2] {
        match self {
            TaskType::PickAndPlace => ["put a {o} in {r}", "put some {o} on {r}"],
            TaskType::LookAtObjInLight => {
                ["look at {o} under the {r}", "examine the {o} with the {r}"]
            }
            TaskType::PickCleanThenPlace => {
                ["put a clean {o} in {r}", "clean some {o} and put it in {r}"]
            }
            TaskType::PickHeatThenPlace => {
                ["put a hot {o} in {r}", "heat some {o} and put it in {r}"]
            }
            TaskType::PickCoolThenPlace => {
                ["put a cool {o} in {r}", "cool some {o} and put it in {r}"]
            }
            TaskType::PickTwoObj => ["put two {o} in {r}", "find two {o} and put them in {r}"],
        }
    }

    /// Goal text for phrasing `which` (0 or 1).
    pub fn goal_text(self, which: usize, object: &str, target: &str) -> String {
        self.phrasings()[which % 2]
            .replace("{o}", object)
            .replace("{r}", target)
    }
}
