//! Causal softmax (scale + causal mask + softmax over the last dim) with
//! its backward, for attention scores on the training path.

use candle_core::{DType, Shape, Tensor, D};

use super::expf::exp_in_place;
use super::{fused, par_rows, Fused1, Fused2, Input, Kernel1, Kernel2};
use crate::model::error::Result;

/// Causal softmax over the last dim of `x` `(..., q_len, s)`, after scaling
/// by `scale`: query row `i` (its index within the `q_len` block) sees
/// columns `j <= i + s - q_len`; hidden entries come out exactly 0.
/// Differentiable.
pub(crate) fn causal_softmax(x: &Tensor, scale: f64, q_len: usize) -> Result<Tensor> {
    let s = x.dim(D::Minus1)?;
    if fused(x) {
        return Ok(x.contiguous()?.apply_op1(Fused1(CausalSoftmax {
            scale: scale as f32,
            q_len,
        }))?);
    }
    // Composite fallback, in f32 whatever the input's dtype (as HF does).
    let dt = x.dtype();
    let x = x.to_dtype(DType::F32)?;
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
        .reshape(shape)?
        .to_dtype(dt)?)
}

struct CausalSoftmax {
    scale: f32,
    q_len: usize,
}

impl Kernel1 for CausalSoftmax {
    const NAME: &'static str = "actguide-causal-softmax";

    fn forward(&self, input: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let x = input.data;
        let dims = input.shape.dims();
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
            for (o, &v) in row[..vis].iter_mut().zip(&xr[..vis]) {
                *o = (v - m) * scale;
            }
            exp_in_place(&mut row[..vis]);
            let sum = row[..vis].iter().fold(0f32, |s, &e| s + e);
            let inv = 1.0 / sum;
            for o in &mut row[..vis] {
                *o *= inv;
            }
        });
        Ok((out, input.shape.clone()))
    }

    fn backward(
        &self,
        _arg: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        let y = res.contiguous()?;
        Ok(Some(y.apply_op2_no_bwd(
            &g,
            &Fused2(SoftmaxBwd { scale: self.scale }),
        )?))
    }
}

/// `dx = scale * y * (g - sum(g * y))` row-wise, from the softmax output `y`
/// and the incoming gradient `g`.
struct SoftmaxBwd {
    scale: f32,
}

impl Kernel2 for SoftmaxBwd {
    const NAME: &'static str = "actguide-softmax-bwd";

    fn forward(&self, y: Input<'_>, g: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        if y.shape != g.shape {
            candle_core::bail!("softmax-bwd: shapes {:?} vs {:?}", y.shape, g.shape);
        }
        let shape = y.shape.clone();
        let (y, g) = (y.data, g.data);
        let s = *shape.dims().last().unwrap_or(&1);
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
        Ok((out, shape))
    }
}
