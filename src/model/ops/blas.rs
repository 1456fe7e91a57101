//! A BLAS for the CPU trunk's matrix products, loaded at run time.
//!
//! candle's pure-Rust `gemm` uses AVX2 FMA kernels only; on a CPU with
//! AVX-512 (and AMX for bf16) Intel's MKL computes the same f32 products
//! about 1.6× faster (measured on this project's 2-core machine: ~320 against
//! ~200 GFLOP/s at `(2048, 576) × (576, 1536)`). The library is opened with
//! `dlopen` at the first product, so the default build needs nothing
//! installed and runs anywhere: without a BLAS every product stays on
//! candle's gemm.
//!
//! Where it looks, first hit wins:
//! 1. `ACTGUIDE_BLAS`: a library path, or `off` (also `0`, `none`) to keep
//!    candle's gemm;
//! 2. `.mkl/lib/libmkl_rt.so.*` in the source tree this binary was built
//!    from (what `scripts/install-mkl.sh` installs from PyPI's `mkl` wheel);
//! 3. `libmkl_rt.so.3` / `.2` and OpenBLAS's `libopenblas.so.0` on the
//!    loader's search path (`LD_LIBRARY_PATH`, Debian's `libopenblas0`).
//!
//! On x86-64 a library is only taken on a CPU with AVX2 and FMA (older
//! CPUs keep candle's gemm), and only after a self-test product agrees
//! with a naive one.
//!
//! The library runs single-threaded: products are split into column (or
//! row) blocks over the current rayon pool, the same threads candle's other
//! CPU ops use, so no OpenMP pool spins against them (and `--jobs N`
//! comparisons keep one pool per entry).

use std::sync::OnceLock;

use libloading::Library;

/// `cblas_sgemm` (row-major CBLAS enums as C ints).
type Sgemm = unsafe extern "C" fn(
    layout: i32,
    trans_a: i32,
    trans_b: i32,
    m: i32,
    n: i32,
    k: i32,
    alpha: f32,
    a: *const f32,
    lda: i32,
    b: *const f32,
    ldb: i32,
    beta: f32,
    c: *mut f32,
    ldc: i32,
) -> ();

/// MKL's `cblas_gemm_bf16bf16f32`: bf16 operands (raw `u16` bits), f32
/// result (AMX or AVX-512 BF16 kernels where the CPU has them).
type GemmBf16 = unsafe extern "C" fn(
    layout: i32,
    trans_a: i32,
    trans_b: i32,
    m: i32,
    n: i32,
    k: i32,
    alpha: f32,
    a: *const u16,
    lda: i32,
    b: *const u16,
    ldb: i32,
    beta: f32,
    c: *mut f32,
    ldc: i32,
) -> ();

/// MKL's `cblas_gemm_bf16bf16f32_pack_get_size`.
type PackGetSize = unsafe extern "C" fn(identifier: i32, m: i32, n: i32, k: i32) -> usize;
/// MKL's `cblas_gemm_bf16bf16f32_pack`.
type PackBf16 = unsafe extern "C" fn(
    layout: i32,
    identifier: i32,
    trans: i32,
    m: i32,
    n: i32,
    k: i32,
    src: *const u16,
    ld: i32,
    dest: *mut u16,
) -> ();

/// MKL's bf16 packing API: a weight packed once into the kernels' own
/// layout, then multiplied by `cblas_gemm_bf16bf16f32_compute` (same
/// signature as [`GemmBf16`], with [`PACKED`] for the packed operand).
#[derive(Clone, Copy)]
struct Bf16Packing {
    get_size: PackGetSize,
    pack: PackBf16,
    compute: GemmBf16,
}

const ROW_MAJOR: i32 = 101;
const NO_TRANS: i32 = 111;
const TRANS: i32 = 112;
/// `CblasPacked` and `CblasBMatrix` (MKL's packing API).
const PACKED: i32 = 151;
const B_MATRIX: i32 = 162;
/// The `m` MKL is told when packing a B operand: its packed layout does not
/// depend on it (checked against unpacked products for 1 to 640 rows).
const PACK_M: i32 = 32;

/// A loaded BLAS.
pub(crate) struct Blas {
    sgemm: Sgemm,
    /// MKL only: bf16 × bf16 → f32 products (bf16 rollout weights).
    gemm_bf16: Option<GemmBf16>,
    /// MKL only: packed bf16 weights for small-batch products (decode).
    bf16_packing: Option<Bf16Packing>,
    /// What was loaded, for logs (`MKL (…/libmkl_rt.so.3)`).
    pub(crate) name: String,
    _lib: Library,
}

static BLAS: OnceLock<Option<Blas>> = OnceLock::new();

/// The BLAS in use, if any (loaded on first call).
pub(crate) fn blas() -> Option<&'static Blas> {
    BLAS.get_or_init(load).as_ref()
}

/// One line for run logs and benchmarks: which kernels the CPU products use.
pub fn matmul_backend() -> String {
    let rust = if wide_rust_gemm() {
        "candle gemm (pure Rust, AVX-512)"
    } else {
        "candle gemm (pure Rust)"
    };
    match blas() {
        Some(b) if wide_rust_gemm() => format!(
            "{}, projections of more than {RUST_GEMM_MIN_ROWS} rows on {rust}",
            b.name
        ),
        Some(b) => b.name.clone(),
        None => rust.into(),
    }
}

/// Projections of more rows than this skip the BLAS for candle's gemm where
/// [`wide_rust_gemm`] holds: at decode-sized products MKL stays faster.
const RUST_GEMM_MIN_ROWS: usize = 256;

/// Whether a projection of `rows` rows runs on candle's gemm rather than
/// the BLAS (see [`wide_rust_gemm`]).
pub(crate) fn rust_gemm_for(rows: usize) -> bool {
    rows > RUST_GEMM_MIN_ROWS && wide_rust_gemm()
}

/// Whether candle's gemm has wider kernels here than the BLAS: on x86 CPUs
/// with AVX-512 that are not Intel's, MKL runs a generic AVX2 kernel
/// (`mkl_blas_def_sgemm_kernel_0_zen`, ~90 GFLOP/s per core on an AMD
/// EPYC), while candle's gemm, built with its AVX-512 kernels
/// (`gemm/x86-v4`), reaches ~180 on large products. On Intel CPUs MKL has
/// AVX-512 (and AMX) kernels of its own. `ACTGUIDE_RUST_GEMM=off` keeps
/// every product on the BLAS.
pub(crate) fn wide_rust_gemm() -> bool {
    static WIDE: OnceLock<bool> = OnceLock::new();
    *WIDE.get_or_init(|| {
        if matches!(
            std::env::var("ACTGUIDE_RUST_GEMM").as_deref(),
            Ok("off" | "0" | "none")
        ) {
            return false;
        }
        avx512_not_intel()
    })
}

#[cfg(target_arch = "x86_64")]
fn avx512_not_intel() -> bool {
    // SAFETY: cpuid leaf 0 exists on every x86-64 CPU.
    #[allow(unused_unsafe)]
    let id = unsafe { std::arch::x86_64::__cpuid(0) };
    let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    std::arch::is_x86_feature_detected!("avx512f") && vendor != b"GenuineIntel"
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_not_intel() -> bool {
    false
}

fn load() -> Option<Blas> {
    let chosen = std::env::var("ACTGUIDE_BLAS").ok();
    if matches!(chosen.as_deref(), Some("off" | "0" | "none" | "")) {
        return None;
    }
    if !cpu_ok() {
        return None;
    }
    let candidates: Vec<String> = match chosen {
        Some(path) => vec![path],
        None => {
            let mut v = Vec::new();
            let local = concat!(env!("CARGO_MANIFEST_DIR"), "/.mkl/lib");
            for so in ["libmkl_rt.so.3", "libmkl_rt.so.2"] {
                v.push(format!("{local}/{so}"));
            }
            for so in ["libmkl_rt.so.3", "libmkl_rt.so.2", "libopenblas.so.0"] {
                v.push(so.to_string());
            }
            v
        }
    };
    for path in candidates {
        if let Some(b) = open(&path) {
            return Some(b);
        }
    }
    None
}

#[cfg(target_arch = "x86_64")]
fn cpu_ok() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_ok() -> bool {
    true
}

/// Opens `path`, switches it to one thread, and self-tests it.
fn open(path: &str) -> Option<Blas> {
    // SAFETY: loading a shared library runs its initialisers; the names
    // tried are BLAS libraries, whose initialisers only set up dispatch.
    let lib = unsafe { Library::new(path) }.ok()?;
    // SAFETY: the symbol types are the CBLAS / MKL / OpenBLAS C signatures.
    let sgemm: Sgemm = unsafe { *lib.get::<Sgemm>(b"cblas_sgemm\0").ok()? };
    let gemm_bf16: Option<GemmBf16> = unsafe {
        lib.get::<GemmBf16>(b"cblas_gemm_bf16bf16f32\0")
            .ok()
            .map(|f| *f)
    };
    // SAFETY: as above, MKL's C signatures.
    let bf16_packing = unsafe {
        match (
            lib.get::<PackGetSize>(b"cblas_gemm_bf16bf16f32_pack_get_size\0"),
            lib.get::<PackBf16>(b"cblas_gemm_bf16bf16f32_pack\0"),
            lib.get::<GemmBf16>(b"cblas_gemm_bf16bf16f32_compute\0"),
        ) {
            (Ok(get_size), Ok(pack), Ok(compute)) if gemm_bf16.is_some() => Some(Bf16Packing {
                get_size: *get_size,
                pack: *pack,
                compute: *compute,
            }),
            _ => None,
        }
    };
    let mut name = path.to_string();
    unsafe {
        if let Ok(set_layer) =
            lib.get::<unsafe extern "C" fn(i32) -> i32>(b"MKL_Set_Threading_Layer\0")
        {
            // MKL_THREADING_SEQUENTIAL = 1: no OpenMP runtime is needed.
            set_layer(1);
            name = format!("MKL ({path})");
        }
        if let Ok(set_nt) = lib.get::<unsafe extern "C" fn(i32)>(b"openblas_set_num_threads\0") {
            set_nt(1);
            name = format!("OpenBLAS ({path})");
        }
    }
    let blas = Blas {
        sgemm,
        gemm_bf16,
        bf16_packing,
        name,
        _lib: lib,
    };
    blas.self_test().then_some(blas)
}

impl Blas {
    /// A `(5, 7) × (7, 3)` product against a naive loop.
    fn self_test(&self) -> bool {
        let (m, k, n) = (5, 7, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 5) as f32 - 2.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 3) as f32 * 0.5).collect();
        let c = self.gemm(false, false, m, n, k, &a, &b);
        (0..m).all(|i| {
            (0..n).all(|j| {
                let want: f32 = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
                (c[i * n + j] - want).abs() <= 1e-4 * (1.0 + want.abs())
            })
        })
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn sgemm_raw(
        &self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        beta: f32,
    ) {
        let t = |x: bool| if x { TRANS } else { NO_TRANS };
        (self.sgemm)(
            ROW_MAJOR,
            t(ta),
            t(tb),
            m as i32,
            n as i32,
            k as i32,
            1.0,
            a,
            lda as i32,
            b,
            ldb as i32,
            beta,
            c,
            ldc as i32,
        );
    }

    /// Row-major `C (m, n) = op(A) op(B) + beta C` on the calling thread,
    /// with explicit leading dimensions (strided views); with `beta` 0, `c`
    /// is overwritten and need not be initialised.
    pub(crate) fn gemm_serial(
        &self,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        (a, lda): (&[f32], usize),
        (b, ldb): (&[f32], usize),
        (c, ldc): (&mut [f32], usize),
        beta: f32,
    ) {
        assert_views(
            (ta, tb),
            (m, n, k),
            [(a.len(), lda), (b.len(), ldb), (c.len(), ldc)],
        );
        if m == 0 || n == 0 {
            return;
        }
        if k == 0 {
            if beta == 0.0 {
                for row in c.chunks_mut(ldc).take(m) {
                    row[..n].fill(0.0);
                }
            }
            return;
        }
        // SAFETY: extents checked above.
        unsafe {
            self.sgemm_raw(
                ta,
                tb,
                m,
                n,
                k,
                a.as_ptr(),
                lda,
                b.as_ptr(),
                ldb,
                c.as_mut_ptr(),
                ldc,
                beta,
            )
        }
    }

    /// [`Blas::gemm_serial`] split over the rayon pool as [`Blas::gemm`]
    /// splits (by rows of `C`, or by columns when it has few rows): `C (m,
    /// n) = op(A) op(B) + beta C` on strided views, so a product can write
    /// (or, with `beta` 1, add) into a column block of a wider matrix.
    pub(crate) fn gemm_into(
        &self,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        (a, lda): (&[f32], usize),
        (b, ldb): (&[f32], usize),
        (c, ldc): (&mut [f32], usize),
        beta: f32,
    ) {
        let blocks = if m * n * k < (1 << 20) {
            1
        } else {
            rayon::current_num_threads()
        };
        if blocks <= 1 || m == 0 || n == 0 || k == 0 {
            return self.gemm_serial((ta, tb), (m, n, k), (a, lda), (b, ldb), (c, ldc), beta);
        }
        assert_views(
            (ta, tb),
            (m, n, k),
            [(a.len(), lda), (b.len(), ldb), (c.len(), ldc)],
        );
        let split_rows = m >= n || m >= 64 * blocks;
        let (len, align) = if split_rows { (m, 1) } else { (n, 16) };
        let per = len.div_ceil(blocks).div_ceil(align) * align;
        let (pa, pb, pc) = (
            Ptr(a.as_ptr().cast_mut()),
            Ptr(b.as_ptr().cast_mut()),
            Ptr(c.as_mut_ptr()),
        );
        let run = |start: usize| {
            let size = per.min(len - start);
            let ((mi, nj), a0, b0, c0) = if split_rows {
                (
                    (size, n),
                    if ta { start } else { start * lda },
                    0,
                    start * ldc,
                )
            } else {
                ((m, size), 0, if tb { start * ldb } else { start }, start)
            };
            // SAFETY: every block's view lies inside the operands checked
            // above; blocks write disjoint rows (or columns) of C, and A
            // and B are only read.
            unsafe {
                self.sgemm_raw(
                    ta,
                    tb,
                    mi,
                    nj,
                    k,
                    pa.offset(a0).0,
                    lda,
                    pb.offset(b0).0,
                    ldb,
                    pc.offset(c0).0,
                    ldc,
                    beta,
                )
            }
        };
        rayon::scope(|s| {
            for start in (0..len).step_by(per) {
                let run = &run;
                s.spawn(move |_| run(start));
            }
        });
    }

    /// Row-major `op(A) op(B)`, `(m, n)`, in a new vector (`op` transposes
    /// when `ta` / `tb`; `A` is `(m, k)` or, transposed, `(k, m)`; `B` is
    /// `(k, n)` or `(n, k)`), split over the rayon pool.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        b: &[f32],
    ) -> Vec<f32> {
        assert!(a.len() >= m * k && b.len() >= k * n, "gemm: short operand");
        let (lda, ldb) = (if ta { m } else { k }, if tb { k } else { n });
        let (pa, pb) = (Ptr(a.as_ptr().cast_mut()), Ptr(b.as_ptr().cast_mut()));
        par_blocks(m, n, k, &|(i0, mi), (j0, nj), c: Ptr| {
            let (pa, pb) = (pa, pb);
            // SAFETY: block offsets stay inside the operands checked above.
            unsafe {
                let a0 = if ta { pa.0.add(i0) } else { pa.0.add(i0 * lda) };
                let b0 = if tb { pb.0.add(j0 * ldb) } else { pb.0.add(j0) };
                self.sgemm_raw(ta, tb, mi, nj, k, a0, lda, b0, ldb, c.0, n, 0.0);
            }
        })
    }

    /// Row-major `op(A) op(B)`, `(m, n)`, for bf16 operands (raw bits) with
    /// f32 accumulation and output: [`Blas::gemm`]'s shapes and split.
    /// Mixed-precision training's products (AMX tiles where the CPU has
    /// them). `None` without [`Blas::has_bf16`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_bf16(
        &self,
        ta: bool,
        tb: bool,
        m: usize,
        n: usize,
        k: usize,
        a: &[u16],
        b: &[u16],
    ) -> Option<Vec<f32>> {
        let f = self.gemm_bf16?;
        assert!(a.len() >= m * k && b.len() >= k * n, "gemm: short operand");
        let (lda, ldb) = (if ta { m } else { k }, if tb { k } else { n });
        let (pa, pb) = (PtrU16(a.as_ptr()), PtrU16(b.as_ptr()));
        let t = |x: bool| if x { TRANS } else { NO_TRANS };
        Some(par_blocks(m, n, k, &|(i0, mi), (j0, nj), c: Ptr| {
            let (pa, pb) = (pa, pb);
            // SAFETY: block offsets stay inside the operands checked above.
            unsafe {
                let a0 = if ta { pa.0.add(i0) } else { pa.0.add(i0 * lda) };
                let b0 = if tb { pb.0.add(j0 * ldb) } else { pb.0.add(j0) };
                f(
                    ROW_MAJOR,
                    t(ta),
                    t(tb),
                    mi as i32,
                    nj as i32,
                    k as i32,
                    1.0,
                    a0,
                    lda as i32,
                    b0,
                    ldb as i32,
                    0.0,
                    c.0,
                    n as i32,
                )
            }
        }))
    }

    /// Whether bf16 products are available (MKL's `cblas_gemm_bf16bf16f32`).
    pub(crate) fn has_bf16(&self) -> bool {
        self.gemm_bf16.is_some()
    }

    /// `x (m, k) @ wᵀ` for a bf16 `(n, k)` weight (raw bits), in f32: `x`
    /// is rounded to bf16 first ([`bf16_vec`]: a one-thread scalar
    /// rounding was 9 % of a batch-32 SmolLM2 prefill's CPU time, all of it
    /// on the critical path), the products accumulate in f32. `None`
    /// without [`Blas::has_bf16`].
    pub(crate) fn gemm_bf16_nt(
        &self,
        m: usize,
        n: usize,
        k: usize,
        x: &[f32],
        w: &[u16],
    ) -> Option<Vec<f32>> {
        let f = self.gemm_bf16?;
        assert!(x.len() >= m * k && w.len() >= n * k, "gemm: short operand");
        let xb = bf16_vec(&x[..m * k]);
        let (pa, pb) = (PtrU16(xb.as_ptr()), PtrU16(w.as_ptr()));
        Some(par_blocks(m, n, k, &|(i0, mi), (j0, nj), c: Ptr| {
            let (pa, pb) = (pa, pb);
            // SAFETY: block offsets stay inside the operands checked above.
            unsafe {
                f(
                    ROW_MAJOR,
                    NO_TRANS,
                    TRANS,
                    mi as i32,
                    nj as i32,
                    k as i32,
                    1.0,
                    pa.0.add(i0 * k),
                    k as i32,
                    pb.0.add(j0 * k),
                    k as i32,
                    0.0,
                    c.0,
                    n as i32,
                )
            }
        }))
    }

    /// A bf16 weight `(n, k)` (raw bits), as the `B = wᵀ` operand of later
    /// products, packed into MKL's kernel layout: one block of columns per
    /// rayon thread, so a product runs its blocks in parallel. `reuse`: an
    /// earlier packing of a weight of the same shape, whose buffers are
    /// overwritten instead of allocating (and page-faulting) new ones.
    /// `None` without MKL's packing API.
    pub(crate) fn pack_bf16_nt(
        &self,
        n: usize,
        k: usize,
        w: &[u16],
        reuse: Option<PackedBf16>,
    ) -> Option<PackedBf16> {
        let api = self.bf16_packing?;
        assert!(w.len() >= n * k, "pack: short operand");
        let plan = pack_plan(n);
        let mut old: Vec<Option<AlignedBuf>> = match reuse {
            Some(p) if p.k == k && p.blocks.iter().map(|b| (b.0, b.1)).eq(plan.iter().copied()) => {
                p.blocks.into_iter().map(|b| Some(b.2)).collect()
            }
            _ => plan.iter().map(|_| None).collect(),
        };
        let blocks = plan
            .iter()
            .zip(old.iter_mut())
            .map(|(&(j0, nj), old)| {
                // SAFETY: MKL's size query, then a pack into a buffer of at
                // least that many bytes, reading rows j0..j0 + nj of w.
                unsafe {
                    let bytes = (api.get_size)(B_MATRIX, PACK_M, nj as i32, k as i32);
                    let mut buf = match old.take() {
                        Some(b) if b.len >= bytes => b,
                        _ => AlignedBuf::new(bytes),
                    };
                    (api.pack)(
                        ROW_MAJOR,
                        B_MATRIX,
                        TRANS,
                        PACK_M,
                        nj as i32,
                        k as i32,
                        w.as_ptr().add(j0 * k),
                        k as i32,
                        buf.as_mut_ptr().cast::<u16>(),
                    );
                    (j0, nj, buf)
                }
            })
            .collect();
        Some(PackedBf16 { n, k, blocks })
    }

    /// Bytes [`Blas::pack_bf16_nt`] allocates for an `(n, k)` weight with
    /// the current rayon pool; `None` without MKL's packing API.
    pub(crate) fn packed_bf16_bytes(&self, n: usize, k: usize) -> Option<usize> {
        let api = self.bf16_packing?;
        Some(
            pack_plan(n)
                .into_iter()
                // SAFETY: MKL's size query reads nothing but its arguments.
                .map(
                    |(_, nj)| unsafe { (api.get_size)(B_MATRIX, PACK_M, nj as i32, k as i32) } + 64,
                )
                .sum(),
        )
    }

    /// `x (m, k) @ wᵀ` for a weight packed by [`Blas::pack_bf16_nt`], in
    /// f32 (`x` rounded to bf16 first, as in [`Blas::gemm_bf16_nt`]).
    pub(crate) fn gemm_bf16_packed(&self, m: usize, x: &[f32], w: &PackedBf16) -> Vec<f32> {
        let api = self.bf16_packing.expect("packed by this library");
        let (n, k) = (w.n, w.k);
        assert!(x.len() >= m * k, "gemm: short operand");
        if m == 0 || n == 0 {
            return Vec::new();
        }
        let xb = bf16_vec(&x[..m * k]);
        let mut out: Vec<f32> = Vec::with_capacity(m * n);
        let pc = Ptr(out.spare_capacity_mut().as_mut_ptr().cast::<f32>());
        let pa = PtrU16(xb.as_ptr());
        let run = |(j0, nj, buf): &(usize, usize, AlignedBuf)| {
            let (pa, pc) = (pa, pc);
            // SAFETY: block j writes columns j0..j0 + nj of the m × n output,
            // disjoint from the others; the operands were checked above.
            unsafe {
                (api.compute)(
                    ROW_MAJOR,
                    NO_TRANS,
                    PACKED,
                    m as i32,
                    *nj as i32,
                    k as i32,
                    1.0,
                    pa.0,
                    k as i32,
                    buf.as_ptr().cast::<u16>(),
                    k as i32,
                    0.0,
                    pc.offset(*j0).0,
                    n as i32,
                )
            }
        };
        if w.blocks.len() == 1 {
            run(&w.blocks[0]);
        } else {
            rayon::scope(|s| {
                for b in &w.blocks {
                    let run = &run;
                    s.spawn(move |_| run(b));
                }
            });
        }
        // SAFETY: the blocks cover every column of every row (beta = 0).
        unsafe { out.set_len(m * n) };
        out
    }
}

/// The column blocks `(first column, columns)` a packed `(n, k)` weight is
/// split into: one per rayon thread, in multiples of 16 columns.
fn pack_plan(n: usize) -> Vec<(usize, usize)> {
    let threads = rayon::current_num_threads().max(1);
    let per = n.div_ceil(threads).div_ceil(16).max(1) * 16;
    (0..n)
        .step_by(per)
        .map(|j0| (j0, per.min(n - j0)))
        .collect()
}

/// Runs `block((row0, rows), (col0, cols), c)` over blocks of a new row-major
/// `(m, n)` output (`c` points at the block's first element; row stride
/// `n`), split into one block per rayon thread along the longer side
/// (columns in multiples of 16, so every block keeps full SIMD rows), or
/// one block below ~1 MFLOP, where the split costs more than it saves.
/// Every block must write all of its elements.
/// Panics unless the last element each strided view of a product touches
/// (`A`, `B`, `C` as `(length, leading dimension)`) is in bounds.
fn assert_views(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    views: [(usize, usize); 3],
) {
    let extent = |rows: usize, cols: usize, ld: usize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * ld + cols
        }
    };
    let a = if ta { (k, m) } else { (m, k) };
    let b = if tb { (n, k) } else { (k, n) };
    for ((rows, cols), (len, ld)) in [a, b, (m, n)].into_iter().zip(views) {
        assert!(len >= extent(rows, cols, ld), "gemm: short operand");
    }
}

fn par_blocks(
    m: usize,
    n: usize,
    k: usize,
    block: &(dyn Fn((usize, usize), (usize, usize), Ptr) + Sync),
) -> Vec<f32> {
    if k == 0 || m == 0 || n == 0 {
        return vec![0.0; m * n];
    }
    let mut out: Vec<f32> = Vec::with_capacity(m * n);
    let pc = Ptr(out.spare_capacity_mut().as_mut_ptr().cast::<f32>());
    let blocks = if m * n * k < (1 << 20) {
        1
    } else {
        rayon::current_num_threads()
    };
    let split_rows = m >= n || m >= 64 * blocks;
    let (len, align) = if split_rows { (m, 1) } else { (n, 16) };
    let per = len.div_ceil(blocks).div_ceil(align) * align;
    let run = |start: usize| {
        let size = per.min(len - start);
        // SAFETY: blocks are disjoint and inside the m × n allocation.
        if split_rows {
            block((start, size), (0, n), unsafe { pc.offset(start * n) });
        } else {
            block((0, m), (start, size), unsafe { pc.offset(start) });
        }
    };
    if len <= per {
        run(0);
    } else {
        rayon::scope(|s| {
            for start in (0..len).step_by(per) {
                let run = &run;
                s.spawn(move |_| run(start));
            }
        });
    }
    // SAFETY: the blocks wrote every element (beta = 0).
    unsafe { out.set_len(m * n) };
    out
}

/// A read-only bf16 operand shared by the blocks.
#[derive(Clone, Copy)]
struct PtrU16(*const u16);
// SAFETY: only read.
unsafe impl Send for PtrU16 {}
unsafe impl Sync for PtrU16 {}

/// A raw pointer the rayon blocks may share (each writes its own block).
#[derive(Clone, Copy)]
struct Ptr(*mut f32);

impl Ptr {
    /// `self + n` elements (a method, so closures capture the whole `Ptr`,
    /// which is `Sync`, not its raw field).
    ///
    /// # Safety
    /// The result must stay inside the allocation.
    unsafe fn offset(self, n: usize) -> Ptr {
        Ptr(unsafe { self.0.add(n) })
    }
}
// SAFETY: see `Blas::gemm`: blocks touch disjoint parts of C.
unsafe impl Send for Ptr {}
unsafe impl Sync for Ptr {}

/// A bf16 weight packed by [`Blas::pack_bf16_nt`]: column blocks
/// `(first column, columns, packed buffer)`.
pub(crate) struct PackedBf16 {
    n: usize,
    k: usize,
    blocks: Vec<(usize, usize, AlignedBuf)>,
}

impl PackedBf16 {
    /// Bytes held (the packed layout pads; MKL asks for more than `2 n k`).
    pub(crate) fn bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.2.len).sum()
    }
}

/// A zeroed byte buffer whose start is 64-byte aligned (MKL's packed
/// buffers). Large zeroed allocations are mapped lazily, so pages MKL's
/// padding never touches cost no memory.
struct AlignedBuf {
    raw: Vec<u8>,
    off: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let raw = vec![0u8; len + 64];
        let off = raw.as_ptr().align_offset(64);
        AlignedBuf { raw, off, len }
    }

    fn as_ptr(&self) -> *const u8 {
        self.raw[self.off..].as_ptr()
    }

    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.raw[self.off..].as_mut_ptr()
    }
}

/// `x` rounded to bf16 (raw bits), split over the rayon pool for large
/// inputs (a SmolLM2 weight or activation: ~1M elements per product). On
/// CPUs with AVX512-BF16 one instruction rounds 16 values (to nearest even,
/// as [`bf16_bits`], except that subnormal inputs become zero); elsewhere
/// the portable loop, which the generic x86-64 build vectorises with SSE2
/// only: it took 14 % of a mixed-precision SmolLM2 train step in `perf`.
pub(crate) fn bf16_vec(x: &[f32]) -> Vec<u16> {
    bf16_vec_of(&[x])
}

/// The concatenation of `parts`, rounded to bf16 as [`bf16_vec`] (stacked
/// weights, without an f32 copy of the stack first).
pub(crate) fn bf16_vec_of(parts: &[&[f32]]) -> Vec<u16> {
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let len = parts.iter().map(|p| p.len()).sum();
    let mut out: Vec<u16> = Vec::with_capacity(len);
    let mut spare = &mut out.spare_capacity_mut()[..len];
    for x in parts {
        let (head, rest) = spare.split_at_mut(x.len());
        spare = rest;
        if x.len() < 2 * CHUNK {
            bf16_into(x, head);
        } else {
            head.par_chunks_mut(CHUNK)
                .zip(x.par_chunks(CHUNK))
                .for_each(|(o, x)| bf16_into(x, o));
        }
    }
    // SAFETY: bf16_into wrote every element of every part.
    unsafe { out.set_len(len) };
    out
}

/// Writes `x` rounded to bf16 into `out` (same length).
fn bf16_into(x: &[f32], out: &mut [std::mem::MaybeUninit<u16>]) {
    debug_assert_eq!(x.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bf16")
        && std::arch::is_x86_feature_detected!("avx512f")
    {
        // SAFETY: the features were just detected.
        unsafe { bf16_into_avx512(x, out) };
        return;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        o.write(bf16_bits(v));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn bf16_into_avx512(x: &[f32], out: &mut [std::mem::MaybeUninit<u16>]) {
    use std::arch::x86_64::*;
    let n = x.len().min(out.len());
    let whole = n / 16 * 16;
    let (px, po) = (x.as_ptr(), out.as_mut_ptr().cast::<u16>());
    let mut i = 0;
    while i < whole {
        // SAFETY: i + 16 <= n for both slices.
        unsafe {
            let v = _mm512_loadu_ps(px.add(i));
            let r: __m256bh = _mm512_cvtneps_pbh(v);
            _mm256_storeu_si256(
                po.add(i).cast::<__m256i>(),
                std::mem::transmute::<__m256bh, __m256i>(r),
            );
        }
        i += 16;
    }
    for (o, &v) in out[whole..n].iter_mut().zip(&x[whole..n]) {
        o.write(bf16_bits(v));
    }
}

/// `half::bf16::from_f32(v).to_bits()` (round to nearest even, NaN kept
/// quiet), written branch-free so the conversion loop vectorises: `half`'s
/// scalar version was 4 % of a bf16 prefill in `perf`.
#[inline]
fn bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let rounded = (x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16) as u16;
    if v.is_nan() {
        (x >> 16) as u16 | 0x40
    } else {
        rounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_vec_matches_bf16_bits_on_normal_values() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        // Both the one-thread and the split path, with a ragged tail.
        for len in [37usize, (1 << 17) + 5] {
            let x: Vec<f32> = (0..len)
                .map(|i| match i % 7 {
                    0 => f32::from_bits(rng.random::<u32>()),
                    _ => rng.random::<f32>() * 200.0 - 100.0,
                })
                .collect();
            let y = bf16_vec(&x);
            for (v, b) in x.iter().zip(&y) {
                if v.is_nan() {
                    assert!(half::bf16::from_bits(*b).is_nan());
                } else if v.abs() < f32::MIN_POSITIVE {
                    // AVX512-BF16 flushes subnormal inputs to (signed) zero.
                    assert!(*b == bf16_bits(*v) || *b & 0x7fff == 0, "{v:e}");
                } else {
                    assert_eq!(*b, bf16_bits(*v), "{v:e}");
                }
            }
        }
    }

    #[test]
    fn bf16_bits_match_half() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let special = [
            0.0f32,
            -0.0,
            1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-42,
        ];
        let random = (0..200_000).map(|_| f32::from_bits(rng.random::<u32>()));
        for v in special.into_iter().chain(random) {
            assert_eq!(
                bf16_bits(v),
                half::bf16::from_f32(v).to_bits(),
                "{v:e} ({:#x})",
                v.to_bits()
            );
        }
    }
}
