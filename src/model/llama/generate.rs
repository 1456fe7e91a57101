//! The rollout path: batched, KV-cached, optionally constrained
//! generation ([`Policy::generate`]) and next-token logits
//! ([`Policy::next_logits`]).

use candle_core::Tensor;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use std::cell::OnceCell;

use super::block::AttnMask;
use super::cache::{self, LayerCache};
use super::{pack, Policy, Weights};
use crate::model::error::{ModelError, Result};
use crate::model::sampler::{Prepared, Sampler};
use crate::model::trie::TokenTrie;

/// Sampling settings for [`Policy::generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// Softmax temperature for sampling and for the reported log-probs. Must
    /// be > 0 unless `greedy` (then a non-positive value reports log-probs at
    /// temperature 1).
    pub temperature: f64,
    /// Nucleus sampling mass; `>= 1` disables it, `-> 0` approaches greedy.
    pub top_p: f64,
    /// Arg-max decoding (of the constrained logits) instead of sampling.
    pub greedy: bool,
    pub eos_token_id: u32,
}

/// One generated completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// Generated ids, including the eos if one was emitted.
    pub tokens: Vec<u32>,
    /// One per token: `log softmax(logits / temperature)[token]` over the
    /// full, unconstrained vocabulary (see [`Policy::generate`]).
    pub logprobs: Vec<f32>,
    /// True when eos was emitted (false: stopped by `max_new_tokens`).
    pub finished: bool,
}

impl Policy {
    /// Samples completions for a batch of prompts.
    ///
    /// Runs on detached weights (candle has no no-grad mode, so this is what
    /// keeps generation from building an autograd graph). Prompts are
    /// left-padded to a common length; each sequence's rotary positions start
    /// at 0 on its first real token and an additive mask hides its pad
    /// columns, so a prompt's distribution does not depend on what it is
    /// batched with (greedy output is identical alone or batched). Prompts
    /// are prefilled once, longest first, in chunks of similar length (in a
    /// large model: as packed prefix trees, each shared prefix once), into
    /// a preallocated per-layer KV cache (written in place with
    /// `slice_set`); then all unfinished sequences advance one token per
    /// step; finished ones are dropped from the batch (the caches are
    /// compacted). Each step samples the active sequences in that
    /// longest-first order from `rng`, so results are reproducible for the
    /// same prompts, options and seed.
    ///
    /// With `constraints` (one trie per prompt) a sequence can only emit one
    /// of its trie's actions followed by eos. Sampling uses the masked
    /// distribution (with top-p), but the reported `logprobs` are the
    /// *unconstrained* `log softmax(logits / temperature)` over the full
    /// vocabulary: that is the quantity [`Policy::score`] computes for the
    /// same sequence (which knows nothing about constraints), so the PPO
    /// ratio is exactly 1 before the first update, and the learning signal
    /// moves the model's own distribution towards admissible actions rather
    /// than relying on the mask.
    pub fn generate(
        &self,
        prompts: &[Vec<u32>],
        opts: &GenerateOptions,
        constraints: Option<&[TokenTrie]>,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<Generated>> {
        self.generate_until(prompts, opts, constraints, rng, &mut || false)
    }

    /// [`Policy::generate`], asking `stop` before the prefill and before
    /// every decode step: when it answers true, generation ends there and
    /// the tokens so far are returned (unfinished ones with `finished`
    /// false). A server uses it to drop the work of a client that left.
    pub fn generate_until(
        &self,
        prompts: &[Vec<u32>],
        opts: &GenerateOptions,
        constraints: Option<&[TokenTrie]>,
        rng: &mut ChaCha8Rng,
        stop: &mut dyn FnMut() -> bool,
    ) -> Result<Vec<Generated>> {
        let temperature = self.check_generate(prompts, opts, constraints)?;
        let mut out: Vec<Generated> = prompts
            .iter()
            .map(|_| Generated {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                finished: false,
            })
            .collect();
        if prompts.is_empty() || opts.max_new_tokens == 0 || stop() {
            return Ok(out);
        }
        let w = self.inference_weights()?;
        let n = prompts.len();
        let p_len = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = p_len + opts.max_new_tokens;
        // Longest first; each chunk is prefilled at its own length and
        // written right-aligned into the cache, so columns line up.
        let mut active: Vec<usize> = (0..n).collect();
        active.sort_by_key(|&i| std::cmp::Reverse(prompts[i].len()));
        let mut pads: Vec<usize> = active.iter().map(|&i| p_len - prompts[i].len()).collect();
        let (mut cache, mut logits) = self.prefill_batch(&w, prompts, &active, p_len, capacity)?;

        let sampler = Sampler {
            temperature,
            top_p: opts.top_p,
            greedy: opts.greedy,
            eos: opts.eos_token_id,
        };
        for step in 0..opts.max_new_tokens {
            let keep = sample_step(&sampler, &logits, &active, constraints, &mut out, rng)?;
            if keep.is_empty() || step + 1 == opts.max_new_tokens || stop() {
                break;
            }
            if keep.len() < active.len() {
                cache::compact(&mut cache, &keep, &self.device)?;
                active = keep.iter().map(|&r| active[r]).collect();
                pads = keep.iter().map(|&r| pads[r]).collect();
            }
            // One decode step for every active sequence.
            let last: Vec<u32> = active
                .iter()
                .map(|&i| *out[i].tokens.last().expect("token just pushed"))
                .collect();
            let positions: Vec<usize> = active.iter().map(|&i| prompts[i].len() + step).collect();
            logits = self.decode_step(&w, &mut cache, &last, &positions, &pads, p_len + step)?;
        }
        Ok(out)
    }

    /// Checks [`Policy::generate`]'s arguments; returns the temperature the
    /// log-probs are reported at.
    fn check_generate(
        &self,
        prompts: &[Vec<u32>],
        opts: &GenerateOptions,
        constraints: Option<&[TokenTrie]>,
    ) -> Result<f64> {
        let vocab = self.cfg.vocab_size;
        if let Some(c) = constraints {
            if c.len() != prompts.len() {
                return Err(ModelError::InvalidArgument(format!(
                    "generate: {} prompts but {} constraint tries",
                    prompts.len(),
                    c.len()
                )));
            }
        }
        if opts.eos_token_id as usize >= vocab {
            return Err(ModelError::InvalidArgument(format!(
                "generate: eos id {} outside the vocabulary",
                opts.eos_token_id
            )));
        }
        let temperature = if opts.temperature.is_finite() && opts.temperature > 0.0 {
            opts.temperature
        } else if opts.greedy {
            1.0
        } else {
            return Err(ModelError::InvalidArgument(format!(
                "generate: temperature must be > 0 when sampling, got {}",
                opts.temperature
            )));
        };
        if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
            return Err(ModelError::InvalidArgument(format!(
                "generate: prompt {i} is empty"
            )));
        }
        Ok(temperature)
    }

    /// Prefills the prompts `active` (indices into `prompts`, longest
    /// first) chunk by chunk into one cache of `capacity` columns per
    /// layer, prompts ending at column `p_len`; returns it with the last
    /// position's logits, rows in `active` order.
    fn prefill_batch(
        &self,
        w: &Weights,
        prompts: &[Vec<u32>],
        active: &[usize],
        p_len: usize,
        capacity: usize,
    ) -> Result<(Vec<LayerCache>, Tensor)> {
        // Prompts that share a prefix (a group's rollouts of one task start
        // from the same prompt, and every turn's prompt opens with the
        // system message and task) are prefilled once as a packed prefix
        // tree; each row's cache is gathered from it. Not in small models,
        // whose products round by batch shape: there the saving is nil and
        // the built-in tiny model's runs stay bit-identical.
        if self.is_large() {
            return self.prefill_shared(w, prompts, active, p_len, capacity);
        }
        let lens: Vec<usize> = active.iter().map(|&i| prompts[i].len()).collect();
        let mut caches: Vec<Vec<LayerCache>> = Vec::new();
        let mut logits_parts = Vec::new();
        for chunk in self.plan_chunks(&lens) {
            let chunk_prompts: Vec<&[u32]> = active[chunk]
                .iter()
                .map(|&i| prompts[i].as_slice())
                .collect();
            let (c, l) = self.prefill(w, &chunk_prompts, p_len, capacity)?;
            caches.push(c);
            logits_parts.push(l);
        }
        let cache = cache::concat(caches, self.cfg.num_hidden_layers)?;
        Ok((cache, Tensor::cat(&logits_parts, 0)?))
    }

    /// [`Policy::prefill_batch`] over packed prefix trees: the prompts
    /// `active`, sorted so that those sharing a prefix are neighbours, run
    /// chunk by chunk as packed rows (`pack`, the scorer's layout: each
    /// token sees its own prompt alone and keeps its position), so a shared
    /// prefix runs once; each row's cache columns `p_len - len .. p_len`
    /// are then gathered from the packed keys and values (zeros before, as
    /// padding), and its logits from its last token's hidden row.
    fn prefill_shared(
        &self,
        w: &Weights,
        prompts: &[Vec<u32>],
        active: &[usize],
        p_len: usize,
        capacity: usize,
    ) -> Result<(Vec<LayerCache>, Tensor)> {
        let seqs: Vec<&[u32]> = active.iter().map(|&i| prompts[i].as_slice()).collect();
        let (order, chunks) = pack::plan(&seqs, self.packed_tokens());
        let (nkv, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim());
        let layers = w.layers.len();
        // Per layer, each chunk's packed keys and values.
        let mut packed: Vec<Vec<LayerCache>> = (0..layers).map(|_| Vec::new()).collect();
        // node[r]: packed columns (over all chunks) of row r's tokens.
        let mut node: Vec<Vec<usize>> = vec![Vec::new(); seqs.len()];
        let mut last_rows = Vec::new();
        let mut hidden = Vec::new();
        let mut base = 0usize;
        for chunk in chunks {
            let rs = &order[chunk];
            let chunk_seqs: Vec<&[u32]> = rs.iter().map(|&r| seqs[r]).collect();
            let p = pack::pack(&chunk_seqs);
            let t = p.ids.len();
            let rope = self.rope_tables(&p.positions, 1, t);
            let mask = OnceCell::new();
            let tree = AttnMask::Tree {
                reach: &p.reach,
                mask: &mask,
            };
            let mut x = self.embed(w, &p.ids)?;
            for (lw, parts) in w.layers.iter().zip(packed.iter_mut()) {
                let mut c = LayerCache::zeros(1, nkv, t, hd, self.dtype, &self.device)?;
                x = self.block(lw, &x, 1, t, &rope, tree, Some((&mut c, 0, 0)))?;
                parts.push(c);
            }
            let sel: Vec<u32> = p.node.iter().map(|n| n[n.len() - 1] as u32).collect();
            let n = sel.len();
            hidden.push(x.index_select(&Tensor::from_vec(sel, n, &self.device)?, 0)?);
            for (k, &r) in rs.iter().enumerate() {
                node[r] = p.node[k].iter().map(|&j| base + j).collect();
                last_rows.push(r);
            }
            base += t;
        }
        // Column `base` is zeros: the padding of every row.
        let mut cols = vec![base as u32; seqs.len() * capacity];
        for (r, n) in node.iter().enumerate() {
            let start = r * capacity + p_len - n.len();
            for (c, &j) in cols[start..start + n.len()].iter_mut().zip(n) {
                *c = j as u32;
            }
        }
        let cols = Tensor::from_vec(cols, seqs.len() * capacity, &self.device)?;
        let zero = Tensor::zeros((nkv, 1, hd), self.dtype, &self.device)?;
        let cache = packed
            .iter()
            .map(|parts| {
                let side = |kv: usize| -> Result<Tensor> {
                    let mut all: Vec<Tensor> = parts
                        .iter()
                        .map(|c| {
                            let (k, v) = c.parts();
                            Ok([k, v][kv].squeeze(0)?)
                        })
                        .collect::<Result<_>>()?;
                    all.push(zero.clone());
                    Ok(Tensor::cat(&all, 1)?)
                };
                cache::gather(&side(0)?, &side(1)?, &cols, seqs.len(), capacity)
            })
            .collect::<Result<Vec<_>>>()?;
        // Hidden rows are in chunk order; put them back in `active` order.
        let hidden = self.in_output_order(hidden, &last_rows)?;
        let logits = self.head(w, &hidden)?;
        Ok((cache, logits))
    }

    /// One decode step for every active sequence: feeds each row's `last`
    /// token at rotary position `positions[r]`, writes its keys/values at
    /// cache column `off`, and returns the next logits. `pads[r]`: left
    /// padding of row `r` in the cache.
    fn decode_step(
        &self,
        w: &Weights,
        cache: &mut [LayerCache],
        last: &[u32],
        positions: &[usize],
        pads: &[usize],
        off: usize,
    ) -> Result<Tensor> {
        let b = last.len();
        let rope = self.rope_tables(positions, b, 1);
        // Columns before every active sequence's first real token are
        // skipped outright; the rest of the padding is hidden.
        let from = pads.iter().copied().min().unwrap_or(0);
        let first: Vec<usize> = pads.iter().map(|&p| p - from).collect();
        let mask = OnceCell::new();
        let mut x = self.embed(w, last)?;
        for (lw, c) in w.layers.iter().zip(cache.iter_mut()) {
            x = self.block(
                lw,
                &x,
                b,
                1,
                &rope,
                AttnMask::Padded {
                    pads: &first,
                    mask: &mask,
                },
                Some((c, off, from)),
            )?;
        }
        self.head(w, &x)
    }

    /// Next-token logits (unscaled, full vocabulary) after each prompt, on
    /// detached weights: for diagnostics such as the guidance influence
    /// ‖logit(·|s, g) − logit(·|s)‖.
    pub fn next_logits(&self, prompts: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        if let Some(i) = prompts.iter().position(|p| p.is_empty()) {
            return Err(ModelError::InvalidArgument(format!(
                "next_logits: prompt {i} is empty"
            )));
        }
        let w = self.inference_weights()?;
        // One prompt at a time: no padding, so the logits are exactly those
        // of the unpadded sequence.
        prompts
            .iter()
            .map(|p| {
                let (_, logits) = self.prefill(&w, &[p.as_slice()], p.len(), p.len())?;
                Ok(logits.squeeze(0)?.to_vec1::<f32>()?)
            })
            .collect()
    }

    /// Prefills `prompts`, left-padded to their own longest length `t`,
    /// into fresh caches of `capacity` columns, written right-aligned so the
    /// prompts end at column `p_len` (columns before `p_len - t` stay zero
    /// and count as padding); returns the caches and the last position's
    /// logits.
    fn prefill(
        &self,
        w: &Weights,
        prompts: &[&[u32]],
        p_len: usize,
        capacity: usize,
    ) -> Result<(Vec<LayerCache>, Tensor)> {
        let b = prompts.len();
        let t = prompts.iter().map(|p| p.len()).max().unwrap_or(1);
        let off = p_len - t;
        let pad_id = self.cfg.pad_token_id.unwrap_or(0);
        let mut ids = vec![pad_id; b * t];
        let mut positions = vec![0usize; b * t];
        // Row r, query i sees columns pad..=i (its real tokens); pad
        // queries see themselves (`AttnMask::Padded`).
        for (r, p) in prompts.iter().enumerate() {
            let pad = t - p.len();
            ids[r * t + pad..(r + 1) * t].copy_from_slice(p);
            for i in 0..t {
                positions[r * t + i] = i.saturating_sub(pad);
            }
        }
        let rope = self.rope_tables(&positions, b, t);
        let first: Vec<usize> = prompts.iter().map(|p| t - p.len()).collect();
        let mask = OnceCell::new();
        let (nkv, hd) = (self.cfg.num_key_value_heads, self.cfg.head_dim());
        let mut cache = Vec::with_capacity(w.layers.len());
        let mut x = self.embed(w, &ids)?;
        for lw in &w.layers {
            let mut c = LayerCache::zeros(b, nkv, capacity, hd, self.dtype, &self.device)?;
            x = self.block(
                lw,
                &x,
                b,
                t,
                &rope,
                AttnMask::Padded {
                    pads: &first,
                    mask: &mask,
                },
                Some((&mut c, off, off)),
            )?;
            cache.push(c);
        }
        let last = x
            .reshape((b, t, self.cfg.hidden_size))?
            .narrow(1, t - 1, 1)?
            .squeeze(1)?;
        let logits = self.head(w, &last)?;
        Ok((cache, logits))
    }
}

/// Samples one token for every active sequence (rows of `logits`, in
/// `active` order, `active[r]` indexing `out`), in row order from `rng`,
/// and returns the rows that did not emit eos.
fn sample_step(
    sampler: &Sampler,
    logits: &Tensor,
    active: &[usize],
    constraints: Option<&[TokenTrie]>,
    out: &mut [Generated],
    rng: &mut ChaCha8Rng,
) -> Result<Vec<usize>> {
    let rows: Vec<Vec<f32>> = logits.to_vec2()?;
    // The exps over the vocabulary are most of a pick: rows are prepared
    // in parallel, then drawn in order from the one RNG (the same tokens
    // as picking them one by one).
    let prepared: Vec<Prepared> = active
        .par_iter()
        .enumerate()
        .map(|(row, &i)| {
            let allowed: Option<Vec<u32>> = constraints.map(|tries| {
                let mut a = tries[i].allowed(&out[i].tokens);
                if a.is_empty() {
                    // Empty trie: nothing but eos is admissible.
                    a.push(sampler.eos);
                }
                a
            });
            sampler.prepare(&rows[row], allowed.as_deref())
        })
        .collect();
    let mut keep = Vec::with_capacity(active.len());
    for (row, (&i, p)) in active.iter().zip(&prepared).enumerate() {
        let (tok, lp) = sampler.draw(&rows[row], p, rng);
        out[i].tokens.push(tok);
        out[i].logprobs.push(lp);
        if tok == sampler.eos {
            out[i].finished = true;
        } else {
            keep.push(row);
        }
    }
    Ok(keep)
}
