//! The per-layer KV cache of a generation batch: preallocated
//! `(B, n_kv, capacity, head_dim)` buffers written in place, joined across
//! prefill chunks and compacted when sequences finish.

use candle_core::{DType, Device, Tensor};

use crate::model::error::Result;

/// Per-layer KV cache of a generation batch: `(B, n_kv, capacity, head_dim)`
/// buffers written in place with `slice_set`.
pub(super) struct LayerCache {
    k: Tensor,
    v: Tensor,
}

impl LayerCache {
    /// Zeroed buffers for `b` sequences (zero columns count as padding).
    pub(super) fn zeros(
        b: usize,
        n_kv: usize,
        capacity: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<LayerCache> {
        Ok(LayerCache {
            k: Tensor::zeros((b, n_kv, capacity, head_dim), dtype, device)?,
            v: Tensor::zeros((b, n_kv, capacity, head_dim), dtype, device)?,
        })
    }

    /// Writes keys/values `(b, n_kv, t, head_dim)` at column `off` and
    /// returns the cached keys and values of columns `from..off + t`.
    pub(super) fn write(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        off: usize,
        from: usize,
    ) -> Result<(Tensor, Tensor)> {
        let t = k.dim(2)?;
        self.k.slice_set(k, 2, off)?;
        self.v.slice_set(v, 2, off)?;
        let s = off + t - from;
        Ok((self.k.narrow(2, from, s)?, self.v.narrow(2, from, s)?))
    }

    /// The whole key and value buffers.
    pub(super) fn parts(&self) -> (&Tensor, &Tensor) {
        (&self.k, &self.v)
    }
}

/// A batch cache gathered from packed prefills (see the shared prefill in
/// `generate`): `k`, `v` are `(n_kv, s, head_dim)` and `cols` holds, per
/// batch row and column, the column of them to take (`s - 1`: a zero
/// column, which counts as padding); `rows * capacity` entries.
pub(super) fn gather(
    k: &Tensor,
    v: &Tensor,
    cols: &Tensor,
    rows: usize,
    capacity: usize,
) -> Result<LayerCache> {
    let take = |x: &Tensor| -> Result<Tensor> {
        let (nkv, _, hd) = x.dims3()?;
        Ok(x.index_select(cols, 1)?
            .reshape((nkv, rows, capacity, hd))?
            .transpose(0, 1)?
            .contiguous()?)
    };
    Ok(LayerCache {
        k: take(k)?,
        v: take(v)?,
    })
}

/// Joins the caches of consecutive prefill chunks (each `layers` long, same
/// capacity) into one batch, in chunk order.
pub(super) fn concat(mut caches: Vec<Vec<LayerCache>>, layers: usize) -> Result<Vec<LayerCache>> {
    if caches.len() == 1 {
        return Ok(caches.pop().unwrap_or_default());
    }
    (0..layers)
        .map(|l| {
            let ks: Vec<&Tensor> = caches.iter().map(|c| &c[l].k).collect();
            let vs: Vec<&Tensor> = caches.iter().map(|c| &c[l].v).collect();
            Ok(LayerCache {
                k: Tensor::cat(&ks, 0)?,
                v: Tensor::cat(&vs, 0)?,
            })
        })
        .collect()
}

/// Keeps batch rows `keep` (in that order) of every layer's cache.
pub(super) fn compact(cache: &mut [LayerCache], keep: &[usize], device: &Device) -> Result<()> {
    let idx = Tensor::from_vec(
        keep.iter().map(|&r| r as u32).collect::<Vec<_>>(),
        keep.len(),
        device,
    )?;
    for c in cache.iter_mut() {
        c.k = c.k.index_select(&idx, 0)?;
        c.v = c.v.index_select(&idx, 0)?;
    }
    Ok(())
}
