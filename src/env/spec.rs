//! How a run builds its env from the experiment's settings: [`EnvSpec`]
//! (which env, connection limits, success threshold), [`make_env`] for one
//! episode, the step limit enforced on external envs, and [`fill_experts`]
//! for panels whose expert actions the env itself supplies.

use super::{external, BuiltinEnv, Env, EnvError, Observation, Task};

/// Which env a run talks to, with what it needs to reach it (an
/// experiment's is its `env` section's
/// [`crate::experiment::config::EnvKindSection`]).
#[derive(Debug, Clone, PartialEq)]
pub enum EnvKind {
    Builtin(BuiltinEnv),
    /// AgentGym env server at `url`; its id field (`id` or `env_idx`).
    Http {
        url: String,
        id_field: String,
        /// Where tasks without expert actions get them.
        expert: ExpertSource,
    },
    /// A program speaking `envs/PROTOCOL.md` on stdin/stdout.
    Subprocess {
        command: Vec<String>,
        /// Where tasks without expert actions get them.
        expert: ExpertSource,
    },
}

/// Where an external env's expert actions come from, for tasks whose panel
/// line has none (`env.expert`; `tasks from-server --expert`). Envs that
/// know the gold path per task answer before any reset; game engines that
/// compute it for the game they loaded know it only per env instance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ExpertSource {
    /// Nowhere: the panel must carry them (an http env's default:
    /// AgentGym's API has no expert route).
    #[default]
    Panel,
    /// Per task, before any reset: http `GET /expert?id=<task id>`, stdio
    /// `{"op": "expert", "task": TASK}` (a subprocess env's default).
    Task,
    /// Per env instance, after a reset to the task: http `GET
    /// /expert?<id_field>=<env id>`, stdio `{"op": "expert"}` (no task).
    Instance,
    /// A field of the reset reply, as a dotted path (`info.extra.expert_plan`;
    /// a key that itself holds dots, like ALFWorld's `extra.expert_plan`,
    /// is matched whole).
    ResetField(String),
}

/// The setting's text form: `panel`, `task`, `instance` or `reset:<path>`.
impl std::str::FromStr for ExpertSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "panel" => Ok(ExpertSource::Panel),
            "task" => Ok(ExpertSource::Task),
            "instance" => Ok(ExpertSource::Instance),
            _ => match s.strip_prefix("reset:") {
                Some(path) if !path.is_empty() && !path.split('.').any(str::is_empty) => {
                    Ok(ExpertSource::ResetField(path.to_string()))
                }
                _ => Err(format!(
                    "expert source {s:?}: expected \"panel\", \"task\", \"instance\" or \
                     \"reset:<dotted path>\" (e.g. \"reset:info.extra.expert_plan\")"
                )),
            },
        }
    }
}

impl serde::Serialize for ExpertSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ExpertSource {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// The text form `FromStr` reads.
impl std::fmt::Display for ExpertSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpertSource::Panel => f.write_str("panel"),
            ExpertSource::Task => f.write_str("task"),
            ExpertSource::Instance => f.write_str("instance"),
            ExpertSource::ResetField(p) => write!(f, "reset:{p}"),
        }
    }
}

/// An env kind with its connection limits.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvSpec {
    pub kind: EnvKind,
    pub limits: external::Limits,
    /// A done step with at least this reward counts as a success (external
    /// envs that do not say).
    pub success_reward: f64,
    /// External envs: the longest a step may wait on them (the run sets
    /// `guard`'s deadline from it before each step; `None`: no deadline).
    pub step_deadline: Option<std::time::Duration>,
    /// Shared by every env built from this spec: the step deadline and the
    /// timeout breaker ([`external::StepGuard`]).
    pub guard: external::StepGuard,
    /// Shared by every env built from this spec: the cap on requests in
    /// flight and the envs left open ([`external::Connections`]).
    pub conns: external::Connections,
}

impl EnvSpec {
    pub fn builtin(kind: BuiltinEnv) -> Self {
        EnvSpec {
            kind: EnvKind::Builtin(kind),
            limits: external::Limits::default(),
            success_reward: 1.0,
            step_deadline: None,
            guard: external::StepGuard::default(),
            conns: external::Connections::default(),
        }
    }
}

impl EnvSpec {
    /// A new step (or evaluation) begins: the guard's deadline restarts
    /// and earlier timeouts are forgotten.
    pub fn begin_step(&self) {
        self.guard.begin(self.step_deadline);
    }
}

/// A fresh env for one episode that ends after `max_steps` steps.
pub fn make_env(spec: &EnvSpec, max_steps: usize) -> Box<dyn Env> {
    match &spec.kind {
        EnvKind::Builtin(k) => k.env(max_steps),
        EnvKind::Http { url, id_field, .. } => Box::new(StepLimit::new(
            external::http::HttpEnv::new(url, id_field, spec.limits, spec.success_reward)
                .with_shared(spec.guard.clone(), spec.conns.clone()),
            max_steps,
        )),
        EnvKind::Subprocess { command, .. } => Box::new(StepLimit::new(
            external::subprocess::SubprocessEnv::new(
                command.clone(),
                spec.limits,
                spec.success_reward,
            )
            .with_guard(spec.guard.clone()),
            max_steps,
        )),
    }
}

/// Asks an env for one task's expert actions.
type ExpertFn<'a> = dyn FnMut(&Task) -> Result<Vec<String>, EnvError> + 'a;

/// Fill in missing expert actions by asking the env where `env.expert`
/// says (see [`ExpertSource`]): per task, or from an env instance reset to
/// the task (its reset reply's field, or its expert request after the
/// reset). Returns how many tasks were filled.
pub fn fill_experts(spec: &EnvSpec, tasks: &mut [Task]) -> Result<usize, EnvError> {
    let asked = match &spec.kind {
        EnvKind::Subprocess { command, expert } => asker(
            || {
                external::subprocess::SubprocessEnv::new(
                    command.clone(),
                    spec.limits,
                    spec.success_reward,
                )
            },
            expert,
        ),
        EnvKind::Http {
            url,
            id_field,
            expert,
        } => asker(
            || external::http::HttpEnv::new(url, id_field, spec.limits, spec.success_reward),
            expert,
        ),
        EnvKind::Builtin(_) => None,
    };
    let Some(mut ask) = asked else {
        return Ok(0);
    };
    let mut n = 0;
    for t in tasks.iter_mut().filter(|t| t.expert.is_empty()) {
        t.expert = ask(t)?;
        if t.difficulty == 0 {
            t.difficulty = t.expert.len();
        }
        n += 1;
    }
    Ok(n)
}

/// How to ask envs made by `new` for a task's expert actions from
/// `source` (None: the panel must carry them). Per task, one env answers
/// every task; per instance, each task gets an env reset to it (closed
/// when dropped, after the answer).
fn asker<'a, E: external::Experts + 'a>(
    new: impl Fn() -> E + 'a,
    source: &ExpertSource,
) -> Option<Box<ExpertFn<'a>>> {
    match source {
        ExpertSource::Panel => None,
        ExpertSource::Task => {
            let mut env = new();
            Some(Box::new(move |t| env.task_expert(t)))
        }
        src => {
            let src = src.clone();
            Some(Box::new(move |t| {
                let mut env = new();
                env.reset(t)?;
                env.instance_expert(&src)
            }))
        }
    }
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
