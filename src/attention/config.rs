//! The attention block's configuration and its per-call options and output.

use std::collections::HashMap;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{json_entry, read_json_entry, ATTENTION_KEY};
use crate::error::{check_normal_f32, Error, Result};
use crate::limits::check_elements;
use crate::positions::Positions;

use super::latent::LatentConfig;
use super::qk_norm::QkNormConfig;
use super::temperature::AttentionTemperature;

/// Configuration of [`MultiHeadAttention`](super::MultiHeadAttention).
///
/// Serialised (serde) with its field names, e.g. as JSON
/// `{"d_model": 512, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64, "bias": false,
/// "out_bias": false, "dropout": 0.0, "causal": false, "softmax_scale": 0.125, "qk_norm": null,
/// "sliding_window": null, "attention_chunk": null, "attention_temperature": null,
/// "logit_softcap": null, "sinks": false, "latent": null, "k_eq_v": false, "value_norm": null,
/// "short_conv": null}`.
/// Only `d_model` and `num_heads` are required (`out_bias` defaults to `bias`); the other fields default as in [`AttentionConfig::new`] and its builders (a
/// `head_dim` without a `softmax_scale` gives the scale `1 / √head_dim`). The runtime settings
/// [`Self::query_block`] and [`Self::logits_budget`] are not serialised and read back as
/// their defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "AttentionConfigFields")]
pub struct AttentionConfig {
    /// Model width (input and output features).
    pub d_model: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (`num_heads` for MHA, 1 for MQA, a divisor for GQA).
    pub num_kv_heads: usize,
    /// Features per head (default `d_model / num_heads`).
    pub head_dim: usize,
    /// Whether the query, key and value projections have biases (default false, as in Llama).
    pub bias: bool,
    /// Whether the output projection has a bias (default: as [`Self::bias`]; Qwen2 has biases
    /// on q, k and v only).
    pub out_bias: bool,
    /// Dropout on the attention weights in training (default 0).
    pub dropout: f32,
    /// Whether each query sees only keys at or before it (default false).
    pub causal: bool,
    /// Softmax scale (default `1 / √head_dim`; T5 uses 1).
    pub softmax_scale: f64,
    /// RMS normalisation of the projected queries and keys before the rotation (Qwen3,
    /// Gemma 3, OLMo 2; default none).
    pub qk_norm: Option<QkNormConfig>,
    /// Sliding window of `w` (default none). In a causal block each query sees only its
    /// last `w` keys, itself included (Mistral, Gemma 2/3 and gpt-oss local layers); in a
    /// bidirectional one the keys within `w` of it on either side, `2w + 1` in all
    /// (ModernBERT's local layers, where `w = local_attention / 2`). Counted in key indices
    /// (cache slots), as HF's masks count them.
    pub sliding_window: Option<usize>,
    /// Chunked attention (Llama 4's RoPE layers; default none; needs `causal`): each query
    /// sees only the earlier keys of its own chunk of `c` keys. Chunks are counted from each
    /// sequence's first unpadded key (the padding mask's leading zeros), as HF's mask counts
    /// them, so a left-padded sequence is chunked as the same sequence unpadded.
    pub attention_chunk: Option<usize>,
    /// Attention temperature tuning (Llama 4's NoPE layers; default none): each query
    /// multiplied by `1 + s·ln(1 + ⌊(p + 1)/f⌋)` at key index `p`, after the rotation.
    pub attention_temperature: Option<AttentionTemperature>,
    /// Soft cap `c` of the `q·k` logits: `c·tanh(s / c)`, before biases and masks (Gemma 2;
    /// default none).
    pub logit_softcap: Option<f64>,
    /// Learned per-head sink logits (`sinks`, shape `(num_heads)`) that join every softmax and
    /// carry no value (gpt-oss; default false).
    pub sinks: bool,
    /// Multi-head latent attention (DeepSeek V2/V3; default none): q, k and v from low-rank
    /// latents, RoPE on the first [`LatentConfig::rope_dim`] features of each head, values
    /// [`LatentConfig::v_head_dim`] wide. Needs as many KV heads as heads and no query/key norm.
    pub latent: Option<LatentConfig>,
    /// Values are the key projection, before any key norm and rotation: no `v_proj` (Gemma 4's
    /// full-attention layers, `attention_k_eq_v`; default false).
    pub k_eq_v: bool,
    /// RMS normalisation of each value head without a scale, with this ε (Gemma 4; default
    /// none).
    pub value_norm: Option<f64>,
    /// Short causal convolutions of `K` taps on the projected keys and values, before the key
    /// norm, with the projections as residuals (Inkling's `k_sconv`, `v_sconv`; default none):
    /// weights `k_sconv.conv1d.weight` and `v_sconv.conv1d.weight`, `(Hkv·D, 1, K)`; a
    /// [`KvCache`](super::KvCache) keeps their last `K − 1` inputs.
    pub short_conv: Option<usize>,
    /// Queries per block: attention runs over blocks of this many queries, each against all
    /// its keys (exact softmax per block). `None` (the default) chooses it from the sequence
    /// and [`Self::logits_budget`]. A runtime setting, not stored in checkpoints.
    #[serde(skip)]
    pub query_block: Option<usize>,
    /// Bytes the logits of one query block may take when the block size is automatic
    /// (default [`DEFAULT_LOGITS_BUDGET`](crate::DEFAULT_LOGITS_BUDGET)). A runtime setting, not stored in checkpoints.
    #[serde(skip)]
    pub logits_budget: usize,
}

/// The serialised form of [`AttentionConfig`]: a field left out keeps its value from
/// [`AttentionConfig::new`] and its builders, which depend on the fields given.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AttentionConfigFields {
    d_model: usize,
    num_heads: usize,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    num_kv_heads: Option<usize>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    head_dim: Option<usize>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    bias: Option<bool>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    out_bias: Option<bool>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    dropout: Option<f32>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    causal: Option<bool>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    softmax_scale: Option<f64>,
    #[serde(default)]
    qk_norm: Option<QkNormConfig>,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    attention_chunk: Option<usize>,
    #[serde(default)]
    attention_temperature: Option<AttentionTemperature>,
    #[serde(default)]
    logit_softcap: Option<f64>,
    #[serde(default)]
    sinks: bool,
    #[serde(default)]
    latent: Option<LatentConfig>,
    #[serde(default)]
    k_eq_v: bool,
    #[serde(default)]
    value_norm: Option<f64>,
    #[serde(default)]
    short_conv: Option<usize>,
}

impl From<AttentionConfigFields> for AttentionConfig {
    fn from(f: AttentionConfigFields) -> Self {
        let mut c = AttentionConfig::new(f.d_model, f.num_heads);
        if let Some(kv) = f.num_kv_heads {
            c = c.with_kv_heads(kv);
        }
        // Before the scale: a head width sets the default scale.
        if let Some(d) = f.head_dim {
            c = c.with_head_dim(d);
        }
        if let Some(bias) = f.bias {
            c = c.with_bias(bias);
        }
        if let Some(bias) = f.out_bias {
            c = c.with_out_bias(bias);
        }
        if let Some(p) = f.dropout {
            c = c.with_dropout(p);
        }
        if let Some(causal) = f.causal {
            c = c.with_causal(causal);
        }
        if let Some(scale) = f.softmax_scale {
            c = c.with_softmax_scale(scale);
        }
        c.with_qk_norm(f.qk_norm)
            .with_sliding_window(f.sliding_window)
            .with_attention_chunk(f.attention_chunk)
            .with_attention_temperature(f.attention_temperature)
            .with_logit_softcap(f.logit_softcap)
            .with_sinks(f.sinks)
            .with_latent(f.latent)
            .with_k_eq_v(f.k_eq_v)
            .with_value_norm(f.value_norm)
            .with_short_conv(f.short_conv)
    }
}

/// Default [`AttentionConfig::logits_budget`]: 16 MiB of logits per query block (B2 H8: 256
/// queries against 1024 keys), small enough for the allocator to reuse between blocks.
pub const DEFAULT_LOGITS_BUDGET: usize = 16 << 20;

impl AttentionConfig {
    /// Defaults for `num_heads` heads over `d_model` features: as many KV heads as heads,
    /// `head_dim = d_model / num_heads` (0 if it does not divide, which `validate` rejects),
    /// no bias, no dropout, not causal, scale `1 / √head_dim`, no query/key norm.
    pub fn new(d_model: usize, num_heads: usize) -> Self {
        let head_dim = if num_heads > 0 && d_model.is_multiple_of(num_heads) {
            d_model / num_heads
        } else {
            0
        };
        Self {
            d_model,
            num_heads,
            num_kv_heads: num_heads,
            head_dim,
            bias: false,
            out_bias: false,
            dropout: 0.0,
            causal: false,
            softmax_scale: if head_dim > 0 {
                1.0 / (head_dim as f64).sqrt()
            } else {
                0.0
            },
            qk_norm: None,
            sliding_window: None,
            attention_chunk: None,
            attention_temperature: None,
            logit_softcap: None,
            sinks: false,
            latent: None,
            k_eq_v: false,
            value_norm: None,
            short_conv: None,
            query_block: None,
            logits_budget: DEFAULT_LOGITS_BUDGET,
        }
    }

    /// Sets the number of key/value heads (grouped-query attention).
    pub fn with_kv_heads(mut self, num_kv_heads: usize) -> Self {
        self.num_kv_heads = num_kv_heads;
        self
    }

    /// Sets the head width (and the default scale `1 / √head_dim`).
    pub fn with_head_dim(mut self, head_dim: usize) -> Self {
        self.head_dim = head_dim;
        self.softmax_scale = if head_dim > 0 {
            1.0 / (head_dim as f64).sqrt()
        } else {
            0.0
        };
        self
    }

    /// Turns the biases of all four projections on or off.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self.out_bias = bias;
        self
    }

    /// Turns the output projection's bias on or off (after [`Self::with_bias`], which sets it
    /// too).
    pub fn with_out_bias(mut self, bias: bool) -> Self {
        self.out_bias = bias;
        self
    }

    /// Sets the sliding window (`None`: every key the block's causality allows).
    pub fn with_sliding_window(mut self, window: Option<usize>) -> Self {
        self.sliding_window = window;
        self
    }

    /// Sets the attention chunk (`None`: no chunks).
    pub fn with_attention_chunk(mut self, chunk: Option<usize>) -> Self {
        self.attention_chunk = chunk;
        self
    }

    /// Sets the attention temperature tuning (`None`: none).
    pub fn with_attention_temperature(mut self, temperature: Option<AttentionTemperature>) -> Self {
        self.attention_temperature = temperature;
        self
    }

    /// Sets the soft cap of the `q·k` logits (`None`: none).
    pub fn with_logit_softcap(mut self, cap: Option<f64>) -> Self {
        self.logit_softcap = cap;
        self
    }

    /// Sets multi-head latent attention (`None`: separate q, k, v projections).
    pub fn with_latent(mut self, latent: Option<LatentConfig>) -> Self {
        self.latent = latent;
        self
    }

    /// Takes the values from the key projection (`true`) or from `v_proj`.
    pub fn with_k_eq_v(mut self, k_eq_v: bool) -> Self {
        self.k_eq_v = k_eq_v;
        self
    }

    /// Sets the scale-free RMS norm of the values (its ε; `None`: none).
    pub fn with_value_norm(mut self, eps: Option<f64>) -> Self {
        self.value_norm = eps;
        self
    }

    /// Sets the short convolutions on the keys and values (their taps; `None`: none).
    pub fn with_short_conv(mut self, taps: Option<usize>) -> Self {
        self.short_conv = taps;
        self
    }

    /// Turns learned per-head sink logits on or off.
    pub fn with_sinks(mut self, sinks: bool) -> Self {
        self.sinks = sinks;
        self
    }

    /// Sets the query/key RMS norm (`None`: none).
    pub fn with_qk_norm(mut self, qk_norm: Option<QkNormConfig>) -> Self {
        self.qk_norm = qk_norm;
        self
    }

    /// Sets the attention dropout.
    pub fn with_dropout(mut self, dropout: f32) -> Self {
        self.dropout = dropout;
        self
    }

    /// Makes the attention causal (or not).
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the softmax scale.
    pub fn with_softmax_scale(mut self, scale: f64) -> Self {
        self.softmax_scale = scale;
        self
    }

    /// Fixes the number of queries per block (`None`: automatic, from the logits budget).
    pub fn with_query_block(mut self, queries: Option<usize>) -> Self {
        self.query_block = queries;
        self
    }

    /// Sets the bytes the logits of one query block may take when the block size is automatic.
    pub fn with_logits_budget(mut self, bytes: usize) -> Self {
        self.logits_budget = bytes;
        self
    }

    /// Queries per block for `batch × heads` rows of `keys` logits of `elem_size` bytes: the
    /// fixed [`Self::query_block`], or as many whole rows as fit [`Self::logits_budget`] (at
    /// least one), never more than `queries`.
    pub fn query_block_for(
        &self,
        batch: usize,
        queries: usize,
        keys: usize,
        elem_size: usize,
    ) -> usize {
        let block = self.query_block.unwrap_or_else(|| {
            let row = batch
                .saturating_mul(self.num_heads)
                .saturating_mul(keys)
                .saturating_mul(elem_size)
                .max(1);
            self.logits_budget / row
        });
        block.clamp(1, queries.max(1))
    }

    /// The configuration as checkpoint metadata: one entry, [`ATTENTION_KEY`] → this
    /// configuration as JSON (without the runtime settings [`Self::query_block`] and
    /// [`Self::logits_budget`]).
    pub fn to_metadata(&self) -> HashMap<String, String> {
        json_entry(ATTENTION_KEY, self)
    }

    /// Reads the configuration that [`Self::to_metadata`] wrote and validates it; the runtime
    /// settings take their defaults.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming [`ATTENTION_KEY`] when it is missing or its value is not
    /// the JSON of a configuration (malformed, a missing or unknown field, a value of the wrong
    /// type); as [`Self::validate`].
    pub fn from_metadata(metadata: &HashMap<String, String>, source: &str) -> Result<Self> {
        let cfg: Self = read_json_entry(metadata, source, ATTENTION_KEY)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for zero sizes, heads that do not divide `d_model` (when no head
    /// width is given), KV heads that do not divide the heads, a dropout outside `[0, 1)`, a
    /// scale, soft cap or query/key norm ε that is not a positive normal f32, a causal sliding
    /// window of 0, an attention chunk of 0 or in a bidirectional block, an attention
    /// temperature out of range ([`AttentionTemperature::validate`]), short convolutions of 0 taps
    /// (or past 2^16, or beside latent attention or `k_eq_v`), a query block of 0, a logits budget of 0, or projection weights past
    /// [`crate::limits::max_elements`].
    pub fn validate(&self) -> Result<()> {
        self.validate_heads()?;
        self.validate_projections()?;
        crate::error::check_dropout(self.dropout)?;
        if let Some(norm) = &self.qk_norm {
            norm.validate()?;
        }
        self.validate_masking()?;
        if let Some(eps) = self.value_norm {
            check_normal_f32("value_norm", eps)?;
        }
        self.validate_latent()?;
        self.validate_short_conv()?;
        if let Some(t) = &self.attention_temperature {
            t.validate()?;
        }
        if let Some(cap) = self.logit_softcap {
            check_normal_f32("logit_softcap", cap)?;
        }
        if self.query_block == Some(0) {
            return Err(Error::config(
                "query_block",
                0,
                "at least 1 query, or None (automatic)",
            ));
        }
        if self.logits_budget == 0 {
            return Err(Error::config("logits_budget", 0, "at least 1 byte"));
        }
        // The scale multiplies q in the weights' dtype: it must be a normal f32 (bf16 has the
        // same range; f16 weights are checked against theirs when the block is built).
        check_normal_f32("softmax_scale", self.softmax_scale)
    }
}

impl AttentionConfig {
    /// Sizes at least 1, and KV heads that divide the heads.
    fn validate_heads(&self) -> Result<()> {
        if self.d_model == 0 {
            return Err(Error::config("d_model", self.d_model, "at least 1"));
        }
        if self.num_heads == 0 {
            return Err(Error::config("num_heads", self.num_heads, "at least 1"));
        }
        if self.head_dim == 0 {
            return Err(Error::config(
                "head_dim",
                self.head_dim,
                format!(
                    "at least 1; by default d_model / num_heads, which needs num_heads ({}) to divide d_model ({})",
                    self.num_heads, self.d_model
                ),
            ));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(Error::config(
                "num_kv_heads",
                self.num_kv_heads,
                format!("a divisor of num_heads ({})", self.num_heads),
            ));
        }
        Ok(())
    }

    /// The four projections' weights within the budget, with checked arithmetic.
    fn validate_projections(&self) -> Result<()> {
        let width = check_elements(
            "head_dim",
            self.head_dim,
            format_args!("num_heads ({}) × head_dim", self.num_heads),
            &[self.num_heads, self.head_dim],
        )?;
        check_elements(
            "d_model",
            self.d_model,
            format_args!("d_model × num_heads × head_dim ({width})"),
            &[self.d_model, width],
        )?;
        // The four projections together: q and o hold H·D rows or columns, k and v Hkv·D.
        let heads = self
            .num_heads
            .checked_add(self.num_kv_heads)
            .and_then(|n| n.checked_mul(2))
            .ok_or_else(|| {
                Error::config(
                    "num_heads",
                    self.num_heads,
                    format!(
                        "2·num_heads + 2·num_kv_heads ({}) within usize, the rows of the four projections",
                        self.num_kv_heads
                    ),
                )
            })?;
        check_elements(
            "d_model",
            self.d_model,
            format_args!(
                "d_model × (2·num_heads + 2·num_kv_heads) × head_dim ({heads} × {}) of the four projections together",
                self.head_dim
            ),
            &[self.d_model, heads, self.head_dim],
        )?;
        Ok(())
    }

    /// A causal window of at least one key; chunks of at least one key, in causal blocks only.
    fn validate_masking(&self) -> Result<()> {
        if self.sliding_window == Some(0) && self.causal {
            return Err(Error::config(
                "sliding_window",
                0,
                "at least 1 key in a causal block (the query's own), or None",
            ));
        }
        match self.attention_chunk {
            Some(0) => {
                return Err(Error::config(
                    "attention_chunk",
                    0,
                    "at least 1 key per chunk, or None",
                ))
            }
            Some(c) if !self.causal => {
                return Err(Error::config(
                    "attention_chunk",
                    c,
                    "None in a bidirectional block (chunks are causal: a query's earlier keys in its chunk)",
                ))
            }
            _ => {}
        }
        Ok(())
    }

    /// Short convolutions of 1 to 2^16 taps, on separate key and value projections.
    fn validate_short_conv(&self) -> Result<()> {
        let Some(taps) = self.short_conv else {
            return Ok(());
        };
        if taps == 0 || taps > 1 << 16 {
            return Err(Error::config("short_conv", taps, "1 to 2^16 taps, or None"));
        }
        if self.latent.is_some() || self.k_eq_v {
            return Err(Error::config(
                "short_conv",
                taps,
                "None with latent attention or k_eq_v (the convolutions read separate key and value projections)",
            ));
        }
        Ok(())
    }

    /// Latent attention's own settings, and the settings it excludes.
    fn validate_latent(&self) -> Result<()> {
        let Some(latent) = &self.latent else {
            return Ok(());
        };
        latent.validate(self.d_model, self.num_heads, self.head_dim)?;
        if self.k_eq_v {
            return Err(Error::config(
                "k_eq_v",
                true,
                "false with latent attention (its values have their own projection)",
            ));
        }
        if self.num_kv_heads != self.num_heads {
            return Err(Error::config(
                "num_kv_heads",
                self.num_kv_heads,
                format!(
                    "num_heads ({}) with latent attention (every head has its own keys)",
                    self.num_heads
                ),
            ));
        }
        if self.qk_norm.is_some() {
            return Err(Error::config(
                "qk_norm",
                format!("{:?}", self.qk_norm),
                "None with latent attention (its latents have their own norms)",
            ));
        }
        Ok(())
    }
}

/// Per-call options of [`MultiHeadAttention::forward_with`](super::MultiHeadAttention::forward_with).
#[derive(Debug, Clone, Default)]
pub struct AttentionOptions<'a> {
    /// Positions of the chunk's tokens. Default: continue the cache
    /// ([`KvCache::continuation`](super::KvCache::continuation): each sequence one past its
    /// own largest cached position), or `Offset(0)` without one.
    pub positions: Option<&'a Positions>,
    /// `(B, T_keys)`, non-zero for real tokens and 0 for padding; covers cached keys too.
    pub padding_mask: Option<&'a Tensor>,
    /// Additive mask broadcastable to `(B, H, T, T_keys)`, added to the logits.
    pub attn_mask: Option<&'a Tensor>,
    /// Whether to return the attention weights.
    pub return_weights: bool,
    /// Training mode: dropout on. Gradients do not depend on it: whenever the input, the
    /// weights or an encoding's answers track gradients (a `VarMap`'s variables), the block
    /// takes its differentiable path, whatever this flag says; when nothing does (a model
    /// loaded from a checkpoint), inference takes the fast paths, rotating q and k in place.
    pub train: bool,
    /// Seed of this call's attention dropout (training, dropout above 0) on the fused
    /// training core (f32 on the CPU, weights not returned): the same seed draws the same
    /// mask. Default: a fresh seed per call. The other paths draw from candle's generator.
    pub dropout_seed: Option<u64>,
}

/// Output of [`MultiHeadAttention::forward_with`](super::MultiHeadAttention::forward_with).
#[derive(Debug, Clone)]
pub struct AttentionOutput {
    /// `(B, T, d_model)`.
    pub output: Tensor,
    /// `(B, H, T, T_keys)` attention weights before dropout, when asked for.
    pub weights: Option<Tensor>,
}
