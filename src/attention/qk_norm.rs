//! RMS normalisation of the projected queries and keys, before the rotation (Qwen3, Gemma 3,
//! OLMo 2).
//!
//! ```text
//! n(y) = y / √(mean(y²) + ε) · w            w the learned scale; Gemma stores w − 1: · (1 + w)
//! ```
//!
//! The mean runs over one head's features ([`QkNormScope::PerHead`]: Qwen3, Gemma 3) or over
//! every head's features of a token ([`QkNormScope::AllHeads`]: OLMo 2, which normalises the
//! whole projection before splitting it into heads). The normalisation runs in f32 and the
//! result is cast back to the projection's dtype, as HF's RMS norms do.
//!
//! # Shapes
//! - `q_norm.weight`: `(head_dim)` per head, `(num_heads · head_dim)` over all heads;
//! - `k_norm.weight`: `(head_dim)` per head, `(num_kv_heads · head_dim)` over all heads.
//!
//! Reference: Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters"
//! (query-key normalisation); Zhang & Sennrich 2019 (RMSNorm).

use candle_core::{DType, Tensor, D};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{check_normal_f32, Result};

/// Which features one RMS statistic covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNormScope {
    /// One head's `head_dim` features (Qwen3, Gemma 3).
    PerHead,
    /// All heads of one token together (OLMo 2).
    AllHeads,
}

/// Configuration of the query/key RMS norm of an [`AttentionConfig`](super::AttentionConfig).
///
/// Serialised (serde) as `{"eps": 1e-6, "scope": "per_head", "unit_offset": false}`; every
/// field may be left out and takes the default of [`QkNormConfig::new`].
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
        }
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

    /// Checks ε.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] for an ε that is not a finite number within f32's normal range
    /// (ε = 0 turns a zero projection into NaN).
    pub fn validate(&self) -> Result<()> {
        check_normal_f32("qk_norm.eps", self.eps)
    }
}

/// The loaded norm: the scales of queries and keys, as f32 `(1, 1, width)` or `(1, 1, 1, D)`.
#[derive(Debug, Clone)]
pub(super) struct QkNorm {
    config: QkNormConfig,
    q: Tensor,
    k: Tensor,
}

impl QkNorm {
    /// Loads `q_norm.weight` and `k_norm.weight` from `vb` (created as the identity scale in a
    /// `VarMap`).
    pub(super) fn new(
        config: &QkNormConfig,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        vb: &VarBuilder,
    ) -> Result<Self> {
        config.validate()?;
        let width = |h: usize| match config.scope {
            QkNormScope::PerHead => head_dim,
            QkNormScope::AllHeads => h * head_dim,
        };
        let identity = Init::Const(if config.unit_offset { 0.0 } else { 1.0 });
        let load = |name: &str, h: usize| -> Result<Tensor> {
            Ok(vb.pp(name).get_with_hints(width(h), "weight", identity)?)
        };
        Ok(Self {
            config: *config,
            q: load("q_norm", heads)?,
            k: load("k_norm", kv_heads)?,
        })
    }

    /// Whether either scale tracks gradients.
    pub(super) fn tracks(&self) -> bool {
        self.q.track_op() || self.k.track_op()
    }

    /// Normalises a projection `y` `(B, T, heads · D)` of the queries (`keys == false`) or
    /// keys; returns it split into heads, `(B, T, heads, D)`.
    pub(super) fn apply(&self, y: &Tensor, keys: bool, heads: usize) -> Result<Tensor> {
        let (b, t, width) = y.dims3()?;
        let d = width / heads;
        let scale = if keys { &self.k } else { &self.q };
        let scale = if self.config.unit_offset {
            (scale.to_dtype(DType::F32)? + 1.0)?
        } else {
            scale.to_dtype(DType::F32)?
        };
        let y32 = y.to_dtype(DType::F32)?;
        let y32 = match self.config.scope {
            QkNormScope::PerHead => y32.reshape((b, t, heads, d))?,
            QkNormScope::AllHeads => y32,
        };
        let inv_rms = (y32.sqr()?.mean_keepdim(D::Minus1)? + self.config.eps)?
            .sqrt()?
            .recip()?;
        let normed = y32.broadcast_mul(&inv_rms)?.broadcast_mul(&scale)?;
        Ok(normed.to_dtype(y.dtype())?.reshape((b, t, heads, d))?)
    }
}
