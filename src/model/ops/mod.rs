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
//! [`linear`] (frozen-weight matmul), [`norm`] (RMSNorm), [`rope`]
//! (rotary embeddings + heads-first transpose), [`mod@swiglu`], [`logp`]
//! (target log-prob + entropy). This file holds what they share: the
//! CPU-or-composite switch and the row-parallel loop.

use candle_core::{CpuStorage, DType, Layout, Tensor};

mod attention;
mod blas;
mod bmm;
mod linear;
mod logp;
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
    bf16_rollouts_available, f32_rollout_packs, frozen_linear, linear, PackedWeights,
};
pub use linear::{cpu_has_amx_bf16, packed_f32_rollout_bytes, packed_rollout_bytes};
pub(crate) use logp::logp_entropy;
pub(crate) use norm::rms_norm;
pub(crate) use rope::{rope_heads_first, RopeTables};
pub(crate) use softmax::causal_softmax;
pub(crate) use swiglu::swiglu;
#[cfg(test)]
pub(crate) use {
    linear::{is_packed, PACKED_PRODUCTS, PACK_MIN_ELEMS_OVERRIDE},
    logp::logp_entropy_composite,
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

/// Below this many elements the kernels run on the calling thread.
const PAR_MIN_ELEMS: usize = 1 << 16;

/// Runs `f(row_index, row)` over the rows of `out`, split across the
/// current rayon pool's threads. (Persistent pool threads: a fresh OS thread
/// per op faulted in a new 2 MB huge-page stack each time, which the kernel
/// zeroes; that was ~15 % of a SmolLM2 train step in `perf`.)
fn par_rows(out: &mut [f32], row_len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if row_len == 0 {
        return;
    }
    let n_rows = out.len() / row_len;
    let threads = rayon::current_num_threads().min(n_rows).max(1);
    if threads <= 1 || out.len() < PAR_MIN_ELEMS {
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

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        candle_core::bail!("{op}: only f32 is supported")
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: input must be contiguous"),
    }
}

#[cfg(test)]
mod tests;
