//! JSON-lines logs of typed records: append one, read them back, drop the
//! ones after a step.
//!
//! A record is written through a `serde_json::Value`, whose maps keep keys
//! sorted: every line lists its keys in alphabetical order (nested objects
//! too) whatever the declaration order of the record's fields, as the logs
//! always have.

use std::io::Write;
use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::RunDirError;

/// One line of a run directory's JSONL log.
pub trait Record: Serialize + DeserializeOwned {
    /// The log's file name in the run directory.
    const FILE: &'static str;
}

/// Append `record` as one line of `path`; returns the JSON written.
pub fn append<R: Serialize>(path: &Path, record: &R) -> Result<Value, RunDirError> {
    let v = serde_json::to_value(record).map_err(|source| RunDirError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(RunDirError::io(path))?;
    writeln!(f, "{v}").map_err(RunDirError::io(path))?;
    Ok(v)
}

/// Parse a JSON-lines file into records. `Ok(None)` when the file does not
/// exist. A last line without its newline that does not parse is a write in
/// progress (a live run) and is skipped with a warning rather than failing
/// the whole read; any other bad line is an error naming file and line.
pub fn read<R: DeserializeOwned>(
    path: &Path,
    warnings: &mut Vec<String>,
) -> Result<Option<Vec<R>>, RunDirError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(RunDirError::io(path)(e)),
    };
    let complete = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(v) if v.is_object() => out.push(record(path, i + 1, v)?),
            Ok(_) => {
                return Err(RunDirError::NotObject {
                    path: path.to_path_buf(),
                    line: i + 1,
                })
            }
            Err(_) if !complete && i + 1 == lines.len() => warnings.push(format!(
                "{}:{}: skipped a partly written last line",
                path.display(),
                i + 1
            )),
            Err(source) => {
                return Err(RunDirError::BadLine {
                    path: path.to_path_buf(),
                    line: i + 1,
                    source,
                })
            }
        }
    }
    Ok(Some(out))
}

/// Every record of `path` (none when it does not exist); any bad line is
/// an error.
pub fn read_all<R: DeserializeOwned>(path: &Path) -> Result<Vec<R>, RunDirError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|source| RunDirError::BadLine {
            path: path.to_path_buf(),
            line: i + 1,
            source,
        })?;
        out.push(record(path, i + 1, v)?);
    }
    Ok(out)
}

fn record<R: DeserializeOwned>(path: &Path, line: usize, v: Value) -> Result<R, RunDirError> {
    serde_json::from_value(v).map_err(|source| RunDirError::BadRecord {
        path: path.to_path_buf(),
        line,
        source,
    })
}

/// The one key every record has, and the mark of an evaluation's line.
#[derive(Deserialize)]
struct Stepped {
    step: Option<u64>,
    /// Set on lines an evaluation wrote (the evaluation after `step`
    /// steps, which precedes that step's checkpoint).
    #[serde(default)]
    eval: Option<Value>,
}

/// Drop lines whose `step` is ≥ `step` (they follow the checkpoint we
/// resume from and will be written again), except an evaluation's lines
/// at `step` itself (the checkpoint came after that evaluation). Lines that do not parse as a
/// record with a step (damaged bytes, a line a kill cut short) are never
/// dropped silently: they move to `<file>.damaged` and each gets a warning.
pub fn truncate_after(
    path: &Path,
    step: usize,
    warnings: &mut Vec<String>,
) -> Result<(), RunDirError> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let mut kept = String::new();
    let mut damaged = String::new();
    for (i, l) in text.lines().enumerate() {
        let parsed = serde_json::from_str::<Value>(l)
            .ok()
            .filter(Value::is_object)
            .and_then(|v| serde_json::from_value::<Stepped>(v).ok())
            .and_then(|r| Some((r.step?, r.eval.is_some())));
        match parsed {
            Some((s, eval)) if (s as usize) < step || (eval && s as usize == step) => {
                kept.push_str(l);
                kept.push('\n');
            }
            Some(_) => {}
            None if l.trim().is_empty() => {}
            None => {
                damaged.push_str(l);
                damaged.push('\n');
                warnings.push(format!(
                    "{}:{}: a damaged line (not a record with a step) moved to {}.damaged",
                    path.display(),
                    i + 1,
                    path.display()
                ));
            }
        }
    }
    if !damaged.is_empty() {
        let side = path.with_extension("jsonl.damaged");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&side)
            .map_err(RunDirError::io(&side))?;
        f.write_all(damaged.as_bytes())
            .map_err(RunDirError::io(&side))?;
    }
    super::write_atomic(path, kept.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_earlier_steps_and_sets_damaged_lines_aside() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("metrics.jsonl");
        std::fs::write(
            &path,
            "{\"step\":0}\n{\"st\u{ff}\u{ff}\n{\"step\":1}\n[1]\n\n{\"step\":2}\n{\"step\":3,\"x\"",
        )
        .unwrap();
        let mut warnings = Vec::new();
        truncate_after(&path, 2, &mut warnings).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"step\":0}\n{\"step\":1}\n"
        );
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("metrics.jsonl.damaged")).unwrap(),
            "{\"st\u{ff}\u{ff}\n[1]\n{\"step\":3,\"x\"\n"
        );
        assert_eq!(warnings.len(), 3, "{warnings:?}");
        assert!(
            warnings[0].contains("metrics.jsonl:2: a damaged line"),
            "{warnings:?}"
        );
        assert!(warnings[2].contains("metrics.jsonl:7:"), "{warnings:?}");
    }
}
