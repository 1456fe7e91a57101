//! Products of a few rows by a large weight, `x (m, k) · wᵀ` for decode-sized
//! `m`, from an f32 copy of `w` packed for streaming.
//!
//! At decode a product reads its whole weight from memory for a handful of
//! rows, so its speed is the speed of that read. Neither general-purpose
//! path streams well on AVX-512 CPUs that are not Intel's: MKL runs a
//! generic AVX2 kernel there, and candle's gemm packs for the compute-bound
//! case. Measured on one core of an AMD EPYC (AVX-512, 4 KB pages) for a
//! `(98304, 576)` weight, far larger than the caches: PyTorch (MKL) reached
//! 8.0 / 4.0 / 2.1 GB/s of weight at 1 / 8 / 32 rows, this kernel on the
//! HF `(n, k)` layout 10.5 / 6.0 / 3.6, and on the packed layout 22 / 9.8 /
//! 4.1. The packed layout makes the read one sequential stream: blocks of
//! [`NR`] weight rows, each block stored as `k / 16` chunks of `NR × 16`
//! floats (row `b` of the block at `b × 16` in each chunk), `k` padded to a
//! multiple of 16 and the rows to a multiple of [`NR`] with zeros.
//!
//! With AVX-512, generation uses it for every product, prefill included:
//! cut into tiles of [`ROWS`] input rows, the same kernel is also faster
//! than the general gemms on compute-bound products there. With AVX2 only
//! (16 registers, too few accumulators for compute-bound tiles) it takes
//! decode-sized products alone.
//!
//! The kernel computes [`NR`] outputs of up to [`MR`] rows (3 with AVX2) at
//! a time as 16-lane dot products (AVX-512 FMAs, or two 8-lane AVX2 FMAs
//! into one accumulator, then one horizontal sum per output), so each
//! output's sum runs in a fixed order whatever the thread count: results
//! are deterministic. Threads split the weight's row blocks.

use rayon::prelude::*;

/// Weight rows per packed block (and outputs per kernel call).
pub(crate) const NR: usize = 4;
/// Input rows per kernel call (`MR × NR` accumulators fit the 32 vector
/// registers with the loads).
const MR: usize = 6;
/// Lanes per vector.
const L: usize = 16;
/// Multiply-adds below which a product is not split further (~10 µs on
/// one core: a rayon task costs a few).
const TASK_MACS: usize = 1 << 20;
/// Input rows per task: 96 rows of 1536 floats (576 KB) fit a 1 MB L2.
/// One core of an AMD EPYC (Zen 4) ran prefill-sized products (512 and
/// 2048 rows) at 75-100 GFLOP/s this way, where MKL reached 55-60.
const ROWS: usize = 96;

/// An f32 weight `(n, k)` in the packed layout of this module.
pub(crate) struct PackedF32 {
    n: usize,
    k: usize,
    /// `k` rounded up to a multiple of 16.
    kp: usize,
    data: Vec<f32>,
}

/// The vector kernel this CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512 F and VL: 16-lane FMAs, 32 registers.
    Avx512,
    /// AVX2 and FMA: 8-lane FMAs, 16 registers (AMD Zen CPUs whose
    /// AVX-512 is absent or hidden, Intel client and older server CPUs).
    Avx2,
}

/// The kernel this CPU runs, if any (x86-64 with AVX-512 F and VL, else
/// AVX2 and FMA).
pub(crate) fn isa() -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            return Some(Isa::Avx512);
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Some(Isa::Avx2);
        }
        None
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Whether this CPU runs one of the vector kernels.
pub(crate) fn available() -> bool {
    isa().is_some()
}

/// Bytes a packed copy of an `(n, k)` weight holds.
pub(crate) fn packed_bytes(n: usize, k: usize) -> usize {
    n.div_ceil(NR) * NR * k.div_ceil(L) * L * 4
}

impl PackedF32 {
    /// Packs the row-major `(n, k)` weight `w`, in parallel; `reuse`'s
    /// buffer is overwritten when it has the same size.
    pub(crate) fn pack(w: &[f32], n: usize, k: usize, reuse: Option<PackedF32>) -> PackedF32 {
        assert_eq!(w.len(), n * k, "packing a ({n}, {k}) weight");
        let kp = k.div_ceil(L) * L;
        let len = packed_bytes(n, k) / 4;
        let mut data = match reuse {
            Some(r) if r.data.len() == len => r.data,
            _ => vec![0f32; len],
        };
        data.par_chunks_mut(NR * kp)
            .enumerate()
            .for_each(|(blk, out)| {
                for b in 0..NR {
                    let j = blk * NR + b;
                    for c in 0..kp / L {
                        let dst = &mut out[c * NR * L + b * L..][..L];
                        let (lo, hi) = (c * L, ((c + 1) * L).min(k));
                        if j < n && lo < k {
                            dst[..hi - lo].copy_from_slice(&w[j * k + lo..j * k + hi]);
                            dst[hi - lo..].fill(0.0);
                        } else {
                            dst.fill(0.0);
                        }
                    }
                }
            });
        PackedF32 { n, k, kp, data }
    }

    /// `(n, k)`: the weight's shape.
    pub(crate) fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    /// `y (m, n) = x (m, k) · wᵀ` for a row-major `x`. Tasks take tiles of
    /// up to [`ROWS`] input rows by a range of weight blocks: decode's few
    /// rows split the weight between threads, and a prefill's many rows
    /// are cut so that each tile's rows stay in the core's L2 cache while
    /// its blocks stream past.
    pub(crate) fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            m * self.k,
            "x against a packed ({}, {}) weight",
            self.n,
            self.k
        );
        let n = self.n;
        let mut y = vec![0f32; m * n];
        let blocks = n.div_ceil(NR);
        let row_tiles = m.div_ceil(ROWS).max(1);
        // Enough tasks to balance the pool, each streaming a few blocks
        // and worth a task (small models' products run on one thread).
        let worth = (m * n * self.k).div_ceil(TASK_MACS).div_ceil(row_tiles);
        let groups = (rayon::current_num_threads() * 4)
            .div_ceil(row_tiles)
            .min(blocks.div_ceil(8))
            .min(worth)
            .max(1);
        let per = blocks.div_ceil(groups);
        let groups = blocks.div_ceil(per);
        let out = OutPtr(y.as_mut_ptr());
        (0..row_tiles * groups).into_par_iter().for_each(|t| {
            let out = &out;
            let (tile, g) = (t / groups, t % groups);
            let (r0, r1) = (tile * ROWS, ((tile + 1) * ROWS).min(m));
            let (b0, b1) = (g * per, ((g + 1) * per).min(blocks));
            // SAFETY: tasks write disjoint tiles (rows r0..r1 of their
            // blocks' columns) of `y`, which outlives the parallel loop.
            unsafe {
                self.blocks(
                    &x[r0 * self.k..r1 * self.k],
                    r1 - r0,
                    b0,
                    b1,
                    out.0.add(r0 * n),
                )
            };
        });
        y
    }

    /// Outputs of row blocks `b0..b1` into `y (m, n)`.
    ///
    /// # Safety
    /// `y` points to `m × n` writable floats not written by anyone else
    /// in these blocks' columns meanwhile.
    unsafe fn blocks(&self, x: &[f32], m: usize, b0: usize, b1: usize, y: *mut f32) {
        // SAFETY: as for this function.
        unsafe { self.blocks_on(isa(), x, m, b0, b1, y) }
    }

    /// [`PackedF32::blocks`] on a given kernel (`None`: the portable loop).
    ///
    /// # Safety
    /// As for [`PackedF32::blocks`], and the CPU has `isa`'s features.
    unsafe fn blocks_on(
        &self,
        isa: Option<Isa>,
        x: &[f32],
        m: usize,
        b0: usize,
        b1: usize,
        y: *mut f32,
    ) {
        let (mr, rows): (usize, Rows) = match isa {
            #[cfg(target_arch = "x86_64")]
            Some(Isa::Avx512) => (MR, avx512::rows),
            #[cfg(target_arch = "x86_64")]
            Some(Isa::Avx2) => (avx2::MR, avx2::rows),
            // SAFETY: as for this function.
            _ => return unsafe { self.blocks_portable(x, m, b0, b1, y) },
        };
        let (n, k, kp) = (self.n, self.k, self.kp);
        for blk in b0..b1 {
            // SAFETY: blocks b0..b1 and rows 0..m lie inside the packed
            // data, `x` and `y`; the caller checked the CPU's features.
            unsafe {
                let wp = self.data.as_ptr().add(blk * NR * kp);
                let nr = NR.min(n - blk * NR);
                let mut r = 0;
                while r < m {
                    let take = mr.min(m - r);
                    let yp = y.add(r * n + blk * NR);
                    rows(take, k, x.as_ptr().add(r * k), wp, yp, n, nr);
                    r += take;
                }
            }
        }
    }

    /// [`PackedF32::blocks`] without SIMD, summing in the kernel's order
    /// (16 lanes, then across them).
    ///
    /// # Safety
    /// As for [`PackedF32::blocks`].
    unsafe fn blocks_portable(&self, x: &[f32], m: usize, b0: usize, b1: usize, y: *mut f32) {
        for blk in b0..b1 {
            let w = &self.data[blk * NR * self.kp..][..NR * self.kp];
            for r in 0..m {
                let xr = &x[r * self.k..][..self.k];
                for b in 0..NR.min(self.n - blk * NR) {
                    let mut acc = [0f32; L];
                    for (kk, xv) in xr.iter().enumerate() {
                        acc[kk % L] += xv * w[(kk / L) * NR * L + b * L + kk % L];
                    }
                    // SAFETY: (r, blk·NR + b) is inside y's m × n.
                    unsafe { *y.add(r * self.n + blk * NR + b) = acc.iter().sum() };
                }
            }
        }
    }
}

/// A vector kernel's call: `r` input rows at `xp` (stride `k`) against
/// one packed block at `wp`, into the first `nr` of its [`NR`] columns at
/// `yp` (stride `n`).
type Rows = unsafe fn(usize, usize, *const f32, *const f32, *mut f32, usize, usize);

/// The output pointer, shared by the tasks of [`PackedF32::matmul`].
struct OutPtr(*mut f32);
// SAFETY: each task writes only its own columns (see `PackedF32::matmul`).
unsafe impl Sync for OutPtr {}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{L, NR};
    use std::arch::x86_64::*;

    /// Floats ahead of the current chunk that each step prefetches: the
    /// packed weight is one sequential stream, and prefetching 16 KB ahead
    /// overlapped its read with the FMAs best (8 rows: 9.8 GB/s against
    /// 7.7 without).
    const PREFETCH: usize = 4096;

    /// Up to [`super::MR`] input rows against one packed block (a
    /// [`super::Rows`]).
    #[target_feature(enable = "avx512f,avx512vl")]
    pub(super) unsafe fn rows(
        r: usize,
        k: usize,
        xp: *const f32,
        wp: *const f32,
        yp: *mut f32,
        n: usize,
        nr: usize,
    ) {
        match r {
            1 => block::<1>(k, xp, wp, yp, n, nr),
            2 => block::<2>(k, xp, wp, yp, n, nr),
            3 => block::<3>(k, xp, wp, yp, n, nr),
            4 => block::<4>(k, xp, wp, yp, n, nr),
            5 => block::<5>(k, xp, wp, yp, n, nr),
            _ => block::<6>(k, xp, wp, yp, n, nr),
        }
    }

    /// `R` input rows at `xp` (stride `k`) against one packed block at
    /// `wp`, into the first `nr` of its [`NR`] columns at `yp` (stride `n`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn block<const R: usize>(
        k: usize,
        xp: *const f32,
        wp: *const f32,
        yp: *mut f32,
        n: usize,
        nr: usize,
    ) {
        let full = k / L;
        let mut acc = [[_mm512_setzero_ps(); NR]; R];
        for c in 0..full {
            let w = wp.add(c * NR * L);
            let ahead = w.add(PREFETCH) as *const i8;
            _mm_prefetch::<_MM_HINT_T0>(ahead);
            _mm_prefetch::<_MM_HINT_T0>(ahead.add(64));
            _mm_prefetch::<_MM_HINT_T0>(ahead.add(128));
            _mm_prefetch::<_MM_HINT_T0>(ahead.add(192));
            chunk(&mut acc, w, xp, k, c * L, !0);
        }
        let tail = k - full * L;
        if tail > 0 {
            // The packed weight is zero-padded; only x needs a mask.
            chunk(
                &mut acc,
                wp.add(full * NR * L),
                xp,
                k,
                full * L,
                ((1u32 << tail) - 1) as u16,
            );
        }
        for (a, acc) in acc.iter().enumerate() {
            for (b, acc) in acc.iter().enumerate().take(nr) {
                *yp.add(a * n + b) = _mm512_reduce_add_ps(*acc);
            }
        }
    }

    /// One 16-lane chunk of the depth: the block's [`NR`] weight rows at
    /// `w` against the `R` input rows at column `off` (lanes outside
    /// `mask` read as zero).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl")]
    unsafe fn chunk<const R: usize>(
        acc: &mut [[__m512; NR]; R],
        w: *const f32,
        xp: *const f32,
        k: usize,
        off: usize,
        mask: __mmask16,
    ) {
        let wv = [
            _mm512_loadu_ps(w),
            _mm512_loadu_ps(w.add(L)),
            _mm512_loadu_ps(w.add(2 * L)),
            _mm512_loadu_ps(w.add(3 * L)),
        ];
        for (a, acc) in acc.iter_mut().enumerate() {
            let xv = _mm512_maskz_loadu_ps(mask, xp.add(a * k + off));
            for (b, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_ps(xv, wv[b], *acc);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{L, NR};
    use std::arch::x86_64::*;

    /// Lanes per AVX2 vector: each 16-float chunk of the packed layout is
    /// two vectors.
    const H: usize = 8;
    /// Input rows per kernel call: `MR × NR` accumulators, `MR` inputs and
    /// one weight vector fill the 16 vector registers.
    pub(super) const MR: usize = 3;
    /// As in the AVX-512 kernel: prefetch 16 KB ahead of the stream.
    const PREFETCH: usize = 4096;

    /// Up to [`MR`] input rows against one packed block (a [`super::Rows`]).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows(
        r: usize,
        k: usize,
        xp: *const f32,
        wp: *const f32,
        yp: *mut f32,
        n: usize,
        nr: usize,
    ) {
        match r {
            1 => block::<1>(k, xp, wp, yp, n, nr),
            2 => block::<2>(k, xp, wp, yp, n, nr),
            _ => block::<3>(k, xp, wp, yp, n, nr),
        }
    }

    /// `R` input rows at `xp` (stride `k`) against one packed block at
    /// `wp`, into the first `nr` of its [`NR`] columns at `yp` (stride `n`).
    /// Each output sums its products in one 8-lane accumulator (both halves
    /// of every 16-float chunk), then across the lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block<const R: usize>(
        k: usize,
        xp: *const f32,
        wp: *const f32,
        yp: *mut f32,
        n: usize,
        nr: usize,
    ) {
        let full = k / L;
        let mut acc = [[_mm256_setzero_ps(); NR]; R];
        for c in 0..full {
            let w = wp.add(c * NR * L);
            let ahead = w.add(PREFETCH) as *const i8;
            _mm_prefetch::<_MM_HINT_T0>(ahead);
            _mm_prefetch::<_MM_HINT_T0>(ahead.add(64));
            _mm_prefetch::<_MM_HINT_T0>(ahead.add(128));
            _mm_prefetch::<_MM_HINT_T0>(ahead.add(192));
            for h in 0..2 {
                let mut xv = [_mm256_setzero_ps(); R];
                for (a, xv) in xv.iter_mut().enumerate() {
                    *xv = _mm256_loadu_ps(xp.add(a * k + c * L + h * H));
                }
                half(&mut acc, w.add(h * H), &xv);
            }
        }
        let tail = k - full * L;
        if tail > 0 {
            // The packed weight is zero-padded; only x needs a mask.
            let w = wp.add(full * NR * L);
            for h in 0..2 {
                let lanes = tail.saturating_sub(h * H).min(H) as i32;
                if lanes == 0 {
                    break;
                }
                let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), idx);
                let mut xv = [_mm256_setzero_ps(); R];
                for (a, xv) in xv.iter_mut().enumerate() {
                    *xv = _mm256_maskload_ps(xp.add(a * k + full * L + h * H), mask);
                }
                half(&mut acc, w.add(h * H), &xv);
            }
        }
        for (a, acc) in acc.iter().enumerate() {
            for (b, acc) in acc.iter().enumerate().take(nr) {
                *yp.add(a * n + b) = sum8(*acc);
            }
        }
    }

    /// One 8-lane half of a chunk: the block's [`NR`] weight rows at `w`
    /// (stride 16) against the `R` inputs `xv`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn half<const R: usize>(acc: &mut [[__m256; NR]; R], w: *const f32, xv: &[__m256; R]) {
        for b in 0..NR {
            let wv = _mm256_loadu_ps(w.add(b * L));
            for (acc, xv) in acc.iter_mut().zip(xv) {
                acc[b] = _mm256_fmadd_ps(*xv, wv, acc[b]);
            }
        }
    }

    /// The sum of a vector's 8 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sum8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * n];
        for r in 0..m {
            for j in 0..n {
                y[r * n + j] = (0..k)
                    .map(|c| x[r * k + c] as f64 * w[j * k + c] as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }

    /// The kernels this CPU runs, the portable loop last.
    fn kernels() -> Vec<(&'static str, Option<Isa>)> {
        let mut ks = Vec::new();
        if isa() == Some(Isa::Avx512) {
            ks.push(("avx512", Some(Isa::Avx512)));
        }
        if isa().is_some() {
            // Every CPU with AVX-512 F has AVX2 and FMA too.
            ks.push(("avx2", Some(Isa::Avx2)));
        }
        ks.push(("portable", None));
        ks
    }

    /// Every row count of the kernels' dispatch (1 to 6, and several
    /// passes), widths off the block size and depths off the vector width,
    /// on each vector kernel the CPU runs (AVX-512, AVX2) and the portable
    /// loop.
    #[test]
    fn packed_products_match_the_reference() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for (n, k) in [
            (1, 1),
            (7, 16),
            (5, 24),
            (9, 44),
            (13, 100),
            (64, 576),
            (130, 33),
        ] {
            let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let p = PackedF32::pack(&w, n, k, None);
            assert_eq!(p.bytes(), packed_bytes(n, k));
            for m in [1, 2, 3, 5, 6, 7, 13, 32, 97, 200] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
                let want = reference(&x, &w, m, n, k);
                let got = p.matmul(&x, m);
                let mut outs = vec![("kernel", got)];
                for (name, isa) in kernels() {
                    let mut y = vec![0f32; m * n];
                    // SAFETY: y is m × n, written by this call alone;
                    // `kernels` lists only what this CPU runs.
                    unsafe { p.blocks_on(isa, &x, m, 0, n.div_ceil(NR), y.as_mut_ptr()) };
                    outs.push((name, y));
                }
                for (name, y) in &outs {
                    let d = y
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(d < 1e-5 * k as f32, "{name} {m}x{k}x{n}: differs by {d}");
                }
            }
        }
    }

    /// A repacked weight (reused buffer) gives the new weight's products,
    /// and the thread count does not change a single bit.
    #[test]
    fn repacking_and_threads() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        let (m, n, k) = (8, 301, 80);
        let w1: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let w2: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let p = PackedF32::pack(&w1, n, k, None);
        let p = PackedF32::pack(&w2, n, k, Some(p));
        let fresh = PackedF32::pack(&w2, n, k, None);
        assert_eq!(p.matmul(&x, m), fresh.matmul(&x, m));
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        assert_eq!(
            one.install(|| p.matmul(&x, m)),
            three.install(|| p.matmul(&x, m))
        );
    }
}
