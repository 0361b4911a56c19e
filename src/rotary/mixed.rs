//! RoPE-Mixed: 2-D rotary embeddings whose frequencies are learned per head (vision
//! transformers).
//!
//! ```text
//! angle[h, p, i] = x(p) · f_x[h, i] + y(p) · f_y[h, i]          i < D/2
//! pair i = (2i, 2i + 1) of head h rotated by angle[h, p, i]     (q and k alike)
//! init:  f_x[h] = [m·cos φ_h ‖ m·cos(φ_h + π/2)],  f_y[h] = [m·sin φ_h ‖ m·sin(φ_h + π/2)]
//!        m_k = θ^(−4k/D), k < D/4;   φ_h an angle per head
//! ```
//!
//! Axial 2-D RoPE gives rows and columns separate frequencies; mixing them in one learned
//! frequency vector per head lets a head rotate along any direction of the patch grid (diagonals
//! included), and the training picks the directions. `q·k` still depends only on the offset
//! `(x(p) − x(j), y(p) − y(j))`. `x` is the patch's column (the width axis), `y` its row (the
//! height axis), read from [`PositionIds::multimodal`](crate::positions::PositionIds::multimodal)
//! positions.
//!
//! The frequencies are the `VarMap` parameter `freqs` of shape `(2, H, D/2)` (`f_x`, `f_y`), as
//! timm's `RotaryEmbeddingMixed` and the paper's code store them for one block; a new parameter
//! takes the paper's initialisation with the angles `φ_h = 2π·frac((seed·H + h)·(√5 − 1)/2)`
//! (spread evenly over the circle by the golden ratio, reproducible, different per layer
//! through the seed) where timm draws them at random. The rotation runs on candle ops in f32, so
//! gradients reach the frequencies.
//!
//! # Shapes
//! - `freqs`: `(2, H, D/2)`; queries and keys `(B, H, T, D)`; positions `(3, B, T)`.
//!
//! Reference: Heo et al. 2024, "Rotary Position Embedding for Vision Transformer" (ECCV).

use candle_core::{DType, Tensor, D};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{check_float, check_normal_f32, check_var_builder, learned, Error, Result};
use crate::limits::check_elements;
use crate::plug::{AttentionContext, PositionalEncoding};
use crate::positions::Positions;

/// Configuration of [`RopeMixed`].
///
/// Serialised (serde) as `{"num_heads": 8, "head_dim": 64, "theta": 10.0, "seed": 0}`
/// (`theta` and `seed` may be left out).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RopeMixedConfig {
    /// Heads, each with its own frequencies.
    pub num_heads: usize,
    /// Features per head (a multiple of 4).
    pub head_dim: usize,
    /// `θ` of the initial magnitudes `θ^(−4k/D)` (the paper's and timm's 10; default 10).
    #[serde(default = "RopeMixedConfig::default_theta")]
    pub theta: f64,
    /// Picks the initial angles per head; give each layer its own (default 0).
    #[serde(default)]
    pub seed: u64,
}

impl RopeMixedConfig {
    /// `num_heads` heads of `head_dim` features, θ = 10, seed 0.
    pub fn new(num_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            head_dim,
            theta: Self::default_theta(),
            seed: 0,
        }
    }

    fn default_theta() -> f64 {
        10.0
    }

    /// Sets θ of the initial magnitudes.
    pub fn with_theta(mut self, theta: f64) -> Self {
        self.theta = theta;
        self
    }

    /// Sets the seed of the initial angles (one per layer).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for no heads, a head width that is not a positive multiple of
    /// 4, a θ that is not a normal f32 above 1, or a parameter past
    /// [`crate::limits::max_elements`].
    pub fn validate(&self) -> Result<()> {
        if self.num_heads == 0 {
            return Err(Error::config("num_heads", 0, "at least 1"));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(4) {
            return Err(Error::config(
                "head_dim",
                self.head_dim,
                "a positive multiple of 4 (two axes, pairs of features)",
            ));
        }
        check_normal_f32("theta", self.theta)?;
        if self.theta <= 1.0 {
            return Err(Error::config("theta", self.theta, "more than 1"));
        }
        check_elements(
            "head_dim",
            self.head_dim,
            "2 × num_heads × head_dim / 2 frequencies",
            &[self.num_heads, self.head_dim],
        )?;
        Ok(())
    }

    /// The paper's initial frequencies `(2, H, D/2)` with this configuration's angles.
    pub fn initial_freqs(&self) -> Vec<f32> {
        let (h, d) = (self.num_heads, self.head_dim);
        let quarter = d / 4;
        let golden = (5f64.sqrt() - 1.0) / 2.0;
        let mut out = vec![0f32; 2 * h * d / 2];
        for head in 0..h {
            let n = (self.seed as f64) * h as f64 + head as f64;
            let phi = 2.0 * std::f64::consts::PI * (n * golden).fract();
            for k in 0..quarter {
                let m = self.theta.powf(-((4 * k) as f64) / d as f64);
                for (half, a) in [(0, phi), (1, phi + std::f64::consts::FRAC_PI_2)] {
                    let i = half * quarter + k;
                    out[head * d / 2 + i] = (m * a.cos()) as f32;
                    out[(h + head) * d / 2 + i] = (m * a.sin()) as f32;
                }
            }
        }
        out
    }
}

/// RoPE-Mixed (see the module docs): learned per-head 2-D frequencies applied as a rotation.
///
/// # Example
/// Queries of a 2 × 3 patch grid, at their rows and columns:
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::positions::{PositionIds, Positions};
/// use candle_posenc::rotary::mixed::{RopeMixed, RopeMixedConfig};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let rope = RopeMixed::new(&RopeMixedConfig::new(2, 8), VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
/// assert_eq!(rope.freqs().dims(), &[2, 2, 4]); // a VarMap parameter, trained with the model
/// // (3, B, T): time 0, the patch's row, its column.
/// let axes = Tensor::new(&[[[0u32, 0, 0, 0, 0, 0]], [[0, 0, 0, 1, 1, 1]], [[0, 1, 2, 0, 1, 2]]], &dev)?;
/// let at = Positions::Ids(PositionIds::multimodal(&axes)?);
/// let q = Tensor::randn(0f32, 1.0, (1, 2, 6, 8), &dev)?;
/// assert_eq!(rope.rotate_one(&q, &at)?.dims(), &[1, 2, 6, 8]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RopeMixed {
    config: RopeMixedConfig,
    /// `(2, H, D/2)`.
    freqs: Tensor,
}

/// Largest magnitude of a loaded frequency: `2^64`, so that the angle at any `u32` position
/// (below `2^32`) stays below `2^96`, finite in f32.
pub const MAX_FREQUENCY: f64 = 18_446_744_073_709_551_616.0;

impl RopeMixed {
    /// Loads `freqs` `(2, H, D/2)` from `vb`, or creates it there with the paper's
    /// initialisation ([`RopeMixedConfig::initial_freqs`]).
    ///
    /// # Errors
    /// As [`RopeMixedConfig::validate`]; [`Error::DType`] for a `VarBuilder` (or a `freqs`)
    /// whose dtype is not f32, f64, bf16 or f16 (integer frequencies would be truncated);
    /// [`Error::TensorShape`] for a misshapen `freqs`;
    /// [`Error::InvalidConfig`] for loaded frequencies that are not finite or past
    /// [`MAX_FREQUENCY`] in magnitude (their angles at a `u32` position would not be finite in
    /// f32, so finite input would rotate to NaN).
    pub fn new(config: &RopeMixedConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        check_var_builder("RoPE-Mixed frequencies (the VarBuilder's dtype)", &vb)?;
        let shape = (2, config.num_heads, config.head_dim / 2);
        let fresh = !vb.contains_tensor("freqs");
        let freqs = learned(
            &vb,
            "RoPE-Mixed frequencies",
            shape,
            "freqs",
            Init::Const(0.0),
        )?;
        if fresh {
            // A new parameter: written in place with the initial frequencies, so the VarMap's
            // variable holds them.
            let init = Tensor::from_vec(config.initial_freqs(), shape, freqs.device())?
                .to_dtype(freqs.dtype())?;
            freqs.slice_set(&init, 0, 0)?;
        } else {
            let loaded = freqs
                .to_dtype(DType::F64)?
                .flatten_all()?
                .to_vec1::<f64>()?;
            if let Some(f) = loaded
                .iter()
                .find(|f| f.is_nan() || f.abs() > MAX_FREQUENCY)
            {
                return Err(Error::config(
                    "RoPE-Mixed frequency",
                    f,
                    format!("finite and at most {MAX_FREQUENCY:e} in magnitude: its angle at a u32 position must be finite in f32"),
                ));
            }
        }
        Ok(Self {
            config: *config,
            freqs,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RopeMixedConfig {
        &self.config
    }

    /// The frequencies `(2, H, D/2)`.
    pub fn freqs(&self) -> &Tensor {
        &self.freqs
    }

    /// Rotates `x` `(B, H, T, D)` at the 2-D `positions` of its `T` tokens.
    ///
    /// # Errors
    /// [`Error::Rank`] unless `x` has four dimensions; [`Error::DType`] unless it is float;
    /// [`Error::Shape`] for an input that is not `(B, H, T, D)` with this configuration's heads
    /// and width, or multimodal positions of another batch or length; [`Error::Positions`] for
    /// positions without the three axes of
    /// [`PositionIds::multimodal`](crate::positions::PositionIds::multimodal) (an offset, or
    /// `(B, T)` ids).
    pub fn rotate_one(&self, x: &Tensor, positions: &Positions) -> Result<Tensor> {
        let (h, d) = (self.config.num_heads, self.config.head_dim);
        let (b, xh, t, xd) = x.dims4().map_err(|_| Error::Rank {
            what: "RoPE-Mixed input",
            expected: 4,
            got: x.rank(),
            shape: x.dims().to_vec(),
        })?;
        check_float("RoPE-Mixed input", x.dtype())?;
        if (xh, xd) != (h, d) {
            return Err(Error::shape(
                "RoPE-Mixed input",
                format!("(B, {h}, T, {d}): the configured heads and head width"),
                x.shape(),
            ));
        }
        let (_, axes) = positions.grid_axes(
            "RoPE-Mixed positions",
            "the height (row) and width (column) of each patch",
        )?;
        if axes.dims()[2] != t || (axes.dims()[1] != b && axes.dims()[1] != 1) {
            return Err(Error::shape(
                "RoPE-Mixed positions",
                format!("multimodal ids (3, {b} or 1, {t}) to match the input"),
                axes.shape(),
            ));
        }
        let coord = |axis: usize| -> Result<Tensor> {
            // (B|1, 1, T, 1) in f32.
            Ok(axes
                .get(axis)?
                .to_dtype(DType::F32)?
                .unsqueeze(1)?
                .unsqueeze(3)?)
        };
        let (rows, cols) = (coord(1)?, coord(2)?);
        let freqs = self.freqs.to_dtype(DType::F32)?;
        let fx = freqs.get(0)?.unsqueeze(0)?.unsqueeze(2)?; // (1, H, 1, D/2)
        let fy = freqs.get(1)?.unsqueeze(0)?.unsqueeze(2)?;
        let angles = (cols.broadcast_mul(&fx)? + rows.broadcast_mul(&fy)?)?; // (B|1, H, T, D/2)
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let pairs = x.to_dtype(DType::F32)?.reshape((b, h, t, d / 2, 2))?;
        let (x0, x1) = (
            pairs.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?,
            pairs.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?,
        );
        let r0 = (x0.broadcast_mul(&cos)? - x1.broadcast_mul(&sin)?)?;
        let r1 = (x0.broadcast_mul(&sin)? + x1.broadcast_mul(&cos)?)?;
        Ok(Tensor::stack(&[r0, r1], D::Minus1)?
            .reshape((b, h, t, d))?
            .to_dtype(x.dtype())?)
    }
}

impl PositionalEncoding for RopeMixed {
    /// Rotates q at the queries' 2-D positions and k at the keys'.
    fn rotate(&self, q: Tensor, k: Tensor, ctx: &AttentionContext) -> Result<(Tensor, Tensor)> {
        // Each head turns by its own frequencies: a key shared by a group of query heads would
        // need one rotation per head of the group.
        if k.rank() == 4 && k.dim(1)? != self.config.num_heads {
            return Err(Error::shape(
                "RoPE-Mixed keys",
                format!(
                    "(B, {}, T, {}): one key head per query head (each head has its own frequencies, so grouped KV heads cannot share a rotated key)",
                    self.config.num_heads, self.config.head_dim
                ),
                k.shape(),
            ));
        }
        Ok((
            self.rotate_one(&q, ctx.queries)?,
            self.rotate_one(&k, ctx.keys)?,
        ))
    }
}

impl crate::plug::SchemeConfig for RopeMixedConfig {
    fn validate(&self) -> Result<()> {
        RopeMixedConfig::validate(self)
    }

    fn build(&self, vb: candle_nn::VarBuilder) -> Result<std::sync::Arc<dyn PositionalEncoding>> {
        Ok(std::sync::Arc::new(RopeMixed::new(self, vb)?))
    }
}
