//! RMSNorm (HF `LlamaRMSNorm`) with its backward.

use candle_core::{DType, Shape, Tensor, D};

use super::{fused, par_rows_new, par_rows_work, Fused2, Fused3, Input, Kernel2, Kernel3};
use crate::model::error::Result;

/// RMSNorm over the last dim, `x * rsqrt(mean(x^2) + eps) * w` (HF
/// LlamaRMSNorm), differentiable in `x` and `w`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    if fused(x) {
        return Ok(x
            .contiguous()?
            .apply_op2(&w.contiguous()?, Fused2(RmsNorm { eps: eps as f32 }))?);
    }
    // Statistics and normalisation in f32, then back to the input's dtype
    // before the weight (HF LlamaRMSNorm's order).
    let dt = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?.to_dtype(dt)?.broadcast_mul(w)?)
}

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

struct RmsNorm {
    eps: f32,
}

impl Kernel2 for RmsNorm {
    const NAME: &'static str = "actguide-rms-norm";

    fn forward(&self, input: Input<'_>, w: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let x = input.data;
        let h = *input.shape.dims().last().unwrap_or(&1);
        if w.data.len() != h {
            candle_core::bail!("rms-norm: weight {:?} vs input {:?}", w.shape, input.shape);
        }
        let w = w.data;
        let eps = self.eps;
        let out = par_rows_new(x.len() / h.max(1), h, |r, row| {
            let xr = &x[r * h..(r + 1) * h];
            let inv = inv_rms(xr, eps);
            for ((o, &xv), &wv) in row.iter_mut().zip(xr).zip(w) {
                *o = xv * inv * wv;
            }
        });
        Ok((out, input.shape.clone()))
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let h = w.dim(0)?;
        let rows = x.elem_count() / h.max(1);
        let x2 = x.contiguous()?.reshape((rows, h))?;
        let g2 = grad_res.contiguous()?.reshape((rows, h))?;
        // One op returns [dx; dw] as (rows + 1, h); split it here.
        let both =
            x2.apply_op3_no_bwd(&g2, &w.contiguous()?, &Fused3(RmsNormBwd { eps: self.eps }))?;
        let dx = both.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = both.narrow(0, rows, 1)?.squeeze(0)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// Backward of [`RmsNorm`]. Inputs: `x` and `g` `(rows, h)`, `w` `(h)`.
/// Output `[dx; dw]` `(rows + 1, h)` with, per row and
/// `r = rsqrt(mean(x^2) + eps)`:
/// `dx = r * w * g - x * r^3 / h * sum(w * g * x)`, `dw = sum_rows(g * x * r)`.
/// `dw` is split over the pool by columns, so each element still sums its
/// rows in order (the result does not depend on the thread count).
struct RmsNormBwd {
    eps: f32,
}

impl Kernel3 for RmsNormBwd {
    const NAME: &'static str = "actguide-rms-norm-bwd";

    fn forward(
        &self,
        x: Input<'_>,
        g: Input<'_>,
        w: Input<'_>,
    ) -> candle_core::Result<(Vec<f32>, Shape)> {
        let (rows, h) = x.shape.dims2()?;
        if g.shape.dims2()? != (rows, h) || w.data.len() != h {
            candle_core::bail!(
                "rms-norm-bwd: bad shapes {:?} {:?} {:?}",
                x.shape,
                g.shape,
                w.shape
            );
        }
        let (x, g, w) = (x.data, g.data, w.data);
        let eps = self.eps;
        let mut inv = vec![0f32; rows];
        par_rows_work(&mut inv, 1, h, |r, o| {
            o[0] = inv_rms(&x[r * h..(r + 1) * h], eps);
        });
        let mut out = par_rows_new(rows + 1, h, |r, row| {
            if r == rows {
                return; // dw, below
            }
            let xr = &x[r * h..(r + 1) * h];
            let gr = &g[r * h..(r + 1) * h];
            let inv = inv[r];
            let dot: f32 = xr.iter().zip(gr).zip(w).map(|((a, b), c)| a * b * c).sum();
            let k = inv * inv * inv * dot / h as f32;
            for (((o, &xv), &gv), &wv) in row.iter_mut().zip(xr).zip(gr).zip(w) {
                *o = inv * wv * gv - xv * k;
            }
        });
        let dw = &mut out[rows * h..];
        // A task reads its columns of every row of `x` and `g`.
        let cols = COLS.min(h);
        par_rows_work(dw, cols, rows * cols, |c, d| {
            let c0 = c * cols;
            for (r, &inv) in inv.iter().enumerate() {
                let xr = &x[r * h + c0..r * h + c0 + d.len()];
                let gr = &g[r * h + c0..r * h + c0 + d.len()];
                for ((d, &xv), &gv) in d.iter_mut().zip(xr).zip(gr) {
                    *d += gv * xv * inv;
                }
            }
        });
        Ok((out, Shape::from((rows + 1, h))))
    }
}

/// Columns of `dw` per task of [`RmsNormBwd`]'s column split.
const COLS: usize = 64;
