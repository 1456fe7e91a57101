//! Saved script versions: every version a run used, with its imports in
//! the same relative layout, so a resumed run can load the version that was
//! active at its checkpoint even after the original files changed.

use std::path::{Path, PathBuf};

use super::{write_atomic, RunDirError};
use crate::script::Script;

/// Save `script` as `<scripts_dir>/<role>-<hash>/<file>` plus its imported
/// files beside it (once per version); returns the main file's path.
pub fn save_copy(scripts_dir: &Path, role: &str, script: &Script) -> Result<String, RunDirError> {
    let dir = scripts_dir.join(format!("{role}-{}", script.hash));
    let name = script
        .path
        .file_name()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("script.rhai"));
    let main = dir.join(&name);
    if !main.exists() {
        write_atomic(&main, script.source.as_bytes())?;
        let root = script.path.parent().unwrap_or(Path::new("."));
        for (p, src) in &script.imports {
            let rel = p
                .strip_prefix(root)
                .map(Path::to_path_buf)
                .unwrap_or_else(|_| PathBuf::from(p.file_name().unwrap_or_default()));
            write_atomic(&dir.join(rel), src.as_bytes())?;
        }
    }
    Ok(main.display().to_string())
}
