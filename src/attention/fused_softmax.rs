//! Bias, masks and softmax in one in-place pass over the attention logits (CPU, f32).
//!
//! ```text
//! p[b,h,i,:] = softmax_j( s[b,h,i,j] + bias[b,h,i,j] + mask[b,h,i,j] )   over kept keys j
//! kept(i, j) = (not causal or j ≤ i + Tk − Tq) and padding[b, j] ≠ 0
//! ```
//!
//! Masked logits take `f32::MIN`, so a fully masked row is uniform, as in the unfused path.
//! The unfused path adds the bias into a fresh `(B, H, Tq, Tk)` tensor, fills masked entries
//! into another and normalises into a third; here each row is read and written once while it is
//! in cache, and the bias is read through its broadcast strides (an ALiBi `(1, H, 1, Tk)` row
//! is never expanded). Used for inference only: the logits must not be part of a graph.

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::Result;

/// A broadcast view of an additive term: storage offset and the strides of `(B, H, Tq, Tk)`.
struct Strided {
    tensor: Tensor,
    offset: usize,
    strides: [usize; 4],
}

impl Strided {
    fn new(t: &Tensor, shape: (usize, usize, usize, usize)) -> Result<Self> {
        let t = t.broadcast_as(shape)?;
        let l = t.layout();
        let s = l.stride();
        Ok(Self {
            offset: l.start_offset(),
            strides: [s[0], s[1], s[2], s[3]],
            tensor: t,
        })
    }
}

/// The op: additive terms, padding (`(B, Tk)`, non-zero = keep) and causality.
pub(crate) struct BiasMaskSoftmax {
    terms: Vec<Strided>,
    padding: Option<Tensor>,
    causal: bool,
}

/// Whether the fused pass applies to these logits.
pub(crate) fn applies(scores: &Tensor) -> bool {
    scores.device().is_cpu()
        && scores.dtype() == candle_core::DType::F32
        && scores.is_contiguous()
        && !scores.track_op()
}

/// Softmax of `scores + Σ terms` over kept keys, written into `scores`.
///
/// `terms` must be f32 CPU tensors broadcastable to `scores`; `padding` `(B, Tk)` u8.
pub(crate) fn bias_mask_softmax_in_place(
    scores: &Tensor,
    terms: &[&Tensor],
    padding: Option<&Tensor>,
    causal: bool,
) -> Result<()> {
    let shape = scores.dims4()?;
    let terms = terms
        .iter()
        .map(|t| Strided::new(t, shape))
        .collect::<Result<Vec<_>>>()?;
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
        let first_visible = tk.saturating_sub(tq);
        // Read every term's storage once, for the whole pass.
        let mut run = |terms: &[(&[f32], &Strided)], padding: Option<&[u8]>| {
            data.par_chunks_mut(tk.max(1))
                .enumerate()
                .for_each(|(r, row)| {
                    let (bi, hi, i) = (r / (h * tq), (r / tq) % h, r % tq);
                    for (src, t) in terms {
                        let [s0, s1, s2, s3] = t.strides;
                        let base = t.offset + bi * s0 + hi * s1 + i * s2;
                        if s3 == 1 {
                            for (x, y) in row.iter_mut().zip(&src[base..base + tk]) {
                                *x += y;
                            }
                        } else {
                            for (j, x) in row.iter_mut().enumerate() {
                                *x += src[base + j * s3];
                            }
                        }
                    }
                    let last_visible = if self.causal { first_visible + i } else { tk };
                    if self.causal {
                        for x in row.iter_mut().skip(last_visible + 1) {
                            *x = f32::MIN;
                        }
                    }
                    if let Some(p) = padding {
                        for (x, keep) in row.iter_mut().zip(&p[bi * tk..(bi + 1) * tk]) {
                            if *keep == 0 {
                                *x = f32::MIN;
                            }
                        }
                    }
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0f32;
                    for x in row.iter_mut() {
                        // Below e^-87 the result would be subnormal (slow on x86, and under
                        // 2e-38 next to a sum of at least 1): flush it to zero. A NaN logit
                        // stays NaN (and makes the row NaN), as in the unfused softmax.
                        let d = *x - max;
                        *x = if d > -87.0 || d.is_nan() {
                            d.exp()
                        } else {
                            0.0
                        };
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    for x in row.iter_mut() {
                        *x *= inv;
                    }
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
