//! Checkpoints of a host: the scripts' states (as JSON) and the per-task
//! history, and the guidance state flattened into metrics.

use std::collections::BTreeMap;

use rhai::Dynamic;
use serde::{Deserialize, Serialize};

use super::{GuidanceHost, Role};
use crate::guidance::views::TaskHistory;

/// Checkpointed host state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HostSnapshot {
    pub state: serde_json::Value,
    pub history: BTreeMap<String, TaskHistory>,
    /// States of the reward and intervention scripts, by role name.
    #[serde(default)]
    pub states: BTreeMap<String, serde_json::Value>,
}

/// A saved state that does not convert back into a script value.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct RestoreError(#[from] Box<rhai::EvalAltResult>);

impl GuidanceHost {
    /// Guidance script state as JSON (checkpoints, metrics).
    pub fn state_json(&self) -> serde_json::Value {
        state_json(&self.guidance.state)
    }

    /// Numeric entries of the guidance script's state, flattened with dots
    /// (`state.clusters.0.mu` → `clusters.0.mu`) for metrics.
    pub fn state_numbers(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        flatten_numbers("", &self.state_json(), &mut out);
        out
    }

    /// Everything a checkpoint needs to restore this host.
    pub fn snapshot(&self) -> HostSnapshot {
        HostSnapshot {
            state: self.state_json(),
            history: self.history.clone(),
            states: self
                .roles()
                .into_iter()
                .filter(|r| *r != Role::Guidance)
                .map(|r| {
                    (
                        r.name().to_string(),
                        state_json(&self.slot(r).expect("role present").state),
                    )
                })
                .collect(),
        }
    }

    /// Put a checkpoint's states and history back (the scripts themselves
    /// are loaded separately).
    pub fn restore(&mut self, snap: &HostSnapshot) -> Result<(), RestoreError> {
        let to = |v: &serde_json::Value| -> Result<Dynamic, RestoreError> {
            let d: Dynamic = rhai::serde::to_dynamic(v)?;
            Ok(d.into_shared())
        };
        self.guidance.state = to(&snap.state)?;
        for role in [Role::Reward, Role::Intervene] {
            if let (Some(v), Some(slot)) = (snap.states.get(role.name()), self.slot_mut(role)) {
                slot.state = to(v)?;
            }
        }
        self.history = snap.history.clone();
        Ok(())
    }
}

fn state_json(state: &Dynamic) -> serde_json::Value {
    serde_json::to_value(state.flatten_clone()).unwrap_or(serde_json::Value::Null)
}

fn flatten_numbers(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, f64>) {
    match v {
        serde_json::Value::Number(n) => {
            if let Some(f) = n.as_f64() {
                out.insert(prefix.to_string(), f);
            }
        }
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten_numbers(&key, v, out);
            }
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                flatten_numbers(&format!("{prefix}.{i}"), v, out);
            }
        }
        _ => {}
    }
}
