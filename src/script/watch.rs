//! File watching for hot reload. Editors often save by writing a temporary
//! file and renaming it over the original, which drops a watch on the file
//! itself; so the *parent directory* is watched and events are filtered by
//! file name. Events are debounced: a reload waits until the file has been
//! quiet for a moment, so a half-written file is never compiled.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

use notify::{RecommendedWatcher, RecursiveMode, Watcher};

/// How long a file must be quiet before it is reloaded.
pub const DEBOUNCE: Duration = Duration::from_millis(150);

/// Watches a set of files through their parent directories.
pub struct FileWatcher {
    _watcher: RecommendedWatcher,
    rx: Receiver<notify::Result<notify::Event>>,
    /// (directory, file name) pairs of the watched files.
    names: BTreeSet<(PathBuf, OsString)>,
    dirty: bool,
    last_event: Option<Instant>,
}

/// Errors setting up a watch.
#[derive(Debug, thiserror::Error)]
#[error("cannot watch {path}: {msg}")]
pub struct WatchError {
    pub path: String,
    pub msg: String,
}

fn split(path: &Path) -> (PathBuf, OsString) {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let dir = abs
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let name = abs.file_name().map(OsString::from).unwrap_or_default();
    (dir, name)
}

impl FileWatcher {
    /// Watch `files` (their parent directories, non-recursively).
    pub fn new(files: &[PathBuf]) -> Result<Self, WatchError> {
        let (tx, rx) = channel();
        let mut watcher = notify::recommended_watcher(tx).map_err(|e| WatchError {
            path: "-".into(),
            msg: e.to_string(),
        })?;
        let names: BTreeSet<(PathBuf, OsString)> = files.iter().map(|f| split(f)).collect();
        let dirs: BTreeSet<&PathBuf> = names.iter().map(|(d, _)| d).collect();
        for d in dirs {
            watcher
                .watch(d, RecursiveMode::NonRecursive)
                .map_err(|e| WatchError {
                    path: d.display().to_string(),
                    msg: e.to_string(),
                })?;
        }
        Ok(FileWatcher {
            _watcher: watcher,
            rx,
            names,
            dirty: false,
            last_event: None,
        })
    }

    fn drain(&mut self) {
        while let Ok(ev) = self.rx.try_recv() {
            let Ok(ev) = ev else { continue };
            if ev.kind.is_access() {
                continue;
            }
            let hit = ev.paths.iter().any(|p| {
                let (d, n) = split(p);
                self.names.contains(&(d, n))
            });
            if hit {
                self.dirty = true;
                self.last_event = Some(Instant::now());
            }
        }
    }

    /// True once if a watched file changed since the last call. Waits (at
    /// most `max_wait`) for the file to be quiet for [`DEBOUNCE`].
    pub fn changed(&mut self, max_wait: Duration) -> bool {
        self.drain();
        if !self.dirty {
            return false;
        }
        let start = Instant::now();
        while let Some(t) = self.last_event {
            if t.elapsed() >= DEBOUNCE || start.elapsed() >= max_wait {
                break;
            }
            std::thread::sleep(
                DEBOUNCE
                    .saturating_sub(t.elapsed())
                    .min(Duration::from_millis(50)),
            );
            self.drain();
        }
        self.dirty = false;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait_changed(w: &mut FileWatcher) -> bool {
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(3) {
            if w.changed(Duration::from_secs(1)) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    #[test]
    fn sees_writes_and_rename_saves_but_not_other_files() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("g.rhai");
        std::fs::write(&f, "fn plan(t, s) { none() }").unwrap();
        let mut w = FileWatcher::new(std::slice::from_ref(&f)).unwrap();
        assert!(!w.changed(Duration::ZERO));
        // Another file in the same folder: ignored.
        std::fs::write(tmp.path().join("other.rhai"), "x").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert!(!w.changed(Duration::ZERO));
        // Plain write.
        std::fs::write(&f, "fn plan(t, s) { prefix(1) }").unwrap();
        assert!(wait_changed(&mut w));
        // Editor-style save: write a temp file, rename it over the original.
        let tmpf = tmp.path().join(".g.rhai.swp");
        std::fs::write(&tmpf, "fn plan(t, s) { prefix(2) }").unwrap();
        std::fs::rename(&tmpf, &f).unwrap();
        assert!(wait_changed(&mut w));
        // And once more after the rename: the watch survived.
        std::fs::write(&f, "fn plan(t, s) { prefix(3) }").unwrap();
        assert!(wait_changed(&mut w));
    }
}
