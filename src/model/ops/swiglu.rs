//! SwiGLU on the fused `[gate | up]` projection, with its backward.

use candle_core::{Shape, Tensor, D};

use super::expf::exp_in_place;
use super::{fused, par_rows_new, Fused1, Fused2, Input, Kernel1, Kernel2};
use crate::model::error::Result;

/// `silu(gu[:, :i]) * gu[:, i:]` for the fused `[gate | up]` projection
/// `gu` `(rows, 2 * i)`; differentiable.
pub(crate) fn swiglu(gu: &Tensor) -> Result<Tensor> {
    if fused(gu) {
        return Ok(gu.contiguous()?.apply_op1(Fused1(SwiGlu))?);
    }
    swiglu_composite(gu)
}

pub(crate) fn swiglu_composite(gu: &Tensor) -> Result<Tensor> {
    let i = gu.dim(D::Minus1)? / 2;
    Ok((gu.narrow(D::Minus1, 0, i)?.silu()? * gu.narrow(D::Minus1, i, i)?)?)
}

struct SwiGlu;

impl Kernel1 for SwiGlu {
    const NAME: &'static str = "actguide-swiglu";

    fn forward(&self, input: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let x = input.data;
        let mut dims = input.shape.dims().to_vec();
        let two_i = *dims.last().unwrap_or(&0);
        if !two_i.is_multiple_of(2) {
            candle_core::bail!("swiglu: odd last dim {two_i}");
        }
        let i = two_i / 2;
        let out = par_rows_new(x.len() / two_i.max(1), i, |r, row| {
            let (g, u) = x[r * two_i..(r + 1) * two_i].split_at(i);
            for (o, &gv) in row.iter_mut().zip(g) {
                *o = -gv;
            }
            exp_in_place(row);
            for ((o, &gv), &uv) in row.iter_mut().zip(g).zip(u) {
                *o = gv / (1.0 + *o) * uv;
            }
        });
        if let Some(last) = dims.last_mut() {
            *last = i;
        }
        Ok((out, Shape::from(dims)))
    }

    fn backward(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        Ok(Some(
            arg.contiguous()?.apply_op2_no_bwd(&g, &Fused2(SwiGluBwd))?,
        ))
    }
}

/// `(gu, grad_out)` → `d gu`: `[go * u * silu'(g) | go * silu(g)]`.
struct SwiGluBwd;

impl Kernel2 for SwiGluBwd {
    const NAME: &'static str = "actguide-swiglu-bwd";

    fn forward(&self, gu: Input<'_>, go: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let (x, shape) = (gu.data, gu.shape);
        let two_i = *shape.dims().last().unwrap_or(&0);
        let i = two_i / 2;
        if go.data.len() * 2 != x.len() {
            candle_core::bail!("swiglu-bwd: shapes {:?} vs {:?}", shape, go.shape);
        }
        let go = go.data;
        let out = par_rows_new(x.len() / two_i.max(1), two_i, |r, row| {
            let (g, u) = x[r * two_i..(r + 1) * two_i].split_at(i);
            let gor = &go[r * i..(r + 1) * i];
            let (dg, du) = row.split_at_mut(i);
            // dg holds exp(−g) until its own gradient overwrites it.
            for (e, &gv) in dg.iter_mut().zip(g) {
                *e = -gv;
            }
            exp_in_place(dg);
            for j in 0..i {
                let sig = 1.0 / (1.0 + dg[j]);
                let silu = g[j] * sig;
                dg[j] = gor[j] * u[j] * sig * (1.0 + g[j] * (1.0 - sig));
                du[j] = gor[j] * silu;
            }
        });
        Ok((out, shape.clone()))
    }
}
