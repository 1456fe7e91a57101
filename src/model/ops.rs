//! Fused CPU kernels *with* backward passes for the training path.
//!
//! candle's own fused kernels (`softmax_last_dim`, `rms_norm`, ...) have no
//! backward, and the composite versions (max, sub, exp, sum, div, each a
//! full pass over the tensor and a fresh allocation, with more of the same
//! in the backward) dominate the cost of scoring on CPU. These custom ops do
//! one pass forward and one pass backward. On non-CPU devices the same math
//! falls back to composite candle ops, so results are device-independent up
//! to rounding.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Device, Layout, Shape, Tensor, D};

use super::error::{ModelError, Result};

#[cfg(test)]
thread_local! {
    /// Tests set this to run the composite (non-CPU) fallbacks on CPU.
    pub(crate) static FORCE_COMPOSITE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the fused CPU kernels apply to tensors on `device`.
fn fused(device: &Device) -> bool {
    #[cfg(test)]
    if FORCE_COMPOSITE.with(|c| c.get()) {
        return false;
    }
    device.is_cpu()
}

/// Below this many elements the kernels run on the calling thread.
const PAR_MIN_ELEMS: usize = 1 << 16;

/// Runs `f(row_index, row)` over the rows of `out`, split across threads.
fn par_rows(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if row_len == 0 {
        return;
    }
    let n_rows = out.len() / row_len;
    let threads = candle_core::utils::get_num_threads().min(n_rows).max(1);
    if threads <= 1 || out.len() < PAR_MIN_ELEMS {
        for (r, row) in out.chunks_mut(row_len).enumerate() {
            f(r, row);
        }
        return;
    }
    let rows_per = n_rows.div_ceil(threads);
    std::thread::scope(|sc| {
        for (ci, chunk) in out.chunks_mut(rows_per * row_len).enumerate() {
            let f = &f;
            sc.spawn(move || {
                for (k, row) in chunk.chunks_mut(row_len).enumerate() {
                    f(ci * rows_per + k, row);
                }
            });
        }
    });
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{op}: only f32 is supported")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

/// Causal softmax over the last dim of `x` `(..., q_len, s)`, after scaling
/// by `scale`: query row `i` (its index within the `q_len` block) sees
/// columns `j <= i + s - q_len`; hidden entries come out exactly 0.
/// Differentiable.
pub(crate) fn causal_softmax(x: &Tensor, scale: f64, q_len: usize) -> Result<Tensor> {
    let s = x.dim(D::Minus1)?;
    if fused(x.device()) {
        return Ok(x.contiguous()?.apply_op1(CausalSoftmax {
            scale: scale as f32,
            q_len,
        })?);
    }
    // Composite fallback.
    let mut mask = vec![0f32; q_len * s];
    for i in 0..q_len {
        for j in (i + s - q_len + 1)..s {
            mask[i * s + j] = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(mask, (q_len, s), x.device())?;
    let shape = x.shape().clone();
    let blocks = x.elem_count() / (q_len * s).max(1);
    let x = x
        .reshape((blocks, q_len, s))?
        .affine(scale, 0.0)?
        .broadcast_add(&mask)?;
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .reshape(shape)?)
}

/// `x (rows, in) @ wᵀ` for a frozen HF `(out, in)` weight, differentiable
/// in `x` only. candle's matmul backward always computes the gradient of
/// both operands, so a LoRA base weight would cost a full `(out, in)`
/// product per projection per backward that is then thrown away; this op
/// computes just `dx = dy @ w`.
pub(crate) fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let w = w.detach();
    if fused(x.device()) && x.rank() == 2 {
        return Ok(x.contiguous()?.apply_op1(FrozenLinear { w })?);
    }
    Ok(x.matmul(&w.t()?)?)
}

struct FrozenLinear {
    w: Tensor,
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "actguide-frozen-linear"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, self.name())?;
        // A plain (untracked) tensor over a copy of the input, so the
        // product runs on candle's threaded gemm.
        let x = Tensor::from_slice(x, layout.shape(), &Device::Cpu)?;
        let y = x.matmul(&self.w.t()?)?;
        let shape = y.shape().clone();
        Ok((CpuStorage::F32(y.flatten_all()?.to_vec1()?), shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.matmul(&self.w)?))
    }
}

struct CausalSoftmax {
    scale: f32,
    q_len: usize,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "actguide-causal-softmax"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, self.name())?;
        let dims = layout.shape().dims();
        let s = *dims.last().unwrap_or(&1);
        let q_len = self.q_len.max(1);
        if s < q_len || (!x.is_empty() && !(x.len() / s.max(1)).is_multiple_of(q_len)) {
            candle_core::bail!("causal-softmax: shape {dims:?} does not fit q_len {q_len}");
        }
        let scale = self.scale;
        let mut out = vec![0f32; x.len()];
        par_rows(&mut out, s, |r, row| {
            let xr = &x[r * s..(r + 1) * s];
            let vis = (r % q_len) + s - q_len + 1;
            let m = xr[..vis].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum = 0f32;
            for (o, &v) in row[..vis].iter_mut().zip(&xr[..vis]) {
                let e = ((v - m) * scale).exp();
                *o = e;
                sum += e;
            }
            let inv = 1.0 / sum;
            for o in &mut row[..vis] {
                *o *= inv;
            }
        });
        Ok((CpuStorage::F32(out), layout.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        let y = res.contiguous()?;
        Ok(Some(
            y.apply_op2_no_bwd(&g, &SoftmaxBwd { scale: self.scale })?,
        ))
    }
}

/// `dx = scale * y * (g - sum(g * y))` row-wise, from the softmax output `y`
/// and the incoming gradient `g`.
struct SoftmaxBwd {
    scale: f32,
}

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "actguide-softmax-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = f32_slice(s1, l1, self.name())?;
        let g = f32_slice(s2, l2, self.name())?;
        if l1.shape() != l2.shape() {
            candle_core::bail!("softmax-bwd: shapes {:?} vs {:?}", l1.shape(), l2.shape());
        }
        let s = *l1.shape().dims().last().unwrap_or(&1);
        let scale = self.scale;
        let mut out = vec![0f32; y.len()];
        par_rows(&mut out, s, |r, row| {
            let yr = &y[r * s..(r + 1) * s];
            let gr = &g[r * s..(r + 1) * s];
            let dot: f32 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((o, &yv), &gv) in row.iter_mut().zip(yr).zip(gr) {
                *o = scale * yv * (gv - dot);
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// RMSNorm over the last dim, `x * rsqrt(mean(x^2) + eps) * w` (HF
/// LlamaRMSNorm), differentiable in `x` and `w`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x.device()) {
        return Ok(x
            .contiguous()?
            .apply_op2(&w.contiguous()?, RmsNorm { eps: eps as f32 })?);
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?.broadcast_mul(w)?)
}

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "actguide-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, self.name())?;
        let w = f32_slice(s2, l2, self.name())?;
        let h = *l1.shape().dims().last().unwrap_or(&1);
        if w.len() != h {
            candle_core::bail!(
                "rms-norm: weight {:?} vs input {:?}",
                l2.shape(),
                l1.shape()
            );
        }
        let eps = self.eps;
        let mut out = vec![0f32; x.len()];
        par_rows(&mut out, h, |r, row| {
            let xr = &x[r * h..(r + 1) * h];
            let inv = inv_rms(xr, eps);
            for ((o, &xv), &wv) in row.iter_mut().zip(xr).zip(w) {
                *o = xv * inv * wv;
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad_res.contiguous()?;
        let h = w.dim(0)?;
        let rows = x.elem_count() / h.max(1);
        let x2 = x.reshape((rows, h))?;
        let g2 = g.reshape((rows, h))?;
        // One op returns [dx; dw] as (rows + 1, h); split it here.
        let both = x2.apply_op2_no_bwd(
            &Tensor::cat(&[&g2, &w.unsqueeze(0)?], 0)?,
            &RmsNormBwd { eps: self.eps },
        )?;
        let dx = both.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = both.narrow(0, rows, 1)?.squeeze(0)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward of [`RmsNorm`]. Inputs: `x` `(rows, h)` and `[g; w]`
/// `(rows + 1, h)`. Output `[dx; dw]` `(rows + 1, h)` with, per row and
/// `r = rsqrt(mean(x^2) + eps)`:
/// `dx = r * w * g - x * r^3 / h * sum(w * g * x)`, `dw = sum_rows(g * x * r)`.
struct RmsNormBwd {
    eps: f32,
}

impl CustomOp2 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "actguide-rms-norm-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, self.name())?;
        let gw = f32_slice(s2, l2, self.name())?;
        let (rows, h) = l1.shape().dims2()?;
        if l2.shape().dims2()? != (rows + 1, h) {
            candle_core::bail!("rms-norm-bwd: bad shapes {:?} {:?}", l1.shape(), l2.shape());
        }
        let (g, w) = gw.split_at(rows * h);
        let eps = self.eps;
        let mut out = vec![0f32; (rows + 1) * h];
        let (dx, dw) = out.split_at_mut(rows * h);
        par_rows(dx, h, |r, row| {
            let xr = &x[r * h..(r + 1) * h];
            let gr = &g[r * h..(r + 1) * h];
            let inv = inv_rms(xr, eps);
            let dot: f32 = xr.iter().zip(gr).zip(w).map(|((a, b), c)| a * b * c).sum();
            let k = inv * inv * inv * dot / h as f32;
            for (((o, &xv), &gv), &wv) in row.iter_mut().zip(xr).zip(gr).zip(w) {
                *o = inv * wv * gv - xv * k;
            }
        });
        for r in 0..rows {
            let xr = &x[r * h..(r + 1) * h];
            let gr = &g[r * h..(r + 1) * h];
            let inv = inv_rms(xr, eps);
            for ((d, &xv), &gv) in dw.iter_mut().zip(xr).zip(gr) {
                *d += gv * xv * inv;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((rows + 1, h))))
    }
}

// ----------------------------------------------------------------------
// Rotary embeddings (+ transpose to heads-first)
// ----------------------------------------------------------------------

/// Rotary cos/sin values for a batch: `rows` (1 = shared by every sequence,
/// or one per sequence) × `t` positions × `head_dim / 2` frequencies.
#[derive(Clone)]
pub(crate) struct RopeTables {
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
    rows: usize,
    t: usize,
    half: usize,
}

impl RopeTables {
    /// `positions` has `rows * t` entries (row-major). Angles are computed
    /// in f32 as `pos * inv_freq`, like HF.
    pub(crate) fn new(inv_freq: &[f32], positions: &[usize], rows: usize, t: usize) -> Self {
        debug_assert_eq!(positions.len(), rows * t);
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for f in inv_freq {
                let (s, c) = (p as f32 * f).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        RopeTables {
            cos: Arc::new(cos),
            sin: Arc::new(sin),
            rows,
            t,
            half,
        }
    }

    /// Full-width `(rows, 1, t, 2 * half)` tensors (both halves repeat the
    /// frequencies), for the composite path.
    fn full(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        let widen = |v: &[f32]| -> Vec<f32> {
            v.chunks(self.half.max(1))
                .flat_map(|c| c.iter().chain(c.iter()).copied())
                .collect()
        };
        let shape = (self.rows, 1, self.t, 2 * self.half);
        Ok((
            Tensor::from_vec(widen(&self.cos), shape, device)?,
            Tensor::from_vec(widen(&self.sin), shape, device)?,
        ))
    }
}

/// Applies rotary embeddings (HF rotate-half layout:
/// `x * cos + rotate_half(x) * sin`, `rotate_half([a, b]) = [-b, a]`) to
/// `x` `(b, t, heads, head_dim)` and returns it heads-first,
/// `(b, heads, t, head_dim)`, contiguous. Differentiable in `x`.
pub(crate) fn rope_heads_first(x: &Tensor, tables: &RopeTables) -> Result<Tensor> {
    let (b, t, _h, d) = x.dims4()?;
    if d != 2 * tables.half || t != tables.t || (tables.rows != 1 && tables.rows != b) {
        return Err(ModelError::InvalidArgument(format!(
            "rope: input {:?} does not fit tables rows={} t={} half={}",
            x.dims(),
            tables.rows,
            tables.t,
            tables.half
        )));
    }
    if fused(x.device()) {
        return Ok(x.contiguous()?.apply_op1(Rope {
            tables: tables.clone(),
            inverse: false,
        })?);
    }
    rope_heads_first_composite(x, tables)
}

pub(crate) fn rope_heads_first_composite(x: &Tensor, tables: &RopeTables) -> Result<Tensor> {
    let (cos, sin) = tables.full(x.device())?;
    let x = x.transpose(1, 2)?;
    let d = x.dim(D::Minus1)?;
    let a = x.narrow(D::Minus1, 0, d / 2)?;
    let b = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rot = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
    Ok((x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?)?.contiguous()?)
}

/// Forward: `(b, t, h, d)` → rotated `(b, h, t, d)`. Inverse (the
/// backward): `(b, h, t, d)` gradient → `(b, t, h, d)`, rotated by the
/// negative angle (the rotation's transpose).
struct Rope {
    tables: RopeTables,
    inverse: bool,
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "actguide-rope"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, self.name())?;
        let (d0, d1, d2, d) = layout.shape().dims4()?;
        // Input index order: forward (b, t, h, d); inverse (b, h, t, d).
        let (b, t, h) = if self.inverse {
            (d0, d2, d1)
        } else {
            (d0, d1, d2)
        };
        let half = d / 2;
        let tb = &self.tables;
        let (cos, sin) = (&tb.cos[..], &tb.sin[..]);
        let inverse = self.inverse;
        let mut out = vec![0f32; x.len()];
        par_rows(&mut out, d, |r, row| {
            // Output row r: forward (bi, hi, ti); inverse (bi, ti, hi).
            let (bi, hi, ti) = if inverse {
                (r / (t * h), r % h, (r / h) % t)
            } else {
                (r / (h * t), (r / t) % h, r % t)
            };
            let src_row = if inverse {
                (bi * h + hi) * t + ti
            } else {
                (bi * t + ti) * h + hi
            };
            let src = &x[src_row * d..(src_row + 1) * d];
            let trow = if tb.rows == 1 { ti } else { bi * t + ti };
            let c = &cos[trow * half..(trow + 1) * half];
            let s = &sin[trow * half..(trow + 1) * half];
            let (lo, hi_) = row.split_at_mut(half);
            let (xa, xb) = src.split_at(half);
            if inverse {
                for j in 0..half {
                    lo[j] = xa[j] * c[j] + xb[j] * s[j];
                    hi_[j] = xb[j] * c[j] - xa[j] * s[j];
                }
            } else {
                for j in 0..half {
                    lo[j] = xa[j] * c[j] - xb[j] * s[j];
                    hi_[j] = xb[j] * c[j] + xa[j] * s[j];
                }
            }
        });
        let shape = if inverse { (b, t, h, d) } else { (b, h, t, d) };
        Ok((CpuStorage::F32(out), Shape::from(shape)))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        Ok(Some(g.apply_op1(Rope {
            tables: self.tables.clone(),
            inverse: !self.inverse,
        })?))
    }
}

// ----------------------------------------------------------------------
// SwiGLU on the fused gate/up projection
// ----------------------------------------------------------------------

/// `silu(gu[:, :i]) * gu[:, i:]` for the fused `[gate | up]` projection
/// `gu` `(rows, 2 * i)`; differentiable.
pub(crate) fn swiglu(gu: &Tensor) -> Result<Tensor> {
    if fused(gu.device()) {
        return Ok(gu.contiguous()?.apply_op1(SwiGlu)?);
    }
    swiglu_composite(gu)
}

pub(crate) fn swiglu_composite(gu: &Tensor) -> Result<Tensor> {
    let i = gu.dim(D::Minus1)? / 2;
    Ok((gu.narrow(D::Minus1, 0, i)?.silu()? * gu.narrow(D::Minus1, i, i)?)?)
}

struct SwiGlu;

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "actguide-swiglu"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, self.name())?;
        let mut dims = layout.shape().dims().to_vec();
        let two_i = *dims.last().unwrap_or(&0);
        if !two_i.is_multiple_of(2) {
            candle_core::bail!("swiglu: odd last dim {two_i}");
        }
        let i = two_i / 2;
        let mut out = vec![0f32; x.len() / 2];
        par_rows(&mut out, i, |r, row| {
            let (g, u) = x[r * two_i..(r + 1) * two_i].split_at(i);
            for ((o, &gv), &uv) in row.iter_mut().zip(g).zip(u) {
                *o = gv / (1.0 + (-gv).exp()) * uv;
            }
        });
        if let Some(last) = dims.last_mut() {
            *last = i;
        }
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        Ok(Some(arg.contiguous()?.apply_op2_no_bwd(&g, &SwiGluBwd)?))
    }
}

/// `(gu, grad_out)` → `d gu`: `[go * u * silu'(g) | go * silu(g)]`.
struct SwiGluBwd;

impl CustomOp2 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "actguide-swiglu-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, self.name())?;
        let go = f32_slice(s2, l2, self.name())?;
        let two_i = *l1.shape().dims().last().unwrap_or(&0);
        let i = two_i / 2;
        if go.len() * 2 != x.len() {
            candle_core::bail!("swiglu-bwd: shapes {:?} vs {:?}", l1.shape(), l2.shape());
        }
        let mut out = vec![0f32; x.len()];
        par_rows(&mut out, two_i, |r, row| {
            let (g, u) = x[r * two_i..(r + 1) * two_i].split_at(i);
            let gor = &go[r * i..(r + 1) * i];
            let (dg, du) = row.split_at_mut(i);
            for j in 0..i {
                let sig = 1.0 / (1.0 + (-g[j]).exp());
                let silu = g[j] * sig;
                dg[j] = gor[j] * u[j] * sig * (1.0 + g[j] * (1.0 - sig));
                du[j] = gor[j] * silu;
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

// ----------------------------------------------------------------------
// Target log-prob + entropy straight from the logits
// ----------------------------------------------------------------------

/// For logits `(n, vocab)`, targets (`n` ids) and `scale = 1 / temperature`:
/// returns `(n, 2)` with column 0 = `log softmax(scale * logits)[target]`
/// and column 1 = the entropy of `softmax(scale * logits)`.
/// Differentiable in the logits; never materialises an `(n, vocab)`
/// log-softmax in the graph (only the logits and their gradient).
pub(crate) fn logp_entropy(logits: &Tensor, targets: &[u32], scale: f64) -> Result<Tensor> {
    let (n, v) = logits.dims2()?;
    if targets.len() != n {
        return Err(ModelError::InvalidArgument(format!(
            "logp-entropy: {n} rows but {} targets",
            targets.len()
        )));
    }
    if let Some(bad) = targets.iter().find(|&&t| t as usize >= v) {
        return Err(ModelError::InvalidArgument(format!(
            "logp-entropy: target {bad} outside vocab {v}"
        )));
    }
    if fused(logits.device()) {
        return Ok(logits.contiguous()?.apply_op1(LogpEntropy {
            targets: Arc::new(targets.to_vec()),
            scale: scale as f32,
        })?);
    }
    logp_entropy_composite(logits, targets, scale)
}

pub(crate) fn logp_entropy_composite(
    logits: &Tensor,
    targets: &[u32],
    scale: f64,
) -> Result<Tensor> {
    let n = targets.len();
    let z = logits.affine(scale, 0.0)?;
    let max = z.max_keepdim(D::Minus1)?.detach();
    let d = z.broadcast_sub(&max)?;
    let lse = d.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp_all = d.broadcast_sub(&lse)?;
    let tgt = Tensor::from_vec(targets.to_vec(), (n, 1), logits.device())?;
    let logp = logp_all.gather(&tgt, 1)?;
    let ent = (logp_all.exp()? * &logp_all)?.sum_keepdim(1)?.neg()?;
    Ok(Tensor::cat(&[&logp, &ent], 1)?)
}

/// Per row: max, `lse = ln sum exp(z - max)` (accumulated in f64), and
/// `sum p * (z - max)`, with `z = scale * logits`.
fn row_stats(row: &[f32], scale: f32) -> (f32, f64, f64) {
    let m = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
    let mut sum = 0f64;
    let mut wsum = 0f64;
    for &v in row {
        let d = v * scale - m;
        let e = d.exp() as f64;
        sum += e;
        wsum += e * d as f64;
    }
    (m, sum.ln(), wsum / sum)
}

struct LogpEntropy {
    targets: Arc<Vec<u32>>,
    scale: f32,
}

impl CustomOp1 for LogpEntropy {
    fn name(&self) -> &'static str {
        "actguide-logp-entropy"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, self.name())?;
        let (n, v) = layout.shape().dims2()?;
        let scale = self.scale;
        let targets = &self.targets[..];
        let mut out = vec![0f32; n * 2];
        par_rows(&mut out, 2, |r, o| {
            let row = &x[r * v..(r + 1) * v];
            let (m, lse, mean_d) = row_stats(row, scale);
            let dt = (row[targets[r] as usize] * scale - m) as f64;
            o[0] = (dt - lse) as f32;
            // H = -sum p (d - lse) = lse - sum p d
            o[1] = (lse - mean_d) as f32;
        });
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // Pack [grad_logp, grad_entropy, entropy] per row for the kernel.
        let g = grad_res.contiguous()?;
        let ent = res.narrow(1, 1, 1)?;
        let packed = Tensor::cat(&[&g, &ent], 1)?;
        Ok(Some(arg.contiguous()?.apply_op2_no_bwd(
            &packed,
            &LogpEntropyBwd {
                targets: self.targets.clone(),
                scale: self.scale,
            },
        )?))
    }
}

/// `d logits = scale * (g_lp * (onehot - p) - g_h * p * (log p + H))`.
struct LogpEntropyBwd {
    targets: Arc<Vec<u32>>,
    scale: f32,
}

impl CustomOp2 for LogpEntropyBwd {
    fn name(&self) -> &'static str {
        "actguide-logp-entropy-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, self.name())?;
        let gp = f32_slice(s2, l2, self.name())?;
        let (n, v) = l1.shape().dims2()?;
        if l2.shape().dims2()? != (n, 3) {
            candle_core::bail!(
                "logp-entropy-bwd: bad shapes {:?} {:?}",
                l1.shape(),
                l2.shape()
            );
        }
        let scale = self.scale;
        let targets = &self.targets[..];
        let mut out = vec![0f32; n * v];
        par_rows(&mut out, v, |r, o| {
            let row = &x[r * v..(r + 1) * v];
            let (g_lp, g_h, h) = (gp[r * 3], gp[r * 3 + 1], gp[r * 3 + 2]);
            let (m, lse, _) = row_stats(row, scale);
            let lse = lse as f32;
            for (ov, &xv) in o.iter_mut().zip(row) {
                let logp = xv * scale - m - lse;
                let p = logp.exp();
                *ov = scale * (-g_lp * p - g_h * p * (logp + h));
            }
            o[targets[r] as usize] += scale * g_lp;
        });
        Ok((CpuStorage::F32(out), Shape::from((n, v))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{Rng, SeedableRng};

    fn randn(rng: &mut rand_chacha::ChaCha8Rng, shape: &[usize]) -> Var {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
    }

    #[test]
    fn frozen_linear_matches_matmul_without_a_weight_gradient() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let x = randn(&mut rng, &[7, 5]);
        let w = randn(&mut rng, &[4, 5]);
        let up = randn(&mut rng, &[4, 3]);
        // Something downstream, so the incoming gradient is not all ones.
        let y1 = frozen_linear(x.as_tensor(), w.as_tensor())
            .unwrap()
            .matmul(up.as_tensor())
            .unwrap();
        let y2 = x
            .as_tensor()
            .matmul(&w.as_tensor().t().unwrap())
            .unwrap()
            .matmul(up.as_tensor())
            .unwrap();
        assert!(max_diff(&y1, &y2) < 1e-5);
        let g1 = y1.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let g2 = y2.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let (a, b) = (
            g1.get(x.as_tensor()).unwrap(),
            g2.get(x.as_tensor()).unwrap(),
        );
        assert!(max_diff(a, b) < 1e-4, "dx differs by {}", max_diff(a, b));
        assert!(
            g1.get(w.as_tensor()).is_none(),
            "the frozen weight got a gradient"
        );
        assert!(g2.get(w.as_tensor()).is_some());
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// Composite reference: mask, scale, softmax with candle's slow ops.
    fn ref_softmax(x: &Tensor, scale: f64, q_len: usize) -> Tensor {
        let s = x.dim(D::Minus1).unwrap();
        let mut mask = vec![0f32; q_len * s];
        for i in 0..q_len {
            for j in (i + s - q_len + 1)..s {
                mask[i * s + j] = f32::NEG_INFINITY;
            }
        }
        let mask = Tensor::from_vec(mask, (q_len, s), x.device()).unwrap();
        let shape = x.shape().clone();
        let x = x
            .reshape((x.elem_count() / (q_len * s), q_len, s))
            .unwrap()
            .affine(scale, 0.0)
            .unwrap()
            .broadcast_add(&mask)
            .unwrap();
        candle_nn::ops::softmax(&x, D::Minus1)
            .unwrap()
            .reshape(shape)
            .unwrap()
    }

    #[test]
    fn causal_softmax_matches_composite_forward_and_backward() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        // Small (sequential) and large (threaded) cases; s > q_len = decode-like.
        for (shape, q_len) in [
            (vec![2, 3, 5, 5], 5),
            (vec![2, 2, 3, 7], 3),
            // GQA layout: rows are (kv head, rep, query), q_len divides them.
            (vec![2, 2, 6, 5], 3),
            (vec![4, 2, 2, 96, 96], 96),
        ] {
            let x = randn(&mut rng, &shape);
            let wt = randn(&mut rng, &shape);
            let a = causal_softmax(x.as_tensor(), 0.7, q_len).unwrap();
            let b = ref_softmax(x.as_tensor(), 0.7, q_len);
            assert!(max_diff(&a, &b) < 1e-6, "forward {shape:?}");
            let la = (a * wt.as_tensor()).unwrap().sum_all().unwrap();
            let lb = (b * wt.as_tensor()).unwrap().sum_all().unwrap();
            let ga = la.backward().unwrap();
            let gb = lb.backward().unwrap();
            let (ga, gb) = (ga.get(&x).unwrap(), gb.get(&x).unwrap());
            assert!(max_diff(ga, gb) < 1e-5, "backward {shape:?}");
        }
    }

    #[test]
    fn rms_norm_matches_composite_forward_and_backward() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for rows in [3usize, 700] {
            let x = randn(&mut rng, &[rows, 128]);
            let w = randn(&mut rng, &[128]);
            let wt = randn(&mut rng, &[rows, 128]);
            let a = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            let b = candle_nn::ops::rms_norm_slow(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            assert!(max_diff(&a, &b) < 1e-5, "forward");
            let ga = (a * wt.as_tensor())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gb = (b * wt.as_tensor())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            assert!(
                max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap()) < 1e-4,
                "dx"
            );
            let (dwa, dwb) = (ga.get(&w).unwrap(), gb.get(&w).unwrap());
            let rel = max_diff(dwa, dwb)
                / dwb
                    .abs()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
            assert!(rel < 1e-4, "dw rel {rel}");
        }
    }

    fn grads_match(fused: &Tensor, composite: &Tensor, x: &Var, weight: &Var, what: &str) {
        assert!(max_diff(fused, composite) < 1e-5, "{what} forward");
        let ga = (fused * weight.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gb = (composite * weight.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let d = max_diff(ga.get(x).unwrap(), gb.get(x).unwrap());
        assert!(d < 1e-5, "{what} backward: {d}");
    }

    #[test]
    fn rope_matches_composite() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        let inv_freq: Vec<f32> = (0..8)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / 16.0))
            .collect();
        // Shared positions (scoring), per-sequence positions (generation),
        // and a large case that goes through the threaded path.
        for (b, t, h, rows) in [(2, 5, 3, 1), (3, 4, 2, 3), (8, 64, 4, 8)] {
            let pos: Vec<usize> = (0..rows * t).map(|i| (i * 7) % 50).collect();
            let tables = RopeTables::new(&inv_freq, &pos, rows, t);
            let x = randn(&mut rng, &[b, t, h, 16]);
            let wt = randn(&mut rng, &[b, h, t, 16]);
            let a = rope_heads_first(x.as_tensor(), &tables).unwrap();
            let c = rope_heads_first_composite(x.as_tensor(), &tables).unwrap();
            assert_eq!(a.dims(), &[b, h, t, 16]);
            grads_match(&a, &c, &x, &wt, "rope");
        }
    }

    #[test]
    fn swiglu_matches_composite() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for rows in [3usize, 500] {
            let x = randn(&mut rng, &[rows, 2 * 96]);
            let wt = randn(&mut rng, &[rows, 96]);
            let a = swiglu(x.as_tensor()).unwrap();
            let c = swiglu_composite(x.as_tensor()).unwrap();
            grads_match(&a, &c, &x, &wt, "swiglu");
        }
    }

    #[test]
    fn logp_entropy_matches_composite() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        for (n, v, scale) in [(5usize, 11usize, 1.0), (7, 50, 1.0 / 0.7), (300, 400, 0.8)] {
            let x = randn(&mut rng, &[n, v]);
            let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
            let wt = randn(&mut rng, &[n, 2]);
            let a = logp_entropy(x.as_tensor(), &targets, scale).unwrap();
            let c = logp_entropy_composite(x.as_tensor(), &targets, scale).unwrap();
            grads_match(&a, &c, &x, &wt, "logp-entropy");
        }
    }
}
