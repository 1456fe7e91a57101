//! `exp` over a slice of f32, eight lanes at a time, bit-identical to the
//! scalar `f32::exp`.
//!
//! The row kernels (attention's softmax and its backward, SwiGLU) spent
//! 6–7 % of a SmolLM2 training step in glibc's scalar `expf` (`perf`). A
//! faster approximation would change every run's rounding, so this is
//! glibc's own algorithm (since 2.28; the FMA build `__expf_fma` that
//! x86-64 CPUs with FMA get): in binary64, k = round(x · 32 / ln 2) by the
//! 1.5 · 2⁵² shift trick, r = x · 32 / ln 2 − k by a fused multiply-subtract,
//! 2^(k/32) from a 32-entry table with k's upper bits added to the
//! exponent, a cubic in r with the same three fused multiply-adds, and one
//! rounding to f32. On AVX-512 eight lanes run as one vector (the table
//! read by two permutes); on AVX2 with FMA (AMD Zen 1–3, older Intel) as
//! two vectors of four (the table read by a gather). Lanes with |x| ≥ 88
//! or NaN (over- and underflow, ±inf) take the scalar call, as glibc's own
//! slow path does. Whether the vector path reproduces this
//! machine's `f32::exp` is checked once at first use on 4,096 probes across
//! the range (another libm, or glibc without FMA, rounds otherwise): where it
//! does not, every call takes the scalar loop.

use std::sync::OnceLock;

/// N / ln 2 with N = 32 table entries.
const INV_LN2_N: f64 = f64::from_bits(0x40471547652b82fe);
/// 1.5 · 2⁵²: adding it rounds to an integer in the low mantissa bits.
const SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// The cubic's coefficients for 2^(r/N) − 1 (scaled by N).
const C0: f64 = f64::from_bits(0x3ebc6af84b912394);
const C1: f64 = f64::from_bits(0x3f2ebfce50fac4f3);
const C2: f64 = f64::from_bits(0x3f962e42ff0c52d6);

/// `|x|`'s bits from which glibc takes its slow path (|x| ≥ 88, ±inf, NaN).
const SLOW_FROM: u32 = 0x42b0_0000;

/// `bits(2^(i/32)) − (i << 47)`: adding `k << 47` restores 2^(i/32) and
/// puts k / 32's integer part into the exponent.
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];

/// `xs[i] = xs[i].exp()` for every element, the same bits as `f32::exp`.
pub(crate) fn exp_in_place(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match vector_path() {
        // SAFETY: `vector_path` checked the features at run time.
        Some(Isa::Avx512) => return unsafe { x86::exp_avx512(xs) },
        Some(Isa::Avx2) => return unsafe { x86::exp_avx2(xs) },
        None => {}
    }
    for x in xs {
        *x = x.exp();
    }
}

/// One lane of the algorithm in scalar code (the reference the vector
/// path is held to; also its description).
#[cfg(test)]
fn exp_scalar(x: f32) -> f32 {
    if (x.to_bits() & 0x7fff_ffff) >= SLOW_FROM {
        return x.exp();
    }
    let xd = f64::from(x);
    let kd = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd.to_bits();
    let kd = kd - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let t = TABLE[(ki & 31) as usize].wrapping_add(ki << 47);
    let s = f64::from_bits(t);
    let z = r.mul_add(C0, C1);
    let r2 = r * r;
    let y = r.mul_add(C2, 1.0);
    let y = z.mul_add(r2, y);
    (y * s) as f32
}

/// The vector instruction sets with a path here.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Avx512,
    Avx2,
}

/// The widest path this CPU has whose results equal `f32::exp` on the
/// probes, or `None` (the scalar loop).
#[cfg(target_arch = "x86_64")]
fn vector_path() -> Option<Isa> {
    static ISA: OnceLock<Option<Isa>> = OnceLock::new();
    *ISA.get_or_init(|| {
        let probes = probes();
        let agrees = |isa: Isa| {
            let mut v = probes.clone();
            // SAFETY: only called after the features were detected below.
            match isa {
                Isa::Avx512 => unsafe { x86::exp_avx512(&mut v) },
                Isa::Avx2 => unsafe { x86::exp_avx2(&mut v) },
            }
            probes
                .iter()
                .zip(&v)
                .all(|(x, y)| x.exp().to_bits() == y.to_bits())
        };
        if std::arch::is_x86_feature_detected!("avx512f") && agrees(Isa::Avx512) {
            return Some(Isa::Avx512);
        }
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && agrees(Isa::Avx2)
        {
            return Some(Isa::Avx2);
        }
        None
    })
}

/// 4,096 arguments over (−104, 89), some of them at the special cases.
#[cfg(target_arch = "x86_64")]
fn probes() -> Vec<f32> {
    let mut p: Vec<f32> = (0..4080)
        .map(|i| -104.0 + 193.0 * (i as f32 + 0.37) / 4080.0)
        .collect();
    p.extend([
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        88.0,
        -88.0,
        88.7,
        -103.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE,
        0.5,
        -0.5,
        1.0,
        -1.0,
        2.0,
    ]);
    p
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{C0, C1, C2, INV_LN2_N, SHIFT, SLOW_FROM, TABLE};
    use std::arch::x86_64::*;

    /// Eight lanes at a time; the tail and any lane with |x| ≥ 88 or NaN
    /// (but −inf, which gives 0) take `f32::exp`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_avx512(xs: &mut [f32]) {
        let t = |k: usize| _mm512_loadu_pd(TABLE.as_ptr().add(k).cast::<f64>());
        let (t0, t1, t2, t3) = (t(0), t(8), t(16), t(24));
        let inv = _mm512_set1_pd(INV_LN2_N);
        let shift = _mm512_set1_pd(SHIFT);
        let (c0, c1, c2) = (_mm512_set1_pd(C0), _mm512_set1_pd(C1), _mm512_set1_pd(C2));
        let one = _mm512_set1_pd(1.0);
        let bit4 = _mm512_set1_epi64(16);
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let p = c.as_mut_ptr();
            let x = _mm256_loadu_ps(p);
            let (ninf, slow) = lanes(x);
            let xd = _mm512_cvtps_pd(x);
            let kd = _mm512_fmadd_pd(inv, xd, shift);
            let ki = _mm512_castpd_si512(kd);
            let kd = _mm512_sub_pd(kd, shift);
            let r = _mm512_fmsub_pd(inv, xd, kd);
            // The table lookup: two 16-entry permutes, bit 4 picks.
            let lo = _mm512_permutex2var_pd(t0, ki, t1);
            let hi = _mm512_permutex2var_pd(t2, ki, t3);
            let tv = _mm512_mask_blend_pd(_mm512_test_epi64_mask(ki, bit4), lo, hi);
            let s = _mm512_add_epi64(_mm512_castpd_si512(tv), _mm512_slli_epi64::<47>(ki));
            let z = _mm512_fmadd_pd(r, c0, c1);
            let r2 = _mm512_mul_pd(r, r);
            let y = _mm512_fmadd_pd(r, c2, one);
            let y = _mm512_fmadd_pd(z, r2, y);
            let y = _mm512_mul_pd(y, _mm512_castsi512_pd(s));
            let y = _mm256_andnot_ps(_mm256_castsi256_ps(ninf), _mm512_cvtpd_ps(y));
            _mm256_storeu_ps(p, y);
            if slow {
                slow_lanes(c, std::mem::transmute::<__m256, [f32; 8]>(x));
            }
        }
        for x in chunks.into_remainder() {
            *x = x.exp();
        }
    }

    /// The −inf lanes of `x` (masked scores, whose exp is 0), and whether
    /// any lane needs glibc's slow path (|x| ≥ 88 or NaN; the bits compare
    /// as integers).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn lanes(x: __m256) -> (__m256i, bool) {
        let bits = _mm256_castps_si256(x);
        let abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fff_ffff));
        let ninf = _mm256_cmpeq_epi32(bits, _mm256_set1_epi32(f32::NEG_INFINITY.to_bits() as i32));
        let fast = _mm256_or_si256(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(SLOW_FROM as i32), abs),
            ninf,
        );
        (ninf, _mm256_movemask_epi8(fast) != -1)
    }

    /// glibc's slow path for the lanes of `orig` with |x| ≥ 88 or NaN
    /// (not −inf, which the vector code already set to 0).
    fn slow_lanes(out: &mut [f32], orig: [f32; 8]) {
        for (o, &v) in out.iter_mut().zip(&orig) {
            if (v.to_bits() & 0x7fff_ffff) >= SLOW_FROM && v != f32::NEG_INFINITY {
                *o = v.exp();
            }
        }
    }

    /// The same algorithm on AVX2 with FMA: each eight floats as two
    /// vectors of four doubles, the table read by a gather.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_avx2(xs: &mut [f32]) {
        let inv = _mm256_set1_pd(INV_LN2_N);
        let shift = _mm256_set1_pd(SHIFT);
        let (c0, c1, c2) = (_mm256_set1_pd(C0), _mm256_set1_pd(C1), _mm256_set1_pd(C2));
        let one = _mm256_set1_pd(1.0);
        let low5 = _mm256_set1_epi64x(31);
        let table = TABLE.as_ptr().cast::<f64>();
        // Four lanes: x widened to f64, the result rounded to f32.
        let four = |x: __m128| {
            let xd = _mm256_cvtps_pd(x);
            let kd = _mm256_fmadd_pd(inv, xd, shift);
            let ki = _mm256_castpd_si256(kd);
            let kd = _mm256_sub_pd(kd, shift);
            let r = _mm256_fmsub_pd(inv, xd, kd);
            let tv = _mm256_i64gather_pd::<8>(table, _mm256_and_si256(ki, low5));
            let s = _mm256_add_epi64(_mm256_castpd_si256(tv), _mm256_slli_epi64::<47>(ki));
            let z = _mm256_fmadd_pd(r, c0, c1);
            let r2 = _mm256_mul_pd(r, r);
            let y = _mm256_fmadd_pd(r, c2, one);
            let y = _mm256_fmadd_pd(z, r2, y);
            _mm256_cvtpd_ps(_mm256_mul_pd(y, _mm256_castsi256_pd(s)))
        };
        let mut chunks = xs.chunks_exact_mut(8);
        for c in &mut chunks {
            let p = c.as_mut_ptr();
            let x = _mm256_loadu_ps(p);
            let (ninf, slow) = lanes(x);
            let lo = four(_mm256_castps256_ps128(x));
            let hi = four(_mm256_extractf128_ps::<1>(x));
            let y = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi);
            let y = _mm256_andnot_ps(_mm256_castsi256_ps(ninf), y);
            _mm256_storeu_ps(p, y);
            if slow {
                slow_lanes(c, std::mem::transmute::<__m256, [f32; 8]>(x));
            }
        }
        for x in chunks.into_remainder() {
            *x = x.exp();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_holds_powers_of_two_over_32() {
        for (i, &t) in TABLE.iter().enumerate() {
            let want = 2f64.powf(i as f64 / 32.0).to_bits() - ((i as u64) << 47);
            assert_eq!(t, want, "entry {i}");
        }
    }

    /// Every 61st float in [−104, 89] and the special values, against the
    /// scalar `f32::exp`: the algorithm in scalar code, and the vector path
    /// where this CPU takes it.
    #[test]
    fn bulk_exp_matches_f32_exp_bit_for_bit() {
        let mut xs: Vec<f32> = Vec::new();
        for (lo, hi) in [(0f32, 89.0f32), (-0.0, -104.0)] {
            let (a, b) = (lo.to_bits(), hi.to_bits());
            xs.extend((a..b).step_by(61).map(f32::from_bits));
        }
        xs.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-45, -1e-45]);
        // Masked scores (−inf) among ordinary ones, in whole vectors.
        xs.extend((0..32).map(|i| {
            if i % 3 == 0 {
                f32::NEG_INFINITY
            } else {
                -0.1 * i as f32
            }
        }));
        let want: Vec<u32> = xs.iter().map(|x| x.exp().to_bits()).collect();
        let mut got = xs.clone();
        exp_in_place(&mut got);
        let mism = got
            .iter()
            .zip(&want)
            .zip(&xs)
            .filter(|((g, &w), _)| g.to_bits() != w)
            .map(|(_, x)| *x)
            .collect::<Vec<_>>();
        assert!(
            mism.is_empty(),
            "{} mismatches, first {:?}",
            mism.len(),
            &mism[..mism.len().min(5)]
        );
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // glibc's FMA build is what `f32::exp` calls on such a CPU;
            // the scalar transcription and the vector path both match it.
            let want_isa = if std::arch::is_x86_feature_detected!("avx512f") {
                Isa::Avx512
            } else {
                Isa::Avx2
            };
            assert_eq!(vector_path(), Some(want_isa), "the vector path was refused");
            // The AVX2 path too where AVX-512 took precedence.
            let mut v = xs.clone();
            // SAFETY: AVX2 and FMA detected above.
            unsafe { x86::exp_avx2(&mut v) };
            let avx2_mism = v
                .iter()
                .zip(&want)
                .filter(|(g, &w)| g.to_bits() != w)
                .count();
            assert_eq!(avx2_mism, 0, "AVX2 path");
            let scalar_mism = xs
                .iter()
                .zip(&want)
                .filter(|(x, &w)| !x.is_nan() && exp_scalar(**x).to_bits() != w)
                .count();
            assert_eq!(scalar_mism, 0);
        }
    }

    /// Every float in [−104, 89] (2.2 billion; seconds in release):
    /// `cargo test --release --lib every_float -- --ignored`.
    #[test]
    #[ignore]
    fn every_float_in_range_matches_f32_exp() {
        let mut bad = 0usize;
        for (lo, hi) in [(0f32, 89.0f32), (-0.0, -104.0)] {
            let (a, b) = (lo.to_bits(), hi.to_bits());
            let mut start = a;
            while start < b {
                let end = (start + (1 << 20)).min(b);
                let xs: Vec<f32> = (start..end).map(f32::from_bits).collect();
                let mut got = xs.clone();
                exp_in_place(&mut got);
                bad += xs
                    .iter()
                    .zip(&got)
                    .filter(|(x, g)| x.exp().to_bits() != g.to_bits())
                    .count();
                start = end;
            }
        }
        assert_eq!(bad, 0);
    }
}
