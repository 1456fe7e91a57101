//! `x Wᵀ` for an HF `(out, in)` weight: on the CPU through the run-time
//! BLAS when one is loaded (forward and backward), else candle's matmul;
//! and the frozen-weight form whose gradient flows to `x` only (LoRA's base
//! projections).

use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor};

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};

use candle_core::TensorId;

use super::blas::{bf16_vec, bf16_vec_of, blas, rust_gemm_for, wide_rust_gemm, Blas, PackedBf16};
use super::skinny::{self, PackedF32};
use super::{f32_slice, fused, Fused1, Fused2, Fused3, Input, Kernel1, Kernel2, Kernel3};
use crate::model::error::Result;

/// `x (rows, in) @ wᵀ` for an HF `(out, in)` weight, differentiable in both.
/// A bf16 `w` with an f32 `x` is a bf16 rollout weight
/// ([`bf16_rollouts_available`]): forward only, result in f32.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if w.dtype() == DType::BF16 && x.dtype() == DType::F32 {
        return bf16_linear(x, w);
    }
    if let Some(y) = packed_f32_linear(x, w)? {
        return Ok(y);
    }
    if let Some(y) = blas_linear(x, w)? {
        return Ok(y);
    }
    Ok(x.matmul(&w.t()?)?)
}

/// `x (rows, in) @ wᵀ` for a frozen HF `(out, in)` weight, differentiable
/// in `x` only. candle's matmul backward always computes the gradient of
/// both operands, so a LoRA base weight would cost a full `(out, in)`
/// product per projection per backward that is then thrown away; this op
/// computes just `dx = dy @ w`.
pub(crate) fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let w = w.detach();
    if let Some(y) = blas_linear(x, &w)? {
        return Ok(y);
    }
    if fused(x) && x.rank() == 2 {
        return Ok(x.contiguous()?.apply_op1(Fused1(FrozenLinear { w }))?);
    }
    Ok(x.matmul(&w.t()?)?)
}

/// [`linear`] (or, for a detached `w`, [`frozen_linear`]) with the
/// products in bf16 and f32 accumulation: mixed-precision training as
/// PyTorch's CPU autocast runs it. Both operands are rounded to bf16 for
/// the forward product and kept for the backward, whose products (`dx = dy
/// w`, `dw = dyᵀ x`, each only for a tracked operand) round `dy` too;
/// outputs and gradients stay f32, so master weights and AdamW state are
/// untouched. Where the BLAS has no bf16 products, or the operands are not
/// f32 CPU matrices, this is [`linear`] / [`frozen_linear`].
pub(crate) fn mixed_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let Some(blas) = blas().filter(|b| b.has_bf16()) else {
        return plain(x, w);
    };
    if !(fused(x) && fused(w) && x.rank() == 2 && w.rank() == 2) {
        return plain(x, w);
    }
    Ok(x.contiguous()?.apply_op2(
        &w.contiguous()?,
        Fused2(MixedLinear(MixedProduct::new(blas))),
    )?)
}

/// [`mixed_linear`] against two weights stacked by rows, `x [w1; w2]ᵀ`
/// (the fused gate/up of a trained MLP), without the f32 stack: both are
/// rounded straight into one bf16 operand, and the backward's one weight
/// product is split into the two weights' gradients as views. `None`
/// where [`mixed_linear`] would not run.
pub(crate) fn mixed_linear_pair(x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<Option<Tensor>> {
    let Some(blas) = blas().filter(|b| b.has_bf16()) else {
        return Ok(None);
    };
    if !(fused(x) && fused(w1) && fused(w2) && x.rank() == 2 && w1.rank() == 2 && w2.rank() == 2) {
        return Ok(None);
    }
    #[cfg(test)]
    PAIR_PRODUCTS.with(|c| c.set(c.get() + 1));
    Ok(Some(x.contiguous()?.apply_op3(
        &w1.contiguous()?,
        &w2.contiguous()?,
        Fused3(MixedPair(MixedProduct::new(blas))),
    )?))
}

/// `y = x [w1; w2]ᵀ` on bf16 operands ([`mixed_linear_pair`]).
struct MixedPair(MixedProduct);

impl Kernel3 for MixedPair {
    const NAME: &'static str = "actguide-mixed-linear-pair";

    fn forward(
        &self,
        x: Input<'_>,
        w1: Input<'_>,
        w2: Input<'_>,
    ) -> candle_core::Result<(Vec<f32>, Shape)> {
        self.0.forward(Self::NAME, x, &[w1, w2])
    }

    fn backward(
        &self,
        x: &Tensor,
        w1: &Tensor,
        w2: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (n1, n2) = (w1.dim(0)?, w2.dim(0)?);
        let want_dw = w1.track_op() || w2.track_op();
        let (dx, dw) = self.0.backward(Self::NAME, x, n1 + n2, dy, want_dw)?;
        // Both weights' gradients are row views of the one product.
        let (dw1, dw2) = match dw {
            Some(dw) => (
                w1.track_op().then(|| dw.narrow(0, 0, n1)).transpose()?,
                w2.track_op().then(|| dw.narrow(0, n1, n2)).transpose()?,
            ),
            None => (None, None),
        };
        Ok((dx, dw1, dw2))
    }
}

/// A frozen weight `(n, k)` rounded to bf16 once (a LoRA base under mixed
/// precision: it never changes, so it is not converted again per pass).
pub(crate) struct FrozenBf16 {
    bits: Vec<u16>,
    n: usize,
    k: usize,
}

impl FrozenBf16 {
    /// `w (n, k)`, or the rows of several weights stacked (`cat` along
    /// rows: the fused gate/up), rounded to bf16.
    pub(crate) fn of(ws: &[&Tensor]) -> Result<FrozenBf16> {
        let k = ws[0].dims2()?.1;
        let mut bits = Vec::new();
        let mut n = 0;
        for w in ws {
            let (wn, wk) = w.dims2()?;
            if wk != k {
                return Err(candle_core::Error::Msg(format!(
                    "frozen bf16: stacked weights of {k} and {wk} columns"
                ))
                .into());
            }
            let c = w.to_dtype(DType::F32)?.contiguous()?;
            bits.extend(with_f32(&c, bf16_vec)?);
            n += wn;
        }
        Ok(FrozenBf16 { bits, n, k })
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        2 * self.bits.len()
    }
}

/// `x @ wᵀ` for a frozen weight already in bf16 ([`FrozenBf16`]),
/// differentiable in `x` (`dx = dy w`, in bf16 with f32 accumulation);
/// `None` where [`mixed_linear`] would not run (then the caller takes the
/// f32 weight's path).
pub(crate) fn mixed_frozen_linear(x: &Tensor, w: &Arc<FrozenBf16>) -> Result<Option<Tensor>> {
    let Some(blas) = blas().filter(|b| b.has_bf16()) else {
        return Ok(None);
    };
    if !(fused(x) && x.rank() == 2) {
        return Ok(None);
    }
    Ok(Some(
        x.contiguous()?
            .apply_op1(Fused1(MixedFrozen { blas, w: w.clone() }))?,
    ))
}

struct MixedFrozen {
    blas: &'static Blas,
    w: Arc<FrozenBf16>,
}

impl Kernel1 for MixedFrozen {
    const NAME: &'static str = "actguide-mixed-frozen-linear";

    fn forward(&self, x: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let (m, k) = x.shape.dims2()?;
        let (n, wk) = (self.w.n, self.w.k);
        if k != wk {
            candle_core::bail!("{}: x {:?} against w ({n}, {wk})", Self::NAME, x.shape);
        }
        let xb = bf16_vec(x.data);
        let y = self
            .blas
            .gemm_bf16(false, true, m, n, k, &xb, &self.w.bits)
            .expect("checked has_bf16");
        Ok((y, Shape::from((m, n))))
    }

    fn backward(
        &self,
        x: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let (m, k) = x.dims2()?;
        let n = self.w.n;
        let dy = with_f32(&dy.contiguous()?, bf16_vec)?;
        let v = self
            .blas
            .gemm_bf16(false, false, m, k, n, &dy, &self.w.bits)
            .expect("checked has_bf16");
        Ok(Some(Tensor::from_vec(v, (m, k), &Device::Cpu)?))
    }
}

/// [`linear`] for a tracked `w`, [`frozen_linear`] for a detached one.
fn plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if w.track_op() {
        linear(x, w)
    } else {
        frozen_linear(x, w)
    }
}

/// Whether mixed-precision products ([`mixed_linear`]) run here: a loaded
/// BLAS with bf16 products (MKL).
pub fn mixed_precision_available() -> bool {
    bf16_rollouts_available()
}

/// `y = x wᵀ` on bf16 operands ([`mixed_linear`]).
struct MixedLinear(MixedProduct);

impl Kernel2 for MixedLinear {
    const NAME: &'static str = "actguide-mixed-linear";

    fn forward(&self, x: Input<'_>, w: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        self.0.forward(Self::NAME, x, &[w])
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        self.0.backward(Self::NAME, x, w.dim(0)?, dy, w.track_op())
    }
}

/// The product of the mixed-precision ops: `x (m, k)` times the weights
/// stacked by rows, transposed, on bf16 operands with f32 accumulation;
/// the rounded operands are kept for the backward (as autocast keeps its
/// casts).
struct MixedProduct {
    blas: &'static Blas,
    saved: Mutex<Option<(Vec<u16>, Vec<u16>)>>,
}

impl MixedProduct {
    fn new(blas: &'static Blas) -> Self {
        MixedProduct {
            blas,
            saved: Mutex::new(None),
        }
    }

    /// `x [w…]ᵀ`, `(m, n)` for `n` the weights' rows together; the weights
    /// are rounded straight into one bf16 operand (no f32 stack).
    fn forward(
        &self,
        op: &str,
        x: Input<'_>,
        ws: &[Input<'_>],
    ) -> candle_core::Result<(Vec<f32>, Shape)> {
        let (m, k) = x.shape.dims2()?;
        let mut n = 0;
        for w in ws {
            let (wn, wk) = w.shape.dims2()?;
            if wk != k {
                candle_core::bail!("{op}: x {:?} against w {:?}", x.shape, w.shape);
            }
            n += wn;
        }
        let parts: Vec<&[f32]> = ws.iter().map(|w| w.data).collect();
        let (xb, wb) = (bf16_vec(x.data), bf16_vec_of(&parts));
        let y = self
            .blas
            .gemm_bf16(false, true, m, n, k, &xb, &wb)
            .expect("checked has_bf16");
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some((xb, wb));
        Ok((y, Shape::from((m, n))))
    }

    /// `dx = dy w` (where `x` is tracked) and the stacked `dw = dyᵀ x`
    /// `(n, k)` (where `want_dw`), `dy` rounded to bf16 too.
    fn backward(
        &self,
        op: &str,
        x: &Tensor,
        n: usize,
        dy: &Tensor,
        want_dw: bool,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (m, k) = x.dims2()?;
        // The backward runs once per graph; the operands are freed after.
        let Some((xb, wb)) = self.saved.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            candle_core::bail!("{op}: backward without a forward")
        };
        let dy = with_f32(&dy.contiguous()?, bf16_vec)?;
        let product = |ta, tb, m, n, k, a: &[u16], b: &[u16]| {
            self.blas
                .gemm_bf16(ta, tb, m, n, k, a, b)
                .expect("checked has_bf16")
        };
        let dx = if x.track_op() {
            let v = product(false, false, m, k, n, &dy, &wb);
            Some(Tensor::from_vec(v, (m, k), &Device::Cpu)?)
        } else {
            None
        };
        let dw = if want_dw {
            let v = product(true, false, n, k, m, &dy, &xb);
            Some(Tensor::from_vec(v, (n, k), &Device::Cpu)?)
        } else {
            None
        };
        Ok((dx, dw))
    }
}

/// Whether bf16 rollout weights can run here: a loaded BLAS with bf16
/// products (MKL's `cblas_gemm_bf16bf16f32`).
pub(crate) fn bf16_rollouts_available() -> bool {
    blas().is_some_and(Blas::has_bf16)
}

/// Whether generation packs its f32 weights for [`skinny`]'s kernel: on
/// CPUs with AVX-512 (F and VL), unless MKL is loaded on an Intel CPU (its
/// own AVX-512 kernels, not measured against this one); on CPUs with AVX2
/// and FMA but no AVX-512, for decode-sized products (up to
/// [`PACKED_MAX_ROWS`] rows), where MKL runs the same 256-bit FMAs but
/// does not stream the weight (SmolLM2 decode steps at batch 8 on an
/// AVX2-only AMD EPYC: 204 against 135 tok/s).
/// `ACTGUIDE_PACKED_ROLLOUTS=on` packs wherever a kernel runs (AVX2 or
/// AVX-512), `off` nowhere (saving the copies' memory, one f32 copy of
/// every product weight).
pub(crate) fn f32_rollout_packs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(
        || match std::env::var("ACTGUIDE_PACKED_ROLLOUTS").as_deref() {
            Ok("off" | "0" | "none") => false,
            Ok("on" | "1") => skinny::available(),
            _ => match skinny::isa() {
                Some(skinny::Isa::Avx512) => blas().is_none() || wide_rust_gemm(),
                Some(skinny::Isa::Avx2) => true,
                None => false,
            },
        },
    )
}

/// Product weights (elements, all together) below which f32 rollouts are
/// not packed: such a model (64 MB of f32 or less, the built-in tiny ones)
/// stays in the CPU's caches, where the packed layout has nothing to win,
/// and keeps the general products.
const PACK_MIN_ELEMS: usize = 1 << 24;

/// Whether f32 rollout weights of `elems` elements in all get packed.
fn f32_packs_for(elems: usize) -> bool {
    #[cfg(test)]
    if let Some(v) = PACK_MIN_ELEMS_OVERRIDE.with(|c| c.get()) {
        return f32_rollout_packs() && elems >= v;
    }
    f32_rollout_packs() && elems >= PACK_MIN_ELEMS
}

/// The vector kernel packed f32 generation runs on this CPU (`"AVX-512"`,
/// `"AVX2"`), for the run log; `None` where none runs.
pub fn decode_kernel() -> Option<&'static str> {
    skinny::isa().map(|isa| match isa {
        skinny::Isa::Avx512 => "AVX-512",
        skinny::Isa::Avx2 => "AVX2",
    })
}

#[cfg(test)]
thread_local! {
    /// Tests set this to pack small models' weights on their thread.
    pub(crate) static PACK_MIN_ELEMS_OVERRIDE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// `x @ wᵀ` on [`skinny`]'s kernel when `w` has a registered f32 pack and
/// the product is untracked (generation: decode and prefill); `None`
/// otherwise.
fn packed_f32_linear(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    // Where nothing is ever packed, no registry lookup per product.
    if !f32_rollout_packs()
        || w.dtype() != DType::F32
        || x.dtype() != DType::F32
        || x.rank() != 2
        || x.track_op()
        || !x.device().is_cpu()
    {
        return Ok(None);
    }
    let Some(pack) = registered(w.id()) else {
        return Ok(None);
    };
    let Pack::F32(p) = &*pack else {
        return Ok(None);
    };
    let (m, k) = x.dims2()?;
    if m > PACKED_MAX_ROWS && skinny::isa() == Some(skinny::Isa::Avx2) {
        // With 16 registers the kernel has too few accumulators for
        // compute-bound products: on an AVX2-only AMD EPYC it prefilled
        // SmolLM2 slower than MKL (b8: 1.07 against 0.94 s) and level with
        // candle's gemm, so only decode-sized products take it.
        return Ok(None);
    }
    if p.dims() != w.dims2()? || k != p.dims().1 {
        return Err(candle_core::Error::Msg(format!(
            "packed linear: x {:?} against w {:?} packed as {:?}",
            x.shape(),
            w.shape(),
            p.dims()
        ))
        .into());
    }
    #[cfg(test)]
    PACKED_PRODUCTS.with(|c| c.set(c.get() + 1));
    let x = x.contiguous()?;
    let y = with_f32(&x, |xs| p.matmul(xs, m))?;
    Ok(Some(Tensor::from_vec(y, (m, p.dims().0), &Device::Cpu)?))
}

/// The pack registered for weight `id`, if any.
fn registered(id: TensorId) -> Option<Arc<Pack>> {
    PACKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .cloned()
}

/// Whether this CPU has AMX bf16 tiles (Linux: `/proc/cpuinfo`; `None`
/// where that cannot be read). Without them MKL's bf16 products run on
/// AVX-512 and are slower than its f32 ones: on an AMD EPYC with
/// AVX512-BF16, SmolLM2-135M decoded 11.5 tok/s from bf16 weights against
/// 31.3 in f32 at batch 1.
pub fn cpu_has_amx_bf16() -> Option<bool> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let flags = info.lines().find(|l| l.starts_with("flags"))?;
    Some(flags.split_whitespace().any(|f| f == "amx_bf16"))
}

/// `x (f32) @ wᵀ (bf16)` on the BLAS's bf16 kernels, for generation (no
/// gradient: rollout weights are detached).
fn bf16_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let blas = blas().filter(|b| b.has_bf16()).ok_or_else(|| {
        candle_core::Error::Msg("bf16 rollout weights need a BLAS with bf16 products (MKL)".into())
    })?;
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let ((m, k), (n, k2)) = (x.dims2()?, w.dims2()?);
    if k != k2 || !x.device().is_cpu() {
        return Err(candle_core::Error::Msg(format!(
            "bf16 linear: x {:?} against w {:?} on {:?}",
            x.shape(),
            w.shape(),
            x.device()
        ))
        .into());
    }
    let packed = if m <= PACKED_MAX_ROWS {
        registered(w.id())
    } else {
        None
    };
    let y = with_f32(&x, |xs| match packed.as_deref() {
        Some(Pack::Bf16(p)) => {
            #[cfg(test)]
            PACKED_PRODUCTS.with(|c| c.set(c.get() + 1));
            Ok(blas.gemm_bf16_packed(m, xs, p))
        }
        _ => with_bf16_bits(&w, |wb| {
            blas.gemm_bf16_nt(m, n, k, xs, wb)
                .expect("checked has_bf16")
        }),
    })??;
    Ok(Tensor::from_vec(y, (m, n), &Device::Cpu)?)
}

/// The BLAS product when a BLAS is loaded and both operands are f32 CPU
/// matrices; `None` leaves the product to candle (also for large products
/// where candle's gemm has the wider kernels, see [`rust_gemm_for`]).
fn blas_linear(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let Some(blas) = blas() else { return Ok(None) };
    if !(fused(x) && fused(w) && x.rank() == 2 && w.rank() == 2) {
        return Ok(None);
    }
    if rust_gemm_for(x.dim(0)?) {
        return Ok(None);
    }
    Ok(Some(x.contiguous()?.apply_op2(
        &w.contiguous()?,
        Fused2(BlasLinear { blas }),
    )?))
}

/// `y = x wᵀ`; backward `dx = dy w` and `dw = dyᵀ x`, each only when that
/// operand is tracked (a detached weight gets no product).
struct BlasLinear {
    blas: &'static Blas,
}

impl Kernel2 for BlasLinear {
    const NAME: &'static str = "actguide-blas-linear";

    fn forward(&self, x: Input<'_>, w: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let ((m, k), (n, k2)) = (x.shape.dims2()?, w.shape.dims2()?);
        if k != k2 {
            candle_core::bail!("{}: x {:?} against w {:?}", Self::NAME, x.shape, w.shape);
        }
        let y = self.blas.gemm(false, true, m, n, k, x.data, w.data);
        Ok((y, Shape::from((m, n))))
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let ((m, k), (n, _)) = (x.dims2()?, w.dims2()?);
        let dy = dy.contiguous()?;
        let dx = if x.track_op() {
            let v = with_f32(&dy, |g| {
                with_f32(w, |w| self.blas.gemm(false, false, m, k, n, g, w))
            })??;
            Some(Tensor::from_vec(v, (m, k), &Device::Cpu)?)
        } else {
            None
        };
        let dw = if w.track_op() {
            let v = with_f32(&dy, |g| {
                with_f32(x, |x| self.blas.gemm(true, false, n, k, m, g, x))
            })??;
            Some(Tensor::from_vec(v, (n, k), &Device::Cpu)?)
        } else {
            None
        };
        Ok((dx, dw))
    }
}

/// Runs `f` on the raw bits of a contiguous bf16 CPU tensor, without a copy.
fn with_bf16_bits<R>(t: &Tensor, f: impl FnOnce(&[u16]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let (Storage::Cpu(CpuStorage::BF16(v)), Some((a, b))) =
        (&*storage, layout.contiguous_offsets())
    else {
        candle_core::bail!("actguide-bf16-linear: contiguous bf16 CPU tensors only")
    };
    let v = &v[a..b];
    // SAFETY: half::bf16 is a transparent u16.
    Ok(f(unsafe {
        std::slice::from_raw_parts(v.as_ptr().cast::<u16>(), v.len())
    }))
}

/// Runs `f` on the f32 elements of a contiguous CPU tensor, without a copy.
pub(super) fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => Ok(f(f32_slice(s, layout, "actguide-blas-linear")?)),
        _ => candle_core::bail!("actguide-blas-linear: CPU tensors only"),
    }
}

struct FrozenLinear {
    w: Tensor,
}

impl Kernel1 for FrozenLinear {
    const NAME: &'static str = "actguide-frozen-linear";

    fn forward(&self, x: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        // A plain (untracked) tensor over a copy of the input, so the
        // product runs on candle's threaded gemm.
        let x = Tensor::from_slice(x.data, x.shape, &Device::Cpu)?;
        let y = x.matmul(&self.w.t()?)?;
        let shape = y.shape().clone();
        Ok((y.flatten_all()?.to_vec1()?, shape))
    }

    fn backward(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.matmul(&self.w)?))
    }
}

/// Up to this many rows (decode batches), a packed weight is faster: MKL
/// repacks an unpacked bf16 weight on every call, which at a decode step's
/// few rows costs more than the product (measured: 16 rows × (576, 1536)
/// took 124 µs unpacked, 43 µs packed; at 256 rows packed was slower).
const PACKED_MAX_ROWS: usize = 64;

/// A packed copy of a rollout weight.
pub(crate) enum Pack {
    /// MKL's packed layout of a bf16 weight (its bf16 products).
    Bf16(PackedBf16),
    /// [`skinny`]'s layout of an f32 weight.
    F32(PackedF32),
}

impl Pack {
    fn bytes(&self) -> usize {
        match self {
            Pack::Bf16(p) => p.bytes(),
            Pack::F32(p) => p.bytes(),
        }
    }
}

/// Packed copies of rollout weights, by the id of the tensor they were
/// packed from (ids are never reused). Filled and emptied by
/// [`PackedWeights`].
static PACKED: LazyLock<Mutex<HashMap<TensorId, Arc<Pack>>>> = LazyLock::new(Default::default);

/// Packed copies of a set of rollout weights, used by [`linear`] for
/// small-batch products while this value lives (the rollout cache holds
/// it next to the weights); dropping it unregisters and frees them.
pub(crate) struct PackedWeights {
    packs: Vec<(TensorId, Arc<Pack>)>,
    /// Bytes the packed copies hold (MKL's bf16 layout pads: for
    /// SmolLM2-135M about 2 GB for 270 MB of bf16 weights; the f32 one
    /// holds the weights once, 540 MB).
    pub(crate) bytes: usize,
}

impl PackedWeights {
    /// Packs every bf16 CPU weight of `ws` for MKL (in parallel); `None`
    /// without MKL's packing API. `reuse`: the packs of the previous
    /// version of the same weights (same order), whose buffers are
    /// overwritten.
    pub(crate) fn pack(
        ws: &[&Tensor],
        reuse: Option<PackedWeights>,
    ) -> Result<Option<PackedWeights>> {
        use rayon::prelude::*;
        let Some(blas) = blas() else { return Ok(None) };
        let mut old: Vec<Option<PackedBf16>> = Self::reusable(reuse, ws.len())
            .into_iter()
            .map(|p| match p {
                Some(Pack::Bf16(p)) => Some(p),
                _ => None,
            })
            .collect();
        let packed: Vec<Option<(TensorId, Pack)>> = ws
            .par_iter()
            .zip(old.par_iter_mut())
            .map(|(w, old)| -> Result<_> {
                if w.dtype() != DType::BF16 || !w.device().is_cpu() || w.rank() != 2 {
                    return Ok(None);
                }
                let w = w.contiguous()?;
                let (n, k) = w.dims2()?;
                let packed = with_bf16_bits(&w, |bits| blas.pack_bf16_nt(n, k, bits, old.take()))?;
                Ok(packed.map(|p| (w.id(), Pack::Bf16(p))))
            })
            .collect::<Result<_>>()?;
        Ok(Self::register(packed))
    }

    /// Packs every f32 CPU weight of `ws` for [`skinny`]'s kernel (one
    /// weight at a time, each packed in parallel); `None` where
    /// [`f32_rollout_packs`] does not hold or the weights are small
    /// ([`PACK_MIN_ELEMS`]). `reuse` as for
    /// [`PackedWeights::pack`].
    pub(crate) fn pack_f32(
        ws: &[&Tensor],
        reuse: Option<PackedWeights>,
    ) -> Result<Option<PackedWeights>> {
        let elems: usize = ws
            .iter()
            .filter(|w| w.dtype() == DType::F32 && w.rank() == 2)
            .map(|w| w.elem_count())
            .sum();
        if !f32_packs_for(elems) {
            return Ok(None);
        }
        let old = Self::reusable(reuse, ws.len());
        let mut packed = Vec::with_capacity(ws.len());
        for (w, old) in ws.iter().zip(old) {
            if w.dtype() != DType::F32 || !w.device().is_cpu() || w.rank() != 2 {
                packed.push(None);
                continue;
            }
            let old = match old {
                Some(Pack::F32(p)) => Some(p),
                _ => None,
            };
            let (n, k) = w.dims2()?;
            let c = w.contiguous()?;
            let p = with_f32(&c, |v| PackedF32::pack(v, n, k, old))?;
            packed.push(Some((w.id(), Pack::F32(p))));
        }
        Ok(Self::register(packed))
    }

    /// Unregisters `reuse`'s packs and hands back those no product still
    /// holds, padded with `None` to `len`.
    fn reusable(reuse: Option<PackedWeights>, len: usize) -> Vec<Option<Pack>> {
        let mut old: Vec<Option<Pack>> = match reuse {
            Some(mut r) => {
                let packs = std::mem::take(&mut r.packs);
                unregister(packs.iter().map(|p| p.0));
                // A product still holding a pack keeps it (then packed anew).
                packs
                    .into_iter()
                    .map(|(_, p)| Arc::try_unwrap(p).ok())
                    .collect()
            }
            None => Vec::new(),
        };
        old.resize_with(len, || None);
        old
    }

    fn register(packed: Vec<Option<(TensorId, Pack)>>) -> Option<PackedWeights> {
        if packed.iter().all(Option::is_none) {
            return None;
        }
        let mut map = PACKED.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = PackedWeights {
            packs: Vec::new(),
            bytes: 0,
        };
        for (id, p) in packed.into_iter().flatten() {
            let p = Arc::new(p);
            out.bytes += p.bytes();
            map.insert(id, p.clone());
            out.packs.push((id, p));
        }
        Some(out)
    }
}

/// Bytes [`PackedWeights::pack`] would allocate for bf16 weights of these
/// `(n, k)` shapes (0 without MKL's packing API): for memory estimates.
pub fn packed_rollout_bytes(shapes: &[(usize, usize)]) -> u64 {
    blas().map_or(0, |b| {
        shapes
            .iter()
            .map(|&(n, k)| b.packed_bf16_bytes(n, k).unwrap_or(0) as u64)
            .sum()
    })
}

/// Bytes [`PackedWeights::pack_f32`] would allocate for f32 weights of
/// these `(n, k)` shapes (0 where [`f32_rollout_packs`] does not hold).
pub fn packed_f32_rollout_bytes(shapes: &[(usize, usize)]) -> u64 {
    if !f32_packs_for(shapes.iter().map(|&(n, k)| n * k).sum()) {
        return 0;
    }
    shapes
        .iter()
        .map(|&(n, k)| skinny::packed_bytes(n, k) as u64)
        .sum()
}

fn unregister(ids: impl Iterator<Item = TensorId>) {
    let mut map = PACKED.lock().unwrap_or_else(|e| e.into_inner());
    for id in ids {
        map.remove(&id);
    }
}

impl Drop for PackedWeights {
    fn drop(&mut self) {
        unregister(self.packs.iter().map(|p| p.0));
    }
}

#[cfg(test)]
thread_local! {
    /// Stacked-pair products ([`mixed_linear_pair`]) this thread ran.
    pub(crate) static PAIR_PRODUCTS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
thread_local! {
    /// Products this thread ran with a packed weight.
    pub(crate) static PACKED_PRODUCTS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
/// Whether a packed copy of the weight `id` is registered.
pub(crate) fn is_packed(id: TensorId) -> bool {
    PACKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains_key(&id)
}
