//! Child processes that die with this one: launched inference servers,
//! subprocess envs and data-parallel workers. A run killed with SIGKILL
//! runs no destructor, so the kernel must do it: on Linux each child asks
//! for SIGKILL when its parent goes (`PR_SET_PDEATHSIG`).
//!
//! That signal follows the *thread* that forked the child, not the
//! process: a subprocess env started from a rollout's scoped thread would
//! be killed when that thread ends, mid-episode. So every child is forked
//! by one spawner thread that lives as long as the process.
//!
//! A child that forks again and does not `exec` leaves its own children
//! outside this (the signal is not inherited); launch scripts should
//! `exec` the server.

use std::io;
use std::process::{Child, Command};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};

type Request = (Command, Sender<io::Result<Child>>);

/// The spawner thread's queue (started on first use, never ends).
fn spawner() -> &'static Mutex<Sender<Request>> {
    static SPAWNER: OnceLock<Mutex<Sender<Request>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = channel::<Request>();
        std::thread::Builder::new()
            .name("actguide-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(spawn_here(&mut cmd));
                }
            })
            .expect("the spawner thread starts");
        Mutex::new(tx)
    })
}

/// Start `cmd` as a child that is killed when this process ends, however
/// it ends (Linux; elsewhere a plain spawn).
pub fn spawn(cmd: Command) -> io::Result<Child> {
    let (tx, rx) = channel();
    spawner()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((cmd, tx))
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    rx.recv()
        .map_err(|_| io::Error::other("the spawner thread is gone"))?
}

#[cfg(target_os = "linux")]
fn spawn_here(cmd: &mut Command) -> io::Result<Child> {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: between fork and exec the closure calls only prctl and
    // getppid, both async-signal-safe, and allocates nothing on success.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have gone between fork and prctl.
            if libc::getppid() != parent {
                return Err(io::Error::other("the parent process is gone"));
            }
            Ok(())
        });
    }
    cmd.spawn()
}

#[cfg(not(target_os = "linux"))]
fn spawn_here(cmd: &mut Command) -> io::Result<Child> {
    cmd.spawn()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Whether a process exists and is not a zombie (/proc).
    fn alive(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                let state = s.rsplit(')').next().unwrap_or("").split_whitespace().next();
                state != Some("Z")
            })
            .unwrap_or(false)
    }

    #[test]
    fn a_child_started_from_a_short_lived_thread_outlives_that_thread() {
        let child = std::thread::spawn(|| {
            let mut c = Command::new("sleep");
            c.arg("30");
            spawn(c).unwrap()
        })
        .join()
        .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(
            alive(child.id()),
            "killed with the thread that asked for it"
        );
        let mut child = child;
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
