//! Relative position representations (Shaw, Uszkoreit and Vaswani 2018, "Self-Attention with
//! Relative Position Representations").
//!
//! ```text
//! r(i, j) = clamp(j − i, −k, k) + k
//! e_ij = q_i · (k_j + a^K[r(i, j)]) / √d          α = softmax_j(e)
//! z_i  = Σ_j α_ij (v_j + a^V[r(i, j)])             a^K, a^V: (2k + 1, d_head), learned
//! ```
//!
//! The `(T, T, d)` tensors of the direct formula are never built. The plug's data forms carry
//! both terms with `r(i, j)` as their column rule (a shift for offsets, a bucket map for ids):
//! - keys: the rows `q · a^Kᵀ`, a `(Tq, d) × (d, 2k + 1)` product, read at `r(i, j)`;
//! - values: `a^V` itself; the block sums `α` per column (`Σ_{j: r(i,j) = r} α_ij`) and
//!   multiplies by `a^V`.
//!
//! Both cost `O(Tq·Tk + Tq·(2k + 1)·d)` memory and time per head instead of `O(Tq·Tk·d)`.
//!
//! # Shapes
//! - tables `relative_keys.weight`, `relative_values.weight`: `(2k + 1, head_dim)`, shared by
//!   all heads (as in the paper).
//! - logits bias: `(B, H, Tq, Tk)`; value term: `(B, H, Tq, head_dim)`.

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::positions::Positions;

use super::{query_dims, relative_buckets};
use crate::error::{check_float, Error, Result};
use crate::limits::check_elements;
use crate::plug::{
    AttentionContext, Columns, LogitsBias, PositionalEncoding, RelativeBias, RelativeValues,
};

/// Configuration of [`ShawRelativePosition`].
///
/// Serialised (serde) with its field names, e.g. as JSON
/// `{"head_dim": 64, "max_distance": 16, "values": true}`; `values` may be left out for its
/// default (as in [`ShawConfig::new`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShawConfig {
    /// Features per head, > 0.
    pub head_dim: usize,
    /// Clip distance `k`, > 0.
    pub max_distance: usize,
    /// Whether values get `a^V` as well as keys `a^K` (default true).
    #[serde(default = "default_values")]
    pub values: bool,
}

/// The `values` of a serialised [`ShawConfig`] that leaves it out: that of [`ShawConfig::new`].
fn default_values() -> bool {
    ShawConfig::new(0, 0).values
}

impl ShawConfig {
    /// Keys and values, clip distance `max_distance`.
    pub fn new(head_dim: usize, max_distance: usize) -> Self {
        Self {
            head_dim,
            max_distance,
            values: true,
        }
    }

    /// Keys only (`false`) or keys and values (`true`).
    pub fn with_values(mut self, values: bool) -> Self {
        self.values = values;
        self
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a zero head width, a zero or absurd (> 2^20) clip distance, or
    /// tables past [`crate::limits::max_elements`].
    pub fn validate(&self) -> Result<()> {
        if self.head_dim == 0 {
            return Err(Error::config("head_dim", self.head_dim, "at least 1"));
        }
        if self.max_distance == 0 || self.max_distance > 1 << 20 {
            return Err(Error::config(
                "max_distance",
                self.max_distance,
                "between 1 and 2^20",
            ));
        }
        check_elements(
            "head_dim",
            self.head_dim,
            "(2 · max_distance + 1) × head_dim",
            &[2 * self.max_distance + 1, self.head_dim],
        )?;
        Ok(())
    }

    fn bucket(&self, d: i64) -> u32 {
        let k = self.max_distance as i64;
        (d.clamp(-k, k) + k) as u32
    }
}

/// Shaw et al.'s learned relative key (and value) representations.
///
/// Not a candle `Module`: its bias reads the queries and its value term the attention weights,
/// so no single tensor is its natural input. Use it through the attention block (or call its
/// plug hooks, which return the rows `q · a^Kᵀ` and the table `a^V` with their column rule).
///
/// # Example
/// ```
/// use std::sync::Arc;
/// use candle_core::{Device, DType, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::{AttentionConfig, MultiHeadAttention, ShawConfig, ShawRelativePosition};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let shaw = ShawRelativePosition::new(&ShawConfig::new(8, 4), vb.pp("rel"))?;
/// let mha = MultiHeadAttention::new(&AttentionConfig::new(32, 4), Some(Arc::new(shaw)), vb.pp("attn"))?;
/// let y = mha.forward(&Tensor::randn(0f32, 1.0, (2, 10, 32), &dev)?)?;
/// assert_eq!(y.dims(), &[2, 10, 32]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ShawRelativePosition {
    config: ShawConfig,
    keys: Tensor,
    values: Option<Tensor>,
}

impl ShawRelativePosition {
    /// Loads (or creates, N(0, 0.02)) `relative_keys.weight` and, with values on,
    /// `relative_values.weight`.
    ///
    /// # Errors
    /// As [`ShawConfig::validate`]; [`Error::MissingTensor`] / [`Error::TensorShape`].
    pub fn new(config: &ShawConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        check_float("Shaw tables (the VarBuilder's dtype)", vb.dtype())?;
        let shape = (2 * config.max_distance + 1, config.head_dim);
        let init = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let keys = vb
            .pp("relative_keys")
            .get_with_hints(shape, "weight", init)?;
        let values = if config.values {
            Some(
                vb.pp("relative_values")
                    .get_with_hints(shape, "weight", init)?,
            )
        } else {
            None
        };
        Ok(Self {
            config: config.clone(),
            keys,
            values,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ShawConfig {
        &self.config
    }

    /// `a^K`, `(2k + 1, head_dim)`.
    pub fn relative_keys(&self) -> &Tensor {
        &self.keys
    }

    /// `a^V`, `(2k + 1, head_dim)`, when values are on.
    pub fn relative_values(&self) -> Option<&Tensor> {
        self.values.as_ref()
    }
}

impl ShawRelativePosition {
    /// Checks the queries handed to a bias hook: `(B, H, Tq, head_dim)`.
    fn check_queries(&self, q: &Tensor) -> Result<(usize, usize, usize, usize)> {
        let dims = query_dims(q)?;
        if dims.3 != self.config.head_dim {
            return Err(Error::shape(
                "queries",
                format!(
                    "(batch, heads, seq_len, {}) to match the Shaw tables",
                    self.config.head_dim
                ),
                q.shape(),
            ));
        }
        Ok(dims)
    }

    /// `q · a^Kᵀ`: `(B, H, Tq, d) × (d, 2k + 1)` → `(B, H, Tq, 2k + 1)`.
    fn per_bucket(&self, q: &Tensor) -> Result<Tensor> {
        let (b, h, tq, _) = q.dims4()?;
        let width = 2 * self.config.max_distance + 1;
        check_elements(
            "max_distance",
            self.config.max_distance,
            format!("batch × heads × queries × (2k + 1) of the products q · a^K ({b} × {h} × {tq} × {width})").as_str(),
            &[b, h, tq, width],
        )?;
        Ok(q.broadcast_matmul(&self.keys.to_dtype(q.dtype())?.t()?)?)
    }

    /// The column rule `r(i, j)`: for offsets `clamp(j − i + shift, 0, 2k)` with the shift
    /// `ks − qs + k`; for explicit ids the bucket of every pair, `(1|B, Tq, Tk)`.
    fn columns(&self, ctx: &AttentionContext) -> Result<Columns> {
        let k = self.config.max_distance as i64;
        Ok(match (ctx.queries, ctx.keys) {
            (Positions::Offset(qs), Positions::Offset(ks)) => {
                Columns::Shift(*ks as i64 - *qs as i64 + k)
            }
            (queries, keys) => {
                let cfg = &self.config;
                let device = self.keys.device();
                let (tq, tk) = (ctx.q_len, ctx.k_len);
                Columns::Index(relative_buckets(queries, tq, keys, tk, device, &|d| {
                    cfg.bucket(d)
                })?)
            }
        })
    }
}

impl PositionalEncoding for ShawRelativePosition {
    /// `q_i · a^K[r(i, j)]` with `q` already scaled by `1/√d`: the `2k + 1` products per query
    /// as rows, read at `r(i, j)`.
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        self.check_queries(q)?;
        let rows = RelativeBias::new(self.per_bucket(q)?, self.columns(ctx)?)?;
        Ok(Some(LogitsBias::Relative(rows)))
    }

    /// `a^V`, one row per clamped distance, read at `r(i, j)`.
    fn value_term(&self, ctx: &AttentionContext) -> Result<Option<RelativeValues>> {
        match &self.values {
            Some(table) => Ok(Some(RelativeValues::new(
                table.clone(),
                self.columns(ctx)?,
            )?)),
            None => Ok(None),
        }
    }
}
