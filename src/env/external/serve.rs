//! Servers that expose a built-in env over the subprocess protocol
//! (`envs/PROTOCOL.md`, on stdin/stdout) or over AgentGym's HTTP API — the
//! reference implementation of both, a way to put a built-in env on
//! another machine, and the counterpart of the protocol tests, with fault
//! injection (a server that dies mid-episode, one that sends malformed
//! JSON).
//!
//! The HTTP server takes the whole task in its reset body
//! (`{"id": n, "task": {...}}`), so an http panel's `world` is
//! `{"task": <the built-in task>}`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};

use serde_json::{json, Value};

use super::PROTOCOL_VERSION;
use crate::env::{household, BuiltinEnv, Env, EnvError, Observation, Task};

/// The expert actions of a built-in task: the task's own, else (household)
/// planned from its world.
fn builtin_expert(kind: BuiltinEnv, task: &Task) -> Result<Vec<String>, EnvError> {
    if !task.expert.is_empty() || kind != BuiltinEnv::Household {
        return Ok(task.expert.clone());
    }
    let world = household::HouseholdEnv::parse_world(task)?;
    Ok(household::expert_plan(&world))
}

/// Faults to inject (tests of the clients' error handling).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Faults {
    /// Exit abruptly when asked for step number N+1 (counted over the
    /// whole server process).
    pub die_after_steps: Option<usize>,
    /// Answer step requests after the N-th with text that is not JSON.
    pub malformed_after_steps: Option<usize>,
    /// Only tasks whose id ends in a number divisible by this are affected
    /// (1 = all tasks).
    pub every: usize,
}

impl Faults {
    fn applies(&self, task: Option<&str>) -> bool {
        let every = self.every.max(1) as u64;
        let n = task
            .and_then(|id| id.rsplit('-').next())
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0);
        n.is_multiple_of(every)
    }

    /// Before serving step number `steps` (counted over the whole server
    /// process) of `task`: exit if the server is to die now; `true` if the
    /// reply is to be malformed.
    fn before_step(&self, steps: usize, task: Option<&str>) -> bool {
        let hit = self.applies(task);
        if hit && self.die_after_steps.is_some_and(|n| steps > n) {
            std::process::exit(3);
        }
        hit && self.malformed_after_steps.is_some_and(|n| steps > n)
    }
}

/// A request the HTTP server cannot serve (answered with status 400 and
/// `{"error": <message>}`).
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("reset needs a numeric `id`")]
    NoId,
    #[error("reset needs the task in `task`: {0}")]
    NoTask(serde_json::Error),
    #[error("no env {0}")]
    NoEnv(u64),
    #[error("no task {0:?} in the served panel (serve-env --panel)")]
    NoTaskId(String),
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error("step needs an `action` string")]
    NoAction,
    #[error("{0} is not served: replies carry the actions and observation")]
    NotServed(String),
    #[error("no route {method} {route}")]
    NoRoute { method: String, route: String },
}

fn obs_json(o: &Observation, status: String) -> Value {
    json!({
        "observation": o.text,
        "available_actions": o.admissible,
        "reward": o.reward,
        "done": o.done,
        "success": o.success,
        "valid": o.valid,
        "status": status,
    })
}

/// Serve the subprocess protocol on stdin/stdout until `close` or EOF.
pub fn serve_stdio(kind: BuiltinEnv, max_steps: usize, faults: Faults) -> std::io::Result<()> {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    let mut env: Option<Box<dyn Env>> = None;
    let mut task_id: Option<String> = None;
    let mut steps = 0usize;
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Value>(&line) {
            Err(e) => json!({ "id": null, "error": format!("malformed request: {e}") }),
            Ok(req) => {
                let id = req.get("id").cloned().unwrap_or(Value::Null);
                let op = req.get("op").and_then(Value::as_str).unwrap_or("");
                let mut r = match op {
                    "hello" => json!({ "version": PROTOCOL_VERSION, "env": kind.name() }),
                    "reset" => match serde_json::from_value::<Task>(req["task"].clone()) {
                        Err(e) => json!({ "error": format!("bad task: {e}") }),
                        Ok(task) => {
                            let mut e = kind.env(max_steps);
                            match e.reset(&task) {
                                Ok(o) => {
                                    let v = obs_json(&o, e.status());
                                    task_id = Some(task.id.clone());
                                    env = Some(e);
                                    v
                                }
                                Err(err) => json!({ "error": err.to_string() }),
                            }
                        }
                    },
                    "step" => {
                        steps += 1;
                        if faults.before_step(steps, task_id.as_deref()) {
                            writeln!(out, "{{\"observation\": oops this is not json")?;
                            out.flush()?;
                            continue;
                        }
                        match (&mut env, req.get("action").and_then(Value::as_str)) {
                            (None, _) => json!({ "error": "step before reset" }),
                            (_, None) => json!({ "error": "step needs an `action` string" }),
                            (Some(e), Some(a)) => match e.step(a) {
                                Ok(o) => obs_json(&o, e.status()),
                                Err(err) => json!({ "error": err.to_string() }),
                            },
                        }
                    }
                    "expert" => match serde_json::from_value::<Task>(req["task"].clone()) {
                        Ok(task) => match builtin_expert(kind, &task) {
                            Ok(actions) => json!({ "actions": actions }),
                            Err(e) => json!({ "error": e.to_string() }),
                        },
                        Err(e) => json!({ "error": format!("bad task: {e}") }),
                    },
                    "close" => {
                        writeln!(out, "{}", json!({ "id": id, "ok": true }))?;
                        out.flush()?;
                        return Ok(());
                    }
                    other => json!({ "error": format!("unknown op `{other}`") }),
                };
                r["id"] = id;
                r
            }
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

/// A bound HTTP server (call [`HttpServer::run`] to serve).
pub struct HttpServer {
    listener: TcpListener,
    kind: BuiltinEnv,
    max_steps: usize,
    faults: Faults,
    /// Tasks by id, for `GET /expert?id=` (empty: the route answers an
    /// error).
    panel: BTreeMap<String, Task>,
}

/// The envs an HTTP server holds: id → (env, id of the task it was reset to).
type Envs = BTreeMap<u64, (Box<dyn Env>, String)>;

impl HttpServer {
    /// Bind `127.0.0.1:port` (0 = any free port).
    pub fn bind(
        kind: BuiltinEnv,
        port: u16,
        max_steps: usize,
        faults: Faults,
    ) -> std::io::Result<Self> {
        Ok(HttpServer {
            listener: TcpListener::bind(("127.0.0.1", port))?,
            kind,
            max_steps,
            faults,
            panel: BTreeMap::new(),
        })
    }

    /// Serve `GET /expert?id=` for these tasks (their expert actions, or a
    /// plan for household tasks without any).
    pub fn with_panel(mut self, tasks: Vec<Task>) -> Self {
        self.panel = tasks.into_iter().map(|t| (t.id.clone(), t)).collect();
        self
    }

    pub fn url(&self) -> String {
        match self.listener.local_addr() {
            Ok(a) => format!("http://{a}"),
            Err(_) => "http://127.0.0.1".into(),
        }
    }

    /// Serve requests one at a time, forever (or until a fault exits).
    pub fn run(self) -> std::io::Result<()> {
        let mut envs = Envs::new();
        let mut next = 0u64;
        let mut steps = 0usize;
        for stream in self.listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let Some((method, path, body)) = read_request(&mut stream) else {
                continue;
            };
            let route = path.split('?').next().unwrap_or("").to_string();
            let reply = match (method.as_str(), route.as_str()) {
                ("POST", "/create") => {
                    next += 1;
                    envs.insert(next, (self.kind.env(self.max_steps), String::new()));
                    Ok(json!({ "id": next }))
                }
                ("POST", "/reset") => reset(&mut envs, &body),
                ("POST", "/close") => {
                    let id = body["id"].as_u64().unwrap_or(0);
                    match envs.remove(&id) {
                        Some(_) => Ok(json!({ "closed": id })),
                        None => Err(RequestError::NoEnv(id)),
                    }
                }
                // How many envs are open (tests check that runs close theirs).
                ("GET", "/live") => Ok(json!({ "live": envs.len() })),
                ("GET", "/expert") => {
                    let id = query_value(&path, "id").unwrap_or_default();
                    match self.panel.get(&id) {
                        Some(t) => builtin_expert(self.kind, t)
                            .map(|a| json!({ "expert": a }))
                            .map_err(RequestError::from),
                        None => Err(RequestError::NoTaskId(id)),
                    }
                }
                ("POST", "/step") => {
                    steps += 1;
                    let id = body["id"].as_u64().unwrap_or(0);
                    let tid = envs.get(&id).map(|e| e.1.clone());
                    if self.faults.before_step(steps, tid.as_deref()) {
                        respond(&mut stream, 200, "{\"observation\": oops this is not json");
                        continue;
                    }
                    step(&mut envs, id, &body)
                }
                ("GET", "/available_actions") | ("GET", "/observation") => {
                    Err(RequestError::NotServed(route))
                }
                _ => Err(RequestError::NoRoute { method, route }),
            };
            match reply {
                Ok(v) => respond(&mut stream, 200, &v.to_string()),
                Err(e) => respond(
                    &mut stream,
                    400,
                    &json!({ "error": e.to_string() }).to_string(),
                ),
            }
        }
        Ok(())
    }
}

/// The percent-decoded value of `key` in a request path's query string.
fn query_value(path: &str, key: &str) -> Option<String> {
    let query = path.split_once('?')?.1;
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| percent_decode(v))
    })
}

/// `%XX` escapes and `+` (space) of a query value.
fn percent_decode(v: &str) -> String {
    percent_encoding::percent_decode_str(&v.replace('+', " "))
        .decode_utf8_lossy()
        .into_owned()
}

/// `/reset`: reset env `id` to the task in the body.
fn reset(envs: &mut Envs, body: &Value) -> Result<Value, RequestError> {
    let id = body["id"].as_u64().ok_or(RequestError::NoId)?;
    let task: Task = serde_json::from_value(body["task"].clone()).map_err(RequestError::NoTask)?;
    let (env, tid) = envs.get_mut(&id).ok_or(RequestError::NoEnv(id))?;
    let o = env.reset(&task)?;
    *tid = task.id.clone();
    Ok(
        json!({ "id": id, "observation": o.text, "available_actions": o.admissible, "task_type": task.task_type }),
    )
}

/// `/step`: one action of env `id`.
fn step(envs: &mut Envs, id: u64, body: &Value) -> Result<Value, RequestError> {
    let action = body["action"].as_str().ok_or(RequestError::NoAction)?;
    let (env, _) = envs.get_mut(&id).ok_or(RequestError::NoEnv(id))?;
    let o = env.step(action)?;
    Ok(
        json!({ "observation": o.text, "reward": o.reward, "done": o.done, "available_actions": o.admissible, "success": o.success, "valid": o.valid }),
    )
}

/// (method, path, JSON body or null) of one HTTP/1.1 request (also read
/// by the reference engine server, `crate::inference::reference`).
pub(crate) fn read_request(stream: &mut TcpStream) -> Option<(String, String, Value)> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut first = String::new();
    reader.read_line(&mut first).ok()?;
    let mut parts = first.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).ok()? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut buf = vec![0u8; len];
    reader.read_exact(&mut buf).ok()?;
    let body = serde_json::from_slice(&buf).unwrap_or(Value::Null);
    Some((method, path, body))
}

pub(crate) fn respond(stream: &mut TcpStream, code: u16, body: &str) {
    let reason = if code == 200 { "OK" } else { "Bad Request" };
    let _ = write!(
        stream,
        "HTTP/1.1 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_found_and_decoded() {
        assert_eq!(query_value("/expert?id=a-1", "id").as_deref(), Some("a-1"));
        assert_eq!(
            query_value("/expert?x=1&id=a%20b+c%2Fd", "id").as_deref(),
            Some("a b c/d")
        );
        assert_eq!(
            query_value("/expert?id=%zz%", "id").as_deref(),
            Some("%zz%")
        );
        assert_eq!(query_value("/expert?id=é%", "id").as_deref(), Some("é%"));
        assert_eq!(query_value("/expert", "id"), None);
    }
}
