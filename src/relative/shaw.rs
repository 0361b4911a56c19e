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
//! - keys: the rows `q · a^Kᵀ`, a `(Tq, d) × (d, w)` product (on the CPU in f32 one node of
//!   candle's graph, its backward included), read at `r(i, j)`;
//! - values: `a^V` itself; the block sums `α` per column (`Σ_{j: r(i,j) = r} α_ij`) and
//!   multiplies by `a^V`;
//!
//! where only the `w ≤ min(2k + 1, Tq + Tk − 1)` rows of the tables that the pairs reach are
//! read. Both cost `O(Tq·Tk + Tq·w·d)` memory and time per head instead of `O(Tq·Tk·d)`.
//!
//! # Shapes
//! - tables `relative_keys.weight`, `relative_values.weight`: `(2k + 1, head_dim)`, shared by
//!   all heads (as in the paper).
//! - logits bias: `(B, H, Tq, Tk)`; value term: `(B, H, Tq, head_dim)`.

use candle_core::Tensor;
use candle_nn::{Init, Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::cpu::linear_node::{self, Arrange};
use crate::positions::Positions;

use super::{clipped_row, query_dims, relative_buckets};
use crate::error::{check_var_builder, learned, Error, Result};
use crate::limits::check_elements;
use crate::matmul::broadcast_matmul;
use crate::plug::relative::product_dtype;
use crate::plug::{
    AttentionContext, Columns, Footprint, LogitsBias, PositionalEncoding, RelativeBias,
    RelativeValues,
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
        clipped_row(self.max_distance, d)
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
    /// As [`ShawConfig::validate`]; [`Error::DType`] for a `VarBuilder` (or a table) whose
    /// dtype is not f32, f64, bf16 or f16; [`Error::MissingTensor`] / [`Error::TensorShape`].
    pub fn new(config: &ShawConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        check_var_builder("Shaw tables (the VarBuilder's dtype)", &vb)?;
        let shape = (2 * config.max_distance + 1, config.head_dim);
        let init = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let keys = learned(
            &vb.pp("relative_keys"),
            "Shaw key table",
            shape,
            "weight",
            init,
        )?;
        let values = if config.values {
            Some(learned(
                &vb.pp("relative_values"),
                "Shaw value table",
                shape,
                "weight",
                init,
            )?)
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

    /// The rows of the tables the context's pairs can reach: `(lo, width)`, the clamped
    /// columns `r(i, j)` of every pair lying in `lo..lo + width` (at most `Tq + Tk − 1` of the
    /// `2k + 1`, so a large `k` costs nothing when queries and keys are few). For offsets the
    /// span is exact (up to distance 0 when the caller masks the keys a causal query does not
    /// see); for explicit ids it is bounded by the ids' ends (ids are ≥ 0).
    fn span(&self, ctx: &AttentionContext) -> (usize, usize) {
        let k = self.config.max_distance as i128;
        let (tq, tk) = (ctx.q_len as i128, ctx.k_len as i128);
        if tq == 0 || tk == 0 {
            return (0, 1);
        }
        // The smallest and largest key − query distance.
        let (low, high) = match (ctx.queries, ctx.keys) {
            (Positions::Offset(qs), Positions::Offset(ks)) => {
                let shift = *ks as i128 - *qs as i128;
                (shift - (tq - 1), shift + (tk - 1))
            }
            (queries, keys) => (
                -(queries.end(ctx.q_len) as i128 - 1),
                keys.end(ctx.k_len) as i128 - 1,
            ),
        };
        // A causal query sees no key past its own position: when the caller masks those keys,
        // with offsets (positions in key order) the distances it reaches stop at 0, and the
        // rows need only the k + 1 columns of distances ≤ 0 (half the products q · a^K, and of
        // a^V's rows). A key past it reads the last column, and is masked.
        let high = match (ctx.causal && ctx.masks_unseen, ctx.queries, ctx.keys) {
            (true, Positions::Offset(_), Positions::Offset(_)) => high.min(0),
            _ => high,
        };
        let lo = (low.clamp(-k, k) + k) as usize;
        let hi = (high.clamp(-k, k) + k) as usize;
        (lo, hi.max(lo) - lo + 1)
    }

    /// `q · a^K[lo..lo + width]ᵀ`: `(B, H, Tq, d) × (d, width)` → `(B, H, Tq, width)`, in q's
    /// dtype.
    fn per_bucket(&self, q: &Tensor, (lo, width): (usize, usize)) -> Result<Tensor> {
        let (b, h, tq, _) = q.dims4()?;
        check_elements(
            "max_distance",
            self.config.max_distance,
            format_args!("batch × heads × queries × reachable distances of the products q · a^K ({b} × {h} × {tq} × {width})"),
            &[b, h, tq, width],
        )?;
        let keys = self.keys.narrow(0, lo, width)?;
        // On the CPU in f32, the product is one node of the graph (its backward too): the
        // queries' rows projected with the table's rows as the weights.
        let node = Linear::new(keys.clone(), None);
        if let Some(rows) = linear_node::linear(&node, q, Arrange::Rows(vec![b, h, tq]))? {
            return Ok(rows);
        }
        // In f32 at least (f64 if either side is), rounded once to q's dtype: bf16 and f16 do
        // not hold each other's range, and a table read in q's dtype could turn a zero
        // feature's term into 0 · ∞ = NaN.
        let compute = product_dtype(q.dtype(), keys.dtype());
        let out = broadcast_matmul(&q.to_dtype(compute)?, &keys.to_dtype(compute)?.t()?)?;
        Ok(out.to_dtype(q.dtype())?)
    }

    /// The column rule `r(i, j) − lo`: for offsets `clamp(j − i + shift, 0, 2k) − lo` with the
    /// shift `ks − qs + k`; for explicit ids the bucket of every pair, `(1|B, Tq, Tk)`.
    fn columns(&self, ctx: &AttentionContext, lo: usize) -> Result<Columns> {
        let k = self.config.max_distance as i64;
        Ok(match (ctx.queries, ctx.keys) {
            (Positions::Offset(qs), Positions::Offset(ks)) => {
                Columns::Shift(*ks as i64 - *qs as i64 + k - lo as i64)
            }
            (queries, keys) => {
                let cfg = &self.config;
                let device = self.keys.device();
                let (tq, tk) = (ctx.q_len, ctx.k_len);
                Columns::Index(relative_buckets(queries, tq, keys, tk, device, &|d| {
                    cfg.bucket(d) - lo as u32
                })?)
            }
        })
    }
}

impl PositionalEncoding for ShawRelativePosition {
    /// `q_i · a^K[r(i, j)]` with `q` already scaled by `1/√d`: the products per query with the
    /// rows the pairs reach (at most `min(2k + 1, Tq + Tk − 1)`), read at `r(i, j)`.
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        self.check_queries(q)?;
        ctx.check_positions()?;
        let span = self.span(ctx);
        let rows = RelativeBias::new(self.per_bucket(q, span)?, self.columns(ctx, span.0)?)?;
        Ok(Some(LogitsBias::Relative(rows)))
    }

    /// `a^V`, one row per clamped distance the pairs reach, read at `r(i, j)`.
    fn value_term(&self, ctx: &AttentionContext) -> Result<Option<RelativeValues>> {
        ctx.check_positions()?;
        match &self.values {
            Some(table) => {
                let (lo, width) = self.span(ctx);
                Ok(Some(RelativeValues::new(
                    table.narrow(0, lo, width)?,
                    self.columns(ctx, lo)?,
                )?))
            }
            None => Ok(None),
        }
    }

    /// With offsets, the rows of the distances the whole call's pairs reach (its span,
    /// a bound for any query block of it) for the bias and the value table; explicit ids read
    /// the rows through an index map per query, which is not a row of a fixed width.
    fn footprint(&self, ctx: &AttentionContext) -> Footprint {
        match (ctx.queries, ctx.keys) {
            (Positions::Offset(_), Positions::Offset(_)) => {
                let (_, width) = self.span(ctx);
                Footprint::Rows {
                    bias: width,
                    values: if self.values.is_some() { width } else { 0 },
                }
            }
            _ => Footprint::Unknown,
        }
    }
}

impl crate::plug::SchemeConfig for ShawConfig {
    fn validate(&self) -> Result<()> {
        ShawConfig::validate(self)
    }

    fn build(&self, vb: candle_nn::VarBuilder) -> Result<std::sync::Arc<dyn PositionalEncoding>> {
        Ok(std::sync::Arc::new(ShawRelativePosition::new(self, vb)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};
    use candle_nn::VarBuilder;

    use super::*;
    use crate::positions::Positions;

    /// f16 queries against a bf16 key table past f16's range: a query feature of 0 keeps its
    /// term 0 (reading the table in f16 made it 0 · ∞ = NaN), and the rows are q's dtype.
    #[test]
    fn mixed_half_dtypes_multiply_in_f32() -> Result<()> {
        let dev = Device::Cpu;
        // Row 1 (distance 0) holds the value past f16's range.
        let keys = Tensor::new(&[[1.0f32, 1.0], [1e10, 2.0], [4.0, 5.0]], &dev)?;
        let vb = VarBuilder::from_tensors(
            [("relative_keys.weight".to_string(), keys)].into(),
            DType::BF16,
            &dev,
        );
        let shaw = ShawRelativePosition::new(&ShawConfig::new(2, 1).with_values(false), vb)?;
        let q = Tensor::new(&[0f32, 1.0], &dev)?
            .reshape((1, 1, 1, 2))?
            .to_dtype(DType::F16)?;
        let at = Positions::Offset(0);
        let ctx = AttentionContext::new(&at, 1, &at, 2);
        let Some(LogitsBias::Relative(rows)) = shaw.logits_bias(&q, &ctx)? else {
            panic!("Shaw answers with rows");
        };
        assert_eq!(rows.values()?.dtype(), DType::F16);
        let got = rows
            .values()?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        // Key 0 at distance 0 reads row 1: 0 · 1e10 + 1 · 2; key 1 reads row 2: 0 · 4 + 1 · 5.
        assert_eq!(got, vec![2.0, 5.0]);
        Ok(())
    }

    /// A causal block that masks the keys its queries do not see gets k + 1 columns (distances
    /// ≤ 0) where a hook asked for every pair gets 2k + 1: both give the same bias and value
    /// sums at every pair a query sees, for queries at and after their keys' start.
    #[test]
    fn masked_causal_rows_stop_at_distance_zero() -> Result<()> {
        let dev = Device::Cpu;
        let vb = VarBuilder::from_tensors(
            [
                (
                    "relative_keys.weight".to_string(),
                    crate::seeded::randn(0f32, 1.0, (9, 4), &dev)?,
                ),
                (
                    "relative_values.weight".to_string(),
                    crate::seeded::randn(0f32, 1.0, (9, 4), &dev)?,
                ),
            ]
            .into(),
            DType::F32,
            &dev,
        );
        let shaw = ShawRelativePosition::new(&ShawConfig::new(4, 4).with_values(true), vb)?;
        let q = crate::seeded::randn(0f32, 1.0, (1, 2, 3, 4), &dev)?;
        for (qs, ks, tk) in [(0usize, 0usize, 3usize), (7, 0, 10), (2, 0, 5)] {
            let (qp, kp) = (Positions::Offset(qs), Positions::Offset(ks));
            let all = AttentionContext::new(&qp, 3, &kp, tk).with_causal(true);
            let masked = all.clone().with_masks_unseen(true);
            let rows = |ctx: &AttentionContext| -> Result<RelativeBias> {
                match shaw.logits_bias(&q, ctx)? {
                    Some(LogitsBias::Relative(r)) => Ok(r),
                    _ => panic!("Shaw answers with rows"),
                }
            };
            let (full, half) = (rows(&all)?, rows(&masked)?);
            assert!(
                half.width() <= 5 && half.width() < full.width(),
                "{qs} {ks} {tk}"
            );
            // 1 where query i (at qs + i) sees key j (at ks + j).
            let seen: Vec<f32> = (0..3)
                .flat_map(|i| (0..tk).map(move |j| f32::from(u8::from(ks + j <= qs + i))))
                .collect();
            let seen = Tensor::from_vec(seen, (1, 1, 3, tk), &dev)?.broadcast_as((1, 2, 3, tk))?;
            let a = (full.to_dense(3, tk)?.broadcast_as((1, 2, 3, tk))? * &seen)?;
            let b = (half.to_dense(3, tk)?.broadcast_as((1, 2, 3, tk))? * &seen)?;
            let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff <= 1e-6, "{qs} {ks} {tk}: bias differs by {diff}");
            let probs = (crate::seeded::rand(0f32, 1.0, (1, 2, 3, tk), &dev)? * &seen)?;
            let value = |ctx: &AttentionContext| -> Result<Tensor> {
                shaw.value_term(ctx)?.expect("values").weighted_sum(&probs)
            };
            let diff = (value(&all)? - value(&masked)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff <= 1e-6, "{qs} {ks} {tk}: value sums differ by {diff}");
        }
        Ok(())
    }
}
