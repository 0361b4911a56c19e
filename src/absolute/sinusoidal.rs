//! Sinusoidal positional encoding (Vaswani et al. 2017, "Attention Is All You Need", §3.5).
//!
//! ```text
//! PE(pos, 2i)   = sin(pos / base^(2i / d_model))
//! PE(pos, 2i+1) = cos(pos / base^(2i / d_model))        base = 10000
//! out = dropout(x + PE[positions])
//! ```
//!
//! # Shapes
//! - input `x`: `(B, T, d_model)`; output: same shape.
//! - table: `(N, d_model)` with `N >= max_len`, grown on demand.
//!
//! The table is a plain tensor (a buffer): it is never a trainable variable and never written
//! to checkpoints. Angles are computed in `f64` and the table is stored in `f32`, then cast to the
//! input's dtype, so positions stay exact in bf16/f16 models. The seeds compute the angles in
//! `f32`, which drifts from the formula by ~6e-5 around position 5000 and ~1.5e-2 at 10^6; the
//! `f64` angles here match it to within f32 rounding at every position.

use std::sync::{Arc, RwLock};

use candle_core::{Device, Module, Tensor};
use serde::{Deserialize, Serialize};

use crate::absolute::{add_and_dropout, gather_rows};
use crate::error::check_dropout;
use crate::error::{Error, Result};
use crate::limits::{check_elements, max_elements};
use crate::plug::{AttentionContext, PositionalEncoding};
use crate::positions::Positions;

/// Configuration of [`SinusoidalPositionalEncoding`].
///
/// Serialised (serde) with its field names, e.g. as JSON
/// `{"d_model": 64, "max_len": 5000, "base": 10000.0, "dropout": 0.1}`; only `d_model` is
/// required, the other fields default as in [`SinusoidalConfig::new`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinusoidalConfig {
    /// Model width; must be even and non-zero.
    pub d_model: usize,
    /// Positions precomputed at construction (default 5000). Longer sequences grow the table.
    #[serde(default = "defaults::max_len")]
    pub max_len: usize,
    /// Frequency base (default 10000).
    #[serde(default = "defaults::base")]
    pub base: f64,
    /// Dropout applied after the addition in training mode (default 0.1, as in the paper).
    #[serde(default = "defaults::dropout")]
    pub dropout: f32,
}

/// Values of the fields a serialised [`SinusoidalConfig`] leaves out: those of
/// [`SinusoidalConfig::new`].
mod defaults {
    use super::SinusoidalConfig;

    pub(super) fn max_len() -> usize {
        SinusoidalConfig::new(0).max_len
    }

    pub(super) fn base() -> f64 {
        SinusoidalConfig::new(0).base
    }

    pub(super) fn dropout() -> f32 {
        SinusoidalConfig::new(0).dropout
    }
}

impl SinusoidalConfig {
    /// Defaults for a model of width `d_model`: `max_len` 5000, base 10000, dropout 0.1.
    pub fn new(d_model: usize) -> Self {
        Self {
            d_model,
            max_len: 5000,
            base: 10000.0,
            dropout: 0.1,
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
    /// [`Error::InvalidConfig`] for an odd or zero `d_model`, a zero `max_len`, a table over 2^31
    /// elements, a base that is not finite and > 1, or a dropout outside `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 || !self.d_model.is_multiple_of(2) {
            return Err(Error::config(
                "d_model",
                self.d_model,
                "an even number > 0 (sin/cos pairs)",
            ));
        }
        if self.max_len == 0 {
            return Err(Error::config("max_len", self.max_len, "at least 1"));
        }
        check_elements(
            "max_len",
            self.max_len,
            "max_len × d_model",
            &[self.max_len, self.d_model],
        )?;
        if !(self.base.is_finite() && self.base > 1.0) {
            return Err(Error::config("base", self.base, "a finite number > 1"));
        }
        check_dropout(self.dropout)
    }
}

/// Fixed sin/cos table added to the input.
///
/// # Example
/// ```
/// use candle_core::{Device, DType, Module, Tensor};
/// use candle_posenc::{SinusoidalConfig, SinusoidalPositionalEncoding};
///
/// let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(8), &Device::Cpu)?;
/// let x = Tensor::zeros((2, 5, 8), DType::F32, &Device::Cpu)?;
/// let y = pe.forward(&x)?; // x + PE[0..5]
/// assert_eq!(y.dims(), &[2, 5, 8]);
/// // PE(1, 1) = cos(1 / 10000^0) = cos(1)
/// let v: f32 = y.get(0)?.get(1)?.get(1)?.to_scalar()?;
/// assert!((v - 1f32.cos()).abs() < 1e-6);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SinusoidalPositionalEncoding {
    config: SinusoidalConfig,
    /// `(N, d_model)` f32, shared by clones, grown (doubling) when a position past it is asked for.
    table: Arc<RwLock<Tensor>>,
}

impl SinusoidalPositionalEncoding {
    /// Builds the table for `config.max_len` positions on `device` (a module without weights:
    /// a configuration and a device). The table is kept in f32 and cast to the input's dtype at
    /// the addition.
    ///
    /// # Errors
    /// As [`SinusoidalConfig::validate`].
    pub fn new(config: &SinusoidalConfig, device: &Device) -> Result<Self> {
        config.validate()?;
        let table = sinusoidal_table(0, config.max_len, config.d_model, config.base, device)?;
        Ok(Self {
            config: config.clone(),
            table: Arc::new(RwLock::new(table)),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SinusoidalConfig {
        &self.config
    }

    /// The encodings of positions `0..len`, `(len, d_model)` f32, growing the table if needed.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `len × d_model` exceeds 2^31.
    pub fn encodings(&self, len: usize) -> Result<Tensor> {
        Ok(self.table_covering(len)?.narrow(0, 0, len)?)
    }

    /// Returns a table that holds at least `end` positions.
    fn table_covering(&self, end: usize) -> Result<Tensor> {
        {
            let table = self.table.read().map_err(|_| poisoned())?;
            if table.dim(0)? >= end {
                return Ok(table.clone());
            }
        }
        check_elements(
            "sequence end",
            end,
            "positions × d_model",
            &[end, self.config.d_model],
        )?;
        let mut table = self.table.write().map_err(|_| poisoned())?;
        let have = table.dim(0)?;
        if have < end {
            // Double, so a growing sequence triggers O(log n) extensions, each computing only
            // the new rows.
            let max_rows = max_elements() / self.config.d_model;
            let new_len = end.max(have.saturating_mul(2)).min(max_rows);
            let extra = sinusoidal_table(
                have,
                new_len,
                self.config.d_model,
                self.config.base,
                table.device(),
            )?;
            *table = Tensor::cat(&[&*table, &extra], 0)?;
        }
        Ok(table.clone())
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
    /// [`Error::Rank`] / [`Error::Shape`] for a malformed `x` or ids that do not match it.
    pub fn forward_with_positions(
        &self,
        x: &Tensor,
        positions: &Positions,
        train: bool,
    ) -> Result<Tensor> {
        let (_, t) = positions.check_input(x, self.config.d_model, "input x")?;
        let table = self.table_covering(positions.end(t))?;
        let rows = gather_rows(&table, positions, t)?;
        add_and_dropout(x, &rows, self.config.dropout, train)
    }
}

fn poisoned() -> Error {
    Error::Candle(candle_core::Error::Msg(
        "sinusoidal table lock poisoned by a panicking thread".into(),
    ))
}

/// Rows `from..to` of the sinusoidal table, computed in f64 on the host and stored as f32.
pub(crate) fn sinusoidal_table(
    from: usize,
    to: usize,
    d_model: usize,
    base: f64,
    device: &Device,
) -> Result<Tensor> {
    let half = d_model / 2;
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| base.powf(-((2 * i) as f64) / d_model as f64))
        .collect();
    let mut data = Vec::with_capacity((to - from) * d_model);
    for pos in from..to {
        for &w in &inv_freq {
            let angle = pos as f64 * w;
            data.push(angle.sin() as f32);
            data.push(angle.cos() as f32);
        }
    }
    Ok(Tensor::from_vec(data, (to - from, d_model), device)?)
}

impl Module for SinusoidalPositionalEncoding {
    /// `x + PE[0..T]` in inference mode (no dropout).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_with_positions(x, &Positions::Offset(0), false)?)
    }
}

impl PositionalEncoding for SinusoidalPositionalEncoding {
    fn add_to_input(&self, x: &Tensor, ctx: &AttentionContext) -> Result<Tensor> {
        self.forward_with_positions(x, ctx.queries, ctx.train)
    }

    fn input_only(&self) -> bool {
        true
    }
}

impl crate::plug::SchemeConfig for SinusoidalConfig {
    fn validate(&self) -> Result<()> {
        SinusoidalConfig::validate(self)
    }

    fn build(&self, vb: candle_nn::VarBuilder) -> Result<std::sync::Arc<dyn PositionalEncoding>> {
        Ok(std::sync::Arc::new(SinusoidalPositionalEncoding::new(
            self,
            vb.device(),
        )?))
    }
}
