//! `actguide export`: a run's checkpoint as a folder other tools load —
//! a full HF checkpoint (`config.json`, `model.safetensors`, tokenizer
//! files; LoRA adapters merged into the weights) or, for a LoRA run, the
//! adapters alone in PEFT's layout.

use std::path::{Path, PathBuf};

use crate::experiment::eval::load_run;
use crate::experiment::RunError;
use crate::model::ModelError;

/// What to write.
#[derive(Debug, Clone, Default)]
pub struct ExportOptions {
    /// LoRA runs only: write `adapter_config.json` +
    /// `adapter_model.safetensors` (plus the tokenizer files) instead of
    /// merged weights.
    pub adapter_only: bool,
    /// Shard the weights into files of at most this many bytes.
    pub max_shard_bytes: Option<usize>,
    /// Device to load the checkpoint on; `None`: the run's `model.device`.
    pub device: Option<crate::model::device::DeviceSpec>,
}

/// What was written.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ExportSummary {
    pub checkpoint: PathBuf,
    pub step: usize,
    pub out: PathBuf,
    /// "full" or "adapter".
    pub kind: &'static str,
    /// LoRA adapters merged into the weights.
    pub merged_lora: bool,
    pub files: Vec<String>,
}

/// Exports `path` (a run directory: its latest checkpoint; or a checkpoint
/// directory) into `out`.
pub fn export(path: &Path, out: &Path, opts: &ExportOptions) -> Result<ExportSummary, RunError> {
    let m = load_run(path, opts.device)?;
    let lora = m.trained.lora().is_some();
    let kind = if opts.adapter_only {
        if !lora {
            return Err(ModelError::InvalidArgument(format!(
                "{}: --adapter-only needs a LoRA run (this one trains every weight)",
                path.display()
            ))
            .into());
        }
        m.trained.save_adapter(out, &m.exp.model.path)?;
        "adapter"
    } else {
        let full = if lora { m.trained.merged()? } else { m.trained };
        full.save_hf_dir(out, opts.max_shard_bytes)?;
        "full"
    };
    m.src.write_side_files(out)?;
    let mut files: Vec<String> = std::fs::read_dir(out)
        .map_err(RunError::io(out))?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    files.sort();
    Ok(ExportSummary {
        checkpoint: m.ckpt_dir,
        step: m.step,
        out: out.to_path_buf(),
        kind,
        merged_lora: lora && !opts.adapter_only,
        files,
    })
}
