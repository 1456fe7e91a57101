//! Checkpoints of a runtime: the scripts' states (as JSON) and the per-task
//! history, and the guidance state flattened into metrics.

use std::collections::BTreeMap;

use rhai::Dynamic;
use serde::{Deserialize, Serialize};

use super::{GuidanceRuntime, Role};
use crate::guidance::script_inputs::TaskHistory;

/// Checkpointed runtime state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RuntimeSnapshot {
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

impl GuidanceRuntime {
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

    /// Everything a checkpoint needs to restore this runtime. States are
    /// written with [`encode`], so inf/NaN and function pointers come back
    /// as they were.
    pub fn snapshot(&self) -> RuntimeSnapshot {
        RuntimeSnapshot {
            state: encode(&self.guidance.state.flatten_clone()),
            history: self.history.clone(),
            states: self
                .roles()
                .into_iter()
                .filter(|r| *r != Role::Guidance)
                .map(|r| {
                    (
                        r.name().to_string(),
                        encode(&self.slot(r).expect("role present").state.flatten_clone()),
                    )
                })
                .collect(),
        }
    }

    /// Put a checkpoint's states and history back (the scripts themselves
    /// are loaded separately).
    pub fn restore(&mut self, snap: &RuntimeSnapshot) -> Result<(), RestoreError> {
        let to = |v: &serde_json::Value| -> Result<Dynamic, RestoreError> {
            Ok(decode(v)?.into_shared())
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

/// Tags for the script values plain JSON cannot hold.
const FLOAT_TAG: &str = "$f64";
const FN_TAG: &str = "$fn";

/// A script value as JSON for a checkpoint: like serde's form, except that
/// inf / -inf / NaN become `{"$f64": "inf" | "-inf" | "nan"}` (JSON has no
/// such numbers; serde would write `null`) and a function pointer becomes
/// `{"$fn": name}` (serde would write its name as a string).
pub fn encode(v: &Dynamic) -> serde_json::Value {
    use serde_json::{json, Value};
    if let Some(f) = v.clone().try_cast::<rhai::FLOAT>() {
        return match f {
            f if f.is_finite() => json!(f),
            f if f.is_nan() => json!({ FLOAT_TAG: "nan" }),
            f if f > 0.0 => json!({ FLOAT_TAG: "inf" }),
            _ => json!({ FLOAT_TAG: "-inf" }),
        };
    }
    if let Some(p) = v.clone().try_cast::<rhai::FnPtr>() {
        return json!({ FN_TAG: p.fn_name() });
    }
    if let Some(a) = v.clone().try_cast::<rhai::Array>() {
        return Value::Array(a.iter().map(encode).collect());
    }
    if let Some(m) = v.clone().try_cast::<rhai::Map>() {
        return Value::Object(m.iter().map(|(k, v)| (k.to_string(), encode(v))).collect());
    }
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The inverse of [`encode`].
pub fn decode(v: &serde_json::Value) -> Result<Dynamic, Box<rhai::EvalAltResult>> {
    use serde_json::Value;
    match v {
        Value::Object(m) if m.len() == 1 => {
            if let Some(Value::String(s)) = m.get(FLOAT_TAG) {
                let f: rhai::FLOAT = match s.as_str() {
                    "inf" => rhai::FLOAT::INFINITY,
                    "-inf" => rhai::FLOAT::NEG_INFINITY,
                    _ => rhai::FLOAT::NAN,
                };
                return Ok(Dynamic::from_float(f));
            }
            if let Some(Value::String(name)) = m.get(FN_TAG) {
                return Ok(Dynamic::from(rhai::FnPtr::new(name.as_str())?));
            }
            decode_map(m)
        }
        Value::Object(m) => decode_map(m),
        Value::Array(a) => Ok(Dynamic::from_array(
            a.iter().map(decode).collect::<Result<_, _>>()?,
        )),
        other => rhai::serde::to_dynamic(other),
    }
}

fn decode_map(
    m: &serde_json::Map<String, serde_json::Value>,
) -> Result<Dynamic, Box<rhai::EvalAltResult>> {
    let mut out = rhai::Map::new();
    for (k, v) in m {
        out.insert(k.as_str().into(), decode(v)?);
    }
    Ok(Dynamic::from_map(out))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_numbers_and_function_pointers_round_trip() {
        let engine = rhai::Engine::new();
        let v: Dynamic = engine
            .eval(
                r#"#{ up: 1.0 / 0.0, down: -1.0 / 0.0, nan: 0.0 / 0.0, x: 2.5, n: 3,
                     s: "a", b: true, list: [1, 0.0 / 0.0, #{ f: Fn("pick") }], u: () }"#,
            )
            .unwrap();
        let json = encode(&v);
        assert_eq!(json["up"], serde_json::json!({ "$f64": "inf" }));
        assert_eq!(json["list"][2]["f"], serde_json::json!({ "$fn": "pick" }));
        // Through the checkpoint's text form and back.
        let text = serde_json::to_string(&json).unwrap();
        let back = decode(&serde_json::from_str(&text).unwrap()).unwrap();
        let m = back.cast::<rhai::Map>();
        assert_eq!(m["up"].as_float().unwrap(), f64::INFINITY);
        assert_eq!(m["down"].as_float().unwrap(), f64::NEG_INFINITY);
        assert!(m["nan"].as_float().unwrap().is_nan());
        assert_eq!(m["x"].as_float().unwrap(), 2.5);
        assert_eq!(m["n"].as_int().unwrap(), 3);
        assert_eq!(m["s"].clone().into_string().unwrap(), "a");
        assert!(m["b"].as_bool().unwrap());
        assert!(m["u"].is_unit());
        let list = m["list"].clone().cast::<rhai::Array>();
        assert!(list[1].as_float().unwrap().is_nan());
        let f = list[2].clone().cast::<rhai::Map>()["f"].clone();
        assert_eq!(f.cast::<rhai::FnPtr>().fn_name(), "pick");
        // Encoding the decoded value gives the same JSON: exact resume.
        assert_eq!(encode(&Dynamic::from_map(m)), json);
    }
}
