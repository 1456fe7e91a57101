//! Reading an experiment file: evaluate the Rhai source to a map, expand a
//! comparison's entries, deserialize each into an [`Experiment`] and point
//! any error at its key's line:col.

use std::path::Path;

use super::position::{locate_key, map_start};
use super::{ConfigError, Experiment};
use crate::script::ScriptError;

/// An experiment file's name (as errors show it) and source.
fn read_source(path: &Path) -> Result<(String, String), ConfigError> {
    let file = path.display().to_string();
    let source = std::fs::read_to_string(path).map_err(|e| ConfigError::Invalid {
        file: file.clone(),
        msg: format!("cannot read experiment file: {e}"),
    })?;
    Ok((file, source))
}

/// Evaluate an experiment file's source to its JSON map.
fn source_to_json(file: &str, source: &str) -> Result<serde_json::Value, ConfigError> {
    let engine = crate::script::engine(&crate::guidance::script_handles());
    let value: rhai::Dynamic = engine
        .eval::<rhai::Dynamic>(source)
        .map_err(|e| ScriptError::from_eval(file, &e))?;
    if !value.is_map() {
        return Err(ConfigError::Invalid {
            file: file.into(),
            msg: format!(
                "an experiment file must evaluate to a map #{{ ... }}, got {}",
                value.type_name()
            ),
        });
    }
    // JSON has no inf/NaN (serde would turn them into null and the error
    // would read "invalid type: null"): name the key instead.
    if let Some((keys, f)) = non_finite(&value, &mut Vec::new()) {
        let (line, col) = locate_key(source, &keys);
        return Err(ConfigError::Field {
            file: file.into(),
            line,
            col,
            msg: format!(
                "`{}` is {f}: a setting must be a finite number",
                keys.join(".")
            ),
        });
    }
    serde_json::to_value(&value).map_err(|e| ConfigError::Invalid {
        file: file.into(),
        msg: e.to_string(),
    })
}

/// The key path of the first inf/NaN float in `v`, with its value.
fn non_finite(v: &rhai::Dynamic, path: &mut Vec<String>) -> Option<(Vec<String>, f64)> {
    if let Ok(f) = v.as_float() {
        return (!f.is_finite()).then(|| (path.clone(), f));
    }
    if let Some(m) = v.read_lock::<rhai::Map>() {
        for (k, x) in m.iter() {
            path.push(k.to_string());
            let found = non_finite(x, path);
            path.pop();
            if found.is_some() {
                return found;
            }
        }
    } else if let Some(a) = v.read_lock::<rhai::Array>() {
        for (i, x) in a.iter().enumerate() {
            path.push(i.to_string());
            let found = non_finite(x, path);
            path.pop();
            if found.is_some() {
                return found;
            }
        }
    }
    None
}

/// What an experiment file describes: one run, or a comparison of several
/// runs that share everything but the keys each one overrides.
#[derive(Debug, Clone, PartialEq)]
pub enum ExperimentFile {
    Single(Box<Experiment>),
    Compare(Comparison),
}

/// A comparison: `compare: [#{ name: "...", <overrides> }, …]` in an
/// experiment map. Each entry is deep-merged into the rest of the map;
/// the runs go to `<runs_dir>/<name>/<entry name>`.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    pub name: String,
    pub runs_dir: String,
    pub runs: Vec<Experiment>,
    /// Per run: the earlier entry whose trained model it starts from
    /// (`model.path: "@<entry>"`, e.g. GRPO after a behaviour-cloning
    /// arm), which must have finished first.
    pub after: Vec<Option<usize>>,
}

/// The prefix of a `model.path` that names another entry of the same
/// comparison: `"@bc"` starts from the model entry `bc` (or, in a seed
/// replica, `bc-s<seed>`) writes.
pub const ENTRY_MODEL: char = '@';

/// Resolve every run's `model.path: "@<entry>"` to the index of an earlier
/// SFT entry (the kind that writes `model/`); the error names the run.
fn entry_models(runs: &[Experiment]) -> Result<Vec<Option<usize>>, String> {
    let mut after = Vec::new();
    for (i, exp) in runs.iter().enumerate() {
        let Some(target) = exp.model.path.strip_prefix(ENTRY_MODEL) else {
            after.push(None);
            continue;
        };
        let replica = format!("{target}-s{}", exp.seed);
        let j = runs[..i]
            .iter()
            .position(|r| r.name == replica)
            .or_else(|| runs[..i].iter().position(|r| r.name == target))
            .ok_or_else(|| {
                format!(
                    "compare entry \"{}\": model.path \"{}\" names no earlier entry \"{target}\" (or \"{replica}\")",
                    exp.name, exp.model.path
                )
            })?;
        if runs[j].sft.is_none() {
            return Err(format!(
                "compare entry \"{}\": model.path \"{}\": entry \"{}\" writes no model (only an entry with an `sft` section does)",
                exp.name, exp.model.path, runs[j].name
            ));
        }
        after.push(Some(j));
    }
    Ok(after)
}

/// Merge `over` into `base`: maps key by key, anything else replaced.
fn deep_merge(base: &mut serde_json::Value, over: &serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(slot) => deep_merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// Expand `seeds: [7, 11, 13]` in a compare entry into one entry per
/// seed, named `<name>-s<seed>`: seed replicas of one configuration, which
/// the report aggregates (mean and range). Errors carry the entry's index.
fn expand_seeds(entries: &[serde_json::Value]) -> Result<Vec<serde_json::Value>, (usize, String)> {
    let mut out = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        let Some(seeds) = entry.get("seeds") else {
            out.push(entry.clone());
            continue;
        };
        let bad = || {
            (
                i,
                "`seeds` must be a non-empty array of integers ≥ 0".to_string(),
            )
        };
        let seeds: Vec<u64> = seeds
            .as_array()
            .filter(|a| !a.is_empty())
            .ok_or_else(bad)?
            .iter()
            .map(|s| s.as_u64().ok_or_else(bad))
            .collect::<Result<_, _>>()?;
        if entry.get("seed").is_some() {
            return Err((i, "give `seed` or `seeds`, not both".into()));
        }
        let name = entry.get("name").and_then(|n| n.as_str()).unwrap_or("");
        for s in seeds {
            let mut e = entry.clone();
            let m = e.as_object_mut().ok_or_else(bad)?;
            m.remove("seeds");
            m.insert("seed".into(), serde_json::json!(s));
            m.insert("name".into(), serde_json::json!(format!("{name}-s{s}")));
            out.push(e);
        }
    }
    Ok(out)
}

impl ExperimentFile {
    /// Evaluate an experiment file: one experiment, or a comparison.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let (file, source) = read_source(path)?;
        Self::from_source(&file, &source)
    }

    pub fn from_source(file: &str, source: &str) -> Result<Self, ConfigError> {
        let mut json = source_to_json(file, source)?;
        let Some(list) = json.as_object_mut().and_then(|m| m.remove("compare")) else {
            return Experiment::from_json(file, source, json)
                .map(|e| ExperimentFile::Single(Box::new(e)));
        };
        let (line, col) = locate_key(source, &["compare".to_string()]);
        let at = |msg: String| ConfigError::Field {
            file: file.into(),
            line,
            col,
            msg,
        };
        let entries = list.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
            at("`compare` must be a non-empty array of maps #{ name: \"...\", … }".into())
        })?;
        let name = json["name"].as_str().unwrap_or("compare").to_string();
        let runs_dir = json["runs_dir"].as_str().unwrap_or("runs").to_string();
        let mut runs = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        let entries =
            expand_seeds(entries).map_err(|(i, msg)| at(format!("`compare[{i}]`: {msg}")))?;
        for (i, entry) in entries.iter().enumerate() {
            let rname = entry
                .get("name")
                .and_then(|n| n.as_str())
                .filter(|n| {
                    !n.is_empty()
                        && n.chars()
                            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
                })
                .ok_or_else(|| {
                    at(format!(
                        "`compare[{i}]` needs a `name` of letters, digits, `_`, `-` or `.`"
                    ))
                })?
                .to_string();
            if !seen.insert(rname.clone()) {
                return Err(at(format!(
                    "`compare[{i}]`: the name \"{rname}\" is used twice"
                )));
            }
            let mut merged = json.clone();
            deep_merge(&mut merged, entry);
            merged["name"] = serde_json::json!(rname);
            let exp = Experiment::from_json(file, source, merged).map_err(|e| match e {
                ConfigError::Field {
                    file,
                    line,
                    col,
                    msg,
                } => ConfigError::Field {
                    file,
                    line,
                    col,
                    msg: format!("in compare entry \"{rname}\": {msg}"),
                },
                ConfigError::Invalid { file, msg } => ConfigError::Invalid {
                    file,
                    msg: format!("in compare entry \"{rname}\": {msg}"),
                },
                other => other,
            })?;
            runs.push(exp);
        }
        let after = entry_models(&runs).map_err(at)?;
        Ok(ExperimentFile::Compare(Comparison {
            name,
            runs_dir,
            runs,
            after,
        }))
    }
}

impl Experiment {
    /// Evaluate an experiment file. Relative paths inside it stay relative
    /// to the working directory (experiments are run from the repo root).
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let (file, source) = read_source(path)?;
        Self::from_source(&file, &source)
    }

    pub fn from_source(file: &str, source: &str) -> Result<Self, ConfigError> {
        let json = source_to_json(file, source)?;
        if json.get("compare").is_some() {
            return Err(ConfigError::Invalid {
                file: file.into(),
                msg: "this file is a comparison (it has `compare`): run it with `actguide run`"
                    .into(),
            });
        }
        Self::from_json(file, source, json)
    }

    /// Deserialize and validate an experiment map; errors point at the key
    /// in `source`.
    fn from_json(file: &str, source: &str, json: serde_json::Value) -> Result<Self, ConfigError> {
        let exp: Experiment = serde_path_to_error::deserialize(&json).map_err(|e| {
            // The env section's kind refused one of its keys: point at
            // that key, not at `env`.
            let kind_error = (e.path().to_string() == "env")
                .then(|| json.get("env").and_then(super::env::kind_error))
                .flatten();
            match kind_error {
                Some(k) => env_key_error(file, source, k),
                None => field_error(file, source, e),
            }
        })?;
        let resolved = serde_json::to_value(&exp).map_err(|e| ConfigError::Invalid {
            file: file.into(),
            msg: e.to_string(),
        })?;
        super::ranges::check(file, source, &resolved)?;
        exp.validate(file)?;
        Ok(exp)
    }
}

/// An env key its kind refused, at the key's line:col (a missing key's
/// complaint is at `env.kind`; without it in the source, at `env`).
fn env_key_error(file: &str, source: &str, e: super::env::EnvKeyError) -> ConfigError {
    let at = |keys: &[&str]| {
        locate_key(
            source,
            &keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
        )
    };
    match [at(&["env", e.key]), at(&["env"])]
        .into_iter()
        .find(|&p| p != (0, 0))
    {
        Some((line, col)) => ConfigError::Field {
            file: file.into(),
            line,
            col,
            msg: e.msg,
        },
        None => ConfigError::Invalid {
            file: file.into(),
            msg: e.msg,
        },
    }
}

/// A deserialization error as a positioned [`ConfigError::Field`]. Typed
/// settings whose own message says "must …" (see
/// [`crate::model::device::UnknownDevice`]) read as "<key> must …", the
/// wording of the checks after deserialization; other errors keep serde's
/// wording after the key.
fn field_error(
    file: &str,
    source: &str,
    e: serde_path_to_error::Error<serde_json::Error>,
) -> ConfigError {
    let path = e.path().to_string();
    let inner = e.into_inner().to_string();
    // For unknown fields serde names the field in the message; point
    // at it rather than at its parent.
    let mut keys: Vec<String> = if path == "." {
        vec![]
    } else {
        path.split('.').map(str::to_string).collect()
    };
    if let Some(unknown) = inner
        .strip_prefix("unknown field `")
        .and_then(|s| s.split('`').next())
    {
        // serde_path_to_error usually names it already.
        if keys.last().map(String::as_str) != Some(unknown) {
            keys.push(unknown.to_string());
        }
    }
    let (line, col) = match locate_key(source, &keys) {
        // A key missing from the top-level map: point at the map.
        (0, 0) => map_start(source),
        at => at,
    };
    let shown = if keys.is_empty() {
        "experiment".to_string()
    } else {
        keys.join(".")
    };
    let msg = if inner.starts_with("must ") {
        format!("{shown} {inner}")
    } else {
        format!("`{shown}`: {inner}")
    };
    ConfigError::Field {
        file: file.into(),
        line,
        col,
        msg,
    }
}
