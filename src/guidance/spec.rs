//! Guidance specs: what a script asks for per rollout, and their resolution
//! against a task's expert length.

use rhai::Engine;
use serde::{Deserialize, Serialize};

/// A guidance request for one rollout, as returned by a script's `plan`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum GuidanceSpec {
    /// Plain rollout.
    None,
    /// The env executes the first `n` expert actions before the policy acts.
    Prefix { n: i64 },
    /// Prefix depth as a ratio of the expert length (Agent-G²'s r_i).
    PrefixRatio { r: f64 },
    /// The first `k` expert actions are shown in the prompt as a plan;
    /// `loss` (`plan(k).with_loss("dual")`) overrides the experiment's plan
    /// loss for these rollouts.
    Plan { k: i64, loss: PlanLoss },
    /// The full expert trajectory as an off-policy sample (LUFFY).
    Expert,
}

/// How rollouts generated under a plan in the prompt are trained
/// (docs/ALGORITHMS.md#plan-losses-internalize-on_policy-dual).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PlanLoss {
    /// The experiment's `trainer.plan_loss`.
    #[default]
    Default,
    /// On-policy PPO under the guided prompt.
    OnPolicy,
    /// ActGuide-RL: behaviour log-probs from the guided prompt, actor and
    /// reference log-probs on the unguided prompt with the same tokens.
    Internalize,
    /// On-policy under the guided prompt plus a weighted off-policy term
    /// under the unguided prompt.
    Dual,
}

impl PlanLoss {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "default" => Some(PlanLoss::Default),
            "on_policy" => Some(PlanLoss::OnPolicy),
            "internalize" => Some(PlanLoss::Internalize),
            "dual" => Some(PlanLoss::Dual),
            _ => None,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            PlanLoss::Default => "default",
            PlanLoss::OnPolicy => "on_policy",
            PlanLoss::Internalize => "internalize",
            PlanLoss::Dual => "dual",
        }
    }
}

/// A spec made concrete for one task: how many expert actions are executed
/// and how many are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ResolvedSpec {
    pub prefix: usize,
    pub plan: usize,
    pub expert: bool,
    pub plan_loss: PlanLoss,
}

impl ResolvedSpec {
    pub fn is_guided(&self) -> bool {
        self.prefix > 0 || self.plan > 0 || self.expert
    }
}

impl GuidanceSpec {
    /// Resolve against expert length `len`. Executed prefixes stop one short
    /// of the end (n = min(⌈r·L⌉, L−1), Agent-G²) so the policy always acts;
    /// a plan may show the whole trajectory.
    pub fn resolve(&self, len: usize) -> ResolvedSpec {
        let max_prefix = len.saturating_sub(1);
        match *self {
            GuidanceSpec::None => ResolvedSpec::default(),
            GuidanceSpec::Prefix { n } => ResolvedSpec {
                prefix: (n.max(0) as usize).min(max_prefix),
                ..Default::default()
            },
            GuidanceSpec::PrefixRatio { r } => {
                let r = if r.is_finite() {
                    r.clamp(0.0, 1.0)
                } else {
                    0.0
                };
                let n = (r * len as f64 - 1e-9).ceil().max(0.0) as usize;
                ResolvedSpec {
                    prefix: n.min(max_prefix),
                    ..Default::default()
                }
            }
            GuidanceSpec::Plan { k, loss } => ResolvedSpec {
                plan: (k.max(0) as usize).min(len),
                plan_loss: loss,
                ..Default::default()
            },
            // A task without expert actions (a scarce-data panel) has no
            // expert trajectory to replay: an on-policy rollout instead.
            GuidanceSpec::Expert => ResolvedSpec {
                expert: len > 0,
                ..Default::default()
            },
        }
    }
}

impl std::fmt::Display for GuidanceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GuidanceSpec::None => write!(f, "none()"),
            GuidanceSpec::Prefix { n } => write!(f, "prefix({n})"),
            GuidanceSpec::PrefixRatio { r } => write!(f, "prefix_ratio({r})"),
            GuidanceSpec::Plan {
                k,
                loss: PlanLoss::Default,
            } => write!(f, "plan({k})"),
            GuidanceSpec::Plan { k, loss } => {
                write!(f, "plan({k}).with_loss(\"{}\")", loss.name())
            }
            GuidanceSpec::Expert => write!(f, "expert()"),
        }
    }
}

/// Register the spec type and its constructors with the engine.
type SpecResult = Result<GuidanceSpec, Box<rhai::EvalAltResult>>;

/// A spec constructor's number, refused when inf or NaN (it would
/// otherwise become depth 0, unguided, without a word).
fn finite(what: &str, x: f64) -> Result<f64, Box<rhai::EvalAltResult>> {
    if x.is_finite() {
        Ok(x)
    } else {
        Err(format!("{what}: the argument must be a finite number, got {x}").into())
    }
}

/// A depth (`prefix(n)`, `plan(k)`): refused when negative, which would
/// otherwise read as unguided without a word (a script that draws depths
/// clamps them itself, as the shipped ones do).
fn depth(what: &str, x: f64) -> Result<i64, Box<rhai::EvalAltResult>> {
    let x = finite(what, x)?.round();
    if x < 0.0 {
        return Err(format!("{what}: the depth must be ≥ 0, got {x}").into());
    }
    Ok(x as i64)
}

/// `prefix_ratio(r)`: a share of the expert trajectory, in [0, 1].
fn ratio(r: f64) -> Result<f64, Box<rhai::EvalAltResult>> {
    let r = finite("prefix_ratio", r)?;
    if !(0.0..=1.0).contains(&r) {
        return Err(format!("prefix_ratio: the ratio must be in [0, 1], got {r}").into());
    }
    Ok(r)
}

pub fn register(engine: &mut Engine) {
    engine
        .register_type_with_name::<GuidanceSpec>("Spec")
        .register_fn("none", || GuidanceSpec::None)
        .register_fn("prefix", |n: i64| -> SpecResult {
            Ok(GuidanceSpec::Prefix {
                n: depth("prefix", n as f64)?,
            })
        })
        .register_fn("prefix", |n: f64| -> SpecResult {
            Ok(GuidanceSpec::Prefix {
                n: depth("prefix", n)?,
            })
        })
        .register_fn("prefix_ratio", |r: f64| -> SpecResult {
            Ok(GuidanceSpec::PrefixRatio { r: ratio(r)? })
        })
        .register_fn("prefix_ratio", |r: i64| -> SpecResult {
            Ok(GuidanceSpec::PrefixRatio {
                r: ratio(r as f64)?,
            })
        })
        .register_fn("plan", |k: i64| -> SpecResult {
            Ok(GuidanceSpec::Plan {
                k: depth("plan", k as f64)?,
                loss: PlanLoss::Default,
            })
        })
        .register_fn("plan", |k: f64| -> SpecResult {
            Ok(GuidanceSpec::Plan {
                k: depth("plan", k)?,
                loss: PlanLoss::Default,
            })
        })
        // `plan(k).with_loss("dual")`: a two-argument `plan` would be
        // shadowed by the script's own entry point plan(task, state).
        .register_fn(
            "with_loss",
            |s: &mut GuidanceSpec, loss: &str| -> Result<GuidanceSpec, Box<rhai::EvalAltResult>> {
                let parsed = PlanLoss::parse(loss).ok_or_else(|| {
                    format!("with_loss: loss must be \"on_policy\", \"internalize\" or \"dual\", got \"{loss}\"")
                })?;
                match *s {
                    GuidanceSpec::Plan { k, .. } => Ok(GuidanceSpec::Plan { k, loss: parsed }),
                    other => Err(format!("with_loss applies to plan(k) specs, not {other}").into()),
                }
            },
        )
        .register_fn("expert", || GuidanceSpec::Expert)
        .register_fn("to_string", |s: &mut GuidanceSpec| s.to_string())
        .register_fn("to_debug", |s: &mut GuidanceSpec| s.to_string())
        .register_get("kind", |s: &mut GuidanceSpec| match s {
            GuidanceSpec::None => "none".to_string(),
            GuidanceSpec::Prefix { .. } => "prefix".to_string(),
            GuidanceSpec::PrefixRatio { .. } => "prefix_ratio".to_string(),
            GuidanceSpec::Plan { .. } => "plan".to_string(),
            GuidanceSpec::Expert => "expert".to_string(),
        })
        .register_get("n", |s: &mut GuidanceSpec| match s {
            GuidanceSpec::Prefix { n } => *n,
            GuidanceSpec::Plan { k, .. } => *k,
            _ => 0,
        })
        .register_get("ratio", |s: &mut GuidanceSpec| match s {
            GuidanceSpec::PrefixRatio { r } => *r,
            _ => 0.0,
        })
        .register_fn("==", |a: GuidanceSpec, b: GuidanceSpec| a == b)
        .register_fn("!=", |a: GuidanceSpec, b: GuidanceSpec| a != b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_without_expert_actions_gets_no_guidance() {
        for g in [
            GuidanceSpec::Expert,
            GuidanceSpec::Prefix { n: 3 },
            GuidanceSpec::PrefixRatio { r: 1.0 },
            GuidanceSpec::Plan {
                k: 2,
                loss: PlanLoss::Default,
            },
        ] {
            assert!(!g.resolve(0).is_guided(), "{g}");
            assert!(g.resolve(4).is_guided(), "{g}");
        }
    }

    #[test]
    fn prefix_ratio_follows_agent_g2() {
        // n = min(ceil(r L), L - 1)
        assert_eq!(GuidanceSpec::PrefixRatio { r: 0.5 }.resolve(7).prefix, 4);
        assert_eq!(GuidanceSpec::PrefixRatio { r: 1.0 }.resolve(7).prefix, 6);
        assert_eq!(GuidanceSpec::PrefixRatio { r: 0.0 }.resolve(7).prefix, 0);
        assert_eq!(GuidanceSpec::PrefixRatio { r: 0.01 }.resolve(7).prefix, 1);
        assert_eq!(GuidanceSpec::PrefixRatio { r: 0.8 }.resolve(1).prefix, 0);
    }

    #[test]
    fn negative_depths_and_ratios_outside_0_1_are_script_errors() {
        let mut engine = Engine::new();
        register(&mut engine);
        for (src, msg) in [
            ("prefix(-5)", "prefix: the depth must be ≥ 0, got -5"),
            ("prefix(-2.6)", "prefix: the depth must be ≥ 0, got -3"),
            ("plan(-1)", "plan: the depth must be ≥ 0, got -1"),
            (
                "prefix_ratio(-0.1)",
                "prefix_ratio: the ratio must be in [0, 1], got -0.1",
            ),
            (
                "prefix_ratio(2)",
                "prefix_ratio: the ratio must be in [0, 1], got 2",
            ),
        ] {
            let e = engine.eval::<GuidanceSpec>(src).unwrap_err().to_string();
            assert!(e.contains(msg), "{src}: {e}");
        }
        assert_eq!(
            engine.eval::<GuidanceSpec>("prefix(0)").unwrap(),
            GuidanceSpec::Prefix { n: 0 }
        );
        assert_eq!(
            engine.eval::<GuidanceSpec>("prefix_ratio(1)").unwrap(),
            GuidanceSpec::PrefixRatio { r: 1.0 }
        );
    }

    #[test]
    fn prefix_and_plan_are_clamped() {
        assert_eq!(GuidanceSpec::Prefix { n: 99 }.resolve(5).prefix, 4);
        assert_eq!(GuidanceSpec::Prefix { n: -3 }.resolve(5).prefix, 0);
        let plan = GuidanceSpec::Plan {
            k: 99,
            loss: PlanLoss::Dual,
        }
        .resolve(5);
        assert_eq!((plan.plan, plan.plan_loss), (5, PlanLoss::Dual));
        assert!(!GuidanceSpec::None.resolve(5).is_guided());
    }
}
