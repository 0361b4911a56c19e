//! Normalisation of the projected queries and keys, before the rotation (Qwen3, Gemma 3,
//! OLMo 2, Llama 4, Cohere).
//!
//! ```text
//! n(y) = y / √(mean(y²) + ε) · w            w the learned scale; Gemma stores w − 1: · (1 + w);
//!                                           Llama 4's L2 norm has none (w = 1)
//! n(y) = (y − ȳ) / √(mean((y − ȳ)²) + ε) · w   centred (Cohere's layer norm without bias)
//! ```
//!
//! Llama 4 normalises after its rotation; a per-head norm without a scale commutes with the
//! rotation (which keeps each head's sum of squares), so normalising before it is the same
//! map, up to rounding.
//!
//! Which features one statistic covers, and the shape of the scale, by [`QkNormScope`]:
//!
//! | scope | statistic over | `q_norm.weight` | `k_norm.weight` | models |
//! |---|---|---|---|---|
//! | `PerHead` | one head's features | `(head_dim)` | `(head_dim)` | Qwen3, Gemma 3 |
//! | `AllHeads` | every head's features of a token | `(num_heads · head_dim)` | `(num_kv_heads · head_dim)` | OLMo 2 (the whole projection, before the split into heads) |
//! | `EachHead` | one head's features | `(num_heads, head_dim)` | `(num_kv_heads, head_dim)` | Cohere (a scale per head) |
//!
//! The normalisation runs in f32 and the result is cast back to the projection's dtype, as
//! HF's norms do.
//!
//! # Shapes
//! The scales as the table gives them; the projections `(B, T, heads · head_dim)` in, `(B, T,
//! heads, head_dim)` out.
//!
//! Reference: Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters"
//! (query-key normalisation); Zhang & Sennrich 2019 (RMSNorm).

use candle_core::{DType, Tensor, D};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{check_normal_f32, learned, Result};

/// Which features one statistic covers, and the scale's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNormScope {
    /// One head's `head_dim` features, one scale `(head_dim)` for every head (Qwen3, Gemma 3).
    PerHead,
    /// All heads of one token together, a scale `(heads · head_dim)` (OLMo 2).
    AllHeads,
    /// One head's `head_dim` features, each head with a scale of its own, `(heads,
    /// head_dim)` (Cohere).
    EachHead,
}

impl QkNormScope {
    /// The scale's shape for `heads` heads of `head_dim` features.
    pub(crate) fn scale_shape(self, heads: usize, head_dim: usize) -> Vec<usize> {
        match self {
            Self::PerHead => vec![head_dim],
            Self::AllHeads => vec![heads * head_dim],
            Self::EachHead => vec![heads, head_dim],
        }
    }

    /// Whether one statistic covers one head (the projection is split into heads first).
    fn per_head(self) -> bool {
        !matches!(self, Self::AllHeads)
    }
}

/// Configuration of the query/key RMS norm of an [`AttentionConfig`](super::AttentionConfig).
///
/// Serialised (serde) as `{"eps": 1e-6, "scope": "per_head", "unit_offset": false,
/// "learned_scale": true, "centered": false}`; every field may be left out and takes the
/// default of [`QkNormConfig::new`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QkNormConfig {
    /// Added to the mean square (default 1e-6).
    #[serde(default = "QkNormConfig::default_eps")]
    pub eps: f64,
    /// Which features one statistic covers (default per head).
    #[serde(default = "QkNormConfig::default_scope")]
    pub scope: QkNormScope,
    /// Whether the stored scale is `w − 1`, applied as `1 + w` (Gemma; default false).
    #[serde(default)]
    pub unit_offset: bool,
    /// Whether the norm has learned scales `q_norm.weight` and `k_norm.weight` (default true;
    /// Llama 4's L2 norm has none).
    #[serde(default = "QkNormConfig::default_learned_scale")]
    pub learned_scale: bool,
    /// Whether the mean is subtracted first, making it a layer norm without bias (Cohere;
    /// default false: an RMS norm).
    #[serde(default)]
    pub centered: bool,
}

impl Default for QkNormConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl QkNormConfig {
    /// Per head, ε = 1e-6, the scale applied as stored (Qwen3).
    pub fn new() -> Self {
        Self {
            eps: Self::default_eps(),
            scope: Self::default_scope(),
            unit_offset: false,
            learned_scale: true,
            centered: false,
        }
    }

    fn default_learned_scale() -> bool {
        true
    }

    fn default_eps() -> f64 {
        1e-6
    }

    fn default_scope() -> QkNormScope {
        QkNormScope::PerHead
    }

    /// Sets ε.
    pub fn with_eps(mut self, eps: f64) -> Self {
        self.eps = eps;
        self
    }

    /// Sets which features one statistic covers.
    pub fn with_scope(mut self, scope: QkNormScope) -> Self {
        self.scope = scope;
        self
    }

    /// Applies the stored scale as `1 + w` (Gemma) or as stored.
    pub fn with_unit_offset(mut self, unit_offset: bool) -> Self {
        self.unit_offset = unit_offset;
        self
    }

    /// Gives the norm learned scales (`q_norm.weight`, `k_norm.weight`) or none.
    pub fn with_learned_scale(mut self, learned: bool) -> Self {
        self.learned_scale = learned;
        self
    }

    /// Subtracts the mean first (a layer norm without bias, Cohere) or not (an RMS norm).
    pub fn with_centered(mut self, centered: bool) -> Self {
        self.centered = centered;
        self
    }

    /// Checks ε.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] for an ε that is not a finite number within f32's normal range
    /// (ε = 0 turns a zero projection into NaN).
    pub fn validate(&self) -> Result<()> {
        check_normal_f32("qk_norm.eps", self.eps)
    }
}

/// `y` (f32) divided by its root mean square over the last axis, `√(mean(y²) + ε)`; the one RMS
/// statistic of the block's norms (queries and keys here, values, latent attention's latents).
pub(super) fn rms_normalized(y: &Tensor, eps: f64) -> Result<Tensor> {
    let inv_rms = (y.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok(y.broadcast_mul(&inv_rms)?)
}

/// The loaded norm: the scales of queries and keys (`(width)`), if it has them.
#[derive(Debug, Clone)]
pub(super) struct QkNorm {
    config: QkNormConfig,
    scales: Option<(Tensor, Tensor)>,
}

impl QkNorm {
    /// Loads `q_norm.weight` and `k_norm.weight` from `vb` (created as the identity scale in a
    /// `VarMap`), when the norm has learned scales.
    pub(super) fn new(
        config: &QkNormConfig,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        vb: &VarBuilder,
    ) -> Result<Self> {
        config.validate()?;
        let identity = Init::Const(if config.unit_offset { 0.0 } else { 1.0 });
        let load = |name: &str, h: usize| -> Result<Tensor> {
            learned(
                &vb.pp(name),
                "query/key norm scale",
                config.scope.scale_shape(h, head_dim),
                "weight",
                identity,
            )
        };
        let scales = match config.learned_scale {
            true => Some((load("q_norm", heads)?, load("k_norm", kv_heads)?)),
            false => None,
        };
        Ok(Self {
            config: *config,
            scales,
        })
    }

    /// The learned scales of queries and keys, when the norm has them.
    pub(super) fn held(&self) -> Vec<&Tensor> {
        self.scales.iter().flat_map(|(q, k)| [q, k]).collect()
    }

    /// Normalises a projection `y` `(B, T, heads · D)` of the queries (`keys == false`) or
    /// keys; returns it split into heads, `(B, T, heads, D)`.
    pub(super) fn apply(&self, y: &Tensor, keys: bool, heads: usize) -> Result<Tensor> {
        let (b, t, width) = y.dims3()?;
        let d = width / heads;
        let y32 = y.to_dtype(DType::F32)?;
        let y32 = match self.config.scope.per_head() {
            true => y32.reshape((b, t, heads, d))?,
            false => y32,
        };
        let y32 = match self.config.centered {
            true => y32.broadcast_sub(&y32.mean_keepdim(D::Minus1)?)?,
            false => y32,
        };
        let mut normed = rms_normalized(&y32, self.config.eps)?;
        if let Some((q, k)) = &self.scales {
            let scale = if keys { k } else { q }.to_dtype(DType::F32)?;
            let scale = match self.config.unit_offset {
                true => (scale + 1.0)?,
                false => scale,
            };
            normed = normed.broadcast_mul(&scale)?;
        }
        Ok(normed.to_dtype(y.dtype())?.reshape((b, t, heads, d))?)
    }
}
