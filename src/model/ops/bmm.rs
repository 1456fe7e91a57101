//! Batched matrix products for attention (`q kᵀ` and `softmax · v`) on the
//! run-time BLAS, forward and backward, reading strided views in place (the
//! KV cache is a narrowed view of a larger buffer: no copy per decode step).
//! Without a BLAS, or off the f32 CPU path, candle's matmul.

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::blas::{blas, Blas};
use super::{f32_data, fused};
use crate::model::error::Result;

/// `a (…, m, k) @ b (…, k, n)`, or `@ b (…, n, k)ᵀ` when `tb`; the leading
/// (batch) dimensions of both must agree.
pub(crate) fn bmm(a: &Tensor, b: &Tensor, tb: bool) -> Result<Tensor> {
    if let Some(blas) = blas() {
        let r = a.rank();
        let same_batch = r >= 3 && b.rank() == r && a.dims()[..r - 2] == b.dims()[..r - 2];
        if fused(a) && fused(b) && same_batch {
            let (a, b) = (a.contiguous_if_needed()?, b.contiguous_if_needed()?);
            return Ok(a.apply_op2(
                &b,
                Bmm {
                    blas,
                    ta: false,
                    tb,
                },
            )?);
        }
    }
    let b = if tb { b.t()? } else { b.clone() };
    Ok(a.matmul(&b)?)
}

/// A batch of row-major matrices in a storage slice: element `(i, r, c)` at
/// `start + i * bstride + r * ld + c`.
#[derive(Clone, Copy)]
struct Mat {
    start: usize,
    batch: usize,
    bstride: usize,
    rows: usize,
    cols: usize,
    ld: usize,
}

impl Mat {
    /// Rows must be unit-stride and the batch dimensions mergeable into one
    /// stride; anything else is `None`.
    fn view(l: &Layout) -> Option<Mat> {
        let (dims, strides) = (l.dims(), l.stride());
        let r = dims.len();
        if r < 2 || (strides[r - 1] != 1 && dims[r - 1] > 1) {
            return None;
        }
        let (rows, cols) = (dims[r - 2], dims[r - 1]);
        let ld = if rows > 1 { strides[r - 2] } else { cols };
        let batch: usize = dims[..r - 2].iter().product();
        // Innermost non-trivial batch stride; outer ones must nest it.
        let mut bstride = None;
        let mut expect = None;
        for i in (0..r - 2).rev() {
            if dims[i] == 1 {
                continue;
            }
            match expect {
                None => bstride = Some(strides[i]),
                Some(e) if e != strides[i] => return None,
                Some(_) => {}
            }
            expect = Some(strides[i] * dims[i]);
        }
        Some(Mat {
            start: l.start_offset(),
            batch,
            bstride: bstride.unwrap_or(rows * ld),
            rows,
            cols,
            ld,
        })
    }
}

struct Bmm {
    blas: &'static Blas,
    ta: bool,
    tb: bool,
}

impl Bmm {
    /// `op(A) op(B)` per batch entry of the views `la`, `lb` of `a`, `b`:
    /// a new `(batch dims of a, m, n)` result.
    fn run(
        &self,
        a: &[f32],
        la: &Layout,
        b: &[f32],
        lb: &Layout,
    ) -> candle_core::Result<(Vec<f32>, Shape)> {
        let (Some(am), Some(bm)) = (Mat::view(la), Mat::view(lb)) else {
            candle_core::bail!("actguide-bmm: unsupported strides")
        };
        let (m, k) = if self.ta {
            (am.cols, am.rows)
        } else {
            (am.rows, am.cols)
        };
        let (k2, n) = if self.tb {
            (bm.cols, bm.rows)
        } else {
            (bm.rows, bm.cols)
        };
        if k != k2 || am.batch != bm.batch {
            candle_core::bail!(
                "actguide-bmm: {}x{m}x{k} against {}x{k2}x{n}",
                am.batch,
                bm.batch
            );
        }
        let mut dims = la.dims()[..la.dims().len() - 2].to_vec();
        dims.extend([m, n]);
        let mut out = vec![0f32; am.batch * m * n];
        if m * n == 0 {
            return Ok((out, Shape::from(dims)));
        }
        let blas = self.blas;
        let (ta, tb) = (self.ta, self.tb);
        out.par_chunks_mut(m * n).enumerate().for_each(|(i, c)| {
            let a = &a[am.start + i * am.bstride..];
            let b = &b[bm.start + i * bm.bstride..];
            blas.gemm_serial((ta, tb), (m, n, k), (a, am.ld), (b, bm.ld), (c, n), 0.0);
        });
        Ok((out, Shape::from(dims)))
    }

    /// The product of two tensors (views read in place) as a new tensor.
    fn tensors(&self, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        let (a, b) = (a.contiguous_if_needed()?, b.contiguous_if_needed()?);
        let (sa, la) = a.storage_and_layout();
        let (sb, lb) = b.storage_and_layout();
        let (Storage::Cpu(CpuStorage::F32(va)), Storage::Cpu(CpuStorage::F32(vb))) = (&*sa, &*sb)
        else {
            candle_core::bail!("actguide-bmm: f32 CPU tensors only")
        };
        let (out, shape) = self.run(va, la, vb, lb)?;
        Tensor::from_vec(out, shape, &Device::Cpu)
    }
}

/// A view [`Mat`] can read, else a contiguous copy.
trait ContiguousIfNeeded {
    fn contiguous_if_needed(&self) -> candle_core::Result<Tensor>;
}

impl ContiguousIfNeeded for Tensor {
    fn contiguous_if_needed(&self) -> candle_core::Result<Tensor> {
        if Mat::view(self.layout()).is_some() {
            Ok(self.clone())
        } else {
            self.contiguous()
        }
    }
}

impl CustomOp2 for Bmm {
    fn name(&self) -> &'static str {
        "actguide-bmm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        // Strided views are read in place (see `Mat`), so only the dtype
        // is checked here.
        let (a, b) = (f32_data(s1, self.name())?, f32_data(s2, self.name())?);
        let (out, shape) = self.run(a, l1, b, l2)?;
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dc: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // Forward is C = A op(B) (ta = false); the gradients:
        //   C = A B:  dA = dC Bᵀ, dB = Aᵀ dC;
        //   C = A Bᵀ: dA = dC B,  dB = dCᵀ A.
        let op = |ta, tb| Bmm {
            blas: self.blas,
            ta,
            tb,
        };
        let da = if a.track_op() {
            Some(op(false, !self.tb).tensors(dc, b)?)
        } else {
            None
        };
        let db = if b.track_op() {
            Some(if self.tb {
                op(true, false).tensors(dc, a)?
            } else {
                op(true, false).tensors(a, dc)?
            })
        } else {
            None
        };
        Ok((da, db))
    }
}
