//! Decoding what scripts return: the specs of `plan`, the request of
//! `review`, the number of `reward` and the decision of `intervene`. A
//! value of the wrong shape becomes a [`ScriptError`] naming the expected
//! shape, positioned at the entry point's definition ([`at_fn`]).

use rhai::{Array, Dynamic, Map};
use serde::{Deserialize, Serialize};

use crate::guidance::spec::GuidanceSpec;
use crate::script::{Script, ScriptError};

/// What `review(task, group, state)` asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum Review {
    /// Train on the group as it is.
    Accept,
    /// Run another round for this task.
    Round(RoundRequest),
    /// Make the rollouts of round `i` (0 = the first) the training group.
    Select(usize),
}

/// How a further round's rollouts are used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoundUse {
    /// Seen by the script; joins the training group only if kept.
    Probe,
    /// Replaces the training group.
    Replace,
    /// Added to the training group.
    Append,
}

impl RoundUse {
    pub fn name(&self) -> &'static str {
        match self {
            RoundUse::Probe => "probe",
            RoundUse::Replace => "replace",
            RoundUse::Append => "append",
        }
    }
}

/// A request for another round: one spec per rollout.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundRequest {
    pub specs: Vec<GuidanceSpec>,
    pub use_: RoundUse,
    /// For probes: train on them too (they join the final group).
    pub keep: bool,
}

/// What an intervention script decided for one turn.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Intervention {
    #[default]
    Nothing,
    /// Text shown to the policy for this turn (in the plan slot).
    Hint(String),
    /// End the episode (counted as a failure).
    Stop,
}

/// Cap on hint length (a runaway script cannot flood prompts).
const MAX_HINT_CHARS: usize = 512;

/// A wrong return value of entry point `name`: positioned at its
/// definition.
pub(crate) fn at_fn(s: &Script, name: &str, e: ScriptError) -> ScriptError {
    if e.line > 0 {
        return e;
    }
    let mut at = s.fn_position(name);
    at.msg = e.msg;
    at
}

pub(crate) fn type_error(file: &str, msg: String) -> ScriptError {
    ScriptError {
        file: file.to_string(),
        line: 0,
        col: 0,
        msg,
    }
}

/// Check a spec result: one spec (repeated `r` times, the group size) or
/// an array of specs, one per rollout (any length up to
/// [`MAX_ROUND_ROLLOUTS`]: TraPO's micro-groups are smaller than a group).
pub(crate) fn specs_from(
    file: &str,
    what: &str,
    v: Dynamic,
    r: usize,
) -> Result<Vec<GuidanceSpec>, ScriptError> {
    let bad = |got: &str| {
        type_error(
            file,
            format!("{what} must return a spec or an array of 1..={MAX_ROUND_ROLLOUTS} specs, got {got}"),
        )
    };
    if v.is::<GuidanceSpec>() {
        return Ok(vec![v.cast::<GuidanceSpec>(); r]);
    }
    if v.is::<Array>() {
        let arr = v.cast::<Array>();
        if arr.is_empty() || arr.len() > MAX_ROUND_ROLLOUTS {
            return Err(bad(&format!("an array of {}", arr.len())));
        }
        return arr
            .into_iter()
            .map(|x| {
                let tn = x.type_name().to_string();
                x.try_cast::<GuidanceSpec>()
                    .ok_or_else(|| bad(&format!("an array holding {tn}")))
            })
            .collect();
    }
    Err(bad(v.type_name()))
}

/// Most rollouts one review round may ask for per task.
pub const MAX_ROUND_ROLLOUTS: usize = 256;

/// The shape `review` must return, quoted by each of its errors.
const REVIEW_SHAPE: &str = "review() must return () to accept, #{ select: round } or #{ guidance: spec or [specs], rollouts: n, mode: \"probe\" | \"replace\" | \"append\", keep: bool }";

/// Check a `review` result.
pub(crate) fn review_from(
    file: &str,
    v: Dynamic,
    group_size: usize,
) -> Result<Review, ScriptError> {
    if v.is_unit() {
        return Ok(Review::Accept);
    }
    let Some(m) = v.clone().try_cast::<Map>() else {
        return Err(type_error(
            file,
            format!("{REVIEW_SHAPE}; got {}", v.type_name()),
        ));
    };
    for k in m.keys() {
        if !["guidance", "rollouts", "mode", "use", "keep", "select"].contains(&k.as_str()) {
            return Err(type_error(
                file,
                format!("{REVIEW_SHAPE}; unknown key `{k}`"),
            ));
        }
    }
    if let Some(sel) = m.get("select") {
        let i = sel.as_int().ok().filter(|i| *i >= 0).ok_or_else(|| {
            type_error(
                file,
                format!("{REVIEW_SHAPE}; `select` must be a round index ≥ 0"),
            )
        })?;
        return Ok(Review::Select(i as usize));
    }
    round_from(file, &m, group_size).map(Review::Round)
}

/// A `review` result asking for another round.
fn round_from(file: &str, m: &Map, group_size: usize) -> Result<RoundRequest, ScriptError> {
    let Some(g) = m.get("guidance") else {
        return Err(type_error(
            file,
            format!("{REVIEW_SHAPE}; `guidance` is missing"),
        ));
    };
    let rollouts = match m.get("rollouts") {
        Some(n) => Some(
            n.as_int()
                .ok()
                .filter(|n| (1..=MAX_ROUND_ROLLOUTS as i64).contains(n))
                .ok_or_else(|| {
                    type_error(
                        file,
                        format!("{REVIEW_SHAPE}; `rollouts` must be 1..={MAX_ROUND_ROLLOUTS}"),
                    )
                })? as usize,
        ),
        None => None,
    };
    let specs = specs_from(
        file,
        "review()'s `guidance`",
        g.clone(),
        rollouts.unwrap_or(group_size),
    )?;
    if let Some(n) = rollouts.filter(|&n| n != specs.len()) {
        return Err(type_error(
            file,
            format!(
                "{REVIEW_SHAPE}; `rollouts` is {n} but `guidance` holds {} specs",
                specs.len()
            ),
        ));
    }
    let use_ = mode_from(file, m)?;
    let keep = match m.get("keep") {
        None => false,
        Some(k) => k
            .as_bool()
            .map_err(|_| type_error(file, format!("{REVIEW_SHAPE}; `keep` must be a bool")))?,
    };
    Ok(RoundRequest { specs, use_, keep })
}

/// The `mode` of a requested round (`use` is a reserved word in Rhai;
/// `"use"` quoted works too); a probe when absent.
fn mode_from(file: &str, m: &Map) -> Result<RoundUse, ScriptError> {
    let Some(u) = m
        .get("mode")
        .or_else(|| m.get("use"))
        .map(|u| u.to_string())
    else {
        return Ok(RoundUse::Probe);
    };
    match u.as_str() {
        "probe" => Ok(RoundUse::Probe),
        "replace" => Ok(RoundUse::Replace),
        "append" => Ok(RoundUse::Append),
        other => Err(type_error(
            file,
            format!("{REVIEW_SHAPE}; unknown mode \"{other}\""),
        )),
    }
}

pub(crate) fn number_from(file: &str, v: Dynamic) -> Result<f64, ScriptError> {
    let x = if let Ok(f) = v.as_float() {
        f
    } else if let Ok(i) = v.as_int() {
        i as f64
    } else {
        return Err(type_error(
            file,
            format!("reward() must return a number, got {}", v.type_name()),
        ));
    };
    if !x.is_finite() {
        return Err(type_error(file, format!("reward() returned {x}")));
    }
    Ok(x)
}

pub(crate) fn intervention_from(file: &str, v: Dynamic) -> Result<Intervention, ScriptError> {
    const SHAPE: &str = "intervene() must return (), #{ hint: text } or #{ stop: true }";
    if v.is_unit() {
        return Ok(Intervention::Nothing);
    }
    let Some(m) = v.clone().try_cast::<Map>() else {
        return Err(type_error(file, format!("{SHAPE}; got {}", v.type_name())));
    };
    if let Some(s) = m.get("stop") {
        if s.as_bool().unwrap_or(false) {
            return Ok(Intervention::Stop);
        }
    }
    match m.get("hint") {
        Some(h) if h.is_string() => {
            let h = h.to_string();
            let h: String = h.chars().take(MAX_HINT_CHARS).collect();
            Ok(if h.trim().is_empty() {
                Intervention::Nothing
            } else {
                Intervention::Hint(h)
            })
        }
        Some(h) => Err(type_error(
            file,
            format!("{SHAPE}; `hint` must be a string, got {}", h.type_name()),
        )),
        None if m.contains_key("stop") => Ok(Intervention::Nothing),
        None => Err(type_error(
            file,
            format!("{SHAPE}; got a map without `hint` or `stop`"),
        )),
    }
}
