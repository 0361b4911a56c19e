//! ALiBi: attention with linear biases (Press et al. 2022, "Train Short, Test Long").
//!
//! ```text
//! slopes, n heads a power of two:  m_h = 2^(−8h/n),  h = 1..n
//! otherwise, c = the largest power of two below n:
//!     the c slopes for c heads, then every other slope for 2c heads (2^(−4h/c), h = 1, 3, 5..),
//!     n − c of them                                    (as BLOOM's `build_alibi_tensor`)
//! causal:        bias[h, i, j] = −m_h · (i − j)   for j ≤ i (later keys are masked)
//!                 ≡ m_h · (j − i_last) per key, i_last = the chunk's last query position: the two
//!                   differ by a constant along each softmax row, which softmax ignores
//! bidirectional: bias[h, i, j] = −m_h · |i − j|
//! Falcon:        bias[h, i, j] = bf16(bf16(m_h) · p_j) / √d   per key, at absolute positions
//! ```
//!
//! By default ([`AlibiMode::Auto`]) the form follows the attention it serves: the causal form
//! in a causal block, the bidirectional one otherwise, read from the plug's
//! [`AttentionContext`]. An explicit mode overrides that on purpose.
//!
//! # Shapes
//! - causal, per-key form: `(1|B, H, 1, Tk)`; pairwise forms: `(1|B, H, Tq, Tk)`.
//! - slopes: `(H,)`; learnable ones are the `VarBuilder` variable `slopes`.
//!
//! The per-key form is what BLOOM uses; it needs no `(H, T, T)` tensor, so decoding costs
//! O(Tk) per step. A tensor-parallel shard takes its own heads' slopes with
//! [`AlibiConfig::with_head_range`].

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::{Deserialize, Serialize};

use super::{check_queries, logits_positions, BucketCache, DistanceRange, ROWS_LAYOUT};
use crate::error::{check_float, check_var_builder, Error, Result};
use crate::limits::check_elements;
use crate::plug::{AttentionContext, Columns, LogitsBias, PositionalEncoding, RelativeBias};
use crate::positions::Positions;

/// How the bias treats keys after the query.
///
/// Serialised in snake case: `"causal"`, `"causal_pairwise"`, `"symmetric"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlibiMode {
    /// Follow the attention (the default): [`AlibiMode::Causal`] when it is causal,
    /// [`AlibiMode::Symmetric`] when it is bidirectional.
    Auto,
    /// Decoder: keys after the query are masked by the attention; the bias is `m·(j − i_last)`
    /// per key.
    Causal,
    /// Decoder, written pairwise: `−m·(i − j)` (equal attention to [`AlibiMode::Causal`] under a
    /// causal mask; kept for checking and for callers who want the paper's matrix).
    CausalPairwise,
    /// Encoder: `−m·|i − j|`.
    Symmetric,
}

/// Configuration of [`Alibi`].
///
/// Serialised (serde) with its field names, e.g. as JSON
/// `{"num_heads": 8, "first_head": 0, "head_count": 8, "mode": "causal", "learnable": false,
/// "slopes": {"formula": "bloom"}}`;
/// only `num_heads` is required, the other fields default as in [`AlibiConfig::new`]
/// (`head_count` to `num_heads`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "AlibiConfigFields")]
pub struct AlibiConfig {
    /// Heads of the whole model, > 0 (slopes depend on it).
    pub num_heads: usize,
    /// First head this module serves (default 0).
    pub first_head: usize,
    /// Heads this module serves (default: all).
    pub head_count: usize,
    /// Follow the attention, or force causal (per-key), causal pairwise or symmetric (default
    /// [`AlibiMode::Auto`]).
    pub mode: AlibiMode,
    /// Whether the slopes are a trainable variable `slopes` (default false).
    pub learnable: bool,
    /// Which formula gives the slopes (default [`AlibiSlopes::Bloom`]).
    pub slopes: AlibiSlopes,
}

/// The slope formulas in use. Both are Press et al.'s `2^(−8h/n)` for a power-of-two `n`;
/// they differ in the largest exponent and in the slopes of other head counts.
///
/// Serialised as `{"formula": "bloom"}`, `{"formula": "mpt", "max_bias": 8.0}` or
/// `{"formula": "falcon", "head_dim": 64}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "formula", rename_all = "snake_case", deny_unknown_fields)]
pub enum AlibiSlopes {
    /// BLOOM's `build_alibi_tensor` ([`alibi_slopes`]): for `n` heads, the `c` slopes of the
    /// largest power of two `c ≤ n`, then every other slope of `2c` heads.
    #[default]
    Bloom,
    /// MPT's `gen_slopes`: `m_h = 2^(−max_bias·h/N)`, `h = 1..N`, `N` the smallest power of two
    /// `≥ n`; for `N ≠ n` the odd-indexed slopes, then the even-indexed ones, the first `n`.
    Mpt {
        /// The largest exponent (MPT's `alibi_bias_max`, default 8). MosaicML's code reads it
        /// from `attn_config`; HF transformers' `MptModel` always uses 8, and so does
        /// `HfAttentionConfig`'s reading of an MPT `config.json`.
        max_bias: f64,
    },
    /// Falcon's (Falcon-RW): BLOOM's slopes rounded to bfloat16, the per-key bias
    /// `bf16(m · p_j)` rounded to bfloat16 too, at each key's absolute position `p_j`, and
    /// added before the softmax scale, so the block adds `bf16(m · p_j) / √head_dim`. The form
    /// is per key in every mode (a constant along each row apart from the rounding), as in
    /// Falcon's own code; pass position ids counted from each sequence's first unpadded token,
    /// as HF's Falcon does, for its rounding at long positions.
    Falcon {
        /// The attention's head width (the bias is divided by its square root).
        head_dim: usize,
    },
}

impl AlibiSlopes {
    /// The slopes of a model with `num_heads` heads, in f64.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for zero heads, more than [`crate::limits::max_elements`], or
    /// an MPT `max_bias` that is not a finite number > 0.
    pub fn slopes(&self, num_heads: usize) -> Result<Vec<f64>> {
        match *self {
            AlibiSlopes::Bloom => alibi_slopes(num_heads),
            AlibiSlopes::Falcon { .. } => Ok(alibi_slopes(num_heads)?
                .into_iter()
                .map(|m| f64::from(half::bf16::from_f32(m as f32)))
                .collect()),
            AlibiSlopes::Mpt { max_bias } => {
                check_num_heads(num_heads)?;
                if !(max_bias.is_finite() && max_bias > 0.0) {
                    return Err(Error::config("max_bias", max_bias, "a finite number > 0"));
                }
                let n = num_heads.next_power_of_two();
                let all: Vec<f64> = (1..=n)
                    .map(|h| 2f64.powf(-(h as f64) * max_bias / n as f64))
                    .collect();
                if n == num_heads {
                    return Ok(all);
                }
                let odd = all.iter().skip(1).step_by(2);
                let even = all.iter().step_by(2);
                Ok(odd.chain(even).take(num_heads).copied().collect())
            }
        }
    }
}

/// The serialised form of [`AlibiConfig`]: a field left out keeps its value from
/// [`AlibiConfig::new`], which depends on `num_heads`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AlibiConfigFields {
    num_heads: usize,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    first_head: Option<usize>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    head_count: Option<usize>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    mode: Option<AlibiMode>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    learnable: Option<bool>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    slopes: Option<AlibiSlopes>,
}

impl From<AlibiConfigFields> for AlibiConfig {
    fn from(f: AlibiConfigFields) -> Self {
        let mut c = AlibiConfig::new(f.num_heads);
        c.first_head = f.first_head.unwrap_or(c.first_head);
        c.head_count = f.head_count.unwrap_or(c.head_count);
        c.mode = f.mode.unwrap_or(c.mode);
        c.learnable = f.learnable.unwrap_or(c.learnable);
        c.slopes = f.slopes.unwrap_or(c.slopes);
        c
    }
}

impl AlibiConfig {
    /// All `num_heads` heads, the form following the attention, fixed slopes.
    pub fn new(num_heads: usize) -> Self {
        Self {
            num_heads,
            first_head: 0,
            head_count: num_heads,
            mode: AlibiMode::Auto,
            learnable: false,
            slopes: AlibiSlopes::Bloom,
        }
    }

    /// Sets the slope formula.
    pub fn with_slopes(mut self, slopes: AlibiSlopes) -> Self {
        self.slopes = slopes;
        self
    }

    /// Serves heads `first..first + count` of the model (a tensor-parallel shard).
    pub fn with_head_range(mut self, first: usize, count: usize) -> Self {
        self.first_head = first;
        self.head_count = count;
        self
    }

    /// Sets the mode.
    pub fn with_mode(mut self, mode: AlibiMode) -> Self {
        self.mode = mode;
        self
    }

    /// Makes the slopes trainable.
    pub fn with_learnable(mut self, learnable: bool) -> Self {
        self.learnable = learnable;
        self
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for zero heads, more than [`crate::limits::max_elements`] heads, a
    /// head range outside `0..num_heads`, or an MPT `max_bias` that is not a finite number > 0.
    pub fn validate(&self) -> Result<()> {
        check_num_heads(self.num_heads)?;
        if let AlibiSlopes::Mpt { max_bias } = self.slopes {
            if !(max_bias.is_finite() && max_bias > 0.0) {
                return Err(Error::config("max_bias", max_bias, "a finite number > 0"));
            }
        }
        if self.slopes == (AlibiSlopes::Falcon { head_dim: 0 }) {
            return Err(Error::config(
                "head_dim",
                0,
                "at least 1 (Falcon's ALiBi is divided by √head_dim)",
            ));
        }
        if self.head_count == 0 || self.first_head.saturating_add(self.head_count) > self.num_heads
        {
            return Err(Error::config(
                "head range",
                format!(
                    "{}..{}",
                    self.first_head,
                    self.first_head.saturating_add(self.head_count)
                ),
                format!("a non-empty range inside 0..{}", self.num_heads),
            ));
        }
        Ok(())
    }
}

/// The ALiBi slopes of a model with `num_heads` heads, in f64 (BLOOM's formula).
///
/// # Errors
/// [`Error::InvalidConfig`] for zero heads or more than [`crate::limits::max_elements`].
pub fn alibi_slopes(num_heads: usize) -> Result<Vec<f64>> {
    check_num_heads(num_heads)?;
    let closest = 1usize << (usize::BITS - 1 - num_heads.leading_zeros());
    let base = 2f64.powf(-8.0 / closest as f64);
    let mut slopes: Vec<f64> = (1..=closest).map(|h| base.powi(h as i32)).collect();
    if closest != num_heads {
        let extra_base = 2f64.powf(-4.0 / closest as f64);
        let remaining = num_heads - closest;
        slopes.extend((0..remaining).map(|i| extra_base.powi(2 * i as i32 + 1)));
    }
    Ok(slopes)
}

/// ALiBi linear biases for the attention logits.
///
/// # Example
/// ```
/// use candle_core::Device;
/// use candle_posenc::{alibi_slopes, Alibi, AlibiConfig, AttentionContext, Positions};
///
/// assert_eq!(alibi_slopes(8)?[0], 0.5);
/// let alibi = Alibi::new(&AlibiConfig::new(8), &Device::Cpu)?;
/// let p = Positions::Offset(0);
/// // Bidirectional attention: −m·|i − j|, one row per query.
/// let bias = alibi.bias(&AttentionContext::new(&p, 4, &p, 4))?;
/// assert_eq!(bias.dims(), &[1, 8, 4, 4]);
/// // Causal attention: m·(j − i_last), one row per key.
/// let bias = alibi.bias(&AttentionContext::new(&p, 4, &p, 4).with_causal(true))?;
/// assert_eq!(bias.dims(), &[1, 8, 1, 4]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Alibi {
    config: AlibiConfig,
    /// `(H,)` f32.
    slopes: Tensor,
    cache: std::sync::Arc<BucketCache>,
}

impl Alibi {
    /// Fixed slopes on `device`.
    ///
    /// # Errors
    /// As [`AlibiConfig::validate`]; [`Error::InvalidConfig`] if `learnable` is set (use
    /// [`Alibi::new_learnable`]).
    pub fn new(config: &AlibiConfig, device: &Device) -> Result<Self> {
        config.validate()?;
        if config.learnable {
            return Err(Error::config(
                "learnable",
                true,
                "false here; learnable slopes are created by Alibi::new_learnable",
            ));
        }
        let slopes = Self::initial_slopes(config, device)?;
        Ok(Self::from_slopes(config, slopes))
    }

    /// Slopes loaded from `vb` (variable `slopes`, `(head_count,)`), or created there with the
    /// paper's values when the `VarBuilder` is backed by a `VarMap` that lacks them. The slopes
    /// are used in f32 whatever the variable's dtype (a `VarMap` hands back a variable it
    /// already holds in its own dtype), through a tracked cast, so the gradient still reaches
    /// the variable.
    ///
    /// # Errors
    /// As [`AlibiConfig::validate`]; [`Error::DType`] for a `VarBuilder` (or a `slopes`
    /// variable) whose dtype is not f32, f64, bf16 or f16; [`Error::MissingTensor`] /
    /// [`Error::TensorShape`].
    pub fn new_learnable(config: &AlibiConfig, vb: VarBuilder) -> Result<Self> {
        config.validate()?;
        check_var_builder("ALiBi slopes (the VarBuilder's dtype)", &vb)?;
        let fresh = !vb.contains_tensor("slopes");
        let slopes =
            vb.get_with_hints_dtype(config.head_count, "slopes", Init::Const(0.0), DType::F32)?;
        check_float("ALiBi slopes", slopes.dtype())?;
        if fresh {
            // A VarMap just created the variable with zeros: write the paper's slopes into it
            // in place (the tensor shares the variable's storage).
            let init = Self::initial_slopes(config, slopes.device())?;
            slopes.slice_set(&init.to_dtype(slopes.dtype())?, 0, 0)?;
        }
        let mut config = config.clone();
        config.learnable = true;
        Ok(Self::from_slopes(&config, slopes.to_dtype(DType::F32)?))
    }

    fn initial_slopes(config: &AlibiConfig, device: &Device) -> Result<Tensor> {
        let all = config.slopes.slopes(config.num_heads)?;
        let mine: Vec<f32> = all[config.first_head..config.first_head + config.head_count]
            .iter()
            .map(|&s| s as f32)
            .collect();
        Ok(Tensor::from_vec(mine, config.head_count, device)?)
    }

    fn from_slopes(config: &AlibiConfig, slopes: Tensor) -> Self {
        Self {
            config: config.clone(),
            slopes,
            cache: Default::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &AlibiConfig {
        &self.config
    }

    /// The slopes of the served heads, `(head_count,)`.
    pub fn slopes(&self) -> &Tensor {
        &self.slopes
    }

    /// Bias tensors built so far (fixed slopes: once per shape).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn bias_builds(&self) -> usize {
        self.cache.builds()
    }

    /// The mode this bias takes in attention that is `causal` or not.
    pub fn mode_for(&self, causal: bool) -> AlibiMode {
        match (self.config.mode, causal) {
            (AlibiMode::Auto, true) => AlibiMode::Causal,
            (AlibiMode::Auto, false) => AlibiMode::Symmetric,
            (mode, _) => mode,
        }
    }

    /// The mode this bias takes in the attention `ctx` describes: [`Self::mode_for`] its
    /// causality, and the pairwise causal form when the softmax has sinks (the per-key form
    /// differs from `−m·(i − j)` by a constant per row, which sinks do not ignore).
    pub fn mode_in(&self, ctx: &AttentionContext) -> AlibiMode {
        match self.mode_for(ctx.causal) {
            AlibiMode::Causal if ctx.sinks => AlibiMode::CausalPairwise,
            mode => mode,
        }
    }

    /// The bias for `ctx`'s queries and keys, dense, in the mode [`Self::mode_in`] gives.
    ///
    /// # Shapes
    /// Causal: `(1|B, H, 1, Tk)`; pairwise modes: `(1|B, H, Tq, Tk)`.
    ///
    /// # Errors
    /// [`Error::Shape`] if explicit ids disagree on the batch size or the lengths.
    pub fn bias(&self, ctx: &AttentionContext) -> Result<Tensor> {
        ctx.check_positions()?;
        let (queries, tq, keys, tk) = (ctx.queries, ctx.q_len, ctx.keys, ctx.k_len);
        let mode = self.mode_in(ctx);
        if tq == 0 {
            // No query row to anchor the causal form on: an empty bias.
            let h = self.config.head_count;
            return Ok(Tensor::zeros(
                (1, h, 0, tk),
                DType::F32,
                self.slopes.device(),
            )?);
        }
        let build = || self.build_bias(mode, queries, tq, keys, tk);
        if self.config.learnable {
            // Trainable slopes: recompute so gradients reach them.
            return build();
        }
        let layout = (mode as usize, 0);
        self.cache
            .get_or_build(queries, tq, keys, tk, layout, build)
    }

    fn build_bias(
        &self,
        mode: AlibiMode,
        queries: &Positions,
        tq: usize,
        keys: &Positions,
        tk: usize,
    ) -> Result<Tensor> {
        let device = self.slopes.device();
        let h = self.config.head_count;
        let slopes = self.slopes.reshape((1, h, 1, 1))?;
        if let AlibiSlopes::Falcon { head_dim } = self.config.slopes {
            // bf16(m · p_j) / √d per key, at absolute key positions. (1|B, H, 1, Tk).
            let k = keys.to_ids(tk, device)?.to_dtype(DType::F32)?;
            let (b, _) = k.dims2()?;
            let products = k.reshape((b, 1, 1, tk))?.broadcast_mul(&slopes)?;
            let rounded = products.to_dtype(DType::BF16)?.to_dtype(DType::F32)?;
            return Ok((rounded / (head_dim as f64).sqrt())?);
        }
        match mode {
            AlibiMode::Causal | AlibiMode::Auto => {
                // m · (j − i_last) for every key j, where i_last is the chunk's last query
                // position: the paper's −m·(i − j) plus the row constant m·(i − i_last), kept
                // near zero so f32 stays exact at large positions. Shape (1|B, H, 1, Tk).
                let k = keys.to_ids(tk, device)?.to_dtype(DType::I64)?;
                let q_last = queries
                    .to_ids(tq, device)?
                    .narrow(1, tq.saturating_sub(1), tq.min(1))?
                    .to_dtype(DType::I64)?;
                let (qb, kb) = (q_last.dim(0)?, k.dim(0)?);
                if qb != kb && qb != 1 && kb != 1 {
                    return Err(Error::shape(
                        "key position ids",
                        format!("batch 1 or {qb} to match the query positions"),
                        k.shape(),
                    ));
                }
                let rel = k.broadcast_sub(&q_last)?.to_dtype(DType::F32)?;
                let (b, _) = rel.dims2()?;
                Ok(rel.reshape((b, 1, 1, tk))?.broadcast_mul(&slopes)?)
            }
            mode => {
                // d = j − i in f32 (candle has no i64 negation), then −m·|d| or m·d.
                let d = Positions::relative_distances(queries, tq, keys, tk, device)?
                    .to_dtype(DType::F32)?
                    .unsqueeze(1)?;
                if mode == AlibiMode::Symmetric {
                    Ok(d.abs()?.broadcast_mul(&slopes)?.neg()?)
                } else {
                    Ok(d.broadcast_mul(&slopes)?)
                }
            }
        }
    }
}

impl candle_core::Module for Alibi {
    /// Adds the bias to logits `(B, H, Tq, Tk)` whose queries are the last `Tq` of the `Tk`
    /// keys. [`AlibiMode::Auto`] takes the bidirectional form `−m·|i − j|` here: a module on
    /// logits does not know the attention's mask, and for keys at or before the query that form
    /// equals the causal one, so it is right under a causal mask too.
    fn forward(&self, logits: &Tensor) -> candle_core::Result<Tensor> {
        let (tq, tk) = logits_positions(logits, self.config.head_count)?;
        let (q, k) = (Positions::Offset(tk - tq), Positions::Offset(0));
        let bias = self.bias(&AttentionContext::new(&q, tq, &k, tk))?;
        logits.broadcast_add(&bias.to_dtype(logits.dtype())?)
    }
}

impl PositionalEncoding for Alibi {
    /// The causal form as one row per key; the pairwise forms as rows per distance for offsets
    /// (`(1, H, 1, Tq + Tk − 1)`), dense for explicit ids.
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let (_, h, tq, _) = check_queries(q, self.config.head_count)?;
        let mode = self.mode_in(ctx);
        let range = DistanceRange::of(ctx.queries, tq, ctx.keys, ctx.k_len)?;
        let falcon = matches!(self.config.slopes, AlibiSlopes::Falcon { .. });
        let (AlibiMode::CausalPairwise | AlibiMode::Symmetric, Some(range), false) =
            (mode, range, falcon)
        else {
            return Ok(Some(LogitsBias::Dense(self.bias(ctx)?)));
        };
        let build = || -> Result<Tensor> {
            let d: Vec<f32> = range
                .distances()
                .map(|d| match mode {
                    AlibiMode::Symmetric => -(d.abs() as f32),
                    _ => d as f32,
                })
                .collect();
            let d = Tensor::from_vec(d, (1, 1, 1, range.width), self.slopes.device())?;
            Ok(d.broadcast_mul(&self.slopes.reshape((1, h, 1, 1))?)?)
        };
        let values = if self.config.learnable {
            build()?
        } else {
            let layout = (ROWS_LAYOUT.0, mode as usize);
            let (qs, ks) = (&range.queries, &range.keys);
            self.cache
                .get_or_build(qs, tq, ks, ctx.k_len, layout, build)?
        };
        let rows = RelativeBias::new(values, Columns::Shift(range.shift(tq)))?;
        Ok(Some(LogitsBias::Relative(rows)))
    }
}

/// At least one head, and few enough for the slopes to be allocated.
fn check_num_heads(num_heads: usize) -> Result<()> {
    if num_heads == 0 {
        return Err(Error::config("num_heads", num_heads, "at least 1"));
    }
    check_elements("num_heads", num_heads, "the number of heads", &[num_heads])?;
    Ok(())
}

impl crate::plug::SchemeConfig for AlibiConfig {
    fn validate(&self) -> Result<()> {
        AlibiConfig::validate(self)
    }

    fn build(&self, vb: candle_nn::VarBuilder) -> Result<std::sync::Arc<dyn PositionalEncoding>> {
        Ok(match self.learnable {
            true => std::sync::Arc::new(Alibi::new_learnable(self, vb)?),
            false => std::sync::Arc::new(Alibi::new(self, vb.device())?),
        })
    }
}
