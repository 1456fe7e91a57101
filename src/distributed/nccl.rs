//! NCCL between CUDA ranks (feature `nccl`): tensors are summed on the
//! devices by NCCL's all-reduce; bytes (plans, episodes, metrics) still
//! travel over the [`TcpGroup`], which also carries the NCCL unique id from
//! rank 0 at start-up. libnccl is loaded at run time, like the CUDA driver.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::cuda::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use super::{Collective, CollectiveError, TcpGroup};

/// cudarc's communicator holds a raw handle; every use goes through the
/// mutex below, one call at a time.
struct CommCell(Comm);
// SAFETY: NCCL communicators may be used from any thread as long as calls
// on one communicator do not overlap, which the mutex guarantees.
unsafe impl Send for CommCell {}
unsafe impl Sync for CommCell {}

/// Ranks on CUDA devices: NCCL for tensors, TCP for bytes.
pub struct NcclGroup {
    tcp: TcpGroup,
    comm: Mutex<CommCell>,
}

impl NcclGroup {
    /// Open the NCCL communicator of `tcp`'s rank on `device` (a CUDA
    /// device): rank 0 creates the unique id and sends it over `tcp`.
    pub fn new(tcp: TcpGroup, device: &Device) -> Result<Self, CollectiveError> {
        let (rank, world) = (tcp.rank(), tcp.world());
        let fail = |msg: String| CollectiveError::Protocol { rank, world, msg };
        let Device::Cuda(dev) = device else {
            return Err(fail(format!(
                "NCCL needs a CUDA device, this rank has {device:?}"
            )));
        };
        let mine = if rank == 0 {
            let id = Id::new().map_err(|e| fail(format!("cannot create the NCCL id: {e:?}")))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        let bytes = tcp.broadcast(mine)?;
        let raw: [core::ffi::c_char; 128] = bytes
            .iter()
            .map(|&b| b as core::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| {
                fail(format!(
                    "the NCCL id from rank 0 has {} bytes, not 128",
                    bytes.len()
                ))
            })?;
        let comm = Comm::from_rank(dev.cuda_stream(), rank, world, Id::uninit(raw))
            .map_err(|e| fail(format!("NCCL init failed: {e:?}")))?;
        Ok(NcclGroup {
            tcp,
            comm: Mutex::new(CommCell(comm)),
        })
    }
}

impl Collective for NcclGroup {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn world(&self) -> usize {
        self.tcp.world()
    }

    fn all_gather(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.tcp.all_gather(bytes)
    }

    fn all_reduce_sum(&self, ts: &[Tensor]) -> Result<Vec<Tensor>, CollectiveError> {
        let comm = self.comm.lock().expect("nccl lock");
        let op = AllReduce { comm: &comm.0 };
        ts.iter()
            .map(|t| Ok(t.contiguous()?.apply_op1_no_bwd(&op)?))
            .collect()
    }
}

/// NCCL's in-device sum as a candle op (no backward: gradients are what
/// it reduces).
struct AllReduce<'a> {
    comm: &'a Comm,
}

impl CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("NCCL all-reduce on a CPU tensor: CPU ranks use the TCP group")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let n = l.shape().elem_count();
        if l.contiguous_offsets() != Some((0, n)) {
            candle_core::bail!("NCCL all-reduce needs a contiguous tensor");
        }
        let dev = s.device().clone();
        let out = match s.dtype() {
            DType::F32 => {
                let src = s.as_cuda_slice::<f32>()?;
                // SAFETY: every element is written by the all-reduce.
                let mut dst = unsafe { dev.alloc::<f32>(n) }?;
                self.comm
                    .all_reduce(src, &mut dst, &ReduceOp::Sum)
                    .map_err(|e| candle_core::Error::Msg(format!("NCCL all-reduce: {e:?}")))?;
                CudaStorage::wrap_cuda_slice(dst, dev)
            }
            DType::BF16 => {
                let src = s.as_cuda_slice::<half::bf16>()?;
                // SAFETY: as above.
                let mut dst = unsafe { dev.alloc::<half::bf16>(n) }?;
                self.comm
                    .all_reduce(src, &mut dst, &ReduceOp::Sum)
                    .map_err(|e| candle_core::Error::Msg(format!("NCCL all-reduce: {e:?}")))?;
                CudaStorage::wrap_cuda_slice(dst, dev)
            }
            d => candle_core::bail!("NCCL all-reduce of {d:?} is not supported (f32, bf16)"),
        };
        Ok((out, l.shape().clone()))
    }
}
