//! Which env: the built-in envs by name ([`BuiltinEnv`]), the `env.kind`
//! setting of an experiment file ([`EnvKindName`]), and the dispatch from a
//! built-in env to its env, panel generator, default panels
//! ([`write_default_panels`]) and random-policy baseline
//! ([`random_policy_success`]).
//!
//! This is the one place that lists the env names, so an unknown name is
//! rejected in one way everywhere: [`UnknownEnv`] for the command line
//! (`--env`), serde's "unknown variant … expected one of …" for experiment
//! files. Nothing falls back to a default env.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::panel::PanelError;
use super::{household, searchqa, shop, Env, Task};

/// A built-in env.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BuiltinEnv {
    Household,
    Shop,
    SearchQa,
}

/// A name that is not a built-in env (`--env`, `tasks generate`, …).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown env `{0}` (built-in: household, shop, searchqa)")]
pub struct UnknownEnv(pub String);

/// A request for panels that a built-in generator cannot meet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot generate {n_train} train and {n_test} test {kind} tasks: {why}")]
pub struct CannotGenerate {
    pub kind: BuiltinEnv,
    pub n_train: usize,
    pub n_test: usize,
    pub why: GenerateError,
}

/// A panel that asks a built-in generator for more distinct tasks than the
/// env has (searchqa's question pool, shop's goals), or a generator that
/// found no valid task for a slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerateError {
    #[error("household generator: no valid {task_type} world for index {index}")]
    NoHouseholdWorld { task_type: &'static str, index: u64 },
    #[error("shop generator: no valid goal for {split} task {index}")]
    NoShopGoal { split: &'static str, index: usize },
    #[error(
        "searchqa: the {split} split has only {have} distinct {hops}-hop questions, {asked} asked"
    )]
    TooFewQuestions {
        split: &'static str,
        have: usize,
        hops: usize,
        asked: usize,
    },
}

impl BuiltinEnv {
    /// Every built-in env, in the order the docs list them.
    pub const ALL: [BuiltinEnv; 3] = [
        BuiltinEnv::Household,
        BuiltinEnv::Shop,
        BuiltinEnv::SearchQa,
    ];

    /// The name in experiment files, on the command line and in `envs/<name>/`.
    pub fn name(self) -> &'static str {
        match self {
            BuiltinEnv::Household => "household",
            BuiltinEnv::Shop => "shop",
            BuiltinEnv::SearchQa => "searchqa",
        }
    }

    /// A fresh env whose episodes end after `max_steps` steps.
    pub fn env(self, max_steps: usize) -> Box<dyn Env> {
        match self {
            BuiltinEnv::Household => Box::new(household::HouseholdEnv::new(max_steps)),
            BuiltinEnv::Shop => Box::new(shop::ShopEnv::new(max_steps)),
            BuiltinEnv::SearchQa => Box::new(searchqa::SearchQaEnv::new(max_steps)),
        }
    }

    /// The seed and the train and test sizes of the env's default panels
    /// (the ones committed under `envs/<name>/`).
    pub fn default_panels(self) -> (u64, usize, usize) {
        match self {
            BuiltinEnv::Household => (
                household::DEFAULT_SEED,
                household::DEFAULT_TRAIN,
                household::DEFAULT_TEST,
            ),
            BuiltinEnv::Shop => (shop::DEFAULT_SEED, shop::DEFAULT_TRAIN, shop::DEFAULT_TEST),
            BuiltinEnv::SearchQa => (
                searchqa::DEFAULT_SEED,
                searchqa::DEFAULT_TRAIN,
                searchqa::DEFAULT_TEST,
            ),
        }
    }

    /// The env's word list (what its tiny tokenizer covers).
    pub fn vocabulary(self) -> Vec<String> {
        match self {
            BuiltinEnv::Household => household::vocabulary(),
            BuiltinEnv::Shop => shop::vocabulary(),
            BuiltinEnv::SearchQa => searchqa::vocabulary(),
        }
    }
}

impl fmt::Display for BuiltinEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BuiltinEnv {
    type Err = UnknownEnv;

    fn from_str(s: &str) -> Result<Self, UnknownEnv> {
        BuiltinEnv::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| UnknownEnv(s.to_string()))
    }
}

/// Generate disjoint train/test panels of a built-in env (deterministic:
/// the same arguments give byte-identical panels). Asking for more
/// distinct tasks than the env has is an error naming the request.
pub fn generate_panels(
    kind: BuiltinEnv,
    seed: u64,
    n_train: usize,
    n_test: usize,
) -> Result<(Vec<Task>, Vec<Task>), CannotGenerate> {
    let generate = match kind {
        BuiltinEnv::Household => household::generate_panels,
        BuiltinEnv::Shop => shop::generate_panels,
        BuiltinEnv::SearchQa => searchqa::generate_panels,
    };
    generate(seed, n_train, n_test).map_err(|why| CannotGenerate {
        kind,
        n_train,
        n_test,
        why,
    })
}

/// Write a built-in env's default panels (its [`BuiltinEnv::default_panels`]
/// seed and sizes; the panels committed under `envs/<name>/`) as
/// `dir/train.jsonl` and `dir/test.jsonl`, creating `dir` if needed.
pub fn write_default_panels(kind: BuiltinEnv, dir: &Path) -> Result<(), PanelError> {
    let (seed, n_train, n_test) = kind.default_panels();
    // The committed panels are these: the default sizes always fit (each
    // env's tests pin it).
    let (train, test) = generate_panels(kind, seed, n_train, n_test)
        .unwrap_or_else(|e| panic!("the default {kind} panels generate: {e}"));
    super::panel::write_panels(dir, &train, &test)
}

/// Success of a uniformly random admissible-action policy per difficulty:
/// `(difficulty, tasks, success rate)` sorted by difficulty, for a
/// built-in env's panel. Tasks whose world fails to load count as
/// failures.
pub fn random_policy_success(
    kind: BuiltinEnv,
    tasks: &[Task],
    rollouts: usize,
    max_steps: usize,
    seed: u64,
) -> Vec<(usize, usize, f64)> {
    let mut env = kind.env(max_steps);
    super::panel::random_policy_success(env.as_mut(), tasks, rollouts, seed)
}

/// The `env.kind` setting of an experiment file: a built-in env, or an
/// external env reached over AgentGym's HTTP API (`http`) or the
/// subprocess protocol (`subprocess`). Written as its name; an unknown name
/// is a serde error listing [`EnvKindName::NAMES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvKindName {
    Builtin(BuiltinEnv),
    Http,
    Subprocess,
}

impl EnvKindName {
    /// Every name `env.kind` accepts.
    pub const NAMES: &'static [&'static str] =
        &["household", "shop", "searchqa", "http", "subprocess"];

    pub fn name(self) -> &'static str {
        match self {
            EnvKindName::Builtin(b) => b.name(),
            EnvKindName::Http => "http",
            EnvKindName::Subprocess => "subprocess",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "http" => Some(EnvKindName::Http),
            "subprocess" => Some(EnvKindName::Subprocess),
            b => b.parse().ok().map(EnvKindName::Builtin),
        }
    }
}

impl Default for EnvKindName {
    fn default() -> Self {
        EnvKindName::Builtin(BuiltinEnv::Household)
    }
}

impl fmt::Display for EnvKindName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for EnvKindName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for EnvKindName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        EnvKindName::parse(&s)
            .ok_or_else(|| serde::de::Error::unknown_variant(&s, EnvKindName::NAMES))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_errors() {
        for k in BuiltinEnv::ALL {
            assert_eq!(k.name().parse::<BuiltinEnv>(), Ok(k));
        }
        assert_eq!(
            "kitchen".parse::<BuiltinEnv>().unwrap_err().to_string(),
            "unknown env `kitchen` (built-in: household, shop, searchqa)"
        );
        // The setting's names are the built-in ones plus the two protocols.
        let mut names: Vec<&str> = BuiltinEnv::ALL.iter().map(|k| k.name()).collect();
        names.extend(["http", "subprocess"]);
        assert_eq!(EnvKindName::NAMES, names.as_slice());
        for n in EnvKindName::NAMES {
            let k: EnvKindName = serde_json::from_value(serde_json::json!(n)).unwrap();
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::json!(n));
        }
    }

    #[test]
    fn an_unknown_setting_names_the_allowed_values() {
        let err = serde_json::from_value::<EnvKindName>(serde_json::json!("kitchen"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "unknown variant `kitchen`, expected one of `household`, `shop`, `searchqa`, \
             `http`, `subprocess`"
        );
    }
}
