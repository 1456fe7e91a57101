//! The HTTP connections of an external env: how requests reach an
//! ordinary server intact, what is retried, and what the envs of one run
//! share about their server.
//!
//! **One write per request.** ureq sends a request's head and its body in
//! two writes. Against a server with a small listen backlog (Python's
//! `http.server` listens with 5) under SYN cookies, the kernel may drop the
//! segment that carries the head while the accept queue is full and then
//! answer the body's segment, whose sequence number fails the cookie
//! check, with a reset: the client reads "connection reset by peer" and
//! the server never saw the request. [`Coalescing`] holds a request's
//! bytes until ureq waits for the reply and sends them in one write, so
//! a request that fits one segment arrives whole or not at all (and TCP
//! retransmits it). Measured with 16 threads × 200 requests against a
//! `ThreadingHTTPServer`: 3–4 resets per 3,200 with split writes, 0 with
//! one write.
//!
//! **Failures before sending** ([`NotSent`]): a connection refused, reset
//! or timed out while it was being opened carries no request, so it may
//! be retried even for `step`.
//!
//! **Shared limits** ([`Connections`], shared by every env built from one
//! spec): when connection failures repeat, the requests in flight at once
//! are capped at half of what they were, and the run says so once; and
//! envs whose `close` was skipped (after a timeout) are kept to be closed
//! at the end of the step, or listed.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ureq::unversioned::resolver::DefaultResolver;
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, DefaultConnector, NextTimeout, Transport,
};

/// An agent whose requests go out in one write each (see the module
/// docs) and whose connect-phase failures are [`NotSent`].
pub fn agent(config: ureq::config::Config) -> ureq::Agent {
    ureq::Agent::with_parts(
        config,
        Coalescing(DefaultConnector::default()),
        DefaultResolver::default(),
    )
}

/// A connection that failed while it was being opened: no byte of the
/// request left this machine.
#[derive(Debug)]
pub struct NotSent(pub std::io::Error);

impl std::fmt::Display for NotSent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "could not connect: {}", self.0)
    }
}

impl std::error::Error for NotSent {}

/// Whether a ureq error happened before the request was sent.
pub fn not_sent(e: &ureq::Error) -> bool {
    match e {
        ureq::Error::Other(b) => b.is::<NotSent>(),
        ureq::Error::ConnectionFailed => true,
        ureq::Error::Timeout(ureq::Timeout::Connect | ureq::Timeout::Resolve) => true,
        _ => false,
    }
}

/// Whether a ureq error is the server's side dropping connections (refused
/// or reset), the sign of a server past what it sustains.
pub fn dropped(e: &ureq::Error) -> bool {
    use std::io::ErrorKind::*;
    match e {
        ureq::Error::Other(b) => b.is::<NotSent>(),
        ureq::Error::Io(io) => matches!(
            io.kind(),
            ConnectionReset | ConnectionRefused | ConnectionAborted | BrokenPipe
        ),
        ureq::Error::ConnectionFailed => true,
        _ => false,
    }
}

/// The default connector, its transports wrapped in [`OneWrite`] and its
/// I/O failures marked [`NotSent`].
#[derive(Debug)]
struct Coalescing(DefaultConnector);

impl Connector<()> for Coalescing {
    type Out = OneWrite;

    fn connect(
        &self,
        details: &ConnectionDetails,
        chained: Option<()>,
    ) -> Result<Option<OneWrite>, ureq::Error> {
        match self.0.connect(details, chained) {
            Ok(t) => Ok(t.map(|inner| OneWrite {
                inner,
                pending: Vec::new(),
            })),
            Err(ureq::Error::Io(e)) => Err(ureq::Error::Other(Box::new(NotSent(e)))),
            Err(e) => Err(e),
        }
    }
}

/// A transport that sends what ureq writes only when ureq waits for the
/// reply, in as few writes as the output buffer allows (one for any env
/// request).
#[derive(Debug)]
struct OneWrite {
    inner: Box<dyn Transport>,
    pending: Vec<u8>,
}

impl OneWrite {
    fn flush(&mut self, timeout: NextTimeout) -> Result<(), ureq::Error> {
        while !self.pending.is_empty() {
            let out = self.inner.buffers().output();
            let n = out.len().min(self.pending.len());
            out[..n].copy_from_slice(&self.pending[..n]);
            self.inner.transmit_output(n, timeout)?;
            self.pending.drain(..n);
        }
        Ok(())
    }
}

impl Transport for OneWrite {
    fn buffers(&mut self) -> &mut dyn Buffers {
        self.inner.buffers()
    }

    fn transmit_output(&mut self, amount: usize, _: NextTimeout) -> Result<(), ureq::Error> {
        let out = self.inner.buffers().output();
        self.pending.extend_from_slice(&out[..amount]);
        Ok(())
    }

    fn maybe_await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        self.flush(timeout)?;
        if self.inner.buffers().can_use_input() {
            return Ok(true);
        }
        self.inner.await_input(timeout)
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        self.flush(timeout)?;
        self.inner.await_input(timeout)
    }

    fn is_open(&mut self) -> bool {
        self.inner.is_open()
    }

    fn is_tls(&self) -> bool {
        self.inner.is_tls()
    }
}

/// An env whose `close` was skipped: the server, its id field and value,
/// and the task it last ran.
#[derive(Debug, Clone, PartialEq)]
pub struct LeftOpen {
    pub base: String,
    pub id_field: String,
    pub id: serde_json::Value,
    pub task: String,
}

#[derive(Debug, Default)]
struct State {
    /// Requests in flight now, and the cap (None: only env.concurrency).
    in_flight: usize,
    cap: Option<usize>,
    /// Connection failures since the cap last changed.
    drops: usize,
    /// The message to show once, not yet taken; whether it was shown.
    notice: Option<String>,
    said: bool,
    left_open: Vec<LeftOpen>,
}

/// What the envs built from one spec share about their server: the cap on
/// requests in flight and the envs left open. Cloning shares it; every
/// value compares equal (run-time state, not a setting).
#[derive(Debug, Clone, Default)]
pub struct Connections(Arc<(Mutex<State>, Condvar)>);

impl PartialEq for Connections {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// Connection failures within one cap before it is lowered.
const DROPS_BEFORE_CAP: usize = 2;

/// A request slot, given back when dropped.
pub struct Slot<'a>(&'a Connections);

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let (m, cv) = &*self.0 .0;
        let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
        s.in_flight -= 1;
        cv.notify_all();
    }
}

impl Connections {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Plain field writes: a poisoned lock is still consistent.
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait (at most `wait`) for a slot under the cap; `None` when the wait
    /// ran out.
    pub fn slot(&self, wait: Duration) -> Option<Slot<'_>> {
        let (_, cv) = &*self.0;
        let s = self.state();
        let (mut s, timeout) = cv
            .wait_timeout_while(s, wait, |s| s.cap.is_some_and(|c| s.in_flight >= c))
            .unwrap_or_else(|p| p.into_inner());
        if timeout.timed_out() && s.cap.is_some_and(|c| s.in_flight >= c) {
            return None;
        }
        s.in_flight += 1;
        Some(Slot(self))
    }

    /// A request's connection was refused or reset (`base` names the
    /// server). When that repeats, the cap becomes half the requests in
    /// flight (at least 1).
    pub fn dropped(&self, base: &str) {
        let mut s = self.state();
        s.drops += 1;
        if s.drops < DROPS_BEFORE_CAP {
            return;
        }
        let was = s.cap.unwrap_or(s.in_flight).max(1);
        let cap = (was / 2).max(1);
        if s.cap == Some(cap) {
            return;
        }
        s.cap = Some(cap);
        s.drops = 0;
        if !s.said {
            s.said = true;
            s.notice = Some(format!(
                "env {base}: connections were refused or reset {DROPS_BEFORE_CAP} times with \
                 {was} request(s) in flight; at most {cap} at once from now on (lower \
                 env.concurrency to start there)"
            ));
        }
    }

    /// The cap on requests in flight, if lowered.
    pub fn cap(&self) -> Option<usize> {
        self.state().cap
    }

    /// The message about a lowered cap, once.
    pub fn take_notice(&self) -> Option<String> {
        self.state().notice.take()
    }

    /// An env whose `close` was skipped.
    pub fn left_open(&self, env: LeftOpen) {
        self.state().left_open.push(env);
    }

    /// Close the envs whose `close` was skipped, each waiting at most
    /// `wait` for its reply; after the first that fails, the rest are not
    /// tried. Returns those not closed, with why.
    pub fn close_left_open(&self, wait: Duration) -> Vec<(LeftOpen, String)> {
        let list = std::mem::take(&mut self.state().left_open);
        let agent = agent(
            ureq::Agent::config_builder()
                .timeout_global(Some(wait))
                .http_status_as_error(false)
                .build(),
        );
        let mut failed: Option<String> = None;
        let mut out = Vec::new();
        for env in list {
            if let Some(why) = &failed {
                out.push((env, format!("not tried: {why}")));
                continue;
            }
            let mut body = serde_json::Map::new();
            body.insert(env.id_field.clone(), env.id.clone());
            let r = agent
                .post(&format!("{}/close", env.base))
                .send_json(serde_json::Value::Object(body));
            match r {
                Ok(resp) if resp.status().is_success() => {}
                Ok(resp) => {
                    let why = format!("close of env {} got HTTP {}", env.id, resp.status());
                    out.push((env, why));
                }
                Err(e) => {
                    let why = format!("close of env {} failed: {e}", env.id);
                    failed = Some(why.clone());
                    out.push((env, why));
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn repeated_drops_halve_the_requests_in_flight_and_say_so_once() {
        let c = Connections::default();
        let slots: Vec<Slot> = (0..16)
            .map(|_| c.slot(Duration::from_secs(1)).unwrap())
            .collect();
        c.dropped("http://x");
        assert_eq!(c.cap(), None, "one reset is not a pattern");
        c.dropped("http://x");
        assert_eq!(c.cap(), Some(8));
        let note = c.take_notice().unwrap();
        assert!(
            note.contains("with 16 request(s) in flight; at most 8 at once"),
            "{note}"
        );
        assert_eq!(c.take_notice(), None);
        // Full: a new request waits, and gets its slot when one is given back.
        drop(slots);
        let held: Vec<Slot> = (0..8)
            .map(|_| c.slot(Duration::from_secs(1)).unwrap())
            .collect();
        assert!(c.slot(Duration::from_millis(20)).is_none());
        c.dropped("http://x");
        c.dropped("http://x");
        assert_eq!(c.cap(), Some(4));
        assert_eq!(c.take_notice(), None, "said once");
        drop(held);
        for _ in 0..10 {
            c.dropped("http://x");
        }
        assert_eq!(c.cap(), Some(1), "never below one");
        assert!(c.slot(Duration::from_millis(20)).is_some());
    }

    /// A transport that records what it is asked to send.
    #[derive(Debug)]
    struct Recording {
        bufs: ureq::unversioned::transport::LazyBuffers,
        sent: Arc<Mutex<Vec<Vec<u8>>>>,
    }

    impl Transport for Recording {
        fn buffers(&mut self) -> &mut dyn Buffers {
            &mut self.bufs
        }
        fn transmit_output(&mut self, amount: usize, _: NextTimeout) -> Result<(), ureq::Error> {
            let out = self.bufs.output()[..amount].to_vec();
            self.sent.lock().unwrap().push(out);
            Ok(())
        }
        fn await_input(&mut self, _: NextTimeout) -> Result<bool, ureq::Error> {
            Ok(false)
        }
        fn is_open(&mut self) -> bool {
            true
        }
    }

    #[test]
    fn a_request_goes_out_in_one_write_and_a_refused_connection_is_not_sent() {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let mut t = OneWrite {
            inner: Box::new(Recording {
                bufs: ureq::unversioned::transport::LazyBuffers::new(64, 8),
                sent: sent.clone(),
            }),
            pending: Vec::new(),
        };
        // ureq writes the head, then the body, each into the output buffer.
        for part in ["POST /step HTTP/1.1\r\n\r\n", "{\"a\":1}"] {
            for chunk in part.as_bytes().chunks(8) {
                t.buffers().output()[..chunk.len()].copy_from_slice(chunk);
                t.transmit_output(chunk.len(), NextTimeout::default())
                    .unwrap();
            }
        }
        assert!(
            sent.lock().unwrap().is_empty(),
            "nothing leaves before the reply is awaited"
        );
        t.await_input(NextTimeout::default()).unwrap();
        let sent = sent.lock().unwrap().concat();
        assert_eq!(
            String::from_utf8(sent).unwrap(),
            "POST /step HTTP/1.1\r\n\r\n{\"a\":1}"
        );
        // With an output buffer as large as the request, it is one write.
        let one = Arc::new(Mutex::new(Vec::new()));
        let mut t = OneWrite {
            inner: Box::new(Recording {
                bufs: ureq::unversioned::transport::LazyBuffers::new(64, 4096),
                sent: one.clone(),
            }),
            pending: Vec::new(),
        };
        for part in ["POST /step HTTP/1.1\r\n\r\n", "{\"a\":1}"] {
            t.buffers().output()[..part.len()].copy_from_slice(part.as_bytes());
            t.transmit_output(part.len(), NextTimeout::default())
                .unwrap();
        }
        t.maybe_await_input(NextTimeout::default()).unwrap();
        assert_eq!(one.lock().unwrap().len(), 1);

        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let a = agent(ureq::Agent::config_builder().build());
        // Nothing listens on the port now.
        let e = a
            .post(&format!("http://127.0.0.1:{port}/step"))
            .send_json(serde_json::json!({}))
            .unwrap_err();
        assert!(not_sent(&e) && dropped(&e), "{e:?}");
        assert!(e.to_string().contains("could not connect"), "{e}");
    }

    #[test]
    fn envs_left_open_are_closed_or_listed_with_why() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", l.local_addr().unwrap());
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            std::thread::sleep(Duration::from_millis(50));
            let mut buf = vec![0u8; 4096];
            let n = s.read(&mut buf).unwrap();
            write!(s, "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{{}}").unwrap();
            String::from_utf8_lossy(&buf[..n]).to_string()
        });
        let gone = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}", l.local_addr().unwrap())
        };
        let c = Connections::default();
        let env = |base: &str, id: u64, task: &str| LeftOpen {
            base: base.into(),
            id_field: "env_idx".into(),
            id: id.into(),
            task: task.into(),
        };
        c.left_open(env(&base, 3, "a"));
        c.left_open(env(&gone, 4, "b"));
        c.left_open(env(&base, 5, "c"));
        let open = c.close_left_open(Duration::from_secs(2));
        let got = server.join().unwrap();
        assert!(got.starts_with("POST /close"), "{got}");
        let body: serde_json::Value =
            serde_json::from_str(got.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body, serde_json::json!({"env_idx": 3}));
        assert_eq!(open.len(), 2);
        assert_eq!(open[0].0.task, "b");
        assert!(open[0].1.contains("close of env 4 failed"), "{}", open[0].1);
        assert_eq!(open[1].0.task, "c");
        assert!(
            open[1].1.starts_with("not tried: close of env 4"),
            "{}",
            open[1].1
        );
        assert!(c.close_left_open(Duration::from_secs(1)).is_empty());
    }
}
