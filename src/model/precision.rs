//! Numeric precision of a policy (`model.dtype`): `"f32"` or `"bf16"`.
//!
//! Under bf16 the forward and backward passes run in bf16 (weights used
//! in bf16, activations in bf16), while everything that accumulates stays
//! in f32: the trained parameters are f32 master `Var`s (cast to bf16 at
//! each forward, so their gradients arrive in f32 through the cast's
//! backward), AdamW's moments are f32, and the numerically delicate steps
//! (RMSNorm statistics, attention softmax, the LM head's log-softmax and
//! entropy) are computed in f32 like HF does. Frozen weights — a LoRA
//! run's base, the KL reference, rollout weights — are stored in bf16,
//! which halves their memory. The default is bf16 on CUDA and f32 on CPU,
//! where candle widens bf16 matmuls to f32 anyway (correct, slower); the
//! CPU bf16 path exists so that it is tested where CI runs.

use std::fmt;
use std::str::FromStr;

use candle_core::DType;
use serde::{Deserialize, Serialize};

use super::device::DeviceSpec;

/// A policy's compute precision, as an experiment file names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Precision {
    F32,
    Bf16,
}

/// A dtype name that is neither `f32` nor `bf16`. The message completes the
/// setting's key ("model.dtype must be …") in config errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be \"f32\" or \"bf16\", got \"{0}\"")]
pub struct UnknownPrecision(pub String);

impl FromStr for Precision {
    type Err = UnknownPrecision;

    fn from_str(s: &str) -> Result<Self, UnknownPrecision> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            _ => Err(UnknownPrecision(s.to_string())),
        }
    }
}

impl TryFrom<String> for Precision {
    type Error = UnknownPrecision;

    fn try_from(s: String) -> Result<Self, UnknownPrecision> {
        s.parse()
    }
}

impl From<Precision> for String {
    fn from(p: Precision) -> String {
        p.to_string()
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

impl Precision {
    /// The precision a setting resolves to on `device`: the one asked for,
    /// else bf16 on CUDA and f32 on CPU.
    pub fn resolve(asked: Option<Precision>, device: DeviceSpec) -> Precision {
        asked.unwrap_or(match device {
            DeviceSpec::Cpu => Precision::F32,
            DeviceSpec::Cuda(_) => Precision::Bf16,
        })
    }

    /// The candle dtype of the compute path.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// Bytes per stored (frozen) weight.
    pub fn bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_defaults_follow_the_device() {
        for p in [Precision::F32, Precision::Bf16] {
            assert_eq!(p.to_string().parse::<Precision>().unwrap(), p);
        }
        assert!("fp16".parse::<Precision>().is_err());
        assert_eq!(Precision::resolve(None, DeviceSpec::Cpu), Precision::F32);
        assert_eq!(
            Precision::resolve(None, DeviceSpec::Cuda(1)),
            Precision::Bf16
        );
        assert_eq!(
            Precision::resolve(Some(Precision::Bf16), DeviceSpec::Cpu),
            Precision::Bf16
        );
        assert_eq!(Precision::Bf16.dtype(), DType::BF16);
    }
}
