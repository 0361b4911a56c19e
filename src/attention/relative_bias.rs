//! A logits bias that depends on the query/key distance only through a short row of values.
//!
//! ```text
//! bias[b, h, i, j] = values[b, h, i, c(i, j)],   c(i, j) = clamp(j − i + shift, 0, W − 1)
//! values: (1|B, H, 1|Tq, W)
//! ```
//!
//! With offset positions every relative encoding has this form: T5 and the clipped bias give
//! one row per head over all `Tq + Tk − 1` distances (`W = Tq + Tk − 1`), Shaw's keys give one
//! row of `2k + 1` products `q_i · a^K[r]` per query, the clamp doing the clipping. The fused
//! CPU softmax reads these rows directly, so no `(B, H, Tq, Tk)` bias is ever built; the dense
//! form ([`RelativeBias::to_dense`]) is what the other paths add.
//!
//! [`bucket_sums`] is the adjoint: per query, the attention weights summed per column `c(i, j)`
//! (Shaw's value term needs `Σ_j α_ij a^V[c(i, j)] = Σ_c (Σ_{j: c(i,j) = c} α_ij) a^V[c]`).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::{Error, Result};

/// A relative logits bias given by rows of values per distance; see the module docs.
///
/// Returned by [`PositionalEncoding::relative_logits_bias`](super::PositionalEncoding::relative_logits_bias).
///
/// # Shapes
/// `values`: `(1|B, H, 1|Tq, W)`; the bias it stands for is `(1|B, H, Tq, Tk)`.
#[derive(Debug, Clone)]
pub struct RelativeBias {
    /// `(1|B, H, 1|Tq, W)`: the bias of each clamped column `c(i, j)`.
    pub values: Tensor,
    /// Column of the pair `(i, j)` before clamping: `j − i + shift`.
    pub shift: i64,
}

/// A relative value term given by one table row per clamped distance:
/// `out[b, h, i, :] += Σ_j α[b, h, i, j] · table[clamp(j − i + shift, 0, W − 1), :]`.
///
/// Returned by
/// [`PositionalEncoding::relative_value_term`](super::PositionalEncoding::relative_value_term).
///
/// # Shapes
/// `table`: `(W, D)`, shared by every batch item and head.
#[derive(Debug, Clone)]
pub struct RelativeValues {
    /// `(W, D)`: the value added per unit of weight at each clamped column.
    pub table: Tensor,
    /// Column of the pair `(i, j)` before clamping: `j − i + shift`.
    pub shift: i64,
}

/// Where row `i`'s columns start and stop being clamped: keys `j < lo` read column 0, keys
/// `lo ≤ j < hi` read `j − i + shift`, keys `j ≥ hi` read column `W − 1`.
pub(crate) fn row_segments(i: usize, shift: i64, width: usize, tk: usize) -> (usize, usize) {
    let first = i as i64 - shift;
    let lo = first.clamp(0, tk as i64) as usize;
    let hi = (first + width as i64).clamp(0, tk as i64) as usize;
    (lo, hi)
}

impl RelativeBias {
    /// Checks the rank and returns `(batch, heads, rows, width)`.
    ///
    /// # Errors
    /// [`Error::Rank`] unless `values` is 4-D; [`Error::Shape`] for an empty last axis.
    pub fn dims(&self) -> Result<(usize, usize, usize, usize)> {
        let dims = self.values.dims4().map_err(|_| Error::Rank {
            what: "relative bias values",
            expected: 4,
            got: self.values.rank(),
            shape: self.values.dims().to_vec(),
        })?;
        if dims.3 == 0 {
            return Err(Error::shape(
                "relative bias values",
                "(batch, heads, rows, width) with width ≥ 1",
                self.values.shape(),
            ));
        }
        Ok(dims)
    }

    /// The bias for `tq` queries and `tk` keys as a dense `(1|B, H, Tq, Tk)` tensor (gradients
    /// flow to `values`).
    ///
    /// # Errors
    /// As [`Self::dims`]; [`Error::Shape`] if `values` has neither 1 nor `tq` rows.
    pub fn to_dense(&self, tq: usize, tk: usize) -> Result<Tensor> {
        let (b, h, rows, width) = self.dims()?;
        if rows != 1 && rows != tq {
            return Err(Error::shape(
                "relative bias values",
                format!("(batch, heads, 1 or {tq} rows, width)"),
                self.values.shape(),
            ));
        }
        let mut index = Vec::with_capacity(tq * tk);
        for i in 0..tq {
            let (lo, hi) = row_segments(i, self.shift, width, tk);
            index.extend(std::iter::repeat_n(0u32, lo));
            let first = (lo as i64 - i as i64 + self.shift) as u32;
            index.extend(first..first + (hi - lo) as u32);
            index.extend(std::iter::repeat_n(width as u32 - 1, tk - hi));
        }
        let device = self.values.device();
        if rows == 1 {
            let index = Tensor::from_vec(index, tq * tk, device)?;
            Ok(self
                .values
                .reshape((b, h, width))?
                .index_select(&index, 2)?
                .reshape((b, h, tq, tk))?)
        } else {
            let index = Tensor::from_vec(index, (1, 1, tq, tk), device)?
                .broadcast_as((b, h, tq, tk))?
                .contiguous()?;
            Ok(self.values.contiguous()?.gather(&index, 3)?)
        }
    }
}

/// Per query, the weights summed per clamped column: `out[b, h, i, c] = Σ_{j: c(i,j) = c}
/// probs[b, h, i, j]`, an `O(Tq·Tk)` pass with no index tensor.
///
/// For f32 CPU tensors outside a graph only (the callers check [`bucket_sums_apply`]).
///
/// # Shapes
/// `probs`: `(B, H, Tq, Tk)` → `(B, H, Tq, width)`.
pub(crate) fn bucket_sums(probs: &Tensor, width: usize, shift: i64) -> Result<Tensor> {
    Ok(probs
        .contiguous()?
        .apply_op1_no_bwd(&BucketSums { width, shift })?)
}

/// Adds query row `i`'s weights (keys `0..row.len()`) into `sums` per clamped column
/// `clamp(j − i + shift, 0, sums.len() − 1)`.
pub(crate) fn add_bucket_sums(row: &[f32], i: usize, shift: i64, sums: &mut [f32]) {
    let width = sums.len();
    let (lo, hi) = row_segments(i, shift, width, row.len());
    sums[0] += row[..lo].iter().sum::<f32>();
    let first = (lo as i64 - i as i64 + shift) as usize;
    for (s, p) in sums[first..first + (hi - lo)].iter_mut().zip(&row[lo..hi]) {
        *s += p;
    }
    sums[width - 1] += row[hi..].iter().sum::<f32>();
}

/// Whether [`bucket_sums`] runs on these weights.
pub(crate) fn bucket_sums_apply(probs: &Tensor) -> bool {
    probs.device().is_cpu() && probs.dtype() == DType::F32 && !probs.track_op()
}

struct BucketSums {
    width: usize,
    shift: i64,
}

impl CustomOp1 for BucketSums {
    fn name(&self) -> &'static str {
        "posenc-relative-bucket-sums"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, h, tq, tk) = layout.shape().dims4()?;
        let (CpuStorage::F32(data), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("relative bucket sums: weights must be contiguous f32");
        };
        let probs = &data[start..end];
        let width = self.width;
        if width == 0 {
            candle_core::bail!("relative bucket sums: width must be at least 1");
        }
        let mut out = vec![0f32; b * h * tq * width];
        out.par_chunks_mut(width).enumerate().for_each(|(r, sums)| {
            add_bucket_sums(&probs[r * tk..(r + 1) * tk], r % tq, self.shift, sums);
        });
        Ok((CpuStorage::F32(out), Shape::from((b, h, tq, width))))
    }
}
