//! A client of AgentGym's env-server HTTP API (docs/ENVIRONMENTS.md#agentgym-http): `POST
//! /create` → `{"id"}`, `POST /reset {id, …task.world}` → first
//! observation and available actions, `POST /step {id, action}` →
//! observation (or WebShop's `state`), reward, done; `GET
//! /available_actions?id=` when a reply carries none. The id field is `id`
//! (ALFWorld adapter) or `env_idx` (WebShop adapter). One server-side env
//! per client, created on the first reset and closed (`POST /close {id}`)
//! when the client is dropped, so servers that run a process per env do
//! not pile them up.

use serde_json::{json, Map, Value};

use std::time::{Duration, Instant};

use super::connections::{self, dropped, not_sent, Connections, LeftOpen};
use super::{check_error, err, field, strings, Limits, StepGuard};
use crate::env::{Env, EnvError, ExpertSource, Observation, Task};

/// The client end of an AgentGym env server.
pub struct HttpEnv {
    base: String,
    id_field: String,
    limits: Limits,
    success_reward: f64,
    agent: ureq::Agent,
    env_id: Option<Value>,
    /// The last reset's reply (an instance's expert may be in it).
    reset_reply: Option<Value>,
    /// The task of the last reset (named if the env is left open).
    task: String,
    guard: StepGuard,
    conns: Connections,
}

/// A failed request: the error, and whether the request may have reached
/// the server.
struct Failed {
    error: EnvError,
    sent: bool,
}

impl Failed {
    fn sent(error: EnvError) -> Self {
        Failed { error, sent: true }
    }
    fn not_sent(error: EnvError) -> Self {
        Failed { error, sent: false }
    }
}

impl HttpEnv {
    pub fn new(url: &str, id_field: &str, limits: Limits, success_reward: f64) -> Self {
        let agent = connections::agent(
            ureq::Agent::config_builder()
                .timeout_global(Some(limits.timeout))
                .http_status_as_error(false)
                .build(),
        );
        HttpEnv {
            base: url.trim_end_matches('/').to_string(),
            id_field: id_field.to_string(),
            limits,
            success_reward,
            agent,
            env_id: None,
            reset_reply: None,
            task: String::new(),
            guard: StepGuard::default(),
            conns: Connections::default(),
        }
    }

    /// Share a run's step guard (deadline and timeout breaker) and its
    /// connection state (cap on requests in flight, envs left open).
    pub fn with_shared(mut self, guard: StepGuard, conns: Connections) -> Self {
        self.guard = guard;
        self.conns = conns;
        self
    }

    fn name(&self) -> String {
        format!("http env {}", self.base)
    }

    /// One request; `body` None is a GET. Non-JSON replies, HTTP errors
    /// and `{"error": …}` are errors.
    fn call(&self, path: &str, body: Option<Value>) -> Result<Value, Failed> {
        let url = format!("{}/{path}", self.base);
        let op = path.split('?').next().unwrap_or(path);
        self.send(op, |agent, wait| match &body {
            Some(b) => agent
                .post(&url)
                .config()
                .timeout_global(Some(wait))
                .build()
                .send_json(b),
            None => agent
                .get(&url)
                .config()
                .timeout_global(Some(wait))
                .build()
                .call(),
        })
    }

    /// `GET /<op>?<key>=<value>` (the value percent-encoded).
    fn call_query(&self, op: &str, key: &str, value: &str) -> Result<Value, Failed> {
        let url = format!("{}/{op}", self.base);
        self.send(op, |agent, wait| {
            agent
                .get(&url)
                .query(key, value)
                .config()
                .timeout_global(Some(wait))
                .build()
                .call()
        })
    }

    /// Send one request under the step guard's wait and the shared cap on
    /// requests in flight; a refused or reset connection is counted
    /// against the cap.
    fn send(
        &self,
        op: &str,
        request: impl FnOnce(
            &ureq::Agent,
            Duration,
        ) -> Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Value, Failed> {
        // The guard's refusal: nothing was sent (and the retry loop asks
        // the guard before any retry).
        let wait = self.wait(op).map_err(Failed::not_sent)?;
        let started = Instant::now();
        let Some(_slot) = self.conns.slot(wait) else {
            return Err(Failed::not_sent(err(
                &self.name(),
                op,
                format!(
                    "no request slot within {:.1} s (at most {} in flight after resets)",
                    wait.as_secs_f64(),
                    self.conns.cap().unwrap_or(0)
                ),
            )));
        };
        let wait = wait
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(1));
        match request(&self.agent, wait) {
            Ok(resp) => self.reply(op, resp).map_err(Failed::sent),
            Err(e) => {
                if dropped(&e) {
                    self.conns.dropped(&self.base);
                }
                let before = not_sent(&e);
                let e = self.failed(op, e);
                Err(if before {
                    Failed::not_sent(e)
                } else {
                    Failed::sent(e)
                })
            }
        }
    }

    /// The time request `op` may wait for its reply, or why it may not be
    /// sent (see [`StepGuard`]).
    fn wait(&self, op: &str) -> Result<Duration, EnvError> {
        self.guard
            .wait(self.limits.timeout)
            .map_err(|why| err(&self.name(), op, why))
    }

    /// A reply as JSON: non-JSON replies, HTTP errors and `{"error": …}`
    /// are errors.
    fn reply(
        &self,
        op: &str,
        mut resp: ureq::http::Response<ureq::Body>,
    ) -> Result<Value, EnvError> {
        let name = self.name();
        let status = resp.status();
        let text = resp.body_mut().read_to_string().map_err(|e| match e {
            ureq::Error::Timeout(_) => self.failed(op, e),
            e => err(&name, op, format!("cannot read the reply: {e}")),
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            let cut: String = text.chars().take(200).collect();
            err(&name, op, format!("malformed JSON reply ({e}): {cut}"))
        })?;
        check_error(&name, op, &v)?;
        if !status.is_success() {
            return Err(err(&name, op, format!("HTTP {status}")));
        }
        Ok(v)
    }

    /// A transport error as an env error; a timeout trips the step guard.
    fn failed(&self, op: &str, e: ureq::Error) -> EnvError {
        let e = match e {
            ureq::Error::Timeout(t) => {
                let msg = format!("no reply in time ({t})");
                self.guard.trip(format!("{op}: {msg}"));
                msg
            }
            e => e.to_string(),
        };
        err(&self.name(), op, e)
    }

    /// Repeat a request that is safe to repeat.
    fn call_retrying(&self, path: &str, body: Option<Value>) -> Result<Value, EnvError> {
        self.retrying(true, || self.call(path, body.clone()))
    }

    /// `request` until it succeeds, at most `retries` more times, backing
    /// off a little more each time. With `any` false only failures before
    /// the request was sent are repeated (a `step` may have been applied).
    fn retrying(
        &self,
        any: bool,
        request: impl Fn() -> Result<Value, Failed>,
    ) -> Result<Value, EnvError> {
        let mut last = None;
        for attempt in 0..=self.limits.retries {
            if attempt > 0 {
                // No retry once the step guard says the wait is over: the
                // error kept is the real one, not the guard's refusal.
                if self.guard.wait(self.limits.timeout).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100 << (attempt - 1).min(5)));
            }
            match request() {
                Ok(v) => return Ok(v),
                Err(f) => {
                    let again = any || !f.sent;
                    last = Some(f.error);
                    if !again {
                        break;
                    }
                }
            }
        }
        Err(last.expect("at least one attempt"))
    }

    fn id(&mut self) -> Result<Value, EnvError> {
        if let Some(id) = &self.env_id {
            return Ok(id.clone());
        }
        let v = self.call_retrying("create", Some(json!({})))?;
        let id = field(&self.name(), "create", &v, &self.id_field)
            .or_else(|_| field(&self.name(), "create", &v, "id"))?
            .clone();
        self.env_id = Some(id.clone());
        Ok(id)
    }

    /// A task's expert actions from the server's `GET /expert?id=<task
    /// id>` (a reply `{"expert": [...]}`; `actions` is read too). AgentGym
    /// servers have no such route; servers that know the gold paths can
    /// offer it (`actguide serve-env --protocol http --panel P` does).
    pub fn expert(&self, task: &Task) -> Result<Vec<String>, EnvError> {
        let v = self.retrying(true, || self.call_query("expert", "id", &task.id))?;
        Self::expert_list(&self.name(), &v)
    }

    /// The expert actions of the task this env was last reset to: a field
    /// of the reset reply, or `GET /expert?<id_field>=<env id>` (a reply
    /// `{"expert": [...]}` or `{"actions": [...]}`).
    pub fn instance_expert(&self, src: &ExpertSource) -> Result<Vec<String>, EnvError> {
        let (Some(id), Some(reply)) = (&self.env_id, &self.reset_reply) else {
            return Err(err(&self.name(), "expert", "no env reset to the task"));
        };
        match src {
            ExpertSource::ResetField(path) => super::expert_at(&self.name(), reply, path),
            ExpertSource::Instance => {
                let q = match id {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                let v = self.retrying(true, || self.call_query("expert", &self.id_field, &q))?;
                Self::expert_list(&self.name(), &v)
            }
            other => Err(err(
                &self.name(),
                "expert",
                format!("expert source {other} is not per env instance"),
            )),
        }
    }

    fn expert_list(name: &str, v: &Value) -> Result<Vec<String>, EnvError> {
        let list = v.get("expert").or_else(|| v.get("actions"));
        if !list.is_some_and(Value::is_array) {
            return Err(err(name, "expert", "the reply has no `expert` array"));
        }
        Ok(strings(list))
    }

    fn actions_if_missing(&self, v: &Value, id: &Value) -> Vec<String> {
        if v.get("available_actions").is_some() {
            return strings(v.get("available_actions"));
        }
        let q = match id {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        self.retrying(true, || {
            self.call(&format!("available_actions?{}={q}", self.id_field), None)
        })
        .map(|a| match a {
            Value::Array(_) => strings(Some(&a)),
            other => strings(other.get("available_actions")),
        })
        .unwrap_or_default()
    }
}

impl Drop for HttpEnv {
    /// Best effort: a server without `/close`, or one that is gone, costs
    /// one failed request. After a timeout this step (the step guard) no
    /// close is sent now (a hung server would cost one timeout per env):
    /// the env is kept in the shared [`Connections`], and the run closes
    /// it at the end of the step or lists it in `env_errors.jsonl`.
    fn drop(&mut self) {
        let Some(id) = self.env_id.take() else {
            return;
        };
        if self.guard.wait(self.limits.timeout).is_err() {
            self.conns.left_open(LeftOpen {
                base: self.base.clone(),
                id_field: self.id_field.clone(),
                id,
                task: std::mem::take(&mut self.task),
            });
            return;
        }
        let mut body = Map::new();
        body.insert(self.id_field.clone(), id);
        let _ = self.call("close", Some(Value::Object(body)));
    }
}

impl Env for HttpEnv {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        let id = self.id()?;
        let mut body = match &task.world {
            Value::Object(m) => m.clone(),
            Value::Null => Map::new(),
            other => {
                return Err(EnvError::BadTask {
                    task: task.id.clone(),
                    msg: format!("an http env task's `world` must be a JSON object (the reset body), got {other}"),
                })
            }
        };
        body.insert(self.id_field.clone(), id.clone());
        self.task = task.id.clone();
        let v = self.call_retrying("reset", Some(Value::Object(body)))?;
        self.reset_reply = Some(v.clone());
        let name = self.name();
        let text = match v.get("observation").or_else(|| v.get("state")) {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => {
                return Err(err(
                    &name,
                    "reset",
                    "reply has no `observation` (or `state`) field",
                ));
            }
        };
        Ok(Observation {
            admissible: self.actions_if_missing(&v, &id),
            text,
            done: false,
            reward: 0.0,
            success: false,
            valid: true,
            info: Default::default(),
        })
    }

    fn step(&mut self, action: &str) -> Result<Observation, EnvError> {
        let id = self
            .env_id
            .clone()
            .ok_or_else(|| err(&self.name(), "step", "step before reset"))?;
        let mut body = Map::new();
        body.insert(self.id_field.clone(), id.clone());
        body.insert("action".into(), json!(action));
        // A step is repeated only when it was never sent: the server may
        // have applied it.
        let body = Value::Object(body);
        let v = self.retrying(false, || self.call("step", Some(body.clone())))?;
        let mut obs = super::step_observation(&self.name(), &v, self.success_reward)?;
        if v.get("available_actions").is_none() && !obs.done {
            obs.admissible = self.actions_if_missing(&v, &id);
        }
        Ok(obs)
    }

    fn status(&self) -> String {
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;

    fn task() -> Task {
        Task {
            id: "t".into(),
            task_type: String::new(),
            goal: String::new(),
            world: Value::Null,
            expert: Vec::new(),
            difficulty: 0,
        }
    }

    /// Serve `n` requests on `l`, one connection each; returns the paths.
    fn serve(l: &TcpListener, n: usize) -> Vec<String> {
        let mut paths = Vec::new();
        for _ in 0..n {
            let (s, _) = l.accept().unwrap();
            let mut r = BufReader::new(s);
            let mut head = String::new();
            let mut len = 0;
            loop {
                let mut line = String::new();
                r.read_line(&mut line).unwrap();
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap();
                }
                if line == "\r\n" {
                    break;
                }
                head.push_str(&line);
            }
            let mut body = vec![0; len];
            r.read_exact(&mut body).unwrap();
            let path = head.split(' ').nth(1).unwrap().to_string();
            let reply = match path.as_str() {
                "/create" => r#"{"id": 7}"#,
                "/reset" => r#"{"observation": "a room", "available_actions": ["wait"]}"#,
                "/step" => r#"{"observation": "done", "reward": 1.0, "done": true}"#,
                _ => r#"{"ok": true}"#,
            };
            let mut s = r.into_inner();
            write!(
                s,
                "HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{reply}",
                reply.len()
            )
            .unwrap();
            paths.push(path);
        }
        paths
    }

    /// A listener on a free port and an env (5 s timeout, 4 retries) on it.
    fn listener_and_env() -> (TcpListener, std::net::SocketAddr, HttpEnv) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let limits = Limits {
            timeout: Duration::from_secs(5),
            retries: 4,
        };
        let env = HttpEnv::new(&format!("http://{addr}"), "id", limits, 1.0);
        (l, addr, env)
    }

    #[test]
    fn a_step_whose_connection_was_refused_is_sent_again() {
        let (l, addr, mut env) = listener_and_env();
        let server = std::thread::spawn(move || {
            let first = serve(&l, 2);
            // The server goes away for a moment: the step's first
            // connections are refused.
            drop(l);
            std::thread::sleep(Duration::from_millis(250));
            let l = TcpListener::bind(addr).unwrap();
            (first, serve(&l, 2))
        });
        let task = task();
        env.reset(&task).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let obs = env.step("wait").unwrap();
        assert!(obs.done && obs.success);
        drop(env);
        let (first, then) = server.join().unwrap();
        assert_eq!(first, ["/create", "/reset"]);
        // One step reached the server, then the close.
        assert_eq!(then, ["/step", "/close"]);
    }

    #[test]
    fn a_step_that_reached_a_server_that_then_failed_is_not_sent_again() {
        let (l, _, mut env) = listener_and_env();
        let server = std::thread::spawn(move || {
            serve(&l, 2);
            // The step arrives and the server drops it unanswered.
            let (mut s, _) = l.accept().unwrap();
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).unwrap();
            drop(s);
            // Anything further would be a repeat.
            l.set_nonblocking(true).unwrap();
            std::thread::sleep(Duration::from_millis(700));
            let again = l.accept().is_ok();
            (String::from_utf8_lossy(&buf[..n]).to_string(), again)
        });
        let task = task();
        env.reset(&task).unwrap();
        let e = env.step("wait").unwrap_err().to_string();
        assert!(e.contains("step"), "{e}");
        let (got, again) = server.join().unwrap();
        assert!(got.starts_with("POST /step"), "{got}");
        assert!(!again, "the step was sent twice");
        // The close goes to a server that is gone: no panic, no wait.
        env.env_id = None;
    }

    #[test]
    fn refused_connections_from_many_envs_lower_the_shared_cap_once() {
        // Nothing listens: every create is refused.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let limits = Limits {
            timeout: Duration::from_secs(5),
            retries: 3,
        };
        let conns = Connections::default();
        let guard = StepGuard::default();
        let barrier = std::sync::Barrier::new(8);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let mut env = HttpEnv::new(&format!("http://{addr}"), "id", limits, 1.0)
                        .with_shared(guard.clone(), conns.clone());
                    barrier.wait();
                    let task = task();
                    let e = env.reset(&task).unwrap_err().to_string();
                    assert!(e.contains("could not connect"), "{e}");
                });
            }
        });
        let cap = conns.cap().expect("lowered");
        assert!(cap < 8, "{cap}");
        let note = conns.take_notice().unwrap();
        assert!(note.contains("were refused or reset"), "{note}");
        assert_eq!(conns.take_notice(), None);
    }
}
