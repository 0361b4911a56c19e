//! One query block as candle ops (and, on the CPU in f32 inference, the in-place row pass):
//! the path that returns the weights, trains, and runs on every device and dtype.
//!
//! ```text
//! s = cap(q kᵀ) + Σ terms             q already scaled; terms dense (B, H, n, kv), shifted rows
//!                                     or separable pairs (the row pass); summed in f32 (f64)
//! α = softmax(s masked ‖ sink)[..kv]  masked logits filled with f32's (f64's) lowest value; a
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
    let scores = matmul(&part.q, &part.k.t()?)?;
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
        // Caps, terms, masks, sinks and the softmax in f32 for half formats, as the terms come
        // (`LogitTerms`): a term rounded to the logits' half format would lose its low bits,
        // a cap outside f16's range (or near bf16's top) would turn finite logits into NaN,
        // and a row's sum of exponentials accumulated in bf16 (8 bits of mantissa) drifts by
        // whole percents over a few hundred keys. The weights return to the block's dtype
        // after.
        let dtype = scores.dtype();
        let mut wide = match dtype {
            DType::F16 | DType::BF16 => scores.to_dtype(DType::F32)?,
            _ => scores,
        };
        if let Some(c) = rule.softcap {
            let c = f64::from(c);
            wide = ((wide / c)?.tanh()? * c)?;
        }
        for term in &terms.dense {
            wide = wide.broadcast_add(term)?;
        }
        let (b, h, n, kv) = wide.dims4()?;
        let keep = keep_mask(rule, part.padding, b, n, kv, wide.device())?;
        if let Some(keep) = keep {
            wide = apply_keep_mask(&wide, &keep)?;
        }
        if let Some(sinks) = part.sinks {
            let column = sinks
                .to_dtype(wide.dtype())?
                .reshape((1, h, 1, 1))?
                .broadcast_as((b, h, n, 1))?;
            wide = Tensor::cat(&[&wide, &column], 3)?;
        }
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
