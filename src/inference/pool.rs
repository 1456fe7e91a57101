//! Many engine servers behind one call: requests go to the server with the
//! fewest in flight; a server that fails (connection refused, timeout,
//! 5xx) fails the requests it had, is left alone for a back-off that
//! doubles on each further failure, and is tried again after it. The
//! policy version each server holds is tracked: only servers synced to
//! the current version get requests, and each reply says the version it
//! was generated at. A weight sync first lets the requests in flight
//! finish and holds new ones until the servers hold the new version
//! ([`Pool::begin_sync`]), so a reply never straddles two versions (a
//! multi-turn episode can, under asynchronous rollouts: its turns each
//! carry theirs).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::api::{Api, Request};
use super::{EngineError, EngineReply};
use crate::env::external::short_text as short;

/// The longest back-off.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// A set of servers speaking one API.
#[derive(Debug)]
pub struct Pool {
    api: Api,
    urls: Vec<String>,
    agent: ureq::Agent,
    max_concurrency: usize,
    retry: Duration,
    state: Mutex<State>,
    freed: Condvar,
}

#[derive(Debug, Clone)]
struct State {
    /// Per server.
    in_flight: Vec<usize>,
    down_until: Vec<Option<Instant>>,
    backoff: Vec<Duration>,
    /// The policy version each server holds.
    synced: Vec<u64>,
    /// Requests served and failed, per server (reported per step).
    served: Vec<usize>,
    failed: Vec<usize>,
    version: u64,
    /// A weight sync is under way: new requests wait for its end.
    syncing: bool,
}

/// Per-server counters since the last [`Pool::take_counts`] (a step's
/// `engine.servers` in `metrics.jsonl`).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ServerCounts {
    pub url: String,
    pub served: usize,
    pub failed: usize,
    /// Down (in back-off) right now.
    pub down: bool,
}

/// Why one request failed.
#[derive(Debug)]
enum CallError {
    /// The server is unreachable, timed out or failed (5xx): it goes down.
    Server(String),
    /// The server answered, but not with a usable reply.
    Reply(String),
    /// A 2xx reply that is not JSON (the text, and why it did not parse).
    NotJson(String, String),
}

impl CallError {
    fn message(self) -> String {
        match self {
            CallError::Server(m) | CallError::Reply(m) => m,
            CallError::NotJson(text, why) => format!("reply is not JSON ({why}): {}", short(&text)),
        }
    }
}

impl Pool {
    pub fn new(
        api: Api,
        urls: Vec<String>,
        timeout: Duration,
        max_concurrency: usize,
        retry: Duration,
    ) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        let n = urls.len();
        Pool {
            api,
            urls,
            agent,
            max_concurrency: max_concurrency.max(1),
            retry,
            state: Mutex::new(State {
                in_flight: vec![0; n],
                down_until: vec![None; n],
                backoff: vec![retry; n],
                synced: vec![0; n],
                served: vec![0; n],
                failed: vec![0; n],
                version: 0,
                syncing: false,
            }),
            freed: Condvar::new(),
        }
    }

    pub fn api(&self) -> Api {
        self.api
    }

    pub fn urls(&self) -> &[String] {
        &self.urls
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A worker that panicked leaves counters only: keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The policy version requests are served at.
    pub fn version(&self) -> u64 {
        self.lock().version
    }

    /// Start serving `version`: servers get requests again once
    /// [`Pool::mark_synced`] says they hold it.
    pub fn set_version(&self, version: u64) {
        self.lock().version = version;
    }

    /// Start a weight sync: new requests wait until [`Pool::end_sync`];
    /// returns once the requests in flight are done (or after `wait`, when
    /// a server hangs: its requests then fail on their own timeout).
    pub fn begin_sync(&self, wait: Duration) {
        let deadline = Instant::now() + wait;
        let mut s = self.lock();
        s.syncing = true;
        while s.in_flight.iter().any(|&n| n > 0) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s = self
                .freed
                .wait_timeout(s, left.min(Duration::from_millis(200)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// End a weight sync: waiting requests go to the servers that hold the
    /// new version.
    pub fn end_sync(&self) {
        self.lock().syncing = false;
        self.freed.notify_all();
    }

    /// Server `i` now holds `version` (and is up).
    pub fn mark_synced(&self, i: usize, version: u64) {
        let mut s = self.lock();
        s.synced[i] = version;
        s.down_until[i] = None;
        s.backoff[i] = self.retry;
        self.freed.notify_all();
    }

    /// Server `i` failed outside a request (a sync): down for its back-off.
    pub fn mark_failed(&self, i: usize) {
        let mut s = self.lock();
        Self::down(&mut s, i);
        self.freed.notify_all();
    }

    fn down(s: &mut State, i: usize) {
        s.down_until[i] = Some(Instant::now() + s.backoff[i]);
        s.backoff[i] = (s.backoff[i] * 2).min(MAX_BACKOFF);
    }

    /// Whether server `i` may take requests now (synced and not in
    /// back-off).
    fn eligible(s: &State, i: usize, now: Instant) -> bool {
        s.synced[i] == s.version && s.down_until[i].is_none_or(|t| t <= now)
    }

    /// A server slot and the version it holds: the eligible server with
    /// the fewest requests in flight (waits while all eligible ones are
    /// full, and while a weight sync is under way); `None` when no server
    /// is eligible.
    fn acquire(&self) -> Option<(usize, u64)> {
        let mut s = self.lock();
        loop {
            if s.syncing {
                s = self
                    .freed
                    .wait_timeout(s, Duration::from_millis(200))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                continue;
            }
            let now = Instant::now();
            let up: Vec<usize> = (0..self.urls.len())
                .filter(|&i| Self::eligible(&s, i, now))
                .collect();
            if up.is_empty() {
                return None;
            }
            if let Some(&i) = up
                .iter()
                .filter(|&&i| s.in_flight[i] < self.max_concurrency)
                .min_by_key(|&&i| (s.in_flight[i], i))
            {
                s.in_flight[i] += 1;
                return Some((i, s.synced[i]));
            }
            s = self
                .freed
                .wait_timeout(s, Duration::from_millis(200))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn release(&self, i: usize, outcome: &Result<EngineReply, CallError>) {
        let mut s = self.lock();
        s.in_flight[i] -= 1;
        match outcome {
            Ok(_) => {
                s.served[i] += 1;
                s.backoff[i] = self.retry;
            }
            Err(e) => {
                s.failed[i] += 1;
                if matches!(e, CallError::Server(_)) {
                    Self::down(&mut s, i);
                }
            }
        }
        self.freed.notify_all();
    }

    /// One reply per request, in order: `Err(reason)` for a request whose
    /// server failed (or when no server was up for it); the call fails as
    /// a whole only when every request failed and no server is up.
    pub fn generate(
        &self,
        reqs: &[Request<'_>],
    ) -> Result<Vec<Result<EngineReply, String>>, EngineError> {
        let n = reqs.len();
        let next = AtomicUsize::new(0);
        let out: Mutex<Vec<Option<Result<EngineReply, String>>>> =
            Mutex::new((0..n).map(|_| None).collect());
        let workers = n.min(self.urls.len() * self.max_concurrency).max(1);
        std::thread::scope(|sc| {
            for _ in 0..workers {
                sc.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= n {
                        break;
                    }
                    let r = match self.acquire() {
                        None => Err("no engine server is up".to_string()),
                        Some((i, version)) => {
                            let r = self.call(i, &reqs[k]);
                            self.release(i, &r);
                            r.map(|reply| EngineReply { version, ..reply })
                                .map_err(|e| format!("engine {}: {}", self.urls[i], e.message()))
                        }
                    };
                    out.lock().unwrap_or_else(|e| e.into_inner())[k] = Some(r);
                });
            }
        });
        let out: Vec<Result<EngineReply, String>> = out
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err("not sent".into())))
            .collect();
        if n > 0 && out.iter().all(Result::is_err) && self.up_count() == 0 {
            let first = out.iter().find_map(|r| r.as_ref().err()).cloned();
            return Err(EngineError::AllDown {
                servers: self.urls.len(),
                last: first.unwrap_or_default(),
            });
        }
        Ok(out)
    }

    /// Servers eligible now.
    pub fn up_count(&self) -> usize {
        let s = self.lock();
        let now = Instant::now();
        (0..self.urls.len())
            .filter(|&i| Self::eligible(&s, i, now))
            .count()
    }

    /// Per-server counters since the last call, reset.
    pub fn take_counts(&self) -> Vec<ServerCounts> {
        let mut s = self.lock();
        let now = Instant::now();
        let out = (0..self.urls.len())
            .map(|i| ServerCounts {
                url: self.urls[i].clone(),
                served: s.served[i],
                failed: s.failed[i],
                down: !Self::eligible(&s, i, now),
            })
            .collect();
        s.served.iter_mut().for_each(|x| *x = 0);
        s.failed.iter_mut().for_each(|x| *x = 0);
        out
    }

    fn call(&self, i: usize, r: &Request<'_>) -> Result<EngineReply, CallError> {
        let url = format!("{}{}", self.urls[i], self.api.route());
        let v = self.post(&url, &self.api.body(r))?;
        self.api.parse(&v, r.stop).map_err(CallError::Reply)
    }

    /// POST a JSON body; transport errors and 5xx are the server's fault,
    /// 4xx and non-JSON replies the request's.
    fn post(&self, url: &str, body: &Value) -> Result<Value, CallError> {
        let resp = self
            .agent
            .post(url)
            .send_json(body)
            .map_err(|e| CallError::Server(e.to_string()))?;
        let status = resp.status().as_u16();
        let text = resp
            .into_body()
            .read_to_string()
            .map_err(|e| CallError::Server(format!("reading the reply: {e}")))?;
        if status >= 500 {
            return Err(CallError::Server(format!(
                "HTTP {status}: {}",
                short(&text)
            )));
        }
        if status >= 400 {
            return Err(CallError::Reply(format!("HTTP {status}: {}", short(&text))));
        }
        serde_json::from_str(&text).map_err(|e| CallError::NotJson(text, e.to_string()))
    }

    /// POST `body` to `route` of server `i` (weight sync): the reply's
    /// JSON (a 2xx reply that is not JSON, as vLLM's adapter routes send,
    /// comes back as a string), or why it failed.
    pub fn post_to(&self, i: usize, route: &str, body: &Value) -> Result<Value, String> {
        match self.post(&format!("{}{route}", self.urls[i]), body) {
            Ok(v) => Ok(v),
            Err(CallError::NotJson(text, _)) => Ok(Value::String(text)),
            Err(e) => Err(e.message()),
        }
    }

    /// Whether server `i` answers its health route with 200 now.
    pub fn healthy(&self, i: usize) -> bool {
        let url = format!("{}{}", self.urls[i], self.api.health_route());
        matches!(self.agent.get(&url).call(), Ok(r) if r.status().as_u16() == 200)
    }
}
