//! Prefix-tree packing for scoring: sequences that share a prefix (the
//! rollouts of one task share their first prompt, every turn of an episode
//! shares the system message and the history before it, an executed expert
//! prefix repeats across a group) are scored in one packed row that holds
//! each shared prefix once.
//!
//! The packed row is the token trie of the sequences in depth-first order.
//! With the sequences sorted, that order is simply each sequence's suffix
//! after its longest common prefix (lcp) with the one before. A token sees
//! exactly its ancestors in the trie, i.e. the tokens of its own sequence
//! before it; it keeps its position in that sequence (RoPE). In depth-first
//! order a token's subtree is a contiguous range that starts at the token,
//! so one number per column says who sees it: query `i` sees column `j` iff
//! `j <= i < reach[j]`.

use std::ops::Range;

/// One packed row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::model) struct Packed {
    /// The packed tokens.
    pub ids: Vec<u32>,
    /// Each token's position in its sequences (its depth in the trie).
    pub positions: Vec<usize>,
    /// Query `i` sees column `j` iff `j <= i < reach[j]`.
    pub reach: Vec<usize>,
    /// `node[k][d]`: packed index of token `d` of the chunk's `k`-th
    /// sequence (in the order given to [`pack`]).
    pub node: Vec<Vec<usize>>,
}

/// Length of the longest common prefix of `a` and `b`.
pub(crate) fn lcp(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Packs `seqs` into one row. Sharing is found between neighbours, so the
/// caller sorts them (see [`plan`]); any order is correct.
pub(in crate::model) fn pack(seqs: &[&[u32]]) -> Packed {
    let n = seqs.len();
    // shared[k]: lcp of sequence k with sequence k - 1 (0 for the first).
    let shared: Vec<usize> = (0..n)
        .map(|k| if k == 0 { 0 } else { lcp(seqs[k - 1], seqs[k]) })
        .collect();
    let total: usize = seqs.iter().zip(&shared).map(|(s, &c)| s.len() - c).sum();
    let mut ids = Vec::with_capacity(total);
    let mut positions = Vec::with_capacity(total);
    let mut node: Vec<Vec<usize>> = Vec::with_capacity(n);
    // end[k]: one past the last packed token of sequence k's suffix.
    let mut end = Vec::with_capacity(n);
    for (k, s) in seqs.iter().enumerate() {
        let start = ids.len();
        let mut nd = Vec::with_capacity(s.len());
        if k > 0 {
            nd.extend_from_slice(&node[k - 1][..shared[k]]);
        }
        for (d, &tok) in s.iter().enumerate().skip(shared[k]) {
            nd.push(start + d - shared[k]);
            ids.push(tok);
            positions.push(d);
        }
        node.push(nd);
        end.push(ids.len());
    }
    // A token at depth d of sequence k's suffix is shared by the following
    // sequences while their running lcp stays above d.
    let mut reach = vec![0usize; total];
    for k in 0..n {
        let own = shared[k]..seqs[k].len();
        let first = end[k] - own.len();
        for r in &mut reach[first..end[k]] {
            *r = end[k];
        }
        let mut run = usize::MAX;
        for k2 in k + 1..n {
            run = run.min(shared[k2]);
            if run <= own.start {
                break;
            }
            // Depths own.start..run are shared by sequence k2.
            let upto = run.min(own.end) - own.start;
            for r in &mut reach[first..first + upto] {
                *r = end[k2];
            }
        }
    }
    Packed {
        ids,
        positions,
        reach,
        node,
    }
}

/// Orders `seqs` so that sequences sharing a prefix are neighbours
/// (lexicographic; stable) and splits that order into consecutive chunks of
/// at most `max_tokens` packed tokens each (a longer sequence is a chunk of
/// its own). Returns the order and the chunks as ranges of it.
pub(in crate::model) fn plan(
    seqs: &[&[u32]],
    max_tokens: usize,
) -> (Vec<usize>, Vec<Range<usize>>) {
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by(|&a, &b| seqs[a].cmp(seqs[b]));
    let mut chunks = Vec::new();
    let (mut start, mut tokens) = (0usize, 0usize);
    for k in 0..order.len() {
        let s = seqs[order[k]];
        let new = if k == start {
            s.len()
        } else {
            s.len() - lcp(seqs[order[k - 1]], s)
        };
        if k > start && tokens + new > max_tokens {
            chunks.push(start..k);
            start = k;
            tokens = s.len();
        } else {
            tokens += new;
        }
    }
    if start < order.len() {
        chunks.push(start..order.len());
    }
    (order, chunks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Query `i` sees `j` by the reach rule exactly when `j` is a token of
    /// one of `i`'s sequences at a depth not past `i`'s.
    fn check(seqs: &[&[u32]]) {
        let p = pack(seqs);
        let t = p.ids.len();
        for (k, s) in seqs.iter().enumerate() {
            assert_eq!(p.node[k].len(), s.len());
            for (d, &j) in p.node[k].iter().enumerate() {
                assert_eq!(p.ids[j], s[d], "token");
                assert_eq!(p.positions[j], d, "position");
            }
        }
        for i in 0..t {
            let want: Vec<usize> = {
                // i's ancestors: the nodes before it on any sequence through i.
                let mut w: Vec<usize> = seqs
                    .iter()
                    .enumerate()
                    .filter_map(|(k, _)| {
                        let d = p.node[k].iter().position(|&x| x == i)?;
                        Some(p.node[k][..=d].to_vec())
                    })
                    .flatten()
                    .collect();
                w.sort_unstable();
                w.dedup();
                w
            };
            let got: Vec<usize> = (0..=i).filter(|&j| i < p.reach[j]).collect();
            assert_eq!(got, want, "visible columns of {i} in {seqs:?}");
        }
    }

    #[test]
    fn shared_prefixes_are_packed_once_and_seen_only_by_their_subtree() {
        let a: &[u32] = &[1, 2, 3, 4, 5];
        let b: &[u32] = &[1, 2, 3, 6];
        let c: &[u32] = &[1, 2, 7, 8];
        let d: &[u32] = &[9, 9];
        let p = pack(&[a, b, c, d]);
        assert_eq!(p.ids, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 9]);
        assert_eq!(p.positions, vec![0, 1, 2, 3, 4, 3, 2, 3, 0, 1]);
        assert_eq!(p.reach, vec![8, 8, 6, 5, 5, 6, 8, 8, 10, 10]);
        assert_eq!(p.node[1], vec![0, 1, 2, 5]);
        check(&[a, b, c, d]);
        // Duplicates, a sequence that is a prefix of the next, no sharing.
        check(&[a, a, b]);
        check(&[&a[..3], a, b]);
        check(&[d, a]);
        check(&[a]);
        // Unsorted input: correct, with less sharing.
        check(&[a, c, b]);
        assert_eq!(pack(&[a, c, b]).ids.len(), 5 + 2 + 2);
    }

    #[test]
    fn plan_sorts_neighbours_together_and_bounds_chunks() {
        let seqs: Vec<&[u32]> = vec![&[5, 1], &[1, 2, 3], &[5, 2], &[1, 2, 4]];
        let (order, chunks) = plan(&seqs, 4);
        assert_eq!(order, vec![1, 3, 0, 2]);
        // [1,2,3] + [4] = 4 tokens; then [5,1] + [2] = 3.
        assert_eq!(chunks, vec![0..2, 2..4]);
        let (_, chunks) = plan(&seqs, 100);
        assert_eq!(chunks, vec![0..4]);
        // A sequence longer than the budget is a chunk of its own.
        let (_, chunks) = plan(&seqs, 1);
        assert_eq!(chunks, vec![0..1, 1..2, 2..3, 3..4]);
        assert!(plan(&[], 4).1.is_empty());
    }
}
