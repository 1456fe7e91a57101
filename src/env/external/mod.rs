//! External environments: a real benchmark (ALFWorld, WebShop, …) running
//! elsewhere, reached over AgentGym's env-server HTTP API ([`http`]) or a
//! newline-delimited JSON protocol on a child process's stdin/stdout
//! ([`subprocess`], documented in `envs/PROTOCOL.md`); and servers that
//! expose any built-in env over either protocol ([`serve`]) — the
//! reference implementation, and what the protocol tests talk to.
//!
//! Every failure (timeout, dead server, malformed JSON, missing field, an
//! `{"error": …}` reply) becomes an [`EnvError`] naming the env and the
//! request: the runner fails that one episode with the reason and the run
//! goes on.

pub mod connections;
pub mod guard;
pub mod http;
pub mod serve;
pub mod subprocess;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::env::{EnvError, Observation};

pub use connections::Connections;
pub use guard::StepGuard;

/// Version of the subprocess protocol (`hello` handshake).
pub const PROTOCOL_VERSION: u64 = 1;

/// Limits of an external env connection.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// Wait at most this long for one reply.
    pub timeout: Duration,
    /// Extra attempts for requests that are safe to repeat (create, reset,
    /// expert); `step` is never repeated.
    pub retries: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: Duration::from_secs(30),
            retries: 2,
        }
    }
}

/// An external env that names expert actions: a task's, asked before any
/// reset, or those of the task it was last reset to.
pub trait Experts: crate::env::Env {
    fn task_expert(&mut self, task: &crate::env::Task) -> Result<Vec<String>, EnvError>;
    fn instance_expert(&mut self, src: &crate::env::ExpertSource) -> Result<Vec<String>, EnvError>;
}

impl Experts for http::HttpEnv {
    fn task_expert(&mut self, task: &crate::env::Task) -> Result<Vec<String>, EnvError> {
        self.expert(task)
    }
    fn instance_expert(&mut self, src: &crate::env::ExpertSource) -> Result<Vec<String>, EnvError> {
        http::HttpEnv::instance_expert(self, src)
    }
}

impl Experts for subprocess::SubprocessEnv {
    fn task_expert(&mut self, task: &crate::env::Task) -> Result<Vec<String>, EnvError> {
        self.expert(task)
    }
    fn instance_expert(&mut self, src: &crate::env::ExpertSource) -> Result<Vec<String>, EnvError> {
        subprocess::SubprocessEnv::instance_expert(self, src)
    }
}

/// A protocol error: which env, which request, what went wrong.
pub(crate) fn err(env: &str, request: &str, msg: impl std::fmt::Display) -> EnvError {
    EnvError::Other(format!("{env}: {request}: {msg}"))
}

/// Field `key` of a reply, or a "missing field" error.
pub(crate) fn field<'a>(
    env: &str,
    request: &str,
    v: &'a Value,
    key: &str,
) -> Result<&'a Value, EnvError> {
    v.get(key).ok_or_else(|| {
        err(
            env,
            request,
            format!("reply has no `{key}` field: {}", short(v)),
        )
    })
}

/// A reply's `error` field, if it has one.
pub(crate) fn check_error(env: &str, request: &str, v: &Value) -> Result<(), EnvError> {
    match v.get("error") {
        Some(Value::Null) | None => Ok(()),
        Some(e) => Err(err(
            env,
            request,
            format!(
                "env error: {}",
                e.as_str().map_or(e.to_string(), String::from)
            ),
        )),
    }
}

/// A list of strings (available actions), or empty when absent or null.
pub(crate) fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The value at a dotted `path` in `v`: each step takes the longest key
/// that matches (so ALFWorld's `info` key `extra.expert_plan` is found by
/// `info.extra.expert_plan` as well as a nested `extra` → `expert_plan`).
pub(crate) fn at_path<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    if let Some(x) = v.get(path) {
        return Some(x);
    }
    let m = v.as_object()?;
    // Split points from the longest key prefix to the shortest.
    path.match_indices('.')
        .map(|(i, _)| i)
        .rev()
        .find_map(|i| at_path(m.get(&path[..i])?, &path[i + 1..]))
}

/// The expert actions at `path` of a reset reply: a list of strings, or
/// an error naming what is there instead.
pub(crate) fn expert_at(env: &str, reply: &Value, path: &str) -> Result<Vec<String>, EnvError> {
    match at_path(reply, path) {
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            Ok(strings(Some(&Value::Array(a.clone()))))
        }
        Some(other) => Err(err(
            env,
            "reset",
            format!(
                "`{path}` of the reset reply is not a list of actions: {}",
                short(other)
            ),
        )),
        None => Err(err(
            env,
            "reset",
            format!("the reset reply has no `{path}`: {}", short(reply)),
        )),
    }
}

/// At most 200 characters of a value, for error messages.
pub(crate) fn short(v: &Value) -> String {
    short_text(&v.to_string())
}

/// At most 200 characters of a text, for error messages.
pub(crate) fn short_text(s: &str) -> String {
    match s.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// A step reply in either dialect: `observation` (ALFWorld adapter) or
/// `state` (WebShop adapter), `reward`, `done`, optional
/// `available_actions`, optional `success` and `valid`.
pub(crate) fn step_observation(
    env: &str,
    v: &Value,
    success_reward: f64,
) -> Result<Observation, EnvError> {
    check_error(env, "step", v)?;
    let text = match v.get("observation").or_else(|| v.get("state")) {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => {
            return Err(err(
                env,
                "step",
                format!(
                    "reply has no `observation` (or `state`) field: {}",
                    short(v)
                ),
            ))
        }
    };
    let reward = field(env, "step", v, "reward")?
        .as_f64()
        .ok_or_else(|| err(env, "step", "`reward` is not a number"))?;
    let done = field(env, "step", v, "done")?
        .as_bool()
        .ok_or_else(|| err(env, "step", "`done` is not a bool"))?;
    let success = v
        .get("success")
        .and_then(Value::as_bool)
        .unwrap_or(done && reward >= success_reward);
    Ok(Observation {
        text,
        admissible: strings(v.get("available_actions")),
        done,
        reward: reward as f32,
        success,
        valid: v.get("valid").and_then(Value::as_bool).unwrap_or(true),
        // Numeric fields of WebShop-style `info` objects.
        info: v
            .get("info")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, x)| x.as_f64().map(|f| (k.clone(), f)))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn dotted_paths_find_nested_keys_and_keys_holding_dots() {
        let nested = json!({"info": {"extra": {"expert_plan": ["go to a", "take b"]}}});
        let dotted = json!({"info": {"extra.expert_plan": ["go to a"]}, "x": 1});
        assert_eq!(
            expert_at("e", &nested, "info.extra.expert_plan").unwrap(),
            ["go to a", "take b"]
        );
        assert_eq!(
            expert_at("e", &dotted, "info.extra.expert_plan").unwrap(),
            ["go to a"]
        );
        let e = expert_at("e", &dotted, "info.plan")
            .unwrap_err()
            .to_string();
        assert!(e.contains("has no `info.plan`"), "{e}");
        let e = expert_at("e", &dotted, "x").unwrap_err().to_string();
        assert!(
            e.contains("`x` of the reset reply is not a list of actions: 1"),
            "{e}"
        );
    }
}
