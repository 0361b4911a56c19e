//! Clipped relative position bias: one learned scalar per head and clipped distance (the
//! seeds' `RelativePositionBias`; the scalar form of Shaw et al. 2018's clipped distances).
//!
//! ```text
//! bias[h, i, j] = table[clamp(j − i, −k, k) + k, h]      table: (2k + 1, num_heads), learned
//! ```
//!
//! # Shapes
//! - bias: `(1, H, Tq, Tk)` for offsets, `(B, H, Tq, Tk)` for per-sequence ids.
//! - table `bias_table.weight`: `(2·max_distance + 1, num_heads)` (the seeds' `nn.Embedding`
//!   named `bias_table`).

use serde::{Deserialize, Serialize};

use super::{clipped_row, BucketedRelativeBias, RelativeBucketing};
use crate::error::{Error, Result};
use crate::limits::check_elements;

/// Configuration of [`ClippedRelativeBias`].
///
/// Serialised (serde) with its field names, e.g. as JSON `{"num_heads": 8, "max_distance": 16}`;
/// both are required.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClippedBiasConfig {
    /// Attention heads, > 0.
    pub num_heads: usize,
    /// Clip distance `k` (> 0): farther pairs share the bias of distance ±k.
    pub max_distance: usize,
}

impl ClippedBiasConfig {
    /// `num_heads` heads clipped at `max_distance`.
    pub fn new(num_heads: usize, max_distance: usize) -> Self {
        Self {
            num_heads,
            max_distance,
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for zero heads, a zero or absurd (> 2^30) clip distance, or a table
    /// past [`crate::limits::max_elements`].
    pub fn validate(&self) -> Result<()> {
        if self.num_heads == 0 {
            return Err(Error::config("num_heads", self.num_heads, "at least 1"));
        }
        if self.max_distance == 0 || self.max_distance > 1 << 30 {
            return Err(Error::config(
                "max_distance",
                self.max_distance,
                "between 1 and 2^30",
            ));
        }
        check_elements(
            "num_heads",
            self.num_heads,
            "(2 · max_distance + 1) × num_heads",
            &[2 * self.max_distance + 1, self.num_heads],
        )?;
        Ok(())
    }

    /// The table row of distance `d = j − i`: `clamp(d, −k, k) + k`.
    ///
    /// Total: it never panics. A configuration that [`Self::validate`] refuses (a clip
    /// distance of 0 or past 2^30) has no rows to name, and its rows are saturated values;
    /// [`Self::try_bucket`] checks the configuration first.
    pub fn bucket(&self, d: i64) -> u32 {
        clipped_row(self.max_distance, d)
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

impl RelativeBucketing for ClippedBiasConfig {
    const TABLE: &'static str = "bias_table";

    fn num_heads(&self) -> usize {
        self.num_heads
    }

    fn num_buckets(&self) -> usize {
        self.max_distance.saturating_mul(2).saturating_add(1)
    }

    fn bucket(&self, d: i64) -> u32 {
        ClippedBiasConfig::bucket(self, d)
    }

    fn validate(&self) -> Result<()> {
        ClippedBiasConfig::validate(self)
    }
}

/// A learned bias per head and clipped relative distance, table `bias_table.weight`.
///
/// # Example
/// ```
/// use candle_core::{Device, DType};
/// use candle_nn::VarBuilder;
/// use candle_posenc::{ClippedBiasConfig, ClippedRelativeBias, Positions};
///
/// let rb = ClippedRelativeBias::new(&ClippedBiasConfig::new(4, 2), VarBuilder::zeros(DType::F32, &Device::Cpu))?;
/// let bias = rb.bias(&Positions::Offset(0), 6, &Positions::Offset(0), 6)?;
/// assert_eq!(bias.dims(), &[1, 4, 6, 6]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
pub type ClippedRelativeBias = BucketedRelativeBias<ClippedBiasConfig>;

impl crate::plug::SchemeConfig for ClippedBiasConfig {
    fn validate(&self) -> Result<()> {
        ClippedBiasConfig::validate(self)
    }

    fn build(
        &self,
        vb: candle_nn::VarBuilder,
    ) -> Result<std::sync::Arc<dyn crate::plug::PositionalEncoding>> {
        Ok(std::sync::Arc::new(ClippedRelativeBias::new(self, vb)?))
    }
}
