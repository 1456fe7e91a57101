//! The experiment file's `env` section, parsed once into [`EnvSection`]:
//! the settings every env has (panels, step limits, timeouts, …) around an
//! [`EnvKindSection`], one variant per `env.kind` carrying that kind's own
//! keys (an http env's `url` is required, a subprocess env's `command`
//! too). A key of another kind, or a missing required key, is refused
//! with the key's name ([`EnvKeyError`]; `load` adds its line:col).
//!
//! The section reads and writes the flat map of the file
//! (`FlatEnvSection`): `experiment.json` keeps every key, so a run
//! directory written by any kind reads back unchanged.

use serde::{Deserialize, Serialize};

use crate::env::{external::Limits, BuiltinEnv, EnvKind, EnvKindName, EnvSpec, ExpertSource};

/// Environment and task panels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "FlatEnvSection", into = "FlatEnvSection")]
pub struct EnvSection {
    /// Which env, with its own settings (`env.kind` and its keys).
    pub kind: EnvKindSection,
    pub train: String,
    pub test: String,
    /// Episode step limit in policy actions (executed expert prefix
    /// actions come on top).
    pub max_steps: usize,
    /// If set, a task's policy budget is min(max_steps, expert actions
    /// left + step_slack): rewarded episodes then hold little wandering.
    pub step_slack: Option<usize>,
    /// External envs: seconds to wait for one reply, and extra attempts of
    /// requests that are safe to repeat (create, reset, expert).
    pub timeout_s: f64,
    pub retries: usize,
    /// External envs: episodes whose requests run at once (a silent server
    /// then costs one timeout per turn, not one per episode).
    pub concurrency: usize,
    /// External envs: the longest one training step (or one evaluation)
    /// waits on the env in all; past it, and after any timeout in the
    /// step, requests fail at once (their episodes fail with the reason).
    pub step_deadline_s: f64,
    /// External envs: a done step with at least this reward is a success
    /// (unless the reply says `success`).
    pub success_reward: f64,
}

/// `env.kind` with the keys that belong to it.
#[derive(Debug, Clone, PartialEq)]
pub enum EnvKindSection {
    /// "household", "shop" or "searchqa": no keys of its own.
    Builtin(BuiltinEnv),
    /// "http": an AgentGym env server.
    Http(HttpEnvSection),
    /// "subprocess": a program speaking envs/PROTOCOL.md.
    Subprocess(SubprocessEnvSection),
}

/// The keys of `env.kind = "http"`.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpEnvSection {
    /// The env server's base URL (`http://host:port`; required).
    pub url: String,
    /// The id field of the server's dialect.
    pub id_field: IdField,
    /// The server answers `GET /expert?id=<task id>` with the task's
    /// expert actions: the same as `expert: "task"` (kept as written, so
    /// `experiment.json` says what the file said).
    pub expert_endpoint: bool,
    /// Where tasks without expert actions get them (see [`ExpertSource`]).
    pub expert: Option<ExpertSource>,
}

/// The keys of `env.kind = "subprocess"`.
#[derive(Debug, Clone, PartialEq)]
pub struct SubprocessEnvSection {
    /// The program and its arguments (required, non-empty).
    pub command: Vec<String>,
    /// Where tasks without expert actions get them (see [`ExpertSource`]).
    pub expert: Option<ExpertSource>,
}

/// The key an AgentGym server names its envs by (`env.id_field`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdField {
    /// `id`: the ALFWorld adapter (and `actguide serve-env`).
    #[default]
    Id,
    /// `env_idx`: the WebShop adapter.
    EnvIdx,
}

impl IdField {
    /// The JSON key.
    pub fn as_str(self) -> &'static str {
        match self {
            IdField::Id => "id",
            IdField::EnvIdx => "env_idx",
        }
    }
}

/// A key of the `env` section that its kind refuses: a key of another
/// kind, a required key missing, or settings that contradict each other.
/// `key` is where the complaint points (for a missing key, `kind`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{msg}")]
pub struct EnvKeyError {
    pub key: &'static str,
    pub msg: String,
}

impl HttpEnvSection {
    /// Where tasks without expert actions get them: `env.expert`, else
    /// the task route when `expert_endpoint` is set, else the panel
    /// (AgentGym's API has no expert route).
    pub fn expert(&self) -> ExpertSource {
        self.expert.clone().unwrap_or(if self.expert_endpoint {
            ExpertSource::Task
        } else {
            ExpertSource::Panel
        })
    }
}

impl SubprocessEnvSection {
    /// Where tasks without expert actions get them: `env.expert`, else
    /// per task (the protocol has an expert request).
    pub fn expert(&self) -> ExpertSource {
        self.expert.clone().unwrap_or(ExpertSource::Task)
    }
}

impl EnvKindSection {
    /// The `env.kind` name.
    pub fn name(&self) -> EnvKindName {
        match self {
            EnvKindSection::Builtin(b) => EnvKindName::Builtin(*b),
            EnvKindSection::Http(_) => EnvKindName::Http,
            EnvKindSection::Subprocess(_) => EnvKindName::Subprocess,
        }
    }

    /// What the runner builds envs of.
    pub fn env_kind(&self) -> EnvKind {
        match self {
            EnvKindSection::Builtin(b) => EnvKind::Builtin(*b),
            EnvKindSection::Http(h) => EnvKind::Http {
                url: h.url.clone(),
                id_field: h.id_field.as_str().to_string(),
                expert: h.expert(),
            },
            EnvKindSection::Subprocess(s) => EnvKind::Subprocess {
                command: s.command.clone(),
                expert: s.expert(),
            },
        }
    }
}

impl EnvSection {
    /// The env spec the runner builds envs from: the parsed kind with the
    /// connection limits, and a fresh step guard and connection pool (one
    /// per call: each run, evaluation or probe shares its own).
    pub fn spec(&self) -> EnvSpec {
        EnvSpec {
            kind: self.kind.env_kind(),
            limits: Limits {
                timeout: std::time::Duration::from_secs_f64(self.timeout_s.clamp(0.001, 86_400.0)),
                retries: self.retries,
            },
            success_reward: self.success_reward,
            step_deadline: Some(std::time::Duration::from_secs_f64(
                self.step_deadline_s.clamp(0.001, 1e9),
            )),
            guard: Default::default(),
            conns: Default::default(),
        }
    }

    /// A built-in env (no server, no process).
    pub fn is_builtin(&self) -> bool {
        matches!(self.kind, EnvKindSection::Builtin(_))
    }
}

/// The `env` map as the file writes it: every kind's keys, optional.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FlatEnvSection {
    /// "household", "shop", "searchqa" (built-in), "http" (AgentGym env
    /// server at `url`) or "subprocess" (`command` speaking
    /// envs/PROTOCOL.md).
    #[serde(default)]
    kind: EnvKindName,
    train: String,
    test: String,
    #[serde(default = "d_max_steps")]
    max_steps: usize,
    #[serde(default)]
    step_slack: Option<usize>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    id_field: IdField,
    #[serde(default)]
    expert_endpoint: bool,
    #[serde(default)]
    expert: Option<ExpertSource>,
    #[serde(default)]
    command: Vec<String>,
    #[serde(default = "d_timeout_s")]
    timeout_s: f64,
    #[serde(default = "d_retries")]
    retries: usize,
    #[serde(default = "d_concurrency")]
    concurrency: usize,
    #[serde(default = "d_step_deadline_s")]
    step_deadline_s: f64,
    #[serde(default = "d_success_reward")]
    success_reward: f64,
}

fn d_max_steps() -> usize {
    50
}
fn d_concurrency() -> usize {
    16
}
fn d_step_deadline_s() -> f64 {
    1800.0
}
fn d_timeout_s() -> f64 {
    30.0
}
fn d_retries() -> usize {
    2
}
fn d_success_reward() -> f64 {
    1.0
}

/// A key of the flat map that `kind` does not own is refused when it is
/// set; at its default (as `experiment.json` writes it) it is no setting.
fn foreign(
    kind: EnvKindName,
    key: &'static str,
    set: bool,
    owner: &str,
) -> Result<(), EnvKeyError> {
    if !set {
        return Ok(());
    }
    Err(EnvKeyError {
        key,
        msg: format!(
            "env.{key} belongs to env.kind \"{owner}\"; this env is \"{}\", which would ignore it",
            kind.name()
        ),
    })
}

impl FlatEnvSection {
    /// The keys of the chosen kind, every other kind's left unset.
    fn kind_section(&self) -> Result<EnvKindSection, EnvKeyError> {
        let kind = self.kind;
        if kind != EnvKindName::Http {
            foreign(kind, "url", self.url.is_some(), "http")?;
            foreign(kind, "id_field", self.id_field != IdField::Id, "http")?;
            foreign(kind, "expert_endpoint", self.expert_endpoint, "http")?;
        }
        if kind != EnvKindName::Subprocess {
            foreign(kind, "command", !self.command.is_empty(), "subprocess")?;
        }
        Ok(match kind {
            EnvKindName::Builtin(b) => {
                foreign(
                    kind,
                    "expert",
                    self.expert.is_some(),
                    "http\" or \"subprocess",
                )?;
                EnvKindSection::Builtin(b)
            }
            EnvKindName::Http => EnvKindSection::Http(self.http()?),
            EnvKindName::Subprocess => {
                if self.command.is_empty() {
                    return Err(EnvKeyError {
                        key: "kind",
                        msg:
                            "env.kind \"subprocess\" needs env.command = [\"program\", \"arg\", …]"
                                .into(),
                    });
                }
                EnvKindSection::Subprocess(SubprocessEnvSection {
                    command: self.command.clone(),
                    expert: self.expert.clone(),
                })
            }
        })
    }

    fn http(&self) -> Result<HttpEnvSection, EnvKeyError> {
        if let Some(x) = self
            .expert
            .as_ref()
            .filter(|x| self.expert_endpoint && **x != ExpertSource::Task)
        {
            return Err(EnvKeyError {
                key: "expert_endpoint",
                msg: format!(
                    "env.expert_endpoint means env.expert \"task\", but env.expert is \"{x}\": keep one"
                ),
            });
        }
        let needs = "env.kind \"http\" needs env.url = \"http://host:port\"";
        let url = match &self.url {
            None => {
                return Err(EnvKeyError {
                    key: "kind",
                    msg: needs.into(),
                })
            }
            Some(u) if !u.starts_with("http://") => {
                return Err(EnvKeyError {
                    key: "url",
                    msg: format!("{needs}, got {u:?}"),
                })
            }
            Some(u) => u.clone(),
        };
        Ok(HttpEnvSection {
            url,
            id_field: self.id_field,
            expert_endpoint: self.expert_endpoint,
            expert: self.expert.clone(),
        })
    }
}

impl TryFrom<FlatEnvSection> for EnvSection {
    type Error = EnvKeyError;

    fn try_from(f: FlatEnvSection) -> Result<Self, EnvKeyError> {
        Ok(EnvSection {
            kind: f.kind_section()?,
            train: f.train,
            test: f.test,
            max_steps: f.max_steps,
            step_slack: f.step_slack,
            timeout_s: f.timeout_s,
            retries: f.retries,
            concurrency: f.concurrency,
            step_deadline_s: f.step_deadline_s,
            success_reward: f.success_reward,
        })
    }
}

impl From<EnvSection> for FlatEnvSection {
    fn from(e: EnvSection) -> Self {
        let mut flat = FlatEnvSection {
            kind: e.kind.name(),
            train: e.train,
            test: e.test,
            max_steps: e.max_steps,
            step_slack: e.step_slack,
            url: None,
            id_field: IdField::Id,
            expert_endpoint: false,
            expert: None,
            command: Vec::new(),
            timeout_s: e.timeout_s,
            retries: e.retries,
            concurrency: e.concurrency,
            step_deadline_s: e.step_deadline_s,
            success_reward: e.success_reward,
        };
        match e.kind {
            EnvKindSection::Builtin(_) => {}
            EnvKindSection::Http(h) => {
                flat.url = Some(h.url);
                flat.id_field = h.id_field;
                flat.expert_endpoint = h.expert_endpoint;
                flat.expert = h.expert;
            }
            EnvKindSection::Subprocess(s) => {
                flat.command = s.command;
                flat.expert = s.expert;
            }
        }
        flat
    }
}

/// Why the `env` map `json` fails to become an [`EnvSection`] for its
/// kind, if it does; `None` when it is not a well-typed flat map (serde's
/// own error, with its path, says what is wrong then).
pub(super) fn kind_error(json: &serde_json::Value) -> Option<EnvKeyError> {
    let flat = FlatEnvSection::deserialize(json).ok()?;
    flat.kind_section().err()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::config::Experiment;

    /// An experiment whose env map holds `env` (its keys after the panels).
    fn source(env: &str) -> String {
        format!(
            "#{{\n    name: \"t\", steps: 1,\n    model: #{{ path: \"m\" }},\n    env: #{{ train: \"a\", test: \"b\", {env} }},\n    guidance: #{{ script: \"g.rhai\" }},\n}}\n"
        )
    }

    fn parse(env: &str) -> Result<EnvSection, String> {
        Experiment::from_source("x.rhai", &source(env))
            .map(|e| e.env)
            .map_err(|e| e.to_string())
    }

    /// The error `parse(env)` gives, which must point at `needle`'s
    /// line:col in the source.
    fn refused_at(env: &str, needle: &str) -> String {
        let src = source(env);
        let msg = parse(env).unwrap_err();
        let i = src.find(needle).unwrap();
        let line = src[..i].matches('\n').count() + 1;
        let col = i - src[..i].rfind('\n').map_or(0, |p| p + 1) + 1;
        let at = format!("x.rhai:{line}:{col}: ");
        msg.strip_prefix(&at)
            .unwrap_or_else(|| panic!("{env}: expected at {at}, got {msg}"))
            .to_string()
    }

    #[test]
    fn each_kind_reads_its_own_keys() {
        for (name, b) in [
            ("", BuiltinEnv::Household),
            ("kind: \"household\"", BuiltinEnv::Household),
            ("kind: \"shop\"", BuiltinEnv::Shop),
            ("kind: \"searchqa\"", BuiltinEnv::SearchQa),
        ] {
            let e = parse(name).unwrap();
            assert_eq!(e.kind, EnvKindSection::Builtin(b), "{name}");
            assert!(e.is_builtin());
            assert_eq!(e.spec().kind, EnvKind::Builtin(b));
        }
        let e = parse("kind: \"http\", url: \"http://h:1\", id_field: \"env_idx\"").unwrap();
        let http = HttpEnvSection {
            url: "http://h:1".into(),
            id_field: IdField::EnvIdx,
            expert_endpoint: false,
            expert: None,
        };
        assert_eq!(e.kind, EnvKindSection::Http(http));
        assert!(!e.is_builtin());
        assert_eq!(
            e.spec().kind,
            EnvKind::Http {
                url: "http://h:1".into(),
                id_field: "env_idx".into(),
                expert: ExpertSource::Panel,
            }
        );
        let e = parse("kind: \"http\", url: \"http://h:1\", expert_endpoint: true").unwrap();
        assert!(
            matches!(&e.spec().kind, EnvKind::Http { expert, .. } if *expert == ExpertSource::Task)
        );
        let e = parse("kind: \"subprocess\", command: [\"env\", \"--stdio\"]").unwrap();
        let sub = SubprocessEnvSection {
            command: vec!["env".into(), "--stdio".into()],
            expert: None,
        };
        assert_eq!(e.kind, EnvKindSection::Subprocess(sub));
        assert_eq!(
            e.spec().kind,
            EnvKind::Subprocess {
                command: vec!["env".into(), "--stdio".into()],
                expert: ExpertSource::Task,
            }
        );
        let e = parse("kind: \"subprocess\", command: [\"env\"], expert: \"instance\"").unwrap();
        assert!(
            matches!(&e.spec().kind, EnvKind::Subprocess { expert, .. } if *expert == ExpertSource::Instance)
        );
    }

    #[test]
    fn a_key_of_another_kind_is_refused_at_its_position() {
        for (env, key, msg) in [
            (
                "url: \"http://h:1\"",
                "url:",
                "env.url belongs to env.kind \"http\"; this env is \"household\", which would ignore it",
            ),
            (
                "kind: \"shop\", expert: \"task\"",
                "expert:",
                "env.expert belongs to env.kind \"http\" or \"subprocess\"; this env is \"shop\", which would ignore it",
            ),
            (
                "kind: \"subprocess\", command: [\"x\"], id_field: \"env_idx\"",
                "id_field:",
                "env.id_field belongs to env.kind \"http\"; this env is \"subprocess\", which would ignore it",
            ),
            (
                "kind: \"subprocess\", command: [\"x\"], expert_endpoint: true",
                "expert_endpoint:",
                "env.expert_endpoint belongs to env.kind \"http\"; this env is \"subprocess\", which would ignore it",
            ),
            (
                "kind: \"http\", url: \"http://h:1\", command: [\"x\"]",
                "command:",
                "env.command belongs to env.kind \"subprocess\"; this env is \"http\", which would ignore it",
            ),
            (
                "kind: \"http\", url: \"http://h:1\", expert_endpoint: true, expert: \"instance\"",
                "expert_endpoint:",
                "env.expert_endpoint means env.expert \"task\", but env.expert is \"instance\": keep one",
            ),
        ] {
            assert_eq!(refused_at(env, key), msg, "{env}");
        }
    }

    #[test]
    fn a_missing_required_key_is_refused_at_the_kind() {
        assert_eq!(
            refused_at("kind: \"http\"", "kind:"),
            "env.kind \"http\" needs env.url = \"http://host:port\""
        );
        assert_eq!(
            refused_at("kind: \"http\", url: \"h:1\"", "url:"),
            "env.kind \"http\" needs env.url = \"http://host:port\", got \"h:1\""
        );
        for env in ["kind: \"subprocess\"", "kind: \"subprocess\", command: []"] {
            assert_eq!(
                refused_at(env, "kind:"),
                "env.kind \"subprocess\" needs env.command = [\"program\", \"arg\", …]"
            );
        }
        // A wrong type keeps serde's positioned error.
        let msg = refused_at("kind: \"http\", url: 3", "url:");
        assert!(msg.starts_with("`env.url`: invalid type"), "{msg}");
    }

    /// `experiment.json` keeps the flat map with every key, whatever the
    /// kind, and reads back to the same section.
    #[test]
    fn the_written_section_is_the_flat_map() {
        let base = serde_json::json!({
            "kind": "household", "train": "a", "test": "b", "max_steps": 50,
            "step_slack": null, "url": null, "id_field": "id",
            "expert_endpoint": false, "expert": null, "command": [],
            "timeout_s": 30.0, "retries": 2, "concurrency": 16,
            "step_deadline_s": 1800.0, "success_reward": 1.0,
        });
        let with = |over: serde_json::Value| {
            let mut v = base.clone();
            for (k, x) in over.as_object().unwrap() {
                v[k] = x.clone();
            }
            v
        };
        for (env, want) in [
            ("max_steps: 6", with(serde_json::json!({ "max_steps": 6 }))),
            (
                "kind: \"shop\"",
                with(serde_json::json!({ "kind": "shop" })),
            ),
            (
                "kind: \"http\", url: \"http://h:1\", expert_endpoint: true",
                with(serde_json::json!({
                    "kind": "http", "url": "http://h:1", "expert_endpoint": true
                })),
            ),
            (
                "kind: \"http\", url: \"http://h:1\", id_field: \"env_idx\", expert: \"reset:a.b\"",
                with(serde_json::json!({
                    "kind": "http", "url": "http://h:1", "id_field": "env_idx",
                    "expert": "reset:a.b"
                })),
            ),
            (
                "kind: \"subprocess\", command: [\"x\", \"y\"], expert: \"panel\"",
                with(serde_json::json!({
                    "kind": "subprocess", "command": ["x", "y"], "expert": "panel"
                })),
            ),
        ] {
            let e = parse(env).unwrap();
            let json = serde_json::to_value(&e).unwrap();
            assert_eq!(json, want, "{env}");
            let back: EnvSection = serde_json::from_value(json).unwrap();
            assert_eq!(back, e, "{env}");
        }
        // The keys keep the file's order of the section's settings.
        let text = serde_json::to_string(&parse("").unwrap()).unwrap();
        let names = [
            "kind",
            "train",
            "test",
            "max_steps",
            "step_slack",
            "url",
            "id_field",
            "expert_endpoint",
            "expert",
            "command",
            "timeout_s",
            "retries",
            "concurrency",
            "step_deadline_s",
            "success_reward",
        ];
        let at: Vec<usize> = names
            .iter()
            .map(|k| text.find(&format!("\"{k}\":")).unwrap())
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");
    }
}
