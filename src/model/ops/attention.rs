//! Fused attention for the f32 CPU path: `softmax(q kᵀ · scale + mask) v`
//! one block of query rows at a time on the run-time BLAS, so the `(t, s)`
//! scores and probabilities are never tensors and are not kept for the
//! backward. The forward saves one log-sum-exp per query row; the backward
//! recomputes each block's probabilities from it (flash attention's scheme).
//! A block multiplies only the key columns its rows can see, so a causal
//! mask skips about half the work; under a packed prefix tree's mask
//! ([`Visible::Tree`]) a block gathers just the columns its rows see.
//! Grouped-query heads read their kv head in place, and the KV cache's
//! strided views are read without a copy.
//!
//! Without a BLAS, or off the f32 CPU path, [`attention`] returns `None`
//! and the caller takes the composite ops (batched products and
//! [`super::causal_softmax`]), which compute the same function.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::blas::{blas, Blas};
use super::expf::exp_in_place;
use super::{f32_data, f32_slice, fused};
use crate::model::error::Result;

/// Whether attention runs fused on this machine's CPU f32 path (a BLAS is
/// loaded): no `(t, t)` scores are kept for the backward.
pub fn fused_attention_available() -> bool {
    blas().is_some()
}

/// Query rows per block: the scratch of a block is `ROWS × s` floats.
const ROWS: usize = 64;

/// Which key columns a query sees, beyond causality (column `hi = i + s -
/// q_len` is query position `i`'s own).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Visible<'a> {
    /// Columns `0 ..= hi`.
    Causal,
    /// Left padding: columns `pads[batch row] ..= hi`; a row whose pad lies
    /// past `hi` sees column `hi` alone (a pad query: finite, never read).
    Pads(&'a [usize]),
    /// A packed prefix tree (`q_len == s`): column `j <= hi` is seen iff
    /// `hi < reach[batch row * s + j]`.
    Tree(&'a [usize]),
}

/// Fused attention of `q` `(b, n_kv, rep * q_len, hd)` (query head
/// `g * rep + r` of kv head `g`, rows ordered `(r, position)`) over `k`, `v`
/// `(b, n_kv, s, hd)`, `s >= q_len`, query position `i` seeing the columns
/// `vis` allows up to `i + s - q_len`. Returns `(b, n_kv, rep * q_len, hd)`,
/// differentiable in `q`, `k`, `v`; `None` where the fused path does not
/// apply.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    q_len: usize,
    vis: Visible<'_>,
) -> Result<Option<Tensor>> {
    let Some(blas) = blas() else { return Ok(None) };
    if !(fused(q) && fused(k) && fused(v)) || q.rank() != 4 {
        return Ok(None);
    }
    let (b, nkv, rq, hd) = q.dims4()?;
    let s = k.dim(2)?;
    let shapes_fit = k.dims() == [b, nkv, s, hd]
        && v.dims() == k.dims()
        && q_len > 0
        && rq.is_multiple_of(q_len)
        && s >= q_len
        && match vis {
            Visible::Causal => true,
            Visible::Pads(p) => p.len() == b,
            Visible::Tree(r) => r.len() == b * s && s == q_len,
        };
    if !shapes_fit || !KvView::fits(k.layout()) || !KvView::fits(v.layout()) {
        return Ok(None);
    }
    let op = Attention {
        blas,
        scale: scale as f32,
        q_len,
        mask: match vis {
            Visible::Causal => Mask::Causal,
            Visible::Pads(p) => Mask::Pads(Arc::new(p.to_vec())),
            Visible::Tree(r) => Mask::Tree(Arc::new(r.to_vec())),
        },
        lse: Mutex::new(None),
    };
    Ok(Some(q.contiguous()?.apply_op3(k, v, op)?))
}

/// Per-(batch, kv head) matrices of a `(b, n_kv, s, hd)` view with unit
/// stride along `hd`: unit `(bi, g)` starts at `start + bi * sb + g * sg`,
/// row `j` of it `ld` further per row.
#[derive(Clone, Copy)]
struct KvView {
    start: usize,
    sb: usize,
    sg: usize,
    ld: usize,
    nkv: usize,
}

impl KvView {
    fn fits(l: &Layout) -> bool {
        l.dims().len() == 4 && (l.stride()[3] == 1 || l.dims()[3] == 1)
    }

    fn of(l: &Layout) -> KvView {
        let st = l.stride();
        KvView {
            start: l.start_offset(),
            sb: st[0],
            sg: st[1],
            ld: st[2],
            nkv: l.dims()[1],
        }
    }

    /// Offset of unit `u = bi * n_kv + g`, key column `c0`.
    fn at(&self, u: usize, c0: usize) -> usize {
        self.start + (u / self.nkv) * self.sb + (u % self.nkv) * self.sg + c0 * self.ld
    }
}

/// [`Visible`], owned by the op (its backward runs later).
enum Mask {
    Causal,
    Pads(Arc<Vec<usize>>),
    Tree(Arc<Vec<usize>>),
}

struct Attention {
    blas: &'static Blas,
    scale: f32,
    q_len: usize,
    mask: Mask,
    /// Per query row, `log Σ exp(scale · score)` over its visible columns,
    /// saved by the forward for the backward.
    lse: Mutex<Option<Arc<Vec<f32>>>>,
}

/// The shape of one call: `units` = b · n_kv matrices of `rq` query rows
/// and `s` key columns.
#[derive(Clone, Copy)]
struct Dims {
    nkv: usize,
    rq: usize,
    s: usize,
    hd: usize,
    q_len: usize,
}

impl Attention {
    fn dims(&self, lq: &Layout, lk: &Layout) -> Dims {
        let d = lq.dims();
        Dims {
            nkv: d[1],
            rq: d[2],
            s: lk.dims()[2],
            hd: d[3],
            q_len: self.q_len,
        }
    }

    /// The key columns block `r0..r0 + m` of unit `u` multiplies.
    fn block(&self, d: Dims, u: usize, r0: usize, m: usize) -> Block<'_> {
        // Row rr's own column: the last it may see.
        let hi = |rr: usize| rr % d.q_len + d.s - d.q_len;
        match &self.mask {
            Mask::Causal | Mask::Pads(_) => {
                let rows: Vec<(usize, usize)> = (r0..r0 + m)
                    .map(|rr| {
                        let hi = hi(rr);
                        let lo = match &self.mask {
                            Mask::Pads(p) => p[u / d.nkv].min(hi),
                            _ => 0,
                        };
                        (lo, hi)
                    })
                    .collect();
                let c0 = rows.iter().map(|v| v.0).min().unwrap_or(0);
                let c1 = rows.iter().map(|v| v.1 + 1).max().unwrap_or(0);
                Block {
                    c0,
                    n: c1 - c0,
                    rows,
                    tree: None,
                }
            }
            Mask::Tree(reach) => {
                let bi = u / d.nkv;
                let reach = &reach[bi * d.s..(bi + 1) * d.s];
                let rows: Vec<(usize, usize)> = (r0..r0 + m).map(|rr| (0, hi(rr))).collect();
                let lo = rows.iter().map(|v| v.1).min().unwrap_or(0);
                let top = rows.iter().map(|v| v.1).max().unwrap_or(0);
                // Every column some row of the block sees (a superset per
                // row; `sees` tells them apart).
                let cols: Vec<usize> = (0..=top).filter(|&c| reach[c] > lo).collect();
                Block {
                    c0: 0,
                    n: cols.len(),
                    rows,
                    tree: Some((cols, reach)),
                }
            }
        }
    }
}

/// The key columns one block of query rows multiplies.
struct Block<'a> {
    /// Causal and padded masks: the block reads columns `c0..c0 + n` of
    /// the keys in place.
    c0: usize,
    n: usize,
    /// Per row `(lo, hi)`: it sees columns `lo..=hi` (a tree row: `hi` is
    /// its own column).
    rows: Vec<(usize, usize)>,
    /// A tree mask: the `n` columns the block gathers (ascending) and the
    /// batch row's `reach`.
    tree: Option<(Vec<usize>, &'a [usize])>,
}

impl Block<'_> {
    /// Whether row `r` of the block sees its `jj`-th column.
    fn sees(&self, r: usize, jj: usize) -> bool {
        let (lo, hi) = self.rows[r];
        match &self.tree {
            Some((cols, reach)) => cols[jj] <= hi && hi < reach[cols[jj]],
            None => (lo..=hi).contains(&(self.c0 + jj)),
        }
    }

    /// Softmax of row `r`'s scores `row` in place over the columns it sees;
    /// returns the log-sum-exp.
    fn softmax(&self, r: usize, row: &mut [f32], scale: f32) -> f32 {
        match &self.tree {
            None => {
                let (lo, hi) = self.rows[r];
                softmax_row(row, lo - self.c0, hi - self.c0, scale)
            }
            Some(_) => {
                for (jj, x) in row.iter_mut().enumerate() {
                    if !self.sees(r, jj) {
                        *x = f32::NEG_INFINITY;
                    }
                }
                softmax_row(row, 0, row.len() - 1, scale)
            }
        }
    }

    /// The block's keys (or values) `x` of unit `u` as (slice, row
    /// stride): in place, or gathered into `buf`.
    fn keys<'b>(
        &self,
        x: &'b [f32],
        view: KvView,
        u: usize,
        hd: usize,
        buf: &'b mut Vec<f32>,
    ) -> (&'b [f32], usize) {
        match &self.tree {
            None => (&x[view.at(u, self.c0)..], view.ld),
            Some((cols, _)) => {
                buf.clear();
                for &c in cols {
                    let at = view.at(u, c);
                    buf.extend_from_slice(&x[at..at + hd]);
                }
                (&buf[..], hd)
            }
        }
    }

    /// Accumulates the block's `n × hd` gradient rows into the unit's
    /// `(s, hd)` gradient `dst`: `acc` adds them (beta = 1) to the slice it
    /// is given, `dst`'s own rows in place, or a zeroed scratch that is then
    /// scattered to the gathered columns.
    fn accumulate(&self, dst: &mut [f32], hd: usize, acc: impl FnOnce(&mut [f32])) {
        match &self.tree {
            None => acc(&mut dst[self.c0 * hd..]),
            Some((cols, _)) => {
                let mut g = vec![0f32; self.n * hd];
                acc(&mut g);
                for (row, &c) in g.chunks(hd).zip(cols) {
                    for (d, x) in dst[c * hd..(c + 1) * hd].iter_mut().zip(row) {
                        *d += x;
                    }
                }
            }
        }
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "actguide-attention"
    }

    fn cpu_fwd(
        &self,
        sq: &CpuStorage,
        lq: &Layout,
        sk: &CpuStorage,
        lk: &Layout,
        sv: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        // k and v are strided views of the cache (see `KvView`); q is
        // contiguous.
        let q = f32_slice(sq, lq, self.name())?;
        let (k, v) = (f32_data(sk, self.name())?, f32_data(sv, self.name())?);
        let d = self.dims(lq, lk);
        let (kv, vv) = (KvView::of(lk), KvView::of(lv));
        let (rq, hd) = (d.rq, d.hd);
        let mut out = vec![0f32; q.len()];
        let mut lse = vec![0f32; q.len() / hd.max(1)];
        if out.is_empty() || hd == 0 {
            *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(lse));
            return Ok((CpuStorage::F32(out), lq.shape().clone()));
        }
        let blas = self.blas;
        out.par_chunks_mut(rq * hd)
            .zip(lse.par_chunks_mut(rq))
            .enumerate()
            .for_each(|(u, (ou, lu))| {
                ou.par_chunks_mut(ROWS * hd)
                    .zip(lu.par_chunks_mut(ROWS))
                    .enumerate()
                    .for_each(|(bk, (ob, lb))| {
                        let (r0, m) = (bk * ROWS, lb.len());
                        let blk = self.block(d, u, r0, m);
                        let n = blk.n;
                        let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
                        let (kb, kld) = blk.keys(k, kv, u, hd, &mut kbuf);
                        let (vb, vld) = blk.keys(v, vv, u, hd, &mut vbuf);
                        let qb = &q[(u * rq + r0) * hd..];
                        let mut p = vec![0f32; m * n];
                        blas.gemm_serial(
                            (false, true),
                            (m, n, hd),
                            (qb, hd),
                            (kb, kld),
                            (&mut p, n),
                            0.0,
                        );
                        for (r, (row, l)) in p.chunks_mut(n).zip(lb.iter_mut()).enumerate() {
                            *l = blk.softmax(r, row, self.scale);
                        }
                        blas.gemm_serial(
                            (false, false),
                            (m, hd, n),
                            (&p, n),
                            (vb, vld),
                            (ob, hd),
                            0.0,
                        );
                    });
            });
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(lse));
        Ok((CpuStorage::F32(out), lq.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(lse) = self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone() else {
            candle_core::bail!("actguide-attention: backward before forward")
        };
        let (o, g) = (res.contiguous()?, grad_res.contiguous()?);
        let (sq, lq) = q.storage_and_layout();
        let (sk, lk) = k.storage_and_layout();
        let (sv, lv) = v.storage_and_layout();
        let (so, lo) = o.storage_and_layout();
        let (sg, lg) = g.storage_and_layout();
        fn f32s(s: &Storage) -> Option<&[f32]> {
            match s {
                Storage::Cpu(CpuStorage::F32(x)) => Some(x.as_slice()),
                _ => None,
            }
        }
        let (Some(qa), Some(ka), Some(va), Some(oa), Some(ga)) =
            (f32s(&sq), f32s(&sk), f32s(&sv), f32s(&so), f32s(&sg))
        else {
            candle_core::bail!("actguide-attention: f32 CPU tensors only")
        };
        let (Some((q0, q1)), Some((o0, o1)), Some((g0, g1))) = (
            lq.contiguous_offsets(),
            lo.contiguous_offsets(),
            lg.contiguous_offsets(),
        ) else {
            candle_core::bail!("actguide-attention: q, output and gradient must be contiguous")
        };
        let grads = self.backward(
            (&qa[q0..q1], lq),
            (ka, lk),
            (va, lv),
            &oa[o0..o1],
            &ga[g0..g1],
            &lse,
        );
        let dev = Device::Cpu;
        let wrap = |t: &Tensor, x: Vec<f32>| -> candle_core::Result<Option<Tensor>> {
            Ok(if t.track_op() {
                Some(Tensor::from_vec(x, t.shape(), &dev)?)
            } else {
                None
            })
        };
        let (dq, dk, dv) = grads;
        Ok((wrap(q, dq)?, wrap(k, dk)?, wrap(v, dv)?))
    }
}

impl Attention {
    /// `(dq, dk, dv)`, unit by unit (a unit owns its kv head's `dk`, `dv`
    /// rows, accumulated over its query blocks).
    fn backward(
        &self,
        (q, lq): (&[f32], &Layout),
        (k, lk): (&[f32], &Layout),
        (v, lv): (&[f32], &Layout),
        o: &[f32],
        g: &[f32],
        lse: &[f32],
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = self.dims(lq, lk);
        let (kv, vv) = (KvView::of(lk), KvView::of(lv));
        let (rq, s, hd) = (d.rq, d.s, d.hd);
        let mut dq = vec![0f32; q.len()];
        let units = q.len().checked_div(rq * hd).unwrap_or(0);
        let mut dk = vec![0f32; units * s * hd];
        let mut dv = vec![0f32; units * s * hd];
        if units == 0 || s == 0 {
            return (dq, dk, dv);
        }
        let blas = self.blas;
        dq.par_chunks_mut(rq * hd)
            .zip(dk.par_chunks_mut(s * hd))
            .zip(dv.par_chunks_mut(s * hd))
            .enumerate()
            .for_each(|(u, ((dqu, dku), dvu))| {
                for r0 in (0..rq).step_by(ROWS) {
                    let m = ROWS.min(rq - r0);
                    let blk = self.block(d, u, r0, m);
                    let n = blk.n;
                    let row0 = u * rq + r0;
                    let (qb, ob, gb) = (
                        &q[row0 * hd..(row0 + m) * hd],
                        &o[row0 * hd..(row0 + m) * hd],
                        &g[row0 * hd..(row0 + m) * hd],
                    );
                    let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
                    let (ku, kld) = blk.keys(k, kv, u, hd, &mut kbuf);
                    let (vu, vld) = blk.keys(v, vv, u, hd, &mut vbuf);
                    // P from the saved log-sum-exp.
                    let mut p = vec![0f32; m * n];
                    blas.gemm_serial(
                        (false, true),
                        (m, n, hd),
                        (qb, hd),
                        (ku, kld),
                        (&mut p, n),
                        0.0,
                    );
                    for (i, row) in p.chunks_mut(n).enumerate() {
                        let l = lse[row0 + i];
                        for (j, x) in row.iter_mut().enumerate() {
                            *x = if blk.sees(i, j) {
                                *x * self.scale - l
                            } else {
                                f32::NEG_INFINITY
                            };
                        }
                        exp_in_place(row);
                    }
                    // dV += Pᵀ dO.
                    blk.accumulate(dvu, hd, |dvb| {
                        blas.gemm_serial(
                            (true, false),
                            (n, hd, m),
                            (&p, n),
                            (gb, hd),
                            (dvb, hd),
                            1.0,
                        )
                    });
                    // dS = scale · P ⊙ (dO Vᵀ − rowsum(dO ⊙ O)).
                    let mut ds = vec![0f32; m * n];
                    blas.gemm_serial(
                        (false, true),
                        (m, n, hd),
                        (gb, hd),
                        (vu, vld),
                        (&mut ds, n),
                        0.0,
                    );
                    for (i, (dsr, pr)) in ds.chunks_mut(n).zip(p.chunks(n)).enumerate() {
                        let dot: f32 = gb[i * hd..(i + 1) * hd]
                            .iter()
                            .zip(&ob[i * hd..(i + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum();
                        for (x, &pv) in dsr.iter_mut().zip(pr) {
                            *x = self.scale * pv * (*x - dot);
                        }
                    }
                    // dQ = dS K, dK += dSᵀ Q.
                    blas.gemm_serial(
                        (false, false),
                        (m, hd, n),
                        (&ds, n),
                        (ku, kld),
                        (&mut dqu[r0 * hd..], hd),
                        0.0,
                    );
                    blk.accumulate(dku, hd, |dkb| {
                        blas.gemm_serial(
                            (true, false),
                            (n, hd, m),
                            (&ds, n),
                            (qb, hd),
                            (dkb, hd),
                            1.0,
                        )
                    });
                }
            });
        (dq, dk, dv)
    }
}

/// Softmax of `scale · row` over columns `lo..=hi` in place (0 elsewhere);
/// returns the log-sum-exp `log Σ exp(scale · x)` over those columns.
fn softmax_row(row: &mut [f32], lo: usize, hi: usize, scale: f32) -> f32 {
    let mx = row[lo..=hi]
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x));
    let span = &mut row[lo..=hi];
    for x in span.iter_mut() {
        *x = (*x - mx) * scale;
    }
    exp_in_place(span);
    let sum = span.iter().fold(0f32, |s, &e| s + e);
    let inv = 1.0 / sum;
    for x in &mut row[lo..=hi] {
        *x *= inv;
    }
    row[..lo].fill(0.0);
    row[hi + 1..].fill(0.0);
    mx * scale + sum.ln()
}
