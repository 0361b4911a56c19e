//! Causal and padding masks, applied by filling masked logits with the dtype's lowest value.
//!
//! Filling (instead of adding `-inf`) keeps a fully masked row finite: it gets uniform weights,
//! as in HF transformers, instead of NaN.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

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
    Ok(padding.ne(&padding.zeros_like()?)?)
}

/// Keep-mask (`u8`, 1 = attend) broadcastable to `(B, 1, Tq, Tk)`, or `None` when nothing is
/// masked. With `causal = Some(first)`, query row `r` keeps keys `j ≤ first + r` (for a whole
/// chunk `first = tk − tq`: row `r` is cache index `tk − tq + r`), and with a `window` of `w`
/// only keys `j > first + r − w`. `padding` is a checked `(B, Tk)` 0/1 mask (see
/// [`check_padding`]).
pub(crate) fn keep_mask(
    causal: Option<usize>,
    window: Option<usize>,
    padding: Option<&Tensor>,
    batch: usize,
    tq: usize,
    tk: usize,
    device: &Device,
) -> Result<Option<Tensor>> {
    let causal_mask = match causal {
        Some(first) if tq > 0 => {
            let first = first as u32;
            let key_index = Tensor::arange(0u32, tk as u32, device)?.unsqueeze(0)?;
            let last_visible = Tensor::arange(first, first + tq as u32, device)?.unsqueeze(1)?;
            let mut keep = key_index.broadcast_le(&last_visible)?;
            if let Some(w) = window {
                // Row r keeps the last w keys it sees: j ≥ first + r + 1 − w (built on the host
                // from sizes, one value per row).
                let starts: Vec<u32> = (0..tq)
                    .map(|r| (first as usize + r + 1).saturating_sub(w) as u32)
                    .collect();
                let start = Tensor::from_vec(starts, (tq, 1), device)?;
                keep = keep.mul(&key_index.broadcast_ge(&start)?)?;
            }
            Some(keep.reshape((1, 1, tq, tk))?)
        }
        _ => None,
    };
    let padding_mask = match padding {
        None => None,
        Some(p) => Some(p.reshape((batch, 1, 1, tk))?),
    };
    Ok(match (causal_mask, padding_mask) {
        (None, None) => None,
        (Some(c), None) => Some(c),
        (None, Some(p)) => Some(p),
        (Some(c), Some(p)) => Some(c.broadcast_mul(&p)?),
    })
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

/// The additive mask in the logits' `dtype`. A finite value past the dtype's range (an f64
/// mask of `f64::MIN` for f32 logits) saturates to its largest finite value instead of
/// becoming ±∞ in the cast, so a finite mask stays finite; NaN and ±∞ pass through as given.
pub(crate) fn cast_mask(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let limit = match dtype {
        DType::F16 => 65504.0,
        DType::BF16 => 3.389_531_389_251_535_5e38,
        DType::F32 => f32::MAX as f64,
        _ => return Ok(mask.to_dtype(dtype)?),
    };
    let wider = match mask.dtype() {
        DType::F64 => true,
        // bf16's largest value is below f32's: f32::MIN rounds to −∞ there.
        DType::F32 => matches!(dtype, DType::F16 | DType::BF16),
        DType::BF16 => matches!(dtype, DType::F16),
        _ => false,
    };
    if !wider {
        return Ok(mask.to_dtype(dtype)?);
    }
    let size = mask.abs()?;
    let past = size.gt(limit)?.mul(&size.lt(f64::INFINITY)?)?;
    let saturated = (mask.sign()? * limit)?;
    Ok(past.where_cond(&saturated, mask)?.to_dtype(dtype)?)
}
