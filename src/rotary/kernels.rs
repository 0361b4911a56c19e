//! The two ways a rotation is computed, on a tensor whose last dimension is the rotary part.
//!
//! - [`rotate_fused`]: candle-nn's fused kernels (`rope`, `rope_i`, `rope_thd`; CPU, CUDA and
//!   Metal). They have no backward pass, so when the input is part of a graph the result is
//!   grafted onto it (`crate::graft`) with [`RotationGrad`] as backward, whose backward is the rotation by `−θ`: the same kernel
//!   with `−sin`. For `y = R(θ)·x` (per pair, `[[c, −s], [s, c]]`), `∂L/∂x = R(θ)ᵀ·∂L/∂y =
//!   R(−θ)·∂L/∂y`, and that stays true when cos and sin carry a common scale (xPos, YaRN).
//! - [`rotate_ops`]: the textbook formula from tensor ops (`x·cos + rotate_half(x)·sin`, or its
//!   interleaved form), differentiable by candle's autograd; the reference the fused path is
//!   tested against.
//!
//! Both take cos/sin of shape `(T, D/2)` (shared by the batch) or `(B, T, D/2)` (per sequence),
//! with exactly `T` rows: candle's kernels index 3-D tables as if they had `T` rows.

use candle_core::{Tensor, D};

use super::{QkLayout, RopeLayout};
use crate::error::Result;
use crate::graft::{graft, GraftBackward};

/// Rotates `x` (`(B, H, T, D)` or `(B, T, H, D)`) with candle-nn's fused kernels, keeping
/// gradients to `x` when it is part of a graph.
pub(crate) fn rotate_fused(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    pairs: RopeLayout,
    axes: QkLayout,
) -> Result<Tensor> {
    let x = x.contiguous()?;
    let y = match (pairs, axes) {
        (RopeLayout::Half, QkLayout::Bhtd) => candle_nn::rotary_emb::rope(&x, cos, sin)?,
        (RopeLayout::Interleaved, QkLayout::Bhtd) => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
        (RopeLayout::Half, QkLayout::Bthd) => candle_nn::rotary_emb::rope_thd(&x, cos, sin)?,
        // candle has no interleaved kernel for (B, T, H, D): rotate the (B, H, T, D) view.
        (RopeLayout::Interleaved, QkLayout::Bthd) => {
            let xt = x.transpose(1, 2)?.contiguous()?;
            return Ok(rotate_fused(&xt, cos, sin, pairs, QkLayout::Bhtd)?.transpose(1, 2)?);
        }
    };
    if !x.track_op() {
        return Ok(y);
    }
    let grad = RotationGrad {
        cos: cos.clone(),
        sin: sin.clone(),
        pairs,
        axes,
    };
    graft(&x, &y, grad)
}

/// Rotates `x` with differentiable tensor ops (no custom kernel).
pub(crate) fn rotate_ops(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    pairs: RopeLayout,
    axes: QkLayout,
) -> Result<Tensor> {
    // cos/sin to a shape that broadcasts against x with the pair axis last.
    let expand = |t: &Tensor| -> Result<Tensor> {
        let t = if t.rank() == 2 {
            t.unsqueeze(0)?
        } else {
            t.clone()
        };
        // (B|1, T, D/2) → heads axis inserted where x has it.
        Ok(match axes {
            QkLayout::Bhtd => t.unsqueeze(1)?,
            QkLayout::Bthd => t.unsqueeze(2)?,
        })
    };
    let (cos, sin) = (expand(cos)?, expand(sin)?);
    match pairs {
        RopeLayout::Half => {
            let cos = Tensor::cat(&[&cos, &cos], D::Minus1)?;
            let sin = Tensor::cat(&[&sin, &sin], D::Minus1)?;
            let half = x.dim(D::Minus1)? / 2;
            let x1 = x.narrow(D::Minus1, 0, half)?;
            let x2 = x.narrow(D::Minus1, half, half)?;
            let rotated_half = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
            Ok((x.broadcast_mul(&cos)? + rotated_half.broadcast_mul(&sin)?)?)
        }
        RopeLayout::Interleaved => {
            let mut dims = x.dims().to_vec();
            let d = dims.pop().unwrap_or(0);
            dims.extend([d / 2, 2]);
            let xp = x.reshape(dims)?;
            let x0 = xp.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
            let x1 = xp.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
            let y0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
            let y1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
            Ok(Tensor::stack(&[&y0, &y1], D::Minus1)?.flatten_from(D::Minus2)?)
        }
    }
}

/// The backward of a fused rotation: the gradient rotated by `−θ` through the same kernel.
#[derive(Debug, Clone)]
struct RotationGrad {
    cos: Tensor,
    sin: Tensor,
    pairs: RopeLayout,
    axes: QkLayout,
}

impl GraftBackward for RotationGrad {
    const NAME: &'static str = "posenc-rope-grad";

    fn grad(&self, grad_y: &Tensor) -> candle_core::Result<Tensor> {
        // On CUDA with the crate's kernels on: a copy of the gradient rotated by −θ in place.
        if crate::cuda::kernels_on(grad_y.device())
            && self.cos.dtype() == candle_core::DType::F32
            && self.sin.dtype() == candle_core::DType::F32
        {
            let g = grad_y.force_contiguous()?;
            let op = super::inplace::RotateInPlace {
                pairs: self.pairs,
                axes: self.axes,
                inverse: true,
            };
            g.inplace_op3(&self.cos.contiguous()?, &self.sin.contiguous()?, &op)?;
            return Ok(g);
        }
        let neg_sin = self.sin.neg()?;
        Ok(rotate_fused(
            grad_y, &self.cos, &neg_sin, self.pairs, self.axes,
        )?)
    }
}
