//! Per-token policy losses: the clipped PPO/GRPO surrogate and LUFFY's
//! shaped off-policy loss (docs/ALGORITHMS.md §1).

use candle_core::Tensor;

/// Per-token PPO loss (to be minimised) and the ratio π_θ/π_old:
/// max(−Â ρ, −Â clip(ρ, 1−ε_low, 1+ε_high)), and for Â < 0 with dual clip c
/// also capped at −c Â (ALGORITHMS.md §1).
pub fn ppo_token_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    adv: &Tensor,
    clip_low: f64,
    clip_high: f64,
    dual_clip: f64,
) -> Result<(Tensor, Tensor), candle_core::Error> {
    let ratio = (logp - old_logp)?.exp()?;
    let neg_adv = adv.neg()?;
    let l1 = (&neg_adv * &ratio)?;
    let l2 = (&neg_adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)?)?;
    let mut pg = l1.maximum(&l2)?;
    if dual_clip > 0.0 {
        let cap = (&neg_adv * dual_clip)?;
        pg = adv.lt(0.0f32)?.where_cond(&pg.minimum(&cap)?, &pg)?;
    }
    Ok((pg, ratio))
}

/// LUFFY's off-policy token loss: −Â · f(π_θ), f(x) = x / (x + γ), with
/// the behaviour probability of expert data taken as 1 and no clipping.
/// The shaping keeps gradients of low-probability expert tokens large
/// (f'(x) = γ / (x + γ)²) instead of vanishing with x.
pub fn luffy_token_loss(
    logp: &Tensor,
    adv: &Tensor,
    gamma: f64,
) -> Result<Tensor, candle_core::Error> {
    let x = logp.exp()?;
    let f = (&x / (&x + gamma)?)?;
    adv.neg()? * f
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Loss and d loss / d logp for one token.
    fn one(logp: f32, old: f32, adv: f32) -> (f32, f32) {
        let dev = Device::Cpu;
        let lp = Var::new(&[logp], &dev).unwrap();
        let old = Tensor::new(&[old], &dev).unwrap();
        let adv = Tensor::new(&[adv], &dev).unwrap();
        let (pg, _) = ppo_token_loss(lp.as_tensor(), &old, &adv, 0.2, 0.28, 3.0).unwrap();
        let g = pg.sum_all().unwrap().backward().unwrap();
        let grad = g
            .get(lp.as_tensor())
            .map(|t| t.to_vec1::<f32>().unwrap()[0])
            .unwrap_or(0.0);
        (pg.to_vec1::<f32>().unwrap()[0], grad)
    }

    #[test]
    fn ppo_loss_clips_and_dual_clips() {
        // ratio 1: loss −A, gradient −A (push up good tokens).
        let (l, g) = one(-1.0, -1.0, 2.0);
        assert!((l + 2.0).abs() < 1e-6 && (g + 2.0).abs() < 1e-5, "{l} {g}");
        // A > 0, ratio 1.5 > 1 + 0.28: clipped, loss −1.28 A, no gradient.
        let (l, g) = one(1.5f32.ln(), 0.0, 1.0);
        assert!((l + 1.28).abs() < 1e-5 && g == 0.0, "{l} {g}");
        // A < 0, ratio 0.5 < 1 − 0.2: clipped at 0.8, no gradient.
        let (l, g) = one(0.5f32.ln(), 0.0, -1.0);
        assert!((l - 0.8).abs() < 1e-5 && g == 0.0, "{l} {g}");
        // A < 0, ratio 5: unclipped would be 5|A|, dual clip caps at 3|A|.
        let (l, g) = one(5f32.ln(), 0.0, -1.0);
        assert!((l - 3.0).abs() < 1e-5 && g == 0.0, "{l} {g}");
        // A < 0, ratio 2 (inside the dual-clip cap): loss 2|A|, gradient flows.
        let (l, g) = one(2f32.ln(), 0.0, -1.0);
        assert!((l - 2.0).abs() < 1e-5 && (g - 2.0).abs() < 1e-4, "{l} {g}");
    }

    #[test]
    fn luffy_loss_is_shaped_and_unclipped() {
        let dev = Device::Cpu;
        let gamma = 0.1;
        for (p, a) in [(0.05f32, 1.0f32), (0.9, 1.0), (0.3, -2.0)] {
            let lp = Var::new(&[p.ln()], &dev).unwrap();
            let adv = Tensor::new(&[a], &dev).unwrap();
            let l = luffy_token_loss(lp.as_tensor(), &adv, gamma).unwrap();
            let g = l.sum_all().unwrap().backward().unwrap();
            let grad = g.get(lp.as_tensor()).unwrap().to_vec1::<f32>().unwrap()[0];
            let x = p as f64;
            let want_l = -(a as f64) * x / (x + gamma);
            // d/dlogp of -A x/(x+g) = -A g x / (x+g)^2
            let want_g = -(a as f64) * gamma * x / (x + gamma).powi(2);
            let got_l = l.to_vec1::<f32>().unwrap()[0] as f64;
            assert!((got_l - want_l).abs() < 1e-5, "{got_l} {want_l}");
            assert!((grad as f64 - want_g).abs() < 1e-5, "{grad} {want_g}");
        }
        // A low-probability expert token keeps a large gradient relative to
        // its probability (plain x would give d/dlogp = x).
        let x = 0.01f64;
        assert!(gamma * x / (x + gamma).powi(2) > 0.8 * x);
    }
}
