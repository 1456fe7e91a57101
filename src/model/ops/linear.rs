//! `x Wᵀ` for a frozen weight: the gradient flows to `x` only (LoRA's
//! base projections).

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};

use super::{f32_slice, fused};
use crate::model::error::Result;

/// `x (rows, in) @ wᵀ` for a frozen HF `(out, in)` weight, differentiable
/// in `x` only. candle's matmul backward always computes the gradient of
/// both operands, so a LoRA base weight would cost a full `(out, in)`
/// product per projection per backward that is then thrown away; this op
/// computes just `dx = dy @ w`.
pub(crate) fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let w = w.detach();
    if fused(x) && x.rank() == 2 {
        return Ok(x.contiguous()?.apply_op1(FrozenLinear { w })?);
    }
    Ok(x.matmul(&w.t()?)?)
}

struct FrozenLinear {
    w: Tensor,
}

impl CustomOp1 for FrozenLinear {
    fn name(&self) -> &'static str {
        "actguide-frozen-linear"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, self.name())?;
        // A plain (untracked) tensor over a copy of the input, so the
        // product runs on candle's threaded gemm.
        let x = Tensor::from_slice(x, layout.shape(), &Device::Cpu)?;
        let y = x.matmul(&self.w.t()?)?;
        let shape = y.shape().clone();
        Ok((CpuStorage::F32(y.flatten_all()?.to_vec1()?), shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.matmul(&self.w)?))
    }
}
