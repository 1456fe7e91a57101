//! Data parallelism: the collective operations ranks use to train one
//! policy together (docs/DISTRIBUTED.md).
//!
//! [`Collective`] is the one interface the trainer talks to. [`Single`] is
//! the one-process path: no messages, nothing changes. [`TcpGroup`] joins
//! ranks over TCP through rank 0 (a star): it runs anywhere, CPU tensors
//! included, so the data-parallel step is tested without GPUs. The NCCL
//! transport for CUDA devices sits behind the `nccl` feature
//! ([`nccl::NcclGroup`]) and only swaps how tensors travel.
//!
//! Every rank computes reductions in rank order, so all ranks hold
//! bit-identical results and their weights never drift apart.

pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
mod tcp;

use candle_core::{DType, Tensor};

pub use tcp::TcpGroup;

/// Errors of collective operations: a peer that left, timed out or sent
/// something else than the protocol says.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("rank {rank} of {world}: {what}: {source}")]
    Io {
        rank: usize,
        world: usize,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("rank {rank} of {world}: {msg}")]
    Protocol {
        rank: usize,
        world: usize,
        msg: String,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// The operations data-parallel training needs. Every rank calls the same
/// operations in the same order.
pub trait Collective: Send + Sync {
    /// This process's rank, 0 ..world.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;
    /// Every rank's bytes, in rank order, on every rank.
    fn all_gather(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError>;

    /// Rank 0's bytes on every rank (other ranks' `bytes` are ignored).
    fn broadcast(&self, bytes: Vec<u8>) -> Result<Vec<u8>, CollectiveError> {
        let mut all = self.all_gather(if self.rank() == 0 { bytes } else { Vec::new() })?;
        Ok(std::mem::take(&mut all[0]))
    }

    /// Element-wise sums over ranks of same-shaped tensors; every rank
    /// gets the same sums (added in rank order, in f32, cast back to each
    /// tensor's dtype). The host-side default serves any device.
    fn all_reduce_sum(&self, ts: &[Tensor]) -> Result<Vec<Tensor>, CollectiveError> {
        if self.world() == 1 {
            return Ok(ts.to_vec());
        }
        let mut flat: Vec<f32> = Vec::new();
        for t in ts {
            flat.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        let sums = sum_in_rank_order(self, &flat, f32::to_le_bytes, f32::from_le_bytes)?;
        let mut out = Vec::with_capacity(ts.len());
        let mut at = 0;
        for t in ts {
            let n = t.elem_count();
            let s = Tensor::from_slice(&sums[at..at + n], t.shape(), t.device())?;
            out.push(s.to_dtype(t.dtype())?);
            at += n;
        }
        Ok(out)
    }

    /// Element-wise sums of host numbers (metric sums, counts).
    fn all_reduce_f64(&self, xs: &[f64]) -> Result<Vec<f64>, CollectiveError> {
        if self.world() == 1 {
            return Ok(xs.to_vec());
        }
        sum_in_rank_order(self, xs, f64::to_le_bytes, f64::from_le_bytes)
    }

    /// A peer sent a buffer of another size than this rank's.
    fn mismatch(&self, from: usize, got: usize, want: usize) -> CollectiveError {
        CollectiveError::Protocol {
            rank: self.rank(),
            world: self.world(),
            msg: format!(
                "rank {from} sent {got} bytes where this rank has {want}: the ranks disagree on \
                 what they reduce (different experiments or model files?)"
            ),
        }
    }
}

/// Sums over ranks, added in rank order, of numbers sent as `N`
/// little-endian bytes.
fn sum_in_rank_order<C, T, const N: usize>(
    c: &C,
    xs: &[T],
    to: fn(T) -> [u8; N],
    from: fn([u8; N]) -> T,
) -> Result<Vec<T>, CollectiveError>
where
    C: Collective + ?Sized,
    T: Copy + Default + std::ops::AddAssign,
{
    let bytes: Vec<u8> = xs.iter().flat_map(|&x| to(x)).collect();
    let all = c.all_gather(bytes)?;
    let mut out = vec![T::default(); xs.len()];
    for (r, b) in all.iter().enumerate() {
        if b.len() != xs.len() * N {
            return Err(c.mismatch(r, b.len(), xs.len() * N));
        }
        for (o, ch) in out.iter_mut().zip(b.chunks_exact(N)) {
            *o += from(ch.try_into().expect("N bytes"));
        }
    }
    Ok(out)
}

/// One process: every operation is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_gather(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        Ok(vec![bytes])
    }
}

/// Which of `n` work items (micro-batches, task groups) rank `rank` of
/// `world` takes: every `world`-th, starting at its rank.
pub fn shard(n: usize, rank: usize, world: usize) -> impl Iterator<Item = usize> {
    (rank..n).step_by(world.max(1))
}
