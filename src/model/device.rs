//! Devices by name (`model.device`): `"cpu"` (the default), `"cuda"` or
//! `"cuda:N"`. CUDA needs a build with `--features cuda` and a GPU; the
//! model then runs in f32 there too.
//!
//! [`DeviceSpec`] is the setting as an experiment file holds it: it
//! (de)serializes as its name, so an unknown name fails while the file is
//! read, and it touches no hardware until [`DeviceSpec::open`].

use std::fmt;
use std::str::FromStr;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::error::{ModelError, Result};

/// What a device name asks for, without touching any hardware.
///
/// Written back as `"cpu"` or `"cuda:N"` (`"cuda"` reads as `"cuda:0"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
}

/// A device name that is none of `cpu`, `cuda`, `cuda:N`. The message
/// completes the setting's key ("model.device must be …") in config errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("must be \"cpu\", \"cuda\" or \"cuda:N\", got \"{0}\"")]
pub struct UnknownDevice(pub String);

impl FromStr for DeviceSpec {
    type Err = UnknownDevice;

    /// Parses `cpu`, `cuda`, `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<Self, UnknownDevice> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| UnknownDevice(s.to_string())),
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = UnknownDevice;

    fn try_from(s: String) -> std::result::Result<Self, UnknownDevice> {
        s.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(d: DeviceSpec) -> String {
        d.to_string()
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    /// Parses `cpu`, `cuda`, `cuda:N`.
    pub fn parse(s: &str) -> Result<DeviceSpec> {
        s.parse().map_err(|_| {
            ModelError::InvalidConfig(format!(
                "device \"{s}\": expected \"cpu\", \"cuda\" or \"cuda:N\""
            ))
        })
    }

    /// Whether this build can use the device at all.
    pub fn compiled(self) -> bool {
        match self {
            DeviceSpec::Cpu => true,
            DeviceSpec::Cuda(_) => candle_core::utils::cuda_is_available(),
        }
    }

    /// Opens the device; `name` is what the user wrote, for errors.
    fn open_named(self, name: &str) -> Result<Device> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => {
                if !self.compiled() {
                    return Err(ModelError::InvalidConfig(format!(
                        "device \"{name}\" needs a build with `--features cuda`"
                    )));
                }
                // The driver is opened at run time (vendor/README.md):
                // without it cudarc would panic at the first call.
                #[cfg(feature = "cuda")]
                // SAFETY: only tries to open the driver library.
                if !unsafe { candle_core::cuda::cudarc::driver::sys::is_culib_present() } {
                    return Err(ModelError::InvalidConfig(format!(
                        "device \"{name}\": no NVIDIA driver here (libcuda.so.1 is not on the \
                         library path)"
                    )));
                }
                Device::new_cuda(n).map_err(|e| {
                    ModelError::InvalidConfig(format!("device \"{name}\" cannot be opened: {e}"))
                })
            }
        }
    }

    /// Opens the device.
    pub fn open(self) -> Result<Device> {
        self.open_named(&self.to_string())
    }
}

/// Opens the device `s` names.
pub fn parse(s: &str) -> Result<Device> {
    DeviceSpec::parse(s)?.open_named(s)
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

    #[test]
    fn specs_round_trip_through_serde_as_their_names() {
        for (name, spec, back) in [
            ("cpu", DeviceSpec::Cpu, "cpu"),
            ("cuda", DeviceSpec::Cuda(0), "cuda:0"),
            ("cuda:2", DeviceSpec::Cuda(2), "cuda:2"),
        ] {
            let d: DeviceSpec = serde_json::from_value(serde_json::json!(name)).unwrap();
            assert_eq!(d, spec);
            assert_eq!(serde_json::to_value(d).unwrap(), serde_json::json!(back));
        }
        let e = serde_json::from_value::<DeviceSpec>(serde_json::json!("gpu"))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "must be \"cpu\", \"cuda\" or \"cuda:N\", got \"gpu\"");
        assert!(DeviceSpec::default().open().unwrap().is_cpu());
    }
}
