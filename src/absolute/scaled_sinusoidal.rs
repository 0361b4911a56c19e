//! Scaled sinusoidal positional embedding: fixed sinusoids times one learned scalar
//! (x-transformers' `ScaledSinusoidalEmbedding`, the `scaled_sinu_pos_emb` option of its
//! `TransformerWrapper`).
//!
//! ```text
//! inv_freq_i = base^(−i / half)                 i < half = d_model / 2,  base 10000
//! PE(pos)    = scale · [sin(pos · inv_freq) | cos(pos · inv_freq)]     the sines, then the cosines
//! out        = dropout(x + PE[positions])        scale: one learned scalar, initially d_model^−0.5
//! ```
//!
//! # Shapes
//! - input `x`: `(B, T, d_model)`; output: same shape.
//! - `scale`: `(1,)`, a `VarBuilder` variable (x-transformers' parameter of the same name).
//!
//! The frequencies are [`SinusoidalPositionalEncoding`]'s (`base^(−2i/d_model)` is the same
//! number), so this module keeps one and reads its table: angles in `f64`, stored as `f32`,
//! grown on demand, cast to the input's dtype at the addition. Only the layout differs: that
//! table interleaves `[sin_0, cos_0, sin_1, cos_1, …]`, and the rows a call reads are reordered
//! to `[sin_0, sin_1, … | cos_0, cos_1, …]` before they are scaled.
//!
//! x-transformers adds the embedding to the token embeddings as it is (no further scaling) and
//! applies its `emb_dropout` (default 0) after; `dropout` here is that dropout. x-transformers
//! names no paper for it; implementations of Hua et al. 2022, "Transformer Quality in Linear
//! Time" (FLASH), use the same embedding.

use candle_core::{DType, Module, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::absolute::sinusoidal::{SinusoidalConfig, SinusoidalPositionalEncoding};
use crate::absolute::{add_and_dropout, gather_rows};
use crate::error::{check_dropout, check_var_builder, learned, Result};
use crate::plug::{AttentionContext, PositionalEncoding};
use crate::positions::Positions;

/// Configuration of [`ScaledSinusoidalPositionalEncoding`].
///
/// Serialised (serde) with its field names, e.g. as JSON
/// `{"d_model": 64, "max_len": 5000, "base": 10000.0, "dropout": 0.0}`; only `d_model` is
/// required, the other fields default as in [`ScaledSinusoidalConfig::new`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaledSinusoidalConfig {
    /// Model width; must be even and non-zero.
    pub d_model: usize,
    /// Positions precomputed at construction (default 5000). Longer sequences grow the table.
    #[serde(default = "defaults::max_len")]
    pub max_len: usize,
    /// Frequency base, x-transformers' `theta` (default 10000).
    #[serde(default = "defaults::base")]
    pub base: f64,
    /// Dropout applied after the addition in training mode (default 0, x-transformers'
    /// `emb_dropout`).
    #[serde(default = "defaults::dropout")]
    pub dropout: f32,
}

/// Values of the fields a serialised [`ScaledSinusoidalConfig`] leaves out: those of
/// [`ScaledSinusoidalConfig::new`].
mod defaults {
    use super::ScaledSinusoidalConfig;

    pub(super) fn max_len() -> usize {
        ScaledSinusoidalConfig::new(0).max_len
    }

    pub(super) fn base() -> f64 {
        ScaledSinusoidalConfig::new(0).base
    }

    pub(super) fn dropout() -> f32 {
        ScaledSinusoidalConfig::new(0).dropout
    }
}

impl ScaledSinusoidalConfig {
    /// Defaults for a model of width `d_model`: `max_len` 5000, base 10000, dropout 0.
    pub fn new(d_model: usize) -> Self {
        Self {
            d_model,
            max_len: 5000,
            base: 10000.0,
            dropout: 0.0,
        }
    }

    /// Sets the number of precomputed positions.
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len;
        self
    }

    /// Sets the frequency base.
    pub fn with_base(mut self, base: f64) -> Self {
        self.base = base;
        self
    }

    /// Sets the dropout probability.
    pub fn with_dropout(mut self, dropout: f32) -> Self {
        self.dropout = dropout;
        self
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] for an odd or zero `d_model`, a zero `max_len`, a table
    /// over the size budget, a base that is not finite and > 1, or a dropout outside `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        self.sinusoids().validate()?;
        check_dropout(self.dropout)
    }

    /// The unscaled table's configuration (its fields have the same names; the dropout is
    /// applied here, after the scale).
    fn sinusoids(&self) -> SinusoidalConfig {
        SinusoidalConfig::new(self.d_model)
            .with_max_len(self.max_len)
            .with_base(self.base)
            .with_dropout(0.0)
    }
}

/// Fixed sines and cosines, times a learned scalar, added to the input.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::{ScaledSinusoidalConfig, ScaledSinusoidalPositionalEncoding};
///
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let pe = ScaledSinusoidalPositionalEncoding::new(&ScaledSinusoidalConfig::new(16), vb.pp("pos_emb"))?;
/// assert_eq!(pe.scale().to_vec1::<f32>()?, [0.25]); // 16^-0.5, a variable of the VarMap
/// let x = Tensor::zeros((2, 5, 16), DType::F32, &Device::Cpu)?;
/// let y = pe.forward(&x)?; // x + PE[0..5]
/// // PE(1, 8) = 0.25 · cos(1 · base^0): column 8 is the first cosine.
/// let v: f32 = y.get(0)?.get(1)?.get(8)?.to_scalar()?;
/// assert!((v - 0.25 * 1f32.cos()).abs() < 1e-6);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ScaledSinusoidalPositionalEncoding {
    config: ScaledSinusoidalConfig,
    /// The unscaled, interleaved table (f32, grown on demand, shared by clones).
    sinusoids: SinusoidalPositionalEncoding,
    /// `(1,)`, as `vb` holds it.
    scale: Tensor,
}

impl ScaledSinusoidalPositionalEncoding {
    /// Loads (or creates, `d_model^−0.5`) the scalar `scale` of shape `(1,)` from `vb`, and
    /// builds the table for `config.max_len` positions on `vb`'s device.
    ///
    /// # Errors
    /// As [`ScaledSinusoidalConfig::validate`]; [`crate::Error::MissingTensor`] /
    /// [`crate::Error::TensorShape`] when a checkpoint lacks `scale` or holds it with another
    /// shape; [`crate::Error::DType`] for an integer `VarBuilder` or `scale`.
    pub fn new(config: &ScaledSinusoidalConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        check_var_builder("scale (the VarBuilder's dtype)", &vb)?;
        let init = Init::Const((config.d_model as f64).powf(-0.5));
        let scale = learned(&vb, "scale", 1, "scale", init)?;
        let sinusoids = SinusoidalPositionalEncoding::new(&config.sinusoids(), vb.device())?;
        Ok(Self {
            config: config.clone(),
            sinusoids,
            scale,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ScaledSinusoidalConfig {
        &self.config
    }

    /// The learned scalar, `(1,)`, as the `VarBuilder` gave it (a `VarMap`'s variable tracks
    /// gradients).
    pub fn scale(&self) -> &Tensor {
        &self.scale
    }

    /// The scaled encodings of positions `0..len`, `(len, d_model)` f32, growing the table if
    /// needed.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] if `len × d_model` exceeds the size budget.
    pub fn encodings(&self, len: usize) -> Result<Tensor> {
        let rows = self.sinusoids.encodings(len)?.unsqueeze(0)?;
        Ok(self.scaled(&rows)?.squeeze(0)?)
    }

    /// `dropout(x + PE[0..T])`, dropout active when `train`.
    ///
    /// candle implements `ModuleT` for every `Module` by ignoring the flag, so call this inherent
    /// method (or go through the attention plug) to get dropout in training.
    ///
    /// # Errors
    /// As [`Self::forward_with_positions`].
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_with_positions(x, &Positions::Offset(0), train)
    }

    /// `x + PE[positions]`, with dropout when `train`.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)`; positions: an offset or `(B, T)` / `(1, T)` ids.
    ///
    /// # Errors
    /// [`crate::Error::Rank`] / [`crate::Error::Shape`] / [`crate::Error::DType`] for a
    /// malformed `x` or ids that do not match it; [`crate::Error::InvalidConfig`] for positions
    /// whose table would pass the size budget.
    pub fn forward_with_positions(
        &self,
        x: &Tensor,
        positions: &Positions,
        train: bool,
    ) -> Result<Tensor> {
        let (_, t) = positions.check_input(x, self.config.d_model, "input x")?;
        let table = self.sinusoids.encodings(positions.end(t))?;
        let rows = self.scaled(&gather_rows(&table, positions, t)?)?;
        add_and_dropout(x, &rows, self.config.dropout, train)
    }

    /// Interleaved rows `(N, T, d_model)` reordered to sines then cosines and multiplied by the
    /// scale (in f32, through a tracked cast, so the gradient reaches the variable).
    fn scaled(&self, rows: &Tensor) -> Result<Tensor> {
        let (n, t, d) = rows.dims3()?;
        let halves = rows.reshape((n, t, d / 2, 2))?.transpose(2, 3)?;
        let rows = halves.reshape((n, t, d))?;
        Ok(rows.broadcast_mul(&self.scale.to_dtype(DType::F32)?)?)
    }
}

impl Module for ScaledSinusoidalPositionalEncoding {
    /// `x + PE[0..T]` in inference mode (no dropout).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_with_positions(x, &Positions::Offset(0), false)?)
    }
}

impl PositionalEncoding for ScaledSinusoidalPositionalEncoding {
    fn add_to_input(&self, x: &Tensor, ctx: &AttentionContext) -> Result<Tensor> {
        self.forward_with_positions(x, ctx.queries, ctx.train)
    }

    fn input_only(&self) -> bool {
        true
    }
}

impl crate::plug::SchemeConfig for ScaledSinusoidalConfig {
    fn validate(&self) -> Result<()> {
        ScaledSinusoidalConfig::validate(self)
    }

    fn build(&self, vb: VarBuilder) -> Result<std::sync::Arc<dyn PositionalEncoding>> {
        Ok(std::sync::Arc::new(
            ScaledSinusoidalPositionalEncoding::new(self, vb)?,
        ))
    }
}
