//! Value parsers of the numeric flags: each flag's valid range, refused
//! by clap with the flag named (`--k 0` is an error, not K = 1).

use clap::builder::RangedU64ValueParser;

/// A count of at least `min`.
pub fn at_least(min: u64) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(min..)
}

/// Extra attempts of a request: a few, not a loop.
pub fn retries(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n > 100 {
        return Err(format!("must be at most 100, got {n}"));
    }
    Ok(n)
}

fn float(s: &str, ok: fn(f64) -> bool, what: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if !x.is_finite() || !ok(x) {
        return Err(format!("must be {what}, got {s}"));
    }
    Ok(x)
}

/// A finite number.
pub fn finite(s: &str) -> Result<f64, String> {
    float(s, |_| true, "a finite number")
}

/// A finite number > 0.
pub fn positive(s: &str) -> Result<f64, String> {
    float(s, |x| x > 0.0, "a finite number > 0")
}

/// A finite number ≥ 0.
pub fn non_negative(s: &str) -> Result<f64, String> {
    float(s, |x| x >= 0.0, "a finite number ≥ 0")
}

/// A number in [0, 1].
pub fn fraction(s: &str) -> Result<f64, String> {
    float(s, |x| (0.0..=1.0).contains(&x), "in [0, 1]")
}
