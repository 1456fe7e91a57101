//! One live run per directory. A run holds an exclusive advisory lock on
//! `<run>/lock` for its whole life (the OS drops it when the process ends,
//! however it ends), so a second start or a `--resume` of a live run is
//! refused instead of interleaving its lines with the first one's. New runs
//! claim their directory with `create_dir` plus the lock, so two starts of
//! one experiment at the same moment get `runs/<name>` and `runs/<name>-2`.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::RunDirError;

/// The lock file in a run directory; it holds the owner's process id.
pub const LOCK_FILE: &str = "lock";

/// An exclusive hold on a run directory, released on drop.
#[derive(Debug)]
pub struct RunLock {
    _file: File,
    dir: PathBuf,
}

impl RunLock {
    /// Lock `dir` (which must exist) for this process, or fail with
    /// [`RunDirError::Busy`] naming the process that holds it.
    pub fn acquire(dir: &Path) -> Result<RunLock, RunDirError> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(RunDirError::io(&path))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                // Best effort: the holder wrote its pid after locking.
                let _ = file.read_to_string(&mut holder);
                return Err(RunDirError::Busy {
                    dir: dir.to_path_buf(),
                    holder: holder.trim().to_string(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(RunDirError::io(&path)(e)),
        }
        let pid = std::process::id().to_string();
        file.set_len(0)
            .and_then(|_| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(pid.as_bytes()))
            .map_err(RunDirError::io(&path))?;
        Ok(RunLock {
            _file: file,
            dir: dir.to_path_buf(),
        })
    }

    /// The directory this lock holds.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Claim the first of `base`, `base-2`, `base-3`, … that `taken` does not
/// reject and no live process holds: create it and lock it.
pub fn claim(base: &Path, taken: impl Fn(&Path) -> bool) -> Result<RunLock, RunDirError> {
    if let Some(parent) = base.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(RunDirError::io(parent))?;
    }
    let name = base.file_name().and_then(|s| s.to_str()).unwrap_or("run");
    let candidates = std::iter::once(base.to_path_buf())
        .chain((2..).map(|i| base.with_file_name(format!("{name}-{i}"))));
    for dir in candidates {
        if taken(&dir) {
            continue;
        }
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            // An empty directory, or one another start created a moment ago.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(RunDirError::io(&dir)(e)),
        }
        match RunLock::acquire(&dir) {
            // Checked again under the lock: a run may have finished there
            // between the first look and the lock.
            Ok(lock) if !taken(&dir) => return Ok(lock),
            Ok(_) | Err(RunDirError::Busy { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    unreachable!("the candidate names never run out")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_directory_is_refused_until_released() {
        let tmp = tempfile::tempdir().unwrap();
        let a = RunLock::acquire(tmp.path()).unwrap();
        let e = RunLock::acquire(tmp.path()).unwrap_err();
        match &e {
            RunDirError::Busy { holder, .. } => {
                assert_eq!(holder, &std::process::id().to_string())
            }
            other => panic!("{other:?}"),
        }
        assert!(
            e.to_string().contains("in use by another actguide process"),
            "{e}"
        );
        drop(a);
        RunLock::acquire(tmp.path()).unwrap();
    }

    #[test]
    fn concurrent_claims_get_distinct_directories() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("runs").join("q");
        let never = |_: &Path| false;
        let a = claim(&base, never).unwrap();
        let b = claim(&base, never).unwrap();
        let c = claim(&base, never).unwrap();
        assert_eq!(a.dir(), base);
        assert_eq!(b.dir(), tmp.path().join("runs").join("q-2"));
        assert_eq!(c.dir(), tmp.path().join("runs").join("q-3"));
        // From threads at once: all distinct.
        let base2 = tmp.path().join("runs").join("r");
        let dirs: Vec<PathBuf> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..6)
                .map(|_| s.spawn(|| claim(&base2, never).unwrap()))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        })
        .iter()
        .map(|l| l.dir().to_path_buf())
        .collect();
        let unique: std::collections::BTreeSet<_> = dirs.iter().collect();
        assert_eq!(unique.len(), 6, "{dirs:?}");
    }
}
