//! A LoRA-adapted projection as one op: `y = x Wᵀ + s (x Aᵀ) Bᵀ` for a
//! frozen base `W`, forward and backward on the BLAS.
//!
//! Composed from candle ops, the update costs more than its rank suggests:
//! it allocates `(x Aᵀ) Bᵀ`, scales it, adds it to the base product (and,
//! for the fused gate/up projection, concatenates two of them), and the
//! backward repeats each pass and sums `x`'s gradient from two branches.
//! Each of those is a full pass over a `(rows, out)` or `(rows, in)`
//! matrix, about as many bytes as the base product's output, on a step
//! whose products are compute-bound. Here the update is added into the
//! base product by the BLAS itself (`beta = 1`), and `x`'s gradient is
//! summed the same way.
//!
//! Several projections of the same input whose outputs sit side by side
//! (gate and up, which SwiGLU reads as one matrix) are `g` groups: their
//! bases are multiplied into column blocks of one output (no concatenated
//! weight), `A` stacks their `A`s by rows `(g r, in)`, `B` their `B`s
//! `(out, r)`, and group `i` adds to output columns `i out/g ..`.

use std::sync::Mutex;

use candle_core::{Device, Shape, Tensor};

use super::blas::{blas, rust_gemm_for, wide_rust_gemm, Blas};
use super::linear::with_f32;
use super::{fused, Fused3, Input, Kernel3};
use crate::model::error::Result;

/// Whether [`lora_linear`] runs training-sized products here: a BLAS is
/// loaded and does them (on CPUs where candle's gemm takes wide products,
/// see [`rust_gemm_for`], the update stays composed).
pub fn fused_lora_available() -> bool {
    blas().is_some() && !wide_rust_gemm()
}

/// `x (rows, in) [W₀ … W_g-1]ᵀ + scale [(x A₀ᵀ) B₀ᵀ … ]`: the frozen
/// bases `ws` (each `(out/g, in)`, outputs side by side) with their
/// adapters stacked, `a (g r, in)` and `b (out, r)`; differentiable in `x`,
/// `a` and `b`. `None` where the fused product does not apply (not f32 CPU
/// matrices, no BLAS, or a product candle's gemm runs faster, see
/// [`rust_gemm_for`]); the caller then composes it from candle ops.
pub(crate) fn lora_linear(
    x: &Tensor,
    ws: &[Tensor],
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> Result<Option<Tensor>> {
    let Some(blas) = blas() else { return Ok(None) };
    let g = ws.len();
    if g == 0 || !(fused(x) && fused(a) && fused(b) && ws.iter().all(fused)) {
        return Ok(None);
    }
    if x.rank() != 2 || a.rank() != 2 || b.rank() != 2 || ws.iter().any(|w| w.rank() != 2) {
        return Ok(None);
    }
    let ((m, k), (gr, k2), (n, r)) = (x.dims2()?, a.dims2()?, b.dims2()?);
    let shapes_fit =
        ws.iter().all(|w| w.dims() == [n / g, k]) && k == k2 && n % g == 0 && gr == g * r;
    if !shapes_fit || rust_gemm_for(m) {
        return Ok(None);
    }
    #[cfg(test)]
    LORA_PRODUCTS.with(|c| c.set(c.get() + 1));
    let op = LoraLinear {
        blas,
        ws: ws
            .iter()
            .map(|w| w.contiguous())
            .collect::<candle_core::Result<_>>()?,
        scale: scale as f32,
        saved: Mutex::new(None),
    };
    Ok(Some(x.contiguous()?.apply_op3(
        &a.contiguous()?,
        &b.contiguous()?,
        Fused3(op),
    )?))
}

#[cfg(test)]
thread_local! {
    /// Fused LoRA products this thread ran.
    pub(crate) static LORA_PRODUCTS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

#[cfg(test)]
/// Whether a BLAS is loaded (so [`lora_linear`] can apply).
pub(crate) fn blas_loaded() -> bool {
    blas().is_some()
}

struct LoraLinear {
    blas: &'static Blas,
    /// The frozen bases, each `(out/g, in)`, contiguous.
    ws: Vec<Tensor>,
    scale: f32,
    /// `scale · x Aᵀ` from the forward, for the backward's `B` gradient.
    saved: Mutex<Option<Vec<f32>>>,
}

impl LoraLinear {
    /// `scale · x Aᵀ`, `(rows, g r)`.
    fn xs(&self, (m, k, gr): (usize, usize, usize), x: &[f32], a: &[f32]) -> Vec<f32> {
        let mut xs = self.blas.gemm(false, true, m, gr, k, x, a);
        xs.iter_mut().for_each(|v| *v *= self.scale);
        xs
    }
}

impl Kernel3 for LoraLinear {
    const NAME: &'static str = "actguide-lora-linear";

    fn forward(
        &self,
        x: Input<'_>,
        a: Input<'_>,
        b: Input<'_>,
    ) -> candle_core::Result<(Vec<f32>, Shape)> {
        let ((m, k), (gr, _), (n, r)) = (x.shape.dims2()?, a.shape.dims2()?, b.shape.dims2()?);
        let (g, nb) = (self.ws.len(), n / self.ws.len());
        let xs = self.xs((m, k, gr), x.data, a.data);
        let mut y = match self.ws.as_slice() {
            [w] => with_f32(w, |w| self.blas.gemm(false, true, m, n, k, x.data, w))?,
            _ => vec![0f32; m * n],
        };
        for (i, w) in self.ws.iter().enumerate() {
            if g > 1 {
                // y[:, i nb ..] = x W_iᵀ
                with_f32(w, |w| {
                    self.blas.gemm_into(
                        (false, true),
                        (m, nb, k),
                        (x.data, k),
                        (w, k),
                        (&mut y[i * nb..], n),
                        0.0,
                    )
                })?;
            }
            // y[:, i nb ..] += xs[:, i r ..] B_iᵀ
            self.blas.gemm_into(
                (false, true),
                (m, nb, r),
                (&xs[i * r..], gr),
                (&b.data[i * nb * r..], r),
                (&mut y[i * nb..], n),
                1.0,
            );
        }
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(xs);
        Ok((y, Shape::from((m, n))))
    }

    fn backward(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let ((m, k), (gr, _), (n, r)) = (x.dims2()?, a.dims2()?, b.dims2()?);
        let (g, nb) = (self.ws.len(), n / self.ws.len());
        let dy = dy.contiguous()?;
        let saved = self.saved.lock().unwrap_or_else(|e| e.into_inner()).take();
        let xs = match saved {
            Some(xs) => xs,
            None => with_f32(x, |xv| with_f32(a, |av| self.xs((m, k, gr), xv, av)))??,
        };
        with_f32(&dy, |dy| {
            // d(xs) = dy_i B_i per group, then dA and dx through xs = s x Aᵀ.
            let mut dxa = vec![0f32; m * gr];
            let mut db = vec![0f32; n * r];
            with_f32(b, |bv| {
                for i in 0..g {
                    self.blas.gemm_into(
                        (false, false),
                        (m, r, nb),
                        (&dy[i * nb..], n),
                        (&bv[i * nb * r..], r),
                        (&mut dxa[i * r..], gr),
                        0.0,
                    );
                    // dB_i = dy_iᵀ xs_i
                    self.blas.gemm_into(
                        (true, false),
                        (nb, r, m),
                        (&dy[i * nb..], n),
                        (&xs[i * r..], gr),
                        (&mut db[i * nb * r..], r),
                        0.0,
                    );
                }
            })?;
            dxa.iter_mut().for_each(|v| *v *= self.scale);
            let da = with_f32(x, |xv| self.blas.gemm(true, false, gr, k, m, &dxa, xv))?;
            let dx = if x.track_op() {
                // dx = Σᵢ dy_i W_i + dxa A
                let mut dx = match self.ws.as_slice() {
                    [w] => with_f32(w, |w| self.blas.gemm(false, false, m, k, n, dy, w))?,
                    _ => vec![0f32; m * k],
                };
                for (i, w) in self.ws.iter().enumerate().filter(|_| g > 1) {
                    with_f32(w, |w| {
                        self.blas.gemm_into(
                            (false, false),
                            (m, k, nb),
                            (&dy[i * nb..], n),
                            (w, k),
                            (&mut dx, k),
                            if i == 0 { 0.0 } else { 1.0 },
                        )
                    })?;
                }
                with_f32(a, |av| {
                    self.blas.gemm_into(
                        (false, false),
                        (m, k, gr),
                        (&dxa, gr),
                        (av, k),
                        (&mut dx, k),
                        1.0,
                    )
                })?;
                Some(Tensor::from_vec(dx, (m, k), &Device::Cpu)?)
            } else {
                None
            };
            let da = Tensor::from_vec(da, (gr, k), &Device::Cpu)?;
            let db = Tensor::from_vec(db, (n, r), &Device::Cpu)?;
            Ok((dx, a.track_op().then_some(da), b.track_op().then_some(db)))
        })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Var};

    fn rand(shape: (usize, usize), seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The same update composed from candle ops (the path without BLAS).
    fn composed(x: &Tensor, ws: &[Tensor], a: &Tensor, b: &Tensor, s: f64) -> Tensor {
        let g = ws.len();
        let w = Tensor::cat(ws, 0).unwrap();
        let (gr, n) = (a.dim(0).unwrap(), w.dim(0).unwrap());
        let (r, nb) = (gr / g, n / g);
        let y = x.matmul(&w.t().unwrap()).unwrap();
        let d: Vec<Tensor> = (0..g)
            .map(|i| {
                let ai = a.narrow(0, i * r, r).unwrap();
                let bi = b.narrow(0, i * nb, nb).unwrap();
                (x.matmul(&ai.t().unwrap())
                    .unwrap()
                    .matmul(&bi.t().unwrap())
                    .unwrap()
                    * s)
                    .unwrap()
            })
            .collect();
        (y + Tensor::cat(&d, 1).unwrap()).unwrap()
    }

    fn max_diff(p: &Tensor, q: &Tensor) -> f32 {
        (p - q)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Forward and all three gradients match the composed update, for one
    /// adapter and for two stacked ones (gate/up), at sizes that split
    /// over threads.
    #[test]
    fn matches_the_composed_update_forward_and_backward() {
        if blas().is_none() {
            println!("SKIPPED: no BLAS found (scripts/install-mkl.sh, or ACTGUIDE_BLAS)");
            return;
        }
        for (g, m, k, n, r) in [(1, 70, 48, 40, 4), (2, 300, 96, 256, 8), (1, 5, 16, 8, 2)] {
            let ws: Vec<Tensor> = (0..g).map(|i| rand((n / g, k), 10 + i as u64)).collect();
            let x = Var::from_tensor(&rand((m, k), 2)).unwrap();
            let a = Var::from_tensor(&rand((g * r, k), 3)).unwrap();
            let b = Var::from_tensor(&rand((n, r), 4)).unwrap();
            let up = rand((m, n), 5);
            let fused = lora_linear(&x, &ws, &a, &b, 0.7).unwrap().expect("applies");
            let plain = composed(&x, &ws, &a, &b, 0.7);
            assert!(max_diff(&fused, &plain) < 1e-4, "forward g={g} m={m}");
            let gf = (fused * &up)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let gp = (plain * &up)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            for (name, v) in [("x", &x), ("a", &a), ("b", &b)] {
                let (f, p) = (gf.get(v).unwrap(), gp.get(v).unwrap());
                let scale = p.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
                let tol = 1e-5 * (1.0 + scale.to_scalar::<f32>().unwrap());
                assert!(
                    max_diff(f, p) < tol,
                    "d{name} g={g} m={m}: {}",
                    max_diff(f, p)
                );
            }
        }
    }

    /// An untracked input gets no gradient (the first layer's rows under
    /// LoRA come from the frozen embedding), and the others still do.
    #[test]
    fn an_untracked_input_gets_no_gradient() {
        if blas().is_none() {
            println!("SKIPPED: no BLAS found (scripts/install-mkl.sh, or ACTGUIDE_BLAS)");
            return;
        }
        let (w, x) = (rand((32, 16), 1), rand((20, 16), 2));
        let a = Var::from_tensor(&rand((4, 16), 3)).unwrap();
        let b = Var::from_tensor(&rand((32, 4), 4)).unwrap();
        let y = lora_linear(&x, &[w], &a, &b, 2.0).unwrap().unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        assert!(g.get(&x).is_none());
        assert!(g.get(&a).is_some() && g.get(&b).is_some());
        assert_eq!(y.dtype(), DType::F32);
    }
}
