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

use super::{setup, Ctx, RunError, RunOptions};
use crate::distributed::{Collective, TcpGroup};
use crate::env::{make_env, Env, Task};
use crate::experiment::config::Experiment;
use crate::experiment::models;
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
const PEER_TIMEOUT: Duration = Duration::from_secs(3600);

/// How long rank 0 waits for the workers to start and join.
const JOIN_TIMEOUT: Duration = Duration::from_secs(300);

/// Rank 0's command to the other ranks (borrowed when sent, owned when
/// received, so sending copies nothing).
#[derive(Serialize, Deserialize)]
enum Command<'a> {
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
    /// The run is over.
    Stop,
}

/// One rank's rollouts.
#[derive(Serialize, Deserialize)]
struct Share {
    episodes: Vec<Episode>,
    prompt_tokens: usize,
    generated_tokens: usize,
    generate_calls: usize,
    seconds: f64,
}

/// Rank 0's side: the group and the worker processes.
pub(super) struct Ranks {
    coll: Arc<dyn Collective>,
    workers: Vec<Child>,
    devices: Vec<DeviceSpec>,
}

impl std::fmt::Debug for Ranks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ranks(world {})", self.coll.world())
    }
}

impl Drop for Ranks {
    /// Workers never outlive rank 0: after `Stop` they exit by themselves;
    /// on an error path they are killed.
    fn drop(&mut self) {
        for w in &mut self.workers {
            if matches!(w.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(200));
                if matches!(w.try_wait(), Ok(None)) {
                    let _ = w.kill();
                }
            }
            let _ = w.wait();
        }
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
    /// Start ranks 1.. on `devices[1..]` (`exe dp-worker …`), wait until
    /// they join, and open the group (NCCL on CUDA devices).
    fn launch(
        exe: &Path,
        run_dir: &Path,
        devices: &[DeviceSpec],
        resumed: bool,
        device: &candle_core::Device,
        interrupt: Option<Arc<std::sync::atomic::AtomicBool>>,
    ) -> Result<Self, RunError> {
        let world = devices.len();
        let io =
            |e: std::io::Error| RunError::Ranks(format!("cannot open the rendezvous port: {e}"));
        let listener = TcpListener::bind("127.0.0.1:0").map_err(io)?;
        let addr = listener.local_addr().map_err(io)?.to_string();
        let mut workers = Vec::new();
        for (rank, d) in devices.iter().enumerate().skip(1) {
            let mut p = Process::new(exe);
            p.args(["dp-worker", "--rank", &rank.to_string()])
                .args(["--world", &world.to_string(), "--rendezvous", &addr])
                .args(["--device", &d.to_string()])
                .arg("--run-dir")
                .arg(run_dir);
            if resumed {
                p.arg("--resume");
            }
            // Killed with rank 0, however it ends.
            let child = crate::children::spawn(p).map_err(|e| {
                RunError::Ranks(format!("cannot start rank {rank} ({}): {e}", exe.display()))
            })?;
            workers.push(child);
        }
        // From here on, dropping `ranks` stops the workers.
        let mut ranks = Ranks {
            coll: Arc::new(crate::distributed::Single),
            workers,
            devices: devices.to_vec(),
        };
        let workers = &mut ranks.workers;
        let tcp = TcpGroup::host_watching(listener, world, JOIN_TIMEOUT, &mut || {
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
        ranks.coll = group(tcp, device)?;
        Ok(ranks)
    }

    /// Start the other ranks of `opts.devices` for the run of `ctx` (set
    /// up, memory-checked), and point its trainer at the group.
    pub(super) fn start(ctx: &mut Ctx, opts: &RunOptions) -> Result<Self, RunError> {
        let exe = match &opts.worker_program {
            Some(p) => p.clone(),
            None => worker_program()?,
        };
        let r = Ranks::launch(
            &exe,
            ctx.dir.path(),
            &opts.devices,
            opts.resume.is_some(),
            ctx.policy.device(),
            opts.interrupt.clone(),
        )?;
        ctx.trainer.set_collective(r.coll.clone());
        Ok(r)
    }

    /// `data-parallel: 2 ranks on cuda:0, cuda:1`.
    pub(super) fn describe(&self) -> String {
        let devices: Vec<String> = self.devices.iter().map(|d| d.to_string()).collect();
        format!(
            "data-parallel: {} ranks on {}",
            devices.len(),
            devices.join(", ")
        )
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
fn group(tcp: TcpGroup, device: &candle_core::Device) -> Result<Arc<dyn Collective>, RunError> {
    tcp.set_peer_timeout(PEER_TIMEOUT)?;
    #[cfg(feature = "nccl")]
    if device.is_cuda() {
        return Ok(Arc::new(crate::distributed::nccl::NcclGroup::new(
            tcp, device,
        )?));
    }
    let _ = device;
    Ok(Arc::new(tcp))
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, RunError> {
    serde_json::to_vec(v).map_err(|e| RunError::Ranks(format!("cannot encode: {e}")))
}

fn decode<T: for<'de> Deserialize<'de>>(b: &[u8]) -> Result<T, RunError> {
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
    fn rollout(
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

/// `actguide dp-worker`: rank `rank` of `world`, on `device`, serving the
/// rank 0 at `rendezvous` for the run in `run_dir` until it says stop.
pub fn serve_worker(
    rank: usize,
    world: usize,
    rendezvous: &str,
    device: DeviceSpec,
    run_dir: &Path,
    resume: bool,
) -> Result<(), RunError> {
    let mut exp: Experiment = crate::rundir::RunDir::at(run_dir).read_experiment()?;
    exp.model.device = device;
    let dev = models::device(&exp)?;
    let (train, _test, _clusters) = setup::panels(&exp)?;
    let src = models::open(&exp)?;
    let resumed = if resume {
        // Rank 0 verified this checkpoint before it started the ranks.
        Some(checkpoint::load_latest(
            run_dir,
            &dev,
            checkpoint::Sums::MayLack,
        )?)
    } else {
        None
    };
    let (policy, mut trainer) =
        setup::policy_and_trainer(&exp, &exp.trainer, &src, resumed.as_ref(), &dev)?;
    if let Some(l) = &resumed {
        models::restore_optimizer(&mut trainer, l)?;
    }
    let ropts = models::rollout_options(
        &exp,
        &src,
        exp.trainer.aux_nll_coef > 0.0 || exp.trainer.train_prefix,
    )?;
    let tcp = TcpGroup::connect(rendezvous, rank, world, JOIN_TIMEOUT)?;
    let coll = group(tcp, &dev)?;
    let mut trainer = trainer.with_collective(coll.clone());
    let spec = exp.env.spec();
    let make = move |limit: usize| -> Box<dyn Env> { make_env(&spec, limit) };
    let local = Local {
        policy: &policy,
        tok: &src.tok,
        make: &make,
        ropts: &ropts,
        train: &train,
        seed: exp.seed,
    };
    loop {
        let cmd: Command<'static> = decode(&coll.broadcast(Vec::new())?)?;
        match cmd {
            Command::Rollout { step, call, shares } => {
                let share = shares.get(rank).map_or(&[][..], Vec::as_slice);
                let mine = local.rollout(rank, step, call, share)?;
                coll.all_gather(encode(&mine)?)?;
            }
            Command::Train { step, samples } => {
                let mut rng = seed::rng(exp.seed, &[seed::label("train"), step as u64]);
                trainer.step(&policy, &samples, step, &mut rng)?;
            }
            Command::Stop => return Ok(()),
        }
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
