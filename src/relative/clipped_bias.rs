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

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};

use super::{check_queries, RelativeBiasTable};
use crate::attention::PositionalEncoding;
use crate::{Error, Positions, Result};

/// Configuration of [`ClippedRelativeBias`].
#[derive(Debug, Clone, PartialEq)]
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
    /// [`Error::InvalidConfig`] for zero heads or a zero or absurd (> 2^30) clip distance.
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
        Ok(())
    }

    /// The table row of distance `d = j − i`.
    pub fn bucket(&self, d: i64) -> u32 {
        let k = self.max_distance as i64;
        (d.clamp(-k, k) + k) as u32
    }
}

/// A learned bias per head and clipped relative distance.
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
#[derive(Debug, Clone)]
pub struct ClippedRelativeBias {
    config: ClippedBiasConfig,
    table: RelativeBiasTable,
}

impl ClippedRelativeBias {
    /// Loads (or creates, N(0, 1) like `nn.Embedding`) `bias_table.weight`.
    ///
    /// # Errors
    /// As [`ClippedBiasConfig::validate`]; [`Error::MissingTensor`] / [`Error::TensorShape`].
    pub fn new(config: &ClippedBiasConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        let table = vb.pp("bias_table").get_with_hints(
            (2 * config.max_distance + 1, config.num_heads),
            "weight",
            Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        )?;
        Ok(Self {
            config: config.clone(),
            table: RelativeBiasTable::new(table),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ClippedBiasConfig {
        &self.config
    }

    /// The learned table, `(2k + 1, num_heads)`.
    pub fn weight(&self) -> &Tensor {
        self.table.table()
    }

    /// Bucket maps built so far.
    pub fn bucket_builds(&self) -> usize {
        self.table.builds()
    }

    /// The bias to add to the logits.
    ///
    /// # Shapes
    /// `(1, H, tq, tk)`, or `(B, H, tq, tk)` with per-sequence ids.
    ///
    /// # Errors
    /// [`Error::Shape`] if explicit ids disagree on the batch size.
    pub fn bias(
        &self,
        queries: &Positions,
        tq: usize,
        keys: &Positions,
        tk: usize,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        self.table.bias(queries, tq, keys, tk, &|d| cfg.bucket(d))
    }
}

impl PositionalEncoding for ClippedRelativeBias {
    fn logits_bias(
        &self,
        q: &Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
        k_len: usize,
    ) -> Result<Option<Tensor>> {
        let (_, _, tq, _) = check_queries(q, self.config.num_heads)?;
        Ok(Some(self.bias(q_positions, tq, k_positions, k_len)?))
    }
}
