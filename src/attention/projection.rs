//! The block's linear projections, `y = x Wᵀ + b`, on the CPU without candle's per-call cost.
//!
//! ```text
//! x: (…, in)   W: (out, in)   b: (out)   →   y: (…, out)
//! ```
//!
//! candle 0.11's CPU matmul asks for the number of threads on every call, and without
//! `RAYON_NUM_THREADS` set that reads `/proc/cpuinfo`: 30–40 µs per call, three projections and
//! the output one per decoding step, where the whole step is 0.2–0.4 ms. When nothing tracks
//! gradients and everything is f32 on the CPU, the product runs on `gemm` directly (the crate
//! candle's matmul calls); otherwise through candle's `Linear`, unchanged.

use candle_core::{DType, Module, Tensor};
use candle_nn::Linear;

use super::fused_attention::product_parallel;
use crate::error::Result;

/// `linear(x)`: by `gemm` directly for f32 CPU tensors that track no gradients, else by
/// candle's `Linear`.
pub(crate) fn project(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    let w = linear.weight();
    let direct = x.device().is_cpu()
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && w.device().is_cpu()
        && !x.track_op()
        && !w.track_op()
        && linear
            .bias()
            .is_none_or(|b| b.dtype() == DType::F32 && b.device().is_cpu() && !b.track_op());
    let (Some(&features), Ok((out, inner))) = (x.dims().last(), w.dims2()) else {
        return Ok(linear.forward(x)?);
    };
    if !direct || features != inner || x.rank() < 2 {
        return Ok(linear.forward(x)?);
    }
    let x = x.contiguous()?;
    let w = w.contiguous()?;
    let rows = x.elem_count() / inner.max(1);
    let mut y = Vec::new();
    y.try_reserve_exact(rows * out).map_err(|e| {
        crate::error::Error::from(candle_core::Error::Msg(format!("projection output: {e}")))
    })?;
    match linear.bias() {
        Some(b) => {
            let b = b.flatten_all()?.to_vec1::<f32>()?;
            for _ in 0..rows {
                y.extend_from_slice(&b);
            }
        }
        None => y.resize(rows * out, 0.0),
    }
    if rows > 0 && out > 0 && inner > 0 {
        let (xs, _) = x.storage_and_layout();
        let (ws, _) = w.storage_and_layout();
        let (
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(xd)),
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(wd)),
        ) = (&*xs, &*ws)
        else {
            return Ok(linear.forward(&x)?);
        };
        let (xo, wo) = (x.layout().start_offset(), w.layout().start_offset());
        if xd.len() < xo + rows * inner || wd.len() < wo + out * inner {
            return Ok(linear.forward(&x)?);
        }
        // SAFETY: x holds rows × in values from xo and W out × in from wo (checked above),
        // both contiguous; y holds rows × out; `Wᵀ` is read with column stride `in`.
        unsafe {
            product_parallel(
                (rows, out, inner),
                (y.as_mut_ptr(), out, linear.bias().is_some()),
                (xd.as_ptr().add(xo), 1, inner),
                (wd.as_ptr().add(wo), inner, 1),
            )
        };
    }
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = out;
    }
    Ok(Tensor::from_vec(y, dims, x.device())?)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use candle_nn::{linear_b, VarBuilder};

    use super::*;

    /// The direct product equals candle's `Linear`, with and without a bias, for a decoding
    /// step, a batch of sequences and a strided input.
    #[test]
    fn equals_candle_linear() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        for bias in [false, true] {
            let vb = VarBuilder::from_tensors(
                [
                    (
                        "weight".to_string(),
                        Tensor::randn(0f32, 1.0, (24, 40), &dev)?,
                    ),
                    ("bias".to_string(), Tensor::randn(0f32, 1.0, 24, &dev)?),
                ]
                .into(),
                DType::F32,
                &dev,
            );
            let linear = linear_b(40, 24, bias, vb)?;
            for x in [
                Tensor::randn(0f32, 1.0, (1, 1, 40), &dev)?,
                Tensor::randn(0f32, 1.0, (3, 7, 40), &dev)?,
                Tensor::randn(0f32, 1.0, (7, 3, 40), &dev)?.transpose(0, 1)?,
            ] {
                let want = linear.forward(&x)?;
                let got = project(&linear, &x)?;
                assert_eq!(got.dims(), want.dims());
                let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(diff < 1e-5, "bias {bias} {:?}: {diff:e}", x.dims());
            }
        }
        Ok(())
    }
}
