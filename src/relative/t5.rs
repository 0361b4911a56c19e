//! T5 relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning
//! with a Unified Text-to-Text Transformer", §2.1).
//!
//! ```text
//! d = j − i                                     (key position minus query position)
//! bidirectional: n = num_buckets / 2, offset = n if d > 0 else 0, r = |d|
//! causal:        n = num_buckets,     offset = 0,                r = max(−d, 0)
//! exact = n / 2
//! bucket(d) = offset + r                                                       if r < exact
//!           = offset + min(n − 1, exact + ⌊ln(r / exact) / ln(max_distance / exact) · (n − exact)⌋)
//! bias[h, i, j] = table[bucket(j − i), h]       table: (num_buckets, num_heads), learned
//! ```
//!
//! The bucket function follows HF transformers' `T5Attention._relative_position_bucket`
//! exactly, including its f32 arithmetic in the log branch (so bucket edges agree with it); the
//! log is only evaluated where `r ≥ exact`. T5 computes the bias once, in the first layer, and
//! shares it with every layer: build one [`T5RelativeBias`] and plug the same `Arc` into each
//! layer. T5 does not scale logits by `1/√d`; set the attention's `softmax_scale` to 1 for T5
//! checkpoints.
//!
//! # Shapes
//! - bias: `(1, H, Tq, Tk)` for offsets, `(B, H, Tq, Tk)` for per-sequence ids.
//! - table `relative_attention_bias.weight`: `(num_buckets, num_heads)`.
//!
//! candle-transformers' T5 uses bidirectional buckets in the decoder as well; this follows HF,
//! where the decoder's self-attention is causal (`bidirectional = false`).

use serde::{Deserialize, Serialize};

use super::{BucketedRelativeBias, RelativeBucketing};
use crate::error::{Error, Result};
use crate::limits::check_elements;

/// Configuration of [`T5RelativeBias`].
///
/// Serialised (serde) with its field names, e.g. as JSON
/// `{"num_heads": 8, "num_buckets": 32, "max_distance": 128, "bidirectional": true}`; only
/// `num_heads` is required, the other fields default as in [`T5Config::new`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct T5Config {
    /// Attention heads, > 0.
    pub num_heads: usize,
    /// Buckets (default 32); at least 2, or 4 when bidirectional.
    #[serde(default = "defaults::num_buckets")]
    pub num_buckets: usize,
    /// Distance from which every farther pair shares the last bucket (default 128).
    #[serde(default = "defaults::max_distance")]
    pub max_distance: usize,
    /// Encoder-style (keys after the query get their own buckets) or decoder-style (default
    /// true).
    #[serde(default = "defaults::bidirectional")]
    pub bidirectional: bool,
}

/// Values of the fields a serialised [`T5Config`] leaves out: those of [`T5Config::new`].
mod defaults {
    use super::T5Config;

    pub(super) fn num_buckets() -> usize {
        T5Config::new(0).num_buckets
    }

    pub(super) fn max_distance() -> usize {
        T5Config::new(0).max_distance
    }

    pub(super) fn bidirectional() -> bool {
        T5Config::new(0).bidirectional
    }
}

impl T5Config {
    /// T5's defaults: 32 buckets, max distance 128, bidirectional.
    pub fn new(num_heads: usize) -> Self {
        Self {
            num_heads,
            num_buckets: 32,
            max_distance: 128,
            bidirectional: true,
        }
    }

    /// Sets the number of buckets.
    pub fn with_num_buckets(mut self, n: usize) -> Self {
        self.num_buckets = n;
        self
    }

    /// Sets the max distance.
    pub fn with_max_distance(mut self, d: usize) -> Self {
        self.max_distance = d;
        self
    }

    /// Sets bidirectional (encoder) or causal (decoder) bucketing.
    pub fn with_bidirectional(mut self, bidirectional: bool) -> Self {
        self.bidirectional = bidirectional;
        self
    }

    /// Buckets per direction and the size of the exact range.
    fn halves(&self) -> (usize, usize) {
        let n = if self.bidirectional {
            self.num_buckets / 2
        } else {
            self.num_buckets
        };
        (n, n / 2)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for zero heads, too few buckets (< 2, or < 4 bidirectional), or
    /// a `max_distance` not greater than the exact range (`num_buckets / 2`, halved again when
    /// bidirectional), or a table past [`crate::limits::max_elements`].
    pub fn validate(&self) -> Result<()> {
        if self.num_heads == 0 {
            return Err(Error::config("num_heads", self.num_heads, "at least 1"));
        }
        let min = if self.bidirectional { 4 } else { 2 };
        if self.num_buckets < min {
            return Err(Error::config(
                "num_buckets",
                self.num_buckets,
                format!("at least {min} (bidirectional: {})", self.bidirectional),
            ));
        }
        check_elements(
            "num_buckets",
            self.num_buckets,
            format_args!("num_buckets × num_heads ({})", self.num_heads),
            &[self.num_buckets, self.num_heads],
        )?;
        // Buckets index the table as u32 (a budget raised past 2^32 must not wrap them).
        if u32::try_from(self.num_buckets).is_err() {
            return Err(Error::config(
                "num_buckets",
                self.num_buckets,
                format!("at most {} (buckets are u32 indices)", u32::MAX),
            ));
        }
        let (_, exact) = self.halves();
        if self.max_distance <= exact {
            return Err(Error::config(
                "max_distance",
                self.max_distance,
                format!("greater than the exact range ({exact})"),
            ));
        }
        Ok(())
    }

    /// The bucket of relative distance `d = j − i`, as HF T5 computes it.
    ///
    /// Total: it never panics (it saturates where an unchecked configuration would overflow).
    /// Buckets are defined for valid configurations only: with no bucket, or a `max_distance`
    /// within the exact range, the log branch has no answer and the value means nothing;
    /// [`Self::try_bucket`] checks the configuration first.
    pub fn bucket(&self, d: i64) -> u32 {
        let (n, exact) = self.halves();
        let (offset, r) = if self.bidirectional {
            (if d > 0 { n } else { 0 }, d.unsigned_abs())
        } else {
            // Keys after the query share bucket 0; |d| without negating (i64::MIN has no −d).
            (0, if d < 0 { d.unsigned_abs() } else { 0 })
        };
        let within = if r < exact as u64 {
            r as usize
        } else {
            // f32 throughout, as HF does: ln(r / exact) / ln(max_distance / exact) · (n − exact).
            // The cast saturates (∞ → usize::MAX, NaN → 0), and so does the sum: a far
            // distance whose quotient passes usize lands in the last bucket, never wraps.
            let ratio = (r as f32 / exact as f32).ln();
            let scale = (self.max_distance as f64 / exact as f64).ln() as f32;
            let large = exact.saturating_add((ratio / scale * (n - exact) as f32) as usize);
            large.min(n.saturating_sub(1))
        };
        u32::try_from(offset.saturating_add(within)).unwrap_or(u32::MAX)
    }

    /// [`Self::bucket`] of a checked configuration.
    ///
    /// # Errors
    /// As [`Self::validate`].
    pub fn try_bucket(&self, d: i64) -> Result<u32> {
        self.validate()?;
        Ok(self.bucket(d))
    }
}

impl RelativeBucketing for T5Config {
    const TABLE: &'static str = "relative_attention_bias";

    fn num_heads(&self) -> usize {
        self.num_heads
    }

    fn num_buckets(&self) -> usize {
        self.num_buckets
    }

    fn bucket(&self, d: i64) -> u32 {
        T5Config::bucket(self, d)
    }

    fn validate(&self) -> Result<()> {
        T5Config::validate(self)
    }
}

/// T5's bucketed relative position bias, a learned `(num_buckets, num_heads)` table named
/// `relative_attention_bias.weight` (HF T5's name); its `bias` is HF's `compute_bias`.
///
/// # Example
/// ```
/// use candle_core::{Device, DType};
/// use candle_nn::VarBuilder;
/// use candle_posenc::{Positions, T5Config, T5RelativeBias};
///
/// let t5 = T5RelativeBias::new(&T5Config::new(8), VarBuilder::zeros(DType::F32, &Device::Cpu))?;
/// assert_eq!(t5.config().bucket(-3), 3);  // 3 keys back, exact bucket
/// assert_eq!(t5.config().bucket(3), 19);  // 3 keys ahead: the second half
/// let bias = t5.bias(&Positions::Offset(0), 5, &Positions::Offset(0), 5)?;
/// assert_eq!(bias.dims(), &[1, 8, 5, 5]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
pub type T5RelativeBias = BucketedRelativeBias<T5Config>;

impl crate::plug::SchemeConfig for T5Config {
    fn validate(&self) -> Result<()> {
        T5Config::validate(self)
    }

    fn build(
        &self,
        vb: candle_nn::VarBuilder,
    ) -> Result<std::sync::Arc<dyn crate::plug::PositionalEncoding>> {
        Ok(std::sync::Arc::new(T5RelativeBias::new(self, vb)?))
    }
}
