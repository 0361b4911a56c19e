//! Attention temperature tuning: queries sharpened with the logarithm of their position (Llama 4's
//! NoPE layers).
//!
//! ```text
//! q_p ← q_p · (1 + s · ln(1 + ⌊(p + 1) / f⌋))       s = attn_scale, f = floor_scale
//! ```
//!
//! A layer without positional encoding spreads its attention more thinly as the context grows;
//! scaling the logits by the log of the length keeps the distribution as sharp at 100k tokens
//! as at 8k. Llama 4 applies the factor to the queries of its NoPE layers, stepped every
//! `floor_scale` positions (8192; `attn_scale` 0.1), after the query/key norm.
//!
//! `p` is the query's key index (its cache slot: the tokens before it in the cache, plus its
//! index in the chunk), as HF counts it (`cache_position`), not its position id.
//!
//! # Shapes
//! - the factors: `(1, 1, T, 1)` for a chunk of `T` queries, multiplying `(B, H, T, D)` queries.
//!
//! Reference: Nakanishi 2025, "Scalable-Softmax Is Superior for Attention" (arXiv:2501.19399);
//! Meta's Llama 4 (`attn_temperature_tuning`, `floor_scale`, `attn_scale`).

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::cpu::row_scale::scale_rows_owned;
use crate::error::{Error, Result};

/// Settings of [`AttentionConfig::attention_temperature`](super::AttentionConfig::attention_temperature).
///
/// Serialised (serde) as `{"attn_scale": 0.1, "floor_scale": 8192}` (both required).
///
/// # Example
/// ```
/// use candle_posenc::attention::AttentionTemperature;
///
/// let t = AttentionTemperature::new(0.1, 8192);
/// assert_eq!(t.factor(0), 1.0); // ⌊1 / 8192⌋ = 0
/// assert!((t.factor(8191) - (1.0 + 0.1 * 2f64.ln())).abs() < 1e-12);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionTemperature {
    /// `s`: the weight of the logarithm (Llama 4: 0.1).
    pub attn_scale: f64,
    /// `f`: positions per step of the logarithm (Llama 4: 8192).
    pub floor_scale: usize,
}

impl AttentionTemperature {
    /// Llama 4's form with weight `attn_scale` and steps of `floor_scale` positions.
    pub fn new(attn_scale: f64, floor_scale: usize) -> Self {
        Self {
            attn_scale,
            floor_scale,
        }
    }

    /// The largest `attn_scale` [`Self::validate`] accepts, `f32::MAX / 64`: the logarithm is
    /// below 45 at every position (`p < 2^64`), so the factor stays finite in f32.
    pub const MAX_ATTN_SCALE: f64 = f32::MAX as f64 / 64.0;

    /// The largest factor at any key index (`p < 2^64`: the factor grows with `p`), the one a
    /// block checks against its dtype's range when it is built.
    pub fn largest_factor(&self) -> f64 {
        self.factor(usize::MAX)
    }

    /// The factor `1 + s · ln(1 + ⌊(p + 1) / f⌋)` of the query at key index `p`.
    pub fn factor(&self, p: usize) -> f64 {
        let steps = (p as f64 + 1.0) / self.floor_scale.max(1) as f64;
        1.0 + self.attn_scale * steps.floor().ln_1p()
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an `attn_scale` that is negative, NaN or past
    /// [`Self::MAX_ATTN_SCALE`], or a `floor_scale` of 0.
    pub fn validate(&self) -> Result<()> {
        // The factor multiplies f32 (or narrower) queries, so it must be finite in f32 at
        // every position: ln(1 + ⌊(p + 1)/f⌋) ≤ ln(1 + 2^64) < 45, so s ≤ f32::MAX / 64 keeps
        // 1 + s·ln(..) finite wherever p is.
        if !(self.attn_scale >= 0.0 && self.attn_scale <= Self::MAX_ATTN_SCALE) {
            return Err(Error::config(
                "attention_temperature.attn_scale",
                self.attn_scale,
                "a number from 0 to f32::MAX / 64 (so the factor 1 + s·ln(1 + ⌊(p + 1)/f⌋) is finite in f32 at every position)",
            ));
        }
        if self.floor_scale == 0 {
            return Err(Error::config(
                "attention_temperature.floor_scale",
                0,
                "at least 1 position",
            ));
        }
        Ok(())
    }

    /// `q` `(B, H, T, D)` whose query `i` sits at key index `first + i`, each multiplied by its
    /// factor (computed in f32, as HF does, and cast back to `q`'s dtype).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `attn_scale` if the factor at the chunk's last key
    /// index (the largest: the factor grows with `p`) is not finite in f32 — never for a
    /// validated configuration, checked here since the fields are public.
    pub(super) fn apply(&self, q: Tensor, first: usize) -> Result<Tensor> {
        let t = q.dim(2)?;
        let last = first.saturating_add(t.saturating_sub(1));
        if !(self.factor(last) as f32).is_finite() {
            return Err(Error::config(
                "attention_temperature.attn_scale",
                self.attn_scale,
                format!("a factor finite in f32 at key index {last}, the chunk's last"),
            ));
        }
        let factors: Vec<f32> = (0..t)
            .map(|i| self.factor(first.saturating_add(i)) as f32)
            .collect();
        scale_rows_owned(q, factors)
    }
}
