//! The trunk both paths run: token embedding, the decoder block
//! (attention with rotary embeddings and grouped-query heads, SwiGLU MLP,
//! with any LoRA updates), the final norm and LM head, and how sequences
//! are chunked so no activation grows past a few MB.
//!
//! candle-transformers' Llama has its own per-layer types (a `Block` of
//! `CausalSelfAttention` and `Mlp` with `with_tracing::RmsNorm`, private to
//! its `models::llama`), and the tests check this forward against that
//! model. They do not fit the training path: their forward calls candle's
//! fused `softmax_last_dim`, `rms_norm` and `rotary_emb::rope`, which have
//! no backward, so gradients would not reach the weights. They also own
//! their weights and KV cache per layer, where scoring and generation here
//! run one `Weights` (with LoRA adapters, merged or bf16 rollout copies
//! chosen per call), and they know neither Qwen's biases and q/k norms nor
//! packed prefix trees. So the block is written as functions over
//! `LayerW` with this crate's differentiable `ops`.

use std::cell::OnceCell;

use candle_core::{DType, Device, Tensor};

use super::cache::LayerCache;
use super::{LayerW, Policy, Weights};
use crate::model::error::{ModelError, Result};
use crate::model::lora::Proj;
use crate::model::ops;

/// Additive mask value for hidden attention columns. `-inf` gives exactly
/// zero weight; every query row keeps at least its own column visible, so no
/// row is all `-inf` (which would give NaN).
const MASKED: f32 = f32::NEG_INFINITY;

/// Budget (in f32 elements) for the largest activation of one chunk of
/// sequences (attention scores or the fused gate/up projection). Scoring
/// and prefill run the trunk chunk by chunk: on CPU, tensors of a few MB
/// stay in the allocator's heap and in cache, while tens-of-MB tensors are
/// mmapped and page-faulted afresh on every op, which costs more than the
/// arithmetic. Results do not depend on it (up to float rounding).
pub(super) const CHUNK_BUDGET: usize = 1 << 21;

/// Budget (in f32 elements, as [`CHUNK_BUDGET`]) for the widest activation
/// of one packed prefix-tree row on the fused attention path. Larger than
/// [`CHUNK_BUDGET`] because every row runs its sequences' shared prefix
/// (the system message, the task) again: at 2M elements SmolLM2's rows held
/// 682 tokens, and its 8 × 8 household step ran 9,180 trunk tokens for a
/// trie of 7,764 and prefilled 2,578 tokens for a turn's trie of 2,267.
/// 8M (2,730 SmolLM2 tokens) holds a micro-batch or a turn's prompts in one
/// row; its 32 MB activations stay in the allocator (which never returns
/// freed memory, see `main.rs`), and the step ran faster with a lower peak.
pub(super) const PACKED_ROW_BUDGET: usize = 1 << 23;

thread_local! {
    /// Per-thread override of [`CHUNK_BUDGET`], for tests that force tiny chunks.
    pub(super) static CHUNK_BUDGET_OVERRIDE: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// How attention hides columns.
#[derive(Clone, Copy)]
pub(super) enum AttnMask<'a> {
    /// Plain causal mask (scoring: right-padded, positions from 0).
    Causal,
    /// Generation (left padding): query `i` of batch row `r` sees key
    /// columns `pads[r] ..= i + s - t`; a pad query, whose range is empty,
    /// sees its own column (finite; its output is never read). `mask` holds
    /// the additive form the composite path needs, built on first use (the
    /// fused path reads `pads` alone).
    Padded {
        pads: &'a [usize],
        mask: &'a OnceCell<Tensor>,
    },
    /// Scoring a packed prefix tree (one row, see `pack`): query `i` sees
    /// column `j` iff `j <= i < reach[j]`. `mask` as for `Padded`.
    Tree {
        reach: &'a [usize],
        mask: &'a OnceCell<Tensor>,
    },
}

/// [`CHUNK_BUDGET`], or this thread's test override.
fn chunk_budget() -> usize {
    CHUNK_BUDGET_OVERRIDE
        .with(|c| c.get())
        .unwrap_or(CHUNK_BUDGET)
}

impl<'a> AttnMask<'a> {
    /// The additive mask the composite path adds to `(b, n_kv, rep, t, s)`
    /// scores, built on first use; `None` for the causal mask, which
    /// `ops::causal_softmax` applies itself.
    fn additive(self, t: usize, s: usize, device: &Device) -> Result<Option<&'a Tensor>> {
        // Built only when the cell is still empty.
        let (cell, built) = match self {
            AttnMask::Causal => return Ok(None),
            AttnMask::Padded { pads, mask } => (
                mask,
                mask.get()
                    .is_none()
                    .then(|| padded_mask(pads, t, s, device))
                    .transpose()?,
            ),
            AttnMask::Tree { reach, mask } => (
                mask,
                mask.get()
                    .is_none()
                    .then(|| tree_mask(reach, device))
                    .transpose()?,
            ),
        };
        if let Some(m) = built {
            let _ = cell.set(m);
        }
        Ok(cell.get())
    }
}

/// [`AttnMask::Tree`]'s additive mask, `(1, 1, 1, t, t)`.
fn tree_mask(reach: &[usize], device: &Device) -> Result<Tensor> {
    let t = reach.len();
    let mut m = vec![MASKED; t * t];
    for (i, row) in m.chunks_mut(t.max(1)).enumerate() {
        for (j, x) in row[..=i].iter_mut().enumerate() {
            if i < reach[j] {
                *x = 0.0;
            }
        }
    }
    Ok(Tensor::from_vec(m, (1, 1, 1, t, t), device)?)
}

/// [`AttnMask::Padded`]'s additive mask, `(b, 1, 1, t, s)`.
fn padded_mask(pads: &[usize], t: usize, s: usize, device: &Device) -> Result<Tensor> {
    let mut m = vec![MASKED; pads.len() * t * s];
    for (r, &pad) in pads.iter().enumerate() {
        for i in 0..t {
            let hi = i + s - t;
            let row = (r * t + i) * s;
            m[row + pad.min(hi)..=row + hi].fill(0.0);
        }
    }
    Ok(Tensor::from_vec(m, (pads.len(), 1, 1, t, s), device)?)
}

impl Policy {
    /// Width of the widest per-token activation of a block (the fused
    /// gate/up projection, in practice).
    fn widest_activation(&self) -> usize {
        (2 * self.cfg.intermediate_size)
            .max(self.cfg.hidden_size)
            .max(self.cfg.num_attention_heads * self.cfg.head_dim())
    }

    /// Splits sequences, sorted by decreasing length `lens`, into
    /// consecutive chunks whose largest activation fits [`CHUNK_BUDGET`].
    pub(super) fn plan_chunks(&self, lens: &[usize]) -> Vec<std::ops::Range<usize>> {
        let budget = chunk_budget();
        let widest = self.widest_activation();
        let mut out = Vec::new();
        let mut start = 0;
        while start < lens.len() {
            let t = lens[start].max(1);
            let per_seq = t * widest.max(self.cfg.num_attention_heads * t);
            let n = (budget / per_seq).max(1);
            let end = (start + n).min(lens.len());
            out.push(start..end);
            start = end;
        }
        out
    }

    /// Tokens per packed prefix-tree row (`pack`): the fused attention
    /// keeps no scores, so in a large model its widest activation fits
    /// [`PACKED_ROW_BUDGET`]; the composite path keeps `(heads, t, t)`
    /// scores, which fit
    /// [`Policy::plan_chunks`]' budget. A test override of that budget
    /// applies to both.
    pub(super) fn packed_tokens(&self) -> usize {
        let widest = self.widest_activation();
        let nh = self.cfg.num_attention_heads;
        let fused =
            ops::fused_attention_available() && self.device.is_cpu() && self.dtype == DType::F32;
        // Large models only: a wider row changes the order of float sums,
        // and the built-in tiny model's runs stay bit-identical.
        let wide = fused && self.is_large();
        let budget = CHUNK_BUDGET_OVERRIDE.with(|c| c.get()).unwrap_or(if wide {
            PACKED_ROW_BUDGET
        } else {
            CHUNK_BUDGET
        });
        let mut t = (budget / widest).max(1);
        if !fused {
            while t > 1 && t * (nh * t).max(widest) > budget {
                t = t * 3 / 4;
            }
        }
        t
    }

    /// Rotary tables for `rows * t` positions (`rows` = 1 when all
    /// sequences share positions `0..t`).
    pub(super) fn rope_tables(
        &self,
        positions: &[usize],
        rows: usize,
        t: usize,
    ) -> ops::RopeTables {
        ops::RopeTables::new(&self.inv_freq, positions, rows, t)
    }

    pub(super) fn embed(&self, w: &Weights, ids: &[u32]) -> Result<Tensor> {
        let v = self.cfg.vocab_size;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= v) {
            return Err(ModelError::InvalidArgument(format!(
                "token id {bad} outside the vocabulary (vocab_size {v})"
            )));
        }
        let ids = Tensor::from_slice(ids, ids.len(), &self.device)?;
        Ok(w.embed.index_select(&ids, 0)?)
    }

    /// One decoder block on `x` `(b * t, hidden)`. `cache = Some((c, off,
    /// from))` writes this step's keys/values at column `off` of the cache
    /// and attends over columns `from..off + t`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn block(
        &self,
        lw: &LayerW,
        x: &Tensor,
        b: usize,
        t: usize,
        rope: &ops::RopeTables,
        mask: AttnMask<'_>,
        cache: Option<(&mut LayerCache, usize, usize)>,
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps;
        let h = ops::rms_norm(x, &lw.ln1, eps)?;
        let y = self.attention(lw, &h, b, t, rope, mask, cache)?;
        let x = (x + self.proj(lw, Proj::O, &y, &lw.o, lw.bo.as_ref())?)?;

        let h = ops::rms_norm(&x, &lw.ln2, eps)?;
        let m = self.mlp(lw, &h)?;
        Ok((x + m)?)
    }

    /// Grouped-query attention of the normed rows `h` `(b * t, hidden)`,
    /// before the output projection: `(b * t, heads * head_dim)`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        lw: &LayerW,
        h: &Tensor,
        b: usize,
        t: usize,
        rope: &ops::RopeTables,
        mask: AttnMask<'_>,
        cache: Option<(&mut LayerCache, usize, usize)>,
    ) -> Result<Tensor> {
        let eps = self.cfg.rms_norm_eps;
        let hd = self.cfg.head_dim();
        let (nh, nkv) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads);
        let rep = nh / nkv;
        let scale = 1.0 / (hd as f64).sqrt();

        // Qwen3: RMSNorm over each head's `head_dim` values of q and k,
        // after the projection and before rotary (HF order). Rows of
        // `(b * t, heads * hd)` split into `(b * t * heads, hd)`.
        let head_norm = |y: Tensor, w: &Option<Tensor>, heads: usize| -> Result<Tensor> {
            match w {
                Some(w) => ops::rms_norm(&y.reshape((b * t * heads, hd))?, w, eps),
                None => Ok(y),
            }
        };
        let q = head_norm(
            self.proj(lw, Proj::Q, h, &lw.q, lw.bq.as_ref())?,
            &lw.q_norm,
            nh,
        )?;
        let k = head_norm(
            self.proj(lw, Proj::K, h, &lw.k, lw.bk.as_ref())?,
            &lw.k_norm,
            nkv,
        )?;
        // (b, heads, t, hd), rotated.
        let q = ops::rope_heads_first(&q.reshape((b, t, nh, hd))?, rope)?;
        let k = ops::rope_heads_first(&k.reshape((b, t, nkv, hd))?, rope)?;
        let v = self
            .proj(lw, Proj::V, h, &lw.v, lw.bv.as_ref())?
            .reshape((b, t, nkv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let (k, v) = match cache {
            None => (k, v),
            Some((c, off, from)) => c.write(&k, &v, off, from)?,
        };
        let s = k.dim(2)?;
        // GQA without materialising repeated K/V: query head h = g * rep + r
        // reads kv head g, so (b, nh, t, hd) regroups to (b, nkv, rep * t, hd);
        // score rows are then ordered (b, kv head, r, query).
        let q = q.reshape((b, nkv, rep * t, hd))?;
        let vis = match mask {
            AttnMask::Causal => ops::Visible::Causal,
            AttnMask::Padded { pads, .. } => ops::Visible::Pads(pads),
            AttnMask::Tree { reach, .. } => ops::Visible::Tree(reach),
        };
        let heads_last = |y: Tensor| -> Result<Tensor> {
            Ok(y.reshape((b, nh, t, hd))?
                .transpose(1, 2)?
                .reshape((b * t, nh * hd))?)
        };
        if let Some(y) = ops::attention(&q, &k, &v, scale, t, vis)? {
            return heads_last(y);
        }
        let att = match mask.additive(t, s, &self.device)? {
            // Training path: fused scale + causal mask + softmax, with backward.
            None => ops::causal_softmax(&ops::bmm(&q, &k, true)?, scale, t)?,
            Some(m) => {
                // In f32 whatever the compute dtype (as HF does).
                let att = ops::bmm(&q.affine(scale, 0.0)?, &k, true)?
                    .reshape((b, nkv, rep, t, s))?
                    .to_dtype(DType::F32)?
                    .broadcast_add(m)?;
                let p = match mask {
                    // Scoring: candle's composite (differentiable) softmax.
                    AttnMask::Tree { .. } => candle_nn::ops::softmax(&att, candle_core::D::Minus1)?,
                    // Generation (detached weights, no backward needed), so
                    // candle's fused forward-only softmax is fine here.
                    _ => candle_nn::ops::softmax_last_dim(&att)?,
                };
                p.to_dtype(q.dtype())?.reshape((b, nkv, rep * t, s))?
            }
        };
        heads_last(ops::bmm(&att, &v, false)?)
    }

    /// SwiGLU MLP of the normed rows `h`, down projection included.
    fn mlp(&self, lw: &LayerW, h: &Tensor) -> Result<Tensor> {
        let gu_w = || -> Result<Tensor> {
            Ok(match &lw.gu {
                Some(gu) => gu.clone(),
                None => Tensor::cat(&[&lw.gate, &lw.up], 0)?,
            })
        };
        let ws = [&lw.gate, &lw.up];
        if let Some(gu) = self.lora_product(lw, &[Proj::Gate, Proj::Up], h, &ws)? {
            return self.proj(lw, Proj::Down, &ops::swiglu(&gu)?, &lw.down, None);
        }
        let frozen = self.frozen_mixed(h, &[&lw.gate, &lw.up])?;
        let mut gu = match frozen {
            Some(gu) => gu,
            None => match self.mixed_pair(lw, h)? {
                Some(gu) => gu,
                None => self.base_linear(h, &gu_w()?)?,
            },
        };
        let (dg, du) = (
            self.lora_delta(lw, Proj::Gate, h)?,
            self.lora_delta(lw, Proj::Up, h)?,
        );
        if dg.is_some() || du.is_some() {
            let i = self.cfg.intermediate_size;
            let zeros = || Tensor::zeros((h.dim(0)?, i), h.dtype(), &self.device);
            let dg = dg.map_or_else(zeros, Ok)?;
            let du = du.map_or_else(zeros, Ok)?;
            gu = (gu + Tensor::cat(&[&dg, &du], 1)?)?;
        }
        self.proj(lw, Proj::Down, &ops::swiglu(&gu)?, &lw.down, None)
    }

    /// `x Wᵀ (+ bias)` plus the LoRA update of projection `p`, if adapted.
    fn proj(
        &self,
        lw: &LayerW,
        p: Proj,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        // The fused product holds the LoRA update; else it is composed.
        let (y, delta) = match self.lora_product(lw, &[p], x, &[w])? {
            Some(y) => (y, None),
            None => (self.base_linear(x, w)?, self.lora_delta(lw, p, x)?),
        };
        let y = match bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        Ok(match delta {
            Some(d) => (y + d)?,
            None => y,
        })
    }

    /// Whether this policy's LoRA updates can run as fused products
    /// ([`Policy::lora_product`]): f32 CPU products with a BLAS (mixed
    /// precision has its own frozen-base path) and no LoRA dropout (which
    /// masks only the adapter's input). The memory estimate counts the
    /// composed update's tensors where they do not.
    pub(in crate::model) fn lora_updates_fused(&self) -> bool {
        self.lora.as_ref().is_some_and(|cfg| cfg.dropout <= 0.0)
            && !self.mixed_precision
            && self.device.is_cpu()
            && self.dtype == DType::F32
            && ops::fused_lora_available()
    }

    /// `x Wᵀ` for a base weight: under LoRA the base is frozen, and the
    /// product skips the weight gradient candle's matmul would compute.
    pub(in crate::model) fn base_linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        // Only when a gradient flows through `x` (scoring the trained
        // policy); generation and the frozen reference build no graph.
        if let Some(y) = self.frozen_mixed(x, &[w])? {
            return Ok(y);
        }
        if self.mixed_precision && x.track_op() {
            // bf16 products for the pass that trains (a LoRA base is
            // detached, so it gets no weight gradient here either).
            let w = if self.lora.is_some() {
                w.detach()
            } else {
                w.clone()
            };
            ops::mixed_linear(x, &w)
        } else if self.lora.is_some() && x.track_op() {
            ops::frozen_linear(x, w)
        } else {
            linear(x, w)
        }
    }

    /// Without LoRA, with mixed precision, in the pass that trains: `h`
    /// times the stacked gate and up weights, rounded to bf16 straight from
    /// the two (no f32 `cat` of them per pass); `None` elsewhere.
    fn mixed_pair(&self, lw: &LayerW, h: &Tensor) -> Result<Option<Tensor>> {
        if !(self.mixed_precision && self.lora.is_none() && h.track_op() && lw.gu.is_none()) {
            return Ok(None);
        }
        ops::mixed_linear_pair(h, &lw.gate, &lw.up)
    }

    /// Under LoRA with mixed precision, in the pass that trains: `x` times
    /// the frozen weights `ws` (stacked by rows) from their bf16 copy,
    /// rounded once per run instead of once per pass; `None` elsewhere.
    fn frozen_mixed(&self, x: &Tensor, ws: &[&Tensor]) -> Result<Option<Tensor>> {
        if !(self.mixed_precision && self.lora.is_some() && x.track_op()) {
            return Ok(None);
        }
        if ws.iter().any(|w| w.track_op() || !w.device().is_cpu()) {
            return Ok(None);
        }
        let w = self.frozen_bf16(ws)?;
        ops::mixed_frozen_linear(x, &w)
    }

    /// Logits `(rows, vocab)` from pre-norm hidden rows `(rows, hidden)`,
    /// in f32 whatever the compute dtype.
    pub(super) fn head(&self, w: &Weights, hidden: &Tensor) -> Result<Tensor> {
        let h = ops::rms_norm(hidden, &w.norm, self.cfg.rms_norm_eps)?;
        Ok(self.base_linear(&h, w.head())?.to_dtype(DType::F32)?)
    }
}

/// `x (rows, in) @ w.T` for an HF `(out, in)` weight.
pub(in crate::model) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    ops::linear(x, w)
}
