//! Short causal convolutions on the projected keys and values (Inkling's `k_sconv`, `v_sconv`:
//! HF transformers 5.24, `InklingShortConvolution`).
//!
//! ```text
//! u[b, t, c] = y[b, t, c] · keep[b, t]                        padded tokens read as 0
//! y'[b, t, c] = y[b, t, c] + Σ_{s=0}^{K−1} w[c, s] · u[b, t − (K − 1) + s, c]
//! ```
//!
//! A depthwise convolution of `K` taps over each channel of the key (and value) projection,
//! before the key norm, with its input as a residual; tokens before the chunk come from the
//! cache's state (the last `K − 1` inputs `u`, zeros at the start), so decoding token by token
//! equals one forward. Computed in f32, as HF keeps the convolutions in f32.
//!
//! # Shapes
//! - `k_sconv.conv1d.weight`: `(Hkv·D, 1, K)`, `v_sconv.conv1d.weight`: `(Hkv·D, 1, K)` (HF's
//!   `nn.Conv1d` with `groups = channels`, no bias).
//! - `y`: `(B, T, C)`; the state: `(B, K − 1, C)`.

use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::error::{learned, Error, Result};

/// The two convolutions of a block, each `(C, K)`.
#[derive(Debug, Clone)]
pub(crate) struct ShortConvs {
    keys: Tensor,
    values: Tensor,
}

/// The last `K − 1` inputs of the key and value convolutions, `(B, K − 1, C)` each: what a
/// cached chunk continues.
pub(crate) type ConvState = (Tensor, Tensor);

impl ShortConvs {
    /// Loads (or creates, uniform in `±1/√K` as torch's `nn.Conv1d`) `k_sconv.conv1d.weight`
    /// and `v_sconv.conv1d.weight` of `channels` channels and `kernel` taps from `vb`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] / [`Error::TensorShape`]; [`Error::DType`] for integers.
    pub(crate) fn new(kernel: usize, channels: usize, vb: &VarBuilder) -> Result<Self> {
        let bound = 1.0 / (kernel as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let load = |name: &str| -> Result<Tensor> {
            let w = learned(
                &vb.pp(name).pp("conv1d"),
                "short convolution",
                (channels, 1, kernel),
                "weight",
                init,
            )?;
            Ok(w.squeeze(1)?)
        };
        Ok(Self {
            keys: load("k_sconv")?,
            values: load("v_sconv")?,
        })
    }

    /// The tensors held.
    pub(crate) fn held(&self) -> [&Tensor; 2] {
        [&self.keys, &self.values]
    }

    /// The keys and values `(B, T, C)` convolved, continuing `state` (zeros without one), with
    /// the padded tokens of `keep` (`(B, T)` 0/1, `None`: none) read as 0; and the state after
    /// the chunk.
    ///
    /// # Errors
    /// [`Error::Shape`] for a state of another batch or width than the chunk.
    pub(crate) fn apply(
        &self,
        (keys, values): (&Tensor, &Tensor),
        state: Option<&ConvState>,
        keep: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, ConvState)> {
        let (k, k_state) = convolve(&self.keys, keys, state.map(|s| &s.0), keep)?;
        let (v, v_state) = convolve(&self.values, values, state.map(|s| &s.1), keep)?;
        Ok((k, v, (k_state, v_state)))
    }
}

/// One convolution `w` `(C, K)` over `y` `(B, T, C)` (see the module docs), in f32 and back to
/// `y`'s dtype; and its last `K − 1` inputs.
fn convolve(
    w: &Tensor,
    y: &Tensor,
    state: Option<&Tensor>,
    keep: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    let (b, t, c) = y.dims3()?;
    let taps = w.dim(1)?;
    let dtype = y.dtype();
    let wide = y.to_dtype(DType::F32)?;
    let u = match keep {
        Some(keep) => wide.broadcast_mul(&keep.to_dtype(DType::F32)?.unsqueeze(2)?)?,
        None => wide.clone(),
    };
    let before = match state {
        Some(s) => {
            if s.dims() != [b, taps - 1, c] {
                return Err(Error::shape(
                    "short convolution state",
                    format!("({b}, {}, {c}) = (batch, taps − 1, channels)", taps - 1),
                    s.shape(),
                ));
            }
            s.to_dtype(DType::F32)?
        }
        None => Tensor::zeros((b, taps - 1, c), DType::F32, y.device())?,
    };
    let padded = Tensor::cat(&[&before, &u], 1)?;
    let w = w.to_dtype(DType::F32)?;
    let mut out = wide;
    for s in 0..taps {
        let tap = w.narrow(1, s, 1)?.squeeze(1)?; // (C)
        out = (out + padded.narrow(1, s, t)?.broadcast_mul(&tap)?)?;
    }
    let next = padded.narrow(1, t, taps - 1)?.detach();
    Ok((out.to_dtype(dtype)?, next))
}
