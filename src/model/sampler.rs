//! Host-side token choice for generation: temperature, nucleus (top-p)
//! and greedy sampling over the full vocabulary or a constrained set of
//! admissible tokens, plus the unconstrained behaviour log-prob of the
//! chosen token. Kept apart from the model (as candle keeps
//! `LogitsProcessor` apart from its models): it sees only a row of logits
//! and the RNG.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Host-side token choice for one sequence at one step.
pub(crate) struct Sampler {
    pub(crate) temperature: f64,
    pub(crate) top_p: f64,
    pub(crate) greedy: bool,
    /// Returned when no candidate is admissible.
    pub(crate) eos: u32,
}

/// Everything a pick computes from one row of logits before it draws:
/// [`Sampler::prepare`] builds it (on any thread), [`Sampler::draw`] takes
/// the one RNG draw, so the rows of a step can be prepared in parallel and
/// drawn in order with the same results as picking them one by one.
pub(crate) struct Prepared {
    /// The arg-max of the candidates (the greedy choice).
    best: u32,
    /// The nucleus: candidates and their unnormalised probabilities, in
    /// draw order (empty when greedy).
    probs: Vec<(u32, f64)>,
    /// The nucleus's total weight (summed here, off the sequential draw).
    mass: f64,
    /// The row's maximum and the log of `Σ exp((x − max) / T)` over the
    /// full vocabulary.
    max: f64,
    lse: f64,
}

/// What [`Sampler::nucleus`] finds among the candidates.
struct Nucleus {
    best: u32,
    /// As [`Prepared::probs`].
    probs: Vec<(u32, f64)>,
    /// `None` when greedy.
    weights: Option<Weights>,
}

/// The nucleus's weights, relative to the arg-max's logit `max`.
#[derive(Clone, Copy)]
struct Weights {
    max: f64,
    /// Every candidate's weight, summed in candidate order.
    total: f64,
    /// The nucleus's weight (what the draw scales its uniform by).
    mass: f64,
}

impl Sampler {
    /// Returns the chosen token and its unconstrained behaviour log-prob
    /// (generation prepares and draws its rows apart).
    #[cfg(test)]
    pub(crate) fn pick(
        &self,
        logits: &[f32],
        allowed: Option<&[u32]>,
        rng: &mut ChaCha8Rng,
    ) -> (u32, f32) {
        let prepared = self.prepare(logits, allowed);
        self.draw(logits, &prepared, rng)
    }

    /// The RNG-free part of [`Sampler::pick`].
    pub(crate) fn prepare(&self, logits: &[f32], allowed: Option<&[u32]>) -> Prepared {
        let inv_t = 1.0 / self.temperature;
        let n = match allowed {
            Some(a) => self.nucleus(logits, a.iter().copied(), inv_t),
            None => self.nucleus(logits, 0..logits.len() as u32, inv_t),
        };
        // Full-vocabulary log-softmax at the temperature, in f64.
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
        let lse = match n.weights {
            // The nucleus summed the same terms in the same order.
            Some(w) if allowed.is_none() && w.max == max => w.total.ln(),
            _ => logits
                .iter()
                .map(|&x| ((x as f64 - max) * inv_t).exp())
                .sum::<f64>()
                .ln(),
        };
        Prepared {
            best: n.best,
            mass: n.weights.map_or(0.0, |w| w.mass),
            probs: n.probs,
            max,
            lse,
        }
    }

    /// The draw of [`Sampler::pick`] from a row `prepare`d from `logits`.
    pub(crate) fn draw(&self, logits: &[f32], p: &Prepared, rng: &mut ChaCha8Rng) -> (u32, f32) {
        let tok = if self.greedy || p.probs.is_empty() {
            p.best
        } else {
            let u = rng.random::<f64>() * p.mass;
            let mut cum = 0.0;
            let mut tok = p.probs[p.probs.len() - 1].0;
            for q in &p.probs {
                cum += q.1;
                if u < cum {
                    tok = q.0;
                    break;
                }
            }
            tok
        };
        let lp = (logits[tok as usize] as f64 - p.max) * (1.0 / self.temperature) - p.lse;
        (tok, lp as f32)
    }

    /// The arg-max of `cands` and, unless greedy, the nucleus to draw from
    /// with its weights.
    fn nucleus(
        &self,
        logits: &[f32],
        cands: impl Iterator<Item = u32> + Clone,
        inv_t: f64,
    ) -> Nucleus {
        // Arg-max, ties to the lowest id (also the top-p order below).
        let best = cands
            .clone()
            .fold(None::<u32>, |best, c| match best {
                None => Some(c),
                Some(b) => {
                    let (lc, lb) = (logits[c as usize], logits[b as usize]);
                    if lc > lb || (lc == lb && c < b) {
                        Some(c)
                    } else {
                        Some(b)
                    }
                }
            })
            .unwrap_or(self.eos);
        if self.greedy {
            return Nucleus {
                best,
                probs: Vec::new(),
                weights: None,
            };
        }
        let m = logits[best as usize] as f64;
        let mut probs: Vec<(u32, f64)> = cands
            .map(|c| (c, ((logits[c as usize] as f64 - m) * inv_t).exp()))
            .collect();
        let total: f64 = probs.iter().map(|p| p.1).sum();
        let mut kept = probs.len();
        if self.top_p < 1.0 {
            // Only tokens with p >= eps can be in the nucleus: the others
            // together weigh less than n * eps = (1 - top_p) * total, so the
            // sorted prefix reaches top_p * total before leaving the p >= eps
            // set. Pruning first keeps the sort small for large vocabularies.
            let eps = total * (1.0 - self.top_p.max(0.0)) / probs.len() as f64;
            probs.retain(|p| p.1 >= eps);
            probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let target = self.top_p.max(0.0) * total;
            let mut cum = 0.0;
            kept = probs.len();
            for (j, p) in probs.iter().enumerate() {
                cum += p.1;
                if cum >= target {
                    kept = j + 1;
                    break;
                }
            }
        }
        probs.truncate(kept.max(1));
        // With top_p >= 1 the nucleus is every candidate in order, so its
        // mass is `total` bit for bit; otherwise it is summed in draw order.
        let mass = if self.top_p < 1.0 {
            probs.iter().map(|p| p.1).sum()
        } else {
            total
        };
        Nucleus {
            best,
            probs,
            weights: Some(Weights {
                max: m,
                total,
                mass,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn top_p_samples_exactly_the_nucleus() {
        let mut rng = ChaCha8Rng::seed_from_u64(28);
        for trial in 0..20 {
            let v = 60;
            let logits: Vec<f32> = (0..v).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            let top_p = [0.3, 0.6, 0.9, 0.99][trial % 4];
            let temp = [0.7, 1.0, 1.6][trial % 3];
            // Brute-force nucleus.
            let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let mut pr: Vec<(u32, f64)> = (0..v as u32)
                .map(|i| (i, ((logits[i as usize] as f64 - m) / temp).exp()))
                .collect();
            let total: f64 = pr.iter().map(|p| p.1).sum();
            pr.sort_by(|a, b| b.1.total_cmp(&a.1));
            let mut cum = 0.0;
            let mut nucleus = std::collections::HashSet::new();
            for (i, p) in &pr {
                nucleus.insert(*i);
                cum += p;
                if cum >= top_p * total {
                    break;
                }
            }
            let sampler = Sampler {
                temperature: temp,
                top_p,
                greedy: false,
                eos: 2,
            };
            let mut seen = std::collections::HashSet::new();
            for _ in 0..400 {
                let (tok, lp) = sampler.pick(&logits, None, &mut rng);
                assert!(nucleus.contains(&tok), "token {tok} outside the nucleus");
                let want = (logits[tok as usize] as f64 - m) / temp - total.ln();
                assert!((lp as f64 - want).abs() < 1e-5);
                seen.insert(tok);
            }
            if nucleus.len() <= 5 {
                assert_eq!(seen, nucleus);
            }
        }
    }
}
