//! Fused CPU kernels *with* backward passes for the training path.
//!
//! candle's own fused kernels (`softmax_last_dim`, `rms_norm`, ...) have no
//! backward, and the composite versions (max, sub, exp, sum, div, each a
//! full pass over the tensor and a fresh allocation, with more of the same
//! in the backward) dominate the cost of scoring on CPU. These custom ops do
//! one pass forward and one pass backward. On non-CPU devices the same math
//! falls back to composite candle ops, so results are device-independent up
//! to rounding. bf16 tensors take the composite ops on every device.
//!
//! One file per kernel family: [`attention`] (fused attention, BLAS path),
//! [`softmax`] (causal attention softmax, the composite path's),
//! [`linear`] (frozen-weight matmul), [`lora`] (a LoRA-adapted
//! projection), [`norm`] (RMSNorm), [`rope`]
//! (rotary embeddings + heads-first transpose), [`mod@swiglu`], [`logp`]
//! (target log-prob + entropy). This file holds what they share: the
//! CPU-or-composite switch, the row-parallel loop, and the adapters
//! ([`Fused1`], [`Fused2`], [`Fused3`]) that turn an op's f32 kernel
//! ([`Kernel1`], [`Kernel2`], [`Kernel3`]) into a candle custom op, so each op states only its kernel
//! and its backward.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};

mod attention;
mod blas;
mod bmm;
mod expf;
mod linear;
mod logp;
mod lora;
mod norm;
mod rope;
mod skinny;
mod softmax;
mod swiglu;

pub use attention::fused_attention_available;
pub(crate) use attention::{attention, Visible};
pub use blas::matmul_backend;
pub(crate) use bmm::bmm;
pub(crate) use linear::{
    bf16_rollouts_available, f32_rollout_packs, frozen_linear, linear, mixed_frozen_linear,
    mixed_linear, mixed_linear_pair, FrozenBf16, PackedWeights,
};
pub use linear::{
    cpu_has_amx_bf16, decode_kernel, mixed_precision_available, packed_f32_rollout_bytes,
    packed_rollout_bytes,
};
pub(crate) use logp::logp_entropy;
pub(crate) use lora::{fused_lora_available, lora_linear};
pub(crate) use norm::rms_norm;
pub(crate) use rope::{rope_heads_first, RopeTables};
pub(crate) use softmax::causal_softmax;
pub(crate) use swiglu::swiglu;
#[cfg(test)]
pub(crate) use {
    linear::{is_packed, PACKED_PRODUCTS, PACK_MIN_ELEMS_OVERRIDE, PAIR_PRODUCTS},
    logp::logp_entropy_composite,
    lora::{blas_loaded, LORA_PRODUCTS},
    rope::rope_heads_first_composite,
    swiglu::swiglu_composite,
};

#[cfg(test)]
thread_local! {
    /// Tests set this to run the composite (non-CPU) fallbacks on CPU.
    pub(crate) static FORCE_COMPOSITE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the fused CPU kernels apply to `x`: f32 on the CPU. This is
/// the one place that decides; every other device or dtype (CUDA, bf16)
/// takes the differentiable composite ops, which compute the numerically
/// delicate steps (norm statistics, softmax, log-softmax) in f32.
fn fused(x: &Tensor) -> bool {
    #[cfg(test)]
    if FORCE_COMPOSITE.with(|c| c.get()) {
        return false;
    }
    x.device().is_cpu() && x.dtype() == DType::F32
}

/// Below this much work (elements touched) the kernels run on the calling
/// thread.
const PAR_MIN_ELEMS: usize = 1 << 16;

/// Runs `f(row_index, row)` over the rows of `out`, split across the
/// current rayon pool's threads. (Persistent pool threads: a fresh OS thread
/// per op faulted in a new 2 MB huge-page stack each time, which the kernel
/// zeroes; that was ~15 % of a SmolLM2 train step in `perf`.)
fn par_rows(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    par_rows_work(out, row_len, row_len, f);
}

/// [`par_rows`] for rows whose work is not their length: `row_work`
/// elements read per row (a row of 4 statistics over a 49k-logit row must
/// not run on one thread because its output is small).
fn par_rows_work(
    out: &mut [f32],
    row_len: usize,
    row_work: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    split_rows(out, row_len, row_work, f);
}

/// The split behind [`par_rows_work`] and [`par_rows_new`], over rows of
/// any element type: on the calling thread below [`PAR_MIN_ELEMS`] of
/// work, else one contiguous block of rows per pool thread.
fn split_rows<T: Send>(
    out: &mut [T],
    row_len: usize,
    row_work: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if row_len == 0 {
        return;
    }
    let n_rows = out.len() / row_len;
    let threads = rayon::current_num_threads().min(n_rows).max(1);
    if threads <= 1 || n_rows * row_len.max(row_work) < PAR_MIN_ELEMS {
        for (r, row) in out.chunks_mut(row_len).enumerate() {
            f(r, row);
        }
        return;
    }
    let rows_per = n_rows.div_ceil(threads);
    rayon::scope(|sc| {
        for (ci, chunk) in out.chunks_mut(rows_per * row_len).enumerate() {
            let f = &f;
            sc.spawn(move |_| {
                for (k, row) in chunk.chunks_mut(row_len).enumerate() {
                    f(ci * rows_per + k, row);
                }
            });
        }
    });
}

/// A new buffer of `rows * row_len` elements, each row filled by `f(row_index,
/// row)` across the pool as [`par_rows`] does. Each row is zeroed by the
/// thread that fills it, just before: `vec![0; n]` zeroed the whole buffer
/// on the calling thread first (for the logits' gradient, 200 MB at batch 8
/// on SmolLM2, a serial `memset` while the pool waited).
fn par_rows_new(rows: usize, row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    let len = rows * row_len;
    let mut out: Vec<f32> = Vec::with_capacity(len);
    split_rows(
        &mut out.spare_capacity_mut()[..len],
        row_len,
        row_len,
        |r, row| {
            for v in row.iter_mut() {
                v.write(0.0);
            }
            // SAFETY: every element of `row` was just initialised, and
            // `MaybeUninit<f32>` has `f32`'s layout.
            let row = unsafe { &mut *(row as *mut [std::mem::MaybeUninit<f32>] as *mut [f32]) };
            f(r, row);
        },
    );
    // SAFETY: `split_rows` visited every row (with `row_len == 0`, `len` is 0).
    unsafe { out.set_len(len) };
    out
}

/// The f32 elements of a CPU storage; any other dtype is an error naming
/// `op`.
fn f32_data<'a>(s: &'a CpuStorage, op: &str) -> candle_core::Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(v),
        _ => candle_core::bail!("{op}: only f32 is supported"),
    }
}

/// The elements of a contiguous f32 CPU storage under `l`; another dtype or
/// a strided layout is an error naming `op`.
fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let v = f32_data(s, op)?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

/// One input of a kernel: its contiguous f32 elements and its shape.
#[derive(Clone, Copy)]
struct Input<'a> {
    data: &'a [f32],
    shape: &'a Shape,
}

impl<'a> Input<'a> {
    fn of(s: &'a CpuStorage, l: &'a Layout, op: &str) -> candle_core::Result<Self> {
        Ok(Input {
            data: f32_slice(s, l, op)?,
            shape: l.shape(),
        })
    }
}

/// A one-input op whose CPU forward is an f32 kernel over a contiguous
/// input; [`Fused1`] makes it a candle `CustomOp1`.
trait Kernel1: Send + Sync {
    /// The op's name in candle's graph and in errors.
    const NAME: &'static str;

    /// The output's elements and shape.
    fn forward(&self, x: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)>;

    /// `CustomOp1::bwd`; the default (candle's) has no backward, as for
    /// the backward kernels themselves, which run without one.
    fn backward(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Err(candle_core::Error::BackwardNotSupported { op: Self::NAME })
    }
}

/// A two-input op whose CPU forward is an f32 kernel over contiguous
/// inputs; [`Fused2`] makes it a candle `CustomOp2`.
trait Kernel2: Send + Sync {
    /// The op's name in candle's graph and in errors.
    const NAME: &'static str;

    /// The output's elements and shape.
    fn forward(&self, a: Input<'_>, b: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)>;

    /// `CustomOp2::bwd`; the default (candle's) has no backward.
    fn backward(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Err(candle_core::Error::BackwardNotSupported { op: Self::NAME })
    }
}

/// A three-input op whose CPU forward is an f32 kernel over contiguous
/// inputs; [`Fused3`] makes it a candle `CustomOp3`.
trait Kernel3: Send + Sync {
    /// The op's name in candle's graph and in errors.
    const NAME: &'static str;

    /// The output's elements and shape.
    fn forward(
        &self,
        a: Input<'_>,
        b: Input<'_>,
        c: Input<'_>,
    ) -> candle_core::Result<(Vec<f32>, Shape)>;

    /// `CustomOp3::bwd`; the default (candle's) has no backward.
    #[allow(clippy::type_complexity)]
    fn backward(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        _c: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Err(candle_core::Error::BackwardNotSupported { op: Self::NAME })
    }
}

/// A [`Kernel1`] as a candle custom op: checks that the input is a
/// contiguous f32 CPU tensor, runs the kernel, wraps its output. (The
/// callers only apply it where [`fused`] holds.)
struct Fused1<K>(K);

impl<K: Kernel1> CustomOp1 for Fused1<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (out, shape) = self.0.forward(Input::of(s, l, K::NAME)?)?;
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        self.0.backward(arg, res, grad)
    }
}

/// A [`Kernel2`] as a candle custom op (see [`Fused1`]).
struct Fused2<K>(K);

impl<K: Kernel2> CustomOp2 for Fused2<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let a = Input::of(s1, l1, K::NAME)?;
        let b = Input::of(s2, l2, K::NAME)?;
        let (out, shape) = self.0.forward(a, b)?;
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        self.0.backward(a, b, res, grad)
    }
}

/// A [`Kernel3`] as a candle custom op (see [`Fused1`]).
struct Fused3<K>(K);

impl<K: Kernel3> CustomOp3 for Fused3<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let a = Input::of(s1, l1, K::NAME)?;
        let b = Input::of(s2, l2, K::NAME)?;
        let c = Input::of(s3, l3, K::NAME)?;
        let (out, shape) = self.0.forward(a, b, c)?;
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.0.backward(a, b, c, res, grad)
    }
}

#[cfg(test)]
mod tests;
