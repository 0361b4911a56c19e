//! Relative position representations (Shaw, Uszkoreit and Vaswani 2018, "Self-Attention with
//! Relative Position Representations").
//!
//! ```text
//! r(i, j) = clamp(j − i, −k, k) + k
//! e_ij = q_i · (k_j + a^K[r(i, j)]) / √d          α = softmax_j(e)
//! z_i  = Σ_j α_ij (v_j + a^V[r(i, j)])             a^K, a^V: (2k + 1, d_head), learned
//! ```
//!
//! The `(T, T, d)` tensors of the direct formula are never built:
//! - keys: `q · a^Kᵀ` is a `(Tq, d) × (d, 2k + 1)` product, gathered at `r(i, j)`;
//! - values: `α` is summed into `2k + 1` buckets per query (`Σ_{j: r(i,j) = r} α_ij`, a
//!   scatter-add), then multiplied by `a^V`.
//!
//! Both cost `O(Tq·Tk + Tq·(2k + 1)·d)` memory and time per head instead of `O(Tq·Tk·d)`.
//!
//! # Shapes
//! - tables `relative_keys.weight`, `relative_values.weight`: `(2k + 1, head_dim)`, shared by
//!   all heads (as in the paper).
//! - logits bias: `(B, H, Tq, Tk)`; value term: `(B, H, Tq, head_dim)`.

use std::sync::Arc;

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::{query_dims, relative_buckets, BucketCache};
use crate::attention::{
    bucket_sums, bucket_sums_apply, PositionalEncoding, RelativeBias, RelativeValues,
};
use crate::graft::{graft, GraftBackward};
use crate::limits::check_elements;
use crate::{Error, Positions, Result};

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
    /// tables past [`crate::limits::MAX_ELEMENTS`].
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
    cache: Arc<BucketCache>,
}

impl ShawRelativePosition {
    /// Loads (or creates, N(0, 0.02)) `relative_keys.weight` and, with values on,
    /// `relative_values.weight`.
    ///
    /// # Errors
    /// As [`ShawConfig::validate`]; [`Error::MissingTensor`] / [`Error::TensorShape`].
    pub fn new(config: &ShawConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
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
            cache: Default::default(),
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

    /// Index maps built so far (once per shape for offsets).
    pub fn bucket_builds(&self) -> usize {
        self.cache.builds()
    }

    /// `r(i, j)` broadcast to `(B, H, Tq, Tk)`, contiguous (gather and scatter need it whole),
    /// cached per shape for offsets.
    fn index(
        &self,
        qp: &Positions,
        tq: usize,
        kp: &Positions,
        tk: usize,
        b: usize,
        h: usize,
    ) -> Result<Tensor> {
        let device = self.keys.device();
        let cfg = &self.config;
        // Cached expanded, so the keys and values hooks of one forward share one build.
        self.cache.get_or_build(qp, tq, kp, tk, (b, h), || {
            let idx = relative_buckets(qp, tq, kp, tk, device, &|d| cfg.bucket(d))?;
            Ok(idx
                .unsqueeze(1)?
                .broadcast_as((b, h, tq, tk))?
                .contiguous()?)
        })
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
        Ok(q.broadcast_matmul(&self.keys.to_dtype(q.dtype())?.t()?)?)
    }

    /// For offsets, `r(i, j) = clamp(j − i + shift, 0, 2k)`: the shift `ks − qs + k`.
    fn shift(&self, qp: &Positions, kp: &Positions) -> Option<i64> {
        match (qp, kp) {
            (Positions::Offset(qs), Positions::Offset(ks)) => {
                Some(*ks as i64 - *qs as i64 + self.config.max_distance as i64)
            }
            _ => None,
        }
    }
}

/// The adjoint of summing weights per bucket: each weight's gradient is its bucket's.
struct GatherAt(Tensor);

impl GraftBackward for GatherAt {
    const NAME: &'static str = "posenc-shaw-bucket-sums-grad";

    fn grad(&self, grad_sums: &Tensor) -> candle_core::Result<Tensor> {
        grad_sums.contiguous()?.gather(&self.0, 3)
    }
}

impl PositionalEncoding for ShawRelativePosition {
    /// Only with relative values.
    fn has_value_term(&self) -> bool {
        self.values.is_some()
    }

    /// `q_i · a^K[r(i, j)]` with `q` already scaled by `1/√d`.
    fn logits_bias(
        &self,
        q: &Tensor,
        qp: &Positions,
        kp: &Positions,
        k_len: usize,
    ) -> Result<Option<Tensor>> {
        let (b, h, tq, _) = self.check_queries(q)?;
        let index = self.index(qp, tq, kp, k_len, b, h)?;
        Ok(Some(self.per_bucket(q)?.contiguous()?.gather(&index, 3)?))
    }

    /// For offsets: the `2k + 1` products `q_i · a^K[r]` per query, clamped per key.
    fn relative_logits_bias(
        &self,
        q: &Tensor,
        qp: &Positions,
        kp: &Positions,
        _k_len: usize,
    ) -> Result<Option<RelativeBias>> {
        self.check_queries(q)?;
        let Some(shift) = self.shift(qp, kp) else {
            return Ok(None);
        };
        Ok(Some(RelativeBias {
            values: self.per_bucket(q)?.contiguous()?,
            shift,
        }))
    }

    /// For offsets: `a^V` itself, one row per clamped distance.
    fn relative_value_term(
        &self,
        qp: &Positions,
        kp: &Positions,
    ) -> Result<Option<RelativeValues>> {
        Ok(match (&self.values, self.shift(qp, kp)) {
            (Some(table), Some(shift)) => Some(RelativeValues {
                table: table.clone(),
                shift,
            }),
            _ => None,
        })
    }

    /// `Σ_r (Σ_{j: r(i,j) = r} α_ij) a^V[r]`.
    fn value_term(&self, probs: &Tensor, qp: &Positions, kp: &Positions) -> Result<Option<Tensor>> {
        let Some(values) = &self.values else {
            return Ok(None);
        };
        let (b, h, tq, tk) = probs.dims4().map_err(|_| Error::Rank {
            what: "attention probabilities",
            expected: 4,
            got: probs.rank(),
            shape: probs.dims().to_vec(),
        })?;
        let buckets = 2 * self.config.max_distance + 1;
        let summed = match self.shift(qp, kp) {
            // Offsets, inference on the CPU: one pass over the weights, no index.
            Some(shift) if bucket_sums_apply(probs) => bucket_sums(probs, buckets, shift)?,
            _ => {
                // candle 0.11's scatter_add backward breaks when the index is wider than the
                // target, so the sums are computed outside the graph and grafted onto `probs`
                // with their adjoint, a gather at the same index.
                let index = self.index(qp, tq, kp, tk, b, h)?;
                let sums = Tensor::zeros((b, h, tq, buckets), probs.dtype(), probs.device())?
                    .scatter_add(&index, &probs.detach().contiguous()?, 3)?;
                if probs.track_op() {
                    graft(probs, &sums, GatherAt(index))?
                } else {
                    sums
                }
            }
        };
        Ok(Some(
            summed.broadcast_matmul(&values.to_dtype(probs.dtype())?)?,
        ))
    }
}
