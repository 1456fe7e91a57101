//! Target log-prob and entropy straight from the logits, with their
//! backward, without an `(n, vocab)` log-softmax in the graph.

use std::sync::Arc;

use candle_core::{Shape, Tensor, D};

use super::expf::exp_in_place;
use super::{fused, par_rows_new, par_rows_work, Fused1, Fused2, Input, Kernel1, Kernel2};
use crate::model::error::{ModelError, Result};

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
    if fused(logits) {
        // The op's columns 2 and 3 (the row max and log-sum-exp) are for
        // its backward, which then needs no second exp pass over the row.
        return Ok(logits
            .contiguous()?
            .apply_op1(Fused1(LogpEntropy {
                targets: Arc::new(targets.to_vec()),
                scale: scale as f32,
            }))?
            .narrow(1, 0, 2)?);
    }
    logp_entropy_composite(logits, targets, scale)
}

pub(crate) fn logp_entropy_composite(
    logits: &Tensor,
    targets: &[u32],
    scale: f64,
) -> Result<Tensor> {
    let n = targets.len();
    // In f32 whatever the logits' dtype.
    let z = logits
        .to_dtype(candle_core::DType::F32)?
        .affine(scale, 0.0)?;
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
    let mut e: Vec<f32> = row.iter().map(|&v| v * scale - m).collect();
    exp_in_place(&mut e);
    let mut sum = 0f64;
    let mut wsum = 0f64;
    for (&v, &e) in row.iter().zip(&e) {
        let d = v * scale - m;
        let e = e as f64;
        sum += e;
        wsum += e * d as f64;
    }
    (m, sum.ln(), wsum / sum)
}

struct LogpEntropy {
    targets: Arc<Vec<u32>>,
    scale: f32,
}

impl Kernel1 for LogpEntropy {
    const NAME: &'static str = "actguide-logp-entropy";

    fn forward(&self, logits: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let x = logits.data;
        let (n, v) = logits.shape.dims2()?;
        let scale = self.scale;
        let targets = &self.targets[..];
        let mut out = vec![0f32; n * 4];
        par_rows_work(&mut out, 4, v, |r, o| {
            let row = &x[r * v..(r + 1) * v];
            let (m, lse, mean_d) = row_stats(row, scale);
            let dt = (row[targets[r] as usize] * scale - m) as f64;
            o[0] = (dt - lse) as f32;
            // H = -sum p (d - lse) = lse - sum p d
            o[1] = (lse - mean_d) as f32;
            // For the backward: exactly the values it would recompute.
            o[2] = m;
            o[3] = lse as f32;
        });
        Ok((out, Shape::from((n, 4))))
    }

    fn backward(
        &self,
        arg: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        // Pack [grad_logp, grad_entropy, entropy, max, lse] per row for
        // the kernel (the gradient of the stats columns is zero: only
        // columns 0 and 1 leave `logp_entropy`).
        let g = grad_res.narrow(1, 0, 2)?;
        let rest = res.narrow(1, 1, 3)?;
        let packed = Tensor::cat(&[&g, &rest], 1)?.contiguous()?;
        Ok(Some(arg.contiguous()?.apply_op2_no_bwd(
            &packed,
            &Fused2(LogpEntropyBwd {
                targets: self.targets.clone(),
                scale: self.scale,
            }),
        )?))
    }
}

/// `d logits = scale * (g_lp * (onehot - p) - g_h * p * (log p + H))`.
struct LogpEntropyBwd {
    targets: Arc<Vec<u32>>,
    scale: f32,
}

impl Kernel2 for LogpEntropyBwd {
    const NAME: &'static str = "actguide-logp-entropy-bwd";

    fn forward(&self, logits: Input<'_>, gp: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let (n, v) = logits.shape.dims2()?;
        if gp.shape.dims2()? != (n, 5) {
            candle_core::bail!(
                "logp-entropy-bwd: bad shapes {:?} {:?}",
                logits.shape,
                gp.shape
            );
        }
        let (x, gp) = (logits.data, gp.data);
        let scale = self.scale;
        let targets = &self.targets[..];
        let out = par_rows_new(n, v, |r, o| {
            let row = &x[r * v..(r + 1) * v];
            let st = &gp[r * 5..r * 5 + 5];
            let (g_lp, g_h, h, m, lse) = (st[0], st[1], st[2], st[3], st[4]);
            // o holds p until the gradient overwrites it.
            for (ov, &xv) in o.iter_mut().zip(row) {
                *ov = xv * scale - m - lse;
            }
            exp_in_place(o);
            for (ov, &xv) in o.iter_mut().zip(row) {
                let logp = xv * scale - m - lse;
                let p = *ov;
                *ov = scale * (-g_lp * p - g_h * p * (logp + h));
            }
            o[targets[r] as usize] += scale * g_lp;
        });
        Ok((out, Shape::from((n, v))))
    }
}
