//! Inkling's relative logits: a bias per backward distance that each query mixes from a learned
//! bank of profiles, read from its own hidden state (HF transformers 5.24,
//! `models/inkling/modeling_inkling.py`: `InklingRelativeLogits` inside `InklingAttention`).
//!
//! ```text
//! r[b, i, h, :]   = (x[b, i] · W_rᵀ)[h·d_rel .. (h + 1)·d_rel]         W_r = r_proj.weight
//! R[b, h, i, δ]   = Σ_e r[b, i, h, e] · proj[e, δ]                      δ = 0 .. rel_extent − 1
//! bias[b, h, i, j] = R[b, h, i, p_i − p_j]   when 0 ≤ p_i − p_j < rel_extent, else 0
//! log-n scaling (optional, Inkling's full layers):
//!   τ_i = 1 + α · ln(max((p_i + 1) / n_floor, 1))
//!   q_i ← τ_i · q_i,   bias[b, h, i, :] ← τ_i · bias[b, h, i, :]      so logits_i = τ_i (q_i·k_j s + bias_ij)
//! ```
//!
//! `p` are the positions the block gives: HF counts them from the cache's start, pads
//! included, which is the block's default offset (give no position ids to match it). The
//! causal and padding masks stay the block's; the bias itself is zero outside the bank. On
//! Inkling's sliding layers the bank is as wide as the window and the scaling is off.
//!
//! # Shapes
//! - `r_proj.weight`: `(H·d_rel, d_model)`; `rel_logits_proj.proj`: `(d_rel, rel_extent)`
//!   (HF's names under the attention module).
//! - per-token states ([`PositionalEncoding::token_states`]): `r`, `(B, H·d_rel, T)`.
//! - bias: a [`RelativeBias`] of mixed rows ([`RelativeBias::mixed`]): each query's mix
//!   `τ_i r_i`, `(B, H, Tq, d_rel)`, of the bank reversed between two zero columns,
//!   `(d_rel, rel_extent + 2)`, read through a shift (offsets) or a column map (ids). The fused
//!   CPU cores compute each row's columns as they read them, forward and backward, so neither
//!   a `(Tq, Tk)` tensor nor the `(B, H, Tq, rel_extent + 2)` rows exist there. The clamp of
//!   the shift form sends every key beyond the bank (either side) to a zero column.
//!
//! Reference: Thinking Machines' Inkling (HF `thinkingmachines/Inkling`); the bias as sglang's
//! `RelLogitsProj` and FlashAttention-4 `score_mod`, materialised densely by HF.

use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::{check_queries, input_projection, relative_buckets};
use crate::cpu::linear_node::{self, Arrange};
use crate::cpu::row_scale::{scale_rows, scale_rows_owned};
use crate::error::{check_var_builder, learned, Error, Result};
use crate::plug::{
    AttentionContext, Columns, Content, Footprint, LogitsBias, PositionalEncoding, RelativeBias,
    SchemeConfig,
};
use crate::positions::Positions;

/// Log-n scaling of the queries and the bias past a floor: `τ_p = 1 + α · ln(max((p + 1) /
/// n_floor, 1))` (Inkling's `log_scaling_n_floor`, `log_scaling_alpha`).
///
/// Serialised (serde) as `{"n_floor": 8192, "alpha": 0.1}` (both required).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogScaling {
    /// Position from which the factor grows (`n_floor` ≥ 1).
    pub n_floor: usize,
    /// Weight of the logarithm, `α` (finite, ≥ 0; Inkling: 0.1).
    pub alpha: f64,
}

impl LogScaling {
    /// The factor of the query at position `p`, computed in f64.
    pub fn factor(&self, p: usize) -> f64 {
        let ratio = (p as f64 + 1.0) / self.n_floor.max(1) as f64;
        1.0 + self.alpha * ratio.max(1.0).ln()
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a floor of 0, or an `alpha` that is negative, not finite,
    /// or so large that the factor at 2^64 passes f32 (`alpha ≤ f32::MAX / 64`).
    pub fn validate(&self) -> Result<()> {
        if self.n_floor == 0 {
            return Err(Error::config("log_scaling.n_floor", 0, "at least 1"));
        }
        // ln((p + 1)/n) < 45 for every p < 2^64, so the factor stays finite in f32.
        if !(self.alpha >= 0.0 && self.alpha <= f64::from(f32::MAX) / 64.0) {
            return Err(Error::config(
                "log_scaling.alpha",
                self.alpha,
                "a number from 0 to f32::MAX / 64 (the factor is finite in f32 at every position)",
            ));
        }
        Ok(())
    }
}

/// Configuration of [`InklingRelativeLogits`].
///
/// Serialised (serde) with its field names, e.g. as JSON `{"d_model": 512, "num_heads": 8,
/// "d_rel": 16, "rel_extent": 1024, "log_scaling": null}`; `d_model` and `num_heads` are
/// required, the other fields default as in [`InklingConfig::new`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InklingConfig {
    /// Width of the block's input, which `r_proj` reads, > 0.
    pub d_model: usize,
    /// Attention heads, > 0.
    pub num_heads: usize,
    /// Mixing weights per head and query (default 16, as HF's class).
    #[serde(default = "defaults::d_rel")]
    pub d_rel: usize,
    /// Backward distances the bank covers (default 1024, as HF's class; a sliding layer's is
    /// its window).
    #[serde(default = "defaults::rel_extent")]
    pub rel_extent: usize,
    /// Log-n scaling of the queries and the bias (default none).
    #[serde(default)]
    pub log_scaling: Option<LogScaling>,
}

/// Values of the fields a serialised [`InklingConfig`] leaves out: those of
/// [`InklingConfig::new`].
mod defaults {
    use super::InklingConfig;

    pub(super) fn d_rel() -> usize {
        InklingConfig::new(1, 1).d_rel
    }

    pub(super) fn rel_extent() -> usize {
        InklingConfig::new(1, 1).rel_extent
    }
}

impl InklingConfig {
    /// `num_heads` heads reading `d_model` features; `d_rel` 16 and a bank of 1024 distances
    /// (HF's `InklingTextConfig` defaults), no log-n scaling.
    pub fn new(d_model: usize, num_heads: usize) -> Self {
        Self {
            d_model,
            num_heads,
            d_rel: 16,
            rel_extent: 1024,
            log_scaling: None,
        }
    }

    /// Sets the mixing weights per head.
    pub fn with_d_rel(mut self, d_rel: usize) -> Self {
        self.d_rel = d_rel;
        self
    }

    /// Sets the distances the bank covers.
    pub fn with_rel_extent(mut self, rel_extent: usize) -> Self {
        self.rel_extent = rel_extent;
        self
    }

    /// Sets the log-n scaling.
    pub fn with_log_scaling(mut self, log_scaling: Option<LogScaling>) -> Self {
        self.log_scaling = log_scaling;
        self
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a zero size, a bank past 2^30 distances, weights past
    /// [`crate::limits::max_elements`], or as [`LogScaling::validate`].
    pub fn validate(&self) -> Result<()> {
        for (name, n) in [
            ("d_model", self.d_model),
            ("num_heads", self.num_heads),
            ("d_rel", self.d_rel),
            ("rel_extent", self.rel_extent),
        ] {
            if n == 0 {
                return Err(Error::config(name, n, "at least 1"));
            }
        }
        if self.rel_extent > 1 << 30 {
            return Err(Error::config(
                "rel_extent",
                self.rel_extent,
                "at most 2^30 distances",
            ));
        }
        crate::limits::check_elements(
            "num_heads",
            self.num_heads,
            "heads × d_rel × d_model of r_proj",
            &[self.num_heads, self.d_rel, self.d_model],
        )?;
        crate::limits::check_elements(
            "rel_extent",
            self.rel_extent,
            "d_rel × rel_extent of the bank",
            &[self.d_rel, self.rel_extent + 2],
        )?;
        self.log_scaling
            .as_ref()
            .map_or(Ok(()), LogScaling::validate)
    }
}

/// Inkling's relative logits as an encoding (see the module docs): per-token mixing weights
/// from the block's input, a learned bank of bias profiles, and the optional log-n scaling.
///
/// # Example
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::{AttentionConfig, InklingConfig, InklingRelativeLogits, MultiHeadAttention};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let config = InklingConfig::new(32, 4).with_d_rel(4).with_rel_extent(8);
/// let rel = InklingRelativeLogits::new(&config, vb.clone())?;
/// let attn = AttentionConfig::new(32, 4).with_causal(true);
/// let mha = MultiHeadAttention::new(&attn, Some(Arc::new(rel)), vb)?;
/// let x = Tensor::randn(0f32, 1.0, (2, 11, 32), &dev)?;
/// assert_eq!(candle_core::Module::forward(&mha, &x)?.dims(), &[2, 11, 32]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct InklingRelativeLogits {
    config: InklingConfig,
    /// `(H·d_rel, d_model)`.
    r_proj: Tensor,
    /// `(d_rel, rel_extent)`.
    proj: Tensor,
}

impl InklingRelativeLogits {
    /// Loads (or creates) `r_proj.weight` and `rel_logits_proj.proj` from `vb`, the attention
    /// module's prefix: `r_proj` uniform in `±1/√d_model` (torch's `nn.Linear`), the bank
    /// N(0, 0.02²) (HF's `initializer_range`).
    ///
    /// # Errors
    /// As [`InklingConfig::validate`]; [`Error::DType`] for a `VarBuilder` (or a variable)
    /// whose dtype is not f32, f64, bf16 or f16; [`Error::MissingTensor`] /
    /// [`Error::TensorShape`].
    pub fn new(config: &InklingConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        check_var_builder("relative logits (the VarBuilder's dtype)", &vb)?;
        let (h, e, d) = (config.num_heads, config.d_rel, config.d_model);
        let bound = 1.0 / (d as f64).sqrt();
        let uniform = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let r_proj = learned(
            &vb.pp("r_proj"),
            "relative states' projection",
            (h * e, d),
            "weight",
            uniform,
        )?;
        let bank = Init::Randn {
            mean: 0.0,
            stdev: 0.02,
        };
        let proj = learned(
            &vb.pp("rel_logits_proj"),
            "relative logits' bank",
            (e, config.rel_extent),
            "proj",
            bank,
        )?;
        Ok(Self {
            config: config.clone(),
            r_proj,
            proj,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &InklingConfig {
        &self.config
    }

    /// The mixing weights of `x`'s tokens, `(B, H·d_rel, T)` in `x`'s dtype.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)`.
    ///
    /// # Errors
    /// [`Error::Shape`] for an input of another width.
    pub fn relative_states(&self, x: &Tensor) -> Result<Tensor> {
        let what = "input of the relative states' projection";
        // f32 on the CPU: one node of the graph writes the states channels first (candle's
        // product, transpose and copy were three, each with its own gradient tensors).
        if let (Ok((b, t, d)), Ok(w)) = (x.dims3(), self.r_proj.to_dtype(x.dtype())) {
            let node = candle_nn::Linear::new(w, None);
            if d == self.config.d_model {
                let arrange = Arrange::Channels { batch: b, len: t };
                if let Some(states) = linear_node::linear(&node, x, arrange)? {
                    return Ok(states);
                }
            }
        }
        Ok(
            input_projection(what, x, &self.r_proj, self.config.d_model)?
                .transpose(1, 2)?
                .contiguous()?,
        )
    }

    /// The dense bias HF's `InklingRelativeLogits` returns (scaled when the configuration
    /// scales), for queries at `queries` and keys at `keys`.
    ///
    /// # Shapes
    /// `relative_states`: `(B, Tq, H, d_rel)` (HF's layout); returns `(B, H, Tq, Tk)`.
    ///
    /// # Errors
    /// [`Error::Shape`] for states of another layout; as [`RelativeBias::to_dense`].
    pub fn bias(
        &self,
        relative_states: &Tensor,
        queries: &Positions,
        keys: &Positions,
        k_len: usize,
    ) -> Result<Tensor> {
        let (b, tq, h, e) = relative_states.dims4()?;
        if (h, e) != (self.config.num_heads, self.config.d_rel) {
            return Err(Error::shape(
                "relative states",
                format!(
                    "(batch, queries, {}, {})",
                    self.config.num_heads, self.config.d_rel
                ),
                relative_states.shape(),
            ));
        }
        let states = relative_states.reshape((b, tq, h * e))?.transpose(1, 2)?;
        self.rows(&states, queries, tq, keys, k_len)?
            .to_dense(tq, k_len)
    }

    /// The bank reversed between two zero columns, `(d_rel, rel_extent + 2)`: column
    /// `c ∈ 1..=E` holds distance `E − c`; gradients flow to the bank.
    fn padded_bank(&self, dtype: DType) -> Result<Tensor> {
        let (e, extent) = (self.config.d_rel, self.config.rel_extent);
        let reversed: Vec<u32> = (0..extent as u32).rev().collect();
        let reversed = Tensor::from_vec(reversed, extent, self.proj.device())?;
        let bank = self.proj.to_dtype(dtype)?.index_select(&reversed, 1)?;
        let zero = Tensor::zeros((e, 1), dtype, self.proj.device())?;
        Ok(Tensor::cat(&[&zero, &bank, &zero], 1)?)
    }

    /// The rows of `tq` queries at `queries` against `tk` keys at `keys`, from the queries'
    /// states `(B, H·d_rel, Tq)`, scaled when the configuration scales.
    fn rows(
        &self,
        states: &Tensor,
        queries: &Positions,
        tq: usize,
        keys: &Positions,
        tk: usize,
    ) -> Result<RelativeBias> {
        let (h, e, extent) = (
            self.config.num_heads,
            self.config.d_rel,
            self.config.rel_extent,
        );
        let (b, c, n) = states.dims3()?;
        if c != h * e || n != tq {
            return Err(Error::shape(
                "relative states of the queries",
                format!("(batch, {}, {tq}) = (batch, heads × d_rel, queries)", h * e),
                states.shape(),
            ));
        }
        let width = extent as i64;
        let columns = match (queries, keys) {
            // Key j of query i reads column E + (ks + j) − (qs + i): distance 0 at column E.
            (Positions::Offset(qs), Positions::Offset(ks)) => {
                Columns::Shift(width + *ks as i64 - *qs as i64)
            }
            _ => Columns::Index(relative_buckets(
                queries,
                tq,
                keys,
                tk,
                states.device(),
                &|d| (width + d).clamp(0, width + 1) as u32,
            )?),
        };
        // τ_i (r_i · bank) = (τ_i r_i) · bank: the factors scale the mix, read from the
        // states where they lie (one factor per query), else from a scaled view.
        let bank = self.padded_bank(states.dtype())?;
        match self.factors(queries, tq, states.device())? {
            Some((factors, rows)) if rows > 1 => {
                let mix = states.reshape((b, h, e, tq))?.transpose(2, 3)?;
                RelativeBias::mixed(scale_rows(&mix, factors)?, bank, columns)
            }
            factors => {
                let scale = factors.map(|(f, _)| f);
                RelativeBias::mixed_states(states.clone(), h, bank, scale, columns)
            }
        }
    }

    /// The log-n factors of the queries at `queries` and their rows (1, or one per sequence
    /// for explicit ids), when the configuration scales.
    fn factors(
        &self,
        queries: &Positions,
        tq: usize,
        device: &candle_core::Device,
    ) -> Result<Option<(Vec<f32>, usize)>> {
        let Some(scaling) = self.config.log_scaling else {
            return Ok(None);
        };
        let ids = queries.to_ids(tq, device)?;
        let (rows, _) = ids.dims2()?;
        let factors = ids
            .flatten_all()?
            .to_vec1::<u32>()?
            .into_iter()
            .map(|p| scaling.factor(p as usize) as f32)
            .collect();
        Ok(Some((factors, rows)))
    }

    /// The queries `q` `(B, H, Tq, D)` each times its log-n factor (in f32, as HF scales,
    /// and back to `q`'s dtype; where they lie when they can be), or `q` as it is when the
    /// configuration does not scale.
    fn scaled(&self, x: Tensor, queries: &Positions, tq: usize) -> Result<Tensor> {
        match self.factors(queries, tq, x.device())? {
            Some((factors, _)) => scale_rows_owned(x, factors),
            None => Ok(x),
        }
    }
}

impl PositionalEncoding for InklingRelativeLogits {
    /// The log-n scaling of the queries (the keys as they are).
    fn rotate(&self, q: Tensor, k: Tensor, ctx: &AttentionContext) -> Result<(Tensor, Tensor)> {
        Ok((self.scaled(q, ctx.queries, ctx.q_len)?, k))
    }

    /// The relative states of the chunk's tokens (`carried` is not read: each token's own).
    fn token_states(
        &self,
        x: &Tensor,
        _carried: Option<&Tensor>,
        _ctx: &AttentionContext,
    ) -> Result<Option<Tensor>> {
        Ok(Some(self.relative_states(x)?))
    }

    fn content(&self) -> Content {
        Content::Input
    }

    /// The log-n factors multiply each query (linear in it), and the bias hook reads only the
    /// queries' shape.
    fn scaled_queries(&self) -> bool {
        true
    }

    /// One row per query and head over the bank's distances (see the module docs).
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        check_queries(q, self.config.num_heads)?;
        ctx.check_positions()?;
        let Some(states) = ctx.states else {
            return Err(Error::config(
                "relative states",
                "none",
                "the block's per-token states (Inkling's relative logits read the block's \
                 input: plug them into MultiHeadAttention, which computes them)",
            ));
        };
        let rows = self.rows(&states.queries, ctx.queries, ctx.q_len, ctx.keys, ctx.k_len)?;
        Ok(Some(LogitsBias::Relative(rows)))
    }

    /// With offsets, a mix of `d_rel` per query (the bank is shared; a path that builds the
    /// rows finds them `rel_extent + 2` wide and shrinks its blocks); explicit ids read
    /// through a column map, which is not a row of a fixed width.
    fn footprint(&self, ctx: &AttentionContext) -> Footprint {
        match (ctx.queries, ctx.keys) {
            (Positions::Offset(_), Positions::Offset(_)) => Footprint::Rows {
                bias: self.config.d_rel,
                values: 0,
            },
            _ => Footprint::Unknown,
        }
    }
}

impl SchemeConfig for InklingConfig {
    fn validate(&self) -> Result<()> {
        InklingConfig::validate(self)
    }

    fn build(&self, vb: VarBuilder) -> Result<Arc<dyn PositionalEncoding>> {
        Ok(Arc::new(InklingRelativeLogits::new(self, vb)?))
    }
}
