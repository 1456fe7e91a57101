//! A subprocess env: any program that speaks the newline-delimited JSON
//! protocol of `envs/PROTOCOL.md` on stdin/stdout. One child process per
//! env (per episode), started lazily on `reset`, killed on drop; replies
//! are read on a thread so a silent child times out instead of hanging the
//! run.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};

use serde_json::{json, Value};

use super::{check_error, err, field, strings, Limits, StepGuard, PROTOCOL_VERSION};
use crate::env::{Env, EnvError, ExpertSource, Observation, Task};

/// The client end of a subprocess env.
pub struct SubprocessEnv {
    command: Vec<String>,
    limits: Limits,
    success_reward: f64,
    proc: Option<Proc>,
    next_id: u64,
    status: String,
    /// The last reset's reply (an instance's expert may be in it).
    reset_reply: Option<Value>,
    guard: StepGuard,
}

struct Proc {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<std::io::Result<String>>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Best effort: ask politely, then make sure.
        let _ = writeln!(self.stdin, "{}", json!({ "op": "close" }));
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl SubprocessEnv {
    /// `command` is the program and its arguments.
    pub fn new(command: Vec<String>, limits: Limits, success_reward: f64) -> Self {
        SubprocessEnv {
            command,
            limits,
            success_reward,
            proc: None,
            next_id: 0,
            status: String::new(),
            reset_reply: None,
            guard: StepGuard::default(),
        }
    }

    /// Share a run's step guard (deadline and timeout breaker).
    pub fn with_guard(mut self, guard: StepGuard) -> Self {
        self.guard = guard;
        self
    }

    fn name(&self) -> String {
        format!("subprocess env `{}`", self.command.join(" "))
    }

    fn spawn(&mut self) -> Result<(), EnvError> {
        let name = self.name();
        let (prog, args) = self
            .command
            .split_first()
            .ok_or_else(|| err(&name, "start", "empty command"))?;
        let mut cmd = Command::new(prog);
        cmd.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // Killed with the run, however the run ends.
        let mut child = crate::children::spawn(cmd).map_err(|e| err(&name, "start", e))?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        self.proc = Some(Proc {
            child,
            stdin,
            lines: rx,
        });
        let hello = self.request(
            "hello",
            json!({ "op": "hello", "version": PROTOCOL_VERSION }),
        )?;
        let v = hello.get("version").and_then(Value::as_u64);
        if v != Some(PROTOCOL_VERSION) {
            self.proc = None;
            return Err(err(
                &name,
                "hello",
                format!("protocol version {v:?}, expected {PROTOCOL_VERSION}"),
            ));
        }
        Ok(())
    }

    /// Send one request and wait for its reply (matched by `id`). Any
    /// failure kills the child: the next reset starts a fresh one.
    fn request(&mut self, op: &str, mut msg: Value) -> Result<Value, EnvError> {
        let name = self.name();
        self.next_id += 1;
        let id = self.next_id;
        msg["id"] = json!(id);
        let timeout = self
            .guard
            .wait(self.limits.timeout)
            .map_err(|why| err(&name, op, why))?;
        let proc = self
            .proc
            .as_mut()
            .ok_or_else(|| err(&name, op, "no process (reset first)"))?;
        let result = (|| {
            writeln!(proc.stdin, "{msg}")
                .and_then(|_| proc.stdin.flush())
                .map_err(|e| err(&name, op, format!("cannot write to the env process: {e}")))?;
            let line = match proc.lines.recv_timeout(timeout) {
                Ok(Ok(line)) => line,
                Ok(Err(e)) => return Err(err(&name, op, format!("cannot read: {e}"))),
                Err(RecvTimeoutError::Timeout) => {
                    let msg = format!("no reply within {:.1} s", timeout.as_secs_f64());
                    self.guard.trip(format!("{op}: {msg}"));
                    return Err(err(&name, op, msg));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = proc
                        .child
                        .try_wait()
                        .ok()
                        .flatten()
                        .map_or("closed its output".to_string(), |s| format!("exited ({s})"));
                    return Err(err(&name, op, format!("the env process {status}")));
                }
            };
            let v: Value = serde_json::from_str(&line).map_err(|e| {
                err(
                    &name,
                    op,
                    format!("malformed JSON reply ({e}): {}", truncate(&line)),
                )
            })?;
            if v.get("id").and_then(Value::as_u64) != Some(id) {
                return Err(err(
                    &name,
                    op,
                    format!(
                        "reply id {} does not match request id {id}",
                        v.get("id").map_or("none".to_string(), |x| x.to_string())
                    ),
                ));
            }
            check_error(&name, op, &v)?;
            Ok(v)
        })();
        if result.is_err() {
            self.proc = None;
        }
        result
    }

    /// No retry once the step guard says the wait is over (the error kept
    /// is then the real one, not the guard's refusal).
    fn retry_refused(&self) -> bool {
        self.guard.wait(self.limits.timeout).is_err()
    }

    /// The env's expert actions for `task` (for panels without them).
    pub fn expert(&mut self, task: &Task) -> Result<Vec<String>, EnvError> {
        let v = self.request_retried("expert", json!({ "op": "expert", "task": task }))?;
        field(&self.name(), "expert", &v, "actions")?;
        Ok(strings(v.get("actions")))
    }

    /// `request` with a fresh process and another try after a failure, up
    /// to `limits.retries` times (while the step guard allows): for the
    /// requests that are safe to repeat (reset, expert).
    fn request_retried(&mut self, op: &str, body: Value) -> Result<Value, EnvError> {
        let mut last = None;
        for attempt in 0..=self.limits.retries {
            if attempt > 0 && self.retry_refused() {
                break;
            }
            if self.proc.is_none() {
                if let Err(e) = self.spawn() {
                    last = Some(e);
                    continue;
                }
            }
            match self.request(op, body.clone()) {
                Ok(v) => return Ok(v),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| err(&self.name(), op, "failed")))
    }
}

impl SubprocessEnv {
    /// The expert actions of the task this env was last reset to: a field
    /// of the reset reply, or `{"op": "expert"}` (no task) to the process
    /// that holds the reset game.
    pub fn instance_expert(&mut self, src: &ExpertSource) -> Result<Vec<String>, EnvError> {
        let name = self.name();
        let Some(reply) = &self.reset_reply else {
            return Err(err(&name, "expert", "no env reset to the task"));
        };
        match src {
            ExpertSource::ResetField(path) => super::expert_at(&name, reply, path),
            ExpertSource::Instance => {
                // Not retried: a fresh process would not hold the game.
                let v = self.request("expert", json!({ "op": "expert" }))?;
                field(&name, "expert", &v, "actions")?;
                Ok(strings(v.get("actions")))
            }
            other => Err(err(
                &name,
                "expert",
                format!("expert source {other} is not per env instance"),
            )),
        }
    }
}

fn truncate(s: &str) -> String {
    let cut: String = s.chars().take(200).collect();
    if cut.len() < s.len() {
        format!("{cut}…")
    } else {
        cut
    }
}

impl Env for SubprocessEnv {
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        let v = self.request_retried("reset", json!({ "op": "reset", "task": task }))?;
        let name = self.name();
        self.reset_reply = Some(v.clone());
        let text = field(&name, "reset", &v, "observation")?
            .as_str()
            .ok_or_else(|| err(&name, "reset", "`observation` is not a string"))?
            .to_string();
        self.status = v
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        Ok(Observation {
            text,
            admissible: strings(v.get("available_actions")),
            done: v.get("done").and_then(Value::as_bool).unwrap_or(false),
            reward: 0.0,
            success: false,
            valid: true,
            info: Default::default(),
        })
    }

    fn step(&mut self, action: &str) -> Result<Observation, EnvError> {
        let v = self.request("step", json!({ "op": "step", "action": action }))?;
        self.status = v
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        super::step_observation(&self.name(), &v, self.success_reward)
    }

    fn status(&self) -> String {
        self.status.clone()
    }
}
