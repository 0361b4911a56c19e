//! Learned absolute positional embeddings (GPT-2, BERT), optionally stretched past their trained
//! length by linear interpolation.
//!
//! ```text
//! out = dropout(x + P[positions])                 P: (max_len, d_model), learned
//! interpolation to n > max_len positions (PyTorch F.interpolate, mode="linear",
//! align_corners=False):
//!   src(i) = max(0, (i + 0.5) · max_len / n − 0.5),   i0 = ⌊src⌋,  i1 = min(i0 + 1, max_len − 1)
//!   P'(i)  = (1 − λ) · P(i0) + λ · P(i1),             λ = src − i0
//! ```
//!
//! # Shapes
//! - input `x`: `(B, T, d_model)`; output: same shape.
//! - table `weight`: `(max_len, d_model)`, a `VarBuilder` variable initialised N(0, 0.02).
//!
//! Interpolation is built from `index_select` and elementwise ops, so gradients reach the table.
//! References: Radford et al. 2019 (GPT-2); the interpolation follows the seeds'
//! `LearnedPositionalEncodingWithInterpolation`.

use candle_core::{DType, Module, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::absolute::{add_and_dropout, gather_rows};
use crate::error::check_dropout;
use crate::error::{check_float, check_var_builder, learned, Error, Result};
use crate::limits::{check_elements, max_elements};
use crate::plug::{AttentionContext, PositionalEncoding};
use crate::positions::Positions;

/// What to do with positions at or past `max_len`.
///
/// Serialised in snake case: `"off"`, `"to_sequence_length"`, `{"to_length": 2048}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Interpolation {
    /// Such positions are an error ([`Error::PositionOutOfRange`]). The default.
    #[default]
    Off,
    /// Stretch the table to exactly as many positions as the chunk needs (`offset + T`, or the
    /// largest id + 1), as the seeds do. Each length gets its own stretch, so a cached decoder
    /// would see positions move between steps: use [`Interpolation::ToLength`] there.
    ToSequenceLength,
    /// Stretch the table once to this many positions and read every position from the
    /// stretched table, those below `max_len` included, so a position means the same in every
    /// chunk and decoding step (a length of `max_len` is the table itself). Positions at or past
    /// this length are an error.
    ToLength(usize),
}

/// Configuration of [`LearnedPositionalEncoding`].
///
/// Serialised (serde) with its field names, e.g. as JSON
/// `{"d_model": 64, "max_len": 512, "dropout": 0.1, "interpolation": "off"}`; only `d_model`
/// is required, the other fields default as in [`LearnedConfig::new`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnedConfig {
    /// Model width, > 0.
    pub d_model: usize,
    /// Positions in the learned table (default 512).
    #[serde(default = "defaults::max_len")]
    pub max_len: usize,
    /// Dropout applied after the addition in training mode (default 0.1).
    #[serde(default = "defaults::dropout")]
    pub dropout: f32,
    /// Behaviour past `max_len` (default: error).
    #[serde(default = "defaults::interpolation")]
    pub interpolation: Interpolation,
}

/// Values of the fields a serialised [`LearnedConfig`] leaves out: those of
/// [`LearnedConfig::new`].
mod defaults {
    use super::{Interpolation, LearnedConfig};

    pub(super) fn max_len() -> usize {
        LearnedConfig::new(0).max_len
    }

    pub(super) fn dropout() -> f32 {
        LearnedConfig::new(0).dropout
    }

    pub(super) fn interpolation() -> Interpolation {
        LearnedConfig::new(0).interpolation
    }
}

impl LearnedConfig {
    /// Defaults for width `d_model`: 512 positions, dropout 0.1, no interpolation.
    pub fn new(d_model: usize) -> Self {
        Self {
            d_model,
            max_len: 512,
            dropout: 0.1,
            interpolation: Interpolation::Off,
        }
    }

    /// Sets the table length.
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len;
        self
    }

    /// Sets the dropout probability.
    pub fn with_dropout(mut self, dropout: f32) -> Self {
        self.dropout = dropout;
        self
    }

    /// Sets the behaviour past `max_len`.
    pub fn with_interpolation(mut self, interpolation: Interpolation) -> Self {
        self.interpolation = interpolation;
        self
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a zero width or length, a table over 2^31 elements, a
    /// dropout outside `[0, 1)`, or an interpolation target shorter than `max_len`.
    pub fn validate(&self) -> Result<()> {
        if self.d_model == 0 {
            return Err(Error::config("d_model", self.d_model, "at least 1"));
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
        if let Interpolation::ToLength(n) = self.interpolation {
            if n < self.max_len {
                return Err(Error::config(
                    "interpolation length",
                    n,
                    format!("at least max_len ({})", self.max_len),
                ));
            }
            check_elements(
                "interpolation length",
                n,
                "length × d_model",
                &[n, self.d_model],
            )?;
        }
        check_dropout(self.dropout)
    }
}

/// A learned `(max_len, d_model)` table added to the input.
///
/// # Example
/// ```
/// use candle_core::{Device, DType, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::{Interpolation, LearnedConfig, LearnedPositionalEncoding};
///
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let cfg = LearnedConfig::new(16).with_max_len(32).with_interpolation(Interpolation::ToSequenceLength);
/// let pe = LearnedPositionalEncoding::new(&cfg, vb.pp("wpe"))?;
/// let x = Tensor::zeros((1, 64, 16), DType::F32, &Device::Cpu)?; // twice the trained length
/// assert_eq!(pe.forward(&x)?.dims(), &[1, 64, 16]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LearnedPositionalEncoding {
    config: LearnedConfig,
    weight: Tensor,
}

impl LearnedPositionalEncoding {
    /// Loads (or creates, N(0, 0.02)) the table `weight` of shape `(max_len, d_model)` from `vb`.
    ///
    /// # Errors
    /// As [`LearnedConfig::validate`]; [`Error::MissingTensor`] / [`Error::TensorShape`] when a
    /// checkpoint lacks `weight` or holds it with another shape; [`Error::DType`] for an
    /// integer `VarBuilder`.
    pub fn new(config: &LearnedConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        check_var_builder("learned table (the VarBuilder's dtype)", &vb)?;
        let weight = learned(
            &vb,
            "learned table",
            (config.max_len, config.d_model),
            "weight",
            Init::Randn {
                mean: 0.0,
                stdev: 0.02,
            },
        )?;
        Ok(Self {
            config: config.clone(),
            weight,
        })
    }

    /// Wraps an existing `(max_len, d_model)` table; `config.max_len` and `config.d_model` must
    /// match it.
    ///
    /// # Errors
    /// [`Error::Shape`] if the table disagrees with the config; [`Error::DType`] for an integer
    /// table; as [`LearnedConfig::validate`].
    pub fn from_table(config: &LearnedConfig, weight: Tensor) -> Result<Self> {
        config.validate()?;
        if weight.dims() != [config.max_len, config.d_model] {
            return Err(Error::shape(
                "learned table",
                format!("({}, {})", config.max_len, config.d_model),
                weight.shape(),
            ));
        }
        check_float("learned table", weight.dtype())?;
        Ok(Self {
            config: config.clone(),
            weight,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LearnedConfig {
        &self.config
    }

    /// The learned table, `(max_len, d_model)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The table linearly stretched to `len` rows (PyTorch `F.interpolate`, mode `linear`,
    /// `align_corners=False`). `len == max_len` returns the table itself.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for `len == 0` or `len × d_model` past [`crate::limits::max_elements`].
    pub fn interpolated(&self, len: usize) -> Result<Tensor> {
        let n_in = self.config.max_len;
        if len == 0 {
            return Err(Error::config("interpolation length", len, "at least 1"));
        }
        crate::limits::check_elements(
            "interpolation length",
            len,
            format_args!("length × d_model ({})", self.config.d_model),
            &[len, self.config.d_model],
        )?;
        if len == n_in {
            return Ok(self.weight.clone());
        }
        self.stretched(len, 0..len)
    }

    /// Rows `rows` of the table stretched to `len` rows, computed for those rows alone: row
    /// `i` blends the two trained rows around `(i + ½)·max_len / len − ½`.
    fn stretched(&self, len: usize, rows: impl ExactSizeIterator<Item = usize>) -> Result<Tensor> {
        let n_in = self.config.max_len;
        let n = rows.len();
        // a, b and b − a live at once.
        check_elements(
            "positions",
            n,
            format_args!(
                "3 × rows × d_model ({}) of the stretched rows",
                self.config.d_model
            ),
            &[3, n, self.config.d_model],
        )?;
        let scale = n_in as f64 / len as f64;
        let mut lo = Vec::with_capacity(n);
        let mut hi = Vec::with_capacity(n);
        let mut lambda = Vec::with_capacity(n);
        for i in rows {
            let src = ((i as f64 + 0.5) * scale - 0.5).max(0.0);
            let i0 = (src.floor() as usize).min(n_in - 1);
            lo.push(i0 as u32);
            hi.push((i0 + 1).min(n_in - 1) as u32);
            lambda.push((src - i0 as f64) as f32);
        }
        let device = self.weight.device();
        let lo = Tensor::from_vec(lo, n, device)?;
        let hi = Tensor::from_vec(hi, n, device)?;
        let lambda = Tensor::from_vec(lambda, (n, 1), device)?.to_dtype(self.weight.dtype())?;
        let a = self.weight.index_select(&lo, 0)?;
        let b = self.weight.index_select(&hi, 0)?;
        // (1 − λ)·a + λ·b, written as a + λ·(b − a).
        Ok((&a + (b - &a)?.broadcast_mul(&lambda)?)?)
    }

    /// The length of the stretch that serves positions `0..end` per the interpolation mode
    /// (`None`: the trained table itself).
    fn stretch_for(&self, end: usize) -> Result<Option<usize>> {
        let max_len = self.config.max_len;
        match self.config.interpolation {
            // One stretch for every chunk, whatever its end.
            Interpolation::ToLength(n) if end <= n && n != max_len => Ok(Some(n)),
            Interpolation::ToLength(n) if end <= n => Ok(None),
            Interpolation::ToLength(n) => Err(Error::PositionOutOfRange {
                table: "interpolated learned positional",
                position: end - 1,
                len: n,
            }),
            _ if end <= max_len => Ok(None),
            Interpolation::Off => Err(Error::PositionOutOfRange {
                table: "learned positional",
                position: end - 1,
                len: max_len,
            }),
            Interpolation::ToSequenceLength => {
                if end.saturating_mul(self.config.d_model) > max_elements() {
                    return Err(Error::PositionOutOfRange {
                        table: "interpolated learned positional",
                        position: end - 1,
                        len: max_elements() / self.config.d_model,
                    });
                }
                Ok(Some(end).filter(|&n| n != max_len))
            }
        }
    }

    /// The rows of the table (or of its stretch to `len`) at `positions`, `t` tokens: only those
    /// rows are computed, so one token far along a stretched table costs one row.
    fn rows_at(&self, stretch: Option<usize>, positions: &Positions, t: usize) -> Result<Tensor> {
        let Some(len) = stretch else {
            return gather_rows(&self.weight, positions, t);
        };
        match positions {
            Positions::Offset(start) => {
                Ok(self.stretched(len, *start..*start + t)?.unsqueeze(0)?)
            }
            Positions::Ids(ids) => {
                let (b, t) = ids.ids().dims2()?;
                let flat = ids
                    .ids()
                    .flatten_all()?
                    .to_dtype(DType::I64)?
                    .to_vec1::<i64>()?;
                let rows = self.stretched(len, flat.into_iter().map(|p| p as usize))?;
                Ok(rows.reshape((b, t, self.config.d_model))?)
            }
        }
    }

    /// `dropout(x + P[0..T])`, dropout active when `train`.
    ///
    /// candle implements `ModuleT` for every `Module` by ignoring the flag, so call this inherent
    /// method (or go through the attention plug) to get dropout in training.
    ///
    /// # Errors
    /// As [`Self::forward_with_positions`].
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_with_positions(x, &Positions::Offset(0), train)
    }

    /// `x + P[positions]`, with dropout when `train`.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)`; positions: an offset or `(B, T)` / `(1, T)` ids.
    ///
    /// # Errors
    /// [`Error::PositionOutOfRange`] for a position past the table (or past the interpolation
    /// target); [`Error::Rank`] / [`Error::Shape`] for a malformed `x` or mismatched ids.
    pub fn forward_with_positions(
        &self,
        x: &Tensor,
        positions: &Positions,
        train: bool,
    ) -> Result<Tensor> {
        let (_, t) = positions.check_input(x, self.config.d_model, "input x")?;
        let stretch = self.stretch_for(positions.end(t))?;
        let rows = self.rows_at(stretch, positions, t)?;
        add_and_dropout(x, &rows, self.config.dropout, train)
    }
}

impl Module for LearnedPositionalEncoding {
    /// `x + P[0..T]` in inference mode (no dropout).
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_with_positions(x, &Positions::Offset(0), false)?)
    }
}

impl PositionalEncoding for LearnedPositionalEncoding {
    fn add_to_input(&self, x: &Tensor, ctx: &AttentionContext) -> Result<Tensor> {
        self.forward_with_positions(x, ctx.queries, ctx.train)
    }

    fn input_only(&self) -> bool {
        true
    }
}

impl crate::plug::SchemeConfig for LearnedConfig {
    fn validate(&self) -> Result<()> {
        LearnedConfig::validate(self)
    }

    fn build(&self, vb: candle_nn::VarBuilder) -> Result<std::sync::Arc<dyn PositionalEncoding>> {
        Ok(std::sync::Arc::new(LearnedPositionalEncoding::new(
            self, vb,
        )?))
    }
}
