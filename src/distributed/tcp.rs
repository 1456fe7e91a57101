//! Ranks joined over TCP through rank 0 (a star): each worker holds one
//! connection to rank 0, which relays. Length-prefixed frames; every read
//! and write has a deadline, so a rank that died fails the operation with
//! its rank named instead of hanging the others.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Collective, CollectiveError};

/// First bytes of a worker's greeting.
const MAGIC: &[u8; 4] = b"AGDP";

/// A group of ranks over TCP (see the module docs).
pub struct TcpGroup {
    rank: usize,
    world: usize,
    /// The node of each rank, where this rank knows it and the group spans
    /// several nodes (rank 0 knows all): errors name it.
    nodes: Vec<Option<usize>>,
    /// Rank 0: the link to rank r at index r − 1. Others: the link to 0.
    links: Mutex<Vec<TcpStream>>,
    /// How long a read waits for a peer, and what ends the wait early.
    wait: Mutex<Wait>,
}

/// Tells whether peer rank `r`'s process is stopped (SIGSTOP, a debugger):
/// such a peer cannot answer until it is continued.
pub type StalledPeer = Arc<dyn Fn(usize) -> bool + Send + Sync>;

/// How a read waits for a peer (see [`TcpGroup::recv`]).
#[derive(Clone)]
struct Wait {
    timeout: Duration,
    /// Raised by an interrupt of the run: a stopped peer is then given up
    /// at once (a running one still gets to finish its step).
    stop: Option<Arc<AtomicBool>>,
    stalled: Option<StalledPeer>,
}

/// How long a stopped peer is waited for without an interrupt (it may be
/// continued).
const STALL_GRACE: Duration = Duration::from_secs(60);

impl Wait {
    fn new(timeout: Duration) -> Self {
        Wait {
            timeout,
            stop: None,
            stalled: None,
        }
    }
}

impl std::fmt::Debug for TcpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl TcpGroup {
    /// Rank 0: accept the `world − 1` workers on `listener` (each says its
    /// rank) within `timeout`; every later operation waits at most
    /// `timeout` for a peer.
    pub fn host(
        listener: TcpListener,
        world: usize,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        Self::host_watching(listener, world, None, timeout, &mut || None)
    }

    /// [`TcpGroup::host`], asking `gone` while it waits whether a worker
    /// is known to have died (then it stops waiting, with that reason).
    /// With `per_node` ranks on each of several nodes, every worker must
    /// say the node its rank belongs to, and errors name nodes.
    pub fn host_watching(
        listener: TcpListener,
        world: usize,
        per_node: Option<usize>,
        timeout: Duration,
        gone: &mut dyn FnMut() -> Option<String>,
    ) -> Result<Self, CollectiveError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| CollectiveError::Io {
                rank: 0,
                world,
                what,
                source,
            }
        };
        let deadline = Instant::now() + timeout;
        listener
            .set_nonblocking(true)
            .map_err(io("cannot poll the rendezvous socket"))?;
        let mut links: Vec<Option<TcpStream>> = (1..world).map(|_| None).collect();
        while links.iter().any(Option::is_none) {
            match listener.accept() {
                Ok((s, peer)) => {
                    s.set_nonblocking(false)
                        .map_err(io("cannot configure a worker's link"))?;
                    configure(&s, timeout).map_err(io("cannot configure a worker's link"))?;
                    let (r, w, node) = greeting(&s).map_err(|e| CollectiveError::Protocol {
                        rank: 0,
                        world,
                        msg: format!("bad greeting from {peer}: {e}"),
                    })?;
                    if w != world || r == 0 || r >= world || links[r - 1].is_some() {
                        return Err(CollectiveError::Protocol {
                            rank: 0,
                            world,
                            msg: format!(
                                "{peer} (node {node}) joined as rank {r} of {w}: expected a free \
                                 rank in 1..{world} of {world}{}",
                                if per_node.is_some() {
                                    "; do all nodes list the same number of --devices?"
                                } else {
                                    ""
                                }
                            ),
                        });
                    }
                    let want = per_node.map_or(0, |d| r / d.max(1));
                    if node != want {
                        return Err(CollectiveError::Protocol {
                            rank: 0,
                            world,
                            msg: format!(
                                "{peer} joined as rank {r} of node {node}, but rank {r} belongs \
                                 to node {want} ({} ranks per node): do all nodes list the same \
                                 number of --devices?",
                                per_node.unwrap_or(world)
                            ),
                        });
                    }
                    links[r - 1] = Some(s);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Some(why) = gone() {
                        return Err(CollectiveError::Protocol {
                            rank: 0,
                            world,
                            msg: why,
                        });
                    }
                    if Instant::now() > deadline {
                        let missing: Vec<usize> =
                            (1..world).filter(|r| links[r - 1].is_none()).collect();
                        let of_nodes = match per_node {
                            Some(d) => {
                                let mut n: Vec<usize> =
                                    missing.iter().map(|r| r / d.max(1)).collect();
                                n.dedup();
                                format!(" (of nodes {n:?})")
                            }
                            None => String::new(),
                        };
                        return Err(CollectiveError::Protocol {
                            rank: 0,
                            world,
                            msg: format!(
                                "ranks {missing:?}{of_nodes} did not join within {} s",
                                timeout.as_secs()
                            ),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(io("rendezvous accept failed")(e)),
            }
        }
        let nodes = (0..world).map(|r| per_node.map(|d| r / d.max(1))).collect();
        Ok(TcpGroup {
            rank: 0,
            world,
            nodes,
            links: Mutex::new(links.into_iter().flatten().collect()),
            wait: Mutex::new(Wait::new(timeout)),
        })
    }

    /// Rank `rank` (≥ 1) of node `node` (0 on one machine): connect to
    /// rank 0 at `addr`, retrying until `timeout` (rank 0 may not listen
    /// yet).
    pub fn connect(
        addr: &str,
        rank: usize,
        world: usize,
        node: usize,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let io = |what: String| {
            move |source| CollectiveError::Io {
                rank,
                world,
                what,
                source,
            }
        };
        if rank == 0 || rank >= world {
            return Err(CollectiveError::Protocol {
                rank,
                world,
                msg: format!("a worker's rank must be in 1..{world}"),
            });
        }
        let deadline = Instant::now() + timeout;
        let s = loop {
            let tried = addr
                .to_socket_addrs()
                .and_then(|mut a| {
                    a.next().ok_or_else(|| {
                        std::io::Error::new(std::io::ErrorKind::InvalidInput, "no address")
                    })
                })
                .and_then(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)));
            match tried {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => {
                    return Err(io(format!(
                        "node {node} cannot reach rank 0 at {addr} (the rendezvous) within {} s",
                        timeout.as_secs()
                    ))(e))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        configure(&s, timeout).map_err(io("cannot configure the link".into()))?;
        let mut hello = MAGIC.to_vec();
        hello.extend((rank as u32).to_le_bytes());
        hello.extend((world as u32).to_le_bytes());
        hello.extend((node as u32).to_le_bytes());
        (&s).write_all(&hello)
            .map_err(io("cannot greet rank 0".into()))?;
        let mut nodes = vec![None; world];
        if node > 0 {
            nodes[0] = Some(0);
            nodes[rank] = Some(node);
        }
        Ok(TcpGroup {
            rank,
            world,
            nodes,
            wait: Mutex::new(Wait::new(timeout)),
            links: Mutex::new(vec![s]),
        })
    }

    /// How long later operations wait for a peer (the join's timeout
    /// until then).
    pub fn set_peer_timeout(&self, timeout: Duration) -> Result<(), CollectiveError> {
        for (i, l) in self.links.lock().expect("links lock").iter().enumerate() {
            let peer = if self.rank == 0 { i + 1 } else { 0 };
            configure(l, timeout).map_err(self.io_err(peer, "cannot configure the link to"))?;
        }
        self.wait.lock().expect("wait lock").timeout = timeout;
        Ok(())
    }

    /// Give up waiting for a stopped peer (`stalled` says which are) at
    /// once when `stop` is raised, and after [`STALL_GRACE`] otherwise,
    /// instead of after the whole peer timeout.
    pub fn watch_peers(&self, stop: Option<Arc<AtomicBool>>, stalled: StalledPeer) {
        let mut w = self.wait.lock().expect("wait lock");
        w.stop = stop;
        w.stalled = Some(stalled);
    }

    /// One frame from peer `peer` on `s`, waiting at most the peer
    /// timeout, and less for a stopped peer.
    fn recv(&self, s: &TcpStream, peer: usize) -> std::io::Result<Vec<u8>> {
        let w = self.wait.lock().expect("wait lock").clone();
        let deadline = Instant::now() + w.timeout;
        let mut stalled_since: Option<Instant> = None;
        let mut give_up = || -> Option<String> {
            let stalled = w.stalled.as_ref()?;
            if !stalled(peer) {
                stalled_since = None;
                return None;
            }
            let since = *stalled_since.get_or_insert_with(Instant::now);
            let stop = w.stop.as_ref().is_some_and(|f| f.load(Ordering::SeqCst));
            (stop || since.elapsed() > STALL_GRACE).then(|| {
                format!(
                    "its process is stopped (SIGSTOP?) and has not answered for {} s{}",
                    since.elapsed().as_secs(),
                    if stop {
                        "; the run was interrupted"
                    } else {
                        ""
                    }
                )
            })
        };
        let mut n = [0u8; 8];
        read_full(s, &mut n, deadline, &mut give_up)?;
        let mut b = vec![0u8; u64::from_le_bytes(n) as usize];
        read_full(s, &mut b, deadline, &mut give_up)?;
        Ok(b)
    }

    fn io_err(&self, peer: usize, what: &str) -> impl FnOnce(std::io::Error) -> CollectiveError {
        let (rank, world) = (self.rank, self.world);
        let what = format!("{what} {} (did it stop?)", self.name(peer));
        move |source| CollectiveError::Io {
            rank,
            world,
            what,
            source,
        }
    }
}

impl TcpGroup {
    /// `rank 3`, or `rank 3 on node 1` where the group spans nodes.
    pub fn name(&self, rank: usize) -> String {
        match self.nodes.get(rank).copied().flatten() {
            Some(n) if self.nodes.iter().flatten().any(|&n| n > 0) => {
                format!("rank {rank} on node {n}")
            }
            _ => format!("rank {rank}"),
        }
    }
}

fn configure(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))
}

/// A worker's (rank, world, node).
fn greeting(mut s: &TcpStream) -> std::io::Result<(usize, usize, usize)> {
    let mut b = [0u8; 16];
    s.read_exact(&mut b)?;
    if &b[..4] != MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not an actguide worker",
        ));
    }
    let r = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")) as usize;
    let w = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")) as usize;
    let n = u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")) as usize;
    Ok((r, w, n))
}

fn send(mut s: &TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(&(bytes.len() as u64).to_le_bytes())?;
    s.write_all(bytes)
}

/// Fill `buf` from `s` by `deadline`, in waits of at most a second; after
/// each, `give_up` may end the read with its reason.
fn read_full(
    mut s: &TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    give_up: &mut dyn FnMut() -> Option<String>,
) -> std::io::Result<()> {
    use std::io::ErrorKind;
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "no reply in time"));
        }
        s.set_read_timeout(Some(left.min(Duration::from_secs(1))))?;
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                if let Some(why) = give_up() {
                    return Err(std::io::Error::new(ErrorKind::Interrupted, why));
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Collective for TcpGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let links = self.links.lock().expect("links lock");
        if self.rank == 0 {
            let mut all = vec![bytes];
            for (i, l) in links.iter().enumerate() {
                all.push(
                    self.recv(l, i + 1)
                        .map_err(self.io_err(i + 1, "no data from"))?,
                );
            }
            for (i, l) in links.iter().enumerate() {
                for b in &all {
                    send(l, b).map_err(self.io_err(i + 1, "cannot send to"))?;
                }
            }
            Ok(all)
        } else {
            let l = &links[0];
            send(l, &bytes).map_err(self.io_err(0, "cannot send to"))?;
            (0..self.world)
                .map(|_| self.recv(l, 0).map_err(self.io_err(0, "no data from")))
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// `world` ranks on threads of this process, joined on a free port.
    pub(crate) fn group(world: usize) -> Vec<TcpGroup> {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = Duration::from_secs(20);
        let workers: Vec<_> = (1..world)
            .map(|r| {
                let a = addr.clone();
                std::thread::spawn(move || TcpGroup::connect(&a, r, world, 0, t).unwrap())
            })
            .collect();
        let mut g = vec![TcpGroup::host(l, world, t).unwrap()];
        g.extend(workers.into_iter().map(|w| w.join().unwrap()));
        g
    }

    #[test]
    fn an_interrupt_gives_up_a_stopped_rank_within_seconds() {
        let mut g = group(2);
        let silent = g.pop().unwrap();
        let host = g.pop().unwrap();
        host.set_peer_timeout(Duration::from_secs(3600)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        // Rank 1 counts as stopped; the flag gives it up at once.
        host.watch_peers(Some(stop.clone()), Arc::new(|r| r == 1));
        let raise = stop.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            raise.store(true, Ordering::SeqCst);
        });
        let t0 = Instant::now();
        let e = host.all_gather(vec![1, 2, 3]).unwrap_err().to_string();
        // A bound on a hang (the timeout is an hour), not a speed check.
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        assert!(e.contains("no data from rank 1"), "{e}");
        assert!(e.contains("its process is stopped"), "{e}");
        assert!(e.contains("the run was interrupted"), "{e}");
        drop(silent);
    }

    #[test]
    fn gathers_broadcasts_and_sums_in_rank_order() {
        let g = group(3);
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = g
                .iter()
                .map(|c| {
                    s.spawn(move || {
                        let r = c.rank();
                        let all = c.all_gather(vec![r as u8; r + 1]).unwrap();
                        let b = c.broadcast(format!("from {r}").into_bytes()).unwrap();
                        let t = Tensor::new(&[r as f32, 1.0, 0.5], &Device::Cpu).unwrap();
                        let sum = c.all_reduce_sum(&[t]).unwrap();
                        let f = c.all_reduce_f64(&[r as f64, 2.0]).unwrap();
                        (all, b, sum[0].to_vec1::<f32>().unwrap(), f)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (all, b, sum, f) in out {
            assert_eq!(all, [vec![0u8], vec![1, 1], vec![2, 2, 2]]);
            assert_eq!(b, b"from 0");
            assert_eq!(sum, [3.0, 3.0, 1.5]);
            assert_eq!(f, [3.0, 6.0]);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_with_its_rank_named() {
        let mut g = group(2);
        let w = g.pop().unwrap();
        drop(w);
        let e = g[0].all_gather(vec![1]).unwrap_err().to_string();
        assert!(e.contains("rank 1 (did it stop?)"), "{e}");
        // A worker whose rank 0 is gone cannot join.
        let e = TcpGroup::connect("127.0.0.1:1", 1, 2, 0, Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot reach rank 0"), "{e}");
    }

    #[test]
    fn ranks_that_disagree_on_sizes_are_refused() {
        let g = group(2);
        let e = std::thread::scope(|s| {
            let a = s.spawn(|| g[0].all_reduce_f64(&[1.0, 2.0]));
            let b = s.spawn(|| g[1].all_reduce_f64(&[1.0]));
            let _ = b.join().unwrap();
            a.join().unwrap().unwrap_err().to_string()
        });
        assert!(e.contains("disagree"), "{e}");
    }
}
