//! The training path: differentiable log-probs and entropies of target
//! tokens ([`Policy::score`]).

use candle_core::{DType, Tensor};

use std::cell::OnceCell;
use std::collections::HashMap;

use super::block::AttnMask;
use super::{pack, Policy, Weights};
use crate::model::error::{ModelError, Result};
use crate::model::ops;

/// Sequences to score, right-padded internally.
#[derive(Debug, Clone, Default)]
pub struct ScoreBatch {
    /// Full token sequences (prompt + completion).
    pub seqs: Vec<Vec<u32>>,
    /// `targets[i]`: positions `p` (`1 <= p < seqs[i].len()`) whose token
    /// `seqs[i][p]` is scored given `seqs[i][..p]`, in the order they should
    /// appear in the output.
    pub targets: Vec<Vec<usize>>,
    /// Logits are divided by this before the softmax; use the sampling
    /// temperature so scores match the behaviour log-probs.
    pub temperature: f64,
    /// Score sequences that share a prefix in one packed row holding the
    /// prefix once (see [`Policy::score`]). The same numbers up to float
    /// rounding; fewer tokens through the trunk.
    pub share_prefixes: bool,
}

impl ScoreBatch {
    /// Total number of scored tokens (`N` in [`ScoreOutput`]).
    pub fn num_targets(&self) -> usize {
        self.targets.iter().map(Vec::len).sum()
    }
}

/// Result of [`Policy::score`]; both tensors are part of the autograd graph
/// when the policy is trainable.
#[derive(Debug, Clone)]
pub struct ScoreOutput {
    /// `(N,)` f32: log-prob of each target token, targets flattened in order
    /// (sequence 0's targets, then sequence 1's, ...).
    pub logp: Tensor,
    /// `(N,)` f32: entropy of the full next-token distribution (at the same
    /// temperature) at each target.
    pub entropy: Tensor,
    /// Tokens the trunk ran: every sequence up to its last target, padding
    /// included, a shared prefix once with `share_prefixes`.
    pub trunk_tokens: usize,
}

impl Policy {
    /// Log-probs (and entropies) of the target tokens, differentiable with
    /// respect to every parameter.
    ///
    /// Sequences are right-padded (a causal mask suffices: real positions
    /// never see the padding after them) and truncated after their last
    /// target's context, the trunk runs once, and only the hidden rows that
    /// predict a target are gathered before the final norm and LM head, so
    /// the `(N, vocab)` logits are the only vocabulary-sized activations.
    ///
    /// With `share_prefixes`, sequences are instead sorted so that those
    /// sharing a prefix are neighbours and packed, chunk by chunk, into
    /// rows that hold their token trie: each shared prefix runs through the
    /// trunk once, each token attends to its own sequence's tokens alone
    /// and keeps its own position.
    pub fn score(&self, batch: &ScoreBatch) -> Result<ScoreOutput> {
        self.score_impl(batch, false)
    }

    /// [`Policy::score`] without an autograd graph: the same numbers, but
    /// each activation is freed as soon as the next op has read it (a
    /// tracked score of a few thousand tokens keeps GBs of activations
    /// alive for a backward that never comes). For π_old rescoring and
    /// diagnostics.
    pub fn score_detached(&self, batch: &ScoreBatch) -> Result<ScoreOutput> {
        self.score_impl(batch, true)
    }

    fn score_impl(&self, batch: &ScoreBatch, detached: bool) -> Result<ScoreOutput> {
        let rows = self.score_rows(batch)?;
        let n_targets = batch.num_targets();
        if n_targets == 0 {
            let empty = Tensor::zeros(0, DType::F32, &self.device)?;
            return Ok(ScoreOutput {
                logp: empty.clone(),
                entropy: empty,
                trunk_tokens: 0,
            });
        }
        // Cast once per call (a no-op in f32): the trunk and the head share it.
        let mut w = self.compute_weights()?;
        if detached {
            w = w.map(&|t| Ok(t.detach()))?;
        }
        let w = &w;
        let heads = if batch.share_prefixes {
            self.packed_hidden(w, batch, &rows, n_targets)?
        } else {
            self.target_hidden(w, batch, &rows, n_targets)?
        };
        #[cfg(test)]
        HEAD_ROWS_SCORED.with(|c| c.set(c.get() + heads.labels.len()));
        let logits = self.head(w, &heads.hidden)?;
        let mut both = ops::logp_entropy(&logits, &heads.labels, 1.0 / batch.temperature)?;
        if let Some(rows) = heads.expand {
            let n = rows.len();
            both = both
                .contiguous()?
                .index_select(&Tensor::from_vec(rows, n, &self.device)?, 0)?;
        }
        let trunk_tokens = heads.trunk_tokens;
        let logp = both.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?;
        let entropy = both.narrow(1, 1, 1)?.squeeze(1)?.contiguous()?;
        Ok(ScoreOutput {
            logp,
            entropy,
            trunk_tokens,
        })
    }

    /// Checks `batch`; returns the rows that have targets as (sequence,
    /// length of the sequence they need: up to their last target).
    fn score_rows(&self, batch: &ScoreBatch) -> Result<Vec<(usize, usize)>> {
        if batch.seqs.len() != batch.targets.len() {
            return Err(ModelError::InvalidArgument(format!(
                "score: {} sequences but {} target lists",
                batch.seqs.len(),
                batch.targets.len()
            )));
        }
        if !(batch.temperature.is_finite() && batch.temperature > 0.0) {
            return Err(ModelError::InvalidArgument(format!(
                "score: temperature must be > 0, got {}",
                batch.temperature
            )));
        }
        let mut rows: Vec<(usize, usize)> = Vec::new();
        for (i, (s, tg)) in batch.seqs.iter().zip(&batch.targets).enumerate() {
            for &p in tg {
                if p == 0 || p >= s.len() {
                    return Err(ModelError::InvalidArgument(format!(
                        "score: target position {p} out of range 1..{} in sequence {i}",
                        s.len()
                    )));
                }
                if s[p] as usize >= self.cfg.vocab_size {
                    return Err(ModelError::InvalidArgument(format!(
                        "token id {} outside the vocabulary (vocab_size {})",
                        s[p], self.cfg.vocab_size
                    )));
                }
            }
            if let Some(&maxp) = tg.iter().max() {
                rows.push((i, maxp));
            }
        }
        Ok(rows)
    }

    /// Runs the trunk (weights `w`) over `rows` (see [`Policy::score_rows`]) chunk by
    /// chunk, longest first, and returns the pre-norm hidden rows that
    /// predict the `n_targets` targets, in output order, and the number of
    /// tokens it ran.
    fn target_hidden(
        &self,
        w: &Weights,
        batch: &ScoreBatch,
        rows: &[(usize, usize)],
        n_targets: usize,
    ) -> Result<HeadRows> {
        let first = first_outputs(batch, rows);
        // Longest first, so each chunk is padded only to its own longest.
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&r| std::cmp::Reverse(rows[r].1));
        let lens: Vec<usize> = order.iter().map(|&r| rows[r].1).collect();
        let mut parts = Vec::new();
        let mut tokens = 0;
        // gathered[k] = output position of the k-th gathered hidden row.
        let mut gathered = Vec::with_capacity(n_targets);
        for chunk in self.plan_chunks(&lens) {
            let rs = &order[chunk];
            let (b, t) = (rs.len(), rows[rs[0]].1);
            tokens += b * t;
            let mut ids = vec![0u32; b * t];
            let mut sel = Vec::new();
            for (k, &r) in rs.iter().enumerate() {
                let (i, len) = rows[r];
                ids[k * t..k * t + len].copy_from_slice(&batch.seqs[i][..len]);
                for (j, &p) in batch.targets[i].iter().enumerate() {
                    sel.push((k * t + p - 1) as u32);
                    gathered.push(first[r] + j);
                }
            }
            let positions: Vec<usize> = (0..t).collect();
            let rope = self.rope_tables(&positions, 1, t);
            parts.push(self.trunk_rows(w, &ids, (b, t), &rope, AttnMask::Causal, sel)?);
        }
        Ok(HeadRows {
            hidden: self.in_output_order(parts, &gathered)?,
            labels: output_labels(batch),
            expand: None,
            trunk_tokens: tokens,
        })
    }

    /// [`Policy::target_hidden`] over packed prefix trees: rows sorted so
    /// that sequences sharing a prefix are neighbours, each chunk of them
    /// one packed row (`pack`), masked so every token sees its own
    /// sequence alone.
    ///
    /// In a large model, a target that another one in the same packed row
    /// repeats (the same token after the same prefix: a group's rollouts
    /// that replay the same expert turns) goes through the LM head once,
    /// and its log-prob and entropy are copied to each (their gradients
    /// summed): on SmolLM2's 8 × 8 household step, 1,011 head rows for
    /// 4,566 targets. Small models keep one row per target, so the built-in
    /// tiny model's runs stay bit-identical.
    fn packed_hidden(
        &self,
        w: &Weights,
        batch: &ScoreBatch,
        rows: &[(usize, usize)],
        n_targets: usize,
    ) -> Result<HeadRows> {
        let first = first_outputs(batch, rows);
        let seqs: Vec<&[u32]> = rows.iter().map(|&(i, len)| &batch.seqs[i][..len]).collect();
        let (order, chunks) = pack::plan(&seqs, self.packed_tokens());
        let dedup = self.is_large();
        let mut parts = Vec::new();
        let mut tokens = 0;
        let mut gathered = Vec::with_capacity(n_targets);
        // With `dedup`: each head row's label, and each output's head row.
        let mut labels = Vec::new();
        let mut expand = vec![0u32; if dedup { n_targets } else { 0 }];
        for chunk in chunks {
            let rs = &order[chunk];
            let chunk_seqs: Vec<&[u32]> = rs.iter().map(|&r| seqs[r]).collect();
            let p = pack::pack(&chunk_seqs);
            let mut sel = Vec::new();
            let mut seen: HashMap<(usize, u32), u32> = HashMap::new();
            for (k, &r) in rs.iter().enumerate() {
                let i = rows[r].0;
                for (j, &pos) in batch.targets[i].iter().enumerate() {
                    let node = p.node[k][pos - 1];
                    if dedup {
                        let label = batch.seqs[i][pos];
                        let row = *seen.entry((node, label)).or_insert_with(|| {
                            sel.push(node as u32);
                            labels.push(label);
                            (labels.len() - 1) as u32
                        });
                        expand[first[r] + j] = row;
                    } else {
                        sel.push(node as u32);
                        gathered.push(first[r] + j);
                    }
                }
            }
            let t = p.ids.len();
            tokens += t;
            let rope = self.rope_tables(&p.positions, 1, t);
            let mask = OnceCell::new();
            let tree = AttnMask::Tree {
                reach: &p.reach,
                mask: &mask,
            };
            parts.push(self.trunk_rows(w, &p.ids, (1, t), &rope, tree, sel)?);
        }
        if dedup {
            return Ok(HeadRows {
                hidden: Tensor::cat(&parts, 0)?,
                labels,
                expand: Some(expand),
                trunk_tokens: tokens,
            });
        }
        debug_assert_eq!(gathered.len(), n_targets);
        Ok(HeadRows {
            hidden: self.in_output_order(parts, &gathered)?,
            labels: output_labels(batch),
            expand: None,
            trunk_tokens: tokens,
        })
    }

    /// Runs the trunk over `ids` (`b` rows of `t` tokens) and keeps the
    /// hidden rows `sel` (indices into the `b * t` rows).
    fn trunk_rows(
        &self,
        w: &Weights,
        ids: &[u32],
        (b, t): (usize, usize),
        rope: &ops::RopeTables,
        mask: AttnMask<'_>,
        sel: Vec<u32>,
    ) -> Result<Tensor> {
        let mut x = self.embed(w, ids)?;
        for lw in &w.layers {
            x = self.block(lw, &x, b, t, rope, mask, None)?;
        }
        let n = sel.len();
        Ok(x.index_select(&Tensor::from_vec(sel, n, &self.device)?, 0)?)
    }

    /// Concatenates the gathered hidden rows `parts` and puts them back in
    /// output order (targets flattened sequence by sequence);
    /// `gathered[k]` is the output position of the `k`-th row.
    pub(super) fn in_output_order(
        &self,
        mut parts: Vec<Tensor>,
        gathered: &[usize],
    ) -> Result<Tensor> {
        let hidden = if parts.len() == 1 {
            parts.pop().expect("one part")
        } else {
            Tensor::cat(&parts, 0)?
        };
        let n = gathered.len();
        let mut perm = vec![0u32; n];
        for (k, &o) in gathered.iter().enumerate() {
            perm[o] = k as u32;
        }
        let is_identity = perm.iter().enumerate().all(|(k, &p)| p as usize == k);
        Ok(if is_identity {
            hidden
        } else {
            hidden.index_select(&Tensor::from_vec(perm, n, &self.device)?, 0)?
        })
    }
}

#[cfg(test)]
thread_local! {
    /// Rows this thread's scoring passed through the LM head.
    pub(super) static HEAD_ROWS_SCORED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The hidden rows the LM head scores, and how its results map to the
/// targets.
struct HeadRows {
    /// `(rows, hidden)`: the pre-norm hidden rows that predict targets.
    hidden: Tensor,
    /// The token each row scores.
    labels: Vec<u32>,
    /// Each target's row (targets flattened sequence by sequence), where
    /// rows are shared; `None` where row `k` is target `k`'s.
    expand: Option<Vec<u32>>,
    /// Tokens the trunk ran.
    trunk_tokens: usize,
}

/// The target tokens, flattened sequence by sequence.
fn output_labels(batch: &ScoreBatch) -> Vec<u32> {
    batch
        .seqs
        .iter()
        .zip(&batch.targets)
        .flat_map(|(s, tg)| tg.iter().map(move |&p| s[p]))
        .collect()
}

/// Output offset of each row's first target.
fn first_outputs(batch: &ScoreBatch, rows: &[(usize, usize)]) -> Vec<usize> {
    rows.iter()
        .scan(0usize, |acc, &(i, _)| {
            let at = *acc;
            *acc += batch.targets[i].len();
            Some(at)
        })
        .collect()
}
