//! A panel named on the command line (`--panel test|train|PATH`): one of
//! the two panels of a run or of a built-in env, or a panel file.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use crate::env::BuiltinEnv;
use crate::experiment::Experiment;

/// `test`, `train`, or any other text as a path to a panel file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PanelRef {
    Test,
    Train,
    File(PathBuf),
}

/// An empty `--panel` value: neither a panel name nor a file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be \"test\", \"train\" or a panel file, got an empty value")]
pub struct EmptyPanel;

impl FromStr for PanelRef {
    type Err = EmptyPanel;

    fn from_str(s: &str) -> Result<Self, EmptyPanel> {
        match s {
            "" => Err(EmptyPanel),
            "test" => Ok(PanelRef::Test),
            "train" => Ok(PanelRef::Train),
            other => Ok(PanelRef::File(PathBuf::from(other))),
        }
    }
}

/// Infallible for the names and any non-empty path; an empty text reads
/// as the file "" (whose reading then fails with its name).
impl From<&str> for PanelRef {
    fn from(s: &str) -> Self {
        s.parse()
            .unwrap_or_else(|_| PanelRef::File(PathBuf::from(s)))
    }
}

impl fmt::Display for PanelRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PanelRef::Test => f.write_str("test"),
            PanelRef::Train => f.write_str("train"),
            PanelRef::File(p) => write!(f, "{}", p.display()),
        }
    }
}

impl PanelRef {
    /// The file, given the test and train panels `test`/`train` stand for.
    fn resolve(&self, test: &Path, train: &Path) -> PathBuf {
        match self {
            PanelRef::Test => test.to_path_buf(),
            PanelRef::Train => train.to_path_buf(),
            PanelRef::File(p) => p.clone(),
        }
    }

    /// The file in a run: `test` and `train` are the run's `env.test` and
    /// `env.train`.
    pub fn in_run(&self, exp: &Experiment) -> PathBuf {
        self.resolve(Path::new(&exp.env.test), Path::new(&exp.env.train))
    }

    /// The file without a run: `test` and `train` are a built-in env's
    /// panels as `actguide tasks generate` writes them,
    /// `envs/<env>/{test,train}.jsonl`.
    pub fn of_env(&self, env: BuiltinEnv) -> PathBuf {
        let dir = Path::new("envs").join(env.name());
        self.resolve(&dir.join("test.jsonl"), &dir.join("train.jsonl"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_panels_and_anything_else_is_a_file() {
        assert_eq!("test".parse(), Ok(PanelRef::Test));
        assert_eq!("train".parse(), Ok(PanelRef::Train));
        assert_eq!(
            "envs/shop/test.jsonl".parse(),
            Ok(PanelRef::File("envs/shop/test.jsonl".into()))
        );
        assert_eq!("".parse::<PanelRef>(), Err(EmptyPanel));
        for s in ["test", "train", "a/b.jsonl"] {
            assert_eq!(PanelRef::from(s).to_string(), s);
        }
    }

    #[test]
    fn without_a_run_the_names_are_the_builtin_envs_panels() {
        assert_eq!(
            PanelRef::Train.of_env(BuiltinEnv::Household),
            PathBuf::from("envs/household/train.jsonl")
        );
        assert_eq!(
            PanelRef::Test.of_env(BuiltinEnv::Shop),
            PathBuf::from("envs/shop/test.jsonl")
        );
        assert_eq!(
            PanelRef::File("p.jsonl".into()).of_env(BuiltinEnv::Shop),
            PathBuf::from("p.jsonl")
        );
    }
}
