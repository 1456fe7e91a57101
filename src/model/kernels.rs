//! The CPU path a policy takes, chosen at start-up from the CPU and from
//! what is installed: which products run in bf16 by default.
//!
//! bf16 products (MKL's `cblas_gemm_bf16bf16f32`) pay only where the CPU
//! multiplies bf16 in hardware tiles (AMX): there they ran SmolLM2-135M's
//! decode 1.7–2.4× and its training ≥ 1.7× faster than f32 on 2 cores of an
//! Intel Xeon (docs/THROUGHPUT.md); on AVX-512 without AMX (AMD Zen 4/5,
//! whose AVX512-BF16 MKL does not use for these products) the same
//! products were slower than f32, and on AVX2-only CPUs MKL has no bf16
//! kernel worth taking. So [`Kernels::detect`] turns bf16 rollout weights
//! and mixed-precision training on by default exactly where the CPU has
//! AMX-BF16 and MKL is loaded, and only for models whose product weights
//! leave the caches (≥ 16M elements): the built-in tiny models stay f32 and
//! bit-identical. An experiment's `model.rollout_bf16` and
//! `model.mixed_precision` (`true`/`false`) override the choice; the run
//! header prints it with the reason.

use std::fmt;

use super::llama::Policy;

/// Product weights (elements) from which a model counts as large: the
/// size at which generation also packs its f32 weights.
pub(crate) const LARGE_MODEL_ELEMS: usize = 1 << 24;

/// The CPU's name and the instruction sets the kernels choose by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuInfo {
    /// `/proc/cpuinfo`'s model name (`"unknown CPU"` where unreadable).
    pub model: String,
    pub avx2: bool,
    pub avx512: bool,
    pub avx512_bf16: bool,
    pub amx_bf16: bool,
}

impl CpuInfo {
    /// This machine's CPU.
    pub fn detect() -> CpuInfo {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        };
        let flags = field("flags").unwrap_or_default();
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        CpuInfo {
            model: field("model name").unwrap_or_else(|| "unknown CPU".into()),
            avx2: has("avx2"),
            avx512: has("avx512f"),
            avx512_bf16: has("avx512_bf16"),
            amx_bf16: has("amx_bf16"),
        }
    }

    /// The CPU class the defaults are chosen for.
    pub fn class(&self) -> &'static str {
        if self.amx_bf16 {
            "AMX-BF16"
        } else if self.avx512 {
            "AVX-512, no AMX"
        } else if self.avx2 {
            "AVX2"
        } else {
            "no AVX2"
        }
    }
}

impl fmt::Display for CpuInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut flags = Vec::new();
        for (on, name) in [
            (self.avx2, "avx2"),
            (self.avx512, "avx512f"),
            (self.avx512_bf16, "avx512_bf16"),
            (self.amx_bf16, "amx_bf16"),
        ] {
            if on {
                flags.push(name);
            }
        }
        write!(f, "{} ({})", self.model, flags.join(" "))
    }
}

/// The bf16 choices for one policy and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernels {
    pub cpu: CpuInfo,
    /// Generate from bf16 weight copies.
    pub rollout_bf16: bool,
    /// Train with bf16 products.
    pub mixed_precision: bool,
    /// What the defaults would be here (bf16 for both, or f32 for both).
    pub default_bf16: bool,
    /// Why the defaults are what they are (one clause).
    pub reason: String,
}

impl Kernels {
    /// The defaults for `policy` on this machine: bf16 where it pays (see
    /// the module docs). `asked_*`: an experiment's explicit setting,
    /// which wins.
    pub fn detect(
        policy: &Policy,
        asked_rollout: Option<bool>,
        asked_mixed: Option<bool>,
    ) -> Kernels {
        let cpu = CpuInfo::detect();
        let (pays, reason) = bf16_pays(policy, &cpu);
        Kernels {
            rollout_bf16: asked_rollout.unwrap_or(pays),
            mixed_precision: asked_mixed.unwrap_or(pays),
            default_bf16: pays,
            reason,
            cpu,
        }
    }

    /// The choices `policy` runs with now, beside this machine's defaults.
    pub fn of(policy: &Policy) -> Kernels {
        Kernels::detect(
            policy,
            Some(policy.rollout_bf16()),
            Some(policy.mixed_precision()),
        )
    }

    /// Applies the choices to `policy` (errors where an explicit `true`
    /// cannot run here).
    pub fn apply(&self, policy: &mut Policy) -> super::error::Result<()> {
        policy.set_rollout_bf16(self.rollout_bf16)?;
        policy.set_mixed_precision(self.mixed_precision)
    }

    /// One line for run headers and benchmarks.
    pub fn line(&self) -> String {
        let onoff = |b: bool, key: &str| {
            let v = if b { "bf16" } else { "f32" };
            if b == self.default_bf16 {
                v.to_string()
            } else {
                format!("{v} (model.{key})")
            }
        };
        format!(
            "CPU {} [{}]: rollout weights {}, training products {}; {}",
            self.cpu,
            self.cpu.class(),
            onoff(self.rollout_bf16, "rollout_bf16"),
            onoff(self.mixed_precision, "mixed_precision"),
            self.reason
        )
    }
}

/// Whether bf16 products pay for `policy` on `cpu`, and why.
fn bf16_pays(policy: &Policy, cpu: &CpuInfo) -> (bool, String) {
    if !policy.device().is_cpu() {
        return (false, "not on the CPU".into());
    }
    if policy.precision() != super::Precision::F32 {
        return (false, format!("compute dtype {}", policy.precision()));
    }
    if !cpu.amx_bf16 {
        return (
            false,
            "default f32: no AMX-BF16, where MKL's bf16 products are slower than f32".into(),
        );
    }
    if !super::ops::mixed_precision_available() {
        return (
            false,
            "default f32: AMX-BF16 but no BLAS with bf16 products (scripts/install-mkl.sh)".into(),
        );
    }
    if !policy.is_large() {
        return (
            false,
            "default f32: the model fits the caches, where bf16 has nothing to win".into(),
        );
    }
    (true, "default bf16: AMX-BF16 with MKL".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_models_stay_f32_whatever_the_cpu() {
        use rand::SeedableRng;
        let cfg = crate::tiny::tiny_config(64);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        let p = Policy::new_random(&cfg, &mut rng, &candle_core::Device::Cpu).unwrap();
        let k = Kernels::detect(&p, None, None);
        assert!(!k.rollout_bf16 && !k.mixed_precision, "{}", k.line());
        assert!(k.line().contains("f32"), "{}", k.line());
        // An explicit setting wins over the default.
        let k = Kernels::detect(&p, Some(false), Some(false));
        assert!(!k.rollout_bf16 && !k.mixed_precision);
    }

    #[test]
    fn cpu_class_follows_the_flags() {
        let mut c = CpuInfo {
            model: "x".into(),
            avx2: true,
            avx512: true,
            avx512_bf16: true,
            amx_bf16: false,
        };
        assert_eq!(c.class(), "AVX-512, no AMX");
        c.amx_bf16 = true;
        assert_eq!(c.class(), "AMX-BF16");
        assert!(c.to_string().contains("amx_bf16"));
    }
}
