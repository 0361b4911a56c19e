//! Causal and padding masks, applied by filling masked logits with the dtype's lowest value.
//!
//! Filling (instead of adding `-inf`) keeps a fully masked row finite: it gets uniform weights,
//! as in HF transformers, instead of NaN.

use candle_core::{DType, Device, Tensor};

use super::fused_softmax::RowRule;
use crate::error::{largest_finite, Error, Result};

/// The lowest finite value of a float dtype, used as the fill for masked logits.
fn lowest(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => -65504.0,
        DType::BF16 => -3.389_531_389_251_535_5e38,
        DType::F32 => f32::MIN as f64,
        _ => f64::MIN,
    }
}

/// Checks a `(B, Tk)` padding mask (non-zero where a key is a real token) and returns it as
/// `u8` 0/1.
pub(crate) fn check_padding(padding: &Tensor, batch: usize, tk: usize) -> Result<Tensor> {
    if padding.dims() != [batch, tk] {
        return Err(Error::shape(
            "padding mask",
            format!("({batch}, {tk}) = (batch, number of keys including cached ones)"),
            padding.shape(),
        ));
    }
    // The dtypes every backend compares (candle's CUDA kernels have no i16/i32 comparison
    // and no cast from them).
    if !matches!(
        padding.dtype(),
        DType::U8 | DType::U32 | DType::I64 | DType::BF16 | DType::F16 | DType::F32 | DType::F64
    ) {
        return Err(Error::DType {
            what: "padding mask",
            expected: "u8, u32, i64, bf16, f16, f32 or f64 (non-zero = a real token)",
            got: padding.dtype(),
        });
    }
    Ok(padding.ne(&padding.zeros_like()?)?)
}

/// Keep-mask (`u8`, 1 = attend) broadcastable to `(B, 1, Tq, Tk)`, or `None` when nothing is
/// masked: the keys `rule` lets each query row see (its causal limit, window and chunk; query
/// row `r` is key `rule.first + r`), and the unpadded ones. `padding` is a checked `(B, Tk)`
/// 0/1 mask (see [`check_padding`]).
///
/// Built from sizes on the host (one start and end per row) and, for chunks counted from each
/// sequence's first unpadded key, from the padding mask on its device.
pub(crate) fn keep_mask(
    rule: &RowRule,
    padding: Option<&Tensor>,
    batch: usize,
    tq: usize,
    tk: usize,
    device: &Device,
) -> Result<Option<Tensor>> {
    let index = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let key_index = Tensor::arange(0u32, index(tk), device)?.unsqueeze(0)?;
    let padded_chunks = rule.needs_left() && padding.is_some();
    // Each row's keys start..end from the causal limit and the window (and the chunk when no
    // key is padded: then every sequence starts at key 0).
    let spans: Vec<(usize, usize)> = (0..tq)
        .map(|r| {
            let (mut start, mut end) = match padded_chunks {
                true => RowRule {
                    chunk: None,
                    ..rule.clone()
                }
                .span(r, 0),
                false => rule.span(r, 0),
            };
            end = end.min(rule.visible(r, tk));
            start = start.min(end);
            (start, end)
        })
        .collect();
    let limited = spans.iter().any(|&(start, end)| start > 0 || end < tk);
    let span_mask = match limited && tq > 0 {
        false => None,
        true => {
            let starts: Vec<u32> = spans.iter().map(|&(s, _)| index(s)).collect();
            let ends: Vec<u32> = spans.iter().map(|&(_, e)| index(e)).collect();
            let start = Tensor::from_vec(starts, (tq, 1), device)?;
            let end = Tensor::from_vec(ends, (tq, 1), device)?;
            let keep = key_index
                .broadcast_ge(&start)?
                .mul(&key_index.broadcast_lt(&end)?)?;
            Some(keep.reshape((1, 1, tq, tk))?)
        }
    };
    let chunk_mask = match (rule.chunk, padding) {
        (Some(c), Some(p)) if padded_chunks && tq > 0 => {
            Some(padded_chunk_mask(c, rule.first, p, (batch, tq, tk))?)
        }
        _ => None,
    };
    let padding_mask = match padding {
        None => None,
        Some(p) => Some(p.reshape((batch, 1, 1, tk))?),
    };
    let mut keep: Option<Tensor> = None;
    for mask in [span_mask, chunk_mask, padding_mask].into_iter().flatten() {
        keep = Some(match keep {
            None => mask,
            Some(k) => k.broadcast_mul(&mask)?,
        });
    }
    Ok(keep)
}

/// `(B, 1, Tq, Tk)`: key `j` and query `p = first + r` lie in the same chunk of `c`, chunks
/// counted from the sequence's first unpadded key `l`, i.e. `⌊(j − l) / c⌋ = ⌊(p − l) / c⌋`.
/// Computed on the padding mask's device in u32: both sides are shifted by a multiple of `c`
/// past every `l` so that no difference is negative.
fn padded_chunk_mask(
    c: usize,
    first: usize,
    padding: &Tensor,
    (batch, tq, tk): (usize, usize, usize),
) -> Result<Tensor> {
    let device = padding.device();
    // Every index and every l lie below `span`: a chunk that long or longer splits them only at
    // l, so chunks past it are the same as chunks of `span` (and fit in u32 wherever the
    // indices do).
    let span = (first + tq).max(tk).saturating_add(1);
    let c = c.clamp(1, span);
    // A multiple of c at or past every l (l ≤ tk).
    let shift = tk.div_ceil(c).saturating_mul(c);
    let fits = |n: usize| u32::try_from(n).ok();
    let top = shift
        .saturating_add(first)
        .saturating_add(tq)
        .saturating_add(tk);
    let (Some(c32), Some(_)) = (fits(c), fits(top)) else {
        return Err(Error::config(
            "number of keys",
            tk,
            format!(
                "a chunked padded block whose shifted key indices (up to {top}) fit in u32, the index type of its mask on this path"
            ),
        ));
    };
    let keys = Tensor::arange(0u32, tk as u32, device)?;
    // l per sequence: the first kept key's index (tk when every key is padded).
    let all = Tensor::full(tk as u32, tk, device)?;
    let left = padding
        .ne(0u8)?
        .where_cond(
            &keys.unsqueeze(0)?.broadcast_as((batch, tk))?,
            &all.unsqueeze(0)?.broadcast_as((batch, tk))?,
        )?
        .min_keepdim(1)?; // (B, 1)
    let chunk_of = |positions: Tensor| -> Result<Tensor> {
        // ⌊(x + shift − l) / c⌋ for x of shape (1, N): (B, N).
        let scalar = |n: u32| Tensor::new(&[n], device)?.unsqueeze(0);
        Ok(positions
            .broadcast_add(&scalar(shift as u32)?)?
            .broadcast_sub(&left)?
            .broadcast_div(&scalar(c32)?)?)
    };
    let key_chunks = chunk_of(keys.unsqueeze(0)?)?; // (B, Tk)
    let rows = Tensor::arange(first as u32, (first + tq) as u32, device)?.unsqueeze(0)?;
    let row_chunks = chunk_of(rows)?; // (B, Tq)
    Ok(row_chunks
        .unsqueeze(2)?
        .broadcast_eq(&key_chunks.unsqueeze(1)?)?
        .unsqueeze(1)?)
}

/// `scores` where `keep` is 1, the dtype's lowest value elsewhere.
pub(crate) fn apply_keep_mask(scores: &Tensor, keep: &Tensor) -> Result<Tensor> {
    let fill = Tensor::new(lowest(scores.dtype()), scores.device())?
        .to_dtype(scores.dtype())?
        .broadcast_as(scores.shape())?;
    Ok(keep
        .broadcast_as(scores.shape())?
        .where_cond(scores, &fill)?)
}

/// A half-precision mask widened to `dtype` (f32) for the fused core: a value at the half
/// format's lowest hides its key as it does in that format, where adding it to any moderate
/// logit gives the lowest value again: it becomes `dtype`'s lowest. Other values are exact in
/// the wider format.
pub(crate) fn widened_mask(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let lowest = match mask.dtype() {
        DType::F16 | DType::BF16 => largest_finite(mask.dtype()).map_or(f64::MIN, |m| -m),
        _ => return Ok(mask.to_dtype(dtype)?),
    };
    let wide = mask.to_dtype(dtype)?;
    let floor = Tensor::full(f32::MIN, (), mask.device())?
        .to_dtype(dtype)?
        .broadcast_as(wide.shape())?;
    Ok(wide.le(lowest)?.where_cond(&floor, &wide)?)
}

/// The additive mask in the logits' `dtype`. A finite value past the dtype's range (an f64
/// mask of `f64::MIN` for f32 logits) saturates to its largest finite value instead of
/// becoming ±∞ in the cast, so a finite mask stays finite; NaN and ±∞ pass through as given.
pub(crate) fn cast_mask(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    // Only a cast to a narrower range can overflow (bf16's largest value is below f32's:
    // f32::MIN rounds to −∞ there).
    let (Some(limit), Some(from)) = (largest_finite(dtype), largest_finite(mask.dtype())) else {
        return Ok(mask.to_dtype(dtype)?);
    };
    if limit >= from {
        return Ok(mask.to_dtype(dtype)?);
    }
    let size = mask.abs()?;
    let past = size.gt(limit)?.mul(&size.lt(f64::INFINITY)?)?;
    let saturated = (mask.sign()? * limit)?;
    Ok(past.where_cond(&saturated, mask)?.to_dtype(dtype)?)
}
