//! Diagnostics along the expert trajectory: the prompts a guided rollout
//! that follows its plan would see, with and without the plan.

use crate::env::{Env, Task};
use crate::guidance::ResolvedSpec;
use crate::model::{Policy, Tok};

use super::encode::Fmt;
use super::episode::{EpisodeRequest, Live};
use super::{RolloutError, RolloutOptions};

/// The guided and unguided prompts of one state along the expert
/// trajectory.
#[derive(Debug, Clone, PartialEq)]
pub struct StatePrompts {
    /// Expert actions executed before this state.
    pub depth: usize,
    /// The expert action taken from this state.
    pub next_action: String,
    /// With the first `plan_k` expert actions shown as the plan.
    pub guided: Vec<u32>,
    /// The same state without the plan.
    pub unguided: Vec<u32>,
}

/// Walk the task's expert trajectory in a fresh env and return, for each
/// state s_t (t = 0 .. L−1, after t expert actions), the prompt the policy
/// would see there with the first `plan_k` expert actions as a plan, and
/// without: the states of a guided rollout that follows its plan
/// (ActGuide-RL's diagnostics, Fig. 3). Stops early if the env ends the
/// episode before the last expert action.
pub fn expert_state_prompts(
    policy: &Policy,
    tok: &Tok,
    make_env: &dyn Fn(usize) -> Box<dyn Env>,
    task: &Task,
    plan_k: usize,
    opts: &RolloutOptions,
) -> Result<Vec<StatePrompts>, RolloutError> {
    let fmt = Fmt::new(policy, tok, opts)?;
    let l_exp = task.expert.len();
    let env = make_env(opts.env_limit(l_exp, l_exp));
    let req = EpisodeRequest {
        task,
        spec: ResolvedSpec {
            plan: plan_k,
            ..ResolvedSpec::default()
        },
    };
    let mut l = Live::new(req, env);
    let mut out = Vec::with_capacity(l_exp);
    let obs = l
        .env
        .reset(task)
        .map_err(|e| RolloutError::Env(e.to_string()))?;
    l.observation = obs.text;
    l.status = l.env.status();
    l.admissible = obs.admissible;
    let mut done = obs.done;
    for (t, a) in task.expert.iter().enumerate() {
        if done {
            break;
        }
        out.push(StatePrompts {
            depth: t,
            next_action: a.clone(),
            guided: l.prompt(&fmt, &l.plan, opts)?,
            unguided: l.prompt(&fmt, &[], opts)?,
        });
        let obs = l
            .env
            .step(a)
            .map_err(|e| RolloutError::Env(e.to_string()))?;
        done = obs.done;
        l.advance(a.clone(), obs.text, obs.admissible);
    }
    Ok(out)
}
