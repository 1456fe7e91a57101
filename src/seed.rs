//! Seed derivation: every random stream of a run (weight init, task order,
//! sampling at step s, the script RNG at step s for task t) is derived from
//! the one run seed and a stream label, so a resumed run needs only the seed
//! and the step to continue exactly.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// SplitMix64 finaliser: a good 64-bit mixer.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Stable 64-bit hash of a label (FNV-1a; std's hasher is not stable
/// across Rust versions).
pub fn label(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Derive a seed from the run seed and a path of stream identifiers.
pub fn derive(seed: u64, parts: &[u64]) -> u64 {
    parts.iter().fold(mix(seed), |acc, &p| mix(acc ^ mix(p)))
}

/// A ChaCha RNG for a derived stream.
pub fn rng(seed: u64, parts: &[u64]) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(derive(seed, parts))
}

/// Task indices for a step: epochs over a seeded permutation of the panel.
pub fn tasks_for_step(seed_: u64, n: usize, per_step: usize, step: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(per_step);
    let mut cached: Option<(usize, Vec<usize>)> = None;
    for j in 0..per_step {
        let g = step * per_step + j;
        let (epoch, pos) = (g / n, g % n);
        if cached.as_ref().is_none_or(|c| c.0 != epoch) {
            let mut perm: Vec<usize> = (0..n).collect();
            perm.shuffle(&mut rng(seed_, &[label("order"), epoch as u64]));
            cached = Some((epoch, perm));
        }
        out.push(cached.as_ref().expect("set above").1[pos]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_differ_and_repeat() {
        assert_eq!(derive(1, &[2, 3]), derive(1, &[2, 3]));
        assert_ne!(derive(1, &[2, 3]), derive(1, &[3, 2]));
        assert_ne!(derive(1, &[2]), derive(2, &[2]));
        assert_eq!(label("plan"), label("plan"));
        assert_ne!(label("plan"), label("update"));
    }
}
