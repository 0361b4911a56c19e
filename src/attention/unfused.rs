//! One query block as candle ops (and, on the CPU in f32 inference, the in-place row pass):
//! the path that returns the weights, trains, and runs on every device and dtype.
//!
//! ```text
//! s = cap(q kᵀ) + Σ terms             q already scaled; terms dense (B, H, n, kv), shifted rows
//!                                     or separable pairs (the row pass)
//! α = softmax(s masked ‖ sink)[..kv]  masked logits filled with the dtype's lowest value; a
//!                                     head's sink logit joins the softmax and is dropped after
//! out = dropout(α) v + Σ_j dropout(α)_ij table[c(i, j)]
//! ```

use candle_core::{DType, Tensor, D};

use super::blocks::{Block, LogitTerms};
use super::fused_softmax;
use super::mask::{apply_keep_mask, keep_mask};
use crate::error::Result;
use crate::matmul::matmul;
use crate::plug::RelativeValues;

/// The weights and output of one block, both `(B, H, n, ·)`. `row_pass` runs bias, masks and
/// softmax in place (f32 CPU inference only); `differentiable` takes candle's differentiable
/// softmax (otherwise its fused one, which has no backward); `dropout` is the training dropout
/// (0 in inference).
pub(crate) fn attend(
    part: &Block,
    terms: &LogitTerms,
    values: Option<&RelativeValues>,
    row_pass: bool,
    differentiable: bool,
    dropout: f32,
) -> Result<(Tensor, Tensor)> {
    let mut scores = matmul(&part.q, &part.k.t()?)?;
    let rule = &part.rule;
    let probs = if row_pass {
        fused_softmax::bias_mask_softmax_in_place(
            &scores,
            (
                &terms.dense.iter().collect::<Vec<_>>(),
                &terms.rows.iter().collect::<Vec<_>>(),
                &terms.separable.iter().collect::<Vec<_>>(),
            ),
            part.padding,
            rule,
        )?;
        scores
    } else {
        if let Some(c) = rule.softcap {
            // In f32 at least: a cap outside f16's range (or near bf16's top) would turn finite
            // logits into NaN in their own dtype.
            let c = f64::from(c);
            let dtype = scores.dtype();
            let wide = match dtype {
                DType::F16 | DType::BF16 => scores.to_dtype(DType::F32)?,
                _ => scores,
            };
            scores = ((wide / c)?.tanh()? * c)?.to_dtype(dtype)?;
        }
        for term in &terms.dense {
            scores = scores.broadcast_add(term)?;
        }
        let (b, h, n, kv) = scores.dims4()?;
        let keep = keep_mask(rule, part.padding, b, n, kv, scores.device())?;
        if let Some(keep) = keep {
            scores = apply_keep_mask(&scores, &keep)?;
        }
        if let Some(sinks) = part.sinks {
            let column = sinks
                .to_dtype(scores.dtype())?
                .reshape((1, h, 1, 1))?
                .broadcast_as((b, h, n, 1))?;
            scores = Tensor::cat(&[&scores, &column], 3)?;
        }
        // In f32 for half formats: a row's sum of exponentials accumulated in bf16 (8 bits of
        // mantissa) drifts by whole percents over a few hundred keys, so its weights no longer
        // sum to one; the weights return to the block's dtype after.
        let dtype = scores.dtype();
        let wide = match dtype {
            DType::F16 | DType::BF16 => scores.to_dtype(DType::F32)?,
            _ => scores,
        };
        let probs = if differentiable {
            candle_nn::ops::softmax(&wide, D::Minus1)?
        } else {
            candle_nn::ops::softmax_last_dim(&wide.contiguous()?)?
        }
        .to_dtype(dtype)?;
        match part.sinks {
            Some(_) => probs.narrow(3, 0, kv)?,
            None => probs,
        }
    };
    let dropped = if dropout > 0.0 {
        candle_nn::ops::dropout(&probs, dropout)?
    } else {
        probs.clone()
    };
    let mut out = matmul(&dropped, &part.v)?;
    if let Some(values) = values {
        out = (out + values.weighted_sum(&dropped)?)?;
    }
    Ok((probs, out))
}
