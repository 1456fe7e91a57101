//! Devices by name (`model.device`): `"cpu"` (the default), `"cuda"` or
//! `"cuda:N"`. CUDA needs a build with `--features cuda` and a GPU; the
//! model then runs in f32 there too.

use candle_core::Device;

use super::error::{ModelError, Result};

/// What a device name asks for, without touching any hardware.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

impl DeviceSpec {
    /// Parses `cpu`, `cuda`, `cuda:N`.
    pub fn parse(s: &str) -> Result<DeviceSpec> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| {
                    ModelError::InvalidConfig(format!(
                        "device \"{s}\": expected \"cpu\", \"cuda\" or \"cuda:N\""
                    ))
                }),
        }
    }

    /// Whether this build can use the device at all.
    pub fn compiled(self) -> bool {
        match self {
            DeviceSpec::Cpu => true,
            DeviceSpec::Cuda(_) => candle_core::utils::cuda_is_available(),
        }
    }
}

/// Opens the device `s` names.
pub fn parse(s: &str) -> Result<Device> {
    match DeviceSpec::parse(s)? {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) => {
            if !DeviceSpec::Cuda(n).compiled() {
                return Err(ModelError::InvalidConfig(format!(
                    "device \"{s}\" needs a build with `--features cuda`"
                )));
            }
            Device::new_cuda(n).map_err(|e| {
                ModelError::InvalidConfig(format!("device \"{s}\" cannot be opened: {e}"))
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_cuda_needs_the_feature() {
        assert_eq!(DeviceSpec::parse("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("cuda").unwrap(), DeviceSpec::Cuda(0));
        assert_eq!(DeviceSpec::parse("cuda:3").unwrap(), DeviceSpec::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:x", "CPU"] {
            assert!(DeviceSpec::parse(bad).is_err(), "{bad}");
        }
        assert!(parse("cpu").unwrap().is_cpu());
        if !cfg!(feature = "cuda") {
            let e = parse("cuda:0").unwrap_err().to_string();
            assert!(e.contains("--features cuda"), "{e}");
        }
    }
}
