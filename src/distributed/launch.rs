//! Where this process sits in a run over several machines: its node, the
//! number of nodes and rank 0's rendezvous address, from the command
//! line or from the variables cluster launchers set (docs/DISTRIBUTED.md).
//!
//! A *node* is one launched `actguide run` process. It runs one rank per
//! entry of its `--devices` (one when there is none), so with `D` devices
//! per node, node `n`'s `i`-th device is global rank `n·D + i` of
//! `nodes·D`. Launchers name processes, not machines: torchrun with
//! `--nproc-per-node 8` starts 8 "nodes" per machine, each one rank on
//! `cuda:LOCAL_RANK`; torchrun with one process per machine and
//! `--devices cuda:0,…,cuda:7` starts 8 ranks per machine from one node.
//!
//! Sources, first match wins:
//! 1. flags: `--nodes N --node-rank R --rendezvous HOST:PORT`;
//! 2. torchrun and its kin (accelerate, deepspeed): `WORLD_SIZE`, `RANK`,
//!    `MASTER_ADDR`, `MASTER_PORT`, `LOCAL_RANK`;
//! 3. Slurm (`srun`): `SLURM_STEP_NUM_TASKS`, `SLURM_PROCID`,
//!    `SLURM_LOCALID`, and
//!    rank 0's host from `MASTER_ADDR` or the first host of
//!    `SLURM_JOB_NODELIST` (`SLURM_NODELIST`), the port from `MASTER_PORT`
//!    or [`DEFAULT_PORT`]. Only `srun` sets `SLURM_STEP_NUM_TASKS`: a batch
//!    script's own `SLURM_NTASKS`/`SLURM_PROCID` (an `sbatch --ntasks 4`
//!    running one `actguide run`) do not make it a node of four.
//!
//! One node (or none of these set) is the one-machine run of `--devices`.

use std::fmt;

/// The rendezvous port when Slurm names the host and nothing names a port
/// (PyTorch's default).
pub const DEFAULT_PORT: u16 = 29500;

/// A launch over several nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// Number of nodes (≥ 2).
    pub nodes: usize,
    /// This node, 0 ..nodes. Node 0 runs rank 0, which owns the run
    /// directory.
    pub node: usize,
    /// Rank 0's `HOST:PORT`: node 0 listens there, the others connect.
    pub rendezvous: String,
    /// The launcher's local rank (`LOCAL_RANK`, `SLURM_LOCALID`): picks
    /// `cuda:LOCAL_RANK` when `--devices` is not given.
    pub local_rank: Option<usize>,
    /// Where the values came from.
    pub source: LaunchSource,
}

/// Where a [`Launch`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaunchSource {
    Flags,
    Torchrun,
    Slurm,
}

impl fmt::Display for LaunchSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchSource::Flags => "--nodes/--node-rank/--rendezvous",
            LaunchSource::Torchrun => "WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT",
            LaunchSource::Slurm => "SLURM_STEP_NUM_TASKS/SLURM_PROCID",
        })
    }
}

/// The command line's part of a launch.
#[derive(Debug, Clone, Default)]
pub struct LaunchFlags {
    pub nodes: Option<usize>,
    pub node_rank: Option<usize>,
    pub rendezvous: Option<String>,
}

/// A launch that cannot be: says which flag or variable, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LaunchError(String);

/// This process's launch from `flags`, else from the variables `var`
/// reads; `None` for a run on one node.
pub fn resolve(
    flags: &LaunchFlags,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<Launch>, LaunchError> {
    if flags.nodes.is_some() || flags.node_rank.is_some() || flags.rendezvous.is_some() {
        return from_flags(flags);
    }
    if var("WORLD_SIZE").is_some() || var("RANK").is_some() {
        return from_torchrun(var);
    }
    if var("SLURM_STEP_NUM_TASKS").is_some() && var("SLURM_PROCID").is_some() {
        return from_slurm(var);
    }
    Ok(None)
}

/// [`resolve`] on this process's environment.
pub fn from_env(flags: &LaunchFlags) -> Result<Option<Launch>, LaunchError> {
    resolve(flags, &|k| std::env::var(k).ok())
}

fn from_flags(f: &LaunchFlags) -> Result<Option<Launch>, LaunchError> {
    let nodes = f.nodes.unwrap_or(1);
    if nodes == 0 {
        return Err(LaunchError("--nodes must be at least 1".into()));
    }
    let node = f.node_rank.unwrap_or(0);
    if node >= nodes {
        return Err(LaunchError(format!(
            "--node-rank {node} is outside 0..{nodes} (--nodes {nodes})"
        )));
    }
    if nodes == 1 {
        return Ok(None);
    }
    let Some(rdv) = &f.rendezvous else {
        return Err(LaunchError(
            "--nodes over 1 needs --rendezvous HOST:PORT (where node 0 listens)".into(),
        ));
    };
    check_address(rdv, "--rendezvous")?;
    if f.node_rank.is_none() {
        return Err(LaunchError(
            "--nodes over 1 needs --node-rank (0 on the node that owns the run)".into(),
        ));
    }
    Ok(Some(Launch {
        nodes,
        node,
        rendezvous: rdv.clone(),
        local_rank: None,
        source: LaunchSource::Flags,
    }))
}

fn from_torchrun(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>, LaunchError> {
    let nodes = number(var, "WORLD_SIZE")?;
    let node = number(var, "RANK")?;
    position(nodes, node, "WORLD_SIZE", "RANK")?;
    if nodes == 1 {
        return Ok(None);
    }
    let host = var("MASTER_ADDR").ok_or_else(|| {
        LaunchError("WORLD_SIZE and RANK are set but MASTER_ADDR is not: where is rank 0?".into())
    })?;
    let port = port(var, "MASTER_PORT")?
        .ok_or_else(|| LaunchError("WORLD_SIZE and RANK are set but MASTER_PORT is not".into()))?;
    Ok(Some(Launch {
        nodes,
        node,
        rendezvous: join_host_port(&host, port),
        local_rank: optional_number(var, "LOCAL_RANK")?,
        source: LaunchSource::Torchrun,
    }))
}

fn from_slurm(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>, LaunchError> {
    let nodes = number(var, "SLURM_STEP_NUM_TASKS")?;
    let node = number(var, "SLURM_PROCID")?;
    position(nodes, node, "SLURM_STEP_NUM_TASKS", "SLURM_PROCID")?;
    if nodes == 1 {
        return Ok(None);
    }
    let host = match var("MASTER_ADDR") {
        Some(h) => h,
        None => {
            let (name, list) = ["SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                .into_iter()
                .find_map(|k| var(k).map(|v| (k, v)))
                .ok_or_else(|| {
                    LaunchError(
                        "Slurm runs need MASTER_ADDR or SLURM_JOB_NODELIST for rank 0's host"
                            .into(),
                    )
                })?;
            expand_nodelist(&list)
                .map_err(|e| LaunchError(format!("{name}={list:?}: {e}")))?
                .into_iter()
                .next()
                .ok_or_else(|| LaunchError(format!("{name} is empty")))?
        }
    };
    let port = port(var, "MASTER_PORT")?.unwrap_or(DEFAULT_PORT);
    Ok(Some(Launch {
        nodes,
        node,
        rendezvous: join_host_port(&host, port),
        local_rank: optional_number(var, "SLURM_LOCALID")?,
        source: LaunchSource::Slurm,
    }))
}

fn position(nodes: usize, node: usize, n: &str, r: &str) -> Result<(), LaunchError> {
    if nodes == 0 {
        return Err(LaunchError(format!("{n}=0: there must be at least one")));
    }
    if node >= nodes {
        return Err(LaunchError(format!(
            "{r}={node} is outside 0..{nodes} ({n}={nodes})"
        )));
    }
    Ok(())
}

fn optional_number(
    var: &dyn Fn(&str) -> Option<String>,
    k: &str,
) -> Result<Option<usize>, LaunchError> {
    var(k)
        .map(|v| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| LaunchError(format!("{k}={v:?} is not a whole number")))
        })
        .transpose()
}

fn number(var: &dyn Fn(&str) -> Option<String>, k: &str) -> Result<usize, LaunchError> {
    optional_number(var, k)?.ok_or_else(|| LaunchError(format!("{k} is not set")))
}

fn port(var: &dyn Fn(&str) -> Option<String>, k: &str) -> Result<Option<u16>, LaunchError> {
    var(k)
        .map(|v| {
            v.trim()
                .parse::<u16>()
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| LaunchError(format!("{k}={v:?} is not a port (1..65535)")))
        })
        .transpose()
}

/// `HOST:PORT`, bracketing an IPv6 address.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A `HOST:PORT` with a port in 1..65535 (the host is resolved when it is
/// used).
pub fn check_address(addr: &str, what: &str) -> Result<(), LaunchError> {
    let bad = || LaunchError(format!("{what} {addr:?} is not HOST:PORT"));
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || port.parse::<u16>().ok().filter(|&p| p > 0).is_none() {
        return Err(bad());
    }
    Ok(())
}

/// The port of a `HOST:PORT`.
pub fn port_of(addr: &str) -> Option<u16> {
    addr.rsplit_once(':')?.1.parse().ok()
}

/// The hosts of a Slurm node list, in order: `gpu[01-03,07],login1`
/// gives gpu01, gpu02, gpu03, gpu07, login1 (ranges keep their zero
/// padding).
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    let mut rest = list.trim();
    while !rest.is_empty() {
        // One entry: up to the first comma outside brackets.
        let mut depth = 0i32;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .map_or(rest.len(), |(i, _)| i);
        if depth != 0 {
            return Err(format!("unbalanced brackets in {rest:?}"));
        }
        expand_entry(&rest[..end], &mut hosts)?;
        rest = rest[end..].trim_start_matches(',');
    }
    Ok(hosts)
}

/// One entry: `prefix[ranges]suffix`, or a plain host.
fn expand_entry(entry: &str, out: &mut Vec<String>) -> Result<(), String> {
    let Some(open) = entry.find('[') else {
        if !entry.is_empty() {
            out.push(entry.to_string());
        }
        return Ok(());
    };
    let close = entry[open..]
        .find(']')
        .map(|i| open + i)
        .ok_or_else(|| format!("no ']' in {entry:?}"))?;
    let (prefix, ranges, suffix) = (&entry[..open], &entry[open + 1..close], &entry[close + 1..]);
    for part in ranges.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let bad = || format!("{part:?} in {entry:?} is not a number or a range");
        let (lo, hi): (u64, u64) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        if lo > hi || hi - lo > 100_000 {
            return Err(bad());
        }
        for n in lo..=hi {
            // Suffixes may hold further brackets (`a[1-2]b[3-4]`).
            let mut tails = Vec::new();
            expand_entry(suffix, &mut tails)?;
            let head = format!("{prefix}{n:0width$}", width = a.len());
            if tails.is_empty() {
                out.push(head);
            } else {
                out.extend(tails.into_iter().map(|t| format!("{head}{t}")));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn none() -> LaunchFlags {
        LaunchFlags::default()
    }

    #[test]
    fn flags_win_over_the_environment() {
        let flags = LaunchFlags {
            nodes: Some(2),
            node_rank: Some(1),
            rendezvous: Some("10.0.0.1:4000".into()),
        };
        let l = resolve(&flags, &env(&[("WORLD_SIZE", "8"), ("RANK", "3")]))
            .unwrap()
            .unwrap();
        assert_eq!(
            l,
            Launch {
                nodes: 2,
                node: 1,
                rendezvous: "10.0.0.1:4000".into(),
                local_rank: None,
                source: LaunchSource::Flags
            }
        );
        // One node is the one-machine run, whatever else is set.
        let one = LaunchFlags {
            nodes: Some(1),
            ..none()
        };
        assert_eq!(resolve(&one, &env(&[])).unwrap(), None);
        assert_eq!(resolve(&none(), &env(&[])).unwrap(), None);
    }

    #[test]
    fn torchrun_variables_name_the_node_and_rank_zero() {
        let l = resolve(
            &none(),
            &env(&[
                ("WORLD_SIZE", "4"),
                ("RANK", "2"),
                ("LOCAL_RANK", "0"),
                ("MASTER_ADDR", "node-a"),
                ("MASTER_PORT", "29400"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!((l.nodes, l.node, l.local_rank), (4, 2, Some(0)));
        assert_eq!(l.rendezvous, "node-a:29400");
        assert_eq!(l.source, LaunchSource::Torchrun);
        let v6 = resolve(
            &none(),
            &env(&[
                ("WORLD_SIZE", "2"),
                ("RANK", "0"),
                ("MASTER_ADDR", "fd00::1"),
                ("MASTER_PORT", "1234"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(v6.rendezvous, "[fd00::1]:1234");
        // A world of one is a plain run.
        let single = env(&[("WORLD_SIZE", "1"), ("RANK", "0")]);
        assert_eq!(resolve(&none(), &single).unwrap(), None);
    }

    #[test]
    fn slurm_takes_rank_zero_from_the_node_list() {
        let l = resolve(
            &none(),
            &env(&[
                ("SLURM_STEP_NUM_TASKS", "3"),
                ("SLURM_PROCID", "1"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_JOB_NODELIST", "gpu[07-09]"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!((l.nodes, l.node, l.local_rank), (3, 1, Some(0)));
        assert_eq!(l.rendezvous, format!("gpu07:{DEFAULT_PORT}"));
        assert_eq!(l.source, LaunchSource::Slurm);
        // MASTER_ADDR/MASTER_PORT, when the job script sets them, win.
        let l = resolve(
            &none(),
            &env(&[
                ("SLURM_STEP_NUM_TASKS", "2"),
                ("SLURM_PROCID", "0"),
                ("SLURM_NODELIST", "a,b"),
                ("MASTER_ADDR", "b"),
                ("MASTER_PORT", "7000"),
            ]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(l.rendezvous, "b:7000");
        // A batch script's own variables (no srun step): one node.
        let batch = env(&[
            ("SLURM_NTASKS", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_JOB_NODELIST", "gpu[01-04]"),
        ]);
        assert_eq!(resolve(&none(), &batch).unwrap(), None);
    }

    #[test]
    fn node_lists_expand_like_slurm() {
        assert_eq!(
            expand_nodelist("gpu[01-03,07],login1").unwrap(),
            ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
        );
        assert_eq!(
            expand_nodelist("r[1-2]n[8-9]").unwrap(),
            ["r1n8", "r1n9", "r2n8", "r2n9"]
        );
        assert_eq!(expand_nodelist("single").unwrap(), ["single"]);
        assert_eq!(
            expand_nodelist("a[9-10],b").unwrap(),
            ["a9", "a10", "b"],
            "no padding without a leading zero"
        );
        for bad in ["gpu[01-03", "gpu[a-b]", "gpu[5-3]"] {
            assert!(expand_nodelist(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_launches_say_which_flag_or_variable() {
        type Case<'a> = (LaunchFlags, Vec<(&'a str, &'a str)>, &'a str);
        let cases: Vec<Case> = vec![
            (
                LaunchFlags {
                    nodes: Some(2),
                    node_rank: Some(2),
                    rendezvous: Some("h:1".into()),
                },
                vec![],
                "--node-rank 2 is outside 0..2",
            ),
            (
                LaunchFlags {
                    nodes: Some(2),
                    node_rank: Some(1),
                    rendezvous: None,
                },
                vec![],
                "needs --rendezvous",
            ),
            (
                LaunchFlags {
                    nodes: Some(2),
                    node_rank: None,
                    rendezvous: Some("h:1".into()),
                },
                vec![],
                "needs --node-rank",
            ),
            (
                LaunchFlags {
                    nodes: Some(2),
                    node_rank: Some(0),
                    rendezvous: Some("nohost".into()),
                },
                vec![],
                "\"nohost\" is not HOST:PORT",
            ),
            (
                none(),
                vec![("WORLD_SIZE", "2"), ("RANK", "x")],
                "RANK=\"x\" is not a whole number",
            ),
            (
                none(),
                vec![("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_PORT", "1")],
                "MASTER_ADDR is not",
            ),
            (
                none(),
                vec![
                    ("WORLD_SIZE", "2"),
                    ("RANK", "1"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT=\"99999\" is not a port",
            ),
            (
                none(),
                vec![("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_PROCID", "5")],
                "SLURM_PROCID=5 is outside 0..2",
            ),
            (
                none(),
                vec![("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_PROCID", "1")],
                "SLURM_JOB_NODELIST",
            ),
        ];
        for (flags, vars, want) in cases {
            let e = resolve(&flags, &env(&vars)).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
        }
    }

    #[test]
    fn addresses_are_host_and_port() {
        assert!(check_address("127.0.0.1:29500", "x").is_ok());
        assert!(check_address("[::1]:80", "x").is_ok());
        assert!(check_address(":80", "x").is_err());
        assert!(check_address("h:0", "x").is_err());
        assert_eq!(port_of("h:81"), Some(81));
    }
}
