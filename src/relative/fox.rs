//! FoX, the Forgetting Transformer's forget gates (Lin et al. 2025, "Forgetting Transformer:
//! Softmax Attention with a Forget Gate", ICLR 2025): ALiBi whose slope each token chooses.
//!
//! ```text
//! log f[b, g, t] = s · logsigmoid(x[b, t] · W_f[g] + b_f[g])     s = post_log_scale (1)
//! c[b, g, t]     = Σ_{u ≤ t} log f[b, g, u]                      over the sequence, cached tokens
//!                                                                included
//! causal:        bias[b, h, i, j] = c[b, h, i] − c[b, h, j]       = Σ_{j < u ≤ i} log f[b, h, u]
//! bidirectional: 2H gates, r = those of heads H..2H:
//!                bias[b, h, i, j] = c[b, h, i] − c[b, h, j]       keys j ≤ i
//!                                 = r[b, h, j] − r[b, h, i]       keys j > i
//! ```
//!
//! As x-transformers' `DataDependentAlibi` inside its `Attention(data_dependent_alibi=True)`
//! (x-transformers 2.26.4): the gates read the block's input `x`, the reverse half of the
//! bidirectional form counts the gates of the keys after the query (its own excluded, the
//! key's included), and the gates' bias starts at 5 (`sigmoid(5) ≈ 0.993`: little is forgotten
//! at first).
//!
//! # Shapes
//! - gates `to_forget_gates.0.weight`: `(G, d_model)`, `to_forget_gates.0.bias`: `(G,)`,
//!   `G = H` causal or `2H` bidirectional (x-transformers' names under its
//!   `data_dependent_alibi` module).
//! - per-token states ([`PositionalEncoding::token_states`]): the cumulative sums `c`,
//!   `(B, G, T)`, f64 in an f64 block and f32 otherwise.
//! - bias: a [`SeparableBias`] with `a = c_q`, `c = −c_k` (and for keys after the query
//!   `a = −r_q`, `c = r_k`), so that no `(Tq, Tk)` tensor is built on the fused paths.
//!
//! Decoding is exact: the KV cache keeps every held token's sums and a step continues them.
//! (x-transformers' own cached decoding computes the gates of the new tokens only, so a step
//! forgets nothing of the cached ones.) The sums are [`Content::RunningSums`]: a streaming cache
//! takes the gates of the tokens it forgets out of the sums of the tokens it keeps after them,
//! so that the bias between two held tokens counts the gates of the held tokens between them,
//! as one forward over the held tokens in a row does (every other encoding sees the held
//! tokens at their slots), and the sums stay bounded however long the stream.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::input_projection;
use crate::error::{check_var_builder, learned, Error, Result};
use crate::graft::{graft, GraftBackward};
use crate::plug::{
    AttentionContext, Content, LogitsBias, PositionalEncoding, SchemeConfig, SeparableBias,
};

/// Configuration of [`ForgettingGates`].
///
/// Serialised (serde) with its field names, e.g. as JSON `{"d_model": 512, "num_heads": 8,
/// "bidirectional": false, "bias_init": 5.0, "post_log_scale": 1.0}`; `d_model` and
/// `num_heads` are required, the other fields default as in [`FoxConfig::new`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FoxConfig {
    /// Width of the block's input, which the gates read, > 0.
    pub d_model: usize,
    /// Attention heads, > 0.
    pub num_heads: usize,
    /// A second set of gates for the keys after each query (default false: causal). A causal
    /// set refuses bidirectional attention.
    #[serde(default = "defaults::bidirectional")]
    pub bidirectional: bool,
    /// Initial bias of the gates' projection (default 5).
    #[serde(default = "defaults::bias_init")]
    pub bias_init: f64,
    /// Factor of the log gates, `s` (default 1).
    #[serde(default = "defaults::post_log_scale")]
    pub post_log_scale: f64,
}

/// Values of the fields a serialised [`FoxConfig`] leaves out: those of [`FoxConfig::new`].
mod defaults {
    use super::FoxConfig;

    pub(super) fn bidirectional() -> bool {
        FoxConfig::new(1, 1).bidirectional
    }

    pub(super) fn bias_init() -> f64 {
        FoxConfig::new(1, 1).bias_init
    }

    pub(super) fn post_log_scale() -> f64 {
        FoxConfig::new(1, 1).post_log_scale
    }
}

impl FoxConfig {
    /// Causal gates of `num_heads` heads reading `d_model` features; bias 5, scale 1 (as
    /// x-transformers).
    pub fn new(d_model: usize, num_heads: usize) -> Self {
        Self {
            d_model,
            num_heads,
            bidirectional: false,
            bias_init: 5.0,
            post_log_scale: 1.0,
        }
    }

    /// Sets whether a second set of gates serves the keys after each query.
    pub fn with_bidirectional(mut self, bidirectional: bool) -> Self {
        self.bidirectional = bidirectional;
        self
    }

    /// Sets the gates' initial bias.
    pub fn with_bias_init(mut self, bias_init: f64) -> Self {
        self.bias_init = bias_init;
        self
    }

    /// Sets the factor of the log gates.
    pub fn with_post_log_scale(mut self, post_log_scale: f64) -> Self {
        self.post_log_scale = post_log_scale;
        self
    }

    /// Gates per token: `H`, or `2H` bidirectional.
    pub fn gates(&self) -> usize {
        match self.bidirectional {
            true => 2 * self.num_heads,
            false => self.num_heads,
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for zero heads or width, gates past
    /// [`crate::limits::max_elements`], or a bias or scale that is not a finite number.
    pub fn validate(&self) -> Result<()> {
        for (name, n) in [("d_model", self.d_model), ("num_heads", self.num_heads)] {
            if n == 0 {
                return Err(Error::config(name, n, "at least 1"));
            }
        }
        crate::limits::check_elements(
            "num_heads",
            self.num_heads,
            "gates × d_model of the forget gates' projection",
            &[self.num_heads, 2, self.d_model],
        )?;
        for (name, v) in [
            ("bias_init", self.bias_init),
            ("post_log_scale", self.post_log_scale),
        ] {
            if !v.is_finite() {
                return Err(Error::config(name, v, "a finite number"));
            }
        }
        Ok(())
    }
}

/// FoX's forget gates as an encoding: per-token cumulative log gates from the block's input,
/// and the bias `c_i − c_j` they give (see the module docs).
///
/// # Example
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::{AttentionConfig, ForgettingGates, FoxConfig, MultiHeadAttention};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let fox = ForgettingGates::new(&FoxConfig::new(32, 4), vb.pp("data_dependent_alibi"))?;
/// let cfg = AttentionConfig::new(32, 4).with_causal(true);
/// let mha = MultiHeadAttention::new(&cfg, Some(Arc::new(fox)), vb)?;
/// let x = Tensor::randn(0f32, 1.0, (2, 7, 32), &dev)?;
/// assert_eq!(candle_core::Module::forward(&mha, &x)?.dims(), &[2, 7, 32]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ForgettingGates {
    config: FoxConfig,
    /// `(G, d_model)`.
    weight: Tensor,
    /// `(G,)`.
    bias: Tensor,
}

impl ForgettingGates {
    /// The gates' projection loaded from `vb` (`to_forget_gates.0.weight` and `.bias`), or
    /// created there as x-transformers does: the weight uniform in `±1/√d_model` (torch's
    /// `nn.Linear`), the bias `bias_init`.
    ///
    /// # Errors
    /// As [`FoxConfig::validate`]; [`Error::DType`] for a `VarBuilder` (or a variable) whose
    /// dtype is not f32, f64, bf16 or f16; [`Error::MissingTensor`] / [`Error::TensorShape`].
    pub fn new(config: &FoxConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        check_var_builder("forget gates (the VarBuilder's dtype)", &vb)?;
        let vb = vb.pp("to_forget_gates.0");
        let (g, d) = (config.gates(), config.d_model);
        let bound = 1.0 / (d as f64).sqrt();
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let what = "forget gates' projection";
        let weight = learned(&vb, what, (g, d), "weight", init)?;
        let bias = learned(&vb, what, g, "bias", Init::Const(config.bias_init))?;
        Ok(Self {
            config: config.clone(),
            weight,
            bias,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &FoxConfig {
        &self.config
    }

    /// The log gates `s · logsigmoid(x W_fᵀ + b_f)`, `(B, G, T)`, f64 for an f64 input and f32
    /// otherwise.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)`.
    ///
    /// # Errors
    /// [`Error::Shape`] for an input of another width.
    pub fn log_gates(&self, x: &Tensor) -> Result<Tensor> {
        let what = "input of the forget gates";
        let z = input_projection(what, x, &self.weight, self.config.d_model)?
            .broadcast_add(&self.bias.to_dtype(x.dtype())?)?
            .to_dtype(work_dtype(x.dtype()))?;
        // logsigmoid(z) = min(z, 0) − ln(1 + e^−|z|), finite for every finite z.
        let log_f = (z.minimum(0.0)? - z.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?)?;
        Ok((log_f * self.config.post_log_scale)?
            .transpose(1, 2)?
            .contiguous()?)
    }
}

impl PositionalEncoding for ForgettingGates {
    /// The cumulative log gates of the chunk's tokens, continuing the last of `carried`
    /// (`(B, G, T_cached)`, the chunk's batch and gates: checked, since sums of another
    /// batch × gates of the same count would be continued row for row).
    fn token_states(
        &self,
        x: &Tensor,
        carried: Option<&Tensor>,
        _ctx: &AttentionContext,
    ) -> Result<Option<Tensor>> {
        let log_f = self.log_gates(x)?;
        let (b, g, _) = log_f.dims3()?;
        if let Some(c) = carried {
            if c.rank() != 3 || c.dims()[..2] != [b, g] {
                return Err(Error::shape(
                    "forget gates' carried sums",
                    format!("({b}, {g}, T) = (batch, gates, cached tokens) like the chunk's"),
                    c.shape(),
                ));
            }
        }
        let start = match carried {
            Some(c) if c.dim(2)? > 0 => {
                let last = c.narrow(2, c.dim(2)? - 1, 1)?;
                Some(last.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
            }
            _ => None,
        };
        Ok(Some(cumulative_sum(&log_f, start)?))
    }

    fn content(&self) -> Content {
        Content::RunningSums
    }

    /// `c_i − c_j` as a [`SeparableBias`], with the reverse half bidirectional.
    fn logits_bias(&self, _q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let Some(states) = ctx.states else {
            return Err(Error::config(
                "forget gates' states",
                "none",
                "the block's per-token states (FoX reads the block's input: plug it into \
                 MultiHeadAttention, which computes them)",
            ));
        };
        if !ctx.causal && !self.config.bidirectional {
            return Err(Error::config(
                "bidirectional",
                false,
                "true in bidirectional attention (causal gates would raise the weights of \
                 the keys after each query without bound)",
            ));
        }
        let h = self.config.num_heads;
        let half = |t: &Tensor, second: bool| t.narrow(1, if second { h } else { 0 }, h);
        let (cq, ck) = (half(&states.queries, false)?, half(&states.keys, false)?);
        let mut bias = SeparableBias::new(cq, ck.neg()?)?;
        if self.config.bidirectional {
            let (rq, rk) = (half(&states.queries, true)?, half(&states.keys, true)?);
            bias = bias.with_after(rq.neg()?, rk, states.first)?;
        }
        Ok(Some(LogitsBias::Separable(bias)))
    }
}

/// The dtype the gates and their sums are kept in: f64 for an f64 block (its biases as exact
/// as its logits), f32 otherwise.
fn work_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// `start[b·G + g] + Σ_{u ≤ t} log_f[b, g, u]` along the last axis of `(B, G, T)`, summed in
/// f64 in order (as torch's CPU `cumsum`) and kept in `log_f`'s dtype, with gradients flowing
/// to `log_f` (the reverse cumulative sum of theirs).
fn cumulative_sum(log_f: &Tensor, start: Option<Vec<f64>>) -> Result<Tensor> {
    let (b, g, t) = log_f.dims3()?;
    let values = log_f
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    if start.as_ref().is_some_and(|s| s.len() != b * g) {
        return Err(Error::shape(
            "forget gates' carried sums",
            format!("({b}, {g}, T) like the chunk's gates"),
            &candle_core::Shape::from(start.map_or(0, |s| s.len())),
        ));
    }
    let mut sums = vec![0f64; values.len()];
    for (row, (src, dst)) in values
        .chunks_exact(t.max(1))
        .zip(sums.chunks_exact_mut(t.max(1)))
        .enumerate()
    {
        let mut acc = start.as_ref().map_or(0.0, |s| s[row]);
        for (x, y) in src.iter().zip(dst) {
            acc += *x;
            *y = acc;
        }
    }
    let sums = Tensor::from_vec(sums, (b, g, t), log_f.device())?.to_dtype(log_f.dtype())?;
    match log_f.track_op() {
        true => graft(log_f, &sums, ReverseSum),
        false => Ok(sums),
    }
}

/// The adjoint of a cumulative sum along the last axis: the reverse cumulative sum.
struct ReverseSum;

impl GraftBackward for ReverseSum {
    const NAME: &'static str = "posenc-fox-cumsum";

    fn grad(&self, grad_y: &Tensor) -> candle_core::Result<Tensor> {
        let (b, g, t) = grad_y.dims3()?;
        let mut grad = grad_y
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1::<f64>()?;
        for row in grad.chunks_exact_mut(t.max(1)) {
            let mut acc = 0f64;
            for x in row.iter_mut().rev() {
                acc += *x;
                *x = acc;
            }
        }
        Tensor::from_vec(grad, (b, g, t), grad_y.device())?.to_dtype(grad_y.dtype())
    }
}

impl SchemeConfig for FoxConfig {
    fn validate(&self) -> Result<()> {
        FoxConfig::validate(self)
    }

    fn build(&self, vb: VarBuilder) -> Result<Arc<dyn PositionalEncoding>> {
        Ok(Arc::new(ForgettingGates::new(self, vb)?))
    }
}
