//! llama.cpp servers started by the run: one process per server on a
//! loopback port, restarted on new weights after each optimiser step
//! (llama.cpp's server loads weights only at start; its `/lora-adapters`
//! route rescales adapters given at start but loads none): a new GGUF,
//! or, for a LoRA policy, the same base GGUF with a new `--lora` adapter.
//! A server that died is started again at the next restart.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::config::LaunchSection;
use super::EngineError;

/// What the servers are started on: a GGUF model, and for adapter sync
/// the llama.cpp LoRA GGUF applied on top of it (`--lora`).
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    pub model: PathBuf,
    pub lora: Option<PathBuf>,
}

/// The processes of a launch.
#[derive(Debug)]
pub struct Launched {
    program: String,
    threads: usize,
    slots: usize,
    ctx_per_slot: usize,
    args: Vec<String>,
    ports: Vec<u16>,
    children: Vec<Option<Child>>,
    /// Where server `i` logs (`server-<i>.log`) and the pid file.
    dir: PathBuf,
}

impl Launched {
    /// Start `l.count` servers on `served`, each with `slots` parallel
    /// sequences of `ctx_per_slot` tokens. Returns once they are spawned
    /// (see [`Launched::wait_ready`]).
    pub fn start(
        l: &LaunchSection,
        slots: usize,
        ctx_per_slot: usize,
        served: &Served,
        dir: &Path,
    ) -> Result<Self, EngineError> {
        let mut ports = Vec::with_capacity(l.count);
        // Free ports now; kept for the run's life (restarts reuse them).
        let listeners: Vec<std::net::TcpListener> = (0..l.count)
            .map(|_| std::net::TcpListener::bind(("127.0.0.1", 0)))
            .collect::<Result<_, _>>()?;
        for li in &listeners {
            ports.push(li.local_addr()?.port());
        }
        drop(listeners);
        let mut la = Launched {
            program: l.program.clone(),
            threads: l.threads,
            slots: slots.max(1),
            ctx_per_slot: ctx_per_slot.max(64),
            args: l.args.clone(),
            ports,
            children: (0..l.count).map(|_| None).collect(),
            dir: dir.to_path_buf(),
        };
        for i in 0..l.count {
            la.spawn(i, served)?;
        }
        la.write_pids()?;
        Ok(la)
    }

    /// The servers' base URLs.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect()
    }

    /// Process ids of the running servers (`engine/servers.json` too).
    pub fn pids(&self) -> Vec<Option<u32>> {
        self.children
            .iter()
            .map(|c| c.as_ref().map(Child::id))
            .collect()
    }

    fn spawn(&mut self, i: usize, served: &Served) -> Result<(), EngineError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("server-{i}.log")))?;
        let mut cmd = Command::new(&self.program);
        cmd.arg("-m").arg(&served.model);
        if let Some(lora) = &served.lora {
            cmd.arg("--lora").arg(lora);
        }
        cmd.args(["--host", "127.0.0.1", "--port"])
            .arg(self.ports[i].to_string())
            .arg("-t")
            .arg(self.threads.to_string())
            .arg("-np")
            .arg(self.slots.to_string())
            .arg("-c")
            .arg((self.slots * self.ctx_per_slot).to_string())
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // Killed with the run, however the run ends (a SIGKILLed run runs
        // no destructor).
        let child = crate::children::spawn(cmd)
            .map_err(|e| EngineError::Setup(format!("starting {}: {e}", self.program)))?;
        self.children[i] = Some(child);
        Ok(())
    }

    /// The last lines of server `i`'s log, for messages.
    fn log_tail(&self, i: usize) -> String {
        let text =
            std::fs::read_to_string(self.dir.join(format!("server-{i}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = lines[lines.len().saturating_sub(10)..].join(" | ");
        if tail.is_empty() {
            String::new()
        } else {
            format!(" — log: {tail}")
        }
    }

    fn write_pids(&self) -> Result<(), EngineError> {
        let v = serde_json::json!({ "urls": self.urls(), "pids": self.pids() });
        std::fs::write(self.dir.join("servers.json"), v.to_string())?;
        Ok(())
    }

    /// Wait until every server answers `/health` with 200 (or exits).
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<(), EngineError> {
        let ready = self.wait_each(timeout);
        let bad: Vec<String> = ready
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                r.as_ref()
                    .err()
                    .map(|e| format!("server {i}: {e}{}", self.log_tail(i)))
            })
            .collect();
        if bad.is_empty() {
            Ok(())
        } else {
            Err(EngineError::Setup(format!(
                "llama.cpp servers did not start ({}; logs in {})",
                bad.join("; "),
                self.dir.display()
            )))
        }
    }

    fn wait_each(&mut self, timeout: Duration) -> Vec<Result<(), String>> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .http_status_as_error(false)
            .build()
            .into();
        let urls = self.urls();
        let deadline = Instant::now() + timeout;
        let mut out: Vec<Option<Result<(), String>>> = vec![None; urls.len()];
        while out.iter().any(Option::is_none) {
            for (i, url) in urls.iter().enumerate() {
                if out[i].is_some() {
                    continue;
                }
                if let Some(c) = self.children[i].as_mut() {
                    if let Ok(Some(st)) = c.try_wait() {
                        out[i] = Some(Err(format!("exited ({st})")));
                        self.children[i] = None;
                        continue;
                    }
                }
                if matches!(agent.get(&format!("{url}/health")).call(), Ok(r) if r.status().as_u16() == 200)
                {
                    out[i] = Some(Ok(()));
                }
            }
            if Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        out.into_iter()
            .map(|r| {
                r.unwrap_or_else(|| Err(format!("not ready after {:.0} s", timeout.as_secs_f64())))
            })
            .collect()
    }

    /// Stop every server and start it again on `served`; per server,
    /// ready or why not.
    pub fn restart(&mut self, served: &Served, timeout: Duration) -> Vec<Result<(), String>> {
        self.stop();
        let spawned: Vec<Result<(), String>> = (0..self.ports.len())
            .map(|i| self.spawn(i, served).map_err(|e| e.to_string()))
            .collect();
        let _ = self.write_pids();
        let ready = self.wait_each(timeout);
        spawned
            .into_iter()
            .zip(ready)
            .map(|(s, r)| s.and(r))
            .collect()
    }

    /// Kill every server and reap it.
    pub fn stop(&mut self) {
        for c in self.children.iter_mut() {
            if let Some(mut c) = c.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        self.stop();
    }
}
