//! The ranks other than 0 (docs/DISTRIBUTED.md): `actguide dp-worker`, a
//! rank on one device, and the first process of a node other than 0
//! (`actguide run --node-rank R`), which starts its node's further ranks
//! and then serves as a rank itself.
//!
//! A rank joins rank 0 at the rendezvous, takes the run's experiment (and
//! on resume the checkpoint) from it, builds the same policy from the same
//! seed, and then only serves rank 0's commands until it says stop.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::ranks::{
    decode, encode, gather_devices, group, spawn_local, weights_digest, Command, Local, Placement,
    Setup, PEER_TIMEOUT,
};
use super::{setup, RunError, RunOptions};
use crate::distributed::{Collective, TcpGroup};
use crate::env::{make_env, Env};
use crate::experiment::config::Experiment;
use crate::experiment::models;
use crate::model::device::DeviceSpec;
use crate::rundir::checkpoint;
use crate::seed;

/// One rank's place: rank `rank` of `world`, on node `node`.
#[derive(Debug, Clone)]
pub struct WorkerPlace {
    pub rank: usize,
    pub world: usize,
    pub node: usize,
    /// Rank 0's address.
    pub rendezvous: String,
    /// The device; `None`: the experiment's `model.device`, a CUDA one
    /// numbered by `local_rank`.
    pub device: Option<DeviceSpec>,
    /// The launcher's local rank (`LOCAL_RANK`), for the default device.
    pub local_rank: Option<usize>,
    pub join_timeout: Duration,
}

/// `actguide dp-worker`: serve rank 0 as one rank until it says stop.
pub fn serve_worker(place: &WorkerPlace) -> Result<(), RunError> {
    let tcp = TcpGroup::connect(
        &place.rendezvous,
        place.rank,
        place.world,
        place.node,
        place.join_timeout,
    )?;
    tcp.set_peer_timeout(PEER_TIMEOUT)?;
    let setup: Setup = decode(&tcp.broadcast(Vec::new())?)?;
    let mut exp: Experiment = serde_json::from_value(setup.experiment.clone()).map_err(|e| {
        RunError::Ranks(format!(
            "rank 0 sent an experiment this build cannot read: {e}"
        ))
    })?;
    exp.model.device = match place.device {
        Some(d) => d,
        None => match (exp.model.device, place.local_rank) {
            (DeviceSpec::Cuda(_), Some(l)) => DeviceSpec::Cuda(l),
            (d, _) => d,
        },
    };
    let checkpoint = receive_checkpoint(&tcp, &setup, place)?;
    let dev = models::device(&exp)?;
    gather_devices(&tcp, exp.model.device)?;
    let (train, _test, _clusters) = setup::panels(&exp)?;
    let src = models::open(&exp)?;
    let resumed = match &checkpoint {
        // Rank 0 verified this checkpoint before it started the ranks; a
        // copy sent over the network is checked against its sums again.
        Some(c) => Some(checkpoint::load_dir(
            c.path(),
            &dev,
            checkpoint::Sums::MayLack,
        )?),
        None => None,
    };
    let (policy, mut trainer) =
        setup::policy_and_trainer(&exp, &exp.trainer, &src, resumed.as_ref(), &dev)?;
    if let Some(l) = &resumed {
        models::restore_optimizer(&mut trainer, l)?;
    }
    drop(resumed);
    drop(checkpoint);
    let ropts = models::rollout_options(
        &exp,
        &src,
        exp.trainer.aux_nll_coef > 0.0 || exp.trainer.train_prefix,
    )?;
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
                let share = shares.get(place.rank).map_or(&[][..], Vec::as_slice);
                let mine = local.rollout(place.rank, step, call, share)?;
                coll.all_gather(encode(&mine)?)?;
            }
            Command::Train { step, samples } => {
                let mut rng = seed::rng(exp.seed, &[seed::label("train"), step as u64]);
                trainer.step(&policy, &samples, step, &mut rng)?;
            }
            Command::Digest => {
                coll.all_gather(weights_digest(&policy)?.into_bytes())?;
            }
            Command::Stop => return Ok(()),
        }
    }
}

/// Where a worker reads the checkpoint it resumes from.
enum Received {
    /// Rank 0's own folder (node 0 shares its file system).
    Shared(PathBuf),
    /// A copy of its files, sent over the rendezvous (removed when
    /// dropped).
    Copy(tempfile::TempDir),
}

impl Received {
    fn path(&self) -> &Path {
        match self {
            Received::Shared(p) => p,
            Received::Copy(t) => t.path(),
        }
    }
}

/// The checkpoint of `setup`, if any; every rank takes part in the
/// broadcasts of its files, and the ranks of other nodes keep them.
fn receive_checkpoint(
    tcp: &TcpGroup,
    setup: &Setup,
    place: &WorkerPlace,
) -> Result<Option<Received>, RunError> {
    let Some(dir) = &setup.checkpoint else {
        return Ok(None);
    };
    let copy = if setup.files.is_empty() || place.node == 0 {
        None
    } else {
        Some(
            tempfile::Builder::new()
                .prefix(&format!("actguide-rank{}-", place.rank))
                .tempdir()
                .map_err(|e| {
                    RunError::Ranks(format!("cannot make a folder for the checkpoint: {e}"))
                })?,
        )
    };
    for f in &setup.files {
        let bytes = tcp.broadcast(Vec::new())?;
        let Some(t) = &copy else { continue };
        if f.is_absolute() || f.components().any(|c| c == std::path::Component::ParentDir) {
            return Err(RunError::Ranks(format!(
                "rank 0 sent a checkpoint file outside the checkpoint: {}",
                f.display()
            )));
        }
        let p = t.path().join(f);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| RunError::Ranks(format!("cannot write {}: {e}", p.display())))?;
        }
        std::fs::write(&p, bytes)
            .map_err(|e| RunError::Ranks(format!("cannot write {}: {e}", p.display())))?;
    }
    Ok(Some(match copy {
        Some(t) => Received::Copy(t),
        None => Received::Shared(dir.clone()),
    }))
}

/// `actguide run … --node-rank R` for R ≥ 1: start this node's further
/// ranks, then serve as its first rank. The run directory, the scripts
/// and the checkpoints stay with node 0.
pub fn serve_node(opts: &RunOptions) -> Result<(), RunError> {
    let place = Placement::of(opts);
    let Some(l) = &place.launch else {
        return Err(RunError::Ranks(
            "serve_node needs a launch over nodes".into(),
        ));
    };
    let exe = match &opts.worker_program {
        Some(p) => p.clone(),
        None => super::ranks::worker_program()?,
    };
    let node = place.node();
    // Stopped when this process returns (or dies).
    let workers = Workers(spawn_local(&exe, &place, node, &l.rendezvous)?);
    let served = serve_worker(&WorkerPlace {
        rank: node * place.per_node(),
        world: place.world(),
        node,
        rendezvous: l.rendezvous.clone(),
        device: opts.devices.first().copied(),
        local_rank: l.local_rank,
        join_timeout: place.join_timeout,
    });
    drop(workers);
    served
}

/// A node's further ranks, reaped when dropped.
struct Workers(Vec<std::process::Child>);

impl Drop for Workers {
    fn drop(&mut self) {
        super::ranks::reap(&mut self.0);
    }
}
