//! Rows multiplied by a factor each, as one node of candle's graph on the CPU in f32.
//!
//! ```text
//! forward:   y[…, i, :] = f_i · x[…, i, :]        x: (…, T, D), f: T constants
//! backward:  ∂x[…, i, :] = f_i · ∂y[…, i, :]
//! ```
//!
//! Per-query factors (the attention temperature, Inkling's log-n scaling) multiply the queries
//! or a mix of each query's; candle's broadcast multiply runs on candle's own thread pool,
//! which on a machine whose cores the block's pool keeps busy waits for a worker that is not
//! running. This node runs on the caller's (rayon's) pool, and its backward is the same node.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp1, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::error::Result;

/// `x` `(…, T, D)` with row `i` multiplied by its factor, computed in f32 and returned in
/// `x`'s dtype: `T` factors shared by every leading index, or `B · T` (one row of `T` per
/// index of the first axis, positions per sequence). One node on the CPU in f32 for shared
/// factors, candle's broadcast multiply otherwise.
///
/// # Errors
/// Candle's, for an `x` of rank below 2 or factors that are neither `T` nor `B · T`.
pub(crate) fn scale_rows(x: &Tensor, factors: Vec<f32>) -> Result<Tensor> {
    let rank = x.rank();
    let t = if rank >= 2 { x.dim(rank - 2)? } else { 0 };
    let batches = factors.len().checked_div(t).unwrap_or(0);
    if rank < 2 || batches * t != factors.len() || (batches != 1 && batches != x.dim(0)?) {
        return Err(candle_core::Error::Msg(format!(
            "scaled rows: {} factors for a tensor of shape {:?}",
            factors.len(),
            x.dims()
        ))
        .into());
    }
    if batches == 1 && x.device().is_cpu() && x.dtype() == DType::F32 {
        return Ok(x.apply_op1(ScaleRows {
            factors: Arc::new(factors),
        })?);
    }
    let mut dims = vec![1usize; rank];
    dims[0] = batches;
    dims[rank - 2] = t;
    let dtype = x.dtype();
    let wide = match dtype {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32)?,
        _ => x.clone(),
    };
    let f = Tensor::from_vec(factors, dims, x.device())?.to_dtype(wide.dtype())?;
    Ok(wide.broadcast_mul(&f)?.to_dtype(dtype)?)
}

/// [`scale_rows`] of a tensor the caller no longer needs: scaled where it lies when it is a
/// contiguous f32 CPU tensor outside any graph (no output allocated, no pages faulted in),
/// else as [`scale_rows`]. The caller must hold the only reference to its storage that will
/// be read again (as the block's rotation hook guarantees for the queries it hands over).
///
/// # Errors
/// As [`scale_rows`].
pub(crate) fn scale_rows_owned(x: Tensor, factors: Vec<f32>) -> Result<Tensor> {
    let rank = x.rank();
    let fits = rank >= 2 && x.dim(rank - 2)? == factors.len();
    if fits && x.device().is_cpu() && x.dtype() == DType::F32 && x.is_contiguous() && !x.track_op()
    {
        x.inplace_op1(&ScaleRows {
            factors: Arc::new(factors),
        })?;
        return Ok(x);
    }
    scale_rows(&x, factors)
}

/// The op: one factor per row of the second-to-last axis.
#[derive(Clone)]
struct ScaleRows {
    factors: Arc<Vec<f32>>,
}

impl CustomOp1 for ScaleRows {
    fn name(&self) -> &'static str {
        "posenc-scale-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = s else {
            candle_core::bail!("scaled rows: expected f32");
        };
        let dims = l.dims();
        let rank = dims.len();
        let (t, d) = (dims[rank - 2], dims[rank - 1]);
        let mut out = crate::cpu::zeroed(l.shape().elem_count(), "scaled rows")?;
        match l.contiguous_offsets() {
            Some((start, _)) => {
                let src = &data[start..];
                out.par_chunks_mut(d.max(1))
                    .zip(src.par_chunks(d.max(1)))
                    .enumerate()
                    .for_each(|(r, (y, x))| {
                        let f = self.factors[r % t];
                        y.iter_mut().zip(x).for_each(|(y, x)| *y = f * x);
                    });
            }
            None => {
                // A strided view: each element read through its index.
                let (offset, stride) = (l.start_offset(), l.stride());
                out.par_chunks_mut(d.max(1)).enumerate().for_each(|(r, y)| {
                    let mut at = offset;
                    let mut rest = r;
                    for axis in (0..rank - 1).rev() {
                        at += (rest % dims[axis]) * stride[axis];
                        rest /= dims[axis];
                    }
                    let f = self.factors[r % t];
                    for (c, y) in y.iter_mut().enumerate() {
                        *y = f * data[at + c * stride[rank - 1]];
                    }
                });
            }
        }
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.apply_op1(self.clone())?))
    }
}

impl InplaceOp1 for ScaleRows {
    fn name(&self) -> &'static str {
        "posenc-scale-rows-in-place"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
        let (CpuStorage::F32(data), Some((start, end))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("scaled rows in place: expected contiguous f32");
        };
        let dims = l.dims();
        let (t, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        data[start..end]
            .par_chunks_mut(d.max(1))
            .enumerate()
            .for_each(|(r, y)| {
                let f = self.factors[r % t];
                y.iter_mut().for_each(|y| *y *= f);
            });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The node and its gradient equal candle's broadcast multiply, contiguous and strided.
    #[test]
    fn equals_candle_broadcast_multiply() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let factors = vec![1.0f32, 1.5, 0.25, 3.0, 2.0];
        let f = Tensor::new(factors.as_slice(), &dev)?.reshape((1, 1, 5, 1))?;
        for strided in [false, true] {
            let v = crate::seeded::var_randn(0f32, 1.0, (2, 3, 5, 4), &dev)?;
            let x = match strided {
                false => v.as_tensor().clone(),
                // (2, 3, 4, 5) stored, read as (2, 3, 5, 4).
                true => v
                    .as_tensor()
                    .transpose(2, 3)?
                    .contiguous()?
                    .transpose(2, 3)?,
            };
            let got = scale_rows(&x, factors.clone())?;
            let want = x.broadcast_mul(&f)?;
            let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff == 0.0, "strided {strided}: {diff}");
            let probe = crate::seeded::randn(0f32, 1.0, (2, 3, 5, 4), &dev)?;
            let a = (&got * &probe)?.sum_all()?.backward()?;
            let b = (&want * &probe)?.sum_all()?.backward()?;
            let (a, b) = (a.get(&v).expect("grad"), b.get(&v).expect("grad"));
            let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff == 0.0, "strided {strided}: gradient {diff}");
        }
        assert!(scale_rows(&Tensor::zeros(4, DType::F32, &dev)?, vec![1.0; 4]).is_err());
        // In place, outside a graph: the same values.
        let x = crate::seeded::randn(0f32, 1.0, (2, 3, 5, 4), &dev)?;
        let want = x.broadcast_mul(&f)?;
        let got = scale_rows_owned(x.copy()?, factors.clone())?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff == 0.0, "in place: {diff}");
        Ok(())
    }
}
