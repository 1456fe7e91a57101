//! Flags several subcommands share, so that one flag name means one thing
//! everywhere: `--device` (one parser, one default rule), `--panel`
//! (`test|train|PATH`), and the closed sets `--protocol` and `--id-field`.

use actguide::model::device::DeviceSpec;
use clap::{Args, ValueEnum};

/// `--device cpu|cuda|cuda:N`. Default: where the command reads a run,
/// the run's `model.device`; otherwise the CPU.
#[derive(Args, Clone, Copy, Debug, Default)]
pub struct DeviceArg {
    /// Device: cpu, cuda or cuda:N (default: the run's model.device, else
    /// cpu).
    #[arg(long, value_name = "cpu|cuda|cuda:N")]
    pub device: Option<DeviceSpec>,
}

impl DeviceArg {
    /// The device of a command that reads no run.
    pub fn or_cpu(self) -> DeviceSpec {
        self.device.unwrap_or(DeviceSpec::Cpu)
    }
}

/// The value name every `--panel` flag shows.
pub const PANEL: &str = "test|train|PATH";

/// `--protocol` of `serve-env`: how the env is served. (The variants have
/// no doc comments: those would turn `--help` into one block per value;
/// the flag's help line says what each is.)
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    // NDJSON on stdin/stdout (envs/PROTOCOL.md).
    Stdio,
    // AgentGym's HTTP API.
    Http,
}

/// `--id-field` of an HTTP env: the key an AgentGym server names its envs
/// by (`env.id_field` of an experiment file).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdField {
    // The ALFWorld adapter (and `actguide serve-env`).
    #[value(name = "id")]
    Id,
    // The WebShop adapter.
    #[value(name = "env_idx")]
    EnvIdx,
}

impl IdField {
    /// The JSON key, as the env client takes it.
    pub fn key(self) -> String {
        let f = match self {
            IdField::Id => actguide::experiment::config::IdField::Id,
            IdField::EnvIdx => actguide::experiment::config::IdField::EnvIdx,
        };
        f.as_str().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_field_names_are_the_experiment_files() {
        let names: Vec<String> = IdField::value_variants()
            .iter()
            .map(|v| v.to_possible_value().unwrap().get_name().to_string())
            .collect();
        assert_eq!(names, ["id", "env_idx"]);
        assert_eq!(IdField::Id.key(), "id");
        assert_eq!(IdField::EnvIdx.key(), "env_idx");
    }

    #[test]
    fn a_command_without_a_run_defaults_to_the_cpu() {
        assert_eq!(DeviceArg::default().or_cpu(), DeviceSpec::Cpu);
        let d = DeviceArg {
            device: Some(DeviceSpec::Cuda(1)),
        };
        assert_eq!(d.or_cpu(), DeviceSpec::Cuda(1));
    }
}
