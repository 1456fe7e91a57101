//! The valid range of every numeric setting of an experiment file, in one
//! table. A value outside its range means nothing (`max_steps: 0`, a
//! negative learning rate, `clusters: 0`) and is refused at its key's
//! line:col, after deserialization, so a setting left at its default and a
//! comparison entry's override are checked the same way.
//!
//! The test below walks every numeric key of a fully populated experiment:
//! a new numeric setting without a row here fails it.

use serde_json::Value;

use super::position::locate_key;
use super::ConfigError;

/// What a numeric setting may be.
#[derive(Debug, Clone, Copy)]
pub(super) enum Range {
    /// Any finite number (listed so the table is complete).
    Any,
    /// ≥ the bound.
    AtLeast(f64),
    /// > the bound.
    Above(f64),
    /// In [lo, hi].
    Closed(f64, f64),
    /// In [lo, hi).
    ClosedOpen(f64, f64),
    /// In (lo, hi].
    OpenClosed(f64, f64),
    /// 0 (off) or > the bound.
    OffOrAbove(f64),
}

impl Range {
    fn holds(self, x: f64) -> bool {
        x.is_finite()
            && match self {
                Range::Any => true,
                Range::AtLeast(lo) => x >= lo,
                Range::Above(lo) => x > lo,
                Range::Closed(lo, hi) => (lo..=hi).contains(&x),
                Range::ClosedOpen(lo, hi) => x >= lo && x < hi,
                Range::OpenClosed(lo, hi) => x > lo && x <= hi,
                Range::OffOrAbove(lo) => x == 0.0 || x > lo,
            }
    }

    fn describe(self) -> String {
        match self {
            Range::Any => "a finite number".into(),
            Range::AtLeast(lo) => format!("≥ {lo}"),
            Range::Above(lo) => format!("> {lo}"),
            Range::Closed(lo, hi) => format!("in [{lo}, {hi}]"),
            Range::ClosedOpen(lo, hi) => format!("in [{lo}, {hi})"),
            Range::OpenClosed(lo, hi) => format!("in ({lo}, {hi}]"),
            Range::OffOrAbove(lo) => format!("0 (off) or > {lo}"),
        }
    }
}

use Range::*;

/// Every numeric setting, by its key path, with its range.
pub(super) const RANGES: &[(&str, Range)] = &[
    ("seed", Any),
    ("steps", AtLeast(1.0)),
    ("model.lora.rank", AtLeast(1.0)),
    ("model.lora.alpha", Above(0.0)),
    ("model.lora.dropout", ClosedOpen(0.0, 1.0)),
    ("env.max_steps", AtLeast(1.0)),
    ("env.step_slack", Any),
    ("env.timeout_s", Above(0.0)),
    ("env.retries", Closed(0.0, 100.0)),
    ("env.concurrency", AtLeast(1.0)),
    ("env.step_deadline_s", Above(0.0)),
    ("env.success_reward", Any),
    ("guidance.clusters", AtLeast(1.0)),
    ("guidance.max_rounds", Any),
    ("guidance.call_budget_s", Above(0.0)),
    ("rollout.tasks_per_step", AtLeast(1.0)),
    ("rollout.group_size", AtLeast(1.0)),
    ("rollout.temperature", Above(0.0)),
    ("rollout.top_p", OpenClosed(0.0, 1.0)),
    ("rollout.history", Any),
    ("rollout.invalid_penalty", Any),
    ("rollout.max_action_tokens", AtLeast(1.0)),
    ("rollout.engine.timeout_s", Above(0.0)),
    ("rollout.engine.max_concurrency", AtLeast(1.0)),
    ("rollout.engine.retry_s", Above(0.0)),
    ("rollout.engine.tis_cap", AtLeast(1.0)),
    ("rollout.engine.launch.count", AtLeast(1.0)),
    ("rollout.engine.launch.threads", AtLeast(1.0)),
    ("rollout.async.max_staleness", AtLeast(0.0)),
    ("trainer.lr", Above(0.0)),
    ("trainer.weight_decay", AtLeast(0.0)),
    ("trainer.beta1", ClosedOpen(0.0, 1.0)),
    ("trainer.beta2", ClosedOpen(0.0, 1.0)),
    ("trainer.eps", Above(0.0)),
    ("trainer.warmup_steps", Any),
    ("trainer.min_lr_ratio", Closed(0.0, 1.0)),
    ("trainer.grad_clip", AtLeast(0.0)),
    ("trainer.gigpo_gamma", Closed(0.0, 1.0)),
    ("trainer.gigpo_step_weight", AtLeast(0.0)),
    ("trainer.clip_low", ClosedOpen(0.0, 1.0)),
    ("trainer.clip_high", AtLeast(0.0)),
    // The dual clip bounds a negative advantage's ratio at c: a c ≤ 1
    // would clip below the ordinary clip range.
    ("trainer.dual_clip", OffOrAbove(1.0)),
    ("trainer.kl_coef", AtLeast(0.0)),
    ("trainer.aux_nll_coef", AtLeast(0.0)),
    ("trainer.dual_weight", AtLeast(0.0)),
    ("trainer.luffy_gamma", Above(0.0)),
    // A negative coefficient (an entropy penalty) is a choice, not a slip.
    ("trainer.entropy_coef", Any),
    ("trainer.ppo_epochs", AtLeast(1.0)),
    ("trainer.minibatches", AtLeast(1.0)),
    ("trainer.micro_batch", AtLeast(1.0)),
    ("evaluation.every", Any),
    ("evaluation.samples", AtLeast(1.0)),
    ("evaluation.max_tasks", Any),
    ("checkpoint.every", Any),
    ("sft.max_expert_len", AtLeast(1.0)),
    ("sft.tasks_per_step", AtLeast(1.0)),
    ("sft.plan_share", Closed(0.0, 1.0)),
    ("sft.eval_tasks", Any),
];

/// The value at a dotted key path, if present and not null.
fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(v, |v, k| v.get(k))
        .filter(|v| !v.is_null())
}

/// Check every row of [`RANGES`] against the resolved experiment `exp`
/// (its JSON); the first value out of range is an error at its key in
/// `source`.
pub(super) fn check(file: &str, source: &str, exp: &Value) -> Result<(), ConfigError> {
    for &(path, range) in RANGES {
        let Some(x) = at(exp, path).and_then(Value::as_f64) else {
            continue;
        };
        if range.holds(x) {
            continue;
        }
        let msg = format!("{path} must be {}, got {x}", range.describe());
        let keys: Vec<String> = path.split('.').map(str::to_string).collect();
        return Err(match locate_key(source, &keys) {
            (0, 0) => ConfigError::Invalid {
                file: file.into(),
                msg,
            },
            (line, col) => ConfigError::Field {
                file: file.into(),
                line,
                col,
                msg,
            },
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experiment::config::Experiment;

    /// An experiment with every optional section present, so every
    /// numeric setting appears in its JSON.
    const FULL: &str = r#"#{
    name: "t", seed: 1, steps: 3,
    model: #{ path: "m", lora: #{ rank: 4 } },
    env: #{ train: "a.jsonl", test: "b.jsonl", step_slack: 2 },
    guidance: #{ script: "g.rhai" },
    rollout: #{ format: "chat", engine: #{ kind: "openai", api: "llama.cpp",
        launch: #{ program: "llama-server" } }, "async": #{ max_staleness: 1 } },
    trainer: #{ lr: 0.001 },
    evaluation: #{ every: 5 },
    sft: #{ max_expert_len: 4 },
}"#;

    fn numeric_paths(v: &Value, prefix: &str, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    numeric_paths(x, &p, out);
                }
            }
            Value::Number(_) => out.push(prefix.to_string()),
            _ => {}
        }
    }

    #[test]
    fn every_numeric_setting_has_a_range() {
        let e = Experiment::from_source("x.rhai", FULL).unwrap();
        let mut paths = Vec::new();
        numeric_paths(&serde_json::to_value(&e).unwrap(), "", &mut paths);
        let listed: Vec<&str> = RANGES.iter().map(|r| r.0).collect();
        let missing: Vec<&String> = paths
            .iter()
            .filter(|p| !listed.contains(&p.as_str()))
            .collect();
        assert!(
            missing.is_empty(),
            "numeric settings without a range: {missing:?}"
        );
        let stale: Vec<&&str> = listed
            .iter()
            .filter(|p| !paths.iter().any(|q| q == *p))
            .collect();
        assert!(stale.is_empty(), "ranges of no setting: {stale:?}");
    }

    /// A value just outside each range, and one inside it.
    fn outside(r: Range) -> Option<(f64, f64)> {
        match r {
            Any => None,
            AtLeast(lo) => Some((lo - 1.0, lo)),
            Above(lo) => Some((lo, lo + 0.5)),
            Closed(lo, hi) => Some((hi + 0.5, lo)),
            ClosedOpen(lo, hi) => Some((hi, lo)),
            OpenClosed(lo, hi) => Some((lo, hi)),
            OffOrAbove(lo) => Some((lo, 0.0)),
        }
    }

    /// The full experiment as a Rhai map with `path` set to `x` (an
    /// integer where the setting is one).
    fn source_with(full: &Value, path: &str, x: f64) -> (String, String) {
        let mut v = full.clone();
        let keys: Vec<&str> = path.split('.').collect();
        let (last, parents) = keys.split_last().unwrap();
        let slot = parents
            .iter()
            .fold(&mut v, |v, k| v.get_mut(*k).unwrap())
            .get_mut(*last)
            .unwrap();
        *slot = if slot.is_u64() {
            let x = if x.fract() == 0.0 { x } else { x.ceil() };
            Value::from(x as i64)
        } else {
            Value::from(x)
        };
        let needle = format!("\"{last}\": {slot}");
        let src = serde_json::to_string_pretty(&v)
            .unwrap()
            .replace('{', "#{")
            .replace("null", "()");
        (src, needle)
    }

    /// Each setting, set just outside its range, is refused at its key
    /// with the range named; just inside, it is accepted.
    #[test]
    fn every_range_is_enforced_at_its_key() {
        let e = Experiment::from_source("x.rhai", FULL).unwrap();
        let full = serde_json::to_value(&e).unwrap();
        for &(path, range) in RANGES {
            let Some((bad, good)) = outside(range) else {
                continue;
            };
            let (src, needle) = source_with(&full, path, bad);
            let msg = match Experiment::from_source("x.rhai", &src) {
                Ok(_) => panic!("{path} = {bad} was accepted"),
                Err(e) => e.to_string(),
            };
            let i = src
                .find(&needle)
                .unwrap_or_else(|| panic!("{needle} in {src}"));
            let line = src[..i].matches('\n').count() + 1;
            assert!(msg.starts_with(&format!("x.rhai:{line}:")), "{path}: {msg}");
            assert!(msg.contains(path), "{path}: {msg}");
            // Inside the range this key is not the complaint (another
            // check may still object: engines want temperature 1).
            let (src, _) = source_with(&full, path, good);
            if let Err(e) = Experiment::from_source("x.rhai", &src) {
                let e = e.to_string();
                let range_error = format!("{path} must be {}", range.describe());
                assert!(!e.contains(&range_error), "{path} = {good}: {e}");
            }
        }
    }
}
