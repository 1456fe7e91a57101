//! Rotary embeddings in the HF rotate-half layout, fused with the
//! transpose to heads-first, and the rotary tables.

use std::sync::Arc;

use candle_core::{Device, Shape, Tensor, D};

use super::{fused, par_rows_new, Fused1, Input, Kernel1};
use crate::model::error::{ModelError, Result};

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
    if fused(x) {
        return Ok(x.contiguous()?.apply_op1(Fused1(Rope {
            tables: tables.clone(),
            inverse: false,
        }))?);
    }
    rope_heads_first_composite(x, tables)
}

pub(crate) fn rope_heads_first_composite(x: &Tensor, tables: &RopeTables) -> Result<Tensor> {
    let (cos, sin) = tables.full(x.device())?;
    let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
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

impl Kernel1 for Rope {
    const NAME: &'static str = "actguide-rope";

    fn forward(&self, input: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let x = input.data;
        let (d0, d1, d2, d) = input.shape.dims4()?;
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
        let out = par_rows_new(x.len() / d.max(1), d, |r, row| {
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
        Ok((out, Shape::from(shape)))
    }

    fn backward(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad_res.contiguous()?;
        Ok(Some(g.apply_op1(Fused1(Rope {
            tables: self.tables.clone(),
            inverse: !self.inverse,
        }))?))
    }
}
