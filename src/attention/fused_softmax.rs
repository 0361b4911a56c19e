//! Bias, masks and softmax in one in-place pass over the attention logits (CPU, f32).
//!
//! ```text
//! p[b,h,i,:] = softmax_j( s[b,h,i,j] + Σ dense[b,h,i,j] + Σ rel.values[b,h,i,c(i,j)] )  over kept j
//! kept(i, j) = (causal = None or j ≤ first + i) and padding[b, j] ≠ 0
//! ```
//!
//! Masked logits take `f32::MIN`, so a fully masked row is uniform over all its keys, as in the
//! unfused path. The unfused path adds a bias into a fresh `(B, H, Tq, Tk)` tensor, fills masked
//! entries into another and normalises into a third; here each row is read and written once
//! while it is in cache. Dense terms are read through their broadcast strides (an ALiBi
//! `(1, H, 1, Tk)` row is never expanded); relative terms ([`RelativeBias`]) are read as short
//! rows of values per distance. Keys past the causal limit are never touched but to write 0.
//! Used for inference only: the logits must not be part of a graph.

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};
use rayon::prelude::*;

use super::relative_bias::{row_segments, RelativeBias};
use crate::Result;

/// A broadcast view of an additive term: storage offset and the strides of `(B, H, Tq, X)`,
/// where `X` is `Tk` for a dense term and the row width for a relative one.
struct Strided {
    tensor: Tensor,
    offset: usize,
    strides: [usize; 4],
    /// `Some((shift, width))` for a relative term.
    relative: Option<(i64, usize)>,
}

impl Strided {
    fn new(
        t: &Tensor,
        shape: (usize, usize, usize, usize),
        relative: Option<(i64, usize)>,
    ) -> Result<Self> {
        let t = t.broadcast_as(shape)?;
        let l = t.layout();
        let s = l.stride();
        Ok(Self {
            offset: l.start_offset(),
            strides: [s[0], s[1], s[2], s[3]],
            tensor: t,
            relative,
        })
    }

    /// Adds this term's row `(bi, hi, i)` to `row` (the first `row.len()` keys).
    fn add_row(&self, src: &[f32], bi: usize, hi: usize, i: usize, row: &mut [f32]) {
        let [s0, s1, s2, s3] = self.strides;
        let base = self.offset + bi * s0 + hi * s1 + i * s2;
        match self.relative {
            None if s3 == 1 => {
                for (x, y) in row.iter_mut().zip(&src[base..]) {
                    *x += y;
                }
            }
            None => {
                for (j, x) in row.iter_mut().enumerate() {
                    *x += src[base + j * s3];
                }
            }
            Some((shift, width)) => {
                // Contiguous values (checked when built): one row of `width` columns.
                let values = &src[base..base + width];
                let (lo, hi) = row_segments(i, shift, width, row.len());
                let first = (lo as i64 - i as i64 + shift) as usize;
                let (left, rest) = row.split_at_mut(lo);
                let (middle, right) = rest.split_at_mut(hi - lo);
                left.iter_mut().for_each(|x| *x += values[0]);
                for (x, y) in middle.iter_mut().zip(&values[first..]) {
                    *x += y;
                }
                right.iter_mut().for_each(|x| *x += values[width - 1]);
            }
        }
    }
}

/// The op: additive terms, padding (`(B, Tk)`, non-zero = keep) and causality.
pub(crate) struct BiasMaskSoftmax {
    terms: Vec<Strided>,
    padding: Option<Tensor>,
    causal: Option<usize>,
}

/// Whether the fused pass applies to these logits.
pub(crate) fn applies(scores: &Tensor) -> bool {
    scores.device().is_cpu()
        && scores.dtype() == candle_core::DType::F32
        && scores.is_contiguous()
        && !scores.track_op()
}

/// Whether a relative term can be read by the fused pass.
pub(crate) fn relative_applies(bias: &RelativeBias) -> bool {
    let v = &bias.values;
    v.device().is_cpu() && v.dtype() == candle_core::DType::F32 && v.rank() == 4
}

/// Softmax of `scores + Σ dense + Σ relative` over kept keys, written into `scores`.
///
/// `dense` terms must be f32 CPU tensors broadcastable to `scores`, `relative` terms pass
/// [`relative_applies`]; `padding` `(B, Tk)` u8; `causal = Some(first)` keeps keys
/// `j ≤ first + i` for query row `i`.
pub(crate) fn bias_mask_softmax_in_place(
    scores: &Tensor,
    dense: &[&Tensor],
    relative: &[&RelativeBias],
    padding: Option<&Tensor>,
    causal: Option<usize>,
) -> Result<()> {
    let shape = scores.dims4()?;
    let mut terms = dense
        .iter()
        .map(|t| Strided::new(t, shape, None))
        .collect::<Result<Vec<_>>>()?;
    for rel in relative {
        let (_, _, _, width) = rel.dims()?;
        let values = rel.values.contiguous()?;
        let (b, h, tq, _) = shape;
        terms.push(Strided::new(
            &values,
            (b, h, tq, width),
            Some((rel.shift, width)),
        )?);
    }
    let op = BiasMaskSoftmax {
        terms,
        padding: padding.map(|p| p.contiguous()).transpose()?,
        causal,
    };
    scores.inplace_op1(&op)?;
    Ok(())
}

impl InplaceOp1 for BiasMaskSoftmax {
    fn name(&self) -> &'static str {
        "posenc-bias-mask-softmax"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let (b, h, tq, tk) = layout.shape().dims4()?;
        let (CpuStorage::F32(data), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("fused softmax: logits must be contiguous f32");
        };
        let data = &mut data[start..end];
        let mut run = |terms: &[(&[f32], &Strided)], padding: Option<&[u8]>| {
            data.par_chunks_mut(tk.max(1))
                .enumerate()
                .for_each(|(r, row)| {
                    let (bi, hi, i) = (r / (h * tq), (r / tq) % h, r % tq);
                    let visible = self.causal.map_or(tk, |first| (first + i + 1).min(tk));
                    let (row, hidden) = row.split_at_mut(visible);
                    for (src, t) in terms {
                        t.add_row(src, bi, hi, i, row);
                    }
                    if let Some(p) = padding {
                        for (x, keep) in row.iter_mut().zip(&p[bi * tk..]) {
                            if *keep == 0 {
                                *x = f32::MIN;
                            }
                        }
                    }
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    if max == f32::MIN && !hidden.is_empty() {
                        // Every key masked: uniform over the whole row, as the unfused path
                        // (which fills the hidden keys with the same lowest value) gives.
                        let u = 1.0 / tk as f32;
                        row.iter_mut().chain(hidden.iter_mut()).for_each(|x| *x = u);
                        return;
                    }
                    let mut sum = 0f32;
                    for x in row.iter_mut() {
                        // Below e^-87 the result would be subnormal (slow on x86, and under
                        // 2e-38 next to a sum of at least 1): flush it to zero.
                        let d = *x - max;
                        *x = if d > -87.0 { d.exp() } else { 0.0 };
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    for x in row.iter_mut() {
                        *x *= inv;
                    }
                    hidden.iter_mut().for_each(|x| *x = 0.0);
                });
        };
        // Hold a read guard on every term's storage for the whole pass.
        let guards: Vec<_> = self
            .terms
            .iter()
            .map(|t| t.tensor.storage_and_layout().0)
            .collect();
        let terms = guards
            .iter()
            .zip(&self.terms)
            .map(|(g, t)| match &**g {
                Storage::Cpu(CpuStorage::F32(v)) => Ok((v.as_slice(), t)),
                _ => candle_core::bail!("fused softmax: additive terms must be f32 CPU tensors"),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let pad_guard = self.padding.as_ref().map(|p| p.storage_and_layout());
        let padding = match &pad_guard {
            None => None,
            Some((g, l)) => match (&**g, l.contiguous_offsets()) {
                (Storage::Cpu(CpuStorage::U8(v)), Some((a, z))) if z - a == b * tk => {
                    Some(&v[a..z])
                }
                _ => candle_core::bail!(
                    "fused softmax: the padding mask must be a contiguous ({b}, {tk}) u8 CPU tensor"
                ),
            },
        };
        run(&terms, padding);
        Ok(())
    }
}
