//! Data-parallel runs (docs/DISTRIBUTED.md): `actguide run EXP --devices
//! D0,D1,…` trains one policy with one process per device.
//!
//! The process the user starts is rank 0: it owns the run directory, the
//! guidance scripts, evaluation and checkpoints, exactly as a one-process
//! run. It starts the other ranks (`actguide dp-worker`), which build the
//! same policy from the run's `experiment.json` (same seed, same weights)
//! and then only serve rank 0's commands:
//!
//! - **rollouts**: every rollout batch the guidance drive asks for is split
//!   by task group (task `i` of the step on rank `i % world`); each rank
//!   rolls out its share from its own random stream and sends the episodes
//!   to rank 0, which puts them back in request order. Scripts only ever
//!   see the whole batch, so hot reload stays one edit on rank 0.
//! - **training**: rank 0 sends the step's samples; every rank scores its
//!   share of the micro-batches and the trainer sums gradients over ranks
//!   before clipping, so every rank takes the same AdamW step and the
//!   weights stay identical without ever being sent.
//!
//! Same seed and same device list give the same numbers; a different
//! number of ranks gives other random streams (and float sums in another
//! order). A rank that fails or leaves fails the run at its next exchange
//! with its rank named; resume from the last checkpoint, with any number
//! of devices.

use std::borrow::Cow;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Ctx, RunError, RunOptions};
use crate::distributed::launch::{self, Launch};
use crate::distributed::{Collective, TcpGroup};
use crate::env::{Env, Task};
use crate::experiment::config::Experiment;
use crate::guidance::ResolvedSpec;
use crate::model::device::DeviceSpec;
use crate::model::{Policy, Tok};
use crate::rollout::{self, Episode, EpisodeRequest, RolloutOptions, RolloutStats};
use crate::rundir::checkpoint;
use crate::seed;
use crate::train::Sample;

/// How long a rank waits for a peer: rank 0 evaluates and checkpoints
/// while the others wait, so this is generous; a peer that *exits* is
/// noticed at once (its connection closes).
pub(super) const PEER_TIMEOUT: Duration = Duration::from_secs(3600);

/// How long rank 0 waits for the other ranks to start and join, and a
/// rank for the rendezvous to answer (`--join-timeout`).
pub const JOIN_TIMEOUT: Duration = Duration::from_secs(300);

/// Where this run's ranks are: this node's devices, and the nodes.
pub(super) struct Placement {
    /// This node's devices (at least one).
    pub(super) devices: Vec<DeviceSpec>,
    pub(super) launch: Option<Launch>,
    pub(super) join_timeout: Duration,
    /// Rank 0's device, as the run resolved it.
    pub(super) rank0_device: DeviceSpec,
}

impl Placement {
    pub(super) fn of(opts: &RunOptions) -> Self {
        Placement {
            devices: if opts.devices.is_empty() {
                vec![DeviceSpec::Cpu]
            } else {
                opts.devices.clone()
            },
            launch: opts.launch.clone(),
            join_timeout: opts.join_timeout.unwrap_or(JOIN_TIMEOUT),
            rank0_device: opts.devices.first().copied().unwrap_or(DeviceSpec::Cpu),
        }
    }
    pub(super) fn per_node(&self) -> usize {
        self.devices.len().max(1)
    }
    pub(super) fn nodes(&self) -> usize {
        self.launch.as_ref().map_or(1, |l| l.nodes)
    }
    pub(super) fn node(&self) -> usize {
        self.launch.as_ref().map_or(0, |l| l.node)
    }
    pub(super) fn world(&self) -> usize {
        self.nodes() * self.per_node()
    }
}

/// What every rank gets from rank 0 once all have joined: the run's
/// resolved experiment, and on resume the checkpoint to start from
/// (read from rank 0's run directory on node 0; its files follow as
/// broadcasts for the other nodes, which need not share a file system).
#[derive(Serialize, Deserialize)]
pub(super) struct Setup {
    pub(super) experiment: serde_json::Value,
    pub(super) checkpoint: Option<PathBuf>,
    /// The checkpoint's files (paths relative to it), sent one broadcast
    /// each after this message.
    pub(super) files: Vec<PathBuf>,
}

impl Setup {
    fn new(
        exp: &Experiment,
        checkpoint: Option<PathBuf>,
        send_files: bool,
    ) -> Result<Self, RunError> {
        let experiment = serde_json::to_value(exp)
            .map_err(|e| RunError::Ranks(format!("cannot encode the experiment: {e}")))?;
        let files = match (&checkpoint, send_files) {
            (Some(dir), true) => files_under(dir)?,
            _ => Vec::new(),
        };
        Ok(Setup {
            experiment,
            checkpoint,
            files,
        })
    }
}

/// Every file under `dir`, relative to it, in name order.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>, RunError> {
    let mut out = Vec::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let here = dir.join(&rel);
        let rd = std::fs::read_dir(&here)
            .map_err(|e| RunError::Ranks(format!("cannot list {}: {e}", here.display())))?;
        for e in rd.flatten() {
            let r = rel.join(e.file_name());
            match e.file_type() {
                Ok(t) if t.is_dir() => todo.push(r),
                Ok(t) if t.is_file() => out.push(r),
                _ => {}
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Rank 0: the [`Setup`], then the checkpoint's files it lists.
fn send_setup(tcp: &TcpGroup, setup: &Setup) -> Result<(), RunError> {
    tcp.broadcast(encode(setup)?)?;
    if let Some(dir) = &setup.checkpoint {
        for f in &setup.files {
            let p = dir.join(f);
            let bytes = std::fs::read(&p)
                .map_err(|e| RunError::Ranks(format!("cannot read {}: {e}", p.display())))?;
            tcp.broadcast(bytes)?;
        }
    }
    Ok(())
}

/// Every rank's device name, in rank order; CPU and CUDA ranks cannot be
/// mixed (one transport for the whole group).
pub(super) fn gather_devices(tcp: &TcpGroup, mine: DeviceSpec) -> Result<Vec<String>, RunError> {
    let all = tcp.all_gather(mine.to_string().into_bytes())?;
    let names: Vec<String> = all
        .iter()
        .map(|b| String::from_utf8_lossy(b).into_owned())
        .collect();
    let cuda = |n: &str| n.starts_with("cuda");
    if let Some(r) = names.iter().position(|n| cuda(n) != cuda(&names[0])) {
        return Err(RunError::Ranks(format!(
            "{} is on {} but rank 0 on {}: mixing CPU and CUDA ranks is not supported",
            tcp.name(r),
            names[r],
            names[0]
        )));
    }
    Ok(names)
}

/// Node 0's rendezvous socket: every interface, on the port of `addr`
/// (the other nodes reach it by the host name or address they were told).
fn bind_rendezvous(addr: &str) -> std::io::Result<TcpListener> {
    let port = launch::port_of(addr).unwrap_or(0);
    let any = if addr.starts_with('[') {
        "[::]"
    } else {
        "0.0.0.0"
    };
    TcpListener::bind(format!("{any}:{port}")).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("{any}:{port} (for --rendezvous {addr}): {e}"),
        )
    })
}

/// Start the ranks of node `node` after its first (`dp-worker`
/// processes, killed with this one), joining at `addr`.
pub(super) fn spawn_local(
    exe: &Path,
    place: &Placement,
    node: usize,
    addr: &str,
) -> Result<Vec<Child>, RunError> {
    let per = place.per_node();
    let mut workers = Vec::new();
    for (i, d) in place.devices.iter().enumerate().skip(1) {
        let rank = node * per + i;
        let mut p = Process::new(exe);
        p.args(["dp-worker", "--rank", &rank.to_string()])
            .args(["--world", &place.world().to_string(), "--rendezvous", addr])
            .args(["--node", &node.to_string()])
            .args([
                "--join-timeout",
                &place.join_timeout.as_secs().max(1).to_string(),
            ])
            .args(["--device", &d.to_string()]);
        // Killed with this process, however it ends.
        let child = crate::children::spawn(p).map_err(|e| {
            RunError::Ranks(format!("cannot start rank {rank} ({}): {e}", exe.display()))
        })?;
        workers.push(child);
    }
    Ok(workers)
}

/// The SHA-256 of a policy's trained tensors (names and f32 bytes, in
/// name order).
pub(super) fn weights_digest(policy: &Policy) -> Result<String, RunError> {
    use sha2::{Digest, Sha256};
    let mut vars = policy.named_vars();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut h = Sha256::new();
    for (name, v) in vars {
        h.update(name.as_bytes());
        let xs = v
            .as_tensor()
            .to_dtype(candle_core::DType::F32)
            .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
            .map_err(crate::distributed::CollectiveError::from)?;
        for x in xs {
            h.update(x.to_le_bytes());
        }
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Rank 0's command to the other ranks (borrowed when sent, owned when
/// received, so sending copies nothing).
#[derive(Serialize, Deserialize)]
pub(super) enum Command<'a> {
    /// Roll out `shares[rank]`: (train-panel index, spec) per episode.
    Rollout {
        step: usize,
        call: u64,
        shares: Cow<'a, [Vec<(usize, ResolvedSpec)>]>,
    },
    /// One trainer step on these samples (every rank gets all of them).
    Train {
        step: usize,
        samples: Cow<'a, [Sample]>,
    },
    /// Every rank sends the digest of its trained weights.
    Digest,
    /// The run is over.
    Stop,
}

/// One rank's rollouts.
#[derive(Serialize, Deserialize)]
pub(super) struct Share {
    episodes: Vec<Episode>,
    prompt_tokens: usize,
    generated_tokens: usize,
    generate_calls: usize,
    seconds: f64,
}

/// Rank 0's side: the group and the worker processes of its node.
pub(super) struct Ranks {
    coll: Arc<dyn Collective>,
    workers: Vec<Child>,
    /// Every rank's device, in rank order, as the ranks reported them.
    devices: Vec<String>,
    nodes: usize,
    /// Where the ranks joined.
    rendezvous: String,
}

/// Beside a checkpoint of a data-parallel run: each rank's weight digest.
pub const RANKS_FILE: &str = "ranks.json";

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ranks(world {})", self.coll.world())
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        reap(&mut self.workers);
    }
}

/// Workers never outlive the process that started them: after `Stop`
/// they exit by themselves; on an error path they are killed.
pub(super) fn reap(workers: &mut [Child]) {
    for w in workers {
        if matches!(w.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(200));
            if matches!(w.try_wait(), Ok(None)) {
                let _ = w.kill();
            }
        }
        let _ = w.wait();
    }
}

/// Rank 0's device: the first of `--devices`; without them the
/// experiment's, a CUDA one numbered by the launcher's local rank.
pub(super) fn rank0_device(exp: &Experiment, opts: &RunOptions) -> DeviceSpec {
    match (opts.devices.first(), exp.model.device, &opts.launch) {
        (Some(d), _, _) => *d,
        (None, DeviceSpec::Cuda(_), Some(l)) => DeviceSpec::Cuda(l.local_rank.unwrap_or(0)),
        (None, d, _) => d,
    }
}

/// What `--devices` may ask for in this build and experiment.
pub(super) fn check(exp: &Experiment, devices: &[DeviceSpec]) -> Result<(), RunError> {
    if devices.iter().any(|d| matches!(d, DeviceSpec::Cuda(_))) && !cfg!(feature = "nccl") {
        return Err(RunError::Ranks(
            "several CUDA devices need the NCCL transport: build with `--features nccl`".into(),
        ));
    }
    if devices.iter().any(|d| matches!(d, DeviceSpec::Cuda(_)))
        && devices.iter().any(|d| matches!(d, DeviceSpec::Cpu))
    {
        return Err(RunError::Ranks(
            "mixing CPU and CUDA ranks is not supported: list only cuda:N or only cpu".into(),
        ));
    }
    if exp.guidance.intervene.is_some() {
        return Err(RunError::Ranks(
            "an intervention script runs inside every policy turn, on rank 0 only: \
             run it on one device"
                .into(),
        ));
    }
    if exp.rollout.engine.is_some() {
        return Err(RunError::Ranks(
            "rollout.engine generates on engine servers: run it on one device (no --devices)"
                .into(),
        ));
    }
    Ok(())
}

impl Ranks {
    /// Start this node's other ranks (`exe dp-worker …`), wait until
    /// every rank of every node joins, and open the group (NCCL on CUDA
    /// devices) after sending each rank the run's [`Setup`].
    fn launch(
        exe: &Path,
        place: &Placement,
        setup: &Setup,
        device: &candle_core::Device,
        interrupt: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<Self, RunError> {
        let world = place.world();
        let io =
            |e: std::io::Error| RunError::Ranks(format!("cannot open the rendezvous port: {e}"));
        let listener = match &place.launch {
            None => TcpListener::bind("127.0.0.1:0"),
            Some(l) => bind_rendezvous(&l.rendezvous),
        }
        .map_err(io)?;
        let port = listener.local_addr().map_err(io)?.port();
        let workers = spawn_local(exe, place, 0, &format!("127.0.0.1:{port}"))?;
        let rendezvous = match &place.launch {
            Some(l) => l.rendezvous.clone(),
            None => format!("127.0.0.1:{port}"),
        };
        // From here on, dropping `ranks` stops the workers.
        let mut ranks = Ranks {
            coll: Arc::new(crate::distributed::Single),
            workers,
            devices: Vec::new(),
            nodes: place.nodes(),
            rendezvous,
        };
        let workers = &mut ranks.workers;
        let per_node = place.launch.as_ref().map(|_| place.per_node());
        let tcp =
            TcpGroup::host_watching(listener, world, per_node, place.join_timeout, &mut || {
                workers
                    .iter_mut()
                    .enumerate()
                    .find_map(|(i, w)| match w.try_wait() {
                        Ok(Some(status)) => Some(format!(
                            "rank {} exited before joining ({status}); its error is printed above",
                            i + 1
                        )),
                        _ => None,
                    })
            })?;
        // A stopped worker (SIGSTOP) must not hold rank 0 for the whole
        // peer timeout, nor an interrupt for longer than a second.
        let pids: Vec<u32> = ranks.workers.iter().map(|w| w.id()).collect();
        tcp.watch_peers(
            interrupt,
            Arc::new(move |r| pids.get(r.wrapping_sub(1)).is_some_and(|&p| stopped(p))),
        );
        tcp.set_peer_timeout(PEER_TIMEOUT)?;
        send_setup(&tcp, setup)?;
        ranks.devices = gather_devices(&tcp, place.rank0_device)?;
        ranks.coll = group(tcp, device)?;
        Ok(ranks)
    }

    /// Start the other ranks of the run of `ctx` (set up, memory-checked)
    /// on `opts.devices` and the other nodes of `opts.launch`, and point
    /// its trainer at the group.
    pub(super) fn start(ctx: &mut Ctx, opts: &RunOptions) -> Result<Self, RunError> {
        let exe = match &opts.worker_program {
            Some(p) => p.clone(),
            None => worker_program()?,
        };
        let place = Placement {
            rank0_device: ctx.exp.model.device,
            ..Placement::of(opts)
        };
        let checkpoint = match &opts.resume {
            Some(dir) => Some(checkpoint::latest_dir(dir)?),
            None => None,
        };
        let setup = Setup::new(&ctx.exp, checkpoint, place.nodes() > 1)?;
        let r = Ranks::launch(
            &exe,
            &place,
            &setup,
            ctx.policy.device(),
            opts.interrupt.clone(),
        )?;
        ctx.trainer.set_collective(r.coll.clone());
        Ok(r)
    }

    /// `data-parallel: 2 ranks on cuda, cuda (rendezvous 127.0.0.1:PORT)`,
    /// or with nodes `data-parallel: 4 ranks on 2 nodes (node 0: cpu, cpu;
    /// node 1: …) (rendezvous …)`.
    pub(super) fn describe(&self) -> String {
        let n = self.devices.len();
        let at = format!("(rendezvous {})", self.rendezvous);
        if self.nodes <= 1 {
            return format!(
                "data-parallel: {n} ranks on {} {at}",
                self.devices.join(", ")
            );
        }
        let per = n / self.nodes;
        let nodes: Vec<String> = self
            .devices
            .chunks(per.max(1))
            .enumerate()
            .map(|(i, d)| format!("node {i}: {}", d.join(", ")))
            .collect();
        format!(
            "data-parallel: {n} ranks on {} nodes ({}) {at}",
            self.nodes,
            nodes.join("; ")
        )
    }

    /// After a checkpoint: every rank's digest of its trained weights,
    /// which must all equal rank 0's (the ranks never send weights, so
    /// this is what shows they did not drift). Written beside the
    /// checkpoint as `ranks.json`.
    pub(super) fn agree(&self, policy: &Policy, dir: &Path) -> Result<(), RunError> {
        self.send(&Command::Digest)?;
        let all = self.coll.all_gather(weights_digest(policy)?.into_bytes())?;
        let digests: Vec<String> = all
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect();
        let per = self.devices.len() / self.nodes.max(1);
        let record: Vec<serde_json::Value> = digests
            .iter()
            .zip(&self.devices)
            .enumerate()
            .map(|(r, (d, dev))| {
                serde_json::json!({"rank": r, "node": r / per.max(1), "device": dev, "weights_sha256": d})
            })
            .collect();
        let text = serde_json::to_string_pretty(&record)
            .map_err(|e| RunError::Ranks(format!("cannot encode ranks.json: {e}")))?;
        std::fs::write(dir.join(RANKS_FILE), text + "\n")
            .map_err(|e| RunError::Ranks(format!("cannot write {}: {e}", dir.display())))?;
        if let Some(r) = digests.iter().position(|d| *d != digests[0]) {
            return Err(RunError::Ranks(format!(
                "rank {r} (node {})'s weights differ from rank 0's after the step: the ranks \
                 drifted apart (see {})",
                r / per.max(1),
                dir.join(RANKS_FILE).display()
            )));
        }
        Ok(())
    }

    fn send(&self, c: &Command<'_>) -> Result<(), RunError> {
        let bytes = serde_json::to_vec(c)
            .map_err(|e| RunError::Ranks(format!("cannot encode a command: {e}")))?;
        self.coll.broadcast(bytes)?;
        Ok(())
    }

    /// Roll out `requests` over the ranks (`train_idx[r.task]`: the train
    /// panel index of request r's task, `pos[i]`: its position in the
    /// step's tasks); the episodes come back in request order.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rollout(
        &self,
        step: usize,
        call: u64,
        requests: &[EpisodeRequest],
        train_idx: &[usize],
        pos: &[usize],
        local: &Local,
    ) -> Result<(Vec<Episode>, RolloutStats), RunError> {
        let world = self.coll.world();
        let mut shares: Vec<Vec<(usize, ResolvedSpec)>> = vec![Vec::new(); world];
        for (q, &p) in requests.iter().zip(pos) {
            shares[p % world].push((train_idx[p], q.spec));
        }
        self.send(&Command::Rollout {
            step,
            call,
            shares: Cow::Borrowed(&shares),
        })?;
        let mine = local.rollout(0, step, call, &shares[0])?;
        let all = self.coll.all_gather(encode(&mine)?)?;
        let mut mine = Some(mine);
        let mut parts: Vec<std::vec::IntoIter<Episode>> = Vec::with_capacity(world);
        let mut stats = RolloutStats::default();
        for (rank, b) in all.iter().enumerate() {
            let s: Share = match mine.take() {
                Some(m) => m,
                None => decode(b).map_err(|e| RunError::Ranks(format!("rank {rank}: {e}")))?,
            };
            if s.episodes.len() != shares[rank].len() {
                return Err(RunError::Ranks(format!(
                    "rank {rank} returned {} episodes for {} requests",
                    s.episodes.len(),
                    shares[rank].len()
                )));
            }
            stats.prompt_tokens += s.prompt_tokens;
            stats.generated_tokens += s.generated_tokens;
            stats.generate_calls += s.generate_calls;
            // Ranks generate at the same time: the step waited for the
            // slowest.
            stats.seconds = stats.seconds.max(s.seconds);
            parts.push(s.episodes.into_iter());
        }
        let eps = pos
            .iter()
            .map(|&p| parts[p % world].next().expect("counted above"))
            .collect();
        Ok((eps, stats))
    }

    /// Send the step's samples to the other ranks before rank 0's own
    /// trainer step (which waits for theirs inside its gradient sums).
    pub(super) fn train(&self, step: usize, samples: &[Sample]) -> Result<(), RunError> {
        self.send(&Command::Train {
            step,
            samples: Cow::Borrowed(samples),
        })
    }

    /// End of the run: the workers exit.
    pub(super) fn stop(&self) -> Result<(), RunError> {
        self.send(&Command::Stop)
    }
}

/// Whether process `pid` is stopped (state `T` or `t` in
/// `/proc/<pid>/stat`); false where `/proc` cannot tell.
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // The state follows the command name's closing parenthesis.
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace()
                .next()
                .map(|st| st == "T" || st == "t")
        })
        .unwrap_or(false)
}

/// The group over `tcp`: NCCL between CUDA devices, else TCP alone.
pub(super) fn group(
    tcp: TcpGroup,
    device: &candle_core::Device,
) -> Result<Arc<dyn Collective>, RunError> {
    #[cfg(feature = "nccl")]
    if device.is_cuda() {
        return Ok(Arc::new(crate::distributed::nccl::NcclGroup::new(
            tcp, device,
        )?));
    }
    let _ = device;
    Ok(Arc::new(tcp))
}

pub(super) fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, RunError> {
    serde_json::to_vec(v).map_err(|e| RunError::Ranks(format!("cannot encode: {e}")))
}

pub(super) fn decode<T: for<'de> Deserialize<'de>>(b: &[u8]) -> Result<T, RunError> {
    serde_json::from_slice(b).map_err(|e| RunError::Ranks(format!("bad message: {e}")))
}

/// What one rank needs to roll out its share.
pub(super) struct Local<'a> {
    pub(super) policy: &'a Policy,
    pub(super) tok: &'a Tok,
    pub(super) make: &'a dyn Fn(usize) -> Box<dyn Env>,
    pub(super) ropts: &'a RolloutOptions,
    pub(super) train: &'a [Task],
    pub(super) seed: u64,
}

impl Local<'_> {
    pub(super) fn rollout(
        &self,
        rank: usize,
        step: usize,
        call: u64,
        share: &[(usize, ResolvedSpec)],
    ) -> Result<Share, RunError> {
        let requests: Vec<EpisodeRequest> = share
            .iter()
            .map(|&(ti, spec)| {
                let task = self.train.get(ti).ok_or_else(|| {
                    RunError::Ranks(format!("task index {ti} is outside the train panel"))
                })?;
                Ok(EpisodeRequest { task, spec })
            })
            .collect::<Result<_, RunError>>()?;
        // Each rank its own stream of this batch.
        let mut rng = seed::rng(
            self.seed,
            &[seed::label("rollout"), step as u64, call, rank as u64],
        );
        let (episodes, st) = if requests.is_empty() {
            (Vec::new(), RolloutStats::default())
        } else {
            rollout::run(
                self.policy,
                self.tok,
                self.make,
                &requests,
                self.ropts,
                &mut rng,
                None,
            )?
        };
        Ok(Share {
            episodes,
            prompt_tokens: st.prompt_tokens,
            generated_tokens: st.generated_tokens,
            generate_calls: st.generate_calls,
            seconds: st.seconds,
        })
    }
}

/// The program that runs `dp-worker`: this executable.
pub fn worker_program() -> Result<PathBuf, RunError> {
    std::env::current_exe().map_err(|e| RunError::Ranks(format!("cannot find this program: {e}")))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_stopped_process_is_told_from_a_running_one() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let signal = |s: &str| {
            std::process::Command::new("kill")
                .args([s, &pid.to_string()])
                .status()
                .unwrap()
        };
        assert!(!super::stopped(pid));
        assert!(signal("-STOP").success());
        // The state changes once the kernel has delivered the signal.
        let t0 = std::time::Instant::now();
        while !super::stopped(pid) && t0.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(super::stopped(pid));
        assert!(signal("-CONT").success());
        let t0 = std::time::Instant::now();
        while super::stopped(pid) && t0.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(!super::stopped(pid));
        child.kill().unwrap();
        child.wait().unwrap();
        // No such process: not stopped.
        assert!(!super::stopped(u32::MAX));
    }
}
