//! Matrix products through candle, with the one left-hand layout that candle 0.11's CPU
//! product reads wrongly given standard strides first.
//!
//! ```text
//! matmul(a, b)            a (…, m, k) · b (…, k, n)     b's batch broadcast: a restrided first
//! broadcast_matmul(a, b)  batch dimensions broadcast as candle does, then matmul
//! linear(L, x)            x Wᵀ + bias                   x restrided first
//! ```
//!
//! On a GPU, candle's product (cuBLAS) refuses matrices whose rows are not packed, which the
//! CPU reads, so there such an operand is copied first (`for_gpu`).
//!
//! candle 0.11's CPU product treats a right-hand side whose batch stride is 0 (a broadcast
//! table, and `candle_nn::Linear`'s weight for a 3-D or 4-D input that is not contiguous) as one
//! matrix, and stacks the left-hand side's batches into the rows of a single `(b·m, k)` product
//! whenever their batch stride is `m·k`, reading row `r` of the stack at `r ×` the rows' stride.
//! That is right only when every batch's rows are `k` apart. A left-hand side laid out
//! otherwise with the same batch stride, such as a `(B, D, T)` tensor transposed to `(B, T, D)`,
//! or a single row per batch with any row stride, is read at the wrong places, and the product
//! is wrong with no error. So every product in the crate goes through this file (clippy's
//! `disallowed_methods`, in `clippy.toml`, refuses `Tensor::matmul` and `broadcast_matmul`
//! elsewhere), which gives such a left-hand side standard strides before candle sees it: a view
//! of the same storage when it is contiguous, one copy when it is not. Everything else reaches
//! candle as it was.

use candle_core::{Module, Shape, Tensor};
use candle_nn::Linear;

use crate::error::Result;

/// `lhs · rhs` over matching batch dimensions, as `Tensor::matmul`.
///
/// # Shapes
/// `lhs (…, m, k)`, `rhs (…, k, n)` → `(…, m, n)`.
///
/// # Errors
/// candle's, for shapes, dtypes or devices that do not match.
#[allow(clippy::disallowed_methods)] // the one call the rest of the crate is sent to
pub(crate) fn matmul(lhs: &Tensor, rhs: &Tensor) -> Result<Tensor> {
    if !lhs.device().is_cpu() {
        return Ok(for_gpu(lhs)?.matmul(&for_gpu(rhs)?)?);
    }
    match batch_broadcast(rhs) {
        true => Ok(standard(lhs)?.matmul(rhs)?),
        false => Ok(lhs.matmul(rhs)?),
    }
}

/// `t` as candle's GPU product reads it: cuBLAS's strided batches take each matrix row- or
/// column-major with no gap between rows (a row of a softmax narrowed past its sinks' column
/// has one), and the batch through one stride. Such a `t` is passed as it is, any other copied.
fn for_gpu(t: &Tensor) -> Result<Tensor> {
    match gpu_readable(t) {
        true => Ok(t.clone()),
        false => standard(t),
    }
}

/// Whether candle's CUDA product (`gemm_config` in candle-core 0.11) accepts `t`'s layout as
/// an operand: rank 2 to 4, each matrix dense in row- or column-major order, and a batch that
/// one stride steps through.
fn gpu_readable(t: &Tensor) -> bool {
    let rank = t.rank();
    if !(2..=4).contains(&rank) {
        return rank < 2; // candle's own error for a vector
    }
    let (rows, cols) = (t.dims()[rank - 2], t.dims()[rank - 1]);
    let (row_step, col_step) = (t.stride()[rank - 2], t.stride()[rank - 1]);
    let row_major = (col_step == 1 || cols == 1) && (row_step == cols || rows == 1);
    let col_major = (col_step == rows || cols == 1) && (row_step == 1 || rows == 1);
    (row_major || col_major) && batch_stride(t).is_some()
}

/// `lhs · rhs` with their batch dimensions broadcast to each other, as
/// `Tensor::broadcast_matmul`. An operand broadcast over all its batch dimensions at once (a
/// table against a batch of queries) is read in place; one whose batch dimensions no single
/// stride steps through (broadcast over some and not others) is copied, as candle's product
/// reads a batch through one stride.
///
/// # Shapes
/// `lhs (…, m, k)`, `rhs (…, k, n)`, batch dimensions broadcastable → `(…, m, n)`.
///
/// # Errors
/// candle's, for batch dimensions that do not broadcast or a `k` that differs.
#[allow(clippy::disallowed_methods)] // (only to pass a rank-1 operand's error on)
pub(crate) fn broadcast_matmul(lhs: &Tensor, rhs: &Tensor) -> Result<Tensor> {
    let (l, r) = (lhs.dims(), rhs.dims());
    if l.len() < 2 || r.len() < 2 {
        return Ok(lhs.broadcast_matmul(rhs)?); // candle's error for a vector
    }
    let (l_batch, l_mat) = l.split_at(l.len() - 2);
    let (r_batch, r_mat) = r.split_at(r.len() - 2);
    let batch = Shape::from(l_batch).broadcast_shape_binary_op(&r_batch.into(), "matmul")?;
    let shape = |mat: &[usize]| Shape::from([batch.dims(), mat].concat());
    let one_stride = |t: Tensor| -> Result<Tensor> {
        match batch_stride(&t).is_some() {
            true => Ok(t),
            false => Ok(t.contiguous()?),
        }
    };
    matmul(
        &one_stride(lhs.broadcast_as(shape(l_mat))?)?,
        &one_stride(rhs.broadcast_as(shape(r_mat))?)?,
    )
}

/// `x Wᵀ + b` through candle-nn's `Linear` (its weight is broadcast over a non-contiguous
/// input's batch, so such an input is made contiguous first).
///
/// # Shapes
/// `x (…, in)` → `(…, out)`.
///
/// # Errors
/// candle's, for an input whose last dimension is not the weight's `in`.
#[allow(clippy::disallowed_methods)] // the one call the rest of the crate is sent to
pub(crate) fn linear(linear: &Linear, x: &Tensor) -> Result<Tensor> {
    Ok(linear.forward(&standard(x)?)?)
}

/// Whether a batch dimension of more than one matrix has stride 0 in `t`, so candle's product
/// reads `t` as a single matrix for every batch.
fn batch_broadcast(t: &Tensor) -> bool {
    let rank = t.rank();
    let batch = rank.saturating_sub(2);
    t.dims()[..batch]
        .iter()
        .zip(&t.stride()[..batch])
        .any(|(&d, &s)| d > 1 && s == 0)
}

/// The one stride that steps through every matrix of `t`'s batch, if there is one: its batch
/// dimensions of more than one matrix nest, each outer stride the inner one times the inner
/// size (all 0 for a batch broadcast whole).
fn batch_stride(t: &Tensor) -> Option<usize> {
    let batch = t.rank().saturating_sub(2);
    let mut dims = t.dims()[..batch]
        .iter()
        .zip(&t.stride()[..batch])
        .filter(|(&d, _)| d > 1)
        .rev();
    let Some((&d, &s)) = dims.next() else {
        return Some(0);
    };
    let mut step = s.checked_mul(d)?;
    for (&d, &s) in dims {
        if s != step {
            return None;
        }
        step = s.checked_mul(d)?;
    }
    Some(s)
}

/// `t` with row-major strides: a view when its elements are already in that order (candle's
/// `reshape` restrides dimensions of size 1), otherwise a copy.
fn standard(t: &Tensor) -> Result<Tensor> {
    let mut standard = true;
    let mut step = 1usize;
    for (&d, &s) in t.dims().iter().zip(t.stride()).rev() {
        standard &= s == step;
        step = step.saturating_mul(d);
    }
    match standard {
        true => Ok(t.clone()),
        false => Ok(t.reshape(t.shape())?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, D};

    /// `a · b` summed in f64 from contiguous copies, broadcasting `b` over `a`'s batch.
    fn reference(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        let a = a.to_dtype(DType::F64)?.contiguous()?.unsqueeze(D::Minus1)?;
        let b = b.to_dtype(DType::F64)?.contiguous()?;
        let b = b.unsqueeze(b.rank() - 2)?;
        a.broadcast_mul(&b)?.sum(a.rank() - 2)
    }

    /// A `(batch, rows, cols)` tensor of standard normals in each layout a caller may hand
    /// over: contiguous, rows and columns swapped in memory, batch and rows swapped, every
    /// axis reversed, narrowed columns, narrowed rows, one matrix broadcast, one transposed
    /// matrix broadcast.
    fn layouts(
        (batch, rows, cols): (usize, usize, usize),
        dtype: DType,
    ) -> candle_core::Result<Vec<(&'static str, Tensor)>> {
        let dev = Device::Cpu;
        let randn = |dims: &[usize]| crate::seeded::randn(0f32, 1.0, dims, &dev)?.to_dtype(dtype);
        Ok(vec![
            ("contiguous", randn(&[batch, rows, cols])?),
            ("rows-cols", randn(&[batch, cols, rows])?.transpose(1, 2)?),
            ("batch-rows", randn(&[rows, batch, cols])?.transpose(0, 1)?),
            ("reversed", randn(&[cols, rows, batch])?.permute((2, 1, 0))?),
            (
                "narrow-cols",
                randn(&[batch, rows, cols + 3])?.narrow(2, 1, cols)?,
            ),
            (
                "narrow-rows",
                randn(&[batch, rows + 2, cols])?.narrow(1, 1, rows)?,
            ),
            (
                "broadcast",
                randn(&[1, rows, cols])?.broadcast_as((batch, rows, cols))?,
            ),
            (
                "broadcast-T",
                randn(&[1, cols, rows])?
                    .transpose(1, 2)?
                    .broadcast_as((batch, rows, cols))?,
            ),
        ])
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f64> {
        a.to_dtype(DType::F64)?
            .broadcast_sub(b)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f64>()
    }

    /// Every pair of layouts, in every float dtype, including one row per batch (m = 1), one
    /// column (n = 1) and a single inner product (k = 1): equal to the f64 reference (within
    /// the dtype's rounding of sums of ~k products of unit normals).
    #[test]
    fn every_layout_pair_equals_the_reference() -> anyhow::Result<()> {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let tol = match dtype {
                DType::F64 => 1e-9,
                DType::F32 => 1e-4,
                _ => 0.25,
            };
            for (b, m, k, n) in [(2, 7, 32, 5), (3, 1, 8, 4), (2, 4, 1, 3), (2, 5, 6, 1)] {
                for (ln, lhs) in layouts((b, m, k), dtype)? {
                    for (rn, rhs) in layouts((b, k, n), dtype)? {
                        let want = reference(&lhs, &rhs)?;
                        let got = matmul(&lhs, &rhs)?;
                        let d = max_diff(&got, &want)?;
                        assert!(d < tol, "{dtype:?} b{b} m{m} k{k} n{n} {ln} · {rn}: {d}");
                        // The same product with `rhs` as one matrix, broadcast by the call.
                        let one = rhs.narrow(0, 0, 1)?.squeeze(0)?;
                        let want = reference(&lhs, &one.unsqueeze(0)?)?;
                        let d = max_diff(&broadcast_matmul(&lhs, &one)?, &want)?;
                        assert!(d < tol, "{dtype:?} b{b} m{m} k{k} n{n} {ln} · {rn}[0]: {d}");
                    }
                }
            }
        }
        Ok(())
    }

    /// What a GPU product receives for each layout: a layout candle's cuBLAS call accepts,
    /// holding the same values; those it already accepts are passed without a copy.
    #[test]
    fn gpu_operands_are_readable() -> anyhow::Result<()> {
        for (b, m, k) in [(2, 7, 32), (3, 1, 8), (2, 4, 1)] {
            for (name, t) in layouts((b, m, k), DType::F32)? {
                let ready = for_gpu(&t)?;
                assert!(gpu_readable(&ready), "{name} ({b}, {m}, {k})");
                assert_eq!(max_diff(&ready, &t.to_dtype(DType::F64)?)?, 0.0, "{name}");
                if gpu_readable(&t) {
                    assert!(
                        ready.is_contiguous() == t.is_contiguous(),
                        "{name} was copied"
                    );
                }
            }
        }
        // The narrowed softmax of a block with sinks: rows one element apart from packed.
        let probs = Tensor::zeros((2, 2, 9, 10), DType::F32, &Device::Cpu)?.narrow(3, 0, 9)?;
        assert!(!gpu_readable(&probs));
        let column_major = Tensor::zeros((2, 9, 5), DType::F32, &Device::Cpu)?.transpose(1, 2)?;
        assert!(gpu_readable(&column_major));
        Ok(())
    }

    /// Rank-4 operands broadcast over one batch dimension and not the other (which no single
    /// stride steps through) on either side, and a table against a rank-4 batch.
    #[test]
    fn partial_broadcasts() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let randn = |dims: &[usize]| crate::seeded::randn(0f32, 1.0, dims, &dev);
        let cases = [
            (randn(&[2, 3, 4, 5])?, randn(&[1, 3, 5, 6])?),
            (randn(&[1, 3, 4, 5])?, randn(&[2, 3, 5, 6])?),
            (randn(&[2, 1, 4, 5])?, randn(&[2, 3, 5, 6])?),
            (randn(&[2, 3, 4, 5])?, randn(&[2, 1, 5, 6])?),
            (randn(&[2, 3, 5, 4])?.transpose(2, 3)?, randn(&[5, 6])?),
            (randn(&[3, 4, 5])?, randn(&[2, 1, 5, 6])?),
        ];
        for (lhs, rhs) in cases {
            let (l, r) = (lhs.dims().to_vec(), rhs.dims().to_vec());
            let shape = [2, 3];
            let full = |t: &Tensor| -> candle_core::Result<Tensor> {
                let mat = &t.dims()[t.rank() - 2..];
                t.broadcast_as([&shape[..], mat].concat())
            };
            let want = reference(
                &full(&lhs)?.reshape((6, 4, 5))?,
                &full(&rhs)?.reshape((6, 5, 6))?,
            )?;
            let got = broadcast_matmul(&lhs, &rhs)?.reshape((6, 4, 6))?;
            let d = max_diff(&got, &want)?;
            assert!(d < 1e-4, "{l:?} · {r:?}: {d}");
        }
        Ok(())
    }

    /// A linear layer on each layout of a `(B, T, in)` input, with and without a bias, equals
    /// the reference on the contiguous copy; 4-D inputs too.
    #[test]
    fn linear_on_every_layout() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            let tol = if dtype == DType::BF16 { 0.25 } else { 1e-4 };
            let w = crate::seeded::randn(0f32, 1.0, (6, 8), &dev)?.to_dtype(dtype)?;
            let bias = crate::seeded::randn(0f32, 1.0, 6, &dev)?.to_dtype(dtype)?;
            for layer in [
                Linear::new(w.clone(), None),
                Linear::new(w.clone(), Some(bias)),
            ] {
                for (name, x) in layouts((3, 5, 8), dtype)?
                    .into_iter()
                    .chain(layouts((1, 1, 8), dtype)?)
                {
                    let mut want = reference(&x, &w.t()?.unsqueeze(0)?)?;
                    if let Some(b) = layer.bias() {
                        want = want.broadcast_add(&b.to_dtype(DType::F64)?)?;
                    }
                    let d = max_diff(&linear(&layer, &x)?, &want)?;
                    assert!(d < tol, "{dtype:?} {name}: {d}");
                    let x4 = x.unsqueeze(0)?.broadcast_as((2, x.dim(0)?, x.dim(1)?, 8))?;
                    let d = max_diff(&linear(&layer, &x4)?, &want.unsqueeze(0)?)?;
                    assert!(d < tol, "{dtype:?} 4-D {name}: {d}");
                }
            }
        }
        Ok(())
    }
}
