//! AdamW with checkpointable state. candle-nn's `AdamW` keeps its moments
//! private, so a run could not be resumed exactly with it; this one exposes
//! them for checkpoints. Weight decay is decoupled and applied to matrices
//! only (not to norm gains), as is usual for transformers.
//!
//! On CPU with f32 tensors the update is one fused pass per parameter that
//! rewrites the weight and both moments in place (candle in-place custom
//! ops, spread over candle's own CPU thread pool). Elsewhere (CUDA, other
//! dtypes, odd layouts) it falls back to plain tensor ops with the same
//! maths.

use std::cell::Cell;
use std::collections::HashMap;

use candle_core::{
    bail, CpuStorage, DType, InplaceOp1, InplaceOp2, Layout, Result, Storage, Tensor, Var,
};

/// Hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamWParams {
    /// Adam's usual betas and eps (0.9, 0.999, 1e-8) without weight decay:
    /// what benchmarks and checks that just need a working optimiser use.
    pub fn without_decay() -> Self {
        AdamWParams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// AdamW over named variables.
///
/// Invariant relied on by the in-place update: every `m[i]` and `v[i]` owns
/// its own storage, shared with no other moment, weight or outside tensor
/// except the clones handed out by [`AdamW::state_tensors`].
pub struct AdamW {
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Number of updates applied.
    pub t: u64,
    pub params: AdamWParams,
}

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        // Two separate allocations: the moments are updated in place, so `v`
        // must not be a clone (shared storage) of `m`.
        let zeros = || {
            vars.iter()
                .map(|(_, v)| v.as_tensor().zeros_like())
                .collect::<Result<Vec<_>>>()
        };
        let m = zeros()?;
        let v = zeros()?;
        Ok(AdamW {
            vars,
            m,
            v,
            t: 0,
            params,
        })
    }

    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// The gradients of `vars()` in `grads` (the result of `backward()`),
    /// aligned for [`AdamW::step`].
    pub fn grads_from(&self, grads: &candle_core::backprop::GradStore) -> Vec<Option<Tensor>> {
        self.vars
            .iter()
            .map(|(_, v)| grads.get(v.as_tensor()).cloned())
            .collect()
    }

    /// One update with gradients aligned to `vars()` (None = no gradient).
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64) -> Result<()> {
        let r = self.step_impl(grads, lr, true);
        // The Vars changed in place (even a failed step may have moved some):
        // derived copies (bf16 rollout weights) are stale.
        crate::model::note_weights_changed();
        r
    }

    /// `fused = false` forces the tensor-op path (used by tests).
    fn step_impl(&mut self, grads: &[Option<Tensor>], lr: f64, fused: bool) -> Result<()> {
        self.t += 1;
        let p = self.params;
        let bc1 = 1.0 - p.beta1.powi(self.t as i32);
        let bc2 = 1.0 - p.beta2.powi(self.t as i32);
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = &grads[i] else { continue };
            let w = var.as_tensor();
            let decay = p.weight_decay > 0.0 && w.rank() >= 2;
            if fused && w.device().is_cpu() {
                let g = g.contiguous()?;
                if fused_eligible(w, &self.m[i], &self.v[i], &g) {
                    let k = Coeffs::new(&p, bc1, bc2, lr, decay);
                    self.m[i].inplace_op1(&FusedOnM {
                        v: &self.v[i],
                        w,
                        g: &g,
                        k,
                    })?;
                    continue;
                }
            }
            // Tensor-op fallback (CUDA, non-f32, aliasing): new tensors.
            let m = ((&self.m[i] * p.beta1)? + (g * (1.0 - p.beta1))?)?;
            let v = ((&self.v[i] * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + p.eps)?)?;
            let mut new = (w - (update * lr)?)?;
            if decay {
                new = (new - (w * (lr * p.weight_decay))?)?;
            }
            var.set(&new)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(())
    }

    /// Moments by name (`m.<param>`, `v.<param>`) for a checkpoint.
    ///
    /// The tensors are cheap clones that SHARE storage with the optimiser's
    /// moments, which `step` updates in place: they are a snapshot only until
    /// the next `step`. Serialise them before stepping again (the experiment
    /// runner does: `checkpoint::save` writes them synchronously right after
    /// calling this), or `.copy()` them to keep a lasting snapshot.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            out.insert(format!("m.{name}"), self.m[i].clone());
            out.insert(format!("v.{name}"), self.v[i].clone());
        }
        out
    }

    /// Restore moments saved by `state_tensors`. The moments become fresh
    /// contiguous copies, so later in-place updates never write into the
    /// caller's tensors.
    pub fn load_state(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        t: u64,
    ) -> std::result::Result<(), OptimStateError> {
        for (i, (name, var)) in self.vars.iter().enumerate() {
            for (slot, key) in [(0, format!("m.{name}")), (1, format!("v.{name}"))] {
                let x = tensors
                    .get(&key)
                    .ok_or_else(|| OptimStateError::Missing(key.clone()))?;
                if x.dims() != var.dims() {
                    return Err(OptimStateError::Shape {
                        key,
                        got: x.dims().to_vec(),
                        want: var.dims().to_vec(),
                    });
                }
                let x = x
                    .to_device(var.device())
                    .and_then(|x| x.force_contiguous())?;
                if slot == 0 {
                    self.m[i] = x;
                } else {
                    self.v[i] = x;
                }
            }
        }
        self.t = t;
        Ok(())
    }
}

/// Saved optimizer moments that do not fit the parameters they are loaded
/// for.
#[derive(Debug, thiserror::Error)]
pub enum OptimStateError {
    #[error("optimizer state lacks `{0}`")]
    Missing(String),
    #[error("optimizer state `{key}` has shape {got:?}, expected {want:?}")]
    Shape {
        key: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("{0}")]
    Tensor(#[from] candle_core::Error),
}

/// Whether the fused CPU kernel applies: all f32 on CPU, contiguous, same
/// element count, non-empty, and four distinct buffers (the nested in-place
/// ops lock each storage for writing; a shared one would deadlock).
fn fused_eligible(w: &Tensor, m: &Tensor, v: &Tensor, g: &Tensor) -> bool {
    let ts = [w, m, v, g];
    let n = w.elem_count();
    if n == 0
        || ts.iter().any(|t| {
            t.dtype() != DType::F32
                || !t.device().is_cpu()
                || !t.is_contiguous()
                || t.elem_count() != n
        })
    {
        return false;
    }
    let mut ptrs = [0usize; 4];
    for (p, t) in ptrs.iter_mut().zip(ts) {
        let (s, _) = t.storage_and_layout();
        match &*s {
            Storage::Cpu(CpuStorage::F32(d)) => *p = d.as_ptr() as usize,
            _ => return false,
        }
    }
    (0..4).all(|a| (a + 1..4).all(|b| ptrs[a] != ptrs[b]))
}

/// Per-step scalars, cast to f32 the way candle's `affine` casts them, so the
/// fused kernel reproduces the tensor-op path.
#[derive(Debug, Clone, Copy)]
struct Coeffs {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    inv_bc1: f32,
    inv_bc2: f32,
    eps: f32,
    lr: f32,
    /// `lr · weight_decay`, applied only when `decay`.
    lr_wd: f32,
    decay: bool,
}

impl Coeffs {
    fn new(p: &AdamWParams, bc1: f64, bc2: f64, lr: f64, decay: bool) -> Self {
        Coeffs {
            beta1: p.beta1 as f32,
            one_minus_beta1: (1.0 - p.beta1) as f32,
            beta2: p.beta2 as f32,
            one_minus_beta2: (1.0 - p.beta2) as f32,
            inv_bc1: (1.0 / bc1) as f32,
            inv_bc2: (1.0 / bc2) as f32,
            eps: p.eps as f32,
            lr: lr as f32,
            lr_wd: (lr * p.weight_decay) as f32,
            decay,
        }
    }
}

/// The element-wise update, operation for operation as the tensor path.
#[inline(always)]
fn adamw_kernel(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], k: &Coeffs) {
    let n = w.len();
    let (m, v, g) = (&mut m[..n], &mut v[..n], &g[..n]);
    for j in 0..n {
        let gj = g[j];
        let mj = m[j] * k.beta1 + gj * k.one_minus_beta1;
        let vj = v[j] * k.beta2 + (gj * gj) * k.one_minus_beta2;
        m[j] = mj;
        v[j] = vj;
        let update = (mj * k.inv_bc1) / ((vj * k.inv_bc2).sqrt() + k.eps);
        let wj = w[j];
        let mut new = wj - update * k.lr;
        if k.decay {
            new -= wj * k.lr_wd;
        }
        w[j] = new;
    }
}

/// Raw pointer that may cross to the pool's threads; each thread touches a
/// disjoint range only.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}
impl<T> SyncPtr<T> {
    // A method (not field access) so closures capture the whole wrapper.
    fn get(self) -> *mut T {
        self.0
    }
}

/// Below this many elements the update runs on the calling thread.
const PARALLEL_MIN: usize = 1 << 15;

fn adamw_parallel(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], k: &Coeffs) {
    let n = w.len();
    assert!(m.len() == n && v.len() == n && g.len() == n);
    let pool = candle_core::utils::barrier_pool();
    if n < PARALLEL_MIN || pool.n_workers() == 0 {
        adamw_kernel(w, m, v, g, k);
        return;
    }
    let (wp, mp, vp) = (
        SyncPtr(w.as_mut_ptr()),
        SyncPtr(m.as_mut_ptr()),
        SyncPtr(v.as_mut_ptr()),
    );
    let gp = SyncPtr(g.as_ptr() as *mut f32);
    pool.execute_chunked(n, |r| {
        let len = r.end - r.start;
        // SAFETY: the four buffers hold `n` elements each and do not overlap
        // (checked by `fused_eligible`, and the `&mut` borrows above are not
        // used while the pool runs); `execute_chunked` hands out disjoint
        // sub-ranges of 0..n, so no element is touched by two threads.
        unsafe {
            adamw_kernel(
                std::slice::from_raw_parts_mut(wp.get().add(r.start), len),
                std::slice::from_raw_parts_mut(mp.get().add(r.start), len),
                std::slice::from_raw_parts_mut(vp.get().add(r.start), len),
                std::slice::from_raw_parts(gp.get().add(r.start) as *const f32, len),
                k,
            )
        }
    });
}

fn f32_slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("adamw: in-place operand is not contiguous")
    };
    match s {
        CpuStorage::F32(d) => Ok(&mut d[start..end]),
        _ => bail!("adamw: in-place operand is not f32"),
    }
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("adamw: gradient is not contiguous")
    };
    match s {
        CpuStorage::F32(d) => Ok(&d[start..end]),
        _ => bail!("adamw: gradient is not f32"),
    }
}

// candle's in-place ops give mutable access to one tensor each, and the
// update rewrites three (m, v, w). So the op on `m` runs the op on `v` from
// inside its `cpu_fwd`, which runs the op on `w` (reading `g`) from inside
// its own; the innermost one holds all three buffers and makes one pass.

/// Stage 1: applied to `m`.
struct FusedOnM<'a> {
    v: &'a Tensor,
    w: &'a Tensor,
    g: &'a Tensor,
    k: Coeffs,
}

impl InplaceOp1 for FusedOnM<'_> {
    fn name(&self) -> &'static str {
        "adamw-fused-m"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let m = f32_slice_mut(s, l)?;
        self.v.inplace_op1(&FusedOnV {
            m: Cell::new(Some(m)),
            w: self.w,
            g: self.g,
            k: self.k,
        })
    }
}

/// Stage 2: applied to `v`, holding `m`.
struct FusedOnV<'a, 'b> {
    m: Cell<Option<&'b mut [f32]>>,
    w: &'a Tensor,
    g: &'a Tensor,
    k: Coeffs,
}

impl InplaceOp1 for FusedOnV<'_, '_> {
    fn name(&self) -> &'static str {
        "adamw-fused-v"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let v = f32_slice_mut(s, l)?;
        let Some(m) = self.m.take() else {
            bail!("adamw: fused op ran twice")
        };
        self.w.inplace_op2(
            self.g,
            &FusedOnW {
                m: Cell::new(Some(m)),
                v: Cell::new(Some(v)),
                k: self.k,
            },
        )
    }
}

/// Stage 3: applied to the weight with the gradient as source, holding
/// `m` and `v`.
struct FusedOnW<'b> {
    m: Cell<Option<&'b mut [f32]>>,
    v: Cell<Option<&'b mut [f32]>>,
    k: Coeffs,
}

impl InplaceOp2 for FusedOnW<'_> {
    fn name(&self) -> &'static str {
        "adamw-fused-w"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let w = f32_slice_mut(s1, l1)?;
        let g = f32_slice(s2, l2)?;
        let (Some(m), Some(v)) = (self.m.take(), self.v.take()) else {
            bail!("adamw: fused op ran twice")
        };
        let n = w.len();
        if g.len() != n || m.len() != n || v.len() != n {
            bail!(
                "adamw: length mismatch (w {n}, g {}, m {}, v {})",
                g.len(),
                m.len(),
                v.len()
            )
        }
        adamw_parallel(w, m, v, g, &self.k);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adamw_minimises_a_quadratic_and_matches_closed_form_first_step() {
        let x = Var::new(&[3.0f32, -2.0], &Device::Cpu).unwrap();
        let mut opt =
            AdamW::new(vec![("x".into(), x.clone())], AdamWParams::without_decay()).unwrap();
        // First Adam step moves each coordinate by lr·sign(g).
        let g = (x.as_tensor() * 2.0).unwrap();
        opt.step(&[Some(g)], 0.1).unwrap();
        let v = x.as_tensor().to_vec1::<f32>().unwrap();
        assert!(
            (v[0] - 2.9).abs() < 1e-5 && (v[1] + 1.9).abs() < 1e-5,
            "{v:?}"
        );
        for _ in 0..300 {
            let g = (x.as_tensor() * 2.0).unwrap();
            opt.step(&[Some(g)], 0.05).unwrap();
        }
        let v = x.as_tensor().to_vec1::<f32>().unwrap();
        assert!(v[0].abs() < 0.05 && v[1].abs() < 0.05, "{v:?}");
    }

    /// The original allocate-everything implementation, kept verbatim as the
    /// reference for the fused in-place one.
    struct Reference {
        vars: Vec<Var>,
        m: Vec<Tensor>,
        v: Vec<Tensor>,
        t: u64,
        params: AdamWParams,
    }

    impl Reference {
        fn new(vars: Vec<Var>, params: AdamWParams) -> Self {
            let m = vars
                .iter()
                .map(|v| v.as_tensor().zeros_like().unwrap())
                .collect::<Vec<_>>();
            let v = m.clone();
            Reference {
                vars,
                m,
                v,
                t: 0,
                params,
            }
        }

        fn step(&mut self, grads: &[Option<Tensor>], lr: f64) -> Result<()> {
            self.t += 1;
            let p = self.params;
            let bc1 = 1.0 - p.beta1.powi(self.t as i32);
            let bc2 = 1.0 - p.beta2.powi(self.t as i32);
            for (i, var) in self.vars.iter().enumerate() {
                let Some(g) = &grads[i] else { continue };
                let m = ((&self.m[i] * p.beta1)? + (g * (1.0 - p.beta1))?)?;
                let v = ((&self.v[i] * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
                let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + p.eps)?)?;
                let w = var.as_tensor();
                let mut new = (w - (update * lr)?)?;
                if p.weight_decay > 0.0 && w.rank() >= 2 {
                    new = (new - (w * (lr * p.weight_decay))?)?;
                }
                var.set(&new)?;
                self.m[i] = m;
                self.v[i] = v;
            }
            Ok(())
        }
    }

    fn flat(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Largest |a - b| / (|b| + 1e-30) over the elements.
    fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (flat(a), flat(b));
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(&b)
            .map(|(&x, &y)| ((x - y).abs() as f64) / ((y.abs() as f64) + 1e-30))
            .fold(0.0, f64::max)
    }

    /// Shapes exercising matrices (decayed), vectors (not decayed), rank 3,
    /// and one large enough for the multi-threaded path.
    const SHAPES: &[&[usize]] = &[&[16, 40], &[40], &[8, 3, 5], &[300, 256], &[7]];

    /// Runs the new optimiser (fused or forced tensor path) and the reference
    /// side by side; returns the worst relative difference over w, m and v.
    fn compare_with_reference(weight_decay: f64, fused: bool) -> f64 {
        let dev = Device::Cpu;
        let params = AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay,
        };
        let init: Vec<Tensor> = SHAPES
            .iter()
            .map(|s| Tensor::randn(0f32, 1f32, *s, &dev).unwrap())
            .collect();
        let new_vars: Vec<(String, Var)> = init
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("p{i}"), Var::from_tensor(t).unwrap()))
            .collect();
        let ref_vars: Vec<Var> = init.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let mut opt = AdamW::new(new_vars.clone(), params).unwrap();
        let mut reference = Reference::new(ref_vars.clone(), params);
        let mut worst = 0.0f64;
        for step in 0..6 {
            let grads: Vec<Option<Tensor>> = SHAPES
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    // Parameter 4 never gets a gradient; parameter 2 skips
                    // odd steps; parameter 0 gets a non-contiguous gradient.
                    if i == 4 || (i == 2 && step % 2 == 1) {
                        return None;
                    }
                    let scale = 10f32.powi(i as i32 - 3);
                    if i == 0 {
                        let t = Tensor::randn(0f32, scale, (s[1], s[0]), &dev).unwrap();
                        let t = t.t().unwrap();
                        assert!(!t.is_contiguous());
                        Some(t)
                    } else {
                        Some(Tensor::randn(0f32, scale, *s, &dev).unwrap())
                    }
                })
                .collect();
            let lr = 1e-3 * (step + 1) as f64;
            opt.step_impl(&grads, lr, fused).unwrap();
            reference.step(&grads, lr).unwrap();
            for i in 0..SHAPES.len() {
                worst = worst
                    .max(max_rel(new_vars[i].1.as_tensor(), ref_vars[i].as_tensor()))
                    .max(max_rel(&opt.m[i], &reference.m[i]))
                    .max(max_rel(&opt.v[i], &reference.v[i]));
            }
        }
        // The parameter without gradients never moved.
        assert_eq!(flat(new_vars[4].1.as_tensor()), flat(&init[4]));
        worst
    }

    #[test]
    fn fused_step_matches_reference_implementation() {
        for wd in [0.0, 0.1] {
            let worst = compare_with_reference(wd, true);
            println!("fused vs reference, weight_decay {wd}: max rel diff {worst:e}");
            assert!(worst <= 1e-6, "weight_decay {wd}: max rel diff {worst}");
        }
    }

    #[test]
    fn tensor_fallback_matches_reference_implementation() {
        for wd in [0.0, 0.1] {
            let worst = compare_with_reference(wd, false);
            assert!(worst <= 1e-6, "weight_decay {wd}: max rel diff {worst}");
        }
    }

    #[test]
    fn load_state_copies_and_resumes_identically() {
        let dev = Device::Cpu;
        let params = AdamWParams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let w0 = Tensor::randn(0f32, 1f32, (6, 5), &dev).unwrap();
        let grad = |s: u64| (Tensor::ones((6, 5), DType::F32, &dev).unwrap() * (s as f64)).unwrap();
        let a = Var::from_tensor(&w0).unwrap();
        let mut opt_a = AdamW::new(vec![("w".into(), a.clone())], params).unwrap();
        opt_a.step(&[Some(grad(1))], 1e-2).unwrap();
        let saved: HashMap<String, Tensor> = opt_a
            .state_tensors()
            .into_iter()
            .map(|(k, t)| (k, t.copy().unwrap()))
            .collect();
        let saved_m = flat(&saved["m.w"]);

        let b = Var::from_tensor(a.as_tensor()).unwrap();
        let mut opt_b = AdamW::new(vec![("w".into(), b.clone())], params).unwrap();
        opt_b.load_state(&saved, opt_a.t).unwrap();
        for s in 2..4 {
            opt_a.step(&[Some(grad(s))], 1e-2).unwrap();
            opt_b.step(&[Some(grad(s))], 1e-2).unwrap();
        }
        // The loaded tensors were not written through.
        assert_eq!(flat(&saved["m.w"]), saved_m);
        assert_eq!(flat(a.as_tensor()), flat(b.as_tensor()));
        assert_eq!(flat(&opt_a.v[0]), flat(&opt_b.v[0]));
    }

    /// Seconds per step over SmolLM2-135M-sized parameters, fused vs the
    /// original implementation. Run with
    /// `RAYON_NUM_THREADS=2 cargo test --release --lib adamw_throughput -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn adamw_throughput() {
        use std::time::Instant;
        let dev = Device::Cpu;
        let params = AdamWParams {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut shapes: Vec<Vec<usize>> = vec![vec![576, 7680]; 30];
        shapes.extend(std::iter::repeat_n(vec![576], 61));
        let vars: Vec<(String, Var)> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let t = Tensor::randn(0f32, 0.02, s.as_slice(), &dev).unwrap();
                (format!("p{i}"), Var::from_tensor(&t).unwrap())
            })
            .collect();
        let grads: Vec<Option<Tensor>> = shapes
            .iter()
            .map(|s| Some(Tensor::randn(0f32, 1e-3, s.as_slice(), &dev).unwrap()))
            .collect();
        let n: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
        println!(
            "adamw_throughput: {:.1} M params, {} threads",
            n as f64 / 1e6,
            candle_core::utils::get_num_threads()
        );
        const STEPS: usize = 5;
        {
            let mut opt = AdamW::new(vars.clone(), params).unwrap();
            opt.step(&grads, 1e-4).unwrap(); // warm-up (first touch of m/v)
            let t0 = Instant::now();
            for _ in 0..STEPS {
                opt.step(&grads, 1e-4).unwrap();
            }
            let s = t0.elapsed().as_secs_f64() / STEPS as f64;
            println!("adamw_throughput: fused in-place: {s:.3} s/step");
        }
        {
            let mut opt = Reference::new(vars.iter().map(|(_, v)| v.clone()).collect(), params);
            opt.step(&grads, 1e-4).unwrap();
            let t0 = Instant::now();
            for _ in 0..STEPS {
                opt.step(&grads, 1e-4).unwrap();
            }
            let s = t0.elapsed().as_secs_f64() / STEPS as f64;
            println!("adamw_throughput: reference (tensor ops): {s:.3} s/step");
        }
    }
}
