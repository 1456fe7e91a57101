//! Environments: the [`Env`] trait every environment implements, the [`Task`]
//! record that task panels are made of (with its expert actions), panel I/O,
//! and the built-in environments.

pub mod external;
pub mod household;
pub mod panel;
pub mod searchqa;
pub mod shop;

use serde::{Deserialize, Serialize};

/// One task of a panel: everything needed to reset an environment to it,
/// plus the expert action data used as guidance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// Stable id, unique within the env (e.g. `household-train-0042`).
    pub id: String,
    /// Task type (household: one of the six ALFWorld types).
    #[serde(rename = "type")]
    pub task_type: String,
    /// Goal text as shown to the agent.
    pub goal: String,
    /// Env-specific world description (household: rooms, objects, start state).
    pub world: serde_json::Value,
    /// A successful action sequence from the start state.
    pub expert: Vec<String>,
    /// Difficulty; for the built-in envs the expert length.
    pub difficulty: usize,
}

/// What the env shows after a reset or a step.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// Feedback text ("You arrive at cabinet 1. ..." / "Nothing happens.").
    pub text: String,
    /// Actions the env accepts now (the admissible list).
    pub admissible: Vec<String>,
    /// Episode over (success or step limit).
    pub done: bool,
    /// Reward of this transition (household: 1.0 on success, else 0.0).
    pub reward: f32,
    /// Goal reached.
    pub success: bool,
    /// The action was a valid command (false for "Nothing happens.").
    pub valid: bool,
    /// Numeric extras of the env (searchqa's answer F1, an external env's
    /// numeric `info` fields); the run logs the mean of each over the
    /// step's episodes, from their last observation.
    pub info: std::collections::BTreeMap<String, f64>,
}

/// Errors an environment can raise (bad task data, protocol trouble).
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("task {task}: {msg}")]
    BadTask { task: String, msg: String },
    #[error("{0}")]
    Other(String),
}

/// A multi-turn text environment.
pub trait Env: Send {
    /// Reset to `task`'s start state and return the first observation.
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError>;
    /// Execute one action (any text; invalid text is a no-op with feedback).
    fn step(&mut self, action: &str) -> Result<Observation, EnvError>;
    /// A short Markovian summary of what the agent knows now (location,
    /// hand, what it has seen where), rendered into every prompt.
    fn status(&self) -> String;
}

/// The built-in env kinds.
pub const BUILTIN: [&str; 3] = ["household", "shop", "searchqa"];

/// A fresh built-in env (`kind` validated by the caller; anything else is
/// the household).
pub fn builtin_env(kind: &str, max_steps: usize) -> Box<dyn Env> {
    match kind {
        "shop" => Box::new(shop::ShopEnv::new(max_steps)),
        "searchqa" => Box::new(searchqa::SearchQaEnv::new(max_steps)),
        _ => Box::new(household::HouseholdEnv::new(max_steps)),
    }
}

/// A built-in env's panel generator: (seed, train size, test size).
type PanelGenerator = fn(u64, usize, usize) -> (Vec<Task>, Vec<Task>);

/// Generate disjoint train/test panels of a built-in env (deterministic:
/// the same arguments give byte-identical panels).
pub fn generate_panels(
    kind: &str,
    seed: u64,
    n_train: usize,
    n_test: usize,
) -> Result<(Vec<Task>, Vec<Task>), EnvError> {
    let gen: PanelGenerator = match kind {
        "household" => household::generate_panels,
        "shop" => shop::generate_panels,
        "searchqa" => searchqa::generate_panels,
        other => {
            return Err(EnvError::Other(format!(
                "unknown env `{other}` (built-in: {})",
                BUILTIN.join(", ")
            )))
        }
    };
    // The generators assert when a panel asks for more distinct tasks than
    // the env has (searchqa's question pool, shop's goals): that is a bad
    // request, reported as an error rather than a crash.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(|| gen(seed, n_train, n_test));
    std::panic::set_hook(hook);
    out.map_err(|p| {
        let why = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the generator gave up".into());
        EnvError::Other(format!(
            "cannot generate {n_train} train and {n_test} test {kind} tasks: {why}"
        ))
    })
}

/// Success of a uniformly random admissible-action policy per difficulty:
/// `(difficulty, tasks, success rate)`, for a built-in env's panel.
pub fn random_policy_success(
    kind: &str,
    tasks: &[Task],
    rollouts: usize,
    max_steps: usize,
    seed: u64,
) -> Result<Vec<(usize, usize, f64)>, EnvError> {
    if !BUILTIN.contains(&kind) {
        return Err(EnvError::Other(format!(
            "unknown env `{kind}` (built-in: {})",
            BUILTIN.join(", ")
        )));
    }
    let mut env = builtin_env(kind, max_steps);
    Ok(panel::random_policy_success(
        env.as_mut(),
        tasks,
        rollouts,
        seed,
    ))
}

/// Which env a run talks to.
#[derive(Debug, Clone, PartialEq)]
pub enum EnvKind {
    Builtin(String),
    /// AgentGym env server at `url`; its id field (`id` or `env_idx`).
    Http {
        url: String,
        id_field: String,
    },
    /// A program speaking `envs/PROTOCOL.md` on stdin/stdout.
    Subprocess {
        command: Vec<String>,
    },
}

/// An env kind with its connection limits.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvSpec {
    pub kind: EnvKind,
    pub limits: external::Limits,
    /// A done step with at least this reward counts as a success (external
    /// envs that do not say).
    pub success_reward: f64,
}

impl EnvSpec {
    pub fn builtin(kind: &str) -> Self {
        EnvSpec {
            kind: EnvKind::Builtin(kind.to_string()),
            limits: external::Limits::default(),
            success_reward: 1.0,
        }
    }
}

/// A fresh env for one episode that ends after `max_steps` steps.
pub fn make_env(spec: &EnvSpec, max_steps: usize) -> Box<dyn Env> {
    match &spec.kind {
        EnvKind::Builtin(k) => builtin_env(k, max_steps),
        EnvKind::Http { url, id_field } => Box::new(StepLimit::new(
            external::http::HttpEnv::new(url, id_field, spec.limits, spec.success_reward),
            max_steps,
        )),
        EnvKind::Subprocess { command } => Box::new(StepLimit::new(
            external::subprocess::SubprocessEnv::new(
                command.clone(),
                spec.limits,
                spec.success_reward,
            ),
            max_steps,
        )),
    }
}

/// Fill in missing expert actions of a subprocess env's tasks by asking
/// the env (`expert` request); http servers have no such request, so
/// their panels must carry them.
pub fn fill_experts(spec: &EnvSpec, tasks: &mut [Task]) -> Result<usize, EnvError> {
    let EnvKind::Subprocess { command } = &spec.kind else {
        return Ok(0);
    };
    let mut env =
        external::subprocess::SubprocessEnv::new(command.clone(), spec.limits, spec.success_reward);
    let mut n = 0;
    for t in tasks.iter_mut().filter(|t| t.expert.is_empty()) {
        t.expert = env.expert(t)?;
        if t.difficulty == 0 {
            t.difficulty = t.expert.len();
        }
        n += 1;
    }
    Ok(n)
}

/// An external env's step limit, enforced on our side (the server may
/// have its own).
struct StepLimit<E> {
    inner: E,
    limit: usize,
    steps: usize,
}

impl<E> StepLimit<E> {
    fn new(inner: E, limit: usize) -> Self {
        StepLimit {
            inner,
            limit: limit.max(1),
            steps: 0,
        }
    }
}

impl<E: Env> Env for StepLimit<E> {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        self.steps = 0;
        self.inner.reset(task)
    }

    fn step(&mut self, action: &str) -> Result<Observation, EnvError> {
        self.steps += 1;
        let mut o = self.inner.step(action)?;
        if self.steps >= self.limit {
            o.done = true;
        }
        Ok(o)
    }

    fn status(&self) -> String {
        self.inner.status()
    }
}
