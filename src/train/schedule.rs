//! Learning-rate schedule: linear warm-up, then cosine decay (or constant).

/// Learning rate at `step` (0-based) of `total` steps.
pub fn lr_at(
    base: f64,
    step: usize,
    total: usize,
    warmup: usize,
    cosine: bool,
    min_ratio: f64,
) -> f64 {
    if warmup > 0 && step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    if !cosine {
        return base;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let t = ((step - warmup.min(step)) as f64 / span).clamp(0.0, 1.0);
    let min = base * min_ratio;
    min + (base - min) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine() {
        assert!((lr_at(1.0, 0, 100, 10, true, 0.1) - 0.1).abs() < 1e-12);
        assert!((lr_at(1.0, 9, 100, 10, true, 0.1) - 1.0).abs() < 1e-12);
        assert!((lr_at(1.0, 10, 100, 10, true, 0.1) - 1.0).abs() < 1e-12);
        assert!((lr_at(1.0, 55, 100, 10, true, 0.1) - 0.55).abs() < 1e-9);
        assert!((lr_at(1.0, 100, 100, 10, true, 0.1) - 0.1).abs() < 1e-12);
        assert_eq!(lr_at(0.5, 70, 100, 0, false, 0.1), 0.5);
    }
}
