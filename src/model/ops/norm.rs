//! RMSNorm (HF `LlamaRMSNorm`) with its backward.

use candle_core::{DType, Shape, Tensor, D};

use super::{fused, par_rows, Fused2, Input, Kernel2};
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
        let mut out = vec![0f32; x.len()];
        par_rows(&mut out, h, |r, row| {
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
        let g = grad_res.contiguous()?;
        let h = w.dim(0)?;
        let rows = x.elem_count() / h.max(1);
        let x2 = x.reshape((rows, h))?;
        let g2 = g.reshape((rows, h))?;
        // One op returns [dx; dw] as (rows + 1, h); split it here.
        let both = x2.apply_op2_no_bwd(
            &Tensor::cat(&[&g2, &w.unsqueeze(0)?], 0)?,
            &Fused2(RmsNormBwd { eps: self.eps }),
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

impl Kernel2 for RmsNormBwd {
    const NAME: &'static str = "actguide-rms-norm-bwd";

    fn forward(&self, x: Input<'_>, gw: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let (rows, h) = x.shape.dims2()?;
        if gw.shape.dims2()? != (rows + 1, h) {
            candle_core::bail!("rms-norm-bwd: bad shapes {:?} {:?}", x.shape, gw.shape);
        }
        let (x, gw) = (x.data, gw.data);
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
        Ok((out, Shape::from((rows + 1, h))))
    }
}
